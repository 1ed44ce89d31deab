"""Fuzz of the core's forward, fused-activation and split entry points through the NumPy
binding (TensorFlow never imported): what scripts/sanitize_check.sh runs under
AddressSanitizer + UndefinedBehaviorSanitizer, beside the backward fuzz of
test_hardening_fuzz.run_core_fuzz.

Per hypothesis example (shapes, dtypes, formats, hostile epsilon / exponential_avg_factor,
wrong ranks and vector sizes, empty tensors, NaN/Inf in x, unknown activation strings):

* core.bn_forward with every activation mode the core has (``core.ACTIVATIONS`` when it
  exists, else identity and relu) on every CPU instruction-set path (1 and 4 threads for big
  tensors): rejected inputs raise ValueError naming the argument (the rules of
  test_hardening_forward.model_validate); accepted ones give bitwise identical results on
  every path, relu = max(identity, 0) exactly, identity within a rounding bound of a float64
  reference on finite data, and a channel with a non-finite x is NaN all through in training;
* core.bn_grad (training and inference), with the fused ReLU's mask (relu_y), on every path:
  bitwise identical, and the mask equals masking y_backprop beforehand;
* core.bn_grad_reduce then core.bn_grad_apply: bitwise identical to bn_grad's x_backprop;
  malformed split inputs (vector sizes, count) raise ValueError naming the argument;
* HOOK(side input): when core.bn_forward grows a ``side_input`` parameter (branch exops),
  ``_side_input_checks`` runs; extend it there.

Values are compared NaN-aware (two NaNs match whatever their payload bits).
"""
import inspect
import math
import os

import numpy as np
from hypothesis import given
from hypothesis import seed as hyp_seed
from hypothesis import strategies as st

import subproc
import test_hardening_forward as fwd
from helpers import assert_fuzz_coverage, fuzz_examples, run_fuzz_child, run_fuzz_property
from test_hardening_fuzz import _hyp_settings, _import_core_without_tf, np_dtype

FORMATS = fwd.FORMATS
BAD_ACTIVATIONS = ("relu7", "sigmoid", "", "identity ", "re lu", "tanh", "linear")
OUT_EPS = {"float32": 2e-6, "float16": 2.0 ** -10, "bfloat16": 2.0 ** -7}


def activation_modes(core):
    """The activation modes the core implements: core.ACTIVATIONS when the core lists them
    (relu6 and swish join there), else the two of today."""
    modes = getattr(core, "ACTIVATIONS", ("identity", "relu"))
    out = []
    for m in modes:
        m = "identity" if m is None else str(m).lower()
        if m not in out:
            out.append(m)
    if "identity" not in out:
        out.insert(0, "identity")
    return tuple(out)


def has_side_input(core):
    return "side_input" in inspect.signature(core.bn_forward).parameters


@st.composite
def examples(draw):
    ex = draw(fwd.examples())
    n_special = draw(st.sampled_from([0] * 6 + [1, 3]))
    ex["nonfinite"] = [(draw(st.integers(0, 10 ** 6)),
                        draw(st.sampled_from([float("nan"), float("inf"), float("-inf")])))
                       for _ in range(n_special)]
    ex["bad_activation"] = draw(st.sampled_from([None] * 24 + list(BAD_ACTIVATIONS)))
    ex["split_mutation"] = draw(st.sampled_from(
        ["none"] * 8 + ["mean", "scale", "variance", "sum_dy", "sum_dy_xmu", "count"]))
    ex["count"] = draw(st.sampled_from([0.0, 0.5, -1.0, float("nan"), float("inf")]))
    ex["dymag"] = draw(st.sampled_from([1e-3, 1.0, 100.0]))
    ex["big"] = False
    return ex


def _bits(a):
    a = np.asarray(a)
    return a.view({1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}[a.dtype.itemsize])


def same(a, b, what):
    """Bitwise equal, except that a NaN matches any NaN."""
    a, b = np.asarray(a), np.asarray(b)
    assert a.shape == b.shape and a.dtype == b.dtype, "%s: %s %s vs %s %s" % (
        what, a.shape, a.dtype, b.shape, b.dtype)
    with np.errstate(invalid="ignore"):
        nan_a, nan_b = np.isnan(a.astype(np.float32)), np.isnan(b.astype(np.float32))
    ok = (_bits(a) == _bits(b)) | (nan_a & nan_b)
    if not np.all(ok):
        i = np.flatnonzero(~ok.ravel())[:5]
        raise AssertionError("%s: differ at %d of %d elements, first %s: %s vs %s" % (
            what, int((~ok).sum()), ok.size, i.tolist(), a.ravel()[i].tolist(),
            b.ravel()[i].tolist()))


def _c_axis(fmt, rank):
    return 1 if fmt in ("NCHW", "NCDHW") else rank - 1


def _expect_value_error(fn, names, what):
    """fn() must raise ValueError whose message contains one of `names`."""
    try:
        fn()
    except ValueError as e:
        assert any(n in str(e) for n in names), "%s: error does not name %s: %s" % (
            what, names, e)
        return
    raise AssertionError("%s: accepted, expected a ValueError naming %s" % (what, names))


def _make(ex, rng):
    dt = np_dtype(ex["dtype"])
    x = (ex["loc"] + rng.standard_normal(ex["dims"])).astype(np.float32)
    flat = x.reshape(-1)
    for pos, val in ex["nonfinite"]:
        if flat.size:
            flat[pos % flat.size] = val
    x = x.astype(dt)
    vecs = [rng.uniform(0.5, 1.5, n).astype(np.float32) for n in ex["lens"]]
    dy = (rng.standard_normal(ex["dims"]) * ex["dymag"]).astype(dt)
    return x, dy, vecs


def _side_input_checks(core, ex, x, kw, isas, stats):
    """HOOK(side input): runs once core.bn_forward takes ``side_input`` (y = act(bn(x) +
    side_input), branch exops). What it checks now is only what any definition must satisfy:
    a side input of x's shape and dtype gives bitwise identical results on every ISA path, and
    one of the wrong shape is refused with a ValueError naming side_input. The other engineer
    adds the backward's side-input gradient and the float64 reference here."""
    if x.ndim == 0:
        return
    side = np.ones_like(x)
    outs = [core.bn_forward(side_input=side, isa=isa, num_threads=1, **kw) for isa in isas]
    for isa, o in zip(isas[1:], outs[1:]):
        for name, a, b in zip(("y", "bm", "bv", "rs1", "rs2"), outs[0], o):
            same(a, b, "side_input %s %s vs %s" % (name, isas[0], isa))
    if x.size:
        bad = np.ones(x.shape[:-1] + (x.shape[-1] + 1,), x.dtype)
        _expect_value_error(lambda: core.bn_forward(side_input=bad, **kw), ["side_input"],
                            "side_input of the wrong shape")
    stats["side_input"] += 1


def _fused_backward_checks(core, ex, dy, x, vecs, kw, modes, isas, threads, stats):
    """The Ex backward (activation modes, side input) through core.bn_grad on every path."""
    training = ex["training"]
    gkw = dict(epsilon=ex["epsilon"], data_format=ex["fmt"], is_training=training)
    for with_side in (False, True):
        side = (np.full_like(x, 0.25) if with_side else None)
        for mode in modes:
            if mode == "identity" and not with_side:
                continue
            fo = core.bn_forward(activation=mode, side_input=side, **kw)
            mean, var = (fo[3], fo[4]) if training else (vecs[2], vecs[3])
            extra = dict(activation=mode, side_input_backprop=with_side)
            if mode in ("relu", "relu6"):
                extra["y"] = fo[0]
            if mode == "swish":
                extra["offset"] = kw["offset"]
            if with_side:
                extra["side_input"] = side
            ref = None
            for isa in isas:
                for nt in threads:
                    o = core.bn_grad(dy, x, vecs[0], mean, var, isa=isa, num_threads=nt,
                                     **gkw, **extra)
                    if ref is None:
                        ref = o
                        continue
                    for name, a, b in zip(("dx", "dscale", "doffset", "dside"), ref, o):
                        same(a, b, "backward %s side=%s %s: %s/%d" % (mode, with_side, name,
                                                                      isa, nt))
            if with_side:  # dz is what the BN backward saw: the plain backward of dz agrees
                plain = core.bn_grad(ref[3], x, vecs[0], mean, var, **gkw)
                for name, a, b in zip(("dx", "dscale", "doffset"), ref, plain):
                    same(a, b, "backward %s vs plain backward of dz: %s" % (mode, name))
            stats["fused_backward"] += 1


def run_core_entry_fuzz(cfg):
    """Child side (no TF). cfg: {"examples": n, "seed": s, "big_every": k}."""
    core = _import_core_without_tf()
    isas = [i for i in core.CPU_ISAS if core.cpu_supports(i)]
    modes = activation_modes(core)
    side_input = has_side_input(core)
    stats = {"examples": 0, "forward_rejected": 0, "forward_accepted": 0, "big": 0,
             "bad_activation": 0, "nonfinite": 0, "empty": 0, "compared_reference": 0,
             "backward": 0, "split": 0, "split_rejected": 0, "side_input": 0,
             "fused_backward": 0,
             "isas": isas, "modes": list(modes), "side_input_hook": side_input}
    big_every = cfg.get("big_every", 25)

    @hyp_seed(cfg["seed"])
    @_hyp_settings(cfg["examples"])
    @given(examples(), st.integers(0, 10 ** 9))
    def prop(ex, salt):
        stats["examples"] += 1
        if stats["examples"] % big_every == 0:  # >= 64K elements: several threads
            r = np.random.default_rng(salt)
            fmt = ex["fmt"]
            rank = 5 if fmt in ("NDHWC", "NCDHW") else 4
            dims = [int(d) for d in r.integers(1, 10, size=rank)]
            dims[_c_axis(fmt, rank)] = int(r.choice([1, 3, 17, 64, 300]))
            while np.prod(dims) < 70000:
                dims[int(r.integers(0, rank))] += 7
            c = dims[_c_axis(fmt, rank)]
            ex = dict(ex, dims=dims, lens=[c] * 4, big=True, bad_activation=None,
                      split_mutation="none")
            stats["big"] += 1
        subproc.note(ex)
        rng = np.random.default_rng(ex["seed"])
        x, dy, vecs = _make(ex, rng)
        fmt, training = ex["fmt"], ex["training"]
        kw = dict(x=x, scale=vecs[0], offset=vecs[1] - 1.0, mean=vecs[2], variance=vecs[3],
                  epsilon=ex["epsilon"], exponential_avg_factor=ex["factor"], data_format=fmt,
                  is_training=training)

        # Unknown activation strings: a ValueError naming the argument, before any kernel.
        if ex["bad_activation"] is not None:
            _expect_value_error(lambda: core.bn_forward(activation=ex["bad_activation"], **kw),
                                ["activation"], "activation=%r" % ex["bad_activation"])
            stats["bad_activation"] += 1

        with np.errstate(all="ignore"):
            expect = fwd.model_validate(ex)
        if expect is not None:
            for mode in modes:
                _expect_value_error(lambda: core.bn_forward(activation=mode, **kw), [expect],
                                    "forward, activation %s" % mode)
            stats["forward_rejected"] += 1
            return
        stats["forward_accepted"] += 1
        stats["empty"] += x.size == 0
        stats["nonfinite"] += bool(ex["nonfinite"]) and x.size > 0
        threads = (1, 4) if ex["big"] else (1,)

        # Forward: every mode on every path, bitwise identical.
        fw = {}
        for mode in modes:
            ref = None
            for isa in isas:
                for nt in threads:
                    o = core.bn_forward(activation=mode, isa=isa, num_threads=nt, **kw)
                    if ref is None:
                        ref = o
                        continue
                    for name, a, b in zip(("y", "batch_mean", "batch_var", "rs1", "rs2"),
                                          ref, o):
                        same(a, b, "forward %s %s: %s/%d vs %s/1" % (mode, name, isa, nt,
                                                                     isas[0]))
            fw[mode] = ref
        y_id = fw["identity"][0]
        for mode in modes:  # the statistics do not depend on the activation
            for a, b in zip(fw["identity"][1:], fw[mode][1:]):
                same(a, b, "statistics of %s vs identity" % mode)
        _check_activations(fw, y_id, ex["dtype"])
        _check_forward_values(ex, x, vecs, fw["identity"], stats)
        if side_input:
            _side_input_checks(core, ex, x, kw, isas, stats)

        # Backward of every fused mode, with and without a side input: bitwise identical
        # on every path and thread count, dz = side_input_backprop consistent with the plain
        # backward of dz.
        if side_input and x.ndim:
            _fused_backward_checks(core, ex, dy, x, vecs, kw, modes, isas, threads, stats)

        # Backward: fused ReLU's mask (relu_y) and the split entry points.
        scale = vecs[0]
        mean, var = fw["identity"][3], fw["identity"][4]
        if not training:
            mean, var = vecs[2], vecs[3]
        gkw = dict(epsilon=ex["epsilon"], data_format=fmt, is_training=training)
        for mode in ("identity", "relu"):
            relu_y = fw["relu"][0] if mode == "relu" else None
            ref = None
            for isa in isas:
                for nt in threads:
                    o = core.bn_grad(dy, x, scale, mean, var, relu_y=relu_y, isa=isa,
                                     num_threads=nt, **gkw)
                    if ref is None:
                        ref = o
                    else:
                        for name, a, b in zip(("dx", "dscale", "doffset"), ref, o):
                            same(a, b, "backward %s %s: %s/%d" % (mode, name, isa, nt))
                    if training and nt == 1:
                        _check_split(core, ex, dy, x, scale, mean, var, relu_y, o[0], o[2],
                                     isa, stats)
            if mode == "relu":
                with np.errstate(invalid="ignore"):
                    masked = np.where(relu_y.astype(np.float32) > 0, dy, np.zeros_like(dy))
                plain = core.bn_grad(masked, x, scale, mean, var, **gkw)
                for name, a, b in zip(("dx", "dscale", "doffset"), ref, plain):
                    same(a, b, "relu_y mask vs masked y_backprop: %s" % name)
            stats["backward"] += 1

    return run_fuzz_property(prop, stats)


def _check_activations(fw, y_id, dtype):
    """Each mode's y against the identity's y: exact for the piecewise-linear ones (rounding
    commutes with them), within rounding for smooth ones; NaN stays NaN."""
    y = y_id.astype(np.float64)
    with np.errstate(all="ignore"):
        nan = np.isnan(y)
        for mode, outs in fw.items():
            got = outs[0].astype(np.float64)
            # swish(-inf) = -inf * sigmoid(-inf) = -inf * 0 is NaN (as tf.nn.silu gives).
            want_nan = nan | np.isneginf(y) if mode in ("swish", "silu") else nan
            assert np.array_equal(np.isnan(got), want_nan), "%s: NaN positions differ" % mode
            if mode == "identity":
                continue
            if mode in ("relu", "relu6"):
                want = np.maximum(y, 0.0)
                if mode == "relu6":
                    want = np.minimum(want, 6.0)
                ok = (got == want) | nan
                assert np.all(ok), "%s != its function of the identity output at %d elements" % (
                    mode, int((~ok).sum()))
            elif mode in ("swish", "silu"):
                want = y / (1.0 + np.exp(-y))
                tol = 4 * OUT_EPS[dtype] * (np.abs(y) + np.abs(want)) + 1e-30
                ok = (np.abs(got - want) <= tol) | nan | ~np.isfinite(y)
                assert np.all(ok), "swish off at %d elements" % int((~ok).sum())


def _check_forward_values(ex, x, vecs, outs, stats):
    """Identity forward vs the float64 reference on the channels whose x is finite; a channel
    with a non-finite x is NaN all through in training."""
    if x.size == 0:
        assert all(np.isnan(outs[i]).all() for i in (1, 2)) or not ex["training"]
        return
    fmt = ex["fmt"]
    c_axis = _c_axis(fmt, x.ndim)
    x64 = x.astype(np.float64)
    red = tuple(i for i in range(x.ndim) if i != c_axis)
    finite_c = np.all(np.isfinite(x64), axis=red)
    y = outs[0].astype(np.float64)
    if ex["training"] and not np.all(finite_c):
        y_bad = np.moveaxis(y, c_axis, -1)[..., ~finite_c]
        assert np.all(np.isnan(y_bad)), "a channel with a non-finite x is not NaN all through"
    if not np.all(finite_c):
        return  # the reference below needs finite data (covered by the TF-level fuzz)
    with np.errstate(all="ignore"):
        ref = fwd.reference(x, vecs[0], vecs[1] - 1.0, vecs[2], vecs[3], fmt, ex["training"],
                            ex["factor"], ex["epsilon"])
    if not np.all(np.isfinite(ref[0])):
        return
    out_eps = OUT_EPS[ex["dtype"]]
    a_mag = np.max(np.abs(vecs[0])) / math.sqrt(max(float(np.min(ref[4])), 0.0)
                                               + float(np.float32(ex["epsilon"])))
    bound = (out_eps * np.abs(ref[0]) + 4e-7 * (abs(ex["loc"]) + 8) * a_mag
             + out_eps * (1 + np.max(np.abs(ref[0]))) * 1e-2)
    assert np.all(np.abs(y - ref[0]) <= bound), "y off by %g" % np.max(np.abs(y - ref[0]))
    stats["compared_reference"] += 1


def _check_split(core, ex, dy, x, scale, mean, var, relu_y, dx, doffset, isa, stats):
    """Reduce then apply (local sums and count) is bn_grad's x_backprop bitwise; a malformed
    split input is refused naming the argument."""
    fmt, eps = ex["fmt"], ex["epsilon"]
    kw = dict(data_format=fmt, isa=isa, num_threads=1, relu_y=relu_y)
    s1, s2, n = core.bn_grad_reduce(dy, x, mean, **kw)
    same(s1, doffset, "split %s: sum_dy vs offset_backprop" % isa)
    dx2 = core.bn_grad_apply(dy, x, scale, mean, var, s1, s2, n, epsilon=eps, **kw)
    same(dx2, dx, "split %s: apply(reduce) vs bn_grad x_backprop" % isa)
    stats["split"] += 1
    mut = ex["split_mutation"]
    if mut == "none" or isa != core.CPU_ISAS[0]:
        return
    args = dict(scale=scale, mean=mean, variance=var, sum_dy=s1, sum_dy_xmu=s2)
    count = n
    if mut == "count":
        if x.size == 0:
            return  # no count check without elements (as the TF op)
        count = ex["count"]
    else:
        args[mut] = np.zeros(args[mut].shape[0] + 1, np.float32)
    if mut == "mean":
        _expect_value_error(lambda: core.bn_grad_reduce(dy, x, args["mean"], **kw), ["mean"],
                            "reduce with a bad mean")
    _expect_value_error(
        lambda: core.bn_grad_apply(dy, x, args["scale"], args["mean"], args["variance"],
                                   args["sum_dy"], args["sum_dy_xmu"], count, epsilon=eps,
                                   **kw), [mut], "apply with a bad %s" % mut)
    stats["split_rejected"] += 1


# ---- parent side --------------------------------------------------------------------

SEED = int(os.environ.get("FBN_FUZZ_SEED", "0"))


def test_fuzz_core_entry_points():
    n = fuzz_examples(400)
    stats = run_fuzz_child("test_hardening_core_entry:run_core_entry_fuzz",
                           {"examples": n, "seed": SEED, "big_every": 50}, 900)
    assert_fuzz_coverage(stats, min(n, 300),
                         shares={"forward_rejected": 0.05, "forward_accepted": 0.4},
                         seen=("split", "split_rejected", "bad_activation", "nonfinite",
                               "empty"))
