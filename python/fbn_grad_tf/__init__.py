"""fbn_grad_tf: a FusedBatchNormGradV3-compatible batch-norm backward for TensorFlow.

Importing the package loads the op library (so SavedModels that use the op can be loaded).
On a machine without TensorFlow only the framework-free ``fbn_grad_tf.core`` is usable.
"""
__version__ = "0.2.0"

def _tf_part_available():
    """False on a machine without TensorFlow (e.g. a GPU box with only PyTorch) and for a
    core-only build (FBN_GRAD_TF_BUILD=core): then only fbn_grad_tf.core is usable."""
    try:
        from . import _build_info
        if _build_info.BUILD != "all":
            return False
    except ImportError:
        pass  # not built: _loader raises a clear error below
    try:
        import tensorflow  # noqa: F401
    except ModuleNotFoundError as e:
        if e.name != "tensorflow":
            raise
        return False
    return True


HAVE_TENSORFLOW = _tf_part_available()
if HAVE_TENSORFLOW:
    from ._loader import REGISTERED_OP_NAME, build_info, library_path, raw_op  # noqa: F401
    from .ops import (  # noqa: F401
        DATA_FORMATS, FusedBatchNorm, FusedBatchNormGrad, FusedBatchNormGradOutputs,
        FusedBatchNormOutputs, Scope, fused_batch_norm_grad, fused_batch_norm_v3)
    from . import gradients  # noqa: F401,E402  (registers the gradient of our op)
    from .nn import fused_batch_norm, use_for_gradients  # noqa: F401,E402
    from . import keras  # noqa: F401,E402  (registers fbn_grad_tf>BatchNormalization)
    from . import sync  # noqa: F401,E402  (registers fbn_grad_tf>SyncBatchNormalization)
    from .sync import SyncBatchNormalization, sync_batch_norm  # noqa: F401,E402
