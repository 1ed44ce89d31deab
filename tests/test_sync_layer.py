"""fbn_grad_tf.sync.SyncBatchNormalization and sync_batch_norm.

In this process (no strategy: the default replica context, one replica) the layer must
behave like keras.layers.BatchNormalization; the MirroredStrategy test runs
sync_scenarios.py in a child process with two logical CPU devices (logical devices must be
configured before TensorFlow initializes) and compares with a single-replica run over the
global batch and with Keras' own synchronized layer.
"""
import json
import os
import sys

import keras
import numpy as np
import pytest
import tensorflow as tf

import fbn_grad_tf  # noqa: F401
from fbn_grad_tf import sync
from fbn_grad_tf.sync import SyncBatchNormalization

import sync_scenarios as S
from subproc import child_env

HERE = os.path.dirname(os.path.abspath(__file__))
TOL = 1e-4


def _weights(layer, rng):
    c = layer.moving_mean.shape[0]
    vals = []
    for w in layer.weights:
        if w.path.endswith("gamma"):
            vals.append(rng.uniform(0.5, 1.5, c))
        elif w.path.endswith("beta"):
            vals.append(rng.standard_normal(c))
        elif w.path.endswith("moving_mean"):
            vals.append(rng.standard_normal(c))
        else:
            vals.append(rng.uniform(0.5, 2.0, c))
    return [v.astype(np.float32) for v in vals]


def _run(layer, x, training=True, mask=None):
    """(y, dx, d(trainable weights)..., non-trainable weights after the call)."""
    x = tf.constant(x)
    w = tf.constant(np.sin(np.arange(np.prod(x.shape))).reshape(x.shape), x.dtype)
    with tf.GradientTape() as tape:
        tape.watch(x)
        y = layer(x, training=training, mask=mask)
        loss = tf.reduce_sum(tf.cast(y, tf.float32) * tf.cast(w, tf.float32))
    grads = tape.gradient(loss, [x] + layer.trainable_weights)
    return ([y] + grads + [v.value for v in layer.non_trainable_weights])


def _pair(shape, x_dtype="float32", seed=0, **kw):
    rng = np.random.default_rng(seed)
    x = (0.5 + 2.0 * rng.standard_normal(shape)).astype(x_dtype)
    ours = SyncBatchNormalization(**kw)
    kw.pop("implementation", None)
    theirs = keras.layers.BatchNormalization(synchronized=True, **kw)
    ours.build(shape)
    theirs.build(shape)
    ours.set_weights(_weights(ours, rng))
    theirs.set_weights(ours.get_weights())
    return x, ours, theirs


def _assert_close(a_list, b_list, tol):
    assert len(a_list) == len(b_list)
    for i, (a, b) in enumerate(zip(a_list, b_list)):
        a = np.asarray(tf.cast(a, tf.float32))
        b = np.asarray(tf.cast(b, tf.float32))
        assert a.shape == b.shape, (i, a.shape, b.shape)
        np.testing.assert_allclose(a, b, rtol=tol, atol=tol * (np.abs(b).max() + 1e-3),
                                   err_msg="output %d" % i)


CASES = [((4, 5, 6, 8), -1), ((4, 8, 5, 6), 1), ((2, 3, 4, 5, 6), -1), ((2, 6, 3, 4, 5), 1),
         ((16, 7), -1), ((4, 6, 5), 1), ((4, 6, 5), -1), ((3, 4, 5, 6), 2)]


@pytest.mark.parametrize("shape,axis", CASES, ids=[
    "4d_last", "4d_axis1", "5d_last", "5d_axis1", "2d", "3d_axis1", "3d_last", "4d_axis2"])
def test_no_strategy_equals_keras(shape, axis):
    x, ours, theirs = _pair(shape, axis=axis)
    _assert_close(_run(ours, x), _run(theirs, x), TOL)
    # A second training call (moving statistics updated again) and inference.
    _assert_close(_run(ours, x + 1.0), _run(theirs, x + 1.0), TOL)
    _assert_close(_run(ours, x, training=False), _run(theirs, x, training=False), TOL)


@pytest.mark.parametrize("dtype,tol", [("float16", 3e-3), ("bfloat16", 3e-2)])
def test_16bit_layers_close_to_keras(dtype, tol):
    """Layer dtype float16/bfloat16: 16-bit kernels (ours) vs Keras' float32 math."""
    x, ours, theirs = _pair((4, 5, 6, 8), dtype=dtype)
    a, b = _run(ours, x), _run(theirs, x)
    assert a[0].dtype == b[0].dtype == tf.as_dtype(dtype)
    assert [v.dtype for v in a] == [v.dtype for v in b]
    _assert_close(a, b, tol)


def test_mixed_precision_policy():
    x, ours, theirs = _pair((4, 5, 6, 8), dtype="mixed_float16")
    x = x.astype(np.float16)
    a, b = _run(ours, x), _run(theirs, x)
    assert a[0].dtype == b[0].dtype == tf.float16
    assert ours.gamma.dtype == "float32"
    _assert_close(a, b, 3e-3)


@pytest.mark.parametrize("center,scale", [(False, True), (True, False), (False, False)])
def test_center_scale_options(center, scale):
    x, ours, theirs = _pair((4, 3, 3, 5), center=center, scale=scale)
    _assert_close(_run(ours, x), _run(theirs, x), TOL)


def test_tf_implementation_equals_fbn():
    x, ours, _ = _pair((4, 5, 6, 8), implementation="fbn")
    plain = SyncBatchNormalization(implementation="tf")
    plain.build(x.shape)
    plain.set_weights(ours.get_weights())
    _assert_close(_run(plain, x), _run(ours, x), 1e-5)


def test_mask_and_renorm_use_keras_path():
    x, ours, theirs = _pair((4, 6, 5))
    mask = tf.constant(np.random.default_rng(0).random((4, 6)) > 0.3)
    _assert_close(_run(ours, x, mask=mask), _run(theirs, x, mask=mask), TOL)
    x, ours, theirs = _pair((4, 3, 3, 5), renorm=True)
    _assert_close(_run(ours, x), _run(theirs, x), TOL)


def test_trainable_false_is_inference():
    x, ours, theirs = _pair((4, 3, 3, 5))
    ours.trainable = False
    theirs.trainable = False
    y1 = ours(x, training=True)
    y2 = theirs(x, training=True)
    _assert_close([y1], [y2], TOL)


def test_tf_function_unknown_batch_and_graph_gradient():
    x, ours, theirs = _pair((6, 4, 4, 3))

    def make(layer):
        @tf.function(input_signature=[tf.TensorSpec([None, 4, 4, 3], tf.float32)])
        def f(x):
            with tf.GradientTape() as t:
                t.watch(x)
                y = layer(x, training=True)
                loss = tf.reduce_sum(tf.sin(y) * tf.range(3, dtype=tf.float32))
            return [y] + t.gradient(loss, [x] + layer.trainable_weights)
        return f

    _assert_close(make(ours)(x), make(theirs)(x), TOL)


def test_xla_falls_back_to_plain_tf_and_fbn_raises():
    x, ours, theirs = _pair((4, 3, 3, 5))

    @tf.function(jit_compile=True)
    def f(x):
        with tf.GradientTape() as t:
            t.watch(x)
            y = ours(x, training=True)
            loss = tf.reduce_sum(y * tf.sin(y))
        return [y] + t.gradient(loss, [x] + ours.trainable_weights)

    @tf.function
    def g(x):
        with tf.GradientTape() as t:
            t.watch(x)
            y = theirs(x, training=True)
            loss = tf.reduce_sum(y * tf.sin(y))
        return [y] + t.gradient(loss, [x] + theirs.trainable_weights)

    _assert_close(f(tf.constant(x)), g(tf.constant(x)), TOL)

    forced = SyncBatchNormalization(implementation="fbn")

    @tf.function(jit_compile=True)
    def h(x):
        return forced(x, training=True)

    with pytest.raises(ValueError, match="XLA"):
        h(tf.constant(x))


def test_resolve_implementation_by_device():
    with tf.Graph().as_default():
        x = tf.compat.v1.placeholder(tf.float32, [2, 2, 2, 2])
        with tf.device("/device:GPU:0"):
            assert sync.resolve_implementation("auto", x) == "tf"
        with tf.device("/job:worker/replica:0/task:1/device:CPU:0"):
            assert sync.resolve_implementation("auto", x) == "fbn"
        with tf.device("/device:GPU:0"):
            assert sync.resolve_implementation("fbn", x) == "fbn"
    if not tf.config.list_logical_devices("GPU"):
        assert sync.resolve_implementation("auto", tf.zeros([1])) == "fbn"
    with pytest.raises(ValueError, match="implementation must be one of"):
        sync.resolve_implementation("cuda", tf.zeros([1]))


def test_get_config_round_trip_and_save_load(tmp_path):
    layer = SyncBatchNormalization(axis=1, momentum=0.9, epsilon=1e-4, center=False,
                                   implementation="tf", name="sbn")
    config = layer.get_config()
    ref = keras.layers.BatchNormalization(axis=1, momentum=0.9, epsilon=1e-4, center=False,
                                          synchronized=True, name="sbn").get_config()
    assert {k: v for k, v in config.items() if k != "implementation"} == ref
    assert config["implementation"] == "tf" and config["synchronized"] is True
    clone = SyncBatchNormalization.from_config(config)
    assert clone.get_config() == config
    assert keras.saving.get_registered_name(SyncBatchNormalization) == \
        "fbn_grad_tf>SyncBatchNormalization"

    inp = keras.Input((3, 4, 4))
    model = keras.Sequential([inp, SyncBatchNormalization(axis=1)])
    x = np.random.default_rng(0).standard_normal((2, 3, 4, 4)).astype(np.float32)
    model(x, training=True)  # moves the statistics
    path = str(tmp_path / "m.keras")
    model.save(path)
    loaded = keras.models.load_model(path)
    assert isinstance(loaded.layers[0], SyncBatchNormalization)
    for a, b in zip(model.get_weights(), loaded.get_weights()):
        np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(loaded(x, training=False), model(x, training=False))


def test_constructor_and_function_argument_checks():
    with pytest.raises(ValueError, match="implementation"):
        SyncBatchNormalization(implementation="gpu")
    x = tf.zeros([2, 3, 3, 4])
    s = tf.ones([4])
    with pytest.raises(ValueError, match="4-dimensional"):
        sync.sync_batch_norm(tf.zeros([2, 4]), s, s)
    with pytest.raises(ValueError, match="scale must have 4 elements"):
        sync.sync_batch_norm(x, tf.ones([3]), s)
    with pytest.raises(ValueError, match="data_format"):
        sync.sync_batch_norm(x, s, s, data_format="HWCN")
    with pytest.raises(ValueError, match="epsilon"):
        sync.sync_batch_norm(x, s, s, epsilon=float("nan"))
    with pytest.raises(TypeError, match="x must have dtype"):
        sync.sync_batch_norm(tf.zeros([2, 3, 3, 4], tf.float64), s, s)


def test_sync_batch_norm_function_statistics():
    rng = np.random.default_rng(5)
    x = (3.0 + rng.standard_normal((4, 8, 3, 3))).astype(np.float32)
    y, mean, var = sync.sync_batch_norm(x, tf.ones([8]), tf.zeros([8]), epsilon=0.0,
                                        data_format="NCHW")
    x64 = x.astype(np.float64)
    np.testing.assert_allclose(mean, x64.mean((0, 2, 3)), rtol=1e-6)
    np.testing.assert_allclose(var, x64.var((0, 2, 3)), rtol=1e-5)
    np.testing.assert_allclose(y.numpy().mean((0, 2, 3)), 0.0, atol=1e-5)


def test_two_pass_statistics_are_accurate_for_offset_data():
    """Mean first, then squared deviations: no E[x^2] - E[x]^2 cancellation."""
    rng = np.random.default_rng(6)
    x = (1000.0 + 0.5 * rng.standard_normal((8, 6, 6, 4))).astype(np.float32)
    _, mean, var = sync.sync_batch_norm(x, tf.ones([4]), tf.zeros([4]))
    x64 = x.astype(np.float64)
    np.testing.assert_allclose(var, x64.var((0, 1, 2)), rtol=1e-4)
    np.testing.assert_allclose(mean, x64.mean((0, 1, 2)), rtol=1e-6)


def test_mirrored_strategy_two_logical_cpus(tmp_path):
    """Custom loop and model.fit under MirroredStrategy(2 logical CPUs) == single replica on
    the global batch == Keras' BatchNormalization(synchronized=True)."""
    import subprocess
    out = str(tmp_path / "mirrored.json")
    try:
        p = subprocess.run([sys.executable, os.path.join(HERE, "sync_scenarios.py"),
                            "mirrored", out], cwd=HERE, env=child_env(), capture_output=True,
                           text=True, timeout=150)
    except subprocess.TimeoutExpired:
        pytest.fail("MirroredStrategy child timed out after 150 s")
    assert p.returncode == 0, p.stderr[-4000:]
    with open(out) as f:
        res = json.load(f)
    assert res["replicas"] == 2
    ctl, fit = res["ctl"], res["fit"]
    for name in ("fbn_single", "fbn_mirrored", "keras_mirrored"):
        diff = S.compare(ctl[name], ctl["reference"])
        assert max(diff.values()) < TOL, (name, diff)
    # Our kernels (not the plain-TF fallback) ran on the CPU replicas.
    assert ctl["fbn_mirrored"]["fbn_ops"] == ["FbnGrad>BatchNormGradApply",
                                              "FbnGrad>BatchNormGradReduce"]
    assert ctl["keras_mirrored"]["fbn_ops"] == []
    diff = S.compare(ctl["fbn_mirrored"], ctl["keras_mirrored"])
    assert max(diff.values()) < TOL, diff
    # Unsynchronized BN under the same strategy differs: the test can see synchronization.
    assert S.compare(ctl["local_mirrored"], ctl["reference"])["weights"] > 1e-3
    for name in ("fbn_mirrored", "keras_mirrored"):
        diff = S.compare(fit[name], fit["reference"])
        assert max(diff.values()) < TOL, (name, diff)


def test_sync_bench_script_smoke(tmp_path):
    """scripts/sync_bench.py runs (tiny sizes) and reports a median per variant."""
    import subprocess
    out = str(tmp_path / "bench.json")
    script = os.path.join(os.path.dirname(HERE), "scripts", "sync_bench.py")
    p = subprocess.run([sys.executable, script, "--model", "bn", "--batch", "4", "--image",
                        "4", "4", "3", "--warmup", "1", "--steps", "2", "--json", out],
                       env=child_env(), capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr[-3000:]
    with open(out) as f:
        res = json.load(f)
    assert set(res["median_ms"]) == {"fbn", "keras", "keras_local"}
    assert res["replicas"] == 2 and res["steps_timed"] == 2


def test_helpers_route_any_keras_batch_normalization():
    """layer_uses_sync_path/sync_layer_call drive a plain keras BN subclass (the wiring
    for fbn_grad_tf.keras.BatchNormalization(synchronized=True))."""

    class Routed(keras.layers.BatchNormalization):
        def call(self, inputs, training=None, mask=None):
            if self.synchronized and sync.layer_uses_sync_path(self, inputs, training, mask):
                return sync.sync_layer_call(self, inputs)
            return super().call(inputs, training=training, mask=mask)

    x, _, theirs = _pair((4, 6, 5), axis=1)
    routed = Routed(axis=1, synchronized=True)
    routed.build(x.shape)
    routed.set_weights(theirs.get_weights())
    _assert_close(_run(routed, x), _run(theirs, x), TOL)
    _assert_close(_run(routed, x, training=False), _run(theirs, x, training=False), TOL)
    assert not sync.layer_uses_sync_path(routed, x, training=False)
    assert not sync.layer_uses_sync_path(routed, x.astype(np.float64), training=True)
