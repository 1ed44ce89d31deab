"""core.bn_grad_reduce / core.bn_grad_apply: the split backward's CPU entry points
(BnGradReduceCpu / BnGradApplyCpu, csrc/core/backward.h) through the NumPy binding.

Reduce followed by apply with the local sums and count is bitwise identical to core.bn_grad's
x_backprop (and reduce's sum_dy to its offset_backprop), on every CPU instruction-set path this
machine runs, with 1 and several threads, with and without the fused ReLU's mask (relu_y);
malformed inputs are refused with a ValueError naming the argument, as the TF split ops do.
No TensorFlow is needed (the core alone)."""
import itertools

import numpy as np
import pytest

from fbn_grad_tf import core

ISAS = [i for i in core.CPU_ISAS if core.cpu_supports(i)]
DTYPES = ["float32", "float16"] + (["bfloat16"] if core.bfloat16 is not None else [])
# (shape, data_format): row tasks (NHWC), plane tasks (NCHW, small and large planes), 5-D,
# one big enough for several threads (ThreadRunner splits from 64K elements), and empties.
SHAPES = [((2, 3, 4, 5), "NHWC"), ((3, 7, 5, 5), "NCHW"), ((2, 4, 33, 31), "NCHW"),
          ((2, 2, 3, 4, 3), "NDHWC"), ((1, 3, 2, 3, 4), "NCDHW"), ((4, 30, 30, 80), "NHWC"),
          ((2, 64, 24, 24), "NCHW"), ((0, 3, 3, 4), "NHWC"), ((2, 0, 3, 3), "NCHW")]


def _np_dtype(name):
    return core.bfloat16 if name == "bfloat16" else np.dtype(name)


def _bits(a):
    a = np.asarray(a)
    return a.view(np.uint16 if a.dtype.itemsize == 2 else np.uint32)


def _assert_bitwise(a, b, what):
    assert a.shape == b.shape, what
    assert np.array_equal(_bits(a), _bits(b)), "%s: not bitwise identical" % what


def _inputs(shape, fmt, dtype, seed=0):
    rng = np.random.default_rng(seed)
    c = shape[1] if fmt in ("NCHW", "NCDHW") else shape[-1]
    dt = _np_dtype(dtype)
    x = (rng.standard_normal(shape) * 2 + 0.5).astype(dt)
    dy = rng.standard_normal(shape).astype(dt)
    scale = rng.uniform(0.5, 1.5, c).astype(np.float32)
    offset = rng.uniform(-0.5, 0.5, c).astype(np.float32)
    return dy, x, scale, offset


@pytest.mark.parametrize("relu", [False, True], ids=["plain", "relu"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape,fmt", SHAPES, ids=["%s-%s" % (fmt, "x".join(map(str, s)))
                                                   for s, fmt in SHAPES])
def test_reduce_then_apply_is_bn_grad_bitwise(shape, fmt, dtype, relu):
    dy, x, scale, offset = _inputs(shape, fmt, dtype)
    eps = 1e-3
    y, _, _, mean, var = core.bn_forward(x, scale, offset, epsilon=eps, data_format=fmt,
                                         activation="relu" if relu else None)
    relu_y = y if relu else None
    big = x.size >= 65536
    for isa, threads in itertools.product(ISAS, (1, 4) if big else (1, 2)):
        kw = dict(data_format=fmt, num_threads=threads, isa=isa)
        dx, dscale, doffset = core.bn_grad(dy, x, scale, mean, var, epsilon=eps,
                                           relu_y=relu_y, **kw)
        sum_dy, sum_dy_xmu, count = core.bn_grad_reduce(dy, x, mean, relu_y=relu_y, **kw)
        channels = scale.shape[0]
        c_axis = 1 if fmt in ("NCHW", "NCDHW") else x.ndim - 1
        assert count == np.prod([d for i, d in enumerate(shape) if i != c_axis])
        assert sum_dy.dtype == sum_dy_xmu.dtype == np.float32
        assert sum_dy.shape == sum_dy_xmu.shape == (channels,)
        _assert_bitwise(sum_dy, doffset, "%s/%d sum_dy vs offset_backprop" % (isa, threads))
        dx2 = core.bn_grad_apply(dy, x, scale, mean, var, sum_dy, sum_dy_xmu, count,
                                 epsilon=eps, relu_y=relu_y, **kw)
        assert dx2.dtype == x.dtype
        _assert_bitwise(dx2, dx, "%s/%d apply(reduce) vs bn_grad x_backprop" % (isa, threads))


def test_apply_with_a_global_count_matches_formula():
    """Apply with sums 'all-reduced' over two identical replicas (sums doubled, count
    doubled) is the same x_backprop as the local one (the sums' ratios are unchanged)."""
    dy, x, scale, offset = _inputs((4, 5, 6, 7), "NHWC", "float32", seed=3)
    _, _, _, mean, var = core.bn_forward(x, scale, offset)
    s1, s2, n = core.bn_grad_reduce(dy, x, mean)
    local = core.bn_grad_apply(dy, x, scale, mean, var, s1, s2, n)
    doubled = core.bn_grad_apply(dy, x, scale, mean, var, 2 * s1, 2 * s2, 2 * n)
    np.testing.assert_allclose(doubled, local, rtol=1e-6, atol=1e-6)


def _reduce_args():
    dy, x, scale, offset = _inputs((2, 3, 4, 5), "NHWC", "float32")
    _, _, _, mean, var = core.bn_forward(x, scale, offset)
    return dy, x, scale, mean, var


@pytest.mark.parametrize("case,expect", [
    ("mean_size", "mean must have 5 elements"),
    ("mean_rank", "mean must be 1-dimensional, got shape [1,5]"),
    ("x_rank", "x must be 4-dimensional for data_format NHWC, got shape [3,4,5]"),
    ("dy_shape", "x and y_backprop must have the same shape"),
    ("format", "data_format must be one of"),
    ("dtype", "y_backprop and x must have the same dtype"),
    ("relu_y_shape", "relu_y must have the shape and dtype of x"),
    ("int_dtype", "must be float32, float16 or bfloat16"),
])
def test_reduce_refuses(case, expect):
    dy, x, scale, mean, var = _reduce_args()
    kw = {}
    if case == "mean_size":
        mean = mean[:3]
    elif case == "mean_rank":
        mean = mean[None]
    elif case == "x_rank":
        x = x[0]
    elif case == "dy_shape":
        dy = dy[:1]
    elif case == "format":
        kw["data_format"] = "NWHC"
    elif case == "dtype":
        dy = dy.astype(np.float16)
    elif case == "relu_y_shape":
        kw["relu_y"] = x[:1]
    elif case == "int_dtype":
        x, dy = x.astype(np.int32), dy.astype(np.int32)
    with pytest.raises((ValueError, TypeError)) as e:
        core.bn_grad_reduce(dy, x, mean, **kw)
    assert expect in str(e.value)


@pytest.mark.parametrize("case,expect", [
    ("scale_size", "scale must have 5 elements"),
    ("variance_size", "variance must have 5 elements"),
    ("sum_dy_size", "sum_dy must have 5 elements"),
    ("sum_dy_xmu_rank", "sum_dy_xmu must be 1-dimensional"),
    ("count_zero", "count must be a finite number >= 1"),
    ("count_half", "count must be a finite number >= 1"),
    ("count_negative", "count must be a finite number >= 1"),
    ("count_nan", "count must be a finite number >= 1"),
    ("count_inf", "count must be a finite number >= 1"),
    ("count_vector", "count must be a scalar, got shape [1]"),
    ("eps_negative", "epsilon must be a finite, non-negative number"),
    ("eps_nan", "epsilon must be a finite, non-negative number"),
    ("eps_overflow", "epsilon must be a finite, non-negative number"),
])
def test_apply_refuses(case, expect):
    dy, x, scale, mean, var = _reduce_args()
    s1, s2, n = core.bn_grad_reduce(dy, x, mean)
    eps = 1e-3
    if case == "scale_size":
        scale = scale[:4]
    elif case == "variance_size":
        var = np.zeros(6, np.float32)
    elif case == "sum_dy_size":
        s1 = s1[:0]
    elif case == "sum_dy_xmu_rank":
        s2 = s2.reshape(5, 1)
    elif case.startswith("count_"):
        n = {"count_zero": 0.0, "count_half": 0.5, "count_negative": -3.0,
             "count_nan": float("nan"), "count_inf": float("inf"),
             "count_vector": np.array([n], np.float32)}[case]
    else:
        eps = {"eps_negative": -1e-3, "eps_nan": float("nan"), "eps_overflow": 1e39}[case]
    with pytest.raises(ValueError) as e:
        core.bn_grad_apply(dy, x, scale, mean, var, s1, s2, n, epsilon=eps)
    assert expect in str(e.value)


def test_empty_x_skips_the_count_check():
    """As the TF op: with no elements there is nothing to divide, any count is accepted."""
    x = np.zeros((0, 2, 2, 3), np.float32)
    z = np.zeros(3, np.float32)
    s1, s2, n = core.bn_grad_reduce(x, x, z)
    assert n == 0 and np.array_equal(s1, z) and np.array_equal(s2, z)
    dx = core.bn_grad_apply(x, x, z + 1, z, z + 1, s1, s2, 0.0)
    assert dx.shape == x.shape


def test_device_arrays_are_refused_clearly():
    class FakeDevice:
        __cuda_array_interface__ = {}
    with pytest.raises(TypeError, match="CPU kernels only"):
        core.bn_grad_reduce(FakeDevice(), FakeDevice(), np.zeros(1, np.float32))
