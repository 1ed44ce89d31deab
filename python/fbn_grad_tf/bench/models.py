"""--model: whole-model training steps of real keras.applications models.

    python -m fbn_grad_tf.bench --model resnet50                     # batch 16, 96x96, float32
    python -m fbn_grad_tf.bench --model resnet50,mobilenetv2,densenet121 --policy mixed_bfloat16
    python -m fbn_grad_tf.bench --model mobilenetv2 --reps 5 --json m.json
    python -m fbn_grad_tf.bench --model resnet50 --trace              # + sum of BN op times

Per model (``weights=None``, ``classes`` outputs, synthetic data), one process builds every
variant of MODEL_VARIANTS from the same model (same weights: the clones get the original's
weights, layer by layer): Keras 3 (the model as built), TF fused and ours (every
keras.layers.BatchNormalization swapped for fbn_grad_tf.keras.BatchNormalization: TF's ops,
or ours), and the floors (every BN an identity; also the activation layers right after a BN).
Each variant is compiled (SGD, sparse categorical cross-entropy, jit_compile=False) and its
training step is Keras' own ``model.train_step`` in a tf.function (what ``fit`` runs per
batch, without fit's iterator machinery). After warm-up (the first step traces; its loss is
checked against Keras 3's), one step of each variant is timed per repetition, the order
rotated every repetition, the loss fetched to the host (.numpy()) as the sync point.

Reported per variant: the median step; BN cost = step - floor's step of the same repetition
(median and interquartile range over repetitions); BN+activation cost = step - the floor
without BN and without those activations; BN's share of the step; ratios against ours with a
bootstrap 95% interval (repetitions resampled jointly); and per model its BN memory roofline:
elements over all BN layers x 8 tensor passes x itemsize / the measured bandwidth. The
"pair" row times two independent BN layers in one tf.function (TF may run them at once)
against the same two forced into sequence (control dependencies), ours and TF fused.

With --trace (off by default; --trace-steps N, default 5) a second, far less noisy estimate
of BN's cost follows the timed repetitions: N more steps of each BN variant (not the floors),
interleaved the same way, under the TF profiler, and per step the sum of the durations of the
ops in BN layers' name scopes (forward and gradient: TF's FusedBatchNorm ops, ours, Keras 3's
unfused ops, the moving-average updates), the BN kernels alone (by op type), and BN+act (plus
the ops of the activation layers after a BN and of the layers convert absorbs). Reported
beside step - floor as "sum of BN op times (trace)": median [IQR] and the ratio to TF fused
with a bootstrap interval. Ops that run at once overlap, so a sum of op times is not wall
time; the profiler's overhead (profiled / unprofiled step) is printed. The steps are traced
in profiler windows of a few rounds, each reduced to its sums before the next, as a window
holds every op event in memory. Details: trace.py.

The mode's modules: model_variants (the model and its variants), model_runs (ModelConfig and
the timed runs), model_stats (quartiles and bootstrap intervals), model_report (the tables);
this one is the command (main_model, model_config_from_args) and re-exports their names, so
``fbn_grad_tf.bench.models.X`` works for every name of the mode.
"""
import os
import sys
import time

# The trace module as bench.models._trace, where the tests read it.
from . import trace as _trace  # noqa: F401
from .results import write_results
from .timing import _fmt_duration
from .model_variants import (  # noqa: F401
    MODEL_VARIANT_KEYS, MODEL_VARIANTS, RATIO_BASE, TINY, ModelVariant, PassThrough, _VARIANTS,
    _activation_types, _build_converted, _build_floor, _build_floor_act, _build_keras,
    _build_ours, _build_tf_fused, _clone, _copy_weights, _fused_path_layers, _is_bn, _keras,
    _producer, activations_after_bn, bn_facts, build_model, is_user_model, model_names,
    selected_variants, without_dropout)
from .model_stats import (  # noqa: F401
    TRACE_RATIO_BASE, _bootstrap_ratio, _quartiles, model_stats, trace_stats)
from .model_runs import (  # noqa: F401
    BN_PASSES, LOSS_RTOL, POLICIES, POLICY_ITEMSIZE, ModelConfig, _compile, _first_loss_check,
    _Policy, _train_step, run_models, run_one_model, run_pair, run_trace)
from .model_report import (  # noqa: F401
    format_model_block, format_model_summary, format_pair, format_trace_notes, model_legend,
    summarize_models)


def main_model(args, parser=None):
    """The --model command: header, per-model blocks, summary, pair row; --json. Argument
    errors go to parser.error (exit 2 with the usage line) when a parser is given."""
    from .timing import _loadavg, _machine_meta
    config = model_config_from_args(args, parser)
    t0 = time.perf_counter()
    load_start = _loadavg()
    if load_start is not None and load_start > 0.75 * (os.cpu_count() or 1):
        print("warning: load average %.1f on %d cores: other work is running, the times will "
              "be noisy (see `ps aux`)" % (load_start, os.cpu_count() or 1), file=sys.stderr)
    res = run_models(config)
    summary = summarize_models(res["models"])
    elapsed = time.perf_counter() - t0
    meta = _machine_meta()
    meta.update(res["meta"])
    meta.update({"elapsed_s": round(elapsed, 1), "loadavg_1min_start": load_start,
                 "loadavg_1min_end": _loadavg()})
    print("fbn_grad_tf benchmark --model: %s, %d cores, TF %s, Keras %s, %d intra-op threads; "
          "ISA %s; bandwidth %.1f GB/s%s" % (
              meta["cpu"], meta["cores"], meta["tf_version"], meta["keras_version"],
              meta["intra_op_threads"], meta["fbn_grad_tf_isa"], meta["bandwidth_gbs"],
              " (given)" if config.bandwidth_gbs else " (measured)"))
    if load_start is not None:
        print("load average (1 min) at start %.2f, at end %.2f on %d cores"
              % (load_start, meta["loadavg_1min_end"], meta["cores"]))
    apps = [m for m in config.models if not is_user_model(m)]
    print("%d repetitions, %d warm-up steps per variant, %ssynthetic data"
          % (config.reps, config.warmup, "%d classes%s, " % (
              config.classes, " (keras.applications models; a model of yours has its own)"
              if len(apps) < len(config.models) else "") if apps else ""))
    print(model_legend(meta))
    for r in res["models"]:
        print()
        print(format_model_block(r, meta))
    print()
    print("Summary (ratios: their step or BN cost / ours; BN %%: BN cost / that variant's "
          "step%s):" % ("; trace: ours or ours conv / TF fused" if config.trace else ""))
    print(format_model_summary(summary))
    if res["pair"]:
        print()
        print(format_pair(res["pair"]))
    na = meta["not_available"]
    if na:
        print()
        print("n/a:")
        for k, why in na.items():
            print("  %s: %s" % (_VARIANTS[k].header if k in _VARIANTS else k, why))
    print()
    print("elapsed %s" % _fmt_duration(elapsed))
    for path in write_results(args, {"meta": meta, "summary": summary, "models": res["models"],
                                     "pair": res["pair"]}):
        print("results written to %s" % path, file=sys.stderr)
    return 0


def model_config_from_args(args, parser=None):
    """ModelConfig from the parsed arguments. A bad argument is parser.error (exit 2, usage)
    with a parser, else SystemExit with the message."""
    def error(msg):
        if parser is not None:
            parser.error(msg)
        raise SystemExit(msg)

    cfg = ModelConfig()
    cfg.models = tuple(m.strip() for m in args.model.split(",") if m.strip())
    known = model_names()
    bad = [m for m in cfg.models if m.lower() not in known and not is_user_model(m)]
    missing = [m for m in cfg.models
               if m.endswith((".keras", ".h5")) and not os.path.isfile(m)]
    if missing:
        error("--model: no such file: %s" % ", ".join(missing))
    if bad or not cfg.models:
        error("--model: unknown model(s) %s; one of: %s; or a model of yours: "
              "path/to/model.keras or package.module:factory" % (
                  ", ".join(bad) or "(none)", ", ".join(sorted(known))))
    for field, val in (("batch", args.batch), ("size", args.size), ("policy", args.policy),
                       ("reps", args.reps), ("threads", args.threads),
                       ("warmup", args.model_warmup), ("classes", args.classes),
                       ("bandwidth_gbs", args.bandwidth), ("bandwidth_mib", args.bandwidth_mib),
                       ("pair_reps", args.pair_reps), ("trace_steps", args.trace_steps)):
        if val is not None:
            setattr(cfg, field, val)
    if args.variants:
        cfg.variants = tuple(v.strip() for v in args.variants.split(",") if v.strip())
        try:
            selected_variants(cfg)
        except ValueError as e:
            error("--variants: %s" % e)
    if args.no_pair:
        cfg.pair = False
    if args.trace or args.trace_steps is not None:
        cfg.trace = True
    if cfg.trace_steps < 1:
        error("--trace-steps must be at least 1")
    if args.pair_shape:
        cfg.pair_shape = args.pair_shape
    if args.no_progress:
        cfg.progress = False
    return cfg
