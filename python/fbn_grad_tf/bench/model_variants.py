"""--model's variants: the keras.applications model (or the tiny CNN) and its clones with every
BatchNormalization swapped (Keras 3 as built, TF fused, ours, ours converted) or made a
pass-through (the floors), the weights copied into every clone; the model's BN facts."""
import dataclasses
import importlib
import math
import os
from typing import Callable, Optional

import keras

#: A small model of our own (Conv-BN-ReLU x 3, GAP, Dense) for smoke tests: no download,
#: traces in seconds.
TINY = "tiny"


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
        "fbn_grad_tf.keras.convert is not in this build")


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


def is_user_model(name):
    """True for a model of the user's: a saved file ("path/to/model.keras", ".h5") or a
    factory ("package.module:function", called without arguments)."""
    return name.endswith((".keras", ".h5")) or ":" in name


class UserModelError(ValueError):
    """A model of the user's (--model path or module:factory) that the bench cannot run; the
    command line prints its message as an error, without a traceback."""


def _user_model(spec):
    keras = _keras()
    if spec.endswith((".keras", ".h5")):
        if not os.path.isfile(spec):
            raise UserModelError("--model %s: no such file" % spec)
        try:
            model = keras.models.load_model(spec, compile=False)
        except Exception as e:  # pylint: disable=broad-except
            raise UserModelError("--model %s: cannot load it as a Keras model (%s: %s)"
                                 % (spec, type(e).__name__, str(e).split("\n")[0])) from None
        policy = keras.mixed_precision.global_policy().name
        saved = sorted({layer.dtype_policy.name for layer in model.layers if _is_bn(layer)})
        if saved and saved != [policy]:
            raise UserModelError(
                "--model %s: its BatchNormalization layers were saved under the dtype policy "
                "%s, and a saved file keeps it; run it with --policy %s (this run: %s), or "
                "save the model under %s" % (spec, " and ".join(saved), saved[0], policy,
                                             policy))
    else:
        module, _, attr = spec.partition(":")
        try:
            factory = getattr(importlib.import_module(module), attr)
        except (ImportError, AttributeError) as e:
            raise UserModelError("--model %s: cannot import %s from %s (%s)"
                                 % (spec, attr, module, e)) from None
        try:
            model = factory()
        except Exception as e:  # pylint: disable=broad-except
            raise UserModelError("--model %s: the factory raised %s: %s"
                                 % (spec, type(e).__name__, str(e).split("\n")[0])) from None
    if not isinstance(model, keras.Model):
        raise UserModelError("--model %s: expected a keras.Model, got %s"
                             % (spec, type(model).__name__))
    if len(model.inputs) != 1 or len(model.outputs) != 1:
        raise UserModelError("--model %s: the bench feeds one input and one output (a classifier "
                         "trained with sparse categorical cross-entropy); this model has %d "
                         "and %d" % (spec, len(model.inputs), len(model.outputs)))
    if None in tuple(model.inputs[0].shape[1:]) or model.outputs[0].shape[-1] is None:
        raise UserModelError("--model %s: its input shape %s and output classes must be known "
                         "(build it with keras.Input of a fixed shape)"
                         % (spec, tuple(model.inputs[0].shape)))
    return model


def build_model(name, size, classes):
    """keras.applications.<name>(weights=None, input_shape=(size, size, 3), classes=classes),
    the TINY model, or a model of the user's (is_user_model: its own input shape and classes;
    size and classes do not apply), with dropout off (without_dropout). Under the global
    dtype policy in force (a saved file keeps the policies it was saved with)."""
    keras = _keras()
    if is_user_model(name):
        return without_dropout(_user_model(name))
    names = model_names()
    key = name.lower()
    if key not in names:
        raise ValueError("unknown model %r: one of %s (keras.applications), a .keras file or "
                         "module:factory" % (name, ", ".join(sorted(names))))
    if key == TINY:
        return _tiny_model(size, classes, keras)
    return without_dropout(getattr(keras.applications, names[key])(
        weights=None, input_shape=(size, size, 3), classes=classes))


def model_data_shapes(model, batch):
    """(input shape, number of classes) of the synthetic data for `model`."""
    return (batch,) + tuple(model.inputs[0].shape[1:]), int(model.outputs[0].shape[-1])


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

