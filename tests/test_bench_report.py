"""The report over stored bench runs (fbn_grad_tf.bench report): its tables from small JSON
fixtures, the docs' GENERATED blocks, and the machine-kind labels the runs are stored under.
No timing runs."""
import json
import os
import re

import pytest

pytest.importorskip("tensorflow")
bench = pytest.importorskip("fbn_grad_tf.bench")
from fbn_grad_tf.bench import results_report as rr  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SLUG = "intel-xeon-avx-512-bf16-fp16-amx"
KIND = "Intel Xeon (AVX-512 BF16/FP16, AMX)"


def _meta(name, command, date="2026-12-06T01:02:03+00:00", **extra):
    meta = {"command": command, "cpu": "Intel(R) Xeon(R) Processor", "cores": 2,
            "machine_kind": KIND, "machine_slug": SLUG, "fbn_grad_tf_isa_path": "avx512bf16",
            "bandwidth_gbs": 30.0, "tf_version": "2.21.0", "fbn_grad_tf_version": "0.2.0",
            "date": date, "result_name": name, "loadavg_1min_start": 0.52,
            "loadavg_1min_end": 2.04}
    meta.update(extra)
    return meta


def _variant(samples, cost_act=None, trace=None):
    s = sorted(samples)
    e = {"step": {"median_ms": s[len(s) // 2], "q25_ms": s[0], "q75_ms": s[-1]},
         "samples_ms": samples}
    if cost_act is not None:
        e["cost_act"] = {"samples_ms": cost_act, "floor": "floor_act"}
    if trace is not None:
        e["trace"] = {"x_bn_act_ops": trace}
    return e


def _models_run(policy):
    # Per repetition TF fused takes exactly 2x and Keras 3 3x ours conv's step, and ours conv's
    # BN+act cost is half TF fused's: every bootstrap resample gives the same ratio.
    conv = [10.0, 11.0, 9.0]
    variants = {"keras": _variant([3 * t for t in conv]),
                "tf_fused": _variant([2 * t for t in conv], cost_act=[4.0, 4.4, 3.6]),
                "ours_converted": _variant(conv, cost_act=[2.0, 2.2, 1.8],
                                           trace=[0.61, 0.55, 0.67])}
    return {"meta": _meta("models-" + policy, "python -m fbn_grad_tf.bench --model resnet50 "
                          "--policy %s --reps 3 --trace --store" % policy, mode="model",
                          config={"policy": policy, "batch": 16, "size": 96, "reps": 3,
                                  "trace_steps": 5, "seed": 1234, "bootstrap": 200}),
            "models": [{"model": "resnet50", "policy": policy, "variants": variants,
                        "trace": {}}]}


def _quick_run():
    results = []
    for shape, x_train, x_infer in (((32, 28, 28, 512), 2.0, 1.0), ((256, 1, 1, 4096), 8.0, 0.25)):
        for mode, x in (("training", x_train), ("inference", x_infer)):
            results.append({"shape": list(shape), "tensor_shape": list(shape), "format": "NHWC",
                            "dtype": "float32", "mode": mode, "ours_ms": 1.5,
                            "speedup_onednn": x})
    return {"meta": _meta("quick", "python -m fbn_grad_tf.bench --quick --store", mode="ops"),
            "results": results}


def _layer_run():
    group = {"dtype": "float32", "format": "NHWC", "tf_ours": 0.91, "tf_relu": 1.02, "tf": 1.17,
             "keras": 5.22, "torch": None}
    group.update({k + "_n": 6 for k in ("tf_ours", "tf_relu", "tf", "keras")})
    group["torch_n"] = 0
    return {"meta": _meta("layer", "python -m fbn_grad_tf.bench --layer --store", mode="layer",
                          ratio_base="ours", ratio_base_relu="ours_relu"),
            "summary": {"speedups": [group]}}


@pytest.fixture
def stored(tmp_path):
    d = tmp_path / "results" / SLUG
    d.mkdir(parents=True)
    for name, run in (("models-float32", _models_run("float32")),
                      ("models-mixed_bfloat16", _models_run("mixed_bfloat16")),
                      ("quick", _quick_run()), ("layer", _layer_run())):
        (d / (name + ".json")).write_text(json.dumps(run))
    (tmp_path / "results" / "notes.json").write_text("[1, 2]")  # not a run: left out
    return tmp_path / "results"


def _rows(block, first):
    """The table rows (lists of cells) whose first cell is `first`."""
    return [[c.strip() for c in line.strip("|").split("|")] for line in block.split("\n")
            if line.startswith("| %s " % first)]


def test_blocks_from_fixtures(stored):
    runs = bench.load_runs([str(stored)])
    assert len(runs) == 4
    gen = bench.blocks(runs)
    assert set(gen) == {"models-" + SLUG, "ops-" + SLUG, "layer-" + SLUG}

    models = gen["models-" + SLUG]
    rows = _rows(models, "resnet50")
    assert len(rows) == 2  # one table per policy
    assert rows[0] == ["resnet50", "30.0", "20.0", "10.0", "2.00x [2.00, 2.00]",
                       "3.00x [3.00, 3.00]", "0.50x [0.50, 0.50]", "0.61x [0.55, 0.67]"]
    # each table headed by the run it comes from: command, CPU, machine kind, TF, date
    heads = [line for line in models.split("\n") if line.startswith("**")]
    assert [h.split("**")[1] for h in heads] == ["float32", "mixed_bfloat16"]
    for h, policy in zip(heads, ("float32", "mixed_bfloat16")):
        for text in ("`python -m fbn_grad_tf.bench --model resnet50 --policy %s --reps 3 "
                     "--trace --store`" % policy, "Intel(R) Xeon(R) Processor, 2 cores", KIND,
                     "TF 2.21.0", "2026-12-06T01:02:03+00:00", "batch 16, 96x96 images",
                     "load average 0.5 at start, 2.0 at end"):
            assert text in h, text

    ops = gen["ops-" + SLUG]
    assert _rows(ops, "32x28x28x512") == [["32x28x28x512", "NHWC", "float32", "1.500", "2.00x",
                                           "1.500", "1.00x"]]
    assert _rows(ops, "geomean, 4 cases") == [["geomean, 4 cases", "", "", "", "4.00x", "",
                                               "0.50x"]]
    assert "training and inference: 1.41x" in ops   # (2 * 8 * 1 * 0.25) ** (1/4)
    assert "Run: `python -m fbn_grad_tf.bench --quick --store`;" in ops

    layer = gen["layer-" + SLUG]
    head = _rows(layer, "dtype")[0]
    assert head == ["dtype", "format", "shapes", "tf+ours / ours", "TF BN+ReLU / ours+ReLU",
                    "TF fused / ours", "Keras / ours", "PyTorch / ours"]
    assert _rows(layer, "float32") == [["float32", "NHWC", "6", "0.91x", "1.02x", "1.17x",
                                        "5.22x", "n/a"]]

    text = bench.report_text(runs)
    assert text.startswith("## " + KIND)
    assert text.index("### models-") < text.index("### ops-") < text.index("### layer-")


def _grid_run():
    """A full-grid (ops) run: float32 NHWC and NCHW, two shapes (one large), both modes; TF
    oneDNN refused NCHW inference; --chain 4."""
    results = []
    for fmt in ("NHWC", "NCHW"):
        for shape, elements, x, bw in (((32, 56, 56, 256), 25_690_112, 3.0, 0.62),
                                       ((256, 1, 1, 4096), 1_048_576, 0.9, 0.30)):
            tensor_shape = list(shape) if fmt == "NHWC" else [shape[0], shape[3], shape[1],
                                                              shape[2]]
            for mode in ("training", "inference"):
                refused = fmt == "NCHW" and mode == "inference"
                results.append({"shape": list(shape), "tensor_shape": tensor_shape,
                                "format": fmt, "dtype": "float32", "mode": mode,
                                "elements": elements, "ours_ms": 1.0,
                                "speedup_onednn": None if refused else x,
                                "bw_fraction": bw if mode == "training" else 2 * bw,
                                "chain_bw_fraction": bw + 0.04})
    return {"meta": _meta("ops", "python -m fbn_grad_tf.bench --chain 4 --store", mode="ops"),
            "results": results}


def test_grid_block(stored):
    (stored / SLUG / "ops.json").write_text(json.dumps(_grid_run()))
    gen = bench.blocks(bench.load_runs([str(stored)]))
    assert set(gen) == {"models-" + SLUG, "ops-" + SLUG, "grid-" + SLUG, "layer-" + SLUG}
    # the per-case table stays the quick run's when a full grid is stored beside it
    assert "Run: `python -m fbn_grad_tf.bench --quick --store`;" in gen["ops-" + SLUG]
    grid = gen["grid-" + SLUG]
    assert "Run: `python -m fbn_grad_tf.bench --chain 4 --store`;" in grid
    rows = _rows(grid, "float32")
    assert rows == [
        ["float32", "NHWC", "training", "2", "1.64x", "0.90x (256x1x1x4096)", "62%", "62%",
         "66%"],
        ["float32", "NHWC", "inference", "2", "1.64x", "0.90x (256x1x1x4096)", "124%", "124%",
         "66%"],
        ["float32", "NCHW", "training", "2", "1.64x", "0.90x (256x4096x1x1)", "62%", "62%",
         "66%"],
        ["float32", "NCHW", "inference", "0", "n/a", "n/a", "124%", "124%", "66%"]]
    assert "All 6 cases TF oneDNN ran: geomean 1.64x." in grid  # (3 * 0.9) ** (1/2)
    text = bench.report_text(bench.load_runs([str(stored)]))
    assert text.index("### ops-") < text.index("### grid-") < text.index("### layer-")


def test_blocks_show_tf_eigen_where_it_is_the_default(stored):
    """A run whose main process ran TF's Eigen kernels (oneDNN off by default): the ops and
    grid blocks add TF Eigen / ours beside TF oneDNN / ours (from the worker)."""
    grid = _grid_run()
    grid["meta"]["tf_backend_main"] = "eigen"
    for r in grid["results"]:
        r["speedup_eigen"] = 2 * r["speedup_onednn"] if r["speedup_onednn"] else None
    (stored / SLUG / "ops.json").write_text(json.dumps(grid))
    quick = json.loads((stored / SLUG / "quick.json").read_text())
    quick["meta"]["tf_backend_main"] = "eigen"
    for r in quick["results"]:
        r["speedup_eigen"] = 3.0
    (stored / SLUG / "quick.json").write_text(json.dumps(quick))
    gen = bench.blocks(bench.load_runs([str(stored)]))
    ops = gen["ops-" + SLUG]
    assert _rows(ops, "shape")[0] == [
        "shape", "format", "dtype", "training ours ms", "training TF oneDNN / ours",
        "training TF Eigen / ours", "inference ours ms", "inference TF oneDNN / ours",
        "inference TF Eigen / ours"]
    assert _rows(ops, "32x28x28x512") == [["32x28x28x512", "NHWC", "float32", "1.500", "2.00x",
                                           "3.00x", "1.500", "1.00x", "3.00x"]]
    assert "TF Eigen / ours, geomean 3.00x" in ops
    rows = _rows(gen["grid-" + SLUG], "float32")
    assert rows[0][-2:] == ["3.29x", "1.80x (256x1x1x4096)"]  # (6 * 1.8) ** (1/2)
    assert rows[3][-2:] == ["n/a", "n/a"]  # neither TF backend ran NCHW inference
    assert "TF Eigen / ours, geomean 3.29x" in gen["grid-" + SLUG]


def test_blocks_without_eigen_default_have_no_eigen_columns(stored):
    (stored / SLUG / "ops.json").write_text(json.dumps(_grid_run()))
    gen = bench.blocks(bench.load_runs([str(stored)]))
    assert "TF Eigen" not in gen["ops-" + SLUG] and "TF Eigen" not in gen["grid-" + SLUG]


def _block(name, body):
    return "<!-- BEGIN GENERATED: %s -->\n%s\n<!-- END GENERATED: %s -->\n" % (name, body, name)


def test_update_docs(stored, tmp_path):
    gen = bench.blocks(bench.load_runs([str(stored)]))
    (tmp_path / "docs").mkdir()
    doc = tmp_path / "docs" / "X.md"
    # ours with a hand-typed figure; one of ours no run makes; another generator's block
    tail = _block("layer-gone", "old") + _block("compat", "another tool's")
    doc.write_text("# X\n\n" + _block("ops-" + SLUG, "hand-typed 9.99x") + "\ntext after\n" + tail)
    (tmp_path / "README.md").write_text("no blocks here\n")
    changed, placed, unknown = bench.update_docs(gen, str(tmp_path))
    assert changed == [str(doc)] and placed == {"ops-" + SLUG} and unknown == {"layer-gone"}
    text = doc.read_text()
    assert "9.99x" not in text and text.endswith("text after\n" + tail)
    assert bench.doc_blocks(text) == [("ops-" + SLUG, gen["ops-" + SLUG]), ("layer-gone", "old"),
                                      ("compat", "another tool's")]
    assert bench.update_docs(gen, str(tmp_path))[0] == []  # a second run changes nothing
    with pytest.raises(ValueError):
        bench.doc_blocks("<!-- BEGIN GENERATED: a -->\n<!-- END GENERATED: b -->\n")
    with pytest.raises(ValueError):
        bench.doc_blocks("<!-- BEGIN GENERATED: a -->\nno end\n")


def test_report_command(stored, tmp_path, capsys):
    assert bench.main(["report", str(stored)]) == 0
    out = capsys.readouterr().out
    assert "### models-" + SLUG in out and "| resnet50 | 30.0 |" in out
    assert bench.main(["report", str(tmp_path / "empty")]) == 1


def test_report_refuses_what_is_not_a_stored_run(stored, tmp_path, capsys):
    """A path that does not exist, a file that is not JSON, JSON that is not a run, and
    --update-docs where there are no docs: an error line and exit 1, no traceback."""
    bad = tmp_path / "bad.json"
    bad.write_text("garbage{")
    meta_only = tmp_path / "meta_only.json"
    meta_only.write_text('{"meta": {"x": 1}}')
    for argv, message in ((["report", str(tmp_path / "missing")], "no such file or directory"),
                          (["report", str(bad)], "is not JSON"),
                          (["report", str(meta_only)], "no stored runs"),
                          (["report", "--update-docs", "--root", str(tmp_path / "nodocs"),
                            str(stored)], "no README.md or docs/*.md")):
        assert bench.main(argv) == 1
        assert message in capsys.readouterr().err


def test_report_chart_is_written_beside_its_runs(stored, tmp_path, monkeypatch, capsys):
    """--chart on a JSON file of a --model run: models.png beside that file, never under the
    current directory's docs/results."""
    pytest.importorskip("matplotlib")
    run = next(p for p in stored.rglob("models-float32.json"))
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    copy = elsewhere / "m.json"
    copy.write_text(run.read_text())
    monkeypatch.chdir(tmp_path)
    assert bench.main(["report", "--chart", str(copy)]) == 0
    assert (elsewhere / "models.png").exists() and not (tmp_path / "docs").exists()


def test_chart(stored, tmp_path):
    pytest.importorskip("matplotlib")
    runs = [r for r in bench.load_runs([str(stored)]) if "models" in r]
    path = tmp_path / "models.png"
    assert rr.chart(runs, str(path), KIND) is None
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_docs_blocks_are_generated():
    """Every GENERATED block in README.md and docs/*.md is what the report makes from the stored
    runs in docs/results/ now: a hand edit of a block, or a stored run changed without
    `python -m fbn_grad_tf.bench report --update-docs`, fails here."""
    runs = bench.load_runs([os.path.join(ROOT, "docs", "results")]) \
        if os.path.isdir(os.path.join(ROOT, "docs", "results")) else []
    gen = bench.blocks(runs)
    for path in rr.doc_files(ROOT):
        with open(path) as f:
            for name, content in bench.doc_blocks(f.read()):
                if not rr.ours(name):  # another generator's block
                    continue
                rel = os.path.relpath(path, ROOT)
                assert name in gen, "%s: block %s has no stored run behind it" % (rel, name)
                assert content == gen[name], (
                    "%s: block %s differs from the stored runs; run `python -m fbn_grad_tf."
                    "bench report --update-docs`" % (rel, name))


def test_stored_runs_name_their_machine():
    """Each stored run lies under its machine kind's slug and says how it was made."""
    d = os.path.join(ROOT, "docs", "results")
    for run in bench.load_runs([d]) if os.path.isdir(d) else []:
        meta = run["meta"]
        assert os.path.basename(os.path.dirname(run["path"])) == meta["machine_slug"]
        assert bench.kind_slug(meta["machine_kind"]) == meta["machine_slug"]
        assert os.path.basename(run["path"]) == meta["result_name"] + ".json"
        assert meta["command"].startswith("python -m fbn_grad_tf.bench ")
        assert re.match(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\+00:00$", meta["date"])


@pytest.mark.parametrize("args, kind", [
    (("GenuineIntel", "Intel(R) Xeon(R) Processor", 6, 207,
      {"avx2", "avx512f", "avx512_bf16", "avx512_fp16", "amx_tile"}), KIND),
    (("GenuineIntel", "Intel(R) Xeon(R) Platinum 8259CL", 6, 85, {"avx2", "avx512f"}),
     "Intel Xeon (AVX-512)"),
    (("AuthenticAMD", "AMD EPYC 9R14 96-Core Processor", 25, 17,
      {"avx2", "avx512f", "avx512_bf16"}), "AMD EPYC Zen 4"),
    (("AuthenticAMD", "AMD EPYC 7B13 64-Core Processor", 25, 1, {"avx2"}), "AMD EPYC Zen 3"),
    (("HygonGenuine", "Hygon C86", 24, 1, {"avx2"}), "x86-64 AVX2"),
])
def test_machine_kind(args, kind):
    assert bench.machine_kind(*args, machine="x86_64") == kind
    assert re.match(r"^[a-z0-9]+(-[a-z0-9]+)*$", bench.kind_slug(kind))


def test_result_names():
    p = bench.build_parser()
    for argv, name in ((["--quick"], "quick"), ([], "ops"), (["--layer"], "layer"),
                       (["--layer", "--quick"], "layer-quick"),
                       (["--model", "tiny"], "models-float32"),
                       (["--model", "tiny", "--policy", "mixed_bfloat16"],
                        "models-mixed_bfloat16")):
        assert bench.result_name(p.parse_args(argv)) == name
    args = p.parse_args(["--quick", "--store"])
    assert args.store == bench.RESULTS_DIR
    assert bench.stored_path({"machine_slug": SLUG}, "quick") == os.path.join(
        "docs", "results", SLUG, "quick.json")
    assert bench.command_line(["--json", "a b.json"]) == \
        "python -m fbn_grad_tf.bench --json 'a b.json'"
