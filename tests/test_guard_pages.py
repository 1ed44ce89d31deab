"""No CPU kernel reads or writes outside its tensors: every full-size tensor of a call ends
right before an inaccessible page (PROT_NONE), on every ISA path this CPU runs.

The kernels' tails (the last n % 16 elements of a plane or row: scalar loops, masked vector
steps, the partial lines of a streamed copy) are where an off-by-one would touch memory past
a tensor; NumPy's allocator leaves slack there, so such a read would go unseen. Here each
tensor (dy, x, y, side input, dx, side_input_backprop; the forward's x, side input and y)
lives at the end of its own anonymous mapping whose next page is PROT_NONE: a byte past the
end faults. A fault kills the child process (tests/subproc.py), which fails that case; the
child also checks that the guarded call's outputs are bitwise those of the same call on
ordinary arrays, so a kernel that skipped its tail would fail too. Every case runs twice: with
the default output stores (plain at these sizes) and with every output streamed
(FBN_GRAD_TF_STREAM_MIB=0: non-temporal stores from an L1 buffer, plain head and tail).
"""
import ctypes
import mmap

import numpy as np
import pytest

import subproc
from helpers import assert_bitwise_equal, np_dtype

PAGE = mmap.PAGESIZE
PROT_NONE = 0

# Shapes whose last plane or row ends in a tail: small channels-first planes (batched in
# runs, masked vector tails), planes of a whole number of vectors, large planes split into
# pieces, channels-last rows with odd channel counts and wide rows walked row by row.
SHAPES = [
    ("NCHW", (3, 5, 7, 7)),        # 49-element planes: 3 vectors + 1
    ("NCHW", (2, 6, 14, 15)),      # 210: 13 vectors + 2
    ("NCHW", (2, 3, 4, 8)),        # 32: whole vectors
    ("NCHW", (1, 2, 150, 130)),    # 19500 > 16384: two pieces per plane, 11-element tail
    ("NCHW", (4, 3, 3, 3)),        # 9-element planes: row tasks walking (c, s) pairs
    ("NHWC", (2, 3, 5, 37)),       # odd channel count
    ("NHWC", (2, 3, 3, 300)),      # wide rows (walked row by row), partial blocks
    ("NCDHW", (1, 3, 3, 5, 7)),    # 105-element planes
]
DTYPES = ["float32", "bfloat16", "float16"]


# ---- the child side -----------------------------------------------------------------------

_keep = []  # the mappings stay mapped for the child's life (NumPy views point into them)


def guarded_empty(shape, dtype):
    """An uninitialized C-contiguous array whose last byte is followed by a PROT_NONE page."""
    dtype = np.dtype(dtype)
    nbytes = int(np.prod(shape)) * dtype.itemsize
    data_pages = max(1, -(-nbytes // PAGE))
    mm = mmap.mmap(-1, (data_pages + 1) * PAGE)
    base = ctypes.addressof(ctypes.c_char.from_buffer(mm))
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    if libc.mprotect(ctypes.c_void_p(base + data_pages * PAGE), PAGE, PROT_NONE) != 0:
        raise OSError(ctypes.get_errno(), "mprotect failed")
    _keep.append(mm)
    offset = data_pages * PAGE - nbytes
    return np.frombuffer(mm, dtype=np.uint8, count=nbytes, offset=offset).view(dtype).reshape(
        shape)


def guarded_copy(a):
    g = guarded_empty(a.shape, a.dtype)
    g[...] = a
    return g


def _backward(core, fmt, shape, dt, training, isa, mode, rng):
    c = shape[1] if fmt.startswith("NC") else shape[-1]
    x = rng.standard_normal(shape).astype(np.float32).astype(dt)
    dy = rng.standard_normal(shape).astype(np.float32).astype(dt)
    side = rng.standard_normal(shape).astype(np.float32).astype(dt)
    scale = rng.standard_normal(c).astype(np.float32)
    offset = rng.standard_normal(c).astype(np.float32)
    axes = tuple(i for i in range(len(shape)) if i != (1 if fmt.startswith("NC") else
                                                         len(shape) - 1))
    mean = x.astype(np.float32).mean(axis=axes)
    var = x.astype(np.float32).var(axis=axes) + 0.5
    fused = mode != "Identity"
    y = None
    if fused:  # the forward's output: what the relu/relu6 masks are read from
        y = core.bn_forward(x, scale, offset, mean, var, 1e-3, data_format=fmt,
                            is_training=False, activation=mode.lower(), side_input=side,
                            num_threads=1)[0]

    def run(dy_, x_, y_, side_, dx, dside):
        out = (dx, np.empty(c, np.float32), np.empty(c, np.float32), dside if fused else None)
        extra = [y_, offset, side_] if fused else None
        core._bn_grad_cpu(dy_, x_, [scale, mean, var], extra, out, fmt, 1e-3, training,
                          "variance", 2, isa, mode)
        return [a for a in out if a is not None]

    want = run(dy, x, y, side, np.empty_like(x), np.empty_like(x))
    got = run(guarded_copy(dy), guarded_copy(x), None if y is None else guarded_copy(y),
              guarded_copy(side), guarded_empty(shape, dt), guarded_empty(shape, dt))
    for name, g, w in zip(("dx", "dscale", "doffset", "side_input_backprop"), got, want):
        assert_bitwise_equal(g, w, name + " against the unguarded call")


def _forward(core, fmt, shape, dt, training, isa, mode, rng):
    c = shape[1] if fmt.startswith("NC") else shape[-1]
    x = (rng.standard_normal(shape) * 2 + 1).astype(np.float32).astype(dt)
    side = rng.standard_normal(shape).astype(np.float32).astype(dt)
    scale = rng.standard_normal(c).astype(np.float32)
    offset = rng.standard_normal(c).astype(np.float32)
    mean = rng.standard_normal(c).astype(np.float32)
    var = rng.random(c).astype(np.float32) + 0.5
    act = None if mode == "Identity" else mode.lower()
    kw = dict(mean=None if training else mean, variance=None if training else var,
              epsilon=1e-3, data_format=fmt, is_training=training, activation=act,
              num_threads=2, isa=isa)
    want = core.bn_forward(x, scale, offset, side_input=side if act else None, **kw)
    # bn_forward allocates y itself; the raw call below writes into a guarded y.
    gx = guarded_copy(x)
    gside = guarded_copy(side) if act else None
    gy = guarded_empty(shape, dt)
    stats = [np.empty(c, np.float32) for _ in range(4)]
    vecs = [scale, offset, np.zeros(0, np.float32) if training else mean,
            np.zeros(0, np.float32) if training else var]
    shapes = [list(a.shape) for a in (gx, *vecs)] + ([] if gside is None else [list(shape)])
    ptrs = ([gx.ctypes.data] + [v.ctypes.data if v.size else 0 for v in vecs] +
            [gy.ctypes.data] + [s.ctypes.data for s in stats] +
            ([] if gside is None else [gside.ctypes.data]))
    core._core.bn_forward_cpu_raw(core._dtype_name(gx.dtype), ptrs, shapes, fmt, 1e-3, 1.0,
                                  training, core._activation_mode(act), "variance", 2, isa)
    for name, g, w in zip(("y", "batch_mean", "batch_var", "saved_mean", "saved_var"),
                          [gy] + stats, want):
        assert_bitwise_equal(g, w, name + " against the unguarded call")


def check_case(case):
    """Child: every supported ISA path, training and inference, plain and fused modes."""
    from fbn_grad_tf import core
    fmt, shape, dtype, direction = case["fmt"], tuple(case["shape"]), case["dtype"], \
        case["direction"]
    dt = np_dtype(dtype)
    streamed = core.stream_min_bytes(np.dtype(dt).itemsize) == 0
    assert streamed == (case["stores"] == "streamed"), "FBN_GRAD_TF_STREAM_MIB not honoured"
    rng = np.random.default_rng(len(shape) * 1000 + shape[-1])
    done = 0
    for isa in core.CPU_ISAS:
        if not core.cpu_supports(isa):
            continue
        for training in (True, False):
            for mode in ("Identity", "Relu", "Swish"):
                subproc.note({"isa": isa, "training": training, "mode": mode})
                (_forward if direction == "forward" else _backward)(
                    core, fmt, shape, dt, training, isa, mode, rng)
                done += 1
    return done


# ---- the parent side ----------------------------------------------------------------------

# stores: "plain" (the default thresholds, far above these sizes) or "streamed" (every output
# through the non-temporal path, in a child run with FBN_GRAD_TF_STREAM_MIB=0).
STORES = {"plain": {"FBN_GRAD_TF_STREAM_MIB": None}, "streamed": {"FBN_GRAD_TF_STREAM_MIB": "0"}}
CASES = [{"id": "%s-%s-%s-%s-%s" % (d, f, "x".join(map(str, s)), t, st), "fmt": f,
          "shape": list(s), "dtype": t, "direction": d, "stores": st}
         for st in STORES for d in ("backward", "forward") for f, s in SHAPES for t in DTYPES]


@pytest.fixture(scope="module")
def outcomes():
    result = {}
    for stores, env in STORES.items():
        cases = [c for c in CASES if c["stores"] == stores]
        outs = subproc.run_cases("test_guard_pages:check_case", cases, timeout=900, env=env)
        result.update({c["id"]: o for c, o in zip(cases, outs)})
    return result


def test_guard_page_really_faults():
    """The harness itself: touching the byte past a guarded array kills the child."""
    r = subproc.run_snippet(
        "import sys; sys.path.insert(0, 'tests')\n"
        "import numpy as np, ctypes, test_guard_pages as g\n"
        "a = g.guarded_empty((3, 5), np.float32)\n"
        "a[...] = 1\n"
        "ctypes.c_char.from_address(a.ctypes.data + a.nbytes).value\n")
    assert r.crashed, r


def test_kernel_writing_one_element_too_many_faults():
    """End to end: the backward given, for dx, a guarded buffer one element shorter than the
    tensor (so dx's last element lies on the guard page) is killed, on the default ISA path:
    the guard is tight enough to catch a kernel's one-element overrun."""
    r = subproc.run_snippet(
        "import sys; sys.path.insert(0, 'tests')\n"
        "import numpy as np, test_guard_pages as g\n"
        "from fbn_grad_tf import core\n"
        "shape = (3, 5, 7, 7)\n"
        "x = np.random.default_rng(0).standard_normal(shape).astype(np.float32)\n"
        "v = [np.ones(5, np.float32), np.zeros(5, np.float32), np.ones(5, np.float32)]\n"
        "short = g.guarded_empty((x.size - 1,), np.float32)\n"
        "ptrs = [x.ctypes.data, x.ctypes.data] + [a.ctypes.data for a in v] + [\n"
        "    short.ctypes.data, v[0].ctypes.data, v[1].ctypes.data]\n"
        "print('calling', flush=True)\n"
        "core._core.bn_grad_cpu_raw('float32', ptrs, [list(shape), list(shape)] + [[5]] * 3,\n"
        "                           'NCHW', 1e-3, True, 'variance', 1, 'auto', 'Identity', [])\n")
    assert "calling" in r.stdout, r.describe()
    assert r.crashed, r.describe()


@pytest.mark.parametrize("case", CASES, ids=[c["id"] for c in CASES])
def test_no_access_past_any_tensor(outcomes, case):
    o = outcomes[case["id"]]
    assert o.status == "ok", o
    assert o.value >= 6, o  # at least one ISA path x (training, inference) x 3 modes
