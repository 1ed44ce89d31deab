"""--model: whole-model training steps of real keras.applications models.

    python -m fbn_grad_tf.bench --model resnet50                     # batch 16, 96x96, float32
    python -m fbn_grad_tf.bench --model resnet50,mobilenetv2,densenet121 --policy mixed_bfloat16
    python -m fbn_grad_tf.bench --model mobilenetv2 --reps 5 --json m.json
    python -m fbn_grad_tf.bench --model resnet50 --trace              # + sum of BN op times

Per model (``weights=None``, ``classes`` outputs, synthetic data), one process builds every
variant of MODEL_VARIANTS from the same model (same weights: the clones get the original's
weights, layer by layer): Keras 3 (the model as built), TF fused and ours (every
keras.layers.BatchNormalization swapped for fbn_grad_tf.keras.BatchNormalization: TF's ops,
or ours), and the floors (every BN an identity; also the activation layers right after a BN).
Each variant is compiled (SGD, sparse categorical cross-entropy, jit_compile=False) and its
training step is Keras' own ``model.train_step`` in a tf.function (what ``fit`` runs per
batch, without fit's iterator machinery). After warm-up (the first step traces; its loss is
checked against Keras 3's), one step of each variant is timed per repetition, the order
rotated every repetition, the loss fetched to the host (.numpy()) as the sync point.

Reported per variant: the median step; BN cost = step - floor's step of the same repetition
(median and interquartile range over repetitions); BN+activation cost = step - the floor
without BN and without those activations; BN's share of the step; ratios against ours with a
bootstrap 95% interval (repetitions resampled jointly); and per model its BN memory roofline:
elements over all BN layers x 8 tensor passes x itemsize / the measured bandwidth. The
"pair" row times two independent BN layers in one tf.function (TF may run them at once)
against the same two forced into sequence (control dependencies), ours and TF fused.

With --trace (off by default; --trace-steps N, default 5) a second, far less noisy estimate
of BN's cost follows the timed repetitions: N more steps of each BN variant (not the floors),
interleaved the same way, under the TF profiler, and per step the sum of the durations of the
ops in BN layers' name scopes (forward and gradient: TF's FusedBatchNorm ops, ours, Keras 3's
unfused ops, the moving-average updates), the BN kernels alone (by op type), and BN+act (plus
the ops of the activation layers after a BN and of the layers convert absorbs). Reported
beside step - floor as "sum of BN op times (trace)": median [IQR] and the ratio to TF fused
with a bootstrap interval. Ops that run at once overlap, so a sum of op times is not wall
time; the profiler's overhead (profiled / unprofiled step) is printed. Details: trace.py.
"""
import dataclasses
import math
import os
import statistics
import sys
import time
from typing import Callable, Optional, Tuple

import keras
import numpy as np
import tensorflow as tf

from . import trace as _trace
from .cases import CorrectnessError, shape_str
from .timing import Progress, _fmt_duration, configure_threads, measure_bandwidth

POLICIES = ("float32", "mixed_bfloat16", "mixed_float16")
#: Bytes per element of the tensors BN reads and writes under each policy (compute dtype).
POLICY_ITEMSIZE = {"float32": 4, "mixed_bfloat16": 2, "mixed_float16": 2}
#: Tensor passes of one BN training step over its activations: forward reads x for the
#: statistics, reads x again and writes y; backward reads dy and x for the reductions, reads
#: them again and writes dx (3 + 5).
BN_PASSES = 8
#: A small model of our own (Conv-BN-ReLU x 3, GAP, Dense) for smoke tests: no download,
#: traces in seconds.
TINY = "tiny"
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


# ---- the variants ----------------------------------------------------------------------------

def _keras():
    import keras
    return keras


def _is_bn(layer):
    """A Keras BatchNormalization (ours included: it subclasses it)."""
    return isinstance(layer, _keras().layers.BatchNormalization)


def _activation_types():
    keras = _keras()
    return (keras.layers.Activation, keras.layers.ReLU)


def _producer(layer):
    """The layer whose output is `layer`'s only input, or None (several inputs, several
    calls, or a Keras without this internal)."""
    try:
        if len(layer._inbound_nodes) != 1:
            return None
        inp = layer.input
        if isinstance(inp, (list, tuple)):
            return None
        return inp._keras_history[0]
    except (AttributeError, IndexError, ValueError, TypeError):
        return None


def activations_after_bn(model):
    """Names of the activation layers (Activation, ReLU) whose input is a BN layer's output."""
    acts = _activation_types()
    return {layer.name for layer in model.layers
            if isinstance(layer, acts) and _is_bn(_producer(layer) or object())}


class PassThrough(keras.layers.Layer):
    """The floors' stand-in for a BN or activation layer: returns its input (and accepts the
    training/mask arguments a BN layer is called with, which keras.layers.Identity does not)."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.supports_masking = True

    def call(self, inputs, training=None, mask=None):
        return inputs

    def compute_output_shape(self, input_shape):
        return input_shape


def _identity(layer):
    return PassThrough(name=layer.name, dtype=layer.dtype_policy)


def _ours_bn(layer, configure=None):
    from ..keras import BatchNormalization
    new = BatchNormalization.from_config(layer.get_config())
    if configure is not None:
        configure(new)
    return new


def _tf_ops(layer):
    layer.forward_op = "tensorflow"
    layer.gradient_op = "tensorflow"


def _copy_weights(src, dst):
    """Copies every layer's weights (BN moving statistics included) from `src` to the layer
    of the same name in `dst` where both have the same number of weights. Returns the number
    of layers copied."""
    n = 0
    for layer in dst.layers:
        try:
            old = src.get_layer(layer.name)
        except ValueError:
            continue
        w = old.get_weights()
        if w and len(w) == len(layer.get_weights()):
            layer.set_weights(w)
            n += 1
    return n


def _clone(model, replace):
    """keras.models.clone_model with `replace(layer)` (a new layer or None: a fresh copy of
    the same config), then the original's weights copied."""
    keras = _keras()

    def clone_function(layer):
        new = replace(layer)
        return new if new is not None else layer.__class__.from_config(layer.get_config())

    clone = keras.models.clone_model(model, clone_function=clone_function)
    _copy_weights(model, clone)
    return clone


def _build_keras(model):
    return model


def _build_ours(model):
    return _clone(model, lambda layer: _ours_bn(layer) if _is_bn(layer) else None)


def _build_tf_fused(model):
    return _clone(model, lambda layer: _ours_bn(layer, _tf_ops) if _is_bn(layer) else None)


def _build_floor(model):
    return _clone(model, lambda layer: _identity(layer) if _is_bn(layer) else None)


def _build_floor_act(model):
    acts = activations_after_bn(model)
    return _clone(model, lambda layer: _identity(layer)
                  if _is_bn(layer) or layer.name in acts else None)


def _convert_fn():
    from .. import keras as fbn_keras
    return getattr(fbn_keras, "convert", None)


def _convert_available():
    return None if callable(_convert_fn()) else (
        "fbn_grad_tf.keras.convert is not in this build (issue 20)")


def _build_converted(model):
    clone = _clone(model, lambda layer: None)
    return _convert_fn()(clone)


def _always():
    return None


@dataclasses.dataclass(frozen=True)
class ModelVariant:
    """One column of --model. build(model) returns the variant (a clone, or the model
    itself); floor: the floor variant its cost is measured against (None: it is a floor);
    available() returns why it is n/a, or None."""
    key: str
    header: str
    description: str
    build: Callable
    floor: Optional[str] = None
    available: Callable = _always


#: The --model variants in table order. A later variant plugs in here (and the table, JSON
#: and ratios pick it up): its cost is step - the step of its `floor`, besides the BN+act cost
#: every non-floor variant has (step - floor_act).
MODEL_VARIANTS = (
    ModelVariant("keras", "Keras 3", "the keras.applications model as built "
                 "(keras.layers.BatchNormalization: plain TF ops, Keras' gradient)",
                 _build_keras, floor="floor"),
    ModelVariant("tf_fused", "TF fused", "every BN -> fbn_grad_tf.keras.BatchNormalization with "
                 "forward_op = gradient_op = 'tensorflow' (TF's FusedBatchNormV3 and its "
                 "FusedBatchNormGradV3)", _build_tf_fused, floor="floor"),
    ModelVariant("ours", "ours", "every BN -> fbn_grad_tf.keras.BatchNormalization (our forward "
                 "and backward ops)", _build_ours, floor="floor"),
    ModelVariant("ours_converted", "ours conv", "fbn_grad_tf.keras.convert(model): BN and the "
                 "activation after it fused in our ops", _build_converted, floor="floor_act",
                 available=_convert_available),
    ModelVariant("floor", "floor", "every BN -> a pass-through layer: the step without BN",
                 _build_floor),
    ModelVariant("floor_act", "floor-act", "every BN and every Activation/ReLU layer right "
                 "after a BN -> a pass-through layer", _build_floor_act),
)
MODEL_VARIANT_KEYS = tuple(v.key for v in MODEL_VARIANTS)
_VARIANTS = {v.key: v for v in MODEL_VARIANTS}
#: The variant every ratio divides by.
RATIO_BASE = "ours"


def model_names():
    """Lower-case name -> keras.applications constructor name, plus TINY."""
    apps = _keras().applications
    names = {n.lower(): n for n in dir(apps) if n[:1].isupper() and callable(getattr(apps, n))}
    names[TINY] = TINY
    return names


def _tiny_model(size, classes, keras):
    inp = keras.Input((size, size, 3))
    x = inp
    for i, ch in enumerate((8, 16, 16)):
        x = keras.layers.Conv2D(ch, 3, strides=2 if i else 1, padding="same", use_bias=False,
                                name="conv%d" % i)(x)
        x = keras.layers.BatchNormalization(name="bn%d" % i)(x)
        x = keras.layers.Activation("relu", name="relu%d" % i)(x)
    x = keras.layers.GlobalAveragePooling2D()(x)
    out = keras.layers.Dense(classes, activation="softmax", dtype="float32", name="predictions")(x)
    return keras.Model(inp, out, name="tiny")


def without_dropout(model):
    """`model`, or a clone of it whose Dropout layers (and subclasses) have rate 0 if it has
    any with a rate above 0. The variants of a model are clones, and each clone's Dropout
    layers draw their own random masks, so with dropout the variants' first losses differ
    by far more than the loss check allows (EfficientNetB0: 20%); at rate 0 a Dropout layer
    passes its input through."""
    keras = _keras()
    if not any(isinstance(layer, keras.layers.Dropout) and layer.rate > 0
               for layer in model.layers):
        return model

    def clone_function(layer):
        config = layer.get_config()
        if isinstance(layer, keras.layers.Dropout):
            config["rate"] = 0.0
        return layer.__class__.from_config(config)

    return keras.models.clone_model(model, clone_function=clone_function)


def build_model(name, size, classes):
    """keras.applications.<name>(weights=None, input_shape=(size, size, 3), classes=classes),
    or the TINY model, with dropout off (without_dropout). Under the global dtype policy in
    force."""
    keras = _keras()
    names = model_names()
    key = name.lower()
    if key not in names:
        raise ValueError("unknown model %r: one of %s (keras.applications)" % (
            name, ", ".join(sorted(names))))
    if key == TINY:
        return _tiny_model(size, classes, keras)
    return without_dropout(getattr(keras.applications, names[key])(
        weights=None, input_shape=(size, size, 3), classes=classes))


def bn_facts(model, batch):
    """BN layers, their elements per step (batch x output shape, summed over every BN layer)
    and the activations right after a BN."""
    bns = [layer for layer in model.layers if _is_bn(layer)]
    elements = sum(batch * math.prod(layer.output.shape[1:]) for layer in bns)
    return {"bn_layers": len(bns), "bn_elements": int(elements),
            "activations_after_bn": len(activations_after_bn(model))}


def _fused_path_layers(model):
    """How many of our BN layers take the fused path (the others fall back to Keras)."""
    n = 0
    for layer in model.layers:
        if hasattr(layer, "fused_data_format") and layer.fused_data_format(
                tuple(layer.input.shape), layer.compute_dtype) is not None:
            n += 1
    return n


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


def selected_variants(config):
    """(variants to run, key -> why n/a for the others)."""
    keys = config.variants or MODEL_VARIANT_KEYS
    bad = [k for k in keys if k not in _VARIANTS]
    if bad:
        raise ValueError("unknown variant(s) %s: %s" % (bad, ", ".join(MODEL_VARIANT_KEYS)))
    run, why = [], {}
    for v in MODEL_VARIANTS:
        if v.key not in keys:
            continue
        reason = v.available()
        if reason:
            why[v.key] = reason
        else:
            run.append(v)
    return run, why


# ---- statistics --------------------------------------------------------------------------------

def _quartiles(vals):
    a = np.asarray(vals, np.float64)
    q1, med, q3 = np.percentile(a, [25, 50, 75])
    return {"median_ms": float(med), "q25_ms": float(q1), "q75_ms": float(q3),
            "iqr_ms": float(q3 - q1)}


def _bootstrap_ratio(num, den, resamples, rng):
    """(median(num)/median(den), 2.5th and 97.5th percentile over `resamples` resamplings of
    the repetitions, the same indices for both: pairs stay pairs)."""
    num, den = np.asarray(num, np.float64), np.asarray(den, np.float64)
    point = float(np.median(num) / np.median(den)) if np.median(den) > 0 else None
    if point is None or len(num) < 2 or resamples < 1:
        return point, None, None
    idx = rng.integers(0, len(num), (resamples, len(num)))
    d = np.median(den[idx], axis=1)
    r = np.median(num[idx], axis=1)[d > 0] / d[d > 0]
    if not len(r):
        return point, None, None
    lo, hi = np.percentile(r, [2.5, 97.5])
    return point, float(lo), float(hi)


def model_stats(samples_ms, variants, config):
    """Per variant: step quartiles, cost vs its floor and vs floor_act (per-repetition
    differences), BN share, and ratios against RATIO_BASE (step and cost, bootstrap 95%)."""
    rng = np.random.default_rng(config.seed)
    out = {}
    for v in variants:
        s = samples_ms[v.key]
        e = {"step": _quartiles(s), "samples_ms": [round(t, 3) for t in s]}
        for name, floor in (("cost", v.floor), ("cost_act", "floor_act" if v.floor else None)):
            if floor and floor in samples_ms:
                diff = [a - b for a, b in zip(s, samples_ms[floor])]
                e[name] = _quartiles(diff)
                e[name]["samples_ms"] = [round(t, 3) for t in diff]
                e[name]["floor"] = floor
        if "cost" in e:
            e["share"] = e["cost"]["median_ms"] / e["step"]["median_ms"]
        out[v.key] = e
    base = out.get(RATIO_BASE)
    for k, e in out.items():
        if base is None or k == RATIO_BASE:
            continue
        e["x_step"] = _bootstrap_ratio(samples_ms[k], samples_ms[RATIO_BASE], config.bootstrap,
                                       rng)
        for name in ("cost", "cost_act"):
            # only costs against the same floor compare (ours conv's cost is against floor_act)
            if name in e and name in base and e[name]["floor"] == base[name]["floor"]:
                e["x_" + name] = _bootstrap_ratio(e[name]["samples_ms"],
                                                  base[name]["samples_ms"], config.bootstrap, rng)
    return out


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
        raise ValueError("%s has no BatchNormalization layer" % name)
    models = {}
    for v in variants:
        models[v.key] = _compile(v.build(base), config)
    if "ours" in models:
        facts["fused_path_layers"] = _fused_path_layers(models["ours"])
    scopes = _trace_scopes(base, models) if config.trace else None
    x = tf.random.stateless_uniform([config.batch, config.size, config.size, 3],
                                    [config.seed, 1], 0.0, 1.0)
    y = tf.random.stateless_uniform([config.batch], [config.seed, 2], 0, config.classes,
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


# ---- --trace: the sum of BN op times in a profiler trace (trace.py) --------------------------

#: The variant the trace's ratios divide by: the question the trace answers is ours against
#: TF's fused ops (issue 19: ours / TF fused, lower is better).
TRACE_RATIO_BASE = "tf_fused"


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
    progress.start("%s: profiler trace of %d steps x %d BN variants (sum of BN op times)"
                   % (name, config.trace_steps, len(keys)))
    t0 = time.perf_counter()
    space, wall, timing = _trace.record(steps, keys, config.trace_steps)
    progress.finish(1)
    progress.start("%s: reading the trace (%.1f MB)" % (name, timing["xplane_bytes"] / 1e6))
    traced_steps, nested = _trace.step_ops(space)
    space = None
    sums = _trace.per_variant_sums(traced_steps, keys, scopes["bn"], scopes["act"])
    progress.finish(1)
    stats = trace_stats(sums, wall, samples, config, {v.key: v.floor for v in variants})
    found = sorted({t for e in stats.values() for t in e["op_types"]})
    return {"variants": stats, "steps_per_variant": config.trace_steps,
            "host_tracer_level": _trace.HOST_TRACER_LEVEL, "ratio_base": TRACE_RATIO_BASE,
            "bn_layers": sorted(scopes["bn"]), "act_layers": sorted(scopes["act"]),
            "op_types_counted": found, "nested_op_events": nested,
            "xplane_bytes": timing["xplane_bytes"],
            "profiler_start_s": round(timing["start_s"], 3),
            "profiler_stop_s": round(timing["stop_s"], 3),
            "wall_s": round(time.perf_counter() - t0, 2)}


def _type_medians(per_step):
    """{op type: {"ms": median ms per step, "count": median count per step}} over steps (a
    type missing from a step counts as 0 there)."""
    types = sorted({t for d in per_step for t in d})
    return {t: {"ms": float(np.median([d.get(t, (0.0, 0))[0] for d in per_step])),
                "count": float(np.median([d.get(t, (0.0, 0))[1] for d in per_step]))}
            for t in types}


def trace_stats(sums, wall, samples, config, floors):
    """Per traced variant: quartiles and samples of bn_ops, bn_act_ops and bn_kernels (ms
    per step), the op types counted (median ms and count per step), the traced steps' wall
    time and its ratio to the untraced steps' median (the profiler's overhead), and x_bn_ops,
    x_bn_act_ops: that variant / TRACE_RATIO_BASE, bootstrap 95% (traced repetitions
    resampled jointly, as the timed ones). x_bn_ops only where the variant's floor is the
    base's (`floors`: key -> floor), as for the step-difference costs: ours conv's BN ops
    include the activation fused into them, so only its BN+act sum compares."""
    rng = np.random.default_rng(config.seed + 1)
    out = {}
    for k, per_step in sums.items():
        if not per_step:
            raise RuntimeError("the profiler trace has no step of %s" % k)
        e = {}
        for what in ("bn_ops", "bn_act_ops", "bn_kernels"):
            vals = [d[what] for d in per_step]
            e[what] = _quartiles(vals)
            e[what]["samples_ms"] = [round(v, 4) for v in vals]
        e["op_types"] = _type_medians([d["types"] for d in per_step])
        e["act_op_types"] = _type_medians([d["act_types"] for d in per_step])
        e["traced_step"] = _quartiles(wall[k])
        e["traced_step"]["samples_ms"] = [round(v, 3) for v in wall[k]]
        timed = statistics.median(samples[k]) if samples.get(k) else None
        e["overhead"] = e["traced_step"]["median_ms"] / timed if timed else None
        out[k] = e
    base = out.get(TRACE_RATIO_BASE)
    for k, e in out.items():
        if base is None or k == TRACE_RATIO_BASE:
            continue
        for what in ("bn_ops", "bn_act_ops"):
            if what == "bn_ops" and floors.get(k) != floors.get(TRACE_RATIO_BASE):
                continue
            e["x_" + what] = _bootstrap_ratio(e[what]["samples_ms"], base[what]["samples_ms"],
                                              config.bootstrap, rng)
    return out


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
    units = (len(config.models) * (1 + len(variants) + config.reps + (2 if config.trace else 0))
             + (2 if config.pair else 0))
    progress = Progress("model", [1] * units, stream=stream, enabled=config.progress)
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


# ---- report --------------------------------------------------------------------------------

def _f(v, fmt="%.1f", na="n/a"):
    return na if v is None else fmt % v


def _x(r):
    """'1.23x [1.10..1.35]' from a (point, lo, hi) ratio."""
    if not r or r[0] is None:
        return "n/a"
    if r[1] is None:
        return "%.2fx" % r[0]
    return "%.2fx [%.2f..%.2f]" % r


def format_model_block(res, meta):
    """One model: a header line (BN layers, elements, roofline) and a row per variant."""
    rf = res["roofline"]
    head = ("%s  batch %d, %dx%d, %s: %d BN layers%s, %.1fM BN elements per step, %d "
            "activations after BN; BN roofline %.3g GB (%d passes x %d B) = %s ms at %s GB/s" % (
                res["model"], res["batch"], res["size"], res["size"], res["policy"],
                res["bn_layers"], (" (%d on our fused path)" % res["fused_path_layers"])
                if "fused_path_layers" in res else "", res["bn_elements"] / 1e6,
                res["activations_after_bn"], rf["bytes"] / 1e9, rf["passes"], rf["itemsize"],
                _f(rf["ms"], "%.3g"), _f(rf["bandwidth_gbs"])))
    traced = "trace" in res
    cols = [("variant", "<", 10), ("step ms", ">", 8), ("x step", ">", 18),
            ("BN cost ms [IQR]", ">", 21), ("x BN cost", ">", 18)]
    if traced:
        cols += [("BN op sum ms [IQR]", ">", 23), ("op sum / TF fused", ">", 18)]
    cols += [("BN share", ">", 8), ("BN+act ms [IQR]", ">", 21), ("x BN+act", ">", 18)]
    if traced:
        cols += [("BN+act op sum [IQR]", ">", 23), ("op sum / TF fused", ">", 18)]
    cols += [("trace s", ">", 7)]

    def line(vals):
        return "  ".join(("{:%s%d}" % (a, w)).format(v) for (_, a, w), v in zip(cols, vals))

    out = [head, line([c[0] for c in cols]), line(["-" * c[2] for c in cols])]
    for k in MODEL_VARIANT_KEYS:
        e = res["variants"].get(k)
        if e is None:
            continue

        def cost(name, d=e, fmt="%.1f [%.1f..%.1f]"):
            c = d.get(name)
            return "n/a" if c is None else fmt % (c["median_ms"], c["q25_ms"], c["q75_ms"])

        tr = e.get("trace")

        def ops(name):
            if tr is None:
                return ["n/a", "n/a"]
            return [cost(name, tr, "%.2f [%.2f..%.2f]"), "base" if k == TRACE_RATIO_BASE
                    else _x(tr.get("x_" + name))]

        vals = [meta["variants"][k]["header"], _f(e["step"]["median_ms"]),
                "base" if k == RATIO_BASE else _x(e.get("x_step")), cost("cost"),
                "base" if k == RATIO_BASE and "cost" in e else _x(e.get("x_cost"))]
        if traced:
            vals += ops("bn_ops")
        vals += [_f(e.get("share") and 100 * e["share"], "%.0f%%"), cost("cost_act"),
                 "base" if k == RATIO_BASE and "cost_act" in e else _x(e.get("x_cost_act"))]
        if traced:
            vals += ops("bn_act_ops")
        vals += [_f(res["trace_s"].get(k), "%.0f")]
        out.append(line(vals))
    if traced:
        out.append(format_trace_notes(res, meta))
    return "\n".join(out)


def _types_text(types, show=6):
    """'SquaredDifference 0.31 ms/53, Tile 0.20 ms/53, ... + 4 more 0.02 ms' (median ms and
    ops per step), largest first."""
    items = sorted(types.items(), key=lambda kv: -kv[1]["ms"])
    text = ", ".join("%s %.2f ms/%d" % (t, d["ms"], round(d["count"])) for t, d in items[:show])
    if len(items) > show:
        text += ", + %d more %.2f ms" % (len(items) - show, sum(d["ms"] for _, d in items[show:]))
    return text or "none"


def format_trace_notes(res, meta):
    """The lines under a traced model's table: what the trace columns are, the profiler's
    overhead, the BN kernels' share, and the op types counted per variant."""
    t = res["trace"]
    v = {k: e["trace"] for k, e in res["variants"].items() if "trace" in e}

    def hdr(k):
        return meta["variants"][k]["header"]

    out = ["BN op sum, BN+act op sum = sum of BN op times (trace): op durations summed per step "
           "over %d profiled steps per BN variant, median [IQR]; not step - floor (ops that run "
           "at once overlap: a sum of op times is not wall time); op sum / TF fused = that "
           "variant's / TF fused's (<1: less BN op time than TF fused), bootstrap 95%%; ours "
           "conv's BN op sum holds the activation fused into its ops, so only its BN+act op sum "
           "is compared" % t["steps_per_variant"],
           "  profiled step / unprofiled step (the profiler's overhead): " + ", ".join(
               "%s %s" % (hdr(k), _f(e["overhead"], "%.2fx")) for k, e in v.items()),
           "  BN kernels alone (op types FusedBatchNorm*, FbnGrad>*) ms: " + ", ".join(
               "%s %.2f" % (hdr(k), e["bn_kernels"]["median_ms"]) for k, e in v.items()),
           "  op types counted in BN layers' scopes (median ms / ops per step):"]
    for k, e in v.items():
        out.append("    %-10s %s" % (hdr(k), _types_text(e["op_types"])))
    out.append("  + in BN+act, the activation/Add layers' scopes (%d layers):"
               % len(t["act_layers"]))
    for k, e in v.items():
        out.append("    %-10s %s" % (hdr(k), _types_text(e["act_op_types"])))
    return "\n".join(out)


def summarize_models(results):
    """One row per model: the headline figures (None where a variant did not run)."""
    rows = []
    for res in results:
        v = res["variants"]

        def get(k, *path):
            d = v.get(k)
            for p in path:
                if d is None:
                    return None
                d = d.get(p) if isinstance(d, dict) else None
            return d

        ours_cost = get("ours", "cost", "median_ms")
        rf = res["roofline"]["ms"]
        rows.append({
            "model": res["model"], "policy": res["policy"], "batch": res["batch"],
            "size": res["size"],
            "step_ms": {k: get(k, "step", "median_ms") for k in v},
            "bn_cost_ms": {k: get(k, "cost", "median_ms") for k in v if get(k, "cost")},
            "bn_cost_iqr_ms": {k: get(k, "cost", "iqr_ms") for k in v if get(k, "cost")},
            "step_tf_over_ours": (v.get("tf_fused") or {}).get("x_step"),
            "step_keras_over_ours": (v.get("keras") or {}).get("x_step"),
            "cost_tf_over_ours": (v.get("tf_fused") or {}).get("x_cost"),
            "cost_keras_over_ours": (v.get("keras") or {}).get("x_cost"),
            "bn_share": {k: get(k, "share") for k in v if get(k, "share") is not None},
            "roofline_ms": rf,
            "ours_cost_over_roofline": ours_cost / rf if ours_cost and rf else None})
        if "trace" in res:
            rows[-1].update({
                "trace_bn_ops_ms": {k: get(k, "trace", "bn_ops", "median_ms")
                                    for k in v if get(k, "trace")},
                "trace_bn_act_ops_ms": {k: get(k, "trace", "bn_act_ops", "median_ms")
                                        for k in v if get(k, "trace")},
                "trace_ours_over_tf_bn_ops": get("ours", "trace", "x_bn_ops"),
                "trace_conv_over_tf_bn_act_ops": get("ours_converted", "trace", "x_bn_act_ops")})
    return rows


def format_model_summary(rows):
    cols = [("model", "<", 14), ("policy", "<", 14), ("ours ms", ">", 8),
            ("TF/ours step", ">", 12), ("Keras/ours step", ">", 15), ("TF/ours BN", ">", 10),
            ("Keras/ours BN", ">", 13), ("BN % TF", ">", 7), ("BN % Keras", ">", 10),
            ("BN % ours", ">", 9), ("roofline ms", ">", 11), ("ours/roof", ">", 9)]
    traced = any("trace_bn_ops_ms" in r for r in rows)
    if traced:
        cols += [("ours/TF BN ops (trace)", ">", 22), ("conv/TF BN+act ops", ">", 18)]

    def line(vals):
        return "  ".join(("{:%s%d}" % (a, w)).format(v) for (_, a, w), v in zip(cols, vals))

    def pt(r):
        return _f(r and r[0], "%.2fx")

    def pct(d, k):
        return _f(d.get(k) and 100 * d[k], "%.0f%%")

    out = [line([c[0] for c in cols]), line(["-" * c[2] for c in cols])]
    for r in rows:
        out.append(line([r["model"], r["policy"], _f(r["step_ms"].get("ours")),
                         pt(r["step_tf_over_ours"]), pt(r["step_keras_over_ours"]),
                         pt(r["cost_tf_over_ours"]), pt(r["cost_keras_over_ours"]),
                         pct(r["bn_share"], "tf_fused"), pct(r["bn_share"], "keras"),
                         pct(r["bn_share"], "ours"), _f(r["roofline_ms"]),
                         _f(r["ours_cost_over_roofline"], "%.2fx")]
                        + ([_x(r.get("trace_ours_over_tf_bn_ops")),
                            _x(r.get("trace_conv_over_tf_bn_act_ops"))] if traced else [])))
    return "\n".join(out)


def format_pair(pair):
    m = pair["median_ms"]
    return ("pair: two independent BN layers (each forward + backward, %s %s) in one tf.function, "
            "%d reps:\n"
            "  ours:     at once %.2f ms, in sequence %.2f ms, sequence/at once %.2fx\n"
            "  TF fused: at once %.2f ms, in sequence %.2f ms, sequence/at once %.2fx\n"
            "  TF fused/ours: at once %.2fx, in sequence %.2fx" % (
                shape_str(pair["shape"]), pair["dtype"], pair["reps"], m["ours_par"],
                m["ours_seq"], pair["seq_over_par"]["ours"], m["tf_fused_par"],
                m["tf_fused_seq"], pair["seq_over_par"]["tf_fused"], pair["tf_over_ours"]["par"],
                pair["tf_over_ours"]["seq"]))


def model_legend(meta):
    lines = ["times: ms of one training step (Keras' train_step in a tf.function, SGD, "
             "jit_compile=False), median over repetitions; variants interleaved, order rotated "
             "per repetition"]
    for v in MODEL_VARIANTS:
        lines.append("  %-10s = %s%s" % (v.header, v.description, (
            "  [n/a: %s]" % meta["not_available"][v.key])
            if v.key in meta["not_available"] else ""))
    lines += [
        "x step = that variant's step / ours (>1: ours faster) [bootstrap 95% interval]",
        "BN cost = step - floor's step of the same repetition: median [25th..75th percentile]; "
        "x BN cost = its median / ours (bootstrap 95% interval)",
        "BN share = BN cost / step; BN+act = step - floor-act's step (BN and the activation "
        "after it); roofline = BN elements x %d passes x itemsize / bandwidth" % BN_PASSES]
    if meta["config"].get("trace"):
        lines += [
            "--trace: BN op sum = sum of BN op times (trace): %d extra steps per BN variant "
            "under the TF profiler, the durations of the ops in BN layers' name scopes (forward "
            "and gradient) summed per step; BN+act op sum adds the activation (and absorbed "
            "Add) layers' ops; op sum / TF fused = variant / TF fused (<1: less BN op time); "
            "'trace s' is tf.function tracing, not this" % meta["config"]["trace_steps"]]
    return "\n".join(lines)


def main_model(args):
    """The --model command: header, per-model blocks, summary, pair row; --json."""
    import json
    from .timing import _loadavg, _machine_meta
    config = model_config_from_args(args)
    t0 = time.perf_counter()
    load_start = _loadavg()
    if load_start is not None and load_start > 0.75 * (os.cpu_count() or 1):
        print("warning: load average %.1f on %d cores: other work is running, the times will "
              "be noisy (see `ps aux`)" % (load_start, os.cpu_count() or 1), file=sys.stderr)
    res = run_models(config)
    summary = summarize_models(res["models"])
    elapsed = time.perf_counter() - t0
    meta = _machine_meta()
    meta.update(res["meta"])
    meta.update({"elapsed_s": round(elapsed, 1), "loadavg_1min_start": load_start,
                 "loadavg_1min_end": _loadavg()})
    print("fbn_grad_tf benchmark --model: %s, %d cores, TF %s, Keras %s, %d intra-op threads; "
          "ISA %s; bandwidth %.1f GB/s%s" % (
              meta["cpu"], meta["cores"], meta["tf_version"], meta["keras_version"],
              meta["intra_op_threads"], meta["fbn_grad_tf_isa"], meta["bandwidth_gbs"],
              " (given)" if config.bandwidth_gbs else " (measured)"))
    if load_start is not None:
        print("load average (1 min) at start %.2f, at end %.2f on %d cores"
              % (load_start, meta["loadavg_1min_end"], meta["cores"]))
    print("%d repetitions, %d warm-up steps per variant, %d classes, synthetic data"
          % (config.reps, config.warmup, config.classes))
    print(model_legend(meta))
    for r in res["models"]:
        print()
        print(format_model_block(r, meta))
    print()
    print("Summary (ratios: their step or BN cost / ours; BN %%: BN cost / that variant's "
          "step%s):" % ("; trace: ours or ours conv / TF fused" if config.trace else ""))
    print(format_model_summary(summary))
    if res["pair"]:
        print()
        print(format_pair(res["pair"]))
    na = meta["not_available"]
    if na:
        print()
        print("n/a:")
        for k, why in na.items():
            print("  %s: %s" % (_VARIANTS[k].header if k in _VARIANTS else k, why))
    print()
    print("elapsed %s" % _fmt_duration(elapsed))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"meta": meta, "summary": summary, "models": res["models"],
                       "pair": res["pair"]}, f, indent=1)
    return 0


def model_config_from_args(args):
    cfg = ModelConfig()
    cfg.models = tuple(m.strip() for m in args.model.split(",") if m.strip())
    known = model_names()
    bad = [m for m in cfg.models if m.lower() not in known]
    if bad or not cfg.models:
        raise SystemExit("--model: unknown model(s) %s; one of: %s" % (
            ", ".join(bad) or "(none)", ", ".join(sorted(known))))
    for field, val in (("batch", args.batch), ("size", args.size), ("policy", args.policy),
                       ("reps", args.reps), ("threads", args.threads),
                       ("warmup", args.model_warmup), ("classes", args.classes),
                       ("bandwidth_gbs", args.bandwidth), ("bandwidth_mib", args.bandwidth_mib),
                       ("pair_reps", args.pair_reps), ("trace_steps", args.trace_steps)):
        if val is not None:
            setattr(cfg, field, val)
    if args.variants:
        cfg.variants = tuple(v.strip() for v in args.variants.split(",") if v.strip())
        try:
            selected_variants(cfg)
        except ValueError as e:
            raise SystemExit("--variants: %s" % e) from None
    if args.no_pair:
        cfg.pair = False
    if args.trace or args.trace_steps is not None:
        cfg.trace = True
    if cfg.trace_steps < 1:
        raise SystemExit("--trace-steps must be at least 1")
    if args.pair_shape:
        cfg.pair_shape = args.pair_shape
    if args.no_progress:
        cfg.progress = False
    return cfg
