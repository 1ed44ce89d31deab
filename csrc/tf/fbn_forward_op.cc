// TensorFlow binding of the forward: FbnGrad>FusedBatchNormV3 (the signature, attributes and
// shape function of TF's FusedBatchNormV3) and FbnGrad>FusedBatchNormEx (the same plus a
// fused activation). All math and all input checks live in csrc/core.
//
// Reserve spaces, as TF's own kernels on the device the op runs on: reserve_space_1 is the
// batch mean; reserve_space_2 the biased batch variance on CPU and the inverse standard
// deviation on GPU (cuDNN's convention), so TF's FusedBatchNormGradV3 and ours both read
// them correctly; reserve_space_3 is an empty [0] tensor (nothing else is needed).
#include <cstdint>
#include <string>
#include <vector>

#include "tensorflow/core/framework/common_shape_fns.h"
#include "tensorflow/core/framework/op.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/shape_inference.h"

#include "../core/activation.h"
#include "../core/forward.h"
#include "tf_binding.h"
#if FBN_WITH_CUDA
#include "../core/cuda/forward.h"
#endif

namespace fbn_tf {

using tensorflow::OpKernel;
using tensorflow::OpKernelConstruction;
using tensorflow::OpKernelContext;
using tensorflow::Tensor;
using tensorflow::TensorShape;

constexpr char kForwardOpName[] = "FbnGrad>FusedBatchNormV3";
constexpr char kForwardExOpName[] = "FbnGrad>FusedBatchNormEx";

#define FBN_FORWARD_OP_COMMON                                              \
  Input("x: T")                                                            \
      .Input("scale: U")                                                   \
      .Input("offset: U")                                                  \
      .Input("mean: U")                                                    \
      .Input("variance: U")                                                \
      .Output("y: T")                                                      \
      .Output("batch_mean: U")                                             \
      .Output("batch_variance: U")                                         \
      .Output("reserve_space_1: U")                                        \
      .Output("reserve_space_2: U")                                        \
      .Output("reserve_space_3: U")                                        \
      .Attr("T: {half, bfloat16, float}")                                  \
      .Attr("U: {float}")                                                  \
      .Attr("epsilon: float = 0.0001")                                     \
      .Attr("exponential_avg_factor: float = 1.0")                         \
      .Attr("data_format: { 'NHWC', 'NCHW', 'NDHWC', 'NCDHW' } = 'NHWC'")  \
      .Attr("is_training: bool = true")

REGISTER_OP("FbnGrad>FusedBatchNormV3")
    .FBN_FORWARD_OP_COMMON
    .SetShapeFn(tensorflow::shape_inference::FusedBatchNormV3Shape)
    .Doc(R"doc(
Batch-normalization forward with the semantics of FusedBatchNormV3, computed by
fbn_grad_tf's own kernels (training statistics in one read of x, deterministic).
reserve_space_2 holds the biased batch variance on CPU and 1/sqrt(var + epsilon) on GPU,
like TF's own kernels; reserve_space_3 is an empty [0] tensor.
)doc");

// Inputs and attributes of TF's _FusedBatchNormEx: the side input is a list of 0 or 1
// tensors (num_side_inputs, default 0, so graphs built before it existed still load).
REGISTER_OP("FbnGrad>FusedBatchNormEx")
    .FBN_FORWARD_OP_COMMON
    .Input("side_input: num_side_inputs * T")
    .Attr("num_side_inputs: int >= 0 = 0")
    .Attr("activation_mode: { 'Identity', 'Relu', 'Relu6', 'Swish' } = 'Identity'")
    .SetShapeFn([](tensorflow::shape_inference::InferenceContext* c) {
      TF_RETURN_IF_ERROR(tensorflow::shape_inference::FusedBatchNormV3Shape(c));
      for (int i = 5; i < c->num_inputs(); ++i) {  // the side input has y's shape
        tensorflow::shape_inference::ShapeHandle y;
        TF_RETURN_IF_ERROR(c->Merge(c->input(i), c->output(0), &y));
        c->set_output(0, y);
      }
      return absl::OkStatus();
    })
    .Doc(R"doc(
FbnGrad>FusedBatchNormV3 followed by a side input and an activation, in the same pass over
the data: y = act(batch_norm(x) + side_input) (side_input optional, num_side_inputs 0 or
1, the shape and type of x). activation_mode: Identity, Relu (max(z, 0)), Relu6
(min(max(z, 0), 6)), Swish (z * sigmoid(z), also called SiLU); NaN stays NaN. Its
gradient is FbnGrad>FusedBatchNormGradEx, which reads y (Relu, Relu6) or recomputes z
from x, offset and the side input (Swish). reserve_space_3 is an empty [0] tensor, except
from the CPU kernel on AVX2 or AVX-512 CPUs in training with Relu or Relu6 where that
backward would read y for the mask (half and bfloat16; float with a side input): it then
holds the mask, 16 elements per 32-bit word (each a finite float), and tag words, and the
CPU backward reads it instead.
)doc");
#undef FBN_FORWARD_OP_COMMON

// Shared by the CPU and GPU kernels: attrs, validation, output allocation.
class FbnForwardOpBase : public OpKernel {
 public:
  explicit FbnForwardOpBase(OpKernelConstruction* ctx) : OpKernel(ctx) {
    std::string format;
    OP_REQUIRES_OK(ctx, ctx->GetAttr("epsilon", &params_.epsilon));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("exponential_avg_factor", &params_.exponential_avg_factor));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("data_format", &format));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("is_training", &params_.is_training));
    OP_REQUIRES(ctx, fbn::ParseDataFormat(format, &format_),
                tensorflow::errors::InvalidArgument("Invalid data format: ", format));
    if (ctx->HasAttr("activation_mode")) {
      std::string mode;
      OP_REQUIRES_OK(ctx, ctx->GetAttr("activation_mode", &mode));
      OP_REQUIRES(ctx, fbn::ParseActivation(mode, &params_.activation),
                  tensorflow::errors::InvalidArgument(fbn::UnknownActivationMessage(mode)));
    }
    if (ctx->HasAttr("num_side_inputs")) {
      OP_REQUIRES_OK(ctx, ctx->GetAttr("num_side_inputs", &num_side_inputs_));
      OP_REQUIRES(ctx, num_side_inputs_ >= 0 && num_side_inputs_ <= 1,
                  tensorflow::errors::InvalidArgument(
                      "num_side_inputs must be 0 or 1, got ", num_side_inputs_));
    }
  }

 protected:
  // Validates the inputs, allocates every output and fills the call's params and pointers.
  // Returns false if ctx holds an error.
  // act_mask (the CPU kernel): reserve_space_3 carries the Relu/Relu6 mask for the backward
  // where CpuForwardWritesActivationMask() (core/forward.h), else it is the empty [0] tensor.
  template <typename T>
  bool Prepare(OpKernelContext* ctx, fbn::SavedStat training_stat, bool act_mask,
               fbn::BnForwardParams* params, fbn::BnForwardArgs<typename CoreType<T>::type>* args) {
    const Tensor& x = ctx->input(0);
    const fbn::ValidationResult v = fbn::ValidateBnForwardInputs(
        Dims(x), Dims(ctx->input(1)), Dims(ctx->input(2)), Dims(ctx->input(3)),
        Dims(ctx->input(4)), format_, params_.epsilon, params_.exponential_avg_factor,
        params_.is_training);
    if (!v.ok) {
      ctx->SetStatus(tensorflow::errors::InvalidArgument(v.error));
      return false;
    }
    const Tensor* side = num_side_inputs_ == 1 ? &ctx->input(5) : nullptr;
    std::vector<int64_t> side_dims;
    fbn::ExInputs ex;
    ex.num_side_inputs = num_side_inputs_;
    if (side != nullptr) {
      side_dims = Dims(*side);
      ex.side_input = &side_dims;
    }
    const fbn::ValidationResult vx =
        fbn::ValidateExInputs(Dims(x), v.shape, params_.activation, ex);
    if (!vx.ok) {
      ctx->SetStatus(tensorflow::errors::InvalidArgument(vx.error));
      return false;
    }
    const TensorShape vec({v.shape.channels});
    const int64_t elements = v.shape.elements();
    const bool with_mask =
        act_mask && elements > 0 &&
        fbn::CpuForwardWritesActivationMask(params_.activation, side != nullptr,
                                            sizeof(T) == 2, params_.is_training);
    const TensorShape rs3_shape({with_mask ? fbn::ActivationMaskFloats(elements) : 0});
    Tensor *y = nullptr, *batch_mean = nullptr, *batch_var = nullptr, *saved_mean = nullptr,
           *saved_var = nullptr, *rs3 = nullptr;
    if (!Allocate(ctx, 0, x.shape(), &y) || !Allocate(ctx, 1, vec, &batch_mean) ||
        !Allocate(ctx, 2, vec, &batch_var) || !Allocate(ctx, 3, vec, &saved_mean) ||
        !Allocate(ctx, 4, vec, &saved_var) || !Allocate(ctx, 5, rs3_shape, &rs3)) {
      return false;
    }
    if (with_mask) {
      args->act_mask = reinterpret_cast<uint32_t*>(rs3->flat<float>().data());
      fbn::SetActivationMaskTag(args->act_mask, elements, params_.activation);
    }
    *params = params_;
    params->shape = v.shape;
    params->saved_stat = training_stat;
    args->x = CoreData<T>(x);
    args->scale = ctx->input(1).flat<float>().data();
    args->offset = ctx->input(2).flat<float>().data();
    if (params->reads_running_stats()) {
      args->running_mean = ctx->input(3).flat<float>().data();
      args->running_var = ctx->input(4).flat<float>().data();
    }
    if (side != nullptr) args->side_input = CoreData<T>(*side);
    args->y = CoreData<T>(y);
    args->batch_mean = batch_mean->flat<float>().data();
    args->batch_variance = batch_var->flat<float>().data();
    args->saved_mean = saved_mean->flat<float>().data();
    args->saved_var = saved_var->flat<float>().data();
    return true;
  }

 private:
  static bool Allocate(OpKernelContext* ctx, int i, const TensorShape& s, Tensor** out) {
    const absl::Status st = ctx->allocate_output(i, s, out);
    if (!st.ok()) ctx->SetStatus(st);
    return st.ok();
  }

  fbn::BnForwardParams params_;  // attrs only; shape and saved_stat are set per call
  fbn::DataFormat format_ = fbn::DataFormat::kNHWC;

 protected:
  int num_side_inputs_ = 0;
};

template <typename T>
class FbnForwardCpuOp : public FbnForwardOpBase {
 public:
  using FbnForwardOpBase::FbnForwardOpBase;
  void Compute(OpKernelContext* ctx) override {
    fbn::BnForwardParams params;
    fbn::BnForwardArgs<typename CoreType<T>::type> args;
    if (!Prepare<T>(ctx, fbn::SavedStat::kVariance, /*act_mask=*/true, &params, &args)) {
      return;
    }
    AdviseFreshOutput(ctx, ctx->mutable_output(0));
    const auto runner = IntraOpThreads(ctx);
    fbn::BnForwardCpu(params, args, runner, fbn::DefaultCpuIsa());
  }
};

FBN_REGISTER_KERNELS(kForwardOpName, tensorflow::DEVICE_CPU, FbnForwardCpuOp);
FBN_REGISTER_KERNELS(kForwardExOpName, tensorflow::DEVICE_CPU, FbnForwardCpuOp);

#if FBN_WITH_CUDA
// GPU kernel: reserve_space_2 receives the inverse std (cuDNN's convention, what TF's GPU
// backward and ours expect). Launched on the op's compute stream.
template <typename T>
class FbnForwardGpuOp : public FbnForwardOpBase {
 public:
  using FbnForwardOpBase::FbnForwardOpBase;
  void Compute(OpKernelContext* ctx) override {
    fbn::BnForwardParams params;
    fbn::BnForwardArgs<typename CoreType<T>::type> args;
    if (!Prepare<T>(ctx, fbn::SavedStat::kInvStd, /*act_mask=*/false, &params, &args)) {
      return;
    }
    const size_t ws_bytes = fbn::BnForwardCudaWorkspaceBytes(params);
    LaunchOnOpStream(ctx, ws_bytes, "forward", [&](void* ws, void* stream) {
      return fbn::BnForwardCuda(params, args, ws, ws_bytes, stream);
    });
  }
};

FBN_REGISTER_KERNELS(kForwardOpName, tensorflow::DEVICE_GPU, FbnForwardGpuOp);
FBN_REGISTER_KERNELS(kForwardExOpName, tensorflow::DEVICE_GPU, FbnForwardGpuOp);
#endif  // FBN_WITH_CUDA

}  // namespace fbn_tf
