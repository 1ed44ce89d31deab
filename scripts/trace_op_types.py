"""Op time per op type inside a keras.applications model's training step: TF fused, ours, floor.

A development diagnostic (not run in CI; docs/PERFORMANCE_NOTES.md, "How in-model speed is
judged"). `python -m fbn_grad_tf.bench --model --trace` sums the ops of the BN layers;
this sums *every* op of the step by op type, so what changes beside our ops shows too (the
convolutions' gradients, the Relu/Add the floor's fused convolutions absorb, casts, small
variable ops).

    .venv/bin/python scripts/trace_op_types.py [MODEL [POLICY [STEPS [ROWS]]]]
                                               # resnet50 mixed_bfloat16 8 30

Builds MODEL (batch 16, 96x96, synthetic data, dropout off) as the bench does in three
variants: TF fused (every BN on TF's FusedBatchNormV3 and its gradient), ours (every BN our
layer) and floor (every BN a pass-through), warms each up, traces STEPS interleaved training
steps of each under the TF profiler (fbn_grad_tf.bench.trace) and prints:
* the median wall time of a traced step per variant (the profiler adds to it);
* the sum of all op times per step and the number of ops per step;
* per op type, the op time in ms per step and the op count per step, the ROWS largest.
Op times overlap (two cores, two inter-op threads), so their sum exceeds the step.
"""
import collections
import statistics
import sys

from fbn_grad_tf.bench import models as M, trace as T
from trace_layers import BATCH, SIZE, build_variants, traced_steps  # this directory

VARIANTS = ("tf_fused", "ours", "floor")


def main(argv):
    name = argv[1] if len(argv) > 1 else "resnet50"
    policy = argv[2] if len(argv) > 2 else "mixed_bfloat16"
    steps_n = int(argv[3]) if len(argv) > 3 else 8
    rows = int(argv[4]) if len(argv) > 4 else 30
    _, models = build_variants(name, policy, {
        "tf_fused": M._build_tf_fused, "ours": M._build_ours, "floor": M._build_floor})
    space, wall = traced_steps(models, steps_n)
    traced, _ = T.step_ops(space)
    per_type = {k: collections.defaultdict(lambda: [0.0, 0.0]) for k in VARIANTS}
    for st in traced:
        if st["variant"] not in per_type:
            continue
        for _, typ, dur in st["ops"]:
            cell = per_type[st["variant"]][typ]
            cell[0] += dur / 1e9 / steps_n  # ps -> ms, per step
            cell[1] += 1.0 / steps_n
    print("%s %s, batch %d, %dx%d, %d traced steps per variant"
          % (name, policy, BATCH, SIZE, SIZE, steps_n))
    print("wall ms per traced step (median):",
          {k: round(statistics.median(wall[k]), 1) for k in VARIANTS})
    print("op ms per step (sum):", {k: round(sum(v[0] for v in per_type[k].values()), 1)
                                    for k in VARIANTS})
    print("ops per step:", {k: round(sum(v[1] for v in per_type[k].values()))
                            for k in VARIANTS})
    types = set().union(*(per_type[k].keys() for k in VARIANTS))
    order = sorted(types, key=lambda t: -max(per_type[k][t][0] for k in VARIANTS))
    print("%-44s" % "op type (ms per step, ops per step)"
          + "".join("%18s" % k for k in VARIANTS))
    for typ in order[:rows]:
        print("%-44s" % typ[:44] + "".join(
            "%18s" % ("%.2f (%d)" % (per_type[k][typ][0], round(per_type[k][typ][1])))
            for k in VARIANTS))


if __name__ == "__main__":
    main(sys.argv)
