#!/usr/bin/env python
"""Per-step time of fbn_grad_tf's SyncBatchNormalization vs Keras' synchronized
BatchNormalization, on MirroredStrategy over logical CPU devices of this machine.

    python scripts/sync_bench.py                      # CNN, global batch 32 of 32x32x16
    python scripts/sync_bench.py --model bn --steps 30 --json out.json

One training step = forward + backward + SGD update of the whole model, run by
``strategy.run`` inside a ``tf.function`` (a custom training loop). For every variant the
step is traced and warmed up first; then the variants are timed interleaved step by step
(fbn, keras, keras_local, fbn, ...: ``--steps`` steps each), so that load from other
processes hits them alike, and the median (and minimum) per variant is reported.

Variants: ``fbn`` (fbn_grad_tf.sync.SyncBatchNormalization), ``keras``
(keras.layers.BatchNormalization(synchronized=True)) and ``keras_local`` (Keras, not
synchronized: the cost of no synchronization at all).

Models: ``cnn``: Conv2D(32,3) -> BN -> ReLU -> Conv2D(32,3) -> BN -> ReLU -> GAP ->
Dense(10); ``bn``: three BN layers (with ReLU) on the input, no convolutions (isolates
batch-norm time).

Logical devices must be configured before TensorFlow initializes, so run this as its own
process.
"""
import argparse
import json
import os
import statistics
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

VARIANTS = ("fbn", "keras", "keras_local")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--replicas", type=int, default=2, help="logical CPU devices (replicas)")
    p.add_argument("--batch", type=int, default=32, help="global batch size")
    p.add_argument("--image", type=int, nargs=3, default=(32, 32, 16), metavar=("H", "W", "C"))
    p.add_argument("--model", choices=("cnn", "bn"), default="cnn")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--steps", type=int, default=20, help="timed steps per variant")
    p.add_argument("--variants", nargs="+", choices=VARIANTS, default=list(VARIANTS))
    p.add_argument("--json", help="write the results here")
    return p.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    import tensorflow as tf
    cpu = tf.config.list_physical_devices("CPU")[0]
    tf.config.set_logical_device_configuration(
        cpu, [tf.config.LogicalDeviceConfiguration()] * args.replicas)
    import keras
    import numpy as np
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python"))
    from fbn_grad_tf.sync import SyncBatchNormalization

    devices = ["/cpu:%d" % i for i in range(args.replicas)]
    strategy = tf.distribute.MirroredStrategy(devices)
    if args.batch % args.replicas:
        sys.exit("--batch must be a multiple of --replicas")
    local = args.batch // args.replicas

    def bn(kind):
        if kind == "fbn":
            return SyncBatchNormalization()
        return keras.layers.BatchNormalization(synchronized=(kind == "keras"))

    def build(kind):
        inp = keras.Input(tuple(args.image))
        h = inp
        if args.model == "cnn":
            for _ in range(2):
                h = keras.layers.Conv2D(32, 3, padding="same", use_bias=False)(h)
                h = keras.layers.ReLU()(bn(kind)(h))
        else:
            for _ in range(3):
                h = keras.layers.ReLU()(bn(kind)(h))
        h = keras.layers.GlobalAveragePooling2D()(h)
        return keras.Model(inp, keras.layers.Dense(10)(h))

    rng = np.random.default_rng(0)
    x = rng.standard_normal((args.batch,) + tuple(args.image)).astype(np.float32)
    y = rng.integers(0, 10, args.batch).astype(np.int32)

    def shard(arr):
        return strategy.experimental_distribute_values_from_function(
            lambda ctx: tf.constant(arr[ctx.replica_id_in_sync_group * local:
                                        (ctx.replica_id_in_sync_group + 1) * local]))

    xb, yb = shard(x), shard(y)
    steps = {}
    for kind in args.variants:
        with strategy.scope():
            model = build(kind)
            opt = keras.optimizers.SGD(0.01)

        def make_step(model=model, opt=opt):
            @tf.function
            def step(xb, yb):
                def replica_fn(xb, yb):
                    with tf.GradientTape() as tape:
                        logits = model(xb, training=True)
                        loss = tf.reduce_sum(keras.losses.sparse_categorical_crossentropy(
                            yb, logits, from_logits=True)) / args.batch
                    grads = tape.gradient(loss, model.trainable_variables)
                    opt.apply_gradients(zip(grads, model.trainable_variables))
                    return loss
                return strategy.reduce("SUM", strategy.run(replica_fn, args=(xb, yb)), None)
            return step

        steps[kind] = make_step()
        for _ in range(args.warmup):
            steps[kind](xb, yb).numpy()

    times = {k: [] for k in args.variants}
    for _ in range(args.steps):
        for kind in args.variants:
            t0 = time.perf_counter()
            steps[kind](xb, yb).numpy()
            times[kind].append(time.perf_counter() - t0)

    result = {
        "replicas": args.replicas, "global_batch": args.batch, "image": list(args.image),
        "model": args.model, "steps_timed": args.steps,
        "cpu_count": os.cpu_count(), "tensorflow": tf.__version__, "keras": keras.__version__,
        "median_ms": {k: 1e3 * statistics.median(v) for k, v in times.items()},
        "min_ms": {k: 1e3 * min(v) for k, v in times.items()},
    }
    print("MirroredStrategy x%d logical CPUs, model=%s, global batch %d of %s, median of %d "
          "steps after %d warm-up" % (args.replicas, args.model, args.batch,
                                      "x".join(map(str, args.image)),
                                      args.steps, args.warmup))
    for kind in args.variants:
        print("  %-12s median %8.2f ms   min %8.2f ms" % (kind, result["median_ms"][kind],
                                                        result["min_ms"][kind]))
    if "fbn" in times and "keras" in times:
        result["keras_over_fbn"] = result["median_ms"]["keras"] / result["median_ms"]["fbn"]
        print("  Keras sync / fbn sync: %.2fx" % result["keras_over_fbn"])
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return result


if __name__ == "__main__":
    main()
