// Framework-free batch-normalization backward: the one public header of the core.
//
// Everything here takes raw pointers, sizes and a parameter struct. The TensorFlow op
// (csrc/tf/) and the pybind11 module (csrc/py/) are thin bindings over it, so the math
// and the input validation exist exactly once.
#ifndef FBN_GRAD_TF_CORE_COMMON_H_
#define FBN_GRAD_TF_CORE_COMMON_H_

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
enum class ElemType { kFloat32, kFloat16, kBFloat16 };

// What reserve_space_2 holds in training mode. TF's CPU forward saves the biased batch
// variance; TF's GPU forward (cuDNN) saves the inverse standard deviation
// 1/sqrt(var + epsilon). Inference mode always receives the population variance.
enum class SavedStat { kVariance, kInvStd };

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

struct BnGradParams {
  BnShape shape;
  float epsilon = 1e-4f;
  bool is_training = true;
  SavedStat saved_stat = SavedStat::kVariance;
};

// Pointers of one call. dy, x, dx have shape.elements() elements of T; the rest C floats.
// dx may not alias dy or x.
template <typename T>
struct BnGradArgs {
  const T* dy = nullptr;
  const T* x = nullptr;
  const float* scale = nullptr;
  const float* saved_mean = nullptr;  // reserve_space_1 (training) / population mean
  const float* saved_var = nullptr;   // reserve_space_2: see SavedStat
  T* dx = nullptr;
  float* dscale = nullptr;
  float* doffset = nullptr;
  // Fused ReLU (the forward was y = max(bn(x), 0)): when set, y_backprop is masked with
  // relu_y > 0 before everything else, in every pass. Same shape and type as x.
  const T* relu_y = nullptr;
};

// ---------------------------------------------------------------------------------------
// Validation: the single source of truth for what inputs are accepted, used by the TF
// kernel and by the pybind11 functions alike. `dims` are the shapes of the six inputs.
struct ValidationResult {
  bool ok = true;
  std::string error;  // set when !ok; names the argument, expected and actual shapes
  BnShape shape;      // set when ok
};

// A failed ValidationResult carrying `msg`.
ValidationResult ValidationFailure(const std::string& msg);

ValidationResult ValidateBnGradInputs(const std::vector<int64_t>& y_backprop_dims,
                                      const std::vector<int64_t>& x_dims,
                                      const std::vector<int64_t>& scale_dims,
                                      const std::vector<int64_t>& reserve_space_1_dims,
                                      const std::vector<int64_t>& reserve_space_2_dims,
                                      DataFormat format, float epsilon);

// The general form: y_backprop and x plus any number of per-channel vectors, each of which
// must have shape [C]. Used by the split (reduce/apply) entry points.
struct NamedDims {
  const char* name;
  const std::vector<int64_t>* dims;
};
ValidationResult ValidateBnInputs(const std::vector<int64_t>& y_backprop_dims,
                                  const std::vector<int64_t>& x_dims,
                                  const std::vector<NamedDims>& per_channel, DataFormat format,
                                  float epsilon);

std::string ShapeString(const std::vector<int64_t>& dims);

// ---------------------------------------------------------------------------------------
// CPU kernels.

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
};

// Runs tasks on up to `num_threads` threads (1 = inline; the others from a process-wide pool
// of worker threads, started on first use and reused). Used by the pybind11 module and by
// the TF ops (sized there by TF's intra-op pool: IntraOpThreads in csrc/tf/tf_binding.h).
class ThreadRunner : public TaskRunner {
 public:
  explicit ThreadRunner(int num_threads) : num_threads_(num_threads < 1 ? 1 : num_threads) {}
  void Run(int64_t num_tasks, int64_t cost_per_task,
           const std::function<void(int64_t, int64_t)>& fn) const override;

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

template <typename T>
void BnGradCpu(const BnGradParams& params, const BnGradArgs<T>& args, const TaskRunner& runner,
               CpuIsa isa);

extern template void BnGradCpu<float>(const BnGradParams&, const BnGradArgs<float>&,
                                      const TaskRunner&, CpuIsa);
extern template void BnGradCpu<half_t>(const BnGradParams&, const BnGradArgs<half_t>&,
                                       const TaskRunner&, CpuIsa);
extern template void BnGradCpu<bfloat16_t>(const BnGradParams&, const BnGradArgs<bfloat16_t>&,
                                           const TaskRunner&, CpuIsa);

// Split backward, for cross-replica (synchronized) batch norm, training mode only:
//   reduce: sum_dy[c] = sum(dy), sum_dy_xmu[c] = sum(dy * (x - saved_mean[c])) over the
//           local tensor (uses args.dy, x, saved_mean);
//   apply:  dx from sums over `count` elements per channel, typically all-reduced across
//           replicas (uses args.dy, x, scale, saved_mean, saved_var, dx).
// Reduce followed by Apply with the local sums and count = shape.per_channel() is bitwise
// identical to BnGradCpu's x_backprop.
template <typename T>
void BnGradReduceCpu(const BnGradParams& params, const BnGradArgs<T>& args, float* sum_dy,
                     float* sum_dy_xmu, const TaskRunner& runner, CpuIsa isa);
template <typename T>
void BnGradApplyCpu(const BnGradParams& params, const BnGradArgs<T>& args, const float* sum_dy,
                    const float* sum_dy_xmu, float count, const TaskRunner& runner, CpuIsa isa);

// Scalar conversions used everywhere on the CPU (round to nearest even, NaN kept quiet).
float HalfToFloat(half_t h);
half_t FloatToHalf(float f);
float BFloat16ToFloat(bfloat16_t h);
bfloat16_t FloatToBFloat16(float f);

}  // namespace fbn

#endif  // FBN_GRAD_TF_CORE_COMMON_H_
