"""Gradient functions: the gradient *of* our op, and gradients of TF's forward batch-norm ops
that are computed *by* our op.

Importing this module (``import fbn_grad_tf`` does) registers:

* ``"FbnGrad>FusedBatchNormGradV3"`` (the op type of our op): its gradient, i.e. double
  backprop, with the math of TF's ``_FusedBatchNormGradGradV3``. The first-order gradient is
  recomputed with plain TF ops under a GradientTape and differentiated. In training mode the
  batch mean and (biased) variance are recomputed from ``x``, so the reserve spaces (whatever
  convention the device used for them) do not matter; in inference mode the population
  statistics (inputs 3 and 4) are used. Returns gradients for (y_backprop, x, scale) and None
  for the three reserve spaces.
* ``"FbnGrad>FusedBatchNormV3"``, ``"FbnGrad>FusedBatchNormV2"``, ``"FbnGrad>FusedBatchNorm"``:
  gradient functions for TF's *forward* ops FusedBatchNormV3/V2/FusedBatchNorm that call our
  op instead of TF's FusedBatchNormGrad*. They are not used by default; they are what
  ``fbn_grad_tf.use_for_gradients()`` routes those ops to (see nn.py).
  "FbnGrad>FusedBatchNormV3" is also the op type of *our* forward op, which has TF's
  signature and reserve-space conventions, so the same function is its gradient.
* ``"FbnGrad>FusedBatchNormEx"`` (our forward with a side input and/or a fused activation:
  Relu, Relu6, Swish): its gradient is ``"FbnGrad>FusedBatchNormGradEx"``, which applies
  the activation's derivative inside the kernel and returns the side input's gradient; and
  the gradient of that op (double backprop), like ``"FbnGrad>FusedBatchNormGradV3"``'s on
  dz = y_backprop * act'(z) (Swish: z recomputed with plain TF ops, so its second-order
  terms in x, scale, offset and the side input are included).

Our op has no XLA kernel: when a gradient is built inside an XLA compilation context
(``tf.function(jit_compile=True)``), these functions fall back to TF's own gradient op, with a
one-time warning, instead of failing at compile time.
"""
import threading
import warnings

import tensorflow as tf
from tensorflow.python.ops import control_flow_util

from ._loader import (FORWARD_EX_OP_NAME, GRAD_EX_OP_NAME, REGISTERED_OP_NAME, raw_grad_ex_op,
                      raw_op)

#: Gradient-function names under which our routing of TF's forward ops is registered
#: (the values to use in ``graph.gradient_override_map``).
FORWARD_GRAD_NAMES = {
    "FusedBatchNormV3": "FbnGrad>FusedBatchNormV3",
    "FusedBatchNormV2": "FbnGrad>FusedBatchNormV2",
    "FusedBatchNorm": "FbnGrad>FusedBatchNorm",
}
_VERSION = {"FusedBatchNormV3": 2, "FusedBatchNormV2": 1, "FusedBatchNorm": 0}

_FORMATS_5D = ("NDHWC", "NCDHW")
_CHANNELS_FIRST = ("NCHW", "NCDHW")


def _as_str(s):
    return s.decode() if isinstance(s, bytes) else s


# ---- XLA detection and the one-time fallback warning ---------------------------------------

_warned = set()
_warn_lock = threading.Lock()


def gradient_may_be_taken():
    """Whether the ops being built now may be differentiated: a GradientTape is recording
    (in eager code, or inside or around the tf.function being traced), or a TF1 graph is
    being built (tf.gradients needs no tape there). Training-mode batch norm builds our
    forward op only then; otherwise (model.export or a SavedModel tracing a layer called with
    training=True) it builds TF's, so that what is saved loads where fbn_grad_tf is not
    installed."""
    if not tf.compat.v1.executing_eagerly_outside_functions():
        return True
    try:
        from tensorflow.python.eager import record  # pylint: disable=import-outside-toplevel
        return bool(record.could_possibly_record())
    except Exception:  # pragma: no cover - private API changed: keep building our op
        return True


def in_xla_context(graph=None):
    """True when ops are being built for XLA compilation (inside tf.function(jit_compile=True)
    or an XLA control-flow context). Our op has no XLA kernel, so callers must then use TF's
    own gradient op."""
    if tf.executing_eagerly():
        return False
    g = graph if graph is not None else tf.compat.v1.get_default_graph()
    try:
        return bool(control_flow_util.GraphOrParentsInXlaContext(g))
    except Exception:  # pragma: no cover - private API changed: be conservative
        return False


def warn_xla_fallback(where):
    """Warns once per process (per `where`) that TF's gradient op is used instead of ours."""
    with _warn_lock:
        if where in _warned:
            return
        _warned.add(where)
    warnings.warn(
        "fbn_grad_tf: %s is being compiled with XLA (jit_compile=True); the fbn_grad_tf op has "
        "no XLA kernel, so TensorFlow's own FusedBatchNormGradV3 is used for this gradient. "
        "Compile without XLA to use fbn_grad_tf's kernels." % where,
        RuntimeWarning, stacklevel=3)


def _reset_warnings_for_tests():
    with _warn_lock:
        _warned.clear()


# ---- pure-TF first-order batch-norm gradient (for double backprop) --------------------------

def batch_norm_grad_reference(y_backprop, x, scale, pop_mean, pop_var, epsilon, data_format,
                              is_training=True):
    """FusedBatchNormGradV3's (x_backprop, scale_backprop, offset_backprop) with plain TF ops.

    The math of TF's ``nn_fused_batch_norm_grad._BatchNormGrad``: half/bfloat16 are computed in
    float32 and x_backprop is cast back; in training the batch mean and biased variance are
    recomputed from x (pop_mean/pop_var are ignored); in inference pop_mean/pop_var are used.
    Unlike TF's version, scale_backprop keeps shape [C] for channels-first formats even when
    C == 1 (TF squeezes it to a scalar).
    """
    data_format = _as_str(data_format)
    x_dtype = x.dtype.base_dtype
    if x_dtype in (tf.float16, tf.bfloat16):
        x = tf.cast(x, tf.float32)
        y_backprop = tf.cast(y_backprop, tf.float32)
    rank = 5 if data_format in _FORMATS_5D else 4
    if data_format in _CHANNELS_FIRST:
        reduce_axis = [0] + list(range(2, rank))
        bshape = [1, -1] + [1] * (rank - 2)
    else:
        reduce_axis = list(range(rank - 1))
        bshape = [-1]
    scale_b = tf.reshape(scale, bshape)
    if is_training:
        mean_dy = tf.reduce_mean(y_backprop, reduce_axis, keepdims=True)
        mean_x = tf.reduce_mean(x, reduce_axis, keepdims=True)
        var_x = tf.reduce_mean(tf.math.squared_difference(x, tf.stop_gradient(mean_x)),
                               reduce_axis, keepdims=True)
        dy_c = y_backprop - mean_dy
        x_c = x - mean_x
        mean_dyx = tf.reduce_mean(y_backprop * x_c, reduce_axis, keepdims=True)
        rstd = tf.math.rsqrt(var_x + epsilon)
        grad_x = scale_b * rstd * (dy_c - tf.math.reciprocal(var_x + epsilon) * mean_dyx * x_c)
        grad_scale = tf.reshape(rstd * tf.reduce_sum(y_backprop * x_c, reduce_axis,
                                                     keepdims=True), [-1])
    else:
        mean_b = tf.reshape(pop_mean, bshape)
        rstd = tf.math.rsqrt(tf.reshape(pop_var, bshape) + epsilon)
        grad_x = y_backprop * scale_b * rstd
        grad_scale = tf.reduce_sum(y_backprop * (x - mean_b) * rstd, axis=reduce_axis)
    grad_offset = tf.reduce_sum(y_backprop, axis=reduce_axis)
    return tf.cast(grad_x, x_dtype), grad_scale, grad_offset


def _zeros_if_none(g, like):
    return tf.zeros_like(like) if g is None else g


@tf.RegisterGradient(REGISTERED_OP_NAME)
def _fbn_grad_grad(op, *grads):
    """Gradient of our op (double backprop), like TF's _FusedBatchNormGradGradV3."""
    return _grad_grad(op, grads)


def _broadcast_shape(data_format):
    rank = 5 if data_format in _FORMATS_5D else 4
    return [1, -1] + [1] * (rank - 2) if data_format in _CHANNELS_FIRST else [-1]


def z_reference(x, scale, offset, pop_mean, pop_var, side_input, epsilon, data_format,
                is_training):
    """z = batch_norm(x) + side_input in float32 with plain TF ops (differentiable in x,
    scale, offset, side_input): in training with the batch statistics of x, in inference
    with pop_mean/pop_var."""
    data_format = _as_str(data_format)
    xf = tf.cast(x, tf.float32)
    rank = 5 if data_format in _FORMATS_5D else 4
    axes = ([0] + list(range(2, rank)) if data_format in _CHANNELS_FIRST
            else list(range(rank - 1)))
    bshape = _broadcast_shape(data_format)
    if is_training:
        mean, var = tf.nn.moments(xf, axes, keepdims=True)
    else:
        mean, var = tf.reshape(pop_mean, bshape), tf.reshape(pop_var, bshape)
    z = ((xf - mean) * tf.math.rsqrt(var + epsilon) * tf.reshape(scale, bshape)
         + tf.reshape(offset, bshape))
    if side_input is not None:
        z = z + tf.cast(side_input, tf.float32)
    return z


def activation_backprop_reference(dy, mode, y=None, z=None):
    """dz = dy * act'(z) with plain TF ops, as our kernels compute it: Relu/Relu6 as selects
    on y (y gets no gradient), Swish from z (float32) as s * (1 + z * (1 - s))."""
    mode = _as_str(mode)
    if mode == "Relu":
        return tf.where(y > 0, dy, tf.zeros_like(dy))
    if mode == "Relu6":
        return tf.where(tf.logical_and(y > 0, y < 6), dy, tf.zeros_like(dy))
    if mode == "Swish":
        s = tf.sigmoid(z)
        return tf.cast(tf.cast(dy, tf.float32) * (s * (1.0 + z * (1.0 - s))), dy.dtype)
    return dy


def _grad_grad(op, grads):
    """Double backprop of FbnGrad>FusedBatchNormGradV3 / ...GradEx: the first-order gradient
    recomputed with plain TF ops (activation_backprop_reference, then
    batch_norm_grad_reference) under a GradientTape, and differentiated."""
    data_format = op.get_attr("data_format")
    epsilon = op.get_attr("epsilon")
    is_training = op.get_attr("is_training")
    dy, x, scale, pop_mean, pop_var = op.inputs[:5]
    ex = op.type == GRAD_EX_OP_NAME
    mode = _as_str(op.get_attr("activation_mode")) if ex else "Identity"
    num_offsets = op.get_attr("num_offsets") if ex else 0
    num_side = op.get_attr("num_side_inputs") if ex else 0
    offset = op.inputs[7] if num_offsets else None
    side = op.inputs[7 + num_offsets] if num_side else None
    n_out = 3 + num_side
    out_index = [0, 1, 2] + ([5] if num_side else [])
    upstream = [_zeros_if_none(grads[i], op.outputs[i]) for i in out_index]
    watched = [dy, x, scale]
    swish = mode == "Swish"
    if swish:
        watched += [offset] + ([side] if side is not None else [])
    with tf.GradientTape() as tape:
        tape.watch(watched)
        z = (z_reference(x, scale, offset, pop_mean, pop_var, side, epsilon, data_format,
                         is_training) if swish else None)
        dz = activation_backprop_reference(dy, mode, y=op.inputs[6] if ex else None, z=z)
        gx, gscale, goffset = batch_norm_grad_reference(dz, x, scale, pop_mean, pop_var,
                                                        epsilon, data_format, is_training)
        outs = [gx, gscale, goffset] + ([dz] if num_side else [])
    got = tape.gradient(outs[:n_out], watched, output_gradients=upstream[:n_out])
    result = [got[0], got[1], got[2], None, None, None]
    if ex:
        result.append(None)  # y: piecewise-constant masks; Swish does not read it
        if num_offsets:
            result.append(got[3] if swish else None)
        if num_side:
            result.append(got[4] if swish and side is not None else None)
    return tuple(result)


@tf.RegisterGradient(GRAD_EX_OP_NAME)
def _fbn_grad_ex_grad(op, *grads):
    """Gradient of FbnGrad>FusedBatchNormGradEx (double backprop)."""
    return _grad_grad(op, grads)


@tf.RegisterGradient(FORWARD_EX_OP_NAME)
def _fbn_forward_ex_grad(op, *grads):
    """Gradient of our fused forward (side input, activation): FbnGrad>FusedBatchNormGradEx,
    which also returns the side input's gradient."""
    epsilon = op.get_attr("epsilon")
    data_format = _as_str(op.get_attr("data_format"))
    is_training = op.get_attr("is_training")
    mode = _as_str(op.get_attr("activation_mode"))
    num_side = op.get_attr("num_side_inputs")
    x, scale, offset = op.inputs[0], op.inputs[1], op.inputs[2]
    side = op.inputs[5] if num_side else None
    y = op.outputs[0]
    dy = _zeros_if_none(grads[0], y)
    if is_training:
        rs1, rs2 = op.outputs[3], op.outputs[4]
    else:
        rs1, rs2 = op.inputs[3], op.inputs[4]
    if in_xla_context():  # not reached in practice: the forward itself has no XLA kernel
        warn_xla_fallback("the gradient of " + FORWARD_EX_OP_NAME)
        z = (z_reference(x, scale, offset, op.inputs[3], op.inputs[4], side, epsilon,
                         data_format, is_training) if mode == "Swish" else None)
        dz = activation_backprop_reference(dy, mode, y=y, z=z)
        dx, dscale, doffset = _tf_builtin_backward(dz, x, scale, rs1, rs2, op.outputs[5],
                                                   epsilon, data_format, is_training)
        dside = [dz] if num_side else []
    else:
        dx, dscale, doffset, _, _, dside = raw_grad_ex_op(
            y_backprop=dy, x=x, scale=scale, reserve_space_1=rs1, reserve_space_2=rs2,
            reserve_space_3=op.outputs[5], y=y, offset=[offset],
            side_input=[] if side is None else [side], epsilon=epsilon,
            data_format=data_format, is_training=is_training, activation_mode=mode)
    return (dx, dscale, doffset, None, None) + tuple(dside)


# ---- gradients of TF's forward ops, computed by our op ---------------------------------------

def _empty_reserve():
    return tf.constant([], dtype=tf.float32)


def fbn_backward(y_backprop, x, scale, saved_mean, saved_var, reserve_space_3, epsilon,
                 data_format, is_training, where="fbn_grad_tf backward"):
    """(dx, dscale, doffset) of a FusedBatchNormV3 forward, by our op.

    Training: saved_mean/saved_var are the forward's reserve_space_1/2 (device convention).
    Inference: the population mean/variance fed to the forward. NCHW/NCDHW inference is
    computed natively (TF's own gradient transposes to NHWC). Inside an XLA context TF's
    FusedBatchNormGradV3 is used instead (one-time warning).
    """
    data_format = _as_str(data_format)
    if reserve_space_3 is None:
        reserve_space_3 = _empty_reserve()
    # Our op (like TF's grad op) takes float scale and statistics; FusedBatchNormV3 also allows
    # U=bfloat16 in its signature, so cast defensively.
    scale = _as_float32(scale)
    saved_mean, saved_var = _as_float32(saved_mean), _as_float32(saved_var)
    reserve_space_3 = _as_float32(reserve_space_3)
    if in_xla_context():
        warn_xla_fallback(where)
        return _tf_builtin_backward(y_backprop, x, scale, saved_mean, saved_var,
                                    reserve_space_3, epsilon, data_format, is_training)
    dx, dscale, doffset, _, _ = raw_op(
        y_backprop=y_backprop, x=x, scale=scale, reserve_space_1=saved_mean,
        reserve_space_2=saved_var, reserve_space_3=reserve_space_3, epsilon=epsilon,
        data_format=data_format, is_training=is_training)
    return dx, dscale, doffset


def _as_float32(t):
    return t if t.dtype == tf.float32 else tf.cast(t, tf.float32)


def _tf_builtin_backward(dy, x, scale, rs1, rs2, rs3, epsilon, data_format, is_training):
    """TF's own FusedBatchNormGradV3, with TF's NCHW->NHWC transposes in inference (its CPU
    kernel refuses channels-first inference)."""
    perm = inv = None
    fmt = data_format
    if not is_training and data_format in _CHANNELS_FIRST:
        if data_format == "NCHW":
            perm, inv, fmt = [0, 2, 3, 1], [0, 3, 1, 2], "NHWC"
        else:
            perm, inv, fmt = [0, 2, 3, 4, 1], [0, 4, 1, 2, 3], "NDHWC"
        x = tf.transpose(x, perm)
        dy = tf.transpose(dy, perm)
    dx, dscale, doffset, _, _ = tf.raw_ops.FusedBatchNormGradV3(
        y_backprop=dy, x=x, scale=scale, reserve_space_1=rs1, reserve_space_2=rs2,
        reserve_space_3=rs3, epsilon=epsilon, data_format=fmt, is_training=is_training)
    if inv is not None:
        dx = tf.transpose(dx, inv)
    return dx, dscale, doffset


def _forward_op_grad(op, grads, op_type):
    if op is None:
        # tf.saved_model.save traces every gradient function named by a `_gradient_op_type`
        # attr as if it were a tf.custom_gradient (called with op=None); ours needs the op.
        raise ValueError(
            "fbn_grad_tf: this function holds %s ops tagged by use_for_gradients() "
            "(graph=True), and SavedModel cannot serialize such op-attached gradients. Save "
            "with tf.saved_model.SaveOptions(experimental_custom_gradients=False) (the loaded "
            "ops keep the tag and use fbn_grad_tf's gradient once fbn_grad_tf is imported), "
            "or trace with use_for_gradients(graph=False)." % op_type)
    version = _VERSION[op_type]
    epsilon = op.get_attr("epsilon")
    data_format = _as_str(op.get_attr("data_format"))
    is_training = op.get_attr("is_training")
    x, scale = op.inputs[0], op.inputs[1]
    dy = _zeros_if_none(grads[0], op.outputs[0])
    rs3 = op.outputs[5] if version == 2 else None
    if is_training:
        rs1, rs2 = op.outputs[3], op.outputs[4]
    else:
        rs1, rs2 = op.inputs[3], op.inputs[4]
    dx, dscale, doffset = fbn_backward(dy, x, scale, rs1, rs2, rs3, epsilon, data_format,
                                       is_training, where="the gradient of " + op_type)
    if scale.dtype != dscale.dtype:
        dscale, doffset = tf.cast(dscale, scale.dtype), tf.cast(doffset, scale.dtype)
    return dx, dscale, doffset, None, None


@tf.RegisterGradient(FORWARD_GRAD_NAMES["FusedBatchNormV3"])
def _fused_batch_norm_v3_grad_by_fbn(op, *grads):
    return _forward_op_grad(op, grads, "FusedBatchNormV3")


@tf.RegisterGradient(FORWARD_GRAD_NAMES["FusedBatchNormV2"])
def _fused_batch_norm_v2_grad_by_fbn(op, *grads):
    return _forward_op_grad(op, grads, "FusedBatchNormV2")


@tf.RegisterGradient(FORWARD_GRAD_NAMES["FusedBatchNorm"])
def _fused_batch_norm_grad_by_fbn(op, *grads):
    return _forward_op_grad(op, grads, "FusedBatchNorm")


FORWARD_GRAD_FUNCTIONS = {
    "FusedBatchNormV3": _fused_batch_norm_v3_grad_by_fbn,
    "FusedBatchNormV2": _fused_batch_norm_v2_grad_by_fbn,
    "FusedBatchNorm": _fused_batch_norm_grad_by_fbn,
}
