// CUDA kernels of the core: same parameters and argument struct as the CPU kernels
// (../backward.h); all pointers are device pointers. Framework-free: the caller owns the
// stream and the workspace. Compiled only when the build has CUDA (FBN_WITH_CUDA).
#ifndef FBN_GRAD_TF_CORE_CUDA_BACKWARD_H_
#define FBN_GRAD_TF_CORE_CUDA_BACKWARD_H_

#include <cstddef>

#include "../backward.h"
#include "common.h"

namespace fbn {

// Bytes of device scratch memory BnGradCuda needs for this shape (may be 0).
size_t BnGradCudaWorkspaceBytes(const BnGradParams& params);

// Enqueues the backward on `stream` (a cudaStream_t; nullptr = default stream).
// Returns the cudaError_t of the launches as an int (0 = cudaSuccess). Deterministic:
// the same inputs give bitwise identical outputs on every run.
template <typename T>
int BnGradCuda(const BnGradParams& params, const BnGradArgs<T>& args, void* workspace,
               size_t workspace_bytes, void* stream);

extern template int BnGradCuda<float>(const BnGradParams&, const BnGradArgs<float>&, void*,
                                      size_t, void*);
extern template int BnGradCuda<half_t>(const BnGradParams&, const BnGradArgs<half_t>&, void*,
                                       size_t, void*);
extern template int BnGradCuda<bfloat16_t>(const BnGradParams&, const BnGradArgs<bfloat16_t>&,
                                           void*, size_t, void*);

}  // namespace fbn

#endif  // FBN_GRAD_TF_CORE_CUDA_BACKWARD_H_
