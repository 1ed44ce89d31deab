"""Per-layer BN op times inside a keras.applications model: TF fused against ours converted.

A development diagnostic (not run in CI; docs/PERFORMANCE_NOTES.md, "How in-model speed is judged"):
`python -m fbn_grad_tf.bench --model --trace` sums BN (+activation) op times per step; this
splits them by BN layer, to find which layers an in-model gap comes from.

    .venv/bin/python scripts/trace_layers.py [--inter-op N] [MODEL [POLICY [STEPS [VARIANT]]]]
                                              # resnet50 float32 6 conv

--inter-op N: TF's inter-op threads (default: TF's, one per core). With 1, TF runs one op at
a time, so no op's duration is stretched by another running beside it on the other core:
what is left of a gap between the columns is the kernels', not the overlap's.

VARIANT: conv (default; fbn_grad_tf.keras.convert) or ours (every BN our layer, the
activations left as TF ops: the "ours" variant of bench --model).

Builds MODEL (batch 16, 96x96, synthetic data, dropout off), its TF-fused variant (every BN
on TF's FusedBatchNormV3 and gradient) and its converted variant (fbn_grad_tf.keras.convert:
fused activation and residual Add), warms both up, traces STEPS interleaved training steps
of each under the TF profiler (fbn_grad_tf.bench.trace; in windows of trace.CHUNK_ROUNDS
rounds, each reduced before the next, as bench --model --trace does) and prints per BN
layer:
* TF bwd+act: TF's batch-norm gradient op + the gradient op of the activation after it (for
  BN+Add+ReLU, the ReLU after the Add is put on the Add's last BN input), ms per step;
* conv: our fused backward op (VARIANT ours: our backward op + the activation's gradient
  op; in the projection blocks, which convert leaves unfused, the shortcut's `_0_bn` adds
  the gradient ops of the Add + ReLU, as TF's column does), ms per step, and c/T, its ratio
  to TF's two;
* beside: the op type that ran on another thread for the longest part of the backward.
* overlap: median share of the backward op's time during which another op ran on another
  thread (TF / ours);
* GB/s: 5 tensor passes of float32 over our backward op's time (a scale, not a roofline);
* fwd: forward op time (+ the activation's forward for TF), ms per step.
"""
import collections
import statistics
import sys

import keras
import numpy as np
import tensorflow as tf

from fbn_grad_tf.bench import models as M, trace as T

BATCH, SIZE, CLASSES = 16, 96, 10


def build_variants(name, policy, builders):
    """MODEL under POLICY (seeded, dropout off) and {key: builder(model), compiled with SGD}
    for each (key, builder) of `builders` (fbn_grad_tf.bench.models' _build_* functions)."""
    keras.mixed_precision.set_global_policy(policy)
    keras.utils.set_random_seed(0)
    base = M.build_model(name, SIZE, CLASSES)

    class Config:
        learning_rate = 0.01

    return base, {k: M._compile(b(base), Config) for k, b in builders.items()}


def build(name, policy, variant="conv"):
    return build_variants(name, policy, {
        "tf_fused": M._build_tf_fused,
        "conv": M._build_ours if variant == "ours" else M._build_converted})


def traced_windows(models, nsteps, chunk_rounds=T.CHUNK_ROUNDS):
    """One training step per model on a synthetic batch, 3 untimed steps of each, then
    `nsteps` interleaved steps of each under the TF profiler, in windows of at most
    chunk_rounds rounds (the profiler holds a window's events in memory until it stops; one
    window of many ResNet50 steps on TF's Eigen kernels outgrows 24 GiB). Yields (XSpace,
    {key: [wall ms]}) per window, rounds numbered on across windows."""
    x = tf.random.stateless_uniform([BATCH, SIZE, SIZE, 3], [0, 1], 0.0, 1.0)
    y = tf.random.stateless_uniform([BATCH], [0, 2], 0, CLASSES, dtype=tf.int32)
    steps = {k: M._train_step(m, x, y) for k, m in models.items()}
    for k in steps:
        for _ in range(3):
            steps[k]()
    windows = T.window_count(nsteps, chunk_rounds)
    for n, first in enumerate(range(0, nsteps, chunk_rounds), 1):
        print("tracing steps %d-%d of %d of each variant (window %d/%d)..."
              % (first + 1, min(first + chunk_rounds, nsteps), nsteps, n, windows),
              file=sys.stderr)
        space, wall, _ = T.record(steps, list(steps), min(chunk_rounds, nsteps - first),
                                  first_round=first)
        yield space, wall
        space = wall = None  # not held while the next window records


def owners(base):
    """{layer name: BN layer name} for the activation layers after a BN and the Add + act of
    a residual block. The Add + act goes to the BN that fbn_grad_tf.keras.convert fuses with
    them: the Add's BN input met first in graph order (in ResNet50's projection blocks the
    shortcut's `_0_bn`, not `_3_bn`; the other BN input then runs as a plain backward on the
    side input's gradient)."""
    order = {layer.name: i for i, layer in enumerate(base.layers)}
    out = {}
    for layer in base.layers:
        if not isinstance(layer, M._activation_types()):
            continue
        p = M._producer(layer)
        if p is not None and M._is_bn(p):
            out[layer.name] = p.name
        elif isinstance(p, keras.layers.Add):
            bns = [t._keras_history[0].name for t in p.input if M._is_bn(t._keras_history[0])]
            if bns:
                out[layer.name] = out[p.name] = min(bns, key=order.get)
    return out


def op_events(space):
    """[(start ps, end ps, thread line id, op name, op type)] of every op event, by start."""
    plane = T.host_plane(space)
    events = []
    for line in plane.lines:
        base_ps = line.timestamp_ns * 1000
        for ev in line.events:
            m = T._OP_EVENT.match(plane.event_metadata[ev.metadata_id].name)
            if m is None or m.group(2) in T.CONTAINER_TYPES:
                continue
            s = base_ps + ev.offset_ps
            events.append((s, s + ev.duration_ps, line.id, m.group(1), m.group(2)))
    events.sort()
    return events


def overlap_share(events, s, e, tid, beside=None):
    """Share of [s, e) during which ops ran on other threads; adds each such op type's
    overlapped time to the Counter `beside` if given."""
    busy = 0
    for s2, e2, t2, _, typ in events:
        if s2 >= e:
            break
        if t2 != tid and e2 > s:
            busy += min(e, e2) - max(s, s2)
            if beside is not None:
                beside[typ] += min(e, e2) - max(s, s2)
    return busy / max(e - s, 1)


def main(argv):
    argv = list(argv)
    if len(argv) > 2 and argv[1] == "--inter-op":
        tf.config.threading.set_inter_op_parallelism_threads(int(argv[2]))
        del argv[1:3]
    name = argv[1] if len(argv) > 1 else "resnet50"
    policy = argv[2] if len(argv) > 2 else "float32"
    nsteps = int(argv[3]) if len(argv) > 3 else 6
    variant = argv[4] if len(argv) > 4 else "conv"
    if variant not in ("conv", "ours"):
        sys.exit("VARIANT must be conv or ours, got %r" % variant)
    base, models = build(name, policy, variant)
    print("variant %s: %s" % (variant, "our BN layers, TF's activation ops after them (its "
          "backward column adds their gradients)" if variant == "ours" else
          "converted, activations fused"), file=sys.stderr)
    shapes = {l.name: tuple(l.output.shape[1:]) for l in base.layers if M._is_bn(l)}
    act_owner = owners(base)
    times = collections.defaultdict(lambda: collections.defaultdict(float))
    overlaps = collections.defaultdict(list)
    besides = collections.defaultdict(collections.Counter)
    wall = collections.defaultdict(list)

    def owner(op_name):
        for p in op_name.split("/")[:-1]:
            for q in (p, T._SUFFIX.sub("", p)):
                if q in shapes:
                    return q, "bn"
                if q in act_owner:
                    return act_owner[q], "act"
        return None, None

    # Each window's trace is reduced into the sums before the next window is recorded.
    for space, window_wall in traced_windows(models, nsteps):
        for k, v in window_wall.items():
            wall[k].extend(v)
        events = op_events(space)
        traced, _ = T.step_ops(space)
        space = None
        for st in traced:
            v = st["variant"]
            for s, e, tid, op_name, typ in events:
                if not st["start_ps"] <= s < st["end_ps"]:
                    continue
                layer, where = owner(op_name)
                if layer is None:
                    continue
                grad = "BatchNormGrad" in typ or typ.endswith("Grad")
                if where == "bn" and not grad and not T.BN_KERNEL_TYPE.match(typ):
                    continue  # moving-average updates
                kind = ("bwd" if grad else "fwd") if where == "bn" else (
                    "act_bwd" if grad else "act_fwd")
                times[(v, layer)][kind] += (e - s) / 1e9 / nsteps
                if kind == "bwd":
                    overlaps[(v, layer)].append(
                        overlap_share(events, s, e, tid, besides[(v, layer)]))
        events = traced = None
    print("wall ms per step:", {k: round(statistics.median(v), 1) for k, v in wall.items()})
    fmt = "%-26s %-12s %-12s %-7s %-6s %-10s %-6s %-11s %s"
    print(fmt % ("layer", "shape", "TF bwd+act", "conv", "c/T", "overlap", "GB/s", "fwd TF/conv",
                 "beside TF / conv (the op type overlapping each backward most)"))

    def top(key):
        c = besides[key]
        return c.most_common(1)[0][0] if c else "-"
    totals = collections.Counter()
    for layer, shape in shapes.items():
        tf_t, cv = times[("tf_fused", layer)], times[("conv", layer)]
        tf_bwd = tf_t["bwd"] + tf_t["act_bwd"]
        # act_bwd: TF ops the conversion left in place (VARIANT ours; the Add + ReLU of the
        # projection blocks convert holds back); 0 where they are fused into our op
        cv_bwd = cv["bwd"] + cv["act_bwd"]
        ov = ["%.0f%%" % (100 * statistics.median(overlaps[(k, layer)]))
              if overlaps[(k, layer)] else "-" for k in ("tf_fused", "conv")]
        elements = BATCH * int(np.prod(shape))
        print(fmt % (layer, "x".join(map(str, shape)),
                     "%.2f+%.2f" % (tf_t["bwd"], tf_t["act_bwd"]), "%.2f" % cv_bwd,
                     "%.2f" % (cv_bwd / tf_bwd) if tf_bwd else "-", "/".join(ov),
                     "%.1f" % (elements * 20 / (cv["bwd"] * 1e6)) if cv["bwd"] else "-",
                     "%.2f/%.2f" % (tf_t["fwd"] + tf_t["act_fwd"], cv["fwd"] + cv["act_fwd"]),
                     "%s / %s" % (top(("tf_fused", layer)), top(("conv", layer)))))
        totals["TF bwd+act"] += tf_bwd
        totals["conv bwd"] += cv_bwd
        totals["TF fwd+act"] += tf_t["fwd"] + tf_t["act_fwd"]
        totals["conv fwd"] += cv["fwd"] + cv["act_fwd"]
    print("totals, ms per step:", {k: round(v, 2) for k, v in totals.items()})


if __name__ == "__main__":
    main(sys.argv)
