// Shared device helpers for pagednb's kernels: programmatic dependent launch, element types, 16-byte
// vector conversions, fast exp2, cp.async, ldmatrix and mma.sync wrappers. Plain CUDA (no torch headers) so
// build units stay small.
#pragma once

#include <cuda_runtime.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <stdint.h>

#include <utility>

#include "launchers.h"

namespace pagednb {

// ---- Programmatic Dependent Launch (Hopper and later) ----------------------------------------------------
// A batch-1 decode step is ~300 short kernels; between two of them the GPU drains one grid, then launches and
// ramps up the next. launch_pdl lets a kernel's CTAs start while the kernel before it in the stream finishes
// (cudaLaunchAttributeProgrammaticStreamSerialization, kept by CUDA graph capture), so that gap overlaps
// work. Every kernel launched this way follows three rules:
//   1. pdl_wait() before it reads anything an earlier kernel wrote and before it writes anything (the
//      earlier kernel may still be reading the memory a write would reuse); only data no kernel writes
//      (weights), or data written before the kernel ahead of it started (host copies and non-PDL kernels
//      before the step's first PDL kernel, earlier steps' keys in the cache, an earlier layer's sort: each
//      use says why), may be read before it;
//   2. every CTA calls pdl_wait() before it exits, so the grid completes only after the grid before it:
//      a later kernel that waits on this one has then waited on every earlier one too;
//   3. pdl_launch_dependents() may come anywhere: from then on the next kernel may start its CTAs (they
//      wait in their own pdl_wait(); it fires once every CTA of this grid has called it or exited).
// Without the attribute (PAGEDNB_PDL=0, a GPU before sm_90, or launched by someone else) both instructions
// are no-ops, and for code built for an older architecture they compile to nothing.
__device__ __forceinline__ void pdl_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;\n" ::: "memory");
#endif
}
__device__ __forceinline__ void pdl_launch_dependents() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#endif
}
// The first line of a kernel with nothing to read before its inputs: let the next kernel launch, then wait.
#define PAGEDNB_PDL_ENTER() (::pagednb::pdl_launch_dependents(), ::pagednb::pdl_wait())

// When a kernel that may run right before a cuBLAS GEMM lets the next kernel launch (its Trigger template
// argument): PdlEarly at its first line, as PAGEDNB_PDL_ENTER; PdlLate only as its CTAs exit, after their last
// memory access (no explicit trigger) and with their stores made visible GPU-wide first (pdl_exit). A decode
// graph gives a GEMM behind a PdlLate kernel a programmatic edge (pagednb/engine/graph_edges.py), and cuBLAS's
// GEMM kernels do not wait (griddepcontrol.wait) before all of their memory accesses: they may write their output
// before the wait, over a buffer the kernel before them read for the last time, and some of them read part of
// their input before it (H200 probes, benchmarks/NOTES.md issue 19's tenth and eleventh rounds). A CTA's exit
// alone does not make its stores visible to the next kernel (only griddepcontrol.wait promises that), hence the
// fence. The launchers pick PdlLate where a GEMM, not pagednb's GEMV, comes next (more than kGemvMaxRows rows).
struct PdlEarly { static constexpr bool kEarly = true; };
struct PdlLate { static constexpr bool kEarly = false; };
template <typename Trigger>
__device__ __forceinline__ void pdl_enter() {
  if constexpr (Trigger::kEarly) pdl_launch_dependents();
  pdl_wait();
}
// A release fence at GPU scope: the thread's earlier stores are performed for every thread of the GPU before it
// goes on (MEMBAR.ALL.GPU, waiting for their acknowledgements). fence.release (PTX ISA 8.6, sm_90) is the half of
// fence.acq_rel that a writer needs: no L1 invalidation after it, and none of __threadfence()'s sequentially
// consistent ordering (MEMBAR.SC.GPU) against other fences; older toolkits and GPUs take __threadfence().
__device__ __forceinline__ void fence_release_gpu() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900 && \
    (__CUDACC_VER_MAJOR__ > 12 || (__CUDACC_VER_MAJOR__ == 12 && __CUDACC_VER_MINOR__ >= 8))
  asm volatile("fence.release.gpu;\n" ::: "memory");
#else
  __threadfence();
#endif
}
// A PdlLate kernel's last line, in every thread after its last store: its stores are performed for the whole GPU
// before the CTA exits (and with it lets the GEMM launch). The release fence measured +0.1% (fp8) and +0.4% (bf16)
// over __threadfence() on the H200's standard workload (benchmarks/NOTES.md, issue 19 round 12).
template <typename Trigger>
__device__ __forceinline__ void pdl_exit() {
  if constexpr (!Trigger::kEarly) fence_release_gpu();
}

// kernel<<<grid, block, smem, st>>>(args...) in thread-block clusters of `cluster_x` CTAs along x (1: no
// clusters; more needs sm_90), with programmatic stream serialization where pdl_enabled() (launchers.h);
// returns the launch's status (0 or a cudaError_t).
template <typename... Params, typename... Args>
int launch_pdl_clusters(void (*kernel)(Params...), unsigned cluster_x, dim3 grid, dim3 block, size_t smem,
                        cudaStream_t st, Args&&... args) {
  cudaLaunchAttribute attr[2];
  unsigned n = 0;
  if (pdl_enabled()) {
    attr[n].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attr[n++].val.programmaticStreamSerializationAllowed = 1;
  }
  if (cluster_x > 1) {
    attr[n].id = cudaLaunchAttributeClusterDimension;
    attr[n++].val.clusterDim = {cluster_x, 1, 1};
  }
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = grid;
  cfg.blockDim = block;
  cfg.dynamicSmemBytes = smem;
  cfg.stream = st;
  cfg.attrs = attr;
  cfg.numAttrs = n;
  return (int)cudaLaunchKernelEx(&cfg, kernel, std::forward<Args>(args)...);
}

// launch_pdl_clusters without clusters: the launch of nearly every kernel.
template <typename... Params, typename... Args>
int launch_pdl(void (*kernel)(Params...), dim3 grid, dim3 block, size_t smem, cudaStream_t st, Args&&... args) {
  return launch_pdl_clusters(kernel, 1, grid, block, smem, st, std::forward<Args>(args)...);
}

// The host launchers' dtype dispatch: f(T{}) with the element type of a dtype code (f instantiates its
// kernel for decltype of the argument); -1 for an unknown code.
template <typename F>
int with_dtype(int dtype, F&& f) {
  switch (dtype) {
    case kFloat32: return f(float{});
    case kFloat16: return f(__half{});
    case kBFloat16: return f(__nv_bfloat16{});
    default: return -1;
  }
}

// ---- scalar conversions (bit-level, independent of __CUDA_NO_*_CONVERSIONS__ macros) -------------
__device__ __forceinline__ float bf16_lo(uint32_t x) { return __uint_as_float(x << 16); }
__device__ __forceinline__ float bf16_hi(uint32_t x) { return __uint_as_float(x & 0xffff0000u); }

template <typename T> struct Elem;
template <> struct Elem<float> {
  static constexpr int kVec = 4;  // elements per 16-byte vector
  __device__ __forceinline__ static void unpack(const uint4& v, float* f) {
    f[0] = __uint_as_float(v.x); f[1] = __uint_as_float(v.y);
    f[2] = __uint_as_float(v.z); f[3] = __uint_as_float(v.w);
  }
  __device__ __forceinline__ static float to_float(float x) { return x; }
  __device__ __forceinline__ static float from_float(float x) { return x; }
};
template <> struct Elem<__nv_bfloat16> {
  static constexpr int kVec = 8;
  __device__ __forceinline__ static void unpack(const uint4& v, float* f) {
    f[0] = bf16_lo(v.x); f[1] = bf16_hi(v.x); f[2] = bf16_lo(v.y); f[3] = bf16_hi(v.y);
    f[4] = bf16_lo(v.z); f[5] = bf16_hi(v.z); f[6] = bf16_lo(v.w); f[7] = bf16_hi(v.w);
  }
  __device__ __forceinline__ static float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }
  __device__ __forceinline__ static __nv_bfloat16 from_float(float x) { return __float2bfloat16_rn(x); }
};
template <> struct Elem<__half> {
  static constexpr int kVec = 8;
  __device__ __forceinline__ static void unpack(const uint4& v, float* f) {
    const uint32_t w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      __half2 h = *reinterpret_cast<const __half2*>(&w[i]);
      float2 t = __half22float2(h);
      f[2 * i] = t.x; f[2 * i + 1] = t.y;
    }
  }
  __device__ __forceinline__ static float to_float(__half x) { return __half2float(x); }
  __device__ __forceinline__ static __half from_float(float x) { return __float2half_rn(x); }
};

// The RMSNorm kernel's CTA (fused_ops.cu) for a row of nvec 16-byte vectors: the fewest vectors per thread
// (iters: 1, 2, 4 or 8) that fit in kNormMaxThreads threads, the threads rounded up to whole warps (iters 16:
// the row is too long). Thread t sums vectors t, t + threads, ... in order, then lanes, then warps; the GEMV's
// fused norm (gemv.cu) adds its squares in this same order, so both give the same bits.
constexpr int kNormMaxThreads = 512;
struct NormCta {
  int iters, threads;
};
__host__ __device__ inline NormCta rms_norm_cta(int nvec) {
  int iters = 1, threads = 0;
  for (; iters <= 8; iters *= 2) {
    threads = ((nvec + iters - 1) / iters + 31) / 32 * 32;
    if (threads <= kNormMaxThreads) break;
  }
  return {iters, threads};
}

// x rounded to T and back: where torch rounds an elementwise result to the model dtype.
template <typename T> __device__ __forceinline__ float round_to(float x) {
  return Elem<T>::to_float(Elem<T>::from_float(x));
}

// SiLU(gate) * up as torch's CUDA silu and mul round it: round(round(gate / (1 + exp(-gate))) * up). One
// definition for the SiLU kernel (fused_ops.cu) and the GEMV that forms its input with it (gemv.cu), so
// both give the same bits; __fdiv_rn / __fadd_rn / __fmul_rn: never contracted into an FMA.
template <typename T> __device__ __forceinline__ float silu_and_mul(float gate, float up) {
  const float silu = round_to<T>(__fdiv_rn(gate, __fadd_rn(1.0f, expf(-gate))));
  return round_to<T>(__fmul_rn(silu, up));
}

// GELU-tanh(gate) * up as torch's CUDA gelu(approximate="tanh") and mul round it (HF's gelu_pytorch_tanh, Gemma):
// round(round(0.5 x (1 + tanh(b (x + k x^3)))) * up), b = sqrt(2 / pi), k = 0.044715, with torch's float32
// evaluation order. nvcc builds torch's kernel with FMA contraction on, which fuses x + k * x^3 (its one
// multiply-then-add) into an FMA: fmaf here; every other product and sum is rounded on its own.
template <typename T> __device__ __forceinline__ float gelu_tanh_and_mul(float gate, float up) {
  constexpr float kBeta = (float)(1.41421356237309504880 * 1.12837916709551257390 * 0.5);  // M_SQRT2 * M_2_SQRTPI / 2
  constexpr float kKappa = 0.044715f;
  const float cube = __fmul_rn(__fmul_rn(gate, gate), gate);
  const float inner = __fmul_rn(kBeta, fmaf(kKappa, cube, gate));
  const float gelu = round_to<T>(__fmul_rn(__fmul_rn(0.5f, gate), __fadd_rn(1.0f, tanhf(inner))));
  return round_to<T>(__fmul_rn(gelu, up));
}

// act(gate) * up of a gated MLP, act by its GemvGate code (launchers.h): the GEMV and fused_ops' kernel share it.
template <typename T, int GATE> __device__ __forceinline__ float gate_and_mul(float gate, float up) {
  static_assert(GATE == kGemvSilu || GATE == kGemvGeluTanh, "a gated activation");
  if constexpr (GATE == kGemvSilu) return silu_and_mul<T>(gate, up);
  else return gelu_tanh_and_mul<T>(gate, up);
}
// ---- the fp8 KV cache: float8 e4m3, stored = fp8(x / scale), read = fp8 * scale ----------------------------
// pagednb/attention/kv_quant.py is the reference: the same float32 division, rounding to nearest even and
// saturation to +-448 (cvt.rn.satfinite.e4m3x2.f32), so a kernel's cache holds the reference's bytes.
// Reads convert with cvt.rn.f16x2.e4m3x2 (sm_89+), exact: every e4m3 value is an fp16 (and a bf16) value.
struct Fp8E4M3 {  // an fp8 cache's element: storage only, the kernels convert on use
  uint8_t bits;
};

__device__ __forceinline__ float2 fp8x2_to_float2(uint16_t x) {
  const __half2_raw h = __nv_cvt_fp8x2_to_halfraw2(static_cast<__nv_fp8x2_storage_t>(x), __NV_E4M3);
  return __half22float2(*reinterpret_cast<const __half2*>(&h));
}
// 4 fp8 values (byte i = element i) -> 4 floats
__device__ __forceinline__ void fp8x4_to_float(uint32_t x, float* f) {
  const float2 lo = fp8x2_to_float2(static_cast<uint16_t>(x & 0xffffu));
  const float2 hi = fp8x2_to_float2(static_cast<uint16_t>(x >> 16));
  f[0] = lo.x; f[1] = lo.y; f[2] = hi.x; f[3] = hi.y;
}
// 4 floats -> 4 fp8 values of x / scale (byte i = element i)
__device__ __forceinline__ uint32_t fp8x4_from_float(const float* f, float scale) {
  const uint32_t lo = __nv_cvt_float2_to_fp8x2(make_float2(__fdiv_rn(f[0], scale), __fdiv_rn(f[1], scale)),
                                               __NV_SATFINITE, __NV_E4M3);
  const uint32_t hi = __nv_cvt_float2_to_fp8x2(make_float2(__fdiv_rn(f[2], scale), __fdiv_rn(f[3], scale)),
                                               __NV_SATFINITE, __NV_E4M3);
  return lo | (hi << 16);
}
// 8 floats -> 8 fp8 values of x / scale: what a 16-byte vector of 8 bf16/fp16 becomes in the cache
__device__ __forceinline__ uint2 fp8x8_from_float(const float* f, float scale) {
  return make_uint2(fp8x4_from_float(f, scale), fp8x4_from_float(f + 4, scale));
}

// A 16-byte vector of 8 bf16/fp16 values (as floats) -> its 8 fp8 bytes at p (8-byte aligned). Nothing for
// float32: its models keep a float32 cache (the bindings refuse an fp8 one).
template <typename T> __device__ __forceinline__ void store_fp8_vec(uint8_t* p, const float* f, float scale) {
  if constexpr (sizeof(T) == 2) *reinterpret_cast<uint2*>(p) = fp8x8_from_float(f, scale);
}

template <> struct Elem<Fp8E4M3> {
  static constexpr int kVec = 16;
  __device__ __forceinline__ static void unpack(const uint4& v, float* f) {
    fp8x4_to_float(v.x, f); fp8x4_to_float(v.y, f + 4); fp8x4_to_float(v.z, f + 8); fp8x4_to_float(v.w, f + 12);
  }
};

// Pack two floats into one 32-bit register of two 16-bit values (low = a).
template <typename T> __device__ __forceinline__ uint32_t pack2(float a, float b);
template <> __device__ __forceinline__ uint32_t pack2<__nv_bfloat16>(float a, float b) {
  __nv_bfloat162 h = __floats2bfloat162_rn(a, b);
  return *reinterpret_cast<uint32_t*>(&h);
}
template <> __device__ __forceinline__ uint32_t pack2<__half>(float a, float b) {
  __half2 h = __floats2half2_rn(a, b);
  return *reinterpret_cast<uint32_t*>(&h);
}

// A 16-bit query's power-of-2 scaling for f16 MMAs over an fp8 cache (the cache's values are exact f16s; a bf16
// query may lie outside f16's range): down = 2^-e brings the largest magnitude mx into [2^14, 2^15) (e clamped to
// [-32, 113]), factor = 2^e multiplies the scores back.
struct F16Scale {
  float down, factor;
};
__device__ __forceinline__ F16Scale f16_scale_for(float mx) {
  const int e = min(max((int)(__float_as_uint(mx) >> 23) - 127 - 14, -32), 113);
  return {__uint_as_float((uint32_t)(127 - e) << 23), __uint_as_float((uint32_t)(127 + e) << 23)};
}
// the larger magnitude of the two bf16 values of x
__device__ __forceinline__ float bf16x2_absmax(uint32_t x) {
  return fmaxf(fabsf(__uint_as_float(x << 16)), fabsf(__uint_as_float(x & 0xffff0000u)));
}
// the two bf16 values of x times `scale`, as an f16 pair (same order)
__device__ __forceinline__ uint32_t bf16x2_to_f16x2(uint32_t x, float scale) {
  return pack2<__half>(__uint_as_float(x << 16) * scale, __uint_as_float(x & 0xffff0000u) * scale);
}

// 8 fp8 values (byte i = element i) -> 8 values of T as one 16-byte vector (exact): an fp8 cache's tile in the
// 16-bit layout that ldmatrix and mma.sync take.
template <typename T> __device__ __forceinline__ uint32_t fp8x2_to(uint16_t x);
template <> __device__ __forceinline__ uint32_t fp8x2_to<__half>(uint16_t x) {
  const __half2_raw h = __nv_cvt_fp8x2_to_halfraw2(static_cast<__nv_fp8x2_storage_t>(x), __NV_E4M3);
  return *reinterpret_cast<const uint32_t*>(&h);
}
template <> __device__ __forceinline__ uint32_t fp8x2_to<__nv_bfloat16>(uint16_t x) {
  const float2 f = fp8x2_to_float2(x);
  return pack2<__nv_bfloat16>(f.x, f.y);
}
template <typename T> __device__ __forceinline__ uint4 fp8x8_to(uint2 x) {
  return make_uint4(fp8x2_to<T>(x.x & 0xffffu), fp8x2_to<T>(x.x >> 16), fp8x2_to<T>(x.y & 0xffffu),
                    fp8x2_to<T>(x.y >> 16));
}

// 2^x; MUFU.EX2 (about 2 ulp). ex2.approx.ftz(-inf) = +0.
// Gemma 2's attention logit soft-capping, s -> c * tanh(s / c), with c in the units of s (c <= 0: none).
// Applied to a score before it is masked (tanh would turn a masked -inf into -c).
__device__ __forceinline__ float soft_cap(float s, float c) { return c > 0.f ? c * tanhf(s / c) : s; }

__device__ __forceinline__ float fast_exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

__device__ __forceinline__ uint4 ldg16(const void* p) {
  return __ldg(reinterpret_cast<const uint4*>(p));
}

// ---- cp.async --------------------------------------------------------------------------------------
__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}
// 16 bytes global -> shared; when !valid nothing is read and the destination is zero-filled.
__device__ __forceinline__ void cp_async16(void* dst, const void* src, bool valid) {
  const int n = valid ? 16 : 0;
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_addr(dst)), "l"(src), "r"(n));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N> __device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

// ---- ldmatrix / mma ----------------------------------------------------------------------------------
__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], const void* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(smem_addr(p)));
}
__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t (&r)[4], const void* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(smem_addr(p)));
}

// D (16x8 f32) += A (16x16, row) * B (16x8, col)
template <typename T> __device__ __forceinline__ void mma16816(float (&d)[4], const uint32_t (&a)[4],
                                                               uint32_t b0, uint32_t b1);
template <> __device__ __forceinline__ void mma16816<__nv_bfloat16>(float (&d)[4], const uint32_t (&a)[4],
                                                                    uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
template <> __device__ __forceinline__ void mma16816<__half>(float (&d)[4], const uint32_t (&a)[4],
                                                             uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// Sequence that owns flattened query row `row`: qsl[s] <= row < qsl[s+1]; -1 past the last sequence.
__device__ __forceinline__ int find_seq(const int* __restrict__ qsl, int num_seqs, int row) {
  if (row >= __ldg(qsl + num_seqs)) return -1;
  int lo = 0, hi = num_seqs - 1;  // answer in [lo, hi]
  while (lo < hi) {
    const int mid = (lo + hi + 1) >> 1;
    if (__ldg(qsl + mid) <= row) lo = mid; else hi = mid - 1;
  }
  return lo;
}

}  // namespace pagednb
