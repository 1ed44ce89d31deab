// pybind11 module fbn_grad_tf._core: the framework-free core for Python, without
// TensorFlow. Functions take raw addresses plus shapes; python/fbn_grad_tf/core.py turns
// NumPy arrays and device arrays (PyTorch, CuPy, __cuda_array_interface__) into them and
// owns every buffer. Validation is the core's own, so errors match the TF op's.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

#include "../core/bn_grad.h"
#if FBN_WITH_CUDA
#include "../core/bn_grad_cuda.h"
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
  if (s == "baseline" || s == "scalar") return fbn::CpuIsa::kBaseline;
  if (s == "avx2") return fbn::CpuIsa::kAvx2;
  if (s == "avx512") return fbn::CpuIsa::kAvx512;
  throw py::value_error("isa must be auto, baseline, avx2 or avx512, got '" + s + "'");
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

// Addresses of dy, x, scale, rs1, rs2, dx, dscale, doffset.
template <typename T>
fbn::BnGradArgs<T> Args(const std::vector<uintptr_t>& p) {
  if (p.size() != 8) throw py::value_error("expected 8 buffer addresses");
  fbn::BnGradArgs<T> a;
  a.dy = reinterpret_cast<const T*>(p[0]);
  a.x = reinterpret_cast<const T*>(p[1]);
  a.scale = reinterpret_cast<const float*>(p[2]);
  a.saved_mean = reinterpret_cast<const float*>(p[3]);
  a.saved_var = reinterpret_cast<const float*>(p[4]);
  a.dx = reinterpret_cast<T*>(p[5]);
  a.dscale = reinterpret_cast<float*>(p[6]);
  a.doffset = reinterpret_cast<float*>(p[7]);
  return a;
}

fbn::BnGradParams Params(const fbn::BnShape& s, float epsilon, bool is_training,
                         const std::string& saved_stat) {
  fbn::BnGradParams p;
  p.shape = s;
  p.epsilon = epsilon;
  p.is_training = is_training;
  p.saved_stat = Stat(saved_stat);
  return p;
}

void BnGradCpuRaw(const std::string& dtype, const std::vector<uintptr_t>& ptrs,
                  const std::vector<std::vector<int64_t>>& shapes, const std::string& format,
                  float epsilon, bool is_training, const std::string& saved_stat,
                  int num_threads, const std::string& isa) {
  const fbn::BnGradParams params =
      Params(Validate(shapes, format, epsilon), epsilon, is_training, saved_stat);
  const fbn::CpuIsa cpu_isa = Isa(isa);
  const fbn::ThreadRunner runner(num_threads);
  py::gil_scoped_release release;
  if (dtype == "float32") {
    fbn::BnGradCpu(params, Args<float>(ptrs), runner, cpu_isa);
  } else if (dtype == "float16") {
    fbn::BnGradCpu(params, Args<fbn::half_t>(ptrs), runner, cpu_isa);
  } else if (dtype == "bfloat16") {
    fbn::BnGradCpu(params, Args<fbn::bfloat16_t>(ptrs), runner, cpu_isa);
  } else {
    py::gil_scoped_acquire acquire;
    throw py::type_error("dtype must be float32, float16 or bfloat16, got " + dtype);
  }
}

#if FBN_WITH_CUDA
size_t CudaWorkspaceBytes(const std::vector<std::vector<int64_t>>& shapes,
                          const std::string& format, float epsilon) {
  fbn::BnGradParams p;
  p.shape = Validate(shapes, format, epsilon);
  return fbn::BnGradCudaWorkspaceBytes(p);
}

void BnGradCudaRaw(const std::string& dtype, const std::vector<uintptr_t>& ptrs,
                   const std::vector<std::vector<int64_t>>& shapes, const std::string& format,
                   float epsilon, bool is_training, const std::string& saved_stat,
                   uintptr_t workspace, size_t workspace_bytes, uintptr_t stream) {
  const fbn::BnGradParams params =
      Params(Validate(shapes, format, epsilon), epsilon, is_training, saved_stat);
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

}  // namespace

PYBIND11_MODULE(_core, m) {
  m.doc() = "fbn_grad_tf core kernels (no TensorFlow). Use fbn_grad_tf.core for arrays.";
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
        py::arg("saved_stat"), py::arg("num_threads"), py::arg("isa"));
  m.def("cpu_supports", [](const std::string& isa) { return fbn::CpuSupports(Isa(isa)); });
  m.def("default_isa", [] { return std::string(fbn::CpuIsaName(fbn::DefaultCpuIsa())); });
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
        py::arg("stream"));
#else
  m.attr("with_cuda") = false;
#endif
}
