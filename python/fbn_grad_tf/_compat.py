"""What differs between the Keras 3 versions fbn_grad_tf runs with (TensorFlow 2.16 to 2.21,
Keras 3.3 and later; scripts/compat_check.sh tests each pair): kept here, in one place, so
the layers' code reads as written for the newest Keras.

* Batch renormalization (``renorm``, ``renorm_clipping``, ``renorm_momentum``): arguments
  and attributes of ``keras.layers.BatchNormalization`` from Keras 3.14 on. Our layers take
  them in every version; where the installed Keras lacks them, ``bn_init_kwargs`` drops them
  if they change nothing (``renorm=False``: the other two are then unused) and refuses them
  otherwise, and ``renorm(layer)`` reads False. So a config written by a newer Keras (what
  ``convert`` copies, what a .keras file holds) builds the same layer with an older one.
"""
import inspect

import keras

__all__ = ["bn_init_kwargs", "renorm"]

#: The arguments of keras.layers.BatchNormalization.__init__ in the installed Keras (read
#: before override() can wrap it; its wrapper keeps this signature anyway).
_KERAS_BN_ARGS = frozenset(inspect.signature(keras.layers.BatchNormalization.__init__)
                           .parameters)

#: Arguments of keras.layers.BatchNormalization that older Keras 3 versions do not take,
#: each with a test of whether leaving it out changes nothing (value, all the arguments).
_NEWER_BN_ARGS = {
    "renorm": lambda value, kwargs: not value,                   # Keras >= 3.14
    "renorm_clipping": lambda value, kwargs: not kwargs.get("renorm"),
    "renorm_momentum": lambda value, kwargs: not kwargs.get("renorm"),
}


def bn_init_kwargs(kwargs):
    """``kwargs`` (keyword arguments for ``keras.layers.BatchNormalization.__init__``, as
    the newest Keras takes them) minus those the installed Keras does not take and that
    change nothing. ValueError if such an argument would change the layer."""
    out = dict(kwargs)
    for name, unused in _NEWER_BN_ARGS.items():
        if name in out and name not in _KERAS_BN_ARGS:
            if not unused(out[name], kwargs):
                raise ValueError(
                    "BatchNormalization(%s=%r): Keras %s's BatchNormalization has no %r "
                    "argument (batch renormalization needs Keras 3.14 or later)"
                    % (name, out[name], keras.__version__, name))
            del out[name]
    return out


def renorm(layer):
    """``layer.renorm`` of a keras.layers.BatchNormalization; False where Keras has none."""
    return bool(getattr(layer, "renorm", False))
