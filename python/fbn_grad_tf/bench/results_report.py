"""``python -m fbn_grad_tf.bench report``: Markdown tables from the stored runs (results.py).

    python -m fbn_grad_tf.bench report                  # print the tables of docs/results/
    python -m fbn_grad_tf.bench report --update-docs    # ... and rewrite the docs' blocks
    python -m fbn_grad_tf.bench report --chart          # ... and docs/results/<kind>/models.png

Per machine kind (the directory docs/results/<slug>/) it makes up to three blocks, each table
headed by a line naming the run it comes from (command, CPU, machine kind, TF, date):

* ``models-<slug>``: one table per models-<policy> run: per model the step times of Keras 3,
  TF fused and ours converted, the step speed-ups of ours converted, and its BN+activation
  cost against TF fused's, from step - floor and (--trace) from the sum of op times;
* ``ops-<slug>``: the backward op per case of the quick run (or else of the full grid), ours
  against TF oneDNN, training and inference, and the geomean over the cases;
* ``grid-<slug>``: the full grid (the ops run) summed up per dtype, format and mode: the
  geomean and the lowest case of TF oneDNN / ours, and our fraction of the bandwidth on the
  large shapes, per call and (--chain) in a chain;
* ``layer-<slug>``: the --layer summary (layer, else layer-quick).

A doc holds a block between the lines ``<!-- BEGIN GENERATED: <name> -->`` and
``<!-- END GENERATED: <name> -->``; --update-docs replaces what is between them in README.md
and docs/*.md, so the numbers in the docs are the stored runs' and are never typed in.
"""
import argparse
import math
import os
import re
import sys

import numpy as np

from .cases import DTYPES, FORMATS, LARGE_ELEMENTS, MODES
from .contestants import LAYER_HEADERS, LAYER_KEYS, _layer_partner
from .model_stats import _bootstrap_ratio
from .results import RESULTS_DIR, load_runs

#: The variants of the models table, in column order.
MODEL_COLUMNS = (("keras", "Keras 3"), ("tf_fused", "TF fused"), ("ours_converted", "ours conv"))
MARKER = re.compile(r"^<!-- (BEGIN|END) GENERATED: (\S+) -->$")
#: The blocks this report makes are named <prefix><machine kind slug>; blocks of other names
#: belong to other generators and are left alone.
BLOCK_PREFIXES = ("models-", "ops-", "grid-", "layer-")
DOC_FILES = ("README.md", os.path.join("docs", "*.md"))


# ---- formatting ----------------------------------------------------------------------------

def _ms(v, fmt="%.1f"):
    return "n/a" if v is None else fmt % v


def _x(point, lo=None, hi=None):
    """'1.23x' or '1.23x [1.10, 1.35]'."""
    if point is None:
        return "n/a"
    if lo is None or hi is None:
        return "%.2fx" % point
    return "%.2fx [%.2f, %.2f]" % (point, lo, hi)


def _table(head, rows, text_cols=1):
    """A Markdown table: the first `text_cols` columns left-aligned, the numbers right."""
    out = ["| " + " | ".join(head) + " |", "|" + "|".join(
        " --- " if i < text_cols else " ---: " for i in range(len(head))) + "|"]
    out += ["| " + " | ".join(r) + " |" for r in rows]
    return out


def run_line(meta):
    """The line over a table: the run's command, CPU, machine kind, ISA, bandwidth, load, TF
    and fbn_grad_tf versions, date."""
    parts = ["`%s`" % meta["command"] if meta.get("command") else "command not recorded",
             "%s, %s cores" % (meta.get("cpu", "CPU not recorded"), meta.get("cores", "?")),
             meta.get("machine_kind", "machine kind not recorded")]
    if meta.get("fbn_grad_tf_isa_path"):
        parts.append("our ISA path %s" % meta["fbn_grad_tf_isa_path"])
    if meta.get("bandwidth_gbs"):
        parts.append("bandwidth %.1f GB/s" % meta["bandwidth_gbs"])
    if meta.get("loadavg_1min_start") is not None and meta.get("loadavg_1min_end") is not None:
        # other work on the machine during the run (the bench itself adds about 1 per core)
        parts.append("load average %.1f at start, %.1f at end" % (
            meta["loadavg_1min_start"], meta["loadavg_1min_end"]))
    parts.append("TF %s" % meta.get("tf_version", "?"))
    if meta.get("fbn_grad_tf_version"):
        parts.append("fbn_grad_tf %s" % meta["fbn_grad_tf_version"])
    parts.append(meta.get("date", "date not recorded"))
    return "Run: " + "; ".join(parts) + "."


# ---- the blocks ----------------------------------------------------------------------------

def _ratio(num, den, meta):
    """median(num) / median(den) with its bootstrap 95% interval (repetitions resampled
    jointly, as the bench's own ratios), or (None, None, None)."""
    if not num or not den or len(num) != len(den):
        return None, None, None
    cfg = meta.get("config", {})
    rng = np.random.default_rng(cfg.get("seed", 1234))
    return _bootstrap_ratio(num, den, cfg.get("bootstrap", 2000), rng)


def model_rows(run):
    """Per model of a models run: {"model", "step_ms": {key: ms}, "speedup_tf", "speedup_keras",
    "cost_act", "trace_act"} (ratios as (point, lo, hi))."""
    meta = run["meta"]
    rows = []
    for res in run["models"]:
        v = res["variants"]
        conv = v.get("ours_converted") or {}

        def samples(k, what=None):
            e = v.get(k) or {}
            if what:
                e = e.get(what) or {}
            return e.get("samples_ms")

        trace = (conv.get("trace") or {}).get("x_bn_act_ops")
        rows.append({
            "model": res["model"],
            "step_ms": {k: (v.get(k) or {}).get("step", {}).get("median_ms")
                        for k, _ in MODEL_COLUMNS},
            "speedup_tf": _ratio(samples("tf_fused"), samples("ours_converted"), meta),
            "speedup_keras": _ratio(samples("keras"), samples("ours_converted"), meta),
            "cost_act": _ratio(samples("ours_converted", "cost_act"),
                               samples("tf_fused", "cost_act"), meta),
            "trace_act": tuple(trace) if trace else (None, None, None)})
    return rows


def models_block(runs):
    """The models-<slug> block's lines: a table per models run (one per policy)."""
    out = []
    for run in sorted(runs, key=lambda r: r["meta"]["config"]["policy"]):
        meta = run["meta"]
        cfg = meta["config"]
        traced = any("trace" in m for m in run["models"])
        # A model of the user's has its own input shape ("input"); the others cfg["size"].
        inputs = sorted({m.get("input") or "%dx%d" % (cfg["size"], cfg["size"])
                         for m in run["models"]})
        out += ["", "**%s**, batch %d, %s images, %d repetitions%s. %s" % (
            cfg["policy"], cfg["batch"], " / ".join(inputs), cfg["reps"],
            " (+ %d profiled steps per BN variant)" % cfg["trace_steps"] if traced else "",
            run_line(meta)), ""]
        rows = []
        for r in model_rows(run):
            rows.append([r["model"]] + [_ms(r["step_ms"][k]) for k, _ in MODEL_COLUMNS] +
                        [_x(*r["speedup_tf"]), _x(*r["speedup_keras"]), _x(*r["cost_act"]),
                         _x(*r["trace_act"])])
        out += _table(["model"] + ["%s ms" % h for _, h in MODEL_COLUMNS] +
                      ["step TF fused / ours conv", "step Keras 3 / ours conv",
                       "BN+act cost ours conv / TF fused (step - floor)",
                       "BN+act op time ours conv / TF fused (trace)"], rows)
    out += ["", "Step times: median ms of one training step. Speed-ups: their step / ours "
            "conv's (>1: ours faster). Cost ratios: ours conv's BN+activation cost / TF fused's "
            "(<1: ours cheaper). Brackets: bootstrap 95% intervals."]
    return out


def _geomean(vals):
    vals = [v for v in vals if v]
    return math.exp(sum(math.log(v) for v in vals) / len(vals)) if vals else None


def _rank(seq, value):
    """The position of `value` in the grid's order `seq` (DTYPES, FORMATS, MODES); a value
    the grid lacks sorts after them."""
    return seq.index(value) if value in seq else len(seq)


def ops_block(run):
    """The ops-<slug> block's lines: per case (shape, format, dtype; grouped by dtype and
    format, shapes in the grid's order) ours ms and TF oneDNN / ours in training and
    inference, and the geomeans."""
    cases, shape_order = {}, {}
    for r in run["results"]:
        shape_order.setdefault(tuple(r["shape"]), len(shape_order))
        key = (r["dtype"], r["format"], tuple(r["shape"]))
        cases.setdefault(key, {})[r["mode"]] = r
    def order(key):
        dtype, fmt, shape = key
        return _rank(DTYPES, dtype), _rank(FORMATS, fmt), shape_order[shape]

    eigen = _eigen_default(run)
    rows, per_mode = [], {"training": [], "inference": []}
    per_mode_eigen = {"training": [], "inference": []}
    for key in sorted(cases, key=order):
        modes = cases[key]
        tensor_shape = next(iter(modes.values()))["tensor_shape"]
        row = ["x".join(map(str, tensor_shape)), key[1], key[0]]
        for mode in ("training", "inference"):
            r = modes.get(mode) or {}
            row += [_ms(r.get("ours_ms"), "%.3f"), _x(r.get("speedup_onednn"))]
            per_mode[mode].append(r.get("speedup_onednn"))
            if eigen:
                row.append(_x(r.get("speedup_eigen")))
                per_mode_eigen[mode].append(r.get("speedup_eigen"))
        rows.append(row)
    every = per_mode["training"] + per_mode["inference"]
    geo = ["geomean, %d cases" % sum(1 for v in every if v), "", ""]
    for mode in ("training", "inference"):
        geo += ["", _x(_geomean(per_mode[mode]))]
        if eigen:
            geo.append(_x(_geomean(per_mode_eigen[mode])))
    rows.append(geo)
    head = ["shape", "format", "dtype"]
    for mode in ("training", "inference"):
        head += ["%s ours ms" % mode, "%s TF oneDNN / ours" % mode]
        if eigen:
            head.append("%s TF Eigen / ours" % mode)
    out = ["", run_line(run["meta"]), ""]
    out += _table(head, rows, text_cols=3)
    out += ["", "Geomean over all cases, training and inference: %s. Ratios: TF oneDNN's "
            "median ms / ours (>1: ours faster), same process, interleaved." % _x(_geomean(every))]
    if eigen:
        out += ["", EIGEN_NOTE % _x(_geomean(per_mode_eigen["training"] +
                                             per_mode_eigen["inference"]))]
    return out


# Where the CPU lacks AVX-512 VNNI/BF16, AVX-VNNI and AMX, TF runs its Eigen kernels by
# default (oneDNN off, and a non-pooling allocator); the bench then times oneDNN in a worker
# process (TF_ENABLE_ONEDNN_OPTS=1) and the blocks show both.
EIGEN_NOTE = ("TF's default on this CPU is its Eigen kernels (TF turns oneDNN on by default "
              "only where the CPU has AVX-512 VNNI or BF16, AVX-VNNI or AMX): TF Eigen / "
              "ours, geomean %s, compares with what TF users get here; TF oneDNN "
              "(TF_ENABLE_ONEDNN_OPTS=1) ran in a worker process, against ours in that "
              "process. \"ours ms\": this process's, on TF's default (non-pooling) "
              "allocator, whose fresh outputs page-fault.")


def _eigen_default(run):
    """Whether the run's main process ran TF's Eigen kernels (TF's default where oneDNN is
    off), so that the blocks also show TF Eigen / ours."""
    return run["meta"].get("tf_backend_main") == "eigen" and any(
        r.get("speedup_eigen") for r in run["results"])


def _pct(v):
    return "n/a" if v is None else "%.0f%%" % (100 * v)


def _speedups(rs, key):
    """The `key` speed-ups of the cases that have one, their geomean and the lowest with its
    shape, as table cells ("n/a" where none ran)."""
    ran = [r for r in rs if r.get(key)]
    if not ran:
        return [], "n/a", "n/a"
    low = min(ran, key=lambda r: r[key])
    return ([r[key] for r in ran], _x(_geomean([r[key] for r in ran])),
            "%s (%s)" % (_x(low[key]), "x".join(map(str, low["tensor_shape"]))))


def grid_block(run):
    """The grid-<slug> block's lines: the full grid per dtype, format and mode (training
    first): cases TF oneDNN ran, the geomean and the lowest of TF oneDNN / ours (with its
    shape), and on the large shapes (LARGE_ELEMENTS) our median and lowest fraction of the
    bandwidth per call and, if the run had --chain, the median in the chain."""
    groups = {}
    for r in run["results"]:
        groups.setdefault((r["dtype"], r["format"], r["mode"]), []).append(r)

    def order(key):
        dtype, fmt, mode = key
        return _rank(DTYPES, dtype), _rank(FORMATS, fmt), _rank(MODES, mode)

    chained = any(r.get("chain_bw_fraction") for r in run["results"])
    eigen = _eigen_default(run)
    rows, every, every_eigen = [], [], []
    for key in sorted(groups, key=order):
        rs = groups[key]
        ran, geo, lowest = _speedups(rs, "speedup_onednn")
        every += ran
        large = [r for r in rs if r.get("elements", 0) >= LARGE_ELEMENTS]
        bw = [r["bw_fraction"] for r in large if r.get("bw_fraction")]
        row = [key[0], key[1], key[2], str(len(ran)), geo, lowest,
               _pct(float(np.median(bw)) if bw else None), _pct(min(bw) if bw else None)]
        if chained:
            cbw = [r["chain_bw_fraction"] for r in large if r.get("chain_bw_fraction")]
            row.append(_pct(float(np.median(cbw)) if cbw else None))
        if eigen:
            ran_e, geo_e, lowest_e = _speedups(rs, "speedup_eigen")
            every_eigen += ran_e
            row += [geo_e, lowest_e]
        rows.append(row)
    head = ["dtype", "format", "mode", "cases", "TF oneDNN / ours, geomean", "lowest (shape)",
            "%BW large, median", "%BW large, lowest"] + (["%BW(c) large, median"] if chained
                                                         else [])
    if eigen:
        head += ["TF Eigen / ours, geomean", "lowest vs Eigen (shape)"]
    out = ["", run_line(run["meta"]), ""]
    out += _table(head, rows, text_cols=3)
    out += ["", "All %d cases TF oneDNN ran: geomean %s. Ratios: TF oneDNN's median ms / ours "
            "(>1: ours faster), same process, interleaved; cases: those TF oneDNN ran (it "
            "refuses some inference cases in NCHW). %%BW: 3 x elements x itemsize / our time "
            "over the run's bandwidth, on shapes of %s+ elements; a two-pass training backward "
            "from memory reaches at most about 60%%; above that, the tensors stayed in the "
            "last-level cache between the passes." % (len(every), _x(_geomean(every)),
                                                      "{:,}".format(LARGE_ELEMENTS))]
    if eigen:
        out += ["", EIGEN_NOTE % _x(_geomean(every_eigen))]
    return out


def layer_block(run):
    """The layer-<slug> block's lines: the --layer summary (median over shapes of each
    contestant's ms / its partner's)."""
    meta = run["meta"]
    base, relu_base = meta["ratio_base"], meta["ratio_base_relu"]
    keys = [k for k in LAYER_KEYS if _layer_partner(k, base, relu_base) is not None]
    rows = []
    for g in run["summary"]["speedups"]:
        rows.append([g["dtype"], g["format"], str(max(g.get(k + "_n", 0) for k in keys))] +
                    [_x(g.get(k)) for k in keys])
    out = ["", run_line(meta), ""]
    out += _table(["dtype", "format", "shapes"] + ["%s / %s" % (
        LAYER_HEADERS[k], LAYER_HEADERS[_layer_partner(k, base, relu_base)]) for k in keys], rows,
        text_cols=2)
    out += ["", "Median over the shapes of one BN layer training step's ms (forward + backward) "
            "of that contestant / ours (>1: ours faster)."]
    return out


def _latest(runs, name):
    sel = [r for r in runs if r["meta"].get("result_name") == name]
    return max(sel, key=lambda r: r["meta"].get("date", "")) if sel else None


def kinds(runs):
    """{slug: (machine kind, [runs])}, in slug order."""
    out = {}
    for r in runs:
        m = r["meta"]
        slug = m.get("machine_slug") or os.path.basename(os.path.dirname(r["path"]))
        out.setdefault(slug, (m.get("machine_kind", slug), []))[1].append(r)
    return dict(sorted(out.items()))


def blocks(runs):
    """{block name: its Markdown text} for every machine kind of `runs`."""
    out = {}
    for slug, (_, rs) in kinds(runs).items():
        hint = ("<!-- made by `python -m fbn_grad_tf.bench report --update-docs` from "
                "docs/results/%s/: rerun the bench with --store instead of editing -->" % slug)
        models = [r for r in rs if (r["meta"].get("result_name") or "").startswith("models-")]
        ops = _latest(rs, "quick") or _latest(rs, "ops")
        grid = _latest(rs, "ops")
        layer = _latest(rs, "layer") or _latest(rs, "layer-quick")
        for prefix, lines in (("models", models and models_block(models)),
                              ("ops", ops and ops_block(ops)),
                              ("grid", grid and grid_block(grid)),
                              ("layer", layer and layer_block(layer))):
            if lines:
                out["%s-%s" % (prefix, slug)] = "\n".join([hint] + lines)
    return out


def report_text(runs):
    """Everything, per machine kind: a heading and each block under its name."""
    out = []
    gen = blocks(runs)
    for slug, (kind, _) in kinds(runs).items():
        out += ["## %s" % kind, ""]
        for prefix in ("models", "ops", "grid", "layer"):
            name = "%s-%s" % (prefix, slug)
            if name in gen:
                out += ["### %s" % name, gen[name], ""]
    return "\n".join(out)


# ---- the docs' GENERATED blocks --------------------------------------------------------------

def doc_blocks(text):
    """[(name, content)] of the GENERATED blocks in `text`; content is the lines between the
    markers. Raises ValueError on an unmatched or nested marker."""
    found, name, lines = [], None, []
    for i, line in enumerate(text.split("\n"), 1):
        m = MARKER.match(line.strip())
        if not m:
            if name is not None:
                lines.append(line)
            continue
        what, n = m.groups()
        if what == "BEGIN":
            if name is not None:
                raise ValueError("line %d: BEGIN GENERATED: %s inside block %s" % (i, n, name))
            name, lines = n, []
        else:
            if n != name:
                raise ValueError("line %d: END GENERATED: %s without its BEGIN" % (i, n))
            found.append((name, "\n".join(lines)))
            name = None
    if name is not None:
        raise ValueError("BEGIN GENERATED: %s has no END" % name)
    return found


def replace_blocks(text, generated):
    """`text` with every GENERATED block whose name is in `generated` replaced; returns
    (new text, names replaced, names in the text that `generated` lacks)."""
    doc_blocks(text)  # raises on broken markers
    out, name, done, unknown = [], None, [], []
    for line in text.split("\n"):
        m = MARKER.match(line.strip())
        if m and m.group(1) == "BEGIN":
            name = m.group(2)
            out.append(line)
            if name in generated:
                out.append(generated[name])
                done.append(name)
            else:
                unknown.append(name)
            continue
        if m and m.group(1) == "END":
            name = None
        if name is None or name not in generated:
            out.append(line)
    return "\n".join(out), done, unknown


def doc_files(root="."):
    import glob
    return [p for pattern in DOC_FILES for p in sorted(glob.glob(os.path.join(root, pattern)))]


def ours(name):
    """Whether a GENERATED block of this name is this report's to make."""
    return name.startswith(BLOCK_PREFIXES)


def update_docs(generated, root="."):
    """Rewrites the GENERATED blocks of README.md and docs/*.md under `root` that `generated`
    has. Returns (files changed, names placed, names of this report's blocks in the docs with
    nothing generated)."""
    changed, placed, unknown = [], set(), set()
    for path in doc_files(root):
        with open(path) as f:
            text = f.read()
        new, done, missing = replace_blocks(text, generated)
        placed.update(done)
        unknown.update(n for n in missing if ours(n))
        if new != text:
            with open(path, "w") as f:
                f.write(new)
            changed.append(path)
    return changed, placed, unknown


# ---- the chart -----------------------------------------------------------------------------

MATPLOTLIB_HINT = "matplotlib is not installed: pip install matplotlib (only --chart needs it)"


def chart(runs, path, kind):
    """A bar chart of step time per model and policy (Keras 3, TF fused, ours conv; whiskers:
    the interquartile range) of one machine kind's models runs, written to `path`. Returns an
    error message instead of raising when matplotlib is missing."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return MATPLOTLIB_HINT
    groups = []
    for run in sorted(runs, key=lambda r: r["meta"]["config"]["policy"]):
        for res in run["models"]:
            steps = {k: (res["variants"].get(k) or {}).get("step") for k, _ in MODEL_COLUMNS}
            groups.append(("%s\n%s" % (res["model"], res["policy"]), steps))
    fig, ax = plt.subplots(figsize=(max(6, 1.6 * len(groups) + 1.5), 4.2))
    xs = np.arange(len(groups))
    w = 0.8 / len(MODEL_COLUMNS)
    for i, (k, header) in enumerate(MODEL_COLUMNS):
        med = np.array([g[1][k]["median_ms"] if g[1][k] else np.nan for g in groups])
        lo = np.array([g[1][k]["median_ms"] - g[1][k]["q25_ms"] if g[1][k] else 0 for g in groups])
        hi = np.array([g[1][k]["q75_ms"] - g[1][k]["median_ms"] if g[1][k] else 0 for g in groups])
        pos = xs + (i - (len(MODEL_COLUMNS) - 1) / 2) * w
        ax.bar(pos, med, w, yerr=[lo, hi], capsize=2, label=header)
        for x, v, top in zip(pos, med, med + hi):  # the median over its whisker
            if np.isfinite(v):
                ax.text(x, top, "%.0f" % v, ha="center", va="bottom", fontsize=7)
    ax.set_xticks(xs)
    ax.set_xticklabels([g[0] for g in groups], fontsize=8)
    ax.set_ylabel("training step, ms (median; whiskers: IQR)")
    ax.set_title("Whole-model training step, lower is better: %s\n%s" % (
        kind, ", ".join(sorted({r["meta"].get("date", "?")[:10] for r in runs}))), fontsize=9)
    ax.legend(fontsize=8)
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return None


# ---- the command ---------------------------------------------------------------------------

def build_report_parser():
    p = argparse.ArgumentParser(
        prog="python -m fbn_grad_tf.bench report",
        description="Markdown tables per machine kind from the stored runs (--store), headed "
                    "by the run they come from; optionally written into the docs' GENERATED "
                    "blocks and drawn as a chart.")
    p.add_argument("paths", nargs="*", default=[RESULTS_DIR],
                   help="stored runs: JSON files or directories (default %s)" % RESULTS_DIR)
    p.add_argument("--update-docs", action="store_true",
                   help="rewrite the blocks between '<!-- BEGIN GENERATED: <name> -->' and "
                        "'<!-- END GENERATED: <name> -->' in README.md and docs/*.md")
    p.add_argument("--root", default=".", help="the repository root for --update-docs "
                   "(default: the current directory)")
    p.add_argument("--chart", action="store_true",
                   help="draw each machine kind's step times per model to models.png "
                        "beside that kind's models runs (<results>/<kind>/models.png for "
                        "stored runs; needs matplotlib)")
    return p


def main_report(argv=None):
    args = build_report_parser().parse_args(argv)
    try:
        runs = load_runs(args.paths)
    except ValueError as e:
        print("error: %s" % e, file=sys.stderr)
        return 1
    if not runs:
        print("no stored runs under %s (run the bench with --store)" % ", ".join(args.paths),
              file=sys.stderr)
        return 1
    print(report_text(runs))
    rc = 0
    if args.update_docs:
        if not doc_files(args.root):
            print("error: --update-docs: no README.md or docs/*.md under %s (give the "
                  "repository root with --root)" % os.path.abspath(args.root), file=sys.stderr)
            return 1
        generated = blocks(runs)
        changed, placed, unknown = update_docs(generated, args.root)
        for path in changed:
            print("updated %s" % path, file=sys.stderr)
        for name in sorted(set(generated) - placed):
            print("note: block %s is in no doc (add its markers where it belongs)" % name,
                  file=sys.stderr)
        for name in sorted(unknown):
            print("error: the docs have a block %s that no stored run makes" % name,
                  file=sys.stderr)
            rc = 1
    if args.chart:
        for slug, (kind, rs) in kinds(runs).items():
            models = [r for r in rs if "models" in r]
            if not models:
                continue
            # Beside the runs it is drawn from: <results>/<kind>/ for stored runs.
            path = os.path.join(os.path.dirname(models[0]["path"]), "models.png")
            msg = chart(models, path, kind)
            if msg:
                print(msg, file=sys.stderr)
                return rc or 1
            print("chart written to %s" % path, file=sys.stderr)
    return rc
