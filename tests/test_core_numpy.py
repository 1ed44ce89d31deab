"""The framework-free core (fbn_grad_tf.core / fbn_grad_tf._core) on NumPy arrays.

* Every CPU instruction-set path this machine supports, with 1, 2 and 5 threads, gives
  bitwise identical results; the TF op (default path, intra-op pool) gives the same bits.
* saved_stat="inv_std" (cuDNN's convention for reserve_space_2).
* The 16-bit conversions, exhaustively over all 65536 half / bfloat16 bit patterns, in the
  scalar helpers and in the vectorized conversions inside the kernels.
* The core's validation errors.
"""
import os
import subprocess
import sys
import zlib

import ml_dtypes
import numpy as np
import pytest

from fbn_grad_tf import _core, core
from fbn_grad_tf.bench.timing import cpuinfo_field
from helpers import (DTYPES, EPSILON, FORMATS, Case, assert_bitwise_equal, assert_outputs_close,
                     bits, child_with_env_value, make_inputs, make_shape, np_dtype,
                     reference_float64, run_core, subprocess_env)

THREADS = (1, 2, 5)

# Big enough for several tasks (the core's thread runner goes parallel above 64K elements),
# covering both task kinds: row tasks (channels-last, small planes) and plane tasks
# (channels-first planes >= 64, split above 16384 elements).
BITWISE_CASES = [
    ("NHWC", (8, 32, 32, 24)),      # row tasks, many of them
    ("NCHW", (8, 24, 32, 32)),      # plane tasks
    ("NCHW", (32, 64, 7, 7)),       # small planes batched per run, a 1-element tail each
    ("NCHW", (8, 48, 14, 15)),      # small planes of 210: 13 vectors and a 2-element tail
    ("NCHW", (16, 40, 4, 8)),       # small planes of 32: whole vectors, no tail
    ("NCHW", (4, 6, 10, 30)),       # row tasks on small planes walking (c, s) pairs
    ("NCDHW", (2, 3, 4, 80, 70)),   # planes of 22400 > 16384: two pieces per plane
    ("NDHWC", (2, 4, 30, 30, 17)),  # odd channel count
    ("NHWC", (3, 140, 170, 1)),     # C = 1: one plane
    ("NHWC", (2, 6, 7, 1000)),      # rows longer than a float run (512), one 16-bit run
    ("NHWC", (4, 16, 16, 64)),      # whole 64-channel register blocks, many rows per run
    ("NHWC", (2, 20, 20, 48)),      # a 3-group block on AVX-512, 2 + 1 on AVX2, 1 x 3 baseline
    ("NHWC", (1, 4, 20, 2100)),     # rows longer than every run: rows split at run offsets
    ("NHWC", (4, 12, 12, 256)),     # wide rows walked row by row: 2 float, 4 16-bit rows a run
    ("NHWC", (2, 10, 10, 300)),     # the same with partial blocks and a scalar tail
]


def seed_of(*parts):
    return zlib.crc32(repr(parts).encode())


def case_id(c):
    return "%s-%s" % (c[0], "x".join(map(str, c[1])))


@pytest.fixture(scope="module")
def bitwise_inputs():
    cache = {}

    def get(fmt, shape, dtype, training):
        key = (fmt, shape, dtype, training)
        if key not in cache:
            cache[key] = make_inputs(shape, fmt, dtype, training, seed=seed_of(*key))
        return cache[key]
    return get


@pytest.mark.parametrize("training", [True, False], ids=["train", "infer"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", BITWISE_CASES, ids=case_id)
def test_isa_paths_and_thread_counts_bitwise_equal(isa, case, dtype, training, bitwise_inputs):
    fmt, shape = case
    inputs = bitwise_inputs(fmt, shape, dtype, training)
    base = run_core(inputs, EPSILON, fmt, training, num_threads=1, isa="baseline")
    # Anchor: the baseline path itself is right (so "all equal" cannot mean "all wrong").
    ref = reference_float64(*inputs[:5], EPSILON, fmt, training)
    assert_outputs_close(base, ref, inputs, dtype, "vs_f64", fmt, EPSILON, training)
    for threads in THREADS:
        out = run_core(inputs, EPSILON, fmt, training, num_threads=threads, isa=isa)
        for name, a, b in zip(("x_backprop", "scale_backprop", "offset_backprop"), out, base):
            assert_bitwise_equal(a, b, "%s, isa=%s, threads=%d vs baseline/1" % (
                name, isa, threads))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", [BITWISE_CASES[0], BITWISE_CASES[1], BITWISE_CASES[3]],
                         ids=case_id)
@pytest.mark.parametrize("training", [True, False], ids=["train", "infer"])
def test_tf_op_bitwise_equal_to_core_default_isa(case, dtype, training, bitwise_inputs):
    pytest.importorskip("tensorflow")
    from helpers import run_ours
    fmt, shape = case
    inputs = bitwise_inputs(fmt, shape, dtype, training)
    ours = run_ours(inputs, EPSILON, fmt, training)
    for threads in (1, 2):
        out = run_core(inputs, EPSILON, fmt, training, num_threads=threads,
                       isa=core.default_isa())
        for name, a, b in zip(("x_backprop", "scale_backprop", "offset_backprop"), ours, out):
            assert_bitwise_equal(a, b, "%s: TF op vs core (threads=%d)" % (name, threads))


def test_isa_queries():
    assert core.cpu_supports("baseline")
    assert core.CPU_ISAS == ("baseline", "avx2", "avx512", "avx512bf16")
    assert core.default_isa() in core.CPU_ISAS
    assert core.cpu_supports(core.default_isa())
    # Each path needs everything the paths below it need.
    supported = [core.cpu_supports(i) for i in core.CPU_ISAS]
    assert supported == sorted(supported, reverse=True)
    with pytest.raises(ValueError, match="isa"):
        core.cpu_supports("sse9")


def _prefetch_by_vendor():
    """The software prefetch the CPU vendor calls for: off on AMD (where the backward
    measured faster without it), on elsewhere; None without a vendor_id to go by."""
    vendor = cpuinfo_field("vendor_id")
    return None if vendor is None else vendor != "AuthenticAMD"


@pytest.mark.skipif(os.environ.get("FBN_GRAD_TF_PREFETCH", "auto") != "auto",
                    reason="FBN_GRAD_TF_PREFETCH is set in this environment")
def test_software_prefetch_follows_the_cpu_vendor():
    want = _prefetch_by_vendor()
    if want is None:
        pytest.skip("no vendor_id in /proc/cpuinfo")
    assert core.software_prefetch() == want


@pytest.mark.parametrize("value, want", [("on", True), ("1", True), ("off", False),
                                         ("0", False), ("bogus", None)])
def test_software_prefetch_environment_override(value, want):
    # An unknown value: a warning and the CPU vendor's default.
    words = child_with_env_value("FBN_GRAD_TF_PREFETCH", value,
                                 "from fbn_grad_tf import _core; print(_core.software_prefetch())",
                                 rejected=want is None)
    if want is None:
        want = _prefetch_by_vendor()
        if want is None:
            return
    assert words == [str(want)]


def _default_stream_min_bytes():
    """float32 and 16-bit outputs stream from 8 MiB and max(8 MiB, L3 / 10) (common.h)."""
    try:  # glibc's sysconf(_SC_LEVEL3_CACHE_SIZE), which the core reads (Python lacks it)
        out = subprocess.run(["getconf", "LEVEL3_CACHE_SIZE"], capture_output=True, text=True,
                             timeout=30).stdout.strip()
    except OSError:
        pytest.skip("getconf not available")
    l3 = int(out) if out.isdigit() else 0
    return [8 << 20, max(8 << 20, l3 // 10)]


def test_addresses_are_the_arrays_data_pointers():
    """_core.addresses is what the wrappers pass the kernels as pointers: each array's data
    address (views included, as ndarray.ctypes.data gives it), 0 for None."""
    base = np.arange(64, dtype=np.float32)
    arrays = [base, base[8:], base.reshape(8, 8)[2], np.zeros(0, np.float32),
              np.ones((2, 3), ml_dtypes.bfloat16)]
    got = _core.addresses(arrays + [None])
    assert got == [a.ctypes.data for a in arrays] + [0]
    assert got[1] - got[0] == 8 * 4 and got[2] - got[0] == 16 * 4
    assert _core.addresses([]) == []
    with pytest.raises(TypeError, match="NumPy arrays or None"):
        _core.addresses([base, [1.0, 2.0]])


@pytest.mark.skipif(os.environ.get("FBN_GRAD_TF_STREAM_MIB", "") not in ("", "auto"),
                    reason="FBN_GRAD_TF_STREAM_MIB is set in this environment")
def test_stream_threshold_by_element_size():
    assert [core.stream_min_bytes(4), core.stream_min_bytes(2)] == _default_stream_min_bytes()
    for itemsize in (0, 1, 8):
        with pytest.raises(ValueError, match="itemsize must be 4"):
            core.stream_min_bytes(itemsize)


@pytest.mark.parametrize("value, want", [("0", [0, 0]), ("16", [16 << 20] * 2),
                                         ("0.5", [1 << 19] * 2), (".25", [1 << 18] * 2),
                                         ("auto", None), ("", None), ("-1", None),
                                         ("-0", None), (" 16", None), ("16 ", None),
                                         ("1e3", None), ("0x10", None), ("nan", None),
                                         ("inf", None), ("1.2.3", None), (".", None),
                                         ("bogus", None)])
def test_stream_threshold_environment_override(value, want):
    # auto, or an unusable value (with a warning): the defaults
    words = child_with_env_value(
        "FBN_GRAD_TF_STREAM_MIB", value,
        "from fbn_grad_tf import _core; print(_core.stream_min_bytes(4), "
        "_core.stream_min_bytes(2))",
        rejected=want is None and value not in ("auto", ""))
    if want is None:
        want = _default_stream_min_bytes()
    assert [int(v) for v in words] == want


def test_auto_isa_and_all_threads_match_default():
    inputs = make_inputs((4, 16, 16, 8), "NHWC", "float32", True, seed=3)
    a = run_core(inputs, isa="auto", num_threads=0)
    b = run_core(inputs, isa=core.default_isa(), num_threads=1)
    for u, v in zip(a, b):
        assert_bitwise_equal(u, v)


def test_unsupported_isa_request_falls_back_without_crashing():
    """Asking for a path the CPU lacks runs the best supported one (never SIGILL)."""
    inputs = make_inputs((2, 8, 8, 16), "NHWC", "bfloat16", True, seed=4)
    expected = run_core(inputs, isa="baseline")
    for isa in core.CPU_ISAS[1:]:
        out = run_core(inputs, isa=isa)
        for u, v in zip(out, expected):
            assert_bitwise_equal(u, v)


# ---- saved_stat ---------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("fmt", FORMATS)
def test_inv_std_convention(fmt, dtype):
    """reserve_space_2 = 1/sqrt(var + eps) with saved_stat="inv_std" == variance form.

    The kernel computes 1.0f / sqrtf(var + eps) in float32, which NumPy reproduces exactly,
    so the two forms must agree bit for bit."""
    shape = make_shape(Case("s", 3, (5, 6), (2, 3, 6), 7), fmt)
    inputs = make_inputs(shape, fmt, dtype, True, seed=seed_of("inv", fmt, dtype))
    eps = np.float32(1e-3)
    inv = (np.float32(1.0) / np.sqrt(inputs.rs2 + eps)).astype(np.float32)
    a = run_core(inputs, float(eps), fmt, True)
    b = run_core(inputs._replace(rs2=inv), float(eps), fmt, True, saved_stat="inv_std")
    for u, v in zip(a, b):
        assert_bitwise_equal(u, v, "inv_std vs variance")
    ref = reference_float64(*inputs[:4], inv, float(eps), fmt, True, saved_stat="inv_std")
    assert_outputs_close(b, ref, inputs, dtype, "vs_f64", fmt, float(eps), True)
    # A wrong convention would be far off: variance passed as inv_std must differ.
    c = run_core(inputs, float(eps), fmt, True, saved_stat="inv_std")
    assert not np.allclose(c[1], a[1], rtol=1e-3)


def test_inference_ignores_saved_stat():
    """Inference always receives the population variance, whatever the training convention."""
    inputs = make_inputs((2, 5, 6, 7), "NCHW", "float32", False, seed=6)
    a = run_core(inputs, EPSILON, "NCHW", False, saved_stat="variance")
    b = run_core(inputs, EPSILON, "NCHW", False, saved_stat="inv_std")
    for u, v in zip(a, b):
        assert_bitwise_equal(u, v)


# ---- 16-bit conversions --------------------------------------------------------------------

ALL16 = np.arange(65536, dtype=np.uint32).astype(np.uint16)


def _f32_from_bits(u):
    return np.asarray(u, np.uint32).view(np.float32)


def test_half_to_float_exhaustive():
    got = np.array([_core.half_to_float(int(b)) for b in ALL16], np.float32).view(np.uint32)
    ref = ALL16.view(np.float16).astype(np.float32)
    nan = np.isnan(ref)
    assert nan.sum() == 2046
    np.testing.assert_array_equal(got[~nan], ref.view(np.uint32)[~nan])
    # NaNs come out quiet, sign and payload kept (as the F16C instruction does).
    h = ALL16[nan].astype(np.uint32)
    expected = ((h & 0x8000) << 16) | 0x7F800000 | ((h & 0x3FF) << 13) | 0x400000
    np.testing.assert_array_equal(got[nan], expected)


def _half_midpoints():
    """Every float32 exactly halfway between two adjacent finite halves (ties), plus the
    floats one float-ulp either side of each tie."""
    pos = ALL16[:0x7C00].view(np.float16).astype(np.float64)  # +0 .. 65504
    mids = ((pos[:-1] + pos[1:]) / 2).astype(np.float32)      # exact in float32
    mids = np.concatenate([mids, [np.float32(65520.0)]])       # tie with "65536" -> inf
    u = mids.view(np.uint32)
    near = np.concatenate([u, u - 1, u + 1]).view(np.float32)
    return np.concatenate([near, -near])


def _random_floats(n, seed):
    u = np.random.default_rng(seed).integers(0, 2 ** 32, n, dtype=np.uint64).astype(np.uint32)
    return u.view(np.float32)


def _float_to_half_expected(f):
    u = f.view(np.uint32)
    with np.errstate(over="ignore", invalid="ignore"):
        ref = f.astype(np.float16).view(np.uint16)
    nan = np.isnan(f)
    quiet = ((u >> 16) & 0x8000) | 0x7C00 | 0x200 | ((u >> 13) & 0x3FF)
    return np.where(nan, quiet, ref).astype(np.uint16)


def test_float_to_half_round_trip_and_ties():
    halves = ALL16.view(np.float16)
    finite = ~np.isnan(halves)
    values = halves.astype(np.float32)
    got = np.array([_core.float_to_half(float(v)) for v in values[finite]], np.uint16)
    np.testing.assert_array_equal(got, ALL16[finite])  # exact round trip
    f = _half_midpoints()
    got = np.array([_core.float_to_half(float(v)) for v in f], np.uint16)
    np.testing.assert_array_equal(got, _float_to_half_expected(f))  # round to nearest even


def test_float_to_half_random_bit_patterns():
    f = _random_floats(200_000, seed=7)
    got = np.array([_core.float_to_half(float(v)) for v in f], np.uint16)
    np.testing.assert_array_equal(got, _float_to_half_expected(f))


def _bfloat16_expected(f):
    u = f.view(np.uint32)
    with np.errstate(over="ignore", invalid="ignore"):
        ref = f.astype(ml_dtypes.bfloat16).view(np.uint16)
    nan = np.isnan(f)
    return np.where(nan, ((u >> 16) | 0x40).astype(np.uint16), ref).astype(np.uint16)


def test_float_to_bfloat16():
    # All bfloat16 values (round trip), the ties between neighbours, random patterns.
    bf = ALL16.view(ml_dtypes.bfloat16).astype(np.float32)
    ub = bf.view(np.uint32)
    ties = np.concatenate([ub | 0x8000, (ub | 0x8000) - 1, (ub | 0x8000) + 1]).view(np.float32)
    f = np.concatenate([bf, ties, _random_floats(100_000, seed=8)])
    got = np.array([_core.float_to_bfloat16(float(v)) for v in f], np.uint16)
    np.testing.assert_array_equal(got, _bfloat16_expected(f))
    nan = np.isnan(bf)
    np.testing.assert_array_equal(got[:65536][~nan], ALL16[~nan])


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_kernel_conversions_exhaustive(isa, dtype):
    """Inference x_backprop = dy * (scale / sqrt(var + eps)) in float32, rounded once: with
    all 65536 bit patterns as dy this checks the kernels' vectorized 16-bit loads and
    stores (and their scalar tails) bit for bit against NumPy."""
    dt = np_dtype(dtype)
    # 65536 = 4096 rows of 16 channels (row tasks), and 16 planes of 4096 (plane tasks).
    for fmt, shape in (("NHWC", (16, 16, 16, 16)), ("NCHW", (1, 16, 64, 64)),
                       ("NHWC", (1, 1, 65536, 1))):
        c = shape[-1] if fmt == "NHWC" else shape[1]
        dy = ALL16.view(dt).reshape(shape)
        x = np.zeros(shape, dt)
        scale = np.linspace(0.3, 1.7, c, dtype=np.float32)
        mean = np.zeros(c, np.float32)
        var = np.linspace(0.5, 3.0, c, dtype=np.float32)
        eps = np.float32(EPSILON)
        dx, _, _ = core.bn_grad(dy, x, scale, mean, var, float(eps), fmt, False,
                                num_threads=2, isa=isa)
        a = scale * (np.float32(1) / np.sqrt(var + eps))
        bshape = (1, 1, 1, c) if fmt == "NHWC" else (1, c, 1, 1)
        with np.errstate(over="ignore", invalid="ignore"):
            prod = (dy.astype(np.float32) * a.reshape(bshape)).astype(np.float32)
            expected = prod.astype(dt)
        nan = np.isnan(prod)
        got, exp = bits(dx), bits(expected)
        assert np.array_equal(np.isnan(dx.astype(np.float32)), nan)
        mismatch = (got != exp) & ~nan
        assert not mismatch.any(), "%s %s: %d mismatches, first dy bits %#x" % (
            fmt, isa, int(mismatch.sum()), int(bits(dy)[mismatch][0]))


def test_subnormals_not_flushed_after_import():
    """Loading the extension modules must not switch the process to flush-to-zero."""
    import fbn_grad_tf  # noqa: F401  (loads the op library when TF is installed)
    tiny = np.float32(1e-40)
    assert tiny * np.float32(1.0) != 0
    assert np.finfo(np.float32).smallest_subnormal * np.float32(2.0) > 0


# ---- dtype handling and validation -------------------------------------------------------

def test_outputs_and_inputs():
    inputs = make_inputs((2, 3, 4, 5), "NHWC", "float16", True, seed=9)
    copies = [a.copy() for a in inputs]
    dx, dscale, doffset = run_core(inputs)
    assert dx.dtype == np.float16 and dx.shape == (2, 3, 4, 5)
    assert dscale.dtype == np.float32 and doffset.dtype == np.float32
    for a, b in zip(inputs, copies):  # inputs untouched
        assert_bitwise_equal(a, b)


def test_non_contiguous_and_float64_vectors_accepted():
    inputs = make_inputs((2, 5, 4, 6), "NCHW", "float32", True, seed=10)
    expected = run_core(inputs, EPSILON, "NCHW", True)
    # The same values as strided views and float64 vectors.
    dy = np.asfortranarray(inputs.dy)
    x = np.repeat(inputs.x, 2, axis=0)[::2]
    assert not dy.flags.c_contiguous and not x.flags.c_contiguous
    got = core.bn_grad(dy, x, inputs.scale.astype(np.float64), inputs.rs1.astype(np.float64),
                       inputs.rs2[::-1][::-1], EPSILON, "NCHW", True)
    for u, v in zip(got, expected):
        assert_bitwise_equal(u, v)


CORE_SHAPE_ERRORS = [
    # (shapes of dy, x, scale, rs1, rs2), data_format, epsilon, message regex
    (([2, 3, 4], [2, 3, 4], [4], [4], [4]), "NHWC", 1e-4, r"y_backprop must be 4-dimensional"),
    (([2, 3, 4, 5], [2, 3, 4], [5], [5], [5]), "NHWC", 1e-4, r"y_backprop and x|x must be 4-dim"),
    (([2, 3, 4, 5], [2, 3, 4, 5], [5], [5], [5]), "NDHWC", 1e-4, r"5-dimensional"),
    (([2, 3, 4, 5], [2, 3, 4, 6], [5], [5], [5]), "NHWC", 1e-4, r"same shape.*\[2,3,4,6\]"),
    (([2, 3, 4, 5], [2, 3, 4, 5], [4], [5], [5]), "NHWC", 1e-4, r"^scale must have 5 elements"),
    (([2, 3, 4, 5], [2, 3, 4, 5], [5], [6], [5]), "NHWC", 1e-4, r"^reserve_space_1"),
    (([2, 3, 4, 5], [2, 3, 4, 5], [5], [5], [5, 1]), "NHWC", 1e-4, r"^reserve_space_2.*1-dim"),
    (([2, 3, 4, 5], [2, 3, 4, 5], [], [5], [5]), "NHWC", 1e-4, r"^scale must be 1-dim"),
    (([2, 3, 4, 5], [2, 3, 4, 5], [5], [5], [5]), "NCHW", 1e-4, r"scale must have 3 elements"),
    (([2, 3, 4, 5], [2, 3, 4, 5], [5], [5], [5]), "NHWC", -1.0, r"epsilon"),
    (([2, 3, 4, 5], [2, 3, 4, 5], [5], [5], [5]), "NHWC", float("nan"), r"epsilon"),
    (([2, 3, 4, 5], [2, 3, 4, 5], [5], [5], [5]), "NHWC", float("inf"), r"epsilon"),
    (([2, 3, 4, 5], [2, 3, 4, 5], [5], [5], [5]), "NHWC ", 1e-4, r"data_format"),
    (([2, -3, 4, 5], [2, -3, 4, 5], [5], [5], [5]), "NHWC", 1e-4, r"non-negative"),
    (([2 ** 40, 2 ** 40, 4, 5], [2 ** 40, 2 ** 40, 4, 5], [5], [5], [5]), "NHWC", 1e-4,
     r"64 bits"),
]


@pytest.mark.parametrize("shapes,fmt,eps,msg", CORE_SHAPE_ERRORS,
                         ids=["%d-%s" % (i, c[1].strip()) for i, c in enumerate(CORE_SHAPE_ERRORS)])
def test_core_validate_errors(shapes, fmt, eps, msg):
    with pytest.raises(ValueError, match=msg):
        core.validate([list(s) for s in shapes], fmt, eps)


def test_core_validate_canonical_view():
    assert tuple(core.validate([[2, 3, 4, 5]] * 2 + [[5]] * 3, "NHWC", 0.0)) == (24, 5, 1)
    assert tuple(core.validate([[2, 5, 3, 4]] * 2 + [[5]] * 3, "NCHW", 0.0)) == (2, 5, 12)
    assert tuple(core.validate([[2, 3, 4, 6, 5]] * 2 + [[5]] * 3, "NDHWC", 0.0)) == (144, 5, 1)
    assert tuple(core.validate([[2, 5, 3, 4, 6]] * 2 + [[5]] * 3, "NCDHW", 0.0)) == (2, 5, 72)


def test_bn_grad_errors():
    inputs = make_inputs((2, 3, 4, 5), "NHWC", "float32", True, seed=12)
    with pytest.raises(ValueError, match="scale must have 5 elements"):
        run_core(inputs._replace(scale=np.ones(4, np.float32)))
    with pytest.raises(ValueError, match="x and y_backprop must have the same shape"):
        run_core(inputs._replace(x=inputs.x[:1]))
    with pytest.raises(ValueError, match="data_format"):
        run_core(inputs, data_format="HWCN")
    with pytest.raises(ValueError, match="epsilon"):
        run_core(inputs, epsilon=-1e-3)
    with pytest.raises(ValueError, match="saved_stat"):
        run_core(inputs, saved_stat="stddev")
    with pytest.raises(ValueError, match="isa"):
        run_core(inputs, isa="neon")
    for bad in (np.float64, np.int32):
        with pytest.raises(TypeError, match="float32, float16 or bfloat16"):
            run_core(inputs._replace(dy=inputs.dy.astype(bad), x=inputs.x.astype(bad)))
    with pytest.raises(TypeError, match="same dtype"):
        run_core(inputs._replace(dy=inputs.dy.astype(np.float16)))


NEG_ZERO_CASES = [("NCHW", (2, 4, 5, 4)), ("NCHW", (3, 4, 7, 7)), ("NHWC", (2, 3, 3, 20))]


@pytest.mark.parametrize("fmt, shape", NEG_ZERO_CASES, ids=[case_id(c) for c in NEG_ZERO_CASES])
def test_negative_zero_scale_keeps_its_sign_on_every_path(fmt, shape):
    """Inference dx = dy * (scale * inv) with scale = -0.0: every element's zero takes the
    sign IEEE gives that product, in the vector body and in the tail alike, on every ISA
    path (a broadcast that computed 0.0 + v once turned -0.0 into +0.0 in the body only)."""
    rng = np.random.default_rng(7)
    c = shape[1] if fmt == "NCHW" else shape[-1]
    dy = rng.standard_normal(shape).astype(np.float32)
    x = rng.standard_normal(shape).astype(np.float32)
    scale = np.where(np.arange(c) % 2 == 0, -0.0, 0.0).astype(np.float32)
    mean, var = np.zeros(c, np.float32), np.ones(c, np.float32)
    a = scale * (np.float32(1) / np.sqrt(var + np.float32(EPSILON)))
    bshape = [1, c, 1, 1] if fmt == "NCHW" else [1, 1, 1, c]
    want = dy * a.reshape(bshape)
    assert np.signbit(want).any() and not np.signbit(want).all()
    for isa in core.CPU_ISAS:
        if not core.cpu_supports(isa):
            continue
        dx = core.bn_grad(dy, x, scale, mean, var, EPSILON, fmt, False, num_threads=2,
                          isa=isa)[0]
        assert_bitwise_equal(dx, want, "dx, isa=%s" % isa)


# Streamed and plainly stored outputs carry the same bits: a child with every output streamed
# (FBN_GRAD_TF_STREAM_MIB=0) against this process (plain at these sizes), forward and
# backward, plain and fused. (The TF op's backward: test_determinism.py.)
_STREAM_CHILD = r"""
import sys, numpy as np
sys.path.insert(0, %(tests)r)
from fbn_grad_tf import core
from test_core_numpy import streamed_vs_plain_outputs
assert core.stream_min_bytes(4) == core.stream_min_bytes(2) == 0
out = streamed_vs_plain_outputs()
# Every forward and every backward wrote its output streamed (none of them in place).
streamed = core._core.streamed_output_count()
assert streamed == out.pop("calls"), streamed
np.savez(sys.argv[1], **out)
"""


def streamed_vs_plain_outputs():
    """Forward and backward outputs on shapes with tails, every dtype, NHWC and NCHW, every
    activation, training and inference (2 threads): name -> raw bits, and "calls": how many
    kernel passes wrote an output (one per forward, one per backward)."""
    out = {}
    calls = 0
    for fmt, shape in (("NHWC", (3, 5, 7, 37)), ("NCHW", (3, 6, 7, 7)), ("NCHW", (2, 3, 30, 31))):
        c = shape[-1] if fmt == "NHWC" else shape[1]
        for dtype in DTYPES:
            dt = np_dtype(dtype)
            rng = np.random.default_rng(zlib.crc32(("%s%s%s" % (fmt, shape, dtype)).encode()))
            x, dy, side = (rng.standard_normal(shape).astype(np.float32).astype(dt)
                           for _ in range(3))
            scale, offset = rng.standard_normal(c).astype(np.float32), \
                rng.standard_normal(c).astype(np.float32)
            for act in (None, "relu", "swish"):
                for training in (True, False):
                    mean = x.astype(np.float32).mean(axis=(0, 2, 3) if fmt == "NCHW"
                                                     else (0, 1, 2))
                    var = rng.random(c).astype(np.float32) + 0.5
                    y = core.bn_forward(x, scale, offset, None if training else mean,
                                        None if training else var, 1e-3, data_format=fmt,
                                        is_training=training, activation=act,
                                        side_input=side if act else None, num_threads=2)
                    g = core.bn_grad(dy, x, scale, mean, var, 1e-3, fmt, training,
                                     num_threads=2, activation=act, y=y[0] if act else None,
                                     offset=offset if act else None,
                                     side_input=side if act else None,
                                     side_input_backprop=bool(act))
                    key = "%s-%s-%s-%s-%s" % (fmt, "x".join(map(str, shape)), dtype, act,
                                              training)
                    calls += 2
                    for i, a in enumerate(list(y) + list(g)):
                        out["%s-%d" % (key, i)] = bits(np.asarray(a))
    out["calls"] = calls
    return out


@pytest.mark.skipif(os.environ.get("FBN_GRAD_TF_STREAM_MIB", "") not in ("", "auto"),
                    reason="FBN_GRAD_TF_STREAM_MIB is set in this environment")
def test_streamed_outputs_are_bitwise_the_plain_ones(tmp_path):
    path = str(tmp_path / "streamed.npz")
    tests_dir = os.path.dirname(os.path.abspath(__file__))
    p = subprocess.run([sys.executable, "-c", _STREAM_CHILD % {"tests": tests_dir}, path],
                       capture_output=True, text=True, timeout=300,
                       env=subprocess_env(FBN_GRAD_TF_STREAM_MIB="0"))
    assert p.returncode == 0, p.stderr[-3000:]
    streamed = dict(np.load(path))
    before = _core.streamed_output_count()
    plain = streamed_vs_plain_outputs()
    assert _core.streamed_output_count() == before  # small outputs: plain stores here
    del plain["calls"]
    assert sorted(streamed) == sorted(plain) and len(plain) > 200
    for k in plain:
        np.testing.assert_array_equal(streamed[k], plain[k], err_msg=k)
