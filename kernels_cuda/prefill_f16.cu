// Tensor-core prefill attention for one dtype: a build unit of its own. See prefill.cuh.
#include "prefill.cuh"

namespace pagednb {

int launch_prefill_f16(int head_dim, const AttnParams& p, void* stream) {
  return launch_prefill_dtype<__half>(head_dim, p, static_cast<cudaStream_t>(stream));
}

int occupancy_prefill_f16(int head_dim) { return occupancy_prefill_dtype<__half>(head_dim); }

}  // namespace pagednb
