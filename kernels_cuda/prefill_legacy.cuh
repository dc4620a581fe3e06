// The first tensor-core prefill kernel, kept for comparison (variant 10 of the head_dim-128 bf16
// dispatch in prefill.cuh, 128-row tiles; benchmarks only): mma.sync m16n8k16, one warp per 16 query
// rows, Q fragments in registers, K/V tiles double-buffered by cp.async into padded shared memory; one
// CTA per (query head, tile of BM rows, sequence). 222 TFLOP/s on the 2048-over-2048 benchmark.
#pragma once

#include "common.cuh"
#include "launchers.h"

namespace pagednb {

template <int D, int BM_>
struct LegacyCfg {
  static constexpr int BM = BM_;                  // query rows per CTA (128, or 64 for D = 256)
  static constexpr int BN = D <= 128 ? 64 : 32;   // keys per tile
  static constexpr int NW = BM / 16;
  static constexpr int NT = NW * 32;
  static constexpr int LDS = D + 8;               // smem row stride (elements): +16 B, no ldmatrix conflicts
  static constexpr bool QREG = D <= 128;          // Q fragments live in registers
  static constexpr int SMEM = (BM + 4 * BN) * LDS * 2;
};

template <typename T, int D, int BM_>
__global__ void __launch_bounds__(LegacyCfg<D, BM_>::NT, 1) prefill_legacy_kernel(const AttnParams p) {
  using C = LegacyCfg<D, BM_>;
  constexpr int BM = C::BM, BN = C::BN, LDS = C::LDS, NT = C::NT;
  constexpr int CPR = D / 8;  // 16-byte chunks per row

  const int h = blockIdx.x, s = blockIdx.z;
  const int qs = __ldg(p.qsl + s);
  const int qlen = __ldg(p.qsl + s + 1) - qs;
  if (qlen <= 1) return;
  const int tile = p.max_tiles - 1 - (int)blockIdx.y;  // heaviest tiles launch first
  if (tile * BM >= qlen) return;

  extern __shared__ __align__(16) unsigned char smem_raw[];
  T* sQ = reinterpret_cast<T*>(smem_raw);
  T* sK = sQ + BM * LDS;
  T* sV = sK + 2 * BN * LDS;

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

  // Q tile -> smem (rows past the chunk zero-filled)
  {
    const T* qg = reinterpret_cast<const T*>(p.q) + (int64_t)(qs + q0) * p.q_stride_tok +
                  (int64_t)h * p.q_stride_head;
    for (int c = tid; c < BM * CPR; c += NT) {
      const int r = c / CPR, cc = c % CPR;
      const bool ok = r < rows;
      const T* src = ok ? qg + (int64_t)r * p.q_stride_tok + cc * 8 : qg;
      cp_async16(sQ + r * LDS + cc * 8, src, ok);
    }
    cp_async_commit();
  }

  const int* bt = p.block_tables + (int64_t)s * p.bt_stride;
  const T* cache = reinterpret_cast<const T*>(p.cache);
  const int64_t row_elems = (int64_t)p.Hkv * D;
  const int bs_mask = (1 << p.bs_log2) - 1;
  auto load_kv = [&](int j, int buf) {
    const int kt0 = kt_first + j * BN;
    T* dk = sK + buf * BN * LDS;
    T* dv = sV + buf * BN * LDS;
    for (int c = tid; c < BN * CPR; c += NT) {
      const int r = c / CPR, cc = c % CPR;
      const int t = kt0 + r;
      const bool ok = t >= kv_lo && t < kv_hi;  // never touch blocks outside the needed range
      const T* src = cache;
      if (ok) {
        const int blk = __ldg(bt + (t >> p.bs_log2));
        src = cache + (((int64_t)blk << p.bs_log2) + (t & bs_mask)) * row_elems + (int64_t)kvh * D + cc * 8;
      }
      cp_async16(dk + r * LDS + cc * 8, src, ok);
      cp_async16(dv + r * LDS + cc * 8, ok ? src + p.v_offset : src, ok);
    }
  };
  load_kv(0, 0);
  cp_async_commit();

  // Q fragments (A operand): rows warp*16.., ldmatrix lane address
  const int a_row = warp * 16 + (lane & 7) + 8 * ((lane >> 3) & 1);
  const int a_col = 8 * (lane >> 4);
  uint32_t qfrag[C::QREG ? D / 16 : 1][4];
  cp_async_wait<1>();
  __syncthreads();
  if constexpr (C::QREG) {
#pragma unroll
    for (int kc = 0; kc < D / 16; ++kc) ldmatrix_x4(qfrag[kc], sQ + a_row * LDS + kc * 16 + a_col);
  }

  float o[D / 8][4];
#pragma unroll
  for (int i = 0; i < D / 8; ++i) o[i][0] = o[i][1] = o[i][2] = o[i][3] = 0.f;
  float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.f, 0.f};
  const int r_lo = warp * 16 + (lane >> 2);  // this thread's rows: r_lo and r_lo + 8
  const int k_row = (lane & 7) + 8 * (lane >> 4), k_col = 8 * ((lane >> 3) & 1);   // K ldmatrix
  const int v_row = (lane & 7) + 8 * ((lane >> 3) & 1), v_col = 8 * (lane >> 4);   // V ldmatrix.trans

  for (int j = 0; j < nkv; ++j) {
    if (j + 1 < nkv) load_kv(j + 1, (j + 1) & 1);
    cp_async_commit();
    cp_async_wait<1>();
    __syncthreads();
    const T* kS = sK + (j & 1) * BN * LDS;
    const T* vS = sV + (j & 1) * BN * LDS;

    float sacc[BN / 8][4];
#pragma unroll
    for (int i = 0; i < BN / 8; ++i) sacc[i][0] = sacc[i][1] = sacc[i][2] = sacc[i][3] = 0.f;
#pragma unroll
    for (int kc = 0; kc < D / 16; ++kc) {
      uint32_t a[4];
      if constexpr (C::QREG) {
        a[0] = qfrag[kc][0]; a[1] = qfrag[kc][1]; a[2] = qfrag[kc][2]; a[3] = qfrag[kc][3];
      } else {
        ldmatrix_x4(a, sQ + a_row * LDS + kc * 16 + a_col);
      }
#pragma unroll
      for (int nt2 = 0; nt2 < BN / 16; ++nt2) {
        uint32_t b[4];
        ldmatrix_x4(b, kS + (nt2 * 16 + k_row) * LDS + kc * 16 + k_col);
        mma16816<T>(sacc[2 * nt2], a, b[0], b[1]);
        mma16816<T>(sacc[2 * nt2 + 1], a, b[2], b[3]);
      }
    }

    const int kt0 = kt_first + j * BN;
    const bool need_mask = (kt0 + BN - 1 > pos_first) || (W > 0 && kt0 < pos_last - W + 1);
    if (need_mask) {
#pragma unroll
      for (int nt = 0; nt < BN / 8; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int qpos = pos_first + r_lo + 8 * (e >> 1);
          const int t = kt0 + nt * 8 + 2 * (lane & 3) + (e & 1);
          const bool ok = t <= qpos && (W <= 0 || qpos - t < W);
          sacc[nt][e] = ok ? sacc[nt][e] * p.scale_log2 : -INFINITY;
        }
    } else {
#pragma unroll
      for (int nt = 0; nt < BN / 8; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) sacc[nt][e] *= p.scale_log2;
    }

    // online softmax, rows r_lo (e = 0, 1) and r_lo + 8 (e = 2, 3); a quad of lanes shares a row
#pragma unroll
    for (int rh = 0; rh < 2; ++rh) {
      float mx = -INFINITY;
#pragma unroll
      for (int nt = 0; nt < BN / 8; ++nt) mx = fmaxf(mx, fmaxf(sacc[nt][2 * rh], sacc[nt][2 * rh + 1]));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
      const float mnew = fmaxf(m[rh], mx);
      const float muse = mnew == -INFINITY ? 0.f : mnew;  // a row with nothing visible yet
      const float alpha = fast_exp2(m[rh] - muse);
      float rs = 0.f;
#pragma unroll
      for (int nt = 0; nt < BN / 8; ++nt) {
        sacc[nt][2 * rh] = fast_exp2(sacc[nt][2 * rh] - muse);
        sacc[nt][2 * rh + 1] = fast_exp2(sacc[nt][2 * rh + 1] - muse);
        rs += sacc[nt][2 * rh] + sacc[nt][2 * rh + 1];
      }
      l[rh] = l[rh] * alpha + rs;
      m[rh] = mnew;
#pragma unroll
      for (int dt = 0; dt < D / 8; ++dt) { o[dt][2 * rh] *= alpha; o[dt][2 * rh + 1] *= alpha; }
    }

    // O += P V
#pragma unroll
    for (int kc = 0; kc < BN / 16; ++kc) {
      uint32_t a[4];
      a[0] = pack2<T>(sacc[2 * kc][0], sacc[2 * kc][1]);
      a[1] = pack2<T>(sacc[2 * kc][2], sacc[2 * kc][3]);
      a[2] = pack2<T>(sacc[2 * kc + 1][0], sacc[2 * kc + 1][1]);
      a[3] = pack2<T>(sacc[2 * kc + 1][2], sacc[2 * kc + 1][3]);
#pragma unroll
      for (int dt2 = 0; dt2 < D / 16; ++dt2) {
        uint32_t b[4];
        ldmatrix_x4_trans(b, vS + (kc * 16 + v_row) * LDS + dt2 * 16 + v_col);
        mma16816<T>(o[2 * dt2], a, b[0], b[1]);
        mma16816<T>(o[2 * dt2 + 1], a, b[2], b[3]);
      }
    }
    __syncthreads();  // the next iteration's loads overwrite this buffer
  }

  // normalise and store (two adjacent dims per 32-bit store)
#pragma unroll
  for (int rh = 0; rh < 2; ++rh) {
    float lt = l[rh];
    lt += __shfl_xor_sync(0xffffffffu, lt, 1);
    lt += __shfl_xor_sync(0xffffffffu, lt, 2);
    const float inv = 1.f / lt;
    const int r = r_lo + 8 * rh;
    if (r < rows) {
      T* orow = reinterpret_cast<T*>(p.out) + ((int64_t)(qs + q0 + r) * p.H + h) * D + 2 * (lane & 3);
#pragma unroll
      for (int dt = 0; dt < D / 8; ++dt)
        *reinterpret_cast<uint32_t*>(orow + dt * 8) = pack2<T>(o[dt][2 * rh] * inv, o[dt][2 * rh + 1] * inv);
    }
  }
}

template <typename T, int D, int BM>
int launch_prefill_legacy(const AttnParams& p, cudaStream_t st) {
  using C = LegacyCfg<D, BM>;
  static bool configured = false;  // raise the dynamic shared-memory limit once per process
  if (!configured) {
    cudaError_t e = cudaFuncSetAttribute(prefill_legacy_kernel<T, D, BM>, cudaFuncAttributeMaxDynamicSharedMemorySize, C::SMEM);
    if (e != cudaSuccess) return (int)e;
    configured = true;
  }
  AttnParams q = p;
  q.max_tiles = (p.max_query_len + C::BM - 1) / C::BM;
  if (q.max_tiles <= 0) return 0;
  const dim3 grid(p.H, q.max_tiles, p.num_seqs);
  prefill_legacy_kernel<T, D, BM><<<grid, C::NT, C::SMEM, st>>>(q);
  return (int)cudaGetLastError();
}

}  // namespace pagednb
