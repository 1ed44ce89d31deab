// Internal interface between the CPU dispatcher (common.cc) and the per-ISA
// compilations of the kernel sources (kernels_<isa>.cc).
#ifndef FBN_GRAD_TF_CORE_CPU_KERNELS_H_
#define FBN_GRAD_TF_CORE_CPU_KERNELS_H_

#include "../backward.h"
#include "../forward.h"

namespace fbn {
namespace cpu {

// The entry points of one ISA path for one element type.
template <typename T>
struct KernelSet {
  // The backward, fused or split (backward.inc).
  void (*fused)(const BnGradParams&, const BnGradArgs<T>&, const TaskRunner&);
  void (*reduce)(const BnGradParams&, const BnGradArgs<T>&, float* sum_dy, float* sum_dy_xmu,
                 const TaskRunner&);
  void (*apply)(const BnGradParams&, const BnGradArgs<T>&, const float* sum_dy,
                const float* sum_dy_xmu, float count, const TaskRunner&);
  // The forward (forward.inc).
  void (*forward)(const BnForwardParams&, const BnForwardArgs<T>&, const TaskRunner&);
};

// The kernels of `isa`, or of the best supported path when this CPU lacks it (never an
// illegal instruction). Defined in common.cc for float, half_t and bfloat16_t.
template <typename T>
KernelSet<T> KernelsFor(CpuIsa isa);

}  // namespace cpu

#define FBN_DECLARE_ISA_KERNELS(ns)        \
  namespace ns {                           \
  template <typename T>                    \
  cpu::KernelSet<T> Kernels();             \
  extern template cpu::KernelSet<float> Kernels<float>();             \
  extern template cpu::KernelSet<half_t> Kernels<half_t>();           \
  extern template cpu::KernelSet<bfloat16_t> Kernels<bfloat16_t>();   \
  }
FBN_DECLARE_ISA_KERNELS(baseline)
FBN_DECLARE_ISA_KERNELS(avx2)
FBN_DECLARE_ISA_KERNELS(avx512)
FBN_DECLARE_ISA_KERNELS(avx512bf16)
#undef FBN_DECLARE_ISA_KERNELS

}  // namespace fbn

#endif  // FBN_GRAD_TF_CORE_CPU_KERNELS_H_
