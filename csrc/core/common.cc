// What the forward and the backward share (common.h): data formats, the validation helpers,
// 16-bit conversions, the std::thread task runner (worker pool) and the runtime choice of
// the CPU instruction-set path.
#include <algorithm>
#include <atomic>
#include <cmath>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <sstream>
#include <thread>
#include <vector>

#include <pthread.h>
#include <unistd.h>
#if defined(__linux__)
#include <sys/mman.h>
#endif

#include "common.h"
#include "cpu/kernels.h"

namespace fbn {

// ---- data formats -------------------------------------------------------------------------

bool ParseDataFormat(const std::string& s, DataFormat* out) {
  if (s == "NHWC") *out = DataFormat::kNHWC;
  else if (s == "NCHW") *out = DataFormat::kNCHW;
  else if (s == "NDHWC") *out = DataFormat::kNDHWC;
  else if (s == "NCDHW") *out = DataFormat::kNCDHW;
  else return false;
  return true;
}

const char* DataFormatName(DataFormat f) {
  switch (f) {
    case DataFormat::kNHWC: return "NHWC";
    case DataFormat::kNCHW: return "NCHW";
    case DataFormat::kNDHWC: return "NDHWC";
    case DataFormat::kNCDHW: return "NCDHW";
  }
  return "?";
}

int DataFormatRank(DataFormat f) {
  return (f == DataFormat::kNDHWC || f == DataFormat::kNCDHW) ? 5 : 4;
}

bool IsChannelsFirst(DataFormat f) {
  return f == DataFormat::kNCHW || f == DataFormat::kNCDHW;
}

bool ParseActivation(const std::string& s, Activation* out) {
  if (s == "Identity") *out = Activation::kIdentity;
  else if (s == "Relu") *out = Activation::kRelu;
  else if (s == "Relu6") *out = Activation::kRelu6;
  else if (s == "Swish") *out = Activation::kSwish;
  else return false;
  return true;
}

const char* ActivationName(Activation a) {
  switch (a) {
    case Activation::kIdentity: return "Identity";
    case Activation::kRelu: return "Relu";
    case Activation::kRelu6: return "Relu6";
    case Activation::kSwish: return "Swish";
  }
  return "?";
}

std::string UnknownActivationMessage(const std::string& s) {
  return "activation_mode must be one of Identity, Relu, Relu6, Swish, got '" + s + "'";
}

// ---- validation -------------------------------------------------------------------------

std::string ShapeString(const std::vector<int64_t>& dims) {
  std::ostringstream os;
  os << "[";
  for (size_t i = 0; i < dims.size(); ++i) os << (i ? "," : "") << dims[i];
  os << "]";
  return os.str();
}

ValidationResult ValidationFailure(const std::string& msg) {
  ValidationResult r;
  r.ok = false;
  r.error = msg;
  return r;
}

namespace {

// Product of dims, false on a negative dim or int64 overflow.
bool CheckedNumElements(const std::vector<int64_t>& dims, int64_t* out) {
  int64_t n = 1;
  for (int64_t d : dims) {
    if (d < 0) return false;
    if (__builtin_mul_overflow(n, d, &n)) return false;
  }
  *out = n;
  return true;
}

}  // namespace

ValidationResult ValidateBnInputs(const std::vector<int64_t>& dy_dims,
                                  const std::vector<int64_t>& x_dims,
                                  const std::vector<NamedDims>& per_channel, DataFormat format,
                                  float epsilon) {
  const int rank = DataFormatRank(format);
  const std::string fmt = DataFormatName(format);
  const auto rank_error = [&](const char* name, const std::vector<int64_t>& d) {
    return ValidationFailure(std::string(name) + " must be " + std::to_string(rank) +
        "-dimensional for data_format " + fmt + ", got shape " + ShapeString(d));
  };
  if (static_cast<int>(dy_dims.size()) != rank) return rank_error("y_backprop", dy_dims);
  if (static_cast<int>(x_dims.size()) != rank) return rank_error("x", x_dims);
  if (x_dims != dy_dims) {
    return ValidationFailure("x and y_backprop must have the same shape, but x has shape " +
        ShapeString(x_dims) + " and y_backprop has shape " + ShapeString(dy_dims));
  }
  int64_t elements = 0;
  if (!CheckedNumElements(x_dims, &elements)) {
    return ValidationFailure("x has shape " + ShapeString(x_dims) +
        ": dimensions must be non-negative and their product must fit in 64 bits");
  }
  for (const NamedDims& v : per_channel) {
    if (v.dims->size() != 1) {
      return ValidationFailure(std::string(v.name) + " must be 1-dimensional, got shape " +
          ShapeString(*v.dims));
    }
  }
  const int channel_axis = IsChannelsFirst(format) ? 1 : rank - 1;
  const int64_t C = x_dims[channel_axis];
  for (const NamedDims& v : per_channel) {
    if ((*v.dims)[0] != C) {
      return ValidationFailure(std::string(v.name) + " must have " + std::to_string(C) +
          " elements, the channel count of x (axis " + std::to_string(channel_axis) +
          " of shape " + ShapeString(x_dims) + " for data_format " + fmt +
          "), but has shape " + ShapeString(*v.dims));
    }
  }
  // The sign is read from the bits: TF runs kernels with denormals flushed to zero, where a
  // negative subnormal epsilon would compare equal to 0.
  uint32_t eps_bits;
  std::memcpy(&eps_bits, &epsilon, sizeof(eps_bits));
  const bool eps_negative = (eps_bits >> 31) != 0 && (eps_bits & 0x7fffffffu) != 0;
  if (!std::isfinite(epsilon) || eps_negative) {
    std::ostringstream os;
    os << "epsilon must be a finite, non-negative number, got " << epsilon;
    return ValidationFailure(os.str());
  }

  // The canonical view's factors are sub-products of the dims: with a zero dim elsewhere
  // they can still overflow, so they are checked too.
  ValidationResult r;
  std::vector<int64_t> outer_dims, inner_dims;
  if (IsChannelsFirst(format)) {
    outer_dims.assign(x_dims.begin(), x_dims.begin() + 1);
    inner_dims.assign(x_dims.begin() + 2, x_dims.end());
  } else {
    outer_dims.assign(x_dims.begin(), x_dims.end() - 1);
  }
  if (!CheckedNumElements(outer_dims, &r.shape.outer) ||
      !CheckedNumElements(inner_dims, &r.shape.inner)) {
    return ValidationFailure("x has shape " + ShapeString(x_dims) +
        ": the product of its non-channel dimensions must fit in 64 bits");
  }
  r.shape.channels = C;
  return r;
}

ValidationResult ValidateExInputs(const std::vector<int64_t>& x_dims, const BnShape& shape,
                                  Activation activation, const ExInputs& in) {
  if (in.num_side_inputs < 0 || in.num_side_inputs > 1) {
    return ValidationFailure("num_side_inputs must be 0 or 1, got " +
                             std::to_string(in.num_side_inputs));
  }
  const bool side_needed = !in.backward || activation == Activation::kSwish;
  if (in.num_side_inputs == 1 && side_needed && in.side_input == nullptr) {
    return ValidationFailure("side_input is missing (num_side_inputs is 1)");
  }
  if (in.side_input != nullptr && *in.side_input != x_dims) {
    return ValidationFailure("side_input must have the shape of x " + ShapeString(x_dims) +
                             ", got shape " + ShapeString(*in.side_input));
  }
  if (in.backward) {
    const bool needs_y = activation == Activation::kRelu || activation == Activation::kRelu6;
    if (needs_y && in.y == nullptr) {
      return ValidationFailure(std::string("y (the forward's output) is required by "
                                           "activation_mode ") + ActivationName(activation));
    }
    if (in.y != nullptr && *in.y != x_dims) {
      return ValidationFailure("y must have the shape of x " + ShapeString(x_dims) +
                               ", got shape " + ShapeString(*in.y));
    }
    if (activation == Activation::kSwish && in.offset == nullptr) {
      return ValidationFailure("offset is required by activation_mode Swish (its backward "
                               "recomputes z = bn(x) + side_input)");
    }
    if (in.offset != nullptr &&
        (in.offset->size() != 1 || (*in.offset)[0] != shape.channels)) {
      return ValidationFailure("offset must have shape [" + std::to_string(shape.channels) +
                               "] (the channel count of x), got shape " +
                               ShapeString(*in.offset));
    }
  }
  ValidationResult r;
  r.shape = shape;
  return r;
}

// ---- 16-bit conversions (round to nearest even) ----------------------------------------

namespace {
inline uint32_t FloatBits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}
inline float BitsFloat(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
}  // namespace

float HalfToFloat(half_t h) {
  const uint32_t sign = static_cast<uint32_t>(h.bits & 0x8000u) << 16;
  const uint32_t exp = (h.bits >> 10) & 0x1fu;
  const uint32_t mant = h.bits & 0x3ffu;
  if (exp == 0) {  // zero or subnormal: mant * 2^-24 is exact in float
    const float v = static_cast<float>(mant) * 5.9604644775390625e-8f;
    return BitsFloat(FloatBits(v) | sign);
  }
  if (exp == 31) {  // inf, or NaN made quiet (as the F16C instruction does)
    return BitsFloat(sign | 0x7f800000u | (mant << 13) | (mant ? 0x400000u : 0u));
  }
  return BitsFloat(sign | ((exp + 112u) << 23) | (mant << 13));
}

half_t FloatToHalf(float f) {
  uint32_t u = FloatBits(f);
  const uint16_t sign = static_cast<uint16_t>((u >> 16) & 0x8000u);
  u &= 0x7fffffffu;
  half_t h;
  if (u >= 0x7f800000u) {  // inf or NaN (quiet, top payload bits kept)
    h.bits = sign | 0x7c00u | (u > 0x7f800000u ? (0x200u | ((u >> 13) & 0x3ffu)) : 0u);
  } else if (u >= 0x477ff000u) {  // rounds to beyond the largest half: inf
    h.bits = sign | 0x7c00u;
  } else if (u < 0x38800000u) {  // result is subnormal or zero: let the FPU round
    const float v = BitsFloat(u) + 0.5f;
    h.bits = sign | static_cast<uint16_t>(FloatBits(v) - 0x3f000000u);
  } else {
    const uint32_t odd = (u >> 13) & 1u;
    u += 0xc8000fffu;  // rebias exponent (-112 << 23) and add half an ulp minus one
    u += odd;
    h.bits = sign | static_cast<uint16_t>(u >> 13);
  }
  return h;
}

float BFloat16ToFloat(bfloat16_t h) { return BitsFloat(static_cast<uint32_t>(h.bits) << 16); }

bfloat16_t FloatToBFloat16(float f) {
  const uint32_t u = FloatBits(f);
  bfloat16_t h;
  if ((u & 0x7fffffffu) > 0x7f800000u) {
    h.bits = static_cast<uint16_t>((u >> 16) | 0x40u);
  } else {
    h.bits = static_cast<uint16_t>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
  }
  return h;
}

// ---- task runner -------------------------------------------------------------------------

namespace {

// Worker threads kept for the life of the process. Starting and joining a thread on every
// Run cost 20-50 us per pass, a tenth of a 1M-element backward. Between runs a worker spins
// for up to kPoolSpin, then sleeps on a condition variable, so an idle pool takes no CPU
// after that; the caller likewise spins for up to kPoolSpin for the workers to finish before
// it sleeps. Sleeping at once cost a futex sleep and wake per pass on each side: on a 2-core
// VM a 73K-element forward took 143 us on 2 threads against 30 us on 1 (docs/PERFORMANCE_NOTES.md,
// "Spin before sleeping").
class WorkerPool {
 public:
  // Never destroyed: at exit the threads are still blocked in Loop, and destroying a
  // joinable std::thread would terminate the process.
  static WorkerPool& Instance() {
    static const bool registered = [] {
      // A forked child has none of the parent's threads: give it a fresh, empty pool (the
      // old one is abandoned, whatever state its mutexes were in).
      pthread_atfork(nullptr, nullptr, [] { instance_ = new WorkerPool; });
      return true;
    }();
    (void)registered;
    static std::once_flag once;
    std::call_once(once, [] {
      if (instance_ == nullptr) instance_ = new WorkerPool;
    });
    return *instance_;
  }

  // Runs `work` on `extra` pool threads and on the calling thread; returns when all are done.
  void Run(int extra, const std::function<void()>& work) {
    std::lock_guard<std::mutex> one_run_at_a_time(run_mu_);
    {
      std::lock_guard<std::mutex> lk(mu_);
      while (static_cast<int>(threads_.size()) < extra) {
        const int index = static_cast<int>(threads_.size());
        threads_.emplace_back([this, index, seen = generation_.load()] { Loop(index, seen); });
      }
      work_ = &work;
      wanted_ = extra;
      running_.store(extra, std::memory_order_relaxed);
      generation_.store(generation_.load(std::memory_order_relaxed) + 1,
                        std::memory_order_release);
    }
    wake_.notify_all();  // no system call while every worker is still spinning
    work();
    const auto finished = [this] { return running_.load(std::memory_order_acquire) == 0; };
    const bool spun = SpinUntil(finished, kPoolSpin);
    std::unique_lock<std::mutex> lk(mu_);
    if (!spun) done_.wait(lk, finished);
    work_ = nullptr;
  }

 private:
  void Loop(int index, uint64_t seen) {
    const auto started = [&] { return generation_.load(std::memory_order_acquire) != seen; };
    for (;;) {
      SpinUntil(started, kPoolSpin);
      std::unique_lock<std::mutex> lk(mu_);
      wake_.wait(lk, started);
      // Read under mu_: the run's generation, width and work are set together.
      seen = generation_.load(std::memory_order_relaxed);
      if (index >= wanted_) continue;
      const std::function<void()>* work = work_;
      lk.unlock();
      (*work)();
      lk.lock();
      // release: the caller, seeing 0 while it spins, reads what this worker wrote.
      if (running_.fetch_sub(1, std::memory_order_release) == 1) done_.notify_one();
    }
  }

  static constexpr std::chrono::microseconds kPoolSpin{100};

  static WorkerPool* instance_;
  std::mutex run_mu_;  // a second caller (another Python thread) waits for the first
  std::mutex mu_;
  std::condition_variable wake_, done_;
  std::vector<std::thread> threads_;
  const std::function<void()>* work_ = nullptr;
  std::atomic<uint64_t> generation_{0};  // changed under mu_, read also without it
  int wanted_ = 0;   // pool threads taking part in the current run
  std::atomic<int> running_{0};  // of those, the ones not finished yet (changed under mu_)
};

WorkerPool* WorkerPool::instance_ = nullptr;

}  // namespace

void ThreadRunner::Run(int64_t num_tasks, int64_t cost_per_task,
                       const std::function<void(int64_t, int64_t)>& fn) const {
  if (num_tasks <= 0) return;
  const int64_t threads = TaskThreads(num_tasks, cost_per_task, num_threads_);
  if (threads <= 1) {
    fn(0, num_tasks);
    return;
  }
  // Dynamic claiming of small blocks: any partition gives the same result.
  const int64_t block = TaskBlock(num_tasks, threads);
  std::atomic<int64_t> next{0};
  const std::function<void()> worker = [&]() {
    for (;;) {
      const int64_t b = next.fetch_add(block);
      if (b >= num_tasks) return;
      fn(b, std::min(num_tasks, b + block));
    }
  };
  WorkerPool::Instance().Run(static_cast<int>(threads - 1), worker);
}

// ---- instruction-set dispatch --------------------------------------------------------------

const char* CpuIsaName(CpuIsa isa) {
  switch (isa) {
    case CpuIsa::kBaseline: return "baseline";
    case CpuIsa::kAvx2: return "avx2";
    case CpuIsa::kAvx512: return "avx512";
    case CpuIsa::kAvx512Bf16: return "avx512bf16";
  }
  return "?";
}

bool ParseCpuIsa(const std::string& name, CpuIsa* out) {
  for (CpuIsa isa : kCpuIsas) {
    if (name == CpuIsaName(isa)) {
      *out = isa;
      return true;
    }
  }
  if (name == "scalar") {
    *out = CpuIsa::kBaseline;
    return true;
  }
  return false;
}

bool CpuSupports(CpuIsa isa) {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_cpu_init();
  switch (isa) {
    case CpuIsa::kBaseline: return true;
    case CpuIsa::kAvx2:
      return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
             __builtin_cpu_supports("f16c");
    case CpuIsa::kAvx512:
      return CpuSupports(CpuIsa::kAvx2) && __builtin_cpu_supports("avx512f") &&
             __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl") &&
             __builtin_cpu_supports("avx512dq");
    case CpuIsa::kAvx512Bf16:
      return CpuSupports(CpuIsa::kAvx512) && __builtin_cpu_supports("avx512bf16");
  }
  return false;
#else
  return isa == CpuIsa::kBaseline;
#endif
}

namespace {
CpuIsa BestIsa() {
  if (CpuSupports(CpuIsa::kAvx512Bf16)) return CpuIsa::kAvx512Bf16;
  if (CpuSupports(CpuIsa::kAvx512)) return CpuIsa::kAvx512;
  if (CpuSupports(CpuIsa::kAvx2)) return CpuIsa::kAvx2;
  return CpuIsa::kBaseline;
}
}  // namespace

CpuIsa DefaultCpuIsa() {
  static const CpuIsa chosen = [] {
    const CpuIsa best = BestIsa();
    const char* env = std::getenv("FBN_GRAD_TF_ISA");
    if (env == nullptr || *env == '\0' || std::strcmp(env, "auto") == 0) return best;
    CpuIsa want;
    if (!ParseCpuIsa(env, &want)) {
      std::fprintf(stderr,
                   "fbn_grad_tf: ignoring FBN_GRAD_TF_ISA=%s (expected baseline, avx2, avx512, "
                   "avx512bf16 or auto); using %s\n",
                   env, CpuIsaName(best));
      return best;
    }
    if (!CpuSupports(want)) {
      std::fprintf(stderr, "fbn_grad_tf: FBN_GRAD_TF_ISA=%s is not supported by this CPU; "
                   "using %s\n", env, CpuIsaName(best));
      return best;
    }
    return want;
  }();
  return chosen;
}

namespace {
// An on | off | auto switch from the environment variable `name` (also 1 | 0; unset or empty
// is auto): the value, or `auto_value` for auto; anything else is reported and taken as auto.
bool OnOffAutoSwitch(const char* name, bool auto_value) {
  const char* env = std::getenv(name);
  if (env == nullptr || *env == '\0' || std::strcmp(env, "auto") == 0) return auto_value;
  if (std::strcmp(env, "on") == 0 || std::strcmp(env, "1") == 0) return true;
  if (std::strcmp(env, "off") == 0 || std::strcmp(env, "0") == 0) return false;
  std::fprintf(stderr,
               "fbn_grad_tf: ignoring %s=%s (expected on, off or auto); using %s\n", name,
               env, auto_value ? "on" : "off");
  return auto_value;
}
}  // namespace

bool SoftwarePrefetch() {
  static const bool chosen = [] {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_cpu_init();
    const bool by_vendor = !__builtin_cpu_is("amd");
#else
    const bool by_vendor = true;
#endif
    return OnOffAutoSwitch("FBN_GRAD_TF_PREFETCH", by_vendor);
  }();
  return chosen;
}

namespace {
constexpr int64_t kMiB = int64_t{1} << 20;

int64_t LastLevelCacheBytes() {
#if defined(_SC_LEVEL3_CACHE_SIZE)
  const long l3 = sysconf(_SC_LEVEL3_CACHE_SIZE);
  if (l3 > 0) return l3;
#endif
  return 0;
}

// A size from the environment variable `name`: a plain decimal number of `unit` bytes
// (digits and at most one point: no sign, space, exponent or hex, which strtod would take;
// parsed by hand, as strtod's decimal point follows the locale), or -1 when unset, empty or
// "auto". Anything else is reported and taken as auto.
int64_t EnvBytes(const char* name, int64_t unit, const char* unit_name) {
  const char* env = std::getenv(name);
  if (env == nullptr || *env == '\0' || std::strcmp(env, "auto") == 0) return int64_t{-1};
  double value = 0.0, place = 1.0;
  bool digits = false, point = false, ok = true;
  for (const char* c = env; *c != '\0' && ok; ++c) {
    if (*c >= '0' && *c <= '9') {
      digits = true;
      if (point) place /= 10.0;
      value = point ? value + (*c - '0') * place : value * 10.0 + (*c - '0');
    } else if (*c == '.' && !point) {
      point = true;
    } else {
      ok = false;
    }
  }
  if (!ok || !digits || value > 1e9) {
    std::fprintf(stderr, "fbn_grad_tf: ignoring %s=%s (expected a number of %s >= 0, or auto)\n",
                 name, env, unit_name);
    return int64_t{-1};
  }
  return static_cast<int64_t>(value * static_cast<double>(unit));
}
}  // namespace

int64_t StreamMinBytes(int itemsize) {
  // -1: no override; otherwise the threshold for every type.
  static const int64_t forced = EnvBytes("FBN_GRAD_TF_STREAM_MIB", kMiB, "MiB");
  static const int64_t half_bytes = std::max(8 * kMiB, LastLevelCacheBytes() / 10);
  if (forced >= 0) return forced;
  return itemsize >= 4 ? 8 * kMiB : half_bytes;
}

int64_t ChannelMajorMaxBytes() {
  static const int64_t bytes = [] {
    const int64_t forced = EnvBytes("FBN_GRAD_TF_CHANNEL_MAJOR_KIB", 1024, "KiB");
    if (forced >= 0) return forced;
    return SoftwarePrefetch() ? int64_t{0} : 4 * kMiB;
  }();
  return bytes;
}

namespace {
std::atomic<int64_t> g_streamed_outputs{0};
constexpr int kBnOps = 2;
std::atomic<int64_t> g_channel_major_calls[kBnOps] = {{0}, {0}};  // by BnOp
}  // namespace

void CountStreamedOutput() { g_streamed_outputs.fetch_add(1, std::memory_order_relaxed); }

int64_t StreamedOutputCount() { return g_streamed_outputs.load(std::memory_order_relaxed); }

void CountChannelMajorCall(BnOp op) {
  g_channel_major_calls[static_cast<int>(op)].fetch_add(1, std::memory_order_relaxed);
}

int64_t ChannelMajorCallCount(BnOp op) {
  return g_channel_major_calls[static_cast<int>(op)].load(std::memory_order_relaxed);
}

bool HugePageAdvice() {
  static const bool chosen = OnOffAutoSwitch("FBN_GRAD_TF_HUGEPAGES", true);
  return chosen;
}

#if defined(__linux__) && defined(MADV_HUGEPAGE)
namespace {
// The transparent huge page size (2 MiB on x86-64; larger on some arm64 kernels).
uintptr_t HugePageBytes() {
  static const uintptr_t bytes = [] {
    uintptr_t b = uintptr_t{2} << 20;
    if (FILE* f = std::fopen("/sys/kernel/mm/transparent_hugepage/hpage_pmd_size", "r")) {
      unsigned long long v = 0;
      // A power of two of at least a page; anything else keeps the x86-64 size.
      if (std::fscanf(f, "%llu", &v) == 1 && v >= 4096 && (v & (v - 1)) == 0) {
        b = static_cast<uintptr_t>(v);
      }
      std::fclose(f);
    }
    return b;
  }();
  return bytes;
}
}  // namespace
#endif

void AdviseHugePages(void* data, int64_t bytes) {
#if defined(__linux__) && defined(MADV_HUGEPAGE)
  if (data == nullptr || bytes < kHugePageAdviceMinBytes || !HugePageAdvice()) return;
  const uintptr_t huge = HugePageBytes();
  const uintptr_t start = reinterpret_cast<uintptr_t>(data);
  const uintptr_t begin = (start + huge - 1) & ~(huge - 1);
  const uintptr_t end = (start + static_cast<uintptr_t>(bytes)) & ~(huge - 1);
  if (end <= begin) return;
  // Advice only: a kernel without THP, or one that refuses, leaves the buffer as it was
  // (tests/test_hugepages.py reads the result in /proc/self/smaps).
  (void)madvise(reinterpret_cast<void*>(begin), end - begin, MADV_HUGEPAGE);
#else
  (void)data;
  (void)bytes;
#endif
}

template <typename T>
cpu::KernelSet<T> cpu::KernelsFor(CpuIsa isa) {
  // An unsupported request falls back to the best supported path.
  switch (CpuSupports(isa) ? isa : BestIsa()) {
    case CpuIsa::kAvx512Bf16: return avx512bf16::Kernels<T>();
    case CpuIsa::kAvx512: return avx512::Kernels<T>();
    case CpuIsa::kAvx2: return avx2::Kernels<T>();
    case CpuIsa::kBaseline: break;
  }
  return baseline::Kernels<T>();
}
template cpu::KernelSet<float> cpu::KernelsFor<float>(CpuIsa);
template cpu::KernelSet<half_t> cpu::KernelsFor<half_t>(CpuIsa);
template cpu::KernelSet<bfloat16_t> cpu::KernelsFor<bfloat16_t>(CpuIsa);

}  // namespace fbn
