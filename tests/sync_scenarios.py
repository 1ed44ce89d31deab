"""Shared scenario of the synchronized batch-norm tests (tests/test_sync_*.py).

Not a test module: the distributed tests run it in child processes (MirroredStrategy over
logical CPU devices must be configured before TensorFlow initializes; MultiWorkerMirrored
needs one process per worker), and compare what it returns with a single-replica run.

A small CNN with three batch-norm layers covering the layouts of the layer: NHWC (after a
Conv2D), NCHW (axis=1, between two Permutes) and 2-D (after a Dense, reshaped internally).
Weights are set from a NumPy generator, so every process builds the same model. A "step" is
one SGD update on the global batch, whose replicas' losses are ``sum(CE) / GLOBAL_BATCH``
(the custom-training-loop convention; they add up to the global mean).
"""
import json
import os
import sys

import numpy as np

GLOBAL_BATCH = 16
IMAGE = (8, 8, 3)
CLASSES = 3
KINDS = ("fbn", "keras", "keras_local")


def make_data(seed=0, batches=2):
    rng = np.random.default_rng(seed)
    x = (1.5 + 2.0 * rng.standard_normal((batches * GLOBAL_BATCH,) + IMAGE)).astype(np.float32)
    y = rng.integers(0, CLASSES, batches * GLOBAL_BATCH).astype(np.int32)
    return x, y


def _bn(kind, **kw):
    import keras
    if kind == "fbn":
        from fbn_grad_tf.sync import SyncBatchNormalization
        return SyncBatchNormalization(momentum=0.9, **kw)
    return keras.layers.BatchNormalization(momentum=0.9, synchronized=(kind == "keras"), **kw)


def build_model(kind, seed=1):
    import keras
    inp = keras.Input(IMAGE)
    h = keras.layers.Conv2D(6, 3, padding="same", name="conv")(inp)
    h = _bn(kind, name="bn_nhwc")(h)
    h = keras.layers.ReLU()(h)
    h = keras.layers.Permute((3, 1, 2))(h)
    h = _bn(kind, axis=1, name="bn_nchw")(h)
    h = keras.layers.Permute((2, 3, 1))(h)
    h = keras.layers.ReLU()(h)
    h = keras.layers.GlobalAveragePooling2D()(h)
    h = keras.layers.Dense(5, name="dense")(h)
    h = _bn(kind, name="bn_2d")(h)
    h = keras.layers.ReLU()(h)
    out = keras.layers.Dense(CLASSES, name="logits")(h)
    model = keras.Model(inp, out)
    rng = np.random.default_rng(seed)
    values = []
    for w in model.weights:
        name, shape = w.path, tuple(w.shape)
        if name.endswith("gamma"):
            values.append(rng.uniform(0.5, 1.5, shape))
        elif name.endswith("beta"):
            values.append(0.1 * rng.standard_normal(shape))
        elif name.endswith("moving_mean"):
            values.append(np.zeros(shape))
        elif name.endswith("moving_variance"):
            values.append(np.ones(shape))
        else:
            values.append(rng.standard_normal(shape) / np.sqrt(max(1, np.prod(shape[:-1]))))
    model.set_weights([v.astype(np.float32) for v in values])
    return model


def weight_dict(model):
    return {w.path: np.asarray(w.numpy()).tolist() for w in model.weights}


def train_ctl(strategy, kind, steps=2, lr=0.1):
    """Custom training loop: returns (summed first-step gradients, final weights, losses)."""
    import keras
    import tensorflow as tf

    x, y = make_data(batches=steps)
    with strategy.scope():
        model = build_model(kind)
        opt = keras.optimizers.SGD(lr)
        opt.build(model.trainable_variables)
    names = [v.path for v in model.trainable_variables]
    n = strategy.num_replicas_in_sync
    local = GLOBAL_BATCH // n

    @tf.function
    def step(xb, yb):
        def replica_fn(xb, yb):
            with tf.GradientTape() as tape:
                logits = model(xb, training=True)
                ce = keras.losses.sparse_categorical_crossentropy(yb, logits, from_logits=True)
                loss = tf.reduce_sum(ce) / GLOBAL_BATCH
            grads = tape.gradient(loss, model.trainable_variables)
            ctx = tf.distribute.get_replica_context()
            summed = ctx.all_reduce(tf.distribute.ReduceOp.SUM, grads)
            total = ctx.all_reduce(tf.distribute.ReduceOp.SUM, loss)
            opt.apply_gradients(zip(grads, model.trainable_variables))
            return summed, total

        per = strategy.run(replica_fn, args=(xb, yb))
        return tf.nest.map_structure(lambda v: strategy.experimental_local_results(v)[0], per)

    first_grads, losses = None, []
    for s in range(steps):
        xs = x[s * GLOBAL_BATCH:(s + 1) * GLOBAL_BATCH]
        ys = y[s * GLOBAL_BATCH:(s + 1) * GLOBAL_BATCH]

        def value_fn(ctx, arr):
            i = ctx.replica_id_in_sync_group
            return tf.constant(arr[i * local:(i + 1) * local])

        xb = strategy.experimental_distribute_values_from_function(lambda c: value_fn(c, xs))
        yb = strategy.experimental_distribute_values_from_function(lambda c: value_fn(c, ys))
        grads, loss = step(xb, yb)
        losses.append(float(loss))
        if first_grads is None:
            first_grads = {k: np.asarray(g).tolist() for k, g in zip(names, grads)}
            op_types = _fbn_op_types(step.get_concrete_function(xb, yb))
    return {"grads": first_grads, "weights": weight_dict(model), "losses": losses,
            "fbn_ops": op_types}


def _fbn_op_types(concrete):
    """fbn_grad_tf op types in a traced step (its graph and every function it calls)."""
    gd = concrete.graph.as_graph_def()
    nodes = list(gd.node) + [n for f in gd.library.function for n in f.node_def]
    return sorted({n.op for n in nodes if n.op.startswith("FbnGrad>")})


def train_fit(strategy, kind, steps=2, lr=0.1):
    """model.fit for `steps` batches of GLOBAL_BATCH (Keras' own loss scaling)."""
    import keras
    import tensorflow as tf

    x, y = make_data(batches=steps)
    with strategy.scope():
        model = build_model(kind)
        model.compile(optimizer=keras.optimizers.SGD(lr),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    ds = tf.data.Dataset.from_tensor_slices((x, y)).batch(GLOBAL_BATCH)
    opts = tf.data.Options()
    opts.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.OFF
    ds = ds.with_options(opts)
    hist = model.fit(ds, epochs=1, verbose=0, shuffle=False)
    return {"weights": weight_dict(model), "losses": hist.history["loss"]}


def max_rel_diff(a, b, floor=0.02):
    """max |a - b| / (max |b| + floor) per key of two {name: nested list} dicts.

    ``< 1e-4`` means: relative error 1e-4 of the largest entry, or absolute error 1e-4 x
    floor (2e-6 by default) for values near zero (gradients that are exactly zero in exact
    math, e.g. of the bias of a layer followed by batch norm, are pure float32 rounding
    noise: see BN_FED_BIASES)."""
    out = {}
    for k in b:
        pa, pb = np.asarray(a[k], np.float64), np.asarray(b[k], np.float64)
        out[k] = float(np.max(np.abs(pa - pb)) / (np.max(np.abs(pb)) + floor)) if pb.size else 0.0
    return out


# The biases of the layers right before a BN (build_model): their gradient is zero in exact
# math, so both values are float32 rounding noise, which depends on every kernel on the way
# (2.0e-6 apart in ours on TF's Eigen kernels, an AVX2-only AMD EPYC). max_rel_diff's floor
# of 0.02 makes the tests' 1e-4 bound 2e-6 there; these keys get a floor of 0.05 (5e-6).
BN_FED_BIASES = ("conv/bias", "dense/bias")
BN_FED_BIAS_FLOOR = 0.05


def compare(result, reference):
    """Largest relative differences of gradients/weights/losses (keys present in both)."""
    out = {}
    for part in ("grads", "weights"):
        if part in result and part in reference:
            res, ref = result[part], reference[part]
            fed = BN_FED_BIASES if part == "grads" else ()
            rest = {k: v for k, v in ref.items() if k not in fed}
            zero = {k: v for k, v in ref.items() if k in fed}
            out[part] = max(list(max_rel_diff(res, rest).values()) +
                            list(max_rel_diff(res, zero, floor=BN_FED_BIAS_FLOOR).values()))
    out["losses"] = float(np.max(np.abs(np.subtract(result["losses"], reference["losses"]))))
    return out


def mirrored_main(out_path):
    """Child process: MirroredStrategy over two logical CPU devices."""
    import tensorflow as tf
    cpu = tf.config.list_physical_devices("CPU")[0]
    tf.config.set_logical_device_configuration(
        cpu, [tf.config.LogicalDeviceConfiguration()] * 2)
    import fbn_grad_tf.sync  # noqa: F401
    mirrored = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
    single = tf.distribute.get_strategy()
    res = {
        "replicas": mirrored.num_replicas_in_sync,
        "ctl": {
            "reference": train_ctl(single, "keras_local"),
            "fbn_single": train_ctl(single, "fbn"),
            "fbn_mirrored": train_ctl(mirrored, "fbn"),
            "keras_mirrored": train_ctl(mirrored, "keras"),
            "local_mirrored": train_ctl(mirrored, "keras_local"),
        },
        "fit": {
            "reference": train_fit(single, "keras_local"),
            "fbn_mirrored": train_fit(mirrored, "fbn"),
            "keras_mirrored": train_fit(mirrored, "keras"),
        },
    }
    with open(out_path, "w") as f:
        json.dump(res, f)


def worker_main(out_path):
    """Child process: one worker of MultiWorkerMirroredStrategy (TF_CONFIG set by parent)."""
    import tensorflow as tf
    import fbn_grad_tf.sync  # noqa: F401
    strategy = tf.distribute.MultiWorkerMirroredStrategy(
        communication_options=tf.distribute.experimental.CommunicationOptions(
            implementation=tf.distribute.experimental.CommunicationImplementation.RING,
            timeout_seconds=60.0))
    res = {
        "replicas": strategy.num_replicas_in_sync,
        "task": json.loads(os.environ["TF_CONFIG"])["task"]["index"],
        "fbn": train_ctl(strategy, "fbn"),
        "keras": train_ctl(strategy, "keras"),
    }
    with open(out_path, "w") as f:
        json.dump(res, f)


if __name__ == "__main__":
    mode, path = sys.argv[1], sys.argv[2]
    {"mirrored": mirrored_main, "worker": worker_main}[mode](path)
