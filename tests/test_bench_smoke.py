"""Smoke test of the benchmark (python -m fbn_grad_tf.bench): its core loop on tiny shapes,
the built-in correctness check, the merge/table/summary code, and the command line with
its TF_ENABLE_ONEDNN_OPTS=0 worker subprocess. No timing assertions."""
import json
import math

import pytest

tf = pytest.importorskip("tensorflow")
bench = pytest.importorskip("fbn_grad_tf.bench")

TINY = dict(shapes=((2, 3, 3, 8),), reps=2, warmup=1, progress=False, torch=False)


def _check_entry(r):
    for k in ("shape", "tensor_shape", "format", "dtype", "mode", "elements", "min_bytes",
              "reps", "check", "ours"):
        assert k in r, k
    assert r["elements"] == math.prod(r["shape"])
    assert r["min_bytes"] == 3 * r["elements"] * {"float32": 4}.get(r["dtype"], 2)
    assert r["reps"] == 2
    assert len(r["ours"]["samples_ms"]) == 2 and r["ours"]["median_ms"] > 0
    # TF is timed, or refused with a message (NCHW inference on TF's CPU kernels).
    assert ("median_ms" in r["tf"]) != ("error" in r["tf"])
    if "error" in r["tf"]:
        assert r["format"] == "NCHW" and r["mode"] == "inference", r["tf"]["error"]
    # The correctness check ran before timing and passed within tolerance.
    errs = r["check"]["ours"]
    assert set(errs) == {"dx", "dscale", "doffset"}
    assert errs["dx"] <= bench.DX_TOL[r["dtype"]]
    assert errs["dscale"] <= bench.VEC_TOL and errs["doffset"] <= bench.VEC_TOL
    assert r["check"]["reference"]


def test_run_tiny_grid():
    cfg = bench.Config(dtypes=("float32", "bfloat16"), **TINY)
    res = bench.run(cfg)
    assert res["meta"]["tf_backend"] in ("onednn", "eigen")
    results = res["results"]
    assert len(results) == 1 * 2 * 2 * 2
    assert {(r["format"], r["dtype"], r["mode"]) for r in results} == {
        (f, d, m) for f in ("NHWC", "NCHW") for d in ("float32", "bfloat16")
        for m in ("training", "inference")}
    for r in results:
        _check_entry(r)
        if r["format"] == "NCHW":
            assert r["tensor_shape"] == [2, 8, 3, 3]
    json.dumps(res)  # JSON-serializable as is

    # merge/table/summary with a fake second backend made of the same results
    other = json.loads(json.dumps(res))
    other["meta"]["tf_backend"] = "eigen" if res["meta"]["tf_backend"] == "onednn" else "onednn"
    bw = {"bandwidth": 20.0, "copy": 20.0, "triad": 18.0, "numpy_copy": 20.0,
          "numpy_triad": 18.0, "tf_scale": 15.0, "tf_triad": 14.0, "array_mib": 256,
          "threads": 2, "tf_triad_fused": True}
    rows = bench.merge(res, other, bw)
    assert len(rows) == len(results)
    for row in rows:
        assert row["ours_ms"] > 0 and row["gbps"] > 0
        assert row["bw_fraction"] == pytest.approx(row["gbps"] / 20.0)
        for b in ("onednn", "eigen"):
            assert (row["tf_%s_ms" % b] is None) == (row["speedup_%s" % b] is None)
    table = bench.format_table(rows)
    assert "2x8x3x3" in table and "2x3x3x8" in table and "bfloat16" in table
    summary = bench.summarize(rows)
    text = bench.format_summary(summary, bw)
    assert "float32 NHWC" in text and "bandwidth = 20.0 GB/s" in text


def test_check_fails_loudly(monkeypatch):
    real = bench._ours_op

    def wrong(*args, **kw):
        out = real(*args, **kw)
        return (out[0] * 1.5,) + tuple(out[1:])

    monkeypatch.setattr(bench, "_ours_op", wrong)
    cfg = bench.Config(dtypes=("float32",), formats=("NHWC",), modes=("training",), **TINY)
    with pytest.raises(bench.CorrectnessError, match="dx rel err"):
        bench.run(cfg)


def test_numpy_reference_matches_tf():
    import numpy as np
    rng = np.random.default_rng(0)
    dy, x = rng.normal(size=(2, 3, 3, 4)), rng.normal(size=(2, 3, 3, 4))
    scale, mean, var = rng.uniform(0.5, 1.5, 4), x.mean((0, 1, 2)), x.var((0, 1, 2))
    f32 = [np.float32(a) if np.ndim(a) == 0 else a.astype(np.float32)
           for a in (dy, x, scale, mean, var)]
    for training in (True, False):
        ref = bench.numpy_reference(*f32, 1e-3, "NHWC", training)
        out = tf.raw_ops.FusedBatchNormGradV3(
            y_backprop=f32[0], x=f32[1], scale=f32[2], reserve_space_1=f32[3],
            reserve_space_2=f32[4], reserve_space_3=np.zeros(0, np.float32), epsilon=1e-3,
            data_format="NHWC", is_training=training)
        for a, b in zip(out[:3], ref):
            np.testing.assert_allclose(a.numpy(), b, rtol=1e-4, atol=1e-4)


def test_command_line_with_worker(tmp_path, capsys):
    out = tmp_path / "r.json"
    rc = bench.main(["--shapes", "2x3x3x8", "--dtypes", "float32", "--formats", "NHWC,NCHW",
                     "--modes", "train,infer", "--reps", "2", "--no-torch", "--no-progress",
                     "--bandwidth-mib", "16", "--json", str(out)])
    assert rc == 0
    printed = capsys.readouterr().out
    assert "Summary" in printed and "2x3x3x8" in printed
    data = json.loads(out.read_text())
    assert set(data) >= {"meta", "bandwidth", "summary", "results"}
    assert data["bandwidth"]["bandwidth"] > 0
    assert len(data["results"]) == 4
    for row in data["results"]:
        # both TF backends were measured: one here, the other in the worker subprocess
        assert row["raw"]["other"] is not None
        assert row["ours_ms_onednn_run"] and row["ours_ms_eigen_run"]
        if row["format"] == "NHWC":
            assert row["tf_onednn_ms"] and row["tf_eigen_ms"]
        if row["format"] == "NCHW" and row["mode"] == "inference":
            assert row["tf_eigen_ms"] is None and "NHWC" in row["tf_eigen_error"]


def test_parse_filters():
    args = bench.build_parser().parse_args(
        ["--quick", "--shapes", "4x5x5x16", "--dtypes", "bf16,f32", "--formats", "nchw",
         "--modes", "infer", "--threads", "1"])
    cfg = bench.config_from_args(args)
    assert cfg.shapes == ((4, 5, 5, 16),)
    assert cfg.dtypes == ("bfloat16", "float32")
    assert cfg.formats == ("NCHW",) and cfg.modes == ("inference",) and cfg.threads == 1
    assert cfg.budget_s == bench.quick_config().budget_s
    with pytest.raises(SystemExit):
        bench.build_parser().parse_args(["--dtypes", "float64"])
    with pytest.raises(SystemExit):
        bench.build_parser().parse_args(["--shapes", "3x3x3"])
