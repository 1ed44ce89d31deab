"""Large fresh CPU outputs of the TF ops are advised for transparent huge pages (common.h,
AdviseHugePages), and FBN_GRAD_TF_HUGEPAGES=off turns that off.

Each case runs in a fresh child process, so the knob (read once) takes effect and no earlier
buffer shares the output's mapping. The child runs the op eagerly (Python holds the inputs,
so TF allocates x_backprop fresh: a 33.5 MB buffer, above glibc's largest mmap threshold, so
its own mapping), then reads, in /proc/self/smaps, how much of the mapping that holds the
output is backed by huge pages. Where the kernel has no transparent huge pages, or backs
every mapping with them ("always"), only the knob itself is checked.
"""
import json

import pytest

import subproc

pytest.importorskip("tensorflow")
from fbn_grad_tf.bench.timing import thp_mode  # noqa: E402  (the bench's own reading)

THP_ENABLED = "/sys/kernel/mm/transparent_hugepage/enabled"


def _thp_bytes():
    try:
        with open("/sys/kernel/mm/transparent_hugepage/hpage_pmd_size") as f:
            return int(f.read())
    except (OSError, ValueError):
        return None


# The child: our backward on a 8x64x64x256 float32 tensor (dx 33.5 MB), then the huge-page
# kB of the mappings holding dx's buffer.
_CHILD = r"""
import json
import numpy as np
import tensorflow as tf
import fbn_grad_tf
from fbn_grad_tf import core

shape = (8, 64, 64, 256)
rng = np.random.default_rng(3)
dy = rng.standard_normal(shape, dtype=np.float32)
x = rng.standard_normal(shape, dtype=np.float32)
c = shape[-1]
scale, mean, var = np.ones(c, np.float32), np.zeros(c, np.float32), np.ones(c, np.float32)
dx = fbn_grad_tf.fused_batch_norm_grad(dy, x, scale, mean, var, mean, is_training=True)[0]
a = np.from_dlpack(dx)  # the tensor's own buffer (.numpy() returns a copy)
addr = a.__array_interface__["data"][0]
# madvise splits the mapping at the advised range: sum over every mapping that overlaps dx.
huge_kb, mappings = 0, 0
with open("/proc/self/smaps") as f:
    inside = False
    for line in f:
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            lo, hi = (int(v, 16) for v in head.split("-"))
            inside = lo < addr + a.nbytes and addr < hi
            mappings += inside
        elif inside and head == "AnonHugePages:":
            huge_kb += int(line.split()[1])
# The op's result is right too (TF's own op as the oracle), huge pages or not.
want = tf.raw_ops.FusedBatchNormGradV3(
    y_backprop=dy, x=x, scale=scale, reserve_space_1=mean, reserve_space_2=var,
    reserve_space_3=mean, is_training=True)[0].numpy()
print(json.dumps({"advice": bool(core.hugepage_advice()), "huge_kb": huge_kb,
                  "mappings": mappings, "nbytes": a.nbytes,
                  "max_err": float(np.max(np.abs(a - want)))}))
"""


def _run_child(knob):
    env = subproc.child_env({"FBN_GRAD_TF_HUGEPAGES": knob})
    r = subproc.run_snippet(_CHILD, timeout=300, env=env)
    assert r.clean, r.describe()
    return json.loads(r.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("knob", [None, "on", "auto", "off"])
def test_fresh_output_advised_unless_off(knob):
    got = _run_child(knob)
    want_advice = knob != "off"
    assert got["advice"] is want_advice
    assert got["max_err"] < 1e-3, got
    mode = thp_mode(THP_ENABLED)
    if mode is None or mode == "never":
        pytest.skip("this kernel has no transparent huge pages (%s): only the knob checked"
                    % THP_ENABLED)
    if _thp_bytes() != 2 << 20:
        pytest.skip("huge pages of %s bytes, not 2 MiB: only the knob checked" % _thp_bytes())
    assert got["mappings"] > 0, "no mapping in /proc/self/smaps holds the output"
    if want_advice:
        # All but the partial huge pages at the buffer's two ends.
        assert got["huge_kb"] * 1024 >= got["nbytes"] - 2 * (4 << 20), got
    elif mode == "madvise":
        assert got["huge_kb"] == 0, got


def test_bad_knob_warns_and_keeps_advice():
    env = subproc.child_env({"FBN_GRAD_TF_HUGEPAGES": "sometimes"})
    r = subproc.run_snippet(
        "from fbn_grad_tf import core\nprint(core.hugepage_advice())\n", env=env)
    assert r.clean, r.describe()
    assert r.stdout.strip().splitlines()[-1] == "True"
    assert "ignoring FBN_GRAD_TF_HUGEPAGES=sometimes" in r.stderr
