"""Deployment: SavedModel export/reload in a fresh process, and tf.distribute.MirroredStrategy
over two logical CPU devices (configured in a child process: logical devices must be set up
before TensorFlow initializes its runtime).
"""
import os
import subprocess
import sys
import textwrap

import numpy as np
import tensorflow as tf
import keras

import fbn_grad_tf

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_child(code, tmp_path, timeout=300):
    script = os.path.join(str(tmp_path), "child.py")
    with open(script, "w") as f:
        f.write(textwrap.dedent(code))
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", PYTHONHASHSEED="0")
    # The installed (editable) package, or the in-tree one as a fallback.
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in (os.path.join(REPO, "python"), env.get("PYTHONPATH")) if p)
    r = subprocess.run([sys.executable, script], cwd=str(tmp_path), env=env,
                       capture_output=True, text=True, timeout=timeout)
    assert r.returncode == 0, "child failed (rc %s):\n%s\n%s" % (
        r.returncode, r.stdout[-3000:], r.stderr[-6000:])
    return r.stdout


# ---- SavedModel ---------------------------------------------------------------------------

class _Trainer(tf.Module):
    """A Keras CNN with our BN, a gradient function and a serving function."""

    def __init__(self):
        super().__init__()
        keras.utils.set_random_seed(7)
        inp = keras.Input((8, 8, 3))
        h = keras.layers.Conv2D(4, 3, padding="same")(inp)
        h = fbn_grad_tf.keras.BatchNormalization(momentum=0.5)(h)
        h = keras.layers.GlobalAveragePooling2D()(keras.layers.ReLU()(h))
        self.model = keras.Model(inp, keras.layers.Dense(2)(h))
        self.gamma = tf.Variable(tf.linspace(0.5, 1.5, 5))

    @tf.function(input_signature=[tf.TensorSpec([None, 8, 8, 3], tf.float32)])
    def grads(self, x):
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(tf.square(self.model(x, training=True)))
        return tape.gradient(loss, self.model.trainable_variables)

    @tf.function(input_signature=[tf.TensorSpec([None, 5, 4, 4], tf.float32)])
    def nchw_inference_grad(self, x):
        # fused_batch_norm directly, channels-first inference (TF's CPU op refuses it).
        with tf.GradientTape() as tape:
            tape.watch(x)
            y = fbn_grad_tf.fused_batch_norm(x, self.gamma, tf.zeros([5]), tf.ones([5]) * 0.1,
                                             tf.ones([5]) * 2.0, data_format="NCHW",
                                             is_training=False)[0]
            loss = tf.reduce_sum(y * y * x)
        return tape.gradient(loss, [x, self.gamma])

    @tf.function(input_signature=[tf.TensorSpec([None, 8, 8, 3], tf.float32)])
    def serve(self, x):
        return self.model(x, training=False)


def test_saved_model_reload_in_fresh_process(tmp_path):
    m = _Trainer()
    rng = np.random.default_rng(0)
    x = rng.normal(size=(4, 8, 8, 3)).astype("float32")
    xc = rng.normal(size=(2, 5, 4, 4)).astype("float32")
    graph_types = {n.op for f in m.grads.get_concrete_function().graph.as_graph_def()
                   .library.function for n in f.node_def}
    graph_types |= {op.type for op in m.grads.get_concrete_function().graph.get_operations()}
    assert fbn_grad_tf.REGISTERED_OP_NAME in graph_types
    expected = {"g%d" % i: g.numpy() for i, g in enumerate(m.grads(x))}
    expected.update({"c%d" % i: g.numpy() for i, g in enumerate(m.nchw_inference_grad(xc))})
    expected["serve"] = m.serve(x).numpy()  # after grads(): it updated the moving statistics
    np.savez(os.path.join(str(tmp_path), "expected.npz"), x=x, xc=xc, **expected)
    full = os.path.join(str(tmp_path), "full")
    tf.saved_model.save(m, full)
    # Inference-only export, default options: loads without fbn_grad_tf (inference runs TF's
    # ops with TF's gradients). A module holding only the serving function: every tf.function
    # of a saved module is saved, and m.grads itself contains our op.
    serving = tf.Module()
    serving.model = m.model
    serving.serve = tf.function(lambda x: m.model(x, training=False),
                                input_signature=[tf.TensorSpec([None, 8, 8, 3], tf.float32)])
    serve_only = os.path.join(str(tmp_path), "serve_only")
    tf.saved_model.save(serving, serve_only, signatures={"serve": serving.serve})

    out = run_child("""
        import numpy as np, tensorflow as tf
        e = np.load("expected.npz")
        # 1. Without fbn_grad_tf: the full SavedModel holds our ops (its training function)
        #    and cannot be loaded ...
        try:
            tf.saved_model.load("full")
            raise SystemExit("loaded without fbn_grad_tf?")
        except Exception as err:
            assert "FbnGrad>FusedBatchNorm" in str(err), err  # our forward or backward
            print("without import:", type(err).__name__)
        # ... but the serving-only export can be.
        s = tf.saved_model.load("serve_only")
        np.testing.assert_allclose(s.signatures["serve"](x=tf.constant(e["x"]))["output_0"],
                                   e["serve"], rtol=1e-6, atol=1e-6)
        # 2. With fbn_grad_tf imported first: everything, gradients included.
        import fbn_grad_tf
        m = tf.saved_model.load("full")
        np.testing.assert_allclose(m.serve(e["x"]), e["serve"], rtol=1e-6, atol=1e-6)
        for i, g in enumerate(m.grads(e["x"])):
            np.testing.assert_allclose(g, e["g%d" % i], rtol=1e-5, atol=1e-6)
        for i, g in enumerate(m.nchw_inference_grad(e["xc"])):
            np.testing.assert_allclose(g, e["c%d" % i], rtol=1e-5, atol=1e-5)
        gd = m.grads.get_concrete_function(tf.TensorSpec([None, 8, 8, 3])).graph.as_graph_def()
        types = {n.op for n in gd.node} | {n.op for f in gd.library.function for n in f.node_def}
        assert "FbnGrad>FusedBatchNormGradV3" in types and "FusedBatchNormGradV3" not in types
        print("reloaded OK")
    """, tmp_path)
    assert "reloaded OK" in out


# ---- MirroredStrategy -----------------------------------------------------------------------

def test_mirrored_strategy_two_logical_cpus(tmp_path):
    out = run_child("""
        import numpy as np, tensorflow as tf
        cpu = tf.config.list_physical_devices("CPU")[0]
        tf.config.set_logical_device_configuration(
            cpu, [tf.config.LogicalDeviceConfiguration()] * 2)
        import keras, fbn_grad_tf
        from fbn_grad_tf import gradients as fgrads

        traced = []
        real = fgrads.raw_op
        fgrads.raw_op = lambda **kw: (traced.append(1), real(**kw))[1]

        def make(bn):
            keras.utils.set_random_seed(3)
            inp = keras.Input((8, 8, 3))
            h = keras.layers.Conv2D(6, 3, padding="same")(inp)
            h = bn(momentum=0.8)(h)
            h = keras.layers.GlobalAveragePooling2D()(keras.layers.ReLU()(h))
            return keras.Model(inp, keras.layers.Dense(3)(h))

        def compile(m):
            m.compile(optimizer=keras.optimizers.SGD(0.1),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))

        rng = np.random.default_rng(0)
        X = rng.normal(0.5, 2, (96, 8, 8, 3)).astype("float32")
        Y = rng.integers(0, 3, 96).astype("int32")
        GB = 32  # global batch: 16 per replica
        strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
        assert strategy.num_replicas_in_sync == 2
        res = {}
        for name, bn in (("ours", fbn_grad_tf.keras.BatchNormalization),
                         ("keras", keras.layers.BatchNormalization)):
            with strategy.scope():
                m = make(bn)
                compile(m)
            hist = m.fit(X, Y, batch_size=GB, epochs=2, shuffle=False, verbose=0)
            res[name] = (hist.history["loss"], m.get_weights(), m)
        assert traced, "our op was not traced into the distributed train function"
        np.testing.assert_allclose(res["ours"][0], res["keras"][0], rtol=1e-5)
        worst = 0.0
        for a, b in zip(res["ours"][1], res["keras"][1]):
            err = np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-1)
            worst = max(worst, err)
        assert worst < 1e-4, worst
        print("mirrored ours vs keras: max rel weight diff %.3g" % worst)

        # Single device, same math: each replica's half batch normalized on its own, loss =
        # mean of the two replicas' losses (what the strategy all-reduces).
        single = make(fbn_grad_tf.keras.BatchNormalization)
        init = [v.numpy().copy() for v in single.trainable_variables]
        opt = keras.optimizers.SGD(0.1)
        lossf = keras.losses.SparseCategoricalCrossentropy(from_logits=True)

        @tf.function
        def step(x, y):
            with tf.GradientTape() as tape:
                h = GB // 2
                loss = 0.5 * (lossf(y[:h], single(x[:h], training=True))
                              + lossf(y[h:], single(x[h:], training=True)))
            g = tape.gradient(loss, single.trainable_variables)
            opt.apply_gradients(zip(g, single.trainable_variables))
            return loss

        for epoch in range(2):
            for i in range(0, len(X), GB):
                step(tf.constant(X[i:i + GB]), tf.constant(Y[i:i + GB]))
        worst = 0.0
        mirrored = res["ours"][2]
        for a, b in zip(single.trainable_variables, mirrored.trainable_variables):
            err = np.max(np.abs(a.numpy() - b.numpy())) / max(np.max(np.abs(b.numpy())), 1e-1)
            worst = max(worst, err)
        assert worst < 1e-4, worst
        moved = max(np.max(np.abs(a - v.numpy())) for a, v in zip(init, single.trainable_variables))
        assert moved > 1e-3, moved
        print("mirrored vs single-device emulation: max rel weight diff %.3g" % worst)
        print("mirrored OK")
    """, tmp_path)
    assert "mirrored OK" in out, out


def test_saved_model_of_use_for_gradients_tagged_ops(tmp_path):
    """Ops tagged by use_for_gradients(graph=True) cannot have their gradient serialized
    (SavedModel calls gradient functions with op=None); the error says what to do, and
    experimental_custom_gradients=False saves a model whose ops keep using our gradient."""
    scale, offset = tf.constant([1.0, 2.0, 0.5]), tf.constant([0.0, 1.0, -1.0])

    class M(tf.Module):
        @tf.function(input_signature=[tf.TensorSpec([None, 4, 4, 3], tf.float32)])
        def f(self, x):
            # forward=False: TF's forward op, tagged (with the default forward=True the op
            # is our forward, whose gradient is registered by type and saves normally).
            with fbn_grad_tf.use_for_gradients(forward=False):
                return tf.compat.v1.nn.fused_batch_norm(x, scale, offset)[0]

    path = os.path.join(str(tmp_path), "tagged")
    try:
        tf.saved_model.save(M(), path)
        raise AssertionError("saving tagged ops with custom gradients should fail")
    except ValueError as e:
        assert "experimental_custom_gradients=False" in str(e.__cause__ or e)
    tf.saved_model.save(M(), path,
                        options=tf.saved_model.SaveOptions(experimental_custom_gradients=False))
    loaded = tf.saved_model.load(path)
    x = tf.constant(np.random.default_rng(0).normal(size=(2, 4, 4, 3)), tf.float32)

    @tf.function
    def grad(x):
        with tf.GradientTape() as tape:
            tape.watch(x)
            loss = tf.reduce_sum(loaded.f(x) * tf.range(3.0))
        return tape.gradient(loss, x)

    gd = grad.get_concrete_function(x).graph.as_graph_def()
    types = {n.op for n in gd.node} | {n.op for f in gd.library.function for n in f.node_def}
    assert fbn_grad_tf.REGISTERED_OP_NAME in types and "FusedBatchNormGradV3" not in types
    with tf.GradientTape() as tape:
        tape.watch(x)
        loss = tf.reduce_sum(tf.compat.v1.nn.fused_batch_norm(x, scale, offset)[0]
                             * tf.range(3.0))
    np.testing.assert_allclose(grad(x), tape.gradient(loss, x), rtol=1e-4, atol=1e-5)


def test_demo_smoke(capsys):
    """python -m fbn_grad_tf.demo, shortened: checks pass, tables printed."""
    from fbn_grad_tf import demo
    rc = demo.main(["--steps", "4", "--batches", "2", "--batch", "8", "--image", "8",
                    "--no-timing", "--convert-steps", "1"])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "all checks passed" in out and "ours vs keras" in out and "time per training step" in out
    assert "fbn_grad_tf.keras.convert(mobilenetv2_0.35_32): 52 BatchNormalization" in out
