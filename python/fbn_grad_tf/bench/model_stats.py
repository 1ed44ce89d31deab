"""--model's statistics: quartiles of per-repetition steps and step differences, ratios with
bootstrap 95% intervals (repetitions resampled jointly), and the same for the sums of BN op
times read from a profiler trace."""
import statistics

import numpy as np

from .model_variants import RATIO_BASE

#: The variant the trace's ratios divide by: the question the trace answers is ours against
#: TF's fused ops (ours / TF fused, lower is better).
TRACE_RATIO_BASE = "tf_fused"


def _quartiles(vals):
    a = np.asarray(vals, np.float64)
    q1, med, q3 = np.percentile(a, [25, 50, 75])
    return {"median_ms": float(med), "q25_ms": float(q1), "q75_ms": float(q3),
            "iqr_ms": float(q3 - q1)}


def _bootstrap_ratio(num, den, resamples, rng):
    """(median(num)/median(den), 2.5th and 97.5th percentile over `resamples` resamplings of
    the repetitions, the same indices for both: pairs stay pairs)."""
    num, den = np.asarray(num, np.float64), np.asarray(den, np.float64)
    point = float(np.median(num) / np.median(den)) if np.median(den) > 0 else None
    if point is None or len(num) < 2 or resamples < 1:
        return point, None, None
    idx = rng.integers(0, len(num), (resamples, len(num)))
    d = np.median(den[idx], axis=1)
    r = np.median(num[idx], axis=1)[d > 0] / d[d > 0]
    if not len(r):
        return point, None, None
    lo, hi = np.percentile(r, [2.5, 97.5])
    return point, float(lo), float(hi)


def model_stats(samples_ms, variants, config):
    """Per variant: step quartiles, cost vs its floor and vs floor_act (per-repetition
    differences), BN share, and ratios against RATIO_BASE (step and cost, bootstrap 95%)."""
    rng = np.random.default_rng(config.seed)
    out = {}
    for v in variants:
        s = samples_ms[v.key]
        e = {"step": _quartiles(s), "samples_ms": [round(t, 3) for t in s]}
        for name, floor in (("cost", v.floor), ("cost_act", "floor_act" if v.floor else None)):
            if floor and floor in samples_ms:
                diff = [a - b for a, b in zip(s, samples_ms[floor])]
                e[name] = _quartiles(diff)
                e[name]["samples_ms"] = [round(t, 3) for t in diff]
                e[name]["floor"] = floor
        if "cost" in e:
            e["share"] = e["cost"]["median_ms"] / e["step"]["median_ms"]
        out[v.key] = e
    base = out.get(RATIO_BASE)
    for k, e in out.items():
        if base is None or k == RATIO_BASE:
            continue
        e["x_step"] = _bootstrap_ratio(samples_ms[k], samples_ms[RATIO_BASE], config.bootstrap,
                                       rng)
        for name in ("cost", "cost_act"):
            # only costs against the same floor compare (ours conv's cost is against floor_act)
            if name in e and name in base and e[name]["floor"] == base[name]["floor"]:
                e["x_" + name] = _bootstrap_ratio(e[name]["samples_ms"],
                                                  base[name]["samples_ms"], config.bootstrap, rng)
    return out


def _type_medians(per_step):
    """{op type: {"ms": median ms per step, "count": median count per step}} over steps (a
    type missing from a step counts as 0 there)."""
    types = sorted({t for d in per_step for t in d})
    return {t: {"ms": float(np.median([d.get(t, (0.0, 0))[0] for d in per_step])),
                "count": float(np.median([d.get(t, (0.0, 0))[1] for d in per_step]))}
            for t in types}


def trace_stats(sums, wall, samples, config, floors):
    """Per traced variant: quartiles and samples of bn_ops, bn_act_ops and bn_kernels (ms
    per step), the op types counted (median ms and count per step), the traced steps' wall
    time and its ratio to the untraced steps' median (the profiler's overhead), and x_bn_ops,
    x_bn_act_ops: that variant / TRACE_RATIO_BASE, bootstrap 95% (traced repetitions
    resampled jointly, as the timed ones). x_bn_ops only where the variant's floor is the
    base's (`floors`: key -> floor), as for the step-difference costs: ours conv's BN ops
    include the activation fused into them, so only its BN+act sum compares."""
    rng = np.random.default_rng(config.seed + 1)
    out = {}
    for k, per_step in sums.items():
        if not per_step:
            raise RuntimeError("the profiler trace has no step of %s" % k)
        e = {}
        for what in ("bn_ops", "bn_act_ops", "bn_kernels"):
            vals = [d[what] for d in per_step]
            e[what] = _quartiles(vals)
            e[what]["samples_ms"] = [round(v, 4) for v in vals]
        e["op_types"] = _type_medians([d["types"] for d in per_step])
        e["act_op_types"] = _type_medians([d["act_types"] for d in per_step])
        e["traced_step"] = _quartiles(wall[k])
        e["traced_step"]["samples_ms"] = [round(v, 3) for v in wall[k]]
        timed = statistics.median(samples[k]) if samples.get(k) else None
        e["overhead"] = e["traced_step"]["median_ms"] / timed if timed else None
        out[k] = e
    base = out.get(TRACE_RATIO_BASE)
    for k, e in out.items():
        if base is None or k == TRACE_RATIO_BASE:
            continue
        for what in ("bn_ops", "bn_act_ops"):
            if what == "bn_ops" and floors.get(k) != floors.get(TRACE_RATIO_BASE):
                continue
            e["x_" + what] = _bootstrap_ratio(e[what]["samples_ms"], base[what]["samples_ms"],
                                              config.bootstrap, rng)
    return out

