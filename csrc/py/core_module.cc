// pybind11 module fbn_grad_tf._core: the framework-free core for Python, without
// TensorFlow. Functions take raw addresses plus shapes; python/fbn_grad_tf/core.py turns
// NumPy arrays and device arrays (PyTorch, CuPy, __cuda_array_interface__) into them and
// owns every buffer. Validation is the core's own, so errors match the TF op's.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cmath>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <vector>

#include "../core/activation.h"
#include "../core/backward.h"
#include "../core/forward.h"
#if FBN_WITH_CUDA
#include "../core/cuda/backward.h"
#include "../core/cuda/forward.h"
#endif

namespace py = pybind11;

namespace {

fbn::DataFormat Format(const std::string& s) {
  fbn::DataFormat f;
  if (!fbn::ParseDataFormat(s, &f)) {
    throw py::value_error("data_format must be one of NHWC, NCHW, NDHWC, NCDHW, got '" + s +
                          "'");
  }
  return f;
}

fbn::CpuIsa Isa(const std::string& s) {
  if (s == "auto") return fbn::DefaultCpuIsa();
  fbn::CpuIsa isa;
  if (fbn::ParseCpuIsa(s, &isa)) return isa;
  throw py::value_error("isa must be auto, baseline, avx2, avx512 or avx512bf16, got '" + s + "'");
}

fbn::SavedStat Stat(const std::string& s) {
  if (s == "variance") return fbn::SavedStat::kVariance;
  if (s == "inv_std") return fbn::SavedStat::kInvStd;
  throw py::value_error("saved_stat must be 'variance' or 'inv_std', got '" + s + "'");
}

// Shapes of (dy, x, scale, rs1, rs2) -> BnShape, or ValueError with the core's message.
fbn::BnShape Validate(const std::vector<std::vector<int64_t>>& shapes, const std::string& format,
                      float epsilon) {
  if (shapes.size() != 5) throw py::value_error("expected the shapes of 5 inputs");
  const fbn::ValidationResult v = fbn::ValidateBnGradInputs(
      shapes[0], shapes[1], shapes[2], shapes[3], shapes[4], Format(format), epsilon);
  if (!v.ok) throw py::value_error(v.error);
  return v.shape;
}

fbn::Activation ParseAct(const std::string& s) {
  fbn::Activation a;
  if (!fbn::ParseActivation(s, &a)) throw py::value_error(fbn::UnknownActivationMessage(s));
  return a;
}

// The fused backward's extra inputs: shapes[5..7] are those of y, offset, side_input, each
// used where present[0..2] says so; present[3]: side_input_backprop is wanted. Validated by
// the core's ValidateExInputs (the TF op's checks and messages).
void ValidateGradEx(const std::vector<std::vector<int64_t>>& shapes, const fbn::BnShape& shape,
                    fbn::Activation act, const std::vector<bool>& present) {
  if (shapes.size() != 8 || present.size() != 4) {
    throw py::value_error("expected the shapes of 8 inputs and 4 presence flags");
  }
  fbn::ExInputs ex;
  ex.backward = true;
  ex.num_side_inputs = (present[2] || present[3]) ? 1 : 0;
  if (present[0]) ex.y = &shapes[5];
  if (present[1]) ex.offset = &shapes[6];
  if (present[2]) ex.side_input = &shapes[7];
  const fbn::ValidationResult v = fbn::ValidateExInputs(shapes[1], shape, act, ex);
  if (!v.ok) throw py::value_error(v.error);
}

// Where a binding's address list holds each buffer of BnGradArgs: a position, or -1 where
// the binding has no such buffer. The list has either `required` addresses or `all`; a
// position at or past the list's end is an optional buffer the caller left out (null).
struct GradArgSlots {
  size_t required, all;
  int dy, x, scale, saved_mean, saved_var, dx, dscale, doffset;
  int y, offset, side_input, side_input_backprop;
};

// The address lists of the backward bindings:
//   bn_grad_*_raw: dy, x, scale, rs1, rs2, dx, dscale, doffset[, y, offset, side_input,
//     side_input_backprop (0: absent)];
//   bn_grad_reduce_cpu_raw: dy, x, mean, sum_dy (out), sum_dy_xmu (out)[, relu_y];
//   bn_grad_apply_cpu_raw: dy, x, scale, mean, variance, sum_dy, sum_dy_xmu, dx (out)
//     [, relu_y].
// The split ops' sums are not BnGradArgs buffers: their bindings pass them themselves.
// Columns in GradArgSlots' order: required, all; dy, x, scale, saved_mean, saved_var, dx,
// dscale, doffset; y, offset, side_input, side_input_backprop.
constexpr GradArgSlots kGradSlots   = {8, 12,  0, 1,  2, 3,  4,  5,  6,  7,   8,  9, 10, 11};
constexpr GradArgSlots kReduceSlots = {5,  6,  0, 1, -1, 2, -1, -1, -1, -1,   5, -1, -1, -1};
constexpr GradArgSlots kApplySlots  = {8,  9,  0, 1,  2, 3,  4,  7, -1, -1,   8, -1, -1, -1};

// ValueError unless the address list `p` has as many addresses as `at` allows.
void CheckAddressCount(const std::vector<uintptr_t>& p, const GradArgSlots& at) {
  if (p.size() != at.required && p.size() != at.all) {
    throw py::value_error("expected " + std::to_string(at.required) + " or " +
                          std::to_string(at.all) + " buffer addresses");
  }
}

// The BnGradArgs of the addresses `p` laid out as `at` says (CheckAddressCount first).
template <typename T>
fbn::BnGradArgs<T> ArgsAt(const std::vector<uintptr_t>& p, const GradArgSlots& at) {
  CheckAddressCount(p, at);
  const auto addr = [&](int i) {
    return i >= 0 && static_cast<size_t>(i) < p.size() ? p[i] : uintptr_t{0};
  };
  fbn::BnGradArgs<T> a;
  a.dy = reinterpret_cast<const T*>(addr(at.dy));
  a.x = reinterpret_cast<const T*>(addr(at.x));
  a.scale = reinterpret_cast<const float*>(addr(at.scale));
  a.saved_mean = reinterpret_cast<const float*>(addr(at.saved_mean));
  a.saved_var = reinterpret_cast<const float*>(addr(at.saved_var));
  a.dx = reinterpret_cast<T*>(addr(at.dx));
  a.dscale = reinterpret_cast<float*>(addr(at.dscale));
  a.doffset = reinterpret_cast<float*>(addr(at.doffset));
  a.y = reinterpret_cast<const T*>(addr(at.y));
  a.offset = reinterpret_cast<const float*>(addr(at.offset));
  a.side_input = reinterpret_cast<const T*>(addr(at.side_input));
  a.side_input_backprop = reinterpret_cast<T*>(addr(at.side_input_backprop));
  return a;
}

template <typename T>
fbn::BnGradArgs<T> Args(const std::vector<uintptr_t>& p) {
  return ArgsAt<T>(p, kGradSlots);
}

// Calls fn(T{}) with the core storage type named by dtype (a null pointer of it).
template <typename Fn>
auto WithDtype(const std::string& dtype, Fn&& fn) {
  if (dtype == "float32") return fn(static_cast<float*>(nullptr));
  if (dtype == "float16") return fn(static_cast<fbn::half_t*>(nullptr));
  if (dtype == "bfloat16") return fn(static_cast<fbn::bfloat16_t*>(nullptr));
  throw py::type_error("dtype must be float32, float16 or bfloat16, got " + dtype);
}

// What every CPU backward binding does once its params are validated: picks the ISA path
// and the runner, takes the BnGradArgs of dtype from the addresses laid out as `slots`, and
// runs kernel(args, runner, isa) with the GIL released.
template <typename Kernel>
void RunGradCpu(const std::string& dtype, const std::vector<uintptr_t>& ptrs,
                const GradArgSlots& slots, int num_threads, const std::string& isa,
                Kernel&& kernel) {
  const fbn::CpuIsa cpu_isa = Isa(isa);
  const fbn::ThreadRunner runner(num_threads);
  WithDtype(dtype, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    const fbn::BnGradArgs<T> args = ArgsAt<T>(ptrs, slots);
    py::gil_scoped_release release;
    kernel(args, runner, cpu_isa);
  });
}

// ---- forward -------------------------------------------------------------------------------

// Shapes of (x, scale, offset, mean, variance) -> params, or ValueError with the core's
// message (the same validation as the TF op).
fbn::BnForwardParams ForwardParams(const std::vector<std::vector<int64_t>>& shapes,
                                   const std::string& format, float epsilon, float factor,
                                   bool is_training, const std::string& activation,
                                   const std::string& saved_stat) {
  if (shapes.size() != 5 && shapes.size() != 6) {
    throw py::value_error("expected the shapes of 5 or 6 inputs");
  }
  const fbn::ValidationResult v = fbn::ValidateBnForwardInputs(
      shapes[0], shapes[1], shapes[2], shapes[3], shapes[4], Format(format), epsilon, factor,
      is_training);
  if (!v.ok) throw py::value_error(v.error);
  fbn::BnForwardParams p;
  p.shape = v.shape;
  p.epsilon = epsilon;
  p.exponential_avg_factor = factor;
  p.is_training = is_training;
  p.saved_stat = Stat(saved_stat);
  p.activation = ParseAct(activation);
  // shapes[5]: the side input (y = act(bn(x) + side_input)).
  fbn::ExInputs ex;
  if (shapes.size() == 6) {
    ex.num_side_inputs = 1;
    ex.side_input = &shapes[5];
  }
  const fbn::ValidationResult vx = fbn::ValidateExInputs(shapes[0], v.shape, p.activation, ex);
  if (!vx.ok) throw py::value_error(vx.error);
  return p;
}

// Addresses of x, scale, offset, mean, variance, y, batch_mean, batch_variance, saved_mean,
// saved_var[, side_input] (mean/variance may be 0 when the params do not read them).
template <typename T>
fbn::BnForwardArgs<T> ForwardArgs(const std::vector<uintptr_t>& p) {
  if (p.size() != 10 && p.size() != 11) throw py::value_error("expected 10 or 11 buffer addresses");
  fbn::BnForwardArgs<T> a;
  a.x = reinterpret_cast<const T*>(p[0]);
  a.scale = reinterpret_cast<const float*>(p[1]);
  a.offset = reinterpret_cast<const float*>(p[2]);
  a.running_mean = reinterpret_cast<const float*>(p[3]);
  a.running_var = reinterpret_cast<const float*>(p[4]);
  a.y = reinterpret_cast<T*>(p[5]);
  a.batch_mean = reinterpret_cast<float*>(p[6]);
  a.batch_variance = reinterpret_cast<float*>(p[7]);
  a.saved_mean = reinterpret_cast<float*>(p[8]);
  a.saved_var = reinterpret_cast<float*>(p[9]);
  if (p.size() == 11) a.side_input = reinterpret_cast<const T*>(p[10]);
  return a;
}

void BnForwardCpuRaw(const std::string& dtype, const std::vector<uintptr_t>& ptrs,
                     const std::vector<std::vector<int64_t>>& shapes, const std::string& format,
                     float epsilon, float factor, bool is_training, const std::string& activation,
                     const std::string& saved_stat, int num_threads, const std::string& isa,
                     uintptr_t act_mask) {
  const fbn::BnForwardParams params =
      ForwardParams(shapes, format, epsilon, factor, is_training, activation, saved_stat);
  const fbn::CpuIsa cpu_isa = Isa(isa);
  const fbn::ThreadRunner runner(num_threads);
  if (act_mask != 0 && params.activation != fbn::Activation::kRelu &&
      params.activation != fbn::Activation::kRelu6) {
    throw py::value_error("an activation mask is written for relu and relu6 only");
  }
  WithDtype(dtype, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    fbn::BnForwardArgs<T> args = ForwardArgs<T>(ptrs);
    // act_mask: ActivationMaskFloats(elements) words (core/activation.h); tagged here, as
    // the TF op tags its reserve_space_3 (for an empty x too: the tag words alone).
    args.act_mask = reinterpret_cast<uint32_t*>(act_mask);
    if (args.act_mask != nullptr) {
      fbn::SetActivationMaskTag(args.act_mask, params.shape.elements(), params.activation);
    }
    py::gil_scoped_release release;
    fbn::BnForwardCpu(params, args, runner, cpu_isa);
  });
}

fbn::BnGradParams Params(const fbn::BnShape& s, float epsilon, bool is_training,
                         const std::string& saved_stat,
                         const std::string& activation = "Identity") {
  fbn::BnGradParams p;
  p.activation = ParseAct(activation);
  p.shape = s;
  p.epsilon = epsilon;
  p.is_training = is_training;
  p.saved_stat = Stat(saved_stat);
  return p;
}

// The base validation of a backward call (shapes[0..4]) and, with 8 shapes, the fused
// inputs' (ValidateGradEx).
fbn::BnGradParams GradParams(const std::vector<std::vector<int64_t>>& shapes,
                             const std::string& format, float epsilon, bool is_training,
                             const std::string& saved_stat, const std::string& activation,
                             const std::vector<bool>& present) {
  if (shapes.size() != 5 && shapes.size() != 8) {
    throw py::value_error("expected the shapes of 5 or 8 inputs");
  }
  const std::vector<std::vector<int64_t>> base(shapes.begin(), shapes.begin() + 5);
  const fbn::BnGradParams params =
      Params(Validate(base, format, epsilon), epsilon, is_training, saved_stat, activation);
  if (shapes.size() == 8) {
    ValidateGradEx(shapes, params.shape, params.activation, present);
  } else if (params.activation != fbn::Activation::kIdentity) {
    throw py::value_error(std::string("activation_mode ") +
                          fbn::ActivationName(params.activation) +
                          " needs the fused inputs (y, offset, side_input)");
  }
  return params;
}

void BnGradCpuRaw(const std::string& dtype, const std::vector<uintptr_t>& ptrs,
                  const std::vector<std::vector<int64_t>>& shapes, const std::string& format,
                  float epsilon, bool is_training, const std::string& saved_stat,
                  int num_threads, const std::string& isa, const std::string& activation,
                  const std::vector<bool>& present, uintptr_t act_mask, int64_t act_mask_floats) {
  const fbn::BnGradParams params =
      GradParams(shapes, format, epsilon, is_training, saved_stat, activation, present);
  // act_mask: the forward's Relu/Relu6 mask (core/activation.h), read instead of y; as the
  // TF op, anything that is not a mask of this many elements for this activation is refused.
  const uint32_t* mask = reinterpret_cast<const uint32_t*>(act_mask);
  if (mask != nullptr && !fbn::IsActivationMask(mask, act_mask_floats, params.shape.elements(),
                                                params.activation)) {
    throw py::value_error("act_mask is not the forward's activation mask of these " +
                          std::to_string(params.shape.elements()) + " elements for " +
                          fbn::ActivationName(params.activation));
  }
  RunGradCpu(dtype, ptrs, kGradSlots, num_threads, isa,
             [&](const auto& args, const fbn::TaskRunner& runner, fbn::CpuIsa cpu_isa) {
               auto with_mask = args;
               with_mask.act_mask = mask;
               fbn::BnGradCpu(params, with_mask, runner, cpu_isa);
             });
}

#if FBN_WITH_CUDA
size_t CudaForwardWorkspaceBytes(const std::vector<std::vector<int64_t>>& shapes,
                                 const std::string& format, float epsilon, float factor,
                                 bool is_training) {
  return fbn::BnForwardCudaWorkspaceBytes(
      ForwardParams(shapes, format, epsilon, factor, is_training, "Identity", "inv_std"));
}

void BnForwardCudaRaw(const std::string& dtype, const std::vector<uintptr_t>& ptrs,
                      const std::vector<std::vector<int64_t>>& shapes, const std::string& format,
                      float epsilon, float factor, bool is_training,
                      const std::string& activation, const std::string& saved_stat,
                      uintptr_t workspace, size_t workspace_bytes, uintptr_t stream) {
  const fbn::BnForwardParams params =
      ForwardParams(shapes, format, epsilon, factor, is_training, activation, saved_stat);
  if (workspace_bytes < fbn::BnForwardCudaWorkspaceBytes(params)) {
    throw py::value_error("workspace too small");
  }
  const int err = WithDtype(dtype, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    const fbn::BnForwardArgs<T> args = ForwardArgs<T>(ptrs);
    py::gil_scoped_release release;
    return fbn::BnForwardCuda(params, args, reinterpret_cast<void*>(workspace), workspace_bytes,
                              reinterpret_cast<void*>(stream));
  });
  if (err != 0) throw std::runtime_error(std::string("CUDA error: ") + fbn::CudaErrorString(err));
}

size_t CudaWorkspaceBytes(const std::vector<std::vector<int64_t>>& shapes,
                          const std::string& format, float epsilon) {
  fbn::BnGradParams p;
  p.shape = Validate(shapes, format, epsilon);
  return fbn::BnGradCudaWorkspaceBytes(p);
}

void BnGradCudaRaw(const std::string& dtype, const std::vector<uintptr_t>& ptrs,
                   const std::vector<std::vector<int64_t>>& shapes, const std::string& format,
                   float epsilon, bool is_training, const std::string& saved_stat,
                   uintptr_t workspace, size_t workspace_bytes, uintptr_t stream,
                   const std::string& activation, const std::vector<bool>& present) {
  const fbn::BnGradParams params =
      GradParams(shapes, format, epsilon, is_training, saved_stat, activation, present);
  if (workspace_bytes < fbn::BnGradCudaWorkspaceBytes(params)) {
    throw py::value_error("workspace too small");
  }
  void* ws = reinterpret_cast<void*>(workspace);
  void* st = reinterpret_cast<void*>(stream);
  int err;
  {
    py::gil_scoped_release release;
    if (dtype == "float32") {
      err = fbn::BnGradCuda(params, Args<float>(ptrs), ws, workspace_bytes, st);
    } else if (dtype == "float16") {
      err = fbn::BnGradCuda(params, Args<fbn::half_t>(ptrs), ws, workspace_bytes, st);
    } else if (dtype == "bfloat16") {
      err = fbn::BnGradCuda(params, Args<fbn::bfloat16_t>(ptrs), ws, workspace_bytes, st);
    } else {
      err = -1;
    }
  }
  if (err == -1) throw py::type_error("dtype must be float32, float16 or bfloat16, got " + dtype);
  if (err != 0) throw std::runtime_error(std::string("CUDA error: ") + fbn::CudaErrorString(err));
}
#endif

// ---- split backward (reduce / apply), CPU ---------------------------------------------------
// The entry points of backward.h used by cross-replica batch norm (BnGradReduceCpu,
// BnGradApplyCpu), validated exactly like the TF ops FbnGrad>BatchNormGradReduce/Apply
// (fbn_grad_op.cc: ValidateBnInputs with the same vector names; Reduce has no epsilon).

// Shapes of (y_backprop, x, vectors...) named `names` -> BnShape, or ValueError.
fbn::BnShape ValidateSplit(const std::vector<std::vector<int64_t>>& shapes,
                           const std::vector<const char*>& names, const std::string& format,
                           float epsilon) {
  if (shapes.size() != names.size() + 2) {
    throw py::value_error("expected the shapes of " + std::to_string(names.size() + 2) +
                          " inputs");
  }
  std::vector<fbn::NamedDims> vecs;
  for (size_t i = 0; i < names.size(); ++i) vecs.push_back({names[i], &shapes[i + 2]});
  const fbn::ValidationResult v =
      fbn::ValidateBnInputs(shapes[0], shapes[1], vecs, Format(format), epsilon);
  if (!v.ok) throw py::value_error(v.error);
  return v.shape;
}

fbn::BnGradParams SplitParams(const fbn::BnShape& s, float epsilon) {
  fbn::BnGradParams p;
  p.shape = s;
  p.epsilon = epsilon;
  p.is_training = true;
  p.saved_stat = fbn::SavedStat::kVariance;
  return p;
}

// ptrs: dy, x, mean, sum_dy (out), sum_dy_xmu (out)[, relu_y]. Returns the count (elements
// per channel, as the TF op's float output).
float BnGradReduceCpuRaw(const std::string& dtype, const std::vector<uintptr_t>& ptrs,
                         const std::vector<std::vector<int64_t>>& shapes,
                         const std::string& format, int num_threads, const std::string& isa) {
  const GradArgSlots& slots = kReduceSlots;
  CheckAddressCount(ptrs, slots);  // before the count of addresses picks the activation
  fbn::BnGradParams params = SplitParams(ValidateSplit(shapes, {"mean"}, format, 0.0f), 0.0f);
  if (ptrs.size() == 6) params.activation = fbn::Activation::kRelu;  // the fused ReLU's mask
  RunGradCpu(dtype, ptrs, slots, num_threads, isa,
             [&](const auto& args, const fbn::TaskRunner& runner, fbn::CpuIsa cpu_isa) {
               fbn::BnGradReduceCpu(params, args, reinterpret_cast<float*>(ptrs[3]),
                                    reinterpret_cast<float*>(ptrs[4]), runner, cpu_isa);
             });
  return static_cast<float>(params.shape.per_channel());
}

// ptrs: dy, x, scale, mean, variance, sum_dy, sum_dy_xmu, dx (out)[, relu_y].
void BnGradApplyCpuRaw(const std::string& dtype, const std::vector<uintptr_t>& ptrs,
                       const std::vector<std::vector<int64_t>>& shapes, float count,
                       const std::string& format, float epsilon, int num_threads,
                       const std::string& isa) {
  const GradArgSlots& slots = kApplySlots;
  CheckAddressCount(ptrs, slots);  // before the count of addresses picks the activation
  fbn::BnGradParams params = SplitParams(
      ValidateSplit(shapes, {"scale", "mean", "variance", "sum_dy", "sum_dy_xmu"}, format,
                    epsilon),
      epsilon);
  if (ptrs.size() == 9) params.activation = fbn::Activation::kRelu;  // the fused ReLU's mask
  if (params.shape.elements() != 0 && !(std::isfinite(count) && count >= 1.0f)) {
    throw py::value_error(
        "count must be a finite number >= 1 (elements per channel over all replicas), got " +
        py::str(py::float_(count)).cast<std::string>());
  }
  RunGradCpu(dtype, ptrs, slots, num_threads, isa,
             [&](const auto& args, const fbn::TaskRunner& runner, fbn::CpuIsa cpu_isa) {
               fbn::BnGradApplyCpu(params, args, reinterpret_cast<const float*>(ptrs[5]),
                                   reinterpret_cast<const float*>(ptrs[6]), count, runner,
                                   cpu_isa);
             });
}

void DefineSplitBindings(py::module_& m) {
  m.def("validate_split",
        [](const std::vector<std::vector<int64_t>>& shapes, bool apply, const std::string& format,
           float epsilon) {
          const std::vector<const char*> names =
              apply ? std::vector<const char*>{"scale", "mean", "variance", "sum_dy",
                                               "sum_dy_xmu"}
                    : std::vector<const char*>{"mean"};
          const fbn::BnShape s = ValidateSplit(shapes, names, format, apply ? epsilon : 0.0f);
          return py::make_tuple(s.outer, s.channels, s.inner);
        },
        py::arg("shapes"), py::arg("apply"), py::arg("data_format"), py::arg("epsilon"),
        "Validates the shapes of the split backward's inputs: (y_backprop, x, mean) for "
        "reduce, (y_backprop, x, scale, mean, variance, sum_dy, sum_dy_xmu) for apply; "
        "returns the canonical (outer, channels, inner) view or raises ValueError.");
  m.def("bn_grad_reduce_cpu_raw", &BnGradReduceCpuRaw, py::arg("dtype"), py::arg("ptrs"),
        py::arg("shapes"), py::arg("data_format"), py::arg("num_threads"), py::arg("isa"));
  m.def("bn_grad_apply_cpu_raw", &BnGradApplyCpuRaw, py::arg("dtype"), py::arg("ptrs"),
        py::arg("shapes"), py::arg("count"), py::arg("data_format"), py::arg("epsilon"),
        py::arg("num_threads"), py::arg("isa"));
}

}  // namespace

#ifndef FBN_BUILD_INFO_JSON
#error "setup.py defines FBN_BUILD_INFO_JSON (the build facts, read by _build_info.py)"
#endif

PYBIND11_MODULE(_core, m) {
  m.doc() = "fbn_grad_tf core kernels (no TensorFlow). Use fbn_grad_tf.core for arrays.";
  m.attr("build_info") = FBN_BUILD_INFO_JSON;
  // ndarray.ctypes.data builds a ctypes object per array, about 2 us each on the 2-core
  // machines: 8-13 of them were half of a small NumPy call's 30 us outside the kernels.
  m.def("addresses",
        [](const py::sequence& arrays) {
          std::vector<uintptr_t> out;
          out.reserve(arrays.size());
          for (py::handle h : arrays) {
            if (h.is_none()) {
              out.push_back(0);
            } else if (py::array::check_(h)) {
              out.push_back(reinterpret_cast<uintptr_t>(
                  py::reinterpret_borrow<py::array>(h).data()));
            } else {
              throw py::type_error("addresses: expected NumPy arrays or None");
            }
          }
          return out;
        },
        "The data addresses of NumPy arrays, 0 for None (ndarray.ctypes.data without a "
        "ctypes object per array)");
  m.def("validate",
        [](const std::vector<std::vector<int64_t>>& shapes, const std::string& format,
           float epsilon) {
          const fbn::BnShape s = Validate(shapes, format, epsilon);
          return py::make_tuple(s.outer, s.channels, s.inner);
        },
        py::arg("shapes"), py::arg("data_format"), py::arg("epsilon"),
        "Validates the shapes of (y_backprop, x, scale, reserve_space_1, reserve_space_2); "
        "returns the canonical (outer, channels, inner) view or raises ValueError.");
  m.def("bn_grad_cpu_raw", &BnGradCpuRaw, py::arg("dtype"), py::arg("ptrs"), py::arg("shapes"),
        py::arg("data_format"), py::arg("epsilon"), py::arg("is_training"),
        py::arg("saved_stat"), py::arg("num_threads"), py::arg("isa"),
        py::arg("activation") = "Identity", py::arg("present") = std::vector<bool>(),
        py::arg("act_mask") = uintptr_t{0}, py::arg("act_mask_floats") = int64_t{0});
  m.def("activation_mask_floats", &fbn::ActivationMaskFloats, py::arg("elements"),
        "Words (float32-sized) of the forward's Relu/Relu6 mask of `elements` elements, tag "
        "included (core/activation.h).");
  m.def("writes_activation_mask",
        [](const std::string& activation, bool side_input, bool is_16bit, bool is_training) {
          return fbn::CpuForwardWritesActivationMask(ParseAct(activation), side_input,
                                                     is_16bit, is_training);
        },
        py::arg("activation"), py::arg("side_input"), py::arg("is_16bit"),
        py::arg("is_training"),
        "Whether the TF CPU forward hands this case's Relu/Relu6 mask to the backward.");
  m.def("validate_forward",
        [](const std::vector<std::vector<int64_t>>& shapes, const std::string& format,
           float epsilon, float factor, bool is_training, const std::string& activation) {
          const fbn::BnShape s =
              ForwardParams(shapes, format, epsilon, factor, is_training, activation, "variance")
                  .shape;
          return py::make_tuple(s.outer, s.channels, s.inner);
        },
        py::arg("shapes"), py::arg("data_format"), py::arg("epsilon"),
        py::arg("exponential_avg_factor"), py::arg("is_training"),
        py::arg("activation") = "Identity",
        "Validates the shapes of the forward's (x, scale, offset, mean, variance[, "
        "side_input]) and the activation_mode; returns the canonical (outer, channels, "
        "inner) view or raises ValueError.");
  m.def("validate_grad_ex",
        [](const std::vector<std::vector<int64_t>>& shapes, const std::string& format,
           float epsilon, const std::string& activation, const std::vector<bool>& present) {
          const fbn::BnShape s =
              GradParams(shapes, format, epsilon, true, "variance", activation, present).shape;
          return py::make_tuple(s.outer, s.channels, s.inner);
        },
        py::arg("shapes"), py::arg("data_format"), py::arg("epsilon"), py::arg("activation"),
        py::arg("present"),
        "Validates the fused backward's shapes (y_backprop, x, scale, reserve_space_1, "
        "reserve_space_2, y, offset, side_input; present says which of the last three are "
        "given, and whether side_input_backprop is wanted) and the activation_mode.");
  m.def("bn_forward_cpu_raw", &BnForwardCpuRaw, py::arg("dtype"), py::arg("ptrs"),
        py::arg("shapes"), py::arg("data_format"), py::arg("epsilon"),
        py::arg("exponential_avg_factor"), py::arg("is_training"), py::arg("activation"),
        py::arg("saved_stat"), py::arg("num_threads"), py::arg("isa"),
        py::arg("act_mask") = uintptr_t{0});
  m.def("cpu_supports", [](const std::string& isa) { return fbn::CpuSupports(Isa(isa)); });
  m.def("default_isa", [] { return std::string(fbn::CpuIsaName(fbn::DefaultCpuIsa())); });
  m.def("software_prefetch", [] { return fbn::SoftwarePrefetch(); },
        "Whether the CPU backward prefetches its inputs in software (off on AMD CPUs; "
        "FBN_GRAD_TF_PREFETCH=on|off|auto)");
  m.def("hugepage_advice", [] { return fbn::HugePageAdvice(); },
        "Whether the TF ops advise their large fresh CPU outputs for transparent huge pages "
        "(FBN_GRAD_TF_HUGEPAGES=on|off|auto, auto = on)");
  m.def("stream_min_bytes",
        [](int itemsize) {
          if (itemsize != 2 && itemsize != 4)
            throw py::value_error("stream_min_bytes: itemsize must be 4 (float32) or 2 "
                                  "(bfloat16, float16), got " + std::to_string(itemsize));
          return fbn::StreamMinBytes(itemsize);
        },
        py::arg("itemsize"),
        "From how many bytes a fresh CPU output of this element size (4 or 2) is written with "
        "non-temporal stores (FBN_GRAD_TF_STREAM_MIB overrides)");
  m.def("streamed_output_count", [] { return fbn::StreamedOutputCount(); },
        "How many outputs this module's CPU kernels have written with non-temporal stores "
        "(one per kernel pass), a statistic for tests");
  m.def("channel_major_max_bytes", [] { return fbn::ChannelMajorMaxBytes(); },
        "The largest channel (bytes of the planes kept cached between its two passes: "
        "y_backprop and x in the backward, x in the forward) that the CPU training kernels "
        "take channel by channel on channels-first tensors; 0 = never "
        "(FBN_GRAD_TF_CHANNEL_MAJOR_KIB overrides)");
  m.def(
      "channel_major_call_count",
      [](const std::string& op) {
        if (op != "backward" && op != "forward")
          throw py::value_error("channel_major_call_count: op must be 'backward' or "
                                "'forward', got '" + op + "'");
        return fbn::ChannelMajorCallCount(op == "forward" ? fbn::BnOp::kForward
                                                          : fbn::BnOp::kBackward);
      },
      py::arg("op") = "backward",
      "How many training calls of the op ('backward' or 'forward') this module's CPU kernels "
      "have taken channel by channel, a statistic for tests");
  m.def("isa_names", [] {
    std::vector<std::string> names;
    for (fbn::CpuIsa isa : fbn::kCpuIsas) names.push_back(fbn::CpuIsaName(isa));
    return names;
  }, "Names of every CPU path compiled in, lowest first (cpu_supports says which can run).");
  m.def("half_to_float", [](uint16_t b) { return fbn::HalfToFloat(fbn::half_t{b}); });
  m.def("float_to_half", [](float f) { return fbn::FloatToHalf(f).bits; });
  m.def("float_to_bfloat16", [](float f) { return fbn::FloatToBFloat16(f).bits; });
#if FBN_WITH_CUDA
  m.attr("with_cuda") = true;
  m.def("cuda_workspace_bytes", &CudaWorkspaceBytes, py::arg("shapes"), py::arg("data_format"),
        py::arg("epsilon"));
  m.def("bn_grad_cuda_raw", &BnGradCudaRaw, py::arg("dtype"), py::arg("ptrs"), py::arg("shapes"),
        py::arg("data_format"), py::arg("epsilon"), py::arg("is_training"),
        py::arg("saved_stat"), py::arg("workspace"), py::arg("workspace_bytes"),
        py::arg("stream"), py::arg("activation") = "Identity",
        py::arg("present") = std::vector<bool>());
  m.def("cuda_forward_workspace_bytes", &CudaForwardWorkspaceBytes, py::arg("shapes"),
        py::arg("data_format"), py::arg("epsilon"), py::arg("exponential_avg_factor"),
        py::arg("is_training"));
  m.def("bn_forward_cuda_raw", &BnForwardCudaRaw, py::arg("dtype"), py::arg("ptrs"),
        py::arg("shapes"), py::arg("data_format"), py::arg("epsilon"),
        py::arg("exponential_avg_factor"), py::arg("is_training"), py::arg("activation"),
        py::arg("saved_stat"), py::arg("workspace"), py::arg("workspace_bytes"),
        py::arg("stream"));
#else
  m.attr("with_cuda") = false;
#endif
  // Split backward (reduce / apply), CPU: see DefineSplitBindings.
  DefineSplitBindings(m);
}
