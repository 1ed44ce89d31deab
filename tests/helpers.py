"""Shared reference code for the fbn_grad_tf test suite.

Nothing here imports TensorFlow at module level, so the TF-free core tests can use it too;
the functions that need TF import it lazily.

Conventions
-----------
* A test *case* is described format-agnostically by ``Case(name, n, spatial2d, spatial3d, c)``
  and turned into a concrete shape with :func:`make_shape`.
* Arrays of the 16-bit types are NumPy ``float16`` and ``ml_dtypes.bfloat16``; ``scale`` and
  the reserve spaces are always ``float32`` (as in FusedBatchNormGradV3).
* :func:`reference_float64` is the exact math of SPEC.md section 2, evaluated in float64 on
  the (already quantized) inputs: it is the "true" answer for those inputs.
"""
import collections
import os
import time

import ml_dtypes
import numpy as np

FORMATS = ("NHWC", "NCHW", "NDHWC", "NCDHW")
DTYPES = ("float32", "float16", "bfloat16")
NP_DTYPES = {"float32": np.float32, "float16": np.float16, "bfloat16": ml_dtypes.bfloat16}
EPSILON = 1e-4


def np_dtype(dtype):
    return NP_DTYPES[dtype] if isinstance(dtype, str) else dtype


def dtype_name(dtype):
    return np.dtype(np_dtype(dtype)).name


def rank_of(fmt):
    return 5 if fmt in ("NDHWC", "NCDHW") else 4


def channels_first(fmt):
    return fmt in ("NCHW", "NCDHW")


def channel_axis(fmt):
    return 1 if channels_first(fmt) else rank_of(fmt) - 1


def reduce_axes(fmt):
    return tuple(a for a in range(rank_of(fmt)) if a != channel_axis(fmt))


Case = collections.namedtuple("Case", ["name", "n", "spatial2d", "spatial3d", "c"])


def make_shape(case, fmt):
    spatial = case.spatial3d if rank_of(fmt) == 5 else case.spatial2d
    if channels_first(fmt):
        return (case.n, case.c) + tuple(spatial)
    return (case.n,) + tuple(spatial) + (case.c,)


def to_channels_last(a, fmt):
    """Transposes a channels-first array to the matching channels-last layout."""
    if not channels_first(fmt):
        return a
    r = a.ndim
    return np.transpose(a, (0,) + tuple(range(2, r)) + (1,))


def to_channels_first(a):
    r = a.ndim
    return np.transpose(a, (0, r - 1) + tuple(range(1, r - 1)))


def channels_last_format(fmt):
    return {"NCHW": "NHWC", "NCDHW": "NDHWC"}.get(fmt, fmt)


# ---- inputs ---------------------------------------------------------------------------------

Inputs = collections.namedtuple("Inputs", ["dy", "x", "scale", "rs1", "rs2", "rs3"])


def batch_stats(x, fmt):
    """Biased batch mean and variance per channel, float64 math rounded to float32 (what a
    CPU forward in training mode saves in reserve_space_1/2)."""
    x64 = np.asarray(x, np.float64)
    axes = reduce_axes(fmt)
    c = x.shape[channel_axis(fmt)]
    if x64.size == 0:
        return np.zeros(c, np.float32), np.ones(c, np.float32)
    return (x64.mean(axis=axes).astype(np.float32), x64.var(axis=axes).astype(np.float32))


def tf_forward_stats(x, fmt, epsilon=EPSILON):
    """reserve_space_1/2 of TF's own forward (tf.raw_ops.FusedBatchNormV3, training) on CPU:
    the batch mean and the biased batch variance."""
    import tensorflow as tf
    c = x.shape[channel_axis(fmt)]
    with tf.device("/CPU:0"):
        out = tf.raw_ops.FusedBatchNormV3(
            x=tf.constant(x), scale=tf.ones([c]), offset=tf.zeros([c]), mean=tf.zeros([0]),
            variance=tf.zeros([0]), epsilon=epsilon, data_format=fmt, is_training=True)
    return out.reserve_space_1.numpy(), out.reserve_space_2.numpy()


def make_inputs(shape, fmt, dtype="float32", training=True, seed=0, stats="numpy",
                mean_offset=0.0, x_scale=1.0, rs3_shape=(0,)):
    """Random inputs of FusedBatchNormGradV3.

    training: rs1/rs2 are the batch statistics of x (stats="numpy": float64 math;
    stats="tf": TF's own forward op). Inference: random population statistics near (but not
    equal to) the batch statistics, with variances in [0.5, 2).
    """
    dt = np_dtype(dtype)
    rng = np.random.default_rng(seed)
    c = shape[channel_axis(fmt)]
    x = (mean_offset + x_scale * rng.standard_normal(shape)).astype(np.float32).astype(dt)
    dy = rng.standard_normal(shape).astype(np.float32).astype(dt)
    scale = rng.uniform(0.5, 1.5, c).astype(np.float32)
    if training and stats == "tf" and x.size:
        rs1, rs2 = tf_forward_stats(x, fmt)
    elif training:
        rs1, rs2 = batch_stats(x, fmt)
    else:
        rs1 = (mean_offset + 0.3 * rng.standard_normal(c)).astype(np.float32)
        rs2 = (x_scale ** 2 * rng.uniform(0.5, 2.0, c)).astype(np.float32)
    rs3 = np.zeros(rs3_shape, np.float32)
    return Inputs(dy, x, scale, rs1, rs2, rs3)


# ---- references -----------------------------------------------------------------------------

def reference_float64(dy, x, scale, rs1, rs2, epsilon=EPSILON, data_format="NHWC",
                      is_training=True, saved_stat="variance"):
    """FusedBatchNormGradV3 in float64 (SPEC.md section 2). Returns (dx, dscale, doffset)."""
    r = rank_of(data_format)
    ax = channel_axis(data_format)
    axes = reduce_axes(data_format)
    bshape = [1] * r
    bshape[ax] = -1
    dy = np.asarray(dy, np.float64)
    x = np.asarray(x, np.float64)
    gamma = np.asarray(scale, np.float64).reshape(bshape)
    mu = np.asarray(rs1, np.float64).reshape(bshape)
    s = np.asarray(rs2, np.float64).reshape(bshape)
    if is_training and saved_stat == "inv_std":
        inv = s
    else:
        inv = 1.0 / np.sqrt(s + np.float64(np.float32(epsilon)))
    xc = x - mu
    sum_dy = dy.sum(axis=axes, keepdims=True)
    sum_dyxc = (dy * xc).sum(axis=axes, keepdims=True)
    doffset = sum_dy.reshape(-1)
    dscale = (inv * sum_dyxc).reshape(-1)
    if is_training:
        m = max(x.size // max(x.shape[ax], 1), 1)
        dx = gamma * inv * (dy - sum_dy / m - xc * inv * inv * sum_dyxc / m)
    else:
        dx = dy * gamma * inv
    return dx, dscale, doffset


def error_scales(inputs, data_format, epsilon=EPSILON, is_training=True):
    """Per-output magnitudes the rounding errors are measured against (float64):
    dx: max |dx_ref|; dscale: inv * sum |dy * (x - mean)| per channel; doffset: sum |dy|
    per channel. Sums of absolute terms bound what float32 summation can get wrong, and do
    not vanish when a sum cancels."""
    axes = reduce_axes(data_format)
    bshape = [1] * rank_of(data_format)
    bshape[channel_axis(data_format)] = -1
    dy = np.asarray(inputs.dy, np.float64)
    xc = np.asarray(inputs.x, np.float64) - np.asarray(inputs.rs1, np.float64).reshape(bshape)
    inv = 1.0 / np.sqrt(np.asarray(inputs.rs2, np.float64) + np.float32(epsilon))
    return (np.abs(dy * xc).sum(axis=axes) * inv, np.abs(dy).sum(axis=axes))


def tf_reference(inputs, epsilon=EPSILON, data_format="NHWC", is_training=True):
    """tf.raw_ops.FusedBatchNormGradV3 on CPU -> (dx, dscale, doffset) as NumPy arrays.

    TF's CPU kernels refuse some channels-first inference cases ("only support NHWC"); those
    run on the transposed (channels-last) tensors and dx is transposed back."""
    import tensorflow as tf

    def run(dy, x, fmt):
        with tf.device("/CPU:0"):
            out = tf.raw_ops.FusedBatchNormGradV3(
                y_backprop=tf.constant(dy), x=tf.constant(x), scale=tf.constant(inputs.scale),
                reserve_space_1=tf.constant(inputs.rs1), reserve_space_2=tf.constant(inputs.rs2),
                reserve_space_3=tf.constant(inputs.rs3), epsilon=epsilon, data_format=fmt,
                is_training=is_training)
        dx = out[0].numpy()
        if dx.size == 0 and dx.shape != x.shape:
            # TF quirk: for an empty 5-D input TF returns x_backprop in its internal 4-D view
            # ([N, D, H*W, C] / [N, C, D, H*W]): it returns before reshaping back.
            dx = dx.reshape(x.shape)
        return dx, out[1].numpy(), out[2].numpy()

    try:
        return run(inputs.dy, inputs.x, data_format)
    except tf.errors.InvalidArgumentError as e:
        if is_training or not channels_first(data_format) or "NHWC" not in str(e):
            raise
    dx, dscale, doffset = run(to_channels_last(inputs.dy, data_format),
                              to_channels_last(inputs.x, data_format),
                              channels_last_format(data_format))
    return np.ascontiguousarray(to_channels_first(dx)), dscale, doffset


def run_ours(inputs, epsilon=EPSILON, data_format="NHWC", is_training=True):
    """Our op through the public functional API -> all 5 outputs as NumPy arrays."""
    import fbn_grad_tf
    out = fbn_grad_tf.fused_batch_norm_grad(*inputs, epsilon=epsilon, data_format=data_format,
                                            is_training=is_training)
    return tuple(t.numpy() for t in out)


def run_core(inputs, epsilon=EPSILON, data_format="NHWC", is_training=True, **kw):
    from fbn_grad_tf import core
    return core.bn_grad(inputs.dy, inputs.x, inputs.scale, inputs.rs1, inputs.rs2, epsilon,
                        data_format, is_training, **kw)


# ---- tolerances and comparisons -------------------------------------------------------------

# |actual - expected| <= rtol * |expected| + atol * scale, where scale is max |dx_ref| for
# x_backprop and the per-channel sum of absolute terms (error_scales) for the two vectors.
#   vs_tf:  our op against TF's op (both compute in float32 from the same inputs; dx of the
#           16-bit types may differ by one rounding of the output: rtol = 2 ulps).
#   vs_f64: our op against the float64 reference (16-bit dx: the one final rounding, 1/2
#           ulp, plus float32 error: rtol = 1 ulp).
# float32 errors measured on this suite are <= ~4e-7 of the scale (see conftest's report).
TOLERANCES = {
    "vs_tf": {
        "float32": {"dx": (2e-6, 1e-6), "vec": (0.0, 2e-6)},
        "float16": {"dx": (2 ** -9, 1e-6), "vec": (0.0, 2e-6)},
        "bfloat16": {"dx": (2 ** -6, 1e-6), "vec": (0.0, 2e-6)},
    },
    "vs_f64": {
        "float32": {"dx": (2e-6, 1e-6), "vec": (0.0, 2e-6)},
        "float16": {"dx": (2 ** -10, 1e-6), "vec": (0.0, 2e-6)},
        "bfloat16": {"dx": (2 ** -7, 1e-6), "vec": (0.0, 2e-6)},
    },
}
# Smallest normal of each type: below it an ulp is absolute, not relative.
TINY = {"float32": float(np.finfo(np.float32).tiny), "float16": 2.0 ** -14,
        "bfloat16": float(np.finfo(np.float32).tiny)}


def scaled_errors(actual, expected, scale):
    """max |a - e| / scale (scale a scalar or broadcastable array; 0 for empty arrays)."""
    a = np.asarray(actual, np.float64)
    e = np.asarray(expected, np.float64)
    if a.size == 0:
        return 0.0
    s = np.maximum(np.broadcast_to(np.asarray(scale, np.float64), e.shape), 1e-30)
    return float(np.max(np.abs(a - e) / s))


def assert_close(actual, expected, rtol, atol, scale, what="", tiny=0.0):
    """Elementwise |a - e| <= rtol * max(|e|, tiny) + atol * scale, NaN-free, same shape."""
    a = np.asarray(actual, np.float64)
    e = np.asarray(expected, np.float64)
    assert a.shape == e.shape, "%s: shape %s != %s" % (what, a.shape, e.shape)
    assert np.all(np.isfinite(a)) == np.all(np.isfinite(e)), "%s: non-finite values" % what
    if a.size == 0:
        return
    s = np.broadcast_to(np.asarray(scale, np.float64), e.shape)
    bound = rtol * np.maximum(np.abs(e), tiny) + atol * s
    err = np.abs(a - e)
    bad = ~(err <= bound)
    if np.any(bad):
        i = np.unravel_index(int(np.argmax(np.where(bad, err - bound, -np.inf))), e.shape)
        raise AssertionError(
            "%s: %d of %d elements out of tolerance (rtol=%g, atol=%g); worst at %s: "
            "actual %r expected %r |diff| %g bound %g"
            % (what, int(bad.sum()), e.size, rtol, atol, i, a[i], e[i], err[i], bound[i]))


# Largest scaled errors seen in this process, {(kind, dtype, output): error}; printed by
# conftest.py at the end of a verbose run (or with FBN_TEST_REPORT_ERRORS=1).
ERROR_LOG = {}


def log_error(kind, dtype, output, err):
    key = (kind, dtype_name(dtype), output)
    ERROR_LOG[key] = max(ERROR_LOG.get(key, 0.0), float(err))


def assert_outputs_close(ours, expected, inputs, dtype, kind, data_format, epsilon=EPSILON,
                         is_training=True):
    """Compares (dx, dscale, doffset) against expected with the tolerance table; records the
    errors (dx relative to max |dx|, the vectors relative to their error_scales)."""
    dtype = dtype_name(dtype)
    tol = TOLERANCES[kind][dtype]
    ds_scale, do_scale = error_scales(inputs, data_format, epsilon, is_training)
    dx_ref = np.asarray(expected[0], np.float64)
    dx_mag = float(np.max(np.abs(dx_ref))) if dx_ref.size else 0.0
    log_error(kind, dtype, "x_backprop", scaled_errors(ours[0], expected[0], dx_mag))
    log_error(kind, dtype, "scale_backprop", scaled_errors(ours[1], expected[1], ds_scale))
    log_error(kind, dtype, "offset_backprop", scaled_errors(ours[2], expected[2], do_scale))
    assert_close(ours[0], expected[0], *tol["dx"], scale=dx_mag, what="x_backprop",
                 tiny=TINY[dtype])
    assert_close(ours[1], expected[1], *tol["vec"], scale=ds_scale, what="scale_backprop")
    assert_close(ours[2], expected[2], *tol["vec"], scale=do_scale, what="offset_backprop")


def bits(a):
    """The raw bits of an array (for bitwise comparisons that treat NaNs exactly)."""
    a = np.ascontiguousarray(a)
    return a.view({2: np.uint16, 4: np.uint32, 8: np.uint64}[a.dtype.itemsize])


def assert_bitwise_equal(a, b, what=""):
    a, b = np.asarray(a), np.asarray(b)
    assert a.dtype == b.dtype and a.shape == b.shape, "%s: %s%s vs %s%s" % (
        what, a.dtype, a.shape, b.dtype, b.shape)
    ne = bits(a) != bits(b)
    assert not np.any(ne), "%s: %d of %d elements differ, first at %s: %r vs %r" % (
        what, int(ne.sum()), a.size, np.argwhere(ne)[0], a[tuple(np.argwhere(ne)[0])],
        b[tuple(np.argwhere(ne)[0])])


# ---- fuzz loops (tests/test_hardening_*.py) ----------------------------------------------------

def _with_notes(e):
    notes = getattr(e, "__notes__", None) or []
    return AssertionError("%s: %s\n%s" % (type(e).__name__, e, "\n".join(notes)))


def run_fuzz_property(prop, stats):
    """Child side of a fuzz test: runs the hypothesis property prop(), records how long it
    took in stats["seconds"] and returns stats. A failure comes out as an AssertionError
    whose message carries hypothesis' notes (the falsifying example), since only the
    message reaches the parent."""
    t0 = time.monotonic()
    try:
        prop()
    except BaseException as e:  # noqa: BLE001
        raise _with_notes(e) from None
    stats["seconds"] = round(time.monotonic() - t0, 1)
    return stats


def fuzz_examples(default):
    """How many examples a fuzz test runs: FBN_FUZZ_EXAMPLES, else the test's default."""
    return int(os.environ.get("FBN_FUZZ_EXAMPLES", default))


def fuzz_generate_only(cfg):
    """Decorator for a hypothesis property of the forward fuzz children: cfg["examples"]
    generated examples from seed cfg["seed"], no shrinking, no deadline, no example database,
    every health check off (the children note each example themselves)."""
    from hypothesis import HealthCheck, Phase, settings
    from hypothesis import seed as hyp_seed

    def apply(prop):
        return hyp_seed(cfg["seed"])(settings(
            max_examples=cfg["examples"], deadline=None, database=None,
            phases=[Phase.generate], suppress_health_check=list(HealthCheck))(prop))
    return apply


def run_fuzz_child(runner, cfg, timeout):
    """Parent side of a fuzz test: runs runner(cfg) ("module:function") in one child process
    (tests/subproc.py), fails unless it finished cleanly (naming the last example it ran),
    prints the statistics it returned and returns them."""
    import subproc
    (o,) = subproc.run_cases(runner, [cfg], timeout=timeout)
    assert o.status == "ok", "fuzz failed (%s): %s\nlast example: %r" % (
        o.status, o.message or o.detail, o.last_note)
    print("fuzz stats:", o.value)
    return o.value


def assert_fuzz_coverage(stats, min_examples, shares=None, seen=()):
    """A fuzz loop's statistics show it tested what it should: at least min_examples
    examples; for each key: share of shares, more than that share of the examples counted
    under key; for each key of seen, at least one."""
    assert stats["examples"] >= min_examples, "%d examples, wanted %d" % (
        stats["examples"], min_examples)
    for key, share in (shares or {}).items():
        assert stats[key] > share * stats["examples"], "%s: %d of %d examples" % (
            key, stats[key], stats["examples"])
    for key in seen:
        assert stats[key] > 0, key


# ---- subprocesses ---------------------------------------------------------------------------

def subprocess_env(**extra):
    """Environment for child Python processes: quiet TF, this package importable."""
    env = dict(os.environ)
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    env.update({k: str(v) for k, v in extra.items()})
    return env


def child_with_env_value(var, value, code, rejected):
    """Runs `code` (Python that prints what it reads) in a child with the environment
    variable var=value and returns the words it printed. rejected: the library must have
    reported the value ("ignoring VAR=value") and fallen back to its default."""
    import subprocess
    import sys
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       env=subprocess_env(**{var: value}), timeout=120)
    assert p.returncode == 0, p.stderr[-2000:]
    if rejected:
        assert "ignoring %s=%s" % (var, value) in p.stderr, p.stderr[-2000:]
    return p.stdout.split()
