"""Concurrent use of the op: results must equal serial calls bit for bit.

Scenarios (all in one child process, tests/subproc.py, so a crash or deadlock fails the
test instead of pytest):

  eager_threads        8 Python threads calling the op eagerly on different inputs at once
  function_threads     8 threads sharing tf.functions (one per input signature)
  tf_data_map          tf.data map(..., num_parallel_calls=4) applying the op per element
  graph_parallel_ops   one tf.function holding an independent op instance per input; TF's
                       inter-op pool runs them concurrently
  core_threads         8 threads calling fbn_grad_tf.core.bn_grad (the pybind11 module
                       releases the GIL) with several worker threads each

Inputs are large enough (>= 64K elements) that every call also splits its work across
the intra-op / core thread pool, so per-call partitioning varies with the load. The core
promises partition-independent summation order, hence bitwise equality.
"""
import pytest

import subproc

SCENARIOS = ("eager_threads", "function_threads", "tf_data_map", "graph_parallel_ops",
             "core_threads")
# (data_format, dtype, is_training, x shape)
INPUTS = [
    ("NHWC", "float32", True, [4, 32, 32, 24]),
    ("NCHW", "float32", True, [4, 24, 32, 32]),
    ("NHWC", "float16", True, [2, 40, 40, 16]),
    ("NCHW", "bfloat16", False, [2, 16, 48, 48]),
    ("NDHWC", "float32", False, [2, 8, 16, 16, 12]),
    ("NCDHW", "float16", True, [2, 12, 8, 16, 16]),
    ("NHWC", "bfloat16", True, [8, 16, 16, 64]),
    ("NCHW", "float32", False, [1, 3, 200, 200]),
]
NAMES = ("y_backprop", "x", "scale", "reserve_space_1", "reserve_space_2", "reserve_space_3")


def _make(i):
    import numpy as np

    from fbn_grad_tf.core import bfloat16

    fmt, dtype, training, shape = INPUTS[i]
    dt = bfloat16 if dtype == "bfloat16" else np.dtype(dtype)
    rng = np.random.default_rng(100 + i)
    c = shape[1] if fmt in ("NCHW", "NCDHW") else shape[-1]
    arrs = {"y_backprop": rng.standard_normal(shape).astype(dt),
            "x": (rng.standard_normal(shape) * 2 + 0.5).astype(dt),
            "scale": rng.standard_normal(c).astype(np.float32),
            "reserve_space_1": (rng.standard_normal(c) * 0.1 + 0.5).astype(np.float32),
            "reserve_space_2": rng.uniform(0.5, 4.0, c).astype(np.float32),
            "reserve_space_3": np.zeros([], np.float32)}
    return arrs, dict(epsilon=1e-3, data_format=fmt, is_training=training)


def _same(a, b):
    import numpy as np

    a, b = np.asarray(a), np.asarray(b)
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    w = np.uint16 if a.dtype.itemsize == 2 else np.uint32
    return bool(np.array_equal(a.view(w), b.view(w)))


def _diffs(tag, got, ref):
    return ["%s output %d differs from the serial result" % (tag, k)
            for k, (g, r) in enumerate(zip(got, ref)) if not _same(g, r)]


def run_scenario(case):
    """Child side. Returns a list of mismatches (empty: all bitwise equal)."""
    import threading
    from concurrent.futures import ThreadPoolExecutor

    import numpy as np
    import tensorflow as tf

    import fbn_grad_tf
    from fbn_grad_tf import core

    scenario = case["scenario"]
    data = [_make(i) for i in range(len(INPUTS))]
    tens = [[tf.constant(a[n]) for n in NAMES] for a, _ in data]

    def op(t, attrs):
        return fbn_grad_tf.raw_op(**dict(zip(NAMES, t)), **attrs)

    serial = [[o.numpy() for o in op(tens[i], data[i][1])[:3]] for i in range(len(INPUTS))]
    problems = []
    lock = threading.Lock()
    rounds = case.get("rounds", 6)
    jobs = [i % len(INPUTS) for i in range(rounds * len(INPUTS))]
    barrier = threading.Barrier(8)

    def check(tag, i, outs):
        d = _diffs("%s input %d" % (tag, i), [np.asarray(o) for o in outs], serial[i])
        if d:
            with lock:
                problems.extend(d)

    def pool_run(fn):
        def start(k):
            if k < 8:
                barrier.wait(timeout=60)  # all threads start together
            fn(k)
        with ThreadPoolExecutor(8) as ex:
            for f in [ex.submit(start, k) for k in range(len(jobs))]:
                f.result()

    if scenario == "eager_threads":
        def one(k):
            i = jobs[k]
            check("eager", i, [o.numpy() for o in op(tens[i], data[i][1])[:3]])
        pool_run(one)
    elif scenario == "function_threads":
        def make_fn(attrs):
            return tf.function(lambda *t: op(t, attrs))
        fns = [make_fn(data[i][1]) for i in range(len(INPUTS))]
        for i, f in enumerate(fns):  # trace serially; calls below run concurrently
            f(*tens[i])

        def one(k):
            i = jobs[k]
            check("tf.function", i, [o.numpy() for o in fns[i](*tens[i])[:3]])
        pool_run(one)
    elif scenario == "tf_data_map":
        # 16 elements of one input configuration: the op per element, 4 in parallel
        a, attrs = data[0]
        rng = np.random.default_rng(7)
        xs = np.stack([a["x"] + rng.standard_normal(a["x"].shape).astype(np.float32)
                       for _ in range(16)])
        dys = np.stack([a["y_backprop"] * (k + 1) for k in range(16)])
        rest = [tf.constant(a[n]) for n in NAMES[2:]]
        ds = tf.data.Dataset.from_tensor_slices((dys, xs)).map(
            lambda dy, x: op([dy, x] + rest, attrs)[:3], num_parallel_calls=4,
            deterministic=True)
        for k, outs in enumerate(ds):
            ref = [o.numpy() for o in op([tf.constant(dys[k]), tf.constant(xs[k])] + rest,
                                         attrs)[:3]]
            d = _diffs("tf.data element %d" % k, [o.numpy() for o in outs], ref)
            problems.extend(d)
        if k != 15:
            problems.append("tf.data produced %d elements" % (k + 1))
    elif scenario == "graph_parallel_ops":
        @tf.function
        def all_ops(*flat):
            outs = []
            for i in range(len(INPUTS)):
                outs.append(op(flat[6 * i:6 * i + 6], data[i][1])[:3])
            return outs
        flat = [t for ts in tens for t in ts]
        for rep in range(3):
            for i, outs in enumerate(all_ops(*flat)):
                check("graph (run %d)" % rep, i, [o.numpy() for o in outs])
    elif scenario == "core_threads":
        cserial = [core.bn_grad(*(a[n] for n in NAMES[:5]), num_threads=1, **attrs)
                   for a, attrs in data]
        for i in range(len(INPUTS)):  # the TF op and the core agree bit for bit
            problems.extend(_diffs("core vs op input %d" % i, cserial[i], serial[i]))

        def one(k):
            i = jobs[k]
            a, attrs = data[i]
            outs = core.bn_grad(*(a[n] for n in NAMES[:5]), num_threads=1 + k % 4, **attrs)
            check("core", i, outs)
        pool_run(one)
    else:
        raise ValueError(scenario)
    return problems


@pytest.fixture(scope="module")
def results():
    cases = [{"id": s, "scenario": s} for s in SCENARIOS]
    outs = subproc.run_cases("test_hardening_concurrency:run_scenario", cases, timeout=600)
    return dict(zip(SCENARIOS, outs))


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_concurrent_calls_equal_serial(results, scenario):
    o = results[scenario]
    assert o.status == "ok", "scenario %s did not finish cleanly: %r\n%s" % (
        scenario, o, o.message or o.detail)
    assert not o.value, "\n".join(o.value[:20])
