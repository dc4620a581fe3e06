// The decode kernels at head_dim 16 for every dtype: a build unit of its own, so ninja compiles the head dims in
// parallel. See decode.cuh; decode.cu dispatches to these.
#include "decode.cuh"

namespace pagednb {

PAGEDNB_DECODE_INSTANCES(, 16)

}  // namespace pagednb
