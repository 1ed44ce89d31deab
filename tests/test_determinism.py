"""Run-to-run and thread-count determinism of the TF op.

TensorFlow's thread pools cannot be resized after initialization, so each configuration runs
in a child Python process: intra-op threads 1, 2 and 4 (and the CPU paths forced through
FBN_GRAD_TF_ISA, the software prefetch forced on and off through FBN_GRAD_TF_PREFETCH,
every output streamed through FBN_GRAD_TF_STREAM_MIB=0, the channel-major training plan
allowed for every channel and turned off through FBN_GRAD_TF_CHANNEL_MAJOR_KIB, and every
call at once in one
tf.function with inter-op parallelism), on
the same seeded inputs, each computing every case twice, with the plain backward and with
the fused one (FusedBatchNormGradEx: Relu6, Swish with a side input). The children
save the raw output bits; all of them must be identical.
"""
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

pytest.importorskip("tensorflow")

from fbn_grad_tf import core  # noqa: E402
from helpers import subprocess_env  # noqa: E402

TESTS_DIR = os.path.dirname(os.path.abspath(__file__))

# Large enough for many tasks per pass (row tasks for NHWC, plane tasks for NCHW).
CASES = [
    ("NHWC", (8, 64, 64, 32), "float32"),
    ("NCHW", (8, 32, 64, 64), "float32"),
    ("NHWC", (8, 64, 64, 32), "bfloat16"),
    ("NCHW", (8, 32, 64, 64), "bfloat16"),
    ("NCDHW", (2, 16, 8, 32, 32), "float16"),
    # Wide channels-last rows with a remainder: walked in blocks down several rows where the
    # kernels prefetch, row by row where they do not (prefetch-on / prefetch-off children).
    ("NHWC", (4, 8, 8, 264), "bfloat16"),
]

CHILD = textwrap.dedent(r"""
    import os, sys
    threads, out_path, inter = int(sys.argv[1]), sys.argv[2], int(sys.argv[3])
    sys.path.insert(0, %(tests_dir)r)
    import numpy as np
    import tensorflow as tf
    tf.config.threading.set_intra_op_parallelism_threads(threads)
    tf.config.threading.set_inter_op_parallelism_threads(inter)
    import fbn_grad_tf
    from fbn_grad_tf import core
    from helpers import bits, make_inputs
    cases = %(cases)r
    result = {"intra_op_threads": np.array(tf.config.threading.get_intra_op_parallelism_threads()),
              "isa": np.array(core.default_isa()),
              "prefetch": np.array(core.software_prefetch()),
              "stream_min_bytes": np.array([core.stream_min_bytes(4), core.stream_min_bytes(2)]),
              "channel_major_max_bytes": np.array(core.channel_major_max_bytes())}
    calls = {}
    for i, (fmt, shape, dtype) in enumerate(cases):
        for training in (True, False):
            inputs = make_inputs(shape, fmt, dtype, training, seed=1000 + i)
            for rep in range(2):
                calls[(i, training, rep)] = (inputs, fmt, training)

    from fbn_grad_tf import _loader

    def ex_grad(inputs, fmt, training, mode):
        # The fused backward (Relu6 from y, Swish recomputing z with a side input), with
        # side_input_backprop: x stands in for the forward's y and the side input.
        dy, x = inputs[0], inputs[1]
        c = inputs[2].shape[0]
        out = _loader.raw_grad_ex_op(
            y_backprop=dy, x=x, scale=inputs[2], reserve_space_1=inputs[3],
            reserve_space_2=inputs[4], reserve_space_3=inputs[5], y=x,
            offset=[np.linspace(-1, 1, c).astype(np.float32)], side_input=[x],
            data_format=fmt, is_training=training, activation_mode=mode)
        return list(out[:3]) + list(out[5])

    def run_all():
        outs = {key: fbn_grad_tf.fused_batch_norm_grad(*inputs, data_format=fmt,
                                                       is_training=training)[:3]
                for key, (inputs, fmt, training) in calls.items()}
        ex = {}  # (keys of one type per dict: tf.function sorts them)
        for (i, training, rep), (inputs, fmt, _) in calls.items():
            for mode in ("Relu6", "Swish"):
                ex[("e" + mode, i, training, rep)] = ex_grad(inputs, fmt, training, mode)
        return outs, ex
    if inter > 1:
        # All calls in one graph: TF's executor runs independent ops at the same time, so
        # ours share the intra-op pool with each other (helpers join late or not at all).
        outs, ex = tf.function(run_all)()
    else:
        outs, ex = run_all()
    outs = dict(outs)
    outs.update(ex)
    for key, out in outs.items():
        if len(key) == 4:  # the fused backward: "eRelu6_<case>-<training>-<rep>-<output>"
            prefix, (i, training, rep) = key[0] + "_", key[1:]
            names = ("dx", "dscale", "doffset", "dside")
        else:
            prefix, (i, training, rep) = "", key
            names = ("dx", "dscale", "doffset")
        for k, t in zip(names, out):
            result["%%s%%d-%%s-%%d-%%s" %% (prefix, i, training, rep, k)] = bits(t.numpy())
    np.savez(out_path, **result)
""") % {"tests_dir": TESTS_DIR, "cases": CASES}

CONFIGS = {  # name -> (intra-op threads, inter-op threads, extra environment)
    "threads1": (1, 1, {}),
    "threads2": (2, 1, {}),
    "threads4": (4, 1, {}),  # (every configuration is a separate process: run-to-run too)
    # The CPU path forced through the environment (the other paths are compared with each
    # other in test_core_numpy.py; this checks the op honours the override).
    "threads3-baseline": (3, 1, {"FBN_GRAD_TF_ISA": "baseline"}),
    # The software prefetch (on by default except on AMD CPUs) changes speed only.
    "threads2-prefetch-on": (2, 1, {"FBN_GRAD_TF_PREFETCH": "on"}),
    "threads2-prefetch-off": (2, 1, {"FBN_GRAD_TF_PREFETCH": "off"}),
    # Every output written with non-temporal stores (the default streams only large ones).
    "threads2-streamed": (2, 1, {"FBN_GRAD_TF_STREAM_MIB": "0"}),
    # The channels-first training backward channel by channel for every channel (the
    # NCHW/NCDHW cases' planes are 8-32 KB), and never (the default depends on the CPU).
    # (These children run no forward; the forward's plan: test_channel_major.py.)
    "threads2-channel-major": (2, 1, {"FBN_GRAD_TF_CHANNEL_MAJOR_KIB": "1048576"}),
    "threads2-plane-tasks": (2, 1, {"FBN_GRAD_TF_CHANNEL_MAJOR_KIB": "0"}),
    # Every call in one tf.function with 4 inter-op threads: our ops run at the same time
    # and compete for the 2 intra-op threads.
    "threads2-concurrent": (2, 4, {}),
}


@pytest.fixture(scope="module")
def child_outputs(tmp_path_factory):
    """Runs every configuration in its own child process (concurrently) -> {name: npz}."""
    tmp = tmp_path_factory.mktemp("determinism")
    procs = {}
    for name, (threads, inter, env) in CONFIGS.items():
        path = str(tmp / (name + ".npz"))
        procs[name] = (path, subprocess.Popen(
            [sys.executable, "-c", CHILD, str(threads), path, str(inter)],
            env=subprocess_env(**env),
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    results = {}
    for name, (path, p) in procs.items():
        try:
            _, err = p.communicate(timeout=300)
        except subprocess.TimeoutExpired:
            p.kill()
            _, err = p.communicate()
        assert p.returncode == 0, "child %s failed (%s):\n%s" % (name, p.returncode, err[-3000:])
        results[name] = dict(np.load(path))
    return results


def test_children_ran_with_requested_configuration(child_outputs):
    for name, (threads, _, env) in CONFIGS.items():
        out = child_outputs[name]
        assert int(out["intra_op_threads"]) == threads
        assert str(out["isa"]) == env.get("FBN_GRAD_TF_ISA", core.default_isa())
        want = {"on": True, "off": False}.get(env.get("FBN_GRAD_TF_PREFETCH"),
                                              core.software_prefetch())
        assert bool(out["prefetch"]) == want
        kib = env.get("FBN_GRAD_TF_CHANNEL_MAJOR_KIB")
        # (by default never where the kernels prefetch, 4 MiB where they do not)
        assert int(out["channel_major_max_bytes"]) == (
            (0 if want else 4 << 20) if kib is None else int(kib) << 10)
        if "FBN_GRAD_TF_STREAM_MIB" in env:
            assert list(out["stream_min_bytes"]) == [0, 0]
        else:
            assert list(out["stream_min_bytes"]) == [core.stream_min_bytes(4),
                                                     core.stream_min_bytes(2)]


def test_repeated_runs_in_one_process_bitwise_equal(child_outputs):
    for name, out in child_outputs.items():
        for key in out:
            if "-0-" in key:
                np.testing.assert_array_equal(out[key], out[key.replace("-0-", "-1-")],
                                              err_msg="%s: %s" % (name, key))


@pytest.mark.parametrize("name", [n for n in CONFIGS if n != "threads1"])
def test_bitwise_equal_across_thread_counts_processes_and_isas(child_outputs, name):
    ref, out = child_outputs["threads1"], child_outputs[name]
    keys = [k for k in ref if k[0].isdigit() or k[0] == "e"]
    assert len(keys) == len(CASES) * 2 * 2 * 3 + len(CASES) * 2 * 2 * 2 * 4
    for key in keys:
        np.testing.assert_array_equal(out[key], ref[key], err_msg="%s vs threads1: %s" % (
            name, key))


def test_outputs_are_nontrivial(child_outputs):
    """Guards against comparing empty or all-zero outputs."""
    out = child_outputs["threads1"]
    for i, (_, shape, _) in enumerate(CASES):
        dx = out["%d-True-0-dx" % i]
        assert dx.size == np.prod(shape) and np.count_nonzero(dx) > dx.size // 2
