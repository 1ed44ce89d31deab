"""--model's runs: what a run is (ModelConfig), each variant's compiled training step, the
interleaved timed repetitions per model with the first-loss check, the --trace phase under the
profiler (trace.py), the pair row, and run_models over every model of a config."""
import dataclasses
import math
import statistics
import sys
import time
from typing import Optional, Tuple

import tensorflow as tf

from . import trace as _trace
from .cases import CorrectnessError
from .timing import Progress, configure_threads, measure_bandwidth
from .model_stats import TRACE_RATIO_BASE, model_stats, trace_stats
from .model_variants import (
    MODEL_VARIANTS, RATIO_BASE, UserModelError, _VARIANTS, _activation_types,
    _fused_path_layers, _is_bn, _keras, _tf_ops, activations_after_bn, bn_facts, build_model,
    is_user_model, model_data_shapes, selected_variants)

POLICIES = ("float32", "mixed_bfloat16", "mixed_float16")
#: Bytes per element of the tensors BN reads and writes under each policy (compute dtype).
POLICY_ITEMSIZE = {"float32": 4, "mixed_bfloat16": 2, "mixed_float16": 2}
#: Tensor passes of one BN training step over its activations: forward reads x for the
#: statistics, reads x again and writes y; backward reads dy and x for the reductions, reads
#: them again and writes dx (3 + 5).
BN_PASSES = 8
#: The first step's loss of a variant on our ops against Keras 3's (same weights, same data):
#: relative tolerance per policy.
LOSS_RTOL = {"float32": 1e-3, "mixed_bfloat16": 5e-2, "mixed_float16": 2e-2}


@dataclasses.dataclass
class ModelConfig:
    """What --model runs (defaults: ResNet50 at batch 16, 96x96, float32: a few minutes on 2
    cores)."""
    models: Tuple[str, ...] = ("resnet50",)
    batch: int = 16
    size: int = 96
    policy: str = "float32"
    classes: int = 10
    reps: int = 15                  # timed steps per variant (one per variant per repetition)
    warmup: int = 2                 # untimed steps per variant first (the first one traces)
    variants: Optional[Tuple[str, ...]] = None   # None: every available MODEL_VARIANTS key
    threads: Optional[int] = None   # TF intra-op threads; None: TF's default (all cores)
    pair: bool = True               # the two-independent-BN-layers row
    pair_shape: Tuple[int, int, int, int] = (16, 24, 24, 256)
    pair_reps: int = 30
    bandwidth_gbs: Optional[float] = None   # None: measured (timing.measure_bandwidth)
    bandwidth_mib: int = 256
    learning_rate: float = 1e-3
    bootstrap: int = 2000           # resamples for the ratios' 95% intervals
    trace: bool = False             # also sum BN op times in a profiler trace (trace.py)
    trace_steps: int = 5            # traced steps per BN variant with trace
    progress: bool = True
    seed: int = 1234

    def to_json(self):
        return dataclasses.asdict(self)


def _train_step(model, x, y):
    """model.train_step (Keras' own: loss, gradient, loss scaling under mixed_float16,
    optimizer update, moving statistics, metrics) in a tf.function, jit_compile=False. Returns
    a zero-argument callable giving the loss as a float (the host fetch is the sync point)."""
    step = tf.function(lambda x, y: model.train_step((x, y))["loss"], autograph=False,
                       jit_compile=False)

    def call():
        return float(step(x, y).numpy())

    call.step = step
    call.model = model  # keeps the model alive with the callable
    return call


def _compile(model, config):
    keras = _keras()
    model.compile(optimizer=keras.optimizers.SGD(learning_rate=config.learning_rate),
                  loss=keras.losses.SparseCategoricalCrossentropy(), jit_compile=False)
    model.optimizer.build(model.trainable_variables)
    return model


# ---- running -------------------------------------------------------------------------------

class _Policy:
    """Sets the global Keras dtype policy for the block, restores the previous one after."""

    def __init__(self, name):
        self.name = name

    def __enter__(self):
        keras = _keras()
        self.old = keras.mixed_precision.global_policy()
        keras.mixed_precision.set_global_policy(self.name)
        return self

    def __exit__(self, *exc):
        _keras().mixed_precision.set_global_policy(self.old)


def _first_loss_check(losses, policy, model_name):
    """The first step's loss of every variant on BN (not the floors) against Keras 3's: ours
    beyond LOSS_RTOL is a CorrectnessError."""
    ref = losses.get("keras")
    check = {}
    if ref is None:
        return check
    for k, loss in losses.items():
        if k == "keras" or _VARIANTS[k].floor is None:
            continue
        rel = abs(loss - ref) / max(abs(ref), 1e-30) if math.isfinite(loss) else float("inf")
        check[k] = rel
        if not rel <= LOSS_RTOL[policy]:
            raise CorrectnessError("%s: the first step's loss of %s is %.6g, Keras 3's %.6g "
                                   "(rel. diff %.3g > %g)" % (model_name, _VARIANTS[k].header,
                                                            loss, ref, rel, LOSS_RTOL[policy]))
    return check


def run_one_model(name, config, variants, progress, bandwidth_gbs):
    """Builds, checks, warms up and times every variant of one model (interleaved, order
    rotated per repetition). Returns the model's result dict."""
    keras = _keras()
    keras.utils.set_random_seed(config.seed)
    t_build = time.perf_counter()
    progress.start("%s: building %d variants" % (name, len(variants)))
    base = build_model(name, config.size, config.classes)
    facts = bn_facts(base, config.batch)
    if not facts["bn_layers"]:
        raise UserModelError("--model %s: the model has no BatchNormalization layer" % name)
    models = {}
    for v in variants:
        models[v.key] = _compile(v.build(base), config)
    if "ours" in models:
        facts["fused_path_layers"] = _fused_path_layers(models["ours"])
    scopes = _trace_scopes(base, models) if config.trace else None
    x_shape, classes = model_data_shapes(base, config.batch)
    x = tf.random.stateless_uniform(x_shape, [config.seed, 1], 0.0, 1.0)
    y = tf.random.stateless_uniform([config.batch], [config.seed, 2], 0, classes,
                                    dtype=tf.int32)
    steps = {k: _train_step(m, x, y) for k, m in models.items()}
    models = base = None
    progress.finish(1)
    build_s = time.perf_counter() - t_build

    losses, trace_s = {}, {}
    for v in variants:
        progress.start("%s: tracing + %d warm-up steps of %s" % (name, config.warmup, v.header))
        t0 = time.perf_counter()
        for i in range(max(config.warmup, 1)):
            loss = steps[v.key]()
            if i == 0:
                losses[v.key] = loss
                trace_s[v.key] = time.perf_counter() - t0
        progress.finish(1)
    check = _first_loss_check(losses, config.policy, name)

    keys = [v.key for v in variants]
    samples = {k: [] for k in keys}
    for r in range(config.reps):
        progress.start("%s: repetition %d/%d" % (name, r + 1, config.reps))
        order = keys[r % len(keys):] + keys[:r % len(keys)]
        for k in order:
            t0 = time.perf_counter()
            steps[k]()
            samples[k].append((time.perf_counter() - t0) * 1e3)
        progress.finish(1)
    traced = None
    if config.trace:
        traced = run_trace(name, steps, variants, samples, scopes, config, progress)
    steps = None

    itemsize = POLICY_ITEMSIZE[config.policy]
    traffic = facts["bn_elements"] * BN_PASSES * itemsize
    res = {"model": name, "batch": config.batch, "size": config.size,
           "input": ("x".join(str(d) for d in x_shape[1:]) if is_user_model(name)
                     else None),  # a user's model has its own input shape
           "policy": config.policy, **facts,
           "roofline": {"bytes": traffic, "passes": BN_PASSES, "itemsize": itemsize,
                        "bandwidth_gbs": bandwidth_gbs,
                        "ms": traffic / (bandwidth_gbs * 1e9) * 1e3 if bandwidth_gbs else None},
           "first_loss": losses, "loss_check": check, "build_s": round(build_s, 2),
           "trace_s": {k: round(v, 2) for k, v in trace_s.items()},
           "variants": model_stats(samples, variants, config)}
    if traced is not None:
        for k, e in traced.pop("variants").items():
            res["variants"][k]["trace"] = e
        res["trace"] = traced
    return res


def _trace_scopes(base, models):
    """Layer names whose name scopes hold BN's ops (every BN layer) and the activation ops
    counted in BN+act: the Activation/ReLU layers right after a BN, and the layers that
    fbn_grad_tf.keras.convert absorbed (the activation and Add layers of the model that the
    converted model lacks: the activation and, for BN+Add+activation, the Add)."""
    bn = {layer.name for layer in base.layers if _is_bn(layer)}
    act = set(activations_after_bn(base))
    conv = models.get("ours_converted")
    if conv is not None:
        kinds = _activation_types() + (_keras().layers.Add,)
        act |= ({layer.name for layer in base.layers if isinstance(layer, kinds)}
                - {layer.name for layer in conv.layers})
    return {"bn": bn, "act": act}


def run_trace(name, steps, variants, samples, scopes, config, progress):
    """The BN variants' extra steps under the profiler and their BN op sums per step:
    {"variants": {key: stats}, and what was traced and counted}."""
    keys = [v.key for v in variants if v.floor is not None]
    windows = _trace.window_count(config.trace_steps)
    label = ("%s: profiler trace of %d steps x %d BN variants (sum of BN op times), window %%d "
             "of %d" % (name, config.trace_steps, len(keys), windows))

    def window_done(n):
        progress.finish(1)
        if n < windows:
            progress.start(label % (n + 1))

    progress.start(label % 1)
    t0 = time.perf_counter()
    sums, wall, timing = _trace.traced_sums(steps, keys, config.trace_steps, scopes["bn"],
                                            scopes["act"], progress=window_done)
    stats = trace_stats(sums, wall, samples, config, {v.key: v.floor for v in variants})
    found = sorted({t for e in stats.values() for t in e["op_types"]})
    return {"variants": stats, "steps_per_variant": config.trace_steps,
            "host_tracer_level": _trace.HOST_TRACER_LEVEL, "ratio_base": TRACE_RATIO_BASE,
            "bn_layers": sorted(scopes["bn"]), "act_layers": sorted(scopes["act"]),
            "op_types_counted": found, "nested_op_events": timing["nested_op_events"],
            "profiler_windows": timing["windows"], "xplane_bytes": timing["xplane_bytes"],
            "profiler_start_s": round(timing["start_s"], 3),
            "profiler_stop_s": round(timing["stop_s"], 3),
            "wall_s": round(time.perf_counter() - t0, 2)}


def _pair_steps(config, itemsize_dtype, policy):
    """The four pair contestants: (ours, TF fused) x (at once, in sequence). Each is one
    tf.function: two fbn_grad_tf.keras.BatchNormalization layers, each forward + backward
    (upstream gradient fed in) on its own input; "seq" adds control dependencies so that the
    second layer starts after the first one's backward; "par" leaves TF free to run both at
    once. Same ops, same data."""
    from ..keras import BatchNormalization
    shape = tuple(config.pair_shape)
    dt = tf.as_dtype(itemsize_dtype)
    xs = [tf.cast(tf.random.stateless_normal(shape, [config.seed, 10 + i]), dt) for i in (0, 1)]
    dys = [tf.cast(tf.random.stateless_normal(shape, [config.seed, 20 + i]), dt) for i in (0, 1)]
    fns = {}
    for impl in ("ours", "tf_fused"):
        for order in ("par", "seq"):
            layers = [BatchNormalization(dtype=policy) for _ in (0, 1)]
            for layer in layers:
                layer.build(shape)
                if impl == "tf_fused":
                    _tf_ops(layer)
            fns["%s_%s" % (impl, order)] = _pair_fn(layers, xs, dys, order == "seq")
    return fns


def _pair_fn(layers, xs, dys, sequential):
    def one(layer, x, dy):
        with tf.GradientTape() as tape:
            tape.watch(x)
            yv = layer(x, training=True)
        return tape.gradient(yv, [x] + layer.trainable_weights, output_gradients=dy)

    @tf.function(autograph=False)
    def step(x1, x2, dy1, dy2):
        g1 = one(layers[0], x1, dy1)
        if sequential:
            with tf.control_dependencies(g1):
                x2 = tf.identity(x2)
        g2 = one(layers[1], x2, dy2)
        # Small results to fetch (the sync point); each depends on the whole backward op.
        return [tf.reduce_sum(tf.cast(g[0][..., :1], tf.float32)) + tf.reduce_sum(g[1]) +
                tf.reduce_sum(g[2]) for g in (g1, g2)]

    def call():
        out = step(xs[0], xs[1], dys[0], dys[1])
        return [float(o.numpy()) for o in out]

    call.layers = layers
    return call


def run_pair(config, progress):
    """The pair row: medians of the four pair contestants (interleaved, rotated) and the
    ratios seq/par (>1: running the two at once saved time) and TF fused/ours."""
    dtype = {"float32": "float32", "mixed_bfloat16": "bfloat16",
             "mixed_float16": "float16"}[config.policy]
    progress.start("pair: tracing")
    fns = _pair_steps(config, dtype, config.policy)
    for f in fns.values():
        f()
        f()
    progress.finish(1)
    keys = list(fns)
    samples = {k: [] for k in keys}
    progress.start("pair: %d repetitions" % config.pair_reps)
    for r in range(config.pair_reps):
        for k in keys[r % len(keys):] + keys[:r % len(keys)]:
            t0 = time.perf_counter()
            fns[k]()
            samples[k].append((time.perf_counter() - t0) * 1e3)
    progress.finish(1)
    med = {k: statistics.median(v) for k, v in samples.items()}
    return {"shape": list(config.pair_shape), "dtype": dtype, "reps": config.pair_reps,
            "median_ms": med, "samples_ms": {k: [round(t, 3) for t in v]
                                             for k, v in samples.items()},
            "seq_over_par": {i: med[i + "_seq"] / med[i + "_par"] for i in ("ours", "tf_fused")},
            "tf_over_ours": {o: med["tf_fused_" + o] / med["ours_" + o] for o in ("par", "seq")}}


def run_models(config=None, stream=None):
    """--model: every model of `config` (and the pair row), in this process. Returns
    {"meta": {...}, "models": [per model], "pair": {...} or None}."""
    config = config or ModelConfig()
    if config.policy not in POLICIES:
        raise ValueError("policy must be one of %s, got %r" % (", ".join(POLICIES),
                                                               config.policy))
    threads = configure_threads(config.threads)
    variants, na = selected_variants(config)
    for k in [v.key for v in variants]:
        fl = _VARIANTS[k].floor
        if fl and fl not in [v.key for v in variants]:
            na.setdefault(fl + " (needed by %s)" % k, "not selected: no cost column")
    bw = config.bandwidth_gbs
    bw_meas = None
    if bw is None:
        if config.progress:
            print("measuring memory bandwidth ...", file=stream or sys.stderr, flush=True)
        bw_meas = measure_bandwidth(threads, mib=config.bandwidth_mib)
        bw = bw_meas["bandwidth"]
    trace_units = _trace.window_count(config.trace_steps) if config.trace else 0
    units = (len(config.models) * (1 + len(variants) + config.reps + trace_units)
             + (2 if config.pair else 0))
    progress = Progress("model", [1] * units, stream=stream, enabled=config.progress,
                        unit="steps")
    meta = {"mode": "model", "tf_version": tf.__version__, "keras_version": _keras().__version__,
            "intra_op_threads": threads, "bandwidth_gbs": bw, "bandwidth": bw_meas,
            "variants": {v.key: {"header": v.header, "description": v.description,
                                 "floor": v.floor} for v in MODEL_VARIANTS},
            "not_available": na, "ratio_base": RATIO_BASE, "config": config.to_json()}
    logger = tf.get_logger()
    old_level = logger.level
    logger.setLevel("ERROR")
    results, pair = [], None
    try:
        with _Policy(config.policy):
            for name in config.models:
                results.append(run_one_model(name, config, variants, progress, bw))
            if config.pair:
                pair = run_pair(config, progress)
    finally:
        logger.setLevel(old_level)
        progress.close()
    return {"meta": meta, "models": results, "pair": pair}

