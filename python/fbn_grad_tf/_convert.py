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
import contextlib
import dataclasses
import json
import warnings

import keras

from . import nn as _nn
from ._keras_layer import BatchNormalization as _FbnBN
from ._keras_layer import same_static_shape

__all__ = ["convert", "revert", "ConvertReport", "FusedIntoBatchNorm"]

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


def _model_kind(model, what="convert"):
    """"functional" or "sequential"; a TypeError or ValueError for what `what` (convert or
    revert) cannot rewrite, with that function's advice."""
    name = "fbn_grad_tf.keras." + what
    if not isinstance(model, keras.Model):
        mod = type(model).__module__ or ""
        if mod.startswith(("tf_keras", "keras.src.engine", "tensorflow.python.keras")):
            advice = ("For tf_keras, train under fbn_grad_tf.keras.override() (its fused "
                      "BatchNormalization then runs on fbn_grad_tf's ops, see "
                      "docs/DROPIN.md)." if what == "convert" else
                      "A tf_keras model trained under fbn_grad_tf.keras.override() holds "
                      "tf_keras' own layers: it needs no revert.")
            raise TypeError("%s: %r is a tf_keras (Keras 2) model; %s rewrites Keras 3 "
                            "models. %s" % (name, getattr(model, "name", model), what, advice))
        raise TypeError("%s: expected a Keras 3 model, got %r" % (name, type(model).__name__))
    if isinstance(model, keras.Sequential):
        return "sequential"
    if isinstance(model, _functional_class()):
        return "functional"
    advice = ("Build it under `with fbn_grad_tf.keras.override():` (every "
              "keras.layers.BatchNormalization then runs on fbn_grad_tf's ops), or use "
              "fbn_grad_tf.keras.BatchNormalization in its code." if what == "convert" else
              "Use keras.layers.BatchNormalization in its code instead of fbn_grad_tf's "
              "layer; for serving, model.export(path) of it holds TF's ops only "
              "(docs/DROPIN.md, \"Exports and SavedModel\").")
    raise ValueError("%s: model %r is a subclassed keras.Model (%s): its call() is Python "
                     "code, which %s cannot rewrite. %s"
                     % (name, model.name, type(model).__name__, what, advice))


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


# ---- what convert leaves where it removed a layer -------------------------------------------

@keras.saving.register_keras_serializable(package="fbn_grad_tf")
class FusedIntoBatchNorm(keras.layers.Layer):
    """Stands where ``convert`` absorbed a layer (an activation, or a residual ``Add``) into
    the BatchNormalization before it: it passes that BN's fused output through, without an
    op, and holds the absorbed layer's serialized config, from which ``revert`` restores it.

    Keeping a node for every absorbed layer keeps the converted model's graph, layer list
    and layer order those of the original: Keras' weight files and tf.train.Checkpoint match
    variables by the position of their layer, so both pass between a model and its
    conversion in either direction.

    layer: the absorbed layer, as ``keras.saving.serialize_keras_object`` wrote it.
    passthrough_index: for a layer called on a list (the Add), the position of the BN's
    output in that list.
    """

    def __init__(self, layer, passthrough_index=0, **kwargs):
        super().__init__(**kwargs)
        # Kept as JSON text: a dict attribute would be wrapped by Keras' and TF's trackers.
        self._absorbed_json = json.dumps(layer)
        self.passthrough_index = int(passthrough_index)
        self.supports_masking = True  # as the activation and Add layers it stands for

    @classmethod
    def standing_for(cls, layer, passthrough_index=0):
        return cls(keras.saving.serialize_keras_object(layer), passthrough_index,
                   name=layer.name, dtype=layer.dtype_policy.name, trainable=layer.trainable)

    @property
    def absorbed_config(self):
        """The absorbed layer's serialized config (a new dict each time)."""
        return json.loads(self._absorbed_json)

    def restore(self):
        """A new instance of the absorbed layer (same class, name and config)."""
        return keras.saving.deserialize_keras_object(self.absorbed_config)

    def _passed(self, inputs):
        if isinstance(inputs, (list, tuple)):
            return inputs[self.passthrough_index]
        return inputs

    def call(self, inputs):
        return self._passed(inputs)

    def compute_mask(self, inputs, mask=None):
        """The mask the absorbed layer passed on: its input's, or for an Add the elementwise
        AND of its inputs' masks."""
        if not isinstance(mask, (list, tuple)):
            return mask
        masks = [m for m in mask if m is not None]
        if not masks:
            return None
        out = masks[0]
        for m in masks[1:]:
            out = keras.ops.logical_and(out, m)
        return out

    def compute_output_spec(self, inputs):
        x = self._passed(inputs)
        return keras.KerasTensor(x.shape, dtype=x.dtype)

    def get_config(self):
        config = super().get_config()
        config.update(layer=self.absorbed_config, passthrough_index=self.passthrough_index)
        return config


# ---- name scopes --------------------------------------------------------------------------

_name_scope = getattr(keras, "name_scope", None)
if _name_scope is None:  # older Keras 3 releases export it only from the backend
    from keras.src.backend import name_scope as _name_scope


def _scope_parts(layer):
    """The name scopes `layer` was built under, as Keras wrote them into its variables'
    paths ("normal_A_block_0/adjust_block/adjust_bn_0/gamma" -> ["normal_A_block_0",
    "adjust_block"]); [] for a layer without variables."""
    for w in getattr(layer, "weights", None) or ():
        parts = str(getattr(w, "path", "")).split("/")[:-1]
        if layer.name in parts:
            return parts[:len(parts) - 1 - parts[::-1].index(layer.name)]
        return []
    return []


@contextlib.contextmanager
def _scoped_like(layer):
    """Builds a layer under the name scopes `layer` was built under, so that a re-created
    layer's variables get the original's paths."""
    with contextlib.ExitStack() as stack:
        for part in _scope_parts(layer):
            stack.enter_context(_name_scope(part))
        yield


# ---- the graph walk (shared by convert and revert) ------------------------------------------

def _node_list(model):
    by_depth = model._nodes_by_depth  # pylint: disable=protected-access
    return [n for d in sorted(by_depth, reverse=True) for n in by_depth[d]]


def _consumers(nodes):
    consumers = {}
    for n in nodes:
        if not n.is_input:
            for t in n.input_tensors:
                consumers.setdefault(id(t), []).append(n)
    return consumers


def _producer(tensor):
    op, node_index, _ = tensor._keras_history  # pylint: disable=protected-access
    return op._inbound_nodes[node_index]  # pylint: disable=protected-access


def _operation_names(model):
    """The names of `model`'s layers (and operations) in the order Keras keeps them: the
    order by which weight files and tf.train.Checkpoint find their variables."""
    ops = getattr(model, "_operations", None)
    return [op.name for op in (model.layers if ops is None else ops)]


def _call_as_recorded(node, layer, args, kwargs, tensors):
    return layer(*args, **kwargs)


def _rebuild_functional(model, who, new_layer, call=_call_as_recorded, side_input_of=None):
    """A functional model with `model`'s inputs, outputs and name, and a node for each of its
    nodes: new_layer(node) makes the node's layer (once per layer: shared layers stay
    shared), and call(node, layer, args, kwargs, tensors) calls it on the node's recorded
    arguments mapped to the new tensors (tensors: id(old KerasTensor) -> new one), under the
    name scopes the old layer was built under. side_input_of(node): a tensor of the old
    graph the node needs beyond its own inputs (a fused BN's side input), or None. Nodes
    are made in the original's order where they can be; one that needs a tensor made later
    waits for it."""
    layers = {}

    def make(n):
        extra = side_input_of(n) if side_input_of is not None else None
        if not _ready(tensors, list(n.input_tensors) + ([extra] if extra is not None else [])):
            return None
        args, kwargs = n.arguments.fill_in(tensors)
        if id(n.operation) not in layers:
            layers[id(n.operation)] = new_layer(n)
        with _scoped_like(n.operation):
            return call(n, layers[id(n.operation)], args, kwargs, tensors)

    tensors, new_inputs = {}, []
    for x in model.inputs:
        inp_layer = x._keras_history.operation  # pylint: disable=protected-access
        new = keras.Input(batch_shape=x.shape, dtype=x.dtype, sparse=getattr(x, "sparse", False),
                          name=inp_layer.name)
        tensors[id(x)] = new
        new_inputs.append(new)
    pending = [n for n in _node_list(model) if not n.is_input and n.operation is not None]
    while pending:
        waiting = []
        for n in pending:
            outs = make(n)
            if outs is None:
                waiting.append(n)
                continue
            for old, new in zip(n.outputs, keras.tree.flatten(outs)):
                tensors[id(old)] = new
        if len(waiting) == len(pending):
            break  # not computable from the inputs (as in Keras' own graph walk)
        pending = waiting
    missing = [t for t in model.outputs if id(t) not in tensors]
    if missing:
        raise ValueError("%s: output(s) %s of model %r are not connected to its inputs"
                         % (who, [t.name for t in missing], model.name))
    struct_in = keras.tree.pack_sequence_as(model._inputs_struct, new_inputs)  # pylint: disable=protected-access
    struct_out = keras.tree.pack_sequence_as(
        model._outputs_struct, [tensors[id(t)] for t in model.outputs])  # pylint: disable=protected-access
    if type(model) is not _functional_class():  # pylint: disable=unidiomatic-typecheck
        warnings.warn("%s: %r is a %s (a keras.Model subclass built functionally); the new "
                      "model is a plain functional keras.Model without that class's methods"
                      % (who, model.name, type(model).__name__), RuntimeWarning, stacklevel=4)
    return keras.Model(struct_in, struct_out, name=model.name, trainable=model.trainable)


def _ready(tensors, needed):
    return all(id(t) in tensors for t in needed)


# ---- convert ----------------------------------------------------------------------------------

@dataclasses.dataclass
class _Fusion:
    """A planned fusion: the BN node computes act(bn(x) [+ other]); the chain's nodes become
    FusedIntoBatchNorm layers."""
    pattern: _Pattern
    activation: str
    chain: list
    other: object = None        # the residual Add's other input (a KerasTensor), or None
    add_index: int = 0          # where the BN's output sits among the Add's inputs


_ORDER_REASON = ("fusing it would change the order of the model's layers, by which weight "
                 "files and tf.train.Checkpoint match variables")


class _Converter:
    def __init__(self, fuse, synchronized):
        self.fuse = fuse
        self.synchronized = synchronized
        self.report = ConvertReport()
        self.pairs = []         # (old layer, new layer) whose weights are copied
        self.absorbed = {}      # id(old layer) -> passthrough index: becomes FusedIntoBatchNorm

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
        if id(layer) in self.absorbed:
            return FusedIntoBatchNorm.standing_for(layer, self.absorbed[id(layer)])
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
        return _clone_layer(layer, self.pairs, self.report.shared)

    def copy_weights(self):
        _copy_weights(self.pairs)

    # -- fusion ---------------------------------------------------------------------------

    def match(self, bn, consumers, outputs, node_count):
        """For a BN node, the (_Fusion, reason) of the pattern it starts (reason None: it
        can be fused), or None if it starts none."""
        layer = bn.operation
        out = bn.outputs[0] if len(bn.outputs) == 1 else None
        if out is None:
            return None
        nxt = consumers.get(id(out), [])
        if len(nxt) != 1:
            return None
        first = nxt[0]
        act, why = _activation_of(first.operation)
        fusion = _Fusion(_BN_ACT, act, [first])
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
            index = [t is out for t in first.input_tensors].index(True)
            fusion = _Fusion(_BN_ADD_ACT, act, [first, after[0]],
                             other=first.input_tensors[1 - index], add_index=index)
        reason = why
        if reason is None:
            pattern = fusion.pattern
            if id(out) in outputs:
                reason = "the BN output is also a model output"
            elif isinstance(layer, _FbnBN) and layer.activation is not None:
                reason = "the layer already applies activation %r" % layer.activation
            elif fusion.other is not None and not same_static_shape(fusion.other, out):
                reason = ("the Add broadcasts: its inputs have shapes %s and %s (the fused op "
                          "takes a side input of the BN output's shape)"
                          % (tuple(fusion.other.shape), tuple(out.shape)))
            elif any(node_count[id(n.operation)] != 1 for n in [bn] + fusion.chain):
                reason = "a layer of the pattern is called more than once (shared layer)"
            elif any(n.operation.dtype_policy.name != layer.dtype_policy.name
                     for n in fusion.chain):
                reason = "the layers have different dtype policies"
            elif pattern.side_input and act not in pattern.supported():
                reason = ("side input (residual Add, then %s) not supported by the fused "
                          "op yet" % act)
            elif act not in pattern.supported():
                reason = "activation %s not supported by the fused op yet" % act
        return fusion, reason

    def plan(self, nodes, consumers, outputs, held_back):
        """The fusions to make: id(BN node) -> _Fusion; reports the others with the reason.
        held_back: id(BN node or residual Add node) -> reason, fusions not to make."""
        node_count = {}
        for n in nodes:
            if n.operation is not None:
                node_count[id(n.operation)] = node_count.get(id(n.operation), 0) + 1
        found = []
        for n in nodes:
            if n.is_input or not (_is_keras_bn(n.operation) or isinstance(n.operation, _FbnBN)):
                continue
            m = self.match(n, consumers, outputs, node_count)
            if m is not None:
                fusion, reason = m
                if reason is None:  # held back: by its BN node, or by its residual Add
                    reason = held_back.get(id(n), held_back.get(id(fusion.chain[0])))
                found.append((n, fusion, reason))
        # A residual Add fed by two fusable BNs: the BN of the Add's later input takes it, so
        # that the side-input edge to the fused BN comes from the branch Keras orders first.
        claimed = {}
        for n, fusion, reason in found:
            if reason is None and fusion.pattern.side_input:
                add = id(fusion.chain[0])
                if add not in claimed or fusion.add_index > claimed[add][1]:
                    claimed[add] = (id(n), fusion.add_index)
        fusions = {}
        for n, fusion, reason in found:
            if (reason is None and fusion.pattern.side_input
                    and claimed[id(fusion.chain[0])][0] != id(n)):
                reason = "the Add is already fused with its other input's BN"
            removed = [c.operation.name for c in fusion.chain]
            if reason is not None:
                self.report.not_fused.append(
                    (n.operation.name, fusion.pattern.name + ": " + " + ".join(removed), reason))
                continue
            fusions[id(n)] = fusion
            for c in fusion.chain:
                self.absorbed[id(c.operation)] = (fusion.add_index if c is fusion.chain[0]
                                                  and fusion.pattern.side_input else 0)
            self.report.fused.append((n.operation.name, removed, fusion.activation))
        return fusions


def _clone_layer(layer, pairs, shared):
    """`layer` re-created from its config (its weights copied later), or the layer itself
    (reported in `shared`) if its config cannot re-create it."""
    try:
        new = layer.__class__.from_config(layer.get_config())
    except Exception as e:  # pylint: disable=broad-except
        shared.append((layer.name, "cannot be re-created from its config (%s: %s)"
                       % (type(e).__name__, e)))
        return layer
    pairs.append((layer, new))
    return new


def _copy_weights(pairs):
    for old, new in pairs:
        if getattr(old, "weights", None):  # keras.ops operations have none
            new.set_weights(old.get_weights())


def _held_back(fusions):
    """id(BN node) and id(residual Add node) -> reason, for every fusion in `fusions`."""
    held = {bn: _ORDER_REASON for bn in fusions}
    held.update({id(f.chain[0]): _ORDER_REASON for f in fusions.values() if f.other is not None})
    return held


def _depth_raising(model, fusions):
    """The residual fusions whose side-input edge makes the other input's producer deeper
    than in the original, so that Keras may order the model's layers otherwise (as in
    ResNet50's first block of each stage, where both inputs of the Add are BNs): their
    residual Add node ids -> reason."""
    depth = {id(n): d for d, ns in model._nodes_by_depth.items() for n in ns}  # pylint: disable=protected-access
    return {id(f.chain[0]): _ORDER_REASON for bn, f in fusions.items()
            if f.other is not None and depth.get(id(_producer(f.other)), 0)
            <= depth.get(bn, 0)}


def _convert_functional(model, fuse, synchronized):
    """(new model, converter). Fusions that would change the order of the layers are held
    back: the model is built again without them."""
    nodes = _node_list(model)
    consumers = _consumers(nodes)
    outputs = {id(t) for t in model.outputs}
    held_back, first_fusions = {}, {}
    for attempt in ("all fusions", "without depth-raising residual fusions", "no fusion"):
        conv = _Converter(fuse, synchronized)
        fusions = conv.plan(nodes, consumers, outputs, held_back) if fuse else {}
        first_fusions = first_fusions or fusions

        # Used within this attempt only (the model is rebuilt before the loop goes on).
        def new_layer(n):
            fusion = fusions.get(id(n))
            if fusion is not None:
                return conv.new_bn(n.operation, activation=fusion.activation)
            return conv.clone(n.operation)

        def side_input_of(n):
            fusion = fusions.get(id(n))
            return fusion.other if fusion is not None else None

        def call(n, layer, args, kwargs, tensors):
            other = side_input_of(n)
            if other is not None:  # y = act(bn(x) + other): the residual Add's other input
                kwargs["side_input"] = tensors[id(other)]
            return layer(*args, **kwargs)

        new = _rebuild_functional(model, "fbn_grad_tf.keras.convert", new_layer, call,
                                  side_input_of)
        if not fusions or _operation_names(new) == _operation_names(model):
            break
        # Held back next: the residual fusions that make a node deeper, then every fusion.
        held_back = ((attempt == "all fusions" and _depth_raising(model, fusions))
                     or _held_back(first_fusions))
    else:
        warnings.warn("fbn_grad_tf.keras.convert: the layers of %r could not be kept in the "
                      "original's order: its weight files and checkpoints will not load into "
                      "the converted model" % model.name, RuntimeWarning, stacklevel=3)
    return new, conv


def _convert_sequential(model, fuse, synchronized):
    conv = _Converter(fuse, synchronized)
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
                    new_list.append(FusedIntoBatchNorm.standing_for(nxt))
                    conv.report.fused.append((layer.name, [nxt.name], act))
                    i += 2
                    continue
                conv.report.not_fused.append((layer.name, pat, reason))
        new_list.append(conv.clone(layer))
        i += 1
    return _sequential_like(model, new_list, "fbn_grad_tf.keras.convert"), conv


def _sequential_like(model, new_list, who):
    inputs = []
    if model.built:
        if getattr(model, "_functional", None) is None:
            raise ValueError(
                "%s: Sequential model %r is built but has no input graph; give it a "
                "keras.Input first (or call it before building it)" % (who, model.name))
        x = model.inputs[0]
        inputs = [keras.Input(batch_shape=x.shape, dtype=x.dtype,
                              name=x._keras_history.operation.name)]  # pylint: disable=protected-access
    return keras.Sequential(inputs + new_list, name=model.name, trainable=model.trainable)


def _convert(model, fuse, synchronized):
    kind = _model_kind(model)
    if kind == "functional":
        new, conv = _convert_functional(model, fuse, synchronized)
    else:
        new, conv = _convert_sequential(model, fuse, synchronized)
    conv.report.model = model.name
    conv.copy_weights()
    return new, conv.report


def convert(model, fuse=True, synchronized=False, verbose=False, return_report=False):
    """A copy of a Keras 3 functional or Sequential `model` whose
    ``keras.layers.BatchNormalization`` layers are ``fbn_grad_tf.keras.BatchNormalization``
    (our forward and backward ops).

    Every layer is re-created from its config and gets the original's weights (BN moving
    statistics included), with the same names, the same name scopes (so the same variable
    paths) and the same order; the model is not compiled (compile the new one). Weight
    files (``save_weights``/``load_weights``) and ``tf.train.Checkpoint`` pass between the
    original and the converted model both ways. The original model is not modified. Nested
    functional/Sequential models are converted too. ``revert`` undoes it.

    fuse: where a BN's only consumer is an activation layer (``Activation("relu" | "relu6" |
      "swish" | "silu")``, ``ReLU()``, ``ReLU(max_value=6)``), or a 2-input ``Add`` followed
      by one (a residual connection), and our fused op supports that activation
      (``fbn_grad_tf.nn.FUSED_ACTIVATIONS``: "relu", "relu6", "swish"; with a side input for
      the residual pattern), the BN becomes ``BatchNormalization(activation=...)``, called
      with the Add's other input as ``side_input``, and the absorbed layers become
      ``FusedIntoBatchNorm`` layers of the same names (pass-throughs, no op; they hold the
      absorbed layers' configs). Same outputs. Matched patterns that are not fused are
      listed in the report with the reason (one is: fusing would change the order of the
      layers).
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


# ---- revert -----------------------------------------------------------------------------------

def _is_our_bn(layer):
    return (isinstance(layer, keras.layers.BatchNormalization)
            and type(layer).__module__.startswith("fbn_grad_tf"))


class _Reverter:
    def __init__(self, taken_names):
        self.pairs = []
        self.shared = []
        self.taken = set(taken_names)

    def unique(self, name):
        """`name`, or `name`_1, _2, ... if a layer of the model has it."""
        new, i = name, 0
        while new in self.taken:
            i += 1
            new = "%s_%d" % (name, i)
        self.taken.add(new)
        return new

    def keras_bn(self, layer):
        cfg = layer.get_config()
        cfg.pop("activation", None)
        cfg.pop("implementation", None)  # SyncBatchNormalization's choice of kernels
        new = keras.layers.BatchNormalization.from_config(cfg)
        self.pairs.append((layer, new))
        return new

    def clone(self, layer):
        if isinstance(layer, FusedIntoBatchNorm):
            return layer.restore()
        if _is_our_bn(layer):
            return self.keras_bn(layer)
        if isinstance(layer, keras.Model):
            return _revert(layer)
        return _clone_layer(layer, self.pairs, self.shared)

    def unfused_tail(self, bn, y, side_input):
        """The layers a BN's own activation / side input stand for where no
        FusedIntoBatchNorm follows it (a layer built with activation=...): Add, Activation."""
        # The BN's dtype policy, not the global one of the process that reverts.
        if side_input is not None:
            y = keras.layers.Add(name=self.unique(bn.name + "_add"),
                                 dtype=bn.dtype_policy)([y, side_input])
        if getattr(bn, "activation", None) is not None:
            y = keras.layers.Activation(
                bn.activation, name=self.unique(bn.name + "_" + bn.activation),
                dtype=bn.dtype_policy)(y)
        return y


def _revert_functional(model):
    nodes = _node_list(model)
    consumers = _consumers(nodes)
    rev = _Reverter(layer.name for layer in model.layers)

    def call(n, layer, args, kwargs, tensors):
        if not _is_our_bn(n.operation):
            return layer(*args, **kwargs)
        side_input = kwargs.pop("side_input", None)
        y = layer(*args, **kwargs)
        after = consumers.get(id(n.outputs[0]), [])
        if len(after) == 1 and isinstance(after[0].operation, FusedIntoBatchNorm):
            return y  # the absorbed layers follow as nodes of their own
        return rev.unfused_tail(n.operation, y, side_input)

    new = _rebuild_functional(model, "fbn_grad_tf.keras.revert",
                              lambda n: rev.clone(n.operation), call)
    return new, rev


def _revert_sequential(model):
    rev = _Reverter(layer.name for layer in model.layers)
    old = list(model.layers)
    new_list = []
    for i, layer in enumerate(old):
        new_list.append(rev.clone(layer))
        if _is_our_bn(layer) and getattr(layer, "activation", None) is not None:
            nxt = old[i + 1] if i + 1 < len(old) else None
            if not isinstance(nxt, FusedIntoBatchNorm):
                new_list.append(keras.layers.Activation(
                    layer.activation, name=rev.unique(layer.name + "_" + layer.activation),
                    dtype=layer.dtype_policy))
    return _sequential_like(model, new_list, "fbn_grad_tf.keras.revert"), rev


def _revert(model):
    if _model_kind(model, "revert") == "functional":
        new, rev = _revert_functional(model)
    else:
        new, rev = _revert_sequential(model)
    _copy_weights(rev.pairs)
    if rev.shared:
        warnings.warn("fbn_grad_tf.keras.revert: layer(s) shared with the given model (they "
                      "cannot be re-created from their config): %s" % "; ".join(
                          "%s: %s" % item for item in rev.shared), RuntimeWarning, stacklevel=3)
    return new


def revert(model):
    """The inverse of ``convert``: a copy of `model` with stock Keras layers only.

    Each fbn_grad_tf BatchNormalization (and SyncBatchNormalization) becomes a
    ``keras.layers.BatchNormalization`` with the same config and weights (moving statistics
    included); each ``FusedIntoBatchNorm`` becomes the layer it stands for (the activation,
    the residual ``Add``: same name and config), so ``revert(convert(m))`` has ``m``'s
    structure, layer order, variable paths and outputs. A BN built with ``activation=`` (or
    called with ``side_input=``) outside ``convert`` gets an ``Add`` and an ``Activation``
    layer after it, named after the BN. Every other layer is re-created from its config with
    its weights; nested models are reverted too; the given model is not modified.

    The result needs nothing of fbn_grad_tf: it saves, exports and converts (TFLite, ONNX
    exporters) as any Keras model. Functional and Sequential models only (a subclassed
    model is its own code: it has no converted form).
    """
    if keras.backend.backend() != "tensorflow":
        raise RuntimeError("fbn_grad_tf.keras.revert needs Keras' TensorFlow backend, got %r"
                           % keras.backend.backend())
    return _revert(model)
