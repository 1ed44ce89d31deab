"""core._bn_grad_device's out= checks (_check_device_out), run on the CPU with NumPy arrays
behind the same small array interface the device path uses: the kernels get raw pointers,
so every output must have x's shape and type (or [C] float32), be contiguous, and share
memory only as the kernels allow (backward.h: x_backprop in y_backprop or x,
side_input_backprop in y_backprop)."""
import numpy as np
import pytest

core = pytest.importorskip("fbn_grad_tf.core")


class _NumpyLib:
    def shape(self, a):
        return a.shape

    def dtype(self, a):
        return a.dtype

    def is_contiguous(self, a):
        return bool(a.flags.c_contiguous)

    def ptr(self, a):
        return a.ctypes.data


def _arrays():
    x = np.zeros((2, 3, 3, 4), np.float32)
    dy = np.zeros_like(x)
    return dy, x, np.zeros(4, np.float32), np.zeros(4, np.float32)


def _check(out, fused=True):
    dy, x = out[-1]
    core._check_device_out(_NumpyLib(), out[:4], x, dy, 4, "float32", fused)


@pytest.mark.parametrize("dx_in, dz_in", [("fresh", None), ("dy", None), ("x", None),
                                          ("x", "dy"), ("fresh", "dy"), ("x", "fresh")])
def test_allowed_outputs(dx_in, dz_in):
    dy, x, ds, do = _arrays()
    bufs = {"dy": dy, "x": x}
    dx = bufs.get(dx_in, np.zeros_like(x))
    dz = None if dz_in is None else bufs.get(dz_in, np.zeros_like(x))
    _check((dx, ds, do, dz, (dy, x)))


@pytest.mark.parametrize("case", ["dz_in_x", "dz_is_dx", "dscale_is_doffset", "dx_wrong_shape",
                                  "dx_wrong_dtype", "dx_strided", "dscale_wrong_len",
                                  "dz_not_fused", "missing_dscale"])
def test_refused_outputs(case):
    dy, x, ds, do = _arrays()
    dx, dz, fused = np.zeros_like(x), None, True
    if case == "dz_in_x":
        dx, dz = np.zeros_like(x), x
    elif case == "dz_is_dx":
        dz = dx
    elif case == "dscale_is_doffset":
        do = ds
    elif case == "dx_wrong_shape":
        dx = np.zeros((2, 3, 3, 5), np.float32)
    elif case == "dx_wrong_dtype":
        dx = np.zeros(x.shape, np.float16)
    elif case == "dx_strided":
        dx = np.zeros((2, 3, 3, 8), np.float32)[..., ::2]
    elif case == "dscale_wrong_len":
        ds = np.zeros(5, np.float32)
    elif case == "dz_not_fused":
        dz, fused = np.zeros_like(x), False
    elif case == "missing_dscale":
        ds = None
    with pytest.raises(ValueError, match="out"):
        _check((dx, ds, do, dz, (dy, x)), fused=fused)
