"""fbn_grad_tf for Keras 3 models: the layer, and whole models in one call.

    import fbn_grad_tf
    layer = fbn_grad_tf.keras.BatchNormalization()      # same arguments as keras.layers.BN
    bn_relu = fbn_grad_tf.keras.BatchNormalization(activation="relu")  # relu(bn(x)), fused
    y = fbn_grad_tf.keras.BatchNormalization(activation="swish")(x, side_input=r)  # swish(bn(x)+r)

    fast = fbn_grad_tf.keras.convert(model)     # BN (+ activation, + residual Add) on our ops
    stock = fbn_grad_tf.keras.revert(fast)      # back to keras.layers.BatchNormalization & co.
    with fbn_grad_tf.keras.override():          # every BN created or traced here runs on our
        model = keras.applications.ResNet50()   # ops, the model's code unchanged

``BatchNormalization`` and ``override`` live in ``_keras_layer``; ``convert`` and ``revert``
in ``_convert``, which builds on the layer (imports go one way: this module -> _convert ->
_keras_layer). See docs/DROPIN.md for how each fits a training and deployment workflow.
"""
from ._keras_layer import (  # noqa: F401
    BatchNormalization, fused_data_format, override, override_enabled)
from ._convert import ConvertReport, FusedIntoBatchNorm, convert, revert  # noqa: F401

__all__ = ["BatchNormalization", "ConvertReport", "FusedIntoBatchNorm", "convert", "override",
           "override_enabled", "revert"]
