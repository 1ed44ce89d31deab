"""fbn_grad_tf.fused_batch_norm and fbn_grad_tf.use_for_gradients.

Which op computed a gradient is proven by the op types in the traced graphs (our
"FbnGrad>FusedBatchNormGradV3" present, TF's "FusedBatchNormGradV3" absent) or, in eager
mode where there is no graph, by counting calls of our op's Python binding.
"""
import warnings

import numpy as np
import pytest
import tensorflow as tf
from tensorflow.python.framework import ops as tf_ops

import fbn_grad_tf
from fbn_grad_tf import gradients as fgrads
from fbn_grad_tf import nn as fnn

OURS = fbn_grad_tf.REGISTERED_OP_NAME
TFS = "FusedBatchNormGradV3"


def _channels_first(fmt):
    return fmt in ("NCHW", "NCDHW")


def _data(fmt="NHWC", seed=0, dtype=tf.float32, n=3, c=4):
    rng = np.random.default_rng(seed)
    spatial = (3, 2, 5) if fmt in ("NDHWC", "NCDHW") else (4, 5)
    shape = (n, c) + spatial if _channels_first(fmt) else (n,) + spatial + (c,)
    x = tf.cast(tf.constant(rng.normal(0.5, 2.0, shape), tf.float32), dtype)
    scale = tf.constant(rng.uniform(0.5, 1.5, c), tf.float32)
    offset = tf.constant(rng.normal(0, 1, c), tf.float32)
    mean = tf.constant(rng.normal(0, 1, c), tf.float32)
    var = tf.constant(rng.uniform(0.5, 2, c), tf.float32)
    w = tf.cast(tf.constant(rng.normal(0, 1, shape), tf.float32), dtype)
    return x, scale, offset, mean, var, w


def all_op_types(graph):
    """Op types in a graph and in every function of its library (nested tf.functions,
    gradient functions)."""
    gd = graph.as_graph_def()
    types = {n.op for n in gd.node}
    for f in gd.library.function:
        types |= {n.op for n in f.node_def}
    return types


def _close(a, b, rtol=1e-5, atol=1e-5):
    np.testing.assert_allclose(np.asarray(tf.cast(a, tf.float32)),
                               np.asarray(tf.cast(b, tf.float32)), rtol=rtol, atol=atol)


class CountOurOp:
    """Counts calls of our op's binding made by the gradient code (eager proof)."""

    def __init__(self, monkeypatch):
        self.calls = 0
        real = fgrads.raw_op

        def counting(**kw):
            self.calls += 1
            return real(**kw)
        monkeypatch.setattr(fgrads, "raw_op", counting)


# ---- fused_batch_norm: forward semantics ----------------------------------------------------

@pytest.mark.parametrize("fmt", ["NHWC", "NCHW", "NDHWC", "NCDHW"])
@pytest.mark.parametrize("forward", ["ours", "tf"])
def test_forward_matches_tf_wrapper(fmt, forward):
    """forward="tf" is TF's op itself (bit-identical); ours agrees to float rounding."""
    x, scale, offset, mean, var, _ = _data(fmt)
    cases = [dict(), dict(mean=mean, variance=var, exponential_avg_factor=0.3),
             dict(mean=mean, variance=var, is_training=False)]
    tol = 0 if forward == "tf" else 2e-6
    for kw in cases:
        ours = fbn_grad_tf.fused_batch_norm(x, scale, offset, epsilon=1e-3, data_format=fmt,
                                            forward=forward, **kw)
        ref = tf.compat.v1.nn.fused_batch_norm(x, scale, offset, epsilon=1e-3,
                                               data_format=fmt, **kw)
        assert len(ours) == 3
        for a, b in zip(ours, ref):
            assert a.shape == b.shape and a.dtype == b.dtype
            _close(a, b, rtol=tol, atol=tol)


def test_epsilon_passed_through_like_tf_2_21():
    """TF 2.21's wrapper no longer raises epsilon to 1.001e-5 (older ones did): neither do we."""
    x, scale, offset, _, _, _ = _data()

    @tf.function
    def f(bn):
        return bn(x * 1e-3, scale, offset, epsilon=1e-8)[0]

    eps = [op.get_attr("epsilon") for bn in (fbn_grad_tf.fused_batch_norm,
                                              tf.compat.v1.nn.fused_batch_norm)
           for op in f.get_concrete_function(bn).graph.get_operations()
           if op.type in ("FusedBatchNormV3", "FbnGrad>FusedBatchNormV3")]
    assert len(eps) == 2 and eps[0] == eps[1] and eps[0] < 1e-7


def test_argument_checks():
    x, scale, offset, mean, var, _ = _data()
    with pytest.raises(ValueError, match="mean"):
        fbn_grad_tf.fused_batch_norm(x, scale, offset, is_training=False)
    with pytest.raises(ValueError, match="mean"):
        fbn_grad_tf.fused_batch_norm(x, scale, offset, mean=mean, exponential_avg_factor=0.5)
    with pytest.raises(ValueError, match="data_format"):
        fbn_grad_tf.fused_batch_norm(x, scale, offset, data_format="NWC")


# ---- fused_batch_norm: gradients -------------------------------------------------------------

def _grads(bn, x, scale, offset, mean, var, w, fmt, training):
    kw = dict(epsilon=1e-3, data_format=fmt, is_training=training)
    if not training:
        kw.update(mean=mean, variance=var)
    with tf.GradientTape() as tape:
        tape.watch([x, scale, offset])
        y = bn(x, scale, offset, **kw)[0]
        loss = tf.reduce_sum(tf.cast(y * w, tf.float32))
    return tape.gradient(loss, [x, scale, offset])


CASES = [("NHWC", True, tf.float32), ("NCHW", True, tf.float32), ("NCHW", False, tf.float32),
         ("NDHWC", False, tf.float32), ("NCDHW", True, tf.float32),
         ("NHWC", True, tf.float16), ("NCHW", False, tf.bfloat16)]


@pytest.mark.parametrize("fmt,training,dtype", CASES)
def test_gradients_match_tf_eager(fmt, training, dtype, monkeypatch):
    data = _data(fmt, dtype=dtype)
    ref = _grads(tf.compat.v1.nn.fused_batch_norm, *data, fmt, training)
    count = CountOurOp(monkeypatch)
    ours = _grads(fbn_grad_tf.fused_batch_norm, *data, fmt, training)
    assert count.calls == 1
    tol = 1e-4 if dtype == tf.float32 else 3e-2
    for a, b in zip(ours, ref):
        assert a.dtype == b.dtype
        _close(a, b, rtol=tol, atol=tol)


@pytest.mark.parametrize("fmt,training", [("NHWC", True), ("NCHW", False), ("NCDHW", False)])
def test_gradients_in_tf_function_use_our_op(fmt, training):
    data = _data(fmt)

    @tf.function
    def step(bn):
        return _grads(bn, *data, fmt, training)

    cf = step.get_concrete_function(fbn_grad_tf.fused_batch_norm)
    types = all_op_types(cf.graph)
    assert OURS in types and TFS not in types
    if not training:
        # channels-first inference: computed natively, TF's gradient transposes to NHWC.
        assert "Transpose" not in types
    ref = step(tf.compat.v1.nn.fused_batch_norm)
    for a, b in zip(cf(), ref):
        _close(a, b, rtol=1e-4, atol=1e-4)


def test_gradients_tf1_graph():
    xv, sv, ov, mv, vv, wv = (t.numpy() for t in _data("NCHW"))
    out = {}
    for name, bn in (("ours", fbn_grad_tf.fused_batch_norm),
                     ("tf", tf.compat.v1.nn.fused_batch_norm)):
        g = tf.Graph()
        with g.as_default():
            x = tf.compat.v1.placeholder(tf.float32, [None, 4, 4, 5])
            scale, offset = tf.constant(sv), tf.constant(ov)
            y = bn(x, scale, offset, data_format="NCHW")[0]
            grads = tf.compat.v1.gradients(tf.reduce_sum(y * wv), [x, scale, offset])
            types = {op.type for op in g.get_operations()}
            with tf.compat.v1.Session(graph=g) as s:
                out[name] = s.run(grads, {x: xv})
        if name == "ours":
            assert OURS in types and TFS not in types
    for a, b in zip(out["ours"], out["tf"]):
        _close(a, b, rtol=1e-4, atol=1e-4)


def test_xla_falls_back_with_warning():
    data = _data("NHWC")
    fgrads._reset_warnings_for_tests()

    @tf.function(jit_compile=True)
    def step():
        return _grads(fbn_grad_tf.fused_batch_norm, *data, "NHWC", True)

    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        ours = step()
    assert any("XLA" in str(r.message) for r in rec)
    ref = _grads(tf.compat.v1.nn.fused_batch_norm, *data, "NHWC", True)
    for a, b in zip(ours, ref):
        _close(a, b, rtol=1e-4, atol=1e-4)


# ---- use_for_gradients ----------------------------------------------------------------------

def _tf_bn(x, scale, offset, **kw):
    return tf.compat.v1.nn.fused_batch_norm(x, scale, offset, **kw)


def test_use_for_gradients_eager_tape(monkeypatch):
    data = _data("NCHW")
    ref = _grads(_tf_bn, *data, "NCHW", False)
    count = CountOurOp(monkeypatch)
    with fbn_grad_tf.use_for_gradients():
        ours = _grads(_tf_bn, *data, "NCHW", False)
    assert count.calls == 1
    for a, b in zip(ours, ref):
        _close(a, b, rtol=1e-4, atol=1e-4)
    # Eager tapes look the gradient up when tape.gradient runs: for TF's forward op
    # (forward=False) outside the block that is TF's gradient ...
    x, scale, offset, _, _, w = data
    with tf.GradientTape() as tape:
        tape.watch(x)
        with fbn_grad_tf.use_for_gradients(forward=False):
            y = _tf_bn(x, scale, offset, data_format="NCHW")[0]
        loss = tf.reduce_sum(y * w)
    tape.gradient(loss, x)
    assert count.calls == 1
    # ... while a forward built in the block (forward=True) is our op, whose gradient is ours
    # wherever it is taken.
    with tf.GradientTape() as tape:
        tape.watch(x)
        with fbn_grad_tf.use_for_gradients():
            y = _tf_bn(x, scale, offset, data_format="NCHW")[0]
        loss = tf.reduce_sum(y * w)
    tape.gradient(loss, x)
    assert count.calls == 2


def test_use_for_gradients_tape_inside_tf_function():
    data = _data("NHWC")

    @tf.function
    @fbn_grad_tf.use_for_gradients()
    def step_ours():
        return _grads(_tf_bn, *data, "NHWC", True)

    @tf.function
    def step_tf():
        return _grads(_tf_bn, *data, "NHWC", True)

    types = all_op_types(step_ours.get_concrete_function().graph)
    assert OURS in types and TFS not in types
    assert TFS in all_op_types(step_tf.get_concrete_function().graph)
    for a, b in zip(step_ours(), step_tf()):
        _close(a, b, rtol=1e-4, atol=1e-4)


def test_use_for_gradients_override_tag_persists():
    """graph=True alone (no registry swap): forward ops created in the block are tagged, and
    a gradient built after the block (by a tape outside the forward tf.function) uses ours."""
    x, scale, offset, _, _, w = _data("NHWC")

    @tf.function
    def forward(x):
        with fbn_grad_tf.use_for_gradients(registry=False):
            return tf.raw_ops.FusedBatchNormV3(x=x, scale=scale, offset=offset,
                                               mean=tf.constant([]), variance=tf.constant([]),
                                               epsilon=1e-3)[0]

    fwd_ops = [op for op in forward.get_concrete_function(x).graph.get_operations()
               if op.type in ("FusedBatchNormV3", "FbnGrad>FusedBatchNormV3")]
    assert fwd_ops[0].get_attr("_gradient_op_type") == b"FbnGrad>FusedBatchNormV3"

    @tf.function
    def step(x):
        with tf.GradientTape() as tape:
            tape.watch(x)
            loss = tf.reduce_sum(forward(x) * w)
        return tape.gradient(loss, x)

    types = all_op_types(step.get_concrete_function(x).graph)
    assert OURS in types and TFS not in types
    ref = _grads(_tf_bn, x, scale, offset, None, None, w, "NHWC", True)[0]
    _close(step(x), ref, rtol=1e-4, atol=1e-4)


def test_use_for_gradients_overlapping_blocks_on_one_graph():
    """Blocks that overlap on one graph (from threads, or left out of order): the tag holds
    until the last one leaves, then what was there before is back (nothing left behind)."""
    g = tf.Graph()

    def fwd_tag():
        with g.as_default():
            y = tf.raw_ops.FusedBatchNormV3(x=tf.ones([2, 3, 3, 4]), scale=tf.ones([4]),
                                            offset=tf.zeros([4]), mean=tf.constant([]),
                                            variance=tf.constant([]), epsilon=1e-3)[0]
        try:
            return y.op.get_attr("_gradient_op_type")
        except ValueError:
            return None

    with g.as_default():
        a, b = fbn_grad_tf.use_for_gradients(registry=False), \
            fbn_grad_tf.use_for_gradients(registry=False, op_types="FusedBatchNormV3")
        with g.gradient_override_map({"FusedBatchNormV2": "Custom"}):  # someone else's entry
            a.__enter__()
            b.__enter__()
            a.__exit__(None, None, None)  # out of order: b is still active
            assert fwd_tag() == b"FbnGrad>FusedBatchNormV3"
            b.__exit__(None, None, None)
            assert fwd_tag() is None
            assert g._gradient_override_map == {"FusedBatchNormV2": "Custom"}  # pylint: disable=protected-access


def test_use_for_gradients_tf1_graph_and_versions():
    xv, sv, ov, mv, vv, wv = (t.numpy() for t in _data("NHWC"))
    out = {}
    for name in ("ours", "tf"):
        g = tf.Graph()
        with g.as_default():
            x = tf.constant(xv)
            scale, offset = tf.constant(sv), tf.constant(ov)
            with (fbn_grad_tf.use_for_gradients(registry=False) if name == "ours"
                  else tf.name_scope("plain")):
                e = tf.constant([], tf.float32)
                ys = [tf.raw_ops.FusedBatchNormV3(x=x, scale=scale, offset=offset, mean=e,
                                                  variance=e, epsilon=1e-3)[0],
                      tf.raw_ops.FusedBatchNormV2(x=x, scale=scale, offset=offset,
                                                  mean=tf.constant(mv), variance=tf.constant(vv),
                                                  epsilon=1e-3, is_training=False)[0],
                      tf.raw_ops.FusedBatchNorm(x=x, scale=scale, offset=offset, mean=e,
                                                variance=e, epsilon=1e-3)[0]]
            # Gradients built after the block: the tags decide.
            grads = [tf.compat.v1.gradients(tf.reduce_sum(y * wv), [x, scale, offset])
                     for y in ys]
            types = {op.type for op in g.get_operations()}
            with tf.compat.v1.Session(graph=g) as s:
                out[name] = s.run(grads)
        if name == "ours":
            assert OURS in types
            assert not types & {TFS, "FusedBatchNormGradV2", "FusedBatchNormGrad"}
    for ga, gb in zip(out["ours"], out["tf"]):
        for a, b in zip(ga, gb):
            _close(a, b, rtol=1e-4, atol=1e-4)


def test_use_for_gradients_restores_registry():
    reg = tf_ops._gradient_registry
    original = reg.lookup("FusedBatchNormV3")
    ctx = fbn_grad_tf.use_for_gradients()
    with ctx:
        assert reg.lookup("FusedBatchNormV3") is fgrads.FORWARD_GRAD_FUNCTIONS["FusedBatchNormV3"]
        with fbn_grad_tf.use_for_gradients():
            pass
        assert fnn.registry_patched()  # still patched: the outer block is active
    assert reg.lookup("FusedBatchNormV3") is original and not fnn.registry_patched()
    with pytest.raises(RuntimeError):
        with fbn_grad_tf.use_for_gradients():
            raise RuntimeError("boom")
    assert reg.lookup("FusedBatchNormV3") is original

    @fbn_grad_tf.use_for_gradients()
    def recursive(n):
        assert fnn.registry_patched()
        return 0 if n == 0 else 1 + recursive(n - 1)
    assert recursive(3) == 3
    assert reg.lookup("FusedBatchNormV3") is original
    with pytest.raises(ValueError):
        fbn_grad_tf.use_for_gradients(op_types=["Conv2D"])


def test_use_for_gradients_builds_our_forward_while_active():
    """forward=True (default): TF's Python builder of FusedBatchNormV3 makes our op inside the
    block (restored on exit, also after an exception); forward=False keeps TF's op."""
    from tensorflow.python.ops import gen_nn_ops
    original = gen_nn_ops.fused_batch_norm_v3
    data = _data("NHWC")

    def step_types(**kw):
        @tf.function
        @fbn_grad_tf.use_for_gradients(**kw)
        def step():
            return _grads(_tf_bn, *data, "NHWC", True)
        return all_op_types(step.get_concrete_function().graph), step()

    ours_types, ours = step_types()
    assert {"FbnGrad>FusedBatchNormV3", OURS} <= ours_types
    assert not {"FusedBatchNormV3", TFS} & ours_types
    tf_types, theirs = step_types(forward=False)
    assert "FusedBatchNormV3" in tf_types and "FbnGrad>FusedBatchNormV3" not in tf_types
    for a, b in zip(ours, theirs):
        _close(a, b, rtol=1e-4, atol=1e-4)
    assert gen_nn_ops.fused_batch_norm_v3 is original
    with pytest.raises(RuntimeError):
        with fbn_grad_tf.use_for_gradients():
            assert gen_nn_ops.fused_batch_norm_v3 is not original
            raise RuntimeError("boom")
    assert gen_nn_ops.fused_batch_norm_v3 is original
    # Eager: the same outputs as TF's forward, to float rounding.
    x, scale, offset = data[:3]
    with fbn_grad_tf.use_for_gradients():
        y_ours = _tf_bn(x, scale, offset, epsilon=1e-3)
    y_tf = _tf_bn(x, scale, offset, epsilon=1e-3)
    for a, b in zip(y_ours, y_tf):
        _close(a, b, rtol=2e-6, atol=2e-6)
