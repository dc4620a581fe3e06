// Cache write: the step's new K and V rows into their slots of the paged cache. Dtype-agnostic (it
// moves bytes): one CTA per token; a token's K row (Hkv * D elements, heads contiguous) and V row are
// copied with the widest unit that every address and length allows (16 bytes in practice).
// Slot -1 (padding) is skipped. An fp8 cache quantises instead: each thread turns 16 bytes of 8 bf16/fp16
// values into the 8 bytes of fp8(x / scale) (common.cuh, the reference's rounding).
#include "common.cuh"
#include "launchers.h"

namespace pagednb {

template <typename U>
__global__ void __launch_bounds__(128) write_kv_kernel(const char* __restrict__ key, const char* __restrict__ value,
                                                       int64_t k_stride_tok, int64_t v_stride_tok,
                                                       char* __restrict__ cache, int64_t v_offset_bytes,
                                                       const int64_t* __restrict__ slots, int64_t row_bytes) {
  PAGEDNB_PDL_ENTER();
  const int tok = blockIdx.x;
  const int64_t slot = __ldg(slots + tok);
  if (slot < 0) return;
  const int n = (int)(row_bytes / sizeof(U));
  const U* k = reinterpret_cast<const U*>(key + tok * k_stride_tok);
  const U* v = reinterpret_cast<const U*>(value + tok * v_stride_tok);
  U* dk = reinterpret_cast<U*>(cache + slot * row_bytes);
  U* dv = reinterpret_cast<U*>(cache + v_offset_bytes + slot * row_bytes);
  int i = threadIdx.x;
  for (; i + 128 < n; i += 256) {  // two K and two V units in flight per thread
    const U a = k[i], b = k[i + 128], c = v[i], d = v[i + 128];
    dk[i] = a; dk[i + 128] = b; dv[i] = c; dv[i + 128] = d;
  }
  if (i < n) {
    const U a = k[i], c = v[i];
    dk[i] = a; dv[i] = c;
  }
}

template <typename T>
__global__ void __launch_bounds__(128) write_kv_fp8_kernel(const char* __restrict__ key, const char* __restrict__ value,
                                                           int64_t k_stride_tok, int64_t v_stride_tok,
                                                           uint8_t* __restrict__ cache, int64_t v_offset_bytes,
                                                           const int64_t* __restrict__ slots, int row_elems,
                                                           float k_scale, float v_scale) {
  const int tok = blockIdx.x;
  const int64_t slot = __ldg(slots + tok);
  if (slot < 0) return;
  const T* k = reinterpret_cast<const T*>(key + tok * k_stride_tok);
  const T* v = reinterpret_cast<const T*>(value + tok * v_stride_tok);
  uint8_t* dk = cache + slot * row_elems;
  uint8_t* dv = dk + v_offset_bytes;
  for (int i = threadIdx.x * 8; i < row_elems; i += 128 * 8) {
    float kf[8], vf[8];
    Elem<T>::unpack(ldg16(k + i), kf);
    Elem<T>::unpack(ldg16(v + i), vf);
    *reinterpret_cast<uint2*>(dk + i) = fp8x8_from_float(kf, k_scale);
    *reinterpret_cast<uint2*>(dv + i) = fp8x8_from_float(vf, v_scale);
  }
}

int launch_write_kv_fp8(int dtype, const void* key, const void* value, int64_t k_stride_tok, int64_t v_stride_tok,
                        void* cache, int64_t v_offset_bytes, const int64_t* slots, int num_tokens, int row_elems,
                        float k_scale, float v_scale, void* stream) {
  if (num_tokens <= 0) return 0;
  const uint64_t all = reinterpret_cast<uint64_t>(key) | reinterpret_cast<uint64_t>(value) |
                       (uint64_t)k_stride_tok | (uint64_t)v_stride_tok;
  const uint64_t cache_all = reinterpret_cast<uint64_t>(cache) | (uint64_t)v_offset_bytes | (uint64_t)row_elems;
  if (all % 16 != 0 || cache_all % 8 != 0) return -1;
  const cudaStream_t st = static_cast<cudaStream_t>(stream);
  const char* k = static_cast<const char*>(key);
  const char* v = static_cast<const char*>(value);
  uint8_t* c = static_cast<uint8_t*>(cache);
  if (dtype == kBFloat16)
    write_kv_fp8_kernel<__nv_bfloat16><<<num_tokens, 128, 0, st>>>(k, v, k_stride_tok, v_stride_tok, c, v_offset_bytes,
                                                                     slots, row_elems, k_scale, v_scale);
  else if (dtype == kFloat16)
    write_kv_fp8_kernel<__half><<<num_tokens, 128, 0, st>>>(k, v, k_stride_tok, v_stride_tok, c, v_offset_bytes,
                                                              slots, row_elems, k_scale, v_scale);
  else
    return -1;
  return (int)cudaGetLastError();
}

int launch_write_kv(const void* key, const void* value, int64_t k_stride_tok, int64_t v_stride_tok,
                    void* cache, int64_t v_offset_bytes, const int64_t* slots, int num_tokens,
                    int64_t row_bytes, void* stream) {
  if (num_tokens <= 0) return 0;
  const cudaStream_t st = static_cast<cudaStream_t>(stream);
  const uint64_t all = reinterpret_cast<uint64_t>(key) | reinterpret_cast<uint64_t>(value) |
                       reinterpret_cast<uint64_t>(cache) | (uint64_t)k_stride_tok | (uint64_t)v_stride_tok |
                       (uint64_t)v_offset_bytes | (uint64_t)row_bytes;
  const char* k = static_cast<const char*>(key);
  const char* v = static_cast<const char*>(value);
  char* c = static_cast<char*>(cache);
  const auto kernel = all % 16 == 0 ? write_kv_kernel<uint4>
                      : all % 8 == 0  ? write_kv_kernel<uint2>
                      : all % 4 == 0  ? write_kv_kernel<uint32_t>
                                      : write_kv_kernel<uint16_t>;
  return launch_pdl(kernel, dim3(num_tokens), dim3(128), 0, st, k, v, k_stride_tok, v_stride_tok, c, v_offset_bytes,
                    slots, row_bytes);
}

}  // namespace pagednb
