"""Loads the op library, after checking it was built against the running TensorFlow."""
import glob
import os

import tensorflow as tf

_HERE = os.path.dirname(os.path.abspath(__file__))

#: The op type we register (the node type that appears in graphs). TF's own op of the same
#: signature is "FusedBatchNormGradV3"; see README, "Op name".
REGISTERED_OP_NAME = "FbnGrad>FusedBatchNormGradV3"
#: Our forward (FusedBatchNormV3's signature), its fused-activation variant and that
#: variant's backward (which also reads the forward's output y).
FORWARD_OP_NAME = "FbnGrad>FusedBatchNormV3"
FORWARD_EX_OP_NAME = "FbnGrad>FusedBatchNormEx"
GRAD_EX_OP_NAME = "FbnGrad>FusedBatchNormGradEx"


def _check_build():
    try:
        from . import _build_info
    except ImportError as e:
        raise ImportError(
            "fbn_grad_tf is not built, or its core module does not load (%s): run `pip "
            "install --no-build-isolation .` (or `python setup.py build_ext --inplace`) in an "
            "environment with tensorflow-cpu==2.21.0" % e) from None
    if _build_info.TF_VERSION is None:
        raise ImportError("fbn_grad_tf was built without TensorFlow (FBN_GRAD_TF_BUILD=%s); "
                          "only fbn_grad_tf.core is available. Rebuild with "
                          "FBN_GRAD_TF_BUILD=all for the TF op." % _build_info.BUILD)
    if _build_info.TF_VERSION != tf.__version__:
        raise ImportError(
            "fbn_grad_tf was built against TensorFlow %s but TensorFlow %s is installed; "
            "custom ops are bound to the exact TF version they were compiled with. Install "
            "tensorflow-cpu==%s, or rebuild: pip install --no-build-isolation --force-reinstall "
            "--no-deps ." % (_build_info.TF_VERSION, tf.__version__, _build_info.TF_VERSION))
    return _build_info


def _library_path():
    found = sorted(glob.glob(os.path.join(_HERE, "_fbn_grad_ops*.so")))
    if not found:
        raise ImportError("fbn_grad_tf: op library _fbn_grad_ops*.so not found in %s; "
                          "rebuild the package" % _HERE)
    return found[0]


_external = os.environ.get("FBN_GRAD_TF_LIBRARY")
if _external:
    # A library built elsewhere (e.g. with Bazel in a TF source tree, see BUILD): its ABI
    # match with the running TF is the builder's responsibility.
    build_info = None
    library_path = _external
else:
    build_info = _check_build()
    library_path = _library_path()
library = tf.load_op_library(library_path)
# tf.load_op_library names the Python wrapper after the op: "FbnGrad>FusedBatchNormGradV3"
# becomes fbn_grad_fused_batch_norm_grad_v3.
raw_op = library.fbn_grad_fused_batch_norm_grad_v3
# The forward ops; None in a library built without them (an older FBN_GRAD_TF_LIBRARY).
raw_forward_op = getattr(library, "fbn_grad_fused_batch_norm_v3", None)
raw_forward_ex_op = getattr(library, "fbn_grad_fused_batch_norm_ex", None)
raw_grad_ex_op = getattr(library, "fbn_grad_fused_batch_norm_grad_ex", None)
