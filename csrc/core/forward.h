// Framework-free batch-normalization forward (FusedBatchNormV3 semantics): the public
// header of the forward half of the core. Shares the canonical shape, data formats, task
// runner, ISA dispatch and Activation with the backward (common.h); the CUDA entry points
// are in cuda/forward.h.
//
// Training:  mean[c] = sum(x)/M, var[c] = sum((x-mean)^2)/M (biased), computed in one read
//            of x (per-task mean and M2 from a cache-resident chunk, merged with Chan's
//            formula in a fixed order), then y = (x - mean) * scale*inv + offset with
//            inv = 1/sqrt(var + epsilon).
//            batch_mean     = f*mean + (1-f)*running_mean        (f = exponential_avg_factor;
//            batch_variance = f*var*M/max(M-1,1) + (1-f)*running_var   f == 1: no blend)
//            saved_mean = mean; saved_var = var (CPU convention) or inv (GPU / cuDNN).
// Inference: y = (x - running_mean) * scale/sqrt(running_var + epsilon) + offset;
//            batch_mean/batch_variance/saved_mean/saved_var = running_mean/running_var.
// Side input and activation (FusedBatchNormEx): y = act(bn(x) + side_input), the side input
// (optional, the shape and type of x) added in float before the activation (activation.h:
// Identity, Relu, Relu6, Swish; NaN stays NaN). The backward: backward.h (BnGradParams).
#ifndef FBN_GRAD_TF_CORE_FORWARD_H_
#define FBN_GRAD_TF_CORE_FORWARD_H_

#include <cstdint>
#include <string>
#include <vector>

#include "activation.h"
#include "common.h"

namespace fbn {

// True when the running mean/variance inputs are read: inference, or training with
// exponential_avg_factor != 1. Otherwise they may be null / empty ([0]), as in TF.
inline bool ReadsRunningStats(bool is_training, float exponential_avg_factor) {
  return !is_training || exponential_avg_factor != 1.0f;
}

struct BnForwardParams {
  BnShape shape;
  float epsilon = 1e-4f;
  float exponential_avg_factor = 1.0f;
  bool is_training = true;
  // What saved_var (reserve_space_2) receives in training: the biased variance (TF's CPU
  // forward) or the inverse standard deviation (TF's GPU forward, cuDNN).
  SavedStat saved_stat = SavedStat::kVariance;
  Activation activation = Activation::kIdentity;
  bool reads_running_stats() const {
    return ReadsRunningStats(is_training, exponential_avg_factor);
  }
};

// x, side_input and y have shape.elements() elements of T; every other pointer C floats. y may not
// alias x. running_mean/running_var: see BnForwardParams::reads_running_stats().
template <typename T>
struct BnForwardArgs {
  const T* x = nullptr;
  const float* scale = nullptr;
  const float* offset = nullptr;
  const float* running_mean = nullptr;  // input "mean"
  const float* running_var = nullptr;   // input "variance"
  const T* side_input = nullptr;        // optional: y = act(bn(x) + side_input)
  T* y = nullptr;
  float* batch_mean = nullptr;      // output 1
  float* batch_variance = nullptr;  // output 2
  float* saved_mean = nullptr;      // output 3, reserve_space_1
  float* saved_var = nullptr;       // output 4, reserve_space_2
  // Optional output, CPU, Relu/Relu6 (activation.h, "the activation mask"):
  // ActivationMaskWords(elements) words, written when given (callers give it where
  // WritesActivationMask()); the tag words after them are the caller's to set
  // (SetActivationMaskTag).
  uint32_t* act_mask = nullptr;
};

// Whether the TF CPU forward op writes the activation mask (activation.h) for a call: where
// WritesActivationMask(), on the AVX2 and AVX-512 paths, which build and read its words with
// vector loops. The baseline path does both with scalar loops, slower than reading y (the
// avx2 path's scalar words took 1.15x the backward's time of reading y, bfloat16 Relu,
// 16x24x24x256; Intel Xeon, 2026-12-06), so on such CPUs the forward does not write it.
#if !defined(__CUDA_ARCH__)
inline bool CpuForwardWritesActivationMask(Activation act, bool has_side_input, bool is_16bit,
                                           bool is_training) {
  return DefaultCpuIsa() >= CpuIsa::kAvx2 &&
         WritesActivationMask(act, has_side_input, is_16bit, is_training);
}
#endif

// Validation of the forward's inputs (the one place, shared by the TF kernel and the
// pybind11 module). mean/variance may be [0] when !params.reads_running_stats(), like TF.
ValidationResult ValidateBnForwardInputs(const std::vector<int64_t>& x_dims,
                                         const std::vector<int64_t>& scale_dims,
                                         const std::vector<int64_t>& offset_dims,
                                         const std::vector<int64_t>& mean_dims,
                                         const std::vector<int64_t>& variance_dims,
                                         DataFormat format, float epsilon,
                                         float exponential_avg_factor, bool is_training);

template <typename T>
void BnForwardCpu(const BnForwardParams& params, const BnForwardArgs<T>& args,
                  const TaskRunner& runner, CpuIsa isa);

extern template void BnForwardCpu<float>(const BnForwardParams&, const BnForwardArgs<float>&,
                                         const TaskRunner&, CpuIsa);
extern template void BnForwardCpu<half_t>(const BnForwardParams&, const BnForwardArgs<half_t>&,
                                          const TaskRunner&, CpuIsa);
extern template void BnForwardCpu<bfloat16_t>(const BnForwardParams&,
                                              const BnForwardArgs<bfloat16_t>&,
                                              const TaskRunner&, CpuIsa);

}  // namespace fbn

#endif  // FBN_GRAD_TF_CORE_FORWARD_H_
