"""--model's report: the per-model table, the trace notes under it, the summary rows and their
table, the pair row and the legend (plain text, as printed by main_model)."""
from .cases import shape_str
from .model_runs import BN_PASSES
from .model_stats import TRACE_RATIO_BASE
from .model_variants import MODEL_VARIANT_KEYS, MODEL_VARIANTS, RATIO_BASE

def _f(v, fmt="%.1f", na="n/a"):
    return na if v is None else fmt % v


def _x(r):
    """'1.23x [1.10..1.35]' from a (point, lo, hi) ratio."""
    if not r or r[0] is None:
        return "n/a"
    if r[1] is None:
        return "%.2fx" % r[0]
    return "%.2fx [%.2f..%.2f]" % r


def format_model_block(res, meta):
    """One model: a header line (BN layers, elements, roofline) and a row per variant."""
    rf = res["roofline"]
    head = ("%s  batch %d, %s, %s: %d BN layers%s, %.1fM BN elements per step, %d "
            "activations after BN; BN roofline %.3g GB (%d passes x %d B) = %s ms at %s GB/s" % (
                res["model"], res["batch"],
                res.get("input") or "%dx%d" % (res["size"], res["size"]), res["policy"],
                res["bn_layers"], (" (%d on our fused path)" % res["fused_path_layers"])
                if "fused_path_layers" in res else "", res["bn_elements"] / 1e6,
                res["activations_after_bn"], rf["bytes"] / 1e9, rf["passes"], rf["itemsize"],
                _f(rf["ms"], "%.3g"), _f(rf["bandwidth_gbs"])))
    traced = "trace" in res
    cols = [("variant", "<", 10), ("step ms", ">", 8), ("x step", ">", 18),
            ("BN cost ms [IQR]", ">", 21), ("x BN cost", ">", 18)]
    if traced:
        cols += [("BN op sum ms [IQR]", ">", 23), ("op sum / TF fused", ">", 18)]
    cols += [("BN share", ">", 8), ("BN+act ms [IQR]", ">", 21), ("x BN+act", ">", 18)]
    if traced:
        cols += [("BN+act op sum [IQR]", ">", 23), ("op sum / TF fused", ">", 18)]
    cols += [("trace s", ">", 7)]

    def line(vals):
        return "  ".join(("{:%s%d}" % (a, w)).format(v) for (_, a, w), v in zip(cols, vals))

    out = [head]
    fused = res.get("fused_path_layers")
    if fused is not None and fused < res["bn_layers"]:
        out.append("  warning: %s of its %d BN layers take our fused path (the others, e.g. "
                   "on inputs of rank other than 4 and 5, run Keras' BN in every variant)%s"
                   % ("none" if fused == 0 else "only %d" % fused, res["bn_layers"],
                      ": ours and TF fused then run the same code" if fused == 0 else ""))
    out += [line([c[0] for c in cols]), line(["-" * c[2] for c in cols])]
    for k in MODEL_VARIANT_KEYS:
        e = res["variants"].get(k)
        if e is None:
            continue

        def cost(name, d=e, fmt="%.1f [%.1f..%.1f]"):
            c = d.get(name)
            return "n/a" if c is None else fmt % (c["median_ms"], c["q25_ms"], c["q75_ms"])

        tr = e.get("trace")

        def ops(name):
            if tr is None:
                return ["n/a", "n/a"]
            return [cost(name, tr, "%.2f [%.2f..%.2f]"), "base" if k == TRACE_RATIO_BASE
                    else _x(tr.get("x_" + name))]

        vals = [meta["variants"][k]["header"], _f(e["step"]["median_ms"]),
                "base" if k == RATIO_BASE else _x(e.get("x_step")), cost("cost"),
                "base" if k == RATIO_BASE and "cost" in e else _x(e.get("x_cost"))]
        if traced:
            vals += ops("bn_ops")
        vals += [_f(e.get("share") and 100 * e["share"], "%.0f%%"), cost("cost_act"),
                 "base" if k == RATIO_BASE and "cost_act" in e else _x(e.get("x_cost_act"))]
        if traced:
            vals += ops("bn_act_ops")
        vals += [_f(res["trace_s"].get(k), "%.0f")]
        out.append(line(vals))
    if traced:
        out.append(format_trace_notes(res, meta))
    return "\n".join(out)


def _types_text(types, show=6):
    """'SquaredDifference 0.31 ms/53, Tile 0.20 ms/53, ... + 4 more 0.02 ms' (median ms and
    ops per step), largest first."""
    items = sorted(types.items(), key=lambda kv: -kv[1]["ms"])
    text = ", ".join("%s %.2f ms/%d" % (t, d["ms"], round(d["count"])) for t, d in items[:show])
    if len(items) > show:
        text += ", + %d more %.2f ms" % (len(items) - show, sum(d["ms"] for _, d in items[show:]))
    return text or "none"


def format_trace_notes(res, meta):
    """The lines under a traced model's table: what the trace columns are, the profiler's
    overhead, the BN kernels' share, and the op types counted per variant."""
    t = res["trace"]
    v = {k: e["trace"] for k, e in res["variants"].items() if "trace" in e}

    def hdr(k):
        return meta["variants"][k]["header"]

    out = ["BN op sum, BN+act op sum = sum of BN op times (trace): op durations summed per step "
           "over %d profiled steps per BN variant, median [IQR]; not step - floor (ops that run "
           "at once overlap: a sum of op times is not wall time); op sum / TF fused = that "
           "variant's / TF fused's (<1: less BN op time than TF fused), bootstrap 95%%; ours "
           "conv's BN op sum holds the activation fused into its ops, so only its BN+act op sum "
           "is compared" % t["steps_per_variant"],
           "  profiled step / unprofiled step (the profiler's overhead): " + ", ".join(
               "%s %s" % (hdr(k), _f(e["overhead"], "%.2fx")) for k, e in v.items()),
           "  BN kernels alone (op types FusedBatchNorm*, FbnGrad>*) ms: " + ", ".join(
               "%s %.2f" % (hdr(k), e["bn_kernels"]["median_ms"]) for k, e in v.items()),
           "  op types counted in BN layers' scopes (median ms / ops per step):"]
    for k, e in v.items():
        out.append("    %-10s %s" % (hdr(k), _types_text(e["op_types"])))
    out.append("  + in BN+act, the activation/Add layers' scopes (%d layers):"
               % len(t["act_layers"]))
    for k, e in v.items():
        out.append("    %-10s %s" % (hdr(k), _types_text(e["act_op_types"])))
    return "\n".join(out)


def summarize_models(results):
    """One row per model: the headline figures (None where a variant did not run)."""
    rows = []
    for res in results:
        v = res["variants"]

        def get(k, *path):
            d = v.get(k)
            for p in path:
                if d is None:
                    return None
                d = d.get(p) if isinstance(d, dict) else None
            return d

        ours_cost = get("ours", "cost", "median_ms")
        rf = res["roofline"]["ms"]
        rows.append({
            "model": res["model"], "policy": res["policy"], "batch": res["batch"],
            "size": res["size"],
            "step_ms": {k: get(k, "step", "median_ms") for k in v},
            "bn_cost_ms": {k: get(k, "cost", "median_ms") for k in v if get(k, "cost")},
            "bn_cost_iqr_ms": {k: get(k, "cost", "iqr_ms") for k in v if get(k, "cost")},
            "step_tf_over_ours": (v.get("tf_fused") or {}).get("x_step"),
            "step_keras_over_ours": (v.get("keras") or {}).get("x_step"),
            "cost_tf_over_ours": (v.get("tf_fused") or {}).get("x_cost"),
            "cost_keras_over_ours": (v.get("keras") or {}).get("x_cost"),
            "bn_share": {k: get(k, "share") for k in v if get(k, "share") is not None},
            "roofline_ms": rf,
            "ours_cost_over_roofline": ours_cost / rf if ours_cost and rf else None})
        if "trace" in res:
            rows[-1].update({
                "trace_bn_ops_ms": {k: get(k, "trace", "bn_ops", "median_ms")
                                    for k in v if get(k, "trace")},
                "trace_bn_act_ops_ms": {k: get(k, "trace", "bn_act_ops", "median_ms")
                                        for k in v if get(k, "trace")},
                "trace_ours_over_tf_bn_ops": get("ours", "trace", "x_bn_ops"),
                "trace_conv_over_tf_bn_act_ops": get("ours_converted", "trace", "x_bn_act_ops")})
    return rows


def format_model_summary(rows):
    name_w = max([14] + [len(str(r.get("model", ""))) for r in rows])  # a user's file path
    cols = [("model", "<", name_w), ("policy", "<", 14), ("ours ms", ">", 8),
            ("TF/ours step", ">", 12), ("Keras/ours step", ">", 15), ("TF/ours BN", ">", 10),
            ("Keras/ours BN", ">", 13), ("BN % TF", ">", 7), ("BN % Keras", ">", 10),
            ("BN % ours", ">", 9), ("roofline ms", ">", 11), ("ours/roof", ">", 9)]
    traced = any("trace_bn_ops_ms" in r for r in rows)
    if traced:
        cols += [("ours/TF BN ops (trace)", ">", 22), ("conv/TF BN+act ops", ">", 18)]

    def line(vals):
        return "  ".join(("{:%s%d}" % (a, w)).format(v) for (_, a, w), v in zip(cols, vals))

    def pt(r):
        return _f(r and r[0], "%.2fx")

    def pct(d, k):
        return _f(d.get(k) and 100 * d[k], "%.0f%%")

    out = [line([c[0] for c in cols]), line(["-" * c[2] for c in cols])]
    for r in rows:
        out.append(line([r["model"], r["policy"], _f(r["step_ms"].get("ours")),
                         pt(r["step_tf_over_ours"]), pt(r["step_keras_over_ours"]),
                         pt(r["cost_tf_over_ours"]), pt(r["cost_keras_over_ours"]),
                         pct(r["bn_share"], "tf_fused"), pct(r["bn_share"], "keras"),
                         pct(r["bn_share"], "ours"), _f(r["roofline_ms"]),
                         _f(r["ours_cost_over_roofline"], "%.2fx")]
                        + ([_x(r.get("trace_ours_over_tf_bn_ops")),
                            _x(r.get("trace_conv_over_tf_bn_act_ops"))] if traced else [])))
    return "\n".join(out)


def format_pair(pair):
    m = pair["median_ms"]
    return ("pair: two independent BN layers (each forward + backward, %s %s) in one tf.function, "
            "%d reps:\n"
            "  ours:     at once %.2f ms, in sequence %.2f ms, sequence/at once %.2fx\n"
            "  TF fused: at once %.2f ms, in sequence %.2f ms, sequence/at once %.2fx\n"
            "  TF fused/ours: at once %.2fx, in sequence %.2fx" % (
                shape_str(pair["shape"]), pair["dtype"], pair["reps"], m["ours_par"],
                m["ours_seq"], pair["seq_over_par"]["ours"], m["tf_fused_par"],
                m["tf_fused_seq"], pair["seq_over_par"]["tf_fused"], pair["tf_over_ours"]["par"],
                pair["tf_over_ours"]["seq"]))


def model_legend(meta):
    lines = ["times: ms of one training step (Keras' train_step in a tf.function, SGD, "
             "jit_compile=False), median over repetitions; variants interleaved, order rotated "
             "per repetition"]
    for v in MODEL_VARIANTS:
        lines.append("  %-10s = %s%s" % (v.header, v.description, (
            "  [n/a: %s]" % meta["not_available"][v.key])
            if v.key in meta["not_available"] else ""))
    lines += [
        "x step = that variant's step / ours (>1: ours faster) [bootstrap 95% interval]",
        "BN cost = step - floor's step of the same repetition: median [25th..75th percentile]; "
        "x BN cost = its median / ours (bootstrap 95% interval)",
        "BN share = BN cost / step; BN+act = step - floor-act's step (BN and the activation "
        "after it); roofline = BN elements x %d passes x itemsize / bandwidth" % BN_PASSES]
    if meta["config"].get("trace"):
        lines += [
            "--trace: BN op sum = sum of BN op times (trace): %d extra steps per BN variant "
            "under the TF profiler, the durations of the ops in BN layers' name scopes (forward "
            "and gradient) summed per step; BN+act op sum adds the activation (and absorbed "
            "Add) layers' ops; op sum / TF fused = variant / TF fused (<1: less BN op time); "
            "'trace s' is tf.function tracing, not this" % meta["config"]["trace_steps"]]
    return "\n".join(lines)

