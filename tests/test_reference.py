"""Our op against the float64 reference (helpers.reference_float64), and the reference itself
against float64 automatic differentiation of the batch-norm forward.

The float64 reference evaluates the exact formulas on the (already quantized) inputs, so it
is the true answer for those inputs: float32 results must be within float32 rounding error,
16-bit x_backprop within one unit in the last place (the final rounding is half an ulp).
"""
import zlib

import numpy as np
import pytest

tf = pytest.importorskip("tensorflow")

from helpers import (DTYPES, EPSILON, FORMATS, Case, assert_outputs_close,  # noqa: E402
                     channel_axis, error_scales, log_error, make_inputs, make_shape,
                     reduce_axes, reference_float64, run_ours, scaled_errors, tf_reference)

CASES = [
    Case("c3", 2, (5, 7), (3, 4, 5), 3),
    Case("c1000", 2, (3, 3), (1, 3, 3), 1000),
    Case("c1", 4, (6, 5), (2, 3, 5), 1),
    Case("planes", 3, (12, 11), (2, 9, 8), 4),
]


def seed_of(*parts):
    return zlib.crc32(repr(parts).encode())


# ---- the reference itself -------------------------------------------------------------------

@pytest.mark.parametrize("training", [True, False], ids=["train", "infer"])
@pytest.mark.parametrize("fmt", FORMATS)
def test_reference_is_gradient_of_batch_norm(fmt, training):
    """reference_float64 == d/d(x, scale, offset) of sum(dy * BN(x)), by float64 autodiff.

    Training: BN normalizes with the batch statistics of x (which depend on x), and the
    reference is given those statistics. Inference: fixed population statistics."""
    shape = make_shape(Case("g", 3, (4, 5), (2, 3, 4), 3), fmt)
    rng = np.random.default_rng(seed_of("autodiff", fmt, training))
    c = shape[channel_axis(fmt)]
    x = rng.standard_normal(shape) * 2.0 + 0.5
    dy = rng.standard_normal(shape)
    gamma = rng.uniform(0.5, 1.5, c)
    beta = rng.standard_normal(c)
    axes = reduce_axes(fmt)
    bshape = [1] * len(shape)
    bshape[channel_axis(fmt)] = c
    pop_mean, pop_var = rng.standard_normal(c) * 0.3, rng.uniform(0.5, 2.0, c)
    eps = 2.0 ** -10  # exact in float32 (the op's attr type)

    xt, gt, bt = (tf.constant(v, tf.float64) for v in (x, gamma, beta))
    with tf.GradientTape() as tape:
        tape.watch([xt, gt, bt])
        if training:
            mean, var = tf.nn.moments(xt, axes=axes, keepdims=True)
        else:
            mean = tf.constant(pop_mean.reshape(bshape))
            var = tf.constant(pop_var.reshape(bshape))
        y = tf.nn.batch_normalization(xt, mean, var, tf.reshape(bt, bshape),
                                      tf.reshape(gt, bshape), eps)
        loss = tf.reduce_sum(y * dy)
    gx, gg, gb = (g.numpy() for g in tape.gradient(loss, [xt, gt, bt]))

    if training:
        rs1, rs2 = x.mean(axis=axes), x.var(axis=axes)
    else:
        rs1, rs2 = pop_mean, pop_var
    dx, dscale, doffset = reference_float64(dy, x, gamma, rs1, rs2, eps, fmt, training)
    np.testing.assert_allclose(doffset, gb, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(dscale, gg, rtol=1e-6)
    np.testing.assert_allclose(dx, gx, rtol=1e-6, atol=1e-9 * np.abs(gx).max())


def test_reference_saved_stat_inv_std_equivalence():
    inputs = make_inputs((2, 3, 4, 5), "NHWC", "float32", True, seed=11)
    inv = 1.0 / np.sqrt(inputs.rs2.astype(np.float64) + np.float32(EPSILON))
    a = reference_float64(*inputs[:5], EPSILON, "NHWC", True)
    b = reference_float64(*inputs[:4], inv, EPSILON, "NHWC", True, saved_stat="inv_std")
    for u, v in zip(a, b):
        np.testing.assert_allclose(u, v, rtol=1e-12, atol=1e-12)


# ---- our op against the reference --------------------------------------------------------------

@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
@pytest.mark.parametrize("training", [True, False], ids=["train", "infer"])
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_matches_float64_reference(dtype, fmt, training, case):
    shape = make_shape(case, fmt)
    inputs = make_inputs(shape, fmt, dtype, training, seed=seed_of(dtype, fmt, case))
    ours = run_ours(inputs, EPSILON, fmt, training)
    ref = reference_float64(*inputs[:5], EPSILON, fmt, training)
    assert_outputs_close(ours[:3], ref, inputs, dtype, "vs_f64", fmt, EPSILON, training)


@pytest.mark.parametrize("training", [True, False], ids=["train", "infer"])
@pytest.mark.parametrize("fmt", FORMATS)
def test_large_mean_offset(fmt, training):
    """x ~ 1000 + N(0, 1): the centered sums must not lose the signal to cancellation."""
    shape = make_shape(Case("off", 4, (16, 16), (4, 8, 8), 8), fmt)
    inputs = make_inputs(shape, fmt, "float32", training, seed=seed_of("offset", fmt),
                         mean_offset=1000.0)
    ours = run_ours(inputs, EPSILON, fmt, training)
    ref = reference_float64(*inputs[:5], EPSILON, fmt, training)
    assert_outputs_close(ours[:3], ref, inputs, "float32", "vs_f64", fmt, EPSILON, training)


# One channel with 10^6 elements per channel (and a case with many channels), x ~ 1000 + noise:
# ours must be about as accurate as TF's own kernel, or within a tight absolute bound.
BIG_CASES = [((1, 1000, 1000, 1), "NHWC"), ((4, 32, 64, 64), "NCHW")]
TIGHT = {"x_backprop": 1e-6, "scale_backprop": 1e-6, "offset_backprop": 1e-6}


@pytest.mark.parametrize("training", [True, False], ids=["train", "infer"])
@pytest.mark.parametrize("shape,fmt", BIG_CASES, ids=["1x1000x1000x1-NHWC", "4x32x64x64-NCHW"])
def test_million_elements_accuracy_vs_tf(shape, fmt, training):
    inputs = make_inputs(shape, fmt, "float32", training, seed=seed_of("big", shape),
                         mean_offset=1000.0)
    ref = reference_float64(*inputs[:5], EPSILON, fmt, training)
    ours = run_ours(inputs, EPSILON, fmt, training)
    theirs = tf_reference(inputs, EPSILON, fmt, training)
    ds_scale, do_scale = error_scales(inputs, fmt, EPSILON, training)
    scales = [np.abs(ref[0]).max(), ds_scale, do_scale]
    report = []
    for name, o, t, r, s in zip(TIGHT, ours, theirs, ref, scales):
        e_ours, e_tf = scaled_errors(o, r, s), scaled_errors(t, r, s)
        log_error("big_ours", "float32", name, e_ours)
        log_error("big_tf", "float32", name, e_tf)
        report.append("%s: ours %.3g, TF %.3g" % (name, e_ours, e_tf))
        assert e_ours <= max(2 * e_tf, TIGHT[name]), "; ".join(report)
