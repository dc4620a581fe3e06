// Row (decode) attention kernels for one dtype: a build unit of its own, so ninja compiles the
// dtypes in parallel. See decode.cuh.
#include "decode.cuh"

namespace pagednb {

int launch_row_f32(int head_dim, const AttnParams& p, void* stream) {
  return launch_row_dtype<float>(head_dim, p, static_cast<cudaStream_t>(stream));
}
int occupancy_row_f32(int head_dim, int gmax, int variant) {
  return occupancy_dtype<float>(head_dim, gmax, variant, 0);
}

}  // namespace pagednb
