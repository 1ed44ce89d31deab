"""``fbn_grad_tf.keras.convert``: an existing functional or Sequential Keras 3 model, rebuilt
with fbn_grad_tf's BatchNormalization (and, with ``fuse=True``, the activation after each BN
fused into it where our op supports that activation).

The model's graph is walked node by node (Keras' own ``Functional`` graph, as
``keras.models.clone_model`` does) and every layer is re-created from its config; the
weights are then copied layer by layer, so names, configs and weights (moving statistics
included) are those of the original. What is matched is the *pattern table* below: a BN
whose only consumer is an activation layer, or a residual ``Add`` followed by an activation.
What is fused is what ``fbn_grad_tf.nn.FUSED_ACTIVATIONS`` (and, for the residual pattern,
``FUSED_SIDE_INPUT_ACTIVATIONS``) lists (relu, relu6, swish, with or without the side input);
when the C++ ops learn another activation,
extending those lists is all convert needs.
"""
import dataclasses
import warnings

import keras

from . import nn as _nn
from ._keras_layer import BatchNormalization as _FbnBN

__all__ = ["convert", "ConvertReport"]

# ---- the pattern table ----------------------------------------------------------------------

#: (name, activation function) of the activations an ``Activation`` layer can be matched to.
#: "swish" is Keras' silu (keras.activations.swish is the same function).
_ACTIVATION_FUNCTIONS = (
    ("relu", keras.activations.relu),
    ("relu6", keras.activations.relu6),
    ("swish", keras.activations.silu),
)


def _activation_of(layer):
    """(name, None) if `layer` is an activation layer with a name in the pattern table
    ("relu", "relu6", "swish"); (None, reason) for another activation layer (reason says why
    it has no fused form); (None, None) for any other layer."""
    if type(layer) is keras.layers.ReLU:  # pylint: disable=unidiomatic-typecheck
        cfg = layer.get_config()
        max_value = cfg.get("max_value")
        if cfg.get("negative_slope", 0.0) == 0.0 and cfg.get("threshold", 0.0) == 0.0:
            if max_value is None:
                return "relu", None
            if float(max_value) == 6.0:
                return "relu6", None
        return None, ("ReLU(max_value=%r, negative_slope=%r, threshold=%r) has no fused form"
                      % (max_value, cfg.get("negative_slope"), cfg.get("threshold")))
    if type(layer) is keras.layers.Activation:  # pylint: disable=unidiomatic-typecheck
        for name, fn in _ACTIVATION_FUNCTIONS:
            if layer.activation is fn:
                return name, None
        name = getattr(layer.activation, "__name__", repr(layer.activation))
        return None, "activation %s has no fused form" % name
    return None, None


@dataclasses.dataclass(frozen=True)
class _Pattern:
    """A BN followed by layers that fbn_grad_tf's layer can absorb.

    name: for the report. side_input: the BN's output goes through a 2-input ``Add`` first
    (y = act(bn(x) + other)), which needs the op's side input. supported: the activations the
    fused op supports for this pattern (read from fbn_grad_tf.nn when convert runs)."""
    name: str
    side_input: bool

    def supported(self):
        return (_nn.FUSED_SIDE_INPUT_ACTIVATIONS if self.side_input
                else _nn.FUSED_ACTIVATIONS)


_BN_ACT = _Pattern("BN+activation", side_input=False)
_BN_ADD_ACT = _Pattern("BN+Add+activation", side_input=True)
PATTERNS = (_BN_ACT, _BN_ADD_ACT)


# ---- the report -----------------------------------------------------------------------------

@dataclasses.dataclass
class ConvertReport:
    """What ``convert`` did.

    replaced: names of the keras.layers.BatchNormalization layers that are now fbn_grad_tf's.
    fused: (BN name, names of the removed layers, activation) for each fusion.
    not_fused: (BN name, pattern, reason) for each matched pattern left unfused.
    not_converted: (layer name, reason) for each BatchNormalization convert could not replace
      (they keep Keras' implementation).
    shared: (layer name, reason) for layers that could not be re-created from their config and
      are the original instances, shared with the original model.
    """
    model: str = ""
    replaced: list = dataclasses.field(default_factory=list)
    fused: list = dataclasses.field(default_factory=list)
    not_fused: list = dataclasses.field(default_factory=list)
    not_converted: list = dataclasses.field(default_factory=list)
    shared: list = dataclasses.field(default_factory=list)

    def merge(self, other, prefix):
        for name in ("replaced", "fused", "not_fused", "not_converted", "shared"):
            items = getattr(other, name)
            getattr(self, name).extend(
                (prefix + i if isinstance(i, str) else (prefix + i[0],) + tuple(i[1:]))
                for i in items)

    def __str__(self):
        """A summary: counts, and each reason with a few layer names (the attributes hold
        the full lists)."""
        lines = ["fbn_grad_tf.keras.convert(%s): %d BatchNormalization layer(s) replaced, "
                 "%d fused with the layer(s) after them, %d matched pattern(s) not fused, "
                 "%d not converted" % (self.model, len(self.replaced), len(self.fused),
                                       len(self.not_fused), len(self.not_converted))]

        def group(title, names, show=3):
            more = ", ... (%d more)" % (len(names) - show) if len(names) > show else ""
            lines.append("  %s (%d): %s%s" % (title, len(names), ", ".join(names[:show]), more))

        acts = {}
        for bn, removed, act in self.fused:
            acts.setdefault(act, []).append("%s+%s" % (bn, "+".join(removed)))
        for act, items in acts.items():
            group("fused, activation=%r" % act, items)
        reasons = {}
        for bn, pattern, reason in self.not_fused:
            reasons.setdefault(reason, []).append("%s (%s)" % (bn, pattern))
        for reason, items in reasons.items():
            group("not fused: " + reason, items, show=2)
        for name, reason in self.not_converted:
            lines.append("  NOT CONVERTED: %s: %s" % (name, reason))
        for name, reason in self.shared:
            lines.append("  shared with the original model: %s: %s" % (name, reason))
        return "\n".join(lines)


# ---- the graph --------------------------------------------------------------------------------

def _functional_class():
    from keras.src.models.functional import Functional
    return Functional


def _model_kind(model):
    if not isinstance(model, keras.Model):
        mod = type(model).__module__ or ""
        if mod.startswith(("tf_keras", "keras.src.engine", "tensorflow.python.keras")):
            raise TypeError(
                "fbn_grad_tf.keras.convert: %r is a tf_keras (Keras 2) model; convert "
                "rewrites Keras 3 models. For tf_keras, train under "
                "fbn_grad_tf.keras.override() (its fused BatchNormalization then runs on "
                "fbn_grad_tf's ops, see docs/DROPIN.md)." % (getattr(model, "name", model),))
        raise TypeError("fbn_grad_tf.keras.convert: expected a Keras 3 model, got %r"
                        % (type(model).__name__,))
    if isinstance(model, keras.Sequential):
        return "sequential"
    if isinstance(model, _functional_class()):
        return "functional"
    raise ValueError(
        "fbn_grad_tf.keras.convert: model %r is a subclassed keras.Model (%s): its call() is "
        "Python code, which convert cannot rewrite. Build it under "
        "`with fbn_grad_tf.keras.override():` (every keras.layers.BatchNormalization then "
        "runs on fbn_grad_tf's ops), or use fbn_grad_tf.keras.BatchNormalization in its code."
        % (model.name, type(model).__name__))


def _is_keras_bn(layer):
    return type(layer) is keras.layers.BatchNormalization  # pylint: disable=unidiomatic-typecheck


def _opaque_bn_reason(layer):
    """A reason if `layer` is a BatchNormalization convert cannot replace, or a layer of
    Python code holding one; else None."""
    if (isinstance(layer, keras.layers.BatchNormalization) and not _is_keras_bn(layer)
            and not isinstance(layer, _FbnBN)):
        if type(layer).__module__.startswith("fbn_grad_tf"):
            return None  # our SyncBatchNormalization: already ours
        return ("a subclass (%s) of keras.layers.BatchNormalization with its own code"
                % type(layer).__name__)
    if isinstance(layer, keras.layers.BatchNormalization) or isinstance(layer, keras.Model):
        return None
    if not isinstance(layer, keras.layers.Layer):
        return None  # a plain keras.ops operation in the graph (e.g. x * 2, a mask's NotEqual)
    inner = [sub.name for sub in layer._flatten_layers(include_self=False, recursive=True)
             if isinstance(sub, keras.layers.BatchNormalization)
             and not isinstance(sub, _FbnBN)]
    if inner:
        return ("a layer of Python code (%s) holding BatchNormalization layer(s) %s"
                % (type(layer).__name__, ", ".join(inner)))
    return None


class _Converter:
    def __init__(self, fuse, synchronized):
        self.fuse = fuse
        self.synchronized = synchronized
        self.report = ConvertReport()
        self.pairs = []  # (old layer, new layer) whose weights are copied

    # -- layers ---------------------------------------------------------------------------

    def new_bn(self, layer, activation=None):
        """Our BatchNormalization with `layer`'s config (+ activation, synchronized)."""
        cfg = layer.get_config()
        if activation is not None:
            cfg["activation"] = activation
        if self.synchronized:
            cfg["synchronized"] = True
        new = _FbnBN.from_config(cfg)
        if isinstance(layer, _FbnBN):
            new.forward_op = layer.forward_op
            new.gradient_op = layer.gradient_op
        else:
            self.report.replaced.append(layer.name)
        self.pairs.append((layer, new))
        return new

    def clone(self, layer):
        if isinstance(layer, keras.Model) and not isinstance(layer, _FbnBN):
            sub, sub_report = _convert(layer, self.fuse, self.synchronized)
            self.report.merge(sub_report, layer.name + "/")
            return sub
        if _is_keras_bn(layer) or isinstance(layer, _FbnBN):
            return self.new_bn(layer)
        reason = _opaque_bn_reason(layer)
        if reason:
            self.report.not_converted.append(
                (layer.name, reason + ": convert cannot rewrite it (it keeps Keras' "
                 "implementation); create the model under fbn_grad_tf.keras.override()"))
        try:
            new = layer.__class__.from_config(layer.get_config())
        except Exception as e:  # pylint: disable=broad-except
            self.report.shared.append(
                (layer.name, "cannot be re-created from its config (%s: %s)"
                 % (type(e).__name__, e)))
            return layer
        self.pairs.append((layer, new))
        return new

    def copy_weights(self):
        for old, new in self.pairs:
            if getattr(old, "weights", None):  # keras.ops operations have none
                new.set_weights(old.get_weights())

    # -- fusion ---------------------------------------------------------------------------

    def match(self, bn, chain_nodes, consumers, outputs, node_count):
        """For a BN node whose layer is fusable at all, the (pattern, activation, nodes after
        the BN, reason) of the pattern it starts, or None if it starts none."""
        layer = bn.operation
        out = bn.outputs[0] if len(bn.outputs) == 1 else None
        if out is None:
            return None
        nxt = consumers.get(id(out), [])
        if len(nxt) != 1:
            return None
        first = nxt[0]
        act, why = _activation_of(first.operation)
        pattern, chain = _BN_ACT, [first]
        if act is None and why is None:
            if not (type(first.operation) is keras.layers.Add  # noqa: E721
                    and len(first.input_tensors) == 2 and len(first.outputs) == 1):
                return None
            add_out = first.outputs[0]
            after = consumers.get(id(add_out), [])
            if len(after) != 1 or id(add_out) in outputs:
                return None
            act, why = _activation_of(after[0].operation)
            if act is None and why is None:
                return None
            pattern, chain = _BN_ADD_ACT, [first, after[0]]
        reason = why
        if reason is None:
            if id(out) in outputs:
                reason = "the BN output is also a model output"
            elif isinstance(layer, _FbnBN) and layer.activation is not None:
                reason = "the layer already applies activation %r" % layer.activation
            elif any(node_count[id(n.operation)] != 1 for n in [bn] + chain):
                reason = "a layer of the pattern is called more than once (shared layer)"
            elif any(n.operation.dtype_policy.name != layer.dtype_policy.name
                     for n in chain):
                reason = "the layers have different dtype policies"
            elif any(id(n) in chain_nodes for n in chain):
                reason = "the Add is already fused with its other input's BN"
            elif pattern.side_input and act not in pattern.supported():
                reason = ("side input (residual Add, then %s) not supported by the fused "
                          "op yet" % act)
            elif act not in pattern.supported():
                reason = "activation %s not supported by the fused op yet" % act
        return pattern, act, chain, reason


def _node_list(model):
    by_depth = model._nodes_by_depth  # pylint: disable=protected-access
    return [n for d in sorted(by_depth, reverse=True) for n in by_depth[d]]


def _convert_functional(model, conv):
    nodes = _node_list(model)
    consumers, node_count = {}, {}
    for n in nodes:
        if n.operation is not None:
            node_count[id(n.operation)] = node_count.get(id(n.operation), 0) + 1
        if n.is_input:
            continue
        for t in n.input_tensors:
            consumers.setdefault(id(t), []).append(n)
    outputs = {id(t) for t in model.outputs}

    # Fusion plan: BN node -> (activation, nodes absorbed); the chain's last node computes it.
    last_of_chain, absorbed = {}, set()
    if conv.fuse:
        for n in nodes:
            if n.is_input or not (_is_keras_bn(n.operation) or isinstance(n.operation, _FbnBN)):
                continue
            found = conv.match(n, absorbed, consumers, outputs, node_count)
            if found is None:
                continue
            pattern, act, chain, reason = found
            removed = [c.operation.name for c in chain]
            if reason is not None:
                conv.report.not_fused.append(
                    (n.operation.name, pattern.name + ": " + " + ".join(removed), reason))
                continue
            absorbed.update(id(c) for c in [n] + chain[:-1])
            last_of_chain[id(chain[-1])] = (n, pattern, act, chain)
            conv.report.fused.append((n.operation.name, removed, act))

    new_layers = {}  # id(old layer) -> new layer (shared layers stay shared)

    def new_layer(layer):
        if id(layer) not in new_layers:
            new_layers[id(layer)] = conv.clone(layer)
        return new_layers[id(layer)]

    tensors = {}
    new_inputs = []
    for x in model.inputs:
        inp_layer = x._keras_history.operation  # pylint: disable=protected-access
        new = keras.Input(batch_shape=x.shape, dtype=x.dtype, sparse=getattr(x, "sparse", False),
                          name=inp_layer.name)
        tensors[id(x)] = new
        new_inputs.append(new)
    for n in nodes:
        if n.is_input or n.operation is None or id(n) in absorbed:
            continue
        if id(n) in last_of_chain:
            bn, pattern, act, chain = last_of_chain[id(n)]
            args, kwargs = bn.arguments.fill_in(tensors)
            if pattern.side_input:  # y = act(bn(x) + other): the Add's other input
                add = chain[0]
                other = [t for t in add.input_tensors if t is not bn.outputs[0]]
                kwargs["side_input"] = tensors[id(other[0])]
            layer = conv.new_bn(bn.operation, activation=act)
            new_layers[id(bn.operation)] = layer
            outs = layer(*args, **kwargs)
        else:
            if any(id(t) not in tensors for t in n.input_tensors):
                continue  # not computable from the inputs (as in Keras' own graph walk)
            args, kwargs = n.arguments.fill_in(tensors)
            outs = new_layer(n.operation)(*args, **kwargs)
        for old, new in zip(n.outputs, keras.tree.flatten(outs)):
            tensors[id(old)] = new
    missing = [t for t in model.outputs if id(t) not in tensors]
    if missing:
        raise ValueError("fbn_grad_tf.keras.convert: output(s) %s of model %r are not "
                         "connected to its inputs" % ([t.name for t in missing], model.name))
    struct_in = keras.tree.pack_sequence_as(model._inputs_struct, new_inputs)  # pylint: disable=protected-access
    struct_out = keras.tree.pack_sequence_as(
        model._outputs_struct, [tensors[id(t)] for t in model.outputs])  # pylint: disable=protected-access
    if type(model) is not _functional_class():  # pylint: disable=unidiomatic-typecheck
        warnings.warn("fbn_grad_tf.keras.convert: %r is a %s (a keras.Model subclass built "
                      "functionally); the converted model is a plain functional keras.Model "
                      "without that class's methods" % (model.name, type(model).__name__),
                      RuntimeWarning, stacklevel=3)
    return keras.Model(struct_in, struct_out, name=model.name, trainable=model.trainable)


def _convert_sequential(model, conv):
    old = list(model.layers)
    new_list, i = [], 0
    while i < len(old):
        layer = old[i]
        nxt = old[i + 1] if i + 1 < len(old) else None
        if conv.fuse and (_is_keras_bn(layer) or isinstance(layer, _FbnBN)) and nxt is not None:
            act, why = _activation_of(nxt)
            if act is not None or why is not None:
                reason = why
                if reason is None:
                    if isinstance(layer, _FbnBN) and layer.activation is not None:
                        reason = "the layer already applies activation %r" % layer.activation
                    elif nxt.dtype_policy.name != layer.dtype_policy.name:
                        reason = "the layers have different dtype policies"
                    elif act not in _BN_ACT.supported():
                        reason = "activation %s not supported by the fused op yet" % act
                pat = "%s: %s" % (_BN_ACT.name, nxt.name)
                if reason is None:
                    new_list.append(conv.new_bn(layer, activation=act))
                    conv.report.fused.append((layer.name, [nxt.name], act))
                    i += 2
                    continue
                conv.report.not_fused.append((layer.name, pat, reason))
        new_list.append(conv.clone(layer))
        i += 1
    inputs = []
    if model.built:
        if getattr(model, "_functional", None) is None:
            raise ValueError(
                "fbn_grad_tf.keras.convert: Sequential model %r is built but has no input "
                "graph; give it a keras.Input first (or convert it before building it)"
                % model.name)
        x = model.inputs[0]
        inputs = [keras.Input(batch_shape=x.shape, dtype=x.dtype,
                              name=x._keras_history.operation.name)]  # pylint: disable=protected-access
    return keras.Sequential(inputs + new_list, name=model.name, trainable=model.trainable)


def _convert(model, fuse, synchronized):
    kind = _model_kind(model)
    conv = _Converter(fuse, synchronized)
    conv.report.model = model.name
    if kind == "functional":
        new = _convert_functional(model, conv)
    else:
        new = _convert_sequential(model, conv)
    conv.copy_weights()
    return new, conv.report


def convert(model, fuse=True, synchronized=False, verbose=False, return_report=False):
    """A copy of a Keras 3 functional or Sequential `model` whose
    ``keras.layers.BatchNormalization`` layers are ``fbn_grad_tf.keras.BatchNormalization``
    (our forward and backward ops).

    Every layer is re-created from its config and gets the original's weights (BN moving
    statistics included), with the same names; the model is not compiled (compile the new
    one). The original model is not modified. Nested functional/Sequential models are
    converted too.

    fuse: where a BN's only consumer is an activation layer (``Activation("relu" | "relu6" |
      "swish" | "silu")``, ``ReLU()``, ``ReLU(max_value=6)``), or a 2-input ``Add`` followed
      by one (a residual connection), and our fused op supports that activation
      (``fbn_grad_tf.nn.FUSED_ACTIVATIONS``: "relu", "relu6", "swish"; with a side input for
      the residual pattern), the BN becomes
      ``BatchNormalization(activation=...)`` and the activation layer disappears (same
      outputs). Matched patterns that are not fused are listed in the report with the reason.
    synchronized: the BN layers become cross-replica ones (``synchronized=True``, see
      docs/SYNC.md).
    verbose: print the report.
    return_report: return ``(new_model, report)`` (a ConvertReport) instead of the model.

    Raises ValueError for a subclassed model (use ``fbn_grad_tf.keras.override()``) and
    TypeError for a tf_keras (Keras 2) model or a non-model. BatchNormalization layers it
    cannot reach (inside a custom layer's Python code, or a BN subclass with its own code)
    stay Keras' and are reported under ``not_converted``, with a RuntimeWarning.
    """
    if keras.backend.backend() != "tensorflow":
        raise RuntimeError("fbn_grad_tf.keras.convert needs Keras' TensorFlow backend, got %r"
                           % keras.backend.backend())
    new, report = _convert(model, bool(fuse), bool(synchronized))
    if report.not_converted:
        warnings.warn("fbn_grad_tf.keras.convert: %d BatchNormalization layer(s) not "
                      "converted: %s" % (len(report.not_converted), "; ".join(
                          "%s: %s" % item for item in report.not_converted)),
                      RuntimeWarning, stacklevel=2)
    if verbose:
        print(report)
    return (new, report) if return_report else new
