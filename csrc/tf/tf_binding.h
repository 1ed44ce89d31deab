// Pieces shared by the TF bindings of the forward (fbn_forward_op.cc) and the backward
// (fbn_grad_op.cc): tensor -> core pointer mapping and the intra-op task runner.
#ifndef FBN_GRAD_TF_TF_TF_BINDING_H_
#define FBN_GRAD_TF_TF_TF_BINDING_H_

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
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

// The task runner of an op's core call, built to share the cores with the rest of a model.
// Inside a model TF's executor runs independent ops at the same time (a convolution's filter
// gradient beside a BN backward), each on an inter-op thread, and their inner parallel loops
// on the one intra-op pool. So:
//   * the calling thread always works: it claims blocks of tasks until none are left;
//   * helpers are closures scheduled on TF's intra-op pool (never threads of our own): a
//     helper that a free pool thread picks up joins the claiming, one that starts after the
//     last block is claimed returns at once; the caller never waits for a helper that has
//     not started, so a pool busy with another op costs us parallelism, not a stall;
//   * nothing serializes two of our ops: each call has its own claim state; but they share
//     one budget of workers, as many as the pool has threads (a caller always works, a
//     helper joins only while the budget has room), so ops that TF runs at the same time
//     split the cores instead of stacking threads on them.
// Our earlier private worker pool (one extra thread per intra-op thread, one run at a time)
// won single-op microbenchmarks but oversubscribed the cores beside TF's threads inside models
// and queued concurrent BN ops behind each other (docs/PERFORMANCE_NOTES.md,
// "Threading").
// Results do not depend on who runs which block (fixed-order combine): bitwise the same for
// any thread count and any interleaving.
class IntraOpPoolRunner final : public fbn::TaskRunner {
 public:
  explicit IntraOpPoolRunner(tensorflow::thread::ThreadPool* pool) : pool_(pool) {}

  int64_t MaxThreads() const override { return pool_ == nullptr ? 1 : pool_->NumThreads(); }

  void Run(int64_t num_tasks, int64_t cost_per_task,
           const std::function<void(int64_t, int64_t)>& fn) const override {
    if (num_tasks <= 0) return;
    const int64_t threads =
        fbn::TaskThreads(num_tasks, cost_per_task, pool_ == nullptr ? 1 : pool_->NumThreads());
    if (threads <= 1) {
      fn(0, num_tasks);
      return;
    }
    const int64_t block = fbn::TaskBlock(num_tasks, threads);
    auto claim = std::make_shared<Claim>(num_tasks, block, &fn, static_cast<int>(threads));
    // The caller always works; it counts against the budget of `threads` workers shared by
    // all our ops in the process, so two of our ops that TF runs at once get one thread each
    // instead of four threads fighting for two cores (helpers of a busy budget never join).
    const int busy_before = BusyWorkers().fetch_add(1, std::memory_order_relaxed);
    const auto helper = [claim] {
      if (claim->Join()) {
        claim->Drain();
        claim->Leave();
      }
    };
    for (int64_t i = 1 + busy_before; i < threads; ++i) pool_->Schedule(helper);
    // The caller works; between its blocks it schedules one spare helper, once, if none has
    // joined kSpareDelay after the start and blocks are left.
    const auto start = std::chrono::steady_clock::now();
    bool spared = false;
    claim->Drain([&] {
      if (spared || claim->active.load(std::memory_order_relaxed) != 0 ||
          claim->next.load(std::memory_order_relaxed) >= num_tasks ||
          std::chrono::steady_clock::now() - start < kSpareDelay)
        return;
      spared = true;
      pool_->Schedule(helper);
    });
    BusyWorkers().fetch_sub(1, std::memory_order_relaxed);
    claim->Close();
  }

 private:
  // One Run's shared state. Shared-owned by the scheduled helpers: a helper may start long
  // after Run returned, and then only reads `closed`.
  struct Claim {
    Claim(int64_t n, int64_t b, const std::function<void(int64_t, int64_t)>* f, int w)
        : num_tasks(n), block(b), fn(f), max_workers(w) {}
    // Runs blocks until none is left, calling after_block() after each.
    template <typename AfterBlock>
    void Drain(AfterBlock&& after_block) {
      for (;;) {
        const int64_t b = next.fetch_add(block, std::memory_order_relaxed);
        if (b >= num_tasks) return;
        (*fn)(b, std::min(num_tasks, b + block));
        after_block();
      }
    }
    void Drain() {
      Drain([] {});
    }
    // A helper may take part only while the caller has not closed the claim (fn is valid
    // until Close returns).
    // A helper also needs a free place in the process-wide budget of workers.
    bool Join() {
      if (next.load(std::memory_order_relaxed) >= num_tasks) return false;
      if (BusyWorkers().fetch_add(1, std::memory_order_relaxed) >= max_workers) {
        BusyWorkers().fetch_sub(1, std::memory_order_relaxed);
        return false;
      }
      std::lock_guard<std::mutex> lk(mu);
      if (closed) {
        BusyWorkers().fetch_sub(1, std::memory_order_relaxed);
        return false;
      }
      active.fetch_add(1, std::memory_order_relaxed);
      return true;
    }
    void Leave() {
      BusyWorkers().fetch_sub(1, std::memory_order_relaxed);
      std::lock_guard<std::mutex> lk(mu);
      // release: the caller may see 0 while spinning (Close) and read our blocks' output
      if (active.fetch_sub(1, std::memory_order_release) == 1 && closed) done.notify_all();
    }
    // Caller, after its own Drain: no new helper may join; wait for the ones still working.
    // A helper still working has at most one block left (1/8 of its share), usually a few
    // to tens of microseconds: the caller spins for up to kCloseSpin before it sleeps on
    // `done`, because sleeping and being woken costs more than that on a VM (a futex wait,
    // the helper's futex wake, the scheduler). Measured inside training steps, float32 and
    // mixed_bfloat16 (docs/PERFORMANCE_NOTES.md, "Spin before sleeping"): the sum of our BN
    // ops' times fell by 7-11% in ResNet50, MobileNetV2 and DenseNet121, the other ops' times
    // unchanged; bounds of 30, 100 and 1000 us measured the same.
    void Close() {
      const auto finished = [this] { return active.load(std::memory_order_acquire) == 0; };
      {
        std::lock_guard<std::mutex> lk(mu);
        closed = true;
        if (finished()) return;
      }
      if (fbn::SpinUntil(finished, kCloseSpin)) return;
      std::unique_lock<std::mutex> lk(mu);
      done.wait(lk, finished);
    }

    const int64_t num_tasks;
    const int64_t block;
    const std::function<void(int64_t, int64_t)>* const fn;
    const int max_workers;
    std::atomic<int64_t> next{0};
    std::mutex mu;
    std::condition_variable done;
    std::atomic<int> active{0};  // helpers in Drain; changed under mu, read also without it
    bool closed = false;
  };

  // Threads working on blocks of any of our ops right now (callers and helpers), in this
  // library: one budget for the process, like the one intra-op pool it mirrors.
  static std::atomic<int>& BusyWorkers() {
    static std::atomic<int> busy{0};
    return busy;
  }

  // How long a caller spins for its helpers before it sleeps (Claim::Close).
  static constexpr std::chrono::microseconds kCloseSpin{100};

  // When the caller schedules a spare helper (Run). A woken pool thread can
  // be placed on the caller's CPU while another thread holds the other core; it then starts
  // only when the caller is done, and the call runs on one thread. A spare closure wakes a
  // second pool thread, and whichever starts first joins. Scheduled at once, the spare made
  // our BN ops 0.93-0.96x the time inside ResNet50, MobileNetV2 and DenseNet121 training
  // steps, but on an idle machine it woke a thread with nothing to do, which then spun beside
  // the caller and its helper: `bench --layer` TF fused / ours 1.34-1.46x against 1.57-1.65x
  // without it. Scheduled only when no helper has joined within 50 us: --layer 1.71-1.75x,
  // and inside the models 0.98-1.02x of the spare at once (Intel Xeon, paired A/B,
  // docs/PERFORMANCE_NOTES.md, "A spare helper").
  static constexpr std::chrono::microseconds kSpareDelay{50};

  tensorflow::thread::ThreadPool* pool_;
};

// The runner of an op's CPU core call: TF's intra-op pool of the op's device (so
// tf.config.threading.set_intra_op_parallelism_threads decides the width).
inline IntraOpPoolRunner IntraOpThreads(tensorflow::OpKernelContext* ctx) {
  const auto* workers = ctx->device()->tensorflow_cpu_worker_threads();
  return IntraOpPoolRunner(workers == nullptr ? nullptr : workers->workers);
}

// A CPU kernel's large output before the kernel writes it: advised for huge pages
// (fbn::AdviseHugePages says why) when TF has just allocated it, left alone when it took over
// an input's buffer (forward_input_or_allocate_output), whose pages exist already.
inline void AdviseFreshOutput(tensorflow::OpKernelContext* ctx, tensorflow::Tensor* out) {
  if (out == nullptr) return;
  const auto data = out->tensor_data();
  if (static_cast<int64_t>(data.size()) < fbn::kHugePageAdviceMinBytes) return;
  for (int i = 0; i < ctx->num_inputs(); ++i) {
    if (ctx->input(i).tensor_data().data() == data.data()) return;
  }
  fbn::AdviseHugePages(const_cast<char*>(data.data()), static_cast<int64_t>(data.size()));
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
