"""The gradient of our op (double backprop), registered in fbn_grad_tf/gradients.py.

* numerical Jacobians (tf.test.compute_gradient, float32: the op has no float64) of the op's
  three outputs with respect to (y_backprop, x, scale);
* second derivatives through fbn_grad_tf.fused_batch_norm vs TF's own second derivatives
  through tf.raw_ops.FusedBatchNormV3 (TF's registered FusedBatchNormGradV3 and its gradient),
  training and inference, channels-last and channels-first, eager, tf.function and TF1 graphs.
"""
import numpy as np
import pytest
import tensorflow as tf

import fbn_grad_tf
from fbn_grad_tf import gradients as fgrads

EPS = 1e-3


def _rank(fmt):
    return 5 if fmt in ("NDHWC", "NCDHW") else 4


def _shape(fmt, n=2, c=3, spatial=(2, 3)):
    if _rank(fmt) == 5:
        spatial = (2,) + tuple(spatial)
    return (n, c) + tuple(spatial) if fmt in ("NCHW", "NCDHW") else (n,) + tuple(spatial) + (c,)


def _axes(fmt):
    r = _rank(fmt)
    return [0] + list(range(2, r)) if fmt in ("NCHW", "NCDHW") else list(range(r - 1))


def _data(fmt, seed=0, **kw):
    rng = np.random.default_rng(seed)
    shape = _shape(fmt, **kw)
    c = shape[1] if fmt in ("NCHW", "NCDHW") else shape[-1]
    x = tf.constant(rng.normal(0.3, 1.5, shape), tf.float32)
    dy = tf.constant(rng.normal(0, 1, shape), tf.float32)
    scale = tf.constant(rng.uniform(0.5, 1.5, c), tf.float32)
    offset = tf.constant(rng.normal(0, 1, c), tf.float32)
    pmean = tf.constant(rng.normal(0, 0.5, c), tf.float32)
    pvar = tf.constant(rng.uniform(0.5, 2.0, c), tf.float32)
    return x, dy, scale, offset, pmean, pvar


def _op(dy, x, scale, m, v, fmt, training):
    return fbn_grad_tf.raw_op(y_backprop=dy, x=x, scale=scale, reserve_space_1=m,
                              reserve_space_2=v, reserve_space_3=tf.constant([], tf.float32),
                              epsilon=EPS, data_format=fmt, is_training=training)


# ---- numerical Jacobian -------------------------------------------------------------------

@pytest.mark.parametrize("fmt", ["NHWC", "NCHW", "NCDHW"])
@pytest.mark.parametrize("training", [True, False])
def test_compute_gradient_of_op(fmt, training):
    x, dy, scale, _, pmean, pvar = _data(fmt, n=2, c=2, spatial=(2, 2))
    axes = _axes(fmt)

    def f(dy, x, scale):
        if training:
            # The saved statistics are functions of x (what the forward saved): the
            # registered gradient differentiates through them, like TF's.
            m, v = tf.nn.moments(x, axes)
        else:
            m, v = pmean, pvar
        dx, ds, do, _, _ = _op(dy, x, scale, m, v, fmt, training)
        return tf.concat([tf.reshape(dx, [-1]), ds, do], 0)

    theo, num = tf.test.compute_gradient(f, [dy, x, scale], delta=1e-2)
    for t, n in zip(theo, num):
        err = np.max(np.abs(t - n))
        assert err < 2e-2 * max(1.0, np.max(np.abs(n))), err


def test_compute_gradient_half():
    """float16 x/dy: computed in float32 inside, Jacobian w.r.t. scale checked (float32)."""
    x, dy, scale, _, _, _ = _data("NHWC", n=2, c=2, spatial=(2, 2))
    x16, dy16 = tf.cast(x, tf.float16), tf.cast(dy, tf.float16)

    def f(scale):
        m, v = tf.nn.moments(tf.cast(x16, tf.float32), [0, 1, 2])
        dx, ds, do, _, _ = _op(dy16, x16, scale, m, v, "NHWC", True)
        return tf.concat([tf.cast(tf.reshape(dx, [-1]), tf.float32), ds, do], 0)

    theo, num = tf.test.compute_gradient(f, [scale], delta=1e-2)
    assert np.max(np.abs(theo[0] - num[0])) < 5e-2


# ---- second order vs TF's ---------------------------------------------------------------

def _second_order(bn, x, scale, offset, pmean, pvar, fmt, training):
    """d/d(x, scale, offset) of a loss of the first-order gradients, with a loss that makes
    dy depend on x (so the forward gradient is also used inside the second order)."""
    c = scale.shape[0]
    bshape = [1, c] + [1] * (_rank(fmt) - 2) if fmt in ("NCHW", "NCDHW") else [c]
    w = tf.cast(tf.reshape(tf.linspace(0.5, 1.5, c), bshape), x.dtype)
    with tf.GradientTape() as outer:
        outer.watch([x, scale, offset])
        with tf.GradientTape() as inner:
            inner.watch([x, scale, offset])
            y = bn(x, scale, offset, pmean, pvar, fmt, training)
            loss = tf.reduce_sum(w * y * y) + tf.reduce_sum(tf.sin(y))
        gx, gs, go = inner.gradient(loss, [x, scale, offset])
        loss2 = (tf.reduce_sum(tf.cast(tf.cos(x) * gx, tf.float32)) + tf.reduce_sum(gs * gs)
                 + tf.reduce_sum(go * tf.range(1.0, c + 1.0)))
    return [gx, gs, go] + outer.gradient(loss2, [x, scale, offset])


def _bn_ours(x, scale, offset, m, v, fmt, training):
    if training:
        return fbn_grad_tf.fused_batch_norm(x, scale, offset, epsilon=EPS, data_format=fmt)[0]
    return fbn_grad_tf.fused_batch_norm(x, scale, offset, m, v, epsilon=EPS, data_format=fmt,
                                        is_training=False)[0]


def _bn_tf(x, scale, offset, m, v, fmt, training):
    if training:
        m = v = tf.constant([], tf.float32)
    return tf.raw_ops.FusedBatchNormV3(x=x, scale=scale, offset=offset, mean=m, variance=v,
                                       epsilon=EPS, data_format=fmt, is_training=training)[0]


def _assert_close(ours, ref, rtol=2e-4):
    for i, (a, b) in enumerate(zip(ours, ref)):
        assert a is not None and b is not None, i
        a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
        assert a.shape == b.shape, (i, a.shape, b.shape)
        scale = max(1.0, np.max(np.abs(b)))
        err = np.max(np.abs(a - b)) / scale
        assert err < rtol, (i, err)


@pytest.mark.parametrize("fmt", ["NHWC", "NCHW", "NDHWC", "NCDHW"])
@pytest.mark.parametrize("training", [True, False])
def test_second_order_matches_tf_eager(fmt, training):
    x, _, scale, offset, pm, pv = _data(fmt, seed=1)
    ours = _second_order(_bn_ours, x, scale, offset, pm, pv, fmt, training)
    ref = _second_order(_bn_tf, x, scale, offset, pm, pv, fmt, training)
    _assert_close(ours, ref)


@pytest.mark.parametrize("fmt,training", [("NHWC", True), ("NCHW", False)])
def test_second_order_matches_tf_in_function(fmt, training):
    x, _, scale, offset, pm, pv = _data(fmt, seed=2)

    @tf.function
    def run(bn):
        return _second_order(bn, x, scale, offset, pm, pv, fmt, training)

    ours = run.get_concrete_function(_bn_ours)
    types = {op.type for op in ours.graph.get_operations()}
    assert fbn_grad_tf.REGISTERED_OP_NAME in types
    assert "FusedBatchNormGradV3" not in types
    _assert_close(ours(), run(_bn_tf))


def test_second_order_tf1_graph():
    """tf.compat.v1.gradients of tf.compat.v1.gradients in a TF1 graph."""
    fmt = "NCHW"
    xv, _, sv, ov, _, _ = (t.numpy() for t in _data(fmt, seed=3))
    results = {}
    for name, bn in (("ours", _bn_ours), ("tf", _bn_tf)):
        g = tf.Graph()
        with g.as_default():
            x = tf.constant(xv)
            scale, offset = tf.constant(sv), tf.constant(ov)
            y = bn(x, scale, offset, None, None, fmt, True)
            gx, gs = tf.compat.v1.gradients(tf.reduce_sum(y * y * y), [x, scale])
            h = tf.compat.v1.gradients(tf.reduce_sum(gx * gx) + tf.reduce_sum(gs), [x, scale])
            types = {op.type for op in g.get_operations()}
            with tf.compat.v1.Session(graph=g) as s:
                results[name] = s.run([gx, gs] + h)
        if name == "ours":
            assert fbn_grad_tf.REGISTERED_OP_NAME in types and "FusedBatchNormGradV3" not in types
    _assert_close(results["ours"], results["tf"])


@pytest.mark.parametrize("dtype,fmt,training", [(tf.float16, "NHWC", True),
                                                 (tf.bfloat16, "NCHW", True),
                                                 (tf.bfloat16, "NHWC", False)])
def test_second_order_half(dtype, fmt, training):
    x, _, scale, offset, pm, pv = _data(fmt, seed=4, c=4, spatial=(4, 4))
    x16 = tf.cast(x, dtype)
    ours = _second_order(_bn_ours, x16, scale, offset, pm, pv, fmt, training)
    ref = _second_order(_bn_tf, x16, scale, offset, pm, pv, fmt, training)
    assert ours[0].dtype == ours[3].dtype == dtype
    _assert_close(ours, ref, rtol=1e-2 if dtype == tf.float16 else 2e-2)


def test_reference_grad_matches_op():
    """The pure-TF recomputation used for double backprop agrees with the op (first order),
    including C == 1 channels-first (TF's own version squeezes scale_backprop to a scalar)."""
    for fmt, training, c in (("NHWC", True, 3), ("NCHW", True, 1), ("NCDHW", False, 2)):
        x, dy, scale, _, pm, pv = _data(fmt, seed=5, c=c)
        if training:
            pm, pv = tf.nn.moments(x, _axes(fmt))
        ref = fgrads.batch_norm_grad_reference(dy, x, scale, pm, pv, EPS, fmt, training)
        got = _op(dy, x, scale, pm, pv, fmt, training)[:3]
        assert ref[1].shape == [c]
        _assert_close(got, ref, rtol=1e-5)


def test_double_backprop_returns_none_for_reserve_spaces():
    x, dy, scale, _, pm, pv = _data("NHWC", seed=6)
    m, v = tf.nn.moments(x, [0, 1, 2])
    rs3 = tf.constant([], tf.float32)
    with tf.GradientTape() as t:
        t.watch([dy, x, scale, m, v, rs3])
        dx = fbn_grad_tf.raw_op(y_backprop=dy, x=x, scale=scale, reserve_space_1=m,
                                reserve_space_2=v, reserve_space_3=rs3, epsilon=EPS)[0]
        loss = tf.reduce_sum(dx * dx)
    g = t.gradient(loss, [dy, x, scale, m, v, rs3])
    assert all(a is not None for a in g[:3]) and all(a is None for a in g[3:])
