"""The compatibility subset (marker ``compat``): what scripts/compat_check.sh runs against
every TensorFlow 2.16-2.21 with two Keras 3 versions each, from an installed wheel. Quick
(about a minute on two cores), and part of the normal suite too.

* Our backward (FbnGrad>FusedBatchNormGradV3) and forward (FbnGrad>FusedBatchNormV3) against
  TF's own FusedBatchNormGradV3 / FusedBatchNormV3, per dtype, format and mode.
* Keras 3: fbn_grad_tf.keras.BatchNormalization from configs of this and newer Keras
  versions; convert() of keras.applications.MobileNetV2, trained 2 steps next to Keras' own
  model, exported with model.export() and served by a process that cannot import
  fbn_grad_tf; override() on a Keras 3 model and on a tf_keras (Keras 2) model, one step
  against the same step without it.
"""
import os
import subprocess
import sys
import textwrap
import zlib

import numpy as np
import pytest

from helpers import (Case, assert_outputs_close, make_inputs, make_shape, run_ours,
                     tf_reference)

tf = pytest.importorskip("tensorflow")
import keras  # noqa: E402

import fbn_grad_tf  # noqa: E402
from fbn_grad_tf.keras import BatchNormalization as FbnBN  # noqa: E402

import model_oracle as oracle  # noqa: E402
from test_forward import (assert_stats_close, assert_y_close,  # noqa: E402
                          make_forward_inputs, run_op)

pytestmark = pytest.mark.compat

OURS_FWD = "FbnGrad>FusedBatchNormV3"
OURS_BWD = fbn_grad_tf.REGISTERED_OP_NAME  # "FbnGrad>FusedBatchNormGradV3"
DTYPES = ("float32", "bfloat16", "float16")
FORMATS = ("NHWC", "NCHW")
# A few channels, and rows longer than one conversion segment.
CASES = [Case("c7", 3, (4, 4), (2, 2, 4), 7), Case("c1000", 2, (3, 3), (1, 3, 3), 1000)]


def seed_of(*parts):
    return zlib.crc32(repr(parts).encode())


def op_types(concrete):
    gd = concrete.graph.as_graph_def()
    return {n.op for n in gd.node} | {n.op for f in gd.library.function for n in f.node_def}


def train_step_types(model, x, y, loss_fn):
    """Op types of a traced training step (forward, loss, gradients) of `model`."""
    @tf.function
    def step(x, y):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(loss_fn(y, model(x, training=True)))
        return tape.gradient(loss, model.trainable_variables)
    return op_types(step.get_concrete_function(tf.constant(x), tf.constant(y)))


# ---- the ops against TF's -------------------------------------------------------------------

@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
@pytest.mark.parametrize("training", [True, False], ids=["train", "infer"])
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_backward_matches_tf(dtype, fmt, training, case):
    inputs = make_inputs(make_shape(case, fmt), fmt, dtype, training,
                         seed=seed_of("bwd", dtype, fmt, training, case), stats="tf")
    ours = run_ours(inputs, data_format=fmt, is_training=training)
    assert ours[0].dtype == inputs.x.dtype and ours[0].shape == inputs.x.shape
    assert np.any(ours[0].astype(np.float32) != 0)
    ref = tf_reference(inputs, data_format=fmt, is_training=training)
    assert_outputs_close(ours[:3], ref, inputs, dtype, "vs_tf", fmt, is_training=training)


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
@pytest.mark.parametrize("mode", [(True, 1.0), (True, 0.3), (False, 1.0)],
                         ids=["train", "train_avg", "infer"])
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_forward_matches_tf(dtype, fmt, mode, case):
    training, factor = mode
    x, scale, offset, mean, var = make_forward_inputs(
        make_shape(case, fmt), fmt, dtype, seed_of("fwd", dtype, fmt, mode, case))
    if training and factor == 1.0:  # TF's convention: the running stats may be empty
        mean = var = np.zeros(0, np.float32)
    ours = run_op(x, scale, offset, mean, var, fmt, training, factor)
    assert ours[0].dtype == x.dtype and ours[0].shape == x.shape
    try:
        theirs = run_op(x, scale, offset, mean, var, fmt, training, factor,
                        op=tf.raw_ops.FusedBatchNormV3)
    except tf.errors.InvalidArgumentError:
        # TF's CPU kernel refuses channels-first inference: compare on the NHWC transpose.
        assert fmt == "NCHW" and not training
        theirs = run_op(np.transpose(x, (0, 2, 3, 1)), scale, offset, mean, var, "NHWC",
                        training, factor, op=tf.raw_ops.FusedBatchNormV3)
        theirs[0] = np.transpose(theirs[0], (0, 3, 1, 2))
    std = np.sqrt(np.asarray(theirs[4] if training else var, np.float64))
    assert_y_close(ours[0], np.asarray(theirs[0], np.float64), dtype, "y vs TF")
    assert_stats_close(ours[1], theirs[1], std, "batch_mean vs TF")
    assert_stats_close(ours[2], theirs[2], 0.0, "batch_variance vs TF")
    if training:
        assert_stats_close(ours[3], theirs[3], std, "reserve_space_1 vs TF")
        assert_stats_close(ours[4], theirs[4], 0.0, "reserve_space_2 vs TF")


# ---- Keras 3 ------------------------------------------------------------------------------------

def test_layer_from_configs_of_this_and_newer_keras():
    """Our layer takes the config of this Keras' BatchNormalization, and that of a newer
    Keras (batch-renormalization keys at their defaults); renorm=True works where this
    Keras has batch renormalization and is refused with a clear error where it has not."""
    cfg = keras.layers.BatchNormalization(momentum=0.9, epsilon=1e-4, name="bn").get_config()
    ours = FbnBN.from_config(cfg)
    back = ours.get_config()
    assert back.pop("activation") is None
    assert back == cfg
    newer = dict(cfg, renorm=False, renorm_clipping=None, renorm_momentum=0.99)
    assert FbnBN.from_config(newer).fused_data_format((2, 4, 4, 3)) == "NHWC"
    if "renorm" in keras.layers.BatchNormalization().get_config():
        layer = FbnBN(renorm=True)
        assert layer.renorm and layer.fused_data_format((2, 4, 4, 3)) is None
    else:
        with pytest.raises(ValueError, match="renorm=True.*Keras 3.14"):
            FbnBN(renorm=True)


def _compiled(model):
    model.compile(optimizer=keras.optimizers.SGD(0.05),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


SERVE_CHILD = """
    import sys
    sys.path.insert(0, {stub!r})  # a fbn_grad_tf that cannot be imported
    import numpy as np
    import tensorflow as tf
    from tensorflow.python.framework import op_def_registry
    try:
        import fbn_grad_tf
        raise SystemExit("fbn_grad_tf is importable in the serving process")
    except ImportError as e:
        assert "not installed here" in str(e), e
    loaded = tf.saved_model.load("export")
    fn = loaded.signatures["serving_default"]
    (name,) = fn.structured_input_signature[1]
    (y,) = fn(**{{name: tf.constant(np.load("x.npy"))}}).values()
    np.save("served.npy", y.numpy())
    ours = [op for op in ({ops!r}) if op_def_registry.get(op) is not None]
    assert not ours, ours
    print("served", y.shape)
"""


def test_convert_fit_export_serves_without_fbn_grad_tf(tmp_path):
    """convert(MobileNetV2): every BN ours, inference equal to the original's; 2 fit()
    steps on our ops (the first one's loss as the original model's); model.export()
    served by a process in which fbn_grad_tf cannot be imported, with the converted
    model's inference outputs."""
    original = oracle.build_app("MobileNetV2")
    keras_bns = [layer for layer in original.layers
                 if isinstance(layer, keras.layers.BatchNormalization)]
    conv, report = fbn_grad_tf.keras.convert(original, return_report=True)
    assert keras_bns and len(report.replaced) == len(keras_bns) and report.fused
    assert all(isinstance(layer, FbnBN) for layer in conv.layers
               if isinstance(layer, keras.layers.BatchNormalization))
    x, y = oracle.data(0)
    np.testing.assert_allclose(conv(x, training=False), original(x, training=False),
                               rtol=1e-5, atol=1e-5)
    types = train_step_types(conv, x, y, keras.losses.sparse_categorical_crossentropy)
    assert {OURS_FWD, OURS_BWD} <= types or {"FbnGrad>FusedBatchNormEx",
                                             "FbnGrad>FusedBatchNormGradEx"} <= types, types
    assert "FusedBatchNormGradV3" not in types

    # fit(): 2 steps of 4. The first step's loss equals Keras' own model's (a training-mode
    # forward); the second step's does not need to: from random weights at batch 4, one SGD
    # step moves float32 rounding differences far (see tests/model_oracle.py).
    before = [w.numpy() for w in conv.weights]
    first_loss = []
    for m in (conv, original):
        record = keras.callbacks.LambdaCallback(
            on_train_batch_end=lambda batch, logs: batch or first_loss.append(logs["loss"]))
        _compiled(m).fit(x, y, batch_size=4, epochs=1, shuffle=False, verbose=0,
                         callbacks=[record])
    assert np.isfinite(first_loss[0])
    np.testing.assert_allclose(first_loss[0], first_loss[1], rtol=1e-3)
    changed = {w.path for w, b in zip(conv.weights, before) if np.any(w.numpy() != b)}
    for layer in conv.layers:  # every BN's gamma, beta and moving statistics
        if isinstance(layer, FbnBN):
            assert {w.path for w in layer.weights} <= changed, layer.name

    # predict() runs a tf.function, as the export does: TF's graph optimizations (oneDNN
    # fusions) change the rounding against eager execution (~1e-3 of the output here, for
    # Keras' own model too), so the served outputs are compared with the graph's.
    expected = conv.predict(x, verbose=0)
    conv.export(str(tmp_path / "export"))
    stub = tmp_path / "stub" / "fbn_grad_tf"
    stub.mkdir(parents=True)
    (stub / "__init__.py").write_text('raise ImportError("fbn_grad_tf is not installed here")\n')
    np.save(str(tmp_path / "x.npy"), x)
    script = tmp_path / "serve.py"
    script.write_text(textwrap.dedent(SERVE_CHILD.format(
        stub=str(tmp_path / "stub"),
        ops=(OURS_FWD, OURS_BWD, "FbnGrad>FusedBatchNormEx", "FbnGrad>FusedBatchNormGradEx"))))
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
    env.pop("PYTHONPATH", None)
    # -I: no PYTHONPATH, no user site, not the script's folder (a temp dir, also the cwd).
    r = subprocess.run([sys.executable, "-I", str(script)], cwd=str(tmp_path), env=env,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, "serving process failed (rc %s):\n%s\n%s" % (
        r.returncode, r.stdout[-2000:], r.stderr[-4000:])
    served = np.load(str(tmp_path / "served.npy"))
    np.testing.assert_allclose(served, expected, rtol=1e-5,
                               atol=1e-5 * float(np.max(np.abs(expected))))


def test_keras_override_step_matches_keras():
    """A Keras 3 model created under override() trains on our ops, the same step as
    Keras' own."""
    x, y = oracle.data(1, (16, 8, 8, 3), classes=3)

    def make():
        keras.utils.set_random_seed(5)
        L = keras.layers
        inp = keras.Input((8, 8, 3))
        h = L.ReLU()(L.BatchNormalization(momentum=0.9)(L.Conv2D(6, 3, use_bias=False)(inp)))
        return _compiled(keras.Model(inp, L.Dense(3)(L.GlobalAveragePooling2D()(h))))

    with fbn_grad_tf.keras.override():
        ours = make()
    theirs = make()
    theirs.set_weights(ours.get_weights())
    loss_fn = keras.losses.sparse_categorical_crossentropy
    assert OURS_BWD in train_step_types(ours, x, y, loss_fn)
    assert OURS_BWD not in train_step_types(theirs, x, y, loss_fn)
    loss = [float(np.ravel(m.train_on_batch(x, y))[0]) for m in (ours, theirs)]
    np.testing.assert_allclose(loss[0], loss[1], rtol=1e-5)
    for a, b in zip(ours.get_weights(), theirs.get_weights()):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)


def test_tf_keras_override_step_matches_tf_keras():
    """tf_keras (Keras 2): a step under override() runs our forward and backward ops (TF's
    FusedBatchNormV3 builder and gradient routed to them), and equals the step without."""
    tf_keras = pytest.importorskip("tf_keras")
    x, y = oracle.data(2, (16, 8, 8, 3), classes=3)
    loss_fn = tf_keras.losses.sparse_categorical_crossentropy

    def make():
        tf_keras.utils.set_random_seed(4)
        L = tf_keras.layers
        m = tf_keras.Sequential([
            tf_keras.Input((8, 8, 3)), L.Conv2D(6, 3, use_bias=False),
            L.BatchNormalization(momentum=0.9), L.ReLU(), L.GlobalAveragePooling2D(),
            L.Dense(3)])
        m.compile(optimizer=tf_keras.optimizers.SGD(0.05),
                  loss=tf_keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        return m

    ours, theirs = make(), make()
    theirs.set_weights(ours.get_weights())
    with fbn_grad_tf.keras.override():
        types = train_step_types(ours, x, y, loss_fn)
        loss_ours = float(ours.train_on_batch(x, y))
    assert {OURS_FWD, OURS_BWD} <= types, sorted(types)
    assert not {"FusedBatchNormV3", "FusedBatchNormGradV3"} & types
    types = train_step_types(theirs, x, y, loss_fn)
    assert "FusedBatchNormGradV3" in types and OURS_BWD not in types
    loss_theirs = float(theirs.train_on_batch(x, y))
    np.testing.assert_allclose(loss_ours, loss_theirs, rtol=1e-5)
    for a, b in zip(ours.get_weights(), theirs.get_weights()):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)
