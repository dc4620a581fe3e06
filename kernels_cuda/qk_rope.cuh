// The per-head q/k RMSNorm and rotary embedding of one head row, shared by the launch that does it on its own
// (fused_ops.cu's qk_norm_rope_kernel) and the decode kernel that does it in its prologue (decode.cuh,
// FusedRope), so the two give the same bits.
//
// A head row is spread over a group of LANES lanes (lane l holds elements [l E, (l + 1) E)); the rotate-half
// partner of element j (j -/+ D/2) sits in lane l ^ (LANES/2) at the same offset, one shuffle away. Per element,
// as torch computes it:
//   (norm)  x = round(w * round(x * rsqrt(mean(x^2) + eps))), or round(x * rsqrt(...) * (w + offset))
//           with the weight in float32 (NormWeight: Gemma 3's (1 + w))
//   (rope)  out = round(round(x * cos) + round(rot * sin)),  rot = -x[j + D/2] (j < D/2) or x[j - D/2]
// Products and sums are __fmul_rn / __fadd_rn (never contracted into an FMA); only the float32 sum of squares
// is added in another order than torch's.
#pragma once

#include "common.cuh"
#include "launchers.h"

namespace pagednb {

template <typename T, int D>
struct QkCfg {
  static constexpr int VEC = Elem<T>::kVec;
  static constexpr int LANES = (D / VEC) < 32 ? (D / VEC) : 32;
  static constexpr int E = D / LANES;  // elements per lane
  static constexpr int NV = E / VEC;   // 16-byte vectors per lane
  static constexpr int THREADS = 128;
  static constexpr int ITEMS = THREADS / LANES;  // (token, head) items per CTA
  static_assert(LANES >= 2 && E % VEC == 0, "head_dim");
};

// kVec floats -> one 16-byte vector of T (rounded to nearest even)
template <typename T> __device__ __forceinline__ uint4 pack16(const float* f) {
  if constexpr (std::is_same<T, float>::value) {
    return make_uint4(__float_as_uint(f[0]), __float_as_uint(f[1]), __float_as_uint(f[2]), __float_as_uint(f[3]));
  } else {
    return make_uint4(pack2<T>(f[0], f[1]), pack2<T>(f[2], f[3]), pack2<T>(f[4], f[5]), pack2<T>(f[6], f[7]));
  }
}

// The norm (where norm) and the rotary embedding of the lane's E elements x of one head row, in place: on return x
// holds the rotated values before their final rounding (the caller's pack16 or round_to rounds them). w, c, s: the
// lane's elements of the norm weight and of the token's cos and sin. rotated false (a V row, or no row): x is left
// as it is, but the lane still takes part in the shuffles, as every lane of the warp must.
template <typename T, int LANES, int E>
__device__ __forceinline__ void qk_norm_rope_lanes(float (&x)[E], const float* w, const float* c, const float* s,
                                                   bool norm, bool rotated, int lane, float eps, NormWeight style) {
  if (norm) {
    float ss = 0.f;
#pragma unroll
    for (int e = 0; e < E; ++e) ss = __fadd_rn(ss, __fmul_rn(x[e], x[e]));
#pragma unroll
    for (int o = LANES / 2; o > 0; o >>= 1) ss = __fadd_rn(ss, __shfl_xor_sync(0xffffffffu, ss, o));
    const float scale = rsqrtf(__fadd_rn(__fmul_rn(ss, 1.0f / (LANES * E)), eps));  // D: a power of two, 1/D exact
    if (rotated) {
#pragma unroll
      for (int e = 0; e < E; ++e)
        x[e] = round_to<T>(style.in_float32 ? __fmul_rn(__fmul_rn(x[e], scale), __fadd_rn(w[e], style.offset))
                                            : __fmul_rn(w[e], round_to<T>(__fmul_rn(x[e], scale))));
    }
  }
  float rot[E];
  const bool low_half = lane < LANES / 2;
#pragma unroll
  for (int e = 0; e < E; ++e) {
    const float other = __shfl_xor_sync(0xffffffffu, x[e], LANES / 2);
    rot[e] = low_half ? -other : other;
  }
  if (rotated) {
#pragma unroll
    for (int e = 0; e < E; ++e)
      x[e] = __fadd_rn(round_to<T>(__fmul_rn(x[e], c[e])), round_to<T>(__fmul_rn(rot[e], s[e])));
  }
}

}  // namespace pagednb
