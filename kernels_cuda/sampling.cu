// Temperature sampling in one launch (and, at the end of the file, greedy sampling in one launch): for each
// row of logits (float32, or the model's bf16/fp16), the inverse-CDF draw that
// pagednb/engine/sampler.py makes with torch (divide by T, max, exp, cumsum, searchsorted: about eight
// passes over [n, V]), here in one read of the row plus one chunk of it, with no row written back.
//
// The draw (pagednb/engine/sampling_kernel.py has it in torch): with w_j = exp(l_j / T - max_k l_k / T)
// and one uniform u per row, the token is the first j in token-id order whose running sum of weights
// reaches (1 - u) * sum_j w_j. One uniform per row keeps a seeded row's token a function of its own
// logits and generator, whatever the batch.
//
// One CTA per row; its warps split the row into chunks of 32 lanes x kUnroll vectors (1024 tokens with
// float4 loads, 256 without).
//   1. Each warp reads its chunks once and keeps two numbers per chunk in shared memory: the chunk's
//      max m_c of y = l * (log2(e) / T) and s_c = sum 2^(y - m_c) (ex2.approx: about 2 ulp, well
//      below the float32 rounding of the sums; the base-2 scale folded into 1/T saves a multiply).
//   2. Warp 0 rescales them to the row's max m, g_c = s_c * 2^(m_c - m), sums them in chunk order
//      (each lane a contiguous run of chunks, sequentially; the runs' offsets by a warp scan), sets
//      target = (1 - u) * total and picks the first chunk with g_c > 0 whose running sum reaches it.
//   3. Warp 0 reads that chunk again and turns its weights 2^(y - m_c) <= 1 into 2^40 fixed point, so
//      the scan inside the chunk is exact integer arithmetic: the first token whose integer prefix
//      reaches the target's share of the chunk has a weight of at least one unit, hence a finite
//      logit. Weights below 2^-41 of their chunk's max count as zero (a share of the chunk under 2^-31,
//      far below what torch's float32 cumsum resolves).
// Guards: when rounding leaves no chunk reaching the target, the last chunk with g_c > 0 is taken with
// the target at its end, i.e. the row's last token of nonzero weight. A row with no valid distribution
// (a NaN or +inf logit, an overflow of l / T, or all -inf) gets -1, the sampler's INVALID_TOKEN_ID, in
// place of a token: step 1 marks a chunk holding a NaN with s_c = NaN (fmaxf skips NaN, and a chunk of
// only NaN and -inf would otherwise weigh 0), +inf makes s_c NaN through 2^(inf - inf), so the row's
// total weight is NaN exactly when some logit is NaN or +inf, and 0 exactly when all are -inf. The
// engine reads the flag in the copy of the tokens it makes anyway; every other token is in [0, V).
//
// A few rows of a large vocabulary (a batch-1 step) spread step 1 over a cluster of CTAs per row instead
// (sample_temperature_sliced_kernel): one CTA's warps would take ~9 chunks each, one after another.
//
// Cost per row: one coalesced read of the row (four logits per load when the row start, stride and length
// allow it, else one), one more read of one chunk (4 KiB), 8 bytes of shared
// memory per chunk, one barrier. 16 warps per CTA, two CTAs per SM (<= 64 registers), so a batch of
// 256 rows runs in one wave on an H100/H200. The CTA's size depends on V only and every sum has a fixed
// order, so the draw is a deterministic function of the row, T and u, whatever the batch; it differs
// from torch's only when the target lies within float32 rounding (about 1e-6 of the total) of a CDF
// boundary.
#include <climits>
#include <type_traits>

#include <cooperative_groups.h>

#include "common.cuh"
#include "launchers.h"

namespace pagednb {

namespace {

constexpr int kSampleWarps = 16;
constexpr int kUnroll = 8;  // vectors per lane per chunk
constexpr float kLog2e = 1.4426950408889634f;
constexpr float kFixedOne = 1099511627776.0f;  // 2^40: 1024 weights <= 1 sum below 2^51

template <int VEC> struct ChunkCfg {
  static constexpr int kSize = 32 * kUnroll * VEC;  // tokens per chunk
};
// (m_c, s_c) per chunk in shared memory: at most kMaxSampleVocab / 256 chunks, within the 48 KiB a
// launch may take without opting in.
constexpr int kMaxSampleChunks = (kMaxSampleVocab + ChunkCfg<1>::kSize - 1) / ChunkCfg<1>::kSize;
static_assert(kMaxSampleChunks * 8 <= 48 * 1024, "chunk table");

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}
__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}
__device__ __forceinline__ uint64_t warp_sum_u64(uint64_t v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}
template <typename T> __device__ __forceinline__ T warp_inclusive_scan(T v, int lane) {
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    const T n = __shfl_up_sync(0xffffffffu, v, o);
    if (lane >= o) v += n;
  }
  return v;
}

// y[e] = l * scale for the VEC tokens from j (j a multiple of VEC); -inf past the row. __fmul_rn: y rounds
// the same way wherever it is recomputed (never contracted into a later FMA). Logits of type L: float32,
// or the model's bf16/fp16 read as they are (their conversion to float32 is exact, so the draw is the
// one the float32 copy of the row would give, without that copy's pass over memory).
template <typename L, int VEC>
__device__ __forceinline__ void load_vec(const L* __restrict__ row, int vocab, int j, float scale, float (&y)[VEC]) {
  float l[VEC];
  if constexpr (std::is_same<L, float>::value) {
    if constexpr (VEC == 4) {
      const float4 v = j < vocab ? __ldg(reinterpret_cast<const float4*>(row + j)) : make_float4(0.f, 0.f, 0.f, 0.f);
      l[0] = v.x; l[1] = v.y; l[2] = v.z; l[3] = v.w;
    } else {
      l[0] = j < vocab ? __ldg(row + j) : 0.f;
    }
  } else if constexpr (VEC == 4) {  // 8 bytes: four 16-bit logits
    const uint2 v = j < vocab ? __ldg(reinterpret_cast<const uint2*>(row + j)) : make_uint2(0u, 0u);
    const L* h = reinterpret_cast<const L*>(&v);
#pragma unroll
    for (int e = 0; e < 4; ++e) l[e] = Elem<L>::to_float(h[e]);
  } else {
    l[0] = j < vocab ? Elem<L>::to_float(row[j]) : 0.f;
  }
#pragma unroll
  for (int e = 0; e < VEC; ++e) y[e] = j < vocab ? __fmul_rn(l[e], scale) : -INFINITY;
}

// y[k] for tokens (k * 32 + lane) * VEC + e of the chunk at `start`: each load a coalesced 32 * VEC floats.
template <typename L, int VEC>
__device__ __forceinline__ void load_chunk(const L* __restrict__ row, int vocab, int start, float scale,
                                           int lane, float (&y)[kUnroll][VEC]) {
#pragma unroll
  for (int k = 0; k < kUnroll; ++k) load_vec<L, VEC>(row, vocab, start + (k * 32 + lane) * VEC, scale, y[k]);
}

// A token's weight relative to its chunk's max, in units of 2^-40 (NaN -> 0).
__device__ __forceinline__ uint64_t fixed_weight(float y, float mc) {
  const float w = fast_exp2(y - mc);
  return w > 0.f ? __float2ull_rn(fminf(w, 1.f) * kFixedOne) : 0ull;
}

// Chunk c's weight on the row's scale (s_c = 0 for a chunk of -inf; a NaN s_c stays NaN, flagging the row).
// __fmul_rn: rounded before it is added, the same in both sweeps of step 2.
__device__ __forceinline__ float chunk_weight(float2 stats, float m) {
  return stats.x > -INFINITY ? __fmul_rn(stats.y, fast_exp2(stats.x - m)) : stats.y;
}

// Step 3, one warp: the token of the chunk at `start` (max mc) where the running weight, in token order,
// reaches frac of the chunk's weight. Integer weights: the prefix is exact and monotone, so the token
// found has a weight of at least one unit. Lane order inside a slice k is token order, and slices follow
// each other, so a scan per slice plus a carry gives every token's prefix.
template <typename L, int VEC>
__device__ __forceinline__ int pick_in_chunk(const L* __restrict__ row, int vocab, int start, float scale,
                                             float mc, double frac, int lane) {
  float y[kUnroll][VEC];
  load_chunk<L, VEC>(row, vocab, start, scale, lane, y);
  uint64_t part[kUnroll];  // this lane's weight in slice k (tokens (k * 32 + lane) * VEC + e)
  uint64_t mine = 0;
  int first_max = 0x7fffffff;  // this lane's first token at the chunk's max
#pragma unroll
  for (int k = 0; k < kUnroll; ++k) {
    part[k] = 0;
#pragma unroll
    for (int e = VEC - 1; e >= 0; --e) {
      part[k] += fixed_weight(y[k][e], mc);
      if (y[k][e] == mc) first_max = min(first_max, (k * 32 + lane) * VEC + e);
    }
    mine += part[k];
  }
  const uint64_t total = warp_sum_u64(mine);
  if (total == 0) {  // unreachable for an unflagged row (its chunk max weighs 2^40); kept: the index stays in the chunk
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) first_max = min(first_max, __shfl_xor_sync(0xffffffffu, first_max, o));
    return start + (first_max == 0x7fffffff ? 0 : first_max);
  }
  const double want = ceil(frac * (double)total);
  const uint64_t t = !(want >= 1.0) ? 1ull : want >= (double)total ? total : (uint64_t)want;  // NaN -> 1
  // the slice and lane where the prefix first reaches t, and that lane's prefix before its own tokens
  int slice = -1, src = 0;
  uint64_t below = 0, carry = 0;
#pragma unroll
  for (int k = 0; k < kUnroll; ++k) {
    const uint64_t upto = carry + warp_inclusive_scan(part[k], lane);
    const unsigned cross = __ballot_sync(0xffffffffu, upto >= t);
    if (slice < 0 && cross != 0u) {  // warp-uniform
      slice = k;
      src = __ffs(cross) - 1;
      below = upto - part[k];
    }
    carry = __shfl_sync(0xffffffffu, upto, 31);
  }
  int token = 0;
  if (lane == src) {  // below < t <= below + part: one of this lane's VEC tokens reaches t
    const int j = start + (slice * 32 + lane) * VEC;
    float v[VEC];
    load_vec<L, VEC>(row, vocab, j, scale, v);
    int pick = VEC - 1;
#pragma unroll
    for (int e = 0; e < VEC; ++e) {
      below += fixed_weight(v[e], mc);
      if (below >= t) { pick = e; break; }
    }
    token = j + pick;
  }
  return __shfl_sync(0xffffffffu, token, src);
}

// Step 1 for chunk c (one warp): (m_c, s_c), s_c NaN when the chunk holds a NaN.
template <typename L, int VEC>
__device__ __forceinline__ float2 chunk_stats(const L* __restrict__ row, int vocab, int c, float scale, int lane) {
  float y[kUnroll][VEC];
  load_chunk<L, VEC>(row, vocab, c * ChunkCfg<VEC>::kSize, scale, lane, y);
  float mc = -INFINITY;  // fmaxf skips NaN
#pragma unroll
  for (int k = 0; k < kUnroll; ++k)
#pragma unroll
    for (int e = 0; e < VEC; ++e) mc = fmaxf(mc, y[k][e]);
  mc = warp_max(mc);
  float s = 0.f;
  if (mc > -INFINITY) {  // warp-uniform; a chunk of -inf (or past nothing) has no weight
#pragma unroll
    for (int k = 0; k < kUnroll; ++k)
#pragma unroll
      for (int e = 0; e < VEC; ++e) s += fast_exp2(y[k][e] - mc);
    s = warp_sum(s);
  }
  bool has_nan = false;
#pragma unroll
  for (int k = 0; k < kUnroll; ++k)
#pragma unroll
    for (int e = 0; e < VEC; ++e) has_nan |= y[k][e] != y[k][e];
  if (__any_sync(0xffffffffu, has_nan)) s = __int_as_float(0x7fc00000);  // quiet NaN: the row is flagged
  return make_float2(mc, s);
}

// Steps 2 and 3 (one warp, every chunk's stats in shared memory): the row's token, or -1 for a row with no
// valid distribution. u (the row's uniform) is read only for a valid row.
template <typename L, int VEC>
__device__ __forceinline__ int64_t draw_token(const L* __restrict__ row, int vocab, const float2* stats, int nchunks,
                                              float scale, const float* u_ptr, int lane) {
  // ---- 2. the chunk where the running sum reaches the target ----------------------------------------------
  float m = -INFINITY;
  for (int c = lane; c < nchunks; c += 32) m = fmaxf(m, stats[c].x);
  m = warp_max(m);
  const int per = (nchunks + 31) / 32;
  const int c0 = min(lane * per, nchunks), c1 = min(c0 + per, nchunks);
  float seg = 0.f;
  for (int c = c0; c < c1; ++c) seg += chunk_weight(stats[c], m);
  const float incl = warp_inclusive_scan(seg, lane);
  float excl = __shfl_up_sync(0xffffffffu, incl, 1);
  if (lane == 0) excl = 0.f;
  // the total is the last chunk's running sum exactly as the sweep below forms it (its lane's last)
  const float total = __shfl_sync(0xffffffffu, excl + seg, (nchunks - 1) / per);
  if (!(total > 0.f)) return -1;  // warp-uniform: NaN (a NaN or +inf logit) or 0 (all -inf)
  const float target = (1.f - *u_ptr) * total;

  int hit = -1, last = -1;
  double frac = 1.0;  // where the target lies within the hit chunk's weight
  float run = 0.f, before = excl;
  for (int c = c0; c < c1; ++c) {
    const float g = chunk_weight(stats[c], m);
    run += g;
    const float upto = excl + run;
    if (g > 0.f) {
      last = c;
      if (hit < 0 && upto >= target) {
        hit = c;
        frac = ((double)target - (double)before) / (double)g;
      }
    }
    before = upto;
  }
  int chunk;
  const unsigned hits = __ballot_sync(0xffffffffu, hit >= 0);
  if (hits != 0u) {
    const int src = __ffs(hits) - 1;
    chunk = __shfl_sync(0xffffffffu, hit, src);
    frac = __shfl_sync(0xffffffffu, frac, src);
  } else {  // rounding: the target lies past every running sum; the last weighted token (total > 0: one has)
    const unsigned any = __ballot_sync(0xffffffffu, last >= 0);
    chunk = any != 0u ? __shfl_sync(0xffffffffu, last, 31 - __clz(any)) : 0;
    frac = 1.0;
  }

  // ---- 3. the token inside the chunk ------------------------------------------------------------------------
  const int token = pick_in_chunk<L, VEC>(row, vocab, chunk * ChunkCfg<VEC>::kSize, scale, stats[chunk].x, frac, lane);
  return min(max(token, 0), vocab - 1);
}

template <typename L, int VEC>
__global__ void __launch_bounds__(kSampleWarps * 32, 2)
    sample_temperature_kernel(const L* __restrict__ logits, int64_t row_stride, const float* __restrict__ temperature,
                              int64_t t_stride, const float* __restrict__ uniforms, int64_t u_stride,
                              int64_t* __restrict__ out, int vocab) {
  PAGEDNB_PDL_ENTER();
  extern __shared__ float2 stats[];  // [nchunks] (m_c, s_c)
  const int64_t r = blockIdx.x;
  const L* row = logits + r * row_stride;
  const float scale = __fdiv_rn(kLog2e, temperature[r * t_stride]);
  const int nchunks = (vocab + ChunkCfg<VEC>::kSize - 1) / ChunkCfg<VEC>::kSize;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, nwarps = blockDim.x >> 5;
  for (int c = warp; c < nchunks; c += nwarps) {
    const float2 st = chunk_stats<L, VEC>(row, vocab, c, scale, lane);
    if (lane == 0) stats[c] = st;
  }
  __syncthreads();
  if (warp != 0) return;
  const int64_t token = draw_token<L, VEC>(row, vocab, stats, nchunks, scale, uniforms + r * u_stride, lane);
  if (lane == 0) out[r] = token;
}

// A few rows of a large vocabulary (a batch-1 step: 149 chunks, ~9 a warp one after another on one SM): the
// chunks of row blockIdx.y are spread over a cluster of kSampleSlices CTAs (chunk c to CTA (c / warps) %
// kSampleSlices), rank 0 gathers their stats through distributed shared memory and draws as the one-CTA kernel
// does, from the same stats: the same token.
constexpr int kSampleSlices = 8;  // a portable cluster size
constexpr int kSampleSlicedMaxRows = 16;
constexpr int kSampleSlicedMinChunks = 4 * kSampleSlices;

template <typename L, int VEC>
__global__ void __launch_bounds__(kSampleWarps * 32, 2)
    sample_temperature_sliced_kernel(const L* __restrict__ logits, int64_t row_stride,
                                     const float* __restrict__ temperature, int64_t t_stride,
                                     const float* __restrict__ uniforms, int64_t u_stride, int64_t* __restrict__ out,
                                     int vocab) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  PAGEDNB_PDL_ENTER();
  extern __shared__ float2 stats[];  // [nchunks]: this CTA's chunks; rank 0's ends up with all of them
  namespace cg = cooperative_groups;
  const cg::cluster_group cluster = cg::this_cluster();
  const int64_t r = blockIdx.y;
  const L* row = logits + r * row_stride;
  const float scale = __fdiv_rn(kLog2e, temperature[r * t_stride]);
  const int nchunks = (vocab + ChunkCfg<VEC>::kSize - 1) / ChunkCfg<VEC>::kSize;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, nwarps = blockDim.x >> 5;
  for (int c = blockIdx.x * nwarps + warp; c < nchunks; c += kSampleSlices * nwarps) {
    const float2 st = chunk_stats<L, VEC>(row, vocab, c, scale, lane);
    if (lane == 0) stats[c] = st;
  }
  cluster.sync();  // every CTA's stats written
  if (blockIdx.x == 0) {
    for (int c = threadIdx.x; c < nchunks; c += blockDim.x) {
      const int owner = (c / nwarps) % kSampleSlices;
      if (owner != 0) stats[c] = *cluster.map_shared_rank(&stats[c], owner);
    }
  }
  cluster.sync();  // rank 0 holds them all (and has read the others' shared memory: they may go)
  if (blockIdx.x != 0 || warp != 0) return;
  const int64_t token = draw_token<L, VEC>(row, vocab, stats, nchunks, scale, uniforms + r * u_stride, lane);
  if (lane == 0) out[r] = token;
#endif
}

// Whether the device takes thread-block clusters (sm_90 on): the sliced kernels' condition.
bool clusters_supported() {
  static const bool on = [] {
    int dev = 0, major = 0;
    return cudaGetDevice(&dev) == cudaSuccess &&
           cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev) == cudaSuccess && major >= 9;
  }();
  return on;
}

template <typename L, int VEC>
int launch_sample_vec(const SampleArgs& a, cudaStream_t st) {
  const int nchunks = (a.vocab + ChunkCfg<VEC>::kSize - 1) / ChunkCfg<VEC>::kSize;
  if (nchunks > kMaxSampleChunks) return -1;
  const size_t smem = nchunks * sizeof(float2);
  const L* logits = static_cast<const L*>(a.logits);
  if (a.rows <= kSampleSlicedMaxRows && nchunks >= kSampleSlicedMinChunks && clusters_supported()) {
    const int per_cta = (nchunks + kSampleSlices - 1) / kSampleSlices;
    const int warps = per_cta < kSampleWarps ? per_cta : kSampleWarps;
    return launch_pdl_clusters(sample_temperature_sliced_kernel<L, VEC>, kSampleSlices, dim3(kSampleSlices, a.rows),
                           dim3(warps * 32), smem, st, logits, a.row_stride, a.temperature, a.t_stride, a.uniforms,
                           a.u_stride, a.out, a.vocab);
  }
  const int warps = nchunks < kSampleWarps ? nchunks : kSampleWarps;
  return launch_pdl(sample_temperature_kernel<L, VEC>, dim3(a.rows), dim3(warps * 32), smem, st, logits, a.row_stride,
                    a.temperature, a.t_stride, a.uniforms, a.u_stride, a.out, a.vocab);
}

template <typename L>
int launch_sample_dtype(const SampleArgs& a, cudaStream_t st) {
  // four logits per load (16 bytes of float32, 8 of a 16-bit type) when rows allow it
  const bool vec4 = reinterpret_cast<uintptr_t>(a.logits) % (4 * sizeof(L)) == 0 && a.row_stride % 4 == 0 &&
                    a.vocab % 4 == 0;
  return vec4 ? launch_sample_vec<L, 4>(a, st) : launch_sample_vec<L, 1>(a, st);
}

// ---- greedy: the argmax and the validity flag in one launch ----------------------------------------------
// The first index of the row's max logit (torch's tie rule for max and argmax), or -1 where the row has no
// valid distribution: a NaN or +inf logit, or every logit -inf (in torch: max, isfinite and where, three
// launches after the step's graph). Each thread visits its tokens in increasing order, kGreedyLoads vectors
// in flight, keeping its first max (strict >); a reduction then keeps the larger value, the smaller index on
// a tie. Exact: a 16-bit logit's conversion to float32 is exact and nothing is rounded, so how the row is
// split never changes the answer.
// Many rows: one CTA per row. A few rows of a large vocabulary (a batch-1 step: 152k logits): one CTA per row
// read its ~300 KB in 5 dependent rounds of loads on one SM, so each row is cut into kGreedySlices contiguous
// slices, one CTA each, forming a thread-block cluster (sm_90); rank 0 merges the slices' results through
// distributed shared memory, in slice order. No workspace and no counter: nothing outlives the launch, so it
// replays in a CUDA graph as it runs eagerly.
constexpr int kGreedyThreads = 1024;  // 32 warps: a warp reduces their 32 results
constexpr int kGreedyLoads = 4;
constexpr int kGreedySlices = 8;  // a portable cluster size
constexpr int kGreedySlicedMaxRows = 16;  // 128 CTAs: one wave on an H100/H200
constexpr int kGreedySlicedMinVocab = kGreedySlices * kGreedyThreads * 2;  // slices of >= 2048 tokens

template <typename L, int VEC>
__device__ __forceinline__ void load_logits(const L* __restrict__ row, int j, float (&l)[VEC]) {
  if constexpr (VEC == 1) {
    l[0] = Elem<L>::to_float(row[j]);
  } else {
    static_assert(VEC == Elem<L>::kVec, "16-byte vectors");
    Elem<L>::unpack(ldg16(row + j), l);
  }
}

// (v, j) of the pair that wins: the larger value, the smaller index among equal values.
__device__ __forceinline__ void keep_max(float& v, int& j, float ov, int oj) {
  if (ov > v || (ov == v && oj < j)) { v = ov; j = oj; }
}

__device__ __forceinline__ void warp_keep_max(float& v, int& j) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1)
    keep_max(v, j, __shfl_xor_sync(0xffffffffu, v, o), __shfl_xor_sync(0xffffffffu, j, o));
}

// This thread's first max over tokens [begin, end) (begin and end multiples of VEC, or end the row's end), and
// whether it met a NaN or +inf; best_j stays INT_MAX when all it met was -inf.
template <typename L, int VEC>
__device__ __forceinline__ void scan_argmax(const L* __restrict__ row, int begin, int end, float& best, int& best_j,
                                            bool& bad) {
  constexpr int kStride = kGreedyThreads * VEC;
  for (int j0 = begin + threadIdx.x * VEC; j0 < end; j0 += kGreedyLoads * kStride) {
    float l[kGreedyLoads][VEC];
#pragma unroll
    for (int i = 0; i < kGreedyLoads; ++i) {
      if (j0 + i * kStride < end) {
        load_logits<L, VEC>(row, j0 + i * kStride, l[i]);
      } else {
#pragma unroll
        for (int e = 0; e < VEC; ++e) l[i][e] = -INFINITY;
      }
    }
#pragma unroll
    for (int i = 0; i < kGreedyLoads; ++i)
#pragma unroll
      for (int e = 0; e < VEC; ++e) {
        const float v = l[i][e];
        bad |= !(v < INFINITY);
        if (v > best) { best = v; best_j = j0 + i * kStride + e; }
      }
  }
}

// The CTA's first max, in every lane of warp 0; returns whether any thread met a bad logit (to every thread).
__device__ __forceinline__ bool cta_argmax(float& best, int& best_j, bool bad) {
  __shared__ float s_v[kGreedyThreads / 32];
  __shared__ int s_j[kGreedyThreads / 32];
  warp_keep_max(best, best_j);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  if (lane == 0) { s_v[warp] = best; s_j[warp] = best_j; }
  bad = __syncthreads_or(bad);  // also the barrier before s_v is read
  if (warp == 0) {
    best = s_v[lane];  // one per warp: kGreedyThreads / 32 == 32
    best_j = s_j[lane];
    warp_keep_max(best, best_j);
  }
  return bad;
}

template <typename L, int VEC>
__global__ void __launch_bounds__(kGreedyThreads) greedy_kernel(const L* __restrict__ logits, int64_t row_stride,
                                                                int64_t* __restrict__ out, int vocab) {
  PAGEDNB_PDL_ENTER();
  float best = -INFINITY;
  int best_j = INT_MAX;
  bool bad = false;
  scan_argmax<L, VEC>(logits + (int64_t)blockIdx.x * row_stride, 0, vocab, best, best_j, bad);
  bad = cta_argmax(best, best_j, bad);
  if (threadIdx.x == 0) out[blockIdx.x] = bad || best_j == INT_MAX ? -1 : best_j;
}

// Row blockIdx.y, slice blockIdx.x (the CTA's rank in its cluster) of `slice` tokens.
template <typename L, int VEC>
__global__ void __launch_bounds__(kGreedyThreads) greedy_sliced_kernel(const L* __restrict__ logits,
                                                                       int64_t row_stride, int64_t* __restrict__ out,
                                                                       int vocab, int slice) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  PAGEDNB_PDL_ENTER();
  __shared__ float c_v;  // this slice's result, read by rank 0
  __shared__ int c_j, c_bad;
  namespace cg = cooperative_groups;
  const cg::cluster_group cluster = cg::this_cluster();
  const int begin = blockIdx.x * slice;
  float best = -INFINITY;
  int best_j = INT_MAX;
  bool bad = false;
  scan_argmax<L, VEC>(logits + (int64_t)blockIdx.y * row_stride, begin, min(vocab, begin + slice), best, best_j, bad);
  bad = cta_argmax(best, best_j, bad);
  if (threadIdx.x == 0) { c_v = best; c_j = best_j; c_bad = bad; }
  cluster.sync();  // every slice's result written
  const int lane = threadIdx.x & 31;
  if (blockIdx.x == 0 && threadIdx.x < 32) {
    best = -INFINITY;
    best_j = INT_MAX;
    bad = false;
    if (lane < kGreedySlices) {
      best = *cluster.map_shared_rank(&c_v, lane);
      best_j = *cluster.map_shared_rank(&c_j, lane);
      bad = *cluster.map_shared_rank(&c_bad, lane) != 0;
    }
    warp_keep_max(best, best_j);
    bad = __any_sync(0xffffffffu, bad);
    if (lane == 0) out[blockIdx.y] = bad || best_j == INT_MAX ? -1 : best_j;
  }
  cluster.sync();  // rank 0 has read them: the other CTAs' shared memory may go
#endif
}

template <typename L, int VEC>
int launch_greedy_sliced(const GreedyArgs& a, cudaStream_t st) {
  const int per_slice = (a.vocab + kGreedySlices - 1) / kGreedySlices;
  const int slice = (per_slice + VEC - 1) / VEC * VEC;
  return launch_pdl_clusters(greedy_sliced_kernel<L, VEC>, kGreedySlices, dim3(kGreedySlices, a.rows),
                         dim3(kGreedyThreads), 0, st, static_cast<const L*>(a.logits), a.row_stride, a.out, a.vocab,
                         slice);
}

template <typename L, int VEC>
int launch_greedy_vec(const GreedyArgs& a, cudaStream_t st) {
  if (a.rows <= kGreedySlicedMaxRows && a.vocab >= kGreedySlicedMinVocab && clusters_supported())
    return launch_greedy_sliced<L, VEC>(a, st);
  return launch_pdl(greedy_kernel<L, VEC>, dim3(a.rows), dim3(kGreedyThreads), 0, st, static_cast<const L*>(a.logits),
                    a.row_stride, a.out, a.vocab);
}

template <typename L>
int launch_greedy_dtype(const GreedyArgs& a, cudaStream_t st) {
  // 16-byte loads when the row start, stride and length allow them
  constexpr int VEC = Elem<L>::kVec;
  const bool vec = reinterpret_cast<uintptr_t>(a.logits) % 16 == 0 && a.row_stride % VEC == 0 && a.vocab % VEC == 0;
  return vec ? launch_greedy_vec<L, VEC>(a, st) : launch_greedy_vec<L, 1>(a, st);
}

// ---- grammar bitmask: -inf where a structured-output grammar disallows a token --------------------------------
// Token t is bit t % 32 of word t / 32 of its row's int32 bitmask (xgrammar's layout), 1 = allowed. In place, one
// thread per token: a warp reads one word (a broadcast) and writes only the disallowed tokens, coalesced; a
// word with every bit set, the common case inside free text, writes nothing. (In torch: unpack the bits, compare,
// masked_fill into a copy: four launches and ~50 us a step at 64 rows of a 152k vocabulary on an H200.)
constexpr int kMaskThreads = 256;

template <typename L>
__global__ void __launch_bounds__(kMaskThreads) mask_logits_kernel(L* __restrict__ logits, int64_t row_stride,
                                                                   const uint32_t* __restrict__ bitmask,
                                                                   int64_t mask_stride, int vocab) {
  PAGEDNB_PDL_ENTER();
  const int t = blockIdx.x * kMaskThreads + threadIdx.x;
  if (t >= vocab) return;
  const uint32_t word = __ldg(bitmask + (int64_t)blockIdx.y * mask_stride + (t >> 5));
  if (!((word >> (t & 31)) & 1u)) logits[(int64_t)blockIdx.y * row_stride + t] = Elem<L>::from_float(-INFINITY);
}

}  // namespace

int launch_sample_greedy(const GreedyArgs& a, void* stream) {
  if (a.rows <= 0) return 0;
  const cudaStream_t st = static_cast<cudaStream_t>(stream);
  return with_dtype(a.logits_dtype, [&](auto t) { return launch_greedy_dtype<decltype(t)>(a, st); });
}

int launch_sample_temperature(const SampleArgs& a, void* stream) {
  if (a.rows <= 0) return 0;
  const cudaStream_t st = static_cast<cudaStream_t>(stream);
  return with_dtype(a.logits_dtype, [&](auto t) { return launch_sample_dtype<decltype(t)>(a, st); });
}

int launch_mask_logits(const MaskArgs& a, void* stream) {
  if (a.rows <= 0) return 0;
  const cudaStream_t st = static_cast<cudaStream_t>(stream);
  const dim3 grid((a.vocab + kMaskThreads - 1) / kMaskThreads, a.rows);
  return with_dtype(a.logits_dtype, [&](auto t) {
    using L = decltype(t);
    return launch_pdl(mask_logits_kernel<L>, grid, dim3(kMaskThreads), 0, st, static_cast<L*>(a.logits),
                      a.row_stride, static_cast<const uint32_t*>(a.bitmask), a.mask_stride, a.vocab);
  });
}

}  // namespace pagednb
