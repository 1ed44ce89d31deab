"""What a user trains with fbn_grad_tf must leave it: serving exports that load where the
package is not installed, ``revert`` back to stock Keras layers (and TFLite from there), and
weight files, checkpoints and variable paths shared between a model and its conversion.

Models are keras.applications ones at 32x32 (tests/model_oracle.py), NASNetMobile (built
under name scopes), test_convert.py's patterns model and the hand-made ones below (nested
and shared sub-models, a mask, mixed dtype policies).
"""
import inspect
import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import tensorflow as tf
import keras

import fbn_grad_tf
from fbn_grad_tf.keras import FusedIntoBatchNorm, convert, revert

import model_oracle as oracle
from test_convert import patterns_model

NAME_SCOPED = {
    # Built under Keras name scopes: its variables' paths carry them.
    "NASNetMobile": lambda: keras.applications.NASNetMobile(
        input_shape=(32, 32, 3), weights=None, classes=oracle.CLASSES,
        classifier_activation=None),
}


def build(name):
    if name in NAME_SCOPED:
        keras.utils.set_random_seed(0)
        return NAME_SCOPED[name]()
    return oracle.build_app(name)


def trained(model, steps=2, seed=0):
    """`model` after a few SGD steps on random data (moving statistics moved too)."""
    x, y = oracle.data(seed, (oracle.BATCH,) + tuple(model.inputs[0].shape[1:]),
                       classes=model.outputs[0].shape[-1])
    model.compile(optimizer=keras.optimizers.SGD(0.01),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    model.fit(x, y, batch_size=4, epochs=steps, verbose=0)
    return model


def scrambled(model, seed):
    """`model` with every variable set to new random values (variances positive): a weight
    file or checkpoint that did not load would show."""
    rng = np.random.default_rng(seed)
    for v in model.weights:
        value = rng.normal(0.0, 0.1, v.shape)
        if "variance" in v.path:
            value = np.abs(value) + 0.5
        v.assign(value.astype(v.dtype))
    return model


def structure(model):
    """Per layer: (name, class, config), and the inbound layers of each node: what
    `revert(convert(m))` must give back."""
    # Configs as they serialize (older Keras versions mix tuples and lists in them).
    layers = [(layer.name, type(layer).__name__,
               json.loads(json.dumps(layer.get_config(), default=str)))
              for layer in model.layers]
    nodes = {}
    for layer in model.layers:
        for node in layer._inbound_nodes:  # pylint: disable=protected-access
            nodes.setdefault(layer.name, []).append(
                [t._keras_history.operation.name for t in node.input_tensors])  # pylint: disable=protected-access
    return layers, nodes


def assert_same_weights(a, b):
    assert [w.path for w in a.weights] == [w.path for w in b.weights]
    for v, w in zip(a.weights, b.weights):
        np.testing.assert_array_equal(v.numpy(), w.numpy(), err_msg=v.path)


# ---- exports that need nothing of ours ------------------------------------------------------

# The child makes fbn_grad_tf unimportable (the editable install's finder and the source tree
# leave its path; a finder in front refuses the package wherever else it is installed) and
# proves it, loads and serves the SavedModel, and checks that no library of ours was mapped.
_LOAD_WITHOUT_PACKAGE = """
import importlib.abc, os, sys
sys.meta_path[:] = [f for f in sys.meta_path if "fbn_grad_tf" not in repr(f).lower()
                    and "editable" not in type(f).__module__]
sys.path[:] = [p for p in sys.path if not os.path.isfile(
    os.path.join(p or ".", "fbn_grad_tf", "_convert.py")) or "-packages" in p]


class Refuse(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] == "fbn_grad_tf":
            raise ModuleNotFoundError("fbn_grad_tf is hidden from this process")


sys.meta_path.insert(0, Refuse())
try:
    import fbn_grad_tf
    raise SystemExit("fbn_grad_tf still importable")
except ModuleNotFoundError:
    pass
import json
import numpy as np
import tensorflow as tf
ops = set()
saved = tf.saved_model.load(sys.argv[1])
for name, sig in saved.signatures.items():
    for f in sig.graph.as_graph_def().library.function:
        ops.update(n.op for n in f.node_def)
x = np.load(sys.argv[2])
fn = getattr(saved, "serve", None) or saved.signatures["serving_default"]
out = fn(tf.constant(x))
out = list(out.values())[0] if isinstance(out, dict) else out
np.save(sys.argv[3], np.asarray(out))
with open("/proc/self/maps") as maps:
    ours = sorted({line.split()[-1] for line in maps if "/fbn_grad_tf/" in line})
assert not ours and "fbn_grad_tf" not in sys.modules, ours
print(json.dumps(sorted(op for op in ops if "FbnGrad" in op)))
"""


def load_without_package(path, x, tmp_path):
    """The SavedModel at `path` served on `x` in a fresh process in which fbn_grad_tf cannot
    be imported."""
    script = tmp_path / "load_without_package.py"
    script.write_text(textwrap.dedent(_LOAD_WITHOUT_PACKAGE))
    np.save(str(tmp_path / "x.npy"), x)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["TF_CPP_MIN_LOG_LEVEL"] = "2"
    r = subprocess.run([sys.executable, str(script), str(path), str(tmp_path / "x.npy"),
                        str(tmp_path / "y.npy")], cwd=str(tmp_path), env=env,
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, "load without fbn_grad_tf failed:\n" + r.stderr[-4000:]
    assert json.loads(r.stdout.strip().splitlines()[-1]) == []
    return np.load(str(tmp_path / "y.npy"))


def export(model, path):
    """model.export(path), quietly where this Keras can (3.3 has no `verbose`)."""
    quiet = "verbose" in inspect.signature(model.export).parameters
    model.export(str(path), **({"verbose": False} if quiet else {}))


def assert_rel_close(got, want, rtol):
    scale = max(float(np.max(np.abs(want))), 1e-30)
    err = float(np.max(np.abs(got - want))) / scale
    assert err <= rtol, "relative error %.3g > %.3g" % (err, rtol)


@pytest.mark.parametrize("name", ["MobileNetV2", "EfficientNetB0", "ResNet50"])
def test_model_export_of_a_trained_converted_model_loads_without_the_package(name, tmp_path):
    conv = trained(convert(build(name)))
    path = tmp_path / "export"
    export(conv, str(path))
    x = oracle.data(5)[0]
    want = conv(x, training=False).numpy()
    assert_rel_close(load_without_package(path, x, tmp_path), want, 1e-5)


def test_serving_function_and_override_exports_load_without_the_package(tmp_path):
    # tf.saved_model.save of a serving tf.function, default options.
    conv = convert(patterns_model())
    trained(keras.Model(conv.inputs, conv.outputs[0]))  # the logits; same layers
    module = tf.Module()
    module.model = conv
    module.serve = tf.function(lambda x: conv(x, training=False)[0],
                               input_signature=[tf.TensorSpec([None, 8, 8, 3], tf.float32)])
    tf.saved_model.save(module, str(tmp_path / "fn"), signatures={"serving_default": module.serve})
    x = oracle.data(6, (4, 8, 8, 3))[0]
    assert_rel_close(load_without_package(tmp_path / "fn", x, tmp_path),
                     module.serve(x).numpy(), 1e-5)
    # A model trained under override(): stock layers, our ops while on; exported after.
    with fbn_grad_tf.keras.override():
        model = trained(oracle.build_app("MobileNetV2"))
        export(model, str(tmp_path / "override"))
    x = oracle.data(7)[0]
    assert_rel_close(load_without_package(tmp_path / "override", x, tmp_path),
                     model(x, training=False).numpy(), 1e-5)


def test_tf_keras_model_under_override_exports_without_the_package(tmp_path):
    tf_keras = pytest.importorskip("tf_keras")
    L = tf_keras.layers
    tf_keras.utils.set_random_seed(1)
    with fbn_grad_tf.keras.override():
        model = tf_keras.Sequential([tf_keras.Input((8, 8, 3)), L.Conv2D(4, 3),
                                     L.BatchNormalization(), L.ReLU(),
                                     L.GlobalAveragePooling2D(), L.Dense(2)])
        model.compile("sgd", tf_keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        x = oracle.data(8, (8, 8, 8, 3))[0]
        model.fit(x, np.arange(8) % 2, epochs=1, verbose=0)
        model.export(str(tmp_path / "tfk"))  # tf_keras: its own export
    assert_rel_close(load_without_package(tmp_path / "tfk", x, tmp_path),
                     model(x, training=False).numpy(), 1e-5)


def test_bn_called_with_training_true_exports_without_the_package(tmp_path):
    """A BN whose call records training=True (batch statistics at serving time, as in
    pix2pix-style generators): the export traces it in training mode without a gradient
    tape, so it is built on TF's ops, converted or under override()."""
    keras.utils.set_random_seed(2)
    inp = keras.Input((None, None, 3))
    h = keras.layers.Conv2D(4, 3, padding="same")(inp)
    h = keras.layers.BatchNormalization(name="bn_always")(h, training=True)
    model = keras.Model(inp, keras.layers.GlobalAveragePooling2D()(keras.layers.ReLU()(h)))
    x = oracle.data(9, (2, 12, 10, 3))[0]
    conv = convert(model)
    export(conv, str(tmp_path / "conv"))
    assert_rel_close(load_without_package(tmp_path / "conv", x, tmp_path), model(x).numpy(),
                     1e-5)
    with fbn_grad_tf.keras.override():
        export(model, str(tmp_path / "override"))
    assert_rel_close(load_without_package(tmp_path / "override", x, tmp_path),
                     model(x).numpy(), 1e-5)
    # Under a tape the same call runs on our ops.
    xt = tf.constant(x)
    with tf.GradientTape() as tape:
        tape.watch(xt)
        fn = tf.function(lambda t: conv(t))
        types = {op.type for op in fn.get_concrete_function(xt).graph.get_operations()}
    assert "FbnGrad>FusedBatchNormEx" in types


def test_tf_keras_saved_model_saved_under_override_loads_without_the_package(tmp_path):
    """tf_keras' model.save(dir) (a SavedModel) traces the layers in training mode too, with
    no tape: those traces build TF's op, so the SavedModel loads where fbn_grad_tf is not."""
    tf_keras = pytest.importorskip("tf_keras")
    L = tf_keras.layers
    tf_keras.utils.set_random_seed(3)
    x = oracle.data(10, (8, 8, 8, 3))[0]
    with fbn_grad_tf.keras.override():
        model = tf_keras.Sequential([tf_keras.Input((8, 8, 3)), L.Conv2D(4, 3),
                                     L.BatchNormalization(), L.ReLU(),
                                     L.GlobalAveragePooling2D(), L.Dense(2)])
        model.compile("sgd", tf_keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        model.fit(x, np.arange(8) % 2, epochs=1, verbose=0)
        model.save(str(tmp_path / "sm"))
    assert_rel_close(load_without_package(tmp_path / "sm", x, tmp_path),
                     model(x, training=False).numpy(), 1e-5)


# ---- revert ---------------------------------------------------------------------------------

def test_revert_restores_the_absorbed_layers_and_is_stock_keras():
    model = patterns_model()
    conv = convert(model)
    back = revert(conv)
    assert structure(back) == structure(model)
    assert_same_weights(back, model)
    assert not [layer for layer in back._flatten_layers()  # pylint: disable=protected-access
                if type(layer).__module__.startswith("fbn_grad_tf")]
    x = oracle.data(0, (6, 8, 8, 3))[0]
    for a, b in zip(back(x, training=False), model(x, training=False)):
        np.testing.assert_array_equal(a, b)
    # Trained while converted: the reverted model carries the trained weights and moving
    # statistics, and computes what the converted model computes.
    trained_conv = convert(model)
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(trained_conv(x, training=True)[0])
    grads = tape.gradient(loss, trained_conv.trainable_variables)
    keras.optimizers.SGD(0.1).apply_gradients(zip(grads, trained_conv.trainable_variables))
    back = revert(trained_conv)
    assert_same_weights(back, trained_conv)
    for a, b in zip(back(x, training=False), trained_conv(x, training=False)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)


def test_revert_of_layers_built_with_activation_and_side_input():
    """Our layer used directly (activation=, side_input=): revert writes it out as BN, Add
    and Activation layers named after the BN."""
    keras.utils.set_random_seed(2)
    L = keras.layers
    inp = keras.Input((6, 6, 4))
    r = L.Conv2D(4, 1, name="c")(inp)
    y = fbn_grad_tf.keras.BatchNormalization(activation="swish", name="bn")(inp, side_input=r)
    z = fbn_grad_tf.keras.BatchNormalization(activation="relu6", name="bn2")(y)
    model = keras.Model(inp, z)
    seq = keras.Sequential([keras.Input((6, 6, 4)),
                            fbn_grad_tf.keras.BatchNormalization(activation="relu", name="b")])
    back, seq_back = revert(model), revert(seq)
    kinds = {layer.name: type(layer).__name__ for layer in back.layers
             if not isinstance(layer, keras.layers.InputLayer)}
    assert kinds == {"c": "Conv2D", "bn": "BatchNormalization", "bn_add": "Add",
                     "bn_swish": "Activation", "bn2": "BatchNormalization",
                     "bn2_relu6": "Activation"}
    assert [type(layer).__name__ for layer in seq_back.layers] == [
        "BatchNormalization", "Activation"]
    x = oracle.data(1, (3, 6, 6, 4))[0]
    np.testing.assert_allclose(back(x), model(x), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(seq_back(x), seq(x), rtol=1e-5, atol=1e-5)


def test_revert_tail_layers_keep_the_bn_dtype_policy():
    """The Add and Activation that revert writes after a BN built with activation= or
    side_input= take the BN's dtype policy, whatever the global policy of the process that
    reverts."""
    L = keras.layers
    inp = keras.Input((6, 6, 4))
    a = L.Conv2D(4, 1, dtype="mixed_bfloat16")(inp)
    b = fbn_grad_tf.keras.BatchNormalization(activation="relu", name="bnA",
                                             dtype="mixed_bfloat16")(a)
    c = fbn_grad_tf.keras.BatchNormalization(activation="swish", name="bnB",
                                             dtype="mixed_bfloat16")(b, side_input=a)
    model = keras.Model(inp, c)
    seq = keras.Sequential([keras.Input((6, 6, 4)), fbn_grad_tf.keras.BatchNormalization(
        activation="relu", name="b", dtype="mixed_bfloat16")])
    assert keras.config.dtype_policy().name == "float32"
    back, seq_back = revert(model), revert(seq)
    policies = {layer.name: layer.dtype_policy.name for layer in back.layers + seq_back.layers
                if not isinstance(layer, keras.layers.InputLayer)}
    assert set(policies.values()) == {"mixed_bfloat16"}, policies
    x = oracle.data(2, (3, 6, 6, 4))[0]
    np.testing.assert_array_equal(np.asarray(back(x)), np.asarray(model(x)))


@pytest.mark.parametrize("make", ["tf_keras", "subclassed", "layer"])
def test_revert_refusals_name_revert(make):
    if make == "tf_keras":
        tf_keras = pytest.importorskip("tf_keras")
        model = tf_keras.Sequential([tf_keras.Input((3,)), tf_keras.layers.Dense(2)])
        err, match = TypeError, "revert: .* tf_keras .* needs no revert"
    elif make == "subclassed":
        class Sub(keras.Model):
            def __init__(self):
                super().__init__()
                self.bn = fbn_grad_tf.keras.BatchNormalization()

            def call(self, x):
                return self.bn(x)
        model = Sub()
        model(np.zeros((2, 3), "float32"))
        err, match = ValueError, "revert: .*subclassed.*keras.layers.BatchNormalization"
    else:
        model, err, match = keras.layers.Dense(2), TypeError, "revert: expected a Keras 3 model"
    with pytest.raises(err, match=match) as info:
        revert(model)
    assert "keras.convert" not in str(info.value)


def _nested_model():
    """Nested functional + Sequential models, the Sequential one called twice (shared)."""
    L = keras.layers
    keras.utils.set_random_seed(4)
    inner = keras.Sequential([keras.Input((8, 8, 4)), L.Conv2D(4, 3, padding="same"),
                              L.BatchNormalization(name="inner_bn"), L.ReLU(name="inner_relu")],
                             name="inner")
    inp = keras.Input((8, 8, 4))
    h = L.BatchNormalization(name="outer_bn")(inner(inner(inp)))
    h = L.ReLU(name="out_relu")(L.Add(name="add")([h, inp]))
    return keras.Model(inp, h, name="nested")


def _masked_model():
    """A masked sequence model (BN on a 3-D input: Keras' math)."""
    L = keras.layers
    seq_in = keras.Input((5,), dtype="int32")
    e = L.BatchNormalization(name="masked_bn")(L.Embedding(10, 8, mask_zero=True)(seq_in))
    return keras.Model(seq_in, L.GlobalAveragePooling1D()(e), name="masked")


def _mixed_model():
    """A BN and its activation under different dtype policies (not fused)."""
    L = keras.layers
    mix_in = keras.Input((6, 6, 3))
    m = L.BatchNormalization(name="bn16", dtype="mixed_bfloat16")(L.Conv2D(4, 1)(mix_in))
    return keras.Model(mix_in, L.Activation("relu", name="relu32")(m), name="mixed")


HAND_MADE = {"patterns": patterns_model, "nested": _nested_model, "masked": _masked_model,
             "mixed": _mixed_model}


COMPAT = pytest.mark.compat  # also in scripts/compat_check.sh's suite (every TF and Keras)


@pytest.mark.parametrize("name", [pytest.param("patterns", marks=COMPAT),
                                  pytest.param("nested", marks=COMPAT), "masked", "mixed",
                                  pytest.param("MobileNetV2", marks=COMPAT),
                                  "NASNetMobile", "ResNet50", "ResNet50V2",
                                  pytest.param("DenseNet121", marks=pytest.mark.slow),
                                  pytest.param("EfficientNetB0", marks=pytest.mark.slow)])
def test_revert_of_convert_is_the_original(name):
    model = HAND_MADE[name]() if name in HAND_MADE else build(name)
    conv = convert(model)
    back = revert(conv)
    assert structure(back) == structure(model)
    assert_same_weights(back, model)
    assert_same_weights(conv, model)
    if name == "masked":
        x = np.array([[1, 2, 0, 0, 3], [4, 0, 0, 0, 0]], np.int32)
    else:
        x = oracle.data(3, (4,) + tuple(model.inputs[0].shape[1:]))[0]
    for a, b in zip(keras.tree.flatten(back(x, training=False)),
                    keras.tree.flatten(model(x, training=False))):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@COMPAT
def test_reverted_model_runs_in_tflite_with_the_same_outputs(tmp_path):
    conv = trained(convert(oracle.build_app("MobileNetV2")))
    back = revert(conv)
    export(back, str(tmp_path / "sm"))
    converter = tf.lite.TFLiteConverter.from_saved_model(str(tmp_path / "sm"))
    interpreter = tf.lite.Interpreter(model_content=converter.convert())
    x = oracle.data(4)[0][:1]
    inp = interpreter.get_input_details()[0]
    interpreter.resize_tensor_input(inp["index"], x.shape)
    interpreter.allocate_tensors()
    interpreter.set_tensor(inp["index"], x)
    interpreter.invoke()
    got = interpreter.get_tensor(interpreter.get_output_details()[0]["index"])
    assert_rel_close(got, conv(x, training=False).numpy(), 1e-4)


@COMPAT
def test_keras_file_of_a_converted_model_keeps_the_absorbed_layers(tmp_path):
    conv = convert(patterns_model())
    path = str(tmp_path / "m.keras")
    conv.save(path)
    loaded = keras.models.load_model(path)
    assert structure(loaded) == structure(conv)
    assert isinstance(loaded.get_layer("add"), FusedIntoBatchNorm)
    assert structure(revert(loaded)) == structure(patterns_model())


# ---- weight files, checkpoints, variable paths --------------------------------------------

@pytest.mark.parametrize("name", [pytest.param("NASNetMobile", marks=COMPAT),
                                  pytest.param("MobileNetV2", marks=COMPAT),
                                  "ResNet50", "DenseNet121"])
def test_weight_files_and_checkpoints_pass_both_ways(name, tmp_path):
    original = build(name)
    conv = convert(original)
    assert [w.path for w in conv.weights] == [w.path for w in original.weights]
    assert [layer.name for layer in conv.layers] == [layer.name for layer in original.layers]
    x = oracle.data(2)[0]
    scrambled(original, 1)
    scrambled(conv, 2)
    for src, dst in ((original, conv), (conv, original)):
        weights = str(tmp_path / ("%s.weights.h5" % src.name))
        src.save_weights(weights)
        dst.load_weights(weights)
        assert_same_weights(dst, src)
        # Keras' BN and ours (TF's fused op in inference) round differently.
        np.testing.assert_allclose(dst(x, training=False), src(x, training=False),
                                   rtol=1e-4, atol=1e-5)
        scrambled(src, 3)  # the next direction starts from different weights
    for src, dst in ((original, conv), (conv, original)):
        prefix = tf.train.Checkpoint(model=src).save(str(tmp_path / "ckpt" / src.name))
        tf.train.Checkpoint(model=dst).restore(prefix).assert_existing_objects_matched()
        assert_same_weights(dst, src)
        scrambled(dst, 4)
