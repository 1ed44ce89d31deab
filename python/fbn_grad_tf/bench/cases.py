"""The benchmark's cases: the default grid and Config, shape helpers, the synthetic inputs,
the float64 NumPy reference and the correctness checks run before any timing."""
import argparse
import dataclasses
import re
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
#: Mid-size and up (ResNet-50's 32x14x14x1024 has 6.4M): the --chain bandwidth summary.
MID_ELEMENTS = 2_000_000
#: Most links of a --chain: each link multiplies x_backprop by about scale * inv (up to ~3
#: with the bench's inputs), so float16 would reach inf from about 9 links on.
MAX_CHAIN = 8

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
    chain: int = 0                  # >0: also each op K times in a row in one tf.function

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


# ---- inputs ------------------------------------------------------------------------------

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


def op_args(inputs, fmt, mode):
    """The backward's arguments (dy, x, scale, reserve_space_1, reserve_space_2,
    reserve_space_3) of one case from _make_inputs' tensors: dy and x in `fmt` (transposed
    once per format, kept in `inputs`), the batch statistics in training, the perturbed
    population ones in inference."""
    if fmt not in inputs:
        inputs[fmt] = ((inputs["dy"], inputs["x"]) if fmt == "NHWC" else
                       tuple(tf.transpose(inputs[k], [0, 3, 1, 2]) for k in ("dy", "x")))
    rs1, rs2 = inputs[mode]
    return inputs[fmt] + (inputs["scale"], rs1, rs2, inputs["rs3"])


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


# ---- the grid's cases; the --layer checks --------------------------------------------------

def _cases(config):
    for shape in config.shapes:
        for dtype in config.dtypes:
            for fmt in config.formats:
                for mode in config.modes:
                    yield tuple(shape), dtype, fmt, mode


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
