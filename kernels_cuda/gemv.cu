// y[M, N] = x[M, K] . W[N, K]^T (+ bias) for the one or two rows of a small decode step: the
// weight-streaming matrix-vector product. At M = 1 cuBLAS reads a small decoder's projections at
// 0.3-2 TB/s on an H200 (its GEMM tiles are built for many rows); this kernel streams each weight row
// once with 16-byte loads, keeps many of them in flight, and reuses each loaded weight vector for all M
// rows. Which shapes it serves is decided in pagednb/model/small_linear.py from benchmarks/linear.py.
//
// Layout: a CTA of 4 warps. K is cut into chunks of 256 elements (32 lanes x 8, 16 bytes per lane).
// Wide matrices (N >= 4096: the fused qkv and gate/up projections, the LM head): each warp owns R whole
// weight rows and walks all their chunks, U chunks' loads issued before their math. Narrow ones
// (o_proj, down_proj: too few rows to fill the GPU otherwise): the 4 warps share two rows and take
// every 4th chunk (two rows rather than one: half the CTAs, holding 2/3 of the register file rather than
// all of it for Qwen3-0.6B's o and down at batch 1, so the next kernel's CTAs find room to start their
// weight loads before this one ends). Each lane accumulates in float32; a warp then reduces its M x R sums
// across lanes with a reduce-scatter butterfly (31 shuffles for 32 sums instead of 160), ending with one
// total per lane group; the 4 warps of a shared row add their totals in warp order.
//
// Input (GemvInput): x itself, or RMSNorm(x + residual) (a block's first projection without the norm's
// launch): every CTA adds and normalises the 1-2 input rows itself into shared memory (a 1024-wide row is
// 2-4 KB from L2, less than the 4 warps' own x reads), and CTA 0 writes x + residual, the residual stream,
// for the next block. Output (gate, GemvGate): y itself, or for weight rows [gate | up] (a gated MLP's
// gate/up projection) SiLU(gate) * up or GELU-tanh(gate) * up: each warp takes the row pair (p, p + N/2), so
// a gate and its up meet in one warp and the activation is written without the activation kernel's launch
// (and without the
// [M, N] round trip). Both round exactly as fused_ops.cu's kernels do (the norm's sum of squares in its
// RMSNorm kernel's order; gate and up rounded to T first, as the unfused GEMV writes them), so fused or
// not, a layer gives the same bits.
//
// Programmatic dependent launch (common.cuh): the weights are read by no earlier kernel's writes, so each
// warp issues its first group of weight loads (for a 1024-wide or a narrow weight: all of its share), and
// each thread its norm-weight vectors, before pdl_wait(); the weight stream then starts while the kernel
// before it is still finishing. After the wait a batch-1 launch is a chain of latencies (the kernel after
// it waits for all of it), so each step past the wait costs one round trip to L2 at most: x and the
// residual are loaded together, and x's vectors for all of a warp's chunks before the first is used.
//
// Numerics: float32 accumulation, one rounding to the output dtype (as cuBLAS), bias added in float32
// before it. The order of the additions for one output element depends only on N and K (which layout,
// which chunks), never on M, R or the batch around the row, so a row's result is the same whether it
// runs alone, beside another row, or in a padded CUDA-graph bucket.
#include "common.cuh"
#include "launchers.h"

namespace pagednb {

namespace {

constexpr int kGemvWarps = 4;
constexpr int kGemvChunk = 32 * 8;  // elements of K per warp step: 16 bytes per lane
constexpr int kGemvUnroll = 4;      // chunks whose loads a warp issues before their math

__host__ __device__ constexpr int log2i(int v) { return v <= 1 ? 0 : 1 + log2i(v / 2); }

// Sums v[i] over the warp's 32 lanes for all V (a power of two <= 32) values at once. Each level halves
// the values a lane carries (it keeps one half, sends the other to its partner) until one is left, then
// plain butterfly levels follow. Lane l ends with the total of value l >> (5 - log2 V). Every level
// adds the same pairs of lanes as a plain butterfly would, so each total is the same bits as a
// butterfly's, whatever V is.
template <int V>
__device__ __forceinline__ float warp_reduce_scatter(float (&v)[V], int lane) {
#pragma unroll
  for (int s = 16, n = V; s >= 1; s >>= 1) {
    if (n > 1) {
      const bool upper = lane & s;
#pragma unroll
      for (int i = 0; i < n / 2; ++i) {
        const float send = upper ? v[i] : v[i + n / 2];
        const float keep = upper ? v[i + n / 2] : v[i];
        v[i] = keep + __shfl_xor_sync(0xffffffffu, send, s);
      }
      n /= 2;
    } else {
      v[0] += __shfl_xor_sync(0xffffffffu, v[0], s);
    }
  }
  return v[0];
}

// The kU chunks of weight rows wrow starting at chunk c0 (every WK-th chunk), zeros past K.
template <typename T, int R, int WK>
__device__ __forceinline__ void load_weights(const T* const (&wrow)[R], int K, int c0, int lane,
                                             uint4 (&w)[kGemvUnroll][R]) {
#pragma unroll
  for (int u = 0; u < kGemvUnroll; ++u) {
    const int k = (c0 + u * WK) * kGemvChunk + lane * 8;
#pragma unroll
    for (int r = 0; r < R; ++r) w[u][r] = k < K ? ldg16(wrow[r] + k) : make_uint4(0, 0, 0, 0);
  }
}

// kGemvRmsNorm: the CTA's input rows RMSNorm(x + residual) into xs [M][K] (shared memory), as fused_ops.cu's
// rms_norm_kernel computes them: s = round(x + residual), the float32 sum of squares of s, scale =
// rsqrt(sum / K + eps), the weight applied as NormWeight says; CTA 0 writes s to residual_out. The sum is
// added in that kernel's order: its CTA of cta.threads threads (rms_norm_cta) is played by this CTA's 128,
// each standing in for up to 4 of them (virtual thread t + 128 j), so both kernels give the same bits.
constexpr int kNormVirtual = kNormMaxThreads / (kGemvWarps * 32);

template <typename T>
__device__ __forceinline__ void store8(T* p, const float (&v)[8]) {  // rounds to T (exact for values in T)
  *reinterpret_cast<uint4*>(p) = make_uint4(pack2<T>(v[0], v[1]), pack2<T>(v[2], v[3]), pack2<T>(v[4], v[5]),
                                            pack2<T>(v[6], v[7]));
}

__device__ __forceinline__ float butterfly_sum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = __fadd_rn(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

// Norm-weight vectors a thread loads before pdl_wait() (its vectors threadIdx.x + 128 p): all of them up to
// K = 2048 (Qwen3-0.6B's 1024, Llama-3.2-1B's 2048), so no L2 round trip for them is left after the wait.
constexpr int kNormPreload = 2;

// The thread's first kNormPreload norm-weight vectors (zeros past K); no kernel writes weights.
template <typename T>
__device__ __forceinline__ void preload_norm_weight(const GemvArgs& a, uint4 (&nw)[kNormPreload]) {
#pragma unroll
  for (int p = 0; p < kNormPreload; ++p) {
    const int i = threadIdx.x + p * kGemvWarps * 32;
    nw[p] = i < a.K / 8 ? ldg16(static_cast<const T*>(a.norm_weight) + i * 8) : make_uint4(0, 0, 0, 0);
  }
}

// Vector i (8 elements) of a normalised row in xs: scaled, the weight vector wv applied as NormWeight says.
template <typename T>
__device__ __forceinline__ void apply_norm_weight(const GemvArgs& a, T* row, int i, float scale, uint4 wv) {
  float v[8], w[8];
  Elem<T>::unpack(*reinterpret_cast<const uint4*>(row + i * 8), v);
  Elem<T>::unpack(wv, w);
#pragma unroll
  for (int e = 0; e < 8; ++e)
    v[e] = a.norm_style.in_float32 ? __fmul_rn(__fmul_rn(v[e], scale), __fadd_rn(w[e], a.norm_style.offset))
                                   : __fmul_rn(w[e], round_to<T>(__fmul_rn(v[e], scale)));
  store8(row + i * 8, v);
}

template <typename T, int MM>
__device__ __forceinline__ void normalise_rows(const GemvArgs& a, T* xs, const uint4 (&nw)[kNormPreload]) {
  __shared__ float partial[MM][kNormMaxThreads / 32];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nvec = a.K / 8;
  const int vthreads = rms_norm_cta(nvec).threads;
  const float inv_n = 1.0f / (float)a.K;
#pragma unroll
  for (int m = 0; m < MM; ++m) {
    if (m >= a.M) break;
    const T* x = static_cast<const T*>(a.x) + (int64_t)m * a.x_stride;
    const T* res = static_cast<const T*>(a.residual) + (int64_t)m * a.residual_stride;
    T* row = xs + m * a.K;
#pragma unroll
    for (int j = 0; j < kNormVirtual; ++j) {
      const int vt = threadIdx.x + j * kGemvWarps * 32;
      // warp-uniform (vthreads is whole warps); the virtual warps past it hold nothing, and their 5 dependent
      // shuffles of a zero would still lie on the path to the barrier
      if (vt >= vthreads) break;
      float ss = 0.f;
      for (int i = vt; i < nvec; i += vthreads) {
        // both loads issued before either is used (one round trip, not two: a load behind the residual's
        // test is not hoisted above the use of the one before it)
        const uint4 xv = ldg16(x + i * 8);
        const uint4 rv = a.residual != nullptr ? ldg16(res + i * 8) : make_uint4(0, 0, 0, 0);
        float v[8];
        Elem<T>::unpack(xv, v);
        if (a.residual != nullptr) {
          float r[8];
          Elem<T>::unpack(rv, r);
#pragma unroll
          for (int e = 0; e < 8; ++e) v[e] = round_to<T>(__fadd_rn(v[e], r[e]));
          if (blockIdx.x == 0) store8(static_cast<T*>(a.residual_out) + (int64_t)m * a.K + i * 8, v);
        }
        store8(row + i * 8, v);
#pragma unroll
        for (int e = 0; e < 8; ++e) ss = __fadd_rn(ss, __fmul_rn(v[e], v[e]));
      }
      ss = butterfly_sum(ss);  // virtual warp warp + 4 j
      if (lane == 0) partial[m][warp + j * kGemvWarps] = ss;
    }
    __syncthreads();
    const float total = butterfly_sum(lane < vthreads / 32 ? partial[m][lane] : 0.f);
    const float scale = rsqrtf(__fadd_rn(__fmul_rn(total, inv_n), a.eps));
    // each vector read and rewritten by one thread: first those whose weight it holds, then any past them
#pragma unroll
    for (int p = 0; p < kNormPreload; ++p) {
      const int i = threadIdx.x + p * kGemvWarps * 32;
      if (i < nvec) apply_norm_weight(a, row, i, scale, nw[p]);
    }
    for (int i = threadIdx.x + kNormPreload * kGemvWarps * 32; i < nvec; i += kGemvWarps * 32)
      apply_norm_weight(a, row, i, scale, ldg16(static_cast<const T*>(a.norm_weight) + i * 8));
  }
  __syncthreads();
}

// Where the input vectors come from. One row: held in registers, all of a group's kU chunks loaded before any
// is used, so a warp waits for one round trip of x's loads (global memory, or the normalised row in shared
// memory) rather than one per chunk: a load behind a chunk's bounds check is not hoisted above the math of the
// chunk before it. Two rows: read where used (both rows' vectors would cost the narrow kernel resident CTAs).
template <int MM>
constexpr bool kHeldInputs = MM == 1;

// Row 0's vectors for the kU chunks from c0 (every WK-th): x's own, or (NORM) the normalised row xs; zeros past K.
template <typename T, int WK, bool NORM>
__device__ __forceinline__ void load_inputs(const GemvArgs& a, const T* xs, int c0, int lane,
                                            uint4 (&x)[kGemvUnroll]) {
#pragma unroll
  for (int u = 0; u < kGemvUnroll; ++u) {
    const int k = (c0 + u * WK) * kGemvChunk + lane * 8;
    if (k >= a.K) {
      x[u] = make_uint4(0, 0, 0, 0);
    } else if constexpr (NORM) {
      x[u] = *reinterpret_cast<const uint4*>(xs + k);
    } else {
      x[u] = ldg16(static_cast<const T*>(a.x) + k);
    }
  }
}

// Elements k..k+7 of input row m where they are not held: x's own, or (NORM) the normalised rows xs.
template <typename T, bool NORM>
__device__ __forceinline__ uint4 input_at(const GemvArgs& a, const T* xs, int m, int k) {
  if constexpr (NORM) return *reinterpret_cast<const uint4*>(xs + m * a.K + k);
  return ldg16(static_cast<const T*>(a.x) + (int64_t)m * a.x_stride + k);
}

// WK warps share each group of R rows (WK = 1: a warp's own rows; WK = 4: all 4 warps on one row group).
// A group is rows unit * R .. + R - 1, or gated (R = 2) the pair (unit, unit + N/2).
template <typename T, int MM, int R, int WK, bool NORM, int GATE>
__global__ void __launch_bounds__(kGemvWarps * 32) gemv_kernel(const GemvArgs a) {
  constexpr int V = MM * R, GROUPS = kGemvWarps / WK;
  static_assert(V <= 32 && (V & (V - 1)) == 0, "M x R must be a power of two <= 32");
  constexpr bool GATED = GATE != kGemvUngated;
  static_assert(!GATED || R == 2, "a gated group is one (gate, up) pair");
  __shared__ float partial[WK > 1 ? kGemvWarps : 1][V];
  extern __shared__ __align__(16) unsigned char gemv_smem[];  // NORM: the input rows [M][K] of T
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int group = warp / WK, ks = warp % WK;
  const int unit = blockIdx.x * GROUPS + group, half = a.N / 2;
  const T* wrow[R];
#pragma unroll
  for (int r = 0; r < R; ++r) {
    const int n = GATED ? min(unit, half - 1) + r * half : min(unit * R + r, a.N - 1);
    wrow[r] = static_cast<const T*>(a.weight) + (int64_t)n * a.K;
  }

  uint4 w[kGemvUnroll][R];
  load_weights<T, R, WK>(wrow, a.K, ks, lane, w);  // before the wait: no kernel writes weights
  uint4 nw[kNormPreload];  // nor the norm's: in registers (any past them on their way to L2) before the wait
  if constexpr (NORM) {
    preload_norm_weight<T>(a, nw);
    for (int i = (threadIdx.x + kNormPreload * kGemvWarps * 32) * 8; i < a.K; i += kGemvWarps * 32 * 8)
      asm volatile("prefetch.global.L2 [%0];" ::"l"(static_cast<const T*>(a.norm_weight) + i));
  }
  pdl_launch_dependents();
  pdl_wait();
  T* xs = reinterpret_cast<T*>(gemv_smem);
  if constexpr (NORM) normalise_rows<T, MM>(a, xs, nw);

  float acc[V];
#pragma unroll
  for (int i = 0; i < V; ++i) acc[i] = 0.f;

  const int nchunks = (a.K + kGemvChunk - 1) / kGemvChunk;
  for (int c0 = ks; c0 < nchunks; c0 += WK * kGemvUnroll) {
    if (c0 != ks) load_weights<T, R, WK>(wrow, a.K, c0, lane, w);
    uint4 x[kGemvUnroll];
    if constexpr (kHeldInputs<MM>) load_inputs<T, WK, NORM>(a, xs, c0, lane, x);
#pragma unroll
    for (int u = 0; u < kGemvUnroll; ++u) {
      const int k = (c0 + u * WK) * kGemvChunk + lane * 8;
      if (k >= a.K) break;  // later u are past the end too
      float wf[R][8];
#pragma unroll
      for (int r = 0; r < R; ++r) Elem<T>::unpack(w[u][r], wf[r]);
#pragma unroll
      for (int m = 0; m < MM; ++m) {
        if (m < a.M) {
          float xf[8];
          Elem<T>::unpack(kHeldInputs<MM> ? x[u] : input_at<T, NORM>(a, xs, m, k), xf);
#pragma unroll
          for (int r = 0; r < R; ++r)
#pragma unroll
            for (int e = 0; e < 8; ++e) acc[m * R + r] = fmaf(xf[e], wf[r][e], acc[m * R + r]);
        }
      }
    }
  }

  float total = warp_reduce_scatter<V>(acc, lane);
  const int idx = lane >> (5 - log2i(V));              // the value this lane holds
  const bool holder = (lane & ((32 / V) - 1)) == 0;     // one lane per value writes it
  if constexpr (WK > 1) {
    if (holder) partial[warp][idx] = total;
    __syncthreads();
    if (ks != 0) return;
#pragma unroll
    for (int i = 1; i < WK; ++i) total += partial[warp + i][idx];  // warp order
  }
  const int m = idx / R, r = idx % R;
  const T* bias = static_cast<const T*>(a.bias);
  T* out = static_cast<T*>(a.out) + (int64_t)m * a.out_stride;
  if constexpr (GATED) {
    const float up = __shfl_down_sync(0xffffffffu, total, 32 / V);  // the pair's up total: the next value
    if (holder && r == 0 && m < a.M && unit < half) {
      const float g = bias != nullptr ? total + Elem<T>::to_float(bias[unit]) : total;
      const float u = bias != nullptr ? up + Elem<T>::to_float(bias[unit + half]) : up;
      out[unit] = Elem<T>::from_float(gate_and_mul<T, GATE>(round_to<T>(g), round_to<T>(u)));
    }
  } else {
    const int n = unit * R + r;
    if (holder && m < a.M && n < a.N) {
      if (bias != nullptr) total += Elem<T>::to_float(bias[n]);
      out[n] = Elem<T>::from_float(total);
    }
  }
}

template <typename T, int MM, int R, int WK, bool NORM, int GATE>
int launch_gemv_shape(const GemvArgs& a, cudaStream_t st) {
  constexpr int groups = kGemvWarps / WK;
  const int units = GATE != kGemvUngated ? a.N / 2 : (a.N + R - 1) / R;
  const unsigned blocks = (unsigned)((units + groups - 1) / groups);
  const size_t smem = NORM ? (size_t)a.M * a.K * sizeof(T) : 0;
  return launch_pdl(gemv_kernel<T, MM, R, WK, NORM, GATE>, dim3(blocks), dim3(kGemvWarps * 32), smem, st, a);
}

template <typename T, int MM, bool NORM, int GATE>
int launch_gemv_rows(const GemvArgs& a, cudaStream_t st) {
  // the layout depends on N only (never on M), so a row's sums are the same for every batch size, and a
  // gated pair's are those of the same rows unfused
  if (a.N >= 4096) return launch_gemv_shape<T, MM, 2, 1, NORM, GATE>(a, st);
  return launch_gemv_shape<T, MM, 2, 4, NORM, GATE>(a, st);
}

template <typename T, bool NORM, int GATE>
int launch_gemv_rows_in(const GemvArgs& a, cudaStream_t st) {
  static_assert(kGemvMaxRows == 2, "one instantiation per row count");
  return a.M <= 1 ? launch_gemv_rows<T, 1, NORM, GATE>(a, st) : launch_gemv_rows<T, 2, NORM, GATE>(a, st);
}

template <typename T>
int launch_gemv_dtype(const GemvArgs& a, cudaStream_t st) {
  static_assert(kGemvMaxNormWidth * kGemvMaxRows * 2 <= 48 * 1024, "normalised rows within the default smem");
  const bool norm = a.input == kGemvRmsNorm;
  switch (a.gate) {
    case kGemvUngated:
      return norm ? launch_gemv_rows_in<T, true, kGemvUngated>(a, st)
                  : launch_gemv_rows_in<T, false, kGemvUngated>(a, st);
    case kGemvSilu:
      return norm ? launch_gemv_rows_in<T, true, kGemvSilu>(a, st)
                  : launch_gemv_rows_in<T, false, kGemvSilu>(a, st);
    case kGemvGeluTanh:
      return norm ? launch_gemv_rows_in<T, true, kGemvGeluTanh>(a, st)
                  : launch_gemv_rows_in<T, false, kGemvGeluTanh>(a, st);
    default: return -1;
  }
}

}  // namespace

int launch_gemv(int dtype, const GemvArgs& a, void* stream) {
  if (a.M <= 0 || a.N <= 0) return 0;  // the shape is checked by bindings.cpp
  const cudaStream_t st = static_cast<cudaStream_t>(stream);
  switch (dtype) {
    case kFloat16: return launch_gemv_dtype<__half>(a, st);
    case kBFloat16: return launch_gemv_dtype<__nv_bfloat16>(a, st);
    default: return -1;
  }
}

}  // namespace pagednb
