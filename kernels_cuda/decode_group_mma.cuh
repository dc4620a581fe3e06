// Decode attention on tensor cores for grouped-query heads (bf16/fp16; 4 to 16 query heads per kv head;
// head_dim 64, and 128 over an fp8 cache, see group_mma_applies). One CTA of 4 warps per (query row, kv
// head, split-K partition).
//
// Why: with G query heads per kv head the row kernel (decode.cuh) does G dot products and G
// accumulations per K/V element on CUDA cores; at head_dim 64 and G = 4 that is instruction-bound
// (~1.8 TB/s on an H200) long before the K/V read is. Here the G heads are the rows of an
// mma.sync m16n8k16 tile (rows G..15 are zero padding; tensor cores have the throughput to spare), as
// FlashInfer does for large groups: per 16 tokens a warp issues D/8 MMAs for the scores and D/8 for
// P.V, and the K/V bytes become the limit again.
//
// Each warp streams its own tiles of 16 tokens (tiles warp, warp + 4, ... of the partition, so the
// CTA reads the sequence front to back together) through a private S-stage cp.async ring in shared
// memory (rows padded by 16 bytes: conflict-free ldmatrix), so the main loop has no CTA barrier,
// only warp-level syncs. Scores: S = Q K^T (Q fragments loaded once, K by ldmatrix), masked past the
// partition's end, in log2 units (scale * log2 e applied in float32), online softmax per warp row
// (a quad of lanes holds one row), P rounded to the input type as the A operand of P V (V by
// ldmatrix.trans), as the prefill kernel and FlashAttention do. The warps' (o, m, l) are merged in
// shared memory at the end; with P > 1 partitions (SPLIT, chosen per launch as in the row kernel) the last
// partition to finish merges the unnormalised partials as the row kernel does (merge_warps_and_store).
// An fp8 cache has a kernel of its own, group_mma_fp8_decode_kernel below (the same streaming, split-K and
// merge; fragments converted in registers, transposed products). Per element it does far fewer instructions
// than the row kernel's G multiply-adds, so with fp8's halved bytes it stays bandwidth-bound where the row
// kernel would not. k_scale is folded into the score scale, v_scale into the output (the merges).
// Included by decode.cuh after the row kernel, whose row_keys, split_entry, merge_warps_and_store and kNegBig it
// shares.
#pragma once

#include <type_traits>

#include "common.cuh"
#include "launchers.h"

namespace pagednb {

template <int D>
struct GroupMmaCfg {
  static constexpr int NW = 4, NT = 32 * NW;
  static constexpr int BN = 16;                   // tokens per warp tile
  static constexpr int S = 3;                     // ring stages per warp
  static constexpr int LDS = D + 8;               // 16-bit tile row stride (elements)
  static constexpr int RLD = 2 * LDS;            // ring row stride (bytes)
  static constexpr int STAGE = 2 * BN * RLD;      // ring stage bytes: the K tile, then the V tile
  static constexpr int VEC = 8;                   // cache elements per 16-byte chunk
  static constexpr int CPR = D / VEC;             // 16-byte chunks per token row
  static constexpr int CPL = BN * CPR / 32;       // chunks per lane per K (or V) tile
  static constexpr int RING_BYTES = NW * S * STAGE;
  static constexpr int MERGE_BYTES = NW * 16 * (D + 2) * 4;
  static constexpr int SMEM = RING_BYTES > MERGE_BYTES ? RING_BYTES : MERGE_BYTES;
  static_assert((BN * CPR) % 32 == 0 && CPL >= 1, "copy shape");
};

// KV: the cache's type (T); CAP: Gemma 2's soft-capping; SPLIT: P > 1
template <typename T, typename KV, int D, bool CAP = false, bool SPLIT = false>
__global__ void __launch_bounds__(128) group_mma_decode_kernel(const AttnParams p) {
  static_assert(std::is_same<T, KV>::value, "a 16-bit cache of the query's type (fp8: group_mma_fp8_decode_kernel)");
  if constexpr (!SPLIT) decode_entry(p);
  using C = GroupMmaCfg<D>;
  constexpr int NW = C::NW, BN = C::BN, S = C::S, LDS = C::LDS, CPR = C::CPR, CPL = C::CPL, VEC = C::VEC;
  extern __shared__ __align__(16) unsigned char dyn_smem[];
  unsigned char* work = dyn_smem;

  if constexpr (SPLIT)  // the order is written by the step's sort: before the wait only where early_keys says so
    if (p.row_order && !p.early_keys) pdl_wait();
  const int row = cta_row(p, p.Hkv);  // the row kernel's launch order (decode.cuh)
  const int kvh = blockIdx.x % p.Hkv;
  RowKeys keys;
  if constexpr (SPLIT) {
    if (!split_entry<KV, D, C::NT>(p, row, kvh, keys)) return;
  } else if (!row_keys(p, row, keys)) {
    pdl_wait();  // common.cuh's rule 2
    return;
  }
  const int s = keys.seq, t_begin = keys.t_begin, t_end = keys.t_end, t_new = keys.t_new;

  const int G = p.G;
  const int h0 = kvh * G;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;

  // this warp's tiles of the partition: j = warp, warp + NW, ...
  const int ntiles = t_end > t_begin ? (t_end - t_begin + BN - 1) / BN : 0;
  const int my_tiles = ntiles > warp ? (ntiles - warp + NW - 1) / NW : 0;
  unsigned char* ring = work + warp * S * C::STAGE;
  const int* bt = p.block_tables + (int64_t)s * p.bt_stride;
  const int64_t row_elems = (int64_t)p.Hkv * D;
  const KV* kbase = reinterpret_cast<const KV*>(p.cache) + (int64_t)kvh * D;
  const int bs_mask = (1 << p.bs_log2) - 1;
  // cp.async of the warp's tile i's keys of one kind (Keys) into stage i % S (an empty group past the end)
  auto issue = [&](int i, auto which) {
    if (i < my_tiles) {
      const int t0 = t_begin + (warp + i * NW) * BN;
      unsigned char* st = ring + (i % S) * C::STAGE;
#pragma unroll
      for (int c = 0; c < CPL; ++c) {
        const int idx = c * 32 + lane;
        const int r = idx / CPR, col = (idx % CPR) * VEC;
        const int t = min(t0 + r, t_end - 1);  // a real token of this partition: never garbage
        if (takes(which, t, t_new)) {
          const int blk = __ldg(bt + (t >> p.bs_log2));
          const KV* kp = kbase + (((int64_t)blk << p.bs_log2) + (t & bs_mask)) * row_elems + col;
          cp_async16(st + r * C::RLD + col * sizeof(KV), kp, true);
          cp_async16(st + (BN + r) * C::RLD + col * sizeof(KV), kp + p.v_offset, true);
        }
      }
    }
    commit_unless_old(which);
  };
  ring_prologue<S, SPLIT>(issue);

  // Q fragments straight from global memory, in the A layout of mma.m16n8k16 (a lane holds query heads
  // lane / 4 and lane / 4 + 8 at columns 2 (lane % 4) + {0, 1} and + 8); heads G..15 are zero rows. No
  // shared-memory staging: the ring alone then fits 4 CTAs per SM (3 with a staged Q).
  uint32_t qf[D / 16][4];
  {
    const int g = lane >> 2, c = 2 * (lane & 3);
    const T* qrow = reinterpret_cast<const T*>(p.q) + (int64_t)row * p.q_stride_tok;
    const uint32_t* q_lo = reinterpret_cast<const uint32_t*>(qrow + (int64_t)(h0 + g) * p.q_stride_head + c);
    const uint32_t* q_hi = reinterpret_cast<const uint32_t*>(qrow + (int64_t)(h0 + g + 8) * p.q_stride_head + c);
#pragma unroll
    for (int kc = 0; kc < D / 16; ++kc) {
      qf[kc][0] = g < G ? __ldg(q_lo + kc * 8) : 0u;
      qf[kc][1] = g + 8 < G ? __ldg(q_hi + kc * 8) : 0u;
      qf[kc][2] = g < G ? __ldg(q_lo + kc * 8 + 4) : 0u;
      qf[kc][3] = g + 8 < G ? __ldg(q_hi + kc * 8 + 4) : 0u;
    }
  }
  const int k_row = (lane & 7) + 8 * (lane >> 4), k_col = 8 * ((lane >> 3) & 1);  // K: ldmatrix
  const int v_row = (lane & 7) + 8 * ((lane >> 3) & 1), v_col = 8 * (lane >> 4);  // V: ldmatrix.trans
  const int quad = lane & 3;

  float o[D / 8][4];
#pragma unroll
  for (int j = 0; j < D / 8; ++j) o[j][0] = o[j][1] = o[j][2] = o[j][3] = 0.f;
  float m[2] = {kNegBig, kNegBig}, l[2] = {0.f, 0.f};  // rows lane / 4 and lane / 4 + 8
  const float sl2 = p.scale_log2 * p.k_scale;  // (1: no fp8 cache here)

  for (int i = 0; i < my_tiles; ++i) {
    __syncwarp();  // every lane is done with the stage that issue() refills
    issue(i + S - 1, KeysOf<Keys::All>{});
    cp_async_wait<S - 1>();
    const unsigned char* stage = ring + (i % S) * C::STAGE;
    __syncwarp();  // tile i's copies by every lane have landed
    const T* sK = reinterpret_cast<const T*>(stage);
    const T* sV = sK + BN * LDS;

    float sc[2][4];
#pragma unroll
    for (int nt = 0; nt < 2; ++nt) sc[nt][0] = sc[nt][1] = sc[nt][2] = sc[nt][3] = 0.f;
#pragma unroll
    for (int kc = 0; kc < D / 16; ++kc) {
      uint32_t kb[4];
      ldmatrix_x4(kb, sK + k_row * LDS + kc * 16 + k_col);
      mma16816<T>(sc[0], qf[kc], kb[0], kb[1]);
      mma16816<T>(sc[1], qf[kc], kb[2], kb[3]);
    }
    const int t0 = t_begin + (warp + i * NW) * BN;
#pragma unroll
    for (int nt = 0; nt < 2; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int t = t0 + nt * 8 + 2 * quad + (e & 1);
        sc[nt][e] = t < t_end ? sc[nt][e] * sl2 : -INFINITY;
      }
    if constexpr (CAP) {  // its own instantiation: no other model evaluates tanh per score or pays registers
#pragma unroll
      for (int nt = 0; nt < 2; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e)
          if (t0 + nt * 8 + 2 * quad + (e & 1) < t_end) sc[nt][e] = soft_cap(sc[nt][e], p.softcap_log2);
    }
#pragma unroll
    for (int h = 0; h < 2; ++h) {  // h = 0: row lane / 4 (elements 0, 1); h = 1: row + 8 (elements 2, 3)
      float mx = fmaxf(fmaxf(sc[0][2 * h], sc[0][2 * h + 1]), fmaxf(sc[1][2 * h], sc[1][2 * h + 1]));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
      const float mn = fmaxf(m[h], mx);
      const float alpha = fast_exp2(m[h] - mn);
      m[h] = mn;
      float sum = 0.f;
#pragma unroll
      for (int nt = 0; nt < 2; ++nt)
#pragma unroll
        for (int e = 2 * h; e < 2 * h + 2; ++e) {
          sc[nt][e] = fast_exp2(sc[nt][e] - mn);
          sum += sc[nt][e];
        }
      l[h] = l[h] * alpha + sum;
#pragma unroll
      for (int j = 0; j < D / 8; ++j) {
        o[j][2 * h] *= alpha;
        o[j][2 * h + 1] *= alpha;
      }
    }
    uint32_t pa[4] = {pack2<T>(sc[0][0], sc[0][1]), pack2<T>(sc[0][2], sc[0][3]),
                      pack2<T>(sc[1][0], sc[1][1]), pack2<T>(sc[1][2], sc[1][3])};
#pragma unroll
    for (int dc = 0; dc < D / 16; ++dc) {
      uint32_t vb[4];
      ldmatrix_x4_trans(vb, sV + v_row * LDS + dc * 16 + v_col);
      mma16816<T>(o[2 * dc], pa, vb[0], vb[1]);
      mma16816<T>(o[2 * dc + 1], pa, vb[2], vb[3]);
    }
  }

  // the row sums are spread over the quad's lanes
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    l[h] += __shfl_xor_sync(0xffffffffu, l[h], 1);
    l[h] += __shfl_xor_sync(0xffffffffu, l[h], 2);
  }

  // merge the warps through shared memory (the ring's space once every copy has landed)
  cp_async_wait<0>();
  __syncthreads();
  float* s_o = reinterpret_cast<float*>(work);        // [NW][16][D]
  float* s_m = s_o + NW * 16 * D;                      // [NW][16]
  float* s_l = s_m + NW * 16;                          // [NW][16]
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int g = (lane >> 2) + 8 * h;
    if (g < G) {
      float* dst = s_o + (warp * 16 + g) * D + 2 * quad;
#pragma unroll
      for (int j = 0; j < D / 8; ++j) *reinterpret_cast<float2*>(dst + j * 8) = make_float2(o[j][2 * h], o[j][2 * h + 1]);
      if (quad == 0) { s_m[warp * 16 + g] = m[h]; s_l[warp * 16 + g] = l[h]; }
    }
  }
  __syncthreads();
  merge_warps_and_store<T, D, NW, 16, C::NT, SPLIT, CAP>(p, s_o, s_m, s_l, G, h0, row, keys.parts);
}

// ---- an fp8 cache: fragments converted in registers, no 16-bit tile ---------------------------------------
// The ring holds the fp8 tiles (16 tokens of K, then of V, 16-byte chunks XOR-swizzled so that every fragment
// load below is free of bank conflicts); each lane reads its fragments' bytes straight from it and converts
// them with cvt.rn.f16x2.e4m3x2 (exact), so a tile crosses shared memory once each way and the ring alone is
// the CTA's shared memory: 48 KB per kv head (S = 384 / D stages), 4 CTAs of one kv head per SM, the same
// bytes in flight at head_dim 64 and 128 (the 16-bit tile took 90 KB: 2 CTAs).
// KH = 2: a CTA serves two adjacent kv heads (one-partition launches): a token's K (V) bytes of both, 2D
// contiguous bytes, are read by one warp's copies, where one kv head's fp8 token row is only 128 bytes at
// head_dim 128 (64 at 64); each warp computes both heads from its stage. On the H200 (benchmarks/NOTES.md,
// issue 19 seventh round) that took head_dim 64 from 2,255 to 3,197 GB/s at B=64 T=4096, head_dim 128 from
// 3,238 to 3,470 (7 kv heads, one per CTA, vs 8).
// The products are transposed, S^T = K Q^T and O^T = V^T P^T, as m16n8k16 f16 MMAs: the tokens (K) and head
// dims (V^T) are the 16-row A operands, the group's query heads the 8 columns of B (two column tiles, NN = 2,
// for 9-16 heads), so up to 8 heads take half the MMAs, accumulator and Q registers of 16 padded rows. The
// head dims are permuted so that a lane's bytes lie together (a dot product may add its terms in any order;
// O's columns are put back when stored): K/Q: quad q's k-index pair in chunk kc is dims q D/4 + 4 kc + {0,1},
// {2,3}, so a lane reads D/4 contiguous bytes of its K rows g and g + 8; V: m-tile mt's rows g and g + 8 are
// dims g D/8 + 2 mt + {0, 1}, so a lane reads D/8 contiguous bytes of its V rows 2q, 2q + 1, 2q + 8, 2q + 9
// and pairs two tokens' bytes of one dim with one byte permute (prmt) before the conversion. P^T, the B
// operand of the second product, is S^T's accumulator layout transposed by movmatrix. The MMAs are f16: the
// cache's values are f16 values, P is in [0, 1], and a bf16 query is scaled by a power of 2 (its largest
// magnitude into [2^14, 2^15)) before its conversion, the factor folded into the score scale.
// LEAN (row variant 5, the backend's default; two kv heads per CTA at head_dim 128 only): 32 KB per kv head (two
// stages) and at most 168 registers (~40 bytes spilled), so 3 CTAs (12 warps) share an SM where 174 registers and
// 96 KB held it to 2 (8 warps): with 2 warps per scheduler the per-tile chain (fragment loads, conversions, MMAs,
// the softmax's shuffles) was not hidden. On the H200 the standard workload's fp8 decode attention took 2.288 s a
// run against 2.407 and whole runs gained 1.5% (benchmarks/NOTES.md, issue 19's sixteenth round).
template <int D, int KH, bool LEAN = false>
struct GroupFp8Cfg {
  static constexpr int NW = 4, NT = 32 * NW;
  static constexpr int BN = 16;                   // tokens per warp tile
  static constexpr int S = (LEAN ? 256 : 384) / D;  // ring stages per warp: 48 KB per kv head (LEAN: 32)
  static constexpr int MIN_CTAS = LEAN ? 3 : 0;   // __launch_bounds__'s resident CTAs per SM (0: none asked)
  static constexpr int RB = KH * D;               // bytes of a token row of the tile (K or V of KH heads)
  static constexpr int CPR = RB / 16;             // 16-byte chunks per token row
  static constexpr int CPL = BN * CPR / 32;       // chunks per lane per K (or V) tile
  static constexpr int TILE = BN * RB;            // bytes of a K (or V) tile
  static constexpr int STAGE = 2 * TILE;          // the K tile, then the V tile
  static constexpr int RING_BYTES = NW * S * STAGE;
  static constexpr int MERGE_BYTES = KH * NW * 16 * (D + 2) * 4;
  static constexpr int SMEM = RING_BYTES > MERGE_BYTES ? RING_BYTES : MERGE_BYTES;
  static_assert((D == 64 || D == 128) && (KH == 1 || KH == 2) && CPL >= 1, "head_dim 64 or 128, 1 or 2 kv heads");
};

// Byte offset of 16-byte chunk c of token row r in a swizzled tile of rows of KH * D bytes: the chunk's position
// in its 128-byte line XOR a function of the row, chosen so that the 8 lanes of a 16-byte load (K: rows g,
// g + 1, a quad's chunks of one head) and the 16 of an 8-byte load (V at head_dim 64: rows 2q + const, 4 quads)
// hit distinct banks (checked for every layout by enumeration, see NOTES).
template <int D, int KH>
__device__ __forceinline__ int fp8_tile_offset(int r, int c) {
  const int chunk = r * (KH * D / 16) + c, line = chunk >> 3;
  int swizzle;
  if constexpr (D == 128) swizzle = r & 7;                                  // a head's row is one line
  else if constexpr (KH == 1) swizzle = (line & 3) << 1;                    // two rows per line
  else swizzle = (((r >> 1) & 3) << 1) ^ ((r & 1) << 2);                    // two heads' halves per line
  return (line * 8 + ((chunk & 7) ^ swizzle)) * 16;
}

// the 4 fp8 values of x as two f16x2 registers: bytes 0, 1 -> lo, bytes 2, 3 -> hi (the halves of x taken as they
// are, no shift: ptxas selects the upper half in the conversion itself)
__device__ __forceinline__ void e4m3x4_to_f16x2(uint32_t x, uint32_t& lo, uint32_t& hi) {
  asm("{\n .reg .b16 l, h;\n mov.b32 {l, h}, %2;\n cvt.rn.f16x2.e4m3x2 %0, l;\n cvt.rn.f16x2.e4m3x2 %1, h;\n}\n"
      : "=r"(lo), "=r"(hi) : "r"(x));
}
__device__ __forceinline__ uint32_t movmatrix_trans(uint32_t x) {  // an 8x8 16-bit fragment, transposed
  uint32_t y;
  asm volatile("movmatrix.sync.aligned.m8n8.trans.b16 %0, %1;\n" : "=r"(y) : "r"(x));
  return y;
}

// The lane's B fragments of Q^T (f16) for the G heads from q0 (head stride head_stride; SHARED: a shared-memory
// tile, else global memory): column tile nn's head nn * 8 + g (zero past G), dims q D/4 + 4 kc + {0,1} (register 0)
// and {2,3} (register 1). Returns the factor the scores must be multiplied by (a bf16 query's power-of-2 scaling
// undone; 1 for fp16).
template <typename T, int D, int NN, bool SHARED = false>
__device__ __forceinline__ float load_q_f16(const T* q0, int64_t head_stride, int G, uint32_t (&qf)[NN][D / 16][2]) {
  const int lane = threadIdx.x & 31, g = lane >> 2, q = lane & 3;
  uint32_t w[NN][D / 8];  // D/4 16-bit values of each head
#pragma unroll
  for (int nn = 0; nn < NN; ++nn) {
    const int h = nn * 8 + g;
    const T* src = q0 + (int64_t)h * head_stride + q * (D / 4);
#pragma unroll
    for (int v = 0; v < D / 32; ++v) {
      uint4 x = make_uint4(0u, 0u, 0u, 0u);
      if (h < G) x = SHARED ? *reinterpret_cast<const uint4*>(src + v * 8) : ldg16(src + v * 8);
      w[nn][4 * v] = x.x; w[nn][4 * v + 1] = x.y; w[nn][4 * v + 2] = x.z; w[nn][4 * v + 3] = x.w;
    }
  }
  float factor = 1.f;
  if constexpr (std::is_same<T, __nv_bfloat16>::value) {
    float mx = 0.f;
#pragma unroll
    for (int nn = 0; nn < NN; ++nn)
#pragma unroll
      for (int i = 0; i < D / 8; ++i)
        mx = fmaxf(mx, bf16x2_absmax(w[nn][i]));
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
    const F16Scale sc = f16_scale_for(mx);
    factor = sc.factor;
#pragma unroll
    for (int nn = 0; nn < NN; ++nn)
#pragma unroll
      for (int i = 0; i < D / 8; ++i) w[nn][i] = bf16x2_to_f16x2(w[nn][i], sc.down);
  }
#pragma unroll
  for (int nn = 0; nn < NN; ++nn)
#pragma unroll
    for (int kc = 0; kc < D / 16; ++kc) {
      qf[nn][kc][0] = w[nn][2 * kc];
      qf[nn][kc][1] = w[nn][2 * kc + 1];
    }
  return factor;
}

// S^T (16 tokens x 8 heads per column tile) of kv head kh of one ring tile: A = the K rows g, g + 8 (dims
// permuted as Q's)
template <int D, int KH, int NN>
__device__ __forceinline__ void fp8_scores(const unsigned char* sK, int kh, const uint32_t (&qf)[NN][D / 16][2],
                                           float (&sc)[NN][4]) {
  const int lane = threadIdx.x & 31, g = lane >> 2, q = lane & 3;
  uint32_t lo[D / 16], hi[D / 16];  // the lane's D/4 bytes of rows g and g + 8: one word per k chunk
#pragma unroll
  for (int u = 0; u < D / 64; ++u) {
    const int c = kh * (D / 16) + q * (D / 64) + u;
    const uint4 a = *reinterpret_cast<const uint4*>(sK + fp8_tile_offset<D, KH>(g, c));
    const uint4 b = *reinterpret_cast<const uint4*>(sK + fp8_tile_offset<D, KH>(g + 8, c));
    lo[4 * u] = a.x; lo[4 * u + 1] = a.y; lo[4 * u + 2] = a.z; lo[4 * u + 3] = a.w;
    hi[4 * u] = b.x; hi[4 * u + 1] = b.y; hi[4 * u + 2] = b.z; hi[4 * u + 3] = b.w;
  }
#pragma unroll
  for (int nn = 0; nn < NN; ++nn) sc[nn][0] = sc[nn][1] = sc[nn][2] = sc[nn][3] = 0.f;
#pragma unroll
  for (int kc = 0; kc < D / 16; ++kc) {
    uint32_t a[4];  // rows g (0, 2) and g + 8 (1, 3); dims + {0, 1} (0, 1) and + {2, 3} (2, 3)
    e4m3x4_to_f16x2(lo[kc], a[0], a[2]);
    e4m3x4_to_f16x2(hi[kc], a[1], a[3]);
#pragma unroll
    for (int nn = 0; nn < NN; ++nn) mma16816<__half>(sc[nn], a, qf[nn][kc][0], qf[nn][kc][1]);
  }
}

// O^T += V^T P^T of kv head kh of one ring tile: A = m-tile mt's dims of the V rows 2q, 2q + 1 (register 0:
// dim g D/8 + 2 mt; register 1: the next dim) and 2q + 8, 2q + 9 (registers 2, 3), two tokens' bytes paired by
// one prmt
template <int D, int KH, int NN>
__device__ __forceinline__ void fp8_pv(const unsigned char* sV, int kh, const uint32_t (&pb)[NN][2],
                                       float (&o)[D / 16][NN][4]) {
  const int lane = threadIdx.x & 31, g = lane >> 2, q = lane & 3;
  constexpr int W = D / 32;  // the lane's words of a row (D/8 bytes)
  uint32_t v[4][W];
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const int r = 2 * q + (j & 1) + 8 * (j >> 1), byte = kh * D + g * (D / 8);
    const unsigned char* src = sV + fp8_tile_offset<D, KH>(r, byte >> 4) + (byte & 15);
    if constexpr (W == 4) {
      const uint4 x = *reinterpret_cast<const uint4*>(src);
      v[j][0] = x.x; v[j][1] = x.y; v[j][2] = x.z; v[j][3] = x.w;
    } else {
      const uint2 x = *reinterpret_cast<const uint2*>(src);
      v[j][0] = x.x; v[j][1] = x.y;
    }
  }
#pragma unroll
  for (int mt = 0; mt < D / 16; ++mt) {
    const uint32_t sel = mt & 1 ? 0x7362u : 0x5140u;  // bytes (2, 3) or (0, 1) of both rows, interleaved
    const uint32_t x01 = __byte_perm(v[0][mt >> 1], v[1][mt >> 1], sel);
    const uint32_t x89 = __byte_perm(v[2][mt >> 1], v[3][mt >> 1], sel);
    uint32_t a[4];
    e4m3x4_to_f16x2(x01, a[0], a[1]);
    e4m3x4_to_f16x2(x89, a[2], a[3]);
#pragma unroll
    for (int nn = 0; nn < NN; ++nn) mma16816<__half>(o[mt][nn], a, pb[nn][0], pb[nn][1]);
  }
}

// One warp tile's online softmax for one kv head: scores sc (S^T layout) -> P^T fragments pb, o rescaled
template <int D, int NN, bool CAP>
__device__ __forceinline__ void fp8_softmax(const AttnParams& p, float (&sc)[NN][4], const bool (&live)[2], float sl2,
                                            float (&m)[NN][2], float (&l)[NN][2], float (&o)[D / 16][NN][4],
                                            uint32_t (&pb)[NN][2]) {
#pragma unroll
  for (int nn = 0; nn < NN; ++nn) {
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      sc[nn][e] = live[e >> 1] ? sc[nn][e] * sl2 : -INFINITY;
      if constexpr (CAP)
        if (live[e >> 1]) sc[nn][e] = soft_cap(sc[nn][e], p.softcap_log2);
    }
#pragma unroll
    for (int h = 0; h < 2; ++h) {  // head 2q + h: elements h (token g) and h + 2 (token g + 8)
      float mx = fmaxf(sc[nn][h], sc[nn][h + 2]);
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 4));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 8));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 16));
      const float mn = fmaxf(m[nn][h], mx);
      const float alpha = fast_exp2(m[nn][h] - mn);
      m[nn][h] = mn;
      sc[nn][h] = fast_exp2(sc[nn][h] - mn);
      sc[nn][h + 2] = fast_exp2(sc[nn][h + 2] - mn);
      l[nn][h] = l[nn][h] * alpha + sc[nn][h] + sc[nn][h + 2];  // this lane's tokens; summed over g at the end
#pragma unroll
      for (int mt = 0; mt < D / 16; ++mt) {
        o[mt][nn][h] *= alpha;
        o[mt][nn][h + 2] *= alpha;
      }
    }
    pb[nn][0] = movmatrix_trans(pack2<__half>(sc[nn][0], sc[nn][1]));  // tokens 2q, 2q + 1 of head g
    pb[nn][1] = movmatrix_trans(pack2<__half>(sc[nn][2], sc[nn][3]));  // tokens 2q + 8, 2q + 9
  }
}

// T: the query's type; KH: kv heads per CTA (2: one-partition launches only); NN: column tiles of 8 query
// heads (1: G <= 8); CAP: soft-capping; SPLIT: P > 1; FUSE: p.fuse_rope (decode.cuh's FusedRope: the CTA norms
// and rotates its query heads into a shared tile, and writes the new token's K/V)
template <typename T, int D, int KH, int NN, bool CAP = false, bool SPLIT = false, bool FUSE = false,
          bool LEAN = false>
__global__ void __launch_bounds__(128, GroupFp8Cfg<D, KH, LEAN>::MIN_CTAS) group_mma_fp8_decode_kernel(
    const AttnParams p) {
  static_assert(KH == 1 || !SPLIT, "the split-K merge counts one kv head per CTA");
  static_assert(!FUSE || !CAP, "no soft-capped model fuses (decode_fuses_rope)");
  static_assert(!LEAN || KH == 2, "the lean ring is the two-head CTA's");
  if constexpr (!SPLIT) decode_entry(p);
  using C = GroupFp8Cfg<D, KH, LEAN>;
  constexpr int NW = C::NW, BN = C::BN, S = C::S, CPR = C::CPR, CPL = C::CPL;
  extern __shared__ __align__(16) unsigned char dyn_smem[];

  if constexpr (SPLIT)  // the order is written by the step's sort: before the wait only where early_keys says so
    if (p.row_order && !p.early_keys) pdl_wait();
  const int cols = p.Hkv / KH;
  const int row = cta_row(p, cols);  // the row kernel's launch order (decode.cuh)
  const int kvh0 = blockIdx.x % cols * KH, G = p.G;
  FusedRope<T, Fp8E4M3, D> rope;
  if constexpr (FUSE) rope.load(p, row);
  RowKeys keys;
  if constexpr (SPLIT) {
    if (!split_entry<Fp8E4M3, D, C::NT>(p, row, kvh0, keys)) return;
  } else if (!row_keys(p, row, keys)) {
    pdl_wait();  // common.cuh's rule 2
    return;
  }
  const int t_begin = keys.t_begin, t_end = keys.t_end, t_new = keys.t_new;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, q = lane & 3;

  // this warp's tiles of the partition: j = warp, warp + NW, ...
  const int ntiles = t_end > t_begin ? (t_end - t_begin + BN - 1) / BN : 0;
  const int my_tiles = ntiles > warp ? (ntiles - warp + NW - 1) / NW : 0;
  unsigned char* ring = dyn_smem + warp * S * C::STAGE;
  const int* bt = p.block_tables + (int64_t)keys.seq * p.bt_stride;
  const int64_t row_bytes = (int64_t)p.Hkv * D;
  const uint8_t* kbase = reinterpret_cast<const uint8_t*>(p.cache) + (int64_t)kvh0 * D;
  const int bs_mask = (1 << p.bs_log2) - 1;
  // cp.async of the warp's tile i's keys of one kind (Keys) into stage i % S (an empty group past the end)
  auto issue = [&](int i, auto which) {
    if (i < my_tiles) {
      const int t0 = t_begin + (warp + i * NW) * BN;
      unsigned char* st = ring + (i % S) * C::STAGE;
#pragma unroll
      for (int c = 0; c < CPL; ++c) {
        const int idx = c * 32 + lane, r = idx / CPR, chunk = idx % CPR;
        const int t = min(t0 + r, t_end - 1);  // a real token of this partition: never garbage
        if (takes(which, t, t_new)) {
          const int blk = __ldg(bt + (t >> p.bs_log2));
          const uint8_t* kp = kbase + (((int64_t)blk << p.bs_log2) + (t & bs_mask)) * row_bytes + chunk * 16;
          const int at = fp8_tile_offset<D, KH>(r, chunk);
          cp_async16(st + at, kp, true);
          cp_async16(st + C::TILE + at, kp + p.v_offset, true);
        }
      }
    }
    commit_unless_old(which);
  };
  // FUSE: the query tile ([KH * G][D], at most 16 heads: 32 D bytes of a 32 KH D-byte stage) in warp 0's last
  // stage, which no copy fills before its first main-loop step (the prologue fills the first S - 1): no shared
  // memory beyond the ring
  T* q_tile = reinterpret_cast<T*>(dyn_smem + (S - 1) * C::STAGE);
  static_assert(16 * D * 2 <= C::STAGE, "a stage holds the query tile");
  ring_prologue<S, SPLIT>(issue, [&] {
    if constexpr (FUSE) rope.apply(p, row, kvh0, KH, t_begin <= t_new && t_new < t_end, q_tile);
  });

  uint32_t qf[KH][NN][D / 16][2];
  float sl2[KH];
  const T* qrow = reinterpret_cast<const T*>(p.q) + (int64_t)row * p.q_stride_tok;
#pragma unroll
  for (int kh = 0; kh < KH; ++kh) {
    const float f = FUSE ? load_q_f16<T, D, NN, true>(q_tile + kh * G * D, D, G, qf[kh])
                         : load_q_f16<T, D, NN>(qrow + (int64_t)(kvh0 + kh) * G * p.q_stride_head, p.q_stride_head, G,
                                                qf[kh]);
    sl2[kh] = p.scale_log2 * p.k_scale * f;
  }
  if constexpr (FUSE) __syncthreads();  // every warp has its queries before warp 0's first step refills the tile

  float o[KH][D / 16][NN][4];  // O^T: rows dims g D/8 + 2 mt + {0 (elements 0, 1), 1 (2, 3)}, columns heads 2q, 2q + 1
  float m[KH][NN][2], l[KH][NN][2];  // heads nn * 8 + 2q + h
#pragma unroll
  for (int kh = 0; kh < KH; ++kh)
#pragma unroll
    for (int nn = 0; nn < NN; ++nn) {
#pragma unroll
      for (int mt = 0; mt < D / 16; ++mt) o[kh][mt][nn][0] = o[kh][mt][nn][1] = o[kh][mt][nn][2] = o[kh][mt][nn][3] = 0.f;
      m[kh][nn][0] = m[kh][nn][1] = kNegBig;
      l[kh][nn][0] = l[kh][nn][1] = 0.f;
    }

  for (int i = 0; i < my_tiles; ++i) {
    __syncwarp();  // every lane is done with the stage that issue() refills
    issue(i + S - 1, KeysOf<Keys::All>{});
    cp_async_wait<S - 1>();
    __syncwarp();  // tile i's copies by every lane have landed
    const unsigned char* sK = ring + (i % S) * C::STAGE;
    const int t0 = t_begin + (warp + i * NW) * BN;
    const bool live[2] = {t0 + g < t_end, t0 + g + 8 < t_end};
#pragma unroll
    for (int kh = 0; kh < KH; ++kh) {
      float sc[NN][4];  // S^T: elements 0, 1 token g, 2, 3 token g + 8; heads 2q, 2q + 1
      fp8_scores<D, KH, NN>(sK, kh, qf[kh], sc);
      uint32_t pb[NN][2];
      fp8_softmax<D, NN, CAP>(p, sc, live, sl2[kh], m[kh], l[kh], o[kh], pb);
      fp8_pv<D, KH, NN>(sK + C::TILE, kh, pb, o[kh]);
    }
  }

#pragma unroll
  for (int kh = 0; kh < KH; ++kh)
#pragma unroll
    for (int nn = 0; nn < NN; ++nn)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        l[kh][nn][h] += __shfl_xor_sync(0xffffffffu, l[kh][nn][h], 4);
        l[kh][nn][h] += __shfl_xor_sync(0xffffffffu, l[kh][nn][h], 8);
        l[kh][nn][h] += __shfl_xor_sync(0xffffffffu, l[kh][nn][h], 16);
      }

  // merge the warps through shared memory (the ring's space once every copy has landed), dims put back
  cp_async_wait<0>();
  __syncthreads();
  constexpr int HEAD_FLOATS = NW * 16 * (D + 2);  // one kv head's o [NW][16][D], m, l [NW][16]
#pragma unroll
  for (int kh = 0; kh < KH; ++kh) {
    float* s_o = reinterpret_cast<float*>(dyn_smem) + kh * HEAD_FLOATS;
    float* s_m = s_o + NW * 16 * D;
    float* s_l = s_m + NW * 16;
#pragma unroll
    for (int nn = 0; nn < NN; ++nn)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int hd = nn * 8 + 2 * q + h;
        if (hd < G) {
          float* dst = s_o + (warp * 16 + hd) * D + g * (D / 8);
#pragma unroll
          for (int mt = 0; mt < D / 16; ++mt)
            *reinterpret_cast<float2*>(dst + 2 * mt) = make_float2(o[kh][mt][nn][h], o[kh][mt][nn][h + 2]);
          if (g == 0) { s_m[warp * 16 + hd] = m[kh][nn][h]; s_l[warp * 16 + hd] = l[kh][nn][h]; }
        }
      }
  }
  __syncthreads();
#pragma unroll
  for (int kh = 0; kh < KH; ++kh) {
    const float* s_o = reinterpret_cast<const float*>(dyn_smem) + kh * HEAD_FLOATS;
    merge_warps_and_store<T, D, NW, 16, C::NT, SPLIT, CAP>(p, s_o, s_o + NW * 16 * D, s_o + NW * 16 * (D + 1), G,
                                                           (kvh0 + kh) * G, row, keys.parts);
  }
}

// Allows the kernel its dynamic shared memory (over the 48 KiB default); once per instantiation.
template <typename T, typename KV, int D, bool CAP, bool SPLIT = false>
cudaError_t configure_group_mma() {
  using C = GroupMmaCfg<D>;
  static const cudaError_t e = cudaFuncSetAttribute(group_mma_decode_kernel<T, KV, D, CAP, SPLIT>,
                                                    cudaFuncAttributeMaxDynamicSharedMemorySize, C::SMEM);
  return e;
}

template <typename T, typename KV, int D, bool CAP, bool SPLIT>
int launch_group_mma_variant(const AttnParams& p, cudaStream_t st) {
  using C = GroupMmaCfg<D>;
  if (const cudaError_t e = configure_group_mma<T, KV, D, CAP, SPLIT>(); e != cudaSuccess) return (int)e;
  dim3 grid;
  if (!decode_grid(p, p.Hkv, grid)) return -1;
  return launch_pdl(group_mma_decode_kernel<T, KV, D, CAP, SPLIT>, grid, dim3(C::NT), C::SMEM, st, p);
}

template <typename T, typename KV, int D, bool CAP>
int launch_group_mma_split(const AttnParams& p, cudaStream_t st) {
  return p.P > 1 ? launch_group_mma_variant<T, KV, D, CAP, true>(p, st)
                 : launch_group_mma_variant<T, KV, D, CAP, false>(p, st);
}

template <typename T, typename KV, int D>
int launch_group_mma(const AttnParams& p, cudaStream_t st) {
  return p.softcap_log2 > 0.f ? launch_group_mma_split<T, KV, D, true>(p, st)
                              : launch_group_mma_split<T, KV, D, false>(p, st);
}

template <typename T, typename KV, int D>
int occupancy_group_mma_t() {
  using C = GroupMmaCfg<D>;
  if (configure_group_mma<T, KV, D, false>() != cudaSuccess) return 1;
  int n = 0;
  const cudaError_t e = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, group_mma_decode_kernel<T, KV, D>, 128,
                                                                      C::SMEM);
  return e == cudaSuccess && n > 0 ? n : 1;
}

// The fp8 kernel's host side, as above
template <typename T, int D, int KH, int NN, bool CAP, bool SPLIT = false, bool FUSE = false, bool LEAN = false>
cudaError_t configure_group_fp8() {
  static const cudaError_t e = cudaFuncSetAttribute(
      group_mma_fp8_decode_kernel<T, D, KH, NN, CAP, SPLIT, FUSE, LEAN>, cudaFuncAttributeMaxDynamicSharedMemorySize,
      GroupFp8Cfg<D, KH, LEAN>::SMEM);
  return e;
}

template <typename T, int D, int KH, int NN, bool CAP, bool SPLIT, bool FUSE, bool LEAN = false>
int launch_group_fp8_variant(const AttnParams& p, cudaStream_t st) {
  using C = GroupFp8Cfg<D, KH, LEAN>;
  if (const cudaError_t e = configure_group_fp8<T, D, KH, NN, CAP, SPLIT, FUSE, LEAN>(); e != cudaSuccess)
    return (int)e;
  dim3 grid;
  if (!decode_grid(p, p.Hkv / KH, grid)) return -1;
  return launch_pdl(group_mma_fp8_decode_kernel<T, D, KH, NN, CAP, SPLIT, FUSE, LEAN>, grid, dim3(C::NT), C::SMEM,
                    st, p);
}

// Two kv heads per CTA where a launch has one partition, up to 8 query heads per kv head, an even number of kv
// heads and no soft-capping (the split-K merge counts one kv head per CTA; two heads of 9-16 would spill: ptxas
// -v; soft-capped models with 4+ query heads per kv head are rare)
template <typename T, int D, int NN, bool CAP, bool FUSE>
int launch_group_fp8_heads(const AttnParams& p, cudaStream_t st) {
  if (p.P > 1) return launch_group_fp8_variant<T, D, 1, NN, CAP, true, FUSE>(p, st);
  if constexpr (NN == 1 && !CAP)
    if (p.Hkv % 2 == 0) {
      if constexpr (D == 128)  // row variant 5 (the default): the lean ring (GroupFp8Cfg)
        if (p.row_variant == 5) return launch_group_fp8_variant<T, D, 2, NN, CAP, false, FUSE, true>(p, st);
      return launch_group_fp8_variant<T, D, 2, NN, CAP, false, FUSE>(p, st);
    }
  return launch_group_fp8_variant<T, D, 1, NN, CAP, false, FUSE>(p, st);
}

template <typename T, int D, int NN>
int launch_group_fp8_nn(const AttnParams& p, cudaStream_t st) {
  if (p.softcap_log2 > 0.f) return p.fuse_rope ? -1 : launch_group_fp8_heads<T, D, NN, true, false>(p, st);
  return p.fuse_rope ? launch_group_fp8_heads<T, D, NN, false, true>(p, st)
                     : launch_group_fp8_heads<T, D, NN, false, false>(p, st);
}

template <typename T, int D>
int launch_group_fp8(const AttnParams& p, cudaStream_t st) {
  return p.G > 8 ? launch_group_fp8_nn<T, D, 2>(p, st) : launch_group_fp8_nn<T, D, 1>(p, st);
}

template <typename T, int D>
int occupancy_group_fp8_t() {  // per kv head (a two-head CTA counts as two), at up to 8 heads per kv head
  if (configure_group_fp8<T, D, 1, 1, false>() != cudaSuccess) return 1;
  int n = 0;
  const cudaError_t e = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, group_mma_fp8_decode_kernel<T, D, 1, 1>,
                                                                      128, GroupFp8Cfg<D, 1>::SMEM);
  return e == cudaSuccess && n > 0 ? n : 1;
}

// The head dims group_mma_applies admits: 64 (16-bit or fp8 cache) and 128 (fp8 cache); -1 (1) for others.
template <typename T, int D>
int launch_group_mma_hd(const AttnParams& p, cudaStream_t st) {
  if constexpr (D == 64 || D == 128)
    if (p.cache_fp8) return launch_group_fp8<T, D>(p, st);
  if (p.fuse_rope) return -1;  // decode_fuses_rope: the fp8 kernel only
  if constexpr (D == 64) return launch_group_mma<T, T, 64>(p, st);
  return -1;
}
template <typename T, int D>
int occupancy_group_mma_hd(int cache_fp8) {
  if constexpr (D == 64 || D == 128)
    if (cache_fp8) return occupancy_group_fp8_t<T, D>();
  if constexpr (D == 64) return occupancy_group_mma_t<T, T, 64>();
  return 1;
}

}  // namespace pagednb
