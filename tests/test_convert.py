"""fbn_grad_tf.keras.convert: functional and Sequential Keras 3 models rebuilt with
fbn_grad_tf's BatchNormalization (and BN+activation fusion where the fused op supports it),
checked on keras.applications models against a float64 oracle (tests/model_oracle.py)."""
import os
import warnings

import numpy as np
import pytest
import tensorflow as tf
import keras

import fbn_grad_tf
from fbn_grad_tf import nn
from fbn_grad_tf.keras import BatchNormalization as FbnBN
from fbn_grad_tf.keras import convert

import model_oracle as oracle

SLOW_APPS = ("ResNet50", "ResNet50V2", "DenseNet121", "EfficientNetB0")


def all_op_types(fn, *args):
    gd = fn.get_concrete_function(*args).graph.as_graph_def()
    return {n.op for n in gd.node} | {n.op for f in gd.library.function for n in f.node_def}


def keras_bns(model):
    return [layer for layer in model._flatten_layers()  # pylint: disable=protected-access
            if type(layer) is keras.layers.BatchNormalization]


def ours(model):
    return [layer for layer in model._flatten_layers()  # pylint: disable=protected-access
            if isinstance(layer, FbnBN)]


def patterns_model():
    """One of each pattern: BN+Activation(relu), BN+ReLU(), BN+ReLU(6), BN+swish,
    BN+Add+ReLU (residual), a BN with two consumers, a BN that is a model output."""
    keras.utils.set_random_seed(3)
    L = keras.layers
    inp = keras.Input((8, 8, 3), name="img")
    a = L.Conv2D(8, 3, padding="same", name="c1")(inp)
    a = L.BatchNormalization(name="bn_act_relu")(a)
    a = L.Activation("relu", name="act_relu")(a)
    b = L.Conv2D(8, 3, padding="same", name="c2")(a)
    b = L.BatchNormalization(name="bn_relu_layer", momentum=0.9, epsilon=1e-4)(b)
    b = L.ReLU(name="relu_layer")(b)
    c = L.Conv2D(8, 1, name="c3")(b)
    c = L.BatchNormalization(name="bn_relu6")(c)
    c = L.ReLU(6.0, name="relu6")(c)
    d = L.Conv2D(8, 1, name="c4")(c)
    d = L.BatchNormalization(name="bn_swish")(d)
    d = L.Activation("swish", name="swish")(d)
    e = L.Conv2D(8, 1, name="c5")(d)
    e = L.BatchNormalization(name="bn_residual")(e)
    e = L.Add(name="add")([b, e])
    e = L.Activation("relu", name="add_relu")(e)
    f = L.Conv2D(8, 1, name="c6")(e)
    f = L.BatchNormalization(name="bn_two_consumers")(f)
    g = L.Add(name="add2")([L.ReLU(name="relu_a")(f), f])
    h = L.BatchNormalization(name="bn_out")(g)
    logits = L.Dense(4, name="logits")(L.GlobalAveragePooling2D(name="gap")(h))
    return keras.Model(inp, [logits, h], name="patterns")


def test_patterns_fused_and_reported():
    model = patterns_model()
    conv, rep = convert(model, return_report=True)
    # Same layers in the same order; the absorbed ones stand as FusedIntoBatchNorm layers
    # that hold their configs; every BN is ours.
    assert [layer.name for layer in conv.layers] == [layer.name for layer in model.layers]
    absorbed = {layer.name: layer for layer in conv.layers
                if isinstance(layer, fbn_grad_tf.keras.FusedIntoBatchNorm)}
    assert set(absorbed) == {"act_relu", "relu_layer", "relu6", "swish", "add", "add_relu"}
    for name, layer in absorbed.items():
        assert layer.absorbed_config["config"] == model.get_layer(name).get_config()
        assert not layer.weights
    assert not keras_bns(conv) and len(ours(conv)) == 7
    assert sorted(rep.replaced) == sorted(layer.name for layer in keras_bns(model))
    assert sorted(rep.fused) == [("bn_act_relu", ["act_relu"], "relu"),
                                 ("bn_relu6", ["relu6"], "relu6"),
                                 ("bn_relu_layer", ["relu_layer"], "relu"),
                                 ("bn_residual", ["add", "add_relu"], "relu"),
                                 ("bn_swish", ["swish"], "swish")]
    assert conv.get_layer("bn_act_relu").activation == "relu"
    assert conv.get_layer("bn_relu6").activation == "relu6"
    assert conv.get_layer("bn_swish").activation == "swish"
    assert conv.get_layer("bn_relu_layer").get_config()["epsilon"] == 1e-4
    # bn_two_consumers and bn_out match no pattern; everything that matched was fused.
    assert not rep.not_fused
    assert not rep.not_converted and not rep.shared
    assert "5 fused" in str(rep)
    # Same weights, same outputs (inference and a training step), same moving statistics.
    for layer in model.layers:
        if layer.weights:
            for a, b in zip(layer.get_weights(), conv.get_layer(layer.name).get_weights()):
                np.testing.assert_array_equal(a, b)
    x = oracle.data(0, (6, 8, 8, 3))[0]
    for a, b in zip(model(x, training=False), conv(x, training=False)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)
    for a, b in zip(model(x, training=True), conv(x, training=True)):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4)
    for v, w in zip(model.non_trainable_variables, conv.non_trainable_variables):
        assert v.path == w.path
        np.testing.assert_allclose(v.numpy(), w.numpy(), rtol=1e-5, atol=1e-6)
    # The original is untouched.
    assert len(keras_bns(model)) == 7 and "act_relu" in {layer.name for layer in model.layers}


def test_fuse_false_and_synchronized():
    model = patterns_model()
    conv, rep = convert(model, fuse=False, return_report=True)
    assert not rep.fused and not rep.not_fused
    assert len(conv.layers) == len(model.layers)
    assert all(layer.activation is None and not layer.synchronized for layer in ours(conv))
    sync = convert(model, synchronized=True)
    assert all(layer.synchronized for layer in ours(sync))
    x = oracle.data(1, (6, 8, 8, 3))[0]
    for a, b in zip(model(x, training=True), sync(x, training=True)):  # no strategy: local
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4)


def test_fusion_follows_the_lists(monkeypatch):
    """convert fuses exactly what nn.FUSED_ACTIVATIONS / FUSED_SIDE_INPUT_ACTIVATIONS list
    (the op is not called here): without relu6 and side inputs, those are reported."""
    monkeypatch.setattr(nn, "FUSED_ACTIVATIONS", ("relu", "swish"))
    monkeypatch.setattr(nn, "FUSED_SIDE_INPUT_ACTIVATIONS", ())
    conv, rep = convert(patterns_model(), return_report=True)
    reasons = {bn: (pattern, reason) for bn, pattern, reason in rep.not_fused}
    assert reasons["bn_relu6"][1] == "activation relu6 not supported by the fused op yet"
    assert reasons["bn_residual"][0] == "BN+Add+activation: add + add_relu"
    assert "side input" in reasons["bn_residual"][1]
    assert ("bn_swish", ["swish"], "swish") in rep.fused
    assert conv.get_layer("bn_relu6").activation is None
    assert type(conv.get_layer("relu6")) is keras.layers.ReLU


def test_sequential_and_nested():
    keras.utils.set_random_seed(5)
    L = keras.layers
    block = keras.Sequential([keras.Input((8, 8, 4)), L.Conv2D(4, 3, padding="same"),
                              L.BatchNormalization(name="inner_bn"), L.ReLU(name="inner_relu")],
                             name="block")
    seq = keras.Sequential([keras.Input((8, 8, 3)), L.Conv2D(4, 3, padding="same"),
                            L.BatchNormalization(name="bn1"), L.Activation("relu", name="r1"),
                            block, L.BatchNormalization(name="bn2"),
                            L.ReLU(max_value=6.0, name="r6"), L.GlobalAveragePooling2D(),
                            L.Dense(3)], name="seq")
    conv, rep = convert(seq, return_report=True)
    assert isinstance(conv, keras.Sequential) and conv.name == "seq"
    assert [layer.name for layer in conv.layers] == [layer.name for layer in seq.layers]
    assert isinstance(conv.get_layer("r1"), fbn_grad_tf.keras.FusedIntoBatchNorm)
    assert isinstance(conv.get_layer("r6"), fbn_grad_tf.keras.FusedIntoBatchNorm)
    assert ("bn1", ["r1"], "relu") in rep.fused
    assert ("block/inner_bn", ["inner_relu"], "relu") in rep.fused
    assert ("bn2", ["r6"], "relu6") in rep.fused
    assert not rep.not_fused
    assert not keras_bns(conv) and len(ours(conv)) == 3
    x = oracle.data(2, (5, 8, 8, 3))[0]
    np.testing.assert_allclose(seq(x, training=True), conv(x, training=True), rtol=1e-4,
                               atol=1e-4)
    np.testing.assert_allclose(seq(x), conv(x), rtol=1e-5, atol=1e-5)


class Subclassed(keras.Model):
    def __init__(self):
        super().__init__()
        self.bn = keras.layers.BatchNormalization()

    def call(self, x):
        return self.bn(x)


class BlockLayer(keras.layers.Layer):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.bn = keras.layers.BatchNormalization()

    def call(self, x, training=None):
        return self.bn(x, training=training)


def test_refusals_say_why():
    with pytest.raises(ValueError, match="subclassed keras.Model.*override"):
        convert(Subclassed())
    with pytest.raises(TypeError, match="Keras 3 model"):
        convert(keras.layers.Dense(3))
    tf_keras = pytest.importorskip("tf_keras")
    tfk = tf_keras.Sequential([tf_keras.Input((4,)), tf_keras.layers.BatchNormalization()])
    with pytest.raises(TypeError, match="tf_keras.*override"):
        convert(tfk)
    # A BN inside a custom layer's Python code: not reachable, reported, warned.
    inp = keras.Input((4, 4, 2))
    model = keras.Model(inp, BlockLayer(name="blk")(keras.layers.BatchNormalization()(inp)))
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        conv, rep = convert(model, return_report=True)
    assert rep.not_converted and rep.not_converted[0][0] == "blk"
    assert "override" in rep.not_converted[0][1]
    assert any("not converted" in str(r.message) for r in rec)
    assert len(ours(conv)) == 1


def test_training_graph_and_keras_file_round_trip(tmp_path):
    conv = convert(patterns_model())
    x, y = oracle.data(4, (6, 8, 8, 3), classes=4)
    opt = keras.optimizers.SGD(0.05)

    @tf.function
    def step(x, y):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(keras.losses.sparse_categorical_crossentropy(
                y, conv(x, training=True)[0], from_logits=True))
        grads = tape.gradient(loss, conv.trainable_variables)
        opt.apply_gradients(zip(grads, conv.trainable_variables))
        return loss

    types = all_op_types(step, x, y)
    assert {"FbnGrad>FusedBatchNormEx", "FbnGrad>FusedBatchNormGradEx",
            "FbnGrad>FusedBatchNormV3", fbn_grad_tf.REGISTERED_OP_NAME} <= types
    assert not {"FusedBatchNormV3", "FusedBatchNormGradV3"} & types
    step(x, y)
    path = os.path.join(str(tmp_path), "converted.keras")
    conv.save(path)
    loaded = keras.models.load_model(path)
    assert [type(layer) for layer in loaded.layers] == [type(layer) for layer in conv.layers]
    assert loaded.get_layer("bn_act_relu").activation == "relu"
    for a, b in zip(loaded(x), conv(x)):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)


# ---- keras.applications ----------------------------------------------------------------------

EXPECTED = {  # (BN layers replaced, fused with an activation, matched but not fused, reason)
    "MobileNetV2": (52, 35, 0, None),  # BN+ReLU6
    # 33 BN+ReLU and 12 BN+Add+ReLU. The 4 projection blocks' Add has a BN on both inputs:
    # fusing either would make the other's branch deeper, which reorders the layers (weight
    # files and checkpoints match by order), so neither is fused.
    "ResNet50": (53, 45, 8, "order of the model's layers"),
    "ResNet50V2": (49, 49, 0, None),
    "DenseNet121": (121, 121, 0, None),
    "EfficientNetB0": (49, 33, 0, None),  # BN+swish
}
FUSED_ADDS = {"ResNet50": 12}  # BN+Add+ReLU fusions (they absorb two layers each)


@pytest.mark.parametrize("name", ["MobileNetV2"] + [
    pytest.param(n, marks=pytest.mark.slow) for n in SLOW_APPS])
def test_application_converted_matches_float64_oracle(name):
    """convert(app): every BN ours, the fusions expected, and one training step as close to
    the float64 model as Keras' own float32 model (medians over oracle.SEEDS)."""
    k32 = oracle.build_app(name)
    k64 = oracle.build_app(name, "float64")
    conv, rep = convert(k32, return_report=True)
    replaced, fused, not_fused, why = EXPECTED[name]
    assert (len(rep.replaced), len(rep.fused), len(rep.not_fused)) == (
        replaced, fused, not_fused)
    assert all(why in r for _, _, r in rep.not_fused)
    assert not keras_bns(conv) and len(ours(conv)) == replaced
    # Each fusion absorbs one activation, or the Add and the ReLU of BN+Add+ReLU (ResNet50:
    # 33 x 1 + 12 x 2); they stay as FusedIntoBatchNorm layers: same layers, same order.
    absorbed = [name for _, names, _ in rep.fused for name in names]
    assert len(absorbed) == fused + FUSED_ADDS.get(name, 0)
    assert [layer.name for layer in conv.layers] == [layer.name for layer in k32.layers]
    assert sorted(layer.name for layer in conv.layers
                  if isinstance(layer, fbn_grad_tf.keras.FusedIntoBatchNorm)) == sorted(absorbed)
    x = oracle.data(9)[0]
    np.testing.assert_allclose(conv(x), k32(x), rtol=1e-5, atol=1e-5)  # inference
    errs = oracle.compare(conv, k32, k64, seeds=oracle.SEEDS)
    oracle.assert_as_good_as_keras(errs, label=name)


@pytest.mark.slow
def test_application_keras_file_round_trip(tmp_path):
    conv = convert(oracle.build_app("ResNet50"))
    path = os.path.join(str(tmp_path), "resnet50.keras")
    conv.save(path)
    loaded = keras.models.load_model(path)
    assert len(ours(loaded)) == 53 and not keras_bns(loaded)
    x = oracle.data(3)[0]
    np.testing.assert_allclose(loaded(x), conv(x), rtol=1e-6, atol=1e-6)
