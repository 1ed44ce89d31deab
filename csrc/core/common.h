// Framework-free batch normalization: what the forward (forward.h) and the backward
// (backward.h) share. 16-bit storage types, data formats, the canonical shape, the input
// validation helpers, the task runner, the CPU instruction-set paths and the scalar 16-bit
// conversions.
//
// Everything in the core takes raw pointers, sizes and a parameter struct. The TensorFlow
// ops (csrc/tf/) and the pybind11 module (csrc/py/) are thin bindings over it, so the math
// and the input validation exist exactly once.
#ifndef FBN_GRAD_TF_CORE_COMMON_H_
#define FBN_GRAD_TF_CORE_COMMON_H_

#include <chrono>
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

namespace fbn {

// 16-bit storage types. Layout-compatible with Eigen::half / Eigen::bfloat16 (TF),
// numpy float16 / ml_dtypes.bfloat16, __half / __nv_bfloat16 (CUDA): bindings
// reinterpret their pointers. All arithmetic is done in float.
struct half_t {
  uint16_t bits;
};
struct bfloat16_t {
  uint16_t bits;
};

enum class DataFormat { kNHWC, kNCHW, kNDHWC, kNCDHW };

// What reserve_space_2 holds in training mode. TF's CPU forward saves the biased batch
// variance; TF's GPU forward (cuDNN) saves the inverse standard deviation
// 1/sqrt(var + epsilon). Inference mode always receives the population variance.
enum class SavedStat { kVariance, kInvStd };

// The forward's fused activation, applied after the optional side input:
// y = act(bn(x) + side_input). The math (forward and derivative) is in activation.h.
enum class Activation { kIdentity, kRelu, kRelu6, kSwish };
// "Identity", "Relu", "Relu6", "Swish" (the ops' activation_mode values); false otherwise.
bool ParseActivation(const std::string& s, Activation* out);
const char* ActivationName(Activation a);
// The message of an unknown activation_mode (names the argument and the accepted values).
std::string UnknownActivationMessage(const std::string& s);

// Parses "NHWC", "NCHW", "NDHWC", "NCDHW". Returns false for anything else.
bool ParseDataFormat(const std::string& s, DataFormat* out);
const char* DataFormatName(DataFormat f);
int DataFormatRank(DataFormat f);  // 4 or 5
bool IsChannelsFirst(DataFormat f);

// Canonical view of the activation tensor: [outer, channels, inner] in memory order.
//   channels-last  (NHWC, NDHWC): outer = N*spatial, inner = 1
//   channels-first (NCHW, NCDHW): outer = N,         inner = spatial
// Kernels only see this view, so 4-D and 5-D tensors run through the same code.
struct BnShape {
  int64_t outer = 0;
  int64_t channels = 0;
  int64_t inner = 0;
  int64_t elements() const { return outer * channels * inner; }
  int64_t per_channel() const { return outer * inner; }  // M in the formulas
};

// ---------------------------------------------------------------------------------------
// Validation: the single source of truth for what inputs are accepted, used by the TF
// kernels and by the pybind11 functions alike.
struct ValidationResult {
  bool ok = true;
  std::string error;  // set when !ok; names the argument, expected and actual shapes
  BnShape shape;      // set when ok
};

// A failed ValidationResult carrying `msg`.
ValidationResult ValidationFailure(const std::string& msg);

// The general form: y_backprop and x plus any number of per-channel vectors, each of which
// must have shape [C]. Used by ValidateBnGradInputs and the split (reduce/apply) entry
// points (backward.h), and with x standing in for y_backprop by ValidateBnForwardInputs
// (forward.h).
struct NamedDims {
  const char* name;
  const std::vector<int64_t>* dims;
};
ValidationResult ValidateBnInputs(const std::vector<int64_t>& y_backprop_dims,
                                  const std::vector<int64_t>& x_dims,
                                  const std::vector<NamedDims>& per_channel, DataFormat format,
                                  float epsilon);

std::string ShapeString(const std::vector<int64_t>& dims);

// The fused ops' extra inputs (FusedBatchNormEx / FusedBatchNormGradEx), checked after the
// base validation. Null pointers are absent inputs.
//   side_input (0 or 1): the shape of x.
//   y (backward of Relu/Relu6): the shape of x; required by those modes.
//   offset (backward of Swish): [C]; required by Swish, whose z is recomputed.
// num_side_inputs must be 0 or 1.
struct ExInputs {
  int num_side_inputs = 0;
  const std::vector<int64_t>* side_input = nullptr;
  const std::vector<int64_t>* y = nullptr;
  const std::vector<int64_t>* offset = nullptr;
  bool backward = false;
};
ValidationResult ValidateExInputs(const std::vector<int64_t>& x_dims, const BnShape& shape,
                                  Activation activation, const ExInputs& in);

// ---------------------------------------------------------------------------------------
// How the CPU kernels run: the task runner and the instruction-set paths.

// How the CPU kernels run independent tasks. fn(begin, end) handles tasks [begin, end);
// the runner may call it from any thread, with any partition of [0, num_tasks). Results
// never depend on the partition: tasks are fixed by the shape alone, and reductions
// combine per-task partial sums in a fixed order, so output is bitwise identical for any
// number of threads.
class TaskRunner {
 public:
  virtual ~TaskRunner() = default;
  // cost_per_task: rough number of elements one task touches (a scheduling hint).
  virtual void Run(int64_t num_tasks, int64_t cost_per_task,
                   const std::function<void(int64_t, int64_t)>& fn) const = 0;
  // The most threads a Run may use (the caller included).
  virtual int64_t MaxThreads() const = 0;
};

// One step of a spin-wait (the runners' bounded waits for each other): tells the core, and a
// hyperthread sibling, that this thread is waiting.
inline void CpuRelax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield" ::: "memory");
#endif
}

// Spins (CpuRelax) until done() or `limit` has passed; returns done(). The runners' waits for
// each other spin this long before they sleep on a condition variable (ThreadRunner's pool,
// common.cc; the TF ops' IntraOpPoolRunner, csrc/tf/tf_binding.h).
template <typename Done>
bool SpinUntil(const Done& done, std::chrono::microseconds limit) {
  const auto deadline = std::chrono::steady_clock::now() + limit;
  for (int i = 1;; ++i) {
    if (done()) return true;
    CpuRelax();
    if (i % 64 == 0 && std::chrono::steady_clock::now() > deadline) return done();
  }
}

// The scheduling rules every runner follows (ThreadRunner below and the TF ops'
// IntraOpPoolRunner, csrc/tf/tf_binding.h). Below kMinParallelElems elements of work
// (num_tasks * cost_per_task) waking a thread costs more than it saves: the caller runs it all.
constexpr int64_t kMinParallelElems = 65536;
// How many threads to use, at most max_threads and one a task; 1: run inline.
inline int64_t TaskThreads(int64_t num_tasks, int64_t cost_per_task, int64_t max_threads) {
  const int64_t total = num_tasks * (cost_per_task > 0 ? cost_per_task : 1);
  if (total < kMinParallelElems) return 1;
  return max_threads < num_tasks ? max_threads : num_tasks;
}
// Tasks per claimed block: small blocks (8 a thread), so that a thread that arrives late
// still finds work to share.
inline int64_t TaskBlock(int64_t num_tasks, int64_t threads) {
  const int64_t block = num_tasks / (threads * 8);
  return block > 1 ? block : 1;
}

// Runs tasks on up to `num_threads` threads (1 = inline; the others from a process-wide pool
// of worker threads, started on first use and reused). Used by the pybind11 module; the TF
// ops run on TF's intra-op pool instead (IntraOpPoolRunner in csrc/tf/tf_binding.h).
class ThreadRunner : public TaskRunner {
 public:
  explicit ThreadRunner(int num_threads) : num_threads_(num_threads < 1 ? 1 : num_threads) {}
  void Run(int64_t num_tasks, int64_t cost_per_task,
           const std::function<void(int64_t, int64_t)>& fn) const override;
  int64_t MaxThreads() const override { return num_threads_; }

 private:
  int num_threads_;
};

// Instruction-set paths of the CPU kernels: the same source compiled four times.
//   baseline:   plain x86-64 (SSE2), runs on any x86-64 CPU;
//   avx2:       AVX2 + FMA + F16C;
//   avx512:     AVX-512 F/BW/VL/DQ, 512-bit vectors;
//   avx512bf16: avx512 + AVX512-BF16 (hardware float->bfloat16 rounding; Cooper Lake,
//               Sapphire Rapids and later, AMD Zen 4 and later).
// All paths produce bitwise identical results (same summation order, FMA contraction off,
// identical rounding in the 16-bit conversions); they differ only in speed.
enum class CpuIsa { kBaseline = 0, kAvx2 = 1, kAvx512 = 2, kAvx512Bf16 = 3 };
// Every path, lowest first.
constexpr CpuIsa kCpuIsas[] = {CpuIsa::kBaseline, CpuIsa::kAvx2, CpuIsa::kAvx512,
                               CpuIsa::kAvx512Bf16};
const char* CpuIsaName(CpuIsa isa);
// A path by its CpuIsaName (or "scalar", an old name of baseline); false for any other
// string, "auto" included.
bool ParseCpuIsa(const std::string& name, CpuIsa* out);
bool CpuSupports(CpuIsa isa);
// The best supported path, unless the environment variable FBN_GRAD_TF_ISA
// (baseline | avx2 | avx512 | avx512bf16 | auto) asks for a lower one. Read once.
CpuIsa DefaultCpuIsa();

// Whether the CPU backward issues software prefetches ahead of each input run
// (backward.inc, PrefetchInputs). They change no result, only speed, and which way is faster
// depends on the CPU: on a 2-core Xeon they made the DRAM-bound backward 5-15% faster alone
// and our BN ops 1.03-1.08x faster inside ResNet50/MobileNetV2 training steps; on a
// 2-core AMD EPYC (Zen 4) they made it slower: the fused backward's op time inside
// ResNet50 and MobileNetV2 training steps (float32 and mixed_bfloat16) was 1.14-1.28x
// lower without them, 32x14x14x1024 alone 1.36-1.42x (docs/PERFORMANCE_NOTES.md,
// "Software prefetch, by CPU vendor"). So: off on AMD CPUs, on elsewhere, unless the environment
// variable FBN_GRAD_TF_PREFETCH (on | off | auto) says otherwise. Read once.
// It also picks how channels-last rows are walked, which is tied to who prefetches: where
// the hardware alone does (off), wide rows are walked in address order (the backward's
// kRowWalkChannels, the forward statistics' kStatsRows); where the kernels prefetch (on), in
// blocks of channels down several rows. Same results either way.
bool SoftwarePrefetch();

// From how many bytes the CPU kernels write a fresh output (the backward's dx, the forward's y)
// with non-temporal stores, by element size. Streaming saves the read-for-ownership of lines
// that are not cached, but must evict the ones that are, and an output buffer recycled by
// TF's allocator often still is. Measured per call on a Xeon VM that reports a 480 MiB L3
// (docs/PERFORMANCE_NOTES.md, "Streaming stores by element size"): float32 outputs of 12.8-103 MB
// took 0.76-0.93x the time streamed, while the 16-bit kernels (twice the work per byte)
// took 0.65-0.82x the time at 9.4-25.7 MB written plainly, about even at 51 MB; inside
// training steps neither way changed anything beyond noise. So float32 streams from 8 MiB
// (as every type did before), 16-bit outputs from max(8 MiB, last-level cache / 10): 48 MiB
// on that Xeon, still 8 MiB where the L3 is 32 MiB (the EPYC, not measured since). An output
// written in place (dx over dy or x) is never streamed (backward.inc). The environment
// variable FBN_GRAD_TF_STREAM_MIB (a plain decimal number of MiB, 0 = every output; auto)
// sets one threshold for all types, for tests and experiments. Read once, by each library
// that holds the kernels (the TF op library and the core module each have their copy). L3/10
// is a heuristic: measured only on that VM, which sees the host's whole L3.
int64_t StreamMinBytes(int itemsize);

// The largest channel, in bytes of the planes it keeps cached between its two passes, that
// the training backward and forward take channel by channel on channels-first tensors
// (backward.inc and forward.inc, "the channel-major plan"): a task reduces one channel's
// planes and applies dx (or y) to them right after, while they are still cached, so the
// inputs come from memory once instead of twice. The backward keeps y_backprop and x, the
// forward x.
// 4 MiB where the hardware prefetchers work alone (SoftwarePrefetch() off: AMD CPUs), where
// it was measured: on a 2-core AMD EPYC Zen 2 (16 MiB L3 per core complex) channels of up to
// 3.2 MB took 0.74-0.77x the time in float32, and 6.4 MB ones (above this default, with the
// override) still 0.71x (docs/PERFORMANCE_NOTES.md, "Channels-first training: channel by
// channel"); 0 (never) where the kernels prefetch, as the plan was not measured there and
// their prefetch would run past each plane's end into the next channel's. The
// environment variable FBN_GRAD_TF_CHANNEL_MAJOR_KIB (a plain decimal number of KiB,
// 0 = never; auto) overrides it. Read once, by each library that holds the kernels.
int64_t ChannelMajorMaxBytes();

// How many training calls of each op the CPU kernels have taken channel by channel in this
// library since it was loaded: a statistic for tests; results never depend on it.
enum class BnOp { kBackward, kForward };
void CountChannelMajorCall(BnOp op);
int64_t ChannelMajorCallCount(BnOp op);

// How many outputs the CPU kernels have streamed in this library since it was loaded (one per
// kernel pass that writes its dx or y with non-temporal stores). A statistic for tests and
// tools: it shows which way StreamMinBytes sent a call; results never depend on it.
void CountStreamedOutput();
int64_t StreamedOutputCount();

// Advises the OS to back a large output buffer with transparent huge pages before a CPU
// kernel first writes it. TF's default CPU allocator takes a buffer above glibc's mmap
// threshold (at most 32 MiB) fresh from the OS at every call, and the first write of each
// 4 KiB page then faults; on a 2-core AMD EPYC (Zen 2, THP in "madvise" mode) first-touching
// 51 MB took 15 ms in 4 KiB pages, 5 ms in 2 MiB pages, and a second pass 4.8 against 3.5 ms
// (docs/PERFORMANCE_NOTES.md, "Huge pages for fresh outputs"). NumPy advises its arrays the
// same way. Only the whole huge pages inside [data, data + bytes) are advised, only from
// kHugePageAdviceMinBytes, and only on Linux; results never depend on it. The environment
// variable FBN_GRAD_TF_HUGEPAGES (on | off | auto = on) turns it off. Read once.
constexpr int64_t kHugePageAdviceMinBytes = int64_t{4} << 20;
bool HugePageAdvice();
void AdviseHugePages(void* data, int64_t bytes);

// Scalar conversions used everywhere on the CPU (round to nearest even, NaN kept quiet).
float HalfToFloat(half_t h);
half_t FloatToHalf(float f);
float BFloat16ToFloat(bfloat16_t h);
bfloat16_t FloatToBFloat16(float f);

}  // namespace fbn

#endif  // FBN_GRAD_TF_CORE_COMMON_H_
