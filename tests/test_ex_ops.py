"""The fused ops FbnGrad>FusedBatchNormEx / FbnGrad>FusedBatchNormGradEx: a side input and the
activations Identity, Relu, Relu6, Swish (y = act(bn(x) + side_input)), and the gradient of
the side input.

Oracles: a float64 NumPy evaluation of z, the activation and its derivative (core, every
mode x side input x dtype x layout x training/inference); TF's own ops composed unfused
(FusedBatchNormV3 + add + tf.nn.relu/relu6/silu) under tf.GradientTape for the gradients of
fused_batch_norm and the Keras layer (TF has no CPU kernel of its _FusedBatchNormEx); the
TF op equals the core bitwise; validation errors name the argument.
"""
import numpy as np
import pytest
import tensorflow as tf

import fbn_grad_tf
from fbn_grad_tf import _loader, core
from helpers import assert_bitwise_equal, np_dtype

ACTS = (None, "relu", "relu6", "swish")
MODE = {None: "Identity", "relu": "Relu", "relu6": "Relu6", "swish": "Swish"}
TF_ACT = {None: tf.identity, "relu": tf.nn.relu, "relu6": tf.nn.relu6, "swish": tf.nn.silu}
EPS = 1e-3
# Relative to the largest |reference| of each output (dx, side_input_backprop, y) and to the
# per-channel sums of |terms| (scale/offset backprop).
TOL = {"float32": 3e-5, "float16": 6e-3, "bfloat16": 4e-2}
SHAPES = {"NHWC": (3, 5, 6, 8), "NCHW": (3, 8, 5, 6), "NDHWC": (2, 3, 4, 5, 8),
          "NCDHW": (2, 8, 3, 4, 5)}


def axes_of(fmt, ndim):
    c = 1 if fmt in ("NCHW", "NCDHW") else ndim - 1
    return tuple(i for i in range(ndim) if i != c), c


def inputs(fmt, dtype, side, training, seed=0, shape=None):
    rng = np.random.default_rng(seed)
    shape = SHAPES[fmt] if shape is None else shape
    _, c_axis = axes_of(fmt, len(shape))
    C = shape[c_axis]
    dt = np_dtype(dtype)
    # Values around 0..6 after normalization so that every branch of relu6/swish is hit.
    x = (2.5 * rng.standard_normal(shape)).astype(np.float32).astype(dt)
    dy = rng.standard_normal(shape).astype(np.float32).astype(dt)
    scale = rng.uniform(0.5, 3.0, C).astype(np.float32)
    offset = rng.uniform(-1.0, 4.0, C).astype(np.float32)
    mean = (0.3 * rng.standard_normal(C)).astype(np.float32)
    var = rng.uniform(4.0, 8.0, C).astype(np.float32)
    s = (2.0 * rng.standard_normal(shape)).astype(np.float32).astype(dt) if side else None
    return dict(x=x, dy=dy, scale=scale, offset=offset, mean=None if training else mean,
                variance=None if training else var, side=s)


def reference(inp, fmt, act, training, y_ours):
    """float64: y, dx, dscale, doffset, dz. The Relu/Relu6 masks are read from our y (as the
    op defines them: the forward's output, whose rounding decides the boundary cases)."""
    x = inp["x"].astype(np.float64)
    axes, c_axis = axes_of(fmt, x.ndim)
    bshape = [1] * x.ndim
    bshape[c_axis] = -1
    if training:
        mu, v = x.mean(axis=axes), x.var(axis=axes)
    else:
        mu, v = inp["mean"].astype(np.float64), inp["variance"].astype(np.float64)
    inv = 1.0 / np.sqrt(v + np.float64(np.float32(EPS)))
    xhat = (x - mu.reshape(bshape)) * inv.reshape(bshape)
    z = xhat * inp["scale"].reshape(bshape) + inp["offset"].reshape(bshape)
    if inp["side"] is not None:
        z = z + inp["side"].astype(np.float64)
    yo = np.asarray(y_ours, np.float64)
    if act == "relu":
        y, d = np.maximum(z, 0), (yo > 0).astype(np.float64)
    elif act == "relu6":
        y, d = np.clip(z, 0, 6), ((yo > 0) & (yo < 6)).astype(np.float64)
    elif act == "swish":
        s = 1.0 / (1.0 + np.exp(-z))
        y, d = z * s, s * (1 + z * (1 - s))
    else:
        y, d = z, np.ones_like(z)
    dz = inp["dy"].astype(np.float64) * d
    m = x.size / x.shape[c_axis]
    doffset = dz.sum(axis=axes)
    dscale = (dz * xhat).sum(axis=axes)
    sc = (inp["scale"] * inv).reshape(bshape)
    if training:
        dx = sc * (dz - doffset.reshape(bshape) / m - xhat * dscale.reshape(bshape) / m)
    else:
        dx = sc * dz
    scales = (np.abs(dz).sum(axis=axes) + 1e-6, np.abs(dz * xhat).sum(axis=axes) + 1e-6)
    return y, dx, dscale, doffset, dz, scales


def check_rel(got, want, tol, what, scale=None):
    got = np.asarray(got, np.float64)
    if scale is None:
        scale = np.max(np.abs(want)) + 1e-12
    err = np.max(np.abs(got - want) / scale) if want.size else 0.0
    assert err <= tol, "%s: error %.3g > %.3g" % (what, err, tol)


def run_core(inp, fmt, act, training, **kw):
    fwd = core.bn_forward(inp["x"], inp["scale"], inp["offset"], inp["mean"], inp["variance"],
                          epsilon=EPS, data_format=fmt, is_training=training, activation=act,
                          side_input=inp["side"], **kw)
    rs1, rs2 = (fwd[3], fwd[4]) if training else (inp["mean"], inp["variance"])
    side = inp["side"] is not None
    bwd = core.bn_grad(inp["dy"], inp["x"], inp["scale"], rs1, rs2, epsilon=EPS,
                       data_format=fmt, is_training=training, activation=act, y=fwd[0],
                       offset=inp["offset"], side_input=inp["side"], side_input_backprop=side,
                       **kw)
    return fwd, bwd


@pytest.mark.parametrize("training", [True, False], ids=["train", "infer"])
@pytest.mark.parametrize("fmt", ["NHWC", "NCHW"])
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("side", [False, True], ids=["noside", "side"])
@pytest.mark.parametrize("act", ACTS, ids=[str(a) for a in ACTS])
def test_core_matches_float64(act, side, dtype, fmt, training):
    inp = inputs(fmt, dtype, side, training, seed=hash((act, side, dtype, fmt)) % 1000)
    fwd, bwd = run_core(inp, fmt, act, training)
    y, dx, dscale, doffset, dz, (s_off, s_scale) = reference(inp, fmt, act, training, fwd[0])
    tol = TOL[dtype]
    check_rel(fwd[0], y, tol, "y")
    check_rel(bwd[0], dx, tol, "x_backprop")
    check_rel(bwd[1], dscale, tol, "scale_backprop", s_scale)
    check_rel(bwd[2], doffset, tol, "offset_backprop", s_off)
    if side:
        check_rel(bwd[3], dz, tol, "side_input_backprop")
        assert bwd[3].dtype == inp["x"].dtype
    if act in ("relu", "relu6"):
        yf = fwd[0].astype(np.float32)
        assert np.all(yf >= 0) and (act == "relu" or np.all(yf <= 6))


@pytest.mark.parametrize("fmt", ["NDHWC", "NCDHW"])
def test_core_5d_swish_side(fmt):
    for training in (True, False):
        inp = inputs(fmt, "float32", True, training, seed=7)
        fwd, bwd = run_core(inp, fmt, "swish", training)
        y, dx, dscale, doffset, dz, (s_off, s_scale) = reference(inp, fmt, "swish", training,
                                                                  fwd[0])
        check_rel(fwd[0], y, 3e-5, "y")
        check_rel(bwd[0], dx, 3e-5, "dx")
        check_rel(bwd[1], dscale, 3e-5, "dscale", s_scale)
        check_rel(bwd[3], dz, 3e-5, "dside")


# Shapes that exercise every task kind of the kernels (row tasks, plane tasks, pieces of
# large planes, small planes in runs, C = 1, long rows), sized for several threads.
BITWISE = [("NHWC", (8, 32, 32, 24)), ("NCHW", (8, 24, 32, 32)), ("NCHW", (4, 6, 10, 30)),
           ("NCDHW", (2, 3, 4, 80, 70)), ("NHWC", (3, 140, 170, 1)), ("NHWC", (1, 4, 20, 2100))]


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("act", ACTS, ids=[str(a) for a in ACTS])
@pytest.mark.parametrize("case", BITWISE[:3], ids=lambda c: "%s-%s" % (c[0], "x".join(map(str, c[1]))))
def test_side_input_training_equals_plain_backward_of_dz(case, act, dtype):
    """With a side input the training backward's second pass reads the dz its first pass
    wrote to side_input_backprop: x/scale/offset backprop are bitwise those of the plain
    backward of that dz, on 1 and 2 threads."""
    fmt, shape = case
    inp = inputs(fmt, dtype, True, True, seed=5, shape=shape)
    for threads in (1, 2):
        fwd, bwd = run_core(inp, fmt, act, True, num_threads=threads)
        plain = core.bn_grad(bwd[3], inp["x"], inp["scale"], fwd[3], fwd[4], epsilon=EPS,
                             data_format=fmt, is_training=True, num_threads=threads)
        assert np.any(bwd[3] != inp["dy"]) or act is None
        for i, name in enumerate(("x_backprop", "scale_backprop", "offset_backprop")):
            assert_bitwise_equal(bwd[i], plain[i], "%s, %d threads" % (name, threads))


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("case", BITWISE, ids=lambda c: "%s-%s" % (c[0], "x".join(map(str, c[1]))))
def test_bitwise_identical_across_isas_and_threads(case, dtype):
    fmt, shape = case
    rng = np.random.default_rng(11)
    _, c_axis = axes_of(fmt, len(shape))
    C = shape[c_axis]
    dt = np_dtype(dtype)
    inp = dict(x=(2 * rng.standard_normal(shape)).astype(np.float32).astype(dt),
               dy=rng.standard_normal(shape).astype(np.float32).astype(dt),
               scale=rng.uniform(0.5, 3, C).astype(np.float32),
               offset=rng.uniform(-1, 4, C).astype(np.float32),
               mean=None, variance=None,
               side=rng.standard_normal(shape).astype(np.float32).astype(dt))
    isas = [i for i in core.CPU_ISAS if core.cpu_supports(i)]
    for act in ("relu6", "swish"):
        for side in (False, True):
            case_inp = dict(inp, side=inp["side"] if side else None)
            base = run_core(case_inp, fmt, act, True, num_threads=1, isa="baseline")
            for isa in isas:
                for threads in (1, 2, 5):
                    out = run_core(case_inp, fmt, act, True, num_threads=threads, isa=isa)
                    for a, b, name in zip(list(out[0][:1]) + list(out[1]),
                                          list(base[0][:1]) + list(base[1]),
                                          ("y", "dx", "dscale", "doffset", "dside")):
                        assert_bitwise_equal(a, b, "%s side=%s %s isa=%s threads=%d" % (
                            act, side, name, isa, threads))


# ---- the TF ops ----------------------------------------------------------------------------

def tf_ex(inp, fmt, act, training):
    """Our TF ops directly: (forward outputs, grad outputs)."""
    x = tf.constant(inp["x"])
    empty = tf.zeros([0])
    mean = empty if training else tf.constant(inp["mean"])
    var = empty if training else tf.constant(inp["variance"])
    side = [] if inp["side"] is None else [tf.constant(inp["side"])]
    fwd = _loader.raw_forward_ex_op(x=x, scale=inp["scale"], offset=inp["offset"], mean=mean,
                                    variance=var, side_input=side, epsilon=EPS,
                                    data_format=fmt, is_training=training,
                                    activation_mode=MODE[act])
    rs1, rs2 = (fwd[3], fwd[4]) if training else (mean, var)
    bwd = _loader.raw_grad_ex_op(y_backprop=inp["dy"], x=x, scale=inp["scale"],
                                 reserve_space_1=rs1, reserve_space_2=rs2, reserve_space_3=empty,
                                 y=fwd[0], offset=[inp["offset"]], side_input=side, epsilon=EPS,
                                 data_format=fmt, is_training=training,
                                 activation_mode=MODE[act])
    return fwd, bwd


@pytest.mark.parametrize("training", [True, False], ids=["train", "infer"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("side", [False, True], ids=["noside", "side"])
@pytest.mark.parametrize("act", ACTS, ids=[str(a) for a in ACTS])
def test_tf_ops_equal_core_bitwise(act, side, dtype, training):
    fmt = "NCHW" if side else "NHWC"
    inp = inputs(fmt, dtype, side, training, seed=3)
    fwd, bwd = tf_ex(inp, fmt, act, training)
    cf, cb = run_core(inp, fmt, act, training)
    assert_bitwise_equal(fwd[0].numpy(), cf[0], "y")
    for name, a, b in zip(("dx", "dscale", "doffset"), bwd[:3], cb[:3]):
        assert_bitwise_equal(a.numpy(), b, name)
    assert len(bwd[5]) == (1 if side else 0)
    if side:
        assert_bitwise_equal(bwd[5][0].numpy(), cb[3], "side_input_backprop")


@pytest.mark.parametrize("training", [True, False], ids=["train", "infer"])
@pytest.mark.parametrize("fmt", ["NHWC", "NCHW"])
@pytest.mark.parametrize("side", [False, True], ids=["noside", "side"])
@pytest.mark.parametrize("act", ACTS, ids=[str(a) for a in ACTS])
def test_fused_batch_norm_gradients_match_unfused_tf(act, side, fmt, training):
    """fused_batch_norm(activation, side_input) vs TF's FusedBatchNormV3 + add + activation,
    values and gradients (GradientTape) of x, scale, offset and the side input."""
    inp = inputs(fmt, "float32", side, training, seed=5)
    x, sc, of = (tf.constant(inp[k]) for k in ("x", "scale", "offset"))
    si = None if inp["side"] is None else tf.constant(inp["side"])
    kw = dict(mean=inp["mean"], variance=inp["variance"], epsilon=EPS, data_format=fmt,
              is_training=training)
    w = tf.constant(np.random.default_rng(1).standard_normal(inp["x"].shape).astype(np.float32))
    watched = [x, sc, of] + ([si] if side else [])
    with tf.GradientTape(persistent=True) as tape:
        tape.watch(watched)
        y = fbn_grad_tf.fused_batch_norm(x, sc, of, activation=act, side_input=si, **kw)[0]
        yr = tf.compat.v1.nn.fused_batch_norm(x, sc, of, **kw)[0]
        yr = TF_ACT[act](yr + si if side else yr)
        loss, loss_r = tf.reduce_sum(y * w), tf.reduce_sum(yr * w)
    np.testing.assert_allclose(y, yr, rtol=1e-5, atol=1e-5)
    for g, gr, name in zip(tape.gradient(loss, watched), tape.gradient(loss_r, watched),
                           ("x", "scale", "offset", "side_input")):
        np.testing.assert_allclose(g, gr, rtol=2e-4, atol=2e-4 * float(np.max(np.abs(gr))),
                                   err_msg=name)


@pytest.mark.parametrize("act", ["relu6", "swish"])
def test_second_derivative_through_fused_activation(act):
    """Double backprop of the Ex ops (gradients.py) vs the unfused TF composition."""
    inp = inputs("NHWC", "float32", True, True, seed=9)
    x, sc, of, si = (tf.constant(inp[k]) for k in ("x", "scale", "offset", "side"))
    w = tf.constant(np.random.default_rng(2).standard_normal(inp["x"].shape).astype(np.float32))

    def second(fused):
        with tf.GradientTape() as outer:
            outer.watch([x, sc, si])
            with tf.GradientTape() as inner:
                inner.watch([x, sc, si])
                if fused:
                    y = fbn_grad_tf.fused_batch_norm(x, sc, of, epsilon=EPS, activation=act,
                                                     side_input=si)[0]
                else:
                    y = TF_ACT[act](tf.compat.v1.nn.fused_batch_norm(x, sc, of,
                                                                     epsilon=EPS)[0] + si)
                loss = tf.reduce_sum(y * w)
            gx, gs = inner.gradient(loss, [x, si])
            r = tf.reduce_sum(gx * gx) + tf.reduce_sum(tf.sin(gs))
        return [tf.zeros_like(v) if g is None else g   # no path (piecewise-constant masks)
                for g, v in zip(outer.gradient(r, [x, sc, si]), [x, sc, si])]

    for a, b, name in zip(second(True), second(False), ("x", "scale", "side")):
        np.testing.assert_allclose(a, b, rtol=2e-3, atol=2e-3 * float(np.max(np.abs(b))),
                                   err_msg=name)


def test_keras_layer_activation_and_side_input():
    import keras
    keras.utils.set_random_seed(4)
    for act in ("relu6", "swish", "silu"):
        ours = fbn_grad_tf.keras.BatchNormalization(activation=act)
        ref = keras.layers.BatchNormalization()
        x = tf.random.normal([4, 5, 5, 8])
        r = tf.random.normal([4, 5, 5, 8])
        ours.build(x.shape)
        ref.build(x.shape)
        fn = TF_ACT["swish" if act == "silu" else act]
        for training in (True, False):
            with tf.GradientTape(persistent=True) as tape:
                tape.watch([x, r])
                y = ours(x, training=training, side_input=r)
                yr = fn(ref(x, training=training) + r)
                loss, loss_r = tf.reduce_sum(y * y), tf.reduce_sum(yr * yr)
            np.testing.assert_allclose(y, yr, rtol=1e-5, atol=1e-5)
            for g, gr in zip(tape.gradient(loss, [x, r] + ours.trainable_weights),
                             tape.gradient(loss_r, [x, r] + ref.trainable_weights)):
                np.testing.assert_allclose(g, gr, rtol=1e-4,
                                           atol=1e-4 * float(np.max(np.abs(gr))))
        assert ours.get_config()["activation"] == ("swish" if act == "silu" else act)


def test_java_mirror_options():
    from fbn_grad_tf import FusedBatchNorm, Scope
    inp = inputs("NHWC", "float32", True, True, seed=2)
    fwd = FusedBatchNorm.create(Scope(), inp["x"], inp["scale"], inp["offset"], tf.zeros([0]),
                                tf.zeros([0]), FusedBatchNorm.epsilon(EPS),
                                FusedBatchNorm.activation("relu6"),
                                FusedBatchNorm.sideInput(inp["side"]))
    cf, _ = run_core(inp, "NHWC", "relu6", True)
    assert_bitwise_equal(fwd.y().numpy(), cf[0], "y")


# ---- Relu/Relu6 mask: recomputed from z (offset given) == read from y ------------------------

def _boundary_offsets():
    """z values at and beside 0 and 6 (where act(z) changes class), and non-finite ones."""
    vals = []
    for e in (np.float32(0.0), np.float32(6.0)):
        vals += [np.nextafter(e, np.float32(-1)), e, np.nextafter(e, np.float32(7))]
    vals += [-np.float32(0.0), np.float32(7.0), np.float32(-3.0), np.float32(np.inf),
             np.float32(-np.inf), np.float32(np.nan), np.float32(1e30), np.float32(1e-40)]
    return np.array(vals, np.float32)


@pytest.mark.parametrize("act", ["relu", "relu6"])
@pytest.mark.parametrize("fmt", ["NHWC", "NCHW"])
@pytest.mark.parametrize("side", [False, True], ids=["noside", "side"])
def test_relu_mask_recomputed_equals_mask_from_y(act, fmt, side):
    """Given the offset and no side input, the float CPU backward derives the Relu/Relu6 mask
    from z recomputed from x instead of reading y; it must equal the mask read from the
    forward's y bitwise, also for z at and beside 0 and 6 (inference with a = 1, so z = x +
    offset exactly) and on random training data. With a side input the mask is read from y
    whether or not the offset is given: the two calls must agree all the same. (16-bit types
    always read y: their y is rounded.)"""
    b = _boundary_offsets()
    C = b.size
    shape = (2, 3, 5, C) if fmt == "NHWC" else (2, C, 3, 5)
    rng = np.random.default_rng(3)
    x = np.zeros(shape, np.float32)  # z = offset exactly: epsilon 0.25, variance 0.75, scale 1
    x.flat[::7] = rng.standard_normal(x.size)[::7]
    dy = rng.standard_normal(shape).astype(np.float32)
    dy.flat[::5] = np.float32(np.nan)  # a masked-out NaN must not leak
    s = None
    if side:
        s = np.zeros(shape, np.float32)
        s.flat[::3] = rng.standard_normal(s.size)[::3]
    one, zero = np.ones(C, np.float32), np.zeros(C, np.float32)
    inp = inputs(fmt, "float32", side, True, seed=5)
    cases = [dict(x=x, dy=dy, side=s, scale=one, offset=b, mean=zero,
                  variance=np.full(C, 0.75, np.float32), eps=0.25, training=False),
             dict(x=inp["x"], dy=inp["dy"], side=inp["side"], scale=inp["scale"],
                  offset=inp["offset"], mean=None, variance=None, eps=EPS, training=True)]
    for case in cases:
        fwd = core.bn_forward(case["x"], case["scale"], case["offset"], case["mean"],
                              case["variance"], epsilon=case["eps"], data_format=fmt,
                              is_training=case["training"], activation=act,
                              side_input=case["side"])
        rs1, rs2 = ((fwd[3], fwd[4]) if case["training"] else (case["mean"], case["variance"]))
        common = dict(epsilon=case["eps"], data_format=fmt, is_training=case["training"],
                      activation=act, y=fwd[0], side_input=case["side"],
                      side_input_backprop=True)
        from_z = core.bn_grad(case["dy"], case["x"], case["scale"], rs1, rs2,
                              offset=case["offset"], **common)
        from_y = core.bn_grad(case["dy"], case["x"], case["scale"], rs1, rs2, **common)
        for name, got, want in zip(("dx", "dscale", "doffset", "dside"), from_z, from_y):
            assert_bitwise_equal(got, want, "%s (%s)" % (name, "train" if case["training"]
                                                        else "boundaries"))
        if not case["training"]:  # the boundary case reaches both classes (masked, passed)
            dz = np.asarray(from_z[3], np.float32)
            assert np.any(dz == 0) and np.any(np.isfinite(dz) & (dz != 0))


# ---- non-finite values ---------------------------------------------------------------------

def test_nan_and_inf_semantics():
    """act(NaN) = NaN in every mode; Relu/Relu6 masks are selects (a masked-out dy never
    reaches the result, whatever its value), Swish's derivative propagates NaN."""
    x = np.array([1.0, -1.0, np.nan, 2.0, 9.0, 0.5], np.float32).reshape(1, 1, 6, 1)
    one, zero = np.ones(1, np.float32), np.zeros(1, np.float32)
    dy = np.array([1, np.nan, 1, 1, np.inf, 1], np.float32).reshape(x.shape)
    for act in ("relu", "relu6", "swish"):
        y = core.bn_forward(x, one, zero, zero, one, epsilon=0.0, is_training=False,
                            activation=act)[0]
        assert np.isnan(y[0, 0, 2, 0])
        dx, _, _, dside = core.bn_grad(dy, x, one, zero, one, epsilon=0.0, is_training=False,
                                       activation=act, y=y, offset=zero,
                                       side_input=np.zeros_like(x), side_input_backprop=True)
        if act == "relu6":
            assert y[0, 0, 4, 0] == 6.0 and dx[0, 0, 4, 0] == 0.0  # inf dy masked at y == 6
        if act in ("relu", "relu6"):
            assert dx[0, 0, 1, 0] == 0.0 and dx[0, 0, 2, 0] == 0.0  # NaN dy / NaN y masked
        else:
            assert np.isnan(dx[0, 0, 1, 0]) and np.isnan(dx[0, 0, 2, 0])
        assert_bitwise_equal(dside, dx, "inference with scale 1, var 1, eps 0: dx == dz")


# ---- validation ----------------------------------------------------------------------------

def test_validation_errors_name_the_argument():
    inp = inputs("NHWC", "float32", True, True)
    x, sc, of = inp["x"], inp["scale"], inp["offset"]
    bad_side = np.zeros((3, 5, 6, 7), np.float32)
    with pytest.raises(ValueError, match="side_input must have the shape of x"):
        core.bn_forward(x, sc, of, side_input=bad_side)
    with pytest.raises(TypeError, match="side_input must have the dtype of x"):
        core.bn_forward(x, sc, of, side_input=x.astype(np.float16))
    with pytest.raises(ValueError, match="activation must be None or one of"):
        core.bn_forward(x, sc, of, activation="gelu")
    with pytest.raises(ValueError, match="activation_mode must be one of"):
        core._core.validate_forward([list(x.shape), [8], [8], [0], [0]], "NHWC", 1e-3, 1.0,
                                    True, "Gelu")
    with pytest.raises(tf.errors.InvalidArgumentError, match="side_input must have the shape"):
        _loader.raw_forward_ex_op(x=x, scale=sc, offset=of, mean=tf.zeros([0]),
                                  variance=tf.zeros([0]), side_input=[bad_side],
                                  activation_mode="Relu")
    with pytest.raises((tf.errors.InvalidArgumentError, TypeError, ValueError)):
        _loader.raw_forward_ex_op(x=tf.constant(x), scale=sc, offset=of, mean=tf.zeros([0]),
                                  variance=tf.zeros([0]),
                                  side_input=[tf.constant(x.astype(np.float16))])
    with pytest.raises((tf.errors.InvalidArgumentError, ValueError), match="activation_mode"):
        _loader.raw_forward_ex_op(x=x, scale=sc, offset=of, mean=tf.zeros([0]),
                                  variance=tf.zeros([0]), side_input=[],
                                  activation_mode="Gelu")
    fwd = core.bn_forward(x, sc, of, epsilon=EPS)
    grad_kw = dict(y_backprop=x, x=x, scale=sc, reserve_space_1=fwd[3], reserve_space_2=fwd[4],
                   reserve_space_3=tf.zeros([0]), y=x, epsilon=EPS)
    with pytest.raises(tf.errors.InvalidArgumentError, match="offset is required"):
        _loader.raw_grad_ex_op(offset=[], side_input=[], activation_mode="Swish", **grad_kw)
    with pytest.raises(tf.errors.InvalidArgumentError, match="offset must have shape"):
        _loader.raw_grad_ex_op(offset=[np.ones(3, np.float32)], side_input=[],
                               activation_mode="Swish", **grad_kw)
    with pytest.raises(tf.errors.InvalidArgumentError, match="side_input must have the shape"):
        _loader.raw_grad_ex_op(offset=[of], side_input=[bad_side], activation_mode="Swish",
                               **grad_kw)
    with pytest.raises(ValueError, match="offset is required"):
        core.bn_grad(x, x, sc, fwd[3], fwd[4], epsilon=EPS, activation="swish")
    with pytest.raises(ValueError, match="y .* is required"):
        core.bn_grad(x, x, sc, fwd[3], fwd[4], epsilon=EPS, activation="relu6")
    with pytest.raises(ValueError, match="side_input must have the shape"):
        fbn_grad_tf.fused_batch_norm(x, sc, of, side_input=bad_side)
    with pytest.raises(TypeError, match="side_input must have the dtype"):
        fbn_grad_tf.fused_batch_norm(x, sc, of, side_input=x.astype(np.float16))
    with pytest.raises(ValueError, match="activation must be None or one of"):
        fbn_grad_tf.fused_batch_norm(x, sc, of, activation="gelu")
    with pytest.raises(ValueError, match="activation must be None or one of"):
        fbn_grad_tf.FusedBatchNorm.activation("gelu")


def test_graphs_without_the_new_attrs_still_run():
    """An Ex node built the old way (no side input, no num_side_inputs/num_offsets attrs
    in the NodeDef) keeps working: the new attributes default to 0."""
    g = tf.Graph()
    with g.as_default():
        x = tf.constant(np.random.default_rng(0).standard_normal((2, 3, 3, 4)), tf.float32)
        out = _loader.raw_forward_ex_op(x=x, scale=tf.ones([4]), offset=tf.zeros([4]),
                                        mean=tf.zeros([0]), variance=tf.zeros([0]),
                                        side_input=[], activation_mode="Relu")
        gd = g.as_graph_def()
    for node in gd.node:
        node.attr.pop("num_side_inputs", None)
    g2 = tf.Graph()
    with g2.as_default():
        tf.graph_util.import_graph_def(gd, name="")
        with tf.compat.v1.Session(graph=g2) as sess:
            y = sess.run(g2.get_tensor_by_name(out[0].name))
    assert y.shape == (2, 3, 3, 4) and np.all(y >= 0)
