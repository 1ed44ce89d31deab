"""The layer behind ``fbn_grad_tf.keras.BatchNormalization`` and ``override()``: Keras 3's
BatchNormalization computed by fbn_grad_tf's fused forward and backward ops (with an optional
fused activation and side input). Users import it from ``fbn_grad_tf.keras``; ``_convert``
builds on this module, and this module imports neither.

It subclasses ``keras.layers.BatchNormalization`` (same constructor, weights, variable names,
get_config and moving-statistics semantics) and replaces the math of ``call`` when it can:

* fused path (4-D or 5-D input whose normalized axis is the channel axis: last -> NHWC/NDHWC,
  1 -> NCHW/NCDHW; dtype float16/bfloat16/float32; no mask; renorm=False):
  forward = our "FbnGrad>FusedBatchNormV3" op ("FbnGrad>FusedBatchNormEx" with an
  activation or a side input), backward = our "FbnGrad>FusedBatchNormGradV3" ("...GradEx") op. The
  ``forward_op`` property selects TF's ``FusedBatchNormV3`` forward instead (then the
  gradient is a tf.custom_gradient calling our op, and a ReLU is a separate tf.nn.relu).
  Inference (training=False) uses TF's own ops only (FusedBatchNormV3 with TF's registered
  gradient, then the side input and activation), so that serving exports hold only TF's ops
  and load where fbn_grad_tf is not installed (see docs/DROPIN.md). Moving statistics are
  updated exactly like Keras 3 does:
  ``moving = moving * momentum + batch_stat * (1 - momentum)`` with the *biased* batch
  variance (what ``ops.moments`` returns). FusedBatchNormV3's output 2 is Bessel-corrected,
  so it is rescaled by (M-1)/M, M = elements per channel (device-independent; the reserve
  space holds different things on CPU and GPU).
* anything else (2-D/3-D input, another axis, float64, a mask, renorm=True) falls back to
  Keras' own implementation (plain TF ops, Keras' gradient) unchanged, followed by
  the side input and the activation with TF ops (tf.nn.relu / relu6 / silu).

Inside XLA compilation (tf.function(jit_compile=True), model.compile(jit_compile=True)) our
op cannot be compiled: the layer runs TF's own FusedBatchNormV3 forward and its registered
gradient, FusedBatchNormGradV3 (a one-time RuntimeWarning says so). The layer sets
``supports_jit = False`` so that Keras' ``jit_compile="auto"`` does not pick XLA for models
containing it.

Registered as a Keras serializable ("fbn_grad_tf>BatchNormalization"): ``import fbn_grad_tf``
before ``keras.models.load_model`` of a .keras file that contains it.
"""
import contextlib
import functools
import inspect
import threading

import keras
import tensorflow as tf

from . import _compat
from . import gradients as _grads
from .nn import (BatchNormParams, _fused_batch_norm_v3, apply_activation,
                 check_forward_and_activation)

_FUSED_DTYPES = (tf.float16, tf.bfloat16, tf.float32)

# Keras' own BatchNormalization.call, captured before override() can patch the class: the
# fallback of every path below calls it directly.
_KERAS_CALL = keras.layers.BatchNormalization.call

__all__ = ["BatchNormalization", "fused_data_format", "override", "override_enabled"]


def same_static_shape(a, b):
    """Whether tensors (or Keras tensors) a and b have the same static shape: a known rank
    on both and, dimension by dimension, the same size or both unknown. The fused op takes
    a side input only then; otherwise it broadcasts, or may (a known 1 against an unknown)."""
    sa, sb = tf.TensorShape(a.shape), tf.TensorShape(b.shape)  # Keras tensors: tuples
    if sa.rank is None or sb.rank is None:
        return False
    return sa.as_list() == sb.as_list()


def fused_data_format(layer, input_shape, dtype=None, mask=None):
    """The data_format the fused path uses for this call of the Keras BatchNormalization
    `layer` (ours or Keras' own), or None: not the fused path (Keras' implementation, or for
    a synchronized layer the cross-replica path of fbn_grad_tf.sync, docs/SYNC.md)."""
    if mask is not None or _compat.renorm(layer) or layer.synchronized:
        return None
    if dtype is not None and tf.as_dtype(dtype) not in _FUSED_DTYPES:
        return None
    rank = len(input_shape)
    if rank not in (4, 5):
        return None
    axis = layer.axis % rank
    if axis == rank - 1:
        return "NHWC" if rank == 4 else "NDHWC"
    if axis == 1:
        return "NCHW" if rank == 4 else "NCDHW"
    return None


def _fbn_call(layer, inputs, training, mask, activation=None, forward_op="fbn_grad_tf",
              gradient_op="fbn_grad_tf", side_input=None):
    """The call of a built Keras BatchNormalization `layer` (ours, or Keras' own under
    override()) on fbn_grad_tf's ops, with Keras' semantics; then `side_input` is added
    and `activation` applied (fused into our op where it runs)."""
    if layer.synchronized:
        from . import sync as _sync
        if _sync.layer_uses_sync_path(layer, inputs, training, mask):
            y = _sync.sync_layer_call(layer, inputs)
        else:
            y = _KERAS_CALL(layer, inputs, training=training, mask=mask)
        return apply_activation(y, activation, side_input)
    data_format = fused_data_format(layer, tuple(inputs.shape), inputs.dtype, mask)
    if data_format is None:
        y = _KERAS_CALL(layer, inputs, training=training, mask=mask)
        return apply_activation(y, activation, side_input)

    x = tf.convert_to_tensor(inputs)
    if side_input is not None:
        side_input = tf.convert_to_tensor(side_input)
        if side_input.dtype != x.dtype:
            side_input = tf.cast(side_input, x.dtype)
    channels = layer.moving_mean.shape[0]
    gamma = (tf.cast(tf.convert_to_tensor(layer.gamma), tf.float32) if layer.scale
             else tf.ones([channels], tf.float32))
    beta = (tf.cast(tf.convert_to_tensor(layer.beta), tf.float32) if layer.center
            else tf.zeros([channels], tf.float32))
    xla = _grads.in_xla_context()
    if xla:
        _grads.warn_xla_fallback("fbn_grad_tf.keras.BatchNormalization")
    # TF's forward op and its registered gradient (XLA-compilable) instead of ours; also
    # where no gradient can be taken (an export tracing a BN called with training=True), so
    # that what is saved holds TF's ops only.
    tf_grad = xla or gradient_op == "tensorflow" or not _grads.gradient_may_be_taken()
    forward = "tf" if forward_op == "tensorflow" else "ours"

    if training and layer.trainable:
        empty = tf.constant([], tf.float32)
        if tf_grad:
            y, batch_mean, batch_var, _, _, _ = tf.raw_ops.FusedBatchNormV3(
                x=x, scale=gamma, offset=beta, mean=empty, variance=empty,
                epsilon=layer.epsilon, exponential_avg_factor=1.0,
                data_format=data_format, is_training=True)
            y = apply_activation(y, activation, side_input)
        else:  # the activation and side input are fused (or nn.py applies them)
            # The fused op takes a side input of x's shape; one whose static shape differs
            # from x's anywhere (it broadcasts, as Keras' Add allows, or may: a known 1
            # against an unknown size) is added after our op by TF ops, with the
            # activation, as in inference. Sizes unknown in both are taken as equal (a
            # residual block traced with dynamic sizes); the op checks them when it runs.
            fuse_side = side_input is None or same_static_shape(side_input, x)
            y, batch_mean, batch_var = _fused_batch_norm_v3(
                x, gamma, beta, empty, empty, BatchNormParams(
                    epsilon=layer.epsilon, exponential_avg_factor=1.0,
                    data_format=data_format, is_training=True, forward=forward,
                    activation=activation if fuse_side else None,
                    side_input=side_input if fuse_side else None))
            if not fuse_side:
                y = apply_activation(y, activation, side_input)
        # Keras 3 averages the *biased* batch variance; output 2 is var * M / max(M-1, 1).
        m = tf.cast(tf.size(x, out_type=tf.int64) // channels, tf.float32)
        batch_var = tf.where(m > 1.0, batch_var * ((m - 1.0) / m), batch_var)
        batch_mean = tf.stop_gradient(batch_mean)
        batch_var = tf.stop_gradient(batch_var)
        moving_mean = tf.cast(tf.convert_to_tensor(layer.moving_mean), tf.float32)
        moving_var = tf.cast(tf.convert_to_tensor(layer.moving_variance), tf.float32)
        layer.moving_mean.assign(
            moving_mean * layer.momentum + batch_mean * (1.0 - layer.momentum))
        layer.moving_variance.assign(
            moving_var * layer.momentum + batch_var * (1.0 - layer.momentum))
    else:
        # Inference runs TF's own ops only, with TF's registered gradients (no custom
        # gradient: SavedModel keeps those by default, and ours would make every serving
        # export, e.g. model.export, need fbn_grad_tf to load). The forward is the same op
        # either way; only a gradient through a BN in inference mode (a frozen BN while
        # fine-tuning) is then TF's FusedBatchNormGradV3, an elementwise pass.
        moving_mean = tf.cast(tf.convert_to_tensor(layer.moving_mean), tf.float32)
        moving_var = tf.cast(tf.convert_to_tensor(layer.moving_variance), tf.float32)
        y = tf.raw_ops.FusedBatchNormV3(
            x=x, scale=gamma, offset=beta, mean=moving_mean, variance=moving_var,
            epsilon=layer.epsilon, exponential_avg_factor=1.0,
            data_format=data_format, is_training=False)[0]
        y = apply_activation(y, activation, side_input)
    if y.dtype != layer.compute_dtype:
        y = tf.cast(y, layer.compute_dtype)
    return y


@keras.saving.register_keras_serializable(package="fbn_grad_tf")
class BatchNormalization(keras.layers.BatchNormalization):
    """keras.layers.BatchNormalization whose gradient is computed by fbn_grad_tf's op.

    Arguments are those of ``keras.layers.BatchNormalization``. ``synchronized=True`` computes
    the statistics and the backward across the replicas of the active tf.distribute strategy
    (fbn_grad_tf.sync, docs/SYNC.md). ``activation``: None or one of
    ``fbn_grad_tf.nn.FUSED_ACTIVATIONS`` ("relu", "relu6", "swish"; "silu" = "swish"),
    applied in the same pass; ``call(x, side_input=r)`` adds r first: act(bn(x) + r).
    """

    def __init__(self, axis=-1, momentum=0.99, epsilon=1e-3, center=True, scale=True,
                 beta_initializer="zeros", gamma_initializer="ones",
                 moving_mean_initializer="zeros", moving_variance_initializer="ones",
                 beta_regularizer=None, gamma_regularizer=None, beta_constraint=None,
                 gamma_constraint=None, renorm=False, renorm_clipping=None,
                 renorm_momentum=0.99, synchronized=False, activation=None, **kwargs):
        super().__init__(**_compat.bn_init_kwargs(dict(
            axis=axis, momentum=momentum, epsilon=epsilon, center=center, scale=scale,
            beta_initializer=beta_initializer, gamma_initializer=gamma_initializer,
            moving_mean_initializer=moving_mean_initializer,
            moving_variance_initializer=moving_variance_initializer,
            beta_regularizer=beta_regularizer, gamma_regularizer=gamma_regularizer,
            beta_constraint=beta_constraint, gamma_constraint=gamma_constraint,
            renorm=renorm, renorm_clipping=renorm_clipping, renorm_momentum=renorm_momentum,
            synchronized=synchronized, **kwargs)))
        # Our op has no XLA kernel: keep Keras' jit_compile="auto" from choosing XLA.
        self.supports_jit = False
        self._gradient_op = "fbn_grad_tf"
        self._forward_op = "fbn_grad_tf"
        self.activation = check_forward_and_activation("ours", activation)

    def get_config(self):
        config = super().get_config()
        config["activation"] = self.activation
        return config

    @property
    def forward_op(self):
        """Which op computes the fused path's forward: "fbn_grad_tf" (default: our
        FbnGrad>FusedBatchNormV3 where it can run, see fbn_grad_tf.nn.our_forward_available)
        or "tensorflow" (TF's FusedBatchNormV3). Not part of get_config. Takes effect when
        the call is (re)traced."""
        return self._forward_op

    @forward_op.setter
    def forward_op(self, value):
        if value not in ("fbn_grad_tf", "tensorflow"):
            raise ValueError('forward_op must be "fbn_grad_tf" or "tensorflow", got %r'
                             % (value,))
        self._forward_op = value

    @property
    def gradient_op(self):
        """Which op computes the fused path's gradient: "fbn_grad_tf" (default) or
        "tensorflow" (TF's FusedBatchNormGradV3, same fused forward; for comparisons and
        benchmarks). Not part of get_config. Takes effect when the call is (re)traced."""
        return self._gradient_op

    @gradient_op.setter
    def gradient_op(self, value):
        if value not in ("fbn_grad_tf", "tensorflow"):
            raise ValueError('gradient_op must be "fbn_grad_tf" or "tensorflow", got %r'
                             % (value,))
        self._gradient_op = value

    # -- which path ------------------------------------------------------------------------

    def fused_data_format(self, input_shape, dtype=None, mask=None):
        """The data_format the fused path uses for this input, or None (not the fused path:
        Keras' fallback, or the cross-replica path of a synchronized layer)."""
        return fused_data_format(self, input_shape, dtype, mask)

    # -- call ------------------------------------------------------------------------------

    def call(self, inputs, training=None, mask=None, side_input=None):
        """``side_input``: None or a tensor added before the activation:
        act(bn(inputs) + side_input) (a residual connection; what ``convert`` builds from
        BN -> Add -> activation). Of the input's shape, it is one fused op; one that
        broadcasts against it (as Keras' Add allows) is added by TF ops after ours."""
        return _fbn_call(self, inputs, training, mask, self.activation, self._forward_op,
                         self._gradient_op, side_input=side_input)


# ---- override() ----------------------------------------------------------------------------

_override_lock = threading.RLock()
_override_on = False      # the effective state: _override_manual or a block on, none off
_override_manual = False  # override() / override(False) called as a switch
_override_blocks = {True: 0, False: 0}  # `with override(enable)` blocks active, per enable
_override_stack = None   # the tf_keras routing (nn.use_for_gradients' patches) while on
_hooks_installed = False
_KERAS_INIT = keras.layers.BatchNormalization.__init__


def _is_ours(layer):
    if isinstance(layer, BatchNormalization):
        return True
    from .sync import SyncBatchNormalization
    return isinstance(layer, SyncBatchNormalization)


@functools.wraps(_KERAS_INIT)
def _init_hook(self, *args, **kwargs):
    _KERAS_INIT(self, *args, **kwargs)
    if _override_on and not _is_ours(self):
        self._fbn_grad_tf_override = True
        self.supports_jit = False  # our ops have no XLA kernel (as our layer)


# Keras' Operation.__new__ reads the constructor's signature with inspect.getfullargspec,
# which ignores __wrapped__ but honours __signature__.
_init_hook.__signature__ = inspect.signature(_KERAS_INIT)


@functools.wraps(_KERAS_CALL)
def _call_hook(self, inputs, training=None, mask=None):
    if ((_override_on or getattr(self, "_fbn_grad_tf_override", False))
            and not _is_ours(self)):
        return _fbn_call(self, inputs, training, mask)
    return _KERAS_CALL(self, inputs, training=training, mask=mask)


def _install_hooks():
    global _hooks_installed
    if not _hooks_installed:
        keras.layers.BatchNormalization.__init__ = _init_hook
        keras.layers.BatchNormalization.call = _call_hook
        _hooks_installed = True


def _apply_override():
    """Makes the hooks and patches match the effective state (call under _override_lock):
    on while switched on or inside a `with override()` block, unless inside a
    `with override(False)` block. Counted, so blocks that overlap (threads) or are left out
    of order leave the state as the remaining ones say."""
    _set_override((_override_manual or _override_blocks[True] > 0)
                  and _override_blocks[False] == 0)


def _set_override(on):
    """Switches the override on/off; returns the previous state."""
    global _override_on, _override_stack
    from . import nn as _nn
    with _override_lock:
        prev = _override_on
        if on and not prev:
            _install_hooks()
            stack = contextlib.ExitStack()
            stack.enter_context(_nn._patched_gradient_registry(_nn._FORWARD_OPS))
            stack.enter_context(_nn._patched_forward())
            _override_stack = stack
        elif prev and not on:
            _override_stack.close()
            _override_stack = None
        _override_on = on
        return prev


def override_enabled():
    """True while fbn_grad_tf.keras.override() is on."""
    return _override_on


class override:  # noqa: N801 (used like a function)
    """Runs every Keras 3 ``keras.layers.BatchNormalization``, and tf_keras' fused
    BatchNormalization, on fbn_grad_tf's ops, without changing the model's code.

    A context manager, or an on/off call::

        with fbn_grad_tf.keras.override():
            model = keras.applications.ResNet50(weights=None)   # or a subclassed model,
            model.compile(...)                                  # keras.models.load_model,
            model.fit(...)                                      # a tf_keras model, ...

        fbn_grad_tf.keras.override()        # on, until
        fbn_grad_tf.keras.override(False)   # off

    While on:

    * **Keras 3**: ``keras.layers.BatchNormalization.call`` (and that of subclasses that do not
      override it or call it) runs the computation of ``fbn_grad_tf.keras.BatchNormalization``
      (fused forward and backward ops where the input allows, Keras' implementation
      otherwise; same weights and moving-statistics rule). It applies when a call is traced:
      a model traced before (its ``train_function``) keeps what it traced; ``compile()`` again
      to retrace. Layers *created* while on (model constructors, ``load_model``, subclassed
      models' ``__init__``) keep our path after the block too (attribute
      ``_fbn_grad_tf_override``), and get ``supports_jit = False``. The layers stay
      ``keras.layers.BatchNormalization`` instances: configs and saved files are unchanged.
      (After the first use, the class's ``__init__`` and ``call`` are thin dispatchers that
      run Keras' own code unless this applies.)
    * **tf_keras (Keras 2)** and ``tf.compat.v1.nn.fused_batch_norm``: the
      ``fbn_grad_tf.use_for_gradients(graph=False)`` patches are active: TF's FusedBatchNormV3
      builder makes our forward op, and FusedBatchNorm* gradients are computed by our op
      (process-global while on; see docs/DROPIN.md §3).

    No activation is fused (the layers keep their structure): use
    ``fbn_grad_tf.keras.convert`` for that.
    """

    def __init__(self, enable=True):
        global _override_manual
        self._enable = bool(enable)
        self._depth = 0
        with _override_lock:
            # Called as a switch it acts now; a `with` block takes the switch back at entry
            # and counts itself instead (__enter__).
            self._prev_manual, _override_manual = _override_manual, self._enable
            self._switched = True
            _apply_override()

    def __enter__(self):
        global _override_manual
        with _override_lock:
            if self._switched:
                _override_manual = self._prev_manual
                self._switched = False
            _override_blocks[self._enable] += 1
            self._depth += 1
            _apply_override()
        return self

    def __exit__(self, *exc):
        with _override_lock:
            if self._depth > 0:
                self._depth -= 1
                _override_blocks[self._enable] -= 1
                _apply_override()
        return False

