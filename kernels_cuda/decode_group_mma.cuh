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
// An fp8 cache (KV = Fp8E4M3): the ring holds the fp8 tiles (16 values per cp.async); once a tile has
// landed, each lane converts the chunks it copied itself into a per-warp 16-bit tile of the layout above
// (exact), which ldmatrix then reads as before. Per element that is far fewer instructions than the row
// kernel's G multiply-adds, so with fp8's halved bytes the kernel stays bandwidth-bound where the row
// kernel would not. k_scale is folded into the score scale, v_scale into the output (the merges).
// Included by decode.cuh after the row kernel, whose row_keys, split_entry, merge_warps_and_store and kNegBig it
// shares.
#pragma once

#include <type_traits>

#include "common.cuh"
#include "launchers.h"

namespace pagednb {

template <int D, bool FP8 = false>  // FP8: the ring holds an fp8 cache's tiles, converted into a 16-bit tile
struct GroupMmaCfg {
  static constexpr int NW = 4, NT = 32 * NW;
  static constexpr int BN = 16;                   // tokens per warp tile
  static constexpr int S = 3;                     // ring stages per warp
  static constexpr int LDS = D + 8;               // 16-bit tile row stride (elements)
  static constexpr int TILE = 2 * BN * LDS * 2;   // bytes of a 16-bit K tile and V tile
  static constexpr int RLD = FP8 ? D + 16 : 2 * LDS;  // ring row stride (bytes)
  static constexpr int STAGE = 2 * BN * RLD;      // ring stage bytes: the K tile, then the V tile
  static constexpr int VEC = FP8 ? 16 : 8;        // cache elements per 16-byte chunk
  static constexpr int CPR = D / VEC;             // 16-byte chunks per token row
  static constexpr int CPL = BN * CPR / 32;       // chunks per lane per K (or V) tile
  static constexpr int RING_BYTES = NW * (S * STAGE + (FP8 ? TILE : 0));  // + each warp's converted tile
  static constexpr int MERGE_BYTES = NW * 16 * (D + 2) * 4;
  static constexpr int SMEM = RING_BYTES > MERGE_BYTES ? RING_BYTES : MERGE_BYTES;
  static_assert((BN * CPR) % 32 == 0 && CPL >= 1, "copy shape");
};

// KV: the cache's type; CAP: Gemma 2's soft-capping; SPLIT: P > 1
template <typename T, typename KV, int D, bool CAP = false, bool SPLIT = false>
__global__ void __launch_bounds__(128) group_mma_decode_kernel(const AttnParams p) {
  if constexpr (!SPLIT) PAGEDNB_PDL_ENTER();
  constexpr bool FP8 = std::is_same<KV, Fp8E4M3>::value;
  using C = GroupMmaCfg<D, FP8>;
  constexpr int NW = C::NW, BN = C::BN, S = C::S, LDS = C::LDS, CPR = C::CPR, CPL = C::CPL, VEC = C::VEC;
  extern __shared__ __align__(16) unsigned char dyn_smem[];
  unsigned char* work = dyn_smem;

  const int row = blockIdx.x;
  RowKeys keys;
  if constexpr (SPLIT) {
    if (!split_entry<KV, D, C::NT>(p, blockIdx.y, keys)) return;
  } else {
    if (!row_keys(p, row, keys)) return;
  }
  const int s = keys.seq, t_begin = keys.t_begin, t_end = keys.t_end;

  const int kvh = blockIdx.y;
  const int G = p.G;
  const int h0 = kvh * G;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;

  // this warp's tiles of the partition: j = warp, warp + NW, ...
  const int ntiles = t_end > t_begin ? (t_end - t_begin + BN - 1) / BN : 0;
  const int my_tiles = ntiles > warp ? (ntiles - warp + NW - 1) / NW : 0;
  unsigned char* ring = work + warp * (S * C::STAGE + (FP8 ? C::TILE : 0));
  T* tile16 = reinterpret_cast<T*>(ring + S * C::STAGE);  // fp8: the warp's converted tile
  const int* bt = p.block_tables + (int64_t)s * p.bt_stride;
  const int64_t row_elems = (int64_t)p.Hkv * D;
  const KV* kbase = reinterpret_cast<const KV*>(p.cache) + (int64_t)kvh * D;
  const int bs_mask = (1 << p.bs_log2) - 1;
  auto issue = [&](int i) {  // cp.async of the warp's tile i into stage i % S (an empty group past the end)
    if (i < my_tiles) {
      const int t0 = t_begin + (warp + i * NW) * BN;
      unsigned char* st = ring + (i % S) * C::STAGE;
#pragma unroll
      for (int c = 0; c < CPL; ++c) {
        const int idx = c * 32 + lane;
        const int r = idx / CPR, col = (idx % CPR) * VEC;
        const int t = min(t0 + r, t_end - 1);  // a real token of this partition: never garbage
        const int blk = __ldg(bt + (t >> p.bs_log2));
        const KV* kp = kbase + (((int64_t)blk << p.bs_log2) + (t & bs_mask)) * row_elems + col;
        cp_async16(st + r * C::RLD + col * sizeof(KV), kp, true);
        cp_async16(st + (BN + r) * C::RLD + col * sizeof(KV), kp + p.v_offset, true);
      }
    }
    cp_async_commit();
  };
#pragma unroll
  for (int i = 0; i < S - 1; ++i) issue(i);

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
  const float sl2 = p.scale_log2 * p.k_scale;  // an fp8 cache's key scale folded in (1 otherwise)

  for (int i = 0; i < my_tiles; ++i) {
    __syncwarp();  // every lane is done with the stage that issue() refills (and with the converted tile)
    issue(i + S - 1);
    cp_async_wait<S - 1>();
    const unsigned char* stage = ring + (i % S) * C::STAGE;
    if constexpr (FP8) {  // the chunks this lane copied, 16 fp8 values each, into the 16-bit tile
#pragma unroll
      for (int c = 0; c < CPL; ++c) {
        const int idx = c * 32 + lane;
        const int r = idx / CPR, col = (idx % CPR) * VEC;
#pragma unroll
        for (int kv = 0; kv < 2; ++kv) {
          const uint4 raw = *reinterpret_cast<const uint4*>(stage + (kv * BN + r) * C::RLD + col);
          uint4* dst = reinterpret_cast<uint4*>(tile16 + (kv * BN + r) * LDS + col);
          dst[0] = fp8x8_to<T>(make_uint2(raw.x, raw.y));
          dst[1] = fp8x8_to<T>(make_uint2(raw.z, raw.w));
        }
      }
    }
    __syncwarp();  // tile i's copies (fp8: conversions) by every lane have landed
    const T* sK = FP8 ? tile16 : reinterpret_cast<const T*>(stage);
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

// Allows the kernel its dynamic shared memory (over the 48 KiB default); once per instantiation.
template <typename T, typename KV, int D, bool CAP, bool SPLIT = false>
cudaError_t configure_group_mma() {
  using C = GroupMmaCfg<D, std::is_same<KV, Fp8E4M3>::value>;
  static const cudaError_t e = cudaFuncSetAttribute(group_mma_decode_kernel<T, KV, D, CAP, SPLIT>,
                                                    cudaFuncAttributeMaxDynamicSharedMemorySize, C::SMEM);
  return e;
}

template <typename T, typename KV, int D, bool CAP, bool SPLIT>
int launch_group_mma_variant(const AttnParams& p, cudaStream_t st) {
  using C = GroupMmaCfg<D, std::is_same<KV, Fp8E4M3>::value>;
  if (const cudaError_t e = configure_group_mma<T, KV, D, CAP, SPLIT>(); e != cudaSuccess) return (int)e;
  const dim3 grid(p.num_rows, p.Hkv, p.P);
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
  using C = GroupMmaCfg<D, std::is_same<KV, Fp8E4M3>::value>;
  if (configure_group_mma<T, KV, D, false>() != cudaSuccess) return 1;
  int n = 0;
  const cudaError_t e = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, group_mma_decode_kernel<T, KV, D>, 128,
                                                                      C::SMEM);
  return e == cudaSuccess && n > 0 ? n : 1;
}

// The head dims group_mma_applies admits: 64 (16-bit or fp8 cache) and 128 (fp8 cache).
template <typename T>
int launch_group_mma_dtype(int head_dim, const AttnParams& p, cudaStream_t st) {
  if (p.cache_fp8)
    return head_dim == 64    ? launch_group_mma<T, Fp8E4M3, 64>(p, st)
           : head_dim == 128 ? launch_group_mma<T, Fp8E4M3, 128>(p, st)
                             : -1;
  return head_dim == 64 ? launch_group_mma<T, T, 64>(p, st) : -1;
}
template <typename T>
int occupancy_group_mma_dtype(int head_dim, int cache_fp8) {
  if (cache_fp8)
    return head_dim == 64 ? occupancy_group_mma_t<T, Fp8E4M3, 64>()
           : head_dim == 128 ? occupancy_group_mma_t<T, Fp8E4M3, 128>()
                             : 1;
  return head_dim == 64 ? occupancy_group_mma_t<T, T, 64>() : 1;
}

}  // namespace pagednb
