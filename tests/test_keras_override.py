"""fbn_grad_tf.keras.override(): Keras 3 BatchNormalization layers (subclassed models, model
constructors, load_model) and tf_keras' fused BatchNormalization on fbn_grad_tf's ops."""
import os

import numpy as np
import pytest
import tensorflow as tf
import keras

import fbn_grad_tf
from fbn_grad_tf.keras import override, override_enabled

import model_oracle as oracle

OURS_FWD = "FbnGrad>FusedBatchNormV3"
OURS_BWD = fbn_grad_tf.REGISTERED_OP_NAME  # "FbnGrad>FusedBatchNormGradV3"


def op_types(concrete):
    gd = concrete.graph.as_graph_def()
    return {n.op for n in gd.node} | {n.op for f in gd.library.function for n in f.node_def}


def step_types(model, x, y):
    @tf.function
    def step(x, y):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(keras.losses.sparse_categorical_crossentropy(
                y, model(x, training=True), from_logits=True))
        return tape.gradient(loss, model.trainable_variables)
    return op_types(step.get_concrete_function(x, y))


class Net(keras.Model):
    """A subclassed model: convert() cannot rewrite it, override() can run it."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.conv = keras.layers.Conv2D(6, 3, use_bias=False)
        self.bn = keras.layers.BatchNormalization(momentum=0.9)
        self.dense = keras.layers.Dense(3)

    def call(self, x, training=False):
        h = tf.nn.relu(self.bn(self.conv(x), training=training))
        return self.dense(tf.reduce_mean(h, axis=[1, 2]))


def test_on_off_call_and_nesting():
    assert not override_enabled()
    with override():
        assert override_enabled()
        with override(False):
            assert not override_enabled()
        assert override_enabled()
    assert not override_enabled()
    override()
    try:
        assert override_enabled()
    finally:
        override(False)
    assert not override_enabled()
    from fbn_grad_tf import nn
    assert not nn.registry_patched()  # the tf_keras routing is off again


def test_overlapping_blocks_and_a_reused_object():
    """Blocks are counted: left out of order (as from two threads) the override stays on
    while one remains and is off, with TF's registry restored, after the last; an override()
    object entered twice is on both times."""
    from fbn_grad_tf import nn
    a = override()  # as `with` does: made, then entered
    a.__enter__()
    b = override()
    b.__enter__()
    a.__exit__(None, None, None)
    assert override_enabled()
    b.__exit__(None, None, None)
    assert not override_enabled() and not nn.registry_patched()
    assert getattr(keras.layers.BatchNormalization(), "_fbn_grad_tf_override", False) is False
    ov = override()
    for _ in range(2):
        with ov:
            assert override_enabled()
        assert not override_enabled()


def test_subclassed_model_created_under_override():
    x, y = oracle.data(0, (8, 8, 8, 3), classes=3)
    keras.utils.set_random_seed(1)
    with override():
        net = Net()
        net(x)
    keras.utils.set_random_seed(1)
    ref = Net()
    ref(x)
    ref.set_weights(net.get_weights())
    assert type(net.bn) is keras.layers.BatchNormalization  # class and config unchanged
    assert not net.bn.supports_jit
    # Created under override: our ops, also when traced after the block.
    types = step_types(net, x, y)
    assert OURS_FWD in types and OURS_BWD in types
    assert not {"FusedBatchNormV3", "FusedBatchNormGradV3"} & types
    assert OURS_BWD not in step_types(ref, x, y)  # Keras' own layer stays Keras'
    with override():  # called under override: ours
        assert OURS_BWD in step_types(ref, x, y)
    # Same training as Keras' layer: losses of a few fit epochs, moving statistics.
    for m in (net, ref):
        m.compile(optimizer=keras.optimizers.SGD(0.05),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    h = [m.fit(x, y, batch_size=4, epochs=3, shuffle=False, verbose=0).history["loss"]
         for m in (net, ref)]
    np.testing.assert_allclose(h[0], h[1], rtol=1e-4)
    np.testing.assert_allclose(net.bn.moving_variance.numpy(), ref.bn.moving_variance.numpy(),
                               rtol=1e-4)


def test_load_model_under_override(tmp_path):
    keras.utils.set_random_seed(2)
    inp = keras.Input((6, 6, 3))
    h = keras.layers.BatchNormalization(name="bn")(keras.layers.Conv2D(4, 3)(inp))
    model = keras.Model(inp, keras.layers.Dense(2)(keras.layers.Flatten()(h)))
    path = os.path.join(str(tmp_path), "plain.keras")
    model.save(path)
    x, y = oracle.data(1, (4, 6, 6, 3), classes=2)
    with override():
        loaded = keras.models.load_model(path)
    assert type(loaded.get_layer("bn")) is keras.layers.BatchNormalization
    assert OURS_BWD in step_types(loaded, x, y)
    np.testing.assert_allclose(loaded(x, training=True), model(x, training=True), rtol=1e-4,
                               atol=1e-5)
    loaded.save(os.path.join(str(tmp_path), "again.keras"))  # still a plain Keras file
    assert OURS_BWD not in step_types(keras.models.load_model(path), x, y)


@pytest.mark.parametrize("name", ["MobileNetV2"] + [
    pytest.param(n, marks=pytest.mark.slow)
    for n in ("ResNet50", "ResNet50V2", "DenseNet121", "EfficientNetB0")])
def test_application_under_override_matches_float64_oracle(name):
    """The model constructor run under override(): same float64-oracle criterion as
    convert's test (medians over oracle.SEEDS batches)."""
    k32 = oracle.build_app(name)
    k64 = oracle.build_app(name, "float64")
    with override():
        ours = oracle.build_app(name)
    ours.set_weights(k32.get_weights())
    x, y = oracle.data(0)
    assert OURS_BWD in step_types(ours, x, y)
    errs = oracle.compare(ours, k32, k64, seeds=oracle.SEEDS)
    oracle.assert_as_good_as_keras(errs, label=name + " under override")


def test_tf_keras_fit_runs_on_our_ops():
    """tf_keras (Keras 2): its fused BatchNormalization builds FusedBatchNormV3 through TF's
    builder, which override() routes to our forward op (and our gradient)."""
    tf_keras = pytest.importorskip("tf_keras")
    x, y = oracle.data(2, (16, 8, 8, 3), classes=3)

    def make():
        tf_keras.utils.set_random_seed(4)
        L = tf_keras.layers
        return tf_keras.Sequential([
            tf_keras.Input((8, 8, 3)), L.Conv2D(6, 3, use_bias=False),
            L.BatchNormalization(momentum=0.9), L.ReLU(), L.GlobalAveragePooling2D(),
            L.Dense(3)])

    models = [make(), make()]
    models[1].set_weights(models[0].get_weights())
    hist = []
    for i, m in enumerate(models):
        m.compile(optimizer=tf_keras.optimizers.SGD(0.05),
                  loss=tf_keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        if i == 0:
            with override():
                hist.append(m.fit(x, y, batch_size=8, epochs=3, shuffle=False,
                                  verbose=0).history["loss"])
        else:
            hist.append(m.fit(x, y, batch_size=8, epochs=3, shuffle=False,
                              verbose=0).history["loss"])
        types = set().union(*(op_types(cf) for cf in
                              m.train_function._list_all_concrete_functions()))  # noqa: SLF001
        if i == 0:
            assert OURS_FWD in types and OURS_BWD in types, sorted(types)
            assert not {"FusedBatchNormV3", "FusedBatchNormGradV3"} & types
        else:
            assert "FusedBatchNormGradV3" in types and OURS_BWD not in types
    np.testing.assert_allclose(hist[0], hist[1], rtol=1e-4)
    for a, b in zip(models[0].get_weights(), models[1].get_weights()):
        np.testing.assert_allclose(a, b, rtol=1e-3, atol=1e-5)
