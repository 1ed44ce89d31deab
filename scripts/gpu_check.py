#!/usr/bin/env python3
"""GPU check of fbn_grad_tf's CUDA kernels on a machine with PyTorch (CUDA) and no TensorFlow.

Run through scripts/gpu_check.sh (which builds fbn_grad_tf._core with CUDA first), or
directly with PYTHONPATH=python once the module is built:

    python scripts/gpu_check.py               # numerics + determinism + benchmark
    python scripts/gpu_check.py --skip-bench  # numerics + determinism only
    python scripts/gpu_check.py --cpu-only    # CPU kernels vs float64 references (no GPU)

Parts:
  (a) numerics: CUDA kernel vs our CPU kernel vs a float64 NumPy reference, for
      float32/float16/bfloat16 x NHWC/NCHW/NDHWC/NCDHW x {training (saved_stat variance and
      inv_std), inference} over a small shape grid (C=1, C=7, C=1000, N*H*W=1, empty, ...).
  (b) determinism: repeated CUDA runs are bitwise equal, also with misaligned pointers
      (which take the scalar-load path of the same thread mapping).
  (c) benchmark: training backward vs PyTorch's cuDNN (and native) batch-norm backward on
      the ResNet-50 BN shapes at batch 32, interleaved CUDA-event timing, medians: device
      time from CUDA-graph replays, and our eager call's time beside it.
  (d) forward (fbn_grad_tf.core.bn_forward): CUDA and CPU kernels vs a float64 torch
      reference for float32/float16/bfloat16 x NHWC/NCHW (+5-D) x {training (variance,
      inv_std, exponential_avg_factor 0.3), inference} x {identity, relu}, large-mean data
      (mean 1e4, std ~1), NaN through the fused ReLU, determinism, and the fused-ReLU
      backward (bn_grad relu_y=y vs dy masked with y > 0). Runs before (c).
  (e) fused modes (run with (d); FusedBatchNormEx / GradEx): Identity/Relu/Relu6/Swish x
      with/without side input x float32/float16/bfloat16 x NHWC/NCHW x training/inference,
      forward and backward, CUDA and CPU kernels: y vs a float64 reference and CUDA vs CPU;
      side_input_backprop (dz) exactly dy or its Relu/Relu6 select, Swish's within the
      dtype's tolerance; dx/scale/offset backprop vs the float64 backward of the kernel's
      own dz; the CUDA fused backward bitwise equal to the plain CUDA backward of its
      side_input_backprop; determinism with misaligned tensors. 4.7 s on an H200 machine.
  (f) in place (run after (d)): the CUDA backward with its outputs in its inputs' buffers,
      as the TF op forwards them, bitwise equal to the same call with fresh outputs; and the
      fused backward without side_input_backprop (its second pass applies the activation to
      dy) bitwise equal to the one with it (its second pass reads the stored dz).
Exit status: 0 when every numeric/determinism check passed, 1 otherwise (2: setup error).

`reference_bn_grad` (float64, NumPy only) is importable from here for other tests.
"""
import argparse
import itertools
import math
import os
import sys
import time

import numpy as np

try:
    import ml_dtypes  # bfloat16 for NumPy (installed with TF, JAX, ...)
except ImportError:  # pragma: no cover
    ml_dtypes = None

DATA_FORMATS = ("NHWC", "NCHW", "NDHWC", "NCDHW")
DTYPES = ("float32", "float16", "bfloat16")
# (is_training, saved_stat) combinations.
MODES = ((True, "variance"), (True, "inv_std"), (False, "variance"))

# Per-dtype tolerances. dx (stored in the dtype): |err| <= rtol*|ref| + atol_frac*rtol*max|ref|
# (output rounding alone is up to 1/2 ulp; a different float32 evaluation order may move it
# by one more ulp). scale/offset backprop (float32 sums of the same rounded inputs):
# |err| <= red_rtol*|ref| + red_mag*sum|terms|.
DX_RTOL = {"float32": 1e-4, "float16": 2e-3, "bfloat16": 1.6e-2}
DX_ATOL_FRAC = 1e-2
RED_RTOL = 1e-4
RED_MAG = 2e-5

# Logical shapes (N, spatial..., C); channels-first formats permute C to axis 1.
SHAPES_4D = [
    (2, 3, 4, 7), (4, 5, 5, 1), (2, 4, 4, 1000), (1, 1, 1, 1000), (1, 1, 1, 7), (1, 1, 1, 1),
    (0, 3, 3, 8), (2, 0, 3, 8), (3, 17, 19, 24), (2, 1, 1, 2048), (1, 96, 96, 3),
    (16, 32, 32, 32), (1, 256, 256, 1), (8, 14, 14, 64), (5, 7, 7, 6), (4, 32, 32, 200),
    (3, 5, 5, 12), (2, 9, 9, 2),
]
SHAPES_5D = [
    (2, 3, 4, 5, 7), (1, 2, 8, 8, 16), (0, 2, 2, 2, 4), (2, 1, 1, 1, 1000), (2, 4, 16, 16, 8),
    (1, 1, 1, 1, 3),
]
RESNET50_SHAPES = [(32, 112, 112, 64), (32, 56, 56, 256), (32, 28, 28, 512), (32, 14, 14, 1024),
                   (32, 7, 7, 2048)]


# ---------------------------------------------------------------------------------------
# float64 reference (NumPy only; reusable).
def channel_axis(data_format, ndim):
    return 1 if data_format in ("NCHW", "NCDHW") else ndim - 1


def is_channels_first(data_format):
    return data_format in ("NCHW", "NCDHW")


def layout_shape(logical_shape, data_format):
    """(N, spatial..., C) -> the tensor shape of `data_format`."""
    s = tuple(logical_shape)
    if is_channels_first(data_format):
        return (s[0], s[-1]) + s[1:-1]
    return s


def to_f64(a):
    """NumPy array (any float dtype incl. ml_dtypes.bfloat16) -> float64."""
    return np.asarray(a).astype(np.float64)


def reference_bn_grad(y_backprop, x, scale, reserve_space_1, reserve_space_2, epsilon=1e-4,
                      data_format="NHWC", is_training=True, saved_stat="variance"):
    """FusedBatchNormGradV3 in float64. Returns (dx, dscale, doffset, dscale_mag, doffset_mag).

    The *_mag arrays are sum|terms| of the reductions (for error bounds). reserve_space_2 is
    the variance, or in training with saved_stat="inv_std" the inverse std 1/sqrt(var+eps).
    """
    dy = to_f64(y_backprop)
    xx = to_f64(x)
    ax = channel_axis(data_format, xx.ndim)
    axes = tuple(i for i in range(xx.ndim) if i != ax)
    bshape = [1] * xx.ndim
    bshape[ax] = -1
    gamma = to_f64(scale).reshape(bshape)
    mean = to_f64(reserve_space_1).reshape(bshape)
    s = to_f64(reserve_space_2)
    if is_training and saved_stat == "inv_std":
        inv_c = s
    else:
        inv_c = 1.0 / np.sqrt(s + np.float64(np.float32(epsilon)))
    inv = inv_c.reshape(bshape)
    channels = xx.shape[ax]
    m = xx.size // channels if channels else 0
    xc = xx - mean
    s1 = dy.sum(axis=axes)
    s2 = (dy * xc).sum(axis=axes)
    dscale = inv_c * s2
    doffset = s1
    dscale_mag = np.abs(inv_c) * np.abs(dy * xc).sum(axis=axes)
    doffset_mag = np.abs(dy).sum(axis=axes)
    if xx.size == 0:
        dx = np.zeros_like(xx)
    elif is_training:
        dx = gamma * inv * ((dy - s1.reshape(bshape) / m)
                            - xc * inv * inv * s2.reshape(bshape) / m)
    else:
        dx = dy * gamma * inv
    return dx, dscale, doffset, dscale_mag, doffset_mag


def np_dtype(name):
    if name == "float32":
        return np.float32
    if name == "float16":
        return np.float16
    if ml_dtypes is None:
        raise RuntimeError("bfloat16 needs the ml_dtypes package")
    return ml_dtypes.bfloat16


def random_x(logical_shape, dtype, data_format, rng, loc=None):
    """x in `dtype` with per-channel mean mu ~U(-3,3) (or `loc` + U(-1,1)) and std sigma
    ~U(0.5,2). Returns (x, mu, sigma, channel axis, broadcast shape of a [C] vector)."""
    shape = layout_shape(logical_shape, data_format)
    ax = channel_axis(data_format, len(shape))
    c = shape[ax]
    bshape = [1] * len(shape)
    bshape[ax] = -1
    mu = rng.uniform(-3, 3, c) if loc is None else loc + rng.uniform(-1, 1, c)
    sigma = rng.uniform(0.5, 2.0, c)
    x = rng.standard_normal(shape) * sigma.reshape(bshape) + mu.reshape(bshape)
    return x.astype(np.float32).astype(np_dtype(dtype)), mu, sigma, ax, bshape


def make_inputs(logical_shape, dtype, data_format, is_training, saved_stat, epsilon, rng):
    """Random inputs as NumPy arrays: dy, x in `dtype`; scale, rs1, rs2 float32 [C]."""
    x, mu, sigma, ax, bshape = random_x(logical_shape, dtype, data_format, rng)
    shape, ndim, c = x.shape, x.ndim, x.shape[ax]
    dy = rng.standard_normal(shape).astype(np.float32).astype(np_dtype(dtype))
    scale = rng.normal(1.0, 0.5, c).astype(np.float32)
    if is_training:
        xf = to_f64(x)
        axes = tuple(i for i in range(ndim) if i != ax)
        if xf.size:
            mean = xf.mean(axis=axes)
            var = ((xf - mean.reshape(bshape)) ** 2).mean(axis=axes)
        else:
            mean = np.zeros(c)
            var = np.ones(c)
        rs1 = mean.astype(np.float32)
        if saved_stat == "inv_std":
            rs2 = (1.0 / np.sqrt(var + np.float64(np.float32(epsilon)))).astype(np.float32)
        else:
            rs2 = var.astype(np.float32)
    else:
        rs1 = (mu + rng.normal(0, 0.1, c)).astype(np.float32)
        rs2 = (sigma ** 2 * rng.uniform(0.5, 1.5, c)).astype(np.float32)
    return dict(dy=dy, x=x, scale=scale, rs1=rs1, rs2=rs2)


# ---------------------------------------------------------------------------------------
# Module access and array conversion.
def load_bn_grad():
    """The array-level bn_grad: fbn_grad_tf.core.bn_grad, else fbn_grad_tf._core.bn_grad."""
    try:
        from fbn_grad_tf import core as mod
        fn = getattr(mod, "bn_grad", None)
        if fn is not None:
            return fn, bool(getattr(mod, "with_cuda", False))
    except ImportError as e:
        first_error = e
    else:
        first_error = None
    try:
        from fbn_grad_tf import _core as raw
    except ImportError as e:
        raise RuntimeError("cannot import fbn_grad_tf (core: %s; _core: %s); build it with "
                           "scripts/gpu_check.sh or set PYTHONPATH=python" % (first_error, e))
    if not hasattr(raw, "bn_grad"):
        raise RuntimeError("fbn_grad_tf has no bn_grad function")
    return raw.bn_grad, bool(getattr(raw, "with_cuda", False))


def torch_dtype(torch, name):
    return {"float32": torch.float32, "float16": torch.float16,
            "bfloat16": torch.bfloat16}[name]


def to_device(torch, a, misalign=False):
    """NumPy array -> contiguous torch CUDA tensor with identical bits. misalign=True places
    the data one element past an allocation start (not aligned for vector accesses)."""
    a = np.ascontiguousarray(a)
    if ml_dtypes is not None and a.dtype == ml_dtypes.bfloat16:
        t = torch.from_numpy(a.view(np.int16)).view(torch.bfloat16)
    else:
        t = torch.from_numpy(a)
    t = t.cuda()
    if misalign:
        base = torch.empty(t.numel() + 1, dtype=t.dtype, device=t.device)
        mt = base[1:].view(t.shape)
        mt.copy_(t)
        return mt
    return t


def result_to_f64(obj):
    """An output (NumPy array, torch tensor, __cuda_array_interface__ object) -> float64."""
    if type(obj).__module__.split(".")[0] == "torch":
        return obj.detach().float().cpu().numpy().astype(np.float64)
    if hasattr(obj, "__cuda_array_interface__"):
        import torch
        return result_to_f64(torch.as_tensor(obj, device="cuda"))
    return to_f64(obj)


def result_bits(obj):
    """Raw bits of a device output as a CPU NumPy integer array (for bitwise comparisons)."""
    import torch
    t = obj if isinstance(obj, torch.Tensor) else torch.as_tensor(obj, device="cuda")
    t = t.contiguous()
    int_type = {4: torch.int32, 2: torch.int16}[t.element_size()]
    return t.view(int_type).cpu().numpy().copy()


# ---------------------------------------------------------------------------------------
# (a) numerics.
class Stats:
    def __init__(self):
        self.n = 0
        self.failed = 0
        self.dx = 0.0      # max normalized |err| of dx (err / max|ref|)
        self.red = 0.0     # max |err| / sum|terms| of dscale, doffset
        self.rel = 0.0     # max relative error of dx over elements with |ref| > 1e-3 max|ref|

    def update(self, dx_norm, red_norm, rel):
        self.dx = max(self.dx, dx_norm)
        self.red = max(self.red, red_norm)
        self.rel = max(self.rel, rel)


def compare(got, ref, dtype):
    """Returns (ok, dx_norm, red_norm, rel, reason) for got=(dx, dscale, doffset) in float64."""
    dx_ref, ds_ref, do_ref, ds_mag, do_mag = ref
    dx, ds, do = got
    reasons = []
    if dx.shape != dx_ref.shape:
        return False, math.inf, math.inf, math.inf, "dx shape %s != %s" % (dx.shape, dx_ref.shape)
    if ds.shape != ds_ref.shape or do.shape != do_ref.shape:
        return False, math.inf, math.inf, math.inf, "scale/offset backprop shape mismatch"
    if dx_ref.size == 0:
        ok = np.all(ds == 0) and np.all(do == 0)
        return bool(ok), 0.0, 0.0, 0.0, "" if ok else "empty input: nonzero scale/offset grads"
    rtol = DX_RTOL[dtype]
    scale_ref = float(np.max(np.abs(dx_ref))) if dx_ref.size else 0.0
    err = np.abs(dx - dx_ref)
    if not np.all(np.isfinite(dx)):
        reasons.append("dx has non-finite values")
    bound = rtol * np.abs(dx_ref) + DX_ATOL_FRAC * rtol * scale_ref
    if np.any(err > bound):
        i = np.unravel_index(np.argmax(err - bound), err.shape)
        reasons.append("dx%s=%r ref %r" % (tuple(int(v) for v in i), dx[i], dx_ref[i]))
    dx_norm = float(err.max() / scale_ref) if scale_ref > 0 else float(err.max())
    big = np.abs(dx_ref) > 1e-3 * scale_ref
    rel = float((err[big] / np.abs(dx_ref[big])).max()) if np.any(big) else 0.0
    red_norm = 0.0
    for name, g, r, mag in (("scale_backprop", ds, ds_ref, ds_mag),
                            ("offset_backprop", do, do_ref, do_mag)):
        e = np.abs(g - r)
        b = RED_RTOL * np.abs(r) + RED_MAG * mag + 1e-30
        if not np.all(np.isfinite(g)) or np.any(e > b):
            c = int(np.argmax(e - b))
            reasons.append("%s[%d]=%r ref %r" % (name, c, g[c], r[c]))
        red_norm = max(red_norm, float((e / (mag + 1e-30)).max()))
    return not reasons, dx_norm, red_norm, rel, "; ".join(reasons)


def numeric_cases():
    for dtype, fmt, (training, stat) in itertools.product(DTYPES, DATA_FORMATS, MODES):
        shapes = SHAPES_5D if fmt in ("NDHWC", "NCDHW") else SHAPES_4D
        for s in shapes:
            yield dtype, fmt, training, stat, s


def run_numerics(bn_grad, torch, use_cuda, use_cpu, epsilon, seed, verbose):
    rng = np.random.default_rng(seed)
    stats = {}
    failures = []
    n_cases = 0
    t0 = time.time()
    for dtype, fmt, training, stat, shape in numeric_cases():
        if dtype == "bfloat16" and ml_dtypes is None:
            continue
        n_cases += 1
        inp = make_inputs(shape, dtype, fmt, training, stat, epsilon, rng)
        ref = reference_bn_grad(inp["dy"], inp["x"], inp["scale"], inp["rs1"], inp["rs2"],
                                epsilon, fmt, training, stat)
        kw = dict(epsilon=epsilon, data_format=fmt, is_training=training, saved_stat=stat)
        mode = ("train/" + stat) if training else "infer"
        runs = []
        if use_cpu:
            runs.append(("cpu", lambda: bn_grad(inp["dy"], inp["x"], inp["scale"], inp["rs1"],
                                                inp["rs2"], num_threads=0, isa="auto", **kw)))
        if use_cuda:
            def cuda_run():
                d = {k: to_device(torch, v) for k, v in inp.items()}
                out = bn_grad(d["dy"], d["x"], d["scale"], d["rs1"], d["rs2"], **kw)
                torch.cuda.synchronize()
                return out
            runs.append(("cuda", cuda_run))
        got_by_dev = {}
        for dev, fn in runs:
            key = (dtype, fmt, mode, dev)
            st = stats.setdefault(key, Stats())
            st.n += 1
            try:
                out = fn()
                got = tuple(result_to_f64(o) for o in out)
                ok, dxn, redn, rel, why = compare(got, ref, dtype)
                got_by_dev[dev] = got
            except Exception as e:  # noqa: BLE001 - report every kind of failure
                ok, dxn, redn, rel, why = False, math.inf, math.inf, math.inf, repr(e)
            st.update(dxn, redn, rel)
            if not ok:
                st.failed += 1
                failures.append("%s %s %s %s shape=%s: %s" % (dev, dtype, fmt, mode,
                                                              layout_shape(shape, fmt), why))
            if verbose:
                print("  %-4s %-8s %-5s %-15s %-22s dx %.2e red %.2e %s" % (
                    dev, dtype, fmt, mode, layout_shape(shape, fmt), dxn, redn,
                    "ok" if ok else "FAIL"))
        if "cpu" in got_by_dev and "cuda" in got_by_dev:
            a, b = got_by_dev["cpu"], got_by_dev["cuda"]
            scale_ref = max(float(np.max(np.abs(ref[0]))) if ref[0].size else 0.0, 1e-30)
            key = (dtype, fmt, mode, "cpu~cuda")
            st = stats.setdefault(key, Stats())
            st.n += 1
            dxn = float(np.max(np.abs(a[0] - b[0]))) / scale_ref if a[0].size else 0.0
            redn = max(float(np.max(np.abs(a[1] - b[1]) / (ref[3] + 1e-30))) if a[1].size else 0,
                       float(np.max(np.abs(a[2] - b[2]) / (ref[4] + 1e-30))) if a[2].size else 0)
            st.update(dxn, redn, 0.0)
    print("(a) numerics: %d cases in %.1fs (tolerance dx rtol: %s; reductions %g*|ref| + %g*sum|terms|)"
          % (n_cases, time.time() - t0, ", ".join("%s %g" % kv for kv in DX_RTOL.items()),
             RED_RTOL, RED_MAG))
    print("  %-8s %-6s %-16s %-8s %6s %6s %11s %11s %11s" % (
        "dtype", "format", "mode", "device", "cases", "fail", "dx max/max", "dx max rel",
        "red err/mag"))
    for key in sorted(stats):
        st = stats[key]
        print("  %-8s %-6s %-16s %-8s %6d %6d %11.3e %11.3e %11.3e" % (
            key[0], key[1], key[2], key[3], st.n, st.failed, st.dx, st.rel, st.red))
    for f in failures[:40]:
        print("  FAIL " + f)
    if len(failures) > 40:
        print("  ... %d more failures" % (len(failures) - 40))
    total = sum(st.n for k, st in stats.items() if k[3] != "cpu~cuda")
    return total, len(failures)


# ---------------------------------------------------------------------------------------
# (b) determinism.
def run_determinism(bn_grad, torch, epsilon, seed, repeats=3):
    rng = np.random.default_rng(seed + 1)
    shapes = {4: [(8, 56, 56, 256), (1, 512, 512, 1), (4, 64, 64, 7), (2, 3, 3, 1000),
                  (16, 7, 7, 2048)],
              5: [(2, 8, 32, 32, 16)]}
    checks = 0
    bad = []
    t0 = time.time()
    for dtype, fmt, (training, stat) in itertools.product(DTYPES, DATA_FORMATS, MODES):
        if dtype == "bfloat16" and ml_dtypes is None:
            continue
        for shape in shapes[5 if fmt in ("NDHWC", "NCDHW") else 4]:
            inp = make_inputs(shape, dtype, fmt, training, stat, epsilon, rng)
            kw = dict(epsilon=epsilon, data_format=fmt, is_training=training, saved_stat=stat)
            d = {k: to_device(torch, v) for k, v in inp.items()}
            outs = []
            for _ in range(repeats):
                o = bn_grad(d["dy"], d["x"], d["scale"], d["rs1"], d["rs2"], **kw)
                outs.append([result_bits(t) for t in o])
            # Same data at misaligned addresses: scalar loads, same mapping, same bits.
            dm = dict(d)
            dm["dy"] = to_device(torch, inp["dy"], misalign=True)
            dm["x"] = to_device(torch, inp["x"], misalign=True)
            o = bn_grad(dm["dy"], dm["x"], dm["scale"], dm["rs1"], dm["rs2"], **kw)
            outs.append([result_bits(t) for t in o])
            checks += 1
            for i, other in enumerate(outs[1:], 1):
                for name, a, b in zip(("dx", "scale_backprop", "offset_backprop"), outs[0], other):
                    if a.shape != b.shape or not np.array_equal(a, b):
                        what = "misaligned run" if i == repeats else "run %d" % i
                        bad.append("%s %s %s/%s shape=%s: %s of %s differs from run 0" % (
                            dtype, fmt, "train" if training else "infer", stat,
                            layout_shape(shape, fmt), name, what))
    torch.cuda.synchronize()
    print("(b) determinism: %d configurations x (%d runs + 1 misaligned) in %.1fs: %s" % (
        checks, repeats, time.time() - t0, "all bitwise equal" if not bad else
        "%d MISMATCHES" % len(bad)))
    for b in bad[:20]:
        print("  FAIL " + b)
    return checks, len(bad)


# ---------------------------------------------------------------------------------------
# (d) forward (FusedBatchNormV3): CUDA vs float64 torch reference (on the GPU) and vs the
# CPU kernel, plus the fused-ReLU backward.
FWD_FORMATS = ("NHWC", "NCHW")
FWD_SHAPES = [(2, 3, 4, 7), (1, 1, 1, 1000), (1, 1, 1, 1), (0, 3, 3, 8), (3, 17, 19, 24),
              (2, 9, 9, 2), (8, 14, 14, 64), (4, 32, 32, 200), (1, 96, 96, 3)]
FWD_SHAPES_5D = [(2, 3, 4, 5, 7)]
# (is_training, saved_stat, exponential_avg_factor)
FWD_MODES = ((True, "variance", 1.0), (True, "inv_std", 1.0), (True, "variance", 0.3),
             (False, "variance", 1.0))
# Statistics tolerances (float32 arithmetic on exactly representable inputs): mean
# FWD_MEAN_ULP*|terms| + FWD_MEAN_STD*std; variances FWD_VAR_RTOL*|terms|.
FWD_MEAN_ULP = 2.5e-7
FWD_MEAN_STD = 1e-5
FWD_VAR_RTOL = 3e-5


def load_bn_forward():
    try:
        from fbn_grad_tf import core as mod
    except ImportError:
        return None
    return getattr(mod, "bn_forward", None)


def forward_or_report(part, summary_name, summary, hint=""):
    """load_bn_forward() for a part that needs it; when the module has none, prints the
    part's FAIL line, adds "<summary_name> MISSING" to summary and returns None (the caller
    counts the failure)."""
    bn_forward = load_bn_forward()
    if bn_forward is None:
        print("%s: FAIL: fbn_grad_tf.core has no bn_forward%s" % (part, hint))
        summary.append("%s MISSING" % summary_name)
    return bn_forward


def to_numpy_dtype(torch, t, dtype):
    """Torch tensor -> CPU NumPy array of `dtype` with identical bits."""
    t = t.detach().contiguous()
    if dtype == "bfloat16":
        return t.view(torch.int16).cpu().numpy().view(ml_dtypes.bfloat16)
    return t.cpu().numpy()


def make_forward_inputs(logical_shape, dtype, data_format, rng, loc=None):
    """x in `dtype` (per-channel mean ~U(-3,3), or `loc` + U(-1,1) when given; std 0.5..2);
    scale, offset, running mean/var float32 [C]."""
    x, mu, sigma, ax, _ = random_x(logical_shape, dtype, data_format, rng, loc)
    c = x.shape[ax]
    scale = rng.normal(1.0, 0.5, c).astype(np.float32)
    offset = rng.normal(0.0, 0.5, c).astype(np.float32)
    rm = (mu + rng.normal(0, 0.1, c)).astype(np.float32)
    rv = (sigma ** 2 * rng.uniform(0.5, 1.5, c)).astype(np.float32)
    return dict(x=x, scale=scale, offset=offset, rm=rm, rv=rv)


def reference_bn_forward(torch, x, scale, offset, rm, rv, epsilon, data_format, is_training,
                         factor, saved_stat):
    """FusedBatchNormV3 forward in float64 on the GPU (torch tensors in). Returns NumPy
    float64 arrays: y_pre (before any activation), the four statistics outputs, and per
    channel mean/k/std/offset plus the magnitudes of the blended terms (for tolerances)."""
    xd = x.double()
    nd = xd.dim()
    ax = channel_axis(data_format, nd)
    dims = [i for i in range(nd) if i != ax]
    bshape = [1] * nd
    bshape[ax] = -1
    c = xd.shape[ax]
    m = xd.numel() // c if c else 0
    sc, of = scale.double(), offset.double()
    eps = float(np.float32(epsilon))
    f = float(np.float32(factor))
    if is_training:
        if m > 0:
            mean = xd.mean(dim=dims)
            var = ((xd - mean.view(bshape)) ** 2).mean(dim=dims)
        else:
            mean = torch.zeros(c, dtype=torch.float64, device=xd.device)
            var = torch.zeros_like(mean)
        unb = var * m / max(m - 1, 1)
        if f != 1.0:
            rmd, rvd = rm.double(), rv.double()
            bm, bv = f * mean + (1 - f) * rmd, f * unb + (1 - f) * rvd
            bm_mag = (f * mean).abs() + ((1 - f) * rmd).abs()
            bv_mag = (f * unb).abs() + ((1 - f) * rvd).abs()
        else:
            bm, bv, bm_mag, bv_mag = mean, unb, mean.abs(), unb
        inv = 1.0 / torch.sqrt(var + eps)
        sm, sv = mean, (inv if saved_stat == "inv_std" else var)
        ymean, k, std = mean, sc * inv, torch.sqrt(var)
    else:
        rmd, rvd = rm.double(), rv.double()
        bm = sm = ymean = rmd
        bv = sv = rvd
        bm_mag, bv_mag = rmd.abs(), rvd.abs()
        k, std = sc / torch.sqrt(rvd + eps), torch.sqrt(rvd)
    y_pre = (xd - ymean.view(bshape)) * k.view(bshape) + of.view(bshape)
    out = dict(y_pre=y_pre, batch_mean=bm, batch_variance=bv, saved_mean=sm, saved_var=sv,
               mean=ymean, k=k, std=std, offset=of, bm_mag=bm_mag, bv_mag=bv_mag)
    out = {key: v.cpu().numpy() for key, v in out.items()}
    out["bshape"] = bshape
    return out


FWD_OUTPUTS = ("y", "batch_mean", "batch_variance", "saved_mean", "saved_var")


def compare_forward(got, ref, dtype, is_training, saved_stat, factor, relu, rm, rv):
    """got: the five outputs in float64. Returns (ok, y_norm, stat_norm, reason)."""
    reasons = []
    y, bm, bv, sm, sv = got
    y_pre = ref["y_pre"]
    y_ref = np.maximum(y_pre, 0.0) if relu else y_pre
    if y.shape != y_ref.shape:
        return False, math.inf, math.inf, "y shape %s != %s" % (y.shape, y_ref.shape)
    stat_norm = 0.0
    if is_training:
        f = float(np.float32(factor))
        std = ref["std"]
        checks = (("saved_mean", sm, ref["saved_mean"],
                   FWD_MEAN_ULP * np.abs(ref["saved_mean"]) + FWD_MEAN_STD * std),
                  ("batch_mean", bm, ref["batch_mean"],
                   FWD_MEAN_ULP * ref["bm_mag"] + FWD_MEAN_STD * std * f),
                  ("batch_variance", bv, ref["batch_variance"], FWD_VAR_RTOL * ref["bv_mag"]),
                  ("saved_var", sv, ref["saved_var"], FWD_VAR_RTOL * np.abs(ref["saved_var"])))
        for name, g, r, tol in checks:
            if g.shape != r.shape:
                reasons.append("%s shape %s != %s" % (name, g.shape, r.shape))
                continue
            err = np.abs(g - r)
            tol = tol + 1e-30
            if g.size and (not np.all(np.isfinite(g)) or np.any(err > tol)):
                c = int(np.argmax(np.where(np.isfinite(err), err - tol, np.inf)))
                reasons.append("%s[%d]=%r ref %r" % (name, c, g[c], r[c]))
            if g.size:
                stat_norm = max(stat_norm, float(np.max(err / tol)))
    else:  # copies of the running statistics, bit for bit
        for name, g, r in (("batch_mean", bm, rm), ("batch_variance", bv, rv),
                           ("saved_mean", sm, rm), ("saved_var", sv, rv)):
            if g.shape != r.shape or not np.array_equal(g, to_f64(r)):
                reasons.append("%s is not a copy of the running statistic" % name)
    if y_ref.size == 0:
        return not reasons, 0.0, stat_norm, "; ".join(reasons)
    bshape = ref["bshape"]
    k = np.abs(ref["k"]).reshape(bshape)
    mean = np.abs(ref["mean"]).reshape(bshape)
    std = ref["std"].reshape(bshape)
    rtol = DX_RTOL[dtype]
    ymax = float(np.max(np.abs(y_pre)))
    # Output rounding + float32 rounding of the mean (1 ulp of |mean|, large for a large
    # mean) and the statistics' tolerance, carried through k; k's own error in training.
    bound = (rtol * np.abs(y_pre) + DX_ATOL_FRAC * rtol * ymax
             + k * (1.5e-7 * mean + (FWD_MEAN_STD * std if is_training else 0.0)))
    if is_training:
        bound = bound + FWD_VAR_RTOL * np.abs(y_pre - ref["offset"].reshape(bshape))
    err = np.abs(y - y_ref)
    if not np.all(np.isfinite(y)):
        reasons.append("y has non-finite values")
    elif np.any(err > bound):
        i = np.unravel_index(np.argmax(err - bound), err.shape)
        reasons.append("y%s=%r ref %r" % (tuple(int(v) for v in i), y[i], y_ref[i]))
    if relu and np.any(y < 0):
        reasons.append("relu output has negative values")
    y_norm = float(err.max() / ymax) if ymax > 0 else float(err.max())
    return not reasons, y_norm, stat_norm, "; ".join(reasons)


def forward_numeric_cases():
    for dtype, fmt, (training, stat, f), relu in itertools.product(
            DTYPES, FWD_FORMATS + ("NDHWC", "NCDHW"), FWD_MODES, (False, True)):
        if relu and not (stat == "inv_std" or not training):
            continue  # the ReLU with training (inv_std) and inference only
        shapes = FWD_SHAPES_5D if fmt in ("NDHWC", "NCDHW") else FWD_SHAPES
        for s in shapes:
            yield dtype, fmt, training, stat, f, relu, s, None
    # Large mean (std 0.5..2): a naive E[x^2] - E[x]^2 would lose the variance.
    for dtype, fmt, (training, stat, f) in itertools.product(
            DTYPES, FWD_FORMATS, FWD_MODES[:3]):
        loc = 1e4 if dtype == "float32" else 1e2
        for s in ((16, 28, 28, 64), (1, 256, 256, 1), (4, 64, 64, 3)):
            yield dtype, fmt, training, stat, f, False, s, loc


def run_forward_checks(bn_forward, bn_grad, torch, epsilon, seed, verbose):
    """Returns (checks, failures)."""
    rng = np.random.default_rng(seed + 7)
    t0 = time.time()
    failures = []
    stats = {}
    n = 0
    for dtype, fmt, training, stat, f, relu, shape, loc in forward_numeric_cases():
        if dtype == "bfloat16" and ml_dtypes is None:
            continue
        inp = make_forward_inputs(shape, dtype, fmt, rng, loc)
        d = {k: to_device(torch, v) for k, v in inp.items()}
        ref = reference_bn_forward(torch, d["x"], d["scale"], d["offset"], d["rm"], d["rv"],
                                   epsilon, fmt, training, f, stat)
        # Training with factor 1 does not read the running statistics: pass None, like TF's
        # empty tensors.
        no_rs = training and f == 1.0
        kw = dict(epsilon=epsilon, exponential_avg_factor=f, data_format=fmt,
                  is_training=training, activation="relu" if relu else "identity",
                  saved_stat=stat)
        mode = ("train/%s/f%g" % (stat, f)) if training else "infer"
        if loc is not None:
            mode += "/mean%g" % loc
        runs = (("cuda", lambda: bn_forward(d["x"], d["scale"], d["offset"],
                                            None if no_rs else d["rm"],
                                            None if no_rs else d["rv"], **kw)),
                ("cpu", lambda: bn_forward(inp["x"], inp["scale"], inp["offset"],
                                           None if no_rs else inp["rm"],
                                           None if no_rs else inp["rv"], num_threads=0,
                                           isa="auto", **kw)))
        for dev, fn in runs:
            n += 1
            key = (dtype, fmt, mode, dev)
            st = stats.setdefault(key, [0, 0, 0.0, 0.0])
            st[0] += 1
            try:
                out = fn()
                if dev == "cuda":
                    torch.cuda.synchronize()
                got = tuple(result_to_f64(o) for o in out)
                if got[0].size == 0:  # as TF: NaN batch statistics, zero reserve spaces
                    ok = (all(np.all(np.isnan(g)) for g in got[1:3])
                          and all(np.all(g == 0) for g in got[3:5]))
                    yn, sn, why = 0.0, 0.0, "" if ok else "empty x: statistics not TF's"
                else:
                    ok, yn, sn, why = compare_forward(got, ref, dtype, training, stat, f,
                                                      relu, inp["rm"], inp["rv"])
            except Exception as e:  # noqa: BLE001 - report every kind of failure
                ok, yn, sn, why = False, math.inf, math.inf, repr(e)
            st[2] = max(st[2], yn)
            st[3] = max(st[3], sn)
            if not ok:
                st[1] += 1
                failures.append("%s %s %s %s%s shape=%s: %s" % (
                    dev, dtype, fmt, mode, "/relu" if relu else "",
                    layout_shape(shape, fmt), why))
            if verbose:
                print("  %-4s %-8s %-5s %-28s %-5s %-20s y %.2e stats %.2e %s" % (
                    dev, dtype, fmt, mode, "relu" if relu else "", layout_shape(shape, fmt),
                    yn, sn, "ok" if ok else "FAIL"))
    print("(d) forward numerics: %d runs in %.1fs (y: dtype rtol + ulp(mean)*|k|; stats: mean "
          "%g*|ref| + %g*std, variances %g*|ref|)" % (n, time.time() - t0, FWD_MEAN_ULP,
                                                      FWD_MEAN_STD, FWD_VAR_RTOL))
    print("  %-8s %-6s %-28s %-5s %6s %6s %11s %11s" % (
        "dtype", "format", "mode", "dev", "runs", "fail", "y err/max", "stat err/tol"))
    for key in sorted(stats):
        st = stats[key]
        print("  %-8s %-6s %-28s %-5s %6d %6d %11.3e %11.3e" % (key + tuple(st)))

    # NaN propagation through the fused ReLU (inference: one element; training: its channel).
    for dev in ("cuda", "cpu"):
        for training in (False, True):
            n += 1
            inp = make_forward_inputs((2, 3, 3, 4), "float32", "NHWC", rng)
            inp["x"][0, 1, 2, 1] = np.nan
            try:
                args = [inp[k] for k in ("x", "scale", "offset", "rm", "rv")]
                if dev == "cuda":
                    args = [to_device(torch, a) for a in args]
                out = bn_forward(*args, epsilon=epsilon, data_format="NHWC",
                                 is_training=training, activation="relu")
                y = result_to_f64(out[0])
                nan = np.isnan(y)
                want = np.zeros_like(nan)
                if training:
                    want[..., 1] = True
                else:
                    want[0, 1, 2, 1] = True
                ok = np.array_equal(nan, want) and not np.any(y[~nan] < 0)
                why = "NaN pattern of y wrong (%d NaNs, want %d)" % (nan.sum(), want.sum())
            except Exception as e:  # noqa: BLE001
                ok, why = False, repr(e)
            if not ok:
                failures.append("%s relu NaN propagation (%s): %s" % (
                    dev, "train" if training else "infer", why))

    # Determinism: repeated runs and a misaligned x give the same bits.
    for dtype, fmt, shape in itertools.product(("float32", "float16"), FWD_FORMATS,
                                               ((8, 28, 28, 128), (1, 256, 256, 1),
                                                (4, 17, 17, 6))):
        n += 1
        inp = make_forward_inputs(shape, dtype, fmt, rng)
        d = {k: to_device(torch, v) for k, v in inp.items()}
        kw = dict(epsilon=epsilon, exponential_avg_factor=0.3, data_format=fmt,
                  is_training=True, activation="relu", saved_stat="inv_std")
        try:
            outs = []
            for i in range(3):
                x = to_device(torch, inp["x"], misalign=True) if i == 2 else d["x"]
                o = bn_forward(x, d["scale"], d["offset"], d["rm"], d["rv"], **kw)
                outs.append([result_bits(t) for t in o])
            bad = [name for i in (1, 2) for name, a, b in zip(FWD_OUTPUTS, outs[0], outs[i])
                   if not np.array_equal(a, b)]
            ok, why = not bad, "differs between runs: %s" % ",".join(sorted(set(bad)))
        except Exception as e:  # noqa: BLE001
            ok, why = False, repr(e)
        if not ok:
            failures.append("cuda determinism %s %s shape=%s: %s" % (
                dtype, fmt, layout_shape(shape, fmt), why))

    # Fused-ReLU backward: bn_grad(relu_y=y) == bn_grad(dy masked with y > 0), bitwise on the
    # GPU; both devices against the float64 reference on the masked dy.
    for dtype, fmt, shape, training in itertools.product(
            DTYPES, FWD_FORMATS, ((3, 17, 19, 24), (2, 9, 9, 2), (8, 14, 14, 64)), (True, False)):
        if dtype == "bfloat16" and ml_dtypes is None:
            continue
        n += 1
        stat = "inv_std" if training else "variance"
        inp = make_forward_inputs(shape, dtype, fmt, rng)
        d = {k: to_device(torch, v) for k, v in inp.items()}
        tag = "%s %s %s shape=%s" % (dtype, fmt, "train" if training else "infer",
                                     layout_shape(shape, fmt))
        try:
            y, _, _, sm, sv = bn_forward(d["x"], d["scale"], d["offset"], d["rm"], d["rv"],
                                         epsilon=epsilon, data_format=fmt,
                                         is_training=training, activation="relu",
                                         saved_stat=stat)
            y = torch.as_tensor(y, device="cuda")
            sm, sv = torch.as_tensor(sm, device="cuda"), torch.as_tensor(sv, device="cuda")
            dy = to_device(torch, rng.standard_normal(y.shape).astype(np.float32)
                           .astype(np_dtype(dtype)))
            dy_m = torch.where(y > 0, dy, torch.zeros_like(dy))
            kw = dict(epsilon=epsilon, data_format=fmt, is_training=training, saved_stat=stat)
            fused = bn_grad(dy, d["x"], d["scale"], sm, sv, relu_y=y, **kw)
            masked = bn_grad(dy_m, d["x"], d["scale"], sm, sv, **kw)
            for name, a, b in zip(("dx", "scale_backprop", "offset_backprop"), fused, masked):
                if not np.array_equal(result_bits(a), result_bits(b)):
                    failures.append("cuda relu backward %s: %s differs from the pre-masked "
                                    "backward" % (tag, name))
            np_in = [to_numpy_dtype(torch, t, dtype) for t in (dy, dy_m, y)]
            sm_np, sv_np = sm.cpu().numpy(), sv.cpu().numpy()
            ref = reference_bn_grad(np_in[1], inp["x"], inp["scale"], sm_np, sv_np, epsilon,
                                    fmt, training, stat)
            cpu = bn_grad(np_in[0], inp["x"], inp["scale"], sm_np, sv_np, relu_y=np_in[2],
                          num_threads=0, isa="auto", **kw)
            for dev, out in (("cuda", fused), ("cpu", cpu)):
                ok, _, _, _, why = compare(tuple(result_to_f64(o) for o in out), ref, dtype)
                if not ok:
                    failures.append("%s relu backward %s: %s" % (dev, tag, why))
        except Exception as e:  # noqa: BLE001
            failures.append("relu backward %s: %r" % (tag, e))
    n_ex, ex_failures = run_fused_mode_checks(bn_forward, bn_grad, torch, epsilon, rng,
                                              verbose=verbose)
    n += n_ex
    failures += ex_failures
    torch.cuda.synchronize()
    print("(d) forward: %d checks (numerics, NaN/ReLU, determinism, ReLU backward) in %.1fs: %s"
          % (n, time.time() - t0, "all ok" if not failures else "%d FAILED" % len(failures)))
    for msg in failures[:40]:
        print("  FAIL " + msg)
    if len(failures) > 40:
        print("  ... %d more failures" % (len(failures) - 40))
    return n, len(failures)


# ---------------------------------------------------------------------------------------
# (e) fused modes (FusedBatchNormEx / GradEx): every activation x with/without side input x
# dtype x NHWC/NCHW x training/inference, forward and backward, CUDA and CPU kernels vs a
# float64 reference and vs each other, plus exact identities and determinism.
FUSED_ACTIVATIONS = (None, "relu", "relu6", "swish")
# (3, 9, 9, 16): VEC 4/8 channels-last, scalar channels-first; (2, 4, 8, 5): the reverse;
# (8, 24, 24, 32): several chunks per channel in both layouts (and VEC 4/8 in both).
FUSED_SHAPES = ((3, 9, 9, 16), (2, 4, 8, 5), (8, 24, 24, 32))
FUSED_DET_SHAPE = (8, 24, 24, 32)


def activation_f64(act, z):
    """act(z) in float64, as csrc/core/activation.h defines it."""
    if act == "relu":
        return np.maximum(z, 0.0)
    if act == "relu6":
        return np.clip(z, 0.0, 6.0)
    if act == "swish":
        return z / (1.0 + np.exp(-z))
    return z


def activation_grad_f64(act, z, y):
    """act'(z) in float64: the Relu/Relu6 masks from the forward's output y (as the kernels
    take them), Swish's s * (1 + z * (1 - s)) from z."""
    if act == "relu":
        return (y > 0).astype(np.float64)
    if act == "relu6":
        return ((y > 0) & (y < 6)).astype(np.float64)
    if act == "swish":
        s = 1.0 / (1.0 + np.exp(-z))
        return s * (1.0 + z * (1.0 - s))
    return np.ones_like(z)


def host_bits(a):
    """Raw bits of an output (NumPy array or device tensor) as a NumPy integer array."""
    if type(a).__module__.split(".")[0] == "torch" or hasattr(a, "__cuda_array_interface__"):
        return result_bits(a)
    a = np.ascontiguousarray(a)
    return a.view({4: np.int32, 2: np.int16}[a.dtype.itemsize]).copy()


def host_array(torch, a, dtype):
    """An output as a host NumPy array of `dtype` with identical bits (float32 statistics:
    dtype "float32")."""
    if type(a).__module__.split(".")[0] == "torch":
        return to_numpy_dtype(torch, a, dtype)
    return np.asarray(a)


class _FusedCase:
    """One configuration of (e): inputs, the float64 reference and the checks."""

    def __init__(self, bn_forward, bn_grad, torch, epsilon, rng, act, side, dtype, fmt, shape,
                 training):
        self.bn_forward, self.bn_grad, self.torch = bn_forward, bn_grad, torch
        self.act, self.side, self.dtype, self.fmt, self.training = act, side, dtype, fmt, training
        self.eps = epsilon
        inp = make_forward_inputs(shape, dtype, fmt, rng)
        # |z| up to ~10: Relu6's upper clip and Swish's tails are exercised.
        inp["scale"] = (inp["scale"] * 3).astype(np.float32)
        self.inp = inp
        x = inp["x"]
        t = np_dtype(dtype)
        self.side_np = ((rng.standard_normal(x.shape) * 2).astype(np.float32).astype(t)
                        if side else None)
        self.dy = rng.standard_normal(x.shape).astype(np.float32).astype(t)
        self.stat = "inv_std" if training else "variance"
        self.rtol = DX_RTOL[dtype]
        ax = channel_axis(fmt, x.ndim)
        self.axes = tuple(i for i in range(x.ndim) if i != ax)
        self.bshape = [1] * x.ndim
        self.bshape[ax] = -1
        self.x64 = to_f64(x)
        self.side64 = to_f64(self.side_np) if side else 0.0
        self.norms = {}  # name -> max normalized error

    def _b(self, v):
        return np.asarray(v, dtype=np.float64).reshape(self.bshape)

    def _dev(self, a, misalign=False):
        return None if a is None else to_device(self.torch, a, misalign)

    # -- forward ------------------------------------------------------------------------
    def forward(self, dev, misalign=False):
        inp = self.inp
        kw = dict(epsilon=self.eps, data_format=self.fmt, is_training=self.training,
                  activation=self.act, saved_stat=self.stat)
        stats = (None, None) if self.training else (inp["rm"], inp["rv"])
        if dev == "cuda":
            out = self.bn_forward(self._dev(inp["x"], misalign), self._dev(inp["scale"]),
                                  self._dev(inp["offset"]), *[self._dev(v) for v in stats],
                                  side_input=self._dev(self.side_np, misalign), **kw)
            self.torch.cuda.synchronize()
            return out
        return self.bn_forward(inp["x"], inp["scale"], inp["offset"], *stats,
                               side_input=self.side_np, num_threads=0, isa="auto", **kw)

    def forward_reference(self):
        """y_ref and its per-element error bound (output rounding, the statistics' float32
        error carried through k, the float32 rounding of z's terms; |act'| <= 1.1)."""
        inp, x = self.inp, self.x64
        eps = np.float64(np.float32(self.eps))
        if self.training:
            mean, var = x.mean(axis=self.axes), x.var(axis=self.axes)
        else:
            mean, var = to_f64(inp["rm"]), to_f64(inp["rv"])
        k = self._b(to_f64(inp["scale"]) / np.sqrt(var + eps))
        mean_b, std_b, off_b = self._b(mean), self._b(np.sqrt(var)), self._b(inp["offset"])
        xk = (x - mean_b) * k
        z = xk + off_b + self.side64
        y_ref = activation_f64(self.act, z)
        zerr = (np.abs(k) * (1.5e-7 * np.abs(mean_b) + (FWD_MEAN_STD * std_b
                                                         if self.training else 0.0))
                + (FWD_VAR_RTOL * np.abs(xk) if self.training else 0.0)
                + 3e-7 * (np.abs(xk) + np.abs(off_b) + np.abs(self.side64)))
        ymax = float(np.max(np.abs(y_ref)))
        bound = (self.rtol * np.abs(y_ref) + DX_ATOL_FRAC * self.rtol * ymax + 1.1 * zerr
                 + 1e-30)
        return y_ref, bound, ymax

    def check_forward(self, y, y_ref, bound, ymax, what):
        fails = []
        err = np.abs(y - y_ref)
        if not np.all(np.isfinite(y)):
            fails.append("%s: y has non-finite values" % what)
        elif np.any(err > bound):
            i = np.unravel_index(np.argmax(err - bound), err.shape)
            fails.append("%s: y%s=%r ref %r" % (what, tuple(int(v) for v in i), y[i], y_ref[i]))
        if self.act in ("relu", "relu6") and np.any(y < 0):
            fails.append("%s: %s output has negative values" % (what, self.act))
        if self.act == "relu6" and np.any(y > 6):
            fails.append("%s: relu6 output above 6" % what)
        self.norms[what] = float(err.max() / ymax) if ymax > 0 else float(err.max())
        return fails

    # -- backward -----------------------------------------------------------------------
    def grad(self, dev, y, sm, sv, side_np, want_dz, misalign=False, dy=None):
        """The fused backward on `dev` with the forward outputs y, sm, sv (host arrays)."""
        inp = self.inp
        dy = self.dy if dy is None else dy
        kw = dict(epsilon=self.eps, data_format=self.fmt, is_training=self.training,
                  saved_stat=self.stat, activation=self.act, side_input_backprop=want_dz)
        if dev == "cuda":
            out = self.bn_grad(self._dev(dy, misalign), self._dev(inp["x"], misalign),
                               self._dev(inp["scale"]), self._dev(sm), self._dev(sv),
                               y=self._dev(y, misalign), offset=self._dev(inp["offset"]),
                               side_input=self._dev(side_np, misalign), **kw)
            self.torch.cuda.synchronize()
            return out
        return self.bn_grad(dy, inp["x"], inp["scale"], sm, sv, y=y, offset=inp["offset"],
                            side_input=side_np, num_threads=0, isa="auto", **kw)

    def grad_with_dz(self, dev, y, sm, sv):
        """(outputs, dz, failures). dz is the kernel's own side_input_backprop; Swish without
        a side input has none, so there it comes from the same call with a zero side input
        (z + 0 == z), whose outputs must then equal the plain call's bit for bit."""
        if self.side or self.act != "swish":
            out = self.grad(dev, y, sm, sv, self.side_np, True)
            return out[:3], out[3], []
        out = self.grad(dev, y, sm, sv, None, False)
        zero = np.zeros_like(self.inp["x"])
        out_z = self.grad(dev, y, sm, sv, zero, True)
        fails = []
        for name, a, b in zip(("dx", "scale_backprop", "offset_backprop"), out, out_z[:3]):
            if not np.array_equal(host_bits(a), host_bits(b)):
                fails.append("%s: swish without side input: %s differs from the call with a "
                             "zero side input" % (dev, name))
        return out, out_z[3], fails

    def dz_reference(self, y, sm, sv):
        inp = self.inp
        eps = np.float64(np.float32(self.eps))
        inv = to_f64(sv) if self.training else 1.0 / np.sqrt(to_f64(sv) + eps)
        z = ((self.x64 - self._b(sm)) * self._b(to_f64(inp["scale"]) * inv)
             + self._b(inp["offset"]) + self.side64)
        return to_f64(self.dy) * activation_grad_f64(self.act, z, to_f64(y))

    def check_dz(self, dz, dz_ref, y, what):
        if self.act != "swish":  # exact: dy itself or a select of it
            mask = (np.ones(self.dy.shape, dtype=bool) if self.act is None
                    else activation_grad_f64(self.act, None, to_f64(y)) > 0)
            want = np.where(mask, self.dy, np.zeros_like(self.dy))
            if not np.array_equal(host_bits(dz), host_bits(want)):
                return ["%s: side_input_backprop is not dy masked by the activation" % what]
            return []
        d = to_f64(dz)
        err = np.abs(d - dz_ref)
        m = float(np.max(np.abs(dz_ref)))
        bound = self.rtol * np.abs(dz_ref) + DX_ATOL_FRAC * self.rtol * m + 1e-30
        self.norms[what + " dz"] = float(err.max() / m) if m > 0 else float(err.max())
        if not np.all(np.isfinite(d)) or np.any(err > bound):
            i = np.unravel_index(np.argmax(np.where(np.isfinite(err), err - bound, np.inf)),
                                 err.shape)
            return ["%s: side_input_backprop%s=%r ref %r" % (
                what, tuple(int(v) for v in i), d[i], dz_ref[i])]
        return []


def _fused_case(case, devs):
    """Runs one configuration of (e) on `devs`; returns failure messages."""
    torch, fails = case.torch, []
    y_ref, bound, ymax = case.forward_reference()
    fwd = {}
    for dev in devs:
        out = case.forward(dev)
        fwd[dev] = (host_array(torch, out[0], case.dtype),
                    host_array(torch, out[3], "float32"), host_array(torch, out[4], "float32"))
        fails += case.check_forward(to_f64(fwd[dev][0]), y_ref, bound, ymax, dev + " y")
    if len(devs) == 2:
        fails += case.check_forward(to_f64(fwd["cuda"][0]), to_f64(fwd["cpu"][0]), bound, ymax,
                                    "cuda-cpu y")
    # Both devices' backward get the same inputs (the first device's forward outputs).
    y, sm, sv = fwd[devs[0]]
    dz_ref = case.dz_reference(y, sm, sv)
    grads = {}
    for dev in devs:
        out, dz, f = case.grad_with_dz(dev, y, sm, sv)
        fails += f
        dz_h = host_array(torch, dz, case.dtype)
        fails += case.check_dz(dz_h, dz_ref, y, dev)
        # The batch-norm part: the backward of the kernel's own dz (float64 reference).
        ref = reference_bn_grad(dz_h, case.inp["x"], case.inp["scale"], sm, sv, case.eps,
                                case.fmt, case.training, case.stat)
        got = tuple(result_to_f64(o) for o in out)
        ok, dx_norm, _, _, why = compare(got, ref, case.dtype)
        case.norms[dev + " dx"] = dx_norm
        if not ok:
            fails.append("%s backward: %s" % (dev, why))
        if dev == "cuda":  # exactly the plain backward of side_input_backprop
            plain = case.bn_grad(dz, case._dev(case.inp["x"]), case._dev(case.inp["scale"]),
                                 case._dev(sm), case._dev(sv), epsilon=case.eps,
                                 data_format=case.fmt, is_training=case.training,
                                 saved_stat=case.stat)
            for name, a, b in zip(("dx", "scale_backprop", "offset_backprop"), out, plain):
                if not np.array_equal(host_bits(a), host_bits(b)):
                    fails.append("cuda: %s differs from the plain backward of "
                                 "side_input_backprop" % name)
        grads[dev] = (got[0], ref)
    if len(devs) == 2:
        dx_c, (dx_ref, *_) = grads["cuda"][0], grads["cuda"][1]
        dx_cpu = grads["cpu"][0]
        m = float(np.max(np.abs(dx_ref)))
        err = np.abs(dx_c - dx_cpu)
        case.norms["cuda-cpu dx"] = float(err.max() / m) if m > 0 else float(err.max())
        if np.any(err > case.rtol * np.abs(dx_ref) + DX_ATOL_FRAC * case.rtol * m + 1e-30):
            fails.append("cuda-cpu: dx differs by %.3g (max |dx| %.3g)" % (err.max(), m))
    return fails


def _fused_determinism(case):
    """Forward and backward three times (the third with misaligned tensors): bitwise equal."""
    outs_f, outs_b = [], []
    for i in range(3):
        out = case.forward("cuda", misalign=i == 2)
        outs_f.append([result_bits(t) for t in out[:5]])
    out = case.forward("cuda")
    y, sm, sv = (host_array(case.torch, out[0], case.dtype),
                 host_array(case.torch, out[3], "float32"),
                 host_array(case.torch, out[4], "float32"))
    want_dz = case.side or case.act != "swish"
    for i in range(3):
        out = case.grad("cuda", y, sm, sv, case.side_np, want_dz, misalign=i == 2)
        outs_b.append([result_bits(t) for t in out])
    bad = [name for i in (1, 2)
           for name, a, b in zip(FWD_OUTPUTS, outs_f[0], outs_f[i]) if not np.array_equal(a, b)]
    bad += [name for i in (1, 2)
            for name, a, b in zip(("dx", "scale_backprop", "offset_backprop",
                                   "side_input_backprop"), outs_b[0], outs_b[i])
            if not np.array_equal(a, b)]
    return ["differs between runs: %s" % ",".join(sorted(set(bad)))] if bad else []


def run_fused_mode_checks(bn_forward, bn_grad, torch, epsilon, rng, use_cuda=True,
                          verbose=False):
    """(e): every activation mode x with/without side input x dtype x NHWC/NCHW x
    training/inference on the CUDA (use_cuda) and CPU kernels: y vs float64; dz
    (side_input_backprop) exact for Identity/Relu/Relu6 (dy or a select of it) and within
    the dtype's tolerance for Swish; dx/scale/offset backprop vs the float64 backward of the
    kernel's own dz; CUDA fused backward == plain CUDA backward of its side_input_backprop,
    bit for bit; CUDA vs CPU; determinism with misaligned tensors. Returns (checks, failure
    messages)."""
    t0 = time.time()
    devs = ("cuda", "cpu") if use_cuda else ("cpu",)
    n, failures, table = 0, [], {}
    for act, side, dtype, fmt, shape, training in itertools.product(
            FUSED_ACTIVATIONS, (False, True), DTYPES, FWD_FORMATS, FUSED_SHAPES, (True, False)):
        if dtype == "bfloat16" and ml_dtypes is None:
            continue
        n += 1
        tag = "%s side=%s %s %s %s shape=%s" % (
            act or "identity", side, dtype, fmt, "train" if training else "infer",
            layout_shape(shape, fmt))
        case = _FusedCase(bn_forward, bn_grad, torch, epsilon, rng, act, side, dtype, fmt,
                          shape, training)
        try:
            msgs = _fused_case(case, devs)
        except Exception as e:  # noqa: BLE001 - report every kind of failure
            msgs = [repr(e)]
        failures += ["(e) %s: %s" % (tag, m) for m in msgs]
        row = table.setdefault((act or "identity", "side" if side else "-", dtype),
                               [0, 0, {}])
        row[0] += 1
        row[1] += 1 if msgs else 0
        for k, v in case.norms.items():
            row[2][k] = max(row[2].get(k, 0.0), v)
        if verbose:
            print("  (e) %-60s %s" % (tag, "ok" if not msgs else "FAIL"))
    if use_cuda:
        for act, side, dtype, fmt in itertools.product(
                FUSED_ACTIVATIONS, (False, True), ("float32", "float16"), FWD_FORMATS):
            n += 1
            case = _FusedCase(bn_forward, bn_grad, torch, epsilon, rng, act, side, dtype, fmt,
                              FUSED_DET_SHAPE, True)
            try:
                msgs = _fused_determinism(case)
            except Exception as e:  # noqa: BLE001
                msgs = [repr(e)]
            failures += ["(e) cuda determinism %s side=%s %s %s: %s" % (
                act or "identity", side, dtype, fmt, m) for m in msgs]
    cols = (["cuda y", "cpu y", "cuda-cpu y", "cuda dz", "cpu dz", "cuda dx", "cpu dx",
             "cuda-cpu dx"] if use_cuda else ["cpu y", "cpu dz", "cpu dx"])
    print("(e) fused modes: %d checks on %s in %.1fs: %s (err/max|ref|; dz: Swish only, the "
          "masks are exact)" % (n, "+".join(devs), time.time() - t0,
                                "all ok" if not failures else "%d FAILED" % len(failures)))
    print("  %-8s %-4s %-8s %4s %4s " % ("act", "side", "dtype", "runs", "fail")
          + " ".join("%11s" % c for c in cols))
    for key in sorted(table):
        runs, fails, norms = table[key]
        print("  %-8s %-4s %-8s %4d %4d " % (key + (runs, fails))
              + " ".join("%11s" % ("%.2e" % norms[c] if c in norms else "-") for c in cols))
    return n, failures


# ---------------------------------------------------------------------------------------
# (f) in place.
IN_PLACE_SHAPES = FUSED_SHAPES + ((4, 14, 14, 256),)


def run_in_place_checks(bn_forward, torch, epsilon, rng):
    """(f): the CUDA backward in place, as the TF op forwards buffers
    (csrc/tf/fbn_grad_op.cc): without a side input, x_backprop in y_backprop's or in x's
    buffer; with one, side_input_backprop in y_backprop's and x_backprop in x's (or fresh).
    Every aliased call must give the bits of the same call with fresh outputs. Without a
    side input, the call returning no dz must also give the bits of the call storing dz (the
    two second passes differ: activation applied to dy, or dz read back); with one, the same
    for the call given the side input but asked for no dz. Every activation mode x side
    input x dtype x NHWC/NCHW x training/inference. Returns (checks, failures)."""
    from fbn_grad_tf import core
    t0 = time.time()
    n, failures = 0, []
    for act, side, dtype, fmt, shape, training in itertools.product(
            FUSED_ACTIVATIONS, (False, True), DTYPES, FWD_FORMATS, IN_PLACE_SHAPES,
            (True, False)):
        if dtype == "bfloat16" and ml_dtypes is None:
            continue
        case = _FusedCase(bn_forward, None, torch, epsilon, rng, act, side, dtype, fmt, shape,
                          training)
        fwd = case.forward("cuda")
        y, sm, sv = (host_array(torch, fwd[0], dtype), host_array(torch, fwd[3], "float32"),
                     host_array(torch, fwd[4], "float32"))
        mode = core._activation_mode(act)
        fused = act is not None or side
        tag = "%s side=%s %s %s %s shape=%s" % (act or "identity", side, dtype, fmt,
                                                 "train" if training else "infer", shape)

        def call(alias=None, want_dz=False):
            """alias: None (fresh outputs) or (dx's buffer, dz's buffer), each "dy", "x",
            "fresh" (dz: or None)."""
            dy, x = case._dev(case.dy), case._dev(case.inp["x"])
            out = None
            if alias is not None:
                c = x.shape[channel_axis(fmt, x.ndim)]
                bufs = {"dy": dy, "x": x}
                dx = bufs[alias[0]] if alias[0] in bufs else torch.empty_like(x)
                dz = (None if alias[1] is None else
                      bufs[alias[1]] if alias[1] in bufs else torch.empty_like(x))
                out = (dx, torch.empty(c, dtype=torch.float32, device="cuda"),
                       torch.empty(c, dtype=torch.float32, device="cuda"), dz)
            res = core._bn_grad_device(
                dy, x, case._dev(case.inp["scale"]), case._dev(sm), case._dev(sv), case.eps,
                fmt, training, case.stat, mode, fused, case._dev(y),
                case._dev(case.inp["offset"]), case._dev(case.side_np), want_dz, out)
            torch.cuda.synchronize()
            return [result_bits(t) for t in res]

        def same(what, got, want):
            names = ("dx", "scale_backprop", "offset_backprop", "side_input_backprop")
            bad = [nm for nm, a, b in zip(names, got, want) if not np.array_equal(a, b)]
            if bad:
                failures.append("(f) %s: %s: %s differ" % (tag, what, ",".join(bad)))

        try:
            if side:
                ref = call(None, True)
                for alias in (("x", "dy"), ("fresh", "dy"), ("x", "fresh")):
                    n += 1
                    same("dx in %s, dz in %s" % alias, call(alias, True), ref)
                # Without side_input_backprop the second pass applies the activation to dy
                # (with the side input) instead of reading dz back: the same bits.
                n += 1
                same("without dz vs with dz", call(None, False), ref[:3])
            else:
                ref = call(None, False)
                for buf in ("dy", "x"):
                    n += 1
                    same("dx in %s" % buf, call((buf, None), False), ref)
                if act in ("relu", "relu6"):
                    n += 1
                    same("without dz vs with dz", ref, call(None, True)[:3])
        except Exception as e:  # noqa: BLE001 - report every kind of failure
            n += 1
            failures.append("(f) %s: %r" % (tag, e))
    print("(f) in place: %d checks in %.1fs: %s" % (
        n, time.time() - t0, "all ok" if not failures else "%d FAILED" % len(failures)))
    for msg in failures[:40]:
        print("  FAIL " + msg)
    return n, failures


# ---------------------------------------------------------------------------------------
# (c) benchmark.
def copy_bandwidth(torch, iters=10):
    """Device-to-device copy of a 1 GiB tensor; bytes counted read + write."""
    n = 1 << 30
    a = torch.empty(n, dtype=torch.uint8, device="cuda")
    a.fill_(1)
    b = torch.empty_like(a)
    for _ in range(2):
        b.copy_(a)
    times = []
    for _ in range(iters):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        b.copy_(a)
        e.record()
        e.synchronize()
        times.append(s.elapsed_time(e) / 1e3)
    del a, b
    torch.cuda.empty_cache()
    t = float(np.median(times))
    return 2.0 * n / t / 1e9, t


def make_baselines(torch, x, dy, weight, bias, eps):
    """Returns ({name: fn}, save_mean, save_invstd). x, dy are logical NCHW tensors (memory
    NHWC for channels_last)."""
    fns = {}
    rm = torch.zeros_like(weight)
    rv = torch.ones_like(weight)
    _, save_mean, save_invstd = torch.ops.aten.native_batch_norm(x, weight, bias, rm.clone(),
                                                                 rv.clone(), True, 0.1, eps)
    try:
        # cuDNN's bfloat16 BN wants its parameters in x's type (float for float16).
        pt = x.dtype if x.dtype == torch.bfloat16 else weight.dtype
        cw, cb, crm, crv = (t.to(pt) for t in (weight, bias, rm, rv))
        out = torch.ops.aten.cudnn_batch_norm(x, cw, cb, crm.clone(), crv.clone(), True,
                                              0.1, eps)
        c_mean, c_inv, reserve = out[1], out[2], out[3]

        def cudnn_bwd():
            return torch.ops.aten.cudnn_batch_norm_backward(x, dy, cw, crm, crv, c_mean, c_inv,
                                                            eps, reserve)
        cudnn_bwd()
        fns["cudnn"] = cudnn_bwd
    except Exception as e:  # noqa: BLE001
        print("  (cudnn_batch_norm_backward unavailable: %s)" % str(e).splitlines()[0][:120])

    def native_bwd():
        return torch.ops.aten.native_batch_norm_backward(dy, x, weight, rm, rv, save_mean,
                                                         save_invstd, True, eps,
                                                         [True, True, True])
    try:
        native_bwd()
        fns["native"] = native_bwd
    except Exception as e:  # noqa: BLE001
        print("  (native_batch_norm_backward unavailable: %s)" % str(e).splitlines()[0][:120])
    return fns, save_mean, save_invstd


def time_interleaved(torch, fns, iters, reps):
    """Median seconds per call of each fn; the fns take turns (rotating order) each iteration."""
    names = list(fns)
    for n in names:
        for _ in range(3):
            fns[n]()
    torch.cuda.synchronize()
    events = {n: [] for n in names}
    host = {n: [] for n in names}
    for it in range(iters):
        order = names[it % len(names):] + names[:it % len(names)]
        for n in order:
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            h0 = time.perf_counter()
            s.record()
            for _ in range(reps):
                fns[n]()
            e.record()
            host[n].append((time.perf_counter() - h0) / reps)
            events[n].append((s, e))
    torch.cuda.synchronize()
    med = {n: float(np.median([s.elapsed_time(e) / 1e3 / reps for s, e in events[n]]))
           for n in names}
    hmed = {n: float(np.median(host[n])) for n in names}
    return med, hmed


def capture_graphs(torch, fns, reps):
    """{name: replay fn} of a CUDA graph of `reps` calls of each fn (device time alone, none
    of the Python call's); names whose capture fails are left out (said once)."""
    graphs = {}
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    for name, fn in fns.items():
        try:
            with torch.cuda.stream(side):  # warm-up off the default stream, as torch asks
                for _ in range(2):
                    fn()
            torch.cuda.current_stream().wait_stream(side)
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                for _ in range(reps):
                    fn()
            graphs[name] = g.replay
        except Exception as e:  # noqa: BLE001
            print("  (no CUDA graph of %s: %s)" % (name, str(e).splitlines()[0][:100]))
    torch.cuda.synchronize()
    return graphs


def run_benchmark(bn_grad, torch, epsilon, iters, reps, dtypes, layouts):
    torch.backends.cudnn.enabled = True
    bw, t_copy = copy_bandwidth(torch)
    print("(c) benchmark: device copy bandwidth %.0f GB/s (1 GiB torch copy, read+write, %.3f ms)"
          % (bw, t_copy * 1e3))
    print("    training backward, bytes = read dy + read x + write dx; ratio = ours/baseline "
          "time (<1: ours faster). Times: device time per call from CUDA-graph replays "
          "('e': the capture failed, eager time); 'call us': ours called eagerly from Python, "
          "'*' = host-bound there (enqueue time >= 90% of the call)")
    print("  %-20s %-5s %-8s %9s %9s %9s %7s %7s %8s %6s %9s %8s" % (
        "shape (NHWC)", "fmt", "dtype", "ours us", "cudnn us", "native us", "r.cudnn",
        "r.native", "GB/s", "%copy", "dx err", "call us"))
    ratios = []
    numeric_bad = 0
    rows = 0
    for (n, h, w, c), layout, dtype in itertools.product(RESNET50_SHAPES, layouts, dtypes):
        tdt = torch_dtype(torch, dtype)
        gen = torch.Generator(device="cuda")
        gen.manual_seed(1234)
        x = torch.randn(n, c, h, w, device="cuda", dtype=torch.float32, generator=gen)
        x = (x * 1.5 + 0.25).to(tdt)
        dy = torch.randn(n, c, h, w, device="cuda", dtype=torch.float32, generator=gen).to(tdt)
        if layout == "NHWC":
            x = x.contiguous(memory_format=torch.channels_last)
            dy = dy.contiguous(memory_format=torch.channels_last)
        weight = torch.rand(c, device="cuda", dtype=torch.float32) + 0.5
        bias = torch.zeros(c, device="cuda", dtype=torch.float32)
        fns, save_mean, save_invstd = make_baselines(torch, x, dy, weight, bias, epsilon)
        if layout == "NHWC":  # the NHWC tensors our op sees (same memory, no copy)
            x_op, dy_op = x.permute(0, 2, 3, 1), dy.permute(0, 2, 3, 1)
            assert x_op.is_contiguous() and dy_op.is_contiguous()
        else:
            x_op, dy_op = x, dy

        def ours():
            return bn_grad(dy_op, x_op, weight, save_mean, save_invstd, epsilon=epsilon,
                           data_format=layout, is_training=True, saved_stat="inv_std")
        try:
            out = ours()
            torch.cuda.synchronize()
        except Exception as e:  # noqa: BLE001
            print("  %-20s %-5s %-8s ERROR %r" % ("%dx%dx%dx%d" % (n, h, w, c), layout, dtype, e))
            numeric_bad += 1
            continue
        # Sanity: ours vs the baseline's dx (same saved statistics for native).
        err_s = "-"
        base = fns.get("native") or fns.get("cudnn")
        if base is not None:
            ref_dx = base()[0]
            if layout == "NHWC":
                ref_dx = ref_dx.permute(0, 2, 3, 1)
            got_dx = torch.as_tensor(out[0], device="cuda")
            scale_ref = ref_dx.float().abs().max().item()
            err = ((got_dx.float() - ref_dx.float()).abs().max().item()) / max(scale_ref, 1e-30)
            err_s = "%.1e" % err
            if not err < 10 * DX_RTOL[dtype]:
                numeric_bad += 1
                err_s += "!"
        all_fns = dict(fns)
        all_fns["ours"] = ours
        call, hmed = time_interleaved(torch, all_fns, iters, reps)
        # Device time from CUDA-graph replays: at small shapes a Python call (ours builds its
        # outputs and workspace with ~15 torch calls) takes longer than the kernels, so the
        # eager figure is the host's. Eager where a capture failed.
        graphs = capture_graphs(torch, all_fns, reps)
        med = dict(call)
        # One replay is `reps` calls: time replays as single calls, then per call.
        graphs_timed = {name: t / reps for name, t in
                        time_interleaved(torch, graphs, iters, 1)[0].items()}
        med.update(graphs_timed)
        del graphs
        nbytes = 3 * x.numel() * x.element_size()
        gbs = nbytes / med["ours"] / 1e9
        cells = []
        for b in ("cudnn", "native"):
            cells.append("%9.1f" % (med[b] * 1e6) if b in med else "%9s" % "-")
        rc = med["ours"] / med["cudnn"] if "cudnn" in med else float("nan")
        rn = med["ours"] / med["native"] if "native" in med else float("nan")
        if "cudnn" in med:
            ratios.append(rc)
        eager = " " if "ours" in graphs_timed else "e"  # e: no graph, eager time
        flag = "*" if hmed["ours"] >= 0.9 * call["ours"] else " "
        print("  %-20s %-5s %-8s %8.1f%s %s %7.2f %7.2f %8.0f %5.0f%% %9s %7.1f%s" % (
            "%dx%dx%dx%d" % (n, h, w, c), layout, dtype, med["ours"] * 1e6, eager,
            " ".join(cells), rc, rn, gbs, 100 * gbs / bw, err_s, call["ours"] * 1e6, flag))
        rows += 1
        del x, dy, out, fns
        torch.cuda.empty_cache()
    geo = math.exp(sum(math.log(r) for r in ratios) / len(ratios)) if ratios else float("nan")
    print("  geometric-mean time ratio ours/cudnn over %d rows: %.3f" % (len(ratios), geo))
    return rows, numeric_bad, geo


# ---------------------------------------------------------------------------------------
def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cpu-only", action="store_true",
                    help="only (a) and (e) on the CPU kernels, vs float64 references (no GPU "
                         "needed)")
    ap.add_argument("--skip-bench", action="store_true")
    ap.add_argument("--skip-numerics", action="store_true")
    ap.add_argument("--skip-determinism", action="store_true")
    ap.add_argument("--skip-forward", action="store_true")
    ap.add_argument("--skip-in-place", action="store_true")
    ap.add_argument("--bench-iters", type=int, default=15)
    ap.add_argument("--bench-reps", type=int, default=10)
    ap.add_argument("--bench-dtypes", default=",".join(DTYPES))
    ap.add_argument("--bench-layouts", default="NHWC,NCHW")
    ap.add_argument("--epsilon", type=float, default=1e-3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("-v", "--verbose", action="store_true")
    args = ap.parse_args(argv)

    t_start = time.time()
    try:
        bn_grad, with_cuda = load_bn_grad()
    except RuntimeError as e:
        print("SETUP ERROR: %s" % e)
        print("GPU_CHECK SUMMARY: FAIL (module not importable)")
        return 2
    torch = None
    if not args.cpu_only:
        try:
            import torch  # noqa: F811
        except ImportError:
            print("SETUP ERROR: PyTorch is not installed (use --cpu-only)")
            print("GPU_CHECK SUMMARY: FAIL (no torch)")
            return 2
        if not torch.cuda.is_available():
            print("SETUP ERROR: torch sees no CUDA device (use --cpu-only)")
            print("GPU_CHECK SUMMARY: FAIL (no CUDA device)")
            return 2
        if not with_cuda:
            print("SETUP ERROR: fbn_grad_tf._core was built without CUDA")
            print("GPU_CHECK SUMMARY: FAIL (module without CUDA)")
            return 2
        p = torch.cuda.get_device_properties(0)
        print("device: %s, %d SMs, %.0f GiB; torch %s, cuda %s, cudnn %s" % (
            p.name, p.multi_processor_count, p.total_memory / 2**30, torch.__version__,
            torch.version.cuda, torch.backends.cudnn.version()))
    print("numpy %s, ml_dtypes %s" % (np.__version__,
                                      getattr(ml_dtypes, "__version__", "missing")))

    failures = 0
    summary = []
    if not args.skip_numerics:
        print("(a) numerics: running ...", flush=True)
        total, nfail = run_numerics(bn_grad, torch, use_cuda=not args.cpu_only, use_cpu=True,
                                    epsilon=args.epsilon, seed=args.seed, verbose=args.verbose)
        failures += nfail
        summary.append("numerics %d/%d ok" % (total - nfail, total))
    if args.cpu_only and not args.skip_forward:
        bn_forward = forward_or_report("(e) fused modes", "fused modes", summary)
        if bn_forward is None:
            failures += 1
        else:
            n, bad = run_fused_mode_checks(bn_forward, bn_grad, None, args.epsilon,
                                           np.random.default_rng(args.seed + 11),
                                           use_cuda=False, verbose=args.verbose)
            for msg in bad[:40]:
                print("  FAIL " + msg)
            failures += len(bad)
            summary.append("fused modes (CPU) %s (%d checks)" % (
                "ok" if not bad else "%d BAD" % len(bad), n))
    if not args.cpu_only and not args.skip_determinism:
        print("(b) determinism: running ...", flush=True)
        n, nbad = run_determinism(bn_grad, torch, args.epsilon, args.seed)
        failures += nbad
        summary.append("determinism %s (%d configs)" % ("ok" if not nbad else "%d BAD" % nbad, n))
    if not args.cpu_only and not args.skip_forward:
        print("(d) forward: running ...", flush=True)
        bn_forward = forward_or_report("(d) forward", "forward", summary,
                                       " (use --skip-forward)")
        if bn_forward is None:
            failures += 1
        else:
            n, nbad = run_forward_checks(bn_forward, bn_grad, torch, args.epsilon, args.seed,
                                         args.verbose)
            failures += nbad
            summary.append("forward %s (%d checks)" % ("ok" if not nbad else "%d BAD" % nbad,
                                                      n))
    if not args.cpu_only and not args.skip_in_place:
        print("(f) in place: running ...", flush=True)
        bn_forward = forward_or_report("(f) in place", "in place", summary,
                                       " (use --skip-in-place)")
        if bn_forward is None:
            failures += 1
        else:
            n, bad = run_in_place_checks(bn_forward, torch, args.epsilon,
                                         np.random.default_rng(args.seed + 23))
            failures += len(bad)
            summary.append("in place %s (%d checks)" % ("ok" if not bad else "%d BAD" % len(bad),
                                                         n))
    if not args.cpu_only and not args.skip_bench:
        print("(c) benchmark: running ...", flush=True)
        rows, nbad, geo = run_benchmark(
            bn_grad, torch, args.epsilon, args.bench_iters, args.bench_reps,
            [d for d in args.bench_dtypes.split(",") if d],
            [lay for lay in args.bench_layouts.split(",") if lay])
        failures += nbad
        summary.append("bench %d rows, geo-mean time ours/cudnn %.3f%s" % (
            rows, geo, "" if not nbad else ", %d numeric mismatches" % nbad))
    print("GPU_CHECK SUMMARY: %s; %s; %.0fs" % ("PASS" if failures == 0 else "FAIL",
                                              "; ".join(summary), time.time() - t_start))
    return 0 if failures == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
