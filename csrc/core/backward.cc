// The backward's validation and its dispatch to the per-ISA CPU kernels.
#include "backward.h"
#include "cpu/kernels.h"

namespace fbn {

ValidationResult ValidateBnGradInputs(const std::vector<int64_t>& dy_dims,
                                      const std::vector<int64_t>& x_dims,
                                      const std::vector<int64_t>& scale_dims,
                                      const std::vector<int64_t>& rs1_dims,
                                      const std::vector<int64_t>& rs2_dims, DataFormat format,
                                      float epsilon) {
  return ValidateBnInputs(dy_dims, x_dims,
                          {{"scale", &scale_dims},
                           {"reserve_space_1 (saved mean)", &rs1_dims},
                           {"reserve_space_2 (saved variance)", &rs2_dims}},
                          format, epsilon);
}

template <typename T>
void BnGradCpu(const BnGradParams& params, const BnGradArgs<T>& args, const TaskRunner& runner,
               CpuIsa isa) {
  cpu::KernelsFor<T>(isa).fused(params, args, runner);
}

template <typename T>
void BnGradReduceCpu(const BnGradParams& params, const BnGradArgs<T>& args, float* sum_dy,
                     float* sum_dy_xmu, const TaskRunner& runner, CpuIsa isa) {
  cpu::KernelsFor<T>(isa).reduce(params, args, sum_dy, sum_dy_xmu, runner);
}

template <typename T>
void BnGradApplyCpu(const BnGradParams& params, const BnGradArgs<T>& args, const float* sum_dy,
                    const float* sum_dy_xmu, float count, const TaskRunner& runner, CpuIsa isa) {
  cpu::KernelsFor<T>(isa).apply(params, args, sum_dy, sum_dy_xmu, count, runner);
}

#define FBN_INSTANTIATE(T)                                                                 \
  template void BnGradCpu<T>(const BnGradParams&, const BnGradArgs<T>&, const TaskRunner&,  \
                             CpuIsa);                                                      \
  template void BnGradReduceCpu<T>(const BnGradParams&, const BnGradArgs<T>&, float*, float*, \
                                   const TaskRunner&, CpuIsa);                             \
  template void BnGradApplyCpu<T>(const BnGradParams&, const BnGradArgs<T>&, const float*,  \
                                  const float*, float, const TaskRunner&, CpuIsa);
FBN_INSTANTIATE(float)
FBN_INSTANTIATE(half_t)
FBN_INSTANTIATE(bfloat16_t)
#undef FBN_INSTANTIATE

}  // namespace fbn
