"""Results to rows, tables, summaries and the plot (backward grid and --layer)."""
import math
import statistics

import numpy as np

from .cases import DTYPES, FORMATS, LARGE_ELEMENTS, MID_ELEMENTS, MODES, _SHORT_MODE, shape_str
from .contestants import (
    LAYER_HEADERS, LAYER_KEYS, TORCH_INSTALL_HINT, TORCH_MISSING, _layer_partner)


# ---- merging, table, summary ---------------------------------------------------------------

def _case_key(r):
    return (tuple(r["shape"]), r["format"], r["dtype"], r["mode"])


def _ms(d):
    return None if d is None or "median_ms" not in d else d["median_ms"]


def _ratio(num, den):
    return None if num is None or den is None or den <= 0 else num / den


def merge(main_res, other_res=None, bandwidth=None):
    """Merges the main process's results with the other TF backend's worker results.

    Flattened per case: ours_ms (main process), tf_onednn_ms, tf_eigen_ms, core_ms (our
    kernels through the framework-free core), torch_ms, speedup_onednn/eigen/torch (their
    ms / ours ms from the same process), speedup_torch_core (torch ms / core ms), gbps (our
    effective bandwidth on 3 * elements * itemsize bytes) and bw_fraction, torch_gbps and
    torch_bw_fraction (the same for PyTorch's time).
    """
    main_backend = main_res["meta"]["tf_backend"]
    other = {}
    if other_res is not None:
        other = {_case_key(r): r for r in other_res["results"]}
    bw = bandwidth["bandwidth"] if bandwidth else None
    rows = []
    for r in main_res["results"]:
        o = other.get(_case_key(r))
        row = {k: r[k] for k in ("shape", "tensor_shape", "format", "dtype", "mode",
                                 "elements", "min_bytes", "reps")}
        ours = _ms(r.get("ours"))
        row["ours_ms"] = ours
        per_backend = {main_backend: (r, ours)}
        if o is not None:
            per_backend[other_res["meta"]["tf_backend"]] = (o, _ms(o.get("ours")))
        for b in ("onednn", "eigen"):
            src, ours_b = per_backend.get(b, (None, None))
            tf_ms = _ms(src.get("tf")) if src else None
            row["tf_%s_ms" % b] = tf_ms
            row["speedup_%s" % b] = _ratio(tf_ms, ours_b)
            row["tf_%s_error" % b] = (src.get("tf") or {}).get("error") if src else "not run"
            row["ours_ms_%s_run" % b] = ours_b
        row["core_ms"] = _ms(r.get("core"))
        row["torch_ms"] = _ms(r.get("torch"))
        row["speedup_torch"] = _ratio(row["torch_ms"], ours)
        row["speedup_torch_core"] = _ratio(row["torch_ms"], row["core_ms"])
        row["torch_error"] = (r.get("torch") or {}).get("error")
        row["gbps"] = r["min_bytes"] / (ours * 1e-3) / 1e9 if ours else None
        row["bw_fraction"] = row["gbps"] / bw if row["gbps"] and bw else None
        tms = row["torch_ms"]
        row["torch_gbps"] = r["min_bytes"] / (tms * 1e-3) / 1e9 if tms else None
        row["torch_bw_fraction"] = (row["torch_gbps"] / bw if row["torch_gbps"] and bw
                                    else None)
        # --chain: each op k times in a row in one tf.function (per-op ms, main process).
        row["chain"] = r.get("chain")
        row["ours_chain_ms"] = _ms(r.get("ours_chain"))
        row["tf_chain_ms"] = _ms(r.get("tf_chain"))
        row["speedup_chain"] = _ratio(row["tf_chain_ms"], row["ours_chain_ms"])
        cms = row["ours_chain_ms"]
        row["chain_gbps"] = r["min_bytes"] / (cms * 1e-3) / 1e9 if cms else None
        row["chain_bw_fraction"] = (row["chain_gbps"] / bw if row["chain_gbps"] and bw
                                    else None)
        row["check"] = {"main": r["check"], "other": o["check"] if o else None}
        row["raw"] = {"main": r, "other": o}
        rows.append(row)
    return rows


def _sorted(rows):
    """Grouped by dtype and format; shapes in run order (the grid's), training first."""
    order = {}
    for r in rows:
        order.setdefault(tuple(r["shape"]), len(order))
    return sorted(rows, key=lambda r: (
        DTYPES.index(r["dtype"]) if r["dtype"] in DTYPES else 9,
        FORMATS.index(r["format"]), order[tuple(r["shape"])], MODES.index(r["mode"])))


def _f(v, fmt="%.2f", na="n/a"):
    return na if v is None else fmt % v


def format_table(rows, have_torch=False):
    cols = [("shape", "<", 15), ("fmt", "<", 4), ("dtype", "<", 8), ("mode", "<", 5),
            ("ours ms", ">", 8), ("TF-oneDNN", ">", 9), ("x", ">", 6),
            ("ours(E)", ">", 8), ("TF-Eigen", ">", 9), ("x", ">", 6)]
    cols += [("GB/s", ">", 6), ("%BW", ">", 5), ("core ms", ">", 8)]
    have_chain = any(r.get("ours_chain_ms") is not None for r in rows)
    if have_chain:
        cols += [("chain ms", ">", 8), ("x(c)", ">", 6), ("%BW(c)", ">", 6)]
    if have_torch:
        cols += [("torch ms", ">", 9), ("x", ">", 6), ("xc", ">", 6), ("t%BW", ">", 5)]
    cols += [("reps", ">", 4)]
    def line(vals):
        return "  ".join(("{:%s%d}" % (a, w)).format(v) for (_, a, w), v in zip(cols, vals))
    out = [line([c[0] for c in cols]), line(["-" * c[2] for c in cols])]
    prev = None
    for r in _sorted(rows):
        grp = (r["dtype"], r["format"])
        if prev is not None and grp != prev:
            out.append("")
        prev = grp
        vals = [shape_str(r["tensor_shape"]), r["format"], r["dtype"],
                _SHORT_MODE[r["mode"]], _f(r["ours_ms"], "%.3f"),
                _f(r["tf_onednn_ms"], "%.3f"), _f(r["speedup_onednn"], "%.2fx"),
                _f(r["ours_ms_eigen_run"], "%.3f"), _f(r["tf_eigen_ms"], "%.3f"),
                _f(r["speedup_eigen"], "%.2fx")]
        vals += [_f(r["gbps"], "%.1f"), _f(r["bw_fraction"] and 100 * r["bw_fraction"], "%.0f%%"),
                 _f(r.get("core_ms"), "%.3f")]
        if have_chain:
            vals += [_f(r.get("ours_chain_ms"), "%.3f"), _f(r.get("speedup_chain"), "%.2fx"),
                     _f(r.get("chain_bw_fraction") and 100 * r["chain_bw_fraction"],
                        "%.0f%%")]
        if have_torch:
            vals += [_f(r["torch_ms"], "%.3f"), _f(r["speedup_torch"], "%.2fx"),
                     _f(r.get("speedup_torch_core"), "%.2fx"),
                     _f(r.get("torch_bw_fraction") and 100 * r["torch_bw_fraction"], "%.0f%%")]
        vals += [str(r["reps"])]
        out.append(line(vals))
    return "\n".join(out)


def _median(vals):
    vals = [v for v in vals if v is not None]
    return (statistics.median(vals), len(vals)) if vals else (None, 0)


SUMMARY_GROUPS = (("float32 NHWC", ("float32",), "NHWC"),
                  ("float32 NCHW", ("float32",), "NCHW"),
                  ("bf16+f16 NHWC", ("bfloat16", "float16"), "NHWC"),
                  ("bf16+f16 NCHW", ("bfloat16", "float16"), "NCHW"),
                  ("bfloat16 (both)", ("bfloat16",), None),
                  ("float16 (both)", ("float16",), None),
                  ("all cases", DTYPES, None))


def _fraction_table(rows, min_elements, field):
    """Per dtype, the median of `field` (a fraction of the bandwidth) per mode and format
    over the rows of at least min_elements that have it."""
    table = []
    for dtype in DTYPES:
        sel = [r for r in rows if r["dtype"] == dtype and r["elements"] >= min_elements
               and r.get(field)]
        if not sel:
            continue
        g = {"dtype": dtype}
        for mode in MODES:
            for fmt in FORMATS:
                g["%s_%s" % (mode, fmt)], _ = _median(
                    r[field] for r in sel if r["mode"] == mode and r["format"] == fmt)
        table.append(g)
    return table


def _format_fraction_table(table):
    out = ["%-10s  %9s %9s %9s %9s" % ("dtype", "trainNHWC", "trainNCHW", "inferNHWC",
                                       "inferNCHW")]
    for g in table:
        cells = [_f(g["%s_%s" % (m, f)] and 100 * g["%s_%s" % (m, f)], "%.0f%%")
                 for m in MODES for f in FORMATS]
        out.append("%-10s  %9s %9s %9s %9s" % (g["dtype"], *cells))
    return out


def summarize(rows, have_torch=False):
    """Median speed-ups per group and mode, and our fraction of bandwidth on large shapes."""
    targets = ["onednn", "eigen"] + (["torch", "torch_core"] if have_torch else [])
    speedups = []
    for name, dtypes, fmt in SUMMARY_GROUPS:
        sel = [r for r in rows if r["dtype"] in dtypes and (fmt is None or r["format"] == fmt)]
        if not sel:
            continue
        g = {"group": name}
        for t in targets:
            for mode in MODES:
                m, n = _median(r.get("speedup_" + t) for r in sel if r["mode"] == mode)
                g["%s_%s" % (t, mode)] = m
                g["%s_%s_n" % (t, mode)] = n
        speedups.append(g)
    bw_rows = _fraction_table(rows, LARGE_ELEMENTS, "bw_fraction")
    chain_rows = _fraction_table(rows, MID_ELEMENTS, "chain_bw_fraction")
    return {"speedups": speedups, "bandwidth_fraction_large": bw_rows,
            "large_elements": LARGE_ELEMENTS, "chain_bandwidth_fraction": chain_rows,
            "mid_elements": MID_ELEMENTS}


def format_summary(summary, bandwidth=None, have_torch=False):
    targets = [("onednn", "vs TF oneDNN"), ("eigen", "vs TF Eigen")]
    if have_torch:
        targets += [("torch", "vs PyTorch"), ("torch_core", "PyTorch vs core")]
    out = ["Summary: median speed-up over shapes (their ms / ours ms; >1 = ours faster)"]
    head = "%-17s" % "" + "".join("  %-17s" % t[1] for t in targets)
    sub = "%-17s" % "group" + "".join("  %8s %8s" % ("train", "infer") for _ in targets)
    out += [head, sub]
    for g in summary["speedups"]:
        cells = []
        for t, _ in targets:
            for mode in MODES:
                v = g["%s_%s" % (t, mode)]
                cells.append(_f(v, "%.2fx"))
        out.append("%-17s" % g["group"] + "".join(
            "  %8s %8s" % (cells[2 * i], cells[2 * i + 1]) for i in range(len(targets))))
    if bandwidth:
        out.append("")
        out.append("Memory bandwidth (GB/s, best of %d runs on %d MiB arrays, %d threads): "
                   "numpy copy %.1f, numpy triad %.1f, TF x*s %.1f, TF x*s+y%s %.1f"
                   % (bandwidth.get("repeats", 5), bandwidth["array_mib"], bandwidth["threads"],
                      bandwidth["numpy_copy"], bandwidth["numpy_triad"],
                      bandwidth["tf_scale"], " (XLA)" if bandwidth.get("tf_triad_fused")
                      else "", bandwidth["tf_triad"]))
        readings = bandwidth.get("readings_gbs") or []
        out.append("  copy %.1f, triad %.1f -> bandwidth = %.1f GB/s%s"
                   % (bandwidth["copy"], bandwidth["triad"], bandwidth["bandwidth"],
                      " (best of the readings at the run's start and end: %s)"
                      % " and ".join("%.1f" % r for r in readings) if len(readings) > 1
                      else ""))
    if summary["bandwidth_fraction_large"]:
        out.append("Our effective bandwidth (3 x elements x itemsize / time) as a fraction of "
                   "it, median over large shapes (>= %dM elements):" %
                   (summary["large_elements"] // 1_000_000))
        out += _format_fraction_table(summary["bandwidth_fraction_large"])
    if summary.get("chain_bandwidth_fraction"):
        out.append("The same for the op inside a graph (--chain: each op run k times in a row in "
                   "one tf.function, one dispatch shared by the k), median over shapes >= %dM "
                   "elements:" % (summary["mid_elements"] // 1_000_000))
        out += _format_fraction_table(summary["chain_bandwidth_fraction"])
    return "\n".join(out)


def _leading_digit(v):
    return int(round(v / 10 ** math.floor(math.log10(v)))) if v > 0 else 0


def _tick_label(v, _=None):
    return "%gx" % v


def plot(rows, path, have_torch=False):
    """Bar chart of speed-ups (log scale), one panel per dtype. Returns an error message
    instead of raising when matplotlib is missing."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        import matplotlib.ticker  # noqa: F401
    except ImportError:
        return ("--plot: matplotlib is not importable in this environment (pip install "
                "matplotlib); no plot written to %s" % path)
    targets = [("speedup_onednn", "vs TF oneDNN"), ("speedup_eigen", "vs TF Eigen")]
    if have_torch:
        targets.append(("speedup_torch", "vs PyTorch"))
    dtypes = [d for d in DTYPES if any(r["dtype"] == d for r in rows)]
    fig, axes = plt.subplots(len(dtypes), 1, figsize=(max(8, 0.42 * len(rows) / max(
        len(dtypes), 1) + 3), 3.6 * len(dtypes)), squeeze=False)
    for ax, dtype in zip(axes[:, 0], dtypes):
        sel = _sorted([r for r in rows if r["dtype"] == dtype])
        xs = np.arange(len(sel))
        w = 0.8 / len(targets)
        for i, (key, name) in enumerate(targets):
            vals = [r[key] if r[key] is not None else np.nan for r in sel]
            ax.bar(xs + (i - (len(targets) - 1) / 2) * w, vals, w, label=name)
            for x, v in zip(xs, vals):
                if np.isnan(v):
                    ax.text(x + (i - (len(targets) - 1) / 2) * w, 1.0, "n/a", rotation=90,
                            ha="center", va="bottom", fontsize=6, color="0.4")
        ax.axhline(1.0, color="k", lw=0.8)
        ax.set_yscale("log")
        ax.yaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(_tick_label))
        ax.yaxis.set_minor_formatter(matplotlib.ticker.FuncFormatter(
            lambda v, _: _tick_label(v) if _leading_digit(v) in (2, 3, 5) else ""))
        ax.tick_params(axis="y", which="minor", labelsize=6)
        ax.set_ylabel("speed-up (their ms / our ms)")
        ax.set_title(dtype)
        ax.set_xticks(xs)
        ax.set_xticklabels(["%s %s %s" % (shape_str(r["tensor_shape"]), r["format"],
                                          _SHORT_MODE[r["mode"]]) for r in sel],
                           rotation=60, ha="right", fontsize=7)
        ax.legend(fontsize=8)
        ax.grid(axis="y", which="both", alpha=0.3)
    fig.suptitle("fbn_grad_tf speed-up over TF FusedBatchNormGradV3%s (>1: ours faster)"
                 % (" and PyTorch" if have_torch else ""), fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return None


def merge_layer(res):
    """Flattened --layer rows: <key>_ms and <key>_error per contestant, x_<key> (its ms / its
    partner's ms: >1 = ours faster) and the partner's key in partner_<key>."""
    base, relu_base = res["meta"]["ratio_base"], res["meta"]["ratio_base_relu"]
    rows = []
    for r in res["results"]:
        row = {k: r[k] for k in ("shape", "tensor_shape", "format", "dtype", "elements",
                                 "reps", "check")}
        for k in LAYER_KEYS:
            row[k + "_ms"] = _ms(r.get(k))
            row[k + "_error"] = (r.get(k) or {}).get("error")
        for k in LAYER_KEYS:
            p = _layer_partner(k, base, relu_base)
            if p is not None:
                row["partner_" + k] = p
                row["x_" + k] = _ratio(row[k + "_ms"], row[p + "_ms"])
        row["raw"] = r
        rows.append(row)
    return rows


def format_layer_table(rows, meta):
    base, relu_base = meta["ratio_base"], meta["ratio_base_relu"]
    cols = [("shape", "<", 15), ("fmt", "<", 4), ("dtype", "<", 8)]
    keys = []
    for k in LAYER_KEYS:
        cols.append((LAYER_HEADERS[k], ">", max(9, len(LAYER_HEADERS[k]))))
        keys.append((k, "ms"))
        if _layer_partner(k, base, relu_base) is not None:
            cols.append(("x", ">", 6))
            keys.append((k, "x"))
    cols.append(("reps", ">", 4))

    def line(vals):
        return "  ".join(("{:%s%d}" % (a, w)).format(v) for (_, a, w), v in zip(cols, vals))

    out = [line([c[0] for c in cols]), line(["-" * c[2] for c in cols])]
    for r in sorted(rows, key=lambda r: (DTYPES.index(r["dtype"]), FORMATS.index(r["format"]))):
        vals = [shape_str(r["tensor_shape"]), r["format"], r["dtype"]]
        for k, what in keys:
            vals.append(_f(r[k + "_ms"], "%.3f") if what == "ms" else _f(r["x_" + k], "%.2fx"))
        vals.append(str(r["reps"]))
        out.append(line(vals))
    return "\n".join(out)


def summarize_layer(rows, meta):
    """Median x per (dtype, format) group and contestant over shapes."""
    base, relu_base = meta["ratio_base"], meta["ratio_base_relu"]
    groups = []
    for dtype in DTYPES:
        for fmt in FORMATS:
            sel = [r for r in rows if r["dtype"] == dtype and r["format"] == fmt]
            if not sel:
                continue
            g = {"dtype": dtype, "format": fmt}
            for k in LAYER_KEYS:
                if _layer_partner(k, base, relu_base) is not None:
                    g[k], g[k + "_n"] = _median(r["x_" + k] for r in sel)
            groups.append(g)
    return {"speedups": groups}


def format_layer_summary(summary, meta):
    base, relu_base = meta["ratio_base"], meta["ratio_base_relu"]
    keys = [k for k in LAYER_KEYS if _layer_partner(k, base, relu_base) is not None]
    out = ["Summary: median over shapes of their ms / %s ms (%s: / %s ms); >1 = ours faster"
           % (LAYER_HEADERS[base], LAYER_HEADERS["tf_relu"], LAYER_HEADERS[relu_base])]
    out.append("%-16s" % "group" + "".join("  %10s" % LAYER_HEADERS[k] for k in keys))
    for g in summary["speedups"]:
        out.append("%-16s" % ("%s %s" % (g["dtype"], g["format"])) +
                   "".join("  %10s" % _f(g[k], "%.2fx") for k in keys))
    return "\n".join(out)


def layer_notes(rows):
    """Sorted 'header: n/a (why)' lines, one per contestant and distinct reason."""
    notes = []
    for k in LAYER_KEYS:
        for why in sorted({r[k + "_error"] for r in rows if r[k + "_error"]}):
            notes.append("%s: n/a (%s)" % (LAYER_HEADERS[k], why))
    return notes


def torch_header_note(meta, threads):
    """The line above the table that says what the PyTorch columns are, or why they are n/a."""
    why = meta.get("torch_why")
    core = ("core ms = our kernels called through fbn_grad_tf.core.bn_grad on NumPy copies of "
            "the same tensors (a direct call from Python, no TF graph dispatch)")
    if why:
        return "%s\ntorch ms, x, xc, t%%BW: n/a (%s)%s" % (
            core, why, "; %s" % TORCH_INSTALL_HINT if why == TORCH_MISSING else "")
    return ("%s\ntorch ms = torch.ops.aten.native_batch_norm_backward, eager, %s; NHWC as "
            "channels_last, NCHW contiguous, converted once; x = torch ms / ours ms (our TF op, "
            "which pays TF's graph dispatch); xc = torch ms / core ms (kernel against kernel, "
            "neither pays a graph runtime); t%%BW = PyTorch's effective bandwidth / the same "
            "bandwidth" % (core, meta.get("torch")))
