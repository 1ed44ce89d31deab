"""The split backward ops "FbnGrad>BatchNormGradReduce"/"FbnGrad>BatchNormGradApply" through
their checked wrappers in fbn_grad_tf.sync.

* reduce -> apply with the local sums (no all-reduce) equals the fused op's x_backprop
  bitwise, for every dtype and data format;
* with sums added over the halves of a batch (an all-reduce done by hand), apply on each
  half reproduces the fused op on the whole batch;
* the plain-TF fallback (_reduce_tf/_apply_tf) computes the same math;
* Python-side checks reject bad arguments before the kernel runs.
"""
import numpy as np
import pytest
import tensorflow as tf

import fbn_grad_tf
from fbn_grad_tf import sync

import helpers as H

EPS = 1e-3
SHAPES = {"NHWC": (3, 5, 4, 8), "NCHW": (3, 8, 5, 4), "NDHWC": (2, 3, 4, 3, 8),
          "NCDHW": (2, 8, 3, 4, 3)}


def _inputs(fmt, dtype, seed=0, shape=None):
    shape = shape or SHAPES[fmt]
    inp = H.make_inputs(shape, fmt, dtype, training=True, seed=seed, stats="tf")
    return inp


def _fused(inp, fmt):
    return fbn_grad_tf.fused_batch_norm_grad(inp.dy, inp.x, inp.scale, inp.rs1, inp.rs2,
                                             inp.rs3, epsilon=EPS, data_format=fmt)


def _bits(t):
    a = np.asarray(tf.cast(t, tf.float32) if t.dtype == tf.bfloat16 else t)
    return a.view(np.uint16 if a.dtype.itemsize == 2 else np.uint32)


@pytest.mark.parametrize("dtype", H.DTYPES)
@pytest.mark.parametrize("fmt", H.FORMATS)
def test_reduce_apply_equals_fused_op_bitwise(fmt, dtype):
    inp = _inputs(fmt, dtype)
    ref = _fused(inp, fmt)
    sums = sync.batch_norm_grad_reduce(inp.dy, inp.x, inp.rs1, data_format=fmt)
    assert isinstance(sums, sync.BatchNormGradSums)
    c = SHAPES[fmt][H.channel_axis(fmt)]
    assert sums.sum_dy.shape == (c,) and sums.sum_dy_xmu.shape == (c,)
    assert float(sums.count) == np.prod(SHAPES[fmt]) / c
    dx = sync.batch_norm_grad_apply(inp.dy, inp.x, inp.scale, inp.rs1, inp.rs2, *sums,
                                    epsilon=EPS, data_format=fmt)
    assert dx.dtype == ref.x_backprop.dtype and dx.shape == ref.x_backprop.shape
    np.testing.assert_array_equal(_bits(dx), _bits(ref.x_backprop))
    # sum_dy is the fused op's offset_backprop (same accumulation).
    np.testing.assert_array_equal(sums.sum_dy.numpy(), ref.offset_backprop.numpy())


def test_reduce_apply_bitwise_in_tf_function_with_unknown_batch():
    fmt, dtype = "NHWC", "float32"
    inp = _inputs(fmt, dtype, seed=3)

    @tf.function(input_signature=[tf.TensorSpec([None, 5, 4, 8], tf.float32)] * 2)
    def split(dy, x):
        s = sync.batch_norm_grad_reduce(dy, x, inp.rs1, data_format=fmt)
        return sync.batch_norm_grad_apply(dy, x, inp.scale, inp.rs1, inp.rs2, *s,
                                          epsilon=EPS, data_format=fmt)

    np.testing.assert_array_equal(split(inp.dy, inp.x).numpy(), _fused(inp, fmt).x_backprop)


@pytest.mark.parametrize("fmt", ["NHWC", "NCDHW"])
def test_reduce_sums_match_float64(fmt):
    inp = _inputs(fmt, "float32", seed=1)
    s = sync.batch_norm_grad_reduce(inp.dy, inp.x, inp.rs1, data_format=fmt)
    axes = H.reduce_axes(fmt)
    b = [1] * len(inp.x.shape)
    b[H.channel_axis(fmt)] = -1
    dy64, x64 = inp.dy.astype(np.float64), inp.x.astype(np.float64)
    np.testing.assert_allclose(s.sum_dy, dy64.sum(axes), rtol=1e-5, atol=1e-4)
    np.testing.assert_allclose(
        s.sum_dy_xmu, (dy64 * (x64 - inp.rs1.astype(np.float64).reshape(b))).sum(axes),
        rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("fmt", ["NHWC", "NCHW"])
def test_sums_added_over_batch_halves_reproduce_the_whole_batch(fmt):
    """The all-reduce of a 2-replica SyncBN, done by hand."""
    shape = (8,) + SHAPES[fmt][1:]
    inp = _inputs(fmt, "float32", seed=2, shape=shape)
    ref = _fused(inp, fmt).x_backprop.numpy()
    halves = [slice(0, 4), slice(4, 8)]
    local = [sync.batch_norm_grad_reduce(inp.dy[h], inp.x[h], inp.rs1, data_format=fmt)
             for h in halves]
    total = [a + b for a, b in zip(*local)]
    assert float(total[2]) == np.prod(shape) / shape[H.channel_axis(fmt)]
    dx = np.concatenate([sync.batch_norm_grad_apply(inp.dy[h], inp.x[h], inp.scale, inp.rs1,
                                                    inp.rs2, *total, epsilon=EPS,
                                                    data_format=fmt).numpy() for h in halves])
    np.testing.assert_allclose(dx, ref, rtol=1e-5, atol=1e-5 * np.abs(ref).max())


@pytest.mark.parametrize("dtype", H.DTYPES)
def test_plain_tf_fallback_matches_ops(dtype):
    fmt = "NCHW"
    inp = _inputs(fmt, dtype, seed=4)
    s = sync.batch_norm_grad_reduce(inp.dy, inp.x, inp.rs1, data_format=fmt)
    t = sync._reduce_tf(tf.constant(inp.dy), tf.constant(inp.x), inp.rs1, fmt)
    for a, b in zip(s, t):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-4)
    dx = sync.batch_norm_grad_apply(inp.dy, inp.x, inp.scale, inp.rs1, inp.rs2, *s,
                                    epsilon=EPS, data_format=fmt)
    dx_tf = sync._apply_tf(tf.constant(inp.dy), tf.constant(inp.x), inp.scale, inp.rs1,
                           inp.rs2, *s, EPS, fmt)
    assert dx_tf.dtype == dx.dtype
    tol = {"float32": 1e-5, "float16": 2e-3, "bfloat16": 1.6e-2}[dtype]
    a, b = (np.asarray(tf.cast(v, tf.float32)) for v in (dx, dx_tf))
    np.testing.assert_allclose(a, b, rtol=tol, atol=tol * np.abs(a).max())


# ---- argument checks -------------------------------------------------------------------------

def _ok_args(fmt="NHWC"):
    inp = _inputs(fmt, "float32")
    return inp


def test_reduce_rejects_bad_arguments():
    inp = _ok_args()
    with pytest.raises(ValueError, match="data_format"):
        sync.batch_norm_grad_reduce(inp.dy, inp.x, inp.rs1, data_format="NWHC")
    with pytest.raises(TypeError, match="same dtype"):
        sync.batch_norm_grad_reduce(inp.dy.astype(np.float16), inp.x, inp.rs1)
    with pytest.raises(TypeError, match="y_backprop must have dtype"):
        sync.batch_norm_grad_reduce(inp.dy.astype(np.float64), inp.x.astype(np.float64),
                                    inp.rs1)
    with pytest.raises(TypeError, match="mean must have dtype float32"):
        sync.batch_norm_grad_reduce(inp.dy, inp.x, inp.rs1.astype(np.float16))
    with pytest.raises(ValueError, match="4-dimensional"):
        sync.batch_norm_grad_reduce(inp.dy[0], inp.x[0], inp.rs1)
    with pytest.raises(ValueError, match="same shape"):
        sync.batch_norm_grad_reduce(inp.dy[:2], inp.x, inp.rs1)
    with pytest.raises(ValueError, match="mean must have 8 elements"):
        sync.batch_norm_grad_reduce(inp.dy, inp.x, inp.rs1[:3])
    with pytest.raises(ValueError, match="mean must be 1-dimensional"):
        sync.batch_norm_grad_reduce(inp.dy, inp.x, inp.rs1[None])


def test_apply_rejects_bad_arguments():
    inp = _ok_args()
    s = sync.batch_norm_grad_reduce(inp.dy, inp.x, inp.rs1)
    args = [inp.dy, inp.x, inp.scale, inp.rs1, inp.rs2, s.sum_dy, s.sum_dy_xmu, s.count]
    with pytest.raises(ValueError, match="count must be a scalar"):
        sync.batch_norm_grad_apply(*args[:7], tf.reshape(s.count, [1]))
    with pytest.raises(ValueError, match="sum_dy_xmu must have 8 elements"):
        sync.batch_norm_grad_apply(*args[:6], s.sum_dy_xmu[:5], s.count)
    with pytest.raises(TypeError, match="epsilon"):
        sync.batch_norm_grad_apply(*args, epsilon="0.1")
    with pytest.raises(ValueError, match="epsilon"):
        sync.batch_norm_grad_apply(*args, epsilon=-1.0)
    with pytest.raises(TypeError, match="count must have dtype float32"):
        sync.batch_norm_grad_apply(*args[:7], 5)
    # The kernel checks the value of count.
    with pytest.raises(tf.errors.InvalidArgumentError, match="count must be a finite"):
        sync.batch_norm_grad_apply(*args[:7], tf.constant(0.5))
