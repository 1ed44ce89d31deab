"""The Java-style API (mirrors of org.tensorflow.op.nn.FusedBatchNormGrad and
org.tensorflow.op.nn.FusedBatchNorm) and functional forms.

    from fbn_grad_tf import FusedBatchNorm, FusedBatchNormGrad, Scope
    fwd = FusedBatchNorm.create(Scope(), x, scale, offset, mean, var,
                                FusedBatchNorm.exponential_avg_factor(0.1))
    op = FusedBatchNormGrad.create(Scope(), dy, x, scale, mean, var, rs3,
                                   FusedBatchNormGrad.data_format("NCHW"),
                                   FusedBatchNormGrad.is_training(False))
    dx = op.x_backprop()
"""
import collections
import contextlib
import numbers
import re

import numpy as np
import tensorflow as tf

from . import _core
from ._loader import (FORWARD_EX_OP_NAME, FORWARD_OP_NAME, REGISTERED_OP_NAME,
                      raw_forward_ex_op, raw_forward_op, raw_op)

DATA_FORMATS = ("NHWC", "NCHW", "NDHWC", "NCDHW")
_T_DTYPES = (tf.float16, tf.bfloat16, tf.float32)

FusedBatchNormGradOutputs = collections.namedtuple(
    "FusedBatchNormGradOutputs",
    ["x_backprop", "scale_backprop", "offset_backprop", "reserve_space_4", "reserve_space_5"])
FusedBatchNormOutputs = collections.namedtuple(
    "FusedBatchNormOutputs",
    ["y", "batch_mean", "batch_variance", "reserve_space_1", "reserve_space_2",
     "reserve_space_3"])


# ---- argument checks (Python side: what can be known before the kernel runs) -----------

def _check_data_format(data_format):
    if not isinstance(data_format, (str, bytes)):
        raise TypeError("data_format must be a string, got %r" % (data_format,))
    if isinstance(data_format, bytes):
        data_format = data_format.decode()
    if data_format not in DATA_FORMATS:
        raise ValueError("data_format must be one of %s, got %r" % (", ".join(DATA_FORMATS),
                                                                    data_format))
    return data_format


def _check_epsilon(epsilon):
    if isinstance(epsilon, bool) or not isinstance(epsilon, numbers.Real):
        raise TypeError("epsilon must be a real number, got %r" % (epsilon,))
    return float(epsilon)


def _check_factor(factor):
    if isinstance(factor, bool) or not isinstance(factor, numbers.Real):
        raise TypeError("exponential_avg_factor must be a real number, got %r" % (factor,))
    return float(factor)


#: activation argument (lower case) -> the op's activation_mode ("silu" is "swish").
_ACTIVATION_MODES = {"identity": "Identity", "relu": "Relu", "relu6": "Relu6",
                     "swish": "Swish", "silu": "Swish"}


def _check_activation(activation):
    """None/"identity" -> "Identity", "relu" -> "Relu", "relu6" -> "Relu6", "swish"/"silu" ->
    "Swish" (the op's activation_mode)."""
    name = "identity" if activation is None else activation
    if isinstance(name, str) and name.lower() in _ACTIVATION_MODES:
        return _ACTIVATION_MODES[name.lower()]
    raise ValueError("activation must be None or one of %s, got %r"
                     % (", ".join('"%s"' % a for a in _ACTIVATION_MODES), activation))


def _check_is_training(is_training):
    if not isinstance(is_training, (bool, np.bool_)):
        raise TypeError("is_training must be a bool, got %r" % (is_training,))
    return bool(is_training)


def _as_tensor(value, name, dtypes):
    t = tf.convert_to_tensor(value)
    if t.dtype not in dtypes:
        raise TypeError("%s must have dtype %s, got %s" % (
            name, " or ".join(d.name for d in dtypes), t.dtype.name))
    return t


def _static_validate(tensors, data_format, epsilon):
    """Runs the core's validation when every static shape is fully known (always in eager):
    the same checks and messages as the kernel, raised as ValueError."""
    shapes = [t.shape for t in tensors[:5]]
    if all(s.is_fully_defined() for s in shapes):
        _core.validate([s.as_list() for s in shapes], data_format, epsilon)
        return
    if shapes[1].rank is not None:
        rank = 5 if data_format in ("NDHWC", "NCDHW") else 4
        if shapes[1].rank != rank:
            raise ValueError("x must be %d-dimensional for data_format %s, got shape %s"
                             % (rank, data_format, shapes[1]))


def fused_batch_norm_grad(y_backprop, x, scale, reserve_space_1, reserve_space_2,
                          reserve_space_3, epsilon=0.0001, data_format="NHWC", is_training=True,
                          name=None):
    """Batch-norm backward with the semantics of tf.raw_ops.FusedBatchNormGradV3.

    reserve_space_1/2: in training, the batch mean and what the forward saved in
    reserve_space_2 (the biased batch variance on CPU); in inference, the population mean
    and variance. reserve_space_3 is accepted in any shape and ignored.

    Returns FusedBatchNormGradOutputs(x_backprop, scale_backprop, offset_backprop,
    reserve_space_4, reserve_space_5); the last two are empty [0] tensors.
    """
    data_format = _check_data_format(data_format)
    epsilon = _check_epsilon(epsilon)
    is_training = _check_is_training(is_training)
    dy = _as_tensor(y_backprop, "y_backprop", _T_DTYPES)
    xt = _as_tensor(x, "x", _T_DTYPES)
    if dy.dtype != xt.dtype:
        raise TypeError("y_backprop and x must have the same dtype, got %s and %s"
                        % (dy.dtype.name, xt.dtype.name))
    sc = _as_tensor(scale, "scale", (tf.float32,))
    rs1 = _as_tensor(reserve_space_1, "reserve_space_1", (tf.float32,))
    rs2 = _as_tensor(reserve_space_2, "reserve_space_2", (tf.float32,))
    rs3 = _as_tensor(reserve_space_3, "reserve_space_3", (tf.float32,))
    _static_validate((dy, xt, sc, rs1, rs2), data_format, epsilon)
    outputs = raw_op(y_backprop=dy, x=xt, scale=sc, reserve_space_1=rs1, reserve_space_2=rs2,
                     reserve_space_3=rs3, epsilon=epsilon, data_format=data_format,
                     is_training=is_training, name=name or "FusedBatchNormGrad")
    return FusedBatchNormGradOutputs(*outputs)


def fused_batch_norm_v3(x, scale, offset, mean, variance, epsilon=0.0001,
                        exponential_avg_factor=1.0, data_format="NHWC", is_training=True,
                        activation=None, name=None, side_input=None):
    """Batch-norm forward with the semantics of tf.raw_ops.FusedBatchNormV3, by our op
    ("FbnGrad>FusedBatchNormV3"; "FbnGrad>FusedBatchNormEx" with an activation ("relu",
    "relu6", "swish"/"silu") or a side_input: y = act(bn(x) + side_input)).

    mean/variance: the running statistics; in training with exponential_avg_factor == 1 they
    are not read and may be empty ([0]) tensors, as with TF. reserve_space_2 receives the
    biased batch variance on CPU and 1/sqrt(var + epsilon) on GPU, like TF's kernels, so
    both backwards (ours and TF's) read it correctly.

    Returns FusedBatchNormOutputs(y, batch_mean, batch_variance, reserve_space_1,
    reserve_space_2, reserve_space_3); reserve_space_3 is an empty [0] tensor, except from
    the CPU kernel (AVX2 or AVX-512 CPUs) in training with relu/relu6 where its backward would
    read y for the mask (the 16-bit types; float with a side input): it then holds that mask,
    16 elements per finite float word plus tag words, which the fused backward reads instead.
    """
    data_format = _check_data_format(data_format)
    epsilon = _check_epsilon(epsilon)
    factor = _check_factor(exponential_avg_factor)
    is_training = _check_is_training(is_training)
    mode = _check_activation(activation)
    xt = _as_tensor(x, "x", _T_DTYPES)
    vecs = [_as_tensor(v, n, (tf.float32,)) for v, n in
            ((scale, "scale"), (offset, "offset"), (mean, "mean"), (variance, "variance"))]
    side = None
    if side_input is not None:
        side = _as_tensor(side_input, "side_input", _T_DTYPES)
        if side.dtype != xt.dtype:
            raise TypeError("side_input must have the dtype of x (%s), got %s"
                            % (xt.dtype.name, side.dtype.name))
    shapes = [t.shape for t in [xt] + vecs + ([] if side is None else [side])]
    if all(sh.is_fully_defined() for sh in shapes):
        _core.validate_forward([sh.as_list() for sh in shapes], data_format, epsilon, factor,
                               is_training, mode)
    kw = dict(x=xt, scale=vecs[0], offset=vecs[1], mean=vecs[2], variance=vecs[3],
              epsilon=epsilon, exponential_avg_factor=factor, data_format=data_format,
              is_training=is_training, name=name or "FusedBatchNorm")
    if mode == "Identity" and side is None:
        outputs = raw_forward_op(**kw)
    else:
        outputs = raw_forward_ex_op(side_input=[] if side is None else [side],
                                    activation_mode=mode, **kw)
    return FusedBatchNormOutputs(*outputs)


# ---- Scope -------------------------------------------------------------------------------

class Scope:
    """Where ops are built, like org.tensorflow.op.Scope.

    ``Scope()`` (or ``None`` wherever a scope is taken) means the current default context:
    eager execution, the tf.function being traced, or the default tf.Graph. ``Scope(graph)``
    builds into that graph. Scopes are immutable: every ``with_*`` returns a new one.
    """

    def __init__(self, graph=None, _name=None, _prefix=(), _device=None, _control=()):
        if graph is not None and not isinstance(graph, tf.Graph):
            raise TypeError("graph must be a tf.Graph or None, got %r" % (graph,))
        self._graph = graph
        self._name = _name
        self._prefix = tuple(_prefix)
        self._device = _device
        self._control = tuple(_control)

    def _replace(self, **kw):
        state = dict(graph=self._graph, _name=self._name, _prefix=self._prefix,
                     _device=self._device, _control=self._control)
        state.update(kw)
        return Scope(**state)

    # TF's rules for op names and name scopes (one path component each here), checked when
    # the scope is made, as Java's Scope does, not when an op is built (which in eager code
    # would never be: eager ops are not named).
    _VALID_NAME = re.compile(r"^[A-Za-z0-9.][A-Za-z0-9_.\-]*$")

    @classmethod
    def _check_name(cls, name, what):
        if not isinstance(name, str) or not name:
            raise ValueError("%s must be a non-empty string, got %r" % (what, name))
        if not cls._VALID_NAME.match(name):
            raise ValueError("%s %r is not a valid TensorFlow name: a letter, digit or '.', "
                             "then letters, digits, '_', '.' or '-'" % (what, name))
        return name

    def with_name(self, name):
        """The next op built in this scope is named `name` (unique-ified by TF)."""
        return self._replace(_name=self._check_name(name, "op name"))

    def with_sub_scope(self, child_scope_name):
        """Ops are named under `<current prefix>/<child_scope_name>/`."""
        name = self._check_name(child_scope_name, "sub-scope name")
        return self._replace(_prefix=self._prefix + (name,), _name=None)

    def with_device(self, device):
        """Ops are placed on `device` (a string such as "/CPU:0", or a tf.DeviceSpec)."""
        if hasattr(device, "to_string"):
            device = device.to_string()
        if not isinstance(device, str):
            raise TypeError("device must be a string such as \"/CPU:0\" or a tf.DeviceSpec, "
                            "got %r" % (device,))
        tf.DeviceSpec.from_string(device)  # ValueError now for a malformed spec
        return self._replace(_device=device)

    def with_control_dependencies(self, controls):
        """Ops built in this scope run after `controls` (a list of ops or tensors, or one)
        in graphs."""
        if (isinstance(controls, (tf.Operation, tf.Tensor, tf.Variable))
                or not hasattr(controls, "__iter__")):
            controls = (controls,)
        return self._replace(_control=self._control + tuple(controls))

    # Java camelCase aliases.
    withName = with_name
    withSubScope = with_sub_scope
    withDevice = with_device
    withControlDependencies = with_control_dependencies

    @property
    def graph(self):
        return self._graph

    def make_op_name(self, default_name):
        return self._name or default_name

    def is_eager(self):
        return self._graph is None and tf.executing_eagerly()

    @contextlib.contextmanager
    def context(self):
        """Enters the graph, name scopes, device and control dependencies of this scope."""
        with contextlib.ExitStack() as stack:
            if self._graph is not None:
                stack.enter_context(self._graph.as_default())
            if self._prefix:
                # An absolute scope ("outer/inner/") is re-entered as is: every op built in
                # this Scope lands under the same prefix, as in Java (a relative name_scope
                # would become outer_1/ on the second use).
                current = tf.get_current_name_scope()
                absolute = (current + "/" if current else "") + "/".join(self._prefix) + "/"
                stack.enter_context(tf.name_scope(absolute))
            if self._device is not None:
                stack.enter_context(tf.device(self._device))
            if self._control:
                stack.enter_context(tf.control_dependencies(self._control))
            yield self

    def __repr__(self):
        return "Scope(graph=%r, name=%r, prefix=%r, device=%r, controls=%d)" % (
            self._graph, self._name, "/".join(self._prefix), self._device, len(self._control))


# ---- the output side shared by the Java mirrors --------------------------------------------

class _OpOutputs:
    """Holds an op's outputs (a namedtuple of type _OUTPUTS): the tf.Operation in graph
    mode, the namedtuple, and sequence access, like the Java classes' Operand lists."""

    _OUTPUTS = None  # set by subclasses

    def __init__(self, outputs):
        self._outputs = self._OUTPUTS(*outputs)

    @property
    def op(self):
        """The tf.Operation in graph mode (None in eager mode)."""
        try:
            return self._outputs[0].op
        except AttributeError:
            return None

    def outputs(self):
        return self._outputs

    def __iter__(self):
        return iter(self._outputs)

    def __len__(self):
        return len(self._outputs)

    def __getitem__(self, i):
        return self._outputs[i]

    def __repr__(self):
        return "%s(%s)" % (type(self).__name__, ", ".join(
            "%s=%s" % (k, getattr(v, "shape", v)) for k, v in self._outputs._asdict().items()))


# ---- FusedBatchNormGrad (Java mirror) ------------------------------------------------------

class FusedBatchNormGrad(_OpOutputs):
    """Mirror of org.tensorflow.op.nn.FusedBatchNormGrad, backed by our op.

    OP_NAME is the op type this class builds, "FbnGrad>FusedBatchNormGradV3": our op, with
    the signature of TF's built-in "FusedBatchNormGradV3" (Java's OP_NAME), which is kept
    as MIRRORED_OP_NAME.
    """

    _OUTPUTS = FusedBatchNormGradOutputs
    OP_NAME = REGISTERED_OP_NAME
    MIRRORED_OP_NAME = "FusedBatchNormGradV3"
    DEFAULT_NAME = "FusedBatchNormGrad"

    class Options:
        """Optional attributes; unset fields keep the op defaults (1e-4, "NHWC", True)."""

        def __init__(self):
            self._epsilon = None
            self._data_format = None
            self._is_training = None

        def epsilon(self, epsilon):
            self._epsilon = _check_epsilon(epsilon)
            return self

        def data_format(self, data_format):
            self._data_format = _check_data_format(data_format)
            return self

        def is_training(self, is_training):
            self._is_training = _check_is_training(is_training)
            return self

        dataFormat = data_format
        isTraining = is_training

        def __repr__(self):
            return "FusedBatchNormGrad.Options(epsilon=%r, data_format=%r, is_training=%r)" % (
                self._epsilon, self._data_format, self._is_training)

    @staticmethod
    def epsilon(epsilon):
        return FusedBatchNormGrad.Options().epsilon(epsilon)

    @staticmethod
    def data_format(data_format):
        return FusedBatchNormGrad.Options().data_format(data_format)

    @staticmethod
    def is_training(is_training):
        return FusedBatchNormGrad.Options().is_training(is_training)

    dataFormat = data_format
    isTraining = is_training

    @classmethod
    def create(cls, scope, y_backprop, x, scale, reserve_space_1, reserve_space_2,
               reserve_space_3, *options):
        """Builds the op in `scope` (None = current context). Options are applied in order;
        a later value of the same attribute wins, as in Java."""
        if scope is None:
            scope = Scope()
        if not isinstance(scope, Scope):
            raise TypeError("scope must be a fbn_grad_tf.Scope or None, got %r" % (scope,))
        attrs = {"epsilon": 0.0001, "data_format": "NHWC", "is_training": True}
        for opt in _flatten_options(options):
            if opt._epsilon is not None:
                attrs["epsilon"] = opt._epsilon
            if opt._data_format is not None:
                attrs["data_format"] = opt._data_format
            if opt._is_training is not None:
                attrs["is_training"] = opt._is_training
        with scope.context():
            outputs = fused_batch_norm_grad(
                y_backprop, x, scale, reserve_space_1, reserve_space_2, reserve_space_3,
                name=scope.make_op_name(cls.DEFAULT_NAME), **attrs)
        return cls(outputs)

    def x_backprop(self):
        return self._outputs.x_backprop

    def scale_backprop(self):
        return self._outputs.scale_backprop

    def offset_backprop(self):
        return self._outputs.offset_backprop

    def reserve_space_4(self):
        return self._outputs.reserve_space_4

    def reserve_space_5(self):
        return self._outputs.reserve_space_5

    xBackprop = x_backprop
    scaleBackprop = scale_backprop
    offsetBackprop = offset_backprop
    reserveSpace4 = reserve_space_4
    reserveSpace5 = reserve_space_5



def _flatten_options(options, cls=None):
    cls = cls or FusedBatchNormGrad
    for opt in options:
        if isinstance(opt, (list, tuple)):
            yield from _flatten_options(opt, cls)
        elif isinstance(opt, cls.Options):
            yield opt
        else:
            raise TypeError("options must be %s.Options (from its static option builders), "
                            "got %r" % (cls.__name__, opt))


# ---- FusedBatchNorm (Java mirror of the forward) ---------------------------------------------

class FusedBatchNorm(_OpOutputs):
    """Mirror of org.tensorflow.op.nn.FusedBatchNorm, backed by our forward op.

    OP_NAME is the op type this class builds, "FbnGrad>FusedBatchNormV3" (TF's
    "FusedBatchNormV3", Java's OP_NAME, is kept as MIRRORED_OP_NAME); with the extra options
    activation("relu" | "relu6" | "swish") and side_input(tensor) it builds
    "FbnGrad>FusedBatchNormEx" (y = act(batch_norm(x) + side_input), TF's _FusedBatchNormEx).
    Gradients flow through either, to our backward (the side input's too).
    """

    _OUTPUTS = FusedBatchNormOutputs
    OP_NAME = FORWARD_OP_NAME
    EX_OP_NAME = FORWARD_EX_OP_NAME
    MIRRORED_OP_NAME = "FusedBatchNormV3"
    DEFAULT_NAME = "FusedBatchNorm"
    _ATTRS = ("epsilon", "exponential_avg_factor", "data_format", "is_training", "activation",
              "side_input")
    _DEFAULTS = {"epsilon": 0.0001, "exponential_avg_factor": 1.0, "data_format": "NHWC",
                 "is_training": True, "activation": None, "side_input": None}

    class Options:
        """Optional attributes; unset fields keep the op defaults (epsilon 1e-4,
        exponential_avg_factor 1.0, "NHWC", is_training True, no activation)."""

        def __init__(self):
            self._values = {}

        def epsilon(self, epsilon):
            self._values["epsilon"] = _check_epsilon(epsilon)
            return self

        def exponential_avg_factor(self, factor):
            self._values["exponential_avg_factor"] = _check_factor(factor)
            return self

        def data_format(self, data_format):
            self._values["data_format"] = _check_data_format(data_format)
            return self

        def is_training(self, is_training):
            self._values["is_training"] = _check_is_training(is_training)
            return self

        def activation(self, activation):
            _check_activation(activation)
            self._values["activation"] = activation
            return self

        def side_input(self, side_input):
            """y = act(batch_norm(x) + side_input): a tensor of x's shape and dtype (None:
            no side input)."""
            self._values["side_input"] = side_input
            return self

        exponentialAvgFactor = exponential_avg_factor
        dataFormat = data_format
        isTraining = is_training
        sideInput = side_input

        def __repr__(self):
            return "FusedBatchNorm.Options(%s)" % ", ".join(
                "%s=%r" % kv for kv in sorted(self._values.items()))

    @staticmethod
    def epsilon(epsilon):
        return FusedBatchNorm.Options().epsilon(epsilon)

    @staticmethod
    def exponential_avg_factor(factor):
        return FusedBatchNorm.Options().exponential_avg_factor(factor)

    @staticmethod
    def data_format(data_format):
        return FusedBatchNorm.Options().data_format(data_format)

    @staticmethod
    def is_training(is_training):
        return FusedBatchNorm.Options().is_training(is_training)

    @staticmethod
    def activation(activation):
        return FusedBatchNorm.Options().activation(activation)

    @staticmethod
    def side_input(side_input):
        return FusedBatchNorm.Options().side_input(side_input)

    exponentialAvgFactor = exponential_avg_factor
    dataFormat = data_format
    isTraining = is_training
    sideInput = side_input

    @classmethod
    def create(cls, scope, x, scale, offset, mean, variance, *options):
        """Builds the op in `scope` (None = current context). Options are applied in order;
        a later value of the same attribute wins, as in Java."""
        if scope is None:
            scope = Scope()
        if not isinstance(scope, Scope):
            raise TypeError("scope must be a fbn_grad_tf.Scope or None, got %r" % (scope,))
        attrs = dict(cls._DEFAULTS)
        for opt in _flatten_options(options, cls):
            attrs.update(opt._values)
        with scope.context():
            outputs = fused_batch_norm_v3(x, scale, offset, mean, variance,
                                          name=scope.make_op_name(cls.DEFAULT_NAME), **attrs)
        return cls(outputs)

    def y(self):
        return self._outputs.y

    def batch_mean(self):
        return self._outputs.batch_mean

    def batch_variance(self):
        return self._outputs.batch_variance

    def reserve_space_1(self):
        return self._outputs.reserve_space_1

    def reserve_space_2(self):
        return self._outputs.reserve_space_2

    def reserve_space_3(self):
        return self._outputs.reserve_space_3

    batchMean = batch_mean
    batchVariance = batch_variance
    reserveSpace1 = reserve_space_1
    reserveSpace2 = reserve_space_2
    reserveSpace3 = reserve_space_3

