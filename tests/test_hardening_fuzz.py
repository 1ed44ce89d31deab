"""Property-based fuzzing of the op and of the framework-free core (hypothesis).

Random shapes (zero sizes, mismatched x/y_backprop, wrong vector sizes and ranks, wrong
tensor rank, reserve_space_3 of any shape), dtypes (float32/float16/bfloat16), all four data
formats, both modes, and epsilon values from ordinary to hostile (0, -0, subnormal, 1,
1e10, float32 max, negative, NaN, +-inf, 1e39 which overflows float32).

For every example a Python model of the validation rules (docs/HARDENING.md) predicts
accept or reject:

* reject: the op must raise InvalidArgumentError (kernel) / ValueError (Python API, core)
  naming the argument the model names;
* accept: results must match a float64 reference within a rounding-error bound derived
  from the data, and TensorFlow's own tf.raw_ops.FusedBatchNormGradV3 wherever TF accepts
  the input (TF refuses NCHW/NCDHW inference on CPU: the float64 reference covers those).
  The op must also equal fbn_grad_tf.core.bn_grad bitwise (same core code, and the core
  promises results independent of the thread partition), and in training the split ops
  (BatchNormGradReduce, then BatchNormGradApply with the local sums) must give the same
  bits as the fused op.

The core fuzz (no TensorFlow imported at all; also what scripts/asan_check.sh runs under
AddressSanitizer) additionally checks that every CPU instruction-set path and thread count
gives bitwise identical results.

Each fuzz loop runs inside ONE child process (tests/subproc.py), so a crash fails the test
and reports the example being run. CI mode: >= 2,000 examples per loop on small tensors;
`-m slow` runs many more. FBN_FUZZ_SEED (default 0) picks the hypothesis seed;
FBN_FUZZ_EXAMPLES overrides the number of examples.
"""
import math
import os
import zlib

import numpy as np
import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import seed as hyp_seed
from hypothesis import strategies as st

import subproc
from helpers import assert_fuzz_coverage, fuzz_examples, run_fuzz_child, run_fuzz_property

FORMATS = ("NHWC", "NCHW", "NDHWC", "NCDHW")
RANK = {"NHWC": 4, "NCHW": 4, "NDHWC": 5, "NCDHW": 5}
CHANNELS_FIRST = {"NCHW", "NCDHW"}
DTYPES = ("float32", "float16", "bfloat16")
U32 = 2.0 ** -24
OUT_EPS = {"float32": 0.0, "float16": 2.0 ** -10, "bfloat16": 2.0 ** -7}
OUT_TINY = {"float32": 0.0, "float16": 2.0 ** -24, "bfloat16": 2.0 ** -133}
# Round-to-nearest gives +-inf from max + half an ulp on (half: 65504 + 16).
OVERFLOW_AT = {"float32": 3.4028234663852886e38 + 2.0 ** 103, "float16": 65520.0,
               "bfloat16": 3.3895313892515355e38 + 2.0 ** 119}
SPECIAL_EPS = (1e-3, 1e-5, 1.001e-5, 0.0, -0.0, 1e-45, 1e-38, 1.0, 1e10, 3.4028234663852886e38,
               -1e-3, -1.0, -3e38, float("nan"), float("inf"), float("-inf"), 1e39)


def shape_str(s):
    return "[" + ",".join(str(int(d)) for d in s) + "]"


def channel_axis(fmt):
    return 1 if fmt in CHANNELS_FIRST else RANK[fmt] - 1


# ---- the validation model ------------------------------------------------------------

def model_validate(dy, x, scale, rs1, rs2, fmt, eps):
    """What ValidateBnGradInputs decides, in its order. None (accept) or (arg, shapes)."""
    rank = RANK[fmt]
    if len(dy) != rank:
        return "y_backprop", [shape_str(dy)]
    if len(x) != rank:
        return "x", [shape_str(x)]
    if list(x) != list(dy):
        return "x and y_backprop", [shape_str(x), shape_str(dy)]
    named = (("scale", scale), ("reserve_space_1", rs1), ("reserve_space_2", rs2))
    for name, s in named:
        if len(s) != 1:
            return name, [shape_str(s)]
    c = x[channel_axis(fmt)]
    for name, s in named:
        if s[0] != c:
            return name, [shape_str(s)]
    with np.errstate(over="ignore"):
        e32 = np.float32(eps)
    if not np.isfinite(e32) or e32 < 0:
        return "epsilon", []
    return None


# ---- example generation -------------------------------------------------------------

MUTATIONS = ("none",) * 20 + ("dy_shape", "scale_size", "rs1_size", "rs2_size", "scale_rank",
                              "rs_rank", "rank", "dy_rank", "vec_empty")


@st.composite
def examples(draw, max_elems=256):
    fmt = draw(st.sampled_from(FORMATS))
    rank = RANK[fmt]
    size = st.sampled_from((0,) + (1, 2, 3, 4, 5) * 3)  # a zero in ~1 of 16 dims
    dims = [draw(size) for _ in range(rank)]
    dims[channel_axis(fmt)] = draw(st.sampled_from((0,) + (1, 2, 3, 4, 5, 6, 7) * 2))
    while int(np.prod(dims)) > max_elems:
        i = dims.index(max(dims))
        dims[i] //= 2
    c = dims[channel_axis(fmt)]
    x = list(dims)
    dy = list(dims)
    vec = {"scale": [c], "rs1": [c], "rs2": [c]}
    mut = draw(st.sampled_from(MUTATIONS))
    if mut == "dy_shape":
        i = draw(st.integers(0, rank - 1))
        dy[i] = draw(st.integers(0, 5).filter(lambda v: v != x[i]))
    elif mut in ("scale_size", "rs1_size", "rs2_size"):
        vec[mut[:-5]] = [draw(st.integers(0, 8).filter(lambda v: v != c))]
    elif mut == "scale_rank":
        vec["scale"] = draw(st.sampled_from([[], [1, c], [c, 1], [c, c, 1]]))
    elif mut == "rs_rank":
        vec[draw(st.sampled_from(["rs1", "rs2"]))] = draw(st.sampled_from([[], [c, 1], [1, c]]))
    elif mut == "rank":
        r = draw(st.integers(0, 6).filter(lambda v: v != rank))
        x = [draw(st.integers(1, 3)) for _ in range(r)]
        dy = list(x)
    elif mut == "dy_rank":
        r = draw(st.integers(0, 6).filter(lambda v: v != rank))
        dy = [draw(st.integers(1, 3)) for _ in range(r)]
    elif mut == "vec_empty":
        vec[draw(st.sampled_from(["scale", "rs1", "rs2"]))] = [0]
    eps = draw(st.one_of(st.sampled_from(SPECIAL_EPS),
                         st.floats(0.0, 10.0, width=32),
                         st.floats(1e-8, 1e-2)))
    rs3 = [draw(st.integers(0, 3)) for _ in range(draw(st.integers(0, 3)))]
    return dict(fmt=fmt, dtype=draw(st.sampled_from(DTYPES)), training=draw(st.booleans()),
                eps=eps, x=x, dy=dy, scale=vec["scale"], rs1=vec["rs1"], rs2=vec["rs2"],
                rs3=rs3, mutation=mut, seed=draw(st.integers(0, 2 ** 32 - 1)),
                xmag=draw(st.sampled_from([1e-2, 1.0, 30.0])),
                dymag=draw(st.sampled_from([1e-3, 1.0, 100.0])),
                smag=draw(st.sampled_from([0.0, 1.0, 10.0])),
                mmag=draw(st.sampled_from([0.0, 1.0, 100.0])),
                var_zero=draw(st.booleans()))


def np_dtype(name):
    if name == "bfloat16":
        from ml_dtypes import bfloat16
        return bfloat16
    return np.dtype(name)


def make_arrays(ex):
    rng = np.random.default_rng(ex["seed"])
    dt = np_dtype(ex["dtype"])

    def vec(shape, mag, lo=None):
        if lo is not None:
            return rng.uniform(lo, 3.0, size=shape).astype(np.float32)
        return (rng.standard_normal(size=shape) * mag).astype(np.float32)

    mean = vec(ex["rs1"], ex["mmag"])
    center = float(mean.reshape(-1)[0]) if mean.size else 0.0  # keeps x - mean moderate
    x = (rng.standard_normal(size=ex["x"]) * ex["xmag"] + center).astype(dt)
    dy = (rng.standard_normal(size=ex["dy"]) * ex["dymag"]).astype(dt)
    var = vec(ex["rs2"], 0, lo=0.0)
    if ex["var_zero"] and var.size:
        var.reshape(-1)[::2] = 0.0
    return dict(y_backprop=dy, x=x, scale=vec(ex["scale"], ex["smag"]),
                reserve_space_1=mean, reserve_space_2=var,
                reserve_space_3=np.zeros(ex["rs3"], np.float32))


# ---- float64 reference with a rounding-error bound ------------------------------------

class Reference:
    """Exact (float64) result and per-element error bounds for one accepted example.

    inv = 1/sqrt(var + eps) is computed in float32 exactly as the kernels do (IEEE add,
    sqrt, divide), everything else in float64. `comparable` is False when a float32
    intermediate of the kernel would overflow (then only shapes and finiteness rules are
    checked)."""

    def __init__(self, ex, arrs, flush_denormals=False):
        fmt = ex["fmt"]
        ax = channel_axis(fmt)
        x = arrs["x"].astype(np.float64)
        dy = arrs["y_backprop"].astype(np.float64)
        c = x.shape[ax]
        bshape = [1] * x.ndim
        bshape[ax] = c
        red = tuple(i for i in range(x.ndim) if i != ax)
        with np.errstate(all="ignore"):
            eps32 = np.float32(ex["eps"])
            var32 = arrs["reserve_space_2"]
            if flush_denormals:
                # TensorFlow runs kernels with denormals flushed to zero (FTZ/DAZ): a
                # subnormal epsilon (or variance) acts as 0 in the op, as in TF's own op.
                tiny = np.finfo(np.float32).tiny
                eps32 = np.float32(0.0) if abs(eps32) < tiny else eps32
                var32 = np.where(np.abs(var32) < tiny, np.float32(0.0), var32)
            inv32 = np.float32(1.0) / np.sqrt(var32 + eps32)
            inv = inv32.astype(np.float64)
            sc = arrs["scale"].astype(np.float64)
            a32 = (arrs["scale"] * inv32).astype(np.float64)
            mean = arrs["reserve_space_1"].astype(np.float64)
            m_count = x.size // c if c else 0
            xc = x - mean.reshape(bshape)
            s1 = dy.sum(axis=red)
            s2 = (dy * xc).sum(axis=red)
            a1 = np.abs(dy).sum(axis=red)
            a2 = np.abs(dy * xc).sum(axis=red)
            self.doffset = s1
            self.dscale = inv * s2
            self.tol_doffset = (m_count + 4) * U32 * a1
            self.tol_dscale = (m_count + 8) * U32 * inv * a2 + 4 * U32 * np.abs(self.dscale)
            ab = np.abs(a32).reshape(bshape)
            if ex["training"]:
                mm = max(m_count, 1)
                q = (inv * inv * s2 / mm).reshape(bshape)
                self.dx = a32.reshape(bshape) * ((dy - (s1 / mm).reshape(bshape)) - xc * q)
                bound = ab * (np.abs(dy) + (a1 / mm).reshape(bshape)
                              + np.abs(xc) * (inv * inv * a2 / mm).reshape(bshape))
                self.tol_dx = (m_count + 12) * U32 * bound
                biggest = [np.max(inv * inv * a2 / mm, initial=0), np.max(bound, initial=0),
                           np.max(np.abs(a32), initial=0) * np.max(np.abs(dy), initial=0)]
            else:
                self.dx = dy * a32.reshape(bshape)
                self.tol_dx = 2 * U32 * np.abs(self.dx)
                biggest = [np.max(np.abs(self.dx), initial=0)]
            self.comparable = bool(np.all(np.isfinite(inv)) and np.all(np.isfinite(a32))
                                   and all(np.isfinite(b) and b < 1e36 for b in biggest)
                                   and np.all(np.isfinite(a2 * inv)))
        self.dtype = ex["dtype"]

    def check(self, dx, dscale, doffset, slack=1.0, what="op"):
        """Asserts that outputs are within `slack` times the bound of the reference."""
        if not self.comparable:
            return
        _close(what + " doffset", np.asarray(doffset, np.float64), self.doffset,
               slack * self.tol_doffset, "float32")
        _close(what + " dscale", np.asarray(dscale, np.float64), self.dscale,
               slack * self.tol_dscale, "float32")
        _close(what + " x_backprop", np.asarray(dx).astype(np.float64), self.dx,
               slack * self.tol_dx, self.dtype)


def _close(name, got, ref, tol, dtype):
    assert got.shape == ref.shape, "%s: shape %s, expected %s" % (name, got.shape, ref.shape)
    if got.size == 0:
        return
    eps16, tiny, big = OUT_EPS[dtype], OUT_TINY[dtype], OVERFLOW_AT[dtype]
    allowed = tol * (1 + eps16) + eps16 * np.abs(ref) + tiny
    with np.errstate(all="ignore"):
        overflow = np.abs(ref) - tol > big   # must round to +-inf
        edge = np.abs(ref) + tol >= big      # may round either way
        ok = np.abs(got - ref) <= allowed
        ok |= edge & np.isinf(got) & (np.sign(got) == np.sign(ref))
        ok &= ~(overflow & ~np.isinf(got))
    if not np.all(ok):
        i = np.flatnonzero(~ok.ravel())[:5]
        raise AssertionError("%s (%s) off at %d of %d elements, first flat indices %s: got %s, "
                             "reference %s, allowed error %s" % (
                                 name, dtype, int((~ok).sum()), ok.size, i.tolist(),
                                 got.ravel()[i].tolist(), ref.ravel()[i].tolist(),
                                 allowed.ravel()[i].tolist()))


def _bitwise_equal(name, a, b):
    a, b = np.asarray(a), np.asarray(b)
    assert a.shape == b.shape, "%s: shapes %s vs %s" % (name, a.shape, b.shape)
    av = a.view(np.uint16 if a.dtype.itemsize == 2 else np.uint32)
    bv = b.view(np.uint16 if b.dtype.itemsize == 2 else np.uint32)
    if not np.array_equal(av, bv):
        i = np.flatnonzero(av.ravel() != bv.ravel())[:5]
        raise AssertionError("%s: not bitwise equal at %d elements, first %s: %s vs %s" % (
            name, int((av != bv).sum()), i.tolist(), a.ravel()[i].tolist(),
            b.ravel()[i].tolist()))


def _describe(ex):
    return {k: ex[k] for k in ("fmt", "dtype", "training", "eps", "x", "dy", "scale", "rs1",
                               "rs2", "rs3", "mutation", "seed", "xmag", "dymag", "smag",
                               "mmag", "var_zero")}


def _hyp_settings(n):
    return settings(max_examples=n, deadline=None, database=None, print_blob=True,
                    suppress_health_check=list(HealthCheck),
                    phases=[Phase.generate, Phase.shrink])


# ---- child: fuzz through TensorFlow ----------------------------------------------------

def run_tf_fuzz(cfg):
    """Child side. cfg: {"examples": n, "seed": s}. Returns statistics."""
    import tensorflow as tf

    import fbn_grad_tf
    from fbn_grad_tf import core

    stats = {"examples": 0, "rejected_as_expected": 0, "accepted": 0, "compared_tf": 0,
             "tf_refused": 0, "compared_reference": 0, "api_checked": 0, "fn_checked": 0,
             "not_comparable": 0}
    fn_cache = {}
    names = ("y_backprop", "x", "scale", "reserve_space_1", "reserve_space_2",
             "reserve_space_3")

    def call_raw(ex, t):
        return fbn_grad_tf.raw_op(**dict(zip(names, t)), epsilon=ex["eps"],
                                  data_format=ex["fmt"], is_training=ex["training"])

    def call_fn(ex, t):
        key = (t[0].dtype, ex["fmt"], ex["training"], repr(ex["eps"]))
        fn = fn_cache.get(key)
        if fn is None:
            if len(fn_cache) > 200:
                fn_cache.clear()
            sig = [tf.TensorSpec(None, v.dtype) for v in t]
            fn = tf.function(lambda *a: call_raw(ex, a), input_signature=sig)
            fn_cache[key] = fn
        return fn(*t)

    @hyp_seed(cfg["seed"])
    @_hyp_settings(cfg["examples"])
    @given(examples())
    def prop(ex):
        stats["examples"] += 1
        subproc.note(_describe(ex))
        arrs = make_arrays(ex)
        t = [tf.constant(arrs[n]) for n in names]
        expected = model_validate(ex["dy"], ex["x"], ex["scale"], ex["rs1"], ex["rs2"],
                                  ex["fmt"], ex["eps"])
        i = stats["examples"]
        try:
            out = call_raw(ex, t)
            err = None
        except tf.errors.InvalidArgumentError as e:
            out, err = None, str(e)
        if expected is not None:
            arg, shapes = expected
            assert err is not None, "accepted an input the rules reject (%s): %s" % (
                arg, _describe(ex))
            assert arg in err and all(s in err for s in shapes), (
                "error does not name %s %s: %s" % (arg, shapes, err))
            stats["rejected_as_expected"] += 1
            if i % 5 == 0:  # the Python API must refuse it too, with the same argument named
                stats["api_checked"] += 1
                try:
                    fbn_grad_tf.fused_batch_norm_grad(*t, epsilon=ex["eps"],
                                                      data_format=ex["fmt"],
                                                      is_training=ex["training"])
                    raise AssertionError("API accepted what the kernel rejects")
                except (ValueError, tf.errors.InvalidArgumentError) as e:
                    assert arg in str(e), str(e)
            return
        assert err is None, "rejected a valid input: %s\n%s" % (err, _describe(ex))
        stats["accepted"] += 1
        dx, dscale, doffset, rs4, rs5 = (o.numpy() for o in out)
        assert rs4.shape == (0,) and rs5.shape == (0,)
        assert dx.dtype == arrs["x"].dtype and dx.shape == arrs["x"].shape
        # same core, any thread partition: bitwise equal to the numpy path
        cdx, cds, cdo = core.bn_grad(*(arrs[n] for n in names[:5]), epsilon=ex["eps"],
                                     data_format=ex["fmt"], is_training=ex["training"],
                                     num_threads=1)
        # TF runs kernels with denormals flushed to zero (FTZ/DAZ), the NumPy core does
        # not: bitwise equality holds unless a subnormal can occur, i.e. a subnormal
        # epsilon or inv^2 = 1/(var + eps) below FLT_MIN (epsilon near float32 max).
        tiny32 = np.finfo(np.float32).tiny
        with np.errstate(all="ignore"):
            inv2 = 1.0 / (arrs["reserve_space_2"].astype(np.float64) + np.float32(ex["eps"]))
        ftz_may_matter = (0 < abs(ex["eps"]) < tiny32
                          or bool(np.any(np.abs(inv2) < 4 * tiny32)))
        if not ftz_may_matter:
            for nm, a, b in (("dx", dx, cdx), ("dscale", dscale, cds),
                             ("doffset", doffset, cdo)):
                _bitwise_equal("op vs core " + nm, a, b)
        ref = Reference(ex, arrs, flush_denormals=True)
        if not ref.comparable:
            stats["not_comparable"] += 1
        else:
            stats["compared_reference"] += 1
            ref.check(dx, dscale, doffset, what="op")
        # TF's own op, wherever it accepts the input
        try:
            tf_out = tf.raw_ops.FusedBatchNormGradV3(
                y_backprop=t[0], x=t[1], scale=t[2], reserve_space_1=t[3],
                reserve_space_2=t[4], reserve_space_3=t[5], epsilon=ex["eps"],
                data_format=ex["fmt"], is_training=ex["training"])
        except tf.errors.InvalidArgumentError as e:
            assert (not ex["training"] and ex["fmt"] in CHANNELS_FIRST), (
                "TF refused an input ours accepts: %s %s" % (e, _describe(ex)))
            stats["tf_refused"] += 1
        else:
            stats["compared_tf"] += 1
            tdx = tf_out[0].numpy()
            if tdx.size == 0 and tdx.shape != dx.shape:
                # TF quirk: for an empty 5-D input TF's CPU kernel returns x_backprop in its
                # internal 4-D view (it returns before reshaping back). Ours keeps x's shape.
                assert len(ex["x"]) == 5, (tdx.shape, _describe(ex))
                stats["tf_empty_5d_shape_quirk"] = stats.get("tf_empty_5d_shape_quirk", 0) + 1
                tdx = tdx.reshape(dx.shape)
            if ref.comparable:
                ref.check(tdx, tf_out[1].numpy(), tf_out[2].numpy(), slack=2.0, what="TF")
        if i % 7 == 0:  # tf.function with unknown shapes: same kernel, same bits
            stats["fn_checked"] += 1
            fout = call_fn(ex, t)
            for nm, a, b in zip(("dx", "dscale", "doffset"), out[:3], fout[:3]):
                _bitwise_equal("tf.function " + nm, a.numpy(), b.numpy())
        if ex["training"] and i % 3 == 0:
            # the split backward (Reduce, then Apply with the local sums) is bitwise the
            # fused op's x_backprop, and Reduce's sums are its offset/scale gradients
            lib = fbn_grad_tf._loader.library
            sums = lib.fbn_grad_batch_norm_grad_reduce(y_backprop=t[0], x=t[1], mean=t[3],
                                                       data_format=ex["fmt"])
            sdx = lib.fbn_grad_batch_norm_grad_apply(
                y_backprop=t[0], x=t[1], scale=t[2], mean=t[3], variance=t[4], sum_dy=sums[0],
                sum_dy_xmu=sums[1], count=sums[2], epsilon=ex["eps"], data_format=ex["fmt"])
            _bitwise_equal("split Apply vs fused dx", sdx.numpy(), dx)
            _bitwise_equal("split Reduce sum_dy vs fused offset_backprop", sums[0].numpy(),
                           doffset)
            stats["split_checked"] = stats.get("split_checked", 0) + 1
        if i % 11 == 0:
            stats["api_checked"] += 1
            aout = fbn_grad_tf.fused_batch_norm_grad(*t, epsilon=ex["eps"],
                                                     data_format=ex["fmt"],
                                                     is_training=ex["training"])
            for nm, a, b in zip(("dx", "dscale", "doffset"), out[:3], aout[:3]):
                _bitwise_equal("api " + nm, a.numpy(), b.numpy())

    return run_fuzz_property(prop, stats)


# ---- child: fuzz the framework-free core (no TensorFlow) -------------------------------

def _import_core_without_tf():
    import sys
    if "tensorflow" not in sys.modules:
        # fbn_grad_tf/__init__ imports TF when it is installed; block it so this fuzz runs
        # on the bare core (and works with a core-only build such as the ASan one).
        sys.modules["tensorflow"] = None
    from fbn_grad_tf import core
    return core


def run_core_fuzz(cfg):
    """Child side (no TF). cfg: {"examples": n, "seed": s, "big_every": k}."""
    core = _import_core_without_tf()
    isas = [i for i in core.CPU_ISAS if core.cpu_supports(i)]
    stats = {"examples": 0, "rejected_as_expected": 0, "accepted": 0, "compared_reference": 0,
             "big": 0, "isas": isas, "not_comparable": 0}
    names = ("y_backprop", "x", "scale", "reserve_space_1", "reserve_space_2")
    big_every = cfg.get("big_every", 25)

    @hyp_seed(cfg["seed"])
    @_hyp_settings(cfg["examples"])
    @given(examples(), st.integers(0, 10 ** 9))
    def prop(ex, salt):
        stats["examples"] += 1
        big = stats["examples"] % big_every == 0
        if big:  # enough work for several threads (ThreadRunner needs >= 64K elements)
            rng = np.random.default_rng(salt)
            fmt = ex["fmt"]
            dims = [int(d) for d in rng.integers(1, 12, size=RANK[fmt])]
            dims[channel_axis(fmt)] = int(rng.choice([1, 3, 17, 64, 300]))
            while np.prod(dims) < 70000:
                dims[int(rng.integers(0, RANK[fmt]))] += 7
            c = dims[channel_axis(fmt)]
            ex = dict(ex, x=dims, dy=dims, scale=[c], rs1=[c], rs2=[c], mutation="big")
            stats["big"] += 1
        subproc.note(_describe(ex))
        arrs = make_arrays(ex)
        args = [arrs[n] for n in names]
        expected = model_validate(ex["dy"], ex["x"], ex["scale"], ex["rs1"], ex["rs2"],
                                  ex["fmt"], ex["eps"])
        kw = dict(epsilon=ex["eps"], data_format=ex["fmt"], is_training=ex["training"])
        if expected is not None:
            arg, shapes = expected
            try:
                core.bn_grad(*args, num_threads=1, **kw)
            except ValueError as e:
                assert arg in str(e) and all(sh in str(e) for sh in shapes), (
                    "error does not name %s %s: %s" % (arg, shapes, e))
                stats["rejected_as_expected"] += 1
                return
            raise AssertionError("core accepted an input the rules reject (%s)" % arg)
        stats["accepted"] += 1
        outs = {}
        for isa in isas:
            for nt in ((1, 4) if big else (1,)):
                outs[(isa, nt)] = core.bn_grad(*args, num_threads=nt, isa=isa, **kw)
        first_key = next(iter(outs))
        first = outs[first_key]
        for key, o in outs.items():
            for nm, a, b in zip(("dx", "dscale", "doffset"), first, o):
                _bitwise_equal("%s vs %s %s" % (first_key, key, nm), a, b)
        ref = Reference(ex, arrs)
        if ref.comparable:
            stats["compared_reference"] += 1
            ref.check(*first, what="core")
        else:
            stats["not_comparable"] += 1

    return run_fuzz_property(prop, stats)


# ---- parent side --------------------------------------------------------------------

SEED = int(os.environ.get("FBN_FUZZ_SEED", "0"))


def test_fuzz_tf_op():
    n = fuzz_examples(2200)
    stats = run_fuzz_child("test_hardening_fuzz:run_tf_fuzz", {"examples": n, "seed": SEED}, 900)
    assert_fuzz_coverage(stats, min(n, 2000),
                         shares={"rejected_as_expected": 0.15, "compared_tf": 0.3})


def test_fuzz_core():
    n = fuzz_examples(2500)
    stats = run_fuzz_child("test_hardening_fuzz:run_core_fuzz",
                           {"examples": n, "seed": SEED, "big_every": 40}, 900)
    assert_fuzz_coverage(stats, min(n, 2000), shares={"compared_reference": 0.3})


@pytest.mark.slow
def test_fuzz_tf_op_long():
    stats = run_fuzz_child("test_hardening_fuzz:run_tf_fuzz",
                           {"examples": fuzz_examples(30000), "seed": SEED + 1}, 3600)
    assert_fuzz_coverage(stats, 10000)


@pytest.mark.slow
def test_fuzz_core_long():
    stats = run_fuzz_child("test_hardening_fuzz:run_core_fuzz",
                           {"examples": fuzz_examples(30000), "seed": SEED + 1, "big_every": 10},
                           3600)
    assert_fuzz_coverage(stats, 10000)
