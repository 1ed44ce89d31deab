"""Smoke test of the benchmark (python -m fbn_grad_tf.bench): its core loop on tiny shapes,
the built-in correctness check, the merge/table/summary code, and the command line with
its TF_ENABLE_ONEDNN_OPTS=0 worker subprocess; --layer; --model on a tiny CNN (and the
variants of a real keras.applications model, cloned, not run); --model --trace's profiler
trace on the tiny CNN and its XSpace reading on a made-up trace. No timing assertions."""
import json
import math
import os

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
    assert "readings" not in text  # one reading: nothing to say about readings


def test_best_bandwidth_of_start_and_end_readings():
    """A run's bandwidth is the best of its readings, rate by rate; the readings are kept."""
    low = {"bandwidth": 22.5, "copy": 22.5, "triad": 13.5, "numpy_copy": 22.5,
           "numpy_triad": 12.5, "tf_scale": 9.9, "tf_triad": 13.5, "array_mib": 256,
           "threads": 2, "repeats": 5, "tf_triad_fused": True}
    high = dict(low, bandwidth=29.8, copy=29.8, triad=25.0, numpy_copy=29.8, numpy_triad=25.0,
                tf_scale=12.0, tf_triad=15.0)
    bw = bench.best_bandwidth([low, high])
    assert bw["bandwidth"] == 29.8 and bw["triad"] == 25.0 and bw["tf_scale"] == 12.0
    assert bw["readings_gbs"] == [22.5, 29.8]
    assert bw["array_mib"] == 256 and bw["tf_triad_fused"] is True
    assert bench.best_bandwidth([high, low])["bandwidth"] == 29.8
    assert low["bandwidth"] == 22.5  # the readings are not modified
    summary = {"speedups": [], "bandwidth_fraction_large": [], "chain_bandwidth_fraction": []}
    text = bench.format_summary(summary, bw)
    assert ("bandwidth = 29.8 GB/s (best of the readings at the run's start and end: "
            "22.5 and 29.8)") in text
    with pytest.raises(ValueError):
        bench.best_bandwidth([])


def test_chain_columns(capsys):
    """--chain K: each op K times in a row in one tf.function, timed per op, beside the
    single calls; TF's chain only where TF ran the single call."""
    cfg = bench.Config(dtypes=("float32", "float16"), chain=3, **TINY)
    res = bench.run(cfg)
    for r in res["results"]:
        _check_entry(r)
        assert r["chain"] == 3
        assert len(r["ours_chain"]["samples_ms"]) == 2 and r["ours_chain"]["median_ms"] > 0
        assert ("tf_chain" in r) == ("median_ms" in r["tf"])
    bw = {"bandwidth": 20.0, "copy": 20.0, "triad": 18.0, "numpy_copy": 20.0,
          "numpy_triad": 18.0, "tf_scale": 15.0, "tf_triad": 14.0, "array_mib": 256,
          "threads": 2, "tf_triad_fused": True}
    rows = bench.merge(res, None, bw)
    for row in rows:
        assert row["chain"] == 3 and row["ours_chain_ms"] > 0
        assert row["chain_bw_fraction"] == pytest.approx(row["chain_gbps"] / 20.0)
        assert (row["tf_chain_ms"] is None) == (row["speedup_chain"] is None)
    table = bench.format_table(rows)
    assert "chain ms" in table and "%BW(c)" in table
    # Tiny shapes are below the mid-size threshold: no chain bandwidth summary, no error.
    summary = bench.summarize(rows)
    assert summary["chain_bandwidth_fraction"] == []
    fake = [dict(r, elements=bench.MID_ELEMENTS, chain_bw_fraction=0.5) for r in rows]
    text = bench.format_summary(bench.summarize(fake), bw)
    assert "inside a graph" in text and "50%" in text
    # Without --chain the columns are absent.
    plain = bench.merge(bench.run(bench.Config(dtypes=("float32",), **TINY)), None, bw)
    assert "chain ms" not in bench.format_table(plain)
    for argv in (["--chain", "0"], ["--chain", str(bench.MAX_CHAIN + 1)],
                 ["--chain", "2", "--layer"], ["--chain", "2", "--model", "resnet50"]):
        with pytest.raises(SystemExit):
            bench.main(argv)
    capsys.readouterr()
    # The worker subprocess gets the configuration as JSON.
    assert bench.Config.from_json(json.loads(json.dumps(cfg.to_json()))).chain == 3


def test_check_fails_loudly(monkeypatch):
    real = bench.contestants._ours_op

    def wrong(*args, **kw):
        out = real(*args, **kw)
        return (out[0] * 1.5,) + tuple(out[1:])

    monkeypatch.setattr(bench.contestants, "_ours_op", wrong)  # where run() looks it up
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
    # measured at the start and at the end, the best of the two kept
    assert len(data["bandwidth"]["readings_gbs"]) == 2
    assert data["bandwidth"]["bandwidth"] == pytest.approx(max(data["bandwidth"]["readings_gbs"]),
                                                           abs=0.01)
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


# ---- the PyTorch column and --layer, through the command line --------------------------------

import inspect  # noqa: E402
import re  # noqa: E402
import sys  # noqa: E402

CLI_TINY = ["--shapes", "2x3x3x8", "--reps", "2", "--no-progress"]
_NUM = re.compile(r"^\d+\.\d+x?$")


def _torch_state(monkeypatch, torch_mode):
    """'installed': torch as it is here (possibly absent); 'missing': `import torch` fails as
    if not installed. Returns whether torch is importable for the run."""
    if torch_mode == "missing":
        monkeypatch.setitem(sys.modules, "torch", None)  # `import torch` -> ModuleNotFoundError
        return False
    try:
        import torch  # noqa: F401
        return True
    except ImportError:
        return False


def _parse_table(printed, first_col="shape"):
    """The printed table as (header fields, rows of fields): columns are separated by two or
    more spaces (headers have at most one inside: "TF BN+ReLU")."""
    lines = printed.splitlines()
    start = next(i for i, ln in enumerate(lines) if ln.startswith(first_col + " "))
    header = re.split(r" {2,}", lines[start].strip())
    rows = []
    for line in lines[start + 2:]:  # blank lines separate groups; the summary follows
        if line.startswith("Summary"):
            break
        if line.strip():
            rows.append(re.split(r" {2,}", line.strip()))
    for r in rows:
        assert len(r) == len(header), (header, r)
    return header, rows


def _cell_ok(v):
    """A table cell: a positive number (ms or ratio) or n/a."""
    if v == "n/a":
        return True
    assert _NUM.match(v), v
    return float(v.rstrip("x")) > 0


@pytest.mark.parametrize("torch_mode", ["installed", "missing"])
def test_torch_column(tmp_path, capsys, monkeypatch, torch_mode):
    have = _torch_state(monkeypatch, torch_mode)
    out = tmp_path / "r.json"
    rc = bench.main(CLI_TINY + ["--dtypes", "float32,bf16", "--formats", "NHWC,NCHW",
                                "--modes", "train,infer", "--no-eigen",
                                "--bandwidth-mib", "16", "--json", str(out)])
    assert rc == 0
    printed = capsys.readouterr().out
    header, rows = _parse_table(printed)
    assert header[:5] == ["shape", "fmt", "dtype", "mode", "ours ms"]
    assert {"torch ms", "t%BW", "%BW", "GB/s", "core ms"} <= set(header)
    ti = header.index("torch ms")
    assert header[ti + 1] == "x" and header[ti + 2] == "xc"
    assert len(rows) == 8
    for r in rows:
        assert float(r[header.index("core ms")]) > 0  # timed whether or not torch is there
        assert (r[ti + 2] != "n/a") == have, r
        for h, v in zip(header[4:-1], r[4:-1]):  # GB/s, %BW: tiny shapes round to 0
            assert _cell_ok(v) if h not in ("GB/s", "%BW", "t%BW") else (
                v == "n/a" or re.match(r"^\d+(\.\d+)?%?$", v)), (h, v)
        assert float(r[header.index("ours ms")]) > 0
        assert (r[ti] != "n/a") == have, r
    assert "vs PyTorch" in printed
    data = json.loads(out.read_text())
    for row in data["results"]:
        assert row["core_ms"] > 0
        assert row["check"]["main"]["core"]["dx"] <= bench.DX_TOL[row["dtype"]]
        if have:
            assert row["torch_ms"] > 0 and row["speedup_torch"] > 0, row["torch_error"]
            assert row["speedup_torch_core"] == pytest.approx(row["torch_ms"] / row["core_ms"])
            assert row["torch_gbps"] > 0 and row["torch_bw_fraction"] > 0
            assert row["check"]["main"]["torch"]["dx"] <= bench.DX_TOL[row["dtype"]]
        else:
            assert row["torch_ms"] is None and row["speedup_torch"] is None
            assert row["torch_error"] == "torch not installed"
    if not have:
        assert "n/a (torch not installed)" in printed
        assert data["meta"]["torch"] == "torch: n/a (torch not installed)"
        for g in data["summary"]["speedups"]:
            assert g["torch_training"] is None and g["torch_inference"] is None
    else:
        assert any(g["torch_training"] for g in data["summary"]["speedups"])
        assert any(g["torch_core_training"] for g in data["summary"]["speedups"])
        assert "PyTorch vs core" in printed


def _fake_forward_api(monkeypatch, api):
    """'built': fbn_grad_tf.nn.fused_batch_norm as it is; 'no_op': as it is, with
    nn.our_forward_available() False; 'old': without forward=/activation=; 'new': with them
    (a stand-in on top of the built one: TF's forward, our backward, ReLU as tf.nn.relu),
    so that both shapes of the API are exercised whatever this build has. Returns whether
    the ours columns should be measured."""
    from fbn_grad_tf import nn
    real = nn.fused_batch_norm
    has_forward = "forward" in inspect.signature(real).parameters
    if api == "built":
        return bench.ours_forward_support()["forward"]
    if api == "no_op":  # forward= accepted but our forward op cannot run here
        monkeypatch.setattr(nn, "our_forward_available", lambda: False, raising=False)
        return False

    def call_real(x, scale, offset, mean, variance, epsilon, data_format, is_training,
                  exponential_avg_factor):
        extra = {"forward": "tf"} if has_forward else {}
        return real(x, scale, offset, mean, variance, epsilon=epsilon,
                    data_format=data_format, is_training=is_training,
                    exponential_avg_factor=exponential_avg_factor, **extra)

    if api == "old":
        def fused_batch_norm(x, scale, offset, mean=None, variance=None, epsilon=0.001,
                             data_format="NHWC", is_training=True, exponential_avg_factor=1.0,
                             name=None):
            return call_real(x, scale, offset, mean, variance, epsilon, data_format,
                             is_training, exponential_avg_factor)
    else:
        def fused_batch_norm(x, scale, offset, mean=None, variance=None, epsilon=0.001,
                             data_format="NHWC", is_training=True, exponential_avg_factor=1.0,
                             activation=None, forward="ours", name=None):
            y, m, v = call_real(x, scale, offset, mean, variance, epsilon, data_format,
                                is_training, exponential_avg_factor)
            return (tf.nn.relu(y) if activation == "relu" else y), m, v
        monkeypatch.setattr(nn, "our_forward_available", lambda: True, raising=False)
    monkeypatch.setattr(nn, "fused_batch_norm", fused_batch_norm)
    return api == "new"


@pytest.mark.parametrize("api,torch_mode", [("built", "installed"), ("old", "missing"),
                                            ("new", "installed"), ("no_op", "installed")])
def test_layer_mode(tmp_path, capsys, monkeypatch, api, torch_mode):
    has_forward = _fake_forward_api(monkeypatch, api)
    have_torch = _torch_state(monkeypatch, torch_mode)
    out = tmp_path / "l.json"
    rc = bench.main(CLI_TINY + ["--layer", "--dtypes", "float32,bf16", "--formats", "NHWC,NCHW",
                                "--json", str(out)])
    assert rc == 0
    printed = capsys.readouterr().out
    header, rows = _parse_table(printed)
    headers = [h for _, h, _ in bench.LAYER_COLUMNS]
    assert header[:3] == ["shape", "fmt", "dtype"] and header[-1] == "reps"
    assert [h for h in header[3:-1] if h != "x"] == headers
    assert len(rows) == 4
    base = "ours" if has_forward else "tf+ours"
    n_x = len(headers) - (2 if has_forward else 3)  # no x after ours, ours+ReLU (and tf+ours)
    assert header.count("x") == n_x
    for r in rows:
        cells = dict(zip(header, r))  # "x" keeps the last one; all are checked below
        assert all(_cell_ok(v) for v in r[3:-1]), r
        for h in ("tf+ours", "TF BN+ReLU", "TF fused", "Keras"):
            assert cells[h] != "n/a", (h, r)
        assert (cells["ours"] != "n/a") == has_forward
        assert (cells["ours+ReLU"] != "n/a") == has_forward
        assert (cells["PyTorch"] != "n/a") == have_torch
        assert int(cells["reps"]) == 2
    assert ("ours: n/a (needs our forward op)" in printed) == (not has_forward)
    assert ("PyTorch: n/a (torch not installed)" in printed) == (not have_torch)

    data = json.loads(out.read_text())
    assert data["meta"]["mode"] == "layer"
    assert data["meta"]["ratio_base"] == ("ours" if has_forward else "tf_ours")
    assert data["meta"]["ours_forward"]["forward"] == has_forward
    assert {(r["dtype"], r["format"]) for r in data["results"]} == {
        (d, f) for d in ("float32", "bfloat16") for f in ("NHWC", "NCHW")}
    for row in data["results"]:
        assert row["reps"] == 2 and row["check"]["reference"] == "TF fused"
        for k in bench.LAYER_KEYS:
            ms, err = row[k + "_ms"], row[k + "_error"]
            assert (ms is None) != (err is None), (k, ms, err)
            assert ms is None or ms > 0
            if ms is not None and k != "tf":  # TF fused is the reference
                assert set(row["check"][k]) >= {"y", "dx", "dscale", "doffset"}
                if k in ("ours_relu", "tf_relu"):
                    assert row["check"][k]["relu_mask_diff"] >= 0
            if "x_" + k in row and ms is not None and row[row["partner_" + k] + "_ms"]:
                assert row["x_" + k] > 0
        assert row["x_tf"] == pytest.approx(row["tf_ms"] / row[
            ("ours" if has_forward else "tf_ours") + "_ms"])
        assert row["partner_tf_relu"] == ("ours_relu" if has_forward else "tf_ours")
        if has_forward:
            assert row["ours_ms"] and row["ours_relu_ms"]
        else:
            assert row["ours_error"] == row["ours_relu_error"] == bench.NEEDS_FORWARD
        assert (row["torch_ms"] is not None) == have_torch
    groups = data["summary"]["speedups"]
    assert len(groups) == 4 and all(g["tf"] > 0 and g["keras"] > 0 for g in groups)
    assert "Summary: median over shapes of their ms / %s ms" % base in printed


@pytest.mark.parametrize("wrong", ["y", "relu_grad"])
def test_layer_check_catches_a_wrong_forward(monkeypatch, wrong):
    """A wrong result of ours stops --layer before timing: y scaled (tf+ours, which every
    build has), or ours+ReLU whose gradient ignores the ReLU (y right, dx not masked)."""
    from fbn_grad_tf import nn
    real = nn.fused_batch_norm
    if wrong == "y":
        def fake(*args, **kw):
            y, m, v = real(*args, **kw)
            return y * 1.5, m, v
    else:
        _fake_forward_api(monkeypatch, "new")
        good = nn.fused_batch_norm

        def fake(x, scale, offset, mean=None, variance=None, epsilon=0.001, data_format="NHWC",
                 is_training=True, exponential_avg_factor=1.0, activation=None,
                 forward="ours", name=None):
            y, m, v = good(x, scale, offset, mean, variance, epsilon, data_format,
                           is_training, exponential_avg_factor, None, forward)
            if activation == "relu":  # forward relu(y), backward as if there were no ReLU
                y = y + tf.stop_gradient(tf.nn.relu(y) - y)
            return y, m, v
    monkeypatch.setattr(nn, "fused_batch_norm", fake)
    cfg = bench.Config(shapes=((2, 3, 3, 8),), dtypes=("float32",), formats=("NHWC",), reps=2,
                       progress=False, torch=False)
    match = "tf\\+ours differs.*y rel err" if wrong == "y" else "ours\\+ReLU differs.*dx rel err"
    with pytest.raises(bench.CorrectnessError, match=match):
        bench.run_layer(cfg)


def test_layer_parse_defaults():
    args = bench.build_parser().parse_args(["--layer", "--modes", "infer"])
    cfg = bench.config_from_args(args)
    assert cfg.dtypes == ("float32",) and cfg.formats == ("NHWC",)
    assert cfg.modes == ("training",) and cfg.shapes == bench.DEFAULT_SHAPES
    cfg = bench.config_from_args(bench.build_parser().parse_args(
        ["--layer", "--quick", "--dtypes", "bf16"]))
    assert cfg.shapes == bench.QUICK_SHAPES and cfg.dtypes == ("bfloat16",)


# ---- --model: whole keras.applications models (smoke form: one tiny model, a few steps) -------

MODEL_TINY = ["--model", "tiny", "--size", "16", "--batch", "4", "--reps", "3",
              "--model-warmup", "1", "--bandwidth", "20", "--pair-shape", "2x4x4x8",
              "--pair-reps", "2", "--no-progress"]


def test_model_mode_tiny(tmp_path, capsys):
    """The model mode end to end on the tiny CNN: every available variant timed, costs against
    the floors, ratios, roofline, pair row, JSON. No timing assertions (signs of costs are
    noise on a model this small)."""
    out = tmp_path / "m.json"
    rc = bench.main(MODEL_TINY + ["--json", str(out), "--store", str(tmp_path / "results")])
    assert rc == 0
    printed = capsys.readouterr().out
    for text in ("tiny  batch 4, 16x16, float32: 3 BN layers (3 on our fused path)",
                 "BN roofline", "Summary", "pair: two independent BN layers", "x BN cost"):
        assert text in printed, text
    data = json.loads(out.read_text())
    meta = data["meta"]
    assert meta["mode"] == "model" and meta["bandwidth_gbs"] == 20
    # what a stored run says about itself (the report's header line), and where it is stored
    assert meta["command"] == " ".join(["python -m fbn_grad_tf.bench"] + MODEL_TINY + [
        "--json", str(out), "--store", str(tmp_path / "results")])
    assert meta["machine_kind"] == bench.machine_kind()
    assert meta["date"].endswith("+00:00") and meta["fbn_grad_tf_isa_path"]
    for key in ("cpu", "tf_version", "fbn_grad_tf_version"):
        assert meta[key], key
    stored = tmp_path / "results" / meta["machine_slug"] / "models-float32.json"
    assert json.loads(stored.read_text()) == data
    (res,) = data["models"]
    assert res["bn_layers"] == 3 and res["activations_after_bn"] == 3
    assert res["bn_elements"] == 4 * (16 * 16 * 8 + 8 * 8 * 16 + 4 * 4 * 16)
    assert res["roofline"]["bytes"] == res["bn_elements"] * bench.BN_PASSES * 4
    assert res["roofline"]["ms"] == pytest.approx(res["roofline"]["bytes"] / 20e9 * 1e3)
    v = res["variants"]
    convert = data["meta"]["not_available"].get("ours_converted") is None
    assert set(v) == {"keras", "tf_fused", "ours", "floor", "floor_act"} | (
        {"ours_converted"} if convert else set())
    for k, e in v.items():
        assert len(e["samples_ms"]) == 3 and e["step"]["median_ms"] > 0
        floor = bench.models._VARIANTS[k].floor
        assert ("cost" in e) == (floor is not None)
        if floor:
            diffs = [a - b for a, b in zip(e["samples_ms"], v[floor]["samples_ms"])]
            assert e["cost"]["samples_ms"] == pytest.approx(diffs, abs=2e-3)
            assert e["cost_act"]["floor"] == "floor_act"
        if k != "ours":
            point, lo, hi = e["x_step"]
            assert point == pytest.approx(e["step"]["median_ms"] / v["ours"]["step"]["median_ms"])
            assert lo <= hi
    # the first step's loss of every BN variant matched Keras 3's (same weights, same data)
    assert set(res["loss_check"]) >= {"tf_fused", "ours"}
    assert all(r <= 1e-3 for r in res["loss_check"].values())
    pair = data["pair"]
    assert set(pair["median_ms"]) == {"ours_par", "ours_seq", "tf_fused_par", "tf_fused_seq"}
    assert pair["seq_over_par"]["ours"] > 0 and pair["tf_over_ours"]["par"] > 0
    (row,) = data["summary"]
    assert row["model"] == "tiny" and row["step_tf_over_ours"][0] > 0


def test_model_variants_swap_and_floors():
    """The variants of a real keras.applications model (built, not run: cloning only): every
    BN swapped for ours (TF's ops for TF fused) with the weights copied, or a pass-through."""
    keras = pytest.importorskip("keras")
    from fbn_grad_tf.keras import BatchNormalization as Ours
    models = bench.models
    m = models.build_model("MobileNetV2", 32, 10)
    facts = models.bn_facts(m, 2)
    assert facts["bn_layers"] == 52 and facts["activations_after_bn"] == 35
    bns = [layer.name for layer in m.layers if isinstance(layer, keras.layers.BatchNormalization)]
    ours, tf_fused = models._build_ours(m), models._build_tf_fused(m)
    for clone, op in ((ours, "fbn_grad_tf"), (tf_fused, "tensorflow")):
        for name in bns:
            layer = clone.get_layer(name)
            assert isinstance(layer, Ours) and layer.forward_op == layer.gradient_op == op
    w0, w1 = m.get_layer(bns[0]).get_weights(), ours.get_layer(bns[0]).get_weights()
    assert len(w0) == len(w1) == 4 and all((a == b).all() for a, b in zip(w0, w1))
    floor, floor_act = models._build_floor(m), models._build_floor_act(m)
    assert not any(isinstance(layer, keras.layers.BatchNormalization) for layer in floor.layers)
    assert sum(isinstance(layer, models.PassThrough) for layer in floor.layers) == 52
    assert sum(isinstance(layer, models.PassThrough) for layer in floor_act.layers) == 52 + 35


def test_model_dropout_is_off():
    """Models with dropout (EfficientNet) are benchmarked with rate-0 Dropout layers: each
    variant is a clone with its own dropout masks, and the first-loss check compares them."""
    keras = pytest.importorskip("keras")
    import numpy as np
    models = bench.models
    inp = keras.Input((4, 4, 3))
    h = keras.layers.Conv2D(8, 3, padding="same")(inp)
    h = keras.layers.BatchNormalization()(h)
    h = keras.layers.Dropout(0.5, name="drop")(h)
    h = keras.layers.SpatialDropout2D(0.5, name="sdrop")(h)
    m = keras.Model(inp, keras.layers.GlobalAveragePooling2D()(h))
    off = models.without_dropout(m)
    assert off is not m
    assert off.get_layer("drop").rate == 0.0 and off.get_layer("sdrop").rate == 0.0
    assert m.get_layer("drop").rate == 0.5  # the original is left as it was
    x = np.random.default_rng(0).standard_normal((2, 4, 4, 3)).astype("float32")
    a, b = off(x, training=True), off(x, training=True)
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert models.without_dropout(off) is off  # nothing left to turn off: the same model


def test_model_parse():
    args = bench.build_parser().parse_args(
        ["--model", "ResNet50,tiny", "--policy", "mixed_bfloat16", "--batch", "8", "--size",
         "64", "--variants", "ours,floor", "--no-pair"])
    cfg = bench.model_config_from_args(args)
    assert cfg.models == ("ResNet50", "tiny") and cfg.policy == "mixed_bfloat16"
    assert (cfg.batch, cfg.size, cfg.reps, cfg.pair) == (8, 64, bench.ModelConfig.reps, False)
    assert [v.key for v in bench.selected_variants(cfg)[0]] == ["ours", "floor"]
    with pytest.raises(SystemExit):
        bench.model_config_from_args(bench.build_parser().parse_args(["--model", "nosuchnet"]))
    with pytest.raises(SystemExit):
        bench.model_config_from_args(bench.build_parser().parse_args(
            ["--model", "tiny", "--variants", "ours,bogus"]))
    with pytest.raises(SystemExit):
        bench.build_parser().parse_args(["--model", "tiny", "--policy", "float64"])
    with pytest.raises(SystemExit):
        bench.main(["--model", "tiny", "--layer"])


def test_model_converted_column_plugs_in(monkeypatch):
    """The 'ours conv' column (fbn_grad_tf.keras.convert) runs once convert exists:
    here a stand-in that swaps the BN layers for ours; its cost is against floor-act, its
    x against ours' BN+act cost (not the BN cost: another floor)."""
    import fbn_grad_tf.keras as fbn_keras
    models = bench.models
    monkeypatch.setattr(fbn_keras, "convert", models._build_ours, raising=False)
    cfg = bench.ModelConfig(models=("tiny",), batch=2, size=8, reps=2, warmup=1, pair=False,
                            bandwidth_gbs=20.0, progress=False,
                            variants=("keras", "ours", "ours_converted", "floor", "floor_act"))
    res = bench.run_models(cfg)
    assert res["meta"]["not_available"] == {}
    v = res["models"][0]["variants"]
    assert set(v) == {"keras", "ours", "ours_converted", "floor", "floor_act"}
    conv = v["ours_converted"]
    assert conv["cost"]["floor"] == conv["cost_act"]["floor"] == "floor_act"
    assert "x_cost" not in conv and "x_cost_act" in conv and "x_step" in conv
    assert "ours_converted" in res["models"][0]["loss_check"]


# ---- --model --trace: the sum of BN op times in a profiler trace --------------------------------

def test_model_trace_tiny(tmp_path, capsys):
    """--trace on the tiny CNN, 3 profiled steps per BN variant (two profiler windows of at
    most trace.CHUNK_ROUNDS = 2 rounds, merged): the per-step sums are positive finite
    numbers, the op types counted are registered TF ops (ours included), each variant
    counted its own BN kernels, and the ratios against TF fused are the medians' quotient.
    No timing assertions."""
    from tensorflow.python.framework import op_def_registry
    out = tmp_path / "t.json"
    rc = bench.main(["--model", "tiny", "--size", "16", "--batch", "4", "--reps", "2",
                     "--model-warmup", "1", "--bandwidth", "20", "--no-pair", "--no-progress",
                     "--trace", "--trace-steps", "3", "--json", str(out)])
    assert rc == 0
    printed = capsys.readouterr().out
    for text in ("BN op sum ms [IQR]", "op sum / TF fused", "sum of BN op times (trace)",
                 "not step - floor", "the profiler's overhead", "ours/TF BN ops (trace)"):
        assert text in printed, text
    data = json.loads(out.read_text())
    assert data["meta"]["config"]["trace"] is True
    (res,) = data["models"]
    tr = res["trace"]
    assert tr["steps_per_variant"] == 3 and tr["host_tracer_level"] == 3
    assert bench.models._trace.CHUNK_ROUNDS == 2 and tr["profiler_windows"] == 2
    assert tr["nested_op_events"] == 0  # nothing counted twice
    assert tr["bn_layers"] == ["bn0", "bn1", "bn2"]
    assert {"relu0", "relu1", "relu2"} <= set(tr["act_layers"])
    for t in tr["op_types_counted"]:
        assert op_def_registry.get(t) is not None, t
    v = res["variants"]
    traced = {k for k, e in v.items() if "trace" in e}
    assert traced == {k for k in v if bench.models._VARIANTS[k].floor is not None}
    kernel = bench.models._trace.BN_KERNEL_TYPE
    for k in traced:
        e = v[k]["trace"]
        for what in ("bn_ops", "bn_act_ops", "bn_kernels"):
            assert len(e[what]["samples_ms"]) == 3
            assert all(math.isfinite(x) and x >= 0 for x in e[what]["samples_ms"]), (k, what)
        assert all(x > 0 for x in e["bn_ops"]["samples_ms"]), k
        for a, b in zip(e["bn_ops"]["samples_ms"], e["bn_act_ops"]["samples_ms"]):
            assert b >= a
        assert math.isfinite(e["overhead"]) and e["overhead"] > 0
        types = set(e["op_types"])
        if k == "keras":   # Keras 3's BN is unfused TF ops: no BN kernel
            assert not any(kernel.match(t) for t in types) and "SquaredDifference" in types
            assert e["bn_kernels"]["median_ms"] == 0
        else:
            assert e["bn_kernels"]["median_ms"] > 0
        if k == "tf_fused":
            assert any(t.endswith(("FusedBatchNormV3", "FusedBatchNormEx")) for t in types)
            assert any(t.endswith("FusedBatchNormGradV3") for t in types)
            assert not any(t.startswith("FbnGrad>") for t in types)
        if k == "ours":
            assert {"FbnGrad>FusedBatchNormV3", "FbnGrad>FusedBatchNormGradV3"} <= types
        if k == "ours_converted":   # BN+ReLU fused: no activation ops left outside the BN op
            assert {"FbnGrad>FusedBatchNormEx", "FbnGrad>FusedBatchNormGradEx"} <= types
            assert not e["act_op_types"]
        for what in ("bn_ops", "bn_act_ops"):
            if k == "tf_fused" or (what, k) == ("bn_ops", "ours_converted"):
                # the base; ours conv's BN ops hold its fused activation: only BN+act compares
                assert "x_" + what not in e
                continue
            point, lo, hi = e["x_" + what]
            assert point == pytest.approx(
                e[what]["median_ms"] / v["tf_fused"]["trace"][what]["median_ms"], rel=1e-3)
            assert lo <= hi
    (row,) = data["summary"]
    assert row["trace_ours_over_tf_bn_ops"][0] > 0
    assert set(row["trace_bn_ops_ms"]) == traced


def _xspace(events):
    """A host plane like the profiler's: events [(line, name, start ns, duration ns, stats)]."""
    pb2 = bench.models._trace.xplane_pb2()
    space = pb2.XSpace()
    plane = space.planes.add(id=0, name=bench.models._trace.HOST_PLANE)
    ids, lines = {}, {}
    plane.stat_metadata[1].id, plane.stat_metadata[1].name = 1, "variant"
    plane.stat_metadata[2].id, plane.stat_metadata[2].name = 2, "rep"
    plane.stat_metadata[3].id, plane.stat_metadata[3].name = 3, "ours"
    for line, name, start, dur, stats in events:
        if name not in ids:
            ids[name] = len(ids) + 1
            plane.event_metadata[ids[name]].id = ids[name]
            plane.event_metadata[ids[name]].name = name
        if line not in lines:
            lines[line] = plane.lines.add(id=len(lines), name=line, timestamp_ns=1000)
        ev = lines[line].events.add(metadata_id=ids[name], offset_ps=start * 1000,
                                    duration_ps=dur * 1000)
        for sid, val in stats:
            s = ev.stats.add(metadata_id=sid)
            if sid == 1:
                s.ref_value = val
            else:
                s.int64_value = val
    return space


def test_trace_parsing():
    """The XSpace reading on a made-up trace: ops attributed to the step marker they start
    in, name scopes matched with Keras' "_<n>" suffix, containers and ops outside any step
    left out, kernels counted by type."""
    tr = bench.models._trace
    step = [(1, 3), (2, 0)]   # variant: ref to stat metadata 3 ("ours"), rep 0
    space = _xspace([
        ("python", tr.STEP_MARKER, 0, 1000, step),
        ("tf_Compute/1", "m_1/bn0_1/FusedBatchNormV3:FbnGrad>FusedBatchNormV3", 10, 100, []),
        ("tf_Compute/1", "gradient_tape/m_1/bn0_1/G:FbnGrad>FusedBatchNormGradV3", 200, 50, []),
        ("tf_Compute/2", "m_1/bn0_1/AssignVariableOp:AssignVariableOp", 20, 5, []),
        ("tf_Compute/2", "m_1/relu0_1/Relu:Relu", 30, 7, []),
        ("tf_Compute/2", "m_1/bn00_1/Mul:Mul", 40, 3, []),          # not layer bn0
        ("tf_Compute/2", "m_1/bn0_1/f:StatefulPartitionedCall", 50, 300, []),  # container
        ("tf_Compute/1", "ThreadpoolListener::Record", 300, 9, []),  # not an op
        ("tf_Compute/1", "m_1/bn0_1/late:Mul", 2000, 11, []),        # after the step
    ])
    steps, nested = tr.step_ops(space)
    assert nested == 0
    (s,) = steps
    assert (s["variant"], s["rep"]) == ("ours", 0)
    assert len(s["ops"]) == 5
    sums = tr.step_sums(s["ops"], {"bn0"}, {"relu0"})
    assert sums["bn_ops"] == pytest.approx(155e-6)        # 100 + 50 + 5 ns, in ms
    assert sums["bn_act_ops"] == pytest.approx(162e-6)
    assert sums["bn_kernels"] == pytest.approx(150e-6)
    assert set(sums["types"]) == {"FbnGrad>FusedBatchNormV3", "FbnGrad>FusedBatchNormGradV3",
                                  "AssignVariableOp"}
    assert sums["act_types"] == {"Relu": (pytest.approx(7e-6), 1)}
    assert tr.per_variant_sums(steps, ["ours"], {"bn0"}, set())["ours"][0]["bn_ops"] == \
        pytest.approx(155e-6)
    for t in ("FusedBatchNormV3", "FusedBatchNormGradV3", "_MklNativeFusedBatchNormV3",
              "_MklNativeFusedBatchNormGradV3", "_MklNativeFusedBatchNormEx", "_FusedBatchNormEx",
              "FbnGrad>FusedBatchNormGradEx"):
        assert tr.BN_KERNEL_TYPE.match(t), t
    for t in ("Mul", "FusedBatchNormish", "BatchNorm"):
        assert not tr.BN_KERNEL_TYPE.match(t), t


def test_traced_sums_merges_windows(monkeypatch):
    """traced_sums records in windows of chunk_rounds rounds (rounds numbered on from one
    window to the next, so the rotation and the rep stats continue) and concatenates each
    window's per-step sums and wall times in round order."""
    tr = bench.models._trace
    calls = []

    def fake_record(steps, keys, reps, progress=None, first_round=0):
        calls.append((first_round, reps))
        events = []
        for r in range(first_round, first_round + reps):
            t0 = 10_000 * r
            events.append(("python", tr.STEP_MARKER, t0, 1000, [(1, 3), (2, r)]))
            events.append(("tf_Compute/1", "m/bn0/FusedBatchNormV3:FbnGrad>FusedBatchNormV3",
                           t0 + 10, 100 + r, []))
        wall = {"ours": [float(r) for r in range(first_round, first_round + reps)]}
        return _xspace(events), wall, {"start_s": 0.5, "steps_s": 1.0, "stop_s": 0.25,
                                        "xplane_bytes": 7}

    monkeypatch.setattr(tr, "record", fake_record)
    windows = []
    sums, wall, total = tr.traced_sums({}, ["ours"], 5, {"bn0"}, set(), chunk_rounds=2,
                                       progress=windows.append)
    assert calls == [(0, 2), (2, 2), (4, 1)]
    assert windows == [1, 2, 3] and total["windows"] == 3 == tr.window_count(5, 2)
    assert total["xplane_bytes"] == 21 and total["stop_s"] == pytest.approx(0.75)
    assert total["nested_op_events"] == 0
    assert wall["ours"] == [0.0, 1.0, 2.0, 3.0, 4.0]
    assert [s["bn_ops"] for s in sums["ours"]] == pytest.approx(
        [(100 + r) * 1e-6 for r in range(5)])
    with pytest.raises(ValueError, match="chunk_rounds"):
        tr.traced_sums({}, ["ours"], 1, set(), set(), chunk_rounds=0)


def user_cnn():
    """A model of a user's (for --model package.module:factory): non-square input, 5 classes."""
    import keras
    L = keras.layers
    inp = keras.Input((12, 20, 3))
    h = L.ReLU()(L.BatchNormalization()(L.Conv2D(8, 3, padding="same")(inp)))
    h = L.BatchNormalization()(L.Conv2D(8, 3, strides=2, padding="same")(h))
    return keras.Model(inp, L.Dense(5)(L.GlobalAveragePooling2D()(h)), name="user_cnn")


@pytest.mark.parametrize("kind", ["factory", "file"])
def test_model_mode_on_a_users_model(kind, tmp_path, monkeypatch, capsys):
    """--model takes a model of the user's, as a .keras file or a module:factory: built
    from it with its own input shape and classes, converted and compared the same way."""
    if kind == "factory":
        monkeypatch.syspath_prepend(os.path.dirname(os.path.abspath(__file__)))
        spec = "test_bench_smoke:user_cnn"
    else:
        spec = str(tmp_path / "user.keras")
        user_cnn().save(spec)
    out = tmp_path / "u.json"
    args = ["--model", spec] + MODEL_TINY[2:] + ["--json", str(out)]
    assert bench.main(args) == 0
    assert "%s  batch 4, 12x20x3, float32: 2 BN layers" % spec in capsys.readouterr().out
    (res,) = json.loads(out.read_text())["models"]
    assert res["input"] == "12x20x3" and res["bn_layers"] == 2
    assert res["bn_elements"] == 4 * (12 * 20 * 8 + 6 * 10 * 8)
    assert set(res["variants"]) >= {"keras", "tf_fused", "ours", "floor"}
    assert all(r <= 1e-3 for r in res["loss_check"].values())
    with pytest.raises(SystemExit):
        bench.main(["--model", str(tmp_path / "missing.keras")] + MODEL_TINY[2:])


def no_bn_model():
    """A model without BatchNormalization, for --model package.module:factory."""
    import keras
    inp = keras.Input((8, 8, 3))
    return keras.Model(inp, keras.layers.Dense(2)(keras.layers.GlobalAveragePooling2D()(
        keras.layers.Conv2D(4, 3)(inp))))


def failing_factory():
    raise RuntimeError("factory boom")


def not_a_model():
    return 3


@pytest.mark.parametrize("spec,message", [
    ("test_bench_smoke:no_bn_model", "has no BatchNormalization layer"),
    ("test_bench_smoke:failing_factory", "the factory raised RuntimeError: factory boom"),
    ("test_bench_smoke:no_such_function", "cannot import no_such_function"),
    ("test_bench_smoke:not_a_model", "expected a keras.Model, got int"),
])
def test_model_mode_users_model_errors_are_one_line(spec, message, monkeypatch, capsys):
    """A model of the user's that the bench cannot run: exit 2 and one error line naming it,
    no traceback."""
    monkeypatch.syspath_prepend(os.path.dirname(os.path.abspath(__file__)))
    assert bench.main(["--model", spec] + MODEL_TINY[2:]) == 2
    err = capsys.readouterr().err
    assert "error: --model %s: " % spec in err and message in err and "Traceback" not in err


def test_model_mode_saved_file_under_another_policy_is_refused(tmp_path, capsys):
    spec = str(tmp_path / "user.keras")
    user_cnn().save(spec)  # float32 layers
    assert bench.main(["--model", spec, "--policy", "mixed_bfloat16"] + MODEL_TINY[2:]) == 2
    assert "run it with --policy float32" in capsys.readouterr().err


@pytest.mark.parametrize("argv,message", [
    (["--reps", "0"], "--reps: must be at least 1"),
    (["--budget", "-1"], "--budget: must be a positive number"),
    (["--bandwidth-mib", "0"], "--bandwidth-mib: must be at least 1"),
    (["--min-reps", "10", "--max-reps", "2"], "--min-reps 10 is above --max-reps 2"),
    (["--model", "tiny", "--batch", "0"], "--batch: must be at least 1"),
    (["--model", "tiny", "--pair-reps", "0"], "--pair-reps: must be at least 1"),
    (["--model", "tiny", "--trace-steps", "0"], "--trace-steps: must be at least 1"),
    (["--model", "tiny", "--classes", "1"], "--classes: must be at least 2"),
    (["--model", "tiny", "--plot", "x.png"], "--plot: the backward grid's option"),
    (["--model", "tiny", "--shapes", "2x4x4x8"], "--shapes: the backward grid's option"),
    (["--model", "tiny", "--variants", "ours,bogus"], "--variants"),
    (["--model", "nosuchnet"], "unknown model(s) nosuchnet"),
    (["--quick", "--dtypes", "f32", "--store", "/tmp/never"], "--dtypes select(s) a part"),
])
def test_bad_arguments_exit_2_with_usage(argv, message, capsys):
    with pytest.raises(SystemExit) as info:
        bench.main(argv)
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: ") and message in err


def test_interrupt_is_one_line_and_exit_130(monkeypatch, capsys):
    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt
    monkeypatch.setattr(bench.cli, "run", interrupted)
    assert bench.main(["--shapes", "2x4x4x8", "--no-eigen", "--bandwidth-mib", "1"]) == 130
    err = capsys.readouterr().err
    assert "interrupted (Ctrl-C)" in err and "Traceback" not in err


def test_correctness_failure_is_one_line_and_exit_1(monkeypatch, capsys):
    def wrong(*args, **kwargs):
        raise bench.CorrectnessError("dx rel err 1 > 1e-5")
    monkeypatch.setattr(bench.cli, "run", wrong)
    assert bench.main(["--shapes", "2x4x4x8", "--no-eigen", "--bandwidth-mib", "1"]) == 1
    assert "error: correctness check failed: dx rel err" in capsys.readouterr().err


def test_machine_meta_records_huge_pages(tmp_path):
    """Stored runs say whether our ops advise huge pages and what the kernel's THP mode is."""
    from fbn_grad_tf import core
    from fbn_grad_tf.bench import timing
    meta = timing._machine_meta()
    assert meta["fbn_grad_tf_hugepages"] is bool(core.hugepage_advice())
    assert meta["thp_mode"] in ("always", "madvise", "never", None)
    assert ("huge pages %s (THP %s)" % ("on" if meta["fbn_grad_tf_hugepages"] else "off",
                                        meta["thp_mode"] or "n/a")) in meta["fbn_grad_tf_isa"]
    for text, want in [("always [madvise] never\n", "madvise"),
                       ("[always] madvise never", "always"),
                       ("always madvise [never]", "never"), ("garbage", None)]:
        f = tmp_path / "enabled"
        f.write_text(text)
        assert timing.thp_mode(str(f)) == want
    assert timing.thp_mode(str(tmp_path / "missing")) is None
