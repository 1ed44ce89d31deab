"""Synchronized (cross-replica) batch normalization with fbn_grad_tf's split backward.

Three layers of API (docs/SYNC.md explains when to use which):

``batch_norm_grad_reduce`` / ``batch_norm_grad_apply``
    Checked wrappers of the split ops "FbnGrad>BatchNormGradReduce" (local per-channel sums
    ``sum_dy``, ``sum_dy_xmu`` and the element count) and "FbnGrad>BatchNormGradApply"
    (``x_backprop`` from sums, typically all-reduced across replicas). With the local sums,
    reduce + apply equals the fused "FbnGrad>FusedBatchNormGradV3" x_backprop bitwise.

``sync_batch_norm(x, scale, offset, ...)``
    Training-mode batch norm over the *global* batch of all replicas of the current
    ``tf.distribute`` replica context. Forward: the global mean (all-reduce of the local sums
    and counts), then the global biased variance (all-reduce of the local sums of squared
    deviations from that global mean: two passes, no E[x^2] - E[x]^2 cancellation), then
    TF's fused inference kernel normalizes with them. Backward (a ``tf.custom_gradient``):
    reduce -> one all-reduce(SUM) of [sum_dy, sum_dy_xmu, count] -> apply. The gradients of
    scale and offset are the *local* sums (``inv * sum_dy_xmu``, ``sum_dy``): the strategy
    sums gradients over replicas itself, which yields the global-batch gradient.

``SyncBatchNormalization``
    A Keras 3 layer with the constructor, weights, ``get_config`` and moving-statistics
    semantics of ``keras.layers.BatchNormalization(synchronized=True)``, computed by
    ``sync_batch_norm``.

Outside any strategy (the default replica context), or with one replica in sync, no
collective is issued and the result is plain (local) batch norm.

The split ops have CPU kernels only and no XLA kernels. ``implementation="auto"`` (the
default) uses them when the computation is placed on a CPU and falls back to the same math
in plain TensorFlow ops on a GPU (or any non-CPU device) and inside XLA compilation
(``jit_compile=True``); ``"fbn"`` forces our kernels (an XLA context then raises
ValueError), ``"tf"`` forces the plain-TF math.
"""
import collections
import numbers

import keras
import tensorflow as tf

from . import _compat
from . import gradients as _grads
from ._loader import library
from .ops import _as_tensor, _check_data_format, _check_epsilon

__all__ = ["BatchNormGradSums", "batch_norm_grad_reduce", "batch_norm_grad_apply",
           "sync_batch_norm", "SyncBatchNormalization", "IMPLEMENTATIONS",
           "resolve_implementation", "layer_uses_sync_path", "sync_layer_call"]

_T_DTYPES = (tf.float16, tf.bfloat16, tf.float32)
_FORMATS_5D = ("NDHWC", "NCDHW")
_CHANNELS_FIRST = ("NCHW", "NCDHW")
#: Values of the ``implementation`` argument.
IMPLEMENTATIONS = ("auto", "fbn", "tf")

BatchNormGradSums = collections.namedtuple("BatchNormGradSums",
                                           ["sum_dy", "sum_dy_xmu", "count"])


# ---- layout helpers ------------------------------------------------------------------------

def _rank(data_format):
    return 5 if data_format in _FORMATS_5D else 4


def _channel_axis(data_format):
    return 1 if data_format in _CHANNELS_FIRST else _rank(data_format) - 1


def _reduce_axes(data_format):
    ax = _channel_axis(data_format)
    return [a for a in range(_rank(data_format)) if a != ax]


def _bshape(data_format):
    shape = [1] * _rank(data_format)
    shape[_channel_axis(data_format)] = -1
    return shape


def _static_check(dy, x, vectors, data_format):
    """The kernel's shape checks, on whatever is statically known (ValueError)."""
    rank = _rank(data_format)
    for name, t in (("y_backprop", dy), ("x", x)):
        if t.shape.rank is not None and t.shape.rank != rank:
            raise ValueError("%s must be %d-dimensional for data_format %s, got shape %s"
                             % (name, rank, data_format, t.shape))
    if not dy.shape.is_compatible_with(x.shape):
        raise ValueError("x and y_backprop must have the same shape, but x has shape %s and "
                         "y_backprop has shape %s" % (x.shape, dy.shape))
    shape = x.shape.merge_with(dy.shape)
    channels = shape[_channel_axis(data_format)] if shape.rank is not None else None
    for name, v in vectors:
        if v.shape.rank is not None and v.shape.rank != 1:
            raise ValueError("%s must be 1-dimensional, got shape %s" % (name, v.shape))
        n = v.shape[0] if v.shape.rank == 1 else None
        if channels is not None and n is not None and n != channels:
            raise ValueError(
                "%s must have %d elements, the channel count of x (axis %d of shape %s for "
                "data_format %s), but has shape %s" % (name, channels,
                                                       _channel_axis(data_format), shape,
                                                       data_format, v.shape))


def _check_pair(y_backprop, x):
    dy = _as_tensor(y_backprop, "y_backprop", _T_DTYPES)
    xt = _as_tensor(x, "x", _T_DTYPES)
    if dy.dtype != xt.dtype:
        raise TypeError("y_backprop and x must have the same dtype, got %s and %s"
                        % (dy.dtype.name, xt.dtype.name))
    return dy, xt


# ---- the split ops -------------------------------------------------------------------------

def batch_norm_grad_reduce(y_backprop, x, mean, data_format="NHWC", name=None):
    """Local per-channel sums of the training-mode batch-norm backward.

    Args:
      y_backprop, x: 4-D (NHWC/NCHW) or 5-D (NDHWC/NCDHW) tensors of the same shape and dtype
        (float16, bfloat16 or float32).
      mean: [C] float32, the mean the forward normalized with (global under SyncBN).
      data_format: "NHWC", "NCHW", "NDHWC" or "NCDHW".

    Returns:
      BatchNormGradSums(sum_dy [C], sum_dy_xmu [C], count): float32; ``count`` is a scalar,
      the number of elements per channel. Accumulated in float32 by the op's kernels, in the
      same order as the fused op.
    """
    data_format = _check_data_format(data_format)
    dy, xt = _check_pair(y_backprop, x)
    m = _as_tensor(mean, "mean", (tf.float32,))
    _static_check(dy, xt, [("mean", m)], data_format)
    out = library.fbn_grad_batch_norm_grad_reduce(y_backprop=dy, x=xt, mean=m,
                                                  data_format=data_format,
                                                  name=name or "BatchNormGradReduce")
    return BatchNormGradSums(*out)


def batch_norm_grad_apply(y_backprop, x, scale, mean, variance, sum_dy, sum_dy_xmu, count,
                          epsilon=0.0001, data_format="NHWC", name=None):
    """x_backprop of the training-mode batch-norm backward from per-channel sums.

    ``x_backprop = scale * inv * ((dy - sum_dy / count) - (x - mean) * inv^2 * sum_dy_xmu /
    count)`` with ``inv = 1 / sqrt(variance + epsilon)``, variance the *biased* variance the
    forward normalized with. sum_dy, sum_dy_xmu and count are usually all-reduced (SUM) over
    the replicas; with the local ones of batch_norm_grad_reduce this is exactly the fused
    op's x_backprop.

    Args:
      y_backprop, x: as in batch_norm_grad_reduce.
      scale, mean, variance, sum_dy, sum_dy_xmu: [C] float32.
      count: scalar float32 >= 1 (elements per channel over all replicas); checked by the
        kernel.
      epsilon: finite, non-negative float.

    Returns:
      x_backprop, shape and dtype of x.
    """
    data_format = _check_data_format(data_format)
    epsilon = _check_epsilon(epsilon)
    if not epsilon >= 0.0 or epsilon == float("inf"):
        raise ValueError("epsilon must be a finite, non-negative number, got %r" % epsilon)
    dy, xt = _check_pair(y_backprop, x)
    vecs = [(n, _as_tensor(v, n, (tf.float32,))) for n, v in (
        ("scale", scale), ("mean", mean), ("variance", variance), ("sum_dy", sum_dy),
        ("sum_dy_xmu", sum_dy_xmu))]
    c = _as_tensor(count, "count", (tf.float32,))
    if c.shape.rank is not None and c.shape.rank != 0:
        raise ValueError("count must be a scalar, got shape %s" % (c.shape,))
    _static_check(dy, xt, vecs, data_format)
    v = dict(vecs)
    return library.fbn_grad_batch_norm_grad_apply(
        y_backprop=dy, x=xt, scale=v["scale"], mean=v["mean"], variance=v["variance"],
        sum_dy=v["sum_dy"], sum_dy_xmu=v["sum_dy_xmu"], count=c, epsilon=epsilon,
        data_format=data_format, name=name or "BatchNormGradApply")


# ---- the same math in plain TF ops (GPU / XLA fallback) ------------------------------------

def _reduce_tf(dy, x, mean, data_format):
    axes = _reduce_axes(data_format)
    dy32 = tf.cast(dy, tf.float32)
    xmu = tf.cast(x, tf.float32) - tf.reshape(mean, _bshape(data_format))
    count = tf.cast(tf.size(x) // tf.shape(x)[_channel_axis(data_format)], tf.float32)
    return BatchNormGradSums(tf.reduce_sum(dy32, axes), tf.reduce_sum(dy32 * xmu, axes), count)


def _apply_tf(dy, x, scale, mean, variance, sum_dy, sum_dy_xmu, count, epsilon, data_format):
    b = _bshape(data_format)
    inv = tf.math.rsqrt(variance + epsilon)
    xmu = tf.cast(x, tf.float32) - tf.reshape(mean, b)
    dx = tf.reshape(scale * inv, b) * (
        (tf.cast(dy, tf.float32) - tf.reshape(sum_dy / count, b))
        - xmu * tf.reshape(inv * inv * sum_dy_xmu / count, b))
    return tf.cast(dx, x.dtype)


# ---- choosing kernels ----------------------------------------------------------------------

def _current_device(x):
    """The device the next ops will be placed on, as far as known now ('' if unknown)."""
    if tf.executing_eagerly():
        from tensorflow.python.eager import context  # pylint: disable=import-outside-toplevel
        return context.context().device_name or x.device or ""
    try:
        # Device scopes are applied to ops when they are created: a throw-away constant
        # shows the scope in effect (grappler prunes it).
        return tf.constant(0, name="fbn_device_probe").op.device or ""
    except Exception:  # pragma: no cover - be conservative
        return ""


def _has_gpus():
    try:
        return bool(tf.config.list_logical_devices("GPU"))
    except Exception:  # pragma: no cover
        return False


def resolve_implementation(implementation, x):
    """'fbn' (our CPU kernels) or 'tf' (plain TF ops) for ops about to be built on x."""
    if implementation not in IMPLEMENTATIONS:
        raise ValueError("implementation must be one of %s, got %r"
                         % (", ".join(IMPLEMENTATIONS), implementation))
    xla = _grads.in_xla_context()
    if implementation == "fbn":
        if xla:
            raise ValueError(
                "fbn_grad_tf.sync: implementation='fbn' cannot be used inside XLA compilation "
                "(tf.function(jit_compile=True)): the split ops have no XLA kernels. Use "
                "implementation='auto' (plain-TF fallback under XLA) or 'tf', or compile "
                "without XLA.")
        return "fbn"
    if implementation == "tf" or xla:
        return "tf"
    device = _current_device(x)
    if device:
        dtype = tf.DeviceSpec.from_string(device).device_type
        if dtype is not None:
            return "fbn" if dtype.upper() == "CPU" else "tf"
    # No explicit placement: ops without a GPU kernel would land on the CPU with copies.
    return "tf" if _has_gpus() else "fbn"


# ---- replica context and all-reduce --------------------------------------------------------

def _sync_context(synchronized):
    """The replica context to all-reduce in, or None when there is nothing to synchronize
    (synchronized=False, cross-replica context, or a single replica in sync)."""
    if not synchronized:
        return None
    ctx = tf.distribute.get_replica_context()
    if ctx is None or ctx.num_replicas_in_sync == 1:
        return None
    return ctx


def _all_reduce_sum(ctx, vectors):
    """All-reduces float32 vectors (and scalars) as one packed tensor: one collective."""
    if ctx is None:
        return vectors
    flat = [tf.reshape(v, [-1]) for v in vectors]
    if all(v.shape[0] is not None for v in flat):
        sizes = [int(v.shape[0]) for v in flat]
    else:
        sizes = tf.stack([tf.size(v) for v in flat])
    packed = ctx.all_reduce(tf.distribute.ReduceOp.SUM, tf.concat(flat, 0))
    parts = tf.split(packed, sizes)
    return [tf.reshape(p, tf.shape(v)) for p, v in zip(parts, vectors)]


# ---- sync_batch_norm -----------------------------------------------------------------------

def _global_moments(x, data_format, ctx):
    """(mean, biased variance) over the global batch, float32: two passes (mean first)."""
    axes = _reduce_axes(data_format)
    x32 = tf.cast(x, tf.float32)
    local_count = tf.cast(tf.size(x) // tf.shape(x)[_channel_axis(data_format)], tf.float32)
    total, count = _all_reduce_sum(ctx, [tf.reduce_sum(x32, axes), local_count])
    # count == 0 only for an empty global batch: mean 0, variance 0 (like divide_no_nan).
    mean = tf.math.divide_no_nan(total, count)
    ssd = tf.reduce_sum(tf.math.squared_difference(x32, tf.reshape(mean, _bshape(data_format))),
                        axes)
    (ssd,) = _all_reduce_sum(ctx, [ssd])
    variance = tf.math.divide_no_nan(ssd, count)
    return mean, variance


def _check_real(name, value):
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError("%s must be a real number, got %r" % (name, value))
    return float(value)


def sync_batch_norm(x, scale, offset, epsilon=1e-3, data_format="NHWC", synchronized=True,
                    implementation="auto", name=None):
    """Training-mode batch normalization over the global batch of all replicas.

    Call it inside ``strategy.run`` (a replica context) of MirroredStrategy,
    MultiWorkerMirroredStrategy, ...; every replica must call it the same number of times in
    the same order (it issues collectives). Outside a strategy it is ordinary batch norm.

    Args:
      x: 4-D or 5-D float16/bfloat16/float32 tensor in ``data_format``.
      scale, offset: [C] float32 (other float dtypes are cast to float32 and the gradients
        cast back).
      epsilon: added to the variance.
      data_format: "NHWC", "NCHW", "NDHWC" or "NCDHW".
      synchronized: False computes per-replica (local) statistics, with no collectives.
      implementation: "auto", "fbn" or "tf" (see the module docstring).

    Returns:
      (y, mean, variance): y like x; mean and the *biased* variance of the global batch,
      float32 [C], without gradient (use them for moving statistics).

    Gradients: x gets the exact gradient of the global-batch batch norm (its sums are
    all-reduced); scale and offset get this replica's share (``inv * sum_dy_xmu`` and
    ``sum_dy`` over the local batch), which the strategy's gradient all-reduce (SUM) turns
    into the global-batch gradient. Second derivatives are not supported.
    """
    data_format = _check_data_format(data_format)
    epsilon = _check_real("epsilon", epsilon)
    if not (epsilon >= 0.0 and epsilon != float("inf")):
        raise ValueError("epsilon must be a finite, non-negative number, got %r" % epsilon)
    x = _as_tensor(x, "x", _T_DTYPES)
    scale = tf.convert_to_tensor(scale)
    offset = tf.convert_to_tensor(offset)
    for n, v in (("scale", scale), ("offset", offset)):
        if not v.dtype.is_floating:
            raise TypeError("%s must be a floating-point tensor, got %s" % (n, v.dtype.name))
    rank = _rank(data_format)
    if x.shape.rank is not None and x.shape.rank != rank:
        raise ValueError("x must be %d-dimensional for data_format %s, got shape %s"
                         % (rank, data_format, x.shape))
    scale32 = tf.cast(scale, tf.float32)
    offset32 = tf.cast(offset, tf.float32)
    _static_check(x, x, [("scale", scale32), ("offset", offset32)], data_format)
    ctx = _sync_context(synchronized)
    impl = resolve_implementation(implementation, x)

    @tf.custom_gradient
    def _sbn(x, scale32, offset32):
        mean, variance = _global_moments(x, data_format, ctx)
        y = tf.raw_ops.FusedBatchNormV3(
            x=x, scale=scale32, offset=offset32, mean=mean, variance=variance,
            epsilon=epsilon, exponential_avg_factor=1.0, data_format=data_format,
            is_training=False)[0]

        def grad(dy, *unused_stat_grads):
            if dy is None:  # pragma: no cover - only the stats were used downstream
                dy = tf.zeros_like(y)
            if impl == "fbn":
                local = batch_norm_grad_reduce(dy, x, mean, data_format)
            else:
                local = _reduce_tf(dy, x, mean, data_format)
            g_sum_dy, g_sum_dy_xmu, g_count = _all_reduce_sum(ctx, list(local))
            if impl == "fbn":
                dx = batch_norm_grad_apply(dy, x, scale32, mean, variance, g_sum_dy,
                                           g_sum_dy_xmu, g_count, epsilon, data_format)
            else:
                dx = _apply_tf(dy, x, scale32, mean, variance, g_sum_dy, g_sum_dy_xmu,
                               g_count, epsilon, data_format)
            inv = tf.math.rsqrt(variance + epsilon)
            return dx, local.sum_dy_xmu * inv, local.sum_dy

        return (y, tf.stop_gradient(mean), tf.stop_gradient(variance)), grad

    with tf.name_scope(name or "SyncBatchNorm"):
        y, mean, variance = _sbn(x, scale32, offset32)
    return y, mean, variance


# ---- the Keras layer -----------------------------------------------------------------------

def _layout(shape, axis):
    """(data_format, reshape_needed) for an input of `shape` normalized over `axis`: 4-/5-D
    channels-last or axis-1 inputs are used as they are; anything else is reshaped (no copy)
    to NHWC [prod(others), 1, 1, C] (last axis) or NCHW [prod(before), C, prod(after), 1]."""
    rank = len(shape)
    if rank in (4, 5) and axis == rank - 1:
        return ("NHWC" if rank == 4 else "NDHWC"), False
    if rank in (4, 5) and axis == 1:
        return ("NCHW" if rank == 4 else "NCDHW"), False
    return ("NHWC" if axis == rank - 1 else "NCHW"), True


def layer_uses_sync_path(layer, inputs, training, mask=None):
    """Whether ``sync_layer_call`` handles this call of a keras.layers.BatchNormalization
    (training, trainable, no mask, no renorm, float16/bfloat16/float32 input); otherwise
    Keras' own ``call`` should run."""
    return bool(training and layer.trainable and mask is None and not _compat.renorm(layer)
                and tf.as_dtype(inputs.dtype) in _T_DTYPES)


def sync_layer_call(layer, inputs, implementation="auto"):
    """The training-mode call of a built keras.layers.BatchNormalization ``layer`` (any
    subclass) computed by ``sync_batch_norm``, synchronized if ``layer.synchronized``:
    returns the output and updates the layer's moving statistics like Keras does. The
    caller checks ``layer_uses_sync_path`` first."""
    x = tf.convert_to_tensor(inputs)
    shape = tuple(x.shape)
    rank = len(shape)
    axis = layer.axis % rank
    data_format, reshape = _layout(shape, axis)
    if reshape:
        dyn = tf.shape(x)
        c = shape[axis] if shape[axis] is not None else dyn[axis]
        if data_format == "NHWC":
            x4 = tf.reshape(x, [-1, 1, 1, c])
        else:
            x4 = tf.reshape(x, [tf.reduce_prod(dyn[:axis]), c, -1, 1])
    else:
        x4 = x
    channels = layer.moving_mean.shape[0]
    gamma = layer.gamma if layer.scale else tf.ones([channels], tf.float32)
    beta = layer.beta if layer.center else tf.zeros([channels], tf.float32)
    y4, mean, variance = sync_batch_norm(
        x4, tf.convert_to_tensor(gamma), tf.convert_to_tensor(beta), epsilon=layer.epsilon,
        data_format=data_format, synchronized=layer.synchronized,
        implementation=implementation)
    if reshape:
        y = tf.reshape(y4, tf.shape(x))
        y.set_shape(x.shape)
    else:
        y = y4
    momentum = layer.momentum
    moving_mean = tf.cast(tf.convert_to_tensor(layer.moving_mean), tf.float32)
    moving_var = tf.cast(tf.convert_to_tensor(layer.moving_variance), tf.float32)
    layer.moving_mean.assign(tf.cast(moving_mean * momentum + mean * (1.0 - momentum),
                                     layer.moving_mean.dtype))
    layer.moving_variance.assign(tf.cast(moving_var * momentum + variance * (1.0 - momentum),
                                         layer.moving_variance.dtype))
    if y.dtype != layer.compute_dtype:
        y = tf.cast(y, layer.compute_dtype)
    return y


@keras.saving.register_keras_serializable(package="fbn_grad_tf")
class SyncBatchNormalization(keras.layers.BatchNormalization):
    """``keras.layers.BatchNormalization(synchronized=True)`` computed by fbn_grad_tf.

    Same constructor arguments, weights and moving-statistics update as Keras' layer
    (``moving = moving * momentum + batch_stat * (1 - momentum)`` with the global mean and
    the global *biased* variance), plus ``implementation`` ("auto", "fbn" or "tf", see
    ``sync_batch_norm``). ``synchronized`` defaults to True here; ``synchronized=False``
    keeps per-replica statistics.

    In training (``training=True`` and ``trainable``) the forward statistics are all-reduced
    across the replicas of the current ``tf.distribute`` replica context and the backward is
    reduce -> all-reduce -> apply (``sync_batch_norm``). Any rank and axis works (inputs are
    reshaped, without copies, to the 4-D layouts of the kernels). Inference, masks,
    ``renorm=True`` and float64 inputs use Keras' own implementation (synchronized as
    configured).

    Registered as a Keras serializable ("fbn_grad_tf>SyncBatchNormalization").
    """

    def __init__(self, axis=-1, momentum=0.99, epsilon=1e-3, center=True, scale=True,
                 beta_initializer="zeros", gamma_initializer="ones",
                 moving_mean_initializer="zeros", moving_variance_initializer="ones",
                 beta_regularizer=None, gamma_regularizer=None, beta_constraint=None,
                 gamma_constraint=None, renorm=False, renorm_clipping=None,
                 renorm_momentum=0.99, synchronized=True, implementation="auto", **kwargs):
        if implementation not in IMPLEMENTATIONS:
            raise ValueError("implementation must be one of %s, got %r"
                             % (", ".join(IMPLEMENTATIONS), implementation))
        super().__init__(**_compat.bn_init_kwargs(dict(
            axis=axis, momentum=momentum, epsilon=epsilon, center=center, scale=scale,
            beta_initializer=beta_initializer, gamma_initializer=gamma_initializer,
            moving_mean_initializer=moving_mean_initializer,
            moving_variance_initializer=moving_variance_initializer,
            beta_regularizer=beta_regularizer, gamma_regularizer=gamma_regularizer,
            beta_constraint=beta_constraint, gamma_constraint=gamma_constraint,
            renorm=renorm, renorm_clipping=renorm_clipping, renorm_momentum=renorm_momentum,
            synchronized=bool(synchronized), **kwargs)))
        self.implementation = implementation
        # The split ops have no XLA kernels: keep Keras' jit_compile="auto" from picking XLA.
        self.supports_jit = False

    def call(self, inputs, training=None, mask=None):
        if not layer_uses_sync_path(self, inputs, training, mask):
            return super().call(inputs, training=training, mask=mask)
        return sync_layer_call(self, inputs, implementation=self.implementation)

    def get_config(self):
        config = super().get_config()
        config["implementation"] = self.implementation
        return config
