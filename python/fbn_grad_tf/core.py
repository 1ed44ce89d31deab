"""The framework-free core for arrays: NumPy (CPU kernels) and device arrays (CUDA kernels).

No TensorFlow is imported here, so this works on a machine that only has NumPy (and, for
GPU arrays, PyTorch or CuPy)::

    from fbn_grad_tf import core
    dx, dscale, doffset = core.bn_grad(dy, x, scale, mean, var, data_format="NCHW")

Inputs on the GPU are recognized by ``__cuda_array_interface__`` (PyTorch CUDA tensors,
CuPy arrays, Numba arrays); outputs are allocated with the same library as ``x``.
"""
import os

import numpy as np

from . import _core

__all__ = ["bn_grad", "validate", "default_isa", "cpu_supports", "with_cuda", "bfloat16"]

with_cuda = bool(_core.with_cuda)
default_isa = _core.default_isa
cpu_supports = _core.cpu_supports
validate = _core.validate

try:  # NumPy has no bfloat16; ml_dtypes (a TensorFlow dependency) provides one.
    from ml_dtypes import bfloat16
except ImportError:  # pragma: no cover - optional
    bfloat16 = None

_FLOAT_TYPES = {"float32", "float16", "bfloat16"}


def _dtype_name(dtype):
    name = str(dtype).replace("torch.", "")
    if name not in _FLOAT_TYPES:
        raise TypeError("y_backprop and x must be float32, float16 or bfloat16, got %s" % name)
    return name


def _is_device_array(a):
    return hasattr(a, "__cuda_array_interface__") or (
        hasattr(a, "is_cuda") and getattr(a, "is_cuda", False))


def bn_grad(y_backprop, x, scale, reserve_space_1, reserve_space_2, epsilon=1e-4,
            data_format="NHWC", is_training=True, saved_stat="variance", num_threads=0,
            isa="auto"):
    """Batch-norm backward of FusedBatchNormGradV3 on arrays.

    Returns ``(x_backprop, scale_backprop, offset_backprop)``.

    saved_stat: what ``reserve_space_2`` holds in training mode: ``"variance"`` (TF's CPU
    forward) or ``"inv_std"`` (TF's GPU forward: 1/sqrt(var + epsilon)).
    num_threads: CPU threads (0 = all cores). isa: CPU path (auto, baseline, avx2, avx512).
    """
    if _is_device_array(x):
        return _bn_grad_device(y_backprop, x, scale, reserve_space_1, reserve_space_2,
                               epsilon, data_format, is_training, saved_stat)
    # np.require keeps 0-d arrays 0-d (np.ascontiguousarray would make them 1-d and hide a
    # rank error behind a shape of [1]).
    dy = np.require(y_backprop, requirements="C")
    xx = np.require(x, requirements="C")
    vecs = [np.require(v, dtype=np.float32, requirements="C")
            for v in (scale, reserve_space_1, reserve_space_2)]
    dtype = _dtype_name(xx.dtype)
    if dy.dtype != xx.dtype:
        raise TypeError("y_backprop and x must have the same dtype, got %s and %s"
                        % (dy.dtype, xx.dtype))
    shapes = [list(a.shape) for a in (dy, xx, *vecs)]
    _core.validate(shapes, data_format, float(epsilon))
    dx = np.empty_like(xx)
    channels = vecs[0].shape[0]
    dscale = np.empty(channels, np.float32)
    doffset = np.empty(channels, np.float32)
    if num_threads <= 0:
        num_threads = os.cpu_count() or 1
    ptrs = [a.ctypes.data for a in (dy, xx, *vecs, dx, dscale, doffset)]
    _core.bn_grad_cpu_raw(dtype, ptrs, shapes, data_format, float(epsilon), bool(is_training),
                          saved_stat, int(num_threads), isa)
    return dx, dscale, doffset


def _bn_grad_device(dy, x, scale, rs1, rs2, epsilon, data_format, is_training, saved_stat):
    if not with_cuda:
        raise RuntimeError("fbn_grad_tf._core was built without CUDA; rebuild with nvcc "
                           "available (FBN_GRAD_TF_CUDA=1)")
    lib = _array_library(x)
    dy, x = lib.contiguous(dy), lib.contiguous(x)
    vecs = [lib.contiguous(lib.as_float32(v)) for v in (scale, rs1, rs2)]
    dtype = _dtype_name(lib.dtype(x))
    if _dtype_name(lib.dtype(dy)) != dtype:
        raise TypeError("y_backprop and x must have the same dtype")
    shapes = [list(lib.shape(a)) for a in (dy, x, *vecs)]
    _core.validate(shapes, data_format, float(epsilon))
    channels = shapes[2][0]
    dx = lib.empty_like(x)
    dscale = lib.empty_f32(x, channels)
    doffset = lib.empty_f32(x, channels)
    ws_bytes = _core.cuda_workspace_bytes(shapes, data_format, float(epsilon))
    ws = lib.empty_bytes(x, max(ws_bytes, 1))
    ptrs = [lib.ptr(a) for a in (dy, x, *vecs, dx, dscale, doffset)]
    _core.bn_grad_cuda_raw(dtype, ptrs, shapes, data_format, float(epsilon), bool(is_training),
                           saved_stat, lib.ptr(ws), ws_bytes, lib.stream(x))
    return dx, dscale, doffset


class _Torch:
    def __init__(self, torch):
        self.t = torch

    def contiguous(self, a):
        return a.contiguous()

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
