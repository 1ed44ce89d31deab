// Host-side API shared by the CUDA entry points of the forward (forward.h) and the backward
// (backward.h). Compiled only when the build has CUDA (FBN_WITH_CUDA).
#ifndef FBN_GRAD_TF_CORE_CUDA_COMMON_H_
#define FBN_GRAD_TF_CORE_CUDA_COMMON_H_

namespace fbn {

// The message of a cudaError_t returned (as an int) by BnGradCuda or BnForwardCuda.
const char* CudaErrorString(int error);

}  // namespace fbn

#endif  // FBN_GRAD_TF_CORE_CUDA_COMMON_H_
