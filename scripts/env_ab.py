"""Per-call A/B of a run-time switch that the library reads once per process.

A development diagnostic (not run in CI). Switches such as FBN_GRAD_TF_HUGEPAGES,
FBN_GRAD_TF_PREFETCH or FBN_GRAD_TF_STREAM_MIB are read once, so the two sides must run in
separate processes: this script starts one child per side and round, alternating A, B, A, B,
... (the machine's drift falls on both sides alike). Each child times our backward
(fused_batch_norm_grad, training, inside a tf.function, called eagerly with inputs held by
Python: x_backprop is a fresh output every call), or with --op forward our forward
(fused_batch_norm, training; y fresh) on every case, interleaved, and reports per case the
median time and the median of the process's minor page faults per call (getrusage). Per
case the script prints both sides' medians over rounds, the median of the per-round ratios
B / A with a bootstrap 95% interval (scripts/model_ab.py's estimator) and the page faults.

    .venv/bin/python scripts/env_ab.py VAR [--values off,on] [--rounds 5] [--reps 15]
        [--shapes 32x112x112x64,...] [--dtypes float32,bfloat16] [--formats NHWC,NCHW]
        [--op backward|forward] [--env NAME=VALUE ...]
    # e.g. FBN_GRAD_TF_HUGEPAGES --env TF_CPU_ALLOCATOR_USE_BFC=true

--env sets further variables in both sides' children (TF_CPU_ALLOCATOR_USE_BFC=true: TF's
pooling allocator, as with oneDNN on; unset, TF's default CPU allocator, which returns large
buffers to the OS at every free). Calibrate with both values the same (--values on,on).
"""
import argparse
import json
import os
import resource
import subprocess
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from model_ab import interval  # noqa: E402

DEFAULT_SHAPES = "32x112x112x64,32x56x56x256,32x28x28x512,16x24x24x256,256x1x1x4096"


def child(args):
    """Times every case in this process; prints one JSON line {case: median ms}."""
    import tensorflow as tf

    import fbn_grad_tf

    cases = []
    for text in args.shapes.split(","):
        n, h, w, c = (int(v) for v in text.split("x"))
        for dtype in args.dtypes.split(","):
            for fmt in args.formats.split(","):
                shape = (n, h, w, c) if fmt == "NHWC" else (n, c, h, w)
                rng = np.random.default_rng(0)
                dy = tf.constant(rng.standard_normal(shape, dtype=np.float32), dtype=dtype)
                x = tf.constant(rng.standard_normal(shape, dtype=np.float32), dtype=dtype)
                scale, mean, var = (tf.constant(np.full(c, v, np.float32)) for v in (1, 0, 1))

                @tf.function
                def step(dy, x, fmt=fmt, scale=scale, mean=mean, var=var):
                    if args.op == "forward":  # y, a fresh output (dy unused)
                        return fbn_grad_tf.fused_batch_norm(
                            x, scale, mean, data_format=fmt, is_training=True)[0]
                    return fbn_grad_tf.fused_batch_norm_grad(
                        dy, x, scale, mean, var, mean, data_format=fmt, is_training=True)[0]

                step(dy, x)  # trace and warm up
                cases.append(("%s %s %s" % (text, fmt, dtype), step, dy, x))
    times = {name: [] for name, *_ in cases}
    faults = {name: [] for name, *_ in cases}
    for _ in range(args.reps):
        for name, step, dy, x in cases:
            f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            t0 = time.perf_counter()
            out = step(dy, x)
            times[name].append((time.perf_counter() - t0) * 1e3)
            faults[name].append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0)
            del out
    print(json.dumps({name: [float(np.median(times[name])), float(np.median(faults[name]))]
                      for name in times}))


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("var")
    p.add_argument("--values", default="off,on", help="A,B (default off,on)")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--reps", type=int, default=15)
    p.add_argument("--shapes", default=DEFAULT_SHAPES, help="NHWC shapes NxHxWxC, comma list")
    p.add_argument("--dtypes", default="float32,bfloat16")
    p.add_argument("--formats", default="NHWC,NCHW")
    p.add_argument("--op", choices=["backward", "forward"], default="backward",
                   help="our backward (default) or our forward, training")
    p.add_argument("--env", action="append", default=[], metavar="NAME=VALUE")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        child(args)
        return
    values = args.values.split(",")
    if len(values) != 2:
        p.error("--values takes two comma-separated values")
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
    for item in args.env:
        name, _, value = item.partition("=")
        env[name] = value
    argv = [sys.executable, os.path.abspath(__file__), args.var, "--child",
            "--reps", str(args.reps), "--shapes", args.shapes, "--dtypes", args.dtypes,
            "--formats", args.formats, "--op", args.op]
    runs = {v: [] for v in values}
    for r in range(args.rounds):
        for v in values:
            out = subprocess.run(argv, env=dict(env, **{args.var: v}), check=True,
                                 capture_output=True, text=True).stdout
            runs[v].append(json.loads(out.strip().splitlines()[-1]))
            print("round %d/%d, %s=%s done" % (r + 1, args.rounds, args.var, v),
                  file=sys.stderr, flush=True)
    a, b = values
    print("%s: A=%s, B=%s; our %s, %d rounds x %d calls per case; %s" % (
        args.var, a, b, args.op, args.rounds, args.reps,
        " ".join(args.env) or "no other variables"))
    print("%-28s %9s %9s  %-30s %s" % ("case", "A ms", "B ms", "B / A, median [95% interval]",
                                         "page faults per call, A / B"))
    for name in runs[a][0]:
        ta = [run[name][0] for run in runs[a]]
        tb = [run[name][0] for run in runs[b]]
        fa = np.median([run[name][1] for run in runs[a]])
        fb = np.median([run[name][1] for run in runs[b]])
        print("%-28s %9.2f %9.2f  %-30s %.0f / %.0f" % (
            name, np.median(ta), np.median(tb), interval([y / x for x, y in zip(ta, tb)]),
            fa, fb))


if __name__ == "__main__":
    main()
