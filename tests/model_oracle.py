"""A float64 oracle for whole Keras models (tests/test_convert.py, tests/test_keras_override.py).

The reference is the same Keras model built under the "float64" dtype policy with the same
weights. One training step (forward with training=True, loss, gradients of every trainable
variable) is run on the float32 model under test, on Keras' own float32 model and on the
float64 one; the errors of both float32 models against float64 are compared. A single seed
is not enough: a max-pool or ReLU decision can flip between float32 and float64 for any
implementation, and one flip dominates the error, so the medians over a few seeds (data) are
compared.
"""
import numpy as np
import tensorflow as tf
import keras

SIZE = 32  # the smallest input all the applications below accept
BATCH = 8
CLASSES = 10

APPS = {
    "MobileNetV2": lambda: keras.applications.MobileNetV2(
        input_shape=(SIZE, SIZE, 3), alpha=0.35, weights=None, classes=CLASSES,
        classifier_activation=None),
    "ResNet50": lambda: keras.applications.ResNet50(
        input_shape=(SIZE, SIZE, 3), weights=None, classes=CLASSES, classifier_activation=None),
    "ResNet50V2": lambda: keras.applications.ResNet50V2(
        input_shape=(SIZE, SIZE, 3), weights=None, classes=CLASSES, classifier_activation=None),
    "DenseNet121": lambda: keras.applications.DenseNet121(
        input_shape=(SIZE, SIZE, 3), weights=None, classes=CLASSES, classifier_activation=None),
    "EfficientNetB0": lambda: keras.applications.EfficientNetB0(
        input_shape=(SIZE, SIZE, 3), weights=None, classes=CLASSES,
        classifier_activation=None),
}


def build_app(name, policy="float32", seed=0):
    """keras.applications model `name` (weights=None, 32x32 input, 10 logits) under the dtype
    policy; its Dropout layers get rate 0 (EfficientNet's top dropout and stochastic depth),
    so that training-mode steps of different models are comparable."""
    old = keras.config.dtype_policy()
    keras.config.set_dtype_policy(policy)
    try:
        keras.utils.set_random_seed(seed)
        model = APPS[name]()
    finally:
        keras.config.set_dtype_policy(old)
    for layer in model.layers:
        if isinstance(layer, keras.layers.Dropout):
            layer.rate = 0.0
    return model


def biases_before_bn(model):
    """Paths of the biases of layers whose output feeds a BatchNormalization: their true
    gradient is zero, so their float32 gradients are pure rounding noise."""
    paths = set()
    for layer in model.layers:
        if not isinstance(layer, keras.layers.BatchNormalization):
            continue
        for node in layer._inbound_nodes:  # pylint: disable=protected-access
            for t in node.input_tensors:
                prev = t._keras_history.operation  # pylint: disable=protected-access
                bias = getattr(prev, "bias", None)
                if bias is not None:
                    paths.add(bias.path)
    return paths


# The batches (seeds) every model is compared on. The deep models flip ReLU/max-pool
# decisions between float32 and float64 on about half of the batches, for Keras' model as for
# ours, and a flip dominates a batch's error: five batches leave the median to chance
# (ResNet50V2: ours 0.0027 vs Keras 0.00013 over 5, 0.0078 vs 0.0097 over 11; MobileNetV2's
# gradients on TF's Eigen kernels, an AVX2-only AMD EPYC: ours/Keras 1.50x over 5, 1.27x
# over 11).
SEEDS = range(11)


def data(seed, shape=(BATCH, SIZE, SIZE, 3), classes=CLASSES):
    rng = np.random.default_rng(seed)
    return (rng.normal(0.0, 1.0, shape).astype(np.float32),
            rng.integers(0, classes, shape[0]).astype(np.int32))


def train_step(model, x, y):
    """(logits, [gradients], [non-trainable values]) of one training-mode step, float64."""
    with tf.GradientTape() as tape:
        logits = model(x, training=True)
        loss = tf.reduce_mean(keras.losses.sparse_categorical_crossentropy(
            y, logits, from_logits=True))
    grads = tape.gradient(loss, model.trainable_variables)
    return (np.asarray(logits, np.float64),
            [np.asarray(g, np.float64) for g in grads],
            [np.asarray(v.numpy(), np.float64) for v in model.non_trainable_variables])


def _as64(w):
    return w.astype(np.float64) if w.dtype.kind == "f" else w


def global_rel_err(grads, ref, keep):
    num = sum(np.sum((grads[i] - ref[i]) ** 2) for i in keep)
    den = sum(np.sum(ref[i] ** 2) for i in keep)
    return float(np.sqrt(num / den))


def max_rel_err(values, ref):
    """Worst per-array max|a - b| / max|b|, each array's scale floored at 1% of the largest
    one (a moving mean that is zero in exact math, e.g. after a bias-free 1x1 conv of a
    normalized input, holds only rounding noise)."""
    floor = 1e-2 * max(float(np.max(np.abs(b))) for b in ref)
    return max(float(np.max(np.abs(a - b))) / max(float(np.max(np.abs(b))), floor, 1e-30)
               for a, b in zip(values, ref))


def compare(ours, keras32, keras64, seeds):
    """Runs one training step of the three models on each seed's batch, each from the same
    weights (those of keras32 when called). `ours` must have keras32's variables (checked by
    path; their order may differ). Returns a dict of per-seed error lists."""
    init = keras32.get_weights()
    init64 = [_as64(w) for w in init]
    by_path = {v.path: w for v, w in zip(keras32.weights, init)}
    if all(v.path in by_path for v in ours.weights):
        init_ours = [by_path[v.path] for v in ours.weights]
    else:  # the same constructor (override()), auto-named layers numbered differently
        init_ours = init
    paths32 = [v.path for v in keras32.trainable_variables]
    # The same variables, in keras32's order: a converted model may order them differently
    # (a BN+Add+ReLU fusion moves the fused BN after the other branch of the Add).
    paths_ours = [v.path for v in ours.trainable_variables]
    assert sorted(paths_ours) == sorted(paths32)
    grad_order = [paths_ours.index(p) for p in paths32]
    # Non-trainable: the moving statistics (a Dropout of rate 0 has no seed state in the
    # converted model, re-created from its config).
    nt32 = [v.path for v in keras32.non_trainable_variables]
    stats = [i for i, p in enumerate(nt32) if p.endswith(("/moving_mean", "/moving_variance"))]
    nt_ours = [v.path for v in ours.non_trainable_variables]
    stats_ours = [nt_ours.index(nt32[i]) for i in stats]
    skip = biases_before_bn(keras32)
    keep = [i for i, p in enumerate(paths32) if p not in skip]
    errs = {k: [] for k in ("grad_ours", "grad_keras", "fwd_ours", "fwd_keras", "stats_ours",
                            "stats_keras", "fwd_ours_vs_keras", "stats_ours_vs_keras")}
    for seed in seeds:
        x, y = data(seed)
        keras32.set_weights(init)
        ours.set_weights(init_ours)
        keras64.set_weights(init64)
        r32 = train_step(keras32, tf.constant(x), tf.constant(y))
        r = train_step(ours, tf.constant(x), tf.constant(y))
        r64 = train_step(keras64, tf.constant(x.astype(np.float64)), tf.constant(y))
        r32 = r32[:2] + ([r32[2][i] for i in stats],)
        r64 = r64[:2] + ([r64[2][i] for i in stats],)
        r = (r[0], [r[1][i] for i in grad_order], [r[2][i] for i in stats_ours])
        errs["grad_ours"].append(global_rel_err(r[1], r64[1], keep))
        errs["grad_keras"].append(global_rel_err(r32[1], r64[1], keep))
        errs["fwd_ours"].append(max_rel_err([r[0]], [r64[0]]))
        errs["fwd_keras"].append(max_rel_err([r32[0]], [r64[0]]))
        errs["stats_ours"].append(max_rel_err(r[2], r64[2]))
        errs["stats_keras"].append(max_rel_err(r32[2], r64[2]))
        errs["fwd_ours_vs_keras"].append(max_rel_err([r[0]], [r32[0]]))
        errs["stats_ours_vs_keras"].append(max_rel_err(r[2], r32[2]))
    keras32.set_weights(init)
    ours.set_weights(init_ours)
    return errs


def assert_as_good_as_keras(errs, factor=1.5, label=""):
    """Medians over the seeds: ours no further from float64 than `factor` x Keras' float32
    (gradients, forward output, moving statistics), and ours close to Keras' float32."""
    med = {k: float(np.median(v)) for k, v in errs.items()}
    msg = "%s: %s" % (label, {k: ["%.3g" % e for e in v] for k, v in errs.items()})
    assert med["grad_ours"] <= factor * med["grad_keras"], msg
    assert med["fwd_ours"] <= factor * med["fwd_keras"], msg
    assert med["stats_ours"] <= factor * med["stats_keras"], msg
    assert max(errs["fwd_ours_vs_keras"]) < 2e-3, msg
    assert max(errs["stats_ours_vs_keras"]) < 2e-3, msg
    return med
