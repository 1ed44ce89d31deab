"""The build itself: TF version recorded and enforced, CUDA kernels compiled in when nvcc is
present (CI has nvcc, no GPU) and the CUDA-built library still loading and working on
CPU-only TensorFlow."""
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest
import tensorflow as tf
from tensorflow.python.framework import kernels

import fbn_grad_tf
from fbn_grad_tf import core

NVCC = shutil.which("nvcc") or (os.path.exists("/usr/local/cuda/bin/nvcc") and
                                "/usr/local/cuda/bin/nvcc")
OPS = ["FbnGrad>FusedBatchNormGradV3", "FbnGrad>BatchNormGradReduce",
       "FbnGrad>BatchNormGradApply"]
# Ops with CPU and (when CUDA is compiled in) GPU kernels.
DEVICE_OPS = ["FbnGrad>FusedBatchNormGradV3", "FbnGrad>FusedBatchNormGradEx",
              "FbnGrad>FusedBatchNormV3", "FbnGrad>FusedBatchNormEx"]


def test_build_info_matches_running_tf():
    assert fbn_grad_tf.build_info.TF_VERSION == tf.__version__ == "2.21.0"


def test_cuda_compiled_in_when_nvcc_present():
    if fbn_grad_tf.build_info.CUDA_MODE == "0":
        pytest.skip("CUDA disabled for this build (FBN_GRAD_TF_CUDA=0)")
    assert fbn_grad_tf.build_info.WITH_CUDA == bool(NVCC)
    assert core.with_cuda == bool(NVCC)


def _devices(op):
    return sorted({k.device_type for k in kernels.get_registered_kernels_for_op(op).kernel})


def test_registered_kernels():
    for op in DEVICE_OPS:
        assert _devices(op) == (["CPU", "GPU"] if fbn_grad_tf.build_info.WITH_CUDA else ["CPU"]), op
    for op in OPS[1:]:
        assert _devices(op) == ["CPU"]
    # Never on TF's own op name: TF's kernels stay the only ones there.
    assert "FbnGrad" not in str(kernels.get_registered_kernels_for_op("FusedBatchNormGradV3"))
    assert "FbnGrad" not in str(kernels.get_registered_kernels_for_op("FusedBatchNormV3"))


def test_cuda_built_library_runs_on_cpu_only_tf():
    assert not tf.config.list_physical_devices("GPU")
    x = tf.random.stateless_normal([2, 3, 3, 4], seed=[1, 2])
    dy = tf.random.stateless_normal([2, 3, 3, 4], seed=[3, 4])
    mean, var = tf.nn.moments(x, [0, 1, 2])
    ours = fbn_grad_tf.fused_batch_norm_grad(dy, x, tf.ones([4]), mean, var, tf.zeros([0]))
    theirs = tf.raw_ops.FusedBatchNormGradV3(
        y_backprop=dy, x=x, scale=tf.ones([4]), reserve_space_1=mean, reserve_space_2=var,
        reserve_space_3=tf.zeros([0]))
    np.testing.assert_allclose(ours.x_backprop.numpy(), theirs[0].numpy(), rtol=1e-5,
                               atol=1e-5)


def test_cuda_entry_point_without_gpu_fails_cleanly():
    if not core.with_cuda:
        pytest.skip("built without CUDA")
    from fbn_grad_tf import _core
    shapes = [[1, 2, 2, 3], [1, 2, 2, 3], [3], [3], [3]]
    with pytest.raises(RuntimeError, match="CUDA error"):
        _core.bn_grad_cuda_raw("float32", [0] * 8, shapes, "NHWC", 1e-4, True, "variance",
                               0, _core.cuda_workspace_bytes(shapes, "NHWC", 1e-4), 0)


def test_tf_version_mismatch_is_a_clear_import_error():
    code = ("import tensorflow as tf; tf.__version__ = '2.99.0'\n"
            "try:\n    import fbn_grad_tf\nexcept ImportError as e:\n    print('ERR', e)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120).stdout
    assert "ERR fbn_grad_tf was built against TensorFlow 2.21.0 but TensorFlow 2.99.0" in out
    assert "rebuild" in out


@pytest.mark.skipif(shutil.which("objdump") is None, reason="objdump (binutils) not installed")
@pytest.mark.parametrize("library", ["_core", "_fbn_grad_ops"])
def test_cpu_kernels_keep_their_software_prefetches(library):
    """The backward's software prefetch (PrefetchInputs) must survive into the binaries.
    GCC once marked the prefetch-only helpers `const` and deleted every call: the source
    said prefetch, the machine code had none, and only a benchmark could tell. Counted per
    library over all four ISA paths (each compiles the prefetch loops several times)."""
    import glob
    found = glob.glob(os.path.join(os.path.dirname(fbn_grad_tf.__file__), library + "*.so"))
    assert found, "%s*.so not found next to %s" % (library, fbn_grad_tf.__file__)
    path = found[0]
    asm = subprocess.run(["objdump", "-d", "--no-show-raw-insn", path], check=True,
                         capture_output=True, text=True).stdout
    count = sum(1 for line in asm.splitlines() if "\tprefetcht0" in line)
    assert count >= 16, "%s: %d prefetcht0 instructions; the kernels' prefetches were " \
        "optimized away" % (os.path.basename(path), count)
