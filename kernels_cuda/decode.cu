// Decode attention's run-time dispatch over dtype and head_dim. The kernels themselves are compiled in
// decode_hd<D>.cu, one build unit per head_dim (decode.cuh); this unit only declares those instantiations.
#include "decode.cuh"

namespace pagednb {

PAGEDNB_DECODE_INSTANCES(extern, 16)
PAGEDNB_DECODE_INSTANCES(extern, 32)
PAGEDNB_DECODE_INSTANCES(extern, 64)
PAGEDNB_DECODE_INSTANCES(extern, 128)
PAGEDNB_DECODE_INSTANCES(extern, 256)

namespace {

template <typename T>
int launch_row_dtype(int head_dim, const AttnParams& p, void* stream) {
  const auto st = static_cast<cudaStream_t>(stream);
  switch (head_dim) {
    case 16: return launch_decode_hd<T, 16>(p, st);
    case 32: return launch_decode_hd<T, 32>(p, st);
    case 64: return launch_decode_hd<T, 64>(p, st);
    case 128: return launch_decode_hd<T, 128>(p, st);
    case 256: return launch_decode_hd<T, 256>(p, st);
    default: return -1;
  }
}

template <typename T>
int occupancy_row_dtype(int head_dim, int gmax, int variant, int cache_fp8) {
  switch (head_dim) {
    case 16: return occupancy_row_hd<T, 16>(gmax, variant, cache_fp8);
    case 32: return occupancy_row_hd<T, 32>(gmax, variant, cache_fp8);
    case 64: return occupancy_row_hd<T, 64>(gmax, variant, cache_fp8);
    case 128: return occupancy_row_hd<T, 128>(gmax, variant, cache_fp8);
    case 256: return occupancy_row_hd<T, 256>(gmax, variant, cache_fp8);
    default: return 1;
  }
}

template <typename T>
int occupancy_group_mma_dtype(int head_dim, int cache_fp8) {
  switch (head_dim) {
    case 64: return occupancy_group_mma_hd<T, 64>(cache_fp8);
    case 128: return occupancy_group_mma_hd<T, 128>(cache_fp8);
    default: return 1;
  }
}

}  // namespace

int launch_row_f32(int head_dim, const AttnParams& p, void* stream) {
  return launch_row_dtype<float>(head_dim, p, stream);
}
int launch_row_f16(int head_dim, const AttnParams& p, void* stream) {
  return launch_row_dtype<__half>(head_dim, p, stream);
}
int launch_row_bf16(int head_dim, const AttnParams& p, void* stream) {
  return launch_row_dtype<__nv_bfloat16>(head_dim, p, stream);
}
int occupancy_row_f32(int head_dim, int gmax, int variant) { return occupancy_row_dtype<float>(head_dim, gmax, variant, 0); }
int occupancy_row_f16(int head_dim, int gmax, int variant, int cache_fp8) {
  return occupancy_row_dtype<__half>(head_dim, gmax, variant, cache_fp8);
}
int occupancy_row_bf16(int head_dim, int gmax, int variant, int cache_fp8) {
  return occupancy_row_dtype<__nv_bfloat16>(head_dim, gmax, variant, cache_fp8);
}
int occupancy_group_mma_f16(int head_dim, int cache_fp8) { return occupancy_group_mma_dtype<__half>(head_dim, cache_fp8); }
int occupancy_group_mma_bf16(int head_dim, int cache_fp8) {
  return occupancy_group_mma_dtype<__nv_bfloat16>(head_dim, cache_fp8);
}

}  // namespace pagednb
