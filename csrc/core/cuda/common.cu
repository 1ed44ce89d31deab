// Host code shared by the CUDA sources of the forward and the backward (common.h).
#include "common.h"

#include <cuda_runtime.h>

namespace fbn {

const char* CudaErrorString(int error) {
  return cudaGetErrorString(static_cast<cudaError_t>(error));
}

}  // namespace fbn
