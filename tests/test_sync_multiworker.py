"""Synchronized batch norm under MultiWorkerMirroredStrategy: two worker processes on
127.0.0.1 (gRPC, RING collectives), one CPU replica each.

Both workers train the scenario of sync_scenarios.py for two steps with fbn_grad_tf's
SyncBatchNormalization and with keras.layers.BatchNormalization(synchronized=True); the
gradients (summed over the workers), updated weights, moving statistics and losses must
equal a single-replica run of plain Keras batch norm over the concatenated global batch.
Each worker is killed if the pair is not done within WORKER_TIMEOUT seconds.
"""
import json
import os
import socket
import subprocess
import sys
import time

import pytest

import sync_scenarios as S
from subproc import child_env

HERE = os.path.dirname(os.path.abspath(__file__))
WORKER_TIMEOUT = 100.0
TOL = 1e-4


def _free_ports(n):
    socks = []
    try:
        for _ in range(n):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def _run_workers(tmp_path, n=2):
    ports = _free_ports(n)
    cluster = {"worker": ["127.0.0.1:%d" % p for p in ports]}
    procs, outs, logs = [], [], []
    for i in range(n):
        out = str(tmp_path / ("worker%d.json" % i))
        log = open(tmp_path / ("worker%d.log" % i), "w")
        env = child_env({"TF_CONFIG": json.dumps({"cluster": cluster,
                                                  "task": {"type": "worker", "index": i}}),
                         "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": 1})
        procs.append(subprocess.Popen([sys.executable, os.path.join(HERE, "sync_scenarios.py"),
                                       "worker", out], env=env, cwd=HERE, stdout=log,
                                      stderr=subprocess.STDOUT))
        outs.append(out)
        logs.append(log)
    deadline = time.monotonic() + WORKER_TIMEOUT
    try:
        for p in procs:
            p.wait(timeout=max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        pass
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        for log in logs:
            log.close()
    failures = []
    for i, p in enumerate(procs):
        if p.returncode != 0:
            with open(tmp_path / ("worker%d.log" % i)) as f:
                failures.append("worker %d: exit %s\n%s" % (i, p.returncode, f.read()[-3000:]))
    if failures:
        pytest.fail("MultiWorkerMirroredStrategy workers failed or timed out after %.0fs:\n%s"
                    % (WORKER_TIMEOUT, "\n".join(failures)))
    results = []
    for out in outs:
        with open(out) as f:
            results.append(json.load(f))
    return results


def test_multiworker_matches_single_replica_global_batch(tmp_path):
    import tensorflow as tf
    import fbn_grad_tf.sync  # noqa: F401
    results = _run_workers(tmp_path)
    reference = S.train_ctl(tf.distribute.get_strategy(), "keras_local")
    assert [r["task"] for r in results] == [0, 1]
    for r in results:
        assert r["replicas"] == 2
        for kind in ("fbn", "keras"):
            diff = S.compare(r[kind], reference)
            assert max(diff.values()) < TOL, (r["task"], kind, diff)
        assert r["fbn"]["fbn_ops"] == ["FbnGrad>BatchNormGradApply",
                                       "FbnGrad>BatchNormGradReduce"]
        # Ours and Keras' synchronized layer agree with each other too.
        diff = S.compare(r["fbn"], r["keras"])
        assert max(diff.values()) < TOL, diff
    # Both workers hold the same (mirrored) weights.
    assert max(S.max_rel_diff(results[0]["fbn"]["weights"],
                              results[1]["fbn"]["weights"]).values()) == 0.0
