"""fbn_grad_tf: a FusedBatchNormGradV3-compatible batch-norm backward for TensorFlow.

Importing the package loads the op library (so SavedModels that use the op can be loaded).
On a machine without TensorFlow only the framework-free ``fbn_grad_tf.core`` is usable.
"""
__version__ = "0.1.0"

try:
    import tensorflow as _tf  # noqa: F401
except ModuleNotFoundError as _e:  # TF-free machine (e.g. a GPU box with only PyTorch)
    if _e.name != "tensorflow":
        raise
    HAVE_TENSORFLOW = False
else:
    HAVE_TENSORFLOW = True
    from ._loader import REGISTERED_OP_NAME, build_info, library_path, raw_op  # noqa: F401
    from .ops import (  # noqa: F401
        DATA_FORMATS, FusedBatchNormGrad, FusedBatchNormGradOutputs, Scope,
        fused_batch_norm_grad)
    from . import gradients  # noqa: F401,E402  (registers the gradient of our op)
    from .nn import fused_batch_norm, use_for_gradients  # noqa: F401,E402
    from . import keras  # noqa: F401,E402  (registers fbn_grad_tf>BatchNormalization)
