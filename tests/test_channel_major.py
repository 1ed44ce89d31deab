"""The channel-major plan on channels-first tensors: in the training backward (backward.inc)
each task reduces one channel's planes and applies dx to them right after; in the float
training forward (forward.inc) it computes one channel's statistics and normalizes its
planes right after. It must give the bits of the plane-task plan on every path, with every
activation, in place or not, and be taken exactly where ChannelMajorMaxBytes, the plane size,
the channel count (and for the forward the dtype) allow.

Two children compute the same outputs, one with the plan off (FBN_GRAD_TF_CHANNEL_MAJOR_KIB=0)
and one with it allowed for any channel size, so the test does not depend on the CPU's
default (off where the kernels prefetch in software).
"""
import os
import subprocess
import sys

import numpy as np
import pytest

from fbn_grad_tf import core
from helpers import child_with_env_value, np_dtype, subprocess_env

# (format, shape): plane lengths around the 2 KB minimum (kRunBytes) of each element size,
# tails off the 16-lane grid, and planes of more than 16384 elements (two pieces each).
# Channels: at least 4 per thread the call may use (1 and 2 here), or the plan is not taken.
CASES = [
    ("NCHW", (4, 9, 24, 24)),        # 576: float32 2304 B (taken), 16-bit 1152 B (not)
    ("NCHW", (3, 10, 33, 40)),       # 1320: every type; an 8-element tail
    ("NCHW", (2, 8, 17, 61)),        # 1037: 16-bit 2074 B (taken); a 13-element tail
    ("NCDHW", (2, 8, 4, 80, 70)),    # 22400: two pieces per plane
    ("NCHW", (2, 6, 33, 40)),        # 6 channels: taken on one thread, not on two
    ("NCHW", (5, 8, 16, 32)),        # 512: a small plane (batched plane tasks, never taken)
    ("NHWC", (2, 40, 40, 1)),        # one channel of any layout is one plane: never taken
]
DTYPES = ("float32", "float16", "bfloat16")
KINDS = ("plain", "in_place_dy", "in_place_x", "relu", "relu6_side", "swish_side", "inference")
RUN_BYTES = 2048  # backward.inc's kRunBytes
ALWAYS_KIB = 1 << 20


def taken(fmt, shape, dtype, kind, budget_bytes, threads):
    """Whether the plan applies (backward.inc, ChannelMajor)."""
    if fmt.startswith("NC"):
        n, c, inner = shape[0], shape[1], int(np.prod(shape[2:]))
    else:
        n, c, inner = shape[0], shape[-1], int(np.prod(shape[1:-1]))
    if c == 1:  # one plane (Canonical)
        n, inner = 1, n * inner
    if inner < 16:  # row tasks
        return False
    itemsize = np.dtype(np_dtype(dtype)).itemsize
    return (kind != "inference" and inner > 512 and inner * itemsize >= RUN_BYTES
            and c >= 4 * threads and 2 * n * inner * itemsize <= budget_bytes)


def taken_forward(fmt, shape, dtype, kind, budget_bytes, threads):
    """Whether the forward takes the plan (forward.inc): float32 only, x alone cached."""
    if dtype != "float32" or kind == "inference":
        return False
    # The backward's conditions with one cached tensor instead of two.
    return taken(fmt, shape, dtype, "plain", 2 * budget_bytes, threads)


def store_bits(out, key, results):
    """out[key-i] = the bytes of result i."""
    for i, r in enumerate(results):
        out["%s-%d" % (key, i)] = np.asarray(r).view(np.uint8).copy()


FORWARD_KINDS = ("plain", "relu", "relu6_side", "swish_side", "avg_factor", "inference")


def forward_outputs():
    """name -> bits of every forward output (the activation mask too), per (case, dtype, kind,
    threads), and per supported path."""
    out = {}
    for fmt, shape in CASES:
        first = fmt.startswith("NC")
        c = shape[1] if first else shape[-1]
        for dtype in DTYPES:
            dt = np_dtype(dtype)
            rng = np.random.default_rng(len(shape) * 1000 + shape[-1] * 5 + len(dtype))
            # Off-centre data: the statistics' shifted sums and Chan's merge are exercised.
            x = (rng.standard_normal(shape) * 2 + 3).astype(np.float32).astype(dt)
            side = rng.standard_normal(shape).astype(np.float32).astype(dt)
            scale = rng.uniform(0.5, 1.5, c).astype(np.float32)
            offset = rng.standard_normal(c).astype(np.float32)
            running_mean = rng.standard_normal(c).astype(np.float32)
            running_var = rng.uniform(0.5, 2.0, c).astype(np.float32)
            for kind in FORWARD_KINDS:
                act = {"relu": "relu", "relu6_side": "relu6", "swish_side": "swish"}.get(kind)
                kw = dict(data_format=fmt, is_training=kind != "inference", activation=act,
                          side_input=side if kind.endswith("_side") else None,
                          return_act_mask=act in ("relu", "relu6"),
                          exponential_avg_factor=0.3 if kind == "avg_factor" else 1.0)
                for threads in (1, 2):
                    res = core.bn_forward(x, scale, offset, running_mean, running_var, 1e-3,
                                          num_threads=threads, **kw)
                    key = "fwd-%s-%s-%s-%s-%d" % (fmt, "x".join(map(str, shape)), dtype, kind,
                                                  threads)
                    store_bits(out, key, res)
                if kind == "plain":
                    for isa in core.CPU_ISAS:
                        if core.cpu_supports(isa):
                            res = core.bn_forward(x, scale, offset, None, None, 1e-3,
                                                  num_threads=2, isa=isa, **kw)
                            store_bits(out, "fwd-%s-%s-%s-%s" % (
                                fmt, "x".join(map(str, shape)), dtype, isa), res)
    return out


def expected_forward_calls(budget_bytes):
    return expected_calls(budget_bytes, taken_forward, FORWARD_KINDS)


def outputs():
    """name -> bits of every output, and the number of calls made per (case, dtype, kind)."""
    out = {}
    for fmt, shape in CASES:
        first = fmt.startswith("NC")
        c = shape[1] if first else shape[-1]
        axes = (0,) + tuple(range(2, len(shape))) if first else tuple(range(len(shape) - 1))
        for dtype in DTYPES:
            dt = np_dtype(dtype)
            rng = np.random.default_rng(len(shape) * 1000 + shape[-1] * 7 + len(dtype))
            x, dy, side = (rng.standard_normal(shape).astype(np.float32).astype(dt)
                           for _ in range(3))
            scale = rng.uniform(0.5, 1.5, c).astype(np.float32)
            offset = rng.standard_normal(c).astype(np.float32)
            mean = x.astype(np.float32).mean(axis=axes)
            var = rng.uniform(0.5, 2.0, c).astype(np.float32)
            for kind in KINDS:
                for threads in (1, 2):
                    key = "%s-%s-%s-%s-%d" % (fmt, "x".join(map(str, shape)), dtype, kind,
                                              threads)
                    kw = {}
                    act = {"relu": "relu", "relu6_side": "relu6",
                           "swish_side": "swish"}.get(kind)
                    if act:
                        with_side = kind.endswith("_side")
                        y = core.bn_forward(x, scale, offset, None, None, 1e-3,
                                            data_format=fmt, is_training=True, activation=act,
                                            side_input=side if with_side else None,
                                            num_threads=threads)[0]
                        kw = dict(activation=act, y=y, offset=offset,
                                  side_input=side if with_side else None,
                                  side_input_backprop=with_side)
                    if kind.startswith("in_place"):
                        # dx over y_backprop or x, as the TF op forwards a buffer.
                        a, b = dy.copy(), x.copy()
                        dx = a if kind == "in_place_dy" else b
                        res = (dx, np.empty(c, np.float32), np.empty(c, np.float32), None)
                        core._bn_grad_cpu(a, b, [scale, mean, var], None, res, fmt, 1e-3,
                                          True, "variance", threads, "auto", "Identity")
                        res = res[:3]
                    else:
                        res = core.bn_grad(dy, x, scale, mean, var, 1e-3, fmt,
                                           kind != "inference", num_threads=threads, **kw)
                    store_bits(out, key, res)
                # Every supported path, the plain call on two threads.
                if kind == "plain":
                    for isa in core.CPU_ISAS:
                        if core.cpu_supports(isa):
                            res = core.bn_grad(dy, x, scale, mean, var, 1e-3, fmt, True,
                                               num_threads=2, isa=isa)
                            store_bits(out, "%s-%s-%s-%s" % (
                                fmt, "x".join(map(str, shape)), dtype, isa), res)
    return out


def expected_calls(budget_bytes, is_taken=taken, kinds=KINDS):
    """The calls outputs() (or, with taken_forward and FORWARD_KINDS, forward_outputs())
    makes that take the plan."""
    n = 0
    isas = sum(core.cpu_supports(i) for i in core.CPU_ISAS)
    for fmt, shape in CASES:
        for dtype in DTYPES:
            for kind in kinds:
                n += sum(is_taken(fmt, shape, dtype, kind, budget_bytes, t) for t in (1, 2))
                if kind == "plain" and is_taken(fmt, shape, dtype, kind, budget_bytes, 2):
                    n += isas  # the per-path calls, on two threads
    return n


_CHILD = r"""
import sys, numpy as np
sys.path.insert(0, %(tests)r)
from fbn_grad_tf import _core
from test_channel_major import forward_outputs, outputs
out = outputs()
before = _core.channel_major_call_count("forward")  # outputs() runs forwards for y
out.update(forward_outputs())
out["calls"] = np.array([_core.channel_major_call_count("backward")])
out["forward_calls"] = np.array([_core.channel_major_call_count("forward") - before])
np.savez(sys.argv[1], **out)
"""


def _run_child(tmp_path, kib):
    path = str(tmp_path / ("outputs-%s.npz" % kib))
    tests_dir = os.path.dirname(os.path.abspath(__file__))
    p = subprocess.run([sys.executable, "-c", _CHILD % {"tests": tests_dir}, path],
                       capture_output=True, text=True, timeout=600,
                       env=subprocess_env(FBN_GRAD_TF_CHANNEL_MAJOR_KIB=str(kib)))
    assert p.returncode == 0, p.stderr[-3000:]
    return dict(np.load(path))


def test_channel_major_gives_the_plane_tasks_bits(tmp_path):
    off = _run_child(tmp_path, 0)
    on = _run_child(tmp_path, ALWAYS_KIB)
    assert int(off.pop("calls")[0]) == 0
    assert int(off.pop("forward_calls")[0]) == 0
    calls = int(on.pop("calls")[0])
    # The forward: taken exactly where it applies (float32 only), the same bits either way.
    assert int(on.pop("forward_calls")[0]) == expected_forward_calls(ALWAYS_KIB << 10) > 0
    assert any(not taken_forward(fmt, shape, dtype, "plain", ALWAYS_KIB << 10, 1)
               and taken(fmt, shape, dtype, "plain", ALWAYS_KIB << 10, 1)
               for fmt, shape in CASES for dtype in DTYPES)
    # The plan was taken exactly where it applies (and some cases are outside it).
    assert calls == expected_calls(ALWAYS_KIB << 10) > 0
    assert any(not taken(fmt, shape, dtype, "plain", ALWAYS_KIB << 10, 1)
               for fmt, shape in CASES for dtype in DTYPES)
    assert any(taken(fmt, shape, dtype, "plain", ALWAYS_KIB << 10, 1)
               and not taken(fmt, shape, dtype, "plain", ALWAYS_KIB << 10, 2)
               for fmt, shape in CASES for dtype in DTYPES)
    assert sorted(off) == sorted(on) and len(on) > 500
    assert sum(k.startswith("fwd-") for k in on) > 200
    for k in off:
        np.testing.assert_array_equal(on[k], off[k], err_msg=k)


def test_channel_major_respects_the_channel_budget(tmp_path):
    # 20 KiB: only channels of at most 20480 bytes of y_backprop and x (2 x N x plane) qualify
    # in the backward, of x (N x plane) in the forward.
    out = _run_child(tmp_path, 20)
    assert int(out["calls"][0]) == expected_calls(20 << 10)
    assert 0 < expected_calls(20 << 10) < expected_calls(ALWAYS_KIB << 10)
    assert int(out["forward_calls"][0]) == expected_forward_calls(20 << 10)
    assert 0 < expected_forward_calls(20 << 10) < expected_forward_calls(ALWAYS_KIB << 10)
    # A channel that fits the forward's budget but not the backward's.
    assert any(taken_forward(fmt, shape, "float32", "plain", 20 << 10, 1)
               and not taken(fmt, shape, "float32", "plain", 20 << 10, 1)
               for fmt, shape in CASES)


def _default_budget():
    return 0 if core.software_prefetch() else 4 << 20


@pytest.mark.skipif(os.environ.get("FBN_GRAD_TF_CHANNEL_MAJOR_KIB", "") not in ("", "auto"),
                    reason="FBN_GRAD_TF_CHANNEL_MAJOR_KIB is set in this environment")
def test_channel_major_budget_default():
    assert core.channel_major_max_bytes() == _default_budget()


@pytest.mark.parametrize("value, want", [("0", 0), ("4096", 4 << 20), ("0.5", 512),
                                         ("auto", None), ("", None), ("-1", None),
                                         ("1e3", None), ("bogus", None)])
def test_channel_major_budget_environment_override(value, want):
    # auto, or an unusable value (with a warning): the default
    budget, prefetch = child_with_env_value(
        "FBN_GRAD_TF_CHANNEL_MAJOR_KIB", value,
        "from fbn_grad_tf import core; print(core.channel_major_max_bytes(), "
        "core.software_prefetch())",
        rejected=want is None and value not in ("auto", ""))
    if want is None:
        want = 0 if prefetch == "True" else 4 << 20
    assert int(budget) == want


def test_channel_major_call_count_names_the_op():
    from fbn_grad_tf import _core
    assert _core.channel_major_call_count() == _core.channel_major_call_count("backward") >= 0
    assert _core.channel_major_call_count("forward") >= 0
    with pytest.raises(ValueError, match="'backward' or 'forward'"):
        _core.channel_major_call_count("bogus")
