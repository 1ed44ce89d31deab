// The fused activations of the forward (y = act(bn(x) [+ side_input])) and their
// derivatives in the backward, written once for the CPU kernels (every ISA path) and the
// CUDA kernels. Float arithmetic only; the mode is a template parameter of the kernels
// (ActivationOp<kAct>), never a runtime branch per element.
//
//   Identity  act(z) = z                      dz = dy
//   Relu      act(z) = max(z, 0)              dz = y > 0 ? dy : 0          (from y *)
//   Relu6     act(z) = min(max(z, 0), 6)      dz = 0 < y < 6 ? dy : 0      (from y *)
//   Swish     act(z) = z * sigmoid(z) (SiLU)  dz = dy * s * (1 + z * (1 - s)), s = sigmoid(z)
//                                             (z recomputed from x, the statistics, scale,
//                                             offset and the side input)
// * The CUDA kernels read y; the CPU kernels on float, when given the offset and no side
//   input, recompute z as Swish does and derive the same mask from it (cpu/backward.inc),
//   one read less.
// NaN: act(NaN) = NaN in every mode. The Relu/Relu6 masks are selects, as TF's ReluGrad
// and Relu6Grad: where the mask is false dz is 0 whatever dy is (inf, NaN), and a NaN y
// gives dz = 0. Swish's derivative is arithmetic: NaN in z or dy gives NaN. Relu6's
// boundaries follow TF's Relu6Grad on the output (0 < y < 6): at y == 0 and y == 6 no
// gradient flows.
#ifndef FBN_GRAD_TF_CORE_ACTIVATION_H_
#define FBN_GRAD_TF_CORE_ACTIVATION_H_

#include <cmath>
#include <cstdint>
#include <cstring>

#include "common.h"

#if defined(__CUDACC__)
#define FBN_HD __host__ __device__ __forceinline__
#else
#define FBN_HD inline
#endif

namespace fbn {

template <Activation kAct>
struct ActivationOp;

template <>
struct ActivationOp<Activation::kIdentity> {
  static constexpr bool kNeedsY = false;  // the (CUDA) backward reads the forward's y
  static constexpr bool kNeedsZ = false;  // the backward recomputes z = bn(x) + side
  static FBN_HD float Forward(float z) { return z; }
};

template <>
struct ActivationOp<Activation::kRelu> {
  static constexpr bool kNeedsY = true;
  static constexpr bool kNeedsZ = false;
  static FBN_HD float Forward(float z) { return z < 0.0f ? 0.0f : z; }  // NaN stays NaN
  static FBN_HD bool Passes(float y) { return y > 0.0f; }
};

template <>
struct ActivationOp<Activation::kRelu6> {
  static constexpr bool kNeedsY = true;
  static constexpr bool kNeedsZ = false;
  static FBN_HD float Forward(float z) { return z < 0.0f ? 0.0f : (z > 6.0f ? 6.0f : z); }
  static FBN_HD bool Passes(float y) { return y > 0.0f && y < 6.0f; }
};

#if !defined(__CUDA_ARCH__)
// e^x for the CPU sigmoid: branch-free and made of IEEE float operations and integer bit
// moves only, so that the CPU loops vectorize it (std::exp is a call per element) and every
// ISA path, vector body or scalar tail, rounds it identically (-ffp-contract=off).
// x = k ln2 + r with |r| <= ln2/2 (ln2 in two parts, the first exact in k * part), e^r by
// Cephes' expf polynomial, 2^k from the exponent bits. About 1 ulp on [-87, 88]. Outside:
// +inf above 88.72 (e^x overflows), 0 below -87.34; for the sigmoid the few values between
// (88, 88.72] get e^88 (1 + e^x is then 1.6e38 or more either way). NaN stays NaN.
inline float ExpForSigmoid(float x) {
  const float xc = x > 88.0f ? 88.0f : (x < -87.0f ? -87.0f : x);  // NaN passes through
  // round(xc / ln2) by the 1.5 * 2^23 shifter: its low mantissa bits are then k.
  const float shifted = xc * 1.44269504088896341f + 12582912.0f;
  const float kf = shifted - 12582912.0f;
  const float r = (xc - kf * 0.693359375f) - kf * -2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  const float er = p * (r * r) + r + 1.0f;
  uint32_t bits;
  std::memcpy(&bits, &shifted, 4);
  const uint32_t scale_bits = (bits - 0x4B400000u + 127u) << 23;  // 2^k, |k| <= 127
  float scale;
  std::memcpy(&scale, &scale_bits, 4);
  const float e = er * scale;
  return x > 88.7228391f ? HUGE_VALF : (x < -87.3365479f ? 0.0f : e);
}
#endif

template <>
struct ActivationOp<Activation::kSwish> {
  static constexpr bool kNeedsY = false;
  static constexpr bool kNeedsZ = true;
  static FBN_HD float Sigmoid(float z) {
#if defined(__CUDA_ARCH__)
    return 1.0f / (1.0f + expf(-z));
#else
    return 1.0f / (1.0f + ExpForSigmoid(-z));
#endif
  }
  static FBN_HD float Forward(float z) { return z * Sigmoid(z); }
  // d act / dz, in the form of TF's swish gradient: s * (1 + z * (1 - s)).
  static FBN_HD float Derivative(float z) {
    const float s = Sigmoid(z);
#if defined(__CUDA_ARCH__)
    // Each operation rounded on its own, as the CPU kernels do (-ffp-contract=off): nvcc
    // would fuse z * (1 - s) + 1 into an FMA or not depending on the code around it.
    return __fmul_rn(s, __fadd_rn(1.0f, __fmul_rn(z, __fsub_rn(1.0f, s))));
#else
    return s * (1.0f + z * (1.0f - s));
#endif
  }
};

}  // namespace fbn

#endif  // FBN_GRAD_TF_CORE_ACTIVATION_H_
