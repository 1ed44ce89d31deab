"""The backward in place: x_backprop written into y_backprop's or x's buffer,
side_input_backprop into y_backprop's (backward.h). The TF op does this whenever TF can
forward an input's buffer (nothing else holds it: intermediates inside a graph); the kernels
must then give exactly the bits they give into fresh buffers.

Kernel level: the pybind11 entry point called with aliased pointers, against the same call
with separate outputs, for every dtype, layout, mode and both task shapes (and the streamed
dx of a large tensor). Op level: our ops inside a tf.function whose inputs are intermediates
(forwardable), against the same ops called eagerly (inputs held by Python: never forwarded).
"""
import numpy as np
import pytest

from fbn_grad_tf import core
from helpers import assert_bitwise_equal, make_inputs

DTYPES = ["float32", "bfloat16", "float16"]
# (format, shape): row tasks (channels-last), small and large channels-first planes.
SHAPES = [("NHWC", (4, 9, 11, 48)), ("NCHW", (3, 20, 9, 9)), ("NCHW", (2, 6, 70, 300))]
# mode -> (activation, y given, offset given, side input)
MODES = {
    "plain": (None, False, False, False),
    "relu-y": ("relu", True, False, False),
    "relu-recompute": ("relu", True, True, False),
    "relu6-side": ("relu6", True, True, True),
    "swish-side": ("swish", False, True, True),
    "identity-side": (None, False, False, True),
}
# Which output goes into which input's buffer.
ALIASES = {"dx=dy": ("dx", "dy"), "dx=x": ("dx", "x"), "side=dy": ("side", "dy")}


def _raw_grad(inp, fmt, training, mode, alias):
    """The backward through bn_grad's raw CPU call (core._bn_grad_cpu). alias: None (fresh
    outputs) or (output, input) of ALIASES, the output then written into a copy of that
    input. Returns (dx, dscale, doffset, side_input_backprop or None)."""
    activation, with_y, with_offset, with_side = MODES[mode]
    dy, x = inp.dy.copy(), inp.x.copy()
    c = inp.scale.shape[0]
    rng = np.random.default_rng(7)
    y = np.maximum(x.astype(np.float32), 0).astype(x.dtype) if with_y else None
    offset = rng.uniform(-0.5, 0.5, c).astype(np.float32) if with_offset else None
    side = rng.standard_normal(x.shape).astype(np.float32).astype(x.dtype) if with_side else None
    dx = np.empty_like(x)
    dside = np.empty_like(x) if with_side else None
    if alias is not None:
        which, src = alias
        target = {"dy": dy, "x": x}[src]
        if which == "dx":
            dx = target
        else:
            dside = target
    out = (dx, np.empty(c, np.float32), np.empty(c, np.float32), dside)
    mode_name = core._activation_mode(activation)
    extra = [y, offset, side] if mode_name != "Identity" or with_side else None
    core._bn_grad_cpu(dy, x, [inp.scale, inp.rs1, inp.rs2], extra, out, fmt, 1e-3, training,
                      "variance", 2, "auto", mode_name)
    return out


def _cases():
    for dtype in DTYPES:
        for fmt, shape in SHAPES:
            for mode in MODES:
                for alias in ALIASES:
                    if alias == "side=dy" and not MODES[mode][3]:
                        continue
                    yield pytest.param(dtype, fmt, shape, mode, alias,
                                       id="%s-%s-%s-%s-%s" % (dtype, fmt, "x".join(map(str, shape)),
                                                             mode, alias))


@pytest.mark.parametrize("training", [True, False], ids=["train", "infer"])
@pytest.mark.parametrize("dtype,fmt,shape,mode,alias", list(_cases()))
def test_kernel_in_place_is_bitwise_out_of_place(dtype, fmt, shape, mode, alias, training):
    inp = make_inputs(shape, fmt, dtype, training, seed=11)
    want = _raw_grad(inp, fmt, training, mode, None)
    got = _raw_grad(inp, fmt, training, mode, ALIASES[alias])
    assert np.count_nonzero(want[0]) > want[0].size // 4  # a real result, not zeros
    for name, w, g in zip(("dx", "dscale", "doffset", "side_input_backprop"), want, got):
        if w is not None:
            assert_bitwise_equal(g, w, "%s (%s)" % (name, alias))


@pytest.mark.parametrize("alias", ["dx=dy", "dx=x"])
def test_kernel_in_place_streamed_dx(alias):
    """A float32 dx of 8 MiB or more is streamed out through an L1 buffer when it is not
    written in place (StreamMinBytes): the fresh-output reference streams, the aliased call
    must not (it stores plainly over dy or x), and both give the same bits."""
    inp = make_inputs((4, 32, 32, 544), "NHWC", "float32", True, seed=12)
    if inp.x.nbytes < core.stream_min_bytes(4):
        pytest.skip("FBN_GRAD_TF_STREAM_MIB sets a threshold above this dx")
    count = core._core.streamed_output_count
    before = count()
    want = _raw_grad(inp, "NHWC", True, "relu-recompute", None)
    assert count() == before + 1  # the fresh dx streamed
    got = _raw_grad(inp, "NHWC", True, "relu-recompute", ALIASES[alias])
    assert count() == before + 1  # the aliased one did not
    for w, g in zip(want[:3], got[:3]):
        assert_bitwise_equal(g, w, alias)


# ---- the TF ops ---------------------------------------------------------------------------

tf = pytest.importorskip("tensorflow")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("side", [False, True], ids=["relu", "relu-side"])
@pytest.mark.parametrize("training", [True, False], ids=["train", "infer"])
def test_op_with_forwardable_inputs_matches_eager(dtype, side, training):
    import fbn_grad_tf
    from fbn_grad_tf import _loader

    inp = make_inputs((4, 12, 12, 64), "NHWC", dtype, training, seed=13)
    c = inp.scale.shape[0]
    offset = np.linspace(-0.5, 0.5, c).astype(np.float32)
    side_in = np.flip(inp.x, axis=0).copy()
    y = np.maximum(inp.x.astype(np.float32), 0).astype(inp.x.dtype)

    def plain(dy, x):
        return fbn_grad_tf.fused_batch_norm_grad(dy, x, inp.scale, inp.rs1, inp.rs2, inp.rs3,
                                                 is_training=training)[:3]

    def ex(dy, x):
        out = _loader.raw_grad_ex_op(
            y_backprop=dy, x=x, scale=inp.scale, reserve_space_1=inp.rs1,
            reserve_space_2=inp.rs2, reserve_space_3=inp.rs3, y=y, offset=[offset],
            side_input=[side_in] if side else [], is_training=training, activation_mode="Relu")
        return list(out[:3]) + list(out[5])

    # Inside the graph dy and x are intermediates that only our op consumes, so TF may hand
    # their buffers to our outputs; eagerly, Python holds them and it never does. (Each op
    # gets its own intermediates: Grappler merges identical expressions, and a tensor with
    # two consumers is never forwarded.)
    one = tf.constant(np.ones((), np.float32).astype(inp.x.dtype))
    zero = tf.constant(np.zeros((), np.float32).astype(inp.x.dtype))

    @tf.function
    def in_graph(dy, x):  # (the outputs are consumed inside the graph too)
        used = lambda ts: [t * tf.cast(1, t.dtype) for t in ts]  # noqa: E731
        return used(plain(dy * one, x * one)), used(ex(dy + zero, x + zero))

    got_plain, got_ex = in_graph(inp.dy, inp.x)
    want_plain, want_ex = plain(inp.dy, inp.x), ex(inp.dy, inp.x)
    for g, w in zip(list(got_plain) + list(got_ex), list(want_plain) + list(want_ex)):
        assert_bitwise_equal(g.numpy(), w.numpy(), dtype)
    assert np.count_nonzero(want_plain[0].numpy()) > inp.x.size // 2
