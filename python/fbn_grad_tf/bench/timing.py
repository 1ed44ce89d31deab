"""Timing machinery: TF threads and backend, the progress line, the memory-bandwidth
measurement, interleaved timing with warm-up, and the machine description."""
import datetime
import os
import platform
import re
import shlex
import statistics
import sys
import threading
import time

import numpy as np
import tensorflow as tf


def onednn_enabled():
    """Whether this TF process uses oneDNN kernels (TF_ENABLE_ONEDNN_OPTS at start-up)."""
    try:
        from tensorflow.python.util import _pywrap_util_port
        return bool(_pywrap_util_port.IsMklEnabled())
    except Exception:  # pragma: no cover - internal API moved
        return os.environ.get("TF_ENABLE_ONEDNN_OPTS", "1") not in ("0", "false", "False")


def backend_name(onednn):
    return "onednn" if onednn else "eigen"


def _fmt_duration(s):
    s = int(round(s))
    return "%d:%02d" % (s // 60, s % 60)


def cpuinfo_field(key):
    """The first value of `key` ("model name", "vendor_id", ...) in /proc/cpuinfo, or None
    where there is no such file or field."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(key):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return None


def thp_mode(path="/sys/kernel/mm/transparent_hugepage/enabled"):
    """The kernel's transparent huge page mode ('always', 'madvise', 'never'), or None where
    the file is missing or unreadable (not Linux, no THP)."""
    try:
        with open(path) as f:
            words = f.read().split()
    except OSError:
        return None
    for word in words:
        if word.startswith("[") and word.endswith("]"):
            return word[1:-1]
    return None


def _cpu_model():
    return cpuinfo_field("model name") or platform.processor() or platform.machine()


def _isa_text(flags):
    """'AVX-512 BF16/FP16, AMX', 'AVX-512', 'AVX2' or '' from /proc/cpuinfo's flags."""
    parts = []
    if "avx512f" in flags:
        ext = [name for flag, name in (("avx512_bf16", "BF16"), ("avx512_fp16", "FP16"))
               if flag in flags]
        parts.append("AVX-512" + (" " + "/".join(ext) if ext else ""))
    elif "avx2" in flags:
        parts.append("AVX2")
    if "amx_tile" in flags:
        parts.append("AMX")
    return ", ".join(parts)


def _amd_zen(family, model, flags):
    """The Zen generation of an AMD family/model (cpuinfo's decimal 'cpu family' and 'model'),
    or None for another family."""
    if family == 0x17:
        return "Zen 2" if model >= 0x30 else "Zen"
    if family == 0x19:  # Zen 3 and Zen 4 share the family; Zen 4 is the one with AVX-512
        return "Zen 4" if "avx512f" in flags else "Zen 3"
    if family == 0x1A:
        return "Zen 5"
    return None


def _int_field(key):
    try:
        return int(cpuinfo_field(key))
    except (TypeError, ValueError):
        return None


def machine_kind(vendor=None, model_name=None, family=None, model=None, flags=None,
                 machine=None):
    """A label for the kind of machine a run comes from, from the CPU vendor, family and ISA
    flags: 'Intel Xeon (AVX-512 BF16/FP16, AMX)', 'AMD EPYC Zen 4', 'x86-64 AVX2', ...
    Stored runs are grouped by it (kind_slug). Arguments default to this machine's
    /proc/cpuinfo and platform.machine()."""
    if vendor is None and model_name is None and flags is None:
        vendor = cpuinfo_field("vendor_id")
        model_name = _cpu_model()
        family, model = _int_field("cpu family"), _int_field("model\t")  # not "model name"
        flags = set((cpuinfo_field("flags") or "").split())
    flags = set(flags or ())
    model_name = model_name or ""
    machine = machine or platform.machine()
    isa = _isa_text(flags)
    if vendor == "GenuineIntel":
        name = "Intel Xeon" if "Xeon" in model_name else "Intel"
        return "%s (%s)" % (name, isa) if isa else name
    if vendor == "AuthenticAMD":
        name = "AMD EPYC" if "EPYC" in model_name else "AMD"
        zen = _amd_zen(family if family is not None else -1, model if model is not None else -1,
                       flags)
        if zen:
            return "%s %s" % (name, zen)
        return "%s (%s)" % (name, isa) if isa else name
    if machine in ("x86_64", "AMD64"):
        return ("x86-64 " + isa) if isa else "x86-64"
    return machine or "unknown"


def kind_slug(kind):
    """A directory name for a machine kind: 'Intel Xeon (AVX-512 BF16/FP16, AMX)' ->
    'intel-xeon-avx-512-bf16-fp16-amx'."""
    return re.sub(r"[^a-z0-9]+", "-", kind.lower()).strip("-") or "unknown"


def command_line(argv):
    """The bench command as typed: 'python -m fbn_grad_tf.bench' and `argv`, shell-quoted."""
    return " ".join(["python -m fbn_grad_tf.bench"] + [shlex.quote(a) for a in argv])


def configure_threads(threads):
    """Sets TF's intra-op pool size (must precede TF's first op). Returns the value in force."""
    if threads:
        try:
            tf.config.threading.set_intra_op_parallelism_threads(int(threads))
        except RuntimeError as e:
            if tf.config.threading.get_intra_op_parallelism_threads() != int(threads):
                print("warning: --threads %d not applied: %s" % (threads, e), file=sys.stderr)
    return tf.config.threading.get_intra_op_parallelism_threads() or os.cpu_count()


class Progress:
    """A plain-text progress line on stderr ('\\r'-updated on a terminal, else one line per
    case). Progress is weighted by tensor size for the ETA."""

    def __init__(self, label, weights, stream=None, enabled=True, unit="cases"):
        self.label = label
        self.unit = unit
        self.total_w = float(sum(weights)) or 1.0
        self.count = len(weights)
        self.done_w = 0.0
        self.done = 0
        self.stream = stream or sys.stderr
        self.enabled = enabled
        self.tty = hasattr(self.stream, "isatty") and self.stream.isatty()
        self.t0 = time.perf_counter()

    def start(self, what):
        if not self.enabled:
            return
        frac = self.done_w / self.total_w
        elapsed = time.perf_counter() - self.t0
        eta = ("eta %s" % _fmt_duration(elapsed / frac * (1 - frac))) if frac > 0.02 else ""
        width = 20
        bar = "#" * int(frac * width) + "." * (width - int(frac * width))
        line = "[%s] [%s] %d/%d %s  %s %s" % (self.label, bar, self.done + 1, self.count, what,
                                              _fmt_duration(elapsed), eta)
        if self.tty:
            self.stream.write("\r\033[K" + line)
        else:
            self.stream.write(line + "\n")
        self.stream.flush()

    def finish(self, weight):
        self.done += 1
        self.done_w += weight

    def close(self):
        if not self.enabled:
            return
        elapsed = _fmt_duration(time.perf_counter() - self.t0)
        if self.done < self.count:  # an exception or Ctrl-C ended the run
            line = "[%s] stopped after %d of %d %s, %s" % (self.label, self.done, self.count,
                                                          self.unit, elapsed)
        else:
            line = "[%s] %d %s in %s" % (self.label, self.done, self.unit, elapsed)
        self.stream.write(("\r\033[K" if self.tty else "") + line + "\n")
        self.stream.flush()


# ---- memory bandwidth --------------------------------------------------------------------

def _best_rate(fn, nbytes, repeats):
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = fn()
        best = min(best, time.perf_counter() - t0)
        del out
    return nbytes / best / 1e9


def _numpy_bandwidth(n, threads, repeats):
    a = np.zeros(n, np.float32)
    b = np.ones(n, np.float32)
    c = np.full(n, 2.0, np.float32)
    chunk = 1 << 15  # 128 KiB of float32: the temporary stays in L2

    def triad(lo, hi):
        tmp = np.empty(chunk, np.float32)
        for i in range(lo, hi, chunk):
            j = min(i + chunk, hi)
            t = tmp[:j - i]
            np.multiply(c[i:j], np.float32(3.0), out=t)
            np.add(t, b[i:j], out=a[i:j])

    def copy(lo, hi):
        np.copyto(a[lo:hi], b[lo:hi])

    def parallel(fn):
        def go():
            ths = [threading.Thread(target=fn, args=(n * k // threads, n * (k + 1) // threads))
                   for k in range(threads)]
            for t in ths:
                t.start()
            for t in ths:
                t.join()
        return go

    return {"numpy_copy": _best_rate(parallel(copy), 2 * n * 4, repeats),
            "numpy_triad": _best_rate(parallel(triad), 3 * n * 4, repeats)}


def _tf_bandwidth(n, repeats):
    x = tf.fill([n], 1.0)
    y = tf.fill([n], 2.0)
    s = tf.constant(3.0)
    res = {}
    scale_fn = tf.function(lambda x, s: x * s)
    res["tf_scale"] = _best_rate(lambda: scale_fn(x, s), 2 * n * 4, repeats)
    try:
        triad_fn = tf.function(lambda x, y, s: x * s + y, jit_compile=True)
        triad_fn(x, y, s)
        res["tf_triad_fused"] = True
    except Exception:  # no XLA here: two kernels (counted as 3 arrays all the same)
        triad_fn = tf.function(lambda x, y, s: x * s + y)
        res["tf_triad_fused"] = False
    res["tf_triad"] = _best_rate(lambda: triad_fn(x, y, s), 3 * n * 4, repeats)
    return res


def measure_bandwidth(threads=None, mib=256, repeats=5):
    """Memory bandwidth in GB/s (1e9 B/s), STREAM-style byte counts, best of `repeats`.

    numpy_copy: b -> a (2 arrays counted); numpy_triad: a = b + s*c (3 arrays counted),
    both split over `threads` Python threads (NumPy releases the GIL), the triad in
    cache-sized chunks so no temporary goes to memory. tf_scale: x*s (2 arrays);
    tf_triad: x*s + y (3 arrays), XLA-fused when jit_compile works, on TF's thread pool
    (includes allocating the output, as every TF op does). "bandwidth" is the best of all.
    """
    threads = threads or os.cpu_count() or 1
    n = mib * 2 ** 20 // 4
    res = {"array_mib": mib, "threads": threads, "repeats": repeats}
    res.update(_numpy_bandwidth(n, threads, repeats))
    res.update(_tf_bandwidth(n, repeats))
    res["copy"] = max(res["numpy_copy"], res["tf_scale"])
    res["triad"] = max(res["numpy_triad"], res["tf_triad"])
    res["bandwidth"] = max(res["copy"], res["triad"])
    return res


BANDWIDTH_RATES = ("numpy_copy", "numpy_triad", "tf_scale", "tf_triad", "copy", "triad",
                   "bandwidth")


def best_bandwidth(readings):
    """The bandwidth record of a run from its readings (measure_bandwidth at the run's start
    and at its end): every rate the best over the readings, and "readings_gbs" each
    reading's "bandwidth" in order.

    One reading taken while another tenant of the host loads the memory bus comes out low
    (22.5 GB/s on the 2-core Zen 2 VM, where runs read 28-34), and every %BW of the run is
    divided by it while the cases ran at other moments. The best of two readings errs the
    other way, to the lower fraction.
    """
    if not readings:
        raise ValueError("best_bandwidth: no readings")
    out = dict(readings[0])
    for k in BANDWIDTH_RATES:
        out[k] = max(r[k] for r in readings)
    out["readings_gbs"] = [round(r["bandwidth"], 2) for r in readings]
    return out


def _stats(samples_s):
    ms = [s * 1e3 for s in samples_s]
    return {"median_ms": statistics.median(ms), "min_ms": min(ms),
            "mean_ms": statistics.fmean(ms), "samples_ms": [round(v, 4) for v in ms]}


def time_interleaved(fns, reps):
    """Calls each of `fns` (name -> zero-arg callable) once per repetition, alternating the
    order (ABBA...), and returns name -> list of seconds."""
    names = list(fns)
    samples = {k: [] for k in names}
    for i in range(reps):
        for k in (names if i % 2 == 0 else names[::-1]):
            t0 = time.perf_counter()
            out = fns[k]()
            samples[k].append(time.perf_counter() - t0)
            del out
    return samples


def warm_up_and_time(fns, config):
    """Warms each of `fns` up, picks the repetitions (config.reps, or as many as the slowest
    contestant fits into config.budget_s, within min_reps..max_reps) and times them
    interleaved. Returns (reps, name -> list of seconds)."""
    est = {}
    for k, f in fns.items():
        for _ in range(max(config.warmup, 1)):
            t0 = time.perf_counter()
            f()
            est[k] = time.perf_counter() - t0
    if config.reps:
        reps = int(config.reps)
    else:
        reps = int(config.budget_s / max(max(est.values()), 1e-6))
        reps = max(config.min_reps, min(config.max_reps, reps))
    return reps, time_interleaved(fns, reps)


def _loadavg():
    try:
        return round(os.getloadavg()[0], 2)
    except (OSError, AttributeError):
        return None


def _machine_meta():
    from .. import __version__, _build_info
    kind = machine_kind()
    meta = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "cpu": _cpu_model(), "cores": os.cpu_count(),
            "machine_kind": kind, "machine_slug": kind_slug(kind),
            "python": platform.python_version(), "numpy": np.__version__,
            "tf_version": tf.__version__, "fbn_grad_tf_version": __version__,
            "fbn_grad_tf_build": {k: getattr(_build_info, k) for k in dir(_build_info)
                                  if k.isupper()}}
    try:
        from .. import core
        meta["fbn_grad_tf_isa"] = core.default_isa() if callable(core.default_isa) \
            else core.default_isa
        meta["fbn_grad_tf_isa_path"] = meta["fbn_grad_tf_isa"]  # the path alone, without notes
        meta["fbn_grad_tf_prefetch"] = bool(core.software_prefetch())
        # The headers print the ISA string: say there whether the backward prefetches.
        meta["fbn_grad_tf_isa"] += ", software prefetch %s" % (
            "on" if meta["fbn_grad_tf_prefetch"] else "off")
    except Exception as e:  # pragma: no cover
        meta["fbn_grad_tf_isa"] = "unknown (%s)" % e
    try:  # ... and from what size fresh outputs are streamed (float32, 16-bit; common.h)
        from .. import core
        stream = {"float32": core.stream_min_bytes(4), "16-bit": core.stream_min_bytes(2)}
        meta["fbn_grad_tf_stream_min_bytes"] = stream
        meta["fbn_grad_tf_isa"] += ", streaming stores from %g/%g MiB (float32/16-bit)" % (
            stream["float32"] / 2**20, stream["16-bit"] / 2**20)
    except Exception as e:  # pragma: no cover
        meta["fbn_grad_tf_isa"] += ", streaming stores: unknown (%s)" % e
    try:  # ... and whether fresh outputs are advised for huge pages (common.h)
        from .. import core
        meta["fbn_grad_tf_hugepages"] = bool(core.hugepage_advice())
        # The kernel's THP mode decides what the advice does ("madvise": only advised memory,
        # so TF's own tensors stay in 4 KiB pages; "always": every large mapping anyway).
        meta["thp_mode"] = thp_mode()
        meta["fbn_grad_tf_isa"] += ", huge pages %s (THP %s)" % (
            "on" if meta["fbn_grad_tf_hugepages"] else "off", meta["thp_mode"] or "n/a")
    except Exception as e:  # pragma: no cover
        meta["fbn_grad_tf_isa"] += ", huge pages: unknown (%s)" % e
    return meta
