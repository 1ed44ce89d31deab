// Internal helpers shared by the CUDA sources of the core (cuda/backward.cu and
// cuda/forward.cu): element-type traits, vector loads/stores, warp sums and the
// shape-only chunking. Not a public header: include it from .cu files only.
#ifndef FBN_GRAD_TF_CORE_CUDA_COMMON_CUH_
#define FBN_GRAD_TF_CORE_CUDA_COMMON_CUH_

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "../common.h"

namespace fbn {
namespace cuda_detail {

constexpr int kThreads = 256;               // threads per block of every kernel
constexpr int64_t kTargetBlocks = 1024;     // roughly one full wave on a large GPU
constexpr int64_t kMinBlockElems = 4096;    // least work of a reduction block
constexpr int64_t kNominalTile = 128;       // channels-last: channels per tile (for G only)
constexpr int64_t kChunkAlign = 8;          // channels-first chunk: multiple of any VEC
constexpr int64_t kMaxGrid = int64_t{1} << 30;

inline int64_t CeilDiv(int64_t a, int64_t b) { return (a + b - 1) / b; }

// ---------------------------------------------------------------------------------------
// Element types: Raw is the storage, ToF/FromF convert (round to nearest even), Round(v) is v
// rounded to T and back (what a store and a reload give).
template <typename T>
struct Dev;
template <>
struct Dev<float> {
  using Raw = float;
  static __device__ __forceinline__ float ToF(float v) { return v; }
  static __device__ __forceinline__ float FromF(float v) { return v; }
  static __device__ __forceinline__ float Round(float v) { return v; }
};
template <>
struct Dev<half_t> {
  using Raw = unsigned short;
  static __device__ __forceinline__ float ToF(unsigned short b) {
    return __half2float(__ushort_as_half(b));
  }
  static __device__ __forceinline__ unsigned short FromF(float f) {
    return __half_as_ushort(__float2half_rn(f));
  }
  static __device__ __forceinline__ float Round(float f) { return ToF(FromF(f)); }
};
template <>
struct Dev<bfloat16_t> {
  using Raw = unsigned short;
  static __device__ __forceinline__ float ToF(unsigned short b) {
    return __bfloat162float(__ushort_as_bfloat16(b));
  }
  static __device__ __forceinline__ unsigned short FromF(float f) {
    return __bfloat16_as_ushort(__float2bfloat16_rn(f));
  }
  static __device__ __forceinline__ float Round(float f) { return ToF(FromF(f)); }
};

template <int kBytes>
struct Bits;
template <>
struct Bits<2> {
  using type = unsigned short;
};
template <>
struct Bits<4> {
  using type = unsigned int;
};
template <>
struct Bits<8> {
  using type = uint2;
};
template <>
struct Bits<16> {
  using type = uint4;
};

// Loads VEC contiguous elements as floats: one vector load when `aligned`, else VEC
// scalar loads. Both give the same values, so alignment never changes results.
template <typename T, int VEC>
__device__ __forceinline__ void LoadVec(const typename Dev<T>::Raw* p, bool aligned,
                                        float (&out)[VEC]) {
  using Raw = typename Dev<T>::Raw;
  if (VEC == 1 || aligned) {
    using V = typename Bits<sizeof(Raw) * VEC>::type;
    union {
      V v;
      Raw r[VEC];
    } u;
    u.v = __ldg(reinterpret_cast<const V*>(p));
#pragma unroll
    for (int v = 0; v < VEC; ++v) out[v] = Dev<T>::ToF(u.r[v]);
  } else {
#pragma unroll
    for (int v = 0; v < VEC; ++v) out[v] = Dev<T>::ToF(__ldg(p + v));
  }
}

template <typename T, int VEC>
__device__ __forceinline__ void StoreVec(typename Dev<T>::Raw* p, bool aligned,
                                         const float (&in)[VEC]) {
  using Raw = typename Dev<T>::Raw;
  if (VEC == 1 || aligned) {
    using V = typename Bits<sizeof(Raw) * VEC>::type;
    union {
      V v;
      Raw r[VEC];
    } u;
#pragma unroll
    for (int v = 0; v < VEC; ++v) u.r[v] = Dev<T>::FromF(in[v]);
    *reinterpret_cast<V*>(p) = u.v;
  } else {
#pragma unroll
    for (int v = 0; v < VEC; ++v) p[v] = Dev<T>::FromF(in[v]);
  }
}

// The forward's pre-activation z = (x - mean) * k + offset [+ side] (k = scale * inv), each
// operation rounded on its own: nvcc contracts a*b+c into an FMA by default, and where it
// does so depends on the surrounding code. The Swish backward recomputes z with these same
// functions, so its z is bitwise the forward's; it is also the CPU kernels' arithmetic
// (compiled with -ffp-contract=off).
__device__ __forceinline__ float PreActivation(float x, float mean, float k, float offset) {
  return __fadd_rn(__fmul_rn(__fsub_rn(x, mean), k), offset);
}
__device__ __forceinline__ float AddSide(float z, float side) { return __fadd_rn(z, side); }

__device__ __forceinline__ float WarpSum(float s) {
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) s += __shfl_down_sync(0xffffffffu, s, off);
  return s;  // complete in lane 0
}

// ---------------------------------------------------------------------------------------
// Channels-first walk over one chunk of one channel ([outer, C, inner], inner % VEC == 0).
// A unit is VEC consecutive elements of an (outer, channel) run; unit j of the channel is
// at outer j / inner_v, inner unit j % inner_v. A thread visits the chunk's units tid,
// tid + kThreads, ...; its cursor keeps (outer, inner unit) and steps both, so no step
// divides. Shared by the backward's pass and the forward's statistics and apply.
template <int VEC>
struct ChannelsFirstUnits {
  int64_t inner_v;   // units per (outer, channel) run
  int64_t m_v;       // units per channel
  int64_t chunk_v;   // units per chunk
  int64_t step_o;    // a unit index's advance by kThreads,
  int64_t step_i;    //   as (outer, inner unit) steps
  int64_t stride_o;  // elements between consecutive outer

  struct Cursor {
    int64_t j, j_end, o, iv;  // unit index, end of the chunk, its (outer, inner unit)
    __device__ __forceinline__ bool More() const { return j < j_end; }
  };

  // C, inner: the shape; M, chunk: elements per channel and per chunk (ChunkPlan).
  __device__ __forceinline__ ChannelsFirstUnits(int64_t C, int64_t inner, int64_t M,
                                                int64_t chunk)
      : inner_v(inner / VEC),
        m_v(M / VEC),
        chunk_v(chunk / VEC),
        step_o(kThreads / inner_v),  // (members are initialized in declaration order)
        step_i(kThreads % inner_v),
        stride_o(C * inner) {}

  // Thread tid's first unit of chunk g.
  __device__ __forceinline__ Cursor Start(int64_t g, int tid) const {
    Cursor at;
    at.j = g * chunk_v + tid;
    at.j_end = min(m_v, (g + 1) * chunk_v);
    at.o = at.j / inner_v;
    at.iv = at.j - at.o * inner_v;
    return at;
  }

  // The cursor's next U units: offs[u], the unit's element offset from the channel's
  // first element (outer 0, inner 0); valid[u], whether it is still in the chunk. Moves
  // the cursor past them.
  template <int U>
  __device__ __forceinline__ void Next(Cursor& at, int64_t (&offs)[U], bool (&valid)[U]) const {
#pragma unroll
    for (int u = 0; u < U; ++u) {
      valid[u] = at.j < at.j_end;
      offs[u] = at.o * stride_o + at.iv * VEC;
      at.j += kThreads;
      at.iv += step_i;
      at.o += step_o;
      if (at.iv >= inner_v) {
        at.iv -= inner_v;
        ++at.o;
      }
    }
  }
};

// ---------------------------------------------------------------------------------------
// Host side: chunking, a function of the shape alone (not of T, the device or the
// pointers), so every reduction order is fixed by the shape. See docs/GPU.md.
struct ChunkPlan {
  bool channels_last = true;
  int64_t M = 0;      // rows (channels-last) or elements per channel (channels-first)
  int64_t G = 1;      // chunks per channel
  int64_t chunk = 0;  // rows or elements per chunk (the last chunk may be shorter)
};

inline ChunkPlan MakeChunkPlan(const BnShape& s) {
  ChunkPlan plan;
  if (s.elements() <= 0 || s.channels <= 0) return plan;
  const int64_t C = s.channels;
  plan.channels_last = s.inner == 1;
  if (plan.channels_last) {
    plan.M = s.outer;
    const int64_t tiles = CeilDiv(C, kNominalTile);
    const int64_t g_max = std::max<int64_t>(1, CeilDiv(plan.M * std::min(C, kNominalTile),
                                                       kMinBlockElems));
    int64_t g = std::min(std::max<int64_t>(1, CeilDiv(kTargetBlocks, tiles)), g_max);
    g = std::min(g, plan.M);
    plan.chunk = CeilDiv(plan.M, g);
    plan.G = CeilDiv(plan.M, plan.chunk);
  } else {
    plan.M = s.outer * s.inner;
    const int64_t g_max = std::max<int64_t>(1, CeilDiv(plan.M, kMinBlockElems));
    const int64_t g = std::min(std::max<int64_t>(1, CeilDiv(kTargetBlocks, C)), g_max);
    plan.chunk = CeilDiv(CeilDiv(plan.M, g), kChunkAlign) * kChunkAlign;
    plan.G = CeilDiv(plan.M, plan.chunk);
  }
  return plan;
}

template <typename T>
constexpr int MaxVec() {
  return sizeof(T) == 4 ? 4 : 8;
}

// Vector width: the largest power of two (up to MaxVec) dividing `run`, the contiguous run
// of a thread's elements (C for channels-last, inner for channels-first). It depends on the
// shape and T only; misaligned pointers keep it and just use scalar accesses.
// Channels-last caps 16-bit types at 4 elements (8-byte accesses): there a thread keeps
// per-channel state (sums, mean, coefficients) for each of its VEC channels, and at 8 it
// needed 80 registers (37.5% occupancy, fewer bytes in flight); at 4, the 16-bit backward
// ran 0.71-0.89x and the forward 0.73-0.96x the time of the 8-wide passes on every shape
// measured (H200, docs/GPU.md).
// Channels-first threads keep one channel's state, and 16-byte accesses stay faster there.
template <typename T>
int VecWidth(int64_t run, bool channels_last) {
  int vec = channels_last ? std::min(MaxVec<T>(), 4) : MaxVec<T>();
  while (vec > 1 && run % vec != 0) vec /= 2;
  return vec;
}

inline bool Aligned(const void* p, size_t bytes) {
  return reinterpret_cast<uintptr_t>(p) % bytes == 0;
}

inline int GridFor(int64_t blocks) {
  return static_cast<int>(std::max<int64_t>(1, std::min(blocks, kMaxGrid)));
}

// Threads along the channels of a channels-last block: a power of two, at most 32,
// covering the C/VEC vectors of a row when it can.
inline int ChannelsLastBx(int64_t C, int vec) {
  const int64_t nv = C / vec;
  int bx = 1;
  while (bx < 32 && bx < nv) bx *= 2;
  return bx;
}

}  // namespace cuda_detail
}  // namespace fbn

#endif  // FBN_GRAD_TF_CORE_CUDA_COMMON_CUH_
