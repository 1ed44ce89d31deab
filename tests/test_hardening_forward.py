"""Property-based fuzzing of the forward op "FbnGrad>FusedBatchNormV3" (hypothesis).

Random shapes (zero sizes, wrong ranks, wrong or empty vector sizes), dtypes, all four data
formats, training (with exponential_avg_factor 1 and not) and inference, hostile epsilon
and exponential_avg_factor values, and data with large offsets. A Python model of the
validation rules predicts accept or reject:

* reject: the kernel raises InvalidArgumentError naming the argument the model names, and
  fbn_grad_tf.core.bn_forward raises ValueError with the same message;
* accept: y and the four statistics match a float64 evaluation of the same formulas within
  a rounding bound, the op equals core.bn_forward bitwise, and TF's own FusedBatchNormV3
  agrees wherever it accepts the input.

The loop runs in one child process (tests/subproc.py), so a crash fails the test and names
the example that was running.
"""
import math
import os

import numpy as np
from hypothesis import given
from hypothesis import strategies as st

import subproc
from helpers import (assert_fuzz_coverage, fuzz_examples, fuzz_generate_only, np_dtype,
                     run_fuzz_child)

FORMATS = ("NHWC", "NCHW", "NDHWC", "NCDHW")
DTYPES = ("float32", "float16", "bfloat16")
SPECIAL = (1e-3, 0.0, -0.0, 1e-45, 1.0, 1e10, -1e-3, float("nan"), float("inf"), 1e39)
FACTORS = (1.0, 0.3, 0.0, 2.0, -1.0, float("nan"), float("inf"))
SEED = int(os.environ.get("FBN_FUZZ_SEED", "0"))


@st.composite
def examples(draw):
    fmt = draw(st.sampled_from(FORMATS))
    rank = 5 if fmt in ("NDHWC", "NCDHW") else 4
    x_rank = draw(st.sampled_from([rank] * 16 + [rank - 1, rank + 1]))
    dims = [draw(st.integers(0, 4) if i == 0 else st.integers(1, 5)) for i in range(x_rank)]
    c_axis = 1 if fmt in ("NCHW", "NCDHW") else x_rank - 1
    c = dims[c_axis] if x_rank > c_axis else 3
    training = draw(st.booleans())
    factor = draw(st.sampled_from((1.0,) * 6 + (0.3,) * 4 + FACTORS))

    def vec_len():
        return draw(st.sampled_from([c] * 30 + [0, c + 1]))

    return dict(fmt=fmt, dims=dims, dtype=draw(st.sampled_from(DTYPES)), training=training,
                factor=factor, epsilon=draw(st.sampled_from((1e-3,) * 12 + SPECIAL)),
                lens=[vec_len() for _ in range(4)], loc=draw(st.sampled_from([0.0, 3.0, 1e3])),
                seed=draw(st.integers(0, 2 ** 31 - 1)))


def model_validate(ex):
    """None if accepted, else the name the error message must contain."""
    rank = 5 if ex["fmt"] in ("NDHWC", "NCDHW") else 4
    dims = ex["dims"]
    if len(dims) != rank:
        return "x must be %d-dimensional" % rank
    if ex["training"] and not math.isfinite(ex["factor"]):  # inference never reads it
        return "exponential_avg_factor"
    c = dims[1] if ex["fmt"] in ("NCHW", "NCDHW") else dims[-1]
    reads_running = not ex["training"] or ex["factor"] != 1.0
    for name, n in zip(("scale", "offset", "mean", "variance"), ex["lens"]):
        if name in ("mean", "variance") and not reads_running:
            continue  # not read: any length, as TF
        if n != c:
            return name
    eps = np.float32(ex["epsilon"])
    if not np.isfinite(eps) or np.signbit(eps) and eps != 0:
        return "epsilon"
    return None


def reference(x, scale, offset, mean, var, fmt, training, factor, eps):
    x64 = x.astype(np.float64)
    c_axis = 1 if fmt in ("NCHW", "NCDHW") else x.ndim - 1
    axes = tuple(i for i in range(x.ndim) if i != c_axis)
    bshape = [1] * x.ndim
    bshape[c_axis] = -1
    if training:
        m = x64.size // max(scale.size, 1)
        mu, v = x64.mean(axis=axes), x64.var(axis=axes)
        unb = v * m / max(m - 1, 1)
        bm = mu if factor == 1.0 else (1 - factor) * mean + factor * mu
        bv = unb if factor == 1.0 else (1 - factor) * var + factor * unb
    else:
        mu, v = mean.astype(np.float64), var.astype(np.float64)
        bm, bv = mu, v
    a = scale / np.sqrt(v + np.float64(np.float32(eps)))
    y = (x64 - mu.reshape(bshape)) * a.reshape(bshape) + offset.reshape(bshape)
    return y, bm, bv, mu, v


def run_forward_fuzz(cfg):
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import tensorflow as tf
    from fbn_grad_tf import _loader, core
    stats = {"examples": 0, "rejected_as_expected": 0, "compared_tf": 0}

    @fuzz_generate_only(cfg)
    @given(examples())
    def check(ex):
        subproc.note(ex)
        stats["examples"] += 1
        rng = np.random.default_rng(ex["seed"])
        x = (ex["loc"] + rng.standard_normal(ex["dims"])).astype(np.float32)
        x = x.astype(np_dtype(ex["dtype"]))
        vecs = [rng.uniform(0.5, 1.5, n).astype(np.float32) for n in ex["lens"]]
        kw = dict(x=x, scale=vecs[0], offset=vecs[1] - 1.0, mean=vecs[2], variance=vecs[3],
                  epsilon=ex["epsilon"], exponential_avg_factor=ex["factor"],
                  data_format=ex["fmt"], is_training=ex["training"])
        expect = model_validate(ex)
        if expect is not None:
            try:
                _loader.raw_forward_op(**kw)
            except tf.errors.InvalidArgumentError as e:
                assert expect in str(e), (expect, str(e))
            else:
                raise AssertionError("accepted, expected a rejection naming %r" % expect)
            try:
                core.bn_forward(**kw)
            except ValueError as e:
                assert expect in str(e), (expect, str(e))
            else:
                raise AssertionError("core accepted, expected %r" % expect)
            stats["rejected_as_expected"] += 1
            return
        ours = [t.numpy() for t in _loader.raw_forward_op(**kw)]
        mine = core.bn_forward(**kw)
        for a, b in zip(ours[:5], mine):
            assert np.array_equal(a.view(np.uint8), np.asarray(b).view(np.uint8)), "op != core"
        if x.size == 0:
            assert all(np.isnan(ours[i]).all() for i in (1, 2))
            assert all((ours[i] == 0).all() for i in (3, 4))
            return
        ref = reference(x, vecs[0], vecs[1] - 1.0, vecs[2], vecs[3], ex["fmt"], ex["training"],
                        ex["factor"], ex["epsilon"])
        y = ours[0].astype(np.float64)
        out_eps = {"float32": 2e-6, "float16": 2.0 ** -10, "bfloat16": 2.0 ** -7}[ex["dtype"]]
        # x - mean carries float32 rounding of |x| (large offsets): scaled by |a|.
        a_mag = np.max(np.abs(vecs[0])) / math.sqrt(max(float(np.min(ref[4])), 0.0)
                                                   + float(np.float32(ex["epsilon"])))
        bound = (out_eps * np.abs(ref[0]) + 4e-7 * (abs(ex["loc"]) + 8) * a_mag
                 + out_eps * (1 + np.max(np.abs(ref[0]))) * 1e-2)
        if np.all(np.isfinite(ref[0])):
            assert np.all(np.abs(y - ref[0]) <= bound), "y off by %g" % np.max(np.abs(y - ref[0]))
        for got, want, name in zip(ours[1:5], ref[1:5], ("bm", "bv", "rs1", "rs2")):
            scale = np.abs(want) + (abs(ex["loc"]) + 1.0) * 1e-3 + 1e-6
            assert np.all(np.abs(got - want) <= 1e-4 * scale), name
        try:
            theirs = [t.numpy() for t in tf.raw_ops.FusedBatchNormV3(**kw)]
        except tf.errors.InvalidArgumentError:
            return
        stats["compared_tf"] += 1
        for got, want in zip(ours[1:3], theirs[1:3]):
            np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * (abs(ex["loc"]) + 1))

    check()
    return stats


def test_fuzz_forward_op():
    n = fuzz_examples(600)
    stats = run_fuzz_child("test_hardening_forward:run_forward_fuzz",
                           {"examples": n, "seed": SEED}, 900)
    assert_fuzz_coverage(stats, min(n, 500),
                         shares={"rejected_as_expected": 0.1, "compared_tf": 0.25})


# ---- the fused ops (side input, activation) ---------------------------------------------------

EX_MODES = ("Identity", "Relu", "Relu6", "Swish", "Gelu", "relu")


@st.composite
def ex_examples(draw):
    fmt = draw(st.sampled_from(FORMATS))
    rank = 5 if fmt in ("NDHWC", "NCDHW") else 4
    dims = [draw(st.integers(0, 3) if i == 0 else st.integers(1, 4)) for i in range(rank)]
    side = draw(st.sampled_from(["none"] * 3 + ["ok"] * 6 + ["shape", "dtype"]))
    return dict(fmt=fmt, dims=dims, dtype=draw(st.sampled_from(DTYPES)),
                training=draw(st.booleans()), mode=draw(st.sampled_from(EX_MODES * 3 + EX_MODES[:4])),
                side=side, offset_ok=draw(st.sampled_from([True] * 8 + [False])),
                epsilon=draw(st.sampled_from((1e-3,) * 8 + (1e10, 0.0, float("nan")))),
                special=draw(st.sampled_from([None] * 6 + [np.nan, np.inf, -np.inf, 1e30])),
                seed=draw(st.integers(0, 2 ** 31 - 1)))


def run_ex_fuzz(cfg):
    """Never a crash, never silently wrong: a bad side input, activation_mode, offset or
    epsilon is rejected naming it (op and core alike); otherwise the op equals the core
    bitwise, finite inputs give finite outputs, and y matches a float64 evaluation."""
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import tensorflow as tf
    from fbn_grad_tf import _loader, core
    stats = {"examples": 0, "rejected_as_expected": 0, "computed": 0}

    @fuzz_generate_only(cfg)
    @given(ex_examples())
    def check(ex):
        subproc.note(ex)
        stats["examples"] += 1
        rng = np.random.default_rng(ex["seed"])
        dt = np_dtype(ex["dtype"])
        shape = ex["dims"]
        c = shape[1] if ex["fmt"] in ("NCHW", "NCDHW") else shape[-1]
        x = (2 * rng.standard_normal(shape)).astype(np.float32)
        if ex["special"] is not None and x.size:
            x.flat[rng.integers(x.size)] = ex["special"]
        x = x.astype(dt)
        dy = rng.standard_normal(shape).astype(np.float32).astype(dt)
        scale = rng.uniform(0.5, 2, c).astype(np.float32)
        offset = rng.uniform(-1, 4, c).astype(np.float32)
        side = None
        if ex["side"] == "ok":
            side = rng.standard_normal(shape).astype(np.float32).astype(dt)
        elif ex["side"] == "shape":
            side = np.zeros(shape[:-1] + [shape[-1] + 1], dt)
        elif ex["side"] == "dtype":
            side = np.zeros(shape, np.float32 if ex["dtype"] != "float32" else np.float16)
        mode = ex["mode"]
        training = ex["training"]
        eps = ex["epsilon"]
        mean = np.zeros(0 if training else c, np.float32)
        var = np.zeros(0, np.float32) if training else rng.uniform(0.5, 2, c).astype(np.float32)
        # The expected rejection (the first applicable one), as the validation orders them.
        expect = None
        if mode not in ("Identity", "Relu", "Relu6", "Swish"):
            expect = "activation_mode"
        elif not (np.isfinite(np.float32(eps)) and eps >= 0):
            expect = "epsilon"
        elif ex["side"] == "shape":
            expect = "side_input must have the shape of x"
        elif ex["side"] == "dtype":
            expect = "side_input"
        side_list = [] if side is None else [tf.constant(side)]
        kw = dict(x=tf.constant(x), scale=scale, offset=offset, mean=mean, variance=var,
                  epsilon=eps, data_format=ex["fmt"], is_training=training)
        if expect is not None:
            try:
                _loader.raw_forward_ex_op(side_input=side_list, activation_mode=mode, **kw)
            except (tf.errors.InvalidArgumentError, TypeError, ValueError) as e:
                # A side input of another dtype fails TF's type inference (T) first.
                assert expect in str(e) or ex["side"] == "dtype", (expect, str(e))
            else:
                raise AssertionError("accepted, expected a rejection naming %r" % expect)
            # The core's activation argument is case-insensitive ("relu" is valid there).
            if mode != "relu":
                try:
                    core.bn_forward(x, scale, offset, mean, var, epsilon=eps,
                                    data_format=ex["fmt"], is_training=training,
                                    activation=mode, side_input=side)
                except (ValueError, TypeError) as e:
                    bad_side = ex["side"] in ("shape", "dtype") and "side_input" in str(e)
                    assert expect in str(e) or "activation must be" in str(e) or bad_side, (
                        expect, str(e))
                else:
                    raise AssertionError("core accepted, expected %r" % expect)
            stats["rejected_as_expected"] += 1
            return
        fwd = [t.numpy() for t in _loader.raw_forward_ex_op(side_input=side_list,
                                                            activation_mode=mode, **kw)]
        act = mode.lower()
        mine = core.bn_forward(x, scale, offset, mean, var, epsilon=eps, data_format=ex["fmt"],
                               is_training=training, activation=act, side_input=side)
        for a, b in zip(fwd[:5], mine):
            assert np.array_equal(a.view(np.uint8), np.asarray(b).view(np.uint8)), "op != core"
        rs1, rs2 = (fwd[3], fwd[4]) if training else (mean, var)
        offsets = [offset] if ex["offset_ok"] else []
        gkw = dict(y_backprop=dy, x=tf.constant(x), scale=scale, reserve_space_1=rs1,
                   reserve_space_2=rs2, reserve_space_3=np.zeros(0, np.float32), y=fwd[0],
                   offset=offsets, side_input=side_list, epsilon=eps, data_format=ex["fmt"],
                   is_training=training, activation_mode=mode)
        if mode == "Swish" and not ex["offset_ok"]:
            try:
                _loader.raw_grad_ex_op(**gkw)
            except tf.errors.InvalidArgumentError as e:
                assert "offset is required" in str(e)
            else:
                raise AssertionError("Swish backward without offset accepted")
            stats["rejected_as_expected"] += 1
            return
        out = _loader.raw_grad_ex_op(**gkw)
        cb = core.bn_grad(dy, x, scale, rs1, rs2, epsilon=eps, data_format=ex["fmt"],
                          is_training=training, activation=act, y=fwd[0],
                          offset=offset if ex["offset_ok"] else None, side_input=side,
                          side_input_backprop=side is not None)
        for a, b in zip(list(out[:3]) + list(out[5]), cb):
            assert np.array_equal(a.numpy().view(np.uint8), np.asarray(b).view(np.uint8)), \
                "grad op != core"
        stats["computed"] += 1
        if x.size == 0 or ex["special"] is not None or eps > 1e5:
            return
        # Finite inputs, sane epsilon: finite results, y close to float64.
        for a in fwd[:1] + [o.numpy() for o in out[:3]]:
            assert np.all(np.isfinite(a.astype(np.float32))), "non-finite output"
        if training:
            mu64, v64 = None, None
        else:
            mu64, v64 = mean.astype(np.float64), var.astype(np.float64)
        x64 = x.astype(np.float64)
        c_axis = 1 if ex["fmt"] in ("NCHW", "NCDHW") else x.ndim - 1
        axes = tuple(i for i in range(x.ndim) if i != c_axis)
        bshape = [1] * x.ndim
        bshape[c_axis] = -1
        if training:
            mu64, v64 = x64.mean(axis=axes), x64.var(axis=axes)
        z = ((x64 - mu64.reshape(bshape)) / np.sqrt(v64.reshape(bshape) + np.float32(eps))
             * scale.reshape(bshape) + offset.reshape(bshape))
        if side is not None:
            z = z + side.astype(np.float64)
        y = {"Identity": z, "Relu": np.maximum(z, 0), "Relu6": np.clip(z, 0, 6),
             "Swish": z / (1 + np.exp(-z))}[mode]
        tol = {"float32": 1e-4, "float16": 1e-2, "bfloat16": 5e-2}[ex["dtype"]]
        err = np.max(np.abs(fwd[0].astype(np.float64) - y)) / (1 + np.max(np.abs(y)))
        assert err <= tol, "y off by %g" % err

    check()
    return stats


def test_fuzz_ex_ops():
    n = fuzz_examples(400)
    stats = run_fuzz_child("test_hardening_forward:run_ex_fuzz", {"examples": n, "seed": SEED},
                           900)
    assert_fuzz_coverage(stats, min(n, 300),
                         shares={"rejected_as_expected": 0.1, "computed": 0.3})
