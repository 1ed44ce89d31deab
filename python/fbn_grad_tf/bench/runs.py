"""The runs of the backward grid (run, and the TF_ENABLE_ONEDNN_OPTS worker subprocess) and of
--layer (run_layer): check each case, warm up, time interleaved."""
import dataclasses
import json
import math
import os
import subprocess
import sys
import tempfile

import tensorflow as tf

from .cases import (
    Config, CorrectnessError, _ITEMSIZE, _cases, _check, _error_text, _layer_check,
    _make_inputs, _relu_check, numpy_reference, op_args, shape_str, short_error, tensor_shape)
from .timing import (
    Progress, _stats, backend_name, configure_threads, onednn_enabled, warm_up_and_time)
from .contestants import (
    LAYER_COLUMNS, LAYER_HEADERS, LAYER_KEYS, _LAYER_OURS, _core_callable, _from_torch_layout,
    _layer_callables, _setup_torch, _tf_callable, _torch_callable, layer_ratio_base,
    ours_forward_support)


def run(config=None, label=None, stream=None):
    """Runs every case of `config` in this process: check, warm up, time interleaved.

    Returns {"meta": {...}, "results": [case, ...]}; each case has shape (NHWC dims),
    tensor_shape, format, dtype, mode, elements, min_bytes, reps, check (relative errors
    and the reference used), and per contestant ("ours", "tf", "torch" when present) either
    {"median_ms", "min_ms", "mean_ms", "samples_ms"} or {"error": message} (n/a).
    """
    config = config or Config()
    threads = configure_threads(config.threads)
    onednn = onednn_enabled()
    backend = backend_name(onednn)
    label = label or backend
    torch, torch_note, torch_why = _setup_torch(config, threads)
    meta = {"tf_version": tf.__version__, "tf_backend": backend, "onednn": onednn,
            "TF_CPU_ALLOCATOR_USE_BFC": os.environ.get("TF_CPU_ALLOCATOR_USE_BFC"),
            "intra_op_threads": threads, "torch": torch_note, "torch_why": torch_why,
            "config": config.to_json()}

    cases = list(_cases(config))
    progress = Progress(label, [math.prod(c[0]) for c in cases], stream=stream,
                        enabled=config.progress)
    results = []
    inputs = None
    key = None
    eps = float(config.epsilon)
    # Each case builds fresh tf.functions (traced once each); TF's "frequent retracing"
    # warning would misfire on them.
    logger = tf.get_logger()
    old_level = logger.level
    logger.setLevel("ERROR")
    try:
        for shape, dtype, fmt, mode in cases:
            case_name = "%s %s %s %s" % (shape_str(tensor_shape(shape, fmt)), fmt, dtype, mode)
            progress.start(case_name)
            if key != (shape, dtype):
                inputs = None  # free the previous tensors first
                inputs = _make_inputs(shape, dtype, config.seed)
                key = (shape, dtype)
            training = mode == "training"
            args = op_args(inputs, fmt, mode)
            entry = _run_case(config, shape, dtype, fmt, mode, training, args, inputs, eps,
                              torch, case_name, threads)
            if torch_why:
                entry["torch"] = {"error": torch_why}
            results.append(entry)
            progress.finish(math.prod(shape))
    finally:
        inputs = None
        logger.setLevel(old_level)
        progress.close()
    return {"meta": meta, "results": results}


def _run_case(config, shape, dtype, fmt, mode, training, args, inputs, eps, torch, case_name,
              threads):
    fns = {"ours": _tf_callable("ours", args, eps, fmt, training),
           "tf": _tf_callable("tf", args, eps, fmt, training),
           "core": _core_callable(args, eps, fmt, training, threads)}
    entry = {"shape": list(shape), "tensor_shape": list(tensor_shape(shape, fmt)),
             "format": fmt, "dtype": dtype, "mode": mode, "elements": math.prod(shape),
             "min_bytes": 3 * math.prod(shape) * _ITEMSIZE[dtype]}
    errors = {}

    # -- correctness: ours against TF (or TF on the NHWC tensors where TF refuses NCHW).
    ours_out = fns["ours"]()
    try:
        ref = fns["tf"]()
        ref_name = "TF FusedBatchNormGradV3 (%s)" % fmt
    except (tf.errors.InvalidArgumentError, tf.errors.UnimplementedError) as e:
        errors["tf"] = short_error(e)
        del fns["tf"]
        ref = None
    if ref is None and fmt == "NCHW":
        try:
            nhwc_args = (inputs["dy"], inputs["x"]) + args[2:]
            r = _tf_callable("tf", nhwc_args, eps, "NHWC", training)()
            ref = (tf.transpose(r[0], [0, 3, 1, 2]), r[1], r[2])
            ref_name = "TF FusedBatchNormGradV3 (NHWC, dx transposed)"
        except tf.errors.OpError:
            ref = None
    if ref is None:
        ref = numpy_reference(*(t.numpy() for t in args[:5]), eps, fmt, training)
        ref_name = "NumPy float64 reference"
    check = {"reference": ref_name,
             "ours": _check("ours", ours_out, ref, dtype, case_name, ref_name),
             "core": _check("ours (core)", fns["core"](), ref, dtype, case_name, ref_name)}
    del ours_out

    if torch is not None:
        try:
            tcall = _torch_callable(torch, (inputs["dy"], inputs["x"]) + args[2:5], fmt,
                                    training, eps)
            tout = tcall()
            tout = (_from_torch_layout(tout[0], fmt == "NHWC"), tout[1].float().numpy(),
                    tout[2].float().numpy())
            check["torch"] = _check("torch", tout, ref, dtype, case_name, ref_name)
            fns["torch"] = tcall
            del tout
        except CorrectnessError as e:  # PyTorch is only a bystander: n/a, not fatal
            errors["torch"] = "outputs differ: %s" % e
            print("warning: PyTorch %s" % errors["torch"], file=sys.stderr)
        except Exception as e:  # an unsupported dtype/format combination: n/a
            errors["torch"] = "%s: %s" % (type(e).__name__, str(e).split("\n")[0][:200])
    del ref

    # -- the ops in a chain of config.chain calls per tf.function (timed per op), where TF
    # ran the single call too. Each chain is traced and run once here, as the check did for
    # the others, so that its tracing is not taken for its time when picking the reps; its
    # last x_backprop must be finite (at most MAX_CHAIN links: see cases.py).
    k = int(config.chain or 0)
    if k > 0:
        for which in ("ours", "tf"):
            if which in fns:
                fn = _tf_callable(which, args, eps, fmt, training, chain=k)
                if not bool(tf.reduce_all(tf.math.is_finite(tf.cast(fn(), tf.float32)))):
                    raise CorrectnessError("%s: --chain %d: %s's last x_backprop is not "
                                           "finite" % (case_name, k, which))
                fns[which + "_chain"] = fn
        entry["chain"] = k

    # -- warm up (every function was traced and run once above).
    reps, samples = warm_up_and_time(fns, config)

    entry["reps"] = reps
    entry["check"] = check
    for name in ("ours", "tf", "core", "torch", "ours_chain", "tf_chain"):
        if name in samples:
            per_op = k if name.endswith("_chain") else 1
            entry[name] = _stats([t / per_op for t in samples[name]])
        elif name in errors:
            entry[name] = {"error": errors[name]}
    return entry


def _run_layer_case(config, shape, dtype, fmt, support, torch, torch_why, case_name):
    eps = float(config.epsilon)
    inputs = _make_inputs(shape, dtype, config.seed)
    c = shape[-1]
    x, dy = x_nhwc, dy_nhwc = inputs["x"], inputs["dy"]
    if fmt == "NCHW":
        x, dy = tf.transpose(x, [0, 3, 1, 2]), tf.transpose(dy, [0, 3, 1, 2])
    scale = inputs["scale"]
    offset = tf.random.stateless_uniform([c], [config.seed, 8], -0.5, 0.5)
    inputs = None
    fns, errors, converters = _layer_callables(x, scale, offset, dy, fmt, dtype, eps, support,
                                               torch, torch_why, x_nhwc, dy_nhwc)
    x_nhwc = dy_nhwc = None
    entry = {"shape": list(shape), "tensor_shape": list(tensor_shape(shape, fmt)),
             "format": fmt, "dtype": dtype, "elements": math.prod(shape)}

    # -- run each once (traces it) and check its outputs: plain BN against TF fused (or the
    # first plain one that ran), the ReLU ones against TF BN+ReLU (unchecked: not timed).
    outs = {}
    for k in list(fns):
        try:
            o = fns[k]()
            outs[k] = converters[k](o) if k in converters else tuple(t.numpy() for t in o)
        except Exception as e:  # refused (dtype, format, a missing kernel): n/a
            errors[k] = _error_text(e)
            del fns[k]
            if k in _LAYER_OURS and not isinstance(e, (tf.errors.OpError, NotImplementedError,
                                                       ValueError, TypeError)):
                raise
    check = {}
    plain = [k for k in ("tf", "tf_ours", "keras", "torch", "ours") if k in outs]
    if not plain:
        raise RuntimeError("--layer: no contestant ran on %s: %s" % (case_name, errors))
    ref_key = plain[0]
    ref = outs[ref_key]
    check["reference"] = LAYER_HEADERS[ref_key]
    check["reference_relu"] = ("y: relu(%s's y); gradients: TF FusedBatchNormGradV3 in "
                               "float32 on dy * (y > 0) with its own y" % LAYER_HEADERS[ref_key])
    for k in list(fns):
        if k == ref_key:
            continue
        try:
            if k in ("ours_relu", "tf_relu"):
                check[k] = _relu_check(LAYER_HEADERS[k], outs[k], ref, x, dy, scale, eps, fmt,
                                       dtype, case_name, LAYER_HEADERS[ref_key])
            else:
                check[k] = _layer_check(LAYER_HEADERS[k], outs[k], ref, dtype, case_name,
                                        LAYER_HEADERS[ref_key])
        except CorrectnessError as e:
            if k in _LAYER_OURS:
                raise
            errors[k] = "outputs differ: %s" % e
            print("warning: %s %s" % (LAYER_HEADERS[k], errors[k]), file=sys.stderr)
            del fns[k]
    outs = ref = None

    # -- warm up, repetitions from the budget, interleaved timing (as the backward cases).
    reps, samples = warm_up_and_time(fns, config)
    entry["reps"] = reps
    entry["check"] = check
    for k in LAYER_KEYS:
        entry[k] = _stats(samples[k]) if k in samples else {"error": errors.get(k, "not run")}
    return entry


def run_layer(config=None, label="layer", stream=None):
    """--layer: times one BN layer training step (forward + backward) per case of `config`
    (shapes x dtypes x formats; training only) for every LAYER_COLUMNS contestant, in this
    process. Returns {"meta": {...}, "results": [case, ...]}; each case has shape,
    tensor_shape, format, dtype, elements, reps, check and, per contestant key, either
    {"median_ms", "min_ms", "mean_ms", "samples_ms"} or {"error": why n/a}."""
    config = config or Config(dtypes=("float32",), formats=("NHWC",))
    threads = configure_threads(config.threads)
    torch, torch_note, torch_why = _setup_torch(config, threads)
    support = ours_forward_support()
    base, relu_base = layer_ratio_base(support)
    meta = {"mode": "layer", "tf_version": tf.__version__,
            "tf_backend": backend_name(onednn_enabled()), "intra_op_threads": threads,
            "torch": torch_note, "torch_why": torch_why, "ours_forward": support,
            "ratio_base": base, "ratio_base_relu": relu_base,
            "columns": {k: d for k, _, d in LAYER_COLUMNS}, "config": config.to_json()}
    cases = [(tuple(s), d, f) for s in config.shapes for d in config.dtypes
             for f in config.formats]
    progress = Progress(label, [math.prod(c[0]) for c in cases], stream=stream,
                        enabled=config.progress)
    results = []
    logger = tf.get_logger()
    old_level = logger.level
    logger.setLevel("ERROR")
    try:
        for shape, dtype, fmt in cases:
            case_name = "%s %s %s layer step" % (shape_str(tensor_shape(shape, fmt)), fmt, dtype)
            progress.start(case_name)
            results.append(_run_layer_case(config, shape, dtype, fmt, support, torch,
                                           torch_why, case_name))
            progress.finish(math.prod(shape))
    finally:
        logger.setLevel(old_level)
        progress.close()
    return {"meta": meta, "results": results}


def run_worker_subprocess(backend, config, timeout=None):
    """Runs this module again with TF's other backend (the env var is read at TF start-up);
    its progress goes to our stderr. Returns its run() result."""
    env = dict(os.environ)
    env["TF_ENABLE_ONEDNN_OPTS"] = "0" if backend == "eigen" else "1"
    if backend == "eigen" and config.eigen_bfc:
        # With oneDNN on, TF allocates on the CPU from a pool; with it off, from malloc, so
        # every large output is fresh pages from the OS (page faults) on every call.
        env["TF_CPU_ALLOCATOR_USE_BFC"] = "true"
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    # python/ (the directory above the fbn_grad_tf package): bench/ -> fbn_grad_tf/ -> python/
    pkg_parent = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env["PYTHONPATH"] = os.pathsep.join([pkg_parent] + [
        p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    wcfg = dataclasses.replace(config, torch=False, chain=0)  # chains: main process only
    fd, path = tempfile.mkstemp(prefix="fbn_bench_%s_" % backend, suffix=".json")
    os.close(fd)
    try:
        cmd = [sys.executable, "-m", "fbn_grad_tf.bench", "--_worker", backend,
               "--_config", json.dumps(wcfg.to_json()), "--json", path]
        try:  # the worker's output goes to our stderr, live where it has a file descriptor
            sys.stderr.flush()
            proc = subprocess.run(cmd, env=env, stdout=sys.stderr.fileno(), timeout=timeout)
        except (AttributeError, ValueError, OSError):  # stderr is not a file (e.g. captured)
            proc = subprocess.run(cmd, env=env, stdout=subprocess.PIPE,
                                  stderr=subprocess.STDOUT, timeout=timeout)
            sys.stderr.write(proc.stdout.decode(errors="replace"))
        if proc.returncode != 0:
            raise RuntimeError("the %s worker (TF_ENABLE_ONEDNN_OPTS=%s) failed with exit "
                               "code %d (see its messages above)"
                               % (backend, env["TF_ENABLE_ONEDNN_OPTS"], proc.returncode))
        with open(path) as f:
            res = json.load(f)
        if res["meta"]["tf_backend"] != backend:
            raise RuntimeError("the %s worker ran with TF backend %s"
                               % (backend, res["meta"]["tf_backend"]))
        return res
    finally:
        os.unlink(path)
