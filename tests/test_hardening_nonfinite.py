"""NaN and Inf propagation: must match TensorFlow's own FusedBatchNormGradV3.

A NaN, +Inf or -Inf is put into y_backprop, x, scale, reserve_space_1 (mean) or
reserve_space_2 (variance): one element, or every element of one channel. Plus variances
that make var + epsilon negative or zero. For each case our op and
tf.raw_ops.FusedBatchNormGradV3 run on the same inputs (NHWC, training and inference,
float32 / float16 / bfloat16) and must agree on

* where the NaNs are,
* where the infinities are, and their signs,
* the finite values (within a rounding tolerance).

TensorFlow has two CPU implementations (SPEC.md 9): Eigen (AVX2-only CPUs, or
TF_ENABLE_ONEDNN_OPTS=0) and oneDNN (default on CPUs with AVX-512 VNNI/BF16; float32 and
bfloat16 only). Each is run in its own child process. One known deviation from the
Eigen kernel (see INV_INF_REASON; oneDNN agrees with ours) is an expected failure.
"""
import itertools

import pytest

import subproc

TENSORS = ("y_backprop", "x", "scale", "reserve_space_1", "reserve_space_2")
VALUES = ("nan", "inf", "-inf")
DTYPES = ("float32", "float16", "bfloat16")
SHAPE = [2, 3, 4, 3]  # NHWC, C = 3


def build_cases():
    cases = []
    for dtype, training, tensor, value, where in itertools.product(
            DTYPES, (True, False), TENSORS, VALUES, ("one", "channel")):
        if where == "channel" and tensor in ("scale", "reserve_space_1", "reserve_space_2"):
            continue  # a vector's "channel" is one element
        cases.append(dict(id="%s-%s-%s-%s-%s" % (dtype, "train" if training else "infer",
                                                 tensor, value, where),
                          dtype=dtype, training=training, tensor=tensor, value=value,
                          where=where, var=None, eps=1e-3))
    for dtype, training in itertools.product(DTYPES, (True, False)):
        t = "train" if training else "infer"
        # var + eps < 0: sqrt of a negative number; var + eps == 0: 1/0
        for tag, var, eps in (("var_negative", -1.0, 1e-3), ("var_plus_eps_zero", -0.25, 0.25),
                              ("var_zero_eps_zero", 0.0, 0.0)):
            cases.append(dict(id="%s-%s-%s" % (dtype, t, tag), dtype=dtype, training=training,
                              tensor=None, value=None, where=None, var=var, eps=eps))
        # several specials at once, in different tensors and channels
        cases.append(dict(id="%s-%s-mixed" % (dtype, t), dtype=dtype, training=training,
                          tensor="mixed", value=None, where=None, var=None, eps=1e-3))
    return cases


CASES = build_cases()


def _inputs(case):
    import zlib

    import numpy as np

    from fbn_grad_tf.core import bfloat16

    dt = bfloat16 if case["dtype"] == "bfloat16" else np.dtype(case["dtype"])
    rng = np.random.default_rng(zlib.crc32(case["id"].encode()))
    c = SHAPE[-1]
    arrs = {"y_backprop": rng.standard_normal(SHAPE).astype(np.float32),
            "x": rng.standard_normal(SHAPE).astype(np.float32),
            "scale": rng.standard_normal(c).astype(np.float32),
            "reserve_space_1": (rng.standard_normal(c) * 0.1).astype(np.float32),
            "reserve_space_2": rng.uniform(0.5, 2.0, c).astype(np.float32)}
    special = {"nan": np.nan, "inf": np.inf, "-inf": -np.inf}
    if case["tensor"] == "mixed":
        arrs["y_backprop"][0, 1, 2, 0] = np.nan
        arrs["x"][1, 0, 0, 1] = np.inf
        arrs["x"][1, 2, 3, 1] = -np.inf
        arrs["reserve_space_2"][2] = np.inf
    elif case["tensor"] is not None:
        a = arrs[case["tensor"]]
        v = special[case["value"]]
        if a.ndim == 1:
            a[1] = v
        elif case["where"] == "one":
            a[1, 2, 1, 1] = v
        else:
            a[..., 1] = v
    if case["var"] is not None:
        arrs["reserve_space_2"][1] = case["var"]
    arrs["y_backprop"] = arrs["y_backprop"].astype(dt)
    arrs["x"] = arrs["x"].astype(dt)
    arrs["reserve_space_3"] = np.zeros([0], np.float32)
    return arrs


def _classify(a):
    import numpy as np

    a = np.asarray(a).astype(np.float64)
    return np.isnan(a), np.isposinf(a), np.isneginf(a), a


def _compare(name, ours, theirs, dtype):
    import numpy as np

    n1, p1, m1, a1 = _classify(ours)
    n2, p2, m2, a2 = _classify(theirs)
    problems = []
    for what, x, y in (("NaN", n1, n2), ("+Inf", p1, p2), ("-Inf", m1, m2)):
        if not np.array_equal(x, y):
            problems.append("%s %s positions differ: ours %s, TF %s" % (
                name, what, np.flatnonzero(x).tolist()[:12], np.flatnonzero(y).tolist()[:12]))
    fin = np.isfinite(a1) & np.isfinite(a2)
    if fin.any():
        rtol = {"float32": 1e-4, "float16": 4e-3, "bfloat16": 3e-2}[dtype]
        scale = np.max(np.abs(a2[fin]))
        bad = np.abs(a1[fin] - a2[fin]) > rtol * (np.abs(a2[fin]) + 1e-3 * scale) + 1e-30
        if bad.any():
            problems.append("%s finite values differ at %d elements: ours %s, TF %s" % (
                name, int(bad.sum()), a1[fin][bad][:6].tolist(), a2[fin][bad][:6].tolist()))
    return problems


def run_case(case):
    """Child side: our op and TF's on the same inputs; returns the list of differences."""
    import tensorflow as tf

    import fbn_grad_tf

    arrs = _inputs(case)
    t = {k: tf.constant(v) for k, v in arrs.items()}
    kw = dict(epsilon=case["eps"], data_format="NHWC", is_training=case["training"])
    subproc.note({"case": case["id"], "op": "ours"})
    ours = fbn_grad_tf.raw_op(**t, **kw)
    subproc.note({"case": case["id"], "op": "tf"})
    theirs = tf.raw_ops.FusedBatchNormGradV3(**t, **kw)
    problems = []
    for name, o, r in zip(("x_backprop", "scale_backprop", "offset_backprop"), ours, theirs):
        problems += _compare(name, o.numpy(), r.numpy(), case["dtype"] if name == "x_backprop"
                             else "float32")
    from tensorflow.python.util import _pywrap_util_port
    # oneDNN kernels exist for float32 and bfloat16 only; float16 always runs Eigen.
    onednn = bool(_pywrap_util_port.IsMklEnabled()) and case["dtype"] != "float16"
    return {"problems": problems, "tf_kernel": "oneDNN" if onednn else "Eigen"}


# ---- parent side ----------------------------------------------------------------------

# TF on this kind of CPU: Eigen is forced with TF_ENABLE_ONEDNN_OPTS=0; the default picks
# oneDNN on AVX-512 VNNI/BF16 CPUs and Eigen elsewhere.
BACKENDS = {"eigen": {"TF_ENABLE_ONEDNN_OPTS": "0"}, "tf_default": {"TF_ENABLE_ONEDNN_OPTS": None}}


@pytest.fixture(scope="module")
def results():
    out = {}
    for backend, env in BACKENDS.items():
        outs = subproc.run_cases("test_hardening_nonfinite:run_case", CASES, env=env,
                                 timeout=600)
        out[backend] = {c["id"]: o for c, o in zip(CASES, outs)}
    return out


# Known deviation from TF's Eigen kernel (TF's oneDNN kernel agrees with ours): in training
# with var + epsilon == 0, inv = 1/sqrt(var + eps) is +inf. TF's Eigen kernel sums
# dy * (x - mean) * inv element by element, so +inf and -inf terms meet and scale_backprop
# is NaN; ours (like oneDNN) computes inv * sum(dy * (x - mean)) = +-inf.
INV_INF_TRAINING = "-train-var_plus_eps_zero", "-train-var_zero_eps_zero"
INV_INF_REASON = (
    "training with var + epsilon == 0 (inv = inf): scale_backprop is +-inf in ours (and TF's "
    "oneDNN kernel) but NaN in TF's Eigen kernel, which multiplies by inv before summing")


@pytest.mark.parametrize("backend", list(BACKENDS))
@pytest.mark.parametrize("case", CASES, ids=[c["id"] for c in CASES])
def test_nonfinite_matches_tf(results, case, backend):
    o = results[backend][case["id"]]
    assert o.status == "ok", "did not finish cleanly: %r" % (o,)
    problems = o.value["problems"]
    known = (o.value["tf_kernel"] == "Eigen"
             and any(case["id"].endswith(k) for k in INV_INF_TRAINING))
    if known:  # strict xfail, decided at run time (the TF kernel depends on the CPU)
        if problems and all(p.startswith("scale_backprop") for p in problems):
            pytest.xfail(INV_INF_REASON)
        assert problems, "XPASS(strict): known deviation fixed? " + INV_INF_REASON
    assert not problems, "TF kernel %s:\n%s" % (o.value["tf_kernel"], "\n".join(problems))
