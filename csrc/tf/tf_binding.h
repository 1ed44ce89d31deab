// Pieces shared by the TF bindings of the forward (fbn_forward_op.cc) and the backward
// (fbn_grad_op.cc): tensor -> core pointer mapping and the intra-op task runner.
#ifndef FBN_GRAD_TF_TF_TF_BINDING_H_
#define FBN_GRAD_TF_TF_TF_BINDING_H_

#include <cstdint>
#include <functional>
#include <vector>

#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/platform/threadpool.h"

#include "../core/bn_grad.h"

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

// Runs core tasks on the op's intra-op thread pool (honours
// tf.config.threading.set_intra_op_parallelism_threads).
class IntraOpRunner : public fbn::TaskRunner {
 public:
  explicit IntraOpRunner(tensorflow::thread::ThreadPool* pool) : pool_(pool) {}
  explicit IntraOpRunner(tensorflow::OpKernelContext* ctx)
      : pool_(ctx->device()->tensorflow_cpu_worker_threads()->workers) {}
  void Run(int64_t num_tasks, int64_t cost_per_task,
           const std::function<void(int64_t, int64_t)>& fn) const override {
    // ~4 cycles per element and pass is a fair cost model for a bandwidth-bound kernel.
    pool_->ParallelFor(num_tasks, cost_per_task * 4, [&fn](int64_t b, int64_t e) { fn(b, e); });
  }

 private:
  tensorflow::thread::ThreadPool* pool_;
};

inline std::vector<int64_t> Dims(const tensorflow::Tensor& t) {
  std::vector<int64_t> d(t.dims());
  for (int i = 0; i < t.dims(); ++i) d[i] = t.dim_size(i);
  return d;
}

}  // namespace fbn_tf

#endif  // FBN_GRAD_TF_TF_TF_BINDING_H_
