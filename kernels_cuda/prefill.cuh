// Prefill-chunk attention over the paged cache on tensor cores (mma.sync m16n8k16, bf16/fp16 in,
// fp32 accumulate), FlashAttention-2 style. One CTA per (query head, tile of BM query rows, sequence);
// each warp owns MT x 16 consecutive query rows (head_dim 128: 4 warps x 32 rows, two CTAs per SM, so
// one CTA's softmax overlaps the other's matrix products). K/V tiles of BN tokens are gathered from
// the cache through the block table with cp.async into padded shared memory (row stride D + 8: the
// ldmatrix reads are conflict-free), double-buffered, and read with ldmatrix (V with .trans); each K/V
// fragment serves the warp's MT row blocks. The chunk's queries see every cached token of their
// sequence plus themselves causally (and no further back than the sliding window); masks are applied
// only on tiles that need them, and a warp skips the tiles that none of its rows can see.
// Softmax: scores in log2 units (scale * log2 e folded into one FFMA before ex2.approx); the running
// max is only raised when a tile's max exceeds it by more than 2^8 (the stale max keeps every p under
// 256, exact after the final division), so the O rescale is skipped on almost every tile.
// The output goes through shared memory (the warp's own Q rows) so that global stores are 16 bytes.
// Sequences with query_len == 1 are left to the row (decode) kernel.
// An fp8 cache (KV = Fp8E4M3): the K/V tiles' bytes are cp.async'ed into a ring of two fp8 tiles in shared
// memory (8-byte chunks, the 16-bit path's copy pattern), and at the top of each tile's iteration every thread
// converts the chunks it copied into one 16-bit tile of the layout the cp.async path fills, which the math
// then reads as before; k_scale is folded into the score scale and v_scale into the final normalisation.
// The products are f16 MMAs whatever T is: an e4m3 pair becomes an f16 pair in one exact conversion
// (cvt.rn.f16x2.e4m3x2), where bf16 took four instructions; P in [0, 256) is held in f16 more finely than in
// bf16; and a bf16 query tile is scaled by a power of 2 per warp (its largest magnitude into [2^14, 2^15),
// as the fp8 decode kernel does) before its conversion, the factor folded into the score scale, so no query
// value overflows and none that matters underflows. (Staging the next tile in registers instead, converted
// after the math, held 32 registers through it and spilled: H200, workload-sized prefill steps at 123-129
// TFLOP/s against the ring's 153-162 and a bf16 cache's 164-171; benchmarks/NOTES.md, issue 19 round 12.)
#pragma once

#include <type_traits>

#include "common.cuh"
#include "launchers.h"

namespace pagednb {

// NW warps of MT x 16 rows, BN keys per tile, Q fragments in registers (QREG) or re-read from shared
// memory per tile, MINB CTAs per SM asked of the compiler (register cap).
template <int D, int NW_, int MT_, int BN_, bool QREG_, int MINB_>
struct PfCfg {
  static constexpr int NW = NW_, MT = MT_, BN = BN_, MINB = MINB_;
  static constexpr bool QREG = QREG_;
  static constexpr int WR = 16 * MT;  // rows per warp
  static constexpr int BM = NW * WR;  // rows per CTA
  static constexpr int NT = NW * 32;
  static constexpr int LDS = D + 8;   // smem row stride (elements): +16 B, no ldmatrix conflicts
  static constexpr int SMEM = (BM + 4 * BN) * LDS * 2 + 2 * BN * 4;  // + the row table
};

// 16 bytes global -> shared, always read (cp_async16 in common.cuh zero-fills when invalid)
__device__ __forceinline__ void cp_async16_all(void* dst, const void* src) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(smem_addr(dst)), "l"(src));
}
// 8 bytes global -> shared (an fp8 cache's chunk of 8 values)
__device__ __forceinline__ void cp_async8_all(void* dst, const void* src) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 8;\n" ::"r"(smem_addr(dst)), "l"(src));
}

// Shared memory of a launch: the Q tile, the 16-bit K and V tiles (two of each; one over an fp8 cache, which
// adds its ring of two K/V tiles of bytes), the row table.
template <int D, class C, bool FP8>
constexpr int prefill_smem() {
  return FP8 ? (C::BM + 2 * C::BN) * C::LDS * 2 + 4 * C::BN * D + 2 * C::BN * 4 : C::SMEM;
}

constexpr float kRescaleLog2 = 8.f;  // raise the running max only when it grows by more than 2^8

// A bf16 query tile of rows x D (row stride LDS, elements) in shared memory rewritten in place as f16, scaled
// by 2^-e so that its largest magnitude lies in [2^14, 2^15) (f16_scale_for); by one warp. Returns 2^e.
template <int D, int LDS>
__device__ __forceinline__ float q_tile_to_f16(__nv_bfloat16* tile, int rows) {
  const int lane = threadIdx.x & 31;
  constexpr int CPR = D / 8;  // 16-byte chunks per row
  float mx = 0.f;
  for (int c = lane; c < rows * CPR; c += 32) {
    const uint4 x = *reinterpret_cast<const uint4*>(tile + (c / CPR) * LDS + (c % CPR) * 8);
    mx = fmaxf(mx, fmaxf(bf16x2_absmax(x.x), bf16x2_absmax(x.y)));
    mx = fmaxf(mx, fmaxf(bf16x2_absmax(x.z), bf16x2_absmax(x.w)));
  }
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
  const F16Scale sc = f16_scale_for(mx);
  for (int c = lane; c < rows * CPR; c += 32) {
    uint4* at = reinterpret_cast<uint4*>(tile + (c / CPR) * LDS + (c % CPR) * 8);
    const uint4 x = *at;
    *at = make_uint4(bf16x2_to_f16x2(x.x, sc.down), bf16x2_to_f16x2(x.y, sc.down), bf16x2_to_f16x2(x.z, sc.down),
                     bf16x2_to_f16x2(x.w, sc.down));
  }
  __syncwarp();
  return sc.factor;
}

template <typename T, typename KV, int D, class C>  // KV: the cache's element type (T, or Fp8E4M3)
__global__ void __launch_bounds__(C::NT, C::MINB) prefill_kernel(const AttnParams p) {
  constexpr bool FP8 = std::is_same<KV, Fp8E4M3>::value;
  constexpr int KVBUF = FP8 ? 1 : 2;  // 16-bit K (V) tiles
  using M = typename std::conditional<FP8, __half, T>::type;  // the MMAs' element type (see the top)
  constexpr int BM = C::BM, BN = C::BN, LDS = C::LDS, NT = C::NT, MT = C::MT, WR = C::WR;
  constexpr int OB = D / 8;     // 8-column blocks of the accumulator
  constexpr int CPR = D / 8;    // 16-byte chunks per row
  constexpr int RP = NT / CPR;  // rows copied per pass of the CTA
  static_assert(NT % CPR == 0 && BN % RP == 0 && BM % RP == 0 && BN <= NT, "copy shape");

  const int h = blockIdx.x, s = blockIdx.z;
  const int qs = __ldg(p.qsl + s);
  const int qlen = __ldg(p.qsl + s + 1) - qs;
  if (qlen <= 1) return;
  const int tile = p.max_tiles - 1 - (int)blockIdx.y;  // heaviest tiles launch first
  if (tile * BM >= qlen) return;

  extern __shared__ __align__(16) unsigned char smem_raw[];
  T* sQ = reinterpret_cast<T*>(smem_raw);
  M* sK = reinterpret_cast<M*>(sQ + BM * LDS);
  M* sV = sK + KVBUF * BN * LDS;
  unsigned char* ring = reinterpret_cast<unsigned char*>(sV + KVBUF * BN * LDS);  // fp8: [2][K, V][BN][D] bytes
  uint32_t* rowidx = reinterpret_cast<uint32_t*>(ring + (FP8 ? 4 * BN * D : 0));  // [2][BN] cache rows of K/V tiles

  const int q0 = tile * BM;
  const int rows = min(BM, qlen - q0);
  const int seq_len = __ldg(p.seq_lens + s);
  const int ctx = seq_len - qlen;
  const int pos_first = ctx + q0, pos_last = pos_first + rows - 1;
  const int W = p.window;
  const int kv_lo = W > 0 ? max(0, pos_first - W + 1) : 0;
  const int kv_hi = pos_last + 1;
  const int kt_first = (kv_lo / BN) * BN;
  const int nkv = (kv_hi - kt_first + BN - 1) / BN;
  const int kvh = h / p.G;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int cr = tid / CPR, cc = (tid % CPR) * 8;  // this thread's first copy row and its column

  // Q tile -> smem (rows past the chunk zero-filled)
  {
    const T* qg = reinterpret_cast<const T*>(p.q) + (int64_t)(qs + q0) * p.q_stride_tok +
                  (int64_t)h * p.q_stride_head + cc;
#pragma unroll
    for (int i = 0; i < BM / RP; ++i) {
      const int r = cr + i * RP;
      const bool ok = r < rows;
      cp_async16(sQ + r * LDS + cc, ok ? qg + (int64_t)r * p.q_stride_tok : qg, ok);
    }
    cp_async_commit();
  }

  // K/V rows are gathered through the block table: the cache row of each token of a tile (blk *
  // block_size + offset) is computed once, by one thread per row, two tiles ahead, into a small table
  // in shared memory ordered so that each copying thread reads its BN / RP rows contiguously. Tokens
  // outside [kv_lo, kv_hi) are clamped into it: they are masked (p = 0 exactly) and the row read is a
  // real one of this sequence, so no block outside the needed range is ever touched.
  const int* bt = p.block_tables + (int64_t)s * p.bt_stride;
  const char* cache = reinterpret_cast<const char*>(p.cache) + ((int64_t)kvh * D + cc) * sizeof(KV);
  const uint32_t row_bytes = (uint32_t)p.Hkv * D * sizeof(KV);
  const int64_t v_bytes = p.v_offset * sizeof(KV);
  const int bs_log2 = p.bs_log2, bs_mask = (1 << bs_log2) - 1;
  constexpr int RPT = BN / RP;  // rows each thread copies per tile
  const int prow = tid % BN;    // the row this thread plans (threads tid < BN)
  uint32_t* const plan_slot = rowidx + (prow % RP) * RPT + prow / RP;
  auto plan_blk = [&](int j) {  // block id of this thread's (clamped) token of tile j
    const int t = min(max(kt_first + j * BN + prow, kv_lo), kv_hi - 1);
    return __ldg(bt + (t >> bs_log2));
  };
  auto plan_store = [&](int j, int blk, int buf) {
    const int t = min(max(kt_first + j * BN + prow, kv_lo), kv_hi - 1);
    plan_slot[buf * BN] = ((uint32_t)blk << bs_log2) + (uint32_t)(t & bs_mask);
  };
  unsigned char* const ring_k = ring + cr * D + cc, * const ring_v = ring_k + BN * D;  // this thread's fp8 chunks
  auto load_kv = [&](int buf) {  // cp.async into tile buf: the 16-bit tile, or the fp8 ring's
    M* dk = sK + buf * BN * LDS + cc;
    M* dv = sV + buf * BN * LDS + cc;
    uint32_t ri[RPT];
    const uint32_t* ro = rowidx + buf * BN + cr * RPT;
    if constexpr (RPT % 4 == 0) {
#pragma unroll
      for (int i = 0; i < RPT; i += 4) *reinterpret_cast<uint4*>(ri + i) = *reinterpret_cast<const uint4*>(ro + i);
    } else {
#pragma unroll
      for (int i = 0; i < RPT; ++i) ri[i] = ro[i];
    }
#pragma unroll
    for (int i = 0; i < RPT; ++i) {
      const char* src = cache + (uint64_t)ri[i] * row_bytes;
      if constexpr (FP8) {
        cp_async8_all(ring_k + buf * 2 * BN * D + i * RP * D, src);
        cp_async8_all(ring_v + buf * 2 * BN * D + i * RP * D, src + v_bytes);
      } else {
        cp_async16_all(dk + (cr + i * RP) * LDS, src);
        cp_async16_all(dv + (cr + i * RP) * LDS, src + v_bytes);
      }
    }
  };
  auto convert_fp8 = [&](int buf) {  // fp8: this thread's chunks of ring tile buf, as f16, into the 16-bit tile
    if constexpr (FP8) {
#pragma unroll
      for (int i = 0; i < RPT; ++i) {
        const uint2 k8 = *reinterpret_cast<const uint2*>(ring_k + buf * 2 * BN * D + i * RP * D);
        const uint2 v8 = *reinterpret_cast<const uint2*>(ring_v + buf * 2 * BN * D + i * RP * D);
        *reinterpret_cast<uint4*>(sK + cc + (cr + i * RP) * LDS) = fp8x8_to<M>(k8);
        *reinterpret_cast<uint4*>(sV + cc + (cr + i * RP) * LDS) = fp8x8_to<M>(v8);
      }
    }
  };
  if (tid < BN) {
    const int b0 = plan_blk(0), b1 = nkv > 1 ? plan_blk(1) : -1;
    plan_store(0, b0, 0);
    if (nkv > 1) plan_store(1, b1, 1);
  }
  __syncthreads();
  load_kv(0);
  cp_async_commit();

  const int wr0 = warp * WR;                     // the warp's first row in the tile
  const int wrows = min(WR, rows - wr0);         // its rows inside the chunk (may be <= 0)
  const int wpos_first = pos_first + wr0, wpos_last = wpos_first + wrows - 1;
  const int a_row = (lane & 7) + 8 * ((lane >> 3) & 1), a_col = 8 * (lane >> 4);  // A (Q) ldmatrix
  const int k_row = (lane & 7) + 8 * (lane >> 4), k_col = 8 * ((lane >> 3) & 1);  // K ldmatrix
  const int v_row = (lane & 7) + 8 * ((lane >> 3) & 1), v_col = 8 * (lane >> 4);  // V ldmatrix.trans
  const M* sQw = reinterpret_cast<const M*>(sQ) + (wr0 + a_row) * LDS + a_col;

  uint32_t qfrag[C::QREG ? MT : 1][C::QREG ? D / 16 : 1][4];
  cp_async_wait<1>();
  __syncthreads();
  float q_factor = 1.f;  // the scores' factor that undoes a bf16 query's scaling (an fp8 cache)
  if constexpr (FP8 && std::is_same<T, __nv_bfloat16>::value) q_factor = q_tile_to_f16<D, LDS>(sQ + wr0 * LDS, WR);
  if constexpr (C::QREG) {
#pragma unroll
    for (int mi = 0; mi < MT; ++mi)
#pragma unroll
      for (int kc = 0; kc < D / 16; ++kc) ldmatrix_x4(qfrag[mi][kc], sQw + mi * 16 * LDS + kc * 16);
  }

  float o[MT][OB][4];
#pragma unroll
  for (int mi = 0; mi < MT; ++mi)
#pragma unroll
    for (int i = 0; i < OB; ++i) o[mi][i][0] = o[mi][i][1] = o[mi][i][2] = o[mi][i][3] = 0.f;
  float m[MT][2], l[MT][2];
#pragma unroll
  for (int mi = 0; mi < MT; ++mi) m[mi][0] = m[mi][1] = -INFINITY, l[mi][0] = l[mi][1] = 0.f;
  const float sl2 = p.scale_log2 * p.k_scale * q_factor;  // an fp8 cache's key and query scales folded in
  const float cap = p.softcap_log2 / sl2;  // the soft-cap in the units of the raw scores (q . k)

  for (int j = 0; j < nkv; ++j) {
    if (j + 1 < nkv) load_kv((j + 1) & 1);
    cp_async_commit();
    cp_async_wait<1>();
    convert_fp8(j & 1);  // the thread's own copies, complete for it after the wait; the tile is free (see below)
    __syncthreads();
    // block id for tile j + 2 now; its offset goes into the table (the slot tile j used) after the math
    const bool plan = tid < BN && j + 2 < nkv;
    const int pblk = plan ? plan_blk(j + 2) : -1;
    const int kt0 = kt_first + j * BN;
    // warp-uniform: does any of this warp's rows see any key of the tile?
    const bool active = wrows > 0 && kt0 <= wpos_last && (W <= 0 || kt0 + BN - 1 >= wpos_first - W + 1);
    if (active) {
      const M* kS = sK + (FP8 ? 0 : (j & 1) * BN * LDS);
      const M* vS = sV + (FP8 ? 0 : (j & 1) * BN * LDS);

      float sc[MT][BN / 8][4];
#pragma unroll
      for (int mi = 0; mi < MT; ++mi)
#pragma unroll
        for (int i = 0; i < BN / 8; ++i) sc[mi][i][0] = sc[mi][i][1] = sc[mi][i][2] = sc[mi][i][3] = 0.f;
#pragma unroll
      for (int kc = 0; kc < D / 16; ++kc) {
        uint32_t a[MT][4];
#pragma unroll
        for (int mi = 0; mi < MT; ++mi) {
          if constexpr (C::QREG) {
#pragma unroll
            for (int e = 0; e < 4; ++e) a[mi][e] = qfrag[mi][kc][e];
          } else {
            ldmatrix_x4(a[mi], sQw + mi * 16 * LDS + kc * 16);
          }
        }
#pragma unroll
        for (int nt2 = 0; nt2 < BN / 16; ++nt2) {
          uint32_t b[4];
          ldmatrix_x4(b, kS + (nt2 * 16 + k_row) * LDS + kc * 16 + k_col);
#pragma unroll
          for (int mi = 0; mi < MT; ++mi) {
            mma16816<M>(sc[mi][2 * nt2], a[mi], b[0], b[1]);
            mma16816<M>(sc[mi][2 * nt2 + 1], a[mi], b[2], b[3]);
          }
        }
      }

      if (cap > 0.f) {
#pragma unroll
        for (int mi = 0; mi < MT; ++mi)
#pragma unroll
          for (int nt = 0; nt < BN / 8; ++nt)
#pragma unroll
            for (int e = 0; e < 4; ++e) sc[mi][nt][e] = soft_cap(sc[mi][nt][e], cap);
      }
      const bool need_mask = (kt0 + BN - 1 > wpos_first) || (W > 0 && kt0 < wpos_last - W + 1);
      if (need_mask) {
#pragma unroll
        for (int mi = 0; mi < MT; ++mi)
#pragma unroll
          for (int nt = 0; nt < BN / 8; ++nt)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
              const int qpos = wpos_first + mi * 16 + (lane >> 2) + 8 * (e >> 1);
              const int t = kt0 + nt * 8 + 2 * (lane & 3) + (e & 1);
              const bool ok = t <= qpos && (W <= 0 || qpos - t < W);
              if (!ok) sc[mi][nt][e] = -INFINITY;
            }
      }

      // online softmax; rows r (e = 0, 1) and r + 8 (e = 2, 3) of each 16-row block; a quad of lanes
      // shares a row
      float alpha[MT][2];
      bool grew = false;
#pragma unroll
      for (int mi = 0; mi < MT; ++mi)
#pragma unroll
        for (int rh = 0; rh < 2; ++rh) {
          float mx = -INFINITY;
#pragma unroll
          for (int nt = 0; nt < BN / 8; ++nt) mx = fmaxf(mx, fmaxf(sc[mi][nt][2 * rh], sc[mi][nt][2 * rh + 1]));
          mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
          mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
          const float mold = m[mi][rh];
          const float mxs = mx * sl2;
          const float mnew = mxs > mold + kRescaleLog2 ? mxs : mold;
          const float muse = mnew == -INFINITY ? 0.f : mnew;  // a row with nothing visible yet
          alpha[mi][rh] = mnew == mold ? 1.f : fast_exp2(mold - muse);
          grew |= mnew != mold;
          m[mi][rh] = mnew;
          float rs = 0.f;
#pragma unroll
          for (int nt = 0; nt < BN / 8; ++nt) {
            sc[mi][nt][2 * rh] = fast_exp2(fmaf(sc[mi][nt][2 * rh], sl2, -muse));
            sc[mi][nt][2 * rh + 1] = fast_exp2(fmaf(sc[mi][nt][2 * rh + 1], sl2, -muse));
            rs += sc[mi][nt][2 * rh] + sc[mi][nt][2 * rh + 1];
          }
          l[mi][rh] = l[mi][rh] * alpha[mi][rh] + rs;
        }
      if (__any_sync(0xffffffffu, grew)) {
#pragma unroll
        for (int mi = 0; mi < MT; ++mi)
#pragma unroll
          for (int dt = 0; dt < OB; ++dt) {
            o[mi][dt][0] *= alpha[mi][0]; o[mi][dt][1] *= alpha[mi][0];
            o[mi][dt][2] *= alpha[mi][1]; o[mi][dt][3] *= alpha[mi][1];
          }
      }

      // O += P V
#pragma unroll
      for (int kc = 0; kc < BN / 16; ++kc) {
        uint32_t a[MT][4];
#pragma unroll
        for (int mi = 0; mi < MT; ++mi) {
          a[mi][0] = pack2<M>(sc[mi][2 * kc][0], sc[mi][2 * kc][1]);
          a[mi][1] = pack2<M>(sc[mi][2 * kc][2], sc[mi][2 * kc][3]);
          a[mi][2] = pack2<M>(sc[mi][2 * kc + 1][0], sc[mi][2 * kc + 1][1]);
          a[mi][3] = pack2<M>(sc[mi][2 * kc + 1][2], sc[mi][2 * kc + 1][3]);
        }
#pragma unroll
        for (int dt2 = 0; dt2 < D / 16; ++dt2) {
          uint32_t b[4];
          ldmatrix_x4_trans(b, vS + (kc * 16 + v_row) * LDS + dt2 * 16 + v_col);
#pragma unroll
          for (int mi = 0; mi < MT; ++mi) {
            mma16816<M>(o[mi][2 * dt2], a[mi], b[0], b[1]);
            mma16816<M>(o[mi][2 * dt2 + 1], a[mi], b[2], b[3]);
          }
        }
      }
    }
    if (plan) plan_store(j + 2, pblk, j & 1);
    __syncthreads();  // the next iteration's loads (conversion) overwrite this tile and read the new row table
  }

  // normalise into the warp's own Q rows of shared memory (nothing reads them any more), then store
  // 16 bytes per lane
  if (wrows > 0) {
    T* sO = sQ + wr0 * LDS;
#pragma unroll
    for (int mi = 0; mi < MT; ++mi)
#pragma unroll
      for (int rh = 0; rh < 2; ++rh) {
        float lt = l[mi][rh];
        lt += __shfl_xor_sync(0xffffffffu, lt, 1);
        lt += __shfl_xor_sync(0xffffffffu, lt, 2);
        const float inv = p.v_scale / lt;
        T* orow = sO + (mi * 16 + (lane >> 2) + 8 * rh) * LDS + 2 * (lane & 3);
#pragma unroll
        for (int dt = 0; dt < D / 8; ++dt)
          *reinterpret_cast<uint32_t*>(orow + dt * 8) = pack2<T>(o[mi][dt][2 * rh] * inv, o[mi][dt][2 * rh + 1] * inv);
      }
    __syncwarp();
    T* og = reinterpret_cast<T*>(p.out) + ((int64_t)(qs + q0 + wr0) * p.H + h) * D;
    const int64_t ostride = (int64_t)p.H * D;
#pragma unroll
    for (int c = lane; c < WR * CPR; c += 32) {
      const int r = c / CPR, ch = (c % CPR) * 8;
      if (r < wrows)
        *reinterpret_cast<uint4*>(og + r * ostride + ch) = *reinterpret_cast<const uint4*>(sO + r * LDS + ch);
    }
  }
}

template <typename T, typename KV, int D, class C>
int configure_prefill() {
  constexpr int smem = prefill_smem<D, C, std::is_same<KV, Fp8E4M3>::value>();
  static int state = -1;  // raise the dynamic shared-memory limit once per process
  if (state < 0) {
    cudaError_t e = cudaFuncSetAttribute(prefill_kernel<T, KV, D, C>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
    if (e == cudaSuccess && C::MINB > 1)  // room for MINB CTAs: all of the unified L1 as shared memory
      e = cudaFuncSetAttribute(prefill_kernel<T, KV, D, C>, cudaFuncAttributePreferredSharedMemoryCarveout,
                               (int)cudaSharedmemCarveoutMaxShared);
    state = (int)e;
  }
  return state;
}

template <typename T, typename KV, int D, class C>
int launch_prefill_cfg(const AttnParams& p, cudaStream_t st) {
  if (int e = configure_prefill<T, KV, D, C>()) return e;
  AttnParams q = p;
  q.max_tiles = (p.max_query_len + C::BM - 1) / C::BM;
  if (q.max_tiles <= 0) return 0;
  const dim3 grid(p.H, q.max_tiles, p.num_seqs);
  prefill_kernel<T, KV, D, C><<<grid, C::NT, prefill_smem<D, C, std::is_same<KV, Fp8E4M3>::value>(), st>>>(q);
  return (int)cudaGetLastError();
}

template <int D_, class C_>
struct PfPick {
  static constexpr int D = D_;
  using Cfg = C_;
};

// The configuration per head_dim. Variants measured and dropped are in benchmarks/NOTES.md.
template <typename F>
int with_prefill_cfg(int head_dim, F&& f) {
  switch (head_dim) {
    case 16: return f(PfPick<16, PfCfg<16, 4, 2, 64, true, 2>>{});
    case 32: return f(PfPick<32, PfCfg<32, 4, 2, 64, true, 2>>{});
    case 64: return f(PfPick<64, PfCfg<64, 4, 2, 64, true, 2>>{});
    case 128:
      return f(PfPick<128, PfCfg<128, 4, 2, 64, false, 2>>{});  // 4 warps x 32 rows, 2 CTAs/SM
    case 256: return f(PfPick<256, PfCfg<256, 4, 1, 32, false, 1>>{});
    default: return -1;
  }
}

template <typename T>
int launch_prefill_dtype(int head_dim, const AttnParams& p, cudaStream_t st) {
  return with_prefill_cfg(head_dim, [&](auto pick) {
    using P = decltype(pick);
    return p.cache_fp8 ? launch_prefill_cfg<T, Fp8E4M3, P::D, typename P::Cfg>(p, st)
                       : launch_prefill_cfg<T, T, P::D, typename P::Cfg>(p, st);
  });
}

// Resident CTAs per SM of the configuration a launch would use (benchmarks report it); <= 0: error.
template <typename T>
int occupancy_prefill_dtype(int head_dim) {
  return with_prefill_cfg(head_dim, [&](auto pick) {
    using P = decltype(pick);
    using C = typename P::Cfg;
    if (configure_prefill<T, T, P::D, C>() != 0) return -1;
    int n = 0;
    if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, prefill_kernel<T, T, P::D, C>, C::NT, C::SMEM) != cudaSuccess)
      return -1;
    return n;
  });
}

}  // namespace pagednb
