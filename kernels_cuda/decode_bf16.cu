// Row (decode) attention kernels for one dtype: a build unit of its own, so ninja compiles the
// dtypes in parallel. See decode.cuh.
#include "decode.cuh"

namespace pagednb {

int launch_row_bf16(int head_dim, const AttnParams& p, void* stream) {
  return launch_row_dtype<__nv_bfloat16>(head_dim, p, static_cast<cudaStream_t>(stream));
}
int occupancy_row_bf16(int head_dim, int gmax, int variant, int cache_fp8) {
  return occupancy_dtype<__nv_bfloat16>(head_dim, gmax, variant, cache_fp8);
}
int occupancy_group_mma_bf16(int head_dim, int cache_fp8) {
  return occupancy_group_mma_dtype<__nv_bfloat16>(head_dim, cache_fp8);
}

}  // namespace pagednb
