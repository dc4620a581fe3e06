// Fused elementwise ops of the decoder layers, one launch each where torch runs a chain of small
// kernels: RMSNorm with the residual add, Qwen3's per-head q/k RMSNorm with the rotary embedding (in
// place on the fused qkv output), and SiLU(gate) * up or GELU-tanh(gate) * up.
//
// Numerics: each op keeps the rounding points of the torch code it replaces (the references in
// pagednb/model/fused_ops.py, HF transformers' numerics), so greedy outputs stay token-for-token
// HF's. Every elementwise torch op computes in float32 and rounds to the model dtype; here each such
// result goes through round_to<T>, and products and sums use __fmul_rn / __fadd_rn so the compiler
// cannot contract them into an FMA (which rounds once where torch rounds twice). The one difference
// left is the order in which a norm's float32 sum of squares is added up; torch's CUDA mean then
// multiplies the sum by float(1 / n), and so does this file.
//
// Rows are read and written with 16-byte vectors; the Python side checks alignment (and falls back
// to torch when a tensor is not aligned). Every kernel here reads only what the kernel before it wrote, so
// each starts with PAGEDNB_PDL_ENTER() and is launched with launch_pdl (common.cuh).
#include <type_traits>

#include "common.cuh"
#include "launchers.h"
#include "qk_rope.cuh"

namespace pagednb {

namespace {

__device__ __forceinline__ float mul(float a, float b) { return __fmul_rn(a, b); }
__device__ __forceinline__ float add(float a, float b) { return __fadd_rn(a, b); }

template <typename T> __device__ __forceinline__ void load_vec(const T* p, float* f) {  // may alias a store
  Elem<T>::unpack(*reinterpret_cast<const uint4*>(p), f);
}
template <typename T> __device__ __forceinline__ void ldg_vec(const T* p, float* f) {  // read-only data
  Elem<T>::unpack(ldg16(p), f);
}
template <typename T> __device__ __forceinline__ void store_vec(T* p, const float* f) {
  *reinterpret_cast<uint4*>(p) = pack16<T>(f);
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = add(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

// Sum over the CTA (blockDim.x a multiple of 32); every thread gets the same value.
__device__ __forceinline__ float block_sum(float v) {
  __shared__ float partial[32];
  v = warp_sum(v);
  const int warps = blockDim.x >> 5;
  if (warps == 1) return v;
  if ((threadIdx.x & 31) == 0) partial[threadIdx.x >> 5] = v;
  __syncthreads();
  v = (threadIdx.x & 31) < warps ? partial[threadIdx.x & 31] : 0.f;
  return warp_sum(v);  // each warp adds the partials itself: no second barrier
}

// ---- RMSNorm (+ residual) ---------------------------------------------------------------------------
// One CTA per row; thread t owns the vectors t, t + blockDim, ... (ITERS of them, kept in registers
// between the sum of squares and the output). With a residual: s = round(x + residual) is written to
// residual_out and normalised; out = round(w * round(s * rsqrt(mean(s^2) + eps))), or with the weight in
// float32 (NormWeight) round(s * rsqrt(mean(s^2) + eps) * (w + offset)).
template <typename T, int ITERS, bool RESIDUAL, typename Trigger>
__global__ void __launch_bounds__(kNormMaxThreads)
    rms_norm_kernel(T* __restrict__ out, T* __restrict__ residual_out, const T* __restrict__ x, int64_t x_stride,
                    const T* __restrict__ residual, int64_t residual_stride, const T* __restrict__ weight,
                    int hidden, float eps, float inv_n, NormWeight style) {
  pdl_enter<Trigger>();
  constexpr int VEC = Elem<T>::kVec;
  const int64_t row = blockIdx.x;
  const int nvec = hidden / VEC;
  const T* xr = x + row * x_stride;
  float v[ITERS][VEC];
  float ss = 0.f;
#pragma unroll
  for (int it = 0; it < ITERS; ++it) {
    const int i = threadIdx.x + it * blockDim.x;
    if (i < nvec) {
      ldg_vec(xr + i * VEC, v[it]);
      if constexpr (RESIDUAL) {
        float r[VEC];
        ldg_vec(residual + row * residual_stride + i * VEC, r);
#pragma unroll
        for (int e = 0; e < VEC; ++e) v[it][e] = round_to<T>(add(v[it][e], r[e]));
        store_vec(residual_out + row * hidden + i * VEC, v[it]);
      }
#pragma unroll
      for (int e = 0; e < VEC; ++e) ss = add(ss, mul(v[it][e], v[it][e]));
    }
  }
  const float scale = rsqrtf(add(mul(block_sum(ss), inv_n), eps));
#pragma unroll
  for (int it = 0; it < ITERS; ++it) {
    const int i = threadIdx.x + it * blockDim.x;
    if (i < nvec) {
      float w[VEC];
      ldg_vec(weight + i * VEC, w);
#pragma unroll
      for (int e = 0; e < VEC; ++e)
        v[it][e] = style.in_float32 ? mul(mul(v[it][e], scale), add(w[e], style.offset))
                                    : mul(w[e], round_to<T>(mul(v[it][e], scale)));
      store_vec(out + row * hidden + i * VEC, v[it]);
    }
  }
  pdl_exit<Trigger>();
}

template <typename T, bool RESIDUAL, typename Trigger>
int launch_rms_norm_residual(const RmsNormArgs& a, cudaStream_t st) {
  const NormCta cta = rms_norm_cta(a.hidden / Elem<T>::kVec);  // (common.cuh)
  const int iters = cta.iters, threads = cta.threads;
  T* out = static_cast<T*>(a.out);
  T* res_out = static_cast<T*>(a.residual_out);
  const T* x = static_cast<const T*>(a.x);
  const T* res = static_cast<const T*>(a.residual);
  const T* w = static_cast<const T*>(a.weight);
  const float inv_n = 1.0f / (float)a.hidden;
  int e = 0;
#define PAGEDNB_RMS_LAUNCH(IT)                                                                                 \
  e = launch_pdl(rms_norm_kernel<T, IT, RESIDUAL, Trigger>, dim3(a.rows), dim3(threads), 0, st, out, res_out,  \
                 x, a.x_stride, res, a.residual_stride, w, a.hidden, a.eps, inv_n, a.style);                    \
  break;
  switch (iters) {
    case 1: PAGEDNB_RMS_LAUNCH(1)
    case 2: PAGEDNB_RMS_LAUNCH(2)
    case 4: PAGEDNB_RMS_LAUNCH(4)
    case 8: PAGEDNB_RMS_LAUNCH(8)
    default: return -1;  // more than 8 * kNormMaxThreads vectors per row
  }
#undef PAGEDNB_RMS_LAUNCH
  return e;
}

template <typename T>
int launch_rms_norm_dtype(const RmsNormArgs& a, cudaStream_t st) {
  if (a.rows > kGemvMaxRows)  // a cuBLAS GEMM comes next (common.cuh: PdlLate)
    return a.residual != nullptr ? launch_rms_norm_residual<T, true, PdlLate>(a, st)
                                 : launch_rms_norm_residual<T, false, PdlLate>(a, st);
  return a.residual != nullptr ? launch_rms_norm_residual<T, true, PdlEarly>(a, st)
                               : launch_rms_norm_residual<T, false, PdlEarly>(a, st);
}

// ---- q/k RMSNorm + rotary embedding, in place (and the step's K/V into the paged cache) ----------------
// With a cache to write (a.v != nullptr), the items are the heads of q, k and v: k rows go to their slot
// of the cache's K half after the rotary embedding, v rows to the V half as they are (slot -1: not
// written), which saves the separate cache-write launch of every layer.
// One group of LANES lanes per (token, head) of q, k (and v), as qk_rope.cuh lays a head row out and computes it.
template <typename T, int D, bool NORM>
__global__ void __launch_bounds__(128) qk_norm_rope_kernel(const QkRopeArgs a) {
  using C = QkCfg<T, D>;
  constexpr int VEC = C::VEC, LANES = C::LANES, E = C::E, NV = C::NV;
  const bool write_cache = a.v != nullptr;
  const int heads = a.num_heads + a.num_kv_heads * (write_cache ? 2 : 1);
  const int64_t item = (int64_t)blockIdx.x * C::ITEMS + threadIdx.x / LANES;
  const int lane = threadIdx.x % LANES;
  // no early exit: every lane of the warp takes part in the shuffles
  const bool valid = item < (int64_t)a.num_tokens * heads;
  const int64_t tok = valid ? item / heads : 0;
  const int head = valid ? (int)(item % heads) : 0;
  const bool is_q = head < a.num_heads;
  const bool is_v = head >= a.num_heads + a.num_kv_heads;
  const int kvh = is_q ? 0 : head - a.num_heads - (is_v ? a.num_kv_heads : 0);
  T* p = is_q   ? static_cast<T*>(a.q) + tok * a.q_stride_tok + (int64_t)head * a.q_stride_head
         : is_v ? const_cast<T*>(static_cast<const T*>(a.v)) + tok * a.v_stride_tok + (int64_t)kvh * a.v_stride_head
                : static_cast<T*>(a.k) + tok * a.k_stride_tok + (int64_t)kvh * a.k_stride_head;
  p += lane * E;

  // Before the wait, so that only q/k/v's own load is left on the path after it (at batch 1 this kernel is one
  // link of a chain of launches): the norm weights (no kernel writes them), the token's cache slot (a host
  // copy) and its cos/sin rows (looked up by torch kernels at the start of the forward, complete before the
  // step's first PDL kernel started: common.cuh's rule 1, as decode.cuh reads its metadata).
  const bool rotated = valid && !is_v;
  const T* w = static_cast<const T*>(is_q ? a.q_weight : a.k_weight) + lane * E;
  float wv[E], c[E], s[E];
#pragma unroll
  for (int j = 0; j < NV; ++j) {
    if (NORM && rotated) ldg_vec(w + j * VEC, wv + j * VEC);
    if (rotated) {
      ldg_vec(static_cast<const T*>(a.cos) + tok * a.cos_sin_stride + lane * E + j * VEC, c + j * VEC);
      ldg_vec(static_cast<const T*>(a.sin) + tok * a.cos_sin_stride + lane * E + j * VEC, s + j * VEC);
    }
  }
  const int64_t slot = valid && write_cache && !is_q ? __ldg(a.slots + tok) : -1;
  PAGEDNB_PDL_ENTER();

  float v[E];
  if (valid) {
#pragma unroll
    for (int j = 0; j < NV; ++j) load_vec(p + j * VEC, v + j * VEC);
  } else {
#pragma unroll
    for (int e = 0; e < E; ++e) v[e] = 0.f;
  }

  qk_norm_rope_lanes<T, LANES, E>(v, wv, c, s, NORM, rotated, lane, a.eps, a.style);
  if (!valid) return;
  // the element offset of this lane's part of the row in the cache (an fp8 cache: 1 byte per element,
  // stored fp8(x / scale) 8 bytes per 16-byte vector of T)
  const int64_t cached_at = (is_v ? a.cache_v_offset : 0) + (slot * a.num_kv_heads + kvh) * D + lane * E;
  T* cached = slot < 0 || a.cache_fp8 ? nullptr : static_cast<T*>(a.cache) + cached_at;
  uint8_t* cached8 = slot < 0 || !a.cache_fp8 ? nullptr : static_cast<uint8_t*>(a.cache) + cached_at;
  const float cache_scale = is_v ? a.v_scale : a.k_scale;
  if (is_v) {  // values go to the cache as they are
#pragma unroll
    for (int j = 0; j < NV; ++j) {
      if (cached != nullptr) store_vec(cached + j * VEC, v + j * VEC);
      if (cached8 != nullptr) store_fp8_vec<T>(cached8 + j * VEC, v + j * VEC, cache_scale);
    }
    return;
  }
#pragma unroll
  for (int j = 0; j < NV; ++j) {
    float* o = v + j * VEC;
    store_vec(p + j * VEC, o);
    if (cached != nullptr) store_vec(cached + j * VEC, o);
    if (cached8 != nullptr) {  // k as stored in the model's dtype, then quantised (the reference's order)
#pragma unroll
      for (int e = 0; e < VEC; ++e) o[e] = round_to<T>(o[e]);
      store_fp8_vec<T>(cached8 + j * VEC, o, cache_scale);
    }
  }
}

template <typename T, int D>
int launch_qk_norm_rope_d(const QkRopeArgs& a, cudaStream_t st) {
  using C = QkCfg<T, D>;
  const int64_t items = (int64_t)a.num_tokens * (a.num_heads + a.num_kv_heads * (a.v != nullptr ? 2 : 1));
  const int64_t blocks = (items + C::ITEMS - 1) / C::ITEMS;
  if (blocks > 0x7fffffff) return -1;
  return launch_pdl(a.q_weight != nullptr ? qk_norm_rope_kernel<T, D, true> : qk_norm_rope_kernel<T, D, false>,
                    dim3((unsigned)blocks), dim3(C::THREADS), 0, st, a);
}

template <typename T>
int launch_qk_norm_rope_dtype(const QkRopeArgs& a, cudaStream_t st) {
  switch (a.head_dim) {
    case 16: return launch_qk_norm_rope_d<T, 16>(a, st);
    case 32: return launch_qk_norm_rope_d<T, 32>(a, st);
    case 64: return launch_qk_norm_rope_d<T, 64>(a, st);
    case 128: return launch_qk_norm_rope_d<T, 128>(a, st);
    case 256: return launch_qk_norm_rope_d<T, 256>(a, st);
    default: return -1;
  }
}

// ---- act(gate) * up: SiLU (most models) or GELU-tanh (Gemma 2/3) ----------------------------------------------
// One thread per 16-byte vector of the output; gate_up rows are [gate (I) | up (I)]. The activation and the
// product round as torch's CUDA kernels do (common.cuh's silu_and_mul / gelu_tanh_and_mul).
template <typename T, int GATE, typename Trigger>
__global__ void __launch_bounds__(256) gate_and_mul_kernel(T* __restrict__ out, const T* __restrict__ gate_up,
                                                           int64_t stride, int inter, int64_t total_vecs) {
  pdl_enter<Trigger>();
  constexpr int VEC = Elem<T>::kVec;
  const int64_t idx = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
  if (idx >= total_vecs) return;
  const int nvec = inter / VEC;
  const int64_t row = idx / nvec;
  const int col = (int)(idx % nvec) * VEC;
  const T* g = gate_up + row * stride + col;
  float gv[VEC], uv[VEC];
  ldg_vec(g, gv);
  ldg_vec(g + inter, uv);
#pragma unroll
  for (int e = 0; e < VEC; ++e) gv[e] = gate_and_mul<T, GATE>(gv[e], uv[e]);
  store_vec(out + row * inter + col, gv);
  pdl_exit<Trigger>();
}

template <typename T, int GATE>
int launch_gate_and_mul_dtype(void* out, const void* gate_up, int64_t stride, int rows, int inter, cudaStream_t st) {
  const int64_t total = (int64_t)rows * (inter / Elem<T>::kVec);
  const int64_t blocks = (total + 255) / 256;
  if (blocks > 0x7fffffff) return -1;
  const auto kernel = rows > kGemvMaxRows ? gate_and_mul_kernel<T, GATE, PdlLate>  // a cuBLAS GEMM next
                                          : gate_and_mul_kernel<T, GATE, PdlEarly>;
  return launch_pdl(kernel, dim3((unsigned)blocks), dim3(256), 0, st, static_cast<T*>(out),
                    static_cast<const T*>(gate_up), stride, inter, total);
}

}  // namespace

// ---- host launchers (checked by bindings.cpp) ----------------------------------------------------------
int launch_rms_norm(int dtype, const RmsNormArgs& a, void* stream) {
  if (a.rows <= 0) return 0;
  const cudaStream_t st = static_cast<cudaStream_t>(stream);
  return with_dtype(dtype, [&](auto t) { return launch_rms_norm_dtype<decltype(t)>(a, st); });
}

int launch_qk_norm_rope(int dtype, const QkRopeArgs& a, void* stream) {
  if (a.num_tokens <= 0) return 0;
  const cudaStream_t st = static_cast<cudaStream_t>(stream);
  return with_dtype(dtype, [&](auto t) { return launch_qk_norm_rope_dtype<decltype(t)>(a, st); });
}

int launch_gate_and_mul(int dtype, int gate, void* out, const void* gate_up, int64_t stride, int rows, int inter,
                        void* stream) {
  if (rows <= 0) return 0;
  const cudaStream_t st = static_cast<cudaStream_t>(stream);
  return with_dtype(dtype, [&](auto t) {
    using T = decltype(t);
    return gate == kGemvSilu ? launch_gate_and_mul_dtype<T, kGemvSilu>(out, gate_up, stride, rows, inter, st)
                             : launch_gate_and_mul_dtype<T, kGemvGeluTanh>(out, gate_up, stride, rows, inter, st);
  });
}

}  // namespace pagednb
