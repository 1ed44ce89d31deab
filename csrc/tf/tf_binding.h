// Pieces shared by the TF bindings of the forward (fbn_forward_op.cc) and the backward
// (fbn_grad_op.cc): tensor -> core pointer mapping and the intra-op task runner.
#ifndef FBN_GRAD_TF_TF_TF_BINDING_H_
#define FBN_GRAD_TF_TF_TF_BINDING_H_

#include <cstdint>
#include <functional>
#include <vector>

#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/platform/threadpool.h"

#include "../core/common.h"
#if FBN_WITH_CUDA
#include "../core/cuda/common.h"
#include "xla/stream_executor/stream.h"
#endif

namespace fbn_tf {

// TF element type -> core storage type.
template <typename T>
struct CoreType;
template <>
struct CoreType<float> {
  using type = float;
};
template <>
struct CoreType<Eigen::half> {
  using type = fbn::half_t;
};
template <>
struct CoreType<Eigen::bfloat16> {
  using type = fbn::bfloat16_t;
};

// A tensor's data as the core's storage type.
template <typename T>
const typename CoreType<T>::type* CoreData(const tensorflow::Tensor& t) {
  return reinterpret_cast<const typename CoreType<T>::type*>(t.flat<T>().data());
}
template <typename T>
typename CoreType<T>::type* CoreData(tensorflow::Tensor* t) {
  return reinterpret_cast<typename CoreType<T>::type*>(t->flat<T>().data());
}

// The task runner of an op's core call: the core's own worker pool (fbn::ThreadRunner: the
// calling TF thread plus sleeping workers, one contiguous claim of tasks at a time) with as
// many threads as the op's intra-op thread pool has (so it honours
// tf.config.threading.set_intra_op_parallelism_threads). Eigen's ParallelFor on TF's pool, used before, was 10-20% slower on
// the same kernels (2-core Xeon, one op per tf.function call: 32x28x28x512 float32 NHWC
// training 8.4-8.9 -> 6.7-7.2 ms, 256x1x1x4096 1.33-1.48 -> 1.16-1.20 ms). Results do not
// depend on the partition (fixed-order combine), so they are bitwise the same either way.
inline fbn::ThreadRunner IntraOpThreads(tensorflow::OpKernelContext* ctx) {
  return fbn::ThreadRunner(ctx->device()->tensorflow_cpu_worker_threads()->workers->NumThreads());
}

inline std::vector<int64_t> Dims(const tensorflow::Tensor& t) {
  std::vector<int64_t> d(t.dims());
  for (int i = 0; i < t.dims(); ++i) d[i] = t.dim_size(i);
  return d;
}

#if FBN_WITH_CUDA
// Runs a core CUDA entry point on the op's compute stream with a temporary workspace of
// `workspace_bytes`: launch(workspace or nullptr, stream) returns a cudaError_t as int.
// Sets ctx's status on any failure.
template <typename Launch>
void LaunchOnOpStream(tensorflow::OpKernelContext* ctx, size_t workspace_bytes,
                      const char* what, Launch&& launch) {
  auto* dev_ctx = ctx->op_device_context();
  OP_REQUIRES(ctx, dev_ctx != nullptr && dev_ctx->stream() != nullptr,
              tensorflow::errors::Internal("No GPU stream available"));
  void* stream = dev_ctx->stream()->platform_specific_handle().stream;
  tensorflow::Tensor workspace;
  void* ws = nullptr;
  if (workspace_bytes > 0) {
    OP_REQUIRES_OK(ctx, ctx->allocate_temp(
                            tensorflow::DT_UINT8,
                            tensorflow::TensorShape({static_cast<int64_t>(workspace_bytes)}),
                            &workspace));
    ws = workspace.flat<uint8_t>().data();
  }
  const int err = launch(ws, stream);
  OP_REQUIRES(ctx, err == 0,
              tensorflow::errors::Internal("fbn_grad_tf CUDA ", what, " launch failed: ",
                                           fbn::CudaErrorString(err)));
}
#endif  // FBN_WITH_CUDA

}  // namespace fbn_tf

// Registers KERNEL<T> as the kernel of op NAME on DEVICE (tensorflow::DEVICE_CPU or
// DEVICE_GPU) for every element type T: float, half, bfloat16 (the statistics type U is
// float). Expands to declarations; use it at namespace scope, followed by a semicolon.
#define FBN_REGISTER_ONE_KERNEL(NAME, DEVICE, KERNEL, T)                                \
  REGISTER_KERNEL_BUILDER(                                                              \
      Name(NAME).Device(DEVICE).TypeConstraint<T>("T").TypeConstraint<float>("U"),      \
      KERNEL<T>)
#define FBN_REGISTER_KERNELS(NAME, DEVICE, KERNEL)                                      \
  FBN_REGISTER_ONE_KERNEL(NAME, DEVICE, KERNEL, float);                                 \
  FBN_REGISTER_ONE_KERNEL(NAME, DEVICE, KERNEL, Eigen::half);                           \
  FBN_REGISTER_ONE_KERNEL(NAME, DEVICE, KERNEL, Eigen::bfloat16)

#endif  // FBN_GRAD_TF_TF_TF_BINDING_H_
