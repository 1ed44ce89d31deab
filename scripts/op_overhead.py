"""Where a backward call's time goes, ours against TF's FusedBatchNormGradV3: the op itself and
what the call pays outside it.

A development diagnostic (not run in CI; docs/PERFORMANCE_NOTES.md, "Per-call overhead"):
the backward grid of `python -m fbn_grad_tf.bench` times whole tf.function calls, in which
TF's dispatch is a fixed cost of a few tenths of a millisecond for both ops. This splits
each call, by the TF profiler, into

* op: the duration of the backward op's own event (its Compute: validation, output
  allocation, the kernel and its helper threads);
* outside: the call's wall time minus that (tf.function dispatch, executor, returning the
  outputs), the same machinery for both ops;

per call (one op per tf.function call, as the grid times it) and in a chain of 4 (each call's
x_backprop the next one's y_backprop in one tf.function, as a model's backward runs them; op
is then the mean of the four).

    .venv/bin/python scripts/op_overhead.py [--threads N] [--reps R] [--dtype D]
                                            [--format F] [--mode M] SHAPE [SHAPE ...]
    # e.g. 16x3x3x1280 8x7x7x512 16x6x6x960 256x1x1x4096 (NHWC dims)

All contestants are traced interleaved in one process (fbn_grad_tf.bench.trace.record: the
order rotates per round); medians over the rounds.
"""
import argparse
import statistics
import sys

import tensorflow as tf


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("shapes", nargs="+", help="NHWC shapes, e.g. 16x6x6x960")
    p.add_argument("--threads", type=int, default=None,
                   help="TF intra-op threads (default: TF's default, all cores)")
    p.add_argument("--reps", type=int, default=150, help="traced rounds (default 150)")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    p.add_argument("--format", default="NHWC", choices=("NHWC", "NCHW"))
    p.add_argument("--mode", default="training", choices=("training", "inference"))
    return p.parse_args(argv)


def main(argv):
    args = parse_args(argv)
    if args.threads:
        tf.config.threading.set_intra_op_parallelism_threads(args.threads)
    from fbn_grad_tf.bench import cases, contestants, trace

    training = args.mode == "training"
    print("%s %s %s, intra-op threads %s, %d rounds; ms per op (median)"
          % (args.dtype, args.format, args.mode, args.threads or "default", args.reps))
    print("%-14s %-10s %8s %8s %8s   %s" % ("shape", "contestant", "wall", "op", "outside",
                                          "op ours / TF"))
    for text in args.shapes:
        shape = cases.parse_shape(text)
        inputs = cases.op_args(cases._make_inputs(shape, args.dtype, 1234), args.format,
                               args.mode)
        steps = {}
        for who in ("ours", "tf"):
            steps[who] = contestants._tf_callable(who, inputs, 1e-3, args.format, training)
            steps[who + " x4"] = contestants._tf_callable(who, inputs, 1e-3, args.format,
                                                          training, chain=4)
        keys = list(steps)
        for k in keys:  # warm-up: trace, allocator, pool threads
            for _ in range(20):
                steps[k]()
        space, wall, _ = trace.record(steps, keys, args.reps)
        traced, _ = trace.step_ops(space)
        op_ms = {k: [] for k in keys}
        for s in traced:
            durations = [d for _, typ, d in s["ops"] if "FusedBatchNormGrad" in typ]
            if durations:
                op_ms[s["variant"]].append(sum(durations) / len(durations) * 1e-9)
        row = {}
        for k in keys:
            per_op = 4 if k.endswith("x4") else 1
            w = statistics.median(wall[k]) / per_op
            o = statistics.median(op_ms[k])
            row[k] = o
            print("%-14s %-10s %8.3f %8.3f %8.3f" % (text, k, w, o, w - o))
        print("%-14s %-10s %8s %8s %8s   per call %.2fx, chained %.2fx"
              % ("", "", "", "", "", row["ours"] / row["tf"], row["ours x4"] / row["tf x4"]))


if __name__ == "__main__":
    main(sys.argv[1:])
