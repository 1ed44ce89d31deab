"""Property-based fuzzing of the fused-activation ops "FbnGrad>FusedBatchNormEx" and
"FbnGrad>FusedBatchNormGradEx" (hypothesis), with the rule of the backward's fuzz: every input
gives a clear InvalidArgumentError (kernel) or ValueError (Python API) naming the argument, or
a correct result; never a crash, never a silently wrong result.

Examples are those of test_hardening_forward (shapes with zero sizes, wrong ranks, wrong or
empty vector sizes, dtypes, all four data formats, training with and without
exponential_avg_factor 1, inference, hostile epsilon and factor), plus: every activation_mode
the op accepts (read from its OpDef, so modes added later are fuzzed too), unknown activation
strings, huge epsilon (3e38) and factor (1e30), and NaN/+Inf/-Inf written into x.

* unknown activation: the raw ops raise InvalidArgumentError naming activation_mode;
  fused_batch_norm_v3, fused_batch_norm, FusedBatchNorm.activation and the Keras layer
  raise ValueError naming activation;
* rejected shapes/values: InvalidArgumentError from the Ex op naming the argument the model
  names; ValueError from fused_batch_norm_v3 naming it (or another invalid argument);
* accepted: Ex(Identity) is our FusedBatchNormV3 bitwise; every mode's statistics are the
  identity's; Relu's y is max(identity y, 0) exactly (NaN stays NaN); each equals
  core.bn_forward bitwise (NaN-aware); in training a channel with a non-finite x is NaN all
  through. GradEx with the forward's y equals core.bn_grad (relu_y for Relu) bitwise, and
  GradEx(Identity) our FusedBatchNormGradV3; a y of the wrong shape is refused naming y.

The side input (branch exops) is fuzzed by its author; its hook is marked HOOK(side input).
The loop runs in one child process (tests/subproc.py), so a crash fails the test and names
the example that was running.
"""
import os

import numpy as np
from hypothesis import given
from hypothesis import strategies as st

import subproc
from helpers import (assert_fuzz_coverage, fuzz_examples, fuzz_generate_only, np_dtype,
                     run_fuzz_child)
import test_hardening_forward as fwd
from test_hardening_core_entry import BAD_ACTIVATIONS, _check_activations, same

SEED = int(os.environ.get("FBN_FUZZ_SEED", "0"))
# Not valid activation_mode values of the op (its values are capitalized: "Relu").
BAD_MODES = ("relu", "RELU", "Relu7", "Sigmoid", "", "Identity ", "Tanh")
# Unknown to every Python entry point ("linear" is not: fused_batch_norm and the Keras layer
# take it as Keras' name of the identity).
BAD_API_ACTIVATIONS = tuple(a for a in BAD_ACTIVATIONS if a != "linear")


def op_activation_modes(op_name):
    """The allowed values of `op_name`'s activation_mode attribute (from its OpDef)."""
    from tensorflow.python.framework import op_def_registry
    op_def = op_def_registry.get(op_name)
    for attr in op_def.attr:
        if attr.name == "activation_mode":
            return tuple(v.decode() for v in attr.allowed_values.list.s)
    raise AssertionError("%s has no activation_mode attribute" % op_name)


@st.composite
def examples(draw):
    ex = draw(fwd.examples())
    if draw(st.integers(0, 15)) == 0:
        ex["epsilon"] = 3.0e38
    if draw(st.integers(0, 15)) == 0:
        ex["factor"] = 1e30
    n_special = draw(st.sampled_from([0] * 6 + [1, 3]))
    ex["nonfinite"] = [(draw(st.integers(0, 10 ** 6)),
                        draw(st.sampled_from([float("nan"), float("inf"), float("-inf")])))
                       for _ in range(n_special)]
    ex["mode_index"] = draw(st.integers(0, 7))
    ex["bad_mode"] = draw(st.sampled_from([None] * 14 + list(BAD_MODES)))
    ex["bad_activation"] = draw(st.sampled_from([None] * 20 + list(BAD_API_ACTIVATIONS)))
    ex["bad_y"] = draw(st.sampled_from([None] * 8 + ["shape", "rank"]))
    return ex


def _error_names(ex, expect):
    """Every name a correct refusal may carry: the model's, and any other invalid argument
    (the Python API checks epsilon and the factor before the shapes)."""
    names = [expect]
    with np.errstate(over="ignore"):
        eps = np.float32(ex["epsilon"])
    if not np.isfinite(eps) or (np.signbit(eps) and eps != 0):
        names.append("epsilon")
    if not np.isfinite(ex["factor"]):
        names.append("exponential_avg_factor")
    return names


def run_forward_ex_fuzz(cfg):
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import tensorflow as tf

    import fbn_grad_tf
    from fbn_grad_tf import _loader, core

    modes = op_activation_modes(_loader.FORWARD_EX_OP_NAME)
    grad_modes = op_activation_modes(_loader.GRAD_EX_OP_NAME)
    stats = {"examples": 0, "rejected_as_expected": 0, "accepted": 0, "bad_mode": 0,
             "bad_activation": 0, "nonfinite": 0, "empty": 0, "grad_checked": 0,
             "bad_y": 0, "modes": list(modes)}

    def expect_error(fn, types, names, what):
        try:
            fn()
        except types as e:
            msg = str(e)
            assert any(n in msg for n in names), "%s: error does not name %s: %s" % (
                what, names, msg[:400])
            return
        raise AssertionError("%s: accepted, expected an error naming %s" % (what, names))

    @fuzz_generate_only(cfg)
    @given(examples())
    def check(ex):
        subproc.note(ex)
        stats["examples"] += 1
        rng = np.random.default_rng(ex["seed"])
        x = (ex["loc"] + rng.standard_normal(ex["dims"])).astype(np.float32)
        flat = x.reshape(-1)
        for pos, val in ex["nonfinite"]:
            if flat.size:
                flat[pos % flat.size] = val
        x = x.astype(np_dtype(ex["dtype"]))
        vecs = [rng.uniform(0.5, 1.5, n).astype(np.float32) for n in ex["lens"]]
        kw = dict(x=x, scale=vecs[0], offset=vecs[1] - 1.0, mean=vecs[2], variance=vecs[3],
                  epsilon=ex["epsilon"], exponential_avg_factor=ex["factor"],
                  data_format=ex["fmt"], is_training=ex["training"])
        ex_kw = dict(kw, side_input=[])  # the Ex ops: no side input here (test_ex_ops.py)
        mode = modes[ex["mode_index"] % len(modes)]

        if ex["bad_mode"] is not None:  # the raw op: its attribute's allowed values
            expect_error(lambda: _loader.raw_forward_ex_op(activation_mode=ex["bad_mode"], **ex_kw),
                         tf.errors.InvalidArgumentError, ["activation_mode"],
                         "Ex op, activation_mode=%r" % ex["bad_mode"])
            stats["bad_mode"] += 1
        if ex["bad_activation"] is not None:  # the Python API and the layer
            bad = ex["bad_activation"]
            api = dict(kw, mean=tf.constant(vecs[2]), variance=tf.constant(vecs[3]))
            for what, fn in (
                    ("fused_batch_norm_v3", lambda: fbn_grad_tf.fused_batch_norm_v3(
                        activation=bad, **api)),
                    ("fused_batch_norm", lambda: fbn_grad_tf.fused_batch_norm(
                        x, vecs[0], vecs[1], activation=bad)),
                    ("FusedBatchNorm.activation", lambda: fbn_grad_tf.FusedBatchNorm.activation(
                        bad)),
                    ("keras.BatchNormalization", lambda: fbn_grad_tf.keras.BatchNormalization(
                        activation=bad))):
                expect_error(fn, ValueError, ["activation"], "%s(activation=%r)" % (what, bad))
            stats["bad_activation"] += 1

        with np.errstate(all="ignore"):
            expect = fwd.model_validate(ex)
        if expect is not None:
            expect_error(lambda: _loader.raw_forward_ex_op(activation_mode=mode, **ex_kw),
                         tf.errors.InvalidArgumentError, [expect], "Ex op (%s)" % mode)
            if len(ex["dims"]) in (4, 5):  # (other ranks: TF's shape function refuses first)
                expect_error(lambda: fbn_grad_tf.fused_batch_norm_v3(
                    activation=mode.lower(), **kw), ValueError, _error_names(ex, expect),
                    "fused_batch_norm_v3 (%s)" % mode)
            stats["rejected_as_expected"] += 1
            return
        stats["accepted"] += 1
        stats["empty"] += x.size == 0
        stats["nonfinite"] += bool(ex["nonfinite"]) and x.size > 0

        ours = [t.numpy() for t in _loader.raw_forward_op(**kw)]
        fw = {}
        for m in modes:
            got = [t.numpy() for t in _loader.raw_forward_ex_op(activation_mode=m, **ex_kw)]
            for i, name in enumerate(("batch_mean", "batch_var", "rs1", "rs2")):
                same(got[i + 1], ours[i + 1], "Ex(%s) %s vs FusedBatchNormV3" % (m, name))
            mine = core.bn_forward(activation=m.lower(), **kw)
            for name, a, b in zip(("y", "batch_mean", "batch_var", "rs1", "rs2"), got, mine):
                same(a, b, "Ex(%s) %s vs core.bn_forward" % (m, name))
            fw[m.lower()] = got
        same(fw["identity"][0], ours[0], "Ex(Identity) y vs FusedBatchNormV3")
        _check_activations(fw, ours[0], ex["dtype"])
        if ex["training"] and x.size:
            c_axis = 1 if ex["fmt"] in ("NCHW", "NCDHW") else x.ndim - 1
            red = tuple(i for i in range(x.ndim) if i != c_axis)
            bad_c = ~np.all(np.isfinite(x.astype(np.float64)), axis=red)
            y_bad = np.moveaxis(ours[0].astype(np.float32), c_axis, -1)[..., bad_c]
            assert np.all(np.isnan(y_bad)), "a channel with a non-finite x is not all NaN"
        # HOOK(side input): the side-input fuzz of the Ex op goes here (branch exops).

        # GradEx with each forward's y.
        dy = rng.standard_normal(ex["dims"]).astype(np_dtype(ex["dtype"]))
        rs1, rs2 = (ours[3], ours[4]) if ex["training"] else (vecs[2], vecs[3])
        gkw = dict(y_backprop=dy, x=x, scale=vecs[0], reserve_space_1=rs1,
                   reserve_space_2=rs2, reserve_space_3=ours[5], epsilon=ex["epsilon"],
                   data_format=ex["fmt"], is_training=ex["training"])
        plain = [t.numpy() for t in fbn_grad_tf.raw_op(**gkw)[:3]]
        gex_kw = dict(gkw, offset=[kw["offset"]], side_input=[])  # Swish reads the offset
        for m in grad_modes:
            y = fw[m.lower()][0] if m.lower() in fw else ours[0]
            got = [t.numpy() for t in _loader.raw_grad_ex_op(y=y, activation_mode=m, **gex_kw)[:3]]
            relu_y = y if m == "Relu" else None
            if m in ("Identity", "Relu"):
                mine = core.bn_grad(dy, x, vecs[0], rs1, rs2, epsilon=ex["epsilon"],
                                    data_format=ex["fmt"], is_training=ex["training"],
                                    relu_y=relu_y)
                for name, a, b in zip(("dx", "dscale", "doffset"), got, mine):
                    same(a, b, "GradEx(%s) %s vs core.bn_grad" % (m, name))
            if m == "Identity":
                for name, a, b in zip(("dx", "dscale", "doffset"), got, plain):
                    same(a, b, "GradEx(Identity) %s vs FusedBatchNormGradV3" % name)
        stats["grad_checked"] += 1
        if ex["bad_y"] is not None and x.ndim:
            y = fw["relu"][0] if "relu" in fw else ours[0]
            bad_y = y.reshape(-1)[:0] if ex["bad_y"] == "rank" else np.concatenate([y, y])
            if ex["bad_y"] == "shape" and x.shape[0] == 0:
                bad_y = np.zeros((1,) + x.shape[1:], x.dtype)
            expect_error(lambda: _loader.raw_grad_ex_op(y=bad_y, activation_mode="Relu", **gex_kw),
                         tf.errors.InvalidArgumentError, ["y must have the shape of x"],
                         "GradEx with a y of shape %s" % (bad_y.shape,))
            stats["bad_y"] += 1

    check()
    return stats


def test_fuzz_forward_ex_ops():
    n = fuzz_examples(400)
    stats = run_fuzz_child("test_hardening_forward_ex:run_forward_ex_fuzz",
                           {"examples": n, "seed": SEED}, 900)
    assert_fuzz_coverage(stats, min(n, 300),
                         shares={"rejected_as_expected": 0.1, "accepted": 0.4},
                         seen=("bad_mode", "bad_activation", "nonfinite", "empty",
                               "grad_checked", "bad_y"))
