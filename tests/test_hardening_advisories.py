"""Regression tests for advisory-style malformed inputs (SPEC.md sections 4, 7, 9).

TensorFlow's FusedBatchNormGrad* kernels crashed or read out of bounds on malformed inputs
(an empty `scale` segfaulted, tensorflow/tensorflow#58999; the channel-count checks were the
security fixes of tensorflow/tensorflow#49990-49992; validation must still run when x is
empty). Every such input is sent to our op along every path that reaches the kernel or the
core validation:

  raw_eager         fbn_grad_tf.raw_op, eager (no shape function: the kernel validates)
  raw_fn_dynamic    raw_op in a tf.function whose input_signature has unknown shapes
                    (the shape function cannot see anything: the kernel validates)
  raw_fn_static     raw_op in a tf.function traced with the concrete shapes (TF's shape
                    function may reject first, at trace time)
  raw_graph_session raw_op in a tf.Graph with rank-unknown placeholders, run by a Session
  api_eager         fbn_grad_tf.fused_batch_norm_grad, eager (Python pre-validation)
  api_fn_static     the same in a tf.function with concrete shapes
  api_fn_dynamic    the same in a tf.function with unknown shapes (kernel validates)
  java_eager        FusedBatchNormGrad.create(Scope(), ..., Options)
  core_numpy        fbn_grad_tf.core.bn_grad on NumPy arrays (pybind11 module, no TF)

A malformed input must give InvalidArgumentError or ValueError whose message names the
argument and the offending shape(s); a crash fails the case. Valid edge cases (empty
tensors, C = 0, reserve_space_3 of any shape, NCHW inference, 5-D) must succeed on every
path with bitwise identical outputs.

All cases run in one child process (tests/subproc.py): a crash fails its case only.
"""
import zlib

import pytest

import subproc

# ---- cases --------------------------------------------------------------------------------

RANK = {"NHWC": 4, "NCHW": 4, "NDHWC": 5, "NCDHW": 5}
CH_AXIS = {"NHWC": -1, "NCHW": 1, "NDHWC": -1, "NCDHW": 1}
STRICT_MODES = ("raw_eager", "raw_fn_dynamic", "raw_graph_session", "api_eager",
                "api_fn_static", "api_fn_dynamic", "java_eager", "core_numpy")
ALL_MODES = STRICT_MODES + ("raw_fn_static",)
CLEAN_ERRORS = {"InvalidArgumentError", "ValueError", "TypeError", "NotFoundError"}
VALIDATION_ERRORS = {"InvalidArgumentError", "ValueError"}


def shape_str(s):
    return "[" + ",".join(str(d) for d in s) + "]"


def _case(cid, x, scale=None, rs1=None, rs2=None, dy=None, rs3=(), fmt="NHWC", eps=1e-3,
          training=True, dtype="float32", expect="ok", arg=None, shapes=(), scale_dtype=None,
          rs_dtype=None, modes=ALL_MODES):
    """expect: 'ok' (must succeed), 'error' (validation error naming `arg` and `shapes`),
    'clean' (any clean error, or success, e.g. dtype errors that are TypeErrors in Python)."""
    x = list(x)
    c = x[CH_AXIS.get(fmt, -1)] if len(x) == RANK.get(fmt, 4) else 3
    return dict(id=cid, x=x, dy=list(dy) if dy is not None else list(x),
                scale=list(scale) if scale is not None else [c],
                rs1=list(rs1) if rs1 is not None else [c],
                rs2=list(rs2) if rs2 is not None else [c], rs3=list(rs3), fmt=fmt, eps=eps,
                training=training, dtype=dtype, expect=expect, arg=arg, shapes=list(shapes),
                scale_dtype=scale_dtype, rs_dtype=rs_dtype, modes=list(modes))


def build_cases():
    cases = []
    add = cases.append
    X = [2, 3, 2, 4]  # NHWC, C = 4
    # --- scale / reserve_space_1 / reserve_space_2: wrong size or rank (PRs #49990-49992)
    for arg, key in (("scale", "scale"), ("reserve_space_1", "rs1"), ("reserve_space_2", "rs2")):
        for tag, bad in (("empty", [0]), ("short", [3]), ("long", [5]), ("much_long", [4096]),
                         ("rank0", []), ("rank2", [1, 4]), ("rank2_t", [4, 1]),
                         ("rank2_empty", [0, 4]), ("rank3", [1, 1, 4])):
            for training in (True, False):
                add(_case("%s_%s_%s" % (key, tag, "train" if training else "infer"), X,
                          training=training, expect="error", arg=arg, shapes=[shape_str(bad)],
                          **{key: bad}))
    # the original TF 2.4 segfault (tensorflow/tensorflow#58999): empty scale, in every data format and dtype
    for fmt, x in (("NCHW", [2, 4, 3, 2]), ("NDHWC", [1, 2, 3, 2, 4]),
                   ("NCDHW", [1, 4, 2, 3, 2])):
        add(_case("empty_scale_" + fmt, x, scale=[0], fmt=fmt, expect="error", arg="scale",
                  shapes=["[0]"]))
    for dt in ("float16", "bfloat16"):
        add(_case("empty_scale_" + dt, X, scale=[0], dtype=dt, expect="error", arg="scale",
                  shapes=["[0]"]))
    # validation still runs on empty x (TF: step 12 comes after the checks)
    for key, arg in (("scale", "scale"), ("rs1", "reserve_space_1"), ("rs2", "reserve_space_2")):
        add(_case("empty_x_bad_" + key, [0, 3, 2, 4], expect="error", arg=arg,
                  shapes=["[0]"], **{key: [0]}))
        add(_case("empty_x_infer_bad_" + key, [2, 0, 2, 4], training=False, expect="error",
                  arg=arg, shapes=["[5]"], **{key: [5]}))
    # C = 0 with a non-empty vector
    add(_case("c0_scale_1", [2, 3, 2, 0], scale=[1], expect="error", arg="scale",
              shapes=["[1]"]))
    add(_case("c0_rs2_1_nchw", [2, 0, 3, 2], rs2=[1], fmt="NCHW", expect="error",
              arg="reserve_space_2", shapes=["[1]"]))
    # channel count taken from the wrong axis must not pass: NCHW x with C on axis 1
    add(_case("nchw_scale_from_last_axis", [2, 4, 3, 5], scale=[5], rs1=[5], rs2=[5],
              fmt="NCHW", expect="error", arg="scale", shapes=["[5]"]))
    add(_case("nhwc_scale_from_axis1", [2, 4, 3, 5], scale=[4], rs1=[4], rs2=[4],
              fmt="NHWC", expect="error", arg="scale", shapes=["[4]"]))
    # --- x / y_backprop mismatch
    for tag, dy in (("batch", [3, 3, 2, 4]), ("spatial", [2, 3, 3, 4]), ("channel", [2, 3, 2, 5]),
                    ("dy_empty", [0, 3, 2, 4]), ("transposed", [2, 2, 3, 4])):
        add(_case("xdy_mismatch_" + tag, X, dy=dy, expect="error", arg="x and y_backprop",
                  shapes=[shape_str(X), shape_str(dy)]))
    add(_case("xdy_mismatch_x_empty", [0, 3, 2, 4], dy=X, expect="error",
              arg="x and y_backprop", shapes=["[0,3,2,4]", shape_str(X)]))
    add(_case("xdy_mismatch_rank_x5", [2, 3, 2, 1, 4], dy=X, expect="error", arg="x",
              shapes=["[2,3,2,1,4]"]))
    add(_case("xdy_mismatch_rank_dy3", X, dy=[2, 3, 8], expect="error", arg="y_backprop",
              shapes=["[2,3,8]"]))
    add(_case("xdy_mismatch_5d", [1, 2, 3, 2, 4], dy=[1, 2, 3, 4, 2], fmt="NDHWC",
              expect="error", arg="x and y_backprop", shapes=["[1,2,3,2,4]", "[1,2,3,4,2]"]))
    # --- rank 0..6 for every data format (both tensors, then x alone)
    full = [2, 3, 2, 2, 3, 2]
    for fmt, rank in RANK.items():
        for r in range(7):
            if r == rank:
                continue
            shp = full[:r]
            add(_case("rank%d_%s" % (r, fmt), shp, scale=[3], rs1=[3], rs2=[3], fmt=fmt,
                      expect="error", arg="y_backprop", shapes=[shape_str(shp)]))
        good = [2, 3, 2, 3] if rank == 4 else [2, 3, 2, 2, 3]
        c = good[CH_AXIS[fmt]]
        for r in (0, 1, 3, 6):
            shp = full[:r]
            add(_case("x_rank%d_%s" % (r, fmt), shp, dy=good, scale=[c], rs1=[c], rs2=[c],
                      fmt=fmt, expect="error", arg="x", shapes=[shape_str(shp)]))
    # rank of the *other* format: TF's kernel accepts it (only its shape function objects),
    # ours refuses by design (SPEC 4 "Not checked at all"; docs/HARDENING.md)
    add(_case("rank5_under_NHWC", [1, 2, 3, 2, 4], fmt="NHWC", expect="error",
              arg="y_backprop", shapes=["[1,2,3,2,4]"]))
    add(_case("rank4_under_NCDHW", [2, 4, 3, 2], fmt="NCDHW", expect="error",
              arg="y_backprop", shapes=["[2,4,3,2]"]))
    # --- epsilon (ours: finite and >= 0; TF: unchecked)
    for tag, eps in (("neg", -1e-3), ("neg_tiny", -1e-40), ("neg_huge", -3e38),
                     ("nan", float("nan")), ("inf", float("inf")), ("neg_inf", float("-inf")),
                     ("over_float32", 1e39)):
        add(_case("epsilon_" + tag, X, eps=eps, expect="error", arg="epsilon"))
        add(_case("epsilon_%s_infer" % tag, X, eps=eps, training=False, expect="error",
                  arg="epsilon"))
    # --- data types and data_format strings: clean errors (TypeError / InvalidArgument)
    add(_case("dtype_x_float64", X, dtype="float64", expect="clean"))
    add(_case("dtype_x_int32", X, dtype="int32", expect="clean"))
    add(_case("dtype_scale_float16", X, scale_dtype="float16", expect="clean"))
    add(_case("dtype_scale_float64", X, scale_dtype="float64", expect="clean"))
    add(_case("dtype_rs_bfloat16", X, rs_dtype="bfloat16", expect="clean"))
    add(_case("dtype_rs_float16", X, rs_dtype="float16", expect="clean"))
    add(_case("data_format_bogus", X, fmt="NWHC", expect="clean"))
    # --- valid edge cases: must succeed everywhere, identical results on every path
    for fmt, x in (("NHWC", [0, 3, 2, 4]), ("NCHW", [0, 4, 3, 2]), ("NDHWC", [0, 1, 2, 3, 4]),
                   ("NCDHW", [0, 4, 1, 2, 3]), ("NHWC", [2, 0, 2, 4]), ("NCHW", [2, 4, 3, 0]),
                   ("NDHWC", [1, 2, 0, 3, 4])):
        for training in (True, False):
            add(_case("empty_%s_%s_%s" % (fmt, "x".join(map(str, x)),
                                          "train" if training else "infer"), x, fmt=fmt,
                      training=training))
    for fmt, x in (("NHWC", [2, 3, 2, 0]), ("NCHW", [2, 0, 3, 2]), ("NDHWC", [1, 2, 2, 3, 0]),
                   ("NCDHW", [1, 0, 2, 2, 3]), ("NHWC", [0, 0, 0, 0])):
        add(_case("c0_%s_%s" % (fmt, "x".join(map(str, x))), x, fmt=fmt))
    for rs3 in ([], [0], [1], [7], [3, 5], [0, 9], [1, 2, 3, 4, 5, 6], [4096]):
        add(_case("rs3_shape_%s" % ("x".join(map(str, rs3)) or "scalar"), X, rs3=rs3))
        add(_case("rs3_shape_%s_infer_nchw" % ("x".join(map(str, rs3)) or "scalar"),
                  [2, 4, 3, 2], fmt="NCHW", training=False, rs3=rs3))
    for dt in ("float16", "bfloat16"):
        add(_case("rs3_7x3_" + dt, X, rs3=[7, 3], dtype=dt))
    for fmt, x in (("NCHW", [2, 4, 3, 5]), ("NDHWC", [2, 3, 2, 2, 4]), ("NCDHW", [2, 4, 3, 2, 2])):
        for training in (True, False):
            add(_case("valid_%s_%s" % (fmt, "train" if training else "infer"), x, fmt=fmt,
                      training=training))
    add(_case("epsilon_zero", X, eps=0.0))
    add(_case("epsilon_neg_zero", X, eps=-0.0))
    add(_case("epsilon_subnormal", X, eps=1e-45))
    add(_case("epsilon_float32_max", X, eps=3.4028234663852886e38))
    return cases


def _annotate_known_bugs(cases):
    for c in cases:
        c["known_bugs"] = {}  # none open: add {mode: reason} here for a strict xfail
    return cases


def _extra_cases():
    # C = 1: a scalar scale must be refused everywhere. core.bn_grad used to accept it
    # (np.ascontiguousarray made 0-d arrays 1-d); fixed with np.require.
    return [_case("scale_rank0_C1", [2, 3, 2, 1], scale=[], expect="error", arg="scale",
                  shapes=["[]"]),
            _case("rs2_rank0_C1_nchw", [2, 1, 3, 2], rs2=[], fmt="NCHW", expect="error",
                  arg="reserve_space_2", shapes=["[]"])]


CASES = _annotate_known_bugs(build_cases() + _extra_cases())
# ---- the split backward ops (FbnGrad>BatchNormGradReduce / BatchNormGradApply) ----------
# Same validation function (ValidateBnInputs) with other vector names, plus Apply's scalar
# `count`. Paths: raw op eager, raw op in a tf.function with unknown shapes, and the Python
# API (fbn_grad_tf.sync.batch_norm_grad_reduce / _apply).
SPLIT_MODES = ("raw_eager", "raw_fn_dynamic", "api_eager")
SPLIT_VECS = {"reduce": ("mean",),
              "apply": ("scale", "mean", "variance", "sum_dy", "sum_dy_xmu")}


def _split(cid, op, x=(2, 3, 2, 4), dy=None, fmt="NHWC", vec=None, count=24.0,
           count_shape=(), eps=1e-3, expect="ok", arg=None, shapes=()):
    x = list(x)
    c = x[CH_AXIS[fmt]] if len(x) == RANK[fmt] else 4
    vecs = {n: [c] for n in SPLIT_VECS[op]}
    vecs.update(vec or {})
    return dict(id="split_" + cid, op=op, x=x, dy=list(dy) if dy is not None else list(x),
                fmt=fmt, vecs=vecs, count=count, count_shape=list(count_shape), eps=eps,
                expect=expect, arg=arg, shapes=list(shapes), modes=list(SPLIT_MODES),
                dtype="float32")


def build_split_cases():
    cases = []
    add = cases.append
    for tag, bad in (("empty", [0]), ("rank0", []), ("long", [5]), ("rank2", [1, 4])):
        add(_split("reduce_mean_" + tag, "reduce", vec={"mean": bad}, expect="error",
                   arg="mean", shapes=[shape_str(bad)]))
    add(_split("reduce_xdy_mismatch", "reduce", dy=[2, 3, 2, 5], expect="error",
               arg="x and y_backprop", shapes=["[2,3,2,4]", "[2,3,2,5]"]))
    add(_split("reduce_rank3", "reduce", x=[2, 3, 8], expect="error", arg="y_backprop",
               shapes=["[2,3,8]"]))
    add(_split("reduce_empty_x_bad_mean", "reduce", x=[0, 3, 2, 4], vec={"mean": [3]},
               expect="error", arg="mean", shapes=["[3]"]))
    add(_split("reduce_ok_empty", "reduce", x=[0, 3, 2, 4]))
    add(_split("reduce_ok_c0", "reduce", x=[2, 0, 3, 2], fmt="NCHW"))
    add(_split("reduce_ok_ncdhw", "reduce", x=[2, 4, 3, 2, 2], fmt="NCDHW"))
    for name in SPLIT_VECS["apply"]:
        add(_split("apply_%s_empty" % name, "apply", vec={name: [0]}, expect="error",
                   arg=name, shapes=["[0]"]))
    add(_split("apply_sum_dy_rank2", "apply", vec={"sum_dy": [1, 4]}, expect="error",
               arg="sum_dy", shapes=["[1,4]"]))
    add(_split("apply_variance_rank0", "apply", vec={"variance": []}, expect="error",
               arg="variance", shapes=["[]"]))
    add(_split("apply_count_vector", "apply", count_shape=[1], expect="error", arg="count",
               shapes=["[1]"]))
    add(_split("apply_count_matrix_empty", "apply", count_shape=[0, 2], expect="error",
               arg="count", shapes=["[0,2]"]))
    for tag, cnt in (("nan", float("nan")), ("inf", float("inf")), ("zero", 0.0),
                     ("negative", -24.0), ("half", 0.5)):
        add(_split("apply_count_" + tag, "apply", count=cnt, expect="error", arg="count"))
    add(_split("apply_count_zero_empty_x", "apply", x=[0, 3, 2, 4], count=0.0))
    add(_split("apply_eps_negative", "apply", eps=-1e-3, expect="error", arg="epsilon"))
    add(_split("apply_eps_nan", "apply", eps=float("nan"), expect="error", arg="epsilon"))
    add(_split("apply_eps_neg_tiny", "apply", eps=-1e-40, expect="error", arg="epsilon"))
    add(_split("apply_xdy_mismatch", "apply", dy=[2, 3, 2, 5], expect="error",
               arg="x and y_backprop", shapes=["[2,3,2,4]", "[2,3,2,5]"]))
    for fmt, x in (("NHWC", [2, 3, 2, 4]), ("NCHW", [2, 4, 3, 5]), ("NDHWC", [1, 2, 3, 2, 4])):
        add(_split("apply_ok_equals_fused_" + fmt, "apply", x=x, fmt=fmt))
    return cases


SPLIT_CASES = build_split_cases()
for _c in SPLIT_CASES:
    _c["known_bugs"] = {}
KNOWN_BUG_PARAMS = [
    pytest.param(c, m, id="%s-%s" % (c["id"], m),
                 marks=pytest.mark.xfail(strict=True, reason=reason))
    for c in CASES + SPLIT_CASES for m, reason in sorted(c["known_bugs"].items())]


# ---- the child side ---------------------------------------------------------------------

_FN_CACHE = {}


def _arrays(case):
    import numpy as np

    from fbn_grad_tf.core import bfloat16

    def np_dtype(name):
        return bfloat16 if name == "bfloat16" else np.dtype(name)

    rng = np.random.default_rng(zlib.crc32(case["id"].encode()))
    dt = np_dtype(case["dtype"])

    def data(shape, dtype, lo=None):
        if lo is None:
            v = rng.standard_normal(size=shape)
        else:
            v = rng.uniform(lo, 2.0, size=shape)
        return v.astype(dtype)

    x = data(case["x"], dt)
    dy = data(case["dy"], dt)
    sdt = np_dtype(case["scale_dtype"] or "float32")
    rdt = np_dtype(case["rs_dtype"] or "float32")
    return dict(y_backprop=dy, x=x, scale=data(case["scale"], sdt),
                reserve_space_1=data(case["rs1"], rdt),
                reserve_space_2=data(case["rs2"], rdt, lo=0.5),
                reserve_space_3=data(case["rs3"], rdt))


_NAMES = ("y_backprop", "x", "scale", "reserve_space_1", "reserve_space_2", "reserve_space_3")


def _attrs(case):
    return dict(epsilon=case["eps"], data_format=case["fmt"], is_training=case["training"])


def _run_mode(mode, case, arrs):
    import numpy as np
    import tensorflow as tf

    import fbn_grad_tf
    from fbn_grad_tf import core

    attrs = _attrs(case)
    if mode == "core_numpy":
        return core.bn_grad(*(arrs[n] for n in _NAMES[:5]), num_threads=2, **attrs)
    tensors = [tf.constant(arrs[n]) for n in _NAMES]

    def raw(*t):
        return fbn_grad_tf.raw_op(**dict(zip(_NAMES, t)), **attrs)

    def api(*t):
        return fbn_grad_tf.fused_batch_norm_grad(*t, **attrs)

    if mode == "raw_eager":
        return raw(*tensors)
    if mode == "api_eager":
        return api(*tensors)
    if mode == "java_eager":
        G = fbn_grad_tf.FusedBatchNormGrad
        op = G.create(fbn_grad_tf.Scope(), *tensors, G.epsilon(attrs["epsilon"]),
                      G.data_format(attrs["data_format"]).is_training(attrs["is_training"]))
        return op.outputs()
    if mode in ("raw_fn_static", "api_fn_static"):
        return tf.function(raw if mode == "raw_fn_static" else api)(*tensors)
    if mode in ("raw_fn_dynamic", "api_fn_dynamic"):
        key = (mode, tuple(t.dtype for t in tensors), repr(sorted(attrs.items())))
        fn = _FN_CACHE.get(key)
        if fn is None:
            sig = [tf.TensorSpec(None, t.dtype) for t in tensors]
            fn = tf.function(raw if mode == "raw_fn_dynamic" else api, input_signature=sig)
            _FN_CACHE[key] = fn
        return fn(*tensors)
    if mode == "raw_graph_session":
        g = tf.Graph()
        with g.as_default():
            phs = [tf.compat.v1.placeholder(t.dtype, shape=None) for t in tensors]
            outs = raw(*phs)
            with tf.compat.v1.Session(graph=g) as sess:
                return sess.run(list(outs), feed_dict=dict(zip(phs, [arrs[n] for n in _NAMES])))
    raise ValueError(mode)


def _summary(outs):
    import hashlib

    import numpy as np

    arrs = [np.asarray(o) for o in outs]
    h = hashlib.sha1()
    for a in arrs[:3]:
        h.update(str(a.shape).encode())
        h.update(np.ascontiguousarray(a).tobytes())
    return {"status": "ok", "shapes": [list(a.shape) for a in arrs], "digest": h.hexdigest(),
            "dscale": [float(v) for v in arrs[1].astype("float64").ravel()[:8]],
            "doffset": [float(v) for v in arrs[2].astype("float64").ravel()[:8]]}


def _run_split_mode(mode, case, arrs):
    import tensorflow as tf

    import fbn_grad_tf
    from fbn_grad_tf import _loader, sync

    lib = _loader.library
    op = case["op"]
    names = ["y_backprop", "x"] + list(SPLIT_VECS[op]) + (["count"] if op == "apply" else [])
    tensors = [tf.constant(arrs[n]) for n in names]
    kw = {"data_format": case["fmt"]}
    if op == "apply":
        kw["epsilon"] = case["eps"]
    raw_fn = lib.fbn_grad_batch_norm_grad_reduce if op == "reduce" else \
        lib.fbn_grad_batch_norm_grad_apply

    def raw(*t):
        return raw_fn(**dict(zip(names, t)), **kw)

    if mode == "raw_eager":
        out = raw(*tensors)
    elif mode == "raw_fn_dynamic":
        sig = [tf.TensorSpec(None, t.dtype) for t in tensors]
        out = tf.function(raw, input_signature=sig)(*tensors)
    elif mode == "api_eager":
        api = sync.batch_norm_grad_reduce if op == "reduce" else sync.batch_norm_grad_apply
        out = api(*tensors, **kw)
    else:
        raise ValueError(mode)
    out = [out] if op == "apply" else list(out)
    res = {"status": "ok", "shapes": [list(o.shape) for o in out],
           "values": [o.numpy().astype("float64").ravel()[:8].tolist() for o in out]}
    if op == "apply" and case["id"].startswith("split_apply_ok_equals_fused"):
        # with the local sums of Reduce, Apply is bitwise the fused op's x_backprop
        t = dict(zip(names, tensors))
        sums = lib.fbn_grad_batch_norm_grad_reduce(y_backprop=t["y_backprop"], x=t["x"],
                                                   mean=t["mean"], data_format=case["fmt"])
        dx = raw_fn(y_backprop=t["y_backprop"], x=t["x"], scale=t["scale"], mean=t["mean"],
                    variance=t["variance"], sum_dy=sums[0], sum_dy_xmu=sums[1],
                    count=sums[2], **kw)
        fused = fbn_grad_tf.raw_op(y_backprop=t["y_backprop"], x=t["x"], scale=t["scale"],
                                   reserve_space_1=t["mean"], reserve_space_2=t["variance"],
                                   reserve_space_3=tf.zeros([]), epsilon=case["eps"],
                                   data_format=case["fmt"], is_training=True)
        res["equals_fused"] = bool((dx.numpy().view("uint32") ==
                                    fused[0].numpy().view("uint32")).all())
    return res


def _split_arrays(case):
    import numpy as np

    rng = np.random.default_rng(zlib.crc32(case["id"].encode()))
    arrs = {"y_backprop": rng.standard_normal(case["dy"]).astype(np.float32),
            "x": rng.standard_normal(case["x"]).astype(np.float32),
            "count": np.full(case["count_shape"], case["count"], np.float32)}
    for n, shp in case["vecs"].items():
        lo = 0.5 if n == "variance" else None
        arrs[n] = (rng.uniform(lo, 2.0, shp) if lo else rng.standard_normal(shp)).astype(
            np.float32)
    return arrs


def run_case(case):
    """Child side: every mode of one case. Returns {mode: summary or error}."""
    if "op" in case:
        arrs = _split_arrays(case)
        result = {}
        for mode in case["modes"]:
            subproc.note({"case": case["id"], "mode": mode})
            try:
                result[mode] = _run_split_mode(mode, case, arrs)
            except Exception as e:  # noqa: BLE001
                result[mode] = {"status": "raised", "type": type(e).__name__,
                                "message": str(e)}
        return result
    arrs = _arrays(case)
    result = {}
    for mode in case["modes"]:
        subproc.note({"case": case["id"], "mode": mode})
        try:
            result[mode] = _summary(_run_mode(mode, case, arrs))
        except Exception as e:  # noqa: BLE001 - the verdict is checked by the parent
            result[mode] = {"status": "raised", "type": type(e).__name__, "message": str(e)}
    return result


# ---- the parent side --------------------------------------------------------------------

@pytest.fixture(scope="module")
def outcomes():
    outs = subproc.run_cases("test_hardening_advisories:run_case", CASES + SPLIT_CASES,
                             timeout=900)
    return {c["id"]: o for c, o in zip(CASES + SPLIT_CASES, outs)}


def _check_error(case, mode, r):
    assert r["status"] == "raised", "%s: expected an error, got success %r" % (mode, r)
    msg = r["message"]
    if case["expect"] == "clean":
        assert r["type"] in CLEAN_ERRORS, "%s: unexpected %s: %s" % (mode, r["type"], msg)
        return
    assert r["type"] in VALIDATION_ERRORS, "%s: %s instead of a validation error: %s" % (
        mode, r["type"], msg)
    if mode == "raw_fn_static" and "with input shapes" in msg:
        # TF's own shape function rejected it at trace time: its message names the shapes
        # (not the argument). Check the offending shape is listed.
        assert any(s in msg for s in case["shapes"]), "%s: %s" % (mode, msg)
        return
    assert case["arg"] in msg, "%s: message does not name %r: %s" % (mode, case["arg"], msg)
    for s in case["shapes"]:
        assert s in msg, "%s: message does not show shape %s: %s" % (mode, s, msg)


@pytest.mark.parametrize("case", CASES, ids=[c["id"] for c in CASES])
def test_advisory_case(outcomes, case):
    o = outcomes[case["id"]]
    assert o.status == "ok", "case %s did not finish cleanly: %r" % (case["id"], o)
    res = o.value
    failures = []
    for mode in case["modes"]:
        if mode in case["known_bugs"]:
            continue  # checked by test_known_bug (xfail)
        failures += _verdict(case, mode, res[mode])
    if case["expect"] == "ok" and not failures:
        digests = {m: res[m]["digest"] for m in case["modes"]}
        assert len(set(digests.values())) == 1, (
            "outputs differ between paths (must be bitwise identical): %r" % digests)
    assert not failures, "\n".join(failures)


def _tf_shape_str(shape_s):
    """'[2,3]' -> '(2, 3)', the TensorShape spelling the Python split API uses."""
    dims = [d for d in shape_s.strip("[]").split(",") if d]
    return "(" + ", ".join(dims) + ("," if len(dims) == 1 else "") + ")"


@pytest.mark.parametrize("case", SPLIT_CASES, ids=[c["id"] for c in SPLIT_CASES])
def test_split_op_case(outcomes, case):
    o = outcomes[case["id"]]
    assert o.status == "ok", "case %s did not finish cleanly: %r" % (case["id"], o)
    failures = []
    for mode in case["modes"]:
        if mode in case["known_bugs"]:
            continue
        r = o.value[mode]
        if case["expect"] == "ok":
            if r["status"] != "ok":
                failures.append("%s: %s: %s" % (mode, r["type"], r["message"]))
            elif r.get("equals_fused") is False:
                failures.append("%s: Apply(Reduce(...)) is not bitwise the fused x_backprop"
                                % mode)
            continue
        if r["status"] != "raised" or r["type"] not in VALIDATION_ERRORS:
            failures.append("%s: expected a validation error, got %r" % (mode, r))
            continue
        msg = r["message"]
        if case["arg"] not in msg:
            failures.append("%s: message does not name %r: %s" % (mode, case["arg"], msg))
        for sh in case["shapes"]:
            if sh not in msg and not (mode == "api_eager" and _tf_shape_str(sh) in msg):
                failures.append("%s: message does not show shape %s: %s" % (mode, sh, msg))
    assert not failures, "\n".join(failures)


@pytest.mark.parametrize("case,mode", KNOWN_BUG_PARAMS)
def test_known_bug(outcomes, case, mode):
    o = outcomes[case["id"]]
    assert o.status == "ok", "case %s did not finish cleanly: %r" % (case["id"], o)
    if "op" in case:  # split op: the only known bug is an accepted input
        r = o.value[mode]
        assert r["status"] == "raised" and case["arg"] in r.get("message", ""), r
        return
    failures = _verdict(case, mode, o.value[mode])
    assert not failures, "\n".join(failures)


def _verdict(case, mode, r):
    """List of failure messages for one mode of one case (empty: as expected)."""
    try:
        if case["expect"] == "ok":
            assert r["status"] == "ok", "%s: expected success, got %s: %s" % (
                mode, r.get("type"), r.get("message"))
            C = case["scale"][0]
            assert r["shapes"][:3] == [case["x"], [C], [C]], (mode, r["shapes"])
            if mode != "core_numpy":
                assert r["shapes"][3:] == [[0], [0]], (mode, r["shapes"])
            if 0 in case["x"]:
                assert all(v == 0.0 for v in r["dscale"] + r["doffset"]), (mode, r)
        elif case["expect"] == "clean" and r["status"] == "ok":
            pass  # e.g. core.bn_grad converts a float16 scale to float32
        else:
            _check_error(case, mode, r)
    except AssertionError as e:
        return [str(e)]
    return []


def test_case_list_covers_the_advisories():
    ids = {c["id"] for c in CASES}
    for required in ("scale_empty_train", "rs1_empty_train", "rs2_empty_train",
                     "scale_rank0_train", "xdy_mismatch_batch", "empty_x_bad_scale",
                     "rank0_NHWC", "rank6_NCDHW", "c0_scale_1", "epsilon_nan",
                     "rs3_shape_1x2x3x4x5x6"):
        assert required in ids
    assert len(CASES) >= 150


# ---- the isolation harness itself ---------------------------------------------------------

def harness_selftest_case(case):
    """Child side of test_subprocess_harness_reports_crashes (no TF)."""
    import ctypes
    import os

    subproc.note({"about_to": case})
    if case == "abort":
        os.abort()
    if case == "segv":
        ctypes.string_at(0)
    if case == "raise":
        raise ValueError("clean error")
    return case


def test_subprocess_harness_reports_crashes():
    cases = ["ok1", "abort", "ok2", "segv", "raise", "ok3"]
    outs = subproc.run_cases("test_hardening_advisories:harness_selftest_case", cases,
                             timeout=120)
    assert [o.status for o in outs] == ["ok", "crashed", "ok", "crashed", "raised", "ok"], outs
    assert outs[1].last_note == {"about_to": "abort"} and "SIGABRT" in outs[1].detail
    assert "SIGSEGV" in outs[3].detail
    assert outs[4].exc_type == "ValueError" and outs[4].message == "clean error"
    assert outs[5].value == "ok3"
    r = subproc.run_snippet("import os; os.abort()", timeout=60)
    assert r.crashed and not r.clean
