"""--model --trace: BN cost as the sum of BN op times in a TF profiler trace.

The step-difference estimate (step - floor of the same repetition) subtracts two step times
of 100-600 ms whose repetition-to-repetition spread is as large as BN's cost on a 2-core
machine. This estimator instead runs a few extra training steps of the BN variants under the
TF profiler (interleaved, order rotated per repetition, each step wrapped in a TraceMe
marker), reads the XSpace it writes (.xplane.pb) and sums, per step, the durations of the op
events that belong to BN:

* "BN ops": every op whose name lies in a BN layer's name scope, forward and gradient
  (``<model>/<bn layer>/...`` and ``gradient_tape/<model>/<bn layer>/...``; Keras 3 suffixes
  the scope with ``_<n>``). That is TF's FusedBatchNormV3/FusedBatchNormGradV3 (oneDNN:
  ``_MklNative...``), our ``FbnGrad>...`` ops, Keras 3's unfused moments/normalize ops and
  their gradients, and, in every variant, the layer's moving-average updates
  (ReadVariableOp, Mul, AddV2, AssignVariableOp).
* "BN kernels": the ops of a BN kernel type wherever they are (BN_KERNEL_TYPE: TF's
  FusedBatchNorm* family with its oneDNN and _Ex forms, and every ``FbnGrad>`` op).
* "BN+act ops": BN ops plus the ops in the name scopes of the activation layers right after
  a BN and of the layers ``fbn_grad_tf.keras.convert`` absorbs into our fused op (the
  residual Add before such an activation): what "ours conv" runs inside its fused op, the
  other variants run as separate Relu/Relu6/Add ops (and TF's grappler may itself fuse a
  FusedBatchNormV3 + Relu into ``_MklNativeFusedBatchNormEx`` in the BN's scope).

A duration is an op kernel's wall time on the executor thread that ran it (its intra-op
helpers included). Ops that TF runs at the same time (two inter-op threads) overlap, so a sum
of op times is not wall time and not what the step would save; it is the kernels' own time,
measured without the step-to-step noise of the rest of the model. Containers (function calls,
control flow) are left out so nothing is counted twice. The profiler records every op at
host_tracer_level 3 (at level 2 TF traces only the ops its cost model calls expensive, so
small ops would come and go).

The steps are traced in several profiler windows (one profiler start to stop each) of at
most CHUNK_ROUNDS rounds, and each window's XSpace is reduced to per-step sums before the
next one starts: a window holds every op event of its steps in memory until it stops, far
more than the trace it writes: a window of 5 rounds of ResNet50 float32 training steps (4
variants, batch 16, 96x96, TF 2.21 on its Eigen kernels, 2-core AMD EPYC Zen 2) grew the
process by about 5 GB for a 33 MB .xplane.pb, and gave it back when it stopped; 40 rounds
in one window ran a 24 GiB machine out of memory. At 2 rounds per window the peak stayed
2.4 GB above the untraced steps' (ResNet50 there, 3 windows: 4.5 GB in all), and stopping a
window cost about 0.15 s per traced step.
"""
import bisect
import glob
import importlib
import os
import re
import tempfile
import time

#: The XPlane holding the CPU threads' events.
HOST_PLANE = "/host:CPU"
#: The TraceMe around each traced step (stats: variant, rep).
STEP_MARKER = "fbn_bench_step"
#: TF's op activity events are named "<op name>:<op type>"; TF op names cannot contain ':'.
_OP_EVENT = re.compile(r"^([A-Za-z0-9.][A-Za-z0-9_.\\/>-]*):([A-Za-z0-9_>]+)$")
#: Op types that are a batch-norm kernel: TF's FusedBatchNorm (V2, V3, Grad, _FusedBatchNormEx,
#: oneDNN's _Mkl/_MklNative forms) and every op of ours (registered as "FbnGrad>...").
BN_KERNEL_TYPE = re.compile(r"^(_Mkl|_MklNative)?_?FusedBatchNorm(Grad)?(V2|V3)?(Ex)?$"
                            r"|^FbnGrad>")
#: Op types that run other ops (counted by their inner ops instead).
CONTAINER_TYPES = frozenset((
    "PartitionedCall", "StatefulPartitionedCall", "RemoteCall", "While", "StatelessWhile",
    "If", "StatelessIf", "Case", "StatelessCase"))
#: host_tracer_level of the trace: 3 traces inexpensive ops too (see the module docstring).
HOST_TRACER_LEVEL = 3
#: Rounds (one step of every variant) per profiler window (see the module docstring).
CHUNK_ROUNDS = 2
#: A scope component with Keras' / TF's uniquifying suffix ("bn0_1" for layer "bn0").
_SUFFIX = re.compile(r"_\d+$")


def xplane_pb2():
    """The XSpace protobuf module that ships with TensorFlow (its location moved between
    versions)."""
    errors = []
    for name in ("tensorflow.tsl.profiler.protobuf.xplane_pb2",
                 "tsl.profiler.protobuf.xplane_pb2",
                 "tensorflow.core.profiler.protobuf.xplane_pb2"):
        try:
            return importlib.import_module(name)
        except ImportError as e:
            errors.append("%s: %s" % (name, e))
    raise ImportError("no XSpace protobuf module in this TensorFlow (%s)" % "; ".join(errors))


def record(steps, keys, reps, progress=None, first_round=0):
    """Runs `reps` rounds of one step of every key of `keys` (order rotated per round, as the
    timed repetitions; rounds numbered from first_round) under one TF profiler window, each
    step inside a STEP_MARKER TraceMe. Returns (XSpace, {key: [wall ms of each traced step]},
    {"start_s", "steps_s", "stop_s", "xplane_bytes"})."""
    import tensorflow as tf
    pb2 = xplane_pb2()
    wall = {k: [] for k in keys}
    options = tf.profiler.experimental.ProfilerOptions(
        host_tracer_level=HOST_TRACER_LEVEL, python_tracer_level=0, device_tracer_level=0)
    with tempfile.TemporaryDirectory(prefix="fbn_bench_trace_") as logdir:
        t0 = time.perf_counter()
        tf.profiler.experimental.start(logdir, options=options)
        t1 = time.perf_counter()
        try:
            for r in range(first_round, first_round + reps):
                for k in keys[r % len(keys):] + keys[:r % len(keys)]:
                    with tf.profiler.experimental.Trace(STEP_MARKER, variant=k, rep=r):
                        s0 = time.perf_counter()
                        steps[k]()
                        wall[k].append((time.perf_counter() - s0) * 1e3)
        finally:
            t2 = time.perf_counter()
            tf.profiler.experimental.stop()
            t3 = time.perf_counter()
        if progress is not None:
            progress()
        paths = glob.glob(os.path.join(logdir, "**", "*.xplane.pb"), recursive=True)
        if len(paths) != 1:
            raise RuntimeError("the profiler wrote %d .xplane.pb files under %s, expected 1"
                               % (len(paths), logdir))
        with open(paths[0], "rb") as f:
            data = f.read()
    space = pb2.XSpace()
    space.ParseFromString(data)
    return space, wall, {"start_s": t1 - t0, "steps_s": t2 - t1, "stop_s": t3 - t2,
                         "xplane_bytes": len(data)}


def _stat_value(stat, stat_metadata):
    kind = stat.WhichOneof("value")
    if kind == "ref_value":
        return stat_metadata[stat.ref_value].name
    return getattr(stat, kind) if kind else None


def host_plane(space):
    for plane in space.planes:
        if plane.name == HOST_PLANE:
            return plane
    raise ValueError("no %s plane in the trace (planes: %s)" % (
        HOST_PLANE, ", ".join(p.name for p in space.planes)))


def step_ops(space):
    """The traced steps and their op events: a list of {"variant", "rep", "start_ps",
    "end_ps", "ops": [(op name, op type, duration ps)]} in time order, and the number of op
    events that started inside another op event on the same thread (nesting: expected 0 with
    CONTAINER_TYPES left out)."""
    plane = host_plane(space)
    meta, stat_meta = plane.event_metadata, plane.stat_metadata
    steps, ops = [], []
    nested = 0
    for line in plane.lines:
        base_ps = line.timestamp_ns * 1000
        last_end = None
        for ev in sorted(line.events, key=lambda e: e.offset_ps):
            md = meta[ev.metadata_id]
            start = base_ps + ev.offset_ps
            if md.name == STEP_MARKER:
                st = {stat_meta[s.metadata_id].name: _stat_value(s, stat_meta)
                      for s in ev.stats}
                steps.append({"variant": st.get("variant"), "rep": st.get("rep"),
                              "start_ps": start, "end_ps": start + ev.duration_ps, "ops": []})
                continue
            m = _OP_EVENT.match(md.name)
            if m is None or m.group(2) in CONTAINER_TYPES:
                continue
            if last_end is not None and start < last_end:
                nested += 1
            last_end = max(last_end or 0, start + ev.duration_ps)
            ops.append((start, m.group(1), m.group(2), ev.duration_ps))
    steps.sort(key=lambda s: s["start_ps"])
    starts = [s["start_ps"] for s in steps]
    for start, name, typ, dur in ops:
        i = bisect.bisect_right(starts, start) - 1
        if i >= 0 and start < steps[i]["end_ps"]:
            steps[i]["ops"].append((name, typ, dur))
    return steps, nested


def in_scopes(op_name, scopes):
    """Whether one of the op's name-scope components (not its own name) is a layer of
    `scopes`, as is or with the "_<n>" suffix Keras/TF add to a re-entered scope."""
    parts = op_name.split("/")[:-1]
    return any(p in scopes or _SUFFIX.sub("", p) in scopes for p in parts)


def step_sums(ops, bn_scopes, act_scopes):
    """One step's sums in ms: bn_ops, bn_act_ops, bn_kernels, and per op type of the BN
    ops' and the activation ops' (ms, count)."""
    bn = act = kernels = 0
    types, act_types = {}, {}
    for name, typ, dur in ops:
        if BN_KERNEL_TYPE.match(typ):
            kernels += dur
        if in_scopes(name, bn_scopes):
            bn += dur
            t = types.setdefault(typ, [0, 0])
        elif act_scopes and in_scopes(name, act_scopes):
            act += dur
            t = act_types.setdefault(typ, [0, 0])
        else:
            continue
        t[0] += dur
        t[1] += 1
    ms = 1e-9
    return {"bn_ops": bn * ms, "bn_act_ops": (bn + act) * ms, "bn_kernels": kernels * ms,
            "types": {k: (v[0] * ms, v[1]) for k, v in types.items()},
            "act_types": {k: (v[0] * ms, v[1]) for k, v in act_types.items()}}


def per_variant_sums(steps, keys, bn_scopes, act_scopes):
    """{key: [step_sums of each traced step of that variant, in rep order]}."""
    out = {k: [] for k in keys}
    for s in sorted(steps, key=lambda s: (s["rep"] if s["rep"] is not None else -1)):
        if s["variant"] in out:
            out[s["variant"]].append(step_sums(s["ops"], bn_scopes, act_scopes))
    return out


def window_count(reps, chunk_rounds=CHUNK_ROUNDS):
    """Profiler windows that traced_sums uses for `reps` rounds."""
    return -(-reps // chunk_rounds)


def traced_sums(steps, keys, reps, bn_scopes, act_scopes, chunk_rounds=CHUNK_ROUNDS,
                progress=None):
    """`reps` rounds of record() in windows of at most chunk_rounds rounds, each window's
    trace reduced by step_ops and per_variant_sums before the next starts. Returns
    ({key: [step_sums per traced step, in round order]}, {key: [wall ms per traced step]},
    {"windows", "start_s", "steps_s", "stop_s", "xplane_bytes" (summed over the windows),
    "nested_op_events"}). progress(n) is called after the n-th window (from 1)."""
    if chunk_rounds < 1:
        raise ValueError("chunk_rounds must be >= 1, got %r" % (chunk_rounds,))
    sums = {k: [] for k in keys}
    wall = {k: [] for k in keys}
    total = {"windows": 0, "start_s": 0.0, "steps_s": 0.0, "stop_s": 0.0, "xplane_bytes": 0,
             "nested_op_events": 0}
    for first in range(0, reps, chunk_rounds):
        space, chunk_wall, timing = record(steps, keys, min(chunk_rounds, reps - first),
                                           first_round=first)
        chunk_steps, nested = step_ops(space)
        space = None
        for k, v in per_variant_sums(chunk_steps, keys, bn_scopes, act_scopes).items():
            sums[k].extend(v)
        for k, v in chunk_wall.items():
            wall[k].extend(v)
        total["windows"] += 1
        total["nested_op_events"] += nested
        for name in ("start_s", "steps_s", "stop_s", "xplane_bytes"):
            total[name] += timing[name]
        if progress is not None:
            progress(total["windows"])
    return sums, wall, total
