"""fbn_grad_tf.keras.BatchNormalization against keras.layers.BatchNormalization."""
import os
import warnings

import numpy as np
import pytest
import tensorflow as tf
import keras

import fbn_grad_tf
from fbn_grad_tf import gradients as fgrads
from fbn_grad_tf.keras import BatchNormalization as FbnBN

OURS = fbn_grad_tf.REGISTERED_OP_NAME
TFS = "FusedBatchNormGradV3"


def all_op_types(graph):
    gd = graph.as_graph_def()
    types = {n.op for n in gd.node}
    for f in gd.library.function:
        types |= {n.op for n in f.node_def}
    return types


def small_cnn(bn_cls, seed=1, channels_first=False):
    keras.utils.set_random_seed(seed)
    inp = keras.Input((12, 12, 3))
    h = keras.layers.Conv2D(8, 3, padding="same")(inp)
    h = bn_cls()(h)
    h = keras.layers.ReLU()(h)
    h = keras.layers.MaxPooling2D()(h)
    h = keras.layers.Conv2D(8, 3, padding="same")(h)
    if channels_first:
        h = keras.layers.Permute((3, 1, 2))(h)
        h = bn_cls(axis=1, momentum=0.9, epsilon=1e-4)(h)
        h = keras.layers.Permute((2, 3, 1))(h)
    else:
        h = bn_cls(momentum=0.9, epsilon=1e-4)(h)
    h = keras.layers.ReLU()(h)
    h = keras.layers.GlobalAveragePooling2D()(h)
    return keras.Model(inp, keras.layers.Dense(4)(h))


def _data(n=48, seed=0):
    rng = np.random.default_rng(seed)
    return (rng.normal(0.5, 2.0, (n, 12, 12, 3)).astype("float32"),
            rng.integers(0, 4, n).astype("int32"))


def _assert_weights_close(m1, m2, rtol=1e-4):
    worst = 0.0
    for v, a, b in zip(m1.weights, m1.get_weights(), m2.get_weights()):
        # Conv biases right before a BN get a zero gradient in exact math: compare them
        # against the size of the kernel they belong to, not their own (tiny) size.
        ref = max(np.max(np.abs(b)), 1e-1)
        err = np.max(np.abs(a - b)) / ref
        worst = max(worst, err)
        assert err < rtol, (v.path, err)
    return worst


@pytest.mark.parametrize("channels_first", [False, True])
def test_cnn_training_matches_keras(channels_first):
    """Same initial weights, same data, SGD with momentum: same losses and weights."""
    X, Y = _data()
    models = []
    for cls in (FbnBN, keras.layers.BatchNormalization):
        m = small_cnn(cls, channels_first=channels_first)
        m.compile(optimizer=keras.optimizers.SGD(0.05, momentum=0.9),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        models.append(m)
    models[1].set_weights(models[0].get_weights())
    hist = [m.fit(X, Y, batch_size=16, epochs=2, shuffle=False, verbose=0).history["loss"]
            for m in models]
    np.testing.assert_allclose(hist[0], hist[1], rtol=1e-4)
    _assert_weights_close(models[0], models[1])
    np.testing.assert_allclose(models[0].predict(X, verbose=0), models[1].predict(X, verbose=0),
                               rtol=1e-3, atol=1e-4)
    assert not models[0].jit_compile  # supports_jit=False keeps "auto" off XLA


def _train_step_fn(model, opt, jit=False):
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)

    @tf.function(jit_compile=jit)
    def step(x, y):
        with tf.GradientTape() as tape:
            loss = loss_fn(y, model(x, training=True))
        grads = tape.gradient(loss, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables))
        return loss
    return step


def test_train_step_graph_uses_our_op():
    X, Y = _data(16)
    model = small_cnn(FbnBN)
    step = _train_step_fn(model, keras.optimizers.SGD(0.1))
    types = all_op_types(step.get_concrete_function(X, Y).graph)
    # Training runs on our forward and our backward; TF's forward only with forward_op.
    assert OURS in types and TFS not in types
    assert "FbnGrad>FusedBatchNormV3" in types and "FusedBatchNormV3" not in types
    model2 = small_cnn(FbnBN)
    for layer in model2.layers:
        if isinstance(layer, FbnBN):
            layer.forward_op = "tensorflow"
    step2 = _train_step_fn(model2, keras.optimizers.SGD(0.1))
    types2 = all_op_types(step2.get_concrete_function(X, Y).graph)
    assert OURS in types2 and "FusedBatchNormV3" in types2
    assert "FbnGrad>FusedBatchNormV3" not in types2


@pytest.mark.parametrize("forward_op", ["fbn_grad_tf", "tensorflow"])
def test_fused_relu_layer_matches_bn_then_relu(forward_op):
    rng = np.random.default_rng(4)
    x = tf.constant(rng.standard_normal((8, 6, 6, 5)).astype(np.float32))
    ours = FbnBN(activation="relu")
    ours.forward_op = forward_op
    ref = keras.layers.BatchNormalization()
    ours.build(x.shape)
    ref.build(x.shape)
    ref.set_weights(ours.get_weights())
    with tf.GradientTape(persistent=True) as tape:
        tape.watch(x)
        a = ours(x, training=True)
        b = tf.nn.relu(ref(x, training=True))
    np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(tape.gradient(a, x).numpy(), tape.gradient(b, x).numpy(),
                               rtol=1e-4, atol=1e-4)
    for u, v in zip(ours.get_weights(), ref.get_weights()):  # moving statistics
        np.testing.assert_allclose(u, v, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(ours(x, training=False).numpy(),
                               tf.nn.relu(ref(x, training=False)).numpy(), rtol=1e-5, atol=1e-5)
    assert FbnBN.from_config(ours.get_config()).activation == "relu"


def test_jit_compile_falls_back_to_tf_grad_with_warning():
    X, Y = _data(16)
    fgrads._reset_warnings_for_tests()
    m1, m2 = small_cnn(FbnBN), small_cnn(keras.layers.BatchNormalization)
    m2.set_weights(m1.get_weights())
    s1 = _train_step_fn(m1, keras.optimizers.SGD(0.1), jit=True)
    s2 = _train_step_fn(m2, keras.optimizers.SGD(0.1), jit=False)
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        losses = [(float(s1(X, Y)), float(s2(X, Y))) for _ in range(3)]
    msgs = [str(r.message) for r in rec if "fbn_grad_tf" in str(r.message)]
    assert len(msgs) == 1 and "XLA" in msgs[0]
    types = all_op_types(s1.get_concrete_function(X, Y).graph)
    assert OURS not in types
    for a, b in losses:
        assert abs(a - b) < 1e-4 * max(1.0, abs(b))
    _assert_weights_close(m1, m2, rtol=1e-3)  # XLA reorders float math


@pytest.mark.parametrize("shape,axis,dtype_policy", [
    ((4, 5, 6, 3), -1, "float32"),
    ((4, 3, 5, 6), 1, "float32"),
    ((2, 3, 4, 5, 3), -1, "float32"),
    ((2, 3, 3, 4, 5), 1, "float32"),
    ((4, 5, 6, 3), -1, "mixed_float16"),
    ((4, 3, 5, 6), 1, "mixed_bfloat16"),
    ((6, 5), -1, "float32"),          # 2-D: Keras fallback
    ((4, 5, 3), -1, "float32"),       # 3-D: Keras fallback
    ((4, 5, 6, 3), 2, "float32"),     # not the channel axis: Keras fallback
])
def test_layer_matches_keras(shape, axis, dtype_policy):
    rng = np.random.default_rng(3)
    x = rng.normal(1.0, 2.0, shape).astype("float32")
    w = rng.normal(0, 1, shape).astype("float32")
    kw = dict(axis=axis, momentum=0.8, epsilon=1e-3, dtype=dtype_policy,
              gamma_initializer=keras.initializers.RandomUniform(0.5, 1.5, seed=1),
              beta_initializer=keras.initializers.RandomNormal(seed=2),
              moving_mean_initializer=keras.initializers.RandomNormal(seed=3),
              moving_variance_initializer=keras.initializers.RandomUniform(0.5, 2, seed=4))
    ours, ref = FbnBN(**kw), keras.layers.BatchNormalization(**kw)
    ours.build(shape)
    ref.build(shape)
    fused = ours.fused_data_format(shape, tf.as_dtype(ours.compute_dtype)) is not None
    assert fused == (len(shape) in (4, 5) and axis in (1, -1))
    half = dtype_policy != "float32"
    tol = 2e-2 if half else 1e-4
    for training in (True, False, True):
        outs = []
        for layer in (ours, ref):
            xt = tf.constant(x)
            with tf.GradientTape() as tape:
                tape.watch(xt)
                y = layer(xt, training=training)
                loss = tf.reduce_sum(tf.cast(y, tf.float32) * w)
            outs.append([y] + tape.gradient(loss, [xt] + layer.trainable_variables)
                        + [layer.moving_mean.numpy(), layer.moving_variance.numpy()])
        assert outs[0][0].dtype == outs[1][0].dtype == tf.as_dtype(ours.compute_dtype)
        for a, b in zip(outs[0], outs[1]):
            a = np.asarray(tf.cast(tf.convert_to_tensor(a), tf.float32))
            b = np.asarray(tf.cast(tf.convert_to_tensor(b), tf.float32))
            np.testing.assert_allclose(a, b, rtol=tol, atol=tol * max(1.0, np.abs(b).max()))


def test_training_flag_semantics():
    x = tf.constant(np.random.default_rng(0).normal(2.0, 3.0, (8, 4, 4, 2)), tf.float32)
    layer = FbnBN(momentum=0.5)
    inp = keras.Input((4, 4, 2))
    model = keras.Model(inp, layer(inp))
    mm0 = layer.moving_mean.numpy().copy()
    y_none = model(x)  # training=None outside fit: inference, no stat update
    np.testing.assert_array_equal(layer.moving_mean.numpy(), mm0)
    np.testing.assert_allclose(y_none, layer(x, training=False), rtol=1e-6)
    y_train = model(x, training=True)  # propagated to the layer by Keras' call context
    assert np.abs(np.mean(y_train, axis=(0, 1, 2))).max() < 1e-4
    assert not np.allclose(layer.moving_mean.numpy(), mm0)
    layer.trainable = False  # frozen: inference mode even with training=True
    mm1 = layer.moving_mean.numpy().copy()
    np.testing.assert_allclose(layer(x, training=True), layer(x, training=False), rtol=1e-6)
    np.testing.assert_array_equal(layer.moving_mean.numpy(), mm1)


def test_no_scale_no_center_and_mask_fallback():
    x = tf.constant(np.random.default_rng(1).normal(0, 2, (4, 3, 3, 2)), tf.float32)
    for kw in (dict(scale=False), dict(center=False), dict(scale=False, center=False)):
        ours, ref = FbnBN(**kw), keras.layers.BatchNormalization(**kw)
        np.testing.assert_allclose(ours(x, training=True), ref(x, training=True), atol=1e-5)
        assert len(ours.trainable_variables) == len(ref.trainable_variables)
    ours = FbnBN()
    assert ours.fused_data_format((4, 3, 3, 2), tf.float32, mask=tf.ones((4, 3, 3))) is None
    assert FbnBN(renorm=True).fused_data_format((4, 3, 3, 2), tf.float32) is None
    assert ours.fused_data_format((4, 3, 3, 2), tf.float64) is None


def test_synchronized_routes_to_the_sync_path():
    """synchronized=True goes through fbn_grad_tf.sync (split reduce/apply ops); with no
    strategy active it equals Keras' layer, gradients included."""
    x = tf.random.stateless_normal([8, 5, 5, 6], seed=[4, 2]) * 2.0 + 1.0
    w = tf.random.stateless_normal([8, 5, 5, 6], seed=[7, 1])
    ours, ref = FbnBN(synchronized=True), keras.layers.BatchNormalization()
    ours.build(x.shape)
    ref.build(x.shape)

    @tf.function
    def grads(layer):
        with tf.GradientTape() as tape:
            tape.watch(x)
            loss = tf.reduce_sum(layer(x, training=True) * w)
        return tape.gradient(loss, [x] + layer.trainable_variables)

    graph = grads.get_concrete_function(ours).graph
    assert "FbnGrad>BatchNormGradApply" in {op.type for op in graph.get_operations()}
    for a, b in zip(grads(ours), grads(ref)):
        np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=1e-4, atol=1e-5)
    assert FbnBN.from_config(ours.get_config()).synchronized


def test_config_and_keras_file_round_trip(tmp_path):
    layer = FbnBN(axis=1, momentum=0.7, epsilon=1e-4, center=False,
                  gamma_regularizer=keras.regularizers.L2(1e-3),
                  beta_constraint=keras.constraints.NonNeg(), name="fbn")
    cfg = layer.get_config()
    clone = FbnBN.from_config(cfg)
    assert clone.get_config() == cfg and isinstance(clone, FbnBN)
    assert keras.saving.get_registered_name(FbnBN) == "fbn_grad_tf>BatchNormalization"

    X, Y = _data(16)
    model = small_cnn(FbnBN)
    model.compile(optimizer="sgd",
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    model.fit(X, Y, epochs=1, verbose=0)
    path = os.path.join(str(tmp_path), "m.keras")
    model.save(path)
    loaded = keras.models.load_model(path)
    bns = [l for l in loaded.layers if "batch_normalization" in l.name]
    assert bns and all(type(l) is FbnBN for l in bns)
    np.testing.assert_allclose(loaded.predict(X, verbose=0), model.predict(X, verbose=0),
                               rtol=1e-6, atol=1e-6)
    for a, b in zip(loaded.get_weights(), model.get_weights()):
        np.testing.assert_array_equal(a, b)
    loaded.fit(X, Y, epochs=1, verbose=0)  # still trainable after loading
