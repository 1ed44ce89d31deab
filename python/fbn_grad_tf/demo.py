"""Demo: fbn_grad_tf inside a real Keras model, next to Keras' own BatchNormalization.

    python -m fbn_grad_tf.demo                 # about a minute on 2 CPU cores
    python -m fbn_grad_tf.demo --plot loss.png # also a loss-curve plot (needs matplotlib)

What it does:

1. checks our op against tf.raw_ops.FusedBatchNormGradV3 on CNN-like tensors (max diff);
2. builds the same small CNN (Conv-BN-ReLU-Pool-Conv-BN-ReLU-GAP-Dense) three times from the
   same initial weights, differing only in the batch-norm layer:
     ours   fbn_grad_tf.keras.BatchNormalization (our forward and our backward ops),
     tf-op  the same layer with forward_op/gradient_op="tensorflow" (TF's fused ops),
     keras  keras.layers.BatchNormalization (Keras 3: unfused moments + autodiff);
   compares their gradients on the same batch, then trains each for --steps SGD steps in a
   tf.function on synthetic data, printing the losses side by side and the time per step;
3. converts an existing model, keras.applications.MobileNetV2 (32x32, alpha=0.35,
   weights=None), with fbn_grad_tf.keras.convert: prints what was replaced and fused, checks
   that its predictions equal the original's, and trains both, and the original in float64,
   eagerly for --convert-steps steps from the same weights (losses side by side);
4. times our forward and backward ops against TF's FusedBatchNormV3 / FusedBatchNormGradV3
   alone (median of interleaved runs) for a few shapes.

Exits with status 1 if a correctness check fails.
"""
import argparse
import os
import statistics
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import fbn_grad_tf  # noqa: E402
from fbn_grad_tf.keras import BatchNormalization as FbnBatchNormalization  # noqa: E402

OP_CHECK_RTOL = 1e-4     # our op vs TF's op, max |diff| / max |TF|, float32
GRAD_RTOL_TFOP = 1e-4    # model gradients, ours vs tf-op (TF's fused forward and backward)
GRAD_RTOL_KERAS = 1e-3   # model gradients, ours vs Keras' unfused layer
LOSS_RTOL = 1e-3         # training losses, ours vs Keras, every step


class Progress:
    """A minimal text progress bar (\\r-updated on a terminal, a few lines otherwise)."""

    def __init__(self, total, label, width=28, stream=sys.stderr):
        self.total, self.label, self.width, self.stream = total, label, width, stream
        self.tty = hasattr(stream, "isatty") and stream.isatty()
        self.start = time.perf_counter()
        self._last_pct = -1

    def update(self, done, note=""):
        frac = done / float(self.total)
        if self.tty:
            filled = int(round(frac * self.width))
            bar = "#" * filled + "." * (self.width - filled)
            self.stream.write("\r  %s [%s] %3d/%d %5.1fs %s" % (
                self.label, bar, done, self.total, time.perf_counter() - self.start, note))
            if done == self.total:
                self.stream.write("\n")
            self.stream.flush()
        else:
            pct = int(frac * 4) * 25
            if pct != self._last_pct and (pct > 0 or done == self.total):
                self._last_pct = pct
                self.stream.write("  %s: %d%% (%d/%d) %.1fs %s\n" % (
                    self.label, pct, done, self.total, time.perf_counter() - self.start, note))
                self.stream.flush()


def rel_diff(a, b, floor=1e-12):
    """max |a - b| / max(max |b|, floor)."""
    a = np.asarray(a, np.float64)
    b = np.asarray(b, np.float64)
    return float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), floor)) if b.size else 0.0


def model_diff(ours, ref):
    """Worst per-variable rel_diff, each variable's scale floored at 1% of the largest
    one (a variable whose gradient is zero in exact math, e.g. a conv bias right before
    batch norm, holds only rounding noise)."""
    floor = 1e-2 * max(float(np.max(np.abs(b))) for b in ref)
    errs = [rel_diff(a, b, floor) for a, b in zip(ours, ref)]
    worst = int(np.argmax(errs))
    return errs[worst], worst


# ---- 1. op check ------------------------------------------------------------------------

OP_CHECK_CASES = (((16, 32, 32, 32), "NHWC", True), ((16, 32, 16, 16), "NCHW", True),
                  ((16, 16, 16, 64), "NHWC", False), ((8, 32, 8, 8, 8), "NCDHW", True))


def _op_inputs(shape, fmt, training, seed=0):
    rng = np.random.default_rng(seed)
    c = shape[1] if fmt in ("NCHW", "NCDHW") else shape[-1]
    x = tf.constant(rng.normal(0.3, 1.7, shape).astype(np.float32))
    dy = tf.constant(rng.normal(0.0, 1.0, shape).astype(np.float32))
    scale = tf.constant(rng.uniform(0.5, 1.5, c).astype(np.float32))
    if training:
        axes = [0] + list(range(2, len(shape))) if fmt in ("NCHW", "NCDHW") else \
            list(range(len(shape) - 1))
        mean, var = tf.nn.moments(x, axes)
    else:
        mean = tf.constant(rng.normal(0, 0.5, c).astype(np.float32))
        var = tf.constant(rng.uniform(0.5, 2.0, c).astype(np.float32))
    return dict(y_backprop=dy, x=x, scale=scale, reserve_space_1=mean, reserve_space_2=var,
                reserve_space_3=tf.constant([], tf.float32), epsilon=1e-3, data_format=fmt,
                is_training=training)


def op_check():
    print("1. Our op vs tf.raw_ops.FusedBatchNormGradV3 (float32, max |diff| / max |TF|)")
    print("   %-20s %-6s %-9s %10s %10s %10s" % ("shape", "format", "mode", "x_backprop",
                                                  "scale_bp", "offset_bp"))
    ok = True
    for shape, fmt, training in OP_CHECK_CASES:
        kw = _op_inputs(shape, fmt, training)
        ours = fbn_grad_tf.raw_op(**kw)[:3]
        ref = tf.raw_ops.FusedBatchNormGradV3(**kw)[:3]
        diffs = [rel_diff(a, b) for a, b in zip(ours, ref)]
        bad = max(diffs) > OP_CHECK_RTOL
        ok &= not bad
        print("   %-20s %-6s %-9s %10.2e %10.2e %10.2e%s" % (
            "x".join(map(str, shape)), fmt, "training" if training else "inference",
            *diffs, "   <-- FAIL" if bad else ""))
    return ok


# ---- 2. model ---------------------------------------------------------------------------

def make_model(kind, image, classes, seed):
    import keras
    keras.utils.set_random_seed(seed)
    bn = {"ours": FbnBatchNormalization, "tf-op": FbnBatchNormalization,
          "keras": keras.layers.BatchNormalization}[kind]
    inp = keras.Input((image, image, 3))
    # No conv bias before BN (standard practice; BN's beta replaces it).
    h = keras.layers.Conv2D(16, 3, padding="same", use_bias=False)(inp)
    h = bn(momentum=0.9)(h)
    h = keras.layers.ReLU()(h)
    h = keras.layers.MaxPooling2D()(h)
    h = keras.layers.Conv2D(32, 3, padding="same", use_bias=False)(h)
    h = bn(momentum=0.9)(h)
    h = keras.layers.ReLU()(h)
    h = keras.layers.GlobalAveragePooling2D()(h)
    model = keras.Model(inp, keras.layers.Dense(classes)(h), name="cnn_" + kind)
    if kind == "tf-op":
        for layer in model.layers:
            if isinstance(layer, FbnBatchNormalization):
                layer.forward_op = "tensorflow"
                layer.gradient_op = "tensorflow"
    return model


def synthetic_data(n, image, classes, seed):
    """Images whose class is a fixed random function of their per-channel statistics (so
    the loss can go down)."""
    rng = np.random.default_rng(seed)
    x = rng.normal(0.0, 1.0, (n, image, image, 3)).astype(np.float32)
    x += rng.normal(0.0, 1.0, (n, 1, 1, 3)).astype(np.float32)
    feats = np.concatenate([x.mean(axis=(1, 2)), x[:, : image // 2].std(axis=(1, 2))], axis=1)
    w = rng.normal(0.0, 1.0, (feats.shape[1], classes))
    y = np.argmax(feats @ w, axis=1).astype(np.int32)
    return x, y


def make_fns(model, lr):
    import keras
    opt = keras.optimizers.SGD(lr, momentum=0.9)
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)

    @tf.function
    def grads(x, y):
        with tf.GradientTape() as tape:
            loss = loss_fn(y, model(x, training=True))
        return tape.gradient(loss, model.trainable_variables)

    @tf.function
    def step(x, y):
        with tf.GradientTape() as tape:
            loss = loss_fn(y, model(x, training=True))
        g = tape.gradient(loss, model.trainable_variables)
        opt.apply_gradients(zip(g, model.trainable_variables))
        return loss

    return grads, step


def op_types(fn, *args):
    gd = fn.get_concrete_function(*args).graph.as_graph_def()
    return {n.op for n in gd.node} | {n.op for f in gd.library.function for n in f.node_def}


def train_compare(args):
    kinds = ("ours", "tf-op", "keras")
    x, y = synthetic_data(args.batch * args.batches, args.image, 10, args.seed)
    batches = [(tf.constant(x[i:i + args.batch]), tf.constant(y[i:i + args.batch]))
               for i in range(0, len(x), args.batch)]
    models = {k: make_model(k, args.image, 10, args.seed) for k in kinds}
    init = models["ours"].get_weights()
    for k in kinds:
        models[k].set_weights(init)
    fns = {k: make_fns(models[k], args.lr) for k in kinds}

    ok = True
    print("\n2. Small CNN, batch %d of %dx%dx3, 2 x (Conv-BN-ReLU), SGD(lr=%g, momentum=0.9)"
          % (args.batch, args.image, args.image, args.lr))
    types = op_types(fns["ours"][1], *batches[0])
    ours_ops = (fbn_grad_tf.FusedBatchNorm.OP_NAME, fbn_grad_tf.REGISTERED_OP_NAME)
    routed = (all(t in types for t in ours_ops)
              and not {"FusedBatchNormV3", "FusedBatchNormGradV3"} & types)
    print("   train step graph of 'ours' contains %s: %s; TF's FusedBatchNormV3/GradV3: %s"
          % (" + ".join(ours_ops), all(t in types for t in ours_ops),
             bool({"FusedBatchNormV3", "FusedBatchNormGradV3"} & types)))
    ok &= routed

    # Gradients on the same batch from the same weights (then reset the moving stats).
    g = {k: [t.numpy() for t in fns[k][0](*batches[0])] for k in kinds}
    for k in kinds:
        models[k].set_weights(init)
    names = [v.path for v in models["ours"].trainable_variables]
    d_tf, w_tf = model_diff(g["ours"], g["tf-op"])
    d_keras, w_keras = model_diff(g["ours"], g["keras"])
    print("   gradients on one batch, worst of %d weights, max|diff|/max|ref|:" % len(names))
    print("     ours vs tf-op (TF's FusedBatchNormV3 + GradV3):          %.2e  (%s)"
          % (d_tf, names[w_tf]))
    print("     ours vs keras (Keras 3 unfused BatchNormalization):      %.2e  (%s)"
          % (d_keras, names[w_keras]))
    ok &= d_tf < GRAD_RTOL_TFOP and d_keras < GRAD_RTOL_KERAS

    losses = {k: [] for k in kinds}
    times = {k: [] for k in kinds}
    bar = Progress(args.steps, "training")
    for k in kinds:  # trace outside the timed loop
        fns[k][1].get_concrete_function(*batches[0])
    for s in range(args.steps):
        xb, yb = batches[s % len(batches)]
        order = kinds if s % 2 == 0 else kinds[::-1]  # interleave, alternate order
        for k in order:
            t0 = time.perf_counter()
            loss = float(fns[k][1](xb, yb))
            times[k].append(time.perf_counter() - t0)
            losses[k].append(loss)
        bar.update(s + 1, "loss %.4f" % losses["ours"][-1])

    every = max(1, args.steps // 10)
    print("   %5s %12s %12s %12s %12s" % ("step", "ours", "tf-op", "keras", "|ours-keras|"))
    for s in list(range(0, args.steps, every)) + ([args.steps - 1] if (args.steps - 1) % every
                                                   else []):
        print("   %5d %12.6f %12.6f %12.6f %12.2e" % (
            s + 1, losses["ours"][s], losses["tf-op"][s], losses["keras"][s],
            abs(losses["ours"][s] - losses["keras"][s])))
    loss_diff = max(abs(a - b) / max(abs(b), 1e-6) for a, b in zip(losses["ours"],
                                                                   losses["keras"]))
    trained = [v.numpy() for v in models["ours"].trainable_variables]
    w_diff, _ = model_diff(trained, [v.numpy() for v in models["keras"].trainable_variables])
    stats = [v.numpy() for v in models["ours"].non_trainable_variables]
    s_diff, _ = model_diff(stats, [v.numpy() for v in models["keras"].non_trainable_variables])
    print("   max relative loss difference ours vs keras over %d steps: %.2e" % (
        args.steps, loss_diff))
    print("   max relative difference of trained weights ours vs keras:  %.2e" % w_diff)
    print("   max relative difference of moving mean/variance:           %.2e" % s_diff)
    ok &= loss_diff < LOSS_RTOL
    print("   time per training step (median of %d, ms):" % args.steps)
    med = {k: 1e3 * statistics.median(times[k]) for k in kinds}
    for k in kinds:
        print("     %-6s %8.2f" % (k, med[k]))
    return ok, losses


# ---- 3. convert an existing model ------------------------------------------------------------

def convert_demo(args):
    import keras
    print("\n3. An existing model: keras.applications.MobileNetV2(32x32, alpha=0.35, "
          "weights=None), converted")
    keras.utils.set_random_seed(args.seed)
    original = keras.applications.MobileNetV2(input_shape=(32, 32, 3), alpha=0.35,
                                              weights=None, classes=10,
                                              classifier_activation=None)
    model, report = fbn_grad_tf.keras.convert(original, return_report=True)
    print("   model = fbn_grad_tf.keras.convert(model)  ->")
    for line in str(report).splitlines():
        print("   " + line)
    left = [l.name for l in model.layers if type(l) is keras.layers.BatchNormalization]
    x, y = synthetic_data(args.batch, 32, 10, args.seed + 1)
    pred = rel_diff(model.predict(x, verbose=0), original.predict(x, verbose=0))
    print("   Keras BatchNormalization layers left: %d; predictions vs the original: "
          "max|diff|/max|ref| = %.2e" % (len(left), pred))
    ok = not left and pred < 1e-5
    # The same Keras model in float64, same weights: the reference both float32 runs drift
    # from (rounding differences grow from step to step in this small-batch network).
    policy = keras.config.dtype_policy()
    keras.config.set_dtype_policy("float64")
    try:
        ref64 = keras.applications.MobileNetV2(input_shape=(32, 32, 3), alpha=0.35,
                                               weights=None, classes=10,
                                               classifier_activation=None)
    finally:
        keras.config.set_dtype_policy(policy)
    ref64.set_weights([w.astype(np.float64) for w in original.get_weights()])
    losses = []
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    for m, xm in ((model, x), (original, x), (ref64, x.astype(np.float64))):
        opt = keras.optimizers.SGD(0.01)
        run = []
        for _ in range(args.convert_steps):  # eager: no tracing time for a demo
            with tf.GradientTape() as tape:
                loss = loss_fn(y, m(xm, training=True))
            grads = tape.gradient(loss, m.trainable_variables)
            opt.apply_gradients(zip(grads, m.trainable_variables))
            run.append(float(loss))
        losses.append(run)
    print("   eager SGD(0.01) steps, training loss:")
    print("   %5s %12s %12s %16s" % ("step", "converted", "original", "original float64"))
    for s, (a, b, c) in enumerate(zip(*losses)):
        print("   %5d %12.6f %12.6f %16.6f" % (s + 1, a, b, c))
    first = abs(losses[0][0] - losses[1][0]) / max(abs(losses[1][0]), 1e-6)
    ok &= first < LOSS_RTOL
    return ok


# ---- 4. op timing -------------------------------------------------------------------------

TIMING_CASES = (((32, 32, 32, 64), "NHWC", True), ((32, 64, 32, 32), "NCHW", True),
                ((32, 16, 16, 128), "NHWC", False))


def _interleaved_medians(fns, arg, reps):
    for f in fns:
        f(arg).numpy()
    t = ([], [])
    for r in range(reps):
        for i in ((0, 1) if r % 2 == 0 else (1, 0)):
            t0 = time.perf_counter()
            fns[i](arg).numpy()
            t[i].append(time.perf_counter() - t0)
    return tuple(1e3 * statistics.median(v) for v in t)


def op_timing(reps):
    print("\n4. Ops alone, inside tf.function, median of %d interleaved runs (ms)" % reps)
    print("   %-18s %-6s %-9s %-8s %9s %9s %8s" % ("shape", "format", "mode", "op", "ours",
                                                   "TF", "TF/ours"))
    for shape, fmt, training in TIMING_CASES:
        kw = _op_inputs(shape, fmt, training, seed=1)
        tensors = {k: v for k, v in kw.items() if isinstance(v, tf.Tensor)}
        attrs = {k: v for k, v in kw.items() if not isinstance(v, tf.Tensor)}
        channels = int(tensors["scale"].shape[0])
        empty = tf.zeros([0])
        fwd = dict(x=tensors["x"], scale=tensors["scale"], offset=tf.zeros([channels]),
                   mean=empty if training else tensors["reserve_space_1"],
                   variance=empty if training else tensors["reserve_space_2"])

        @tf.function
        def ours_bwd(t):
            return fbn_grad_tf.raw_op(**t, **attrs)[0]

        @tf.function
        def theirs_bwd(t):
            return tf.raw_ops.FusedBatchNormGradV3(**t, **attrs)[0]

        @tf.function
        def ours_fwd(t):
            return fbn_grad_tf.fused_batch_norm_v3(**t, **attrs)[0]

        @tf.function
        def theirs_fwd(t):
            return tf.raw_ops.FusedBatchNormV3(**t, **attrs)[0]

        for name, fns, arg in (("forward", (ours_fwd, theirs_fwd), fwd),
                               ("backward", (ours_bwd, theirs_bwd), tensors)):
            label = ("x".join(map(str, shape)), fmt, "training" if training else "inference",
                     name)
            try:
                a, b = _interleaved_medians(fns, arg, reps)
            except tf.errors.InvalidArgumentError:  # TF's CPU kernel refuses the case
                print("   %-18s %-6s %-9s %-8s %9s %9s %8s" % (label + ("", "n/a", "")))
                continue
            print("   %-18s %-6s %-9s %-8s %9.3f %9.3f %8.2f" % (label + (a, b, b / a)))


def maybe_plot(path, losses):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("\n--plot: matplotlib is not installed; no plot written (pip install matplotlib)")
        return
    fig, ax = plt.subplots(figsize=(6, 4))
    for k, v in losses.items():
        ax.plot(range(1, len(v) + 1), v, label=k, linestyle="--" if k == "keras" else "-")
    ax.set_xlabel("step")
    ax.set_ylabel("training loss")
    ax.set_title("fbn_grad_tf vs Keras BatchNormalization")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    print("\nplot written to %s" % path)


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m fbn_grad_tf.demo", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=30, help="training steps (default 30)")
    p.add_argument("--batch", type=int, default=32, help="batch size (default 32)")
    p.add_argument("--batches", type=int, default=8, help="distinct batches (default 8)")
    p.add_argument("--image", type=int, default=24, help="image side (default 24)")
    p.add_argument("--lr", type=float, default=0.05, help="learning rate (default 0.05)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--reps", type=int, default=15, help="op timing runs (default 15)")
    p.add_argument("--convert-steps", type=int, default=3,
                   help="eager training steps of the converted MobileNetV2 (default 3; 0 "
                        "skips part 3)")
    p.add_argument("--no-timing", action="store_true", help="skip the op timing table")
    p.add_argument("--plot", metavar="FILE.png", help="write the loss curves (matplotlib)")
    args = p.parse_args(argv)
    if args.steps < 1 or args.batch < 2 or args.batches < 1 or args.image < 4:
        p.error("need --steps >= 1, --batch >= 2, --batches >= 1, --image >= 4")

    t0 = time.perf_counter()
    import keras
    print("fbn_grad_tf %s | TensorFlow %s | Keras %s | %d CPU threads | oneDNN %s" % (
        fbn_grad_tf.__version__, tf.__version__, keras.__version__, os.cpu_count() or 0,
        {"0": "off", "1": "on"}.get(os.environ.get("TF_ENABLE_ONEDNN_OPTS", ""),
                                    "TF default")))
    ok = op_check()
    train_ok, losses = train_compare(args)
    ok &= train_ok
    if args.convert_steps > 0:
        ok &= convert_demo(args)
    if not args.no_timing:
        op_timing(args.reps)
    if args.plot:
        maybe_plot(args.plot, losses)
    print("\n%s (%.0f s)" % ("all checks passed" if ok else "CHECK FAILED",
                             time.perf_counter() - t0))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
