"""Our op against TensorFlow's own tf.raw_ops.FusedBatchNormGradV3 on CPU.

Every dtype x data format x mode x shape class. In training mode the reserve spaces come
from TF's own forward op (batch mean and biased variance), in inference mode they are random
population statistics. TF's CPU kernel refuses some channels-first inference cases; those
are compared against TF on the transposed (channels-last) tensors (helpers.tf_reference).
"""
import zlib

import numpy as np
import pytest

tf = pytest.importorskip("tensorflow")

from helpers import (DTYPES, EPSILON, FORMATS, Case,  # noqa: E402
                     assert_outputs_close, make_inputs, make_shape, np_dtype, run_ours,
                     tf_reference)

# Shape classes (N, 2-D spatial, 3-D spatial, C); make_shape lays them out per format.
CASES = [
    Case("c3", 2, (5, 7), (3, 4, 5), 3),
    Case("c7", 3, (4, 4), (2, 2, 4), 7),
    Case("c1000", 2, (3, 3), (1, 3, 3), 1000),      # rows longer than one conversion segment
    Case("nhw1", 1, (1, 1), (1, 1, 1), 5),          # N*H*W = 1 (zero batch variance)
    Case("c1", 4, (6, 5), (2, 3, 5), 1),            # one channel: one contiguous plane
    Case("n0", 0, (3, 4), (2, 3, 4), 5),            # empty batch
    Case("planes", 2, (10, 10), (2, 8, 8), 3),      # channels-first planes >= 64 elements
    Case("pieces", 1, (129, 130), (2, 90, 93), 2),  # planes > 16384 elements: split planes
]

RESNET_SHAPES = [(8, 14, 14, 256), (4, 56, 56, 64)]  # NHWC; NCHW is the transpose


def seed_of(*parts):
    return zlib.crc32(repr(parts).encode())


def check_against_tf(inputs, dtype, fmt, training, epsilon=EPSILON):
    ours = run_ours(inputs, epsilon, fmt, training)
    ref = tf_reference(inputs, epsilon, fmt, training)
    assert ours[0].dtype == np.dtype(np_dtype(dtype))
    assert ours[0].shape == inputs.x.shape
    c = inputs.scale.shape[0]
    for out in ours[1:3]:
        assert out.dtype == np.float32 and out.shape == (c,)
    # reserve_space_4/5: empty [0] float tensors (TF's oneDNN path returns scalars: not
    # compared against TF).
    for out in ours[3:]:
        assert out.dtype == np.float32 and out.shape == (0,)
    assert_outputs_close(ours[:3], ref, inputs, dtype, "vs_tf", fmt, epsilon, training)
    return ours, ref


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
@pytest.mark.parametrize("training", [True, False], ids=["train", "infer"])
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_matches_tf(dtype, fmt, training, case):
    shape = make_shape(case, fmt)
    inputs = make_inputs(shape, fmt, dtype, training, seed=seed_of(dtype, fmt, training, case),
                         stats="tf")
    ours, _ = check_against_tf(inputs, dtype, fmt, training)
    if inputs.x.size:  # a test that compares zeros with zeros would prove nothing
        assert np.any(ours[0].astype(np.float32) != 0) or case.name == "nhw1"


@pytest.mark.parametrize("training", [True, False], ids=["train", "infer"])
@pytest.mark.parametrize("fmt", ["NHWC", "NCHW"])
@pytest.mark.parametrize("nhwc_shape", RESNET_SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_resnet_shapes_float32(nhwc_shape, fmt, training):
    n, h, w, c = nhwc_shape
    shape = nhwc_shape if fmt == "NHWC" else (n, c, h, w)
    inputs = make_inputs(shape, fmt, "float32", training, seed=seed_of(nhwc_shape, fmt),
                         stats="tf")
    check_against_tf(inputs, "float32", fmt, training)


@pytest.mark.parametrize("epsilon", [0.0, 1e-5, 1e-3, 0.5])
@pytest.mark.parametrize("training", [True, False], ids=["train", "infer"])
@pytest.mark.parametrize("fmt", ["NHWC", "NCDHW"])
def test_epsilon_values(fmt, training, epsilon):
    case = Case("eps", 3, (4, 5), (2, 4, 5), 6)
    shape = make_shape(case, fmt)
    inputs = make_inputs(shape, fmt, "float32", training, seed=seed_of(fmt, epsilon),
                         stats="tf")
    check_against_tf(inputs, "float32", fmt, training, epsilon)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("fmt", FORMATS)
def test_training_uses_saved_statistics_as_given(dtype, fmt):
    """Training mode must use reserve_space_1/2 as passed, not recompute them from x."""
    shape = make_shape(Case("s", 2, (4, 6), (2, 3, 4), 5), fmt)
    inputs = make_inputs(shape, fmt, dtype, training=False, seed=seed_of("given", fmt))
    check_against_tf(inputs, dtype, fmt, training=True)


@pytest.mark.parametrize("training", [True, False], ids=["train", "infer"])
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("zero_axis", ["batch", "spatial"])
def test_empty_input(dtype, fmt, training, zero_axis):
    case = (Case("n0", 0, (3, 4), (2, 3, 4), 5) if zero_axis == "batch"
            else Case("h0", 2, (0, 4), (2, 0, 4), 5))
    shape = make_shape(case, fmt)
    inputs = make_inputs(shape, fmt, dtype, training, seed=1)
    # Non-trivial statistics: the outputs must be zeros regardless.
    inputs = inputs._replace(rs1=np.full(5, 3.0, np.float32), rs2=np.full(5, 0.5, np.float32))
    dx, dscale, doffset, rs4, rs5 = run_ours(inputs, EPSILON, fmt, training)
    assert dx.shape == shape and dx.dtype == np.dtype(np_dtype(dtype))
    np.testing.assert_array_equal(dscale, np.zeros(5, np.float32))
    np.testing.assert_array_equal(doffset, np.zeros(5, np.float32))
    assert rs4.shape == (0,) and rs5.shape == (0,)
    ref = tf_reference(inputs, EPSILON, fmt, training)
    assert ref[0].shape == shape
    np.testing.assert_array_equal(dscale, ref[1])
    np.testing.assert_array_equal(doffset, ref[2])


@pytest.mark.parametrize("fmt", FORMATS)
def test_zero_channels(fmt):
    shape = make_shape(Case("c0", 2, (3, 4), (2, 3, 4), 0), fmt)
    inputs = make_inputs(shape, fmt, "float32", True, seed=2)
    dx, dscale, doffset, _, _ = run_ours(inputs, EPSILON, fmt, True)
    assert dx.shape == shape and dscale.shape == (0,) and doffset.shape == (0,)


def test_non_finite_inputs_propagate_like_tf():
    """A NaN/inf in one channel's data poisons that channel only, as in TF."""
    fmt = "NHWC"
    inputs = make_inputs((2, 3, 4, 4), fmt, "float32", True, seed=3, stats="tf")
    x = inputs.x.copy()
    x[0, 0, 0, 1] = np.nan
    dy = inputs.dy.copy()
    dy[1, 2, 3, 2] = np.inf
    inputs = inputs._replace(x=x, dy=dy)
    for training in (True, False):
        ours = run_ours(inputs, EPSILON, fmt, training)
        ref = tf_reference(inputs, EPSILON, fmt, training)
        for o, r in zip(ours[:3], ref):
            np.testing.assert_array_equal(np.isfinite(o), np.isfinite(r))
        assert np.all(np.isfinite(ours[0][..., [0, 3]]))
