"""Paired A/B of a development switch inside a model's training steps, by the trace.

A development diagnostic (not run in CI; docs/PERFORMANCE_NOTES.md, "How in-model speed is
judged", paired A/B): a development build of the kernels reads an environment variable at
every call (a temporary `std::getenv` in the code under test, never committed); this script
alternates its two values step by step in one process, under the TF profiler, and compares
per step

* our ops: the summed durations of the ops whose type starts with "FbnGrad";
* other ops: every other op's duration (a change that speeds ours by slowing the neighbours
  is not a gain);
* step: the step's wall time;

as the median of the per-repetition ratios B / A with a bootstrap 95% interval (2,000
resamples, seeded). The model is the converted one (fbn_grad_tf.keras.convert; VARIANT ours:
every BN our layer, the activations left to TF), batch 16 at 96x96, synthetic data, dropout
off, as scripts/trace_layers.py builds it.

    .venv/bin/python scripts/model_ab.py VAR [MODEL [POLICY [STEPS [ROUNDS [VARIANT]]]]]
    # e.g. FBN_DEV_SWITCH resnet50 float32 40 2 conv

Side A sets VAR=0, side B VAR=1 (AB_VALUES="a,b" sets others).

Calibrate with both values the same (AB_VALUES="0,0"): the ratios should then contain 1.
"""
import os
import statistics
import sys

import numpy as np


def interval(ratios, seed=0):
    """Median of `ratios` and its bootstrap 95% interval, as text."""
    r = np.asarray(ratios, dtype=np.float64)
    rng = np.random.default_rng(seed)
    boot = np.median(rng.choice(r, size=(2000, len(r))), axis=1)
    return "%.3f [%.3f..%.3f]" % (np.median(r), np.percentile(boot, 2.5),
                                  np.percentile(boot, 97.5))


def split_times(traced):
    """{variant: {rep: (our ops ms, other ops ms)}} from trace.step_ops' steps."""
    per = {}
    for s in traced:
        ours = sum(d for _, typ, d in s["ops"] if typ.startswith("FbnGrad")) * 1e-9
        other = sum(d for _, typ, d in s["ops"] if not typ.startswith("FbnGrad")) * 1e-9
        per.setdefault(str(s["variant"]), {})[s["rep"]] = (ours, other)
    return per


def main(argv):
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__)
        return 0 if argv else 2
    var = argv[0]
    name = argv[1] if len(argv) > 1 else "resnet50"
    policy = argv[2] if len(argv) > 2 else "float32"
    nsteps = int(argv[3]) if len(argv) > 3 else 40
    rounds = int(argv[4]) if len(argv) > 4 else 1
    variant = argv[5] if len(argv) > 5 else "conv"
    values = os.environ.get("AB_VALUES", "0,1").split(",")
    if len(values) != 2:
        raise SystemExit("AB_VALUES must be two comma-separated values, got %r"
                         % os.environ.get("AB_VALUES"))
    import tensorflow as tf

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import trace_layers as TL  # scripts/trace_layers.py: the same model build
    from fbn_grad_tf.bench import models as M, trace as T

    builder = M._build_ours if variant == "ours" else M._build_converted
    _, models = TL.build_variants(name, policy, {"conv": builder})
    x = tf.random.stateless_uniform([TL.BATCH, TL.SIZE, TL.SIZE, 3], [0, 1], 0.0, 1.0)
    y = tf.random.stateless_uniform([TL.BATCH], [0, 2], 0, TL.CLASSES, dtype=tf.int32)
    step = M._train_step(models["conv"], x, y)

    def with_value(value):
        def run():
            os.environ[var] = value
            step()
        return run

    steps = {"A": with_value(values[0]), "B": with_value(values[1])}
    for _ in range(3):  # warm-up: tracing, allocator, pool threads
        for k in steps:
            steps[k]()
    print("%s %s (%s), %s: A=%s B=%s, %d steps a side per round; B / A:"
          % (name, policy, variant, var, values[0], values[1], nsteps))
    for rd in range(rounds):
        space, wall, _ = T.record(steps, ["A", "B"], nsteps)
        traced, _ = T.step_ops(space)
        per = split_times(traced)
        reps = sorted(set(per.get("A", {})) & set(per.get("B", {})))
        if not reps:
            raise SystemExit("no traced steps of both sides")
        ours_a = statistics.median(per["A"][r][0] for r in reps)
        ours_b = statistics.median(per["B"][r][0] for r in reps)
        print("round %d: our ops %.2f -> %.2f ms, our ops %s, other ops %s, step %s" % (
            rd, ours_a, ours_b,
            interval([per["B"][r][0] / per["A"][r][0] for r in reps]),
            interval([per["B"][r][1] / per["A"][r][1] for r in reps]),
            interval([b / a for a, b in zip(wall["A"], wall["B"])])), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
