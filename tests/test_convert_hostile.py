"""fbn_grad_tf.keras.convert on hostile models: a BN on a middle axis, masks (from Masking and
from an Embedding), renorm, nested models (shared too), shared layers, a BN whose output feeds
two consumers, float64 models. Each must be converted correctly (same outputs as the
original in inference and in a training step, same moving statistics afterwards, same
gradients), or left as Keras' layer, or refused with a message that says why; the report must
say what was done. Nothing may change silently."""
import inspect

import numpy as np
import pytest
import tensorflow as tf
import keras

from fbn_grad_tf.keras import BatchNormalization as FbnBN
from fbn_grad_tf.keras import convert

L = keras.layers


def _flat_layers(model):
    out = []
    for la in model._flatten_layers():  # pylint: disable=protected-access
        out.append(la)
        if isinstance(la, keras.Model) and la is not model:
            out.extend(_flat_layers(la))
    return [la for la in out if isinstance(la, keras.layers.Layer)]


def _bns(model):
    return [la for la in _flat_layers(model) if isinstance(la, keras.layers.BatchNormalization)]


def _moving(model):
    return [(la.name, np.array(la.moving_mean), np.array(la.moving_variance))
            for la in _bns(model)]


def _assert_same_model(orig, conv, inputs, tol, train=True):
    """Outputs (inference, then training), gradients and moving statistics after the
    training call agree."""
    def run(model, training):
        with tf.GradientTape() as tape:
            out = model(inputs, training=training)
            outs = out if isinstance(out, (list, tuple)) else [out]
            loss = tf.add_n([tf.reduce_sum(tf.cast(o, tf.float64) ** 2) for o in outs])
        grads = tape.gradient(loss, model.trainable_weights)
        return [np.asarray(o) for o in outs], grads

    for training in ((False, True) if train else (False,)):
        o1, g1 = run(orig, training)
        o2, g2 = run(conv, training)
        for a, b in zip(o1, o2):
            assert a.dtype == b.dtype
            np.testing.assert_allclose(b, a, rtol=tol, atol=tol,
                                       err_msg="outputs (training=%s)" % training)
        assert len(g1) == len(g2)
        for w, a, b in zip(orig.trainable_weights, g1, g2):
            if a is None:
                assert b is None, w.path
                continue
            a, b = tf.convert_to_tensor(a), tf.convert_to_tensor(b)  # IndexedSlices
            np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=tol, atol=tol,
                                       err_msg="gradient of %s (training=%s)" % (w.path,
                                                                                 training))
    m1, m2 = _moving(orig), _moving(conv)
    assert [m[0] for m in m1] == [m[0] for m in m2]
    for (name, mm1, mv1), (_, mm2, mv2) in zip(m1, m2):
        np.testing.assert_allclose(mm2, mm1, rtol=tol, atol=tol, err_msg=name)
        np.testing.assert_allclose(mv2, mv1, rtol=tol, atol=tol, err_msg=name)


def _rand(shape, seed=0, dtype="float32"):
    return tf.constant(np.random.default_rng(seed).standard_normal(shape).astype(dtype))


def test_bn_on_a_middle_axis_runs_keras_math():
    """axis=2 of a 4-D input is no data_format: our layer (fused with the ReLU) falls back to
    Keras' implementation, so the results are Keras' exactly."""
    keras.utils.set_random_seed(1)
    inp = keras.Input((6, 5, 4))
    x = L.Conv2D(4, 3, padding="same")(inp)
    x = L.BatchNormalization(axis=2, name="bn_mid")(x)
    x = L.ReLU(name="relu")(x)
    out = L.Dense(2)(L.GlobalAveragePooling2D()(x))
    model = keras.Model(inp, out)
    conv, rep = convert(model, return_report=True)
    assert rep.replaced == ["bn_mid"] and [f[0] for f in rep.fused] == ["bn_mid"]
    bn = conv.get_layer("bn_mid")
    assert isinstance(bn, FbnBN) and bn.axis == 2 and bn.activation == "relu"
    assert bn.fused_data_format((3, 6, 5, 4)) is None
    _assert_same_model(model, conv, _rand((3, 6, 5, 4)), 1e-6)


@pytest.mark.parametrize("fuse", [True, False])
def test_mask_from_masking_reaches_the_bn(fuse):
    """A Masking layer's mask reaches the BN in the converted model (Keras' masked moments in
    training; our layer falls back for masked calls): with the mask dropped, the training
    outputs and moving statistics would differ."""
    keras.utils.set_random_seed(2)
    inp = keras.Input((4, 4, 3))
    x = L.Masking(0.0)(inp)
    x = L.BatchNormalization(name="bn_masked")(x)
    x = L.Activation("relu", name="act")(x)
    out = L.Dense(2)(L.GlobalAveragePooling2D()(x))
    model = keras.Model(inp, out)
    conv, rep = convert(model, fuse=fuse, return_report=True)
    assert rep.replaced == ["bn_masked"] and not rep.not_converted
    data = np.random.default_rng(0).standard_normal((3, 4, 4, 3)).astype(np.float32)
    data[:, :2] = 0.0  # masked positions
    _assert_same_model(model, conv, tf.constant(data), 1e-5)


def test_mask_from_embedding_through_bn_and_pooling():
    keras.utils.set_random_seed(3)
    inp = keras.Input((7,), dtype="int32")
    x = L.Embedding(10, 4, mask_zero=True)(inp)
    x = L.BatchNormalization(name="bn_seq")(x)
    x = L.ReLU(name="relu")(x)
    out = L.GlobalAveragePooling1D()(x)  # averages only the unmasked steps
    model = keras.Model(inp, out)
    conv = convert(model)
    tokens = tf.constant([[1, 2, 3, 0, 0, 0, 0], [4, 5, 6, 7, 8, 9, 1]], tf.int32)
    _assert_same_model(model, conv, tokens, 1e-6)


@pytest.mark.skipif(
    "renorm" not in inspect.signature(keras.layers.BatchNormalization.__init__).parameters,
    reason="this Keras has no batch renormalization (added in Keras 3.14)")
def test_renorm_is_converted_and_runs_keras_renorm():
    keras.utils.set_random_seed(4)
    inp = keras.Input((4, 4, 3))
    x = L.BatchNormalization(renorm=True, renorm_clipping={"rmax": 2.0, "rmin": 0.5,
                                                           "dmax": 1.0},
                             name="bn_renorm")(inp)
    x = L.Activation("relu", name="act")(x)
    model = keras.Model(inp, x)
    conv, rep = convert(model, return_report=True)
    bn = conv.get_layer("bn_renorm")
    assert isinstance(bn, FbnBN) and bn.renorm and bn.renorm_clipping == {
        "rmax": 2.0, "rmin": 0.5, "dmax": 1.0}
    assert len(bn.weights) == len(model.get_layer("bn_renorm").weights)
    _assert_same_model(model, conv, _rand((5, 4, 4, 3), 4), 1e-6)


def _inner_block(name):
    inp = keras.Input((6, 6, 4))
    x = L.Conv2D(4, 1, name=name + "_conv")(inp)
    x = L.BatchNormalization(name=name + "_bn")(x)
    x = L.ReLU(name=name + "_relu")(x)
    return keras.Model(inp, x, name=name)


def test_nested_and_shared_nested_models():
    keras.utils.set_random_seed(5)
    block = _inner_block("block")  # called twice: shared weights
    seq = keras.Sequential([keras.Input((6, 6, 4)), L.BatchNormalization(name="seq_bn"),
                            L.Activation("relu", name="seq_relu")], name="seq")
    inp = keras.Input((6, 6, 4))
    a = block(inp)
    b = block(seq(a))
    model = keras.Model(inp, L.Add()([a, b]))
    conv, rep = convert(model, return_report=True)
    assert sorted(rep.replaced) == ["block/block_bn", "block/block_bn", "seq/seq_bn"] or \
        sorted(rep.replaced) == ["block/block_bn", "seq/seq_bn"]
    new_blocks = [la for la in conv.layers if la.name == "block"]
    assert len(new_blocks) == 1  # still one (shared) block
    assert len(conv.trainable_weights) == len(model.trainable_weights)
    assert not [la for la in _flat_layers(conv) if type(la) is keras.layers.BatchNormalization]
    _assert_same_model(model, conv, _rand((2, 6, 6, 4), 5), 1e-4)


def test_shared_bn_layer_is_not_fused_and_says_why():
    keras.utils.set_random_seed(6)
    bn = L.BatchNormalization(name="bn_shared")
    relu = L.ReLU(name="relu_shared")
    i1, i2 = keras.Input((4, 4, 3)), keras.Input((4, 4, 3))
    model = keras.Model([i1, i2], [relu(bn(i1)), relu(bn(i2))])
    conv, rep = convert(model, return_report=True)
    assert rep.replaced == ["bn_shared"] and not rep.fused
    assert any("shared layer" in reason for _, _, reason in rep.not_fused)
    assert conv.get_layer("relu_shared") is not None
    assert isinstance(conv.get_layer("bn_shared"), FbnBN)
    _assert_same_model(model, conv, [_rand((2, 4, 4, 3), 6), _rand((2, 4, 4, 3), 7)], 1e-4)


def test_bn_with_two_consumers_is_not_fused():
    keras.utils.set_random_seed(7)
    inp = keras.Input((4, 4, 3))
    f = L.BatchNormalization(name="bn_two")(inp)
    out = L.Add(name="add")([L.ReLU(name="relu_a")(f), L.Activation("tanh", name="t")(f)])
    model = keras.Model(inp, out)
    conv, rep = convert(model, return_report=True)
    assert rep.replaced == ["bn_two"] and not rep.fused
    assert conv.get_layer("bn_two").activation is None
    assert {la.name for la in conv.layers} == {la.name for la in model.layers}
    _assert_same_model(model, conv, _rand((3, 4, 4, 3), 8), 1e-4)


@pytest.mark.parametrize("bn_on_the_small_side", [False, True])
def test_broadcasting_residual_add_is_not_fused(bn_on_the_small_side):
    """Keras' Add broadcasts ([N,1,1,C] + [N,H,W,C], as in squeeze-excite blocks); the fused
    op takes a side input of the BN output's shape, so such a BN -> Add -> ReLU keeps its Add
    and ReLU, says why, and the model trains as the original does."""
    keras.utils.set_random_seed(11)
    inp = keras.Input((6, 6, 4))
    r = L.ReLU(name="r0")(L.Conv2D(4, 1, name="c0")(inp))
    g = L.GlobalAveragePooling2D(keepdims=True, name="pool")(r)  # [N,1,1,4]
    if bn_on_the_small_side:
        b, other = L.BatchNormalization(name="bn_b")(g), r
    else:
        b, other = L.BatchNormalization(name="bn_b")(L.Conv2D(4, 1, name="c1")(r)), g
    out = L.ReLU(name="relu_b")(L.Add(name="add_b")([b, other]))
    model = keras.Model(inp, out)
    conv, rep = convert(model, return_report=True)
    assert rep.replaced == ["bn_b"] and not rep.fused
    assert any(name == "bn_b" and "broadcasts" in reason for name, _, reason in rep.not_fused)
    assert conv.get_layer("add_b") is not None and conv.get_layer("bn_b").activation is None
    _assert_same_model(model, conv, _rand((2, 6, 6, 4), 12), 1e-4)


def test_layer_side_input_that_broadcasts_matches_keras():
    """Our layer called directly with a side input that broadcasts against its input:
    act(bn(x) + side) in training and inference, as Keras' BN + Add + ReLU computes it."""
    keras.utils.set_random_seed(13)
    x, side = _rand((2, 5, 5, 3), 14), _rand((2, 1, 1, 3), 15)
    ours = FbnBN(activation="relu")
    ref = L.BatchNormalization()
    for training in (True, False):
        with tf.GradientTape(persistent=True) as tape:
            tape.watch([x, side])
            y1 = ours(x, training=training, side_input=side)
            y2 = tf.nn.relu(ref(x, training=training) + side)
        np.testing.assert_allclose(np.asarray(y1), np.asarray(y2), rtol=1e-5, atol=1e-5)
        for a, b in zip(tape.gradient(y1, [x, side]), tape.gradient(y2, [x, side])):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(np.asarray(ours.moving_mean), np.asarray(ref.moving_mean),
                               rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("x_sig,side_sig,side_shape", [
    ((None, None, None, 3), (None, 1, 1, 3), (2, 1, 1, 3)),   # sizes unknown, side pooled
    ((None, 5, 5, 3), (1, 5, 5, 3), (1, 5, 5, 3)),            # batch unknown, side one image
])
def test_layer_side_input_that_may_broadcast_in_a_traced_step(x_sig, side_sig, side_shape):
    """Traced with unknown sizes, a side input whose static shape shows a 1 where x's size
    is unknown may broadcast: it is added by TF ops after ours, and the training step gives
    Keras' BN + Add + ReLU."""
    keras.utils.set_random_seed(16)
    ours, ref = FbnBN(activation="relu"), L.BatchNormalization()
    x, side = _rand((2, 5, 5, 3), 17), _rand(side_shape, 18)
    ours.build(x.shape)
    ref.build(x.shape)

    @tf.function(input_signature=[tf.TensorSpec(x_sig), tf.TensorSpec(side_sig)])
    def step(x, side):
        with tf.GradientTape() as tape:
            tape.watch(x)
            y1 = ours(x, training=True, side_input=side)
        with tf.GradientTape() as tape2:
            tape2.watch(x)
            y2 = tf.nn.relu(ref(x, training=True) + side)
        return y1, y2, tape.gradient(y1, x), tape2.gradient(y2, x)

    y1, y2, g1, g2 = step(x, side)
    np.testing.assert_allclose(np.asarray(y1), np.asarray(y2), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(g1), np.asarray(g2), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("kind", ["functional", "sequential"])
def test_float64_model(kind):
    """float64 is not a dtype of the op: the converted layers fall back to Keras' own math
    (results identical, in float64), fused activation or not."""
    keras.utils.set_random_seed(8)
    layers = [L.Conv2D(4, 3, padding="same", dtype="float64", name="conv"),
              L.BatchNormalization(dtype="float64", name="bn64"),
              L.ReLU(dtype="float64", name="relu64")]
    if kind == "sequential":
        model = keras.Sequential([keras.Input((5, 5, 2), dtype="float64")] + layers)
    else:
        inp = keras.Input((5, 5, 2), dtype="float64")
        x = inp
        for la in layers:
            x = la(x)
        model = keras.Model(inp, x)
    conv, rep = convert(model, return_report=True)
    bn = conv.get_layer("bn64")
    assert isinstance(bn, FbnBN) and bn.dtype_policy.name == "float64"
    assert bn.fused_data_format((2, 5, 5, 4), "float64") is None  # Keras' math
    assert rep.replaced == ["bn64"]
    x = _rand((2, 5, 5, 2), 9, "float64")
    assert conv(x).dtype == tf.float64
    _assert_same_model(model, conv, x, 1e-12)


def test_mixed_dtype_policies_are_not_fused():
    keras.utils.set_random_seed(9)
    inp = keras.Input((4, 4, 3))
    x = L.BatchNormalization(name="bn32")(inp)
    x = L.Activation("relu", dtype="float64", name="relu64")(x)
    model = keras.Model(inp, x)
    conv, rep = convert(model, return_report=True)
    assert not rep.fused
    assert any("dtype policies" in reason for _, _, reason in rep.not_fused)
    out = conv(_rand((2, 4, 4, 3), 10))
    assert out.dtype == model(_rand((2, 4, 4, 3), 10)).dtype
    _assert_same_model(model, conv, _rand((2, 4, 4, 3), 10), 1e-5)


def test_frozen_bn_keeps_inference_behaviour():
    """trainable=False: Keras runs the BN in inference mode even in training; so must ours."""
    keras.utils.set_random_seed(10)
    inp = keras.Input((4, 4, 3))
    bn = L.BatchNormalization(name="bn_frozen")
    x = L.ReLU(name="relu")(bn(inp))
    model = keras.Model(inp, x)
    model.get_layer("bn_frozen").moving_mean.assign([0.5, -0.5, 0.1])
    bn.trainable = False
    conv = convert(model)
    assert conv.get_layer("bn_frozen").trainable is False
    _assert_same_model(model, conv, _rand((2, 4, 4, 3), 11), 1e-5)
    np.testing.assert_array_equal(np.array(conv.get_layer("bn_frozen").moving_mean),
                                  np.float32([0.5, -0.5, 0.1]))


def test_subclass_of_bn_is_left_as_is_and_reported():
    class MyBN(keras.layers.BatchNormalization):
        def call(self, inputs, training=None, mask=None):
            return super().call(inputs, training=training, mask=mask) * 2.0

    inp = keras.Input((4, 4, 3))
    model = keras.Model(inp, MyBN(name="mybn")(inp))
    with pytest.warns(RuntimeWarning, match="not converted"):
        conv, rep = convert(model, return_report=True)
    assert rep.not_converted and rep.not_converted[0][0] == "mybn"
    assert "subclass" in rep.not_converted[0][1]
    assert type(conv.get_layer("mybn")) is MyBN  # left as it is
    _assert_same_model(model, conv, _rand((2, 4, 4, 3), 12), 0.0)


def test_keras_ops_in_the_graph():
    """Plain keras.ops operations (not layers) in a functional graph: convert used to die in
    an AttributeError ('NotEqual' object has no attribute '_flatten_layers')."""
    keras.utils.set_random_seed(11)
    inp = keras.Input((4, 4, 3))
    x = keras.ops.multiply(inp, 2.0) + 1.0
    x = L.BatchNormalization(name="bn")(x)
    x = L.ReLU(name="relu")(keras.ops.tanh(x))
    model = keras.Model(inp, x)
    conv, rep = convert(model, return_report=True)
    assert rep.replaced == ["bn"] and not rep.shared and not rep.not_converted
    _assert_same_model(model, conv, _rand((2, 4, 4, 3), 13), 1e-4)
