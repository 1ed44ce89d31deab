"""Our forward op ("FbnGrad>FusedBatchNormV3", "FbnGrad>FusedBatchNormEx") and its core.

Oracles: TF's own tf.raw_ops.FusedBatchNormV3 on CPU for every dtype x format x mode x
shape class, and a float64 reference (the same formulas in float64 on the quantized input)
for what TF does not answer or answers less precisely (large-mean data, the fused ReLU).
"""
import zlib

import numpy as np
import pytest

from helpers import (DTYPES, FORMATS, Case, assert_bitwise_equal, channel_axis,  # noqa: E402
                     make_shape, np_dtype, reduce_axes)

tf = pytest.importorskip("tensorflow")
import fbn_grad_tf  # noqa: E402
from fbn_grad_tf import _loader, core  # noqa: E402

EPS = 1e-3
CASES = [
    Case("c3", 2, (5, 7), (3, 4, 5), 3),
    Case("c1000", 2, (3, 3), (1, 3, 3), 1000),      # rows longer than one conversion segment
    Case("nhw1", 1, (1, 1), (1, 1, 1), 5),          # one element per channel: var 0, M-1 = 0
    Case("c1", 4, (6, 5), (2, 3, 5), 1),            # one channel: one contiguous plane
    Case("small_planes", 3, (2, 3), (1, 2, 3), 4),  # channels-first planes < 16 elements
    Case("planes", 2, (10, 10), (2, 8, 8), 3),      # channels-first planes >= 16 elements
    Case("pieces", 1, (129, 130), (2, 90, 93), 2),  # planes > 16384 elements: split planes
]
MODES = [("train", True, 1.0), ("train_avg", True, 0.3), ("infer", False, 1.0)]
# |ours - reference| <= RTOL * |reference| + ATOL * (per-tensor magnitude): one ulp of the
# output type, plus float32 rounding of the intermediate (x - mean) * a.
Y_RTOL = {"float32": 2e-6, "float16": 2.0 ** -10, "bfloat16": 2.0 ** -7}
Y_ATOL = {"float32": 2e-6, "float16": 2.0 ** -12, "bfloat16": 2.0 ** -9}


def seed_of(*parts):
    return zlib.crc32(repr(parts).encode())


def make_forward_inputs(shape, fmt, dtype, seed, mean_offset=0.5, x_scale=2.0):
    rng = np.random.default_rng(seed)
    c = shape[channel_axis(fmt)]
    x = (mean_offset + x_scale * rng.standard_normal(shape)).astype(np.float32)
    x = x.astype(np_dtype(dtype))
    scale = rng.uniform(0.5, 1.5, c).astype(np.float32)
    offset = rng.standard_normal(c).astype(np.float32)
    mean = (mean_offset + 0.3 * rng.standard_normal(c)).astype(np.float32)
    var = (x_scale ** 2 * rng.uniform(0.5, 2.0, c)).astype(np.float32)
    return x, scale, offset, mean, var


def forward_float64(x, scale, offset, mean, var, fmt, training, factor, relu=False, eps=EPS):
    """FusedBatchNormV3 in float64: (y, batch_mean, batch_variance, saved_mean, saved_var)."""
    x64 = np.asarray(x, np.float64)
    axes = reduce_axes(fmt)
    shape = [1] * x.ndim
    shape[channel_axis(fmt)] = -1
    c = scale.shape[0]
    if training:
        m_count = x64.size // max(c, 1)
        mu, v = x64.mean(axis=axes), x64.var(axis=axes)
        unbiased = v * m_count / max(m_count - 1, 1)
        if factor == 1.0:
            batch_mean, batch_var = mu, unbiased
        else:
            batch_mean = (1 - factor) * mean.astype(np.float64) + factor * mu
            batch_var = (1 - factor) * var.astype(np.float64) + factor * unbiased
        saved = (mu, v)
    else:
        mu, v = mean.astype(np.float64), var.astype(np.float64)
        batch_mean, batch_var = mu, v
        saved = (mu, v)
    a = scale.astype(np.float64) / np.sqrt(v + eps)
    y = (x64 - mu.reshape(shape)) * a.reshape(shape) + offset.astype(np.float64).reshape(shape)
    if relu:
        y = np.maximum(y, 0)
    return y, batch_mean, batch_var, saved[0], saved[1]


def assert_y_close(actual, expected, dtype, what="y"):
    a = np.asarray(actual, np.float64)
    e = np.asarray(expected, np.float64)
    assert a.shape == e.shape
    if a.size == 0:
        return
    mag = float(np.max(np.abs(e)))
    bound = Y_RTOL[dtype] * np.abs(e) + Y_ATOL[dtype] * mag
    err = np.abs(a - e)
    assert np.all(err <= bound), "%s: max error %g (bound there %g)" % (
        what, float(np.max(err)), float(bound.flat[int(np.argmax(err - bound))]))


def assert_stats_close(actual, expected, scale, what, rtol=1e-5):
    a = np.asarray(actual, np.float64)
    e = np.asarray(expected, np.float64)
    assert a.shape == e.shape, what
    assert np.all(np.abs(a - e) <= rtol * (np.abs(e) + scale)), "%s: %s vs %s" % (what, a, e)


def run_op(x, scale, offset, mean, var, fmt, training, factor, activation=None, op=None):
    kw = dict(x=tf.constant(x), scale=tf.constant(scale), offset=tf.constant(offset),
              mean=tf.constant(mean), variance=tf.constant(var), epsilon=EPS,
              exponential_avg_factor=factor, data_format=fmt, is_training=training)
    if op is not None:
        return [t.numpy() for t in op(**kw)]
    return [t.numpy() for t in fbn_grad_tf.fused_batch_norm_v3(activation=activation, **kw)]


# ---- against TF's FusedBatchNormV3 and float64 ---------------------------------------------

@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
@pytest.mark.parametrize("mode", MODES, ids=[m[0] for m in MODES])
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_matches_tf_and_float64(dtype, fmt, mode, case):
    _, training, factor = mode
    shape = make_shape(case, fmt)
    x, scale, offset, mean, var = make_forward_inputs(shape, fmt, dtype,
                                                      seed_of(dtype, fmt, mode, case))
    if training and factor == 1.0:  # TF's convention: the running stats may be empty
        mean = var = np.zeros(0, np.float32)
    ours = run_op(x, scale, offset, mean, var, fmt, training, factor)
    assert ours[0].dtype == x.dtype and ours[0].shape == x.shape
    for out in ours[1:5]:
        assert out.dtype == np.float32 and out.shape == scale.shape
    assert ours[5].shape == (0,)

    ref = forward_float64(x, scale, offset, mean, var, fmt, training, factor)
    std = np.sqrt(np.asarray(ref[4], np.float64))
    assert_y_close(ours[0], ref[0], dtype, "y vs float64")
    assert_stats_close(ours[1], ref[1], std, "batch_mean vs float64")
    assert_stats_close(ours[2], ref[2], 0.0, "batch_variance vs float64")
    assert_stats_close(ours[3], ref[3], std, "reserve_space_1 vs float64")
    assert_stats_close(ours[4], ref[4], 0.0, "reserve_space_2 vs float64")

    try:
        theirs = run_op(x, scale, offset, mean, var, fmt, training, factor,
                        op=tf.raw_ops.FusedBatchNormV3)
    except tf.errors.InvalidArgumentError:  # TF's CPU kernel refuses some cases
        return
    assert_y_close(ours[0], np.asarray(theirs[0], np.float64), dtype, "y vs TF")
    assert_stats_close(ours[1], theirs[1], std, "batch_mean vs TF")
    assert_stats_close(ours[2], theirs[2], 0.0, "batch_variance vs TF")
    if training:  # in inference TF leaves 5-D reserve spaces uninitialized
        assert_stats_close(ours[3], theirs[3], std, "reserve_space_1 vs TF")
        assert_stats_close(ours[4], theirs[4], 0.0, "reserve_space_2 vs TF")


@pytest.mark.parametrize("fmt", ["NHWC", "NCHW"])
@pytest.mark.parametrize("shape_nhwc", [(16, 20, 20, 8), (2, 130, 130, 3)])
def test_large_mean_is_exact_where_naive_sums_fail(fmt, shape_nhwc):
    """Mean 1e4, std 1: E[x^2] - E[x]^2 in float32 loses every digit of the variance; the
    block-shifted sums + Chan merge keep it to float32 precision."""
    shape = shape_nhwc if fmt == "NHWC" else (shape_nhwc[0], shape_nhwc[3]) + shape_nhwc[1:3]
    x, scale, offset, _, _ = make_forward_inputs(shape, fmt, "float32", 7, mean_offset=1e4,
                                                 x_scale=1.0)
    empty = np.zeros(0, np.float32)
    ours = run_op(x, scale, offset, empty, empty, fmt, True, 1.0)
    ref = forward_float64(x, scale, offset, empty, empty, fmt, True, 1.0)
    assert_stats_close(ours[4], ref[4], 0.0, "biased variance", rtol=1e-5)
    assert_stats_close(ours[2], ref[2], 0.0, "batch_variance", rtol=1e-5)
    assert np.all(np.abs(ours[1] - ref[1]) <= 1e-6 * 1e4), "batch_mean"
    # y: (x - mean) has only the few significant bits a float32 x near 1e4 carries.
    assert np.max(np.abs(ours[0] - ref[0])) < 2e-3
    # The naive one-pass formula on the same float32 data is far off (the test's premise).
    xs = x.reshape(-1, shape[channel_axis(fmt)]) if fmt == "NHWC" else \
        np.moveaxis(x, 1, -1).reshape(-1, shape[1])
    naive = (xs * xs).mean(axis=0, dtype=np.float32) - xs.mean(axis=0, dtype=np.float32) ** 2
    assert np.max(np.abs(naive / ref[4] - 1)) > 1e-2


def test_empty_batch_matches_tf():
    """Batch statistics as TF's; zero reserve spaces, as TF's oneDNN kernel gives them. TF's
    Eigen kernel (TF's default where oneDNN is off) returns before it writes its
    reserve spaces, so theirs hold whatever the allocator had (seen: 3e-41, -4e+32)."""
    from tensorflow.python.util import _pywrap_util_port
    tf_zeroes_reserve = bool(_pywrap_util_port.IsMklEnabled())
    x = np.zeros((0, 3, 4, 5), np.float32)
    c = np.ones(5, np.float32)
    for training, factor in [(True, 1.0), (True, 0.5), (False, 1.0)]:
        stats = np.zeros(0, np.float32) if training and factor == 1.0 else c
        ours = run_op(x, c, c, stats, stats, "NHWC", training, factor)
        theirs = run_op(x, c, c, stats, stats, "NHWC", training, factor,
                        op=tf.raw_ops.FusedBatchNormV3)
        assert ours[0].shape == x.shape
        for a, b in zip(ours[1:3], theirs[1:3]):
            np.testing.assert_array_equal(a, b)  # NaN batch statistics (training)
        for a, b in zip(ours[3:5], theirs[3:5]):
            np.testing.assert_array_equal(a, np.zeros_like(a))
            if tf_zeroes_reserve:
                np.testing.assert_array_equal(a, b)


# ---- determinism ------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("fmt,shape", [("NHWC", (8, 30, 30, 24)), ("NCHW", (3, 5, 140, 131)),
                                       ("NCHW", (6, 7, 9, 9)), ("NCHW", (40, 9, 2, 3))])
def test_bitwise_identical_for_any_threads_and_isa(dtype, fmt, shape):
    x, scale, offset, mean, var = make_forward_inputs(shape, fmt, dtype, 3)
    runs = [core.bn_forward(x, scale, offset, mean, var, EPS, 0.3, fmt, True,
                            activation="relu", num_threads=t, isa=isa)
            for t in (1, 2, 3) for isa in core.CPU_ISAS
            if core.cpu_supports(isa)]
    for other in runs[1:]:
        for a, b, name in zip(runs[0], other, ["y", "mean", "var", "saved_mean", "saved_var"]):
            assert_bitwise_equal(a, b, name)


# Channels-last rows are swept in vectors of 16 channels, several rows at a time on some
# paths, with masked or scalar last channels and single last rows; the normalize pass is in
# vectors for every activation but Swish. Channel counts with a remainder (7: no whole
# vector; 40; 264: wide rows) and row counts that leave single rows at each block's end,
# every activation, with and without a side input, training and inference.
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(3, 5, 7, 40), (2, 3, 5, 7), (2, 7, 9, 264)])
@pytest.mark.parametrize("activation", [None, "relu", "relu6", "swish"])
@pytest.mark.parametrize("side", [False, True], ids=["noside", "side"])
@pytest.mark.parametrize("training", [True, False], ids=["train", "infer"])
def test_channels_last_bitwise_identical_across_isas(dtype, shape, activation, side, training):
    x, scale, offset, mean, var = make_forward_inputs(shape, "NHWC", dtype, 5)
    side_input = (np.random.default_rng(6).standard_normal(shape).astype(np.float32)
                  .astype(x.dtype) if side else None)
    runs = [core.bn_forward(x, scale, offset, mean, var, EPS, 1.0, "NHWC", training,
                            activation=activation, side_input=side_input, num_threads=t, isa=isa)
            for t in (1, 2) for isa in core.CPU_ISAS if core.cpu_supports(isa)]
    for other in runs[1:]:
        for a, b, name in zip(runs[0], other, ["y", "mean", "var", "saved_mean", "saved_var"]):
            assert_bitwise_equal(a, b, name)
    # And right (every path shares these loops): against float64.
    y, batch_mean, batch_var, saved_mean, saved_var = forward_float64(
        x, scale, offset, mean, var, "NHWC", training, 1.0)
    assert_stats_close(runs[0][1], batch_mean, 1.0, "batch_mean")
    assert_stats_close(runs[0][2], batch_var, 1.0, "batch_variance", rtol=1e-4)
    if side:
        y = y + np.asarray(side_input, np.float64)
    if activation == "relu":
        y = np.maximum(y, 0.0)
    elif activation == "relu6":
        y = np.clip(y, 0.0, 6.0)
    elif activation == "swish":
        y = y / (1.0 + np.exp(-y))
    assert_y_close(runs[0][0], y, dtype)


# ---- fused ReLU ---------------------------------------------------------------------------------

@pytest.mark.parametrize("training", [True, False], ids=["train", "infer"])
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_relu_forward_and_backward(dtype, fmt, training):
    case = Case("relu", 3, (6, 7), (2, 3, 7), 5)
    shape = make_shape(case, fmt)
    x, scale, offset, mean, var = make_forward_inputs(shape, fmt, dtype, seed_of(dtype, fmt))
    ours = run_op(x, scale, offset, mean, var, fmt, training, 1.0, activation="relu")
    plain = run_op(x, scale, offset, mean, var, fmt, training, 1.0)
    ref = forward_float64(x, scale, offset, mean, var, fmt, training, 1.0, relu=True)
    assert_y_close(ours[0], ref[0], dtype, "relu y vs float64")
    # Same bits as the plain forward where positive, 0 elsewhere.
    expect = np.where(plain[0].astype(np.float32) > 0, plain[0], np.zeros_like(plain[0]))
    assert_bitwise_equal(ours[0], expect.astype(plain[0].dtype), "relu y")
    for a, b in zip(ours[1:5], plain[1:5]):
        assert_bitwise_equal(a, b, "statistics")
    # The backward masks y_backprop with y > 0 inside the kernel: equal to the plain
    # backward of the masked gradient.
    rng = np.random.default_rng(1)
    dy = rng.standard_normal(shape).astype(np.float32).astype(x.dtype)
    rs1, rs2 = (ours[3], ours[4]) if training else (mean, var)
    got = _loader.raw_grad_ex_op(
        y_backprop=dy, x=x, scale=scale, reserve_space_1=rs1, reserve_space_2=rs2,
        reserve_space_3=np.zeros(0, np.float32), y=ours[0], offset=[], side_input=[],
        epsilon=EPS, data_format=fmt, is_training=training, activation_mode="Relu")
    masked = np.where(ours[0].astype(np.float32) > 0, dy, np.zeros_like(dy))
    want = fbn_grad_tf.fused_batch_norm_grad(masked, x, scale, rs1, rs2,
                                             np.zeros(0, np.float32), EPS, fmt, training)
    for a, b, name in zip(got[:3], want[:3], ["dx", "dscale", "doffset"]):
        assert_bitwise_equal(a.numpy(), b.numpy(), name)
    # Core path (no TF) gives the same bits.
    dx_core = core.bn_grad(dy, x, scale, rs1, rs2, EPS, fmt, training, relu_y=ours[0])[0]
    assert_bitwise_equal(dx_core, got[0].numpy(), "core dx")


def test_relu_keeps_nan_and_masks_nan_gradient():
    x = np.array([1.0, -1.0, np.nan, 2.0, -2.0, 0.5], np.float32).reshape(1, 1, 6, 1)
    one, zero = np.ones(1, np.float32), np.zeros(1, np.float32)
    y = run_op(x, one, zero, one, one, "NHWC", False, 1.0, activation="relu")[0]
    assert np.isnan(y[0, 0, 2, 0]) and np.all(y[0, 0, [1, 4], 0] == 0)
    dy = np.array([1, np.nan, 1, 1, np.inf, 1], np.float32).reshape(x.shape)
    dx = core.bn_grad(dy, x, one, one, one, EPS, "NHWC", False,
                      relu_y=np.nan_to_num(y, nan=1.0))[0]
    # Masked-out positions (y <= 0) get 0 even where dy is NaN or inf.
    assert dx[0, 0, 1, 0] == 0 and dx[0, 0, 4, 0] == 0 and np.all(np.isfinite(dx))


# ---- validation ---------------------------------------------------------------------------------

@pytest.mark.parametrize("bad,match", [
    (dict(x=np.zeros((2, 3, 4), np.float32)), "4-dimensional"),
    (dict(scale=np.ones(4, np.float32)), "scale must have 3 elements"),
    (dict(offset=np.ones((3, 1), np.float32)), "offset must be 1-dimensional"),
    (dict(mean=np.zeros(0, np.float32), is_training=False), "mean must have 3 elements"),
    (dict(variance=np.zeros(0, np.float32), exponential_avg_factor=0.5),
     "variance must have 3 elements"),
    (dict(epsilon=-1.0), "epsilon"),
    (dict(exponential_avg_factor=float("nan")), "exponential_avg_factor"),
    (dict(mean=np.zeros((3, 1), np.float32)), "mean must be 1-dimensional"),
])
def test_bad_inputs_raise_clear_errors(bad, match):
    kw = dict(x=np.zeros((2, 2, 2, 3), np.float32), scale=np.ones(3, np.float32),
              offset=np.zeros(3, np.float32), mean=np.zeros(3, np.float32),
              variance=np.ones(3, np.float32), epsilon=EPS, exponential_avg_factor=1.0,
              data_format="NHWC", is_training=True)
    kw.update(bad)
    with pytest.raises(tf.errors.InvalidArgumentError, match=match):  # the kernel's check
        _loader.raw_forward_op(**kw)
    with pytest.raises((ValueError, tf.errors.InvalidArgumentError), match=match):
        fbn_grad_tf.fused_batch_norm_v3(**kw)  # checked before building the op
    core_kw = {("variance" if k == "variance" else k): v for k, v in kw.items()}
    with pytest.raises(ValueError, match=match):
        core.bn_forward(**core_kw)


@pytest.mark.parametrize("unread", [
    dict(mean=np.zeros(5, np.float32), variance=np.ones(2, np.float32)),   # any length
    dict(is_training=False, exponential_avg_factor=float("nan")),          # factor unread
    dict(is_training=False, exponential_avg_factor=float("inf")),
])
def test_inputs_tf_does_not_read_are_accepted_as_by_tf(unread):
    """What TF's FusedBatchNormV3 does not read, it does not check: the running statistics in
    training with exponential_avg_factor == 1 need only be vectors, and the factor in
    inference may be anything. Ours accepts the same and gives TF's results."""
    rng = np.random.default_rng(5)
    kw = dict(x=rng.standard_normal((2, 3, 3, 3)).astype(np.float32),
              scale=np.ones(3, np.float32), offset=np.zeros(3, np.float32),
              mean=np.full(3, 0.2, np.float32), variance=np.full(3, 1.5, np.float32),
              epsilon=EPS, exponential_avg_factor=1.0, data_format="NHWC", is_training=True)
    kw.update(unread)
    ref = tf.raw_ops.FusedBatchNormV3(**kw)
    for out in (_loader.raw_forward_op(**kw), fbn_grad_tf.fused_batch_norm_v3(**kw),
                core.bn_forward(**kw)):
        for a, b in zip(out[:3], ref[:3]):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)


def test_core_forward_names_x_in_a_dtype_error():
    with pytest.raises(TypeError, match="^x must be float32, float16 or bfloat16, got float64"):
        core.bn_forward(np.zeros((2, 3, 4, 5)), np.ones(5, np.float32), np.zeros(5, np.float32))


# ---- mixing forwards and backwards --------------------------------------------------------------

@pytest.mark.parametrize("fmt", ["NHWC", "NCHW"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_tf_backward_reads_our_reserve_spaces(dtype, fmt):
    shape = make_shape(Case("mix", 4, (5, 6), (2, 3, 4), 6), fmt)
    x, scale, offset, _, _ = make_forward_inputs(shape, fmt, dtype, 11)
    empty = np.zeros(0, np.float32)
    ours = run_op(x, scale, offset, empty, empty, fmt, True, 1.0)
    theirs = run_op(x, scale, offset, empty, empty, fmt, True, 1.0,
                    op=tf.raw_ops.FusedBatchNormV3)
    dy = np.random.default_rng(2).standard_normal(shape).astype(np.float32).astype(x.dtype)

    def tf_grad(rs1, rs2):
        return tf.raw_ops.FusedBatchNormGradV3(
            y_backprop=dy, x=x, scale=scale, reserve_space_1=rs1, reserve_space_2=rs2,
            reserve_space_3=empty, epsilon=EPS, data_format=fmt, is_training=True)[:3]

    a, b = tf_grad(ours[3], ours[4]), tf_grad(theirs[3], theirs[4])
    rtol = {"float32": 1e-4, "float16": 2e-2, "bfloat16": 5e-2}[dtype]
    for p, q in zip(a, b):
        p = tf.cast(p, tf.float32).numpy()
        q = tf.cast(q, tf.float32).numpy()
        assert np.max(np.abs(p - q)) <= rtol * (np.max(np.abs(q)) + 1e-3)


# ---- Python API ---------------------------------------------------------------------------------

def test_java_style_wrapper_eager_function_and_graph():
    FBN = fbn_grad_tf.FusedBatchNorm
    assert FBN.OP_NAME == "FbnGrad>FusedBatchNormV3" and FBN.MIRRORED_OP_NAME == "FusedBatchNormV3"
    x, scale, offset, mean, var = make_forward_inputs((4, 3, 3, 2), "NHWC", "float32", 5)
    opts = [FBN.epsilon(EPS), FBN.exponentialAvgFactor(0.25), FBN.dataFormat("NHWC"),
            FBN.isTraining(True)]
    eager = FBN.create(fbn_grad_tf.Scope(), x, scale, offset, mean, var, *opts)
    assert eager.op is None and len(eager) == 6
    ref = forward_float64(x, scale, offset, mean, var, "NHWC", True, 0.25)
    assert_y_close(eager.y().numpy(), ref[0], "float32")
    assert_stats_close(eager.batchMean().numpy(), ref[1], 1.0, "batch_mean")
    assert_stats_close(eager.batch_variance().numpy(), ref[2], 0.0, "batch_variance")
    assert eager.reserveSpace3().shape == (0,)

    @tf.function
    def fn(x):
        return FBN.create(None, x, scale, offset, mean, var, *opts).y()

    np.testing.assert_array_equal(fn(tf.constant(x)).numpy(), eager.y().numpy())
    g = tf.Graph()
    with g.as_default():
        op = FBN.create(fbn_grad_tf.Scope(g).with_name("bn"), tf.constant(x), scale, offset,
                        mean, var, *opts, FBN.activation("relu"))
        assert op.op.type == "FbnGrad>FusedBatchNormEx" and op.op.name == "bn"
    with pytest.raises(TypeError):
        FBN.create(None, x, scale, offset, mean, var, fbn_grad_tf.FusedBatchNormGrad.epsilon(1))


@pytest.mark.parametrize("activation", [None, "relu"])
@pytest.mark.parametrize("training", [True, False], ids=["train", "infer"])
def test_fused_batch_norm_ours_matches_tf_forward_with_gradients(activation, training):
    x, scale, offset, mean, var = make_forward_inputs((4, 6, 6, 8), "NHWC", "float32", 9)
    dy = tf.constant(np.random.default_rng(3).standard_normal(x.shape).astype(np.float32))
    stats = {} if training else dict(mean=mean, variance=var)

    def step(forward):
        xs, ss, os_ = tf.constant(x), tf.constant(scale), tf.constant(offset)
        with tf.GradientTape() as tape:
            tape.watch([xs, ss, os_])
            y, m, v = fbn_grad_tf.fused_batch_norm(xs, ss, os_, epsilon=EPS,
                                                   is_training=training, activation=activation,
                                                   forward=forward, **stats)
            loss = tf.reduce_sum(y * dy)
        return [y, m, v] + tape.gradient(loss, [xs, ss, os_])

    step_fn = tf.function(step)
    ours, theirs = step("ours"), step("tf")
    for a, b in zip(ours, theirs):
        np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=2e-4, atol=2e-4)
    types = {op.type for op in step_fn.get_concrete_function("ours").graph.get_operations()}
    fwd = "FbnGrad>FusedBatchNormEx" if activation else "FbnGrad>FusedBatchNormV3"
    grad = "FbnGrad>FusedBatchNormGradEx" if activation else "FbnGrad>FusedBatchNormGradV3"
    assert fwd in types and grad in types and "FusedBatchNormV3" not in types


def test_second_derivative_through_fused_relu():
    x, scale, offset, _, _ = make_forward_inputs((2, 3, 3, 4), "NHWC", "float32", 13)
    xs = tf.constant(x.astype(np.float64).astype(np.float32))

    def loss(forward):
        with tf.GradientTape() as outer:
            outer.watch(xs)
            with tf.GradientTape() as inner:
                inner.watch(xs)
                y = fbn_grad_tf.fused_batch_norm(xs, scale, offset, epsilon=EPS,
                                                 activation="relu", forward=forward)[0]
                first = tf.reduce_sum(y * y)
            g = inner.gradient(first, xs)
            second = tf.reduce_sum(g * g)
        return outer.gradient(second, xs)

    np.testing.assert_allclose(loss("ours").numpy(), loss("tf").numpy(), rtol=1e-3, atol=1e-3)


def test_bad_forward_and_activation_arguments():
    x = np.zeros((1, 1, 1, 2), np.float32)
    with pytest.raises(ValueError, match="forward"):
        fbn_grad_tf.fused_batch_norm(x, np.ones(2), np.zeros(2), forward="cudnn")
    with pytest.raises(ValueError, match="activation"):
        fbn_grad_tf.fused_batch_norm(x, np.ones(2), np.zeros(2), activation="gelu")
