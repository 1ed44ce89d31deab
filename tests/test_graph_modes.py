"""The op in every TF execution mode: eager, tf.function (with partially known shapes), and
tf.compat.v1 Graph + Session; the shape function; gradients (our op as the gradient of a
batch-norm forward, and differentiating through our op)."""
import numpy as np
import pytest

tf = pytest.importorskip("tensorflow")

import fbn_grad_tf  # noqa: E402
from fbn_grad_tf import raw_op  # noqa: E402
from helpers import (DTYPES, EPSILON, FORMATS, Case,  # noqa: E402
                     assert_bitwise_equal, channel_axis, make_inputs, make_shape, reduce_axes,
                     run_ours)

TF_DTYPES = {"float32": tf.float32, "float16": tf.float16, "bfloat16": tf.bfloat16}


def call_ours(dy, x, scale, rs1, rs2, rs3, fmt="NHWC", training=True, epsilon=EPSILON):
    return fbn_grad_tf.fused_batch_norm_grad(dy, x, scale, rs1, rs2, rs3, epsilon=epsilon,
                                             data_format=fmt, is_training=training)


def call_tf(dy, x, scale, rs1, rs2, rs3, fmt="NHWC", training=True, epsilon=EPSILON):
    return tf.raw_ops.FusedBatchNormGradV3(
        y_backprop=dy, x=x, scale=scale, reserve_space_1=rs1, reserve_space_2=rs2,
        reserve_space_3=rs3, epsilon=epsilon, data_format=fmt, is_training=training)


# ---- same numbers in every mode ---------------------------------------------------------------

@pytest.mark.parametrize("training", [True, False], ids=["train", "infer"])
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_eager_function_and_session_agree(dtype, fmt, training):
    shape = make_shape(Case("m", 3, (6, 5), (2, 3, 5), 4), fmt)
    inputs = make_inputs(shape, fmt, dtype, training, seed=31)
    eager = run_ours(inputs, EPSILON, fmt, training)

    spec = [tf.TensorSpec([None] * len(shape), TF_DTYPES[dtype])] * 2 + \
        [tf.TensorSpec([None], tf.float32)] * 4
    fn = tf.function(lambda *a: tuple(call_ours(*a, fmt=fmt, training=training)),
                     input_signature=spec)
    traced = [t.numpy() for t in fn(*inputs)]

    g = tf.Graph()
    with g.as_default():
        phs = [tf.compat.v1.placeholder(s.dtype, s.shape) for s in spec]
        outs = call_ours(*phs, fmt=fmt, training=training)
        assert outs.x_backprop.op.type == fbn_grad_tf.FusedBatchNormGrad.OP_NAME
    with tf.compat.v1.Session(graph=g) as sess:
        in_session = sess.run(list(outs), feed_dict=dict(zip(phs, inputs)))

    for name, e, t, s in zip(("dx", "dscale", "doffset", "rs4", "rs5"), eager, traced, in_session):
        assert_bitwise_equal(t, e, "tf.function " + name)
        assert_bitwise_equal(s, e, "Session " + name)


def test_session_graph_reused_with_different_shapes():
    g = tf.Graph()
    with g.as_default():
        phs = ([tf.compat.v1.placeholder(tf.float32, [None] * 4) for _ in range(2)]
               + [tf.compat.v1.placeholder(tf.float32, [None]) for _ in range(4)])
        outs = call_ours(*phs, fmt="NCHW")
    cases = [make_inputs(shape, "NCHW", "float32", True, seed=shape[1])
             for shape in [(2, 3, 4, 5), (1, 7, 2, 2), (0, 3, 4, 4)]]
    expected = [run_ours(inputs, EPSILON, "NCHW", True) for inputs in cases]
    with tf.compat.v1.Session(graph=g) as sess:  # (the session's graph is the default here)
        for inputs, exp in zip(cases, expected):
            got = sess.run(list(outs), feed_dict=dict(zip(phs, inputs)))
            for a, b in zip(got, exp):
                assert_bitwise_equal(a, b)


# ---- shape inference -----------------------------------------------------------------------------

SHAPE_CASES = [
    # fmt, dy shape, x shape, scale/rs1/rs2 shape, rs3 shape  (None = unknown)
    ("NHWC", [None, None, None, 5], [None, None, None, 5], [5], [0]),
    ("NHWC", [None, None, None, None], [2, None, None, None], [5], [None]),
    ("NHWC", [2, 8, 8, None], [None, None, None, None], [None], None),
    ("NHWC", None, None, [7], None),
    ("NHWC", [None, 4, None, 3], [2, None, 6, None], None, [2, 3]),
    ("NCHW", [None, 7, None, None], [None, None, None, None], [None], []),
    ("NCHW", [4, None, 3, 3], None, [6], [0]),
    ("NDHWC", [None, None, None, None, 3], None, [3], [0]),
    ("NCDHW", [None, None, 2, None, None], [1, None, None, None, None], [9], None),
    ("NCDHW", None, None, None, None),
]


@pytest.mark.parametrize("training", [True, False], ids=["train", "infer"])
@pytest.mark.parametrize("fmt,dy_shape,x_shape,vec_shape,rs3_shape", SHAPE_CASES)
def test_shape_inference_matches_tf(fmt, dy_shape, x_shape, vec_shape, rs3_shape, training):
    specs = [tf.TensorSpec(dy_shape, tf.float32), tf.TensorSpec(x_shape, tf.float32)] + \
        [tf.TensorSpec(vec_shape, tf.float32)] * 3 + [tf.TensorSpec(rs3_shape, tf.float32)]
    inferred = {}

    @tf.function(input_signature=specs)
    def both(*args):
        ours = call_ours(*args, fmt=fmt, training=training)
        theirs = call_tf(*args, fmt=fmt, training=training)
        inferred["ours"] = [t.shape for t in ours]
        inferred["tf"] = [t.shape for t in theirs]
        inferred["dtypes"] = [t.dtype for t in ours], [t.dtype for t in theirs]
        return ours.x_backprop

    both.get_concrete_function()
    for i, (a, b) in enumerate(zip(inferred["ours"], inferred["tf"])):
        assert a.rank == b.rank and a.as_list() == b.as_list(), \
            "output %d: ours %s vs TF %s" % (i, a, b)
    assert inferred["dtypes"][0] == inferred["dtypes"][1]
    # the shape function's facts, independent of TF: outputs 3 and 4 are [0], 1 and 2 [C]
    assert inferred["ours"][3].as_list() == [0] and inferred["ours"][4].as_list() == [0]
    assert inferred["ours"][0].rank == (5 if fmt in ("NDHWC", "NCDHW") else 4)


def test_concrete_function_with_unknown_dims_runs_several_shapes():
    spec = tf.TensorSpec([None, None, None, 3], tf.float32)
    vec = tf.TensorSpec([3], tf.float32)
    fn = tf.function(lambda *a: call_ours(*a).x_backprop,
                     input_signature=[spec, spec, vec, vec, vec, tf.TensorSpec(None, tf.float32)])
    assert fn.get_concrete_function().structured_outputs.shape.as_list() == [None, None, None, 3]
    for shape in [(1, 2, 2, 3), (4, 5, 6, 3), (0, 1, 1, 3)]:
        inputs = make_inputs(shape, "NHWC", "float32", True, seed=sum(shape))
        assert_bitwise_equal(fn(*inputs).numpy(), run_ours(inputs)[0])


GRAPH_SHAPE_ERRORS = [
    # fmt, dy, x, scale, message (all raise at graph construction)
    # fully known shapes: the Python API runs the core's validation (its own message)
    ("NHWC", [2, 3, 4, 5], [2, 3, 4, 5], [4],
     r"[Dd]imensions must be equal|scale must have 5 elements"),
    ("NHWC", [None, None, None, 5], [None, None, None, None], [4],
     r"[Dd]imensions must be equal|5 and 4|4 and 5"),
    ("NHWC", [None, None, None, 5], [None, None, None, 6], [None],
     r"[Dd]imensions must be equal|5 and 6|6 and 5"),
    ("NCHW", [None, 3, None, None], [None, None, None, None], [5],
     r"[Dd]imensions must be equal|3 and 5|5 and 3"),
    ("NHWC", [None, None, None], [None, None, None, None], [None], r"rank|4-dimensional"),
    ("NHWC", [None] * 4, [None, None, None], [None], r"rank|4-dimensional"),
    ("NDHWC", [None] * 4, [None] * 4, [None], r"rank|5-dimensional"),
    ("NHWC", [None] * 4, [None] * 4, [None, None], r"rank|1-dimensional"),
]


@pytest.mark.parametrize("api", ["python", "raw_op"])
@pytest.mark.parametrize("fmt,dy,x,vec,msg", GRAPH_SHAPE_ERRORS)
def test_shape_errors_at_graph_construction(api, fmt, dy, x, vec, msg):
    specs = [tf.TensorSpec(dy, tf.float32), tf.TensorSpec(x, tf.float32)] + \
        [tf.TensorSpec(vec, tf.float32)] * 3 + [tf.TensorSpec([0], tf.float32)]

    def build(*a):
        if api == "python":
            return call_ours(*a, fmt=fmt).x_backprop
        return raw_op(y_backprop=a[0], x=a[1], scale=a[2], reserve_space_1=a[3],
                      reserve_space_2=a[4], reserve_space_3=a[5], data_format=fmt)[0]

    with pytest.raises(ValueError, match=msg):
        tf.function(build, input_signature=specs).get_concrete_function()
    g = tf.Graph()  # and in a plain graph
    with g.as_default():
        phs = [tf.compat.v1.placeholder(s.dtype, s.shape) for s in specs]
        with pytest.raises(ValueError, match=msg):
            build(*phs)


def test_runtime_shape_errors_with_unknown_static_shapes():
    """Shapes unknown when tracing: the kernel's validation raises InvalidArgumentError."""
    spec4 = tf.TensorSpec([None] * 4, tf.float32)
    vec = tf.TensorSpec([None], tf.float32)
    fn = tf.function(lambda *a: call_ours(*a).x_backprop,
                     input_signature=[spec4, spec4, vec, vec, vec, vec])
    inputs = make_inputs((2, 3, 4, 5), "NHWC", "float32", True, seed=3)
    with pytest.raises(tf.errors.InvalidArgumentError, match="scale must have 5 elements"):
        fn(*inputs._replace(scale=np.ones(4, np.float32)))
    with pytest.raises(tf.errors.InvalidArgumentError, match="same shape"):
        fn(*inputs._replace(x=inputs.x[:, :2]))
    assert_bitwise_equal(fn(*inputs).numpy(), run_ours(inputs)[0])  # still usable


# ---- gradients ---------------------------------------------------------------------------------

def _bn_forward(x, scale, offset, fmt, eps, training, pop_mean=None, pop_var=None):
    """Batch-norm forward with plain TF ops (any float dtype); returns (y, mean, var)."""
    axes = list(reduce_axes(fmt))
    rank = len(x.shape)
    bshape = [1] * rank
    bshape[channel_axis(fmt)] = -1
    if training:
        mean, var = tf.nn.moments(x, axes=axes)
    else:
        mean, var = tf.cast(pop_mean, x.dtype), tf.cast(pop_var, x.dtype)
    y = tf.nn.batch_normalization(x, tf.reshape(mean, bshape), tf.reshape(var, bshape),
                                  tf.reshape(offset, bshape), tf.reshape(scale, bshape), eps)
    return y, mean, var


def _bn_with_our_gradient(fmt, eps, training, pop_mean, pop_var):
    @tf.custom_gradient
    def bn(x, scale, offset):
        y, mean, var = _bn_forward(x, scale, offset, fmt, eps, training, pop_mean, pop_var)

        def grad(dy):
            out = fbn_grad_tf.fused_batch_norm_grad(dy, x, scale, mean, var, tf.zeros([0]),
                                                    epsilon=eps, data_format=fmt,
                                                    is_training=training)
            return out.x_backprop, out.scale_backprop, out.offset_backprop
        return y, grad
    return bn


@pytest.mark.parametrize("training", [True, False], ids=["train", "infer"])
@pytest.mark.parametrize("fmt", ["NHWC", "NCHW", "NCDHW"])
def test_our_op_is_the_gradient_of_batch_norm(fmt, training):
    """tf.test.compute_gradient: the Jacobian of a BN forward whose registered backward is
    our op (theoretical, float32) == the numeric Jacobian of the same forward (float64)."""
    shape = make_shape(Case("j", 2, (3, 3), (2, 2, 2), 2), fmt)
    rng = np.random.default_rng(41)
    c = shape[channel_axis(fmt)]
    x = rng.standard_normal(shape) * 1.5 + 0.3
    scale = rng.uniform(0.5, 1.5, c)
    offset = rng.standard_normal(c)
    pop_mean, pop_var = rng.standard_normal(c) * 0.2, rng.uniform(0.5, 2.0, c)
    eps = 2.0 ** -10

    f32 = _bn_with_our_gradient(fmt, eps, training, pop_mean.astype(np.float32),
                                pop_var.astype(np.float32))
    theoretical, _ = tf.test.compute_gradient(
        f32, [tf.constant(v, tf.float32) for v in (x, scale, offset)])

    def f64(x, scale, offset):
        return _bn_forward(x, scale, offset, fmt, eps, training, pop_mean, pop_var)[0]
    _, numeric = tf.test.compute_gradient(
        f64, [tf.constant(v, tf.float64) for v in (x, scale, offset)], delta=1e-4)
    for name, t, n in zip(("x", "scale", "offset"), theoretical, numeric):
        assert t.shape == n.shape
        np.testing.assert_allclose(t, n, rtol=1e-4, atol=2e-5 * np.abs(n).max(),
                                   err_msg="d y / d " + name)


def _grad_formula_tf(dy, x, scale, mean, var, eps, fmt, training):
    """FusedBatchNormGradV3's math in TF ops (float64-capable), for numeric differentiation."""
    axes = list(reduce_axes(fmt))
    bshape = [1] * len(x.shape)
    bshape[channel_axis(fmt)] = -1
    r = lambda v: tf.reshape(v, bshape)  # noqa: E731
    inv = tf.math.rsqrt(var + eps)
    xc = x - r(mean)
    sum_dy = tf.reduce_sum(dy, axes)
    sum_dyxc = tf.reduce_sum(dy * xc, axes)
    m = tf.cast(tf.size(x) // tf.shape(x)[channel_axis(fmt)], x.dtype)
    if training:
        dx = r(scale * inv) * (dy - r(sum_dy) / m - xc * r(inv * inv * sum_dyxc) / m)
    else:
        dx = dy * r(scale * inv)
    return dx, inv * sum_dyxc, sum_dy


@pytest.mark.parametrize("training", [True, False], ids=["train", "infer"])
@pytest.mark.parametrize("fmt", ["NHWC", "NCHW"])
def test_gradient_through_our_op(fmt, training):
    """Differentiating through our op (batch-norm double backward): the theoretical Jacobian
    of f(dy, x, scale) = <w, our outputs>, with rs1/rs2 the moments of x in training, against
    the numeric Jacobian of the same function written with TF ops in float64."""
    shape = make_shape(Case("gg", 2, (3, 2), (1, 1, 1), 2), fmt)
    rng = np.random.default_rng(43)
    c = shape[channel_axis(fmt)]
    dy, x = rng.standard_normal(shape), rng.standard_normal(shape) + 0.5
    scale = rng.uniform(0.5, 1.5, c)
    pop_mean, pop_var = rng.standard_normal(c) * 0.2, rng.uniform(0.5, 2.0, c)
    w = [rng.standard_normal(shape), rng.standard_normal(c), rng.standard_normal(c)]
    eps = 2.0 ** -10
    axes = list(reduce_axes(fmt))

    def stats(x):
        if training:
            return tf.nn.moments(x, axes=axes)
        return tf.constant(pop_mean, x.dtype), tf.constant(pop_var, x.dtype)

    def combine(outs, dtype):
        return sum(tf.reduce_sum(tf.constant(wi, dtype) * o) for wi, o in zip(w, outs))

    def f32(dy, x, scale):
        mean, var = stats(x)
        outs = fbn_grad_tf.fused_batch_norm_grad(dy, x, scale, mean, var, tf.zeros([0]),
                                                 epsilon=eps, data_format=fmt,
                                                 is_training=training)
        return combine(outs[:3], tf.float32)

    def f64(dy, x, scale):
        mean, var = stats(x)
        return combine(_grad_formula_tf(dy, x, scale, mean, var, eps, fmt, training),
                       tf.float64)

    theoretical, _ = tf.test.compute_gradient(
        f32, [tf.constant(v, tf.float32) for v in (dy, x, scale)])
    _, numeric = tf.test.compute_gradient(
        f64, [tf.constant(v, tf.float64) for v in (dy, x, scale)], delta=1e-4)
    for name, t, n in zip(("dy", "x", "scale"), theoretical, numeric):
        np.testing.assert_allclose(t, n, rtol=1e-3, atol=1e-4 * np.abs(n).max(),
                                   err_msg="d f / d " + name)


def test_grad_formula_tf_matches_reference():
    """The TF-ops formula used for numeric differentiation above is the reference's math."""
    from helpers import reference_float64
    for fmt in ("NHWC", "NCDHW"):
        for training in (True, False):
            inputs = make_inputs(make_shape(Case("f", 2, (3, 4), (2, 2, 3), 3), fmt), fmt,
                                 "float32", training, seed=5)
            ref = reference_float64(*inputs[:5], 2.0 ** -10, fmt, training)
            got = _grad_formula_tf(*[tf.constant(np.asarray(a, np.float64)) for a in inputs[:5]],
                                   2.0 ** -10, fmt, training)
            for r, g in zip(ref, got):
                np.testing.assert_allclose(g.numpy(), r, rtol=1e-12, atol=1e-12)
