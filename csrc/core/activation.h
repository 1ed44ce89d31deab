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
//   one read less; elsewhere they read the forward's activation mask when given one (below),
//   2 bits per element instead of y.
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
  // & not &&: no branch, so that the CPU select loops vectorize (or at least run branch-free).
  static FBN_HD bool Passes(float y) { return (y > 0.0f) & (y < 6.0f); }
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

#if !defined(__CUDA_ARCH__)
// ---- the activation mask: the Relu/Relu6 mask handed from the CPU forward to its backward --
// Where the backward would read y only for the Relu/Relu6 mask (the 16-bit types, and float
// with a side input: see the header above and cpu/backward.inc), the CPU forward in training
// also writes that mask, Passes(y[i]) for y as stored (rounded to T), 16 elements to a
// 32-bit word: bit i % 16 of word i / 16, the word's high half always 0x3f80, so that every
// word is a finite float (1.0 <= w < 1.0079): tf.debugging.enable_check_numerics() and any
// other reader see plain numbers. The backward then reads 2 bits per element instead of y's
// 16 or 32. The words travel in the forward's reserve_space_3 (float, otherwise empty on the
// CPU), followed by kActivationMaskTagWords words that tie them to the element count and the
// activation, so that a reserve_space_3 of any other origin (TF's forward, the GPU forward,
// a user's tensor) is never taken for a mask (IsActivationMask): the backward then reads y.
constexpr uint32_t kActivationMaskHigh = 0x3f800000u;
constexpr int64_t kActivationMaskTagWords = 4;
inline bool WritesActivationMask(Activation act, bool has_side_input, bool is_16bit,
                                 bool is_training) {
  return is_training && (act == Activation::kRelu || act == Activation::kRelu6) &&
         (has_side_input || is_16bit);
}
inline int64_t ActivationMaskWords(int64_t elements) { return (elements + 15) / 16; }
// Floats of reserve_space_3 holding the mask of `elements` elements: words, then the tag.
inline int64_t ActivationMaskFloats(int64_t elements) {
  return ActivationMaskWords(elements) + kActivationMaskTagWords;
}
// Tag word k (k < kActivationMaskTagWords) of a mask of `elements` elements for `act`.
inline uint32_t ActivationMaskTagWord(int64_t elements, Activation act, int64_t k) {
  const uint64_t tag = 0x46626e4d61736b00ull ^ (static_cast<uint64_t>(elements) << 8) ^
                       static_cast<uint64_t>(act);
  return kActivationMaskHigh | static_cast<uint32_t>((tag >> (16 * k)) & 0xffffu);
}
inline void SetActivationMaskTag(uint32_t* words, int64_t elements, Activation act) {
  const int64_t n = ActivationMaskWords(elements);
  for (int64_t k = 0; k < kActivationMaskTagWords; ++k)
    words[n + k] = ActivationMaskTagWord(elements, act, k);
}
// Whether `floats` floats at p are the mask of `elements` elements for `act`.
inline bool IsActivationMask(const void* p, int64_t floats, int64_t elements, Activation act) {
  if (p == nullptr || elements <= 0 || floats != ActivationMaskFloats(elements)) return false;
  const int64_t n = ActivationMaskWords(elements);
  for (int64_t k = 0; k < kActivationMaskTagWords; ++k) {
    uint32_t w;
    std::memcpy(&w, static_cast<const char*>(p) + 4 * (n + k), 4);
    if (w != ActivationMaskTagWord(elements, act, k)) return false;
  }
  return true;
}
#endif

}  // namespace fbn

#endif  // FBN_GRAD_TF_CORE_ACTIVATION_H_
