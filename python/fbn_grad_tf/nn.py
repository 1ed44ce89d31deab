"""Using fbn_grad_tf's backward inside ordinary TensorFlow code.

Two entry points:

``fused_batch_norm(x, scale, offset, ...)``
    Drop-in for ``tf.compat.v1.nn.fused_batch_norm``: the same outputs
    ``(y, running_mean, running_var)``, with our forward op ("FbnGrad>FusedBatchNormV3", or
    "FbnGrad>FusedBatchNormEx" with a side input and/or a fused activation) and our backward; ``forward="tf"`` keeps
    TF's FusedBatchNormV3 forward (then the gradient is a ``tf.custom_gradient``). Works eagerly, in tf.function, under GradientTape and
    under ``tf.compat.v1.gradients`` in TF1 graphs; second derivatives work too (our op's own
    gradient is registered in gradients.py).

``use_for_gradients()``
    A context manager and decorator under which the gradients of TF's *own* forward ops
    FusedBatchNormV3/V2/FusedBatchNorm (built by tf.compat.v1.nn.fused_batch_norm,
    tf.raw_ops.FusedBatchNormV3, tf_keras' fused BatchNormalization, ...) are computed by our
    op. See its docstring and docs/DROPIN.md for exactly when it applies.
"""
import collections
import contextlib
import dataclasses
import threading
import weakref

import tensorflow as tf
from tensorflow.python.framework import ops as _tf_ops
from tensorflow.python.framework import registry as _tf_registry

from . import _loader
from . import gradients as _grads

_DATA_FORMATS = ("NHWC", "NCHW", "NDHWC", "NCDHW")
FORWARDS = ("ours", "tf")

#: The activations our forward op can apply in the same pass as the normalization (the one
#: list everything asks: fused_batch_norm, fbn_grad_tf.keras.BatchNormalization(activation=),
#: fbn_grad_tf.keras.convert's fusion). Each maps to the op's ``activation_mode`` attribute.
#: An activation joins when the C++ ops (forward and backward) implement it: add its mode
#: here and its TF function to _ACTIVATION_FUNCTIONS. "silu" is accepted as a synonym of
#: "swish" (the same function, z * sigmoid(z)).
FUSED_ACTIVATIONS = ("relu", "relu6", "swish")
_ACTIVATION_MODES = {"relu": "Relu", "relu6": "Relu6", "swish": "Swish"}
_ACTIVATION_ALIASES = {"silu": "swish"}
#: The plain-TF function of each fused activation (fallback paths: TF's forward, XLA, Keras'
#: own implementation for shapes the fused op does not take).
_ACTIVATION_FUNCTIONS = {"relu": tf.nn.relu, "relu6": tf.nn.relu6, "swish": tf.nn.silu}
#: Activations our ops can apply after adding a side input (y = act(bn(x) + side_input), a
#: residual connection); a side input without activation works too.
FUSED_SIDE_INPUT_ACTIVATIONS = ("relu", "relu6", "swish")

ACTIVATIONS = (None,) + FUSED_ACTIVATIONS


def check_forward_and_activation(forward, activation):
    """Validates the `forward` / `activation` arguments; returns activation normalized."""
    if forward not in FORWARDS:
        raise ValueError('forward must be "ours" or "tf", got %r' % (forward,))
    if isinstance(activation, str):
        activation = activation.lower()
        if activation in ("identity", "linear", "none"):
            activation = None
        activation = _ACTIVATION_ALIASES.get(activation, activation)
    if activation is not None and activation not in FUSED_ACTIVATIONS:
        raise ValueError("activation must be None or one of %s (the activations the fused "
                         "op supports), got %r"
                         % (", ".join('"%s"' % a for a in FUSED_ACTIVATIONS), activation))
    return activation


def apply_activation(y, activation, side_input=None):
    """`activation` (None or one of FUSED_ACTIVATIONS) applied with plain TF ops, after
    adding `side_input` (if any): act(y + side_input)."""
    if side_input is not None:
        y = y + tf.cast(side_input, y.dtype)
    return y if activation is None else _ACTIVATION_FUNCTIONS[activation](y)


@dataclasses.dataclass(frozen=True)
class BatchNormParams:
    """The attributes of one fused batch-norm call, carried as one record from the public
    entry points (fused_batch_norm, the Keras layer) down to the op builders, like the C++
    core's params struct. The tensors x, scale, offset, mean, variance stay positional, as
    the op's inputs; what the fused op adds (activation mode, side input) are fields here,
    not new arguments of every helper.

    epsilon, exponential_avg_factor, data_format, is_training: the op attributes.
    activation: None or one of FUSED_ACTIVATIONS (validated by the entry points).
    forward: "ours" (our forward op where it can run) or "tf" (TF's FusedBatchNormV3 with a
      custom gradient calling our backward).
    name: the op name, or None.
    return_reserve: also return reserve_space_1/2 (gradient-stopped).
    side_input: None or a tensor of x's shape and dtype: y = act(bn(x) + side_input).
    """
    epsilon: float
    exponential_avg_factor: float
    data_format: str
    is_training: bool
    name: object = None
    return_reserve: bool = False
    forward: str = "ours"
    activation: object = None
    side_input: object = None

    def op_attrs(self):
        """The keyword attributes of FusedBatchNormV3 and of our forward ops."""
        return dict(epsilon=self.epsilon, exponential_avg_factor=self.exponential_avg_factor,
                    data_format=self.data_format, is_training=self.is_training,
                    name=self.name)


def our_forward_available():
    """True when our forward op can run where the ops will be placed: always on CPU; on a
    machine with GPUs only if the library has our CUDA kernels (otherwise TF would run our
    op on the CPU and copy the tensors back and forth)."""
    if _loader.raw_forward_op is None:
        return False
    info = _loader.build_info
    if info is not None and info.WITH_CUDA:
        return True
    return not tf.config.list_physical_devices("GPU")


# ---- fused_batch_norm ---------------------------------------------------------------------

def fused_batch_norm(x, scale, offset, mean=None, variance=None, epsilon=0.001,
                     data_format="NHWC", is_training=True, exponential_avg_factor=1.0,
                     name=None, activation=None, forward="ours", side_input=None):
    """Batch normalization with fbn_grad_tf's forward and backward.

    Same arguments, checks and results as ``tf.compat.v1.nn.fused_batch_norm`` of the pinned
    TF 2.21 (x: 4-D or 5-D half/bfloat16/float32 tensor; scale, offset, mean, variance: [C]
    float32):

    * training with ``exponential_avg_factor == 1``: mean and variance must be None; returns
      the batch mean and the Bessel-corrected batch variance;
    * training with ``exponential_avg_factor != 1``: mean/variance are the running statistics
      and the returned ones are blended, ``(1-f)*old + f*batch``;
    * inference (``is_training=False``): mean/variance are the population statistics.

    epsilon is passed through unchanged, as TF 2.21's wrapper does (older TF wrappers raised it
    to at least 1.001e-5, a cuDNN requirement; TF 2.21's does not).

    Gradients flow to x, scale and offset (none to mean/variance, as with TF's op); they are
    computed by the "FbnGrad>FusedBatchNormGradV3" op, including channels-first inference,
    which our op computes natively. Inside tf.function(jit_compile=True) our ops cannot be
    compiled, so TF's forward and built-in gradient are used instead (one-time
    RuntimeWarning).

    activation: None, "relu", "relu6" or "swish" (= "silu") for y = act(batch_norm(x)) in the
    same pass; side_input: None or a tensor of x's shape and dtype, added before the
    activation: y = act(batch_norm(x) + side_input) (a residual connection; its gradient is
    the activation's). The backward computes the activation's derivative inside our backward
    kernel (Swish, and on the CPU float Relu/Relu6, from z recomputed from x; otherwise
    Relu/Relu6 from y): no extra pass, no extra tensor.
    forward: "ours" (default; our "FbnGrad>FusedBatchNormV3" op where it can run, see
    our_forward_available(), else TF's) or "tf" (TF's FusedBatchNormV3, then the side input
    and the activation with TF ops). Both give the same results up to float rounding, and their
    outputs can be mixed with either backward.

    Returns:
      (y, running_mean, running_var).
    """
    if (not is_training or exponential_avg_factor != 1.0) and (
            (mean is None) or (variance is None)):
        raise ValueError("Both `mean` and `variance` must be a 1D tensor when "
                         "`is_training` is False or `exponential_avg_factor` != "
                         f"1.0. Received: `mean` {mean!r} and `variance` "
                         f"{variance!r}")
    if isinstance(data_format, bytes):
        data_format = data_format.decode()
    if data_format not in _DATA_FORMATS:
        raise ValueError("data_format must be one of %s, got %r"
                         % (", ".join(_DATA_FORMATS), data_format))
    activation = check_forward_and_activation(forward, activation)
    is_training = bool(is_training)
    epsilon = float(epsilon)
    exponential_avg_factor = float(exponential_avg_factor)
    x = tf.convert_to_tensor(x, name="input")
    scale = tf.convert_to_tensor(scale, name="scale")
    offset = tf.convert_to_tensor(offset, name="offset")
    mean = tf.constant([]) if mean is None else tf.convert_to_tensor(mean)
    variance = tf.constant([]) if variance is None else tf.convert_to_tensor(variance)
    if side_input is not None:
        side_input = tf.convert_to_tensor(side_input, name="side_input")
        if side_input.dtype != x.dtype:
            raise TypeError("side_input must have the dtype of x (%s), got %s"
                            % (x.dtype.name, side_input.dtype.name))
        if (side_input.shape.rank is not None and x.shape.rank is not None
                and not side_input.shape.is_compatible_with(x.shape)):
            raise ValueError("side_input must have the shape of x %s, got shape %s"
                             % (x.shape, side_input.shape))
    params = BatchNormParams(
        epsilon=epsilon, exponential_avg_factor=exponential_avg_factor,
        data_format=data_format, is_training=is_training, name=name, forward=forward,
        activation=activation, side_input=side_input)
    if _grads.in_xla_context():
        # TF's forward op has an XLA kernel and its registered gradient too; ours do not.
        _grads.warn_xla_fallback("fbn_grad_tf.fused_batch_norm")
        y, running_mean, running_var, _, _, _ = tf.raw_ops.FusedBatchNormV3(
            x=x, scale=scale, offset=offset, mean=mean, variance=variance,
            **params.op_attrs())
        return apply_activation(y, activation, side_input), running_mean, running_var
    return _fused_batch_norm_v3(x, scale, offset, mean, variance, params)


def _our_forward(x, scale, offset, mean, variance, params):
    """Our forward op; its gradient is registered by op type (gradients.py). Every
    activation mode and the side input are fused on CPU and GPU alike (the CUDA kernels of
    every mode were checked against float64 references on an H200: docs/GPU.md)."""
    kw = dict(x=x, scale=scale, offset=offset, mean=mean, variance=variance,
              **params.op_attrs())
    if params.activation is not None or params.side_input is not None:
        side = [] if params.side_input is None else [params.side_input]
        mode = "Identity" if params.activation is None else _ACTIVATION_MODES[params.activation]
        return _loader.raw_forward_ex_op(side_input=side, activation_mode=mode, **kw)
    return _loader.raw_forward_op(**kw)


def _fused_batch_norm_v3(x, scale, offset, mean, variance, params):
    """The forward (ours, or TF's FusedBatchNormV3 with a custom gradient that calls our op),
    as `params` (a BatchNormParams) says.

    Returns (y, batch_mean, batch_variance) (plus reserve_space_1/2 if
    params.return_reserve)."""
    if params.forward == "ours" and our_forward_available():
        y, batch_mean, batch_var, rs1, rs2, _ = _our_forward(x, scale, offset, mean, variance,
                                                             params)
        outs = (y, batch_mean, batch_var)
        if params.return_reserve:
            outs += (tf.stop_gradient(rs1), tf.stop_gradient(rs2))
        return outs
    outs = _tf_forward_our_backward(x, scale, offset, mean, variance, params)
    return ((apply_activation(outs[0], params.activation, params.side_input),)
            + tuple(outs[1:]))


def _tf_forward_our_backward(x, scale, offset, mean, variance, params):
    """TF's FusedBatchNormV3 forward with a custom gradient that calls our op."""
    epsilon, data_format, is_training = params.epsilon, params.data_format, params.is_training

    @tf.custom_gradient
    def _fbn(x, scale, offset, mean, variance):
        y, batch_mean, batch_var, rs1, rs2, rs3 = tf.raw_ops.FusedBatchNormV3(
            x=x, scale=scale, offset=offset, mean=mean, variance=variance,
            **params.op_attrs())

        def grad(dy, *unused_stat_grads):
            # Like TF's gradient: only dy is used; mean/variance get no gradient.
            if dy is None:
                dy = tf.zeros_like(y)
            if is_training:
                saved_mean, saved_var = rs1, rs2
            else:
                saved_mean, saved_var = mean, variance
            dx, dscale, doffset = _grads.fbn_backward(
                dy, x, scale, saved_mean, saved_var, rs3, epsilon, data_format, is_training,
                where="fbn_grad_tf.fused_batch_norm")
            if dscale.dtype != scale.dtype:
                dscale = tf.cast(dscale, scale.dtype)
            if doffset.dtype != offset.dtype:
                doffset = tf.cast(doffset, offset.dtype)
            return dx, dscale, doffset, None, None

        outs = (y, batch_mean, batch_var)
        if params.return_reserve:
            outs += (tf.stop_gradient(rs1), tf.stop_gradient(rs2))
        return outs, grad

    return _fbn(x, scale, offset, mean, variance)


# ---- use_for_gradients ----------------------------------------------------------------------

_FORWARD_OPS = tuple(_grads.FORWARD_GRAD_NAMES)
_patch_lock = threading.RLock()
_patch_depth = collections.Counter()
_saved_entries = {}


def _gradient_registry():
    return _tf_ops._gradient_registry  # pylint: disable=protected-access


@contextlib.contextmanager
def _patched_gradient_registry(op_types):
    """Swaps TF's registered gradient function of `op_types` for ours while active.

    Reference-counted per op type, so nesting and concurrent use from several threads restore
    TF's entry only when the last user leaves. The registry is process-global: while any
    thread is inside, *every* thread's gradients of these ops use our op."""
    table = _gradient_registry()._registry  # pylint: disable=protected-access
    type_tag = _tf_registry._TYPE_TAG  # pylint: disable=protected-access
    with _patch_lock:
        for t in op_types:
            if _patch_depth[t] == 0:
                saved = table.get(t)
                _saved_entries[t] = saved
                entry = dict(saved) if saved is not None else {
                    _tf_registry._LOCATION_TAG: None}  # pylint: disable=protected-access
                entry[type_tag] = _grads.FORWARD_GRAD_FUNCTIONS[t]
                table[t] = entry
            _patch_depth[t] += 1
    try:
        yield
    finally:
        with _patch_lock:
            for t in op_types:
                _patch_depth[t] -= 1
                if _patch_depth[t] == 0:
                    saved = _saved_entries.pop(t)
                    if saved is None:
                        table.pop(t, None)
                    else:
                        table[t] = saved


# Per graph and op type: [blocks active, the override that was there before (or _ABSENT)].
_graph_tags = weakref.WeakKeyDictionary()
_ABSENT = object()


@contextlib.contextmanager
def _tagged_graph(graph, mapping):
    """While active, `graph` tags the forward ops of `mapping`'s op types with our gradient
    (the gradient override map that Graph.gradient_override_map sets). Reference-counted per
    graph and op type under the patch lock, so blocks that overlap on one graph from several
    threads, or exit out of order, keep the tag until the last one leaves and then restore
    what was there (Graph.gradient_override_map restores a snapshot: an overlapping block
    dropped the tag early and left it for good)."""
    table = graph._gradient_override_map  # pylint: disable=protected-access
    with _patch_lock:
        entries = _graph_tags.setdefault(graph, {})
        for op_type, name in mapping.items():
            entry = entries.get(op_type)
            if entry is None:
                entry = entries[op_type] = [0, table.get(op_type, _ABSENT)]
                table[op_type] = name
            entry[0] += 1
    try:
        yield
    finally:
        with _patch_lock:
            for op_type in mapping:
                entry = entries[op_type]
                entry[0] -= 1
                if entry[0] == 0:
                    del entries[op_type]
                    if entry[1] is _ABSENT:
                        table.pop(op_type, None)
                    else:
                        table[op_type] = entry[1]


_forward_patch_depth = 0
_saved_forward = None


def _our_fused_batch_norm_v3(tf_function):
    """A stand-in for gen_nn_ops.fused_batch_norm_v3 that builds our forward op for training
    where it can run (our_forward_available(), float32 statistics, not inside XLA) and a
    gradient may be taken (_grads.gradient_may_be_taken), else TF's. Inference, and the
    training-mode traces a SavedModel makes without a tape, keep TF's op, so that what is
    saved from models traced under the patch (tf_keras under
    fbn_grad_tf.keras.override()) holds only TF's ops."""

    def fused_batch_norm_v3(x, scale, offset, mean, variance, epsilon=0.0001,
                            exponential_avg_factor=1, data_format="NHWC", is_training=True,
                            name=None):
        kw = dict(epsilon=epsilon, exponential_avg_factor=exponential_avg_factor,
                  data_format=data_format, is_training=is_training, name=name)
        vecs = [tf.convert_to_tensor(v) for v in (scale, offset, mean, variance)]
        if (is_training and our_forward_available() and not _grads.in_xla_context()
                and all(v.dtype == tf.float32 for v in vecs)
                and _grads.gradient_may_be_taken()):
            return _loader.raw_forward_op(x=x, scale=vecs[0], offset=vecs[1], mean=vecs[2],
                                          variance=vecs[3], **kw)
        return tf_function(x, *vecs, **kw)

    fused_batch_norm_v3.__wrapped__ = tf_function
    return fused_batch_norm_v3


@contextlib.contextmanager
def _patched_forward():
    """While active, TF's Python builder of FusedBatchNormV3 ops (gen_nn_ops, used by
    tf.compat.v1.nn.fused_batch_norm, tf.nn.fused_batch_norm and tf_keras' fused layer)
    builds our forward op instead. Reference-counted and process-global, like the
    registry patch."""
    from tensorflow.python.ops import gen_nn_ops
    global _forward_patch_depth, _saved_forward
    with _patch_lock:
        if _forward_patch_depth == 0:
            _saved_forward = gen_nn_ops.fused_batch_norm_v3
            gen_nn_ops.fused_batch_norm_v3 = _our_fused_batch_norm_v3(_saved_forward)
        _forward_patch_depth += 1
    try:
        yield
    finally:
        with _patch_lock:
            _forward_patch_depth -= 1
            if _forward_patch_depth == 0:
                gen_nn_ops.fused_batch_norm_v3 = _saved_forward
                _saved_forward = None


def registry_patched(op_type="FusedBatchNormV3"):
    """True while a use_for_gradients() context has swapped `op_type`'s gradient function."""
    return _patch_depth[op_type] > 0


class use_for_gradients(contextlib.ContextDecorator):  # noqa: N801 (reads like a function)
    """Compute gradients of TF's FusedBatchNormV3/V2/FusedBatchNorm with fbn_grad_tf's op.

    Use as a context manager or decorator::

        with fbn_grad_tf.use_for_gradients():
            with tf.GradientTape() as tape:
                y, _, _ = tf.compat.v1.nn.fused_batch_norm(x, scale, offset)
                loss = ...
            grads = tape.gradient(loss, [x, scale, offset])

        @tf.function
        @fbn_grad_tf.use_for_gradients()
        def train_step(...): ...

    Three mechanisms, all on by default:

    forward=True
        While the block is active, FusedBatchNormV3 ops built from Python through TF's
        builder (tf.compat.v1.nn.fused_batch_norm, tf.nn.fused_batch_norm, tf_keras' fused
        BatchNormalization; not tf.raw_ops.FusedBatchNormV3, which is bound at import) are
        our forward op "FbnGrad>FusedBatchNormV3" instead (same signature and outputs; its
        gradient is ours), where our forward can run (see our_forward_available()).
        Process-global while active, like registry=True.

    graph=True
        If entered while a graph is being built (inside tf.function tracing, or in a TF1
        ``tf.Graph``), ``graph.gradient_override_map({"FusedBatchNormV3": "FbnGrad>
        FusedBatchNormV3", ...})`` is active on that graph, so every forward op *created* in
        the block is tagged (attr ``_gradient_op_type``). Gradients built later by
        ``tf.gradients``/``tf.compat.v1.gradients``, or by a GradientTape outside the
        tf.function that traced the op, use our op even after the block has exited.
        GradientTape *inside* a tf.function ignores this tag. Ops built in the graphs of
        tf.cond / tf.while_loop branches or of a nested tf.function are not tagged (TF
        does not carry the map into them): build their gradients inside the block
        (registry=True), or their forward with TF's Python builder (forward=True).
        Reference-counted per graph: blocks that overlap on one graph keep the tag until
        the last leaves.

    registry=True
        While the block is active, TF's gradient registry entry for those op types is
        swapped for ours (restored on exit, reference-counted). Every gradient *built* in the
        block uses our op: eager GradientTape (the tape looks gradients up when
        ``tape.gradient`` runs, so that call must be inside the block), GradientTape inside a
        tf.function being traced, tf.gradients. The registry is process-global: other threads
        computing batch-norm gradients at the same time also get our op.

    SavedModel: tf.saved_model.save of a function traced with graph=True needs
    SaveOptions(experimental_custom_gradients=False) (SavedModel cannot serialize op-tagged
    gradients; the loaded ops keep the tag and use our gradient once fbn_grad_tf is imported).

    Not covered: gradients already built before entering (a tf.function's cached
    backward function, Keras' already-traced train_function), and Keras 3's own
    keras.layers.BatchNormalization, which does not use FusedBatchNorm ops at all (use
    fbn_grad_tf.keras.BatchNormalization). Inside XLA (jit_compile=True) TF's gradient op is
    used (one-time warning).
    """

    def __init__(self, graph=True, registry=True, op_types=_FORWARD_OPS, forward=True):
        op_types = (op_types,) if isinstance(op_types, str) else tuple(op_types)
        for t in op_types:
            if t not in _grads.FORWARD_GRAD_NAMES:
                raise ValueError("op_types: %r is not one of %s" % (t, ", ".join(_FORWARD_OPS)))
        self._graph = bool(graph)
        self._registry = bool(registry)
        self._op_types = op_types
        self._forward = bool(forward) and "FusedBatchNormV3" in op_types
        self._stacks = threading.local()

    def _recreate_cm(self):
        # Decorator use: a fresh context per call (reentrancy, recursion, threads).
        return use_for_gradients(self._graph, self._registry, self._op_types, self._forward)

    def __enter__(self):
        stack = contextlib.ExitStack()
        try:
            if self._graph and not tf.executing_eagerly():
                stack.enter_context(_tagged_graph(
                    tf.compat.v1.get_default_graph(),
                    {t: _grads.FORWARD_GRAD_NAMES[t] for t in self._op_types}))
            if self._registry:
                stack.enter_context(_patched_gradient_registry(self._op_types))
            if self._forward:
                stack.enter_context(_patched_forward())
        except BaseException:
            stack.close()
            raise
        if not hasattr(self._stacks, "items"):
            self._stacks.items = []
        self._stacks.items.append(stack)
        return self

    def __exit__(self, *exc):
        self._stacks.items.pop().close()
        return False
