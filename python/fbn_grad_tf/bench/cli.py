"""The command line: python -m fbn_grad_tf.bench (see the package docstring)."""
import argparse
import json
import os
import sys
import time

import tensorflow as tf

from .cases import Config, DTYPES, FORMATS, MAX_CHAIN, MODES, parse_shape, quick_config
from .timing import (
    _fmt_duration, _loadavg, _machine_meta, backend_name, command_line, configure_threads,
    best_bandwidth, measure_bandwidth, onednn_enabled)
from .contestants import LAYER_COLUMNS, LAYER_HEADERS, NEEDS_FORWARD
from .runs import run, run_layer, run_worker_subprocess
from .models import (
    MODEL_VARIANT_KEYS, POLICIES as MODEL_POLICIES, ModelConfig, main_model)
from .report import (
    format_layer_summary, format_layer_table, format_summary, format_table, layer_notes, merge,
    merge_layer, plot, summarize, summarize_layer, torch_header_note)
from .results import RESULTS_DIR, write_results


def main_layer(args, config):
    """The --layer command: prints the header, table, summary and n/a reasons; --json."""
    t0 = time.perf_counter()
    load_start = _loadavg()
    if load_start is not None and load_start > 0.75 * (os.cpu_count() or 1):
        print("warning: load average %.1f on %d cores: other work is running, the times will "
              "be noisy (see `ps aux`)" % (load_start, os.cpu_count() or 1), file=sys.stderr)
    threads = configure_threads(config.threads)
    if config.progress:
        print("measuring memory bandwidth ...", file=sys.stderr, flush=True)
    bandwidth = measure_bandwidth(threads, mib=args.bandwidth_mib)
    res = run_layer(config)
    rows = merge_layer(res)
    summary = summarize_layer(rows, res["meta"])
    elapsed = time.perf_counter() - t0
    meta = _machine_meta()
    meta.update(res["meta"])
    meta.update({"intra_op_threads": threads, "bandwidth_gbs": bandwidth["bandwidth"],
                 "elapsed_s": round(elapsed, 1), "loadavg_1min_start": load_start,
                 "loadavg_1min_end": _loadavg()})
    base, relu_base = meta["ratio_base"], meta["ratio_base_relu"]
    print("fbn_grad_tf benchmark --layer: %s, %d cores, TF %s (%s), %d intra-op threads, %s; "
          "ISA %s; bandwidth %.1f GB/s" % (
              meta["cpu"], meta["cores"], tf.__version__, meta["tf_backend"], threads,
              meta["torch"], meta["fbn_grad_tf_isa"], meta["bandwidth_gbs"]))
    if load_start is not None:
        print("load average (1 min) at start %.2f, at end %.2f on %d cores"
              % (load_start, meta["loadavg_1min_end"], meta["cores"]))
    print("times: median ms of one BN training step (forward + backward, upstream gradient "
          "dy fed in) over `reps` interleaved calls; epsilon %g" % config.epsilon)
    for k, h, d in LAYER_COLUMNS:
        print("  %-10s = %s" % (h, d))
    print("x = that column's ms / %s ms (%s: / %s ms) from the same process; >1: ours faster"
          % (LAYER_HEADERS[base], LAYER_HEADERS["tf_relu"], LAYER_HEADERS[relu_base]))
    if base != "ours":
        print("  (ours, ours+ReLU: n/a (%s): this fbn_grad_tf.fused_batch_norm %s, so the "
              "ratios are against tf+ours)" % (
                  NEEDS_FORWARD, "cannot run our forward op here (nn.our_forward_available())"
                  if meta["ours_forward"].get("accepts_forward") else "has no forward= argument"))
    print()
    print(format_layer_table(rows, meta))
    print()
    print(format_layer_summary(summary, meta))
    notes = layer_notes(rows)
    if notes:
        print()
        print("n/a (refused, not built or not installed):")
        for n in notes:
            print("  " + n)
    print()
    print("elapsed %s" % _fmt_duration(elapsed))
    for path in write_results(args, {"meta": meta, "bandwidth": bandwidth, "summary": summary,
                                     "results": rows}):
        print("results written to %s" % path, file=sys.stderr)
    if args.plot:
        print("--plot: not drawn in --layer mode", file=sys.stderr)
    return 0


# ---- command line ---------------------------------------------------------------------------

def _split(text, allowed, what):
    vals = tuple(v.strip() for v in text.split(",") if v.strip())
    aliases = {"bf16": "bfloat16", "f16": "float16", "half": "float16", "f32": "float32",
               "train": "training", "infer": "inference", "nhwc": "NHWC", "nchw": "NCHW"}
    vals = tuple(aliases.get(v, aliases.get(v.lower(), v)) for v in vals)
    bad = [v for v in vals if v not in allowed]
    if bad or not vals:
        raise argparse.ArgumentTypeError("%s must be a comma list of %s, got %r"
                                         % (what, ", ".join(allowed), text))
    return vals


def _int_at_least(lo):
    """An argparse type: an integer >= lo."""
    def parse(text):
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError("expected an integer, got %r" % text) from None
        if value < lo:
            raise argparse.ArgumentTypeError("must be at least %d, got %d" % (lo, value))
        return value
    return parse


def _positive_float(text):
    """An argparse type: a finite number > 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError("expected a number, got %r" % text) from None
    if not 0.0 < value < float("inf"):
        raise argparse.ArgumentTypeError("must be a positive number, got %r" % text)
    return value


#: Options of the backward grid (and --layer) that --model does not use: dest -> flag.
GRID_ONLY = {"shapes": "--shapes", "dtypes": "--dtypes", "formats": "--formats",
             "modes": "--modes", "budget": "--budget", "min_reps": "--min-reps",
             "max_reps": "--max-reps", "plot": "--plot", "eigen_bfc": "--eigen-bfc",
             "no_eigen": "--no-eigen", "no_torch": "--no-torch"}
#: Options that select a part of the grid: a stored run (--store) holds the whole of it.
GRID_FILTERS = {"shapes": "--shapes", "dtypes": "--dtypes", "formats": "--formats",
                "modes": "--modes", "reps": "--reps", "budget": "--budget",
                "min_reps": "--min-reps", "max_reps": "--max-reps"}


def build_parser():
    p = argparse.ArgumentParser(
        prog="python -m fbn_grad_tf.bench",
        description="Times fbn_grad_tf's FusedBatchNormGradV3 against TF's built-in op "
                    "(oneDNN and Eigen kernels) and, when importable, PyTorch's; with --layer, "
                    "a whole BN layer training step against TF, Keras and PyTorch; with "
                    "--model, whole keras.applications models' training steps. `python -m "
                    "fbn_grad_tf.bench report` makes Markdown tables from runs stored with "
                    "--store (see its --help).")
    p.add_argument("--quick", action="store_true",
                   help="a subset of under a minute: 2 shapes, float32+bfloat16, fewer reps")
    p.add_argument("--shapes", type=lambda s: tuple(parse_shape(t) for t in s.split(",")),
                   help="comma list of NHWC shapes, e.g. 32x56x56x256,256x1x1x4096")
    p.add_argument("--dtypes", type=lambda s: _split(s, DTYPES, "--dtypes"))
    p.add_argument("--formats", type=lambda s: _split(s, FORMATS, "--formats"))
    p.add_argument("--modes", type=lambda s: _split(s, MODES, "--modes"))
    p.add_argument("--reps", type=_int_at_least(1), help="fixed repetitions per case (default: "
                   "time-budgeted, see --budget); --model: timed steps per variant "
                   "(default %d)" % ModelConfig.reps)
    p.add_argument("--budget", type=_positive_float, help="seconds of the slowest contestant per "
                   "case (default 1.5; --quick 0.3), within --min-reps..--max-reps")
    p.add_argument("--min-reps", type=_int_at_least(1))
    p.add_argument("--max-reps", type=_int_at_least(1))
    p.add_argument("--threads", type=_int_at_least(1), help="TF intra-op threads (and torch threads, "
                   "and NumPy bandwidth threads); default: TF's default (all cores)")
    p.add_argument("--json", metavar="FILE", help="write machine-readable results")
    p.add_argument("--store", nargs="?", const=RESULTS_DIR, metavar="DIR",
                   help="also write the JSON as this run's stored result, "
                        "DIR/<machine kind>/<name>.json (DIR default %s; name: ops, quick, "
                        "layer, layer-quick, models-<policy>), replacing the previous run of "
                        "that name on this kind of machine; `python -m fbn_grad_tf.bench "
                        "report` makes the docs' tables from them" % RESULTS_DIR)
    p.add_argument("--plot", metavar="FILE.png", help="bar chart of speed-ups (matplotlib)")
    p.add_argument("--bandwidth-mib", type=_int_at_least(1), default=256, metavar="MIB",
                   help="array size for the bandwidth measurement (default 256 MiB)")
    p.add_argument("--eigen-bfc", action="store_true",
                   help="run the Eigen worker with TF_CPU_ALLOCATOR_USE_BFC=true (a pooled "
                        "allocator, as TF uses with oneDNN on) instead of TF's default malloc; "
                        "compares kernels without the page faults of fresh outputs")
    p.add_argument("--no-eigen", action="store_true",
                   help="skip the second TF backend (the worker subprocess)")
    p.add_argument("--no-torch", action="store_true", help="skip PyTorch even if importable")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--chain", type=int, metavar="K",
                   help="also time each op K times in a row inside one tf.function (each "
                        "call's x_backprop the next one's y_backprop, as in a model's "
                        "backward): the op without the per-call tf.function dispatch; "
                        "columns 'chain ms', 'x(c)', '%%BW(c)' (default: off)")
    p.add_argument("--layer", action="store_true",
                   help="time one whole BN layer training step (forward + backward) instead: "
                        "ours, ours+ReLU, TF's forward with our backward, TF BN+ReLU, TF fused, "
                        "Keras 3 BatchNormalization, PyTorch; float32 NHWC unless --dtypes/"
                        "--formats say otherwise (--modes does not apply: training only)")
    m = p.add_argument_group(
        "--model", "whole-model training steps (fbn_grad_tf.bench.models): Keras 3 BN, TF fused, "
        "ours and the no-BN floors, interleaved in this process; --reps, --threads, --json, "
        "--bandwidth-mib and --no-progress apply too")
    m.add_argument("--model", metavar="NAMES",
                   help="comma list of keras.applications models (case-insensitive: resnet50, "
                        "mobilenetv2, densenet121, ...; 'tiny' is a 3-layer CNN for smoke "
                        "tests), built with weights=None on synthetic data; or models of "
                        "yours: path/to/model.keras (or .h5), package.module:factory (a "
                        "function returning a keras.Model); one input, one classifier "
                        "output, their shapes from the model (--size, --classes ignored)")
    m.add_argument("--batch", type=_int_at_least(1), help="batch size (default %d)" % ModelConfig.batch)
    m.add_argument("--size", type=_int_at_least(1), help="image height and width (default %d)"
                   % ModelConfig.size)
    m.add_argument("--policy", choices=MODEL_POLICIES,
                   help="Keras dtype policy for building the models (default float32)")
    m.add_argument("--classes", type=_int_at_least(2), help="classifier outputs (default %d)"
                   % ModelConfig.classes)
    m.add_argument("--variants", metavar="KEYS",
                   help="comma list of variants to run (default: all available): %s"
                        % ", ".join(MODEL_VARIANT_KEYS))
    m.add_argument("--model-warmup", type=_int_at_least(1), metavar="N",
                   help="untimed steps per variant before timing, the first traces (default %d)"
                        % ModelConfig.warmup)
    m.add_argument("--bandwidth", type=_positive_float, metavar="GBS",
                   help="memory bandwidth in GB/s for the roofline (default: measured)")
    m.add_argument("--no-pair", action="store_true",
                   help="skip the pair row (two independent BN layers at once vs in sequence)")
    m.add_argument("--pair-shape", type=parse_shape, metavar="NxHxWxC",
                   help="NHWC shape of each pair layer's input (default %s)"
                        % "x".join(map(str, ModelConfig.pair_shape)))
    m.add_argument("--pair-reps", type=_int_at_least(1), metavar="N",
                   help="repetitions of the pair row (default %d)" % ModelConfig.pair_reps)
    m.add_argument("--trace", action="store_true",
                   help="also estimate BN's cost from a TF profiler trace: a few extra steps of "
                        "each BN variant under the profiler, the durations of the ops in BN "
                        "layers' name scopes summed per step ('sum of BN op times', beside "
                        "'step - floor'; ops that run at once overlap, so it is not wall "
                        "time), ratios against TF fused; adds those steps plus the profiler's "
                        "overhead to the run; off by default")
    m.add_argument("--trace-steps", type=_int_at_least(1), metavar="N",
                   help="profiled steps per BN variant with --trace (default %d; implies "
                        "--trace)" % ModelConfig.trace_steps)
    p.add_argument("--_worker", choices=("eigen", "onednn"), help=argparse.SUPPRESS)
    p.add_argument("--_config", help=argparse.SUPPRESS)
    return p


def config_from_args(args):
    if args._config:
        return Config.from_json(json.loads(args._config))
    cfg = quick_config() if args.quick else Config()
    if getattr(args, "layer", False):  # one dtype and format unless asked for more
        cfg.dtypes, cfg.formats, cfg.modes = ("float32",), ("NHWC",), ("training",)
    for field, val in (("shapes", args.shapes), ("dtypes", args.dtypes),
                       ("formats", args.formats),
                       ("modes", None if getattr(args, "layer", False) else args.modes),
                       ("reps", args.reps), ("budget_s", args.budget),
                       ("min_reps", args.min_reps), ("max_reps", args.max_reps),
                       ("threads", args.threads), ("chain", args.chain)):
        if val is not None:
            setattr(cfg, field, val)
    if args.no_torch:
        cfg.torch = False
    if args.eigen_bfc:
        cfg.eigen_bfc = True
    if args.no_progress:
        cfg.progress = False
    return cfg


def main(argv=None):
    """The command line; returns the exit status. A run stopped by Ctrl-C, a failed
    correctness check and a model of the user's that cannot run end with a one-line message
    on stderr, not a traceback."""
    from .cases import CorrectnessError
    from .model_variants import UserModelError
    try:
        return _main(argv)
    except KeyboardInterrupt:
        print("\ninterrupted (Ctrl-C): the run stopped; its results were not written",
              file=sys.stderr)
        return 130
    except CorrectnessError as e:
        print("error: correctness check failed: %s" % e, file=sys.stderr)
        return 1
    except UserModelError as e:
        print("error: %s" % e, file=sys.stderr)
        return 2


def _main(argv):
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["report"]:
        from .results_report import main_report
        return main_report(argv[1:])
    parser = build_parser()
    args = parser.parse_args(argv)
    args.command_line = command_line(argv)
    if (args.min_reps is not None and args.max_reps is not None
            and args.min_reps > args.max_reps):
        parser.error("--min-reps %d is above --max-reps %d" % (args.min_reps, args.max_reps))
    if args.chain is not None:
        if not 1 <= args.chain <= MAX_CHAIN:
            parser.error("--chain must be between 1 and %d (float16 values grow with each "
                         "link), got %d" % (MAX_CHAIN, args.chain))
        if args.layer or args.model:
            parser.error("--chain times the backward grid; it does not combine with --layer "
                         "or --model")
    if args.model:
        if args.layer or args.quick:
            parser.error("--model does not combine with --layer or --quick")
        given = [flag for dest, flag in GRID_ONLY.items() if getattr(args, dest)]
        if given:
            parser.error("%s: the backward grid's option(s), not used by --model"
                         % ", ".join(given))
        return main_model(args, parser)
    if args.store and not args._worker:
        given = [flag for dest, flag in GRID_FILTERS.items()
                 if getattr(args, dest) is not None]
        if given:
            parser.error("--store keeps the whole run that the docs' tables are made from "
                         "(docs/BENCHMARK.md, \"Stored runs\"); %s select(s) a part of it: "
                         "write such a run with --json FILE" % ", ".join(given))
    config = config_from_args(args)
    if args._worker:
        res = run(config, label=args._worker)
        with open(args.json, "w") as f:
            json.dump(res, f)
        return 0
    if args.layer:
        return main_layer(args, config)

    t0 = time.perf_counter()
    load_start = _loadavg()
    if load_start is not None and load_start > 0.75 * (os.cpu_count() or 1):
        print("warning: load average %.1f on %d cores: other work is running, the times will "
              "be noisy (see `ps aux`)" % (load_start, os.cpu_count() or 1), file=sys.stderr)
    threads = configure_threads(config.threads)
    main_backend = backend_name(onednn_enabled())
    if main_backend != "onednn":
        print("note: oneDNN is off in this process (TF_ENABLE_ONEDNN_OPTS=%s); its TF times "
              "go to the Eigen column and a worker measures oneDNN"
              % os.environ.get("TF_ENABLE_ONEDNN_OPTS"), file=sys.stderr)
    if config.progress:
        print("measuring memory bandwidth ...", file=sys.stderr, flush=True)
    bandwidth = measure_bandwidth(threads, mib=args.bandwidth_mib)
    main_res = run(config)
    other_res, other_error = None, None
    if not args.no_eigen:
        other = "eigen" if main_backend == "onednn" else "onednn"
        try:
            other_res = run_worker_subprocess(other, config)
        except (RuntimeError, OSError, ValueError, KeyError) as e:
            other_error = str(e)
    if config.progress:
        print("measuring memory bandwidth again ...", file=sys.stderr, flush=True)
    bandwidth = best_bandwidth([bandwidth, measure_bandwidth(threads, mib=args.bandwidth_mib)])
    rows = merge(main_res, other_res, bandwidth)
    have_torch = any(r["torch_ms"] is not None or r["torch_error"] for r in rows)
    summary = summarize(rows, have_torch)
    elapsed = time.perf_counter() - t0

    meta = _machine_meta()
    meta.update({"mode": "ops", "bandwidth_gbs": bandwidth["bandwidth"],
                 "tf_backend_main": main_backend, "intra_op_threads": threads,
                 "torch": main_res["meta"]["torch"], "config": config.to_json(),
                 "elapsed_s": round(elapsed, 1), "other_backend_error": other_error,
                 "loadavg_1min_start": load_start, "loadavg_1min_end": _loadavg()})
    print("fbn_grad_tf benchmark: %s, %d cores, TF %s (main process: %s), %d intra-op threads, "
          "%s; ISA %s" % (meta["cpu"], meta["cores"], tf.__version__, main_backend, threads,
                          meta["torch"], meta["fbn_grad_tf_isa"]))
    if load_start is not None:
        print("load average (1 min) at start %.2f, at end %.2f on %d cores"
              % (load_start, meta["loadavg_1min_end"], meta["cores"]))
    print("times: median ms over `reps` interleaved calls each (inside tf.function); "
          "x = their ms / ours ms from the same process (>1: ours faster)")
    print("GB/s = 3 x elements x itemsize / ours (read dy and x, write dx); "
          "%%BW = that / %.1f GB/s (this run's bandwidth, below: the best of its readings at "
          "the start and the end)" % bandwidth["bandwidth"])
    if other_res is not None and main_backend == "onednn":
        print("ours(E) = ours timed in the Eigen worker process (TF_ENABLE_ONEDNN_OPTS=0%s), "
              "interleaved with TF-Eigen; TF-Eigen's x is against it" %
              (", TF_CPU_ALLOCATOR_USE_BFC=true" if config.eigen_bfc else ""))
        if not config.eigen_bfc:
            print("  (with oneDNN off TF allocates from malloc, so large outputs are fresh pages "
                  "on every call, for ours(E) and TF-Eigen alike; --eigen-bfc pools them)")
    if config.chain:
        print("chain ms = ours per op, each op run %d times in a row inside one tf.function "
              "(x_backprop fed in as the next y_backprop; one tf.function dispatch shared by "
              "the %d; ours in place after the first); x(c) = TF-%s's chain ms / ours; "
              "%%BW(c) from chain ms" % (config.chain, config.chain,
                                        "Eigen" if main_backend == "eigen" else "oneDNN"))
    if have_torch:
        print(torch_header_note(main_res["meta"], threads))
    print()
    print(format_table(rows, have_torch))
    print()
    print(format_summary(summary, bandwidth, have_torch))
    notes = sorted({"%s: %s" % (b, r["tf_%s_error" % b]) for r in rows for b in ("onednn", "eigen")
                    if r["tf_%s_ms" % b] is None and r["tf_%s_error" % b]})
    tnotes = sorted({r["torch_error"] for r in rows if r["torch_error"]}) if have_torch else []
    if notes or tnotes:
        print()
        print("n/a (refused, not run or not installed):")
        for n in notes + ["torch: " + n for n in tnotes]:
            print("  " + n)
    print()
    print("elapsed %s" % _fmt_duration(elapsed))
    for path in write_results(args, {"meta": meta, "bandwidth": bandwidth, "summary": summary,
                                     "results": rows}):
        print("results written to %s" % path, file=sys.stderr)
    if args.plot:
        msg = plot(rows, args.plot, have_torch)
        print(msg if msg else "plot written to %s" % args.plot, file=sys.stderr)
    if other_error:
        print("error: %s" % other_error, file=sys.stderr)
        return 1
    return 0
