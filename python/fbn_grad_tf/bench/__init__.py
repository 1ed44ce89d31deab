"""Benchmark: our FusedBatchNormGradV3 against TensorFlow's built-in one (and PyTorch's).

    python -m fbn_grad_tf.bench                    # full grid (ResNet-50 BN shapes), ~10 min
    python -m fbn_grad_tf.bench --quick            # ~1 minute subset
    python -m fbn_grad_tf.bench --json r.json --plot r.png
    python -m fbn_grad_tf.bench --layer            # whole BN layer training step (fwd + bwd)
    python -m fbn_grad_tf.bench --model resnet50   # whole-model training steps (models.py)
    python -m fbn_grad_tf.bench --model resnet50 --trace   # + BN op times from a profiler trace
    python -m fbn_grad_tf.bench --quick --store    # keep as docs/results/<machine kind>/quick.json
    python -m fbn_grad_tf.bench report --update-docs   # the docs' tables from the stored runs

What one run does (see docs/BENCHMARK.md):

* measures this machine's memory bandwidth (copy and triad, NumPy on all cores and a
  TensorFlow tf.function), so that our effective GB/s can be read as a fraction of it;
* in this process (TensorFlow's default: oneDNN on for x86 Linux), for every case
  (shape x data format x dtype x mode): builds inputs, runs our op and TF's
  ``tf.raw_ops.FusedBatchNormGradV3`` once each and compares the outputs (a mismatch
  raises CorrectnessError), then times both inside ``tf.function``, interleaved (ours, TF,
  TF, ours, ...), and keeps the medians; PyTorch's CPU ``native_batch_norm_backward`` is a
  third contestant when ``torch`` is importable;
* starts itself again as a worker subprocess with ``TF_ENABLE_ONEDNN_OPTS=0`` (read only
  at TF start-up) to time TF's Eigen kernels, again interleaved with ours;
* prints a table and summary, and optionally writes JSON and a bar chart.

The speed-up is TF time / our time (> 1: ours is faster). Speed-ups against each TF
backend come from same-process pairs; the "ours ms" column is from the main process.

``--layer`` times a whole batch-norm layer training step instead (forward + backward in one
tf.function with a GradientTape, float32 NHWC by default): ours (our forward and backward),
ours+ReLU, TF's forward with our backward, TF BN+ReLU, TF fused, Keras 3's
BatchNormalization and PyTorch (see run_layer and LAYER_COLUMNS); main process only.

The package's modules (everything public is re-exported here, so ``fbn_grad_tf.bench.X``
keeps working for every public name of the former single module):

* cases: the grid, Config, inputs, the NumPy reference and the correctness checks;
* timing: threads and TF backend, the progress line, memory bandwidth, interleaved timing;
* contestants: our op, TF's, the core, PyTorch, and the --layer steps;
* runs: run (backward grid, its worker subprocess) and run_layer;
* report: merge, tables, summaries, plot;
* models: --model, whole keras.applications models' training steps (see its docstring): the
  command, with its parts in model_variants (the model and its variants), model_runs
  (ModelConfig, the timed runs), model_stats (quartiles, bootstrap intervals) and
  model_report (its tables);
* trace: --model --trace, the sum of BN op times per step read from a TF profiler trace;
* results: --store, the stored runs docs/results/<machine kind>/<name>.json;
* results_report: the report command, Markdown tables from the stored runs, the docs'
  GENERATED blocks and the chart;
* cli: the command line (main); __main__ runs it.
"""
from .cases import (  # noqa: F401
    DEFAULT_SHAPES, QUICK_SHAPES, DTYPES, QUICK_DTYPES, FORMATS, MODES, LARGE_ELEMENTS, DX_TOL,
    MID_ELEMENTS, MAX_CHAIN,
    VEC_TOL, CorrectnessError, Config, quick_config, shape_str, parse_shape, tensor_shape,
    short_error, numpy_reference)
from .timing import (  # noqa: F401
    onednn_enabled, backend_name, configure_threads, Progress, measure_bandwidth, best_bandwidth,
    time_interleaved, warm_up_and_time, machine_kind, kind_slug, command_line)
from .contestants import (  # noqa: F401
    TORCH_MISSING, TORCH_INSTALL_HINT, LAYER_COLUMNS, LAYER_KEYS, LAYER_HEADERS, NEEDS_FORWARD,
    ours_forward_support, layer_ratio_base)
from .runs import (  # noqa: F401
    run, run_layer, run_worker_subprocess)
from .report import (  # noqa: F401
    merge, format_table, SUMMARY_GROUPS, summarize, format_summary, plot, merge_layer,
    format_layer_table, summarize_layer, format_layer_summary, layer_notes, torch_header_note)
from .models import (  # noqa: F401
    POLICIES, BN_PASSES, MODEL_VARIANTS, MODEL_VARIANT_KEYS, ModelConfig, ModelVariant,
    activations_after_bn, bn_facts, build_model, format_model_block, format_model_summary,
    format_pair, main_model, model_config_from_args, model_names, model_stats, run_models,
    run_one_model, run_pair, selected_variants, summarize_models)
from .results import (  # noqa: F401
    RESULTS_DIR, result_name, stored_path, write_results, load_runs)
from .results_report import (  # noqa: F401
    blocks, report_text, doc_blocks, replace_blocks, update_docs, main_report)
from .cli import (  # noqa: F401
    main_layer, build_parser, config_from_args, main)
