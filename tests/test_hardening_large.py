"""64-bit indexing.

Fast (CI) part, one child process:
  * shapes whose element count overflows int64, or with negative dims, are rejected by the
    validation with a clear message (core.validate: no memory is needed for this);
  * the largest representable shapes are accepted and mapped to the right
    [outer, C, inner] view;
  * zero-element tensors with huge dims (TF allows [0, 2^40, 2^40, 3]) go through the op
    in every data format and dtype and through the Python API: empty x_backprop of the
    same shape and zero scale/offset gradients, or (only where a product of non-channel
    dims overflows int64) a clean "... must fit in 64 bits" error; never a crash.

Slow part (`-m slow`): one tensor of more than 2^31 elements (half precision, about 4.3 GB
per tensor, three tensors) through the NumPy core path; scale/offset gradients are checked
against float64 sums over all elements (computed in chunks), x_backprop at a sample of
elements, densest past index 2^31, against a float64 reference.
"""
import os
import time

import numpy as np
import pytest

import subproc

I64_MAX = 2 ** 63 - 1


def _core_without_tf():
    import sys
    if "tensorflow" not in sys.modules:
        sys.modules["tensorflow"] = None  # the core alone; TF is not needed here
    from fbn_grad_tf import core
    return core


# ---- fast: validation arithmetic -------------------------------------------------------

OVERFLOW_SHAPES = [
    ("NHWC", [2 ** 31, 2 ** 31, 2, 1]),       # 2^63: one past int64
    ("NHWC", [2 ** 62, 2, 1, 1]),
    ("NCHW", [3, 1, 2 ** 62, 1]),
    ("NDHWC", [2 ** 21, 2 ** 21, 2 ** 21, 1, 1]),
    ("NCDHW", [1, 2, 2 ** 32, 2 ** 32, 1]),
    ("NHWC", [I64_MAX, 2, 1, 1]),
    ("NHWC", [-1, 2, 2, 3]),
    ("NCHW", [2, 3, -4, 5]),
    ("NHWC", [0, -1, 2, 3]),                  # zero elements does not excuse a negative dim
    ("NHWC", [2, 3, 2, -3]),
]
# accepted, with the expected (outer, C, inner)
LARGE_VALID = [
    ("NHWC", [I64_MAX, 1, 1, 1], (I64_MAX, 1, 1)),
    ("NCHW", [1, 1, 1, I64_MAX], (1, 1, I64_MAX)),
    ("NHWC", [2 ** 31, 2 ** 31, 1, 1], (2 ** 62, 1, 1)),
    ("NCDHW", [2 ** 20, 2, 2 ** 20, 2 ** 20, 2], (2 ** 20, 2, 2 ** 41)),
    ("NHWC", [0, 2 ** 40, 2 ** 40, 3], (0, 3, 1)),
    ("NHWC", [2 ** 40, 2 ** 22, 0, 3], (0, 3, 1)),
]
# zero elements but a spatial product beyond int64: ValidateBnGradInputs multiplies the
# spatial dims without overflow checks (signed overflow, undefined behaviour in C++), and
# returns a wrapped view. Harmless today (0 elements, nothing is touched), but the view
# must not be garbage: the shape is rejected, or outer and inner are non-negative.
WRAPPING_ZERO_ELEMENT = [
    ("NCHW", [0, 3, 3, 2 ** 62]),          # inner = 3 * 2^62 wraps to -2^62
    ("NCHW", [0, 3, 2 ** 62, 4]),          # inner = 2^64 wraps to 0
    ("NCDHW", [0, 3, 2 ** 40, 2 ** 40, 2 ** 40]),
]


def run_fast_checks(case):
    """Child side. Returns a list of problems."""
    kind = case["kind"]
    problems = []
    if kind == "validate":
        core = _core_without_tf()
        for fmt, shp in OVERFLOW_SHAPES:
            c = shp[1] if fmt in ("NCHW", "NCDHW") else shp[-1]
            vec = [abs(c)]
            try:
                got = core.validate([shp, shp, vec, vec, vec], fmt, 1e-3)
                problems.append("%s %s accepted as %s" % (fmt, shp, got))
            except ValueError as e:
                msg = str(e)
                if "x has shape" not in msg or "64 bits" not in msg:
                    problems.append("%s %s: unclear message %r" % (fmt, shp, msg))
            except Exception as e:  # noqa: BLE001
                problems.append("%s %s: %s %s" % (fmt, shp, type(e).__name__, e))
        for fmt, shp, view in LARGE_VALID:
            c = shp[1] if fmt in ("NCHW", "NCDHW") else shp[-1]
            try:
                got = tuple(core.validate([shp, shp, [c], [c], [c]], fmt, 1e-3))
                if got != view:
                    problems.append("%s %s: view %s, expected %s" % (fmt, shp, got, view))
            except Exception as e:  # noqa: BLE001
                problems.append("%s %s: %s %s" % (fmt, shp, type(e).__name__, e))
    elif kind == "wrap":
        core = _core_without_tf()
        for fmt, shp in WRAPPING_ZERO_ELEMENT:
            c = shp[1]
            try:
                outer, ch, inner = core.validate([shp, shp, [c], [c], [c]], fmt, 1e-3)
            except ValueError:
                continue  # rejecting is fine too
            if outer < 0 or inner < 0:
                problems.append("%s %s: wrapped view (outer %d, C %d, inner %d); the true "
                                "spatial product is %d" % (fmt, shp, outer, ch, inner,
                                                           int(np.prod(shp[2:], dtype=object))))
    elif kind == "tf_zero_elements":
        import tensorflow as tf

        import fbn_grad_tf
        shapes = {"NHWC": [0, 2 ** 40, 2 ** 40, 3], "NCHW": [0, 3, 2 ** 40, 2 ** 40],
                  "NDHWC": [2 ** 30, 0, 2 ** 30, 2 ** 30, 3],
                  "NCDHW": [2 ** 40, 3, 2 ** 20, 0, 2 ** 40]}
        for fmt, shp in shapes.items():
            for dt in (tf.float32, tf.float16, tf.bfloat16):
                for training in (True, False):
                    x = tf.zeros(shp, dt)
                    v = tf.ones([3])
                    for path in ("raw", "api"):
                        subproc.note([fmt, dt.name, training, path])
                        try:
                            if path == "raw":
                                out = fbn_grad_tf.raw_op(
                                    y_backprop=x, x=x, scale=v, reserve_space_1=v,
                                    reserve_space_2=v, reserve_space_3=tf.zeros([]),
                                    epsilon=1e-3, data_format=fmt, is_training=training)
                            else:
                                out = fbn_grad_tf.fused_batch_norm_grad(
                                    x, x, v, v, v, tf.zeros([]), data_format=fmt,
                                    is_training=training)
                        except (tf.errors.InvalidArgumentError, ValueError) as e:
                            # refusing a shape whose non-channel product overflows int64 is
                            # fine (TF's kernel accepts it; there is nothing to compute)
                            if "64 bits" not in str(e) or "x has shape" not in str(e):
                                problems.append("%s %s %s %s: %s %s" % (
                                    fmt, dt.name, training, path, type(e).__name__, e))
                            continue
                        except Exception as e:  # noqa: BLE001
                            problems.append("%s %s %s %s: %s %s" % (
                                fmt, dt.name, training, path, type(e).__name__, e))
                            continue
                        tag = "%s %s %s %s" % (fmt, dt.name, training, path)
                        if out[0].shape.as_list() != shp:
                            problems.append("%s: x_backprop shape %s" % (tag, out[0].shape))
                        if out[1].numpy().tolist() != [0.0] * 3 or \
                                out[2].numpy().tolist() != [0.0] * 3:
                            problems.append("%s: nonzero scale/offset gradient" % tag)
        # ... and a wrong vector size is still caught on such a tensor
        x = tf.zeros([0, 2 ** 40, 2 ** 40, 3])
        try:
            fbn_grad_tf.raw_op(y_backprop=x, x=x, scale=tf.ones([2]), reserve_space_1=tf.ones([3]),
                               reserve_space_2=tf.ones([3]), reserve_space_3=tf.zeros([]))
            problems.append("scale [2] accepted for C = 3 on a zero-element tensor")
        except tf.errors.InvalidArgumentError as e:
            if "scale" not in str(e) or "[0,1099511627776,1099511627776,3]" not in str(e):
                problems.append("unclear message: %s" % e)
    else:
        raise ValueError(kind)
    return problems


FAST_KINDS = ("tf_zero_elements", "validate", "wrap")  # TF first: the others block it


@pytest.fixture(scope="module")
def fast_results():
    cases = [{"kind": k} for k in FAST_KINDS]
    return dict(zip(FAST_KINDS, subproc.run_cases("test_hardening_large:run_fast_checks",
                                                   cases, timeout=600)))


@pytest.mark.parametrize("kind", [
    "validate", "tf_zero_elements",
    "wrap"])
def test_index_arithmetic(fast_results, kind):
    o = fast_results[kind]
    assert o.status == "ok", "did not finish cleanly: %r\n%s" % (o, o.message or o.detail)
    assert not o.value, "\n".join(o.value)


# ---- slow: more than 2^31 elements -----------------------------------------------------

BIG_CASES = {
    # NHWC, C = 1: one plane of 2^31 + 4633 elements (the core's single-channel path)
    "nhwc_c1": ("NHWC", [1, 46341, 46341, 1]),
    # NHWC, C = 2: row tasks, flat offsets past 2^31 within every channel-interleaved row
    "nhwc_c2": ("NHWC", [1, 46341, 23171, 2]),
    # NCHW, C = 2: plane tasks, the second plane starts past 2^30 and ends past 2^31
    "nchw_c2": ("NCHW", [1, 2, 46341, 23171]),
}


def _mem_available():
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def run_big(case):
    """Child side: the >2^31-element check on the NumPy core path. Returns statistics."""
    core = _core_without_tf()
    fmt, shape = case["fmt"], case["shape"]
    training = case.get("training", True)
    n = int(np.prod(shape, dtype=np.int64))
    assert n > case.get("min_elements", 2 ** 31)
    cf = fmt in ("NCHW", "NCDHW")
    c = shape[1] if cf else shape[-1]
    t0 = time.monotonic()
    x = np.empty(shape, np.float16)
    dy = np.empty(shape, np.float16)
    xf, dyf = x.reshape(-1), dy.reshape(-1)
    rng = np.random.default_rng(1234)
    chunk = 1 << 25
    for s in range(0, n, chunk):
        e = min(n, s + chunk)
        xf[s:e] = rng.random(e - s, dtype=np.float32) * 4.0 - 1.5   # uniform: fast to draw
        dyf[s:e] = rng.random(e - s, dtype=np.float32) * 2.0 - 1.0
    scale = np.linspace(0.5, 1.5, c).astype(np.float32)
    mean = np.full(c, 0.4, np.float32)
    var = np.full(c, 3.9, np.float32)
    eps = 1e-3
    t_gen = time.monotonic() - t0
    subproc.note({"phase": "kernel", "gen_s": t_gen})
    t1 = time.monotonic()
    dx, dscale, doffset = core.bn_grad(dy, x, scale, mean, var, epsilon=eps, data_format=fmt,
                                       is_training=training, num_threads=os.cpu_count() or 1)
    t_kernel = time.monotonic() - t1
    subproc.note({"phase": "reference", "kernel_s": t_kernel})

    # float64 per-channel sums over every element, in chunks
    t2 = time.monotonic()
    s1 = np.zeros(c)
    s2 = np.zeros(c)
    a1 = np.zeros(c)
    a2 = np.zeros(c)
    if cf:
        inner = n // (shape[0] * c)
        planes = x.reshape(shape[0], c, inner)
        dplanes = dy.reshape(shape[0], c, inner)
        for b in range(shape[0]):
            for ch in range(c):
                for s in range(0, inner, chunk):
                    xs = planes[b, ch, s:s + chunk].astype(np.float64) - mean[ch]
                    ds = dplanes[b, ch, s:s + chunk].astype(np.float64)
                    s1[ch] += ds.sum()
                    s2[ch] += (ds * xs).sum()
                    a1[ch] += np.abs(ds).sum()
                    a2[ch] += np.abs(ds * xs).sum()
    else:
        rows = n // c
        x2, dy2 = x.reshape(rows, c), dy.reshape(rows, c)
        step = chunk // c
        for r in range(0, rows, step):
            xs = x2[r:r + step].astype(np.float64) - mean.astype(np.float64)
            ds = dy2[r:r + step].astype(np.float64)
            s1 += ds.sum(axis=0)
            p = ds * xs
            s2 += p.sum(axis=0)
            a1 += np.abs(ds).sum(axis=0)
            a2 += np.abs(p).sum(axis=0)
    inv = (np.float32(1) / np.sqrt(var + np.float32(eps))).astype(np.float64)
    ref_doffset, ref_dscale = s1, inv * s2
    err_doffset = np.abs(doffset - ref_doffset) / a1
    err_dscale = np.abs(dscale - ref_dscale) / (inv * a2)

    # x_backprop at sampled flat indices: a uniform sample, plus dense sampling around and
    # past 2^31 and at the very end
    edge = min(2 ** 31, n // 2)  # 2^31 (n // 2 only in the scaled-down self-check)
    idx = np.concatenate([
        rng.integers(0, n, 200000),
        np.arange(edge - 2048, edge + 2048),
        rng.integers(edge, n, 200000),
        np.arange(n - 4096, n)]).astype(np.int64)
    ch = (idx // (n // (shape[0] * c))) % c if cf else idx % c
    xv = x.reshape(-1)[idx].astype(np.float64)
    dv = dy.reshape(-1)[idx].astype(np.float64)
    got = dx.reshape(-1)[idx].astype(np.float64)
    m = n // c
    a = (scale * inv.astype(np.float32)).astype(np.float64)
    xc = xv - mean.astype(np.float64)[ch]
    if training:
        exact = a[ch] * ((dv - (s1 / m)[ch]) - xc * (inv * inv * s2 / m)[ch])
        # the kernel's own sums (doffset = its sum(dy), dscale / inv = its sum(dy*(x-mean)))
        ks1, ks2 = doffset.astype(np.float64), dscale.astype(np.float64) / inv
        kernel_ref = a[ch] * ((dv - (ks1 / m)[ch]) - xc * (inv * inv * ks2 / m)[ch])
    else:
        exact = kernel_ref = dv * a[ch]
    # Against the kernel's own sums: the half output is the float32 result rounded (<= 2^-11
    # relative), and the float32 arithmetic errs by a few ulps of the terms' magnitude
    # (not of the result, which can cancel to ~0).
    terms = np.abs(a[ch]) * (np.abs(dv) + np.abs(s1 / m)[ch]
                             + np.abs(xc) * (inv * inv * a2 / m)[ch])
    allowed = 2.0 ** -10 * np.abs(kernel_ref) + 8 * 2.0 ** -24 * terms + 2.0 ** -24
    rel_vs_kernel = np.abs(got - kernel_ref) / allowed
    err_dx = np.abs(got - exact) / (np.abs(a[ch]) + terms)
    bad = rel_vs_kernel > 1.0
    t_ref = time.monotonic() - t2
    return {"shape": shape, "fmt": fmt, "elements": n, "bytes_per_tensor": n * 2,
            "gen_s": round(t_gen, 1), "kernel_s": round(t_kernel, 1), "ref_s": round(t_ref, 1),
            "doffset_rel_err": float(err_doffset.max()), "dscale_rel_err": float(err_dscale.max()),
            "dx_samples": int(idx.size), "dx_bad_vs_kernel_sums": int(bad.sum()),
            "dx_max_err_vs_kernel_sums_in_allowed_units": float(rel_vs_kernel.max()),
            "dx_max_err_vs_exact_scaled": float(err_dx.max()),
            "dx_all_finite": bool(np.isfinite(got).all()),
            "first_bad": idx[bad][:5].tolist()}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(BIG_CASES))
def test_more_than_2pow31_elements(name):
    fmt, shape = BIG_CASES[name]
    n = int(np.prod(shape, dtype=np.int64))
    need = 3 * n * 2 + (3 << 30)  # dy, x, dx in half + chunk temporaries and margin
    if _mem_available() < need:
        pytest.skip("needs %.1f GB of available memory, have %.1f GB" % (
            need / 2 ** 30, _mem_available() / 2 ** 30))
    (o,) = subproc.run_cases("test_hardening_large:run_big",
                             [{"fmt": fmt, "shape": shape}], timeout=3600)
    assert o.status == "ok", "failed: %r\n%s\nphase: %r" % (o, o.message or o.detail,
                                                            o.last_note)
    r = o.value
    print("large tensor result:", r)
    assert r["dx_all_finite"]
    assert r["dx_bad_vs_kernel_sums"] == 0, r
    assert r["doffset_rel_err"] < 1e-4 and r["dscale_rel_err"] < 1e-4, r
    assert r["dx_max_err_vs_exact_scaled"] < 2e-3, r
