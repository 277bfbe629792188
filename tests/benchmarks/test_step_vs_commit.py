"""benchmarks/step_vs_commit.py: an older commit's lowmem against this checkout's, alternated in one
process, on the pre-activation ResNet or an .onnx file (NumPy paths: no JIT of the old copy)."""
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(ROOT, "benchmarks", "step_vs_commit.py")


def run(*args):
    env = dict(os.environ, LOWMEM_FAST="0")
    return subprocess.run([sys.executable, SCRIPT, *map(str, args)], capture_output=True, text=True, timeout=600,
                          env=env, cwd=ROOT)


def test_an_onnx_file_against_the_last_commit(tmp_path):
    pytest.importorskip("onnx")
    if subprocess.run(["git", "-C", ROOT, "rev-parse", "HEAD"], capture_output=True).returncode:
        pytest.skip("not a git checkout")
    from lowmem import models
    from lowmem.formats import onnx_export
    path = onnx_export.export_onnx(models.build_model("preact-cifar", 8, num_classes=7), tmp_path / "net.onnx",
                                   input_shape=(3, 12, 12))
    r = run("HEAD", "--model", path, "--batch", 4, "--bits", 4, "--rounds", 2, "--warmup", 0)
    assert r.returncode == 0, r.stderr
    res = json.loads(r.stdout.strip().splitlines()[-1])
    assert res["model"] == str(path) and res["depth"] is None and res["batch"] == 4
    assert res["plan_old"] == res["plan_new"] > 0            # the same network and plan in both copies
    assert res["ratio_min"] <= res["ratio_median"] <= res["ratio_max"]


def test_a_file_it_cannot_read(tmp_path):
    r = run("HEAD", "--model", tmp_path / "missing.onnx", "--rounds", 1)
    assert r.returncode == 2 and "--model:" in r.stderr and "missing.onnx" in r.stderr
