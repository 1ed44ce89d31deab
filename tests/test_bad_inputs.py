"""Every error path, through the Python API (ValueError / TypeError before anything runs, in
eager mode and while tracing a tf.function) and through the raw generated wrapper
fbn_grad_tf.raw_op (the kernel's own validation: tf.errors.InvalidArgumentError naming the
argument). Nothing may crash the process; reserve_space_3 of any shape is accepted."""
import numpy as np
import pytest

tf = pytest.importorskip("tensorflow")

import fbn_grad_tf  # noqa: E402
from fbn_grad_tf import raw_op  # noqa: E402
from helpers import assert_bitwise_equal, make_inputs, run_ours  # noqa: E402

IAE = tf.errors.InvalidArgumentError
ARG_NAMES = ("y_backprop", "x", "scale", "reserve_space_1", "reserve_space_2",
             "reserve_space_3")
F32 = np.float32


def base_args():
    """Valid NHWC [2, 3, 4, 5] float32 arguments, as keyword arguments of raw_op."""
    inputs = make_inputs((2, 3, 4, 5), "NHWC", "float32", True, seed=51)
    args = dict(zip(ARG_NAMES, inputs))
    args.update(epsilon=1e-4, data_format="NHWC", is_training=True)
    return args


def shaped(shape, dtype=F32):
    return np.random.default_rng(0).standard_normal(shape).astype(dtype)


def both(shape, dtype=F32):
    return dict(y_backprop=shaped(shape, dtype), x=shaped(shape, dtype))


# name -> (changes to base_args, Python API (exception, regex), raw_op (exception, regex)).
# Regexes name the offending argument. For dtype errors the raw wrapper reports TF's own
# attr/input type checks (it names the attr, or the input index).
CASES = {
    "data_format-unknown": (dict(data_format="NXHW"), (ValueError, "data_format"),
                            (IAE, "data_format")),
    "data_format-lowercase": (dict(data_format="nhwc"), (ValueError, "data_format"),
                              (IAE, "data_format")),
    "data_format-2d-only-V2-name": (dict(data_format="NCW"), (ValueError, "data_format"),
                                    (IAE, "data_format")),
    "data_format-not-a-string": (dict(data_format=4), (TypeError, "data_format"),
                                 (TypeError, "data_format")),
    "dtype-int32": (both((2, 3, 4, 5), np.int32), (TypeError, "y_backprop must have dtype"),
                    (IAE, "attr 'T'")),
    "dtype-float64": (both((2, 3, 4, 5), np.float64), (TypeError, "y_backprop must have dtype"),
                      (IAE, "attr 'T'")),
    "dtype-x-float64-only": (dict(x=shaped((2, 3, 4, 5), np.float64)),
                             (TypeError, "x must have dtype"), (IAE, "input #1|attr 'T'")),
    "dtype-dy-x-mismatch": (dict(x=shaped((2, 3, 4, 5), np.float16)),
                            (TypeError, "same dtype"), (IAE, "input #1")),
    "dtype-scale-float16": (dict(scale=shaped(5, np.float16)), (TypeError, "scale"),
                            (IAE, "input #2")),
    "dtype-rs1-float64": (dict(reserve_space_1=shaped(5, np.float64)),
                          (TypeError, "reserve_space_1"), (IAE, "attr 'U'")),
    "dtype-rs2-bfloat16": (dict(reserve_space_2=shaped(5).astype(tf.bfloat16.as_numpy_dtype)),
                           (TypeError, "reserve_space_2"), (IAE, "attr 'U'|input #4")),
    "dtype-rs3-float16": (dict(reserve_space_3=shaped(0, np.float16)),
                          (TypeError, "reserve_space_3"), (IAE, "input #5")),
    "rank-3d-nhwc": (both((2, 3, 5)), (ValueError, "y_backprop must be 4-dimensional"),
                     (IAE, "y_backprop must be 4-dimensional")),
    "rank-5d-nhwc": (both((2, 3, 4, 1, 5)), (ValueError, "y_backprop must be 4-dimensional"),
                     (IAE, "y_backprop must be 4-dimensional")),
    "rank-4d-ndhwc": (dict(data_format="NDHWC"), (ValueError, "must be 5-dimensional"),
                      (IAE, "y_backprop must be 5-dimensional")),
    "rank-4d-ncdhw": (dict(data_format="NCDHW"), (ValueError, "must be 5-dimensional"),
                      (IAE, "y_backprop must be 5-dimensional")),
    "rank-x-only": (dict(x=shaped((2, 12, 5))), (ValueError, "x must be 4-dimensional"),
                    (IAE, "x must be 4-dimensional")),
    "shape-x-dy-mismatch": (dict(x=shaped((2, 3, 3, 5))), (ValueError, "same shape"),
                            (IAE, r"x and y_backprop must have the same shape")),
    "shape-x-dy-channel-mismatch": (dict(x=shaped((2, 3, 4, 6))), (ValueError, "same shape"),
                                    (IAE, "same shape")),
    "scale-size": (dict(scale=shaped(4)), (ValueError, "^scale must have 5 elements"),
                   (IAE, "scale must have 5 elements")),
    "scale-scalar": (dict(scale=np.float32(1)), (ValueError, "^scale must be 1-dimensional"),
                     (IAE, "scale must be 1-dimensional")),
    "scale-rank2": (dict(scale=shaped((5, 1))), (ValueError, "^scale must be 1-dimensional"),
                    (IAE, "scale must be 1-dimensional")),
    "rs1-size": (dict(reserve_space_1=shaped(6)), (ValueError, "^reserve_space_1.*5 elements"),
                 (IAE, "reserve_space_1.*5 elements")),
    "rs1-rank2": (dict(reserve_space_1=shaped((1, 5))), (ValueError, "^reserve_space_1.*1-dim"),
                  (IAE, "reserve_space_1.*1-dimensional")),
    "rs2-empty": (dict(reserve_space_2=shaped(0)), (ValueError, "^reserve_space_2.*5 elements"),
                  (IAE, "reserve_space_2.*5 elements")),
    "rs2-rank0": (dict(reserve_space_2=np.float32(1)), (ValueError, "^reserve_space_2.*1-dim"),
                  (IAE, "reserve_space_2.*1-dimensional")),
    "nchw-channel-mismatch": (dict(data_format="NCHW"), (ValueError, "scale must have 3 elem"),
                              (IAE, "scale must have 3 elements.*axis 1")),
    "ncdhw-channel-mismatch": (dict(both((2, 3, 4, 5, 6)), data_format="NCDHW"),
                               (ValueError, "scale must have 3 elements"),
                               (IAE, "scale must have 3 elements")),
    "epsilon-negative": (dict(epsilon=-1e-3), (ValueError, "epsilon"), (IAE, "epsilon")),
    "epsilon-nan": (dict(epsilon=float("nan")), (ValueError, "epsilon"), (IAE, "epsilon")),
    "epsilon-inf": (dict(epsilon=float("inf")), (ValueError, "epsilon"), (IAE, "epsilon")),
    "epsilon-minus-inf": (dict(epsilon=-float("inf")), (ValueError, "epsilon"),
                          (IAE, "epsilon")),
    "epsilon-overflows-float32": (dict(epsilon=1e39), (ValueError, "epsilon"),
                                  (IAE, "epsilon")),
    "epsilon-string": (dict(epsilon="1e-3"), (TypeError, "epsilon"), (TypeError, "epsilon")),
    "is_training-string": (dict(is_training="yes"), (TypeError, "is_training"),
                           (TypeError, "is_training")),
}


def python_api(args):
    a = dict(args)
    tensors = [a.pop(n) for n in ARG_NAMES]
    return fbn_grad_tf.fused_batch_norm_grad(*tensors, **a)


@pytest.mark.parametrize("mode", ["eager", "tf.function"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_python_api_rejects(case, mode):
    changes, (exc, msg), _ = CASES[case]
    args = base_args()
    args.update(changes)
    if mode == "eager":
        with pytest.raises(exc, match=msg):
            python_api(args)
        return
    tensors = {n: tf.constant(args[n]) for n in ARG_NAMES}
    attrs = {k: v for k, v in args.items() if k not in ARG_NAMES}
    fn = tf.function(lambda **t: python_api(dict(t, **attrs)))
    with pytest.raises(exc, match=msg.lstrip("^")):
        fn.get_concrete_function(**tensors)


@pytest.mark.parametrize("case", sorted(CASES))
def test_raw_op_rejects(case):
    changes, _, (exc, msg) = CASES[case]
    args = base_args()
    args.update(changes)
    args = {k: (tf.constant(v) if k in ARG_NAMES else v) for k, v in args.items()}
    with pytest.raises(exc, match=msg):
        raw_op(**args)


def test_raw_op_still_works_after_errors():
    """After every rejected call the op (and the process) is still healthy."""
    args = base_args()
    for case in sorted(CASES):
        bad = dict(args, **CASES[case][0])
        bad = {k: (tf.constant(v) if k in ARG_NAMES else v) for k, v in bad.items()}
        with pytest.raises((IAE, TypeError, ValueError)):
            raw_op(**bad)
    out = raw_op(**{k: (tf.constant(v) if k in ARG_NAMES else v) for k, v in args.items()})
    expected = python_api(base_args())
    for a, b in zip(out, expected):
        assert_bitwise_equal(a.numpy(), b.numpy())


@pytest.mark.parametrize("epsilon", [0.0, -0.0, 1e-45, 1e30])
def test_edge_epsilons_accepted(epsilon):
    args = base_args()
    args["epsilon"] = epsilon
    out = python_api(args)
    raw = raw_op(**{k: (tf.constant(v) if k in ARG_NAMES else v) for k, v in args.items()})
    for a, b in zip(out, raw):
        assert_bitwise_equal(a.numpy(), b.numpy())
    assert np.all(np.isfinite(out.x_backprop.numpy()))


@pytest.mark.parametrize("rs3_shape", [(), (0,), (7,), (2, 3), (1, 2, 3, 4)])
@pytest.mark.parametrize("training", [True, False], ids=["train", "infer"])
def test_reserve_space_3_any_shape_is_ignored(rs3_shape, training):
    inputs = make_inputs((2, 4, 3, 6), "NCHW", "float32", training, seed=52)
    expected = run_ours(inputs, 1e-4, "NCHW", training)
    rs3 = np.random.default_rng(1).standard_normal(rs3_shape).astype(np.float32)
    got = run_ours(inputs._replace(rs3=rs3), 1e-4, "NCHW", training)
    raw = raw_op(y_backprop=inputs.dy, x=inputs.x, scale=inputs.scale,
                 reserve_space_1=inputs.rs1, reserve_space_2=inputs.rs2,
                 reserve_space_3=tf.constant(rs3), data_format="NCHW", is_training=training)
    for a, b, c in zip(got, expected, raw):
        assert_bitwise_equal(a, b)
        assert_bitwise_equal(c.numpy(), b)


def test_empty_tensor_with_huge_dims():
    """0 elements but dims past 2^31: nothing to compute, no overflow, zero gradients."""
    z = tf.zeros([0, 2 ** 31, 2 ** 31, 5])
    vec = tf.ones([5])
    for out in (fbn_grad_tf.fused_batch_norm_grad(z, z, vec, vec, vec, tf.zeros([0])),
                raw_op(y_backprop=z, x=z, scale=vec, reserve_space_1=vec, reserve_space_2=vec,
                       reserve_space_3=tf.zeros([0]))):
        assert out[0].shape == z.shape
        np.testing.assert_array_equal(out[1].numpy(), np.zeros(5, np.float32))
        np.testing.assert_array_equal(out[2].numpy(), np.zeros(5, np.float32))


def test_python_lists_and_numpy_inputs_accepted():
    inputs = make_inputs((1, 2, 2, 3), "NHWC", "float32", True, seed=53)
    expected = run_ours(inputs)
    as_lists = [a.tolist() for a in inputs]
    got = fbn_grad_tf.fused_batch_norm_grad(*as_lists)
    for a, b in zip(got, expected):
        assert_bitwise_equal(a.numpy(), b)
