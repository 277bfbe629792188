"""benchmarks/step_alternated.py: configurations of one network alternated in one process, on the
pre-activation ResNet or on an .onnx file (its input shape and classes from the file)."""
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(ROOT, "benchmarks", "step_alternated.py")


def run(*args):
    return subprocess.run([sys.executable, SCRIPT, *map(str, args)], capture_output=True, text=True, timeout=600)


def test_an_onnx_file_alternated(tmp_path):
    pytest.importorskip("onnx")
    from lowmem import models
    from lowmem.formats import onnx_export
    path = onnx_export.export_onnx(models.build_model("preact-cifar", 8, num_classes=7), tmp_path / "net.onnx",
                                   input_shape=(3, 12, 12))
    out = tmp_path / "r.json"
    r = run("--model", path, "--batch", 4, "--configs", "exact,approx4,approx2u,approx2d", "--rounds", 2, "--warmup", 0,
            "--json", out)
    assert r.returncode == 0, r.stderr
    res = json.loads(out.read_text())
    assert res["model"] == str(path) and res["batch"] == 4
    plans = {c: v["plan_bytes"] for c, v in res["configs"].items()}
    assert set(plans) == {"exact", "approx4", "approx2u", "approx2d"} and plans["approx4"] < plans["exact"]
    assert plans["approx2u"] < plans["approx2d"] < plans["approx4"]          # the dither's stream: 24 bytes a unit
    assert res["configs"]["exact"]["per_round_vs_exact"] == [1.0, 1.0]
    assert len(res["configs"]["approx2u"]["per_round_vs_exact"]) == 2
    for c in plans:
        assert f"{c:10s} plan {plans[c]:>14,d} B" in r.stdout


def test_a_file_it_cannot_read(tmp_path):
    r = run("--model", tmp_path / "missing.onnx", "--rounds", 1)
    assert r.returncode == 2 and "--model:" in r.stderr and "missing.onnx" in r.stderr


def test_ops_times_every_op_kind_and_puts_the_engines_back():
    import importlib.util
    spec = importlib.util.spec_from_file_location("step_alternated", SCRIPT)
    sa = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(sa)
    import lowmem
    x, y = sa.random_batch(4, (3, 8, 8))
    steps = {c: sa.make_step(lowmem, 8, *sa.parse(c), x, y)[0] for c in ("exact", "approx4")}
    engines = {c: s.engine for c, s in steps.items()}
    groups = {c: list(e._forward_groups) for c, e in engines.items()}
    walls = sa.op_times(steps, 2)
    for c, eng in engines.items():
        kinds = set(walls[c])
        ops = {s.op for s in eng.schedule}
        assert {"bwd " + op for op in ops if any(s.op == op and s.phase == "bwd" for s in eng.schedule)} <= kinds
        assert any(k.startswith("fwd ") for k in kinds) and all(v > 0 for v in walls[c].values())
        assert eng._forward_groups == groups[c] and "_sweep" not in vars(eng)     # put back
    steps["exact"]()                                                                  # and still trains


def test_ops_prints_a_table(tmp_path):
    out = tmp_path / "r.json"
    r = run("--depth", 8, "--batch", 4, "--configs", "exact,approx4", "--rounds", 2, "--warmup", 0, "--ops",
            "--json", out)
    assert r.returncode == 0, r.stderr
    res = json.loads(out.read_text())
    table = res["op_ms_per_step"]
    assert set(table) == {"exact", "approx4"} and "bwd conv" in table["exact"]
    assert "wall ms per step by op kind" in r.stdout and "approx4-exact" in r.stdout


def test_ops_by_plane_keeps_the_planes_and_kernels_apart():
    import importlib.util
    spec = importlib.util.spec_from_file_location("step_alternated", SCRIPT)
    sa = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(sa)
    import lowmem
    x, y = sa.random_batch(4, (3, 8, 8))
    steps = {"exact": sa.make_step(lowmem, 8, *sa.parse("exact"), x, y)[0]}
    walls = sa.op_times(steps, 1, by_plane=True)["exact"]
    eng = steps["exact"].engine
    planes = {s.in_shape[-2:] for s in eng.schedule if s.op == "conv" and s.phase == "bwd"}
    assert {f"bwd conv 3x3 {h}x{w}" for h, w in planes} <= set(walls)            # pre-act ResNet-8: 8x8, 4x4, 2x2
    assert len(planes) == 3 and not any(k == "bwd conv" for k in walls)


def test_by_plane_goes_with_ops():
    r = run("--depth", 8, "--batch", 4, "--rounds", 1, "--by-plane")
    assert r.returncode == 2 and "--by-plane goes with --ops" in r.stderr
