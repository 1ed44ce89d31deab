// Framework-free batch-normalization backward (FusedBatchNormGradV3 semantics): parameters,
// arguments, input validation and the CPU entry points, fused and split. The CUDA entry
// points are in cuda/backward.h; what the backward shares with the forward (types, data
// formats, shape, task runner, ISA paths) in common.h.
#ifndef FBN_GRAD_TF_CORE_BACKWARD_H_
#define FBN_GRAD_TF_CORE_BACKWARD_H_

#include <cstdint>
#include <vector>

#include "common.h"

namespace fbn {

struct BnGradParams {
  BnShape shape;
  float epsilon = 1e-4f;
  bool is_training = true;
  SavedStat saved_stat = SavedStat::kVariance;
  // The forward's fused activation (y = act(bn(x) + side_input)): y_backprop is turned into
  // dz = y_backprop * act'(z) inside every pass, then the batch-norm backward runs on dz.
  // Swish recomputes z from x, the statistics, scale, BnGradArgs::offset and (if given)
  // BnGradArgs::side_input. Relu/Relu6 read the mask from BnGradArgs::y; on the CPU, for
  // float with the offset given and no side input, they recompute z instead and derive the
  // same mask from it (y is then not read: it must be the forward's output for those
  // inputs, as the op says).
  Activation activation = Activation::kIdentity;
};

// Pointers of one call. dy, x, dx have shape.elements() elements of T; the rest C floats.
// In place: dx may be dy or x itself (the same pointer; the TF op reuses an input's buffer
// when nothing else holds it), side_input_backprop may be dy itself; no other overlap.
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
  // The fused activation's inputs (BnGradParams::activation), same shape and type as x:
  // y, the forward's output (Relu, Relu6); side_input, the forward's side input (when the
  // forward had one). offset: C floats (Swish; Relu/Relu6 on the CPU: see above).
  const T* y = nullptr;
  const T* side_input = nullptr;
  const float* offset = nullptr;
  // Optional output (the forward had a side input): side_input_backprop = dz, written in
  // the first pass. Same shape and type as x; may be dy itself (see above), no other input.
  T* side_input_backprop = nullptr;
  // Optional (CPU): the forward's Relu/Relu6 mask (activation.h, "the activation mask"),
  // 16 elements per word; where given, read instead of y (unless float Relu/Relu6
  // recomputes z). Only a mask that passed IsActivationMask may be given: the kernels read
  // the word after the last one too (the first tag word).
  const uint32_t* act_mask = nullptr;
};

// Validation of the backward's inputs (the one place, shared by the TF kernel and the
// pybind11 module): the shapes of y_backprop, x, scale and the two reserve spaces.
ValidationResult ValidateBnGradInputs(const std::vector<int64_t>& y_backprop_dims,
                                      const std::vector<int64_t>& x_dims,
                                      const std::vector<int64_t>& scale_dims,
                                      const std::vector<int64_t>& reserve_space_1_dims,
                                      const std::vector<int64_t>& reserve_space_2_dims,
                                      DataFormat format, float epsilon);

// ---------------------------------------------------------------------------------------
// CPU kernels.

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

}  // namespace fbn

#endif  // FBN_GRAD_TF_CORE_BACKWARD_H_
