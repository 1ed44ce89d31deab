// TensorFlow binding: registers our op and its CPU (and, with CUDA, GPU) kernels. All math
// and all input checks live in csrc/core; this file only maps tensors to pointers.
//
// The op has the signature of TF's built-in FusedBatchNormGradV3 under a name of our own:
// registering kernels for the built-in name breaks TF (duplicate registrations, or a crash
// in the oneDNN graph rewrite; docs/ARCHITECTURE.md).
#include <cmath>
#include <cstdint>
#include <vector>

#include "tensorflow/core/framework/common_shape_fns.h"
#include "tensorflow/core/framework/op.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/shape_inference.h"
#include "tensorflow/core/platform/threadpool.h"

#include "../core/activation.h"
#include "../core/backward.h"
#include "tf_binding.h"
#if FBN_WITH_CUDA
#include "../core/cuda/backward.h"
#endif
namespace fbn_tf {

using tensorflow::OpKernel;
using tensorflow::OpKernelConstruction;
using tensorflow::OpKernelContext;
using tensorflow::Tensor;
using tensorflow::TensorShape;

// The one registered name. Python reads it from the library; keep README in sync.
constexpr char kOpName[] = "FbnGrad>FusedBatchNormGradV3";

// The signature of FusedBatchNormGradV3 (GradEx appends its input y after these).
#define FBN_GRAD_OP_COMMON                                                 \
  Input("y_backprop: T")                                                   \
      .Input("x: T")                                                       \
      .Input("scale: float")                                               \
      .Input("reserve_space_1: U")                                         \
      .Input("reserve_space_2: U")                                         \
      .Input("reserve_space_3: U")                                         \
      .Output("x_backprop: T")                                             \
      .Output("scale_backprop: U")                                         \
      .Output("offset_backprop: U")                                        \
      .Output("reserve_space_4: U")                                        \
      .Output("reserve_space_5: U")                                        \
      .Attr("T: {half, bfloat16, float}")                                  \
      .Attr("U: {float}")                                                  \
      .Attr("epsilon: float = 0.0001")                                     \
      .Attr("data_format: { 'NHWC', 'NCHW', 'NDHWC', 'NCDHW' } = 'NHWC'")  \
      .Attr("is_training: bool = true")

REGISTER_OP("FbnGrad>FusedBatchNormGradV3")
    .FBN_GRAD_OP_COMMON
    // TF's own shape function for FusedBatchNormGradV3: identical inference by construction.
    .SetShapeFn(tensorflow::shape_inference::FusedBatchNormGradShape)
    .Doc(R"doc(
Batch-normalization backward with the semantics of FusedBatchNormGradV3, computed by
fbn_grad_tf's own kernels. reserve_space_2 holds the batch variance when the forward ran on
CPU and the inverse standard deviation when it ran on GPU (cuDNN convention); the kernel of
the device it runs on assumes that device's convention. reserve_space_3 is accepted in any
shape and ignored. reserve_space_4/5 are empty [0] tensors.
)doc");

// The backward of our forward with a side input and a fused activation
// (FbnGrad>FusedBatchNormEx): the inputs of FusedBatchNormGradV3 plus that forward's output y,
// then (new, as lists so that graphs built before them still load) the forward's offset and
// side input, read by Swish, which recomputes z = bn(x) + side_input (and on the CPU, for
// float, by Relu/Relu6, which then derive their mask from z instead of reading y); outputs
// those of FusedBatchNormGradV3 plus side_input_backprop (TF's _FusedBatchNormGradEx's list
// of 0/1).
// y_backprop becomes dz = y_backprop * act'(z) inside the kernel's passes (no extra pass, no
// extra tensor); side_input_backprop = dz; "Identity" without side input is
// FusedBatchNormGradV3 exactly.
constexpr char kExOpName[] = "FbnGrad>FusedBatchNormGradEx";
REGISTER_OP("FbnGrad>FusedBatchNormGradEx")
    .FBN_GRAD_OP_COMMON
    .Input("y: T")
    .Input("offset: num_offsets * U")
    .Input("side_input: num_side_inputs * T")
    .Output("side_input_backprop: num_side_inputs * T")
    .Attr("activation_mode: { 'Identity', 'Relu', 'Relu6', 'Swish' } = 'Identity'")
    .Attr("num_offsets: int >= 0 = 0")
    .Attr("num_side_inputs: int >= 0 = 0")
    .SetShapeFn([](tensorflow::shape_inference::InferenceContext* c) {
      TF_RETURN_IF_ERROR(tensorflow::shape_inference::FusedBatchNormGradShape(c));
      tensorflow::shape_inference::ShapeHandle x = c->output(0);
      TF_RETURN_IF_ERROR(c->Merge(c->input(6), x, &x));  // y has x's shape
      int num_offsets = 0, num_side = 0;
      TF_RETURN_IF_ERROR(c->GetAttr("num_offsets", &num_offsets));
      TF_RETURN_IF_ERROR(c->GetAttr("num_side_inputs", &num_side));
      for (int i = 0; i < num_side; ++i) {  // side inputs have x's shape
        TF_RETURN_IF_ERROR(c->Merge(c->input(7 + num_offsets + i), x, &x));
      }
      c->set_output(0, x);
      for (int i = 0; i < num_side; ++i) c->set_output(5 + i, x);
      return absl::OkStatus();
    })
    .Doc(R"doc(
FusedBatchNormGradV3 of y = act(batch_norm(x) + side_input) (FbnGrad>FusedBatchNormEx): y is
that forward's output: Relu passes the gradient where y > 0, Relu6 where 0 < y < 6.
offset (num_offsets = 1) and side_input (num_side_inputs, the forward's) are read by Swish,
which recomputes z. On the CPU, for float with the offset given and no side input, Relu
and Relu6 also recompute z and take the same mask from it without reading y, so y must
then be the forward's output for x, scale, offset and the reserve spaces (as it is in the
registered gradient). Where reserve_space_3 is that forward's Relu/Relu6 mask (its CPU
kernel writes one where this backward would read y), the CPU kernel reads the mask instead
of y; any other reserve_space_3 is ignored. side_input_backprop (num_side_inputs outputs)
is dz, the gradient of batch_norm(x) + side_input.
)doc");
#undef FBN_GRAD_OP_COMMON

// Shared by the CPU and GPU kernels: attrs, validation, output allocation.
class FbnGradOpBase : public OpKernel {
 public:
  explicit FbnGradOpBase(OpKernelConstruction* ctx) : OpKernel(ctx) {
    std::string format;
    OP_REQUIRES_OK(ctx, ctx->GetAttr("epsilon", &epsilon_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("data_format", &format));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("is_training", &is_training_));
    OP_REQUIRES(ctx, fbn::ParseDataFormat(format, &format_),
                tensorflow::errors::InvalidArgument("Invalid data format: ", format));
    if (ctx->HasAttr("activation_mode")) {
      std::string mode;
      OP_REQUIRES_OK(ctx, ctx->GetAttr("activation_mode", &mode));
      OP_REQUIRES(ctx, fbn::ParseActivation(mode, &activation_),
                  tensorflow::errors::InvalidArgument(fbn::UnknownActivationMessage(mode)));
    }
    if (ctx->HasAttr("num_side_inputs")) {
      OP_REQUIRES_OK(ctx, ctx->GetAttr("num_offsets", &num_offsets_));
      OP_REQUIRES_OK(ctx, ctx->GetAttr("num_side_inputs", &num_side_inputs_));
      OP_REQUIRES(ctx, num_offsets_ >= 0 && num_offsets_ <= 1,
                  tensorflow::errors::InvalidArgument("num_offsets must be 0 or 1, got ",
                                                      num_offsets_));
      OP_REQUIRES(ctx, num_side_inputs_ >= 0 && num_side_inputs_ <= 1,
                  tensorflow::errors::InvalidArgument("num_side_inputs must be 0 or 1, got ",
                                                      num_side_inputs_));
    }
  }

 protected:
  struct Prepared {
    fbn::BnGradParams params;
    Tensor* dx = nullptr;
    Tensor* dscale = nullptr;
    Tensor* doffset = nullptr;
    Tensor* side_input_backprop = nullptr;  // GradEx with num_side_inputs 1
    const Tensor* y = nullptr;              // GradEx: the forward's output
    const Tensor* offset = nullptr;         // GradEx with num_offsets 1
    const Tensor* side_input = nullptr;     // GradEx with num_side_inputs 1
  };

  // Validates the inputs and allocates every output. Returns false if ctx holds an error.
  // The full-size outputs reuse the buffers of inputs that nothing else holds (TF's buffer
  // forwarding, as its element-wise ops do; both kernels allow it, backward.h): x_backprop
  // y_backprop's or x's, side_input_backprop y_backprop's. The step then needs one (two)
  // full-size buffer(s) less, and on the CPU pass 2 writes into cache lines it has just read
  // instead of fetching fresh ones. Measured inside ResNet50 and MobileNetV2 float32
  // training steps (2-core Xeon, profiler, 30 steps, alternated): our BN ops' time 0.93-0.97x
  // of the same ops writing fresh buffers (docs/PERFORMANCE_NOTES.md, "The backward in place").
  bool Prepare(OpKernelContext* ctx, fbn::SavedStat training_stat, Prepared* p) {
    const Tensor& dy = ctx->input(0);
    const Tensor& x = ctx->input(1);
    const Tensor& scale = ctx->input(2);
    const fbn::ValidationResult v =
        fbn::ValidateBnGradInputs(Dims(dy), Dims(x), Dims(scale), Dims(ctx->input(3)),
                                  Dims(ctx->input(4)), format_, epsilon_);
    if (!CheckValid(ctx, v)) return false;
    if (ctx->num_inputs() > 6) {  // GradEx: y, offset (list), side_input (list)
      p->y = &ctx->input(6);
      if (num_offsets_ == 1) p->offset = &ctx->input(7);
      if (num_side_inputs_ == 1) p->side_input = &ctx->input(7 + num_offsets_);
      const std::vector<int64_t> y_dims = Dims(*p->y);
      std::vector<int64_t> offset_dims, side_dims;
      fbn::ExInputs ex;
      ex.backward = true;
      ex.num_side_inputs = num_side_inputs_;
      ex.y = &y_dims;
      if (p->offset != nullptr) {
        offset_dims = Dims(*p->offset);
        ex.offset = &offset_dims;
      }
      if (p->side_input != nullptr) {
        side_dims = Dims(*p->side_input);
        ex.side_input = &side_dims;
      }
      if (!CheckValid(ctx, fbn::ValidateExInputs(Dims(x), v.shape, activation_, ex))) {
        return false;
      }
    }
    const int64_t C = v.shape.channels;
    Tensor* unused = nullptr;
    const bool side = num_side_inputs_ == 1;
    // Inputs whose buffers the full-size outputs may take. With a side input, y_backprop's
    // goes to side_input_backprop (allocated first) and x's to x_backprop.
    const std::vector<int> side_reuse = {0};
    const std::vector<int> dx_reuse = side ? std::vector<int>{1} : std::vector<int>{0, 1};
    if ((side && !Allocate(ctx, 5, x.shape(), side_reuse, &p->side_input_backprop)) ||
        !Allocate(ctx, 0, x.shape(), dx_reuse, &p->dx) ||
        !Allocate(ctx, 1, TensorShape({C}), {}, &p->dscale) ||
        !Allocate(ctx, 2, TensorShape({C}), {}, &p->doffset) ||
        !Allocate(ctx, 3, TensorShape({0}), {}, &unused) ||
        !Allocate(ctx, 4, TensorShape({0}), {}, &unused)) {
      return false;
    }
    p->params.shape = v.shape;
    p->params.epsilon = epsilon_;
    p->params.is_training = is_training_;
    p->params.saved_stat = training_stat;
    p->params.activation = p->y != nullptr ? activation_ : fbn::Activation::kIdentity;
    return true;
  }

  template <typename T>
  static fbn::BnGradArgs<typename CoreType<T>::type> Args(OpKernelContext* ctx, Prepared* p) {
    using CT = typename CoreType<T>::type;
    fbn::BnGradArgs<CT> a;
    a.dy = CoreData<T>(ctx->input(0));
    a.x = CoreData<T>(ctx->input(1));
    a.scale = ctx->input(2).flat<float>().data();
    a.saved_mean = ctx->input(3).flat<float>().data();
    a.saved_var = ctx->input(4).flat<float>().data();
    a.dx = CoreData<T>(p->dx);
    a.dscale = p->dscale->flat<float>().data();
    a.doffset = p->doffset->flat<float>().data();
    if (p->y != nullptr) a.y = CoreData<T>(*p->y);
    if (p->offset != nullptr) a.offset = p->offset->flat<float>().data();
    if (p->side_input != nullptr) a.side_input = CoreData<T>(*p->side_input);
    if (p->side_input_backprop != nullptr) a.side_input_backprop = CoreData<T>(p->side_input_backprop);
    return a;
  }

 private:
  // Output i, in the buffer of the first of `reuse` (inputs) that can be forwarded to it.
  static bool Allocate(OpKernelContext* ctx, int i, const TensorShape& s,
                       const std::vector<int>& reuse, Tensor** out) {
    const absl::Status st = reuse.empty()
                                ? ctx->allocate_output(i, s, out)
                                : ctx->forward_input_or_allocate_output(
                                      absl::Span<const int>(reuse), i, s, out);
    if (!st.ok()) ctx->SetStatus(st);
    return st.ok();
  }
  static bool CheckValid(OpKernelContext* ctx, const fbn::ValidationResult& v) {
    if (!v.ok) ctx->SetStatus(tensorflow::errors::InvalidArgument(v.error));
    return v.ok;
  }

  float epsilon_ = 1e-4f;
  bool is_training_ = true;
  fbn::DataFormat format_ = fbn::DataFormat::kNHWC;
  fbn::Activation activation_ = fbn::Activation::kIdentity;

 protected:
  int num_offsets_ = 0;
  int num_side_inputs_ = 0;
};

template <typename T>
class FbnGradCpuOp : public FbnGradOpBase {
 public:
  using FbnGradOpBase::FbnGradOpBase;
  void Compute(OpKernelContext* ctx) override {
    Prepared p;
    if (!Prepare(ctx, fbn::SavedStat::kVariance, &p)) return;
    AdviseFreshOutput(ctx, p.dx);
    AdviseFreshOutput(ctx, p.side_input_backprop);
    const auto runner = IntraOpThreads(ctx);
    auto args = Args<T>(ctx, &p);
    // GradEx: reserve_space_3 from our CPU forward may carry its Relu/Relu6 mask
    // (core/activation.h), read instead of y; anything else there is ignored, as before.
    const Tensor& rs3 = ctx->input(5);
    if (p.y != nullptr &&
        fbn::IsActivationMask(rs3.tensor_data().data(), rs3.NumElements(),
                              p.params.shape.elements(), p.params.activation)) {
      args.act_mask = reinterpret_cast<const uint32_t*>(rs3.tensor_data().data());
    }
    fbn::BnGradCpu(p.params, args, runner, fbn::DefaultCpuIsa());
  }
};

FBN_REGISTER_KERNELS(kOpName, tensorflow::DEVICE_CPU, FbnGradCpuOp);
FBN_REGISTER_KERNELS(kExOpName, tensorflow::DEVICE_CPU, FbnGradCpuOp);

// ---- split backward for cross-replica batch norm (CPU) --------------------------------------
// reduce: local per-channel sums; the caller all-reduces them; apply: x_backprop from the
// (global) sums. reduce + apply with the local sums equals our fused op's x_backprop bitwise.

namespace {
using tensorflow::shape_inference::DimensionHandle;
using tensorflow::shape_inference::InferenceContext;
using tensorflow::shape_inference::ShapeHandle;

// Merges y_backprop (input 0) and x (input 1) at the data_format's rank, then merges inputs
// [first_vec, last_vec] as [C] vectors into the channel dimension. Returns x's shape with
// the merged channel dimension, and that dimension.
absl::Status ActivationAndVectors(InferenceContext* c, int first_vec, int last_vec,
                                  ShapeHandle* x, DimensionHandle* channels) {
  std::string format;
  TF_RETURN_IF_ERROR(c->GetAttr("data_format", &format));
  const int rank = (format == "NDHWC" || format == "NCDHW") ? 5 : 4;
  const int axis = (format == "NCHW" || format == "NCDHW") ? 1 : rank - 1;
  ShapeHandle dy;
  TF_RETURN_IF_ERROR(c->WithRank(c->input(0), rank, &dy));
  TF_RETURN_IF_ERROR(c->WithRank(c->input(1), rank, x));
  TF_RETURN_IF_ERROR(c->Merge(*x, dy, x));
  *channels = c->Dim(*x, axis);
  for (int i = first_vec; i <= last_vec; ++i) {
    ShapeHandle v;
    TF_RETURN_IF_ERROR(c->WithRank(c->input(i), 1, &v));
    TF_RETURN_IF_ERROR(c->Merge(*channels, c->Dim(v, 0), channels));
  }
  return c->ReplaceDim(*x, axis, *channels, x);
}
}  // namespace

REGISTER_OP("FbnGrad>BatchNormGradReduce")
    .Input("y_backprop: T")
    .Input("x: T")
    .Input("mean: U")
    .Output("sum_dy: U")
    .Output("sum_dy_xmu: U")
    .Output("count: U")
    .Attr("T: {half, bfloat16, float}")
    .Attr("U: {float}")
    .Attr("data_format: { 'NHWC', 'NCHW', 'NDHWC', 'NCDHW' } = 'NHWC'")
    .SetShapeFn([](InferenceContext* c) {
      ShapeHandle x;
      DimensionHandle channels;
      TF_RETURN_IF_ERROR(ActivationAndVectors(c, 2, 2, &x, &channels));
      c->set_output(0, c->Vector(channels));
      c->set_output(1, c->Vector(channels));
      c->set_output(2, c->Scalar());
      return absl::OkStatus();
    })
    .Doc(R"doc(
Local per-channel sums of the batch-norm backward (training): sum_dy = sum(y_backprop),
sum_dy_xmu = sum(y_backprop * (x - mean)), count = elements per channel (as float).
)doc");

REGISTER_OP("FbnGrad>BatchNormGradApply")
    .Input("y_backprop: T")
    .Input("x: T")
    .Input("scale: float")
    .Input("mean: U")
    .Input("variance: U")
    .Input("sum_dy: U")
    .Input("sum_dy_xmu: U")
    .Input("count: U")
    .Output("x_backprop: T")
    .Attr("T: {half, bfloat16, float}")
    .Attr("U: {float}")
    .Attr("epsilon: float = 0.0001")
    .Attr("data_format: { 'NHWC', 'NCHW', 'NDHWC', 'NCDHW' } = 'NHWC'")
    .SetShapeFn([](InferenceContext* c) {
      ShapeHandle x, count;
      DimensionHandle channels;
      TF_RETURN_IF_ERROR(ActivationAndVectors(c, 2, 6, &x, &channels));
      TF_RETURN_IF_ERROR(c->WithRank(c->input(7), 0, &count));
      c->set_output(0, x);
      return absl::OkStatus();
    })
    .Doc(R"doc(
x_backprop of the batch-norm backward (training) from per-channel sums over `count`
elements per channel, typically all-reduced across replicas. mean/variance are the batch
statistics the forward normalized with (variance biased, as TF's CPU forward saves it).
)doc");

// Shared by the split kernels: attrs and validation of (y_backprop, x, [C] vectors...).
class SplitOpBase : public OpKernel {
 public:
  explicit SplitOpBase(OpKernelConstruction* ctx) : OpKernel(ctx) {
    std::string format;
    OP_REQUIRES_OK(ctx, ctx->GetAttr("data_format", &format));
    OP_REQUIRES(ctx, fbn::ParseDataFormat(format, &format_),
                tensorflow::errors::InvalidArgument("Invalid data format: ", format));
    if (ctx->HasAttr("epsilon")) OP_REQUIRES_OK(ctx, ctx->GetAttr("epsilon", &epsilon_));
  }

 protected:
  // names[i] names input i + 2. Returns false if ctx holds an error.
  bool Validate(OpKernelContext* ctx, const std::vector<const char*>& names,
                fbn::BnGradParams* params) {
    std::vector<std::vector<int64_t>> dims;
    for (size_t i = 0; i < names.size(); ++i) dims.push_back(Dims(ctx->input(2 + i)));
    std::vector<fbn::NamedDims> vecs;
    for (size_t i = 0; i < names.size(); ++i) vecs.push_back({names[i], &dims[i]});
    const fbn::ValidationResult v = fbn::ValidateBnInputs(
        Dims(ctx->input(0)), Dims(ctx->input(1)), vecs, format_, epsilon_);
    if (!v.ok) {
      ctx->SetStatus(tensorflow::errors::InvalidArgument(v.error));
      return false;
    }
    params->shape = v.shape;
    params->epsilon = epsilon_;
    params->is_training = true;
    params->saved_stat = fbn::SavedStat::kVariance;
    return true;
  }

  fbn::DataFormat format_ = fbn::DataFormat::kNHWC;
  float epsilon_ = 0.0f;
};

template <typename T>
class FbnGradReduceOp : public SplitOpBase {
 public:
  using SplitOpBase::SplitOpBase;
  void Compute(OpKernelContext* ctx) override {
    using CT = typename CoreType<T>::type;
    fbn::BnGradParams params;
    if (!Validate(ctx, {"mean"}, &params)) return;
    const int64_t C = params.shape.channels;
    Tensor *sum_dy = nullptr, *sum_dy_xmu = nullptr, *count = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, TensorShape({C}), &sum_dy));
    OP_REQUIRES_OK(ctx, ctx->allocate_output(1, TensorShape({C}), &sum_dy_xmu));
    OP_REQUIRES_OK(ctx, ctx->allocate_output(2, TensorShape({}), &count));
    count->scalar<float>()() = static_cast<float>(params.shape.per_channel());
    fbn::BnGradArgs<CT> a;
    a.dy = CoreData<T>(ctx->input(0));
    a.x = CoreData<T>(ctx->input(1));
    a.saved_mean = ctx->input(2).flat<float>().data();
    const auto runner = IntraOpThreads(ctx);
    fbn::BnGradReduceCpu(params, a, sum_dy->flat<float>().data(),
                         sum_dy_xmu->flat<float>().data(), runner, fbn::DefaultCpuIsa());
  }
};

template <typename T>
class FbnGradApplyOp : public SplitOpBase {
 public:
  using SplitOpBase::SplitOpBase;
  void Compute(OpKernelContext* ctx) override {
    using CT = typename CoreType<T>::type;
    fbn::BnGradParams params;
    if (!Validate(ctx, {"scale", "mean", "variance", "sum_dy", "sum_dy_xmu"}, &params)) return;
    const Tensor& count = ctx->input(7);
    OP_REQUIRES(ctx, count.dims() == 0,
                tensorflow::errors::InvalidArgument("count must be a scalar, got shape ",
                                                    count.shape().DebugString()));
    const float n = count.scalar<float>()();
    OP_REQUIRES(ctx, params.shape.elements() == 0 || (std::isfinite(n) && n >= 1.0f),
                tensorflow::errors::InvalidArgument(
                    "count must be a finite number >= 1 (elements per channel over all "
                    "replicas), got ", n));
    Tensor* dx = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, ctx->input(1).shape(), &dx));
    AdviseFreshOutput(ctx, dx);
    fbn::BnGradArgs<CT> a;
    a.dy = CoreData<T>(ctx->input(0));
    a.x = CoreData<T>(ctx->input(1));
    a.scale = ctx->input(2).flat<float>().data();
    a.saved_mean = ctx->input(3).flat<float>().data();
    a.saved_var = ctx->input(4).flat<float>().data();
    a.dx = CoreData<T>(dx);
    const auto runner = IntraOpThreads(ctx);
    fbn::BnGradApplyCpu(params, a, ctx->input(5).flat<float>().data(),
                        ctx->input(6).flat<float>().data(), n, runner, fbn::DefaultCpuIsa());
  }
};

FBN_REGISTER_KERNELS("FbnGrad>BatchNormGradReduce", tensorflow::DEVICE_CPU, FbnGradReduceOp);
FBN_REGISTER_KERNELS("FbnGrad>BatchNormGradApply", tensorflow::DEVICE_CPU, FbnGradApplyOp);

#if FBN_WITH_CUDA
// GPU kernel: TF's GPU forward stores the inverse std in reserve_space_2 (cuDNN), so the
// training path reads it as such. Launched on the op's compute stream.
template <typename T>
class FbnGradGpuOp : public FbnGradOpBase {
 public:
  using FbnGradOpBase::FbnGradOpBase;
  void Compute(OpKernelContext* ctx) override {
    Prepared p;
    if (!Prepare(ctx, fbn::SavedStat::kInvStd, &p)) return;
    const auto args = Args<T>(ctx, &p);
    const size_t ws_bytes = fbn::BnGradCudaWorkspaceBytes(p.params);
    LaunchOnOpStream(ctx, ws_bytes, "backward", [&](void* ws, void* stream) {
      return fbn::BnGradCuda(p.params, args, ws, ws_bytes, stream);
    });
  }
};

FBN_REGISTER_KERNELS(kOpName, tensorflow::DEVICE_GPU, FbnGradGpuOp);
FBN_REGISTER_KERNELS(kExOpName, tensorflow::DEVICE_GPU, FbnGradGpuOp);
#endif  // FBN_WITH_CUDA

}  // namespace fbn_tf
