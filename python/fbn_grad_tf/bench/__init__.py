"""Benchmark: our FusedBatchNormGradV3 against TensorFlow's built-in one (and PyTorch's).

    python -m fbn_grad_tf.bench                    # full grid (ResNet-50 BN shapes), ~10 min
    python -m fbn_grad_tf.bench --quick            # ~1 minute subset
    python -m fbn_grad_tf.bench --json r.json --plot r.png
    python -m fbn_grad_tf.bench --layer            # whole BN layer training step (fwd + bwd)

What one run does (see docs/BENCHMARK.md):

* measures this machine's memory bandwidth (copy and triad, NumPy on all cores and a
  TensorFlow tf.function), so that our effective GB/s can be read as a fraction of it;
* in this process (TensorFlow's default: oneDNN on for x86 Linux), for every case
  (shape x data format x dtype x mode): builds inputs, runs our op and TF's
  ``tf.raw_ops.FusedBatchNormGradV3`` once each and compares the outputs (a mismatch
  raises CorrectnessError), then times both inside ``tf.function``, interleaved (ours, TF,
  TF, ours, ...), and keeps the medians; PyTorch's CPU ``native_batch_norm_backward`` is a
  third contestant when ``torch`` is importable;
* starts itself again as a worker subprocess with ``TF_ENABLE_ONEDNN_OPTS=0`` (read only
  at TF start-up) to time TF's Eigen kernels, again interleaved with ours;
* prints a table and summary, and optionally writes JSON and a bar chart.

The speed-up is TF time / our time (> 1: ours is faster). Speed-ups against each TF
backend come from same-process pairs; the "ours ms" column is from the main process.

``--layer`` times a whole batch-norm layer training step instead (forward + backward in one
tf.function with a GradientTape, float32 NHWC by default): ours (our forward and backward),
ours+ReLU, TF's forward with our backward, TF BN+ReLU, TF fused, Keras 3's
BatchNormalization and PyTorch (see run_layer and LAYER_COLUMNS); main process only.
"""
import argparse
import dataclasses
import datetime
import json
import math
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from typing import Optional, Tuple

import numpy as np
import tensorflow as tf

# ---- the grid ---------------------------------------------------------------------------

#: ResNet-50 batch-norm shapes at batch 32 (NHWC), plus a 1x1 many-channel shape.
DEFAULT_SHAPES = ((32, 112, 112, 64), (32, 56, 56, 256), (32, 28, 28, 512),
                  (32, 14, 14, 1024), (32, 7, 7, 2048), (256, 1, 1, 4096))
QUICK_SHAPES = ((32, 28, 28, 512), (256, 1, 1, 4096))
DTYPES = ("float32", "bfloat16", "float16")
QUICK_DTYPES = ("float32", "bfloat16")
FORMATS = ("NHWC", "NCHW")
MODES = ("training", "inference")

#: A shape is "large" (well beyond the 32 MiB L3 cache) from this many elements on: the
#: bandwidth summary uses these.
LARGE_ELEMENTS = 8_000_000

#: Output tolerances for the correctness check: max |ours - ref| / max |ref|, per output.
#: dx is in the input dtype (a few ulps of it); scale/offset backprops are float32 sums.
DX_TOL = {"float32": 1e-4, "float16": 5e-3, "bfloat16": 3e-2}
VEC_TOL = 1e-3

_ITEMSIZE = {"float32": 4, "bfloat16": 2, "float16": 2}
_SHORT_MODE = {"training": "train", "inference": "infer"}


class CorrectnessError(AssertionError):
    """Our outputs differ from the reference beyond tolerance (raised before timing)."""


@dataclasses.dataclass
class Config:
    """What to run. Shapes are NHWC dims; NCHW cases use the transposed tensors."""
    shapes: Tuple[Tuple[int, int, int, int], ...] = DEFAULT_SHAPES
    dtypes: Tuple[str, ...] = DTYPES
    formats: Tuple[str, ...] = FORMATS
    modes: Tuple[str, ...] = MODES
    reps: Optional[int] = None      # fixed repetitions; None: time-budgeted (below)
    min_reps: int = 5
    max_reps: int = 100
    budget_s: float = 1.5           # time for the slowest contestant per case
    warmup: int = 1                 # untimed calls after the (also untimed) check call
    threads: Optional[int] = None   # TF intra-op threads (and torch's); None: TF default
    epsilon: float = 1e-3
    torch: bool = True              # include PyTorch when importable
    eigen_bfc: bool = False         # Eigen worker: TF_CPU_ALLOCATOR_USE_BFC=true (see docs)
    progress: bool = True
    seed: int = 1234

    def to_json(self):
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, d):
        d = dict(d)
        d["shapes"] = tuple(tuple(s) for s in d["shapes"])
        for k in ("dtypes", "formats", "modes"):
            d[k] = tuple(d[k])
        return cls(**d)


def quick_config(**overrides):
    """The --quick subset: 2 shapes, float32 + bfloat16, both formats and modes, few reps."""
    kw = dict(shapes=QUICK_SHAPES, dtypes=QUICK_DTYPES, budget_s=0.3, min_reps=3,
              max_reps=30)
    kw.update(overrides)
    return Config(**kw)


# ---- small helpers ----------------------------------------------------------------------

def shape_str(shape):
    return "x".join(str(d) for d in shape)


def parse_shape(text):
    try:
        dims = tuple(int(t) for t in text.lower().replace("*", "x").split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError("bad shape %r (want NxHxWxC, e.g. 32x56x56x256)"
                                         % text) from None
    if len(dims) != 4 or min(dims) < 1:
        raise argparse.ArgumentTypeError("bad shape %r (want 4 positive NHWC dims, e.g. "
                                         "32x56x56x256)" % text)
    return dims


def tensor_shape(shape_nhwc, fmt):
    n, h, w, c = shape_nhwc
    return (n, h, w, c) if fmt == "NHWC" else (n, c, h, w)


def onednn_enabled():
    """Whether this TF process uses oneDNN kernels (TF_ENABLE_ONEDNN_OPTS at start-up)."""
    try:
        from tensorflow.python.util import _pywrap_util_port
        return bool(_pywrap_util_port.IsMklEnabled())
    except Exception:  # pragma: no cover - internal API moved
        return os.environ.get("TF_ENABLE_ONEDNN_OPTS", "1") not in ("0", "false", "False")


def backend_name(onednn):
    return "onednn" if onednn else "eigen"


def _fmt_duration(s):
    s = int(round(s))
    return "%d:%02d" % (s // 60, s % 60)


def _cpu_model():
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def configure_threads(threads):
    """Sets TF's intra-op pool size (must precede TF's first op). Returns the value in force."""
    if threads:
        try:
            tf.config.threading.set_intra_op_parallelism_threads(int(threads))
        except RuntimeError as e:
            if tf.config.threading.get_intra_op_parallelism_threads() != int(threads):
                print("warning: --threads %d not applied: %s" % (threads, e), file=sys.stderr)
    return tf.config.threading.get_intra_op_parallelism_threads() or os.cpu_count()


class Progress:
    """A plain-text progress line on stderr ('\\r'-updated on a terminal, else one line per
    case). Progress is weighted by tensor size for the ETA."""

    def __init__(self, label, weights, stream=None, enabled=True):
        self.label = label
        self.total_w = float(sum(weights)) or 1.0
        self.count = len(weights)
        self.done_w = 0.0
        self.done = 0
        self.stream = stream or sys.stderr
        self.enabled = enabled
        self.tty = hasattr(self.stream, "isatty") and self.stream.isatty()
        self.t0 = time.perf_counter()

    def start(self, what):
        if not self.enabled:
            return
        frac = self.done_w / self.total_w
        elapsed = time.perf_counter() - self.t0
        eta = ("eta %s" % _fmt_duration(elapsed / frac * (1 - frac))) if frac > 0.02 else ""
        width = 20
        bar = "#" * int(frac * width) + "." * (width - int(frac * width))
        line = "[%s] [%s] %d/%d %s  %s %s" % (self.label, bar, self.done + 1, self.count, what,
                                              _fmt_duration(elapsed), eta)
        if self.tty:
            self.stream.write("\r\033[K" + line)
        else:
            self.stream.write(line + "\n")
        self.stream.flush()

    def finish(self, weight):
        self.done += 1
        self.done_w += weight

    def close(self):
        if not self.enabled:
            return
        line = "[%s] %d cases in %s" % (self.label, self.done,
                                        _fmt_duration(time.perf_counter() - self.t0))
        self.stream.write(("\r\033[K" if self.tty else "") + line + "\n")
        self.stream.flush()


# ---- memory bandwidth --------------------------------------------------------------------

def _best_rate(fn, nbytes, repeats):
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = fn()
        best = min(best, time.perf_counter() - t0)
        del out
    return nbytes / best / 1e9


def _numpy_bandwidth(n, threads, repeats):
    a = np.zeros(n, np.float32)
    b = np.ones(n, np.float32)
    c = np.full(n, 2.0, np.float32)
    chunk = 1 << 15  # 128 KiB of float32: the temporary stays in L2

    def triad(lo, hi):
        tmp = np.empty(chunk, np.float32)
        for i in range(lo, hi, chunk):
            j = min(i + chunk, hi)
            t = tmp[:j - i]
            np.multiply(c[i:j], np.float32(3.0), out=t)
            np.add(t, b[i:j], out=a[i:j])

    def copy(lo, hi):
        np.copyto(a[lo:hi], b[lo:hi])

    def parallel(fn):
        def go():
            ths = [threading.Thread(target=fn, args=(n * k // threads, n * (k + 1) // threads))
                   for k in range(threads)]
            for t in ths:
                t.start()
            for t in ths:
                t.join()
        return go

    return {"numpy_copy": _best_rate(parallel(copy), 2 * n * 4, repeats),
            "numpy_triad": _best_rate(parallel(triad), 3 * n * 4, repeats)}


def _tf_bandwidth(n, repeats):
    x = tf.fill([n], 1.0)
    y = tf.fill([n], 2.0)
    s = tf.constant(3.0)
    res = {}
    scale_fn = tf.function(lambda x, s: x * s)
    res["tf_scale"] = _best_rate(lambda: scale_fn(x, s), 2 * n * 4, repeats)
    try:
        triad_fn = tf.function(lambda x, y, s: x * s + y, jit_compile=True)
        triad_fn(x, y, s)
        res["tf_triad_fused"] = True
    except Exception:  # no XLA here: two kernels (counted as 3 arrays all the same)
        triad_fn = tf.function(lambda x, y, s: x * s + y)
        res["tf_triad_fused"] = False
    res["tf_triad"] = _best_rate(lambda: triad_fn(x, y, s), 3 * n * 4, repeats)
    return res


def measure_bandwidth(threads=None, mib=256, repeats=5):
    """Memory bandwidth in GB/s (1e9 B/s), STREAM-style byte counts, best of `repeats`.

    numpy_copy: b -> a (2 arrays counted); numpy_triad: a = b + s*c (3 arrays counted),
    both split over `threads` Python threads (NumPy releases the GIL), the triad in
    cache-sized chunks so no temporary goes to memory. tf_scale: x*s (2 arrays);
    tf_triad: x*s + y (3 arrays), XLA-fused when jit_compile works, on TF's thread pool
    (includes allocating the output, as every TF op does). "bandwidth" is the best of all.
    """
    threads = threads or os.cpu_count() or 1
    n = mib * 2 ** 20 // 4
    res = {"array_mib": mib, "threads": threads, "repeats": repeats}
    res.update(_numpy_bandwidth(n, threads, repeats))
    res.update(_tf_bandwidth(n, repeats))
    res["copy"] = max(res["numpy_copy"], res["tf_scale"])
    res["triad"] = max(res["numpy_triad"], res["tf_triad"])
    res["bandwidth"] = max(res["copy"], res["triad"])
    return res


# ---- inputs and contestants --------------------------------------------------------------

def _make_inputs(shape, dtype, seed):
    """NHWC dy and x in `dtype` (x with per-channel mean/spread), float32 scale, the batch
    statistics of x (training) and perturbed "population" statistics (inference)."""
    c = shape[-1]
    dt = tf.as_dtype(dtype)
    mu = tf.random.stateless_uniform([c], [seed, 1], -1.0, 1.0)
    sigma = tf.random.stateless_uniform([c], [seed, 2], 0.5, 2.0)
    x = tf.cast(tf.random.stateless_normal(shape, [seed, 3]) * sigma + mu, dt)
    dy = tf.cast(tf.random.stateless_normal(shape, [seed, 4]), dt)
    mean, var = tf.nn.moments(tf.cast(x, tf.float32), axes=[0, 1, 2])
    return {
        "dy": dy, "x": x,
        "scale": tf.random.stateless_uniform([c], [seed, 5], 0.5, 1.5),
        "training": (mean, var),
        "inference": (mean + 0.1 * tf.random.stateless_normal([c], [seed, 6]),
                      var * tf.random.stateless_uniform([c], [seed, 7], 0.8, 1.25)),
        "rs3": tf.zeros([0], tf.float32),
    }


def _ours_op(dy, x, scale, rs1, rs2, rs3, epsilon, data_format, is_training):
    from .. import ops
    return ops.fused_batch_norm_grad(dy, x, scale, rs1, rs2, rs3, epsilon=epsilon,
                                     data_format=data_format, is_training=is_training)


def _tf_op(dy, x, scale, rs1, rs2, rs3, epsilon, data_format, is_training):
    return tf.raw_ops.FusedBatchNormGradV3(
        y_backprop=dy, x=x, scale=scale, reserve_space_1=rs1, reserve_space_2=rs2,
        reserve_space_3=rs3, epsilon=epsilon, data_format=data_format,
        is_training=is_training)


def _core_callable(args, epsilon, fmt, training, threads):
    """Our kernels called through the framework-free core (fbn_grad_tf.core.bn_grad) on
    NumPy copies of the same tensors, made once: a direct kernel call from Python, with no
    TF graph dispatch (about 0.2 ms per tf.function call on the 2-core machines), as
    PyTorch's eager call has none. Returns a zero-argument callable."""
    from .. import core
    dy, x, scale, rs1, rs2 = (np.asarray(t.numpy()) for t in args[:5])

    def call():
        return core.bn_grad(dy, x, scale, rs1, rs2, epsilon, fmt, training,
                            num_threads=threads)

    return call


def _tf_callable(which, args, epsilon, fmt, training):
    """A zero-argument callable running `which` ('ours' or 'tf') in a fresh tf.function."""
    op = _ours_op if which == "ours" else _tf_op

    @tf.function(autograph=False)
    def f(dy, x, scale, rs1, rs2, rs3):
        out = op(dy, x, scale, rs1, rs2, rs3, epsilon=epsilon, data_format=fmt,
                 is_training=training)
        return out[0], out[1], out[2]

    return lambda: f(*args)


#: Why the PyTorch column is n/a when torch cannot be imported (the table and JSON say so).
TORCH_MISSING = "torch not installed"
TORCH_INSTALL_HINT = "pip install torch==2.13.0, or the package's 'bench' extra"


def _torch_module():
    """(torch, None) or (None, reason): TORCH_MISSING, or the import error of a broken one."""
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # no spinning threads between calls
    try:
        import torch
        return torch, None
    except ModuleNotFoundError as e:
        if e.name == "torch":
            return None, TORCH_MISSING
        return None, "torch not importable (%s)" % e
    except ImportError as e:
        return None, "torch not importable (%s)" % e


def _to_torch(torch, t):
    a = t.numpy()
    if a.dtype.name == "bfloat16":
        return torch.from_numpy(a.view(np.uint16)).view(torch.bfloat16)
    return torch.from_numpy(a)


def _to_torch_layout(torch, t, channels_last):
    """A channels-last TF tensor (NHWC/NDHWC) as torch's channels-first shape: a view in
    channels_last (channels_last_3d) memory format, or a contiguous copy (NCHW/NCDHW).
    Conversions happen once per case, outside the timed calls."""
    a = _to_torch(torch, t)
    perm = (0, a.dim() - 1) + tuple(range(1, a.dim() - 1))
    a = a.permute(*perm)
    if not channels_last:
        return a.contiguous()
    fmt = torch.channels_last if a.dim() == 4 else torch.channels_last_3d
    assert a.is_contiguous(memory_format=fmt)
    return a


def _from_torch_layout(a, channels_last):
    """Inverse of _to_torch_layout for an output: a NumPy array in the TF format's layout."""
    if channels_last:
        a = a.permute(0, *range(2, a.dim()), 1)
    return a.float().detach().numpy()


def _torch_callable(torch, nhwc_args, fmt, training, epsilon):
    """torch.ops.aten.native_batch_norm_backward on the same data (`nhwc_args`: dy, x,
    scale, mean, variance as TF tensors, dy/x channels-last): NHWC as an NCHW-shaped tensor
    in channels_last memory format (a view of the same bytes), NCHW contiguous; training
    with save_mean/save_invstd, inference with running_mean/running_var. Returns a
    zero-argument callable; dy/x are converted here, once."""
    channels_last = fmt in ("NHWC", "NDHWC")
    dy = _to_torch_layout(torch, nhwc_args[0], channels_last)
    x = _to_torch_layout(torch, nhwc_args[1], channels_last)
    scale, rs1, rs2 = (_to_torch(torch, t) for t in nhwc_args[2:5])
    if training:
        invstd = torch.rsqrt(rs2 + epsilon)
        args = (dy, x, scale, None, None, rs1, invstd, True, epsilon, [True, True, True])
    else:
        args = (dy, x, scale, rs1, rs2, None, None, False, epsilon, [True, True, True])
    fn = torch.ops.aten.native_batch_norm_backward

    def call():
        return fn(*args)

    return call


# ---- the correctness check -----------------------------------------------------------------

def short_error(e):
    """The meaningful line of a TF error ("... only support NHWC tensor format for now.")."""
    text = getattr(e, "message", None) or str(e)
    for line in text.splitlines():
        line = re.sub(r"\{\{function_node [^}]*\}\}|\[\[.*?\]\]|\[Op:[^\]]*\]", "",
                      line).strip()
        if line and line != "Graph execution error:" and not line.startswith(
                ("Detected at", "File ", "<")):
            return line[:200]
    return type(e).__name__


def _rel_err(out, ref):
    """max |out - ref| / max |ref| in float32; inf if `out` has a non-finite value."""
    out = tf.cast(tf.convert_to_tensor(out), tf.float32)
    ref = tf.cast(tf.convert_to_tensor(ref), tf.float32)
    if out.shape != ref.shape:
        return float("inf")
    if not bool(tf.reduce_all(tf.math.is_finite(out))):
        return float("inf")
    diff = float(tf.reduce_max(tf.abs(out - ref))) if tf.size(ref) else 0.0
    scale = float(tf.reduce_max(tf.abs(ref))) if tf.size(ref) else 0.0
    return diff / max(scale, 1e-30)


def _check(name, outs, ref, dtype, case_name, ref_name, keys=("dx", "dscale", "doffset")):
    """Relative errors of `outs` against `ref`, named by `keys`; raises CorrectnessError
    beyond the tolerances (y and dx: DX_TOL of the dtype; the float32 vectors: VEC_TOL)."""
    errs = {k: _rel_err(o, r) for k, o, r in zip(keys, outs, ref)}
    tol = {k: DX_TOL[dtype] if k in ("y", "dx") else VEC_TOL for k in keys}
    bad = {k: v for k, v in errs.items() if not v <= tol[k]}
    if bad:
        raise CorrectnessError(
            "%s differs from %s on %s: %s (tolerances %s)" % (
                name, ref_name, case_name,
                ", ".join("%s rel err %.3g" % kv for kv in bad.items()), tol))
    return errs


def numpy_reference(dy, x, scale, rs1, rs2, epsilon, data_format, is_training):
    """FusedBatchNormGradV3 in float64 NumPy (NHWC or NCHW). Returns (dx, dscale, doffset)."""
    dy = np.asarray(dy, np.float64)
    x = np.asarray(x, np.float64)
    if data_format == "NCHW":
        dy, x = dy.transpose(0, 2, 3, 1), x.transpose(0, 2, 3, 1)
    axes = (0, 1, 2)
    inv_std = 1.0 / np.sqrt(np.asarray(rs2, np.float64) + epsilon)
    xhat = (x - np.asarray(rs1, np.float64)) * inv_std
    doffset = dy.sum(axis=axes)
    dscale = (dy * xhat).sum(axis=axes)
    k = np.asarray(scale, np.float64) * inv_std
    if is_training:
        m = dy.shape[0] * dy.shape[1] * dy.shape[2]
        dx = k * (dy - doffset / m - xhat * dscale / m)
    else:
        dx = k * dy
    if data_format == "NCHW":
        dx = dx.transpose(0, 3, 1, 2)
    return dx, dscale, doffset


# ---- the core loop ------------------------------------------------------------------------

def _cases(config):
    for shape in config.shapes:
        for dtype in config.dtypes:
            for fmt in config.formats:
                for mode in config.modes:
                    yield tuple(shape), dtype, fmt, mode


def _stats(samples_s):
    ms = [s * 1e3 for s in samples_s]
    return {"median_ms": statistics.median(ms), "min_ms": min(ms),
            "mean_ms": statistics.fmean(ms), "samples_ms": [round(v, 4) for v in ms]}


def time_interleaved(fns, reps):
    """Calls each of `fns` (name -> zero-arg callable) once per repetition, alternating the
    order (ABBA...), and returns name -> list of seconds."""
    names = list(fns)
    samples = {k: [] for k in names}
    for i in range(reps):
        for k in (names if i % 2 == 0 else names[::-1]):
            t0 = time.perf_counter()
            out = fns[k]()
            samples[k].append(time.perf_counter() - t0)
            del out
    return samples


def warm_up_and_time(fns, config):
    """Warms each of `fns` up, picks the repetitions (config.reps, or as many as the slowest
    contestant fits into config.budget_s, within min_reps..max_reps) and times them
    interleaved. Returns (reps, name -> list of seconds)."""
    est = {}
    for k, f in fns.items():
        for _ in range(max(config.warmup, 1)):
            t0 = time.perf_counter()
            f()
            est[k] = time.perf_counter() - t0
    if config.reps:
        reps = int(config.reps)
    else:
        reps = int(config.budget_s / max(max(est.values()), 1e-6))
        reps = max(config.min_reps, min(config.max_reps, reps))
    return reps, time_interleaved(fns, reps)


def _setup_torch(config, threads):
    """(torch or None, note for the header, reason it is n/a or None): torch with
    torch.set_num_threads(threads) (the threads TF, hence our op, uses), or why not."""
    if not config.torch:
        return None, "torch disabled (--no-torch)", None
    torch, why = _torch_module()
    if torch is None:
        return None, "torch: n/a (%s)" % why, why
    torch.set_num_threads(threads)
    return torch, "torch %s (%d threads)" % (torch.__version__, torch.get_num_threads()), None


def run(config=None, label=None, stream=None):
    """Runs every case of `config` in this process: check, warm up, time interleaved.

    Returns {"meta": {...}, "results": [case, ...]}; each case has shape (NHWC dims),
    tensor_shape, format, dtype, mode, elements, min_bytes, reps, check (relative errors
    and the reference used), and per contestant ("ours", "tf", "torch" when present) either
    {"median_ms", "min_ms", "mean_ms", "samples_ms"} or {"error": message} (n/a).
    """
    config = config or Config()
    threads = configure_threads(config.threads)
    onednn = onednn_enabled()
    backend = backend_name(onednn)
    label = label or backend
    torch, torch_note, torch_why = _setup_torch(config, threads)
    meta = {"tf_version": tf.__version__, "tf_backend": backend, "onednn": onednn,
            "TF_CPU_ALLOCATOR_USE_BFC": os.environ.get("TF_CPU_ALLOCATOR_USE_BFC"),
            "intra_op_threads": threads, "torch": torch_note, "torch_why": torch_why,
            "config": config.to_json()}

    cases = list(_cases(config))
    progress = Progress(label, [math.prod(c[0]) for c in cases], stream=stream,
                        enabled=config.progress)
    results = []
    inputs = None
    key = None
    eps = float(config.epsilon)
    # Each case builds fresh tf.functions (traced once each); TF's "frequent retracing"
    # warning would misfire on them.
    logger = tf.get_logger()
    old_level = logger.level
    logger.setLevel("ERROR")
    try:
        for shape, dtype, fmt, mode in cases:
            case_name = "%s %s %s %s" % (shape_str(tensor_shape(shape, fmt)), fmt, dtype, mode)
            progress.start(case_name)
            if key != (shape, dtype):
                inputs = None  # free the previous tensors first
                inputs = _make_inputs(shape, dtype, config.seed)
                key = (shape, dtype)
            if fmt not in inputs:
                if fmt == "NHWC":
                    inputs[fmt] = (inputs["dy"], inputs["x"])
                else:
                    inputs[fmt] = (tf.transpose(inputs["dy"], [0, 3, 1, 2]),
                                   tf.transpose(inputs["x"], [0, 3, 1, 2]))
            training = mode == "training"
            rs1, rs2 = inputs[mode]
            args = inputs[fmt] + (inputs["scale"], rs1, rs2, inputs["rs3"])
            entry = _run_case(config, shape, dtype, fmt, mode, training, args, inputs, eps,
                              torch, case_name, threads)
            if torch_why:
                entry["torch"] = {"error": torch_why}
            results.append(entry)
            progress.finish(math.prod(shape))
    finally:
        inputs = None
        logger.setLevel(old_level)
        progress.close()
    return {"meta": meta, "results": results}


def _run_case(config, shape, dtype, fmt, mode, training, args, inputs, eps, torch, case_name,
              threads):
    fns = {"ours": _tf_callable("ours", args, eps, fmt, training),
           "tf": _tf_callable("tf", args, eps, fmt, training),
           "core": _core_callable(args, eps, fmt, training, threads)}
    entry = {"shape": list(shape), "tensor_shape": list(tensor_shape(shape, fmt)),
             "format": fmt, "dtype": dtype, "mode": mode, "elements": math.prod(shape),
             "min_bytes": 3 * math.prod(shape) * _ITEMSIZE[dtype]}
    errors = {}

    # -- correctness: ours against TF (or TF on the NHWC tensors where TF refuses NCHW).
    ours_out = fns["ours"]()
    try:
        ref = fns["tf"]()
        ref_name = "TF FusedBatchNormGradV3 (%s)" % fmt
    except (tf.errors.InvalidArgumentError, tf.errors.UnimplementedError) as e:
        errors["tf"] = short_error(e)
        del fns["tf"]
        ref = None
    if ref is None and fmt == "NCHW":
        try:
            nhwc_args = (inputs["dy"], inputs["x"]) + args[2:]
            r = _tf_callable("tf", nhwc_args, eps, "NHWC", training)()
            ref = (tf.transpose(r[0], [0, 3, 1, 2]), r[1], r[2])
            ref_name = "TF FusedBatchNormGradV3 (NHWC, dx transposed)"
        except tf.errors.OpError:
            ref = None
    if ref is None:
        ref = numpy_reference(*(t.numpy() for t in args[:5]), eps, fmt, training)
        ref_name = "NumPy float64 reference"
    check = {"reference": ref_name,
             "ours": _check("ours", ours_out, ref, dtype, case_name, ref_name),
             "core": _check("ours (core)", fns["core"](), ref, dtype, case_name, ref_name)}
    del ours_out

    if torch is not None:
        try:
            tcall = _torch_callable(torch, (inputs["dy"], inputs["x"]) + args[2:5], fmt,
                                    training, eps)
            tout = tcall()
            tout = (_from_torch_layout(tout[0], fmt == "NHWC"), tout[1].float().numpy(),
                    tout[2].float().numpy())
            check["torch"] = _check("torch", tout, ref, dtype, case_name, ref_name)
            fns["torch"] = tcall
            del tout
        except CorrectnessError as e:  # PyTorch is only a bystander: n/a, not fatal
            errors["torch"] = "outputs differ: %s" % e
            print("warning: PyTorch %s" % errors["torch"], file=sys.stderr)
        except Exception as e:  # an unsupported dtype/format combination: n/a
            errors["torch"] = "%s: %s" % (type(e).__name__, str(e).split("\n")[0][:200])
    del ref

    # -- warm up (the check call above already traced and ran each function once).
    reps, samples = warm_up_and_time(fns, config)

    entry["reps"] = reps
    entry["check"] = check
    for k in ("ours", "tf", "core", "torch"):
        if k in samples:
            entry[k] = _stats(samples[k])
        elif k in errors:
            entry[k] = {"error": errors[k]}
    return entry


# ---- merging, table, summary ---------------------------------------------------------------

def _case_key(r):
    return (tuple(r["shape"]), r["format"], r["dtype"], r["mode"])


def _ms(d):
    return None if d is None or "median_ms" not in d else d["median_ms"]


def _ratio(num, den):
    return None if num is None or den is None or den <= 0 else num / den


def merge(main_res, other_res=None, bandwidth=None):
    """Merges the main process's results with the other TF backend's worker results.

    Flattened per case: ours_ms (main process), tf_onednn_ms, tf_eigen_ms, core_ms (our
    kernels through the framework-free core), torch_ms, speedup_onednn/eigen/torch (their
    ms / ours ms from the same process), speedup_torch_core (torch ms / core ms), gbps (our
    effective bandwidth on 3 * elements * itemsize bytes) and bw_fraction, torch_gbps and
    torch_bw_fraction (the same for PyTorch's time).
    """
    main_backend = main_res["meta"]["tf_backend"]
    other = {}
    if other_res is not None:
        other = {_case_key(r): r for r in other_res["results"]}
    bw = bandwidth["bandwidth"] if bandwidth else None
    rows = []
    for r in main_res["results"]:
        o = other.get(_case_key(r))
        row = {k: r[k] for k in ("shape", "tensor_shape", "format", "dtype", "mode",
                                 "elements", "min_bytes", "reps")}
        ours = _ms(r.get("ours"))
        row["ours_ms"] = ours
        per_backend = {main_backend: (r, ours)}
        if o is not None:
            per_backend[other_res["meta"]["tf_backend"]] = (o, _ms(o.get("ours")))
        for b in ("onednn", "eigen"):
            src, ours_b = per_backend.get(b, (None, None))
            tf_ms = _ms(src.get("tf")) if src else None
            row["tf_%s_ms" % b] = tf_ms
            row["speedup_%s" % b] = _ratio(tf_ms, ours_b)
            row["tf_%s_error" % b] = (src.get("tf") or {}).get("error") if src else "not run"
            row["ours_ms_%s_run" % b] = ours_b
        row["core_ms"] = _ms(r.get("core"))
        row["torch_ms"] = _ms(r.get("torch"))
        row["speedup_torch"] = _ratio(row["torch_ms"], ours)
        row["speedup_torch_core"] = _ratio(row["torch_ms"], row["core_ms"])
        row["torch_error"] = (r.get("torch") or {}).get("error")
        row["gbps"] = r["min_bytes"] / (ours * 1e-3) / 1e9 if ours else None
        row["bw_fraction"] = row["gbps"] / bw if row["gbps"] and bw else None
        tms = row["torch_ms"]
        row["torch_gbps"] = r["min_bytes"] / (tms * 1e-3) / 1e9 if tms else None
        row["torch_bw_fraction"] = (row["torch_gbps"] / bw if row["torch_gbps"] and bw
                                    else None)
        row["check"] = {"main": r["check"], "other": o["check"] if o else None}
        row["raw"] = {"main": r, "other": o}
        rows.append(row)
    return rows


def _sorted(rows):
    """Grouped by dtype and format; shapes in run order (the grid's), training first."""
    order = {}
    for r in rows:
        order.setdefault(tuple(r["shape"]), len(order))
    return sorted(rows, key=lambda r: (
        DTYPES.index(r["dtype"]) if r["dtype"] in DTYPES else 9,
        FORMATS.index(r["format"]), order[tuple(r["shape"])], MODES.index(r["mode"])))


def _f(v, fmt="%.2f", na="n/a"):
    return na if v is None else fmt % v


def format_table(rows, have_torch=False):
    cols = [("shape", "<", 15), ("fmt", "<", 4), ("dtype", "<", 8), ("mode", "<", 5),
            ("ours ms", ">", 8), ("TF-oneDNN", ">", 9), ("x", ">", 6),
            ("ours(E)", ">", 8), ("TF-Eigen", ">", 9), ("x", ">", 6)]
    cols += [("GB/s", ">", 6), ("%BW", ">", 5), ("core ms", ">", 8)]
    if have_torch:
        cols += [("torch ms", ">", 9), ("x", ">", 6), ("xc", ">", 6), ("t%BW", ">", 5)]
    cols += [("reps", ">", 4)]
    def line(vals):
        return "  ".join(("{:%s%d}" % (a, w)).format(v) for (_, a, w), v in zip(cols, vals))
    out = [line([c[0] for c in cols]), line(["-" * c[2] for c in cols])]
    prev = None
    for r in _sorted(rows):
        grp = (r["dtype"], r["format"])
        if prev is not None and grp != prev:
            out.append("")
        prev = grp
        vals = [shape_str(r["tensor_shape"]), r["format"], r["dtype"],
                _SHORT_MODE[r["mode"]], _f(r["ours_ms"], "%.3f"),
                _f(r["tf_onednn_ms"], "%.3f"), _f(r["speedup_onednn"], "%.2fx"),
                _f(r["ours_ms_eigen_run"], "%.3f"), _f(r["tf_eigen_ms"], "%.3f"),
                _f(r["speedup_eigen"], "%.2fx")]
        vals += [_f(r["gbps"], "%.1f"), _f(r["bw_fraction"] and 100 * r["bw_fraction"], "%.0f%%"),
                 _f(r.get("core_ms"), "%.3f")]
        if have_torch:
            vals += [_f(r["torch_ms"], "%.3f"), _f(r["speedup_torch"], "%.2fx"),
                     _f(r.get("speedup_torch_core"), "%.2fx"),
                     _f(r.get("torch_bw_fraction") and 100 * r["torch_bw_fraction"], "%.0f%%")]
        vals += [str(r["reps"])]
        out.append(line(vals))
    return "\n".join(out)


def _median(vals):
    vals = [v for v in vals if v is not None]
    return (statistics.median(vals), len(vals)) if vals else (None, 0)


SUMMARY_GROUPS = (("float32 NHWC", ("float32",), "NHWC"),
                  ("float32 NCHW", ("float32",), "NCHW"),
                  ("bf16+f16 NHWC", ("bfloat16", "float16"), "NHWC"),
                  ("bf16+f16 NCHW", ("bfloat16", "float16"), "NCHW"),
                  ("bfloat16 (both)", ("bfloat16",), None),
                  ("float16 (both)", ("float16",), None),
                  ("all cases", DTYPES, None))


def summarize(rows, have_torch=False):
    """Median speed-ups per group and mode, and our fraction of bandwidth on large shapes."""
    targets = ["onednn", "eigen"] + (["torch", "torch_core"] if have_torch else [])
    speedups = []
    for name, dtypes, fmt in SUMMARY_GROUPS:
        sel = [r for r in rows if r["dtype"] in dtypes and (fmt is None or r["format"] == fmt)]
        if not sel:
            continue
        g = {"group": name}
        for t in targets:
            for mode in MODES:
                m, n = _median(r.get("speedup_" + t) for r in sel if r["mode"] == mode)
                g["%s_%s" % (t, mode)] = m
                g["%s_%s_n" % (t, mode)] = n
        speedups.append(g)
    large = [r for r in rows if r["elements"] >= LARGE_ELEMENTS]
    bw_rows = []
    for dtype in DTYPES:
        sel = [r for r in large if r["dtype"] == dtype]
        if not sel:
            continue
        g = {"dtype": dtype}
        for mode in MODES:
            for fmt in FORMATS:
                m, _ = _median(r["bw_fraction"] for r in sel
                               if r["mode"] == mode and r["format"] == fmt)
                g["%s_%s" % (mode, fmt)] = m
        bw_rows.append(g)
    return {"speedups": speedups, "bandwidth_fraction_large": bw_rows,
            "large_elements": LARGE_ELEMENTS}


def format_summary(summary, bandwidth=None, have_torch=False):
    targets = [("onednn", "vs TF oneDNN"), ("eigen", "vs TF Eigen")]
    if have_torch:
        targets += [("torch", "vs PyTorch"), ("torch_core", "PyTorch vs core")]
    out = ["Summary: median speed-up over shapes (their ms / ours ms; >1 = ours faster)"]
    head = "%-17s" % "" + "".join("  %-17s" % t[1] for t in targets)
    sub = "%-17s" % "group" + "".join("  %8s %8s" % ("train", "infer") for _ in targets)
    out += [head, sub]
    for g in summary["speedups"]:
        cells = []
        for t, _ in targets:
            for mode in MODES:
                v = g["%s_%s" % (t, mode)]
                cells.append(_f(v, "%.2fx"))
        out.append("%-17s" % g["group"] + "".join(
            "  %8s %8s" % (cells[2 * i], cells[2 * i + 1]) for i in range(len(targets))))
    if bandwidth:
        out.append("")
        out.append("Memory bandwidth (GB/s, best of %d runs on %d MiB arrays, %d threads): "
                   "numpy copy %.1f, numpy triad %.1f, TF x*s %.1f, TF x*s+y%s %.1f"
                   % (bandwidth.get("repeats", 5), bandwidth["array_mib"], bandwidth["threads"],
                      bandwidth["numpy_copy"], bandwidth["numpy_triad"],
                      bandwidth["tf_scale"], " (XLA)" if bandwidth.get("tf_triad_fused")
                      else "", bandwidth["tf_triad"]))
        out.append("  copy %.1f, triad %.1f -> bandwidth = %.1f GB/s"
                   % (bandwidth["copy"], bandwidth["triad"], bandwidth["bandwidth"]))
    if summary["bandwidth_fraction_large"]:
        out.append("Our effective bandwidth (3 x elements x itemsize / time) as a fraction of "
                   "it, median over large shapes (>= %dM elements):" %
                   (summary["large_elements"] // 1_000_000))
        out.append("%-10s  %9s %9s %9s %9s" % ("dtype", "trainNHWC", "trainNCHW",
                                               "inferNHWC", "inferNCHW"))
        for g in summary["bandwidth_fraction_large"]:
            cells = [_f(g["%s_%s" % (m, f)] and 100 * g["%s_%s" % (m, f)], "%.0f%%")
                     for m in MODES for f in FORMATS]
            out.append("%-10s  %9s %9s %9s %9s" % (g["dtype"], *cells))
    return "\n".join(out)


def _leading_digit(v):
    return int(round(v / 10 ** math.floor(math.log10(v)))) if v > 0 else 0


def _tick_label(v, _=None):
    return "%gx" % v


def plot(rows, path, have_torch=False):
    """Bar chart of speed-ups (log scale), one panel per dtype. Returns an error message
    instead of raising when matplotlib is missing."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        import matplotlib.ticker  # noqa: F401
    except ImportError:
        return ("--plot: matplotlib is not importable in this environment (pip install "
                "matplotlib); no plot written to %s" % path)
    targets = [("speedup_onednn", "vs TF oneDNN"), ("speedup_eigen", "vs TF Eigen")]
    if have_torch:
        targets.append(("speedup_torch", "vs PyTorch"))
    dtypes = [d for d in DTYPES if any(r["dtype"] == d for r in rows)]
    fig, axes = plt.subplots(len(dtypes), 1, figsize=(max(8, 0.42 * len(rows) / max(
        len(dtypes), 1) + 3), 3.6 * len(dtypes)), squeeze=False)
    for ax, dtype in zip(axes[:, 0], dtypes):
        sel = _sorted([r for r in rows if r["dtype"] == dtype])
        xs = np.arange(len(sel))
        w = 0.8 / len(targets)
        for i, (key, name) in enumerate(targets):
            vals = [r[key] if r[key] is not None else np.nan for r in sel]
            ax.bar(xs + (i - (len(targets) - 1) / 2) * w, vals, w, label=name)
            for x, v in zip(xs, vals):
                if np.isnan(v):
                    ax.text(x + (i - (len(targets) - 1) / 2) * w, 1.0, "n/a", rotation=90,
                            ha="center", va="bottom", fontsize=6, color="0.4")
        ax.axhline(1.0, color="k", lw=0.8)
        ax.set_yscale("log")
        ax.yaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(_tick_label))
        ax.yaxis.set_minor_formatter(matplotlib.ticker.FuncFormatter(
            lambda v, _: _tick_label(v) if _leading_digit(v) in (2, 3, 5) else ""))
        ax.tick_params(axis="y", which="minor", labelsize=6)
        ax.set_ylabel("speed-up (their ms / our ms)")
        ax.set_title(dtype)
        ax.set_xticks(xs)
        ax.set_xticklabels(["%s %s %s" % (shape_str(r["tensor_shape"]), r["format"],
                                          _SHORT_MODE[r["mode"]]) for r in sel],
                           rotation=60, ha="right", fontsize=7)
        ax.legend(fontsize=8)
        ax.grid(axis="y", which="both", alpha=0.3)
    fig.suptitle("fbn_grad_tf speed-up over TF FusedBatchNormGradV3%s (>1: ours faster)"
                 % (" and PyTorch" if have_torch else ""), fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return None


# ---- --layer: one whole BN layer training step ------------------------------------------------

#: The --layer contestants, in table order: (key, header, description). Each is one
#: tf.function (PyTorch: eager) running forward + backward of one BN layer on the same x and
#: upstream gradient dy, returning (y, dx, dscale, doffset).
LAYER_COLUMNS = (
    ("ours", "ours", "fbn_grad_tf.fused_batch_norm(forward='ours'): our forward and backward"),
    ("ours_relu", "ours+ReLU", "fbn_grad_tf.fused_batch_norm(forward='ours', "
     "activation='relu'): BN and ReLU fused in our ops"),
    ("tf_ours", "tf+ours", "fbn_grad_tf.fused_batch_norm with TF's FusedBatchNormV3 forward "
     "(forward='tf' where the argument exists) and our backward"),
    ("tf_relu", "TF BN+ReLU", "tf.compat.v1.nn.fused_batch_norm (FusedBatchNormV3) then "
     "tf.nn.relu, TF's gradients"),
    ("tf", "TF fused", "tf.raw_ops.FusedBatchNormV3 and its built-in gradient "
     "(FusedBatchNormGradV3)"),
    ("keras", "Keras", "keras.layers.BatchNormalization(training=True) (Keras 3, plain TF ops; "
     "moving statistics updated)"),
    ("torch", "PyTorch", "torch.nn.functional.batch_norm(training=True) + torch.autograd.grad, "
     "eager; NHWC as channels_last"),
)
LAYER_KEYS = tuple(c[0] for c in LAYER_COLUMNS)
LAYER_HEADERS = {c[0]: c[1] for c in LAYER_COLUMNS}
#: The n/a reason of our forward's columns while fused_batch_norm lacks forward=/activation=.
NEEDS_FORWARD = "needs our forward op"
#: Contestants built on our ops: a mismatch of theirs is a CorrectnessError (fatal), of the
#: others only an n/a.
_LAYER_OURS = ("ours", "ours_relu", "tf_ours")


def ours_forward_support():
    """{"forward": bool, "activation": bool, "op_available": bool or None}: whether this
    build's fbn_grad_tf.fused_batch_norm accepts forward= and activation= (our forward op
    and its fused ReLU) and, where nn.our_forward_available exists, whether our forward op
    can run here ("forward" is False when it cannot: fused_batch_norm(forward="ours") would
    quietly run TF's forward, which is not what the ours columns are for)."""
    import inspect
    from .. import nn
    try:
        params = inspect.signature(nn.fused_batch_norm).parameters
    except (TypeError, ValueError):  # pragma: no cover
        params = {}
    available = getattr(nn, "our_forward_available", None)
    op_available = bool(available()) if callable(available) else None
    return {"forward": "forward" in params and op_available is not False,
            "activation": "activation" in params, "accepts_forward": "forward" in params,
            "op_available": op_available}


def layer_ratio_base(support):
    """(base for every ratio, base for the ReLU pair): 'ours' and 'ours_relu' when our
    forward exists, else 'tf_ours' for both (TF's forward with our backward)."""
    if support["forward"]:
        return "ours", ("ours_relu" if support["activation"] else "ours")
    return "tf_ours", "tf_ours"


def _layer_partner(key, base, relu_base):
    """The contestant whose time divides `key`'s in its x column (None: no x column)."""
    if key in (base, relu_base) or key in ("ours", "ours_relu"):
        return None
    return relu_base if key == "tf_relu" else base


def _grad_step(forward, x, scale, offset, dy):
    """A zero-argument callable: one tf.function with a GradientTape around `forward`
    (x, scale, offset -> y), dy fed as the upstream gradient (no loss ops)."""

    @tf.function(autograph=False)
    def step(x, scale, offset, dy):
        with tf.GradientTape() as tape:
            tape.watch([x, scale, offset])
            y = forward(x, scale, offset)
        dx, dscale, doffset = tape.gradient(y, [x, scale, offset], output_gradients=dy)
        return y, dx, dscale, doffset

    return lambda: step(x, scale, offset, dy)


def _keras_step(x, scale, offset, dy, fmt, dtype, epsilon):
    import keras
    policy = {"float32": "float32", "bfloat16": "mixed_bfloat16",
              "float16": "mixed_float16"}[dtype]
    layer = keras.layers.BatchNormalization(axis=-1 if fmt.endswith("C") else 1,
                                            epsilon=epsilon, dtype=policy)
    layer.build(tuple(x.shape))
    layer.gamma.assign(scale)
    layer.beta.assign(offset)
    weights = [layer.gamma, layer.beta]

    @tf.function(autograph=False)
    def step(x, dy):
        with tf.GradientTape() as tape:
            tape.watch(x)
            y = layer(x, training=True)
        dx, dgamma, dbeta = tape.gradient(y, [x] + weights, output_gradients=dy)
        return y, dx, dgamma, dbeta

    step.layer = layer  # keeps the layer (its variables) alive with the callable
    return lambda: step(x, dy)


def _torch_layer_step(torch, x, scale, offset, dy, fmt, epsilon):
    """F.batch_norm(training=True) forward + autograd backward on the same data (x and dy:
    the NHWC TF tensors; for fmt NHWC an NCHW-shaped channels_last view, for NCHW a
    contiguous copy); running stats updated in place, as torch does. Returns (callable,
    converter of its outputs to NumPy in the TF format's layout)."""
    channels_last = fmt in ("NHWC", "NDHWC")
    xt = _to_torch_layout(torch, x, channels_last).requires_grad_(True)
    dyt = _to_torch_layout(torch, dy, channels_last)
    w = _to_torch(torch, scale).clone().requires_grad_(True)
    b = _to_torch(torch, offset).clone().requires_grad_(True)
    rm = torch.zeros_like(w, requires_grad=False)
    rv = torch.ones_like(w, requires_grad=False)
    bn = torch.nn.functional.batch_norm
    grad = torch.autograd.grad

    def call():
        y = bn(xt, rm, rv, w, b, training=True, momentum=0.1, eps=epsilon)
        dx, dw, db = grad(y, (xt, w, b), grad_outputs=dyt)
        return y, dx, dw, db

    def to_tf_layout(outs):
        y, dx, dw, db = outs
        return (_from_torch_layout(y, channels_last), _from_torch_layout(dx, channels_last),
                dw.float().detach().numpy(), db.float().detach().numpy())

    return call, to_tf_layout


def _layer_callables(x, scale, offset, dy, fmt, dtype, epsilon, support, torch, torch_why,
                     x_nhwc, dy_nhwc):
    """(name -> zero-argument callable for every contestant that can be built, name -> why
    not for the others, name -> converter of its outputs to NumPy in the TF layout). x and dy
    are in `fmt`; x_nhwc/dy_nhwc the same data channels-last, from which PyTorch's tensors
    are made."""
    from .. import nn
    fns, errors = {}, {}
    kw = dict(epsilon=epsilon, data_format=fmt, is_training=True)

    def ours_fwd(**extra):
        def f(x, s, o):
            return nn.fused_batch_norm(x, s, o, **kw, **extra)[0]
        return f

    if support["forward"]:
        fns["ours"] = _grad_step(ours_fwd(forward="ours"), x, scale, offset, dy)
    else:
        errors["ours"] = NEEDS_FORWARD
    if support["forward"] and support["activation"]:
        fns["ours_relu"] = _grad_step(ours_fwd(forward="ours", activation="relu"),
                                      x, scale, offset, dy)
    else:
        errors["ours_relu"] = NEEDS_FORWARD
    fns["tf_ours"] = _grad_step(ours_fwd(**({"forward": "tf"} if support.get(
        "accepts_forward", support["forward"]) else {})),
                                x, scale, offset, dy)

    def tf_relu(x, s, o):
        return tf.nn.relu(tf.compat.v1.nn.fused_batch_norm(x, s, o, **kw)[0])

    fns["tf_relu"] = _grad_step(tf_relu, x, scale, offset, dy)

    def tf_fused(x, s, o):
        empty = tf.zeros([0], tf.float32)
        return tf.raw_ops.FusedBatchNormV3(x=x, scale=s, offset=o, mean=empty,
                                           variance=empty, exponential_avg_factor=1.0,
                                           **kw)[0]

    fns["tf"] = _grad_step(tf_fused, x, scale, offset, dy)
    try:
        fns["keras"] = _keras_step(x, scale, offset, dy, fmt, dtype, epsilon)
    except Exception as e:  # Keras missing or refusing: n/a
        errors["keras"] = "%s: %s" % (type(e).__name__, str(e).split("\n")[0][:200])
    converters = {}
    if torch is not None:
        try:
            fns["torch"], converters["torch"] = _torch_layer_step(
                torch, x_nhwc, scale, offset, dy_nhwc, fmt, epsilon)
        except Exception as e:
            errors["torch"] = "%s: %s" % (type(e).__name__, str(e).split("\n")[0][:200])
    else:
        errors["torch"] = torch_why or "disabled by --no-torch"
    return fns, errors, converters


def _layer_check(name, outs, ref, dtype, case_name, ref_name):
    """_check of a layer step's (y, dx, dscale, doffset)."""
    return _check(name, outs, ref, dtype, case_name, ref_name,
                  keys=("y", "dx", "dscale", "doffset"))


def _relu_check(name, outs, ref, x, dy, scale, epsilon, fmt, dtype, case_name, ref_name):
    """Checks relu(batch_norm(x)) and its gradients. y against relu of the plain reference's
    y; the gradients against TF's FusedBatchNormGradV3 (float32, batch statistics of x) fed
    dy * (y > 0) with the contestant's *own* y: where y is within rounding of 0 the two
    forwards may put an element on different sides of the ReLU, and one such element
    changes dx there by about scale * dy / stddev (tens of percent of max |dx|), so
    comparing the gradients of two contestants directly would fail on large tensors without
    either being wrong. "relu_mask_diff" counts those elements against the reference's y."""
    y = np.asarray(outs[0], np.float32)
    y_ref = np.maximum(np.asarray(ref[0], np.float32), 0)
    axes = [0, 2, 3] if fmt == "NCHW" else [0, 1, 2]
    x32 = tf.cast(x, tf.float32)
    mean, var = tf.nn.moments(x32, axes=axes)
    dy_masked = tf.cast(dy, tf.float32) * tf.cast(y > 0, tf.float32)
    grads = tf.raw_ops.FusedBatchNormGradV3(
        y_backprop=dy_masked, x=x32, scale=scale, reserve_space_1=mean, reserve_space_2=var,
        reserve_space_3=tf.zeros([0], tf.float32), epsilon=epsilon, data_format=fmt,
        is_training=True)
    errs = _layer_check(name, outs, (y_ref,) + tuple(g.numpy() for g in grads[:3]), dtype,
                        case_name, "%s (ReLU: y vs relu(%s's y), gradients vs "
                        "FusedBatchNormGradV3 on dy * (y > 0))" % (ref_name, ref_name))
    errs["relu_mask_diff"] = int(np.count_nonzero((y > 0) != (y_ref > 0)))
    return errs


def _error_text(e):
    if isinstance(e, tf.errors.OpError):
        return short_error(e)
    return "%s: %s" % (type(e).__name__, str(e).split("\n")[0][:200])


def _run_layer_case(config, shape, dtype, fmt, support, torch, torch_why, case_name):
    eps = float(config.epsilon)
    inputs = _make_inputs(shape, dtype, config.seed)
    c = shape[-1]
    x, dy = x_nhwc, dy_nhwc = inputs["x"], inputs["dy"]
    if fmt == "NCHW":
        x, dy = tf.transpose(x, [0, 3, 1, 2]), tf.transpose(dy, [0, 3, 1, 2])
    scale = inputs["scale"]
    offset = tf.random.stateless_uniform([c], [config.seed, 8], -0.5, 0.5)
    inputs = None
    fns, errors, converters = _layer_callables(x, scale, offset, dy, fmt, dtype, eps, support,
                                               torch, torch_why, x_nhwc, dy_nhwc)
    x_nhwc = dy_nhwc = None
    entry = {"shape": list(shape), "tensor_shape": list(tensor_shape(shape, fmt)),
             "format": fmt, "dtype": dtype, "elements": math.prod(shape)}

    # -- run each once (traces it) and check its outputs: plain BN against TF fused (or the
    # first plain one that ran), the ReLU ones against TF BN+ReLU (unchecked: not timed).
    outs = {}
    for k in list(fns):
        try:
            o = fns[k]()
            outs[k] = converters[k](o) if k in converters else tuple(t.numpy() for t in o)
        except Exception as e:  # refused (dtype, format, a missing kernel): n/a
            errors[k] = _error_text(e)
            del fns[k]
            if k in _LAYER_OURS and not isinstance(e, (tf.errors.OpError, NotImplementedError,
                                                       ValueError, TypeError)):
                raise
    check = {}
    plain = [k for k in ("tf", "tf_ours", "keras", "torch", "ours") if k in outs]
    if not plain:
        raise RuntimeError("--layer: no contestant ran on %s: %s" % (case_name, errors))
    ref_key = plain[0]
    ref = outs[ref_key]
    check["reference"] = LAYER_HEADERS[ref_key]
    check["reference_relu"] = ("y: relu(%s's y); gradients: TF FusedBatchNormGradV3 in "
                               "float32 on dy * (y > 0) with its own y" % LAYER_HEADERS[ref_key])
    for k in list(fns):
        if k == ref_key:
            continue
        try:
            if k in ("ours_relu", "tf_relu"):
                check[k] = _relu_check(LAYER_HEADERS[k], outs[k], ref, x, dy, scale, eps, fmt,
                                       dtype, case_name, LAYER_HEADERS[ref_key])
            else:
                check[k] = _layer_check(LAYER_HEADERS[k], outs[k], ref, dtype, case_name,
                                        LAYER_HEADERS[ref_key])
        except CorrectnessError as e:
            if k in _LAYER_OURS:
                raise
            errors[k] = "outputs differ: %s" % e
            print("warning: %s %s" % (LAYER_HEADERS[k], errors[k]), file=sys.stderr)
            del fns[k]
    outs = ref = None

    # -- warm up, repetitions from the budget, interleaved timing (as the backward cases).
    reps, samples = warm_up_and_time(fns, config)
    entry["reps"] = reps
    entry["check"] = check
    for k in LAYER_KEYS:
        entry[k] = _stats(samples[k]) if k in samples else {"error": errors.get(k, "not run")}
    return entry


def run_layer(config=None, label="layer", stream=None):
    """--layer: times one BN layer training step (forward + backward) per case of `config`
    (shapes x dtypes x formats; training only) for every LAYER_COLUMNS contestant, in this
    process. Returns {"meta": {...}, "results": [case, ...]}; each case has shape,
    tensor_shape, format, dtype, elements, reps, check and, per contestant key, either
    {"median_ms", "min_ms", "mean_ms", "samples_ms"} or {"error": why n/a}."""
    config = config or Config(dtypes=("float32",), formats=("NHWC",))
    threads = configure_threads(config.threads)
    torch, torch_note, torch_why = _setup_torch(config, threads)
    support = ours_forward_support()
    base, relu_base = layer_ratio_base(support)
    meta = {"mode": "layer", "tf_version": tf.__version__,
            "tf_backend": backend_name(onednn_enabled()), "intra_op_threads": threads,
            "torch": torch_note, "torch_why": torch_why, "ours_forward": support,
            "ratio_base": base, "ratio_base_relu": relu_base,
            "columns": {k: d for k, _, d in LAYER_COLUMNS}, "config": config.to_json()}
    cases = [(tuple(s), d, f) for s in config.shapes for d in config.dtypes
             for f in config.formats]
    progress = Progress(label, [math.prod(c[0]) for c in cases], stream=stream,
                        enabled=config.progress)
    results = []
    logger = tf.get_logger()
    old_level = logger.level
    logger.setLevel("ERROR")
    try:
        for shape, dtype, fmt in cases:
            case_name = "%s %s %s layer step" % (shape_str(tensor_shape(shape, fmt)), fmt, dtype)
            progress.start(case_name)
            results.append(_run_layer_case(config, shape, dtype, fmt, support, torch,
                                           torch_why, case_name))
            progress.finish(math.prod(shape))
    finally:
        logger.setLevel(old_level)
        progress.close()
    return {"meta": meta, "results": results}


def merge_layer(res):
    """Flattened --layer rows: <key>_ms and <key>_error per contestant, x_<key> (its ms / its
    partner's ms: >1 = ours faster) and the partner's key in partner_<key>."""
    base, relu_base = res["meta"]["ratio_base"], res["meta"]["ratio_base_relu"]
    rows = []
    for r in res["results"]:
        row = {k: r[k] for k in ("shape", "tensor_shape", "format", "dtype", "elements",
                                 "reps", "check")}
        for k in LAYER_KEYS:
            row[k + "_ms"] = _ms(r.get(k))
            row[k + "_error"] = (r.get(k) or {}).get("error")
        for k in LAYER_KEYS:
            p = _layer_partner(k, base, relu_base)
            if p is not None:
                row["partner_" + k] = p
                row["x_" + k] = _ratio(row[k + "_ms"], row[p + "_ms"])
        row["raw"] = r
        rows.append(row)
    return rows


def format_layer_table(rows, meta):
    base, relu_base = meta["ratio_base"], meta["ratio_base_relu"]
    cols = [("shape", "<", 15), ("fmt", "<", 4), ("dtype", "<", 8)]
    keys = []
    for k in LAYER_KEYS:
        cols.append((LAYER_HEADERS[k], ">", max(9, len(LAYER_HEADERS[k]))))
        keys.append((k, "ms"))
        if _layer_partner(k, base, relu_base) is not None:
            cols.append(("x", ">", 6))
            keys.append((k, "x"))
    cols.append(("reps", ">", 4))

    def line(vals):
        return "  ".join(("{:%s%d}" % (a, w)).format(v) for (_, a, w), v in zip(cols, vals))

    out = [line([c[0] for c in cols]), line(["-" * c[2] for c in cols])]
    for r in sorted(rows, key=lambda r: (DTYPES.index(r["dtype"]), FORMATS.index(r["format"]))):
        vals = [shape_str(r["tensor_shape"]), r["format"], r["dtype"]]
        for k, what in keys:
            vals.append(_f(r[k + "_ms"], "%.3f") if what == "ms" else _f(r["x_" + k], "%.2fx"))
        vals.append(str(r["reps"]))
        out.append(line(vals))
    return "\n".join(out)


def summarize_layer(rows, meta):
    """Median x per (dtype, format) group and contestant over shapes."""
    base, relu_base = meta["ratio_base"], meta["ratio_base_relu"]
    groups = []
    for dtype in DTYPES:
        for fmt in FORMATS:
            sel = [r for r in rows if r["dtype"] == dtype and r["format"] == fmt]
            if not sel:
                continue
            g = {"dtype": dtype, "format": fmt}
            for k in LAYER_KEYS:
                if _layer_partner(k, base, relu_base) is not None:
                    g[k], g[k + "_n"] = _median(r["x_" + k] for r in sel)
            groups.append(g)
    return {"speedups": groups}


def format_layer_summary(summary, meta):
    base, relu_base = meta["ratio_base"], meta["ratio_base_relu"]
    keys = [k for k in LAYER_KEYS if _layer_partner(k, base, relu_base) is not None]
    out = ["Summary: median over shapes of their ms / %s ms (%s: / %s ms); >1 = ours faster"
           % (LAYER_HEADERS[base], LAYER_HEADERS["tf_relu"], LAYER_HEADERS[relu_base])]
    out.append("%-16s" % "group" + "".join("  %10s" % LAYER_HEADERS[k] for k in keys))
    for g in summary["speedups"]:
        out.append("%-16s" % ("%s %s" % (g["dtype"], g["format"])) +
                   "".join("  %10s" % _f(g[k], "%.2fx") for k in keys))
    return "\n".join(out)


def layer_notes(rows):
    """Sorted 'header: n/a (why)' lines, one per contestant and distinct reason."""
    notes = []
    for k in LAYER_KEYS:
        for why in sorted({r[k + "_error"] for r in rows if r[k + "_error"]}):
            notes.append("%s: n/a (%s)" % (LAYER_HEADERS[k], why))
    return notes


def main_layer(args, config):
    """The --layer command: prints the header, table, summary and n/a reasons; --json."""
    t0 = time.perf_counter()
    load_start = _loadavg()
    if load_start is not None and load_start > 0.75 * (os.cpu_count() or 1):
        print("warning: load average %.1f on %d cores: other work is running, the times will "
              "be noisy (see `ps aux`)" % (load_start, os.cpu_count() or 1), file=sys.stderr)
    threads = configure_threads(config.threads)
    res = run_layer(config)
    rows = merge_layer(res)
    summary = summarize_layer(rows, res["meta"])
    elapsed = time.perf_counter() - t0
    meta = _machine_meta()
    meta.update(res["meta"])
    meta.update({"intra_op_threads": threads, "elapsed_s": round(elapsed, 1),
                 "loadavg_1min_start": load_start, "loadavg_1min_end": _loadavg()})
    base, relu_base = meta["ratio_base"], meta["ratio_base_relu"]
    print("fbn_grad_tf benchmark --layer: %s, %d cores, TF %s (%s), %d intra-op threads, %s; "
          "ISA %s" % (meta["cpu"], meta["cores"], tf.__version__, meta["tf_backend"], threads,
                      meta["torch"], meta["fbn_grad_tf_isa"]))
    if load_start is not None:
        print("load average (1 min) at start %.2f, at end %.2f on %d cores"
              % (load_start, meta["loadavg_1min_end"], meta["cores"]))
    print("times: median ms of one BN training step (forward + backward, upstream gradient "
          "dy fed in) over `reps` interleaved calls; epsilon %g" % config.epsilon)
    for k, h, d in LAYER_COLUMNS:
        print("  %-10s = %s" % (h, d))
    print("x = that column's ms / %s ms (%s: / %s ms) from the same process; >1: ours faster"
          % (LAYER_HEADERS[base], LAYER_HEADERS["tf_relu"], LAYER_HEADERS[relu_base]))
    if base != "ours":
        print("  (ours, ours+ReLU: n/a (%s): this fbn_grad_tf.fused_batch_norm %s, so the "
              "ratios are against tf+ours)" % (
                  NEEDS_FORWARD, "cannot run our forward op here (nn.our_forward_available())"
                  if meta["ours_forward"].get("accepts_forward") else "has no forward= argument"))
    print()
    print(format_layer_table(rows, meta))
    print()
    print(format_layer_summary(summary, meta))
    notes = layer_notes(rows)
    if notes:
        print()
        print("n/a (refused, not built or not installed):")
        for n in notes:
            print("  " + n)
    print()
    print("elapsed %s" % _fmt_duration(elapsed))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"meta": meta, "summary": summary, "results": rows}, f, indent=1)
    if args.plot:
        print("--plot: not drawn in --layer mode", file=sys.stderr)
    return 0


# ---- command line ---------------------------------------------------------------------------

def _split(text, allowed, what):
    vals = tuple(v.strip() for v in text.split(",") if v.strip())
    aliases = {"bf16": "bfloat16", "f16": "float16", "half": "float16", "f32": "float32",
               "train": "training", "infer": "inference", "nhwc": "NHWC", "nchw": "NCHW"}
    vals = tuple(aliases.get(v, aliases.get(v.lower(), v)) for v in vals)
    bad = [v for v in vals if v not in allowed]
    if bad or not vals:
        raise argparse.ArgumentTypeError("%s must be a comma list of %s, got %r"
                                         % (what, ", ".join(allowed), text))
    return vals


def build_parser():
    p = argparse.ArgumentParser(
        prog="python -m fbn_grad_tf.bench",
        description="Times fbn_grad_tf's FusedBatchNormGradV3 against TF's built-in op "
                    "(oneDNN and Eigen kernels) and, when importable, PyTorch's; with --layer, "
                    "a whole BN layer training step against TF, Keras and PyTorch.")
    p.add_argument("--quick", action="store_true",
                   help="~1 minute subset: 2 shapes, float32+bfloat16, fewer reps")
    p.add_argument("--shapes", type=lambda s: tuple(parse_shape(t) for t in s.split(",")),
                   help="comma list of NHWC shapes, e.g. 32x56x56x256,256x1x1x4096")
    p.add_argument("--dtypes", type=lambda s: _split(s, DTYPES, "--dtypes"))
    p.add_argument("--formats", type=lambda s: _split(s, FORMATS, "--formats"))
    p.add_argument("--modes", type=lambda s: _split(s, MODES, "--modes"))
    p.add_argument("--reps", type=int, help="fixed repetitions per case (default: "
                   "time-budgeted, see --budget)")
    p.add_argument("--budget", type=float, help="seconds of the slowest contestant per "
                   "case (default 1.5; --quick 0.3), within --min-reps..--max-reps")
    p.add_argument("--min-reps", type=int)
    p.add_argument("--max-reps", type=int)
    p.add_argument("--threads", type=int, help="TF intra-op threads (and torch threads, "
                   "and NumPy bandwidth threads); default: TF's default (all cores)")
    p.add_argument("--json", metavar="FILE", help="write machine-readable results")
    p.add_argument("--plot", metavar="FILE.png", help="bar chart of speed-ups (matplotlib)")
    p.add_argument("--bandwidth-mib", type=int, default=256, metavar="MIB",
                   help="array size for the bandwidth measurement (default 256 MiB)")
    p.add_argument("--eigen-bfc", action="store_true",
                   help="run the Eigen worker with TF_CPU_ALLOCATOR_USE_BFC=true (a pooled "
                        "allocator, as TF uses with oneDNN on) instead of TF's default malloc; "
                        "compares kernels without the page faults of fresh outputs")
    p.add_argument("--no-eigen", action="store_true",
                   help="skip the second TF backend (the worker subprocess)")
    p.add_argument("--no-torch", action="store_true", help="skip PyTorch even if importable")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--layer", action="store_true",
                   help="time one whole BN layer training step (forward + backward) instead: "
                        "ours, ours+ReLU, TF's forward with our backward, TF BN+ReLU, TF fused, "
                        "Keras 3 BatchNormalization, PyTorch; float32 NHWC unless --dtypes/"
                        "--formats say otherwise (--modes does not apply: training only)")
    p.add_argument("--_worker", choices=("eigen", "onednn"), help=argparse.SUPPRESS)
    p.add_argument("--_config", help=argparse.SUPPRESS)
    return p


def config_from_args(args):
    if args._config:
        return Config.from_json(json.loads(args._config))
    cfg = quick_config() if args.quick else Config()
    if getattr(args, "layer", False):  # one dtype and format unless asked for more
        cfg.dtypes, cfg.formats, cfg.modes = ("float32",), ("NHWC",), ("training",)
    for field, val in (("shapes", args.shapes), ("dtypes", args.dtypes),
                       ("formats", args.formats),
                       ("modes", None if getattr(args, "layer", False) else args.modes),
                       ("reps", args.reps), ("budget_s", args.budget),
                       ("min_reps", args.min_reps), ("max_reps", args.max_reps),
                       ("threads", args.threads)):
        if val is not None:
            setattr(cfg, field, val)
    if args.no_torch:
        cfg.torch = False
    if args.eigen_bfc:
        cfg.eigen_bfc = True
    if args.no_progress:
        cfg.progress = False
    return cfg


def torch_header_note(meta, threads):
    """The line above the table that says what the PyTorch columns are, or why they are n/a."""
    why = meta.get("torch_why")
    core = ("core ms = our kernels called through fbn_grad_tf.core.bn_grad on NumPy copies of "
            "the same tensors (a direct call from Python, no TF graph dispatch)")
    if why:
        return "%s\ntorch ms, x, xc, t%%BW: n/a (%s)%s" % (
            core, why, "; %s" % TORCH_INSTALL_HINT if why == TORCH_MISSING else "")
    return ("%s\ntorch ms = torch.ops.aten.native_batch_norm_backward, eager, %s; NHWC as "
            "channels_last, NCHW contiguous, converted once; x = torch ms / ours ms (our TF op, "
            "which pays TF's graph dispatch); xc = torch ms / core ms (kernel against kernel, "
            "neither pays a graph runtime); t%%BW = PyTorch's effective bandwidth / the same "
            "bandwidth" % (core, meta.get("torch")))


def run_worker_subprocess(backend, config, timeout=None):
    """Runs this module again with TF's other backend (the env var is read at TF start-up);
    its progress goes to our stderr. Returns its run() result."""
    env = dict(os.environ)
    env["TF_ENABLE_ONEDNN_OPTS"] = "0" if backend == "eigen" else "1"
    if backend == "eigen" and config.eigen_bfc:
        # With oneDNN on, TF allocates on the CPU from a pool; with it off, from malloc, so
        # every large output is fresh pages from the OS (page faults) on every call.
        env["TF_CPU_ALLOCATOR_USE_BFC"] = "true"
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    # python/ (the directory above the fbn_grad_tf package): bench/ -> fbn_grad_tf/ -> python/
    pkg_parent = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env["PYTHONPATH"] = os.pathsep.join([pkg_parent] + [
        p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    wcfg = dataclasses.replace(config, torch=False)
    fd, path = tempfile.mkstemp(prefix="fbn_bench_%s_" % backend, suffix=".json")
    os.close(fd)
    try:
        cmd = [sys.executable, "-m", "fbn_grad_tf.bench", "--_worker", backend,
               "--_config", json.dumps(wcfg.to_json()), "--json", path]
        try:  # the worker's output goes to our stderr, live where it has a file descriptor
            sys.stderr.flush()
            proc = subprocess.run(cmd, env=env, stdout=sys.stderr.fileno(), timeout=timeout)
        except (AttributeError, ValueError, OSError):  # stderr is not a file (e.g. captured)
            proc = subprocess.run(cmd, env=env, stdout=subprocess.PIPE,
                                  stderr=subprocess.STDOUT, timeout=timeout)
            sys.stderr.write(proc.stdout.decode(errors="replace"))
        if proc.returncode != 0:
            raise RuntimeError("the %s worker (TF_ENABLE_ONEDNN_OPTS=%s) failed with exit "
                               "code %d (see its messages above)"
                               % (backend, env["TF_ENABLE_ONEDNN_OPTS"], proc.returncode))
        with open(path) as f:
            res = json.load(f)
        if res["meta"]["tf_backend"] != backend:
            raise RuntimeError("the %s worker ran with TF backend %s"
                               % (backend, res["meta"]["tf_backend"]))
        return res
    finally:
        os.unlink(path)


def _loadavg():
    try:
        return round(os.getloadavg()[0], 2)
    except (OSError, AttributeError):
        return None


def _machine_meta():
    from .. import _build_info
    meta = {"date": datetime.datetime.now().isoformat(timespec="seconds"),
            "cpu": _cpu_model(), "cores": os.cpu_count(),
            "python": platform.python_version(), "numpy": np.__version__,
            "tf_version": tf.__version__,
            "fbn_grad_tf_build": {k: getattr(_build_info, k) for k in dir(_build_info)
                                  if k.isupper()}}
    try:
        from .. import core
        meta["fbn_grad_tf_isa"] = core.default_isa() if callable(core.default_isa) \
            else core.default_isa
    except Exception as e:  # pragma: no cover
        meta["fbn_grad_tf_isa"] = "unknown (%s)" % e
    return meta


def main(argv=None):
    args = build_parser().parse_args(argv)
    config = config_from_args(args)
    if args._worker:
        res = run(config, label=args._worker)
        with open(args.json, "w") as f:
            json.dump(res, f)
        return 0
    if args.layer:
        return main_layer(args, config)

    t0 = time.perf_counter()
    load_start = _loadavg()
    if load_start is not None and load_start > 0.75 * (os.cpu_count() or 1):
        print("warning: load average %.1f on %d cores: other work is running, the times will "
              "be noisy (see `ps aux`)" % (load_start, os.cpu_count() or 1), file=sys.stderr)
    threads = configure_threads(config.threads)
    main_backend = backend_name(onednn_enabled())
    if main_backend != "onednn":
        print("note: oneDNN is off in this process (TF_ENABLE_ONEDNN_OPTS=%s); its TF times "
              "go to the Eigen column and a worker measures oneDNN"
              % os.environ.get("TF_ENABLE_ONEDNN_OPTS"), file=sys.stderr)
    if config.progress:
        print("measuring memory bandwidth ...", file=sys.stderr, flush=True)
    bandwidth = measure_bandwidth(threads, mib=args.bandwidth_mib)
    main_res = run(config)
    other_res, other_error = None, None
    if not args.no_eigen:
        other = "eigen" if main_backend == "onednn" else "onednn"
        try:
            other_res = run_worker_subprocess(other, config)
        except (RuntimeError, OSError, ValueError, KeyError) as e:
            other_error = str(e)
    rows = merge(main_res, other_res, bandwidth)
    have_torch = any(r["torch_ms"] is not None or r["torch_error"] for r in rows)
    summary = summarize(rows, have_torch)
    elapsed = time.perf_counter() - t0

    meta = _machine_meta()
    meta.update({"tf_backend_main": main_backend, "intra_op_threads": threads,
                 "torch": main_res["meta"]["torch"], "config": config.to_json(),
                 "elapsed_s": round(elapsed, 1), "other_backend_error": other_error,
                 "loadavg_1min_start": load_start, "loadavg_1min_end": _loadavg()})
    print("fbn_grad_tf benchmark: %s, %d cores, TF %s (main process: %s), %d intra-op threads, "
          "%s; ISA %s" % (meta["cpu"], meta["cores"], tf.__version__, main_backend, threads,
                          meta["torch"], meta["fbn_grad_tf_isa"]))
    if load_start is not None:
        print("load average (1 min) at start %.2f, at end %.2f on %d cores"
              % (load_start, meta["loadavg_1min_end"], meta["cores"]))
    print("times: median ms over `reps` interleaved calls each (inside tf.function); "
          "x = their ms / ours ms from the same process (>1: ours faster)")
    print("GB/s = 3 x elements x itemsize / ours (read dy and x, write dx); "
          "%%BW = that / %.1f GB/s (this run's bandwidth, below)" % bandwidth["bandwidth"])
    if other_res is not None and main_backend == "onednn":
        print("ours(E) = ours timed in the Eigen worker process (TF_ENABLE_ONEDNN_OPTS=0%s), "
              "interleaved with TF-Eigen; TF-Eigen's x is against it" %
              (", TF_CPU_ALLOCATOR_USE_BFC=true" if config.eigen_bfc else ""))
        if not config.eigen_bfc:
            print("  (with oneDNN off TF allocates from malloc, so large outputs are fresh pages "
                  "on every call, for ours(E) and TF-Eigen alike; --eigen-bfc pools them)")
    if have_torch:
        print(torch_header_note(main_res["meta"], threads))
    print()
    print(format_table(rows, have_torch))
    print()
    print(format_summary(summary, bandwidth, have_torch))
    notes = sorted({"%s: %s" % (b, r["tf_%s_error" % b]) for r in rows for b in ("onednn", "eigen")
                    if r["tf_%s_ms" % b] is None and r["tf_%s_error" % b]})
    tnotes = sorted({r["torch_error"] for r in rows if r["torch_error"]}) if have_torch else []
    if notes or tnotes:
        print()
        print("n/a (refused, not run or not installed):")
        for n in notes + ["torch: " + n for n in tnotes]:
            print("  " + n)
    print()
    print("elapsed %s" % _fmt_duration(elapsed))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"meta": meta, "bandwidth": bandwidth, "summary": summary,
                       "results": rows}, f, indent=1)
    if args.plot:
        msg = plot(rows, args.plot, have_torch)
        print(msg if msg else "plot written to %s" % args.plot, file=sys.stderr)
    if other_error:
        print("error: %s" % other_error, file=sys.stderr)
        return 1
    return 0
