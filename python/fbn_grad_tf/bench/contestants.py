"""The contestants: our op, TF's FusedBatchNormGradV3, our kernels through the framework-free
core and PyTorch (backward grid); and the whole-BN-layer training steps of --layer
(LAYER_COLUMNS)."""
import os

import numpy as np
import tensorflow as tf


# ---- the backward grid's contestants ---------------------------------------------------------

def _ours_op(dy, x, scale, rs1, rs2, rs3, epsilon, data_format, is_training):
    from .. import ops
    return ops.fused_batch_norm_grad(dy, x, scale, rs1, rs2, rs3, epsilon=epsilon,
                                     data_format=data_format, is_training=is_training)


def _tf_op(dy, x, scale, rs1, rs2, rs3, epsilon, data_format, is_training):
    return tf.raw_ops.FusedBatchNormGradV3(
        y_backprop=dy, x=x, scale=scale, reserve_space_1=rs1, reserve_space_2=rs2,
        reserve_space_3=rs3, epsilon=epsilon, data_format=data_format,
        is_training=is_training)


def _core_callable(args, epsilon, fmt, training, threads):
    """Our kernels called through the framework-free core (fbn_grad_tf.core.bn_grad) on
    NumPy copies of the same tensors, made once: a direct kernel call from Python, with no
    TF graph dispatch (about 0.2 ms per tf.function call on the 2-core machines), as
    PyTorch's eager call has none. Returns a zero-argument callable."""
    from .. import core
    dy, x, scale, rs1, rs2 = (np.asarray(t.numpy()) for t in args[:5])

    def call():
        return core.bn_grad(dy, x, scale, rs1, rs2, epsilon, fmt, training,
                            num_threads=threads)

    return call


def _tf_callable(which, args, epsilon, fmt, training, chain=0):
    """A zero-argument callable running `which` ('ours' or 'tf') in a fresh tf.function:
    one call returning its three gradients, or with chain=k >= 1, k calls in a row, each
    call's x_backprop the next one's y_backprop (as BN layers follow each other in a model's
    backward), returning the last x_backprop. The chain shares one tf.function dispatch
    (~0.2 ms here) among its k ops, and its intermediates belong to the graph alone, so an
    op that can forward its inputs' buffers (ours) works in place there, as in a model."""
    op = _ours_op if which == "ours" else _tf_op

    @tf.function(autograph=False)
    def f(dy, x, scale, rs1, rs2, rs3):
        if chain:
            d = dy
            for _ in range(chain):
                d = op(d, x, scale, rs1, rs2, rs3, epsilon=epsilon, data_format=fmt,
                       is_training=training)[0]
            return d
        out = op(dy, x, scale, rs1, rs2, rs3, epsilon=epsilon, data_format=fmt,
                 is_training=training)
        return out[0], out[1], out[2]

    return lambda: f(*args)


#: Why the PyTorch column is n/a when torch cannot be imported (the table and JSON say so).
TORCH_MISSING = "torch not installed"
TORCH_INSTALL_HINT = "pip install torch==2.13.0, or the package's 'bench' extra"


def _torch_module():
    """(torch, None) or (None, reason): TORCH_MISSING, or the import error of a broken one."""
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # no spinning threads between calls
    try:
        import torch
        return torch, None
    except ModuleNotFoundError as e:
        if e.name == "torch":
            return None, TORCH_MISSING
        return None, "torch not importable (%s)" % e
    except ImportError as e:
        return None, "torch not importable (%s)" % e


def _to_torch(torch, t):
    a = t.numpy()
    if a.dtype.name == "bfloat16":
        return torch.from_numpy(a.view(np.uint16)).view(torch.bfloat16)
    return torch.from_numpy(a)


def _to_torch_layout(torch, t, channels_last):
    """A channels-last TF tensor (NHWC/NDHWC) as torch's channels-first shape: a view in
    channels_last (channels_last_3d) memory format, or a contiguous copy (NCHW/NCDHW).
    Conversions happen once per case, outside the timed calls."""
    a = _to_torch(torch, t)
    perm = (0, a.dim() - 1) + tuple(range(1, a.dim() - 1))
    a = a.permute(*perm)
    if not channels_last:
        return a.contiguous()
    fmt = torch.channels_last if a.dim() == 4 else torch.channels_last_3d
    assert a.is_contiguous(memory_format=fmt)
    return a


def _from_torch_layout(a, channels_last):
    """Inverse of _to_torch_layout for an output: a NumPy array in the TF format's layout."""
    if channels_last:
        a = a.permute(0, *range(2, a.dim()), 1)
    return a.float().detach().numpy()


def _torch_callable(torch, nhwc_args, fmt, training, epsilon):
    """torch.ops.aten.native_batch_norm_backward on the same data (`nhwc_args`: dy, x,
    scale, mean, variance as TF tensors, dy/x channels-last): NHWC as an NCHW-shaped tensor
    in channels_last memory format (a view of the same bytes), NCHW contiguous; training
    with save_mean/save_invstd, inference with running_mean/running_var. Returns a
    zero-argument callable; dy/x are converted here, once."""
    channels_last = fmt in ("NHWC", "NDHWC")
    dy = _to_torch_layout(torch, nhwc_args[0], channels_last)
    x = _to_torch_layout(torch, nhwc_args[1], channels_last)
    scale, rs1, rs2 = (_to_torch(torch, t) for t in nhwc_args[2:5])
    if training:
        invstd = torch.rsqrt(rs2 + epsilon)
        args = (dy, x, scale, None, None, rs1, invstd, True, epsilon, [True, True, True])
    else:
        args = (dy, x, scale, rs1, rs2, None, None, False, epsilon, [True, True, True])
    fn = torch.ops.aten.native_batch_norm_backward

    def call():
        return fn(*args)

    return call


def _setup_torch(config, threads):
    """(torch or None, note for the header, reason it is n/a or None): torch with
    torch.set_num_threads(threads) (the threads TF, hence our op, uses), or why not."""
    if not config.torch:
        return None, "torch disabled (--no-torch)", None
    torch, why = _torch_module()
    if torch is None:
        return None, "torch: n/a (%s)" % why, why
    torch.set_num_threads(threads)
    return torch, "torch %s (%d threads)" % (torch.__version__, torch.get_num_threads()), None


# ---- --layer: one whole BN layer training step ------------------------------------------------

#: The --layer contestants, in table order: (key, header, description). Each is one
#: tf.function (PyTorch: eager) running forward + backward of one BN layer on the same x and
#: upstream gradient dy, returning (y, dx, dscale, doffset).
LAYER_COLUMNS = (
    ("ours", "ours", "fbn_grad_tf.fused_batch_norm(forward='ours'): our forward and backward"),
    ("ours_relu", "ours+ReLU", "fbn_grad_tf.fused_batch_norm(forward='ours', "
     "activation='relu'): BN and ReLU fused in our ops"),
    ("tf_ours", "tf+ours", "fbn_grad_tf.fused_batch_norm with TF's FusedBatchNormV3 forward "
     "(forward='tf' where the argument exists) and our backward"),
    ("tf_relu", "TF BN+ReLU", "tf.compat.v1.nn.fused_batch_norm (FusedBatchNormV3) then "
     "tf.nn.relu, TF's gradients"),
    ("tf", "TF fused", "tf.raw_ops.FusedBatchNormV3 and its built-in gradient "
     "(FusedBatchNormGradV3)"),
    ("keras", "Keras", "keras.layers.BatchNormalization(training=True) (Keras 3, plain TF ops; "
     "moving statistics updated)"),
    ("torch", "PyTorch", "torch.nn.functional.batch_norm(training=True) + torch.autograd.grad, "
     "eager; NHWC as channels_last"),
)
LAYER_KEYS = tuple(c[0] for c in LAYER_COLUMNS)
LAYER_HEADERS = {c[0]: c[1] for c in LAYER_COLUMNS}
#: The n/a reason of our forward's columns while fused_batch_norm lacks forward=/activation=.
NEEDS_FORWARD = "needs our forward op"
#: Contestants built on our ops: a mismatch of theirs is a CorrectnessError (fatal), of the
#: others only an n/a.
_LAYER_OURS = ("ours", "ours_relu", "tf_ours")


def ours_forward_support():
    """{"forward": bool, "activation": bool, "op_available": bool or None}: whether this
    build's fbn_grad_tf.fused_batch_norm accepts forward= and activation= (our forward op
    and its fused ReLU) and, where nn.our_forward_available exists, whether our forward op
    can run here ("forward" is False when it cannot: fused_batch_norm(forward="ours") would
    quietly run TF's forward, which is not what the ours columns are for)."""
    import inspect
    from .. import nn
    try:
        params = inspect.signature(nn.fused_batch_norm).parameters
    except (TypeError, ValueError):  # pragma: no cover
        params = {}
    available = getattr(nn, "our_forward_available", None)
    op_available = bool(available()) if callable(available) else None
    return {"forward": "forward" in params and op_available is not False,
            "activation": "activation" in params, "accepts_forward": "forward" in params,
            "op_available": op_available}


def layer_ratio_base(support):
    """(base for every ratio, base for the ReLU pair): 'ours' and 'ours_relu' when our
    forward exists, else 'tf_ours' for both (TF's forward with our backward)."""
    if support["forward"]:
        return "ours", ("ours_relu" if support["activation"] else "ours")
    return "tf_ours", "tf_ours"


def _layer_partner(key, base, relu_base):
    """The contestant whose time divides `key`'s in its x column (None: no x column)."""
    if key in (base, relu_base) or key in ("ours", "ours_relu"):
        return None
    return relu_base if key == "tf_relu" else base


def _grad_step(forward, x, scale, offset, dy):
    """A zero-argument callable: one tf.function with a GradientTape around `forward`
    (x, scale, offset -> y), dy fed as the upstream gradient (no loss ops)."""

    @tf.function(autograph=False)
    def step(x, scale, offset, dy):
        with tf.GradientTape() as tape:
            tape.watch([x, scale, offset])
            y = forward(x, scale, offset)
        dx, dscale, doffset = tape.gradient(y, [x, scale, offset], output_gradients=dy)
        return y, dx, dscale, doffset

    return lambda: step(x, scale, offset, dy)


def _keras_step(x, scale, offset, dy, fmt, dtype, epsilon):
    import keras
    policy = {"float32": "float32", "bfloat16": "mixed_bfloat16",
              "float16": "mixed_float16"}[dtype]
    layer = keras.layers.BatchNormalization(axis=-1 if fmt.endswith("C") else 1,
                                            epsilon=epsilon, dtype=policy)
    layer.build(tuple(x.shape))
    layer.gamma.assign(scale)
    layer.beta.assign(offset)
    weights = [layer.gamma, layer.beta]

    @tf.function(autograph=False)
    def step(x, dy):
        with tf.GradientTape() as tape:
            tape.watch(x)
            y = layer(x, training=True)
        dx, dgamma, dbeta = tape.gradient(y, [x] + weights, output_gradients=dy)
        return y, dx, dgamma, dbeta

    step.layer = layer  # keeps the layer (its variables) alive with the callable
    return lambda: step(x, dy)


def _torch_layer_step(torch, x, scale, offset, dy, fmt, epsilon):
    """F.batch_norm(training=True) forward + autograd backward on the same data (x and dy:
    the NHWC TF tensors; for fmt NHWC an NCHW-shaped channels_last view, for NCHW a
    contiguous copy); running stats updated in place, as torch does. Returns (callable,
    converter of its outputs to NumPy in the TF format's layout)."""
    channels_last = fmt in ("NHWC", "NDHWC")
    xt = _to_torch_layout(torch, x, channels_last).requires_grad_(True)
    dyt = _to_torch_layout(torch, dy, channels_last)
    w = _to_torch(torch, scale).clone().requires_grad_(True)
    b = _to_torch(torch, offset).clone().requires_grad_(True)
    rm = torch.zeros_like(w, requires_grad=False)
    rv = torch.ones_like(w, requires_grad=False)
    bn = torch.nn.functional.batch_norm
    grad = torch.autograd.grad

    def call():
        y = bn(xt, rm, rv, w, b, training=True, momentum=0.1, eps=epsilon)
        dx, dw, db = grad(y, (xt, w, b), grad_outputs=dyt)
        return y, dx, dw, db

    def to_tf_layout(outs):
        y, dx, dw, db = outs
        return (_from_torch_layout(y, channels_last), _from_torch_layout(dx, channels_last),
                dw.float().detach().numpy(), db.float().detach().numpy())

    return call, to_tf_layout


def _layer_callables(x, scale, offset, dy, fmt, dtype, epsilon, support, torch, torch_why,
                     x_nhwc, dy_nhwc):
    """(name -> zero-argument callable for every contestant that can be built, name -> why
    not for the others, name -> converter of its outputs to NumPy in the TF layout). x and dy
    are in `fmt`; x_nhwc/dy_nhwc the same data channels-last, from which PyTorch's tensors
    are made."""
    from .. import nn
    fns, errors = {}, {}
    kw = dict(epsilon=epsilon, data_format=fmt, is_training=True)

    def ours_fwd(**extra):
        def f(x, s, o):
            return nn.fused_batch_norm(x, s, o, **kw, **extra)[0]
        return f

    if support["forward"]:
        fns["ours"] = _grad_step(ours_fwd(forward="ours"), x, scale, offset, dy)
    else:
        errors["ours"] = NEEDS_FORWARD
    if support["forward"] and support["activation"]:
        fns["ours_relu"] = _grad_step(ours_fwd(forward="ours", activation="relu"),
                                      x, scale, offset, dy)
    else:
        errors["ours_relu"] = NEEDS_FORWARD
    fns["tf_ours"] = _grad_step(ours_fwd(**({"forward": "tf"} if support.get(
        "accepts_forward", support["forward"]) else {})),
                                x, scale, offset, dy)

    def tf_relu(x, s, o):
        return tf.nn.relu(tf.compat.v1.nn.fused_batch_norm(x, s, o, **kw)[0])

    fns["tf_relu"] = _grad_step(tf_relu, x, scale, offset, dy)

    def tf_fused(x, s, o):
        empty = tf.zeros([0], tf.float32)
        return tf.raw_ops.FusedBatchNormV3(x=x, scale=s, offset=o, mean=empty,
                                           variance=empty, exponential_avg_factor=1.0,
                                           **kw)[0]

    fns["tf"] = _grad_step(tf_fused, x, scale, offset, dy)
    try:
        fns["keras"] = _keras_step(x, scale, offset, dy, fmt, dtype, epsilon)
    except Exception as e:  # Keras missing or refusing: n/a
        errors["keras"] = "%s: %s" % (type(e).__name__, str(e).split("\n")[0][:200])
    converters = {}
    if torch is not None:
        try:
            fns["torch"], converters["torch"] = _torch_layer_step(
                torch, x_nhwc, scale, offset, dy_nhwc, fmt, epsilon)
        except Exception as e:
            errors["torch"] = "%s: %s" % (type(e).__name__, str(e).split("\n")[0][:200])
    else:
        errors["torch"] = torch_why or "disabled by --no-torch"
    return fns, errors, converters
