"""The framework-free core for arrays: NumPy (CPU kernels) and device arrays (CUDA kernels).

No TensorFlow is imported here, so this works on a machine that only has NumPy (and, for
GPU arrays, PyTorch or CuPy)::

    from fbn_grad_tf import core
    dx, dscale, doffset = core.bn_grad(dy, x, scale, mean, var, data_format="NCHW")
    y, batch_mean, batch_var, saved_mean, saved_var = core.bn_forward(x, scale, offset)

Inputs on the GPU are recognized by ``__cuda_array_interface__`` (PyTorch CUDA tensors,
CuPy arrays, Numba arrays); outputs are allocated with the same library as ``x``.
"""
import os

import numpy as np

from . import _core

__all__ = ["bn_grad", "bn_forward", "validate", "validate_forward", "default_isa", "cpu_supports",
           "software_prefetch", "stream_min_bytes", "hugepage_advice", "channel_major_max_bytes",
           "CPU_ISAS", "with_cuda", "bfloat16"]

with_cuda = bool(_core.with_cuda)
default_isa = _core.default_isa
cpu_supports = _core.cpu_supports
# Whether the CPU backward prefetches its inputs in software: off on AMD CPUs, where that
# measured faster, on elsewhere; FBN_GRAD_TF_PREFETCH=on|off|auto overrides (read once).
software_prefetch = _core.software_prefetch
# From how many bytes a fresh CPU output (dx, y) of an element size (4: float32, 2: the 16-bit
# types) is written with non-temporal stores: 8 MiB for float32, max(8 MiB, L3 / 10) for the
# 16-bit types; FBN_GRAD_TF_STREAM_MIB=<MiB> sets one threshold for all (read once).
stream_min_bytes = _core.stream_min_bytes
# Whether the TF ops advise their large fresh CPU outputs (from 4 MiB) for transparent huge
# pages before writing them, which makes their first-touch page faults 512x fewer on Linux;
# FBN_GRAD_TF_HUGEPAGES=on|off|auto (auto = on) overrides (read once).
hugepage_advice = _core.hugepage_advice
# The largest channel (bytes of the planes it keeps cached: y_backprop and x in the backward,
# x in the float32 forward) that the CPU training kernels take channel by channel on
# channels-first tensors, reading them from memory once: 4 MiB where the kernels leave
# prefetching to the hardware (AMD CPUs), 0 (never) elsewhere;
# FBN_GRAD_TF_CHANNEL_MAJOR_KIB=<KiB> overrides (read once).
channel_major_max_bytes = _core.channel_major_max_bytes
# Every CPU path compiled in, lowest first; cpu_supports(name) says which this CPU can run.
CPU_ISAS = tuple(_core.isa_names())
validate = _core.validate
validate_forward = _core.validate_forward

try:  # NumPy has no bfloat16; ml_dtypes (a TensorFlow dependency) provides one.
    from ml_dtypes import bfloat16
except ImportError:  # pragma: no cover - optional
    bfloat16 = None

_FLOAT_TYPES = {"float32", "float16", "bfloat16"}


def _dtype_name(dtype, what="y_backprop and x"):
    """The kernels' name of `dtype`; TypeError naming `what` if they lack it."""
    name = str(dtype).replace("torch.", "")
    if name not in _FLOAT_TYPES:
        raise TypeError("%s must be float32, float16 or bfloat16, got %s" % (what, name))
    return name


def _is_device_array(a):
    return hasattr(a, "__cuda_array_interface__") or (
        hasattr(a, "is_cuda") and getattr(a, "is_cuda", False))


#: activation argument (lower case) -> the ops' activation_mode.
ACTIVATION_MODES = {"identity": "Identity", "relu": "Relu", "relu6": "Relu6",
                    "swish": "Swish", "silu": "Swish"}
#: The activation modes the kernels implement, one name each (silu is swish).
ACTIVATIONS = ("identity", "relu", "relu6", "swish")


def _activation_mode(activation):
    name = "identity" if activation is None else str(activation).lower()
    if name not in ACTIVATION_MODES:
        raise ValueError("activation must be None or one of %s, got %r"
                         % (", ".join('"%s"' % a for a in ACTIVATION_MODES), activation))
    return ACTIVATION_MODES[name]


def _like_x(a, xx, name):
    a = np.require(a, requirements="C")
    if a.dtype != xx.dtype:
        raise TypeError("%s must have the dtype of x (%s), got %s" % (name, xx.dtype, a.dtype))
    return a


def _threads(num_threads):
    return num_threads if num_threads > 0 else (os.cpu_count() or 1)


def bn_forward(x, scale, offset, mean=None, variance=None, epsilon=1e-4,
               exponential_avg_factor=1.0, data_format="NHWC", is_training=True,
               activation=None, saved_stat="variance", num_threads=0, isa="auto",
               side_input=None, return_act_mask=False):
    """Batch-norm forward of FusedBatchNormV3 on arrays.

    Returns ``(y, batch_mean, batch_variance, saved_mean, saved_var)``: batch_variance is
    Bessel-corrected (and blended with `variance` when exponential_avg_factor != 1);
    saved_mean/saved_var are reserve_space_1/2: the batch mean and the biased batch
    variance (``saved_stat="variance"``, TF's CPU convention) or 1/sqrt(var + epsilon)
    (``"inv_std"``, cuDNN's). mean/variance (running statistics) are needed in inference
    and when exponential_avg_factor != 1.
    side_input, activation (fused, FusedBatchNormEx): y = act(bn(x) + side_input);
    activation None, "relu", "relu6", "swish" (= "silu"); side_input None or an array of
    x's shape and dtype.
    return_act_mask=True (relu, relu6; CPU): also returns, last, the activation mask that
    the TF CPU forward hands its backward in reserve_space_3 (16 elements per 32-bit word,
    then a tag; csrc/core/activation.h), for bn_grad(act_mask=...).
    """
    mode = _activation_mode(activation)
    if return_act_mask and (mode not in ("Relu", "Relu6") or _is_device_array(x)):
        raise ValueError("return_act_mask: the activation mask is written by the CPU forward "
                         "of relu and relu6 only")
    if _is_device_array(x):
        return _bn_forward_device(x, scale, offset, mean, variance, epsilon,
                                  exponential_avg_factor, data_format, is_training, mode,
                                  saved_stat, side_input)
    xx = np.require(x, requirements="C")
    dtype = _dtype_name(xx.dtype, "x")
    vecs = [np.require(np.zeros(0) if v is None else v, dtype=np.float32, requirements="C")
            for v in (scale, offset, mean, variance)]
    side = None if side_input is None else _like_x(side_input, xx, "side_input")
    shapes = [list(a.shape) for a in (xx, *vecs)] + ([] if side is None else [list(side.shape)])
    _core.validate_forward(shapes, data_format, float(epsilon), float(exponential_avg_factor),
                           bool(is_training), mode)
    channels = vecs[0].shape[0]
    y = np.empty_like(xx)
    stats = [np.empty(channels, np.float32) for _ in range(4)]
    mask = (np.empty(_core.activation_mask_floats(int(xx.size)), np.uint32)
            if return_act_mask else None)
    ptrs = _core.addresses([*(a if a.size else None for a in (xx, *vecs)), y, *stats]
                           + ([] if side is None else [side]) + [mask])
    mask_ptr = ptrs.pop()
    _core.bn_forward_cpu_raw(dtype, ptrs, shapes, data_format, float(epsilon),
                             float(exponential_avg_factor), bool(is_training), mode, saved_stat,
                             int(_threads(num_threads)), isa, act_mask=mask_ptr)
    return (y, *stats) + (() if mask is None else (mask,))


def _bn_forward_device(x, scale, offset, mean, variance, epsilon, factor, data_format,
                       is_training, mode, saved_stat, side_input=None):
    if not with_cuda:
        raise RuntimeError("fbn_grad_tf._core was built without CUDA; rebuild with nvcc "
                           "available (FBN_GRAD_TF_CUDA=1)")
    lib = _array_library(x)
    x = lib.contiguous(x)
    vecs = [None if v is None else lib.contiguous(lib.as_float32(v))
            for v in (scale, offset, mean, variance)]
    dtype = _dtype_name(lib.dtype(x), "x")
    shapes = [list(lib.shape(x))] + [[0] if v is None else list(lib.shape(v)) for v in vecs]
    side = None
    if side_input is not None:
        side = lib.contiguous(side_input)
        if _dtype_name(lib.dtype(side), "side_input") != dtype:
            raise TypeError("side_input must have the dtype of x")
        shapes.append(list(lib.shape(side)))
    _core.validate_forward(shapes, data_format, float(epsilon), float(factor), bool(is_training),
                           mode)
    channels = shapes[1][0]
    y = lib.empty_like(x)
    stats = [lib.empty_f32(x, channels) for _ in range(4)]
    ws_bytes = _core.cuda_forward_workspace_bytes(shapes, data_format, float(epsilon),
                                                  float(factor), bool(is_training))
    ws = lib.empty_bytes(x, max(ws_bytes, 1))
    ptrs = ([lib.ptr(x)] + [0 if v is None else lib.ptr(v) for v in vecs] + [lib.ptr(y)]
            + [lib.ptr(a) for a in stats] + ([] if side is None else [lib.ptr(side)]))
    _core.bn_forward_cuda_raw(dtype, ptrs, shapes, data_format, float(epsilon), float(factor),
                              bool(is_training), mode, saved_stat, lib.ptr(ws), ws_bytes,
                              lib.stream(x))
    return (y, *stats)


def bn_grad(y_backprop, x, scale, reserve_space_1, reserve_space_2, epsilon=1e-4,
            data_format="NHWC", is_training=True, saved_stat="variance", num_threads=0,
            isa="auto", relu_y=None, activation=None, y=None, offset=None, side_input=None,
            side_input_backprop=False, act_mask=None):
    """Batch-norm backward of FusedBatchNormGradV3 on arrays.

    Returns ``(x_backprop, scale_backprop, offset_backprop)``, plus ``side_input_backprop``
    when side_input_backprop=True.

    The backward of a fused forward (bn_forward(activation=..., side_input=...),
    FusedBatchNormGradEx): activation None, "relu", "relu6", "swish"/"silu"; y (the forward's
    output) is required by relu/relu6; offset (and side_input, if the forward had one) by
    swish, which recomputes z = bn(x) + side_input. For float, relu/relu6 given the offset
    and no side input recompute z too and take their mask from it (y is then not read, one
    pass less, so y must be the forward's output for these inputs). side_input_backprop=True
    also returns dz = y_backprop * act'(z), the gradient of the side input. relu_y=... is the
    older spelling of activation="relu", y=relu_y. act_mask (relu/relu6, CPU): the forward's
    activation mask (bn_forward(return_act_mask=True)), read instead of y where the kernels
    would read y; ValueError if it is not the mask of x's elements for this activation. The
    device path reads y.

    saved_stat: what ``reserve_space_2`` holds in training mode: ``"variance"`` (TF's CPU
    forward) or ``"inv_std"`` (TF's GPU forward: 1/sqrt(var + epsilon)).
    num_threads: CPU threads (0 = all cores). isa: CPU path (auto, baseline, avx2, avx512, avx512bf16).
    """
    if relu_y is not None:
        if activation is not None or y is not None:
            raise ValueError("relu_y cannot be combined with activation= or y=")
        activation, y = "relu", relu_y
    mode = _activation_mode(activation)
    fused = mode != "Identity" or side_input is not None or side_input_backprop or y is not None
    if _is_device_array(x):
        return _bn_grad_device(y_backprop, x, scale, reserve_space_1, reserve_space_2,
                               epsilon, data_format, is_training, saved_stat, mode, fused, y,
                               offset, side_input, side_input_backprop)
    # np.require keeps 0-d arrays 0-d (np.ascontiguousarray would make them 1-d and hide a
    # rank error behind a shape of [1]).
    dy = np.require(y_backprop, requirements="C")
    xx = np.require(x, requirements="C")
    vecs = [np.require(v, dtype=np.float32, requirements="C")
            for v in (scale, reserve_space_1, reserve_space_2)]
    _dtype_name(xx.dtype)  # raises TypeError for a dtype the kernels lack
    if act_mask is not None:
        act_mask = np.require(act_mask, requirements="C")
        if act_mask.dtype.itemsize != 4 or act_mask.ndim != 1:
            raise TypeError("act_mask must be the forward's 1-D mask of 32-bit words "
                            "(bn_forward(return_act_mask=True), or the TF forward's "
                            "reserve_space_3)")
    if dy.dtype != xx.dtype:
        raise TypeError("y_backprop and x must have the same dtype, got %s and %s"
                        % (dy.dtype, xx.dtype))
    extra = None
    if fused:
        extra = [None if y is None else _like_x(y, xx, "y"),
                 None if offset is None else np.require(offset, dtype=np.float32,
                                                        requirements="C"),
                 None if side_input is None else _like_x(side_input, xx, "side_input")]
    _core.validate([list(a.shape) for a in (dy, xx, *vecs)], data_format, float(epsilon))
    channels = vecs[0].shape[0]
    out = (np.empty_like(xx), np.empty(channels, np.float32), np.empty(channels, np.float32),
           np.empty_like(xx) if side_input_backprop else None)
    if num_threads <= 0:
        num_threads = os.cpu_count() or 1
    _bn_grad_cpu(dy, xx, vecs, extra, out, data_format, epsilon, is_training, saved_stat,
                 num_threads, isa, mode, act_mask)
    return out if side_input_backprop else out[:3]


def _bn_grad_cpu(dy, xx, vecs, extra, out, data_format, epsilon, is_training, saved_stat,
                 num_threads, isa, mode, act_mask=None):
    """The raw CPU call of bn_grad, on checked C-contiguous arrays: vecs = [scale, rs1, rs2];
    extra = None (the plain backward) or [y, offset, side_input] (None where absent); out =
    (dx, dscale, doffset, side_input_backprop or None). dx may be dy or xx itself and
    side_input_backprop dy itself (in place, as the TF op does: csrc/core/backward.h)."""
    dx, dscale, doffset, dside = out
    shapes = [list(a.shape) for a in (dy, xx, *vecs)]
    arrays = [dy, xx, *vecs, dx, dscale, doffset]
    present = []
    if extra is not None:
        shapes += [[0] if a is None else list(a.shape) for a in extra]
        arrays += [*extra, dside]
        present = [a is not None for a in extra] + [dside is not None]
    ptrs = _core.addresses(arrays + [act_mask])
    act_mask_ptr = ptrs.pop()
    _core.bn_grad_cpu_raw(_dtype_name(xx.dtype), ptrs, shapes, data_format, float(epsilon),
                          bool(is_training), saved_stat, int(num_threads), isa, mode, present,
                          act_mask=act_mask_ptr,
                          act_mask_floats=0 if act_mask is None else act_mask.size)


def _bn_grad_device(dy, x, scale, rs1, rs2, epsilon, data_format, is_training, saved_stat,
                    mode="Identity", fused=False, y=None, offset=None, side_input=None,
                    side_input_backprop=False, out=None):
    """bn_grad on device arrays. out: None (fresh outputs) or (dx, dscale, doffset,
    side_input_backprop or None): contiguous device arrays of x's shape and type (dscale,
    doffset: [C] float32), where dx may be dy or x itself and side_input_backprop dy itself
    (in place, as the TF op does: csrc/core/backward.h), no other overlap; dy and x must then
    be contiguous already. With out, side_input_backprop is whether out[3] is given."""
    if not with_cuda:
        raise RuntimeError("fbn_grad_tf._core was built without CUDA; rebuild with nvcc "
                           "available (FBN_GRAD_TF_CUDA=1)")
    lib = _array_library(x)
    if out is not None and not (lib.is_contiguous(dy) and lib.is_contiguous(x)):
        raise ValueError("out= needs contiguous y_backprop and x (an output may be one of them)")
    dy, x = lib.contiguous(dy), lib.contiguous(x)
    vecs = [lib.contiguous(lib.as_float32(v)) for v in (scale, rs1, rs2)]
    dtype = _dtype_name(lib.dtype(x))
    if _dtype_name(lib.dtype(dy)) != dtype:
        raise TypeError("y_backprop and x must have the same dtype")
    shapes = [list(lib.shape(a)) for a in (dy, x, *vecs)]
    _core.validate(shapes, data_format, float(epsilon))
    channels = shapes[2][0]
    if out is None:
        dx, dscale, doffset = (lib.empty_like(x), lib.empty_f32(x, channels),
                               lib.empty_f32(x, channels))
        dside = lib.empty_like(x) if side_input_backprop else None
    else:
        dx, dscale, doffset, dside = out
        _check_device_out(lib, out, x, dy, channels, dtype, fused)
        side_input_backprop = dside is not None
    ws_bytes = _core.cuda_workspace_bytes(shapes, data_format, float(epsilon))
    ws = lib.empty_bytes(x, max(ws_bytes, 1))
    ptrs = [lib.ptr(a) for a in (dy, x, *vecs, dx, dscale, doffset)]
    present = []
    if fused:
        ex = [None if y is None else lib.contiguous(y),
              None if offset is None else lib.contiguous(lib.as_float32(offset)),
              None if side_input is None else lib.contiguous(side_input)]
        for a, name in ((ex[0], "y"), (ex[2], "side_input")):
            if a is not None and _dtype_name(lib.dtype(a)) != dtype:
                raise TypeError("%s must have the dtype of x" % name)
        present = [a is not None for a in ex] + [bool(side_input_backprop)]
        shapes = shapes + [[0] if a is None else list(lib.shape(a)) for a in ex]
        ptrs += [0 if a is None else lib.ptr(a) for a in ex]
        ptrs.append(0 if dside is None else lib.ptr(dside))
    _core.bn_grad_cuda_raw(dtype, ptrs, shapes, data_format, float(epsilon), bool(is_training),
                           saved_stat, lib.ptr(ws), ws_bytes, lib.stream(x), mode, present)
    if side_input_backprop:
        return dx, dscale, doffset, dside
    return dx, dscale, doffset


def _check_device_out(lib, out, x, dy, channels, dtype, fused):
    """Raises ValueError unless `out` (see _bn_grad_device) fits the kernel's contract: the
    kernel gets raw pointers, so a wrong shape, type or layout would be written out of
    bounds or silently wrong."""
    dx, dscale, doffset, dside = out
    names = ("x_backprop", "scale_backprop", "offset_backprop", "side_input_backprop")
    for name, a, shape, want in zip(names, out, (lib.shape(x), [channels], [channels],
                                                 lib.shape(x)),
                                    (dtype, "float32", "float32", dtype)):
        if a is None:
            continue
        if (list(lib.shape(a)) != list(shape) or _dtype_name(lib.dtype(a)) != want
                or not lib.is_contiguous(a)):
            raise ValueError("out: %s must be a contiguous %s array of shape %s" % (
                name, want, list(shape)))
    if dside is not None and not fused:
        raise ValueError("out: side_input_backprop needs the fused backward (an activation, "
                         "y, offset or side_input)")
    if dx is None or dscale is None or doffset is None:
        raise ValueError("out: x_backprop, scale_backprop and offset_backprop are required")
    # The aliasing the kernels allow (backward.h); any other shared start is refused.
    allowed = {("y_backprop", "x_backprop"), ("x", "x_backprop"),
               ("y_backprop", "side_input_backprop")}
    bufs = [(n, lib.ptr(a)) for n, a in (("y_backprop", dy), ("x", x)) + tuple(zip(names, out))
            if a is not None]
    for i, (na, pa) in enumerate(bufs):
        for nb, pb in bufs[i + 1:]:
            if pa == pb and nb in names and (na, nb) not in allowed:
                raise ValueError("out: %s must not share memory with %s" % (nb, na))


class _Torch:
    def __init__(self, torch):
        self.t = torch

    def contiguous(self, a):
        return a.contiguous()

    def is_contiguous(self, a):
        return a.is_contiguous()

    def as_float32(self, a):
        return a.to(self.t.float32)

    def dtype(self, a):
        return a.dtype

    def shape(self, a):
        return a.shape

    def empty_like(self, a):
        return self.t.empty_like(a)

    def empty_f32(self, like, n):
        return self.t.empty(n, dtype=self.t.float32, device=like.device)

    def empty_bytes(self, like, n):
        return self.t.empty(n, dtype=self.t.uint8, device=like.device)

    def ptr(self, a):
        return a.data_ptr()

    def stream(self, a):
        return self.t.cuda.current_stream(a.device).cuda_stream


class _CuPy:
    def __init__(self, cp):
        self.cp = cp

    def contiguous(self, a):
        return self.cp.ascontiguousarray(a)

    def is_contiguous(self, a):
        return bool(a.flags.c_contiguous)

    def as_float32(self, a):
        return a.astype(self.cp.float32, copy=False)

    def dtype(self, a):
        return a.dtype

    def shape(self, a):
        return a.shape

    def empty_like(self, a):
        return self.cp.empty_like(a)

    def empty_f32(self, like, n):
        return self.cp.empty(n, self.cp.float32)

    def empty_bytes(self, like, n):
        return self.cp.empty(n, self.cp.uint8)

    def ptr(self, a):
        return a.data.ptr

    def stream(self, a):
        return self.cp.cuda.get_current_stream().ptr


def _array_library(x):
    mod = type(x).__module__.split(".")[0]
    if mod == "torch":
        import torch
        return _Torch(torch)
    if mod == "cupy":
        import cupy
        return _CuPy(cupy)
    raise TypeError("device arrays must be PyTorch tensors or CuPy arrays, got %s" % type(x))


# ---- split backward (reduce / apply), CPU ------------------------------------------------
# The split entry points of the core (BnGradReduceCpu / BnGradApplyCpu, what the TF ops
# FbnGrad>BatchNormGradReduce / BatchNormGradApply run): per-channel sums over the local
# tensor, then x_backprop from sums over `count` elements per channel (all-reduced across
# replicas in cross-replica batch norm). Training mode, reserve_space_2 = the biased
# variance (TF's CPU convention). Reduce followed by apply with the local sums and count is
# bitwise identical to bn_grad's x_backprop.

__all__ += ["bn_grad_reduce", "bn_grad_apply", "validate_split"]

validate_split = _core.validate_split


def _split_arrays(y_backprop, x, vectors, relu_y, what):
    for a in (y_backprop, x):
        if _is_device_array(a):
            raise TypeError("%s runs the CPU kernels only (NumPy arrays); got a device array"
                            % what)
    dy = np.require(y_backprop, requirements="C")
    xx = np.require(x, requirements="C")
    dtype = _dtype_name(xx.dtype)
    if dy.dtype != xx.dtype:
        raise TypeError("y_backprop and x must have the same dtype, got %s and %s"
                        % (dy.dtype, xx.dtype))
    vecs = [np.require(v, dtype=np.float32, requirements="C") for v in vectors]
    ry = None
    if relu_y is not None:
        ry = np.require(relu_y, requirements="C")
        if ry.shape != xx.shape or ry.dtype != xx.dtype:
            raise ValueError("relu_y must have the shape and dtype of x, got %s %s and %s %s"
                             % (ry.shape, ry.dtype, xx.shape, xx.dtype))
    return dtype, dy, xx, vecs, ry


def bn_grad_reduce(y_backprop, x, mean, data_format="NHWC", num_threads=0, isa="auto",
                   relu_y=None):
    """Local per-channel sums of the batch-norm backward (training), as
    FbnGrad>BatchNormGradReduce: ``sum_dy = sum(y_backprop)``,
    ``sum_dy_xmu = sum(y_backprop * (x - mean))``.

    Returns ``(sum_dy, sum_dy_xmu, count)``: two float32 [C] arrays and the number of
    elements per channel (a float, as the op's output). relu_y: as in bn_grad (y_backprop
    masked with relu_y > 0). NumPy arrays only (CPU kernels).
    """
    dtype, dy, xx, (mm,), ry = _split_arrays(y_backprop, x, (mean,), relu_y, "bn_grad_reduce")
    shapes = [list(a.shape) for a in (dy, xx, mm)]
    _core.validate_split(shapes, False, data_format, 0.0)
    channels = mm.shape[0]
    sums = [np.empty(channels, np.float32) for _ in range(2)]
    ptrs = _core.addresses([dy, xx, mm, *sums] + ([] if ry is None else [ry]))
    count = _core.bn_grad_reduce_cpu_raw(dtype, ptrs, shapes, data_format,
                                         int(_threads(num_threads)), isa)
    return sums[0], sums[1], count


def bn_grad_apply(y_backprop, x, scale, mean, variance, sum_dy, sum_dy_xmu, count,
                  epsilon=1e-4, data_format="NHWC", num_threads=0, isa="auto", relu_y=None):
    """x_backprop of the batch-norm backward (training) from per-channel sums over `count`
    elements per channel, as FbnGrad>BatchNormGradApply. mean/variance: the batch statistics
    the forward normalized with (variance biased). count: a finite number >= 1 (a Python
    number or a 0-d array). relu_y: as in bn_grad. NumPy arrays only (CPU kernels).
    """
    dtype, dy, xx, vecs, ry = _split_arrays(
        y_backprop, x, (scale, mean, variance, sum_dy, sum_dy_xmu), relu_y, "bn_grad_apply")
    cnt = np.asarray(count)
    if cnt.ndim != 0:
        raise ValueError("count must be a scalar, got shape %s"
                         % ("[" + ",".join(str(d) for d in cnt.shape) + "]"))
    shapes = [list(a.shape) for a in (dy, xx, *vecs)]
    _core.validate_split(shapes, True, data_format, float(epsilon))
    dx = np.empty_like(xx)
    ptrs = _core.addresses([dy, xx, *vecs, dx] + ([] if ry is None else [ry]))
    _core.bn_grad_apply_cpu_raw(dtype, ptrs, shapes, float(cnt), data_format, float(epsilon),
                                int(_threads(num_threads)), isa)
    return dx
