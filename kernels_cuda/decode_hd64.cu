// The decode kernels at head_dim 64 for every dtype: a build unit of its own, so ninja compiles the head dims in
// parallel. See decode.cuh; decode.cu dispatches to these.
#include "decode.cuh"

namespace pagednb {

PAGEDNB_DECODE_INSTANCES(, 64)

}  // namespace pagednb
