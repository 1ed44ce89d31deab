"""What users install, tested the way they install it.

* A wheel built from this checkout (``pip wheel --no-build-isolation --no-deps``) is installed
  with pip into a fresh virtual environment, which reuses this environment's TensorFlow
  through a .pth file (not --system-site-packages: that would expose the base interpreter's
  packages, not this venv's). From a directory outside the source tree the new environment
  imports fbn_grad_tf, checks that it is the installed copy, reads ``build_info`` and runs
  our op against TF's FusedBatchNormGradV3 and our forward against TF's FusedBatchNormV3.
* The sdist contains every source file of the build (all of csrc/, BUILD, setup.py,
  pyproject.toml, MANIFEST.in), and a wheel builds from it (CPU-only, to keep CI time).

The wheel build reuses the object cache under build/fbn-obj/ (same configuration as the
editable install of scripts/setup_env.sh), so it only links; the sdist build compiles the
CPU kernels from scratch (about a minute on 2 cores).
"""
import json
import os
import subprocess
import sys
import tarfile
import textwrap

import pytest

from helpers import subprocess_env

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

CHECK_SCRIPT = textwrap.dedent("""
    import json, os, sys
    import numpy as np
    import tensorflow as tf
    import fbn_grad_tf
    from fbn_grad_tf import core

    venv = os.path.realpath(sys.argv[1])
    here = os.path.realpath(os.path.dirname(fbn_grad_tf.__file__))
    assert here.startswith(venv + os.sep), (here, venv)
    info = fbn_grad_tf.build_info
    rng = np.random.default_rng(0)
    x = rng.standard_normal((4, 5, 5, 3)).astype(np.float32)
    dy = rng.standard_normal(x.shape).astype(np.float32)
    scale = np.array([0.5, 1.0, 2.0], np.float32)
    empty = np.zeros(0, np.float32)
    fwd_tf = tf.raw_ops.FusedBatchNormV3(x=x, scale=scale, offset=-scale, mean=empty,
                                         variance=empty, epsilon=1e-3, is_training=True)
    fwd = fbn_grad_tf.fused_batch_norm_v3(x, scale, -scale, empty, empty, epsilon=1e-3)
    kw = dict(y_backprop=dy, x=x, scale=scale, reserve_space_1=fwd_tf[3],
              reserve_space_2=fwd_tf[4], reserve_space_3=empty, epsilon=1e-3)
    ours = fbn_grad_tf.fused_batch_norm_grad(**kw)
    theirs = tf.raw_ops.FusedBatchNormGradV3(**kw)
    print(json.dumps({
        "file": here,
        "build_info": info.as_dict(),
        "tf_version": tf.__version__,
        "grad_err": max(float(np.max(np.abs(a.numpy() - b.numpy())))
                        for a, b in zip(ours[:3], theirs[:3])),
        "forward_err": max(float(np.max(np.abs(a.numpy() - b.numpy())))
                           for a, b in zip(fwd[:5], fwd_tf[:5])),
        "core_isa": core.default_isa(),
    }))
""")


def run(cmd, cwd, env=None, timeout=900):
    proc = subprocess.run(cmd, cwd=cwd, env=env or subprocess_env(), capture_output=True,
                          text=True, timeout=timeout)
    assert proc.returncode == 0, "%s failed (%d):\n%s\n%s" % (
        " ".join(map(str, cmd)), proc.returncode, proc.stdout[-4000:], proc.stderr[-4000:])
    return proc.stdout


def fresh_venv_reusing_this_one(path):
    """A new venv (with pip) whose site-packages also sees this venv's site-packages."""
    run([sys.executable, "-m", "venv", str(path)], cwd=str(path.parent))
    py = path / "bin" / "python"
    site = run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
               cwd=str(path)).strip()
    ours = [p for p in sys.path if p.endswith("site-packages") and os.path.isdir(p)]
    with open(os.path.join(site, "zz_reuse_test_venv.pth"), "w") as f:
        f.write("\n".join(ours) + "\n")
    return py


def install_and_check(wheel_dir, tmp_path, name):
    wheels = sorted(wheel_dir.glob("fbn_grad_tf-*.whl"))
    assert len(wheels) == 1, wheels
    venv = tmp_path / name
    py = fresh_venv_reusing_this_one(venv)
    run([str(py), "-m", "pip", "install", "-q", "--no-index", "--no-deps", str(wheels[0])],
        cwd=str(tmp_path))
    outside = tmp_path / "elsewhere"
    outside.mkdir(exist_ok=True)
    script = outside / "check.py"
    script.write_text(CHECK_SCRIPT)
    out = run([str(py), str(script), str(venv)], cwd=str(outside))
    return json.loads(out.strip().splitlines()[-1])


def test_wheel_installs_into_fresh_venv_and_runs_outside_tree(tmp_path):
    import tensorflow as tf
    import fbn_grad_tf
    wheel_dir = tmp_path / "wheel"
    run([sys.executable, "-m", "pip", "wheel", "-q", "--no-build-isolation", "--no-deps",
         "-w", str(wheel_dir), ROOT], cwd=str(tmp_path))
    res = install_and_check(wheel_dir, tmp_path, "venv_wheel")
    info = res["build_info"]
    assert info["TF_VERSION"] == tf.__version__ == res["tf_version"]
    assert info["BUILD"] == "all"
    # Same configuration as the build under test here (CUDA compiled in or not).
    assert info["WITH_CUDA"] == fbn_grad_tf.build_info.WITH_CUDA
    assert res["grad_err"] < 1e-5 and res["forward_err"] < 1e-5


def git_files(*paths):
    try:
        out = subprocess.run(["git", "ls-files", *paths], cwd=ROOT, capture_output=True,
                             text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return None
    return [line for line in out.splitlines() if line]


def test_sdist_has_every_build_source_and_builds_a_working_wheel(tmp_path):
    tracked = git_files("csrc", "python", "BUILD", "setup.py", "pyproject.toml", "MANIFEST.in",
                        "README.md", "requirements.txt")
    if tracked is None:
        pytest.skip("not a git checkout: no list of tracked sources to compare with")
    dist = tmp_path / "dist"
    run([sys.executable, "setup.py", "-q", "sdist", "-d", str(dist)], cwd=ROOT)
    tars = sorted(dist.glob("fbn_grad_tf-*.tar.gz"))
    assert len(tars) == 1, tars
    with tarfile.open(tars[0]) as tar:
        names = tar.getnames()
        top = names[0].split("/")[0]
        inside = {n[len(top) + 1:] for n in names}
        missing = [f for f in tracked if f not in inside
                   and os.path.exists(os.path.join(ROOT, f))]
        assert not missing, "sdist lacks: %s" % missing
        assert not any(n.endswith((".so", ".o")) for n in inside), "built files in the sdist"
        tar.extractall(tmp_path / "src", filter="data")
    # Build a wheel from the unpacked sdist, as `pip install fbn_grad_tf-*.tar.gz` does.
    wheel_dir = tmp_path / "wheel"
    run([sys.executable, "-m", "pip", "wheel", "-q", "--no-build-isolation", "--no-deps",
         "-w", str(wheel_dir), str(tmp_path / "src" / top)], cwd=str(tmp_path),
        env=subprocess_env(FBN_GRAD_TF_CUDA="0"))
    res = install_and_check(wheel_dir, tmp_path, "venv_sdist")
    assert res["build_info"]["WITH_CUDA"] is False
    assert res["grad_err"] < 1e-5 and res["forward_err"] < 1e-5
