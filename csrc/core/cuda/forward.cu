// CUDA kernels of the batch-normalization forward (FusedBatchNormV3 semantics, ../forward.h)
// on the canonical view [outer, C, inner]. Same structure as the backward
// (cuda/backward.cu, docs/GPU.md): the chunking, thread mappings and vector accesses are the
// backward's, from cuda/common.cuh.
//
// Passes (all on the caller's stream, no host synchronisation):
//   training : Stats -> Finalize -> Apply
//   inference: Finalize (copies the running statistics, computes the coefficients) -> Apply
//   M == 0   : Finalize only (as TF: batch_mean/batch_variance NaN, reserve spaces 0)
//
// Stats (numerically sound for data with a large mean): every value is shifted by a pivot
// K[c] = x[outer 0, c, inner 0] (0 when not finite), so the running means are O(std), not
// O(mean). Each thread runs Welford's update over its elements (one reciprocal per row or
// vector, shared by the VEC channels/elements), the block merges the thread states
// (count, mean, M2) with Chan's formula in a fixed tree, and writes one (mean - K, M2) per
// (chunk, channel) into the workspace. Finalize (one warp per channel) merges the G partials
// of a channel with Chan's formula in double (lane l takes g = l, l+32, ... in order, then a
// fixed shuffle tree), adds K back, and writes the four statistics outputs and the apply
// coefficients. Apply is elementwise: y = act((x - mean) * k + offset [+ side_input]),
// k = scale * inv, with the activation of ../activation.h (Identity, Relu, Relu6, Swish; NaN
// stays NaN) and the optional side input as template parameters of one kernel per layout.
// Every order is fixed by the shape alone, so results are bitwise identical from run to run.
// No atomics.
//
// Workspace (floats, contiguous, exact size from BnForwardCudaWorkspaceBytes; 0 when M == 0):
//   training:  [0, GC) partial mean - K  [c * G + g];  [GC, 2GC) partial M2  [c * G + g]
//   then (training at 2GC, inference at 0):  k[c] = scale * inv  [C];  mean[c]  [C]
#include "forward.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <climits>
#include <cstdint>

#include "../activation.h"
#include "common.cuh"

namespace fbn {
namespace {

using namespace cuda_detail;  // NOLINT: kThreads, Dev<T>, LoadVec, StoreVec, ChunkPlan, ...

// ---------------------------------------------------------------------------------------
// Kernel parameters (passed by value).
struct FParams {
  const void* x;
  const void* side;  // optional side input (the Apply kernels with kSide only)
  void* y;
  const float* scale;
  const float* offset;
  const float* running_mean;  // read when `blend` (training) or in inference
  const float* running_var;
  float* p_mean;     // training: partial mean - K  [C, G]
  float* p_m2;       // training: partial M2        [C, G]
  float* coef_k;     // [C] scale * inv   (nullptr when M == 0)
  float* coef_mean;  // [C] mean          (nullptr when M == 0)
  float* batch_mean;
  float* batch_variance;
  float* saved_mean;
  float* saved_var;
  int64_t C;
  int64_t inner;    // channels-first only (channels-last: 1)
  int64_t M;        // channels-last: rows (= outer); channels-first: outer * inner
  int64_t G;        // chunks per channel (0 when M == 0)
  int64_t chunk;    // channels-last: rows per chunk; channels-first: elements (x8)
  int64_t ctn;      // channels-last: channel tiles
  int64_t nblocks;  // logical blocks of a pass
  float eps;
  float factor;     // exponential_avg_factor
  int bx;           // channels-last: threads along the channels (power of 2, <= 32)
  int aligned;      // x, y (and the side input) aligned for VEC-wide vector accesses
  int inv_std;      // saved_var receives 1/sqrt(var + eps) (cuDNN convention)
  int training;
  int blend;        // training with exponential_avg_factor != 1
};

// The pivot of a channel: its first element, or 0 when that is not finite (then the shift
// would turn every value into NaN; without it the statistics are plain Welford's).
__device__ __forceinline__ float Pivot(float v) {
  return fabsf(v) <= 3.402823466e+38f ? v : 0.f;  // false for inf and NaN
}

// One Welford step with r = 1/n (n the count after this element); d is x - K.
__device__ __forceinline__ void WelfordAdd(float& m, float& q, float d, float r) {
  const float delta = d - m;
  m = m + delta * r;
  q = q + delta * (d - m);
}

// Chan's merge of (nb, mb, qb) into (n, m, q); either side may be empty. Both sides are in
// the same shifted coordinates.
__device__ __forceinline__ void ChanMerge(int& n, float& m, float& q, int nb, float mb,
                                          float qb) {
  if (nb == 0) return;
  if (n == 0) {
    n = nb;
    m = mb;
    q = qb;
    return;
  }
  const int nt = n + nb;
  const float fb = static_cast<float>(nb) / static_cast<float>(nt);
  const float delta = mb - m;
  m = m + delta * fb;
  q = (q + qb) + delta * delta * (static_cast<float>(n) * fb);
  n = nt;
}

__device__ __forceinline__ void ChanMergeD(double& n, double& m, double& q, double nb,
                                           double mb, double qb) {
  if (nb == 0.0) return;
  if (n == 0.0) {
    n = nb;
    m = mb;
    q = qb;
    return;
  }
  const double nt = n + nb;
  const double fb = nb / nt;
  const double delta = mb - m;
  m = m + delta * fb;
  q = (q + qb) + delta * delta * (n * fb);
  n = nt;
}

// Fixed shuffle tree; the merged state is complete in lane 0.
__device__ __forceinline__ void WarpChanMerge(int& n, float& m, float& q) {
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) {
    const int nb = __shfl_down_sync(0xffffffffu, n, off);
    const float mb = __shfl_down_sync(0xffffffffu, m, off);
    const float qb = __shfl_down_sync(0xffffffffu, q, off);
    ChanMerge(n, m, q, nb, mb, qb);
  }
}

// y = act(z), z = (x - mean) * k + offset [+ side] (common.cuh: PreActivation).
template <Activation kAct, bool kSide>
__device__ __forceinline__ float Activate(float x, float mean, float k, float offset,
                                          float side) {
  float z = PreActivation(x, mean, k, offset);
  if (kSide) z = AddSide(z, side);
  return ActivationOp<kAct>::Forward(z);
}

// ---------------------------------------------------------------------------------------
// Channels-last statistics over [rows, C]: the backward's tile mapping.
template <typename T, int VEC>
__global__ void __launch_bounds__(kThreads) StatsChannelsLast(const FParams p) {
  using Raw = typename Dev<T>::Raw;
  constexpr int U = VEC >= 4 ? 2 : 4;  // rows in flight per thread
  __shared__ float sm_m[kThreads * VEC];
  __shared__ float sm_q[kThreads * VEC];
  __shared__ int sm_n[kThreads];

  const Raw* __restrict__ x = static_cast<const Raw*>(p.x);
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

    float m[VEC], q[VEC], piv[VEC];
    int n = 0;
#pragma unroll
    for (int v = 0; v < VEC; ++v) m[v] = q[v] = piv[v] = 0.f;
    if (active) {
      LoadVec<T, VEC>(x + c0, aligned, piv);  // row 0
#pragma unroll
      for (int v = 0; v < VEC; ++v) piv[v] = Pivot(piv[v]);

      int64_t r = r_begin + ty;
      const int64_t step = static_cast<int64_t>(by);
      for (; r + (U - 1) * step < r_end; r += U * step) {
        float fx[U][VEC];
#pragma unroll
        for (int u = 0; u < U; ++u) LoadVec<T, VEC>(x + (r + u * step) * C + c0, aligned, fx[u]);
#pragma unroll
        for (int u = 0; u < U; ++u) {
          ++n;
          const float rn = __frcp_rn(static_cast<float>(n));
#pragma unroll
          for (int v = 0; v < VEC; ++v) WelfordAdd(m[v], q[v], fx[u][v] - piv[v], rn);
        }
      }
      for (; r < r_end; r += step) {
        float fx[VEC];
        LoadVec<T, VEC>(x + r * C + c0, aligned, fx);
        ++n;
        const float rn = __frcp_rn(static_cast<float>(n));
#pragma unroll
        for (int v = 0; v < VEC; ++v) WelfordAdd(m[v], q[v], fx[v] - piv[v], rn);
      }
    }

    // Slot of (tx, ty, v) is ty * ct + tx * VEC + v == threadIdx.x * VEC + v.
    const int base = static_cast<int>(threadIdx.x) * VEC;
#pragma unroll
    for (int v = 0; v < VEC; ++v) {
      sm_m[base + v] = m[v];
      sm_q[base + v] = q[v];
    }
    sm_n[threadIdx.x] = n;
    // Fixed tree over ty (by is a power of two).
    for (int s = by / 2; s > 0; s >>= 1) {
      __syncthreads();
      if (ty < s) {
        const int other = base + s * static_cast<int>(ct);
        const int na = sm_n[threadIdx.x];  // the same count for all VEC channels
        const int nb = sm_n[threadIdx.x + s * bx];
#pragma unroll
        for (int v = 0; v < VEC; ++v) {
          int nv = na;
          float mv = sm_m[base + v], qv = sm_q[base + v];
          ChanMerge(nv, mv, qv, nb, sm_m[other + v], sm_q[other + v]);
          sm_m[base + v] = mv;
          sm_q[base + v] = qv;
        }
        sm_n[threadIdx.x] = na + nb;
      }
    }
    if (ty == 0 && active) {
#pragma unroll
      for (int v = 0; v < VEC; ++v) {
        p.p_mean[(c0 + v) * p.G + g] = sm_m[base + v];
        p.p_m2[(c0 + v) * p.G + g] = sm_q[base + v];
      }
    }
    __syncthreads();  // shared memory is reused by the next logical block
  }
}

// ---------------------------------------------------------------------------------------
// Channels-first statistics over [outer, C, inner], inner % VEC == 0: one channel per block.
template <typename T, int VEC>
__global__ void __launch_bounds__(kThreads) StatsChannelsFirst(const FParams p) {
  using Raw = typename Dev<T>::Raw;
  constexpr int U = VEC >= 4 ? 2 : 4;
  constexpr int kWarps = kThreads / 32;
  __shared__ float red_m[kWarps];
  __shared__ float red_q[kWarps];
  __shared__ int red_n[kWarps];

  const Raw* __restrict__ x = static_cast<const Raw*>(p.x);
  const bool aligned = p.aligned != 0;
  const ChannelsFirstUnits<VEC> units(p.C, p.inner, p.M, p.chunk);
  const int tid = static_cast<int>(threadIdx.x);
  const int lane = tid & 31;
  const int warp = tid >> 5;

  for (int64_t b = blockIdx.x; b < p.nblocks; b += gridDim.x) {
    const int64_t c = b / p.G;
    const int64_t g = b % p.G;
    const Raw* xc = x + c * p.inner;
    const float piv = Pivot(Dev<T>::ToF(__ldg(xc)));

    float m[VEC], q[VEC];
#pragma unroll
    for (int v = 0; v < VEC; ++v) m[v] = q[v] = 0.f;
    int n = 0;  // units (each unit gives one element to each of the VEC accumulators)
    typename ChannelsFirstUnits<VEC>::Cursor at = units.Start(g, tid);
    while (at.More()) {
      int64_t offs[U];
      bool valid[U];
      units.Next(at, offs, valid);
      float fx[U][VEC];
#pragma unroll
      for (int u = 0; u < U; ++u) {
        if (valid[u]) LoadVec<T, VEC>(xc + offs[u], aligned, fx[u]);
      }
#pragma unroll
      for (int u = 0; u < U; ++u) {
        if (valid[u]) {
          ++n;
          const float rn = __frcp_rn(static_cast<float>(n));
#pragma unroll
          for (int v = 0; v < VEC; ++v) WelfordAdd(m[v], q[v], fx[u][v] - piv, rn);
        }
      }
    }
    // The VEC accumulators (n elements each), merged in order v = 0, 1, ...
    int nt = n;
    float mt = m[0], qt = q[0];
#pragma unroll
    for (int v = 1; v < VEC; ++v) ChanMerge(nt, mt, qt, n, m[v], q[v]);

    WarpChanMerge(nt, mt, qt);
    if (lane == 0) {
      red_n[warp] = nt;
      red_m[warp] = mt;
      red_q[warp] = qt;
    }
    __syncthreads();
    if (warp == 0) {
      int wn = lane < kWarps ? red_n[lane] : 0;
      float wm = lane < kWarps ? red_m[lane] : 0.f;
      float wq = lane < kWarps ? red_q[lane] : 0.f;
      WarpChanMerge(wn, wm, wq);
      if (lane == 0) {
        p.p_mean[c * p.G + g] = wm;
        p.p_m2[c * p.G + g] = wq;
      }
    }
    __syncthreads();  // red_* are reused by the next logical block
  }
}

// ---------------------------------------------------------------------------------------
// One warp per channel. Training: merges the G partials in double (fixed order), writes the
// statistics outputs and the apply coefficients. Inference: copies the running statistics
// and writes the coefficients. Per channel, every input is read before any output is
// written, so outputs may alias the running statistics.
template <typename T>
__global__ void __launch_bounds__(kThreads) Finalize(const FParams p) {
  using Raw = typename Dev<T>::Raw;
  const Raw* __restrict__ x = static_cast<const Raw*>(p.x);
  const int lane = static_cast<int>(threadIdx.x) & 31;
  const int64_t warps_total = static_cast<int64_t>(gridDim.x) * (kThreads / 32);
  const int64_t C = p.C;
  for (int64_t c = (static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x) / 32; c < C;
       c += warps_total) {
    if (p.M == 0) {  // as TF: no elements -> batch statistics NaN, reserve spaces 0
      if (lane == 0) {
        p.batch_mean[c] = __int_as_float(0x7fc00000);
        p.batch_variance[c] = __int_as_float(0x7fc00000);
        p.saved_mean[c] = 0.f;
        p.saved_var[c] = 0.f;
      }
      continue;
    }
    if (p.training) {
      double n = 0.0, m = 0.0, q = 0.0;
      for (int64_t g = lane; g < p.G; g += 32) {
        const double nb = static_cast<double>(min(p.chunk, p.M - g * p.chunk));
        ChanMergeD(n, m, q, nb, static_cast<double>(p.p_mean[c * p.G + g]),
                   static_cast<double>(p.p_m2[c * p.G + g]));
      }
#pragma unroll
      for (int off = 16; off > 0; off >>= 1) {
        const double nb = __shfl_down_sync(0xffffffffu, n, off);
        const double mb = __shfl_down_sync(0xffffffffu, m, off);
        const double qb = __shfl_down_sync(0xffffffffu, q, off);
        ChanMergeD(n, m, q, nb, mb, qb);
      }
      if (lane == 0) {
        const float piv = p.M > 0 ? Pivot(Dev<T>::ToF(x[c * p.inner])) : 0.f;
        const double mean_d = static_cast<double>(piv) + m;
        const float mean = static_cast<float>(mean_d);
        const float var = p.M > 0 ? static_cast<float>(q / static_cast<double>(p.M)) : 0.f;
        const float inv = 1.0f / sqrtf(var + p.eps);  // as the backward's InvStd
        // var * M / max(M - 1, 1) == M2 / max(M - 1, 1)
        const double unbiased = q / static_cast<double>(max(p.M - 1, int64_t{1}));
        float bm = mean;
        float bv = static_cast<float>(unbiased);
        if (p.blend) {
          const double f = static_cast<double>(p.factor);
          bm = static_cast<float>(f * mean_d + (1.0 - f) * static_cast<double>(p.running_mean[c]));
          bv = static_cast<float>(f * unbiased +
                                  (1.0 - f) * static_cast<double>(p.running_var[c]));
        }
        const float k = p.coef_k != nullptr ? p.scale[c] * inv : 0.f;
        if (p.coef_k != nullptr) {
          p.coef_k[c] = k;
          p.coef_mean[c] = mean;
        }
        p.saved_mean[c] = mean;
        p.saved_var[c] = p.inv_std ? inv : var;
        p.batch_mean[c] = bm;
        p.batch_variance[c] = bv;
      }
    } else if (lane == 0) {
      const float rm = p.running_mean[c];
      const float rv = p.running_var[c];
      const float k = p.coef_k != nullptr ? p.scale[c] * (1.0f / sqrtf(rv + p.eps)) : 0.f;
      if (p.coef_k != nullptr) {
        p.coef_k[c] = k;
        p.coef_mean[c] = rm;
      }
      p.batch_mean[c] = rm;
      p.batch_variance[c] = rv;
      p.saved_mean[c] = rm;
      p.saved_var[c] = rv;
    }
  }
}

// ---------------------------------------------------------------------------------------
// Elementwise y = act((x - mean) * k + offset [+ side]), channels-last: the tile mapping.
template <typename T, int VEC, Activation kAct, bool kSide>
__global__ void __launch_bounds__(kThreads) ApplyChannelsLast(const FParams p) {
  using Raw = typename Dev<T>::Raw;
  constexpr int U = VEC >= 4 ? 2 : 4;
  const Raw* __restrict__ x = static_cast<const Raw*>(p.x);
  const Raw* __restrict__ side = static_cast<const Raw*>(p.side);
  Raw* __restrict__ y = static_cast<Raw*>(p.y);
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
    if (c0 >= C) continue;  // no block-wide synchronisation in this kernel
    const int64_t r_end = min(p.M, g * p.chunk + p.chunk);
    float mean[VEC], k[VEC], off[VEC];
#pragma unroll
    for (int v = 0; v < VEC; ++v) {
      mean[v] = p.coef_mean[c0 + v];
      k[v] = p.coef_k[c0 + v];
      off[v] = p.offset[c0 + v];
    }
    int64_t r = g * p.chunk + ty;
    const int64_t step = static_cast<int64_t>(by);
    for (; r + (U - 1) * step < r_end; r += U * step) {
      float fx[U][VEC], fs[U][VEC];
#pragma unroll
      for (int u = 0; u < U; ++u) {
        LoadVec<T, VEC>(x + (r + u * step) * C + c0, aligned, fx[u]);
        if (kSide) LoadVec<T, VEC>(side + (r + u * step) * C + c0, aligned, fs[u]);
      }
#pragma unroll
      for (int u = 0; u < U; ++u) {
        float out[VEC];
#pragma unroll
        for (int v = 0; v < VEC; ++v) {
          out[v] = Activate<kAct, kSide>(fx[u][v], mean[v], k[v], off[v], kSide ? fs[u][v] : 0.f);
        }
        StoreVec<T, VEC>(y + (r + u * step) * C + c0, aligned, out);
      }
    }
    for (; r < r_end; r += step) {
      float fx[VEC], fs[VEC], out[VEC];
      LoadVec<T, VEC>(x + r * C + c0, aligned, fx);
      if (kSide) LoadVec<T, VEC>(side + r * C + c0, aligned, fs);
#pragma unroll
      for (int v = 0; v < VEC; ++v) {
        out[v] = Activate<kAct, kSide>(fx[v], mean[v], k[v], off[v], kSide ? fs[v] : 0.f);
      }
      StoreVec<T, VEC>(y + r * C + c0, aligned, out);
    }
  }
}

// Elementwise, channels-first: one channel and a chunk of its elements per block.
template <typename T, int VEC, Activation kAct, bool kSide>
__global__ void __launch_bounds__(kThreads) ApplyChannelsFirst(const FParams p) {
  using Raw = typename Dev<T>::Raw;
  constexpr int U = VEC >= 4 ? 2 : 4;
  const Raw* __restrict__ x = static_cast<const Raw*>(p.x);
  const Raw* __restrict__ side = static_cast<const Raw*>(p.side);
  Raw* __restrict__ y = static_cast<Raw*>(p.y);
  const bool aligned = p.aligned != 0;
  const ChannelsFirstUnits<VEC> units(p.C, p.inner, p.M, p.chunk);
  const int tid = static_cast<int>(threadIdx.x);

  for (int64_t b = blockIdx.x; b < p.nblocks; b += gridDim.x) {
    const int64_t c = b / p.G;
    const int64_t g = b % p.G;
    const float mean = p.coef_mean[c];
    const float k = p.coef_k[c];
    const float off = p.offset[c];
    const Raw* xc = x + c * p.inner;
    const Raw* sc = kSide ? side + c * p.inner : nullptr;
    Raw* yc = y + c * p.inner;

    typename ChannelsFirstUnits<VEC>::Cursor at = units.Start(g, tid);
    while (at.More()) {
      int64_t offs[U];
      bool valid[U];
      units.Next(at, offs, valid);
      float fx[U][VEC], fs[U][VEC];
#pragma unroll
      for (int u = 0; u < U; ++u) {
        if (valid[u]) {
          LoadVec<T, VEC>(xc + offs[u], aligned, fx[u]);
          if (kSide) LoadVec<T, VEC>(sc + offs[u], aligned, fs[u]);
        }
      }
#pragma unroll
      for (int u = 0; u < U; ++u) {
        if (valid[u]) {
          float out[VEC];
#pragma unroll
          for (int v = 0; v < VEC; ++v) {
            out[v] = Activate<kAct, kSide>(fx[u][v], mean, k, off, kSide ? fs[u][v] : 0.f);
          }
          StoreVec<T, VEC>(yc + offs[u], aligned, out);
        }
      }
    }
  }
}

// ---------------------------------------------------------------------------------------
// Host side.

// Chunking (cuda/common.cuh, shared with the backward): a function of the shape alone.
struct Plan : ChunkPlan {
  int64_t ws_floats = 0;
};

Plan MakePlan(const BnForwardParams& params) {
  Plan plan;
  static_cast<ChunkPlan&>(plan) = MakeChunkPlan(params.shape);
  const int64_t C = params.shape.channels;
  if (params.shape.elements() <= 0 || C <= 0) return plan;
  plan.ws_floats = (params.is_training ? 2 * plan.G * C : 0) + 2 * C;
  return plan;
}

template <typename T, int VEC, Activation kAct, bool kSide>
void LaunchApply(const FParams& kp, bool channels_last, cudaStream_t stream) {
  const int grid = GridFor(kp.nblocks);
  if (channels_last) {
    ApplyChannelsLast<T, VEC, kAct, kSide><<<grid, kThreads, 0, stream>>>(kp);
  } else {
    ApplyChannelsFirst<T, VEC, kAct, kSide><<<grid, kThreads, 0, stream>>>(kp);
  }
}

// The activation and the presence of a side input: runtime values to template parameters,
// once per call.
template <typename T, int VEC, Activation kAct>
void LaunchApplyAct(const FParams& kp, bool channels_last, cudaStream_t stream) {
  if (kp.side != nullptr) {
    LaunchApply<T, VEC, kAct, true>(kp, channels_last, stream);
  } else {
    LaunchApply<T, VEC, kAct, false>(kp, channels_last, stream);
  }
}

template <typename T, int VEC>
void LaunchApplyFor(Activation act, const FParams& kp, bool channels_last,
                    cudaStream_t stream) {
  switch (act) {
    case Activation::kIdentity:
      return LaunchApplyAct<T, VEC, Activation::kIdentity>(kp, channels_last, stream);
    case Activation::kRelu:
      return LaunchApplyAct<T, VEC, Activation::kRelu>(kp, channels_last, stream);
    case Activation::kRelu6:
      return LaunchApplyAct<T, VEC, Activation::kRelu6>(kp, channels_last, stream);
    case Activation::kSwish:
      return LaunchApplyAct<T, VEC, Activation::kSwish>(kp, channels_last, stream);
  }
}

template <typename T, int VEC>
int RunWithVec(const Plan& plan, FParams kp, Activation act, cudaStream_t stream) {
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
  const int grid = GridFor(kp.nblocks);
  const int fin_grid = GridFor(CeilDiv(kp.C, kThreads / 32));
  if (kp.training) {
    if (plan.channels_last) {
      StatsChannelsLast<T, VEC><<<grid, kThreads, 0, stream>>>(kp);
    } else {
      StatsChannelsFirst<T, VEC><<<grid, kThreads, 0, stream>>>(kp);
    }
  }
  Finalize<T><<<fin_grid, kThreads, 0, stream>>>(kp);
  LaunchApplyFor<T, VEC>(act, kp, plan.channels_last, stream);
  return static_cast<int>(cudaGetLastError());
}

}  // namespace

size_t BnForwardCudaWorkspaceBytes(const BnForwardParams& params) {
  return static_cast<size_t>(MakePlan(params).ws_floats) * sizeof(float);
}

template <typename T>
int BnForwardCuda(const BnForwardParams& params, const BnForwardArgs<T>& args, void* workspace,
                  size_t workspace_bytes, void* stream) {
  cudaStream_t st = static_cast<cudaStream_t>(stream);
  const BnShape& shape = params.shape;
  if (shape.channels < 0 || shape.outer < 0 || shape.inner < 0) {
    return static_cast<int>(cudaErrorInvalidValue);
  }
  const int64_t C = shape.channels;
  if (C == 0) return static_cast<int>(cudaSuccess);
  const bool empty = shape.elements() == 0;
  if (args.batch_mean == nullptr || args.batch_variance == nullptr ||
      args.saved_mean == nullptr || args.saved_var == nullptr ||
      (params.reads_running_stats() &&
       (args.running_mean == nullptr || args.running_var == nullptr)) ||
      (!empty && (args.x == nullptr || args.y == nullptr || args.scale == nullptr ||
                  args.offset == nullptr))) {
    return static_cast<int>(cudaErrorInvalidValue);
  }

  const Plan plan = MakePlan(params);
  const size_t need = static_cast<size_t>(plan.ws_floats) * sizeof(float);
  if (workspace_bytes < need || (need > 0 && workspace == nullptr) ||
      !Aligned(workspace, alignof(float))) {
    return static_cast<int>(cudaErrorInvalidValue);
  }
  // Per-block counts are int: a chunk is at most ~elements/1024 or 4096 elements.
  if (plan.chunk > INT_MAX / 2) return static_cast<int>(cudaErrorInvalidValue);

  float* ws = static_cast<float*>(workspace);
  FParams kp{};
  kp.x = args.x;
  kp.side = args.side_input;
  kp.y = args.y;
  kp.scale = args.scale;
  kp.offset = args.offset;
  kp.running_mean = args.running_mean;
  kp.running_var = args.running_var;
  kp.batch_mean = args.batch_mean;
  kp.batch_variance = args.batch_variance;
  kp.saved_mean = args.saved_mean;
  kp.saved_var = args.saved_var;
  kp.C = C;
  kp.inner = shape.inner;
  kp.eps = params.epsilon;
  kp.factor = params.exponential_avg_factor;
  kp.inv_std = params.saved_stat == SavedStat::kInvStd ? 1 : 0;
  kp.training = params.is_training ? 1 : 0;
  kp.blend = params.is_training && params.exponential_avg_factor != 1.0f ? 1 : 0;
  const int fin_grid = GridFor(CeilDiv(C, kThreads / 32));

  if (empty) {  // no elements: NaN batch statistics, zero reserve spaces (as TF); y is empty
    kp.M = 0;
    kp.G = 0;
    kp.chunk = 0;
    Finalize<T><<<fin_grid, kThreads, 0, st>>>(kp);
    return static_cast<int>(cudaGetLastError());
  }

  const int64_t ws_coef = params.is_training ? 2 * plan.G * C : 0;
  kp.p_mean = params.is_training ? ws : nullptr;
  kp.p_m2 = params.is_training ? ws + plan.G * C : nullptr;
  kp.coef_k = ws + ws_coef;
  kp.coef_mean = ws + ws_coef + C;
  kp.M = plan.M;
  kp.G = plan.G;
  kp.chunk = plan.chunk;

  const int vec = VecWidth<T>(plan.channels_last ? C : shape.inner, plan.channels_last);
  const size_t vbytes = sizeof(T) * static_cast<size_t>(vec);
  kp.aligned = (Aligned(args.x, vbytes) && Aligned(args.y, vbytes) &&
                (args.side_input == nullptr || Aligned(args.side_input, vbytes)))
                   ? 1
                   : 0;

  const Activation act = params.activation;
  switch (vec) {
    case 8:
      if constexpr (MaxVec<T>() >= 8) return RunWithVec<T, 8>(plan, kp, act, st);
      break;
    case 4:
      return RunWithVec<T, 4>(plan, kp, act, st);
    case 2:
      return RunWithVec<T, 2>(plan, kp, act, st);
    default:
      return RunWithVec<T, 1>(plan, kp, act, st);
  }
  return static_cast<int>(cudaErrorInvalidValue);
}

template int BnForwardCuda<float>(const BnForwardParams&, const BnForwardArgs<float>&, void*,
                                  size_t, void*);
template int BnForwardCuda<half_t>(const BnForwardParams&, const BnForwardArgs<half_t>&,
                                   void*, size_t, void*);
template int BnForwardCuda<bfloat16_t>(const BnForwardParams&,
                                       const BnForwardArgs<bfloat16_t>&, void*, size_t,
                                       void*);

}  // namespace fbn
