// The forward's validation and its dispatch to the per-ISA CPU kernels.
#include <cmath>
#include <sstream>

#include "forward.h"
#include "cpu/kernels.h"

namespace fbn {

ValidationResult ValidateBnForwardInputs(const std::vector<int64_t>& x_dims,
                                         const std::vector<int64_t>& scale_dims,
                                         const std::vector<int64_t>& offset_dims,
                                         const std::vector<int64_t>& mean_dims,
                                         const std::vector<int64_t>& variance_dims,
                                         DataFormat format, float epsilon,
                                         float exponential_avg_factor, bool is_training) {
  const int rank = DataFormatRank(format);
  if (static_cast<int>(x_dims.size()) != rank) {
    return ValidationFailure("x must be " + std::to_string(rank) + "-dimensional for data_format " +
        DataFormatName(format) + ", got shape " + ShapeString(x_dims));
  }
  // The factor is read in training only; TF accepts NaN/inf there and returns NaN
  // statistics, which we refuse. In inference nothing reads it, so, like TF, any value goes.
  if (is_training && !std::isfinite(exponential_avg_factor)) {
    std::ostringstream os;
    os << "exponential_avg_factor must be a finite number, got " << exponential_avg_factor;
    return ValidationFailure(os.str());
  }
  // Like TF: training with exponential_avg_factor == 1 never reads the running statistics,
  // so TF checks only that they are vectors, of any length (empty [0] ones included);
  // otherwise they are [C] like scale and offset.
  const bool reads_running = ReadsRunningStats(is_training, exponential_avg_factor);
  std::vector<NamedDims> vecs = {{"scale", &scale_dims}, {"offset", &offset_dims}};
  if (reads_running) {
    vecs.push_back({"mean", &mean_dims});
    vecs.push_back({"variance", &variance_dims});
  }
  // x stands in for y_backprop: the shared checks then cover x, the [C] vectors, epsilon
  // and the canonical shape.
  ValidationResult result = ValidateBnInputs(x_dims, x_dims, vecs, format, epsilon);
  if (result.ok && !reads_running) {
    for (const NamedDims& v :
         {NamedDims{"mean", &mean_dims}, NamedDims{"variance", &variance_dims}}) {
      if (v.dims->size() != 1) {
        return ValidationFailure(std::string(v.name) + " must be 1-dimensional, got shape " +
            ShapeString(*v.dims));
      }
    }
  }
  return result;
}

template <typename T>
void BnForwardCpu(const BnForwardParams& params, const BnForwardArgs<T>& args,
                  const TaskRunner& runner, CpuIsa isa) {
  cpu::KernelsFor<T>(isa).forward(params, args, runner);
}

template void BnForwardCpu<float>(const BnForwardParams&, const BnForwardArgs<float>&,
                                  const TaskRunner&, CpuIsa);
template void BnForwardCpu<half_t>(const BnForwardParams&, const BnForwardArgs<half_t>&,
                                   const TaskRunner&, CpuIsa);
template void BnForwardCpu<bfloat16_t>(const BnForwardParams&, const BnForwardArgs<bfloat16_t>&,
                                       const TaskRunner&, CpuIsa);

}  // namespace fbn
