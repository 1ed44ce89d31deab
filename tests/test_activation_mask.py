"""The activation mask (csrc/core/activation.h): the Relu/Relu6 mask that the CPU forward
writes into reserve_space_3 and the fused backward reads instead of y. The mask path must give
bitwise the backward of the y path, on every ISA path and thread count; a reserve_space_3 that
is not such a mask must be ignored (TF op) or refused (core); every word must be a finite
float."""
import subprocess
import sys

import numpy as np
import pytest
import tensorflow as tf

from fbn_grad_tf import _core, _loader, core
from helpers import assert_bitwise_equal, np_dtype, subprocess_env

EPS = 1e-3
MODE = {"relu": "Relu", "relu6": "Relu6"}
# Odd channel counts and plane sizes put the runs' ends inside a mask word (16 elements).
CASES = [("NHWC", (3, 5, 7, 24)), ("NHWC", (2, 3, 5, 37)), ("NCHW", (2, 37, 5, 7)),
         ("NCHW", (4, 6, 10, 30)), ("NHWC", (1, 4, 20, 2100)), ("NHWC", (8, 16, 16, 64))]


def case_id(case):
    return "%s-%s" % (case[0], "x".join(map(str, case[1])))


def c_axis(fmt):
    return 1 if fmt in ("NCHW", "NCDHW") else -1


def case_inputs(fmt, shape, dtype, side, seed=0):
    rng = np.random.default_rng(seed)
    C = shape[c_axis(fmt)]
    dt = np_dtype(dtype)
    # Around 0..6 after normalization: every branch of relu6, and exact zeros of y.
    x = (2.5 * rng.standard_normal(shape)).astype(np.float32).astype(dt)
    return dict(x=x, dy=rng.standard_normal(shape).astype(np.float32).astype(dt),
                scale=rng.uniform(0.5, 3.0, C).astype(np.float32),
                offset=rng.uniform(-1.0, 4.0, C).astype(np.float32),
                side=(2.0 * rng.standard_normal(shape)).astype(np.float32).astype(dt)
                if side else None)


def passes(y, act):
    y = np.asarray(y, np.float32)
    return (y > 0) & (y < 6) if act == "relu6" else y > 0


def unpack(mask, n):
    """The mask's n bits (element order) from its words."""
    words = np.asarray(mask).view(np.uint32)[: (n + 15) // 16]
    bits = (words[:, None] >> np.arange(16, dtype=np.uint32)) & 1
    return bits.reshape(-1)[:n].astype(bool)


def core_grad(inp, fmt, act, fwd, **kw):
    return core.bn_grad(inp["dy"], inp["x"], inp["scale"], fwd[3], fwd[4], epsilon=EPS,
                        data_format=fmt, is_training=True, activation=act, y=fwd[0],
                        offset=inp["offset"], side_input=inp["side"],
                        side_input_backprop=inp["side"] is not None, **kw)


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("side", [False, True], ids=["noside", "side"])
@pytest.mark.parametrize("act", ["relu", "relu6"])
@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_core_mask_path_equals_y_path(case, act, side, dtype):
    fmt, shape = case
    inp = case_inputs(fmt, shape, dtype, side)
    isas = [i for i in core.CPU_ISAS if core.cpu_supports(i)]
    base_fwd = None
    for isa in isas:
        for threads in (1, 2, 5):
            fwd = core.bn_forward(inp["x"], inp["scale"], inp["offset"], epsilon=EPS,
                                  data_format=fmt, activation=act, side_input=inp["side"],
                                  num_threads=threads, isa=isa, return_act_mask=True)
            y, mask = fwd[0], fwd[-1]
            what = "%s isa=%s threads=%d" % (act, isa, threads)
            assert mask.dtype == np.uint32 and mask.size == _core.activation_mask_floats(y.size)
            assert np.array_equal(unpack(mask, y.size), passes(y, act).reshape(-1)), what
            assert np.all(mask >> 16 == 0x3F80), what + ": a word's high half"
            assert np.all(np.isfinite(mask.view(np.float32))), what
            if y.size % 16:  # the last word's bits past the last element are 0
                assert mask[y.size // 16] & 0xFFFF < 1 << (y.size % 16), what
            if base_fwd is None:
                base_fwd = fwd
                want = core_grad(inp, fmt, act, fwd, isa="baseline", num_threads=1)
            else:  # the forward's words are the same on every path and thread count
                assert_bitwise_equal(mask, base_fwd[-1], what + " mask")
            got = core_grad(inp, fmt, act, fwd, isa=isa, num_threads=threads, act_mask=mask)
            for name, a, b in zip(("dx", "dscale", "doffset", "dside"), got, want):
                assert_bitwise_equal(a, b, "%s %s" % (what, name))


def test_core_refuses_what_is_not_the_mask():
    inp = case_inputs("NHWC", (2, 3, 5, 37), "bfloat16", side=True)
    fwd = core.bn_forward(inp["x"], inp["scale"], inp["offset"], epsilon=EPS, activation="relu",
                          side_input=inp["side"], return_act_mask=True)
    mask = fwd[-1]
    want = core_grad(inp, "NHWC", "relu", fwd)
    flipped = mask.copy()
    flipped[:-4] ^= 0xFFFF  # every bit inverted, tag intact: read, so dx changes
    got = core_grad(inp, "NHWC", "relu", fwd, act_mask=flipped)
    assert not np.array_equal(got[0].view(np.uint16), want[0].view(np.uint16))
    with pytest.raises(ValueError, match="activation mask"):
        core_grad(inp, "NHWC", "relu6", fwd, act_mask=mask)  # another activation's tag
    with pytest.raises(ValueError, match="activation mask"):
        core_grad(inp, "NHWC", "relu", fwd, act_mask=mask[:-1])  # a word short
    corrupt = mask.copy()
    corrupt[-1] ^= 1
    with pytest.raises(ValueError, match="activation mask"):
        core_grad(inp, "NHWC", "relu", fwd, act_mask=corrupt)
    with pytest.raises(ValueError, match="relu and relu6"):
        core.bn_forward(inp["x"], inp["scale"], inp["offset"], activation="swish",
                        return_act_mask=True)


def tf_forward_backward(inp, fmt, act, rs3_for_grad=None):
    x = tf.constant(inp["x"])
    empty = tf.zeros([0])
    side = [] if inp["side"] is None else [tf.constant(inp["side"])]
    fwd = _loader.raw_forward_ex_op(x=x, scale=inp["scale"], offset=inp["offset"], mean=empty,
                                    variance=empty, side_input=side, epsilon=EPS,
                                    data_format=fmt, is_training=True, activation_mode=MODE[act])
    rs3 = fwd[5] if rs3_for_grad is None else rs3_for_grad
    bwd = _loader.raw_grad_ex_op(y_backprop=inp["dy"], x=x, scale=inp["scale"],
                                 reserve_space_1=fwd[3], reserve_space_2=fwd[4],
                                 reserve_space_3=rs3, y=fwd[0], offset=[inp["offset"]],
                                 side_input=side, epsilon=EPS, data_format=fmt,
                                 is_training=True, activation_mode=MODE[act])
    return fwd, list(bwd[:3]) + list(bwd[5])


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("side", [False, True], ids=["noside", "side"])
@pytest.mark.parametrize("act", ["relu", "relu6"])
@pytest.mark.parametrize("case", CASES[1:3], ids=case_id)
def test_tf_forward_hands_the_mask_to_the_backward(case, act, side, dtype):
    fmt, shape = case
    inp = case_inputs(fmt, shape, dtype, side, seed=5)
    fwd, got = tf_forward_backward(inp, fmt, act)
    n = int(np.prod(shape))
    rs3 = fwd[5].numpy()
    if _core.writes_activation_mask(MODE[act], side, dtype != "float32", True):
        assert rs3.shape == (_core.activation_mask_floats(n),)
        assert np.array_equal(unpack(rs3.view(np.uint32), n), passes(fwd[0], act).reshape(-1))
        tf.debugging.check_numerics(fwd[5], "reserve_space_3")  # finite words
    else:  # float without side input: the backward recomputes z from x; no mask
        assert rs3.shape == (0,)
    _, want = tf_forward_backward(inp, fmt, act, rs3_for_grad=tf.zeros([0]))
    for name, a, b in zip(("dx", "dscale", "doffset", "dside"), got, want):
        assert_bitwise_equal(a.numpy(), b.numpy(), name)


def test_tf_backward_ignores_a_reserve_space_3_that_is_not_the_mask():
    inp = case_inputs("NHWC", (2, 3, 5, 37), "bfloat16", side=True, seed=7)
    # The words from the core (written on every CPU path; the TF forward writes them only on
    # the AVX-512 paths): the same kernel, the same words, which the TF backward reads on any.
    words = core.bn_forward(inp["x"], inp["scale"], inp["offset"], epsilon=EPS,
                            activation="relu", side_input=inp["side"], return_act_mask=True)[-1]
    _, want = tf_forward_backward(inp, "NHWC", "relu", rs3_for_grad=tf.zeros([0]))
    flipped = words.copy()
    flipped[:-4] ^= 0xFFFF  # every mask bit inverted, tag intact: would change dx if read
    _, got = tf_forward_backward(inp, "NHWC", "relu",
                                 rs3_for_grad=tf.constant(flipped.view(np.float32)))
    assert not np.array_equal(got[0].numpy().view(np.uint16), want[0].numpy().view(np.uint16))
    for bad in (words[:-1], np.concatenate([words, words[-1:]])):  # sizes off by one word
        _, got = tf_forward_backward(inp, "NHWC", "relu",
                                     rs3_for_grad=tf.constant(bad.view(np.float32)))
        for name, a, b in zip(("dx", "dscale", "doffset", "dside"), got, want):
            assert_bitwise_equal(a.numpy(), b.numpy(), name)
    retagged = words.copy()
    retagged[-1] ^= 1
    _, got = tf_forward_backward(inp, "NHWC", "relu",
                                 rs3_for_grad=tf.constant(retagged.view(np.float32)))
    for name, a, b in zip(("dx", "dscale", "doffset", "dside"), got, want):
        assert_bitwise_equal(a.numpy(), b.numpy(), name)


def test_empty_x_mask_is_the_tag_alone_as_from_the_tf_forward():
    """An empty x has no mask bits: its mask is the tag words alone, written by the core as
    by the TF forward (where that writes a mask), never uninitialized memory."""
    inp = case_inputs("NHWC", (0, 3, 5, 4), "float32", side=False, seed=3)
    words = core.bn_forward(inp["x"], inp["scale"], inp["offset"], epsilon=EPS,
                            activation="relu", return_act_mask=True)[-1]
    assert words.size == _core.activation_mask_floats(0)
    assert np.all(words & np.uint32(0xFFFF0000)) and words.any()  # tag words: high bits set
    fwd, _ = tf_forward_backward(inp, "NHWC", "relu")
    rs3 = fwd[5].numpy()
    if rs3.size:  # the TF forward writes a mask on the AVX-512 paths
        assert_bitwise_equal(rs3.view(np.uint32), words, "reserve_space_3")


def test_inference_and_other_activations_leave_reserve_space_3_empty():
    inp = case_inputs("NHWC", (2, 3, 5, 8), "bfloat16", side=True)
    x = tf.constant(inp["x"])
    for training, mode in ((False, "Relu"), (True, "Swish"), (True, "Identity")):
        stats = tf.zeros([0]) if training else tf.ones([8])
        fwd = _loader.raw_forward_ex_op(x=x, scale=inp["scale"], offset=inp["offset"],
                                        mean=stats, variance=stats,
                                        side_input=[tf.constant(inp["side"])], epsilon=EPS,
                                        is_training=training, activation_mode=mode)
        assert fwd[5].shape == (0,), (training, mode)


# Which CPU paths the TF forward writes the mask on: the ones that build and read its words
# with vector loops (AVX2, AVX-512), not the baseline's scalar loops. The path is chosen once
# per process (FBN_GRAD_TF_ISA), so each is asked in a child process.
POLICY_CHILD = r"""
import numpy as np
import tensorflow as tf
from fbn_grad_tf import _core, _loader, core
x = tf.constant(np.random.default_rng(0).standard_normal((2, 3, 5, 37)), tf.bfloat16)
c = tf.ones([37])
fwd = _loader.raw_forward_ex_op(x=x, scale=c, offset=c, mean=tf.zeros([0]),
                                variance=tf.zeros([0]), side_input=[], epsilon=1e-3,
                                is_training=True, activation_mode="Relu")
print(core.default_isa(), int(_core.writes_activation_mask("Relu", False, True, True)),
      int(fwd[5].shape[0]))
"""


@pytest.mark.parametrize("isa,writes", [("baseline", False), ("avx2", True), ("avx512", True)])
def test_tf_forward_writes_the_mask_on_the_vector_paths(isa, writes):
    if not core.cpu_supports(isa):
        pytest.skip("this CPU cannot run the %s path" % isa)
    out = subprocess.run([sys.executable, "-c", POLICY_CHILD], capture_output=True, text=True,
                         env=subprocess_env(FBN_GRAD_TF_ISA=isa), timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    got_isa, policy, rs3_floats = out.stdout.split()[-3:]
    assert got_isa == isa
    assert bool(int(policy)) == writes
    assert int(rs3_floats) == (_core.activation_mask_floats(2 * 3 * 5 * 37) if writes else 0)
