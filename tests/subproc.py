"""Crash isolation for the hardening tests: run code in a child Python process so that a
segfault, abort or out-of-memory kill fails a test instead of killing pytest.

Two entry points:

* ``run_snippet(code)`` runs a piece of Python source in a fresh interpreter and reports
  whether it exited cleanly, raised (exit status 1), crashed (killed by a signal) or timed
  out.

* ``run_cases("module:function", cases)`` starts ONE child that imports ``tests/<module>.py``
  and calls ``function(case)`` for every case in turn (TensorFlow is imported once per child,
  not once per case). For each case the child prints a start marker, then a result line
  holding what the function returned, or the exception it raised (type and message). If the
  child dies, the case that was running is reported as ``crashed`` (with the signal and the
  tail of stderr, which holds faulthandler's Python traceback) and a new child continues
  with the next case, so every case gets its own verdict.

Children can call ``note(obj)`` to leave a progress marker (e.g. the current fuzz example):
if the child then crashes, the last note is attached to the crashed outcome, which makes a
crash inside a long-running case (a hypothesis loop) reproducible.

This file is also the child's entry point:
``python tests/subproc.py --worker module:function cases.json start``.
"""
import json
import os
import signal
import subprocess
import sys
import tempfile
import time

TESTS_DIR = os.path.dirname(os.path.abspath(__file__))
REPO_ROOT = os.path.dirname(TESTS_DIR)

_MARK = "@@fbn-subproc"
# Exit statuses that mean "the process died" rather than "Python raised": negative values are
# signals (subprocess reports -SIGNUM); 128+SIGNUM is what a shell wrapper would report.
_CRASH_SIGNALS = {signal.SIGSEGV, signal.SIGABRT, signal.SIGBUS, signal.SIGILL, signal.SIGFPE,
                  signal.SIGKILL}


def child_env(extra=None):
    """Environment of a child: quiet TF logging, the repository's python/ dir as fallback."""
    env = dict(os.environ)
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    env.setdefault("PYTHONFAULTHANDLER", "1")
    env.setdefault("PYTHONHASHSEED", "0")
    if extra:
        for k, v in extra.items():
            if v is None:
                env.pop(k, None)
            else:
                env[k] = str(v)
    return env


def describe_returncode(rc):
    if rc is None:
        return "timed out"
    if rc < 0:
        try:
            return "killed by signal %s" % signal.Signals(-rc).name
        except ValueError:
            return "killed by signal %d" % -rc
    if rc > 128 and (rc - 128) in {int(s) for s in _CRASH_SIGNALS}:
        return "exit status %d (signal %s)" % (rc, signal.Signals(rc - 128).name)
    return "exit status %d" % rc


def is_crash(rc):
    return rc is not None and (rc < 0 or (rc > 128 and (rc - 128) in {int(s) for s in
                                                                       _CRASH_SIGNALS}))


class SnippetResult:
    def __init__(self, returncode, stdout, stderr, elapsed):
        self.returncode = returncode
        self.stdout = stdout
        self.stderr = stderr
        self.elapsed = elapsed

    @property
    def timed_out(self):
        return self.returncode is None

    @property
    def crashed(self):
        return is_crash(self.returncode)

    @property
    def clean(self):
        return self.returncode == 0

    def describe(self, tail=3000):
        return "%s after %.1fs\n--- stdout (tail) ---\n%s\n--- stderr (tail) ---\n%s" % (
            describe_returncode(self.returncode), self.elapsed, self.stdout[-tail:],
            self.stderr[-tail:])


def _python_prelude():
    # The child finds the package the way the parent does (editable install or PYTHONPATH);
    # the repository's python/ dir is only a fallback, appended last.
    return ("import sys, faulthandler; faulthandler.enable(); "
            "sys.path.insert(0, %r); sys.path.append(%r)\n" % (TESTS_DIR, os.path.join(
                REPO_ROOT, "python")))


def run_snippet(code, timeout=300, env=None, cwd=None):
    """Runs `code` in a fresh interpreter. Returns a SnippetResult."""
    t0 = time.monotonic()
    try:
        p = subprocess.run([sys.executable, "-c", _python_prelude() + code], capture_output=True,
                           text=True, timeout=timeout, env=child_env(env), cwd=cwd or REPO_ROOT)
        rc, out, err = p.returncode, p.stdout, p.stderr
    except subprocess.TimeoutExpired as e:
        rc = None
        out = e.stdout.decode(errors="replace") if isinstance(e.stdout, bytes) else (e.stdout or "")
        err = e.stderr.decode(errors="replace") if isinstance(e.stderr, bytes) else (e.stderr or "")
    return SnippetResult(rc, out, err, time.monotonic() - t0)


# ---- batches of cases ---------------------------------------------------------------------

class CaseOutcome:
    """Verdict of one case: status is 'ok' (function returned; value holds it), 'raised'
    (exc_type, exc_module, message), 'crashed' / 'timeout' (detail, last_note) or
    'not_run' (the batch gave up)."""

    def __init__(self, status, value=None, exc_type=None, exc_module=None, message=None,
                 detail=None, last_note=None):
        self.status = status
        self.value = value
        self.exc_type = exc_type
        self.exc_module = exc_module
        self.message = message
        self.detail = detail
        self.last_note = last_note

    def __repr__(self):
        if self.status == "ok":
            return "CaseOutcome(ok, %r)" % (self.value,)
        if self.status == "raised":
            return "CaseOutcome(raised %s: %s)" % (self.exc_type, (self.message or "")[:500])
        return "CaseOutcome(%s: %s; last note %r)" % (self.status, self.detail, self.last_note)


def run_cases(runner, cases, timeout=600, env=None, max_restarts=20):
    """Runs runner ("module:function" in tests/) on every case in child processes.

    Returns a list of CaseOutcome, one per case, in order. A child that crashes or exceeds
    `timeout` seconds (for the whole remaining batch) is replaced, starting after the case
    that killed it, at most max_restarts times.
    """
    outcomes = [None] * len(cases)
    with tempfile.TemporaryDirectory(prefix="fbn_subproc_") as tmp:
        path = os.path.join(tmp, "cases.json")
        with open(path, "w") as f:
            json.dump(cases, f)
        start, restarts = 0, 0
        while start < len(cases):
            t0 = time.monotonic()
            cmd = [sys.executable, os.path.abspath(__file__), "--worker", runner, path,
                   str(start)]
            try:
                p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout,
                                   env=child_env(env), cwd=REPO_ROOT)
                rc, out, err = p.returncode, p.stdout, p.stderr
            except subprocess.TimeoutExpired as e:
                rc = None
                out = e.stdout.decode(errors="replace") if isinstance(e.stdout, bytes) \
                    else (e.stdout or "")
                err = e.stderr.decode(errors="replace") if isinstance(e.stderr, bytes) \
                    else (e.stderr or "")
            current, last_note = None, None
            for line in out.splitlines():
                if not line.startswith(_MARK):
                    continue
                kind, _, rest = line[len(_MARK) + 1:].partition(" ")
                if kind == "START":
                    current, last_note = int(rest), None
                elif kind == "NOTE":
                    last_note = json.loads(rest)
                elif kind == "DONE":
                    idx, _, payload = rest.partition(" ")
                    d = json.loads(payload)
                    outcomes[int(idx)] = CaseOutcome(**d)
                    current = None
                elif kind == "FATAL":  # the worker itself failed (e.g. import error)
                    d = json.loads(rest)
                    for i in range(start, len(cases)):
                        if outcomes[i] is None:
                            outcomes[i] = CaseOutcome("not_run", detail=d["message"])
                    return outcomes
            if rc == 0 and current is None:
                break  # all remaining cases done
            # The child died (or hung) in case `current`, or between cases.
            detail = "%s after %.1fs; stderr tail:\n%s" % (
                describe_returncode(rc), time.monotonic() - t0, err[-4000:])
            if current is None:  # died outside a case: mark the first unfinished one
                current = next((i for i in range(start, len(cases)) if outcomes[i] is None),
                               len(cases))
                if current == len(cases):
                    break
            outcomes[current] = CaseOutcome("timeout" if rc is None else "crashed",
                                            detail=detail, last_note=last_note)
            start = current + 1
            restarts += 1
            if restarts > max_restarts:
                for i in range(start, len(cases)):
                    outcomes[i] = CaseOutcome("not_run", detail="too many crashed children")
                break
    return [o if o is not None else CaseOutcome("not_run", detail="no result") for o in outcomes]


def note(obj):
    """In a child: record progress (JSON-serialisable) for crash reports. Cheap."""
    sys.stdout.write("%s NOTE %s\n" % (_MARK, json.dumps(obj, default=repr)))
    sys.stdout.flush()


def _worker(runner, path, start):
    import faulthandler
    import importlib
    import traceback

    faulthandler.enable()
    sys.path.insert(0, TESTS_DIR)
    sys.path.append(os.path.join(REPO_ROOT, "python"))
    try:
        mod_name, fn_name = runner.split(":")
        fn = getattr(importlib.import_module(mod_name), fn_name)
        with open(path) as f:
            cases = json.load(f)
    except Exception as e:  # noqa: BLE001 - reported to the parent
        sys.stdout.write("%s FATAL %s\n" % (_MARK, json.dumps(
            {"message": "".join(traceback.format_exception(type(e), e, e.__traceback__))})))
        sys.stdout.flush()
        return 0
    for i in range(start, len(cases)):
        sys.stdout.write("%s START %d\n" % (_MARK, i))
        sys.stdout.flush()
        try:
            value = fn(cases[i])
            res = {"status": "ok", "value": value}
        except BaseException as e:  # noqa: BLE001 - every exception is a verdict
            if isinstance(e, (KeyboardInterrupt, SystemExit)):
                raise
            res = {"status": "raised", "exc_type": type(e).__name__,
                   "exc_module": type(e).__module__, "message": str(e)}
        sys.stdout.write("%s DONE %d %s\n" % (_MARK, i, json.dumps(res, default=repr)))
        sys.stdout.flush()
    return 0


if __name__ == "__main__":
    if len(sys.argv) == 5 and sys.argv[1] == "--worker":
        sys.exit(_worker(sys.argv[2], sys.argv[3], int(sys.argv[4])))
    sys.exit("usage: subproc.py --worker module:function cases.json start")
