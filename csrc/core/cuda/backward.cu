// CUDA kernels of the core: batch-normalization backward on the canonical view
// [outer, channels, inner] (../common.h). See docs/GPU.md for the design.
//
// Passes (all on the caller's stream, no host synchronisation):
//   training : Pass<kReduce>  -> Finalize -> Pass<kApply>
//   inference: Pass<kReduceScale> (also writes dx = dy * scale * inv) -> Finalize
//
// Pass<...> exists in two layouts:
//   channels-last  (inner == 1): the data is a row-major [rows = outer, C] matrix. A block
//     owns a tile of bx*VEC channels and a fixed chunk of rows; thread (tx, ty) handles VEC
//     adjacent channels and the rows ty, ty + by, ty + 2*by, ... of the chunk.
//   channels-first (inner > 1): a block owns one channel and a fixed chunk of its M
//     elements (enumerated o*inner + i); thread t handles elements (in units of VEC
//     contiguous elements) t, t + 256, t + 512, ... of the chunk.
// With a fused activation (y = act(bn(x) + side_input), ../backward.h) every pass reads
// dz = dy * act'(z) in place of dy, computed per element as it is loaded: Relu/Relu6 mask dy
// with the forward's y, Swish recomputes z from x, the statistics, scale, offset and the side
// input exactly as the forward did (common.cuh: PreActivation). dz is rounded to T, as the CPU
// kernels (which stage it in a T buffer) and side_input_backprop hold it, so dx and the sums
// are exactly the plain backward's of side_input_backprop. The first pass (kReduce,
// kReduceScale) also writes side_input_backprop = dz. The mode and whether Swish reads a side
// input are template parameters of the passes; Finalize does not depend on them.
//
// In place (../backward.h: dx may be dy or x, side_input_backprop may be dy): every element
// is read by one thread, and written only by that thread after it has read it; no element
// is read again in the same kernel, so a stale read-only-cache line is never used.
// Training with side_input_backprop: the second pass reads it (dz) instead of dy.
//
// Reductions: each thread sums its elements in a fixed order, the block combines the
// thread sums with a fixed tree and writes one partial sum per (chunk, channel) into the
// workspace; Finalize combines the partials of a channel with a fixed warp tree. Chunks
// and trees depend on the shape alone (never on timing, the device, pointer alignment or
// the element type), so results are bitwise identical from run to run. No atomics.
//
// Workspace (floats, contiguous, exact size from BnGradCudaWorkspaceBytes):
//   [0,        G*C)   partial sum(dy)            indexed [c * G + g]
//   [G*C,    2*G*C)   partial sum(dy * (x-mean)) indexed [c * G + g]
//   training only:
//   [2GC,    2GC+C)   k[c]   = scale * inv
//   [2GC+C,  2GC+2C)  mdy[c] = sum(dy) / M
//   [2GC+2C, 2GC+3C)  q[c]   = inv * inv * sum(dy * (x-mean)) / M
#include "backward.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "../activation.h"
#include "common.cuh"

namespace fbn {
namespace {

using namespace cuda_detail;  // NOLINT: kThreads, Dev<T>, LoadVec, StoreVec, WarpSum, ...

enum Mode : int { kReduce = 0, kReduceScale = 1, kApply = 2 };

// ---------------------------------------------------------------------------------------
// Kernel parameters (passed by value).
struct KParams {
  const void* dy;
  const void* x;
  void* dx;
  const float* scale;
  const float* mean;
  const float* var;
  float* p1;        // partial sum(dy)            [C, G]
  float* p2;        // partial sum(dy * (x-mean)) [C, G]
  float* coef_k;    // training: [C]
  float* coef_mdy;  // training: [C]
  float* coef_q;    // training: [C]
  float* dscale;
  float* doffset;
  int64_t C;
  int64_t inner;    // channels-first only
  int64_t M;        // channels-last: rows (= outer); channels-first: outer * inner
  int64_t G;        // chunks per channel
  int64_t chunk;    // channels-last: rows per chunk; channels-first: elements (x8)
  int64_t ctn;      // channels-last: channel tiles
  int64_t nblocks;  // logical blocks of a pass
  float eps;
  float inv_m;      // 1 / M, for the training coefficients
  int bx;           // channels-last: threads along the channels (power of 2, <= 32)
  int aligned;      // dy, x, dx aligned for VEC-wide vector accesses
  int inv_std;      // reserve_space_2 already holds 1/sqrt(var + eps)
  int training;
  // The fused activation's inputs (read by the kernels whose kAct needs them) and output.
  const void* act_y;    // the forward's y: Relu/Relu6 masks
  const void* side;     // the forward's side input: Swish's z (kernels with kSide)
  const float* offset;  // Swish's z
  void* side_bp;        // side_input_backprop = dz, written by the first pass; may be null
};

__device__ __forceinline__ float InvStd(const KParams& p, int64_t c) {
  if (p.training && p.inv_std) return p.var[c];
  return 1.0f / sqrtf(p.var[c] + p.eps);  // IEEE sqrt and division (no fast math)
}

// Per-channel values of a pass: the mean, the dx coefficients a, b, q (Dx) and, for Swish,
// z's coefficients k = scale * inv and offset. Every pass computes k bitwise as the forward
// did (Finalize's coef_k is the same product), so z is the forward's z.
template <int kMode, bool kNeedsZ>
__device__ __forceinline__ void ChannelCoefs(const KParams& p, int64_t c, float& mean,
                                             float& a, float& b, float& q, float& zk,
                                             float& zb) {
  mean = p.mean[c];
  a = 0.f;
  b = 0.f;
  q = 0.f;
  if (kMode == kReduceScale) {
    a = p.scale[c] * InvStd(p, c);
  } else if (kMode == kApply) {
    a = p.coef_k[c];
    b = p.coef_mdy[c];
    q = p.coef_q[c];
  }
  zk = 0.f;
  zb = 0.f;
  if (kNeedsZ) {
    zk = kMode == kReduce ? p.scale[c] * InvStd(p, c) : a;
    zb = p.offset[c];
  }
}

// Loads dy and x of VEC elements at element offset `off` and turns dy into dz (see the top
// of the file). mean/zk/zb: per element of the vector (the channels-first passes repeat
// their channel's value).
template <typename T, int VEC, Activation kAct, bool kSide>
__device__ __forceinline__ void LoadDzX(const KParams& p, int64_t off, bool aligned,
                                        const float (&mean)[VEC], const float (&zk)[VEC],
                                        const float (&zb)[VEC], float (&dz)[VEC],
                                        float (&fx)[VEC]) {
  using Raw = typename Dev<T>::Raw;
  using Op = ActivationOp<kAct>;
  LoadVec<T, VEC>(static_cast<const Raw*>(p.dy) + off, aligned, dz);
  LoadVec<T, VEC>(static_cast<const Raw*>(p.x) + off, aligned, fx);
  if constexpr (Op::kNeedsY) {
    // A select, as TF's ReluGrad/Relu6Grad: a masked-out dy never reaches the sums,
    // whatever its value. Exact, so no rounding is needed.
    float fy[VEC];
    LoadVec<T, VEC>(static_cast<const Raw*>(p.act_y) + off, aligned, fy);
#pragma unroll
    for (int v = 0; v < VEC; ++v) dz[v] = Op::Passes(fy[v]) ? dz[v] : 0.f;
  } else if constexpr (Op::kNeedsZ) {
    float fs[VEC];
    if constexpr (kSide) LoadVec<T, VEC>(static_cast<const Raw*>(p.side) + off, aligned, fs);
#pragma unroll
    for (int v = 0; v < VEC; ++v) {
      float z = PreActivation(fx[v], mean[v], zk[v], zb[v]);
      if constexpr (kSide) z = AddSide(z, fs[v]);
      // __fmul_rn: never fused with what consumes dz. For float, Round is the identity,
      // and nvcc contracted dy * d into the pass's next operation (dx's dz - b, the sum
      // s1 + dz) differently in the two passes, so dx was not bitwise the plain backward of
      // the side_input_backprop that the first pass stored (seen on an H200).
      dz[v] = Dev<T>::Round(__fmul_rn(dz[v], Op::Derivative(z)));
    }
  }
}

template <int kMode>
__device__ __forceinline__ float Dx(float dy, float x, float mean, float a, float b,
                                    float q) {
  if (kMode == kReduceScale) return dy * a;
  return a * ((dy - b) - (x - mean) * q);
}

// ---------------------------------------------------------------------------------------
// Channels-last pass over [rows, C].
template <typename T, int VEC, int kMode, Activation kAct, bool kSide>
__global__ void __launch_bounds__(kThreads) PassChannelsLast(const KParams p) {
  using Raw = typename Dev<T>::Raw;
  constexpr int U = VEC >= 4 ? 2 : 4;  // rows in flight per thread
  constexpr bool kSums = kMode != kApply;
  constexpr bool kWriteDx = kMode != kReduce;
  constexpr bool kNeedsZ = ActivationOp<kAct>::kNeedsZ;
  __shared__ float sm1[kSums ? kThreads * VEC : 1];
  __shared__ float sm2[kSums ? kThreads * VEC : 1];

  // Not __restrict__: dx may be dy or x, side_bp may be dy (in place, ../backward.h).
  Raw* dx = static_cast<Raw*>(p.dx);
  Raw* side_bp = kSums ? static_cast<Raw*>(p.side_bp) : nullptr;
  const bool aligned = p.aligned != 0;
  const int bx = p.bx;
  const int by = kThreads / bx;
  const int tx = static_cast<int>(threadIdx.x) % bx;
  const int ty = static_cast<int>(threadIdx.x) / bx;
  const int64_t ct = static_cast<int64_t>(bx) * VEC;
  const int64_t C = p.C;

  for (int64_t b = blockIdx.x; b < p.nblocks; b += gridDim.x) {
    const int64_t tile = b % p.ctn;
    const int64_t g = b / p.ctn;
    const int64_t c0 = tile * ct + static_cast<int64_t>(tx) * VEC;
    const bool active = c0 < C;  // C % VEC == 0: a vector is all in or all out
    const int64_t r_begin = g * p.chunk;
    const int64_t r_end = min(p.M, r_begin + p.chunk);

    float s1[VEC], s2[VEC], mean[VEC], ca[VEC], cb[VEC], cq[VEC], zk[VEC], zb[VEC];
#pragma unroll
    for (int v = 0; v < VEC; ++v) {
      s1[v] = 0.f;
      s2[v] = 0.f;
      mean[v] = ca[v] = cb[v] = cq[v] = zk[v] = zb[v] = 0.f;
    }
    if (active) {
#pragma unroll
      for (int v = 0; v < VEC; ++v) {
        ChannelCoefs<kMode, kNeedsZ>(p, c0 + v, mean[v], ca[v], cb[v], cq[v], zk[v], zb[v]);
      }

      int64_t r = r_begin + ty;
      const int64_t step = static_cast<int64_t>(by);
      // U rows at a time (loads first), then the rest one by one: the same order as a
      // plain loop r, r + by, r + 2*by, ...
      for (; r + (U - 1) * step < r_end; r += U * step) {
        float fdy[U][VEC], fx[U][VEC];
#pragma unroll
        for (int u = 0; u < U; ++u) {
          const int64_t off = (r + u * step) * C + c0;
          LoadDzX<T, VEC, kAct, kSide>(p, off, aligned, mean, zk, zb, fdy[u], fx[u]);
          if (kSums && side_bp != nullptr) StoreVec<T, VEC>(side_bp + off, aligned, fdy[u]);
        }
#pragma unroll
        for (int u = 0; u < U; ++u) {
          float out[VEC];
#pragma unroll
          for (int v = 0; v < VEC; ++v) {
            if (kSums) {
              s1[v] += fdy[u][v];
              s2[v] += fdy[u][v] * (fx[u][v] - mean[v]);
            }
            if (kWriteDx) out[v] = Dx<kMode>(fdy[u][v], fx[u][v], mean[v], ca[v], cb[v], cq[v]);
          }
          if (kWriteDx) StoreVec<T, VEC>(dx + (r + u * step) * C + c0, aligned, out);
        }
      }
      for (; r < r_end; r += step) {
        float fdy[VEC], fx[VEC], out[VEC];
        const int64_t off = r * C + c0;
        LoadDzX<T, VEC, kAct, kSide>(p, off, aligned, mean, zk, zb, fdy, fx);
        if (kSums && side_bp != nullptr) StoreVec<T, VEC>(side_bp + off, aligned, fdy);
#pragma unroll
        for (int v = 0; v < VEC; ++v) {
          if (kSums) {
            s1[v] += fdy[v];
            s2[v] += fdy[v] * (fx[v] - mean[v]);
          }
          if (kWriteDx) out[v] = Dx<kMode>(fdy[v], fx[v], mean[v], ca[v], cb[v], cq[v]);
        }
        if (kWriteDx) StoreVec<T, VEC>(dx + off, aligned, out);
      }
    }

    if (kSums) {
      // Slot of (tx, ty, v) is ty * ct + tx * VEC + v == threadIdx.x * VEC + v.
      const int base = static_cast<int>(threadIdx.x) * VEC;
#pragma unroll
      for (int v = 0; v < VEC; ++v) {
        sm1[base + v] = s1[v];
        sm2[base + v] = s2[v];
      }
      // Fixed tree over ty (by is a power of two).
      for (int s = by / 2; s > 0; s >>= 1) {
        __syncthreads();
        if (ty < s) {
          const int other = base + s * static_cast<int>(ct);
#pragma unroll
          for (int v = 0; v < VEC; ++v) {
            sm1[base + v] += sm1[other + v];
            sm2[base + v] += sm2[other + v];
          }
        }
      }
      if (ty == 0 && active) {
#pragma unroll
        for (int v = 0; v < VEC; ++v) {
          p.p1[(c0 + v) * p.G + g] = sm1[base + v];
          p.p2[(c0 + v) * p.G + g] = sm2[base + v];
        }
      }
      __syncthreads();  // shared memory is reused by the next logical block
    }
  }
}

// ---------------------------------------------------------------------------------------
// Channels-first pass over [outer, C, inner], inner % VEC == 0.
template <typename T, int VEC, int kMode, Activation kAct, bool kSide>
__global__ void __launch_bounds__(kThreads) PassChannelsFirst(const KParams p) {
  using Raw = typename Dev<T>::Raw;
  constexpr int U = VEC >= 4 ? 2 : 4;
  constexpr bool kSums = kMode != kApply;
  constexpr bool kWriteDx = kMode != kReduce;
  constexpr bool kNeedsZ = ActivationOp<kAct>::kNeedsZ;
  constexpr int kWarps = kThreads / 32;
  __shared__ float red1[kWarps];
  __shared__ float red2[kWarps];

  // Not __restrict__: dx may be dy or x, side_bp may be dy (in place, ../backward.h).
  Raw* dx = static_cast<Raw*>(p.dx);
  Raw* side_bp = kSums ? static_cast<Raw*>(p.side_bp) : nullptr;
  const bool aligned = p.aligned != 0;
  const ChannelsFirstUnits<VEC> units(p.C, p.inner, p.M, p.chunk);
  const int tid = static_cast<int>(threadIdx.x);
  const int lane = tid & 31;
  const int warp = tid >> 5;

  for (int64_t b = blockIdx.x; b < p.nblocks; b += gridDim.x) {
    const int64_t c = b / p.G;
    const int64_t g = b % p.G;
    float mean, ca, cb, cq, zk, zb;
    ChannelCoefs<kMode, kNeedsZ>(p, c, mean, ca, cb, cq, zk, zb);
    float mean_v[VEC], zk_v[VEC], zb_v[VEC];  // LoadDzX's per-element form
#pragma unroll
    for (int v = 0; v < VEC; ++v) {
      mean_v[v] = mean;
      zk_v[v] = zk;
      zb_v[v] = zb;
    }
    const int64_t base_c = c * p.inner;  // element offset of (outer 0, c, inner 0)
    Raw* dxc = dx + base_c;

    float s1 = 0.f, s2 = 0.f;
    typename ChannelsFirstUnits<VEC>::Cursor at = units.Start(g, tid);
    while (at.More()) {
      int64_t offs[U];
      bool valid[U];
      units.Next(at, offs, valid);
      float fdy[U][VEC], fx[U][VEC];
#pragma unroll
      for (int u = 0; u < U; ++u) {
        if (valid[u]) {
          const int64_t off = base_c + offs[u];
          LoadDzX<T, VEC, kAct, kSide>(p, off, aligned, mean_v, zk_v, zb_v, fdy[u], fx[u]);
          if (kSums && side_bp != nullptr) StoreVec<T, VEC>(side_bp + off, aligned, fdy[u]);
        }
      }
#pragma unroll
      for (int u = 0; u < U; ++u) {
        if (valid[u]) {
          float out[VEC];
#pragma unroll
          for (int v = 0; v < VEC; ++v) {
            if (kSums) {
              s1 += fdy[u][v];
              s2 += fdy[u][v] * (fx[u][v] - mean);
            }
            if (kWriteDx) out[v] = Dx<kMode>(fdy[u][v], fx[u][v], mean, ca, cb, cq);
          }
          if (kWriteDx) StoreVec<T, VEC>(dxc + offs[u], aligned, out);
        }
      }
    }

    if (kSums) {
      s1 = WarpSum(s1);
      s2 = WarpSum(s2);
      if (lane == 0) {
        red1[warp] = s1;
        red2[warp] = s2;
      }
      __syncthreads();
      if (warp == 0) {
        float t1 = lane < kWarps ? red1[lane] : 0.f;
        float t2 = lane < kWarps ? red2[lane] : 0.f;
        t1 = WarpSum(t1);
        t2 = WarpSum(t2);
        if (lane == 0) {
          p.p1[c * p.G + g] = t1;
          p.p2[c * p.G + g] = t2;
        }
      }
      __syncthreads();  // red1/red2 are reused by the next logical block
    }
  }
}

// ---------------------------------------------------------------------------------------
// One warp per channel: combines the G partial sums (lane l sums g = l, l+32, ... in
// order, then a fixed shuffle tree), writes dscale/doffset and the training coefficients.
__global__ void __launch_bounds__(kThreads) Finalize(const KParams p) {
  const int lane = static_cast<int>(threadIdx.x) & 31;
  const int64_t warps_total = static_cast<int64_t>(gridDim.x) * (kThreads / 32);
  const int64_t C = p.C;
  for (int64_t c = (static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x) / 32; c < C;
       c += warps_total) {
    float s1 = 0.f, s2 = 0.f;
    for (int64_t g = lane; g < p.G; g += 32) {
      s1 += p.p1[c * p.G + g];
      s2 += p.p2[c * p.G + g];
    }
    s1 = WarpSum(s1);
    s2 = WarpSum(s2);
    if (lane == 0) {
      const float inv = InvStd(p, c);
      p.dscale[c] = inv * s2;
      p.doffset[c] = s1;
      if (p.training) {
        p.coef_k[c] = p.scale[c] * inv;
        p.coef_mdy[c] = s1 * p.inv_m;
        p.coef_q[c] = inv * inv * s2 * p.inv_m;
      }
    }
  }
}

// ---------------------------------------------------------------------------------------
// Host side.

// Chunking (cuda/common.cuh, shared with the forward): a function of the shape alone.
struct Plan : ChunkPlan {
  int64_t ws_floats = 0;
};

Plan MakePlan(const BnGradParams& params) {
  Plan plan;
  static_cast<ChunkPlan&>(plan) = MakeChunkPlan(params.shape);
  const int64_t C = params.shape.channels;
  if (params.shape.elements() <= 0 || C <= 0) return plan;
  plan.ws_floats = 2 * plan.G * C + (params.is_training ? 3 * C : 0);
  return plan;
}

template <typename T, int VEC, int kMode, Activation kAct, bool kSide>
void LaunchPass(const KParams& kp, bool channels_last, cudaStream_t stream) {
  const int grid = GridFor(kp.nblocks);
  if (channels_last) {
    PassChannelsLast<T, VEC, kMode, kAct, kSide><<<grid, kThreads, 0, stream>>>(kp);
  } else {
    PassChannelsFirst<T, VEC, kMode, kAct, kSide><<<grid, kThreads, 0, stream>>>(kp);
  }
}

// The passes of one call, for one activation; kSide (Swish reads a side input) exists only
// for Swish, the one mode whose backward reads the side input.
template <typename T, int VEC, Activation kAct, bool kSide>
void RunPasses(const KParams& kp, bool channels_last, bool training, cudaStream_t stream) {
  const int fin_grid = GridFor(CeilDiv(kp.C, kThreads / 32));
  if (training) {
    LaunchPass<T, VEC, kReduce, kAct, kSide>(kp, channels_last, stream);
    Finalize<<<fin_grid, kThreads, 0, stream>>>(kp);
    if (kAct != Activation::kIdentity && kp.side_bp != nullptr) {
      // The first pass stored dz (rounded to T) as side_input_backprop: the second pass
      // reads it as a plain y_backprop, which gives dx bitwise (dz is what it would
      // recompute) from fewer streams (no y, no z), and is required when
      // side_input_backprop is y_backprop's own buffer (in place: dy is then gone).
      KParams plain = kp;
      plain.dy = kp.side_bp;
      LaunchPass<T, VEC, kApply, Activation::kIdentity, false>(plain, channels_last, stream);
    } else {
      LaunchPass<T, VEC, kApply, kAct, kSide>(kp, channels_last, stream);
    }
  } else {
    LaunchPass<T, VEC, kReduceScale, kAct, kSide>(kp, channels_last, stream);
    Finalize<<<fin_grid, kThreads, 0, stream>>>(kp);
  }
}

template <typename T, int VEC>
int RunWithVec(const Plan& plan, KParams kp, Activation act, bool training,
               cudaStream_t stream) {
  if (plan.channels_last) {
    const int bx = ChannelsLastBx(kp.C, VEC);
    kp.bx = bx;
    kp.ctn = CeilDiv(kp.C, static_cast<int64_t>(bx) * VEC);
    kp.nblocks = kp.ctn * plan.G;
  } else {
    kp.bx = 1;
    kp.ctn = 1;
    kp.nblocks = kp.C * plan.G;
  }
  const bool cl = plan.channels_last;
  switch (act) {
    case Activation::kIdentity:
      RunPasses<T, VEC, Activation::kIdentity, false>(kp, cl, training, stream);
      break;
    case Activation::kRelu:
      RunPasses<T, VEC, Activation::kRelu, false>(kp, cl, training, stream);
      break;
    case Activation::kRelu6:
      RunPasses<T, VEC, Activation::kRelu6, false>(kp, cl, training, stream);
      break;
    case Activation::kSwish:
      if (kp.side != nullptr) {
        RunPasses<T, VEC, Activation::kSwish, true>(kp, cl, training, stream);
      } else {
        RunPasses<T, VEC, Activation::kSwish, false>(kp, cl, training, stream);
      }
      break;
  }
  return static_cast<int>(cudaGetLastError());
}

}  // namespace

size_t BnGradCudaWorkspaceBytes(const BnGradParams& params) {
  return static_cast<size_t>(MakePlan(params).ws_floats) * sizeof(float);
}

template <typename T>
int BnGradCuda(const BnGradParams& params, const BnGradArgs<T>& args, void* workspace,
               size_t workspace_bytes, void* stream) {
  cudaStream_t st = static_cast<cudaStream_t>(stream);
  const BnShape& shape = params.shape;
  if (shape.channels < 0 || shape.outer < 0 || shape.inner < 0) {
    return static_cast<int>(cudaErrorInvalidValue);
  }
  const int64_t C = shape.channels;
  if (C == 0) return static_cast<int>(cudaSuccess);
  if (args.dscale == nullptr || args.doffset == nullptr) {
    return static_cast<int>(cudaErrorInvalidValue);
  }
  if (shape.elements() == 0) {
    cudaError_t e = cudaMemsetAsync(args.dscale, 0, sizeof(float) * C, st);
    if (e == cudaSuccess) e = cudaMemsetAsync(args.doffset, 0, sizeof(float) * C, st);
    return static_cast<int>(e);
  }
  if (args.dy == nullptr || args.x == nullptr || args.dx == nullptr ||
      args.scale == nullptr || args.saved_mean == nullptr || args.saved_var == nullptr) {
    return static_cast<int>(cudaErrorInvalidValue);
  }

  const Plan plan = MakePlan(params);
  const size_t need = static_cast<size_t>(plan.ws_floats) * sizeof(float);
  if (workspace_bytes < need || (need > 0 && workspace == nullptr) ||
      !Aligned(workspace, alignof(float))) {
    return static_cast<int>(cudaErrorInvalidValue);
  }

  float* ws = static_cast<float*>(workspace);
  KParams kp{};
  kp.dy = args.dy;
  kp.x = args.x;
  kp.dx = args.dx;
  kp.scale = args.scale;
  kp.mean = args.saved_mean;
  kp.var = args.saved_var;
  kp.p1 = ws;
  kp.p2 = ws + plan.G * C;
  kp.coef_k = params.is_training ? ws + 2 * plan.G * C : nullptr;
  kp.coef_mdy = params.is_training ? ws + 2 * plan.G * C + C : nullptr;
  kp.coef_q = params.is_training ? ws + 2 * plan.G * C + 2 * C : nullptr;
  kp.dscale = args.dscale;
  kp.doffset = args.doffset;
  kp.C = C;
  kp.inner = shape.inner;
  kp.M = plan.M;
  kp.G = plan.G;
  kp.chunk = plan.chunk;
  kp.eps = params.epsilon;
  kp.inv_m = static_cast<float>(1.0 / static_cast<double>(shape.per_channel()));
  kp.inv_std = params.saved_stat == SavedStat::kInvStd ? 1 : 0;
  kp.training = params.is_training ? 1 : 0;
  // The fused activation's inputs: only those the mode reads (the bindings validate them;
  // a missing one here is a caller bug). The side input is read by Swish alone.
  const Activation act = params.activation;
  const bool needs_y = act == Activation::kRelu || act == Activation::kRelu6;
  const bool needs_z = act == Activation::kSwish;
  if ((needs_y && args.y == nullptr) || (needs_z && args.offset == nullptr)) {
    return static_cast<int>(cudaErrorInvalidValue);
  }
  kp.act_y = needs_y ? args.y : nullptr;
  kp.side = needs_z ? args.side_input : nullptr;
  kp.offset = needs_z ? args.offset : nullptr;
  kp.side_bp = args.side_input_backprop;

  // Vector width (common.cuh: VecWidth): a function of the shape and T.
  const int vec = VecWidth<T>(plan.channels_last ? C : shape.inner, plan.channels_last);
  const size_t vbytes = sizeof(T) * static_cast<size_t>(vec);
  kp.aligned = (Aligned(args.dy, vbytes) && Aligned(args.x, vbytes) && Aligned(args.dx, vbytes) &&
                (kp.act_y == nullptr || Aligned(kp.act_y, vbytes)) &&
                (kp.side == nullptr || Aligned(kp.side, vbytes)) &&
                (kp.side_bp == nullptr || Aligned(kp.side_bp, vbytes)))
                   ? 1
                   : 0;

  const bool training = params.is_training;
  switch (vec) {
    case 8:
      if constexpr (MaxVec<T>() >= 8) return RunWithVec<T, 8>(plan, kp, act, training, st);
      break;
    case 4:
      return RunWithVec<T, 4>(plan, kp, act, training, st);
    case 2:
      return RunWithVec<T, 2>(plan, kp, act, training, st);
    default:
      return RunWithVec<T, 1>(plan, kp, act, training, st);
  }
  return static_cast<int>(cudaErrorInvalidValue);
}

template int BnGradCuda<float>(const BnGradParams&, const BnGradArgs<float>&, void*, size_t,
                               void*);
template int BnGradCuda<half_t>(const BnGradParams&, const BnGradArgs<half_t>&, void*, size_t,
                                void*);
template int BnGradCuda<bfloat16_t>(const BnGradParams&, const BnGradArgs<bfloat16_t>&, void*,
                                    size_t, void*);

}  // namespace fbn
