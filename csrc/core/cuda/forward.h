// CUDA kernels of the batch-norm forward: same parameters and argument struct as the CPU
// kernels (../forward.h); all pointers are device pointers. Framework-free: the caller owns
// the stream and the workspace. Compiled only when the build has CUDA (FBN_WITH_CUDA).
// In training, saved_var receives what params.saved_stat says (the TF GPU binding passes
// kInvStd, cuDNN's convention, so TF's GPU backward and ours read it correctly).
#ifndef FBN_GRAD_TF_CORE_CUDA_FORWARD_H_
#define FBN_GRAD_TF_CORE_CUDA_FORWARD_H_

#include <cstddef>

#include "../forward.h"
#include "common.h"

namespace fbn {

// Bytes of device scratch memory BnForwardCuda needs for this shape (may be 0).
size_t BnForwardCudaWorkspaceBytes(const BnForwardParams& params);

// Enqueues the forward on `stream` (a cudaStream_t; nullptr = default stream). Returns the
// cudaError_t of the launches as an int (0 = cudaSuccess). Deterministic.
template <typename T>
int BnForwardCuda(const BnForwardParams& params, const BnForwardArgs<T>& args, void* workspace,
                  size_t workspace_bytes, void* stream);

extern template int BnForwardCuda<float>(const BnForwardParams&, const BnForwardArgs<float>&,
                                         void*, size_t, void*);
extern template int BnForwardCuda<half_t>(const BnForwardParams&, const BnForwardArgs<half_t>&,
                                          void*, size_t, void*);
extern template int BnForwardCuda<bfloat16_t>(const BnForwardParams&,
                                              const BnForwardArgs<bfloat16_t>&, void*, size_t,
                                              void*);

}  // namespace fbn

#endif  // FBN_GRAD_TF_CORE_CUDA_FORWARD_H_
