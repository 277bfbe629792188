"""benchmarks/compare_torch.py end to end at tiny sizes: torchvision's ResNet-18 against its ONNX
export in lowmem, with the op-kind profile; the pre-activation ResNet with rounds and the floor;
an ONNX file alone; the refusals. The structure of what it prints and writes is checked, never a
timing (the machine may be shared: no waiting for a quiet machine, no reruns)."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "compare_torch.py"
sys.path.insert(0, str(ROOT / "benchmarks"))
import compare_torch                                             # noqa: E402
import op_profile                                                # noqa: E402

SHARED = ["--steps", "1", "--warmup", "0", "--max-wait", "0", "--retries", "0"]


def run(*args, timeout=900):
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return subprocess.run([sys.executable, str(SCRIPT), *map(str, args)], capture_output=True, text=True, env=env,
                          cwd=ROOT, timeout=timeout)


def rows(stdout, configs):
    """{config: the table row's fields} of the step table."""
    out = {}
    for line in stdout.splitlines():
        f = line.split()
        if f and f[0] in configs and len(f) > 3 and f[1].isdigit():
            out[f[0]] = f
    return out


def check_header(stdout, *net):
    lines = stdout.splitlines()
    assert lines[0].startswith("machine: ") and (", AVX" in lines[0] or ", SSE" in lines[0])
    assert f"({os.cpu_count()} CPUs)" in lines[0] and " cores " in lines[0]
    assert all(n in stdout.split("\n\n")[0] for n in net)


def test_torchvision_resnet18_against_its_onnx_export(tmp_path):
    pytest.importorskip("torch")
    pytest.importorskip("onnx")
    out = tmp_path / "r18.json"
    r = run("--model", "resnet18", "--size", 32, "--batch", 2, "--classes", 10, "--rounds", 1, "--kernels",
            "--kernel-steps", 1, "--json", out, *SHARED)
    assert r.returncode == 0, r.stderr[-3000:]
    check_header(r.stdout, "torchvision resnet18", "3x32x32 input, batch 2")
    configs = list(compare_torch.IMPORTED_CONFIGS)
    table = rows(r.stdout, configs)
    assert list(table) == configs
    for f in table.values():
        assert f[1:3] == ["2", "1"] and float(f[3]) > 0                  # batch, rounds, median s
    for label in ("lowmem-approx4 / torch-exact: ", "lowmem-approx4 / lowmem-exact: ",
                  "lowmem-approx2u / lowmem-exact: ", "lowmem-exact / torch-exact: "):
        line = next(ln for ln in r.stdout.splitlines() if label in ln)
        assert "(target <= " in line and float(line.split(label)[1].split()[0]) > 0
    kinds = r.stdout[r.stdout.index("own time per step by op kind"):].splitlines()
    assert kinds[1].split() == ["op", "kind", "(own", "time", "per", "step)"] + configs[1:]
    for kind in op_profile.KINDS + ("profiled step",):
        line = next(ln for ln in kinds if ln.startswith(kind + " "))
        cells = line[36:].split()
        assert len(cells) == 9 and cells[1::3] == ["s"] * 3 and all(c.endswith("%") for c in cells[2::3])
    side = r.stdout[r.stdout.index("side by side with PyTorch"):].splitlines()        # PyTorch's kinds beside
    assert side[1].split() == ["op", "kind", "(own", "time", "per", "step)"] + configs
    for kind in op_profile.COARSE + ("profiled step",):
        cells = next(ln for ln in side if ln.startswith(kind + " "))[36:].split()
        assert len(cells) == 12 and cells[1::3] == ["s"] * 4

    res = json.loads(out.read_text())
    assert res["machine"]["isa"] and res["rounds"] == 1
    by = {x["config"]: x for x in res["runs"]}
    assert [by[c]["status"] for c in configs] == ["ok"] * 4
    assert by["torch-exact"]["params"] == by["lowmem-exact"]["params"] == 11_181_642   # the same module
    assert all(by[c]["planned_bytes"] > 0 for c in configs[1:])
    assert by["lowmem-approx2u"]["planned_by_kind"]["saved"] < by["lowmem-exact"]["planned_by_kind"]["saved"]
    assert len(res["ratios"]) == 5
    for c in configs[1:]:
        k = res["kinds"][c]
        assert k["status"] == "ok" and k["lowmem_threads"] == 1
        assert sum(k["kinds"].values()) == pytest.approx(k["own_total_s"], rel=1e-6)
        assert k["kinds"]["conv GEMMs"] > 0 and k["kinds"]["BN-ReLU unit"] > 0
    t = res["kinds"]["torch-exact"]
    assert t["status"] == "ok" and t["torch_threads"] == 1
    assert sum(t["kinds"].values()) == pytest.approx(t["own_total_s"], rel=1e-6)
    assert t["kinds"]["dense convolutions"] > 0 and t["kinds"]["batch norm, ReLU (units, masks)"] > 0
    assert t["kinds"]["range code, kept inputs"] == 0


def test_the_pre_activation_resnet_in_rounds_with_its_floor(tmp_path):
    pytest.importorskip("torch")
    out = tmp_path / "preact.json"
    r = run("--depth", 11, "--size", 16, "--batch", 2, "--rounds", 2, "--configs", "torch-exact,lowmem-approx4,floor",
            "--json", out, *SHARED)
    assert r.returncode == 0, r.stderr[-3000:]
    check_header(r.stdout, "pre-act ResNet-11 (bottleneck blocks)", "3x16x16 input")
    table = rows(r.stdout, ("torch-exact", "lowmem-approx4", "floor"))
    assert list(table) == ["torch-exact", "lowmem-approx4", "floor"] and all(f[2] == "2" for f in table.values())
    assert "lowmem-approx4 / torch-exact: " in r.stdout and "lowmem-approx4 / floor: " in r.stdout
    assert "\nfloor: " in r.stdout and "GFLOP/s" in r.stdout
    res = json.loads(out.read_text())
    for run_ in res["runs"]:
        assert run_["status"] == "ok" and len(run_["rounds"]) == 2 and None not in run_["round_medians"]
        assert run_["step_median"] == pytest.approx(sorted(run_["round_medians"])[0] / 2 +
                                                    sorted(run_["round_medians"])[1] / 2)
    order = [ln.split("running ")[1].split()[0] for ln in r.stderr.splitlines() if ": running " in ln]
    assert order == ["torch-exact", "lowmem-approx4", "floor", "lowmem-approx4", "floor", "torch-exact"]  # rotated


def test_alternated_in_persistent_processes(tmp_path):
    """--alternate with --rounds 0: no fresh-process rows, every config built once in its own process,
    then the rounds of each in turn; the round medians and the per-round ratios in the JSON."""
    pytest.importorskip("torch")
    out = tmp_path / "alt.json"
    r = run("--depth", 11, "--size", 16, "--batch", 2, "--rounds", 0, "--alternate", 3,
            "--configs", "torch-exact,lowmem-exact,lowmem-approx4", "--json", out, *SHARED)
    assert r.returncode == 0, r.stderr[-3000:]
    assert not rows(r.stdout, compare_torch.CONFIGS)                     # no fresh-process table
    assert "alternated in persistent processes: 3 rounds of 1 steps" in r.stdout
    res = json.loads(out.read_text())["alternated"]
    per = res["round_medians_s"]
    assert set(per) == {"torch-exact", "lowmem-exact", "lowmem-approx4"} and all(len(v) == 3 for v in per.values())
    got = res["ratios"]["step time   lowmem-approx4 / torch-exact"]
    want = sorted(a / b for a, b in zip(per["lowmem-approx4"], per["torch-exact"]))
    assert got["ratio"] == pytest.approx(want[1]) and (got["low"], got["high"]) == pytest.approx((want[0], want[2]))
    assert f"lowmem-approx4 / torch-exact: {got['ratio']:.3f} (rounds " in r.stdout
    assert r.stderr.count("alternated: building ") == 3 and r.stderr.count("alternated: round ") == 3
    bad = run("--depth", 11, "--rounds", 0, *SHARED)
    assert bad.returncode == 2 and "0 only with --alternate" in bad.stderr
    bad = run("--depth", 11, "--alternate", 2, "--configs", "lowmem-exact", *SHARED)
    assert bad.returncode == 2 and "two configs or more" in bad.stderr


def test_an_onnx_file_alone(tmp_path):
    pytest.importorskip("torch")
    pytest.importorskip("onnx")
    path = tmp_path / "net.onnx"
    r = run("--worker", "export", "--model", "resnet18", "--shape", "3,32,32", "--classes", 7, "--onnx", path)
    assert r.returncode == 0 and path.exists(), r.stderr[-3000:]
    r = run("--model", path, "--batch", 2, "--rounds", 1, *SHARED)
    assert r.returncode == 0, r.stderr[-3000:]
    check_header(r.stdout, "net.onnx (lowmem only)", "7 classes, 3x32x32 input")
    assert list(rows(r.stdout, compare_torch.CONFIGS)) == ["lowmem-exact", "lowmem-approx4", "lowmem-approx2u"]
    assert "lowmem-approx4 / lowmem-exact: " in r.stdout and "target" not in r.stdout.split("lowmem-approx4 / ")[1]
    bad = run("--model", path, "--configs", "torch-exact", *SHARED)
    assert bad.returncode == 2 and "torch-*: a torchvision model, not a file" in bad.stderr
    bad = run("--model", path, "--size", 64, *SHARED)
    assert bad.returncode == 2 and "fixes its input at 3x32x32" in bad.stderr


def test_what_it_refuses():
    for args, message in ((["--model", "vgg"], "expected one of resnet18, resnet50, densenet121, mobilenet_v2 or a "
                                                "path ending in .onnx"),
                          (["--model", "resnet18", "--configs", "floor"], "do not run on --model resnet18"),
                          (["--model", "resnet18", "--scaling", "lowmem-exact"], "--scaling runs on the "
                                                                                 "pre-activation ResNet only"),
                          (["--configs", "lowmem-approx3"], "unknown config(s) ['lowmem-approx3']"),
                          (["--model", "missing.onnx"], "missing.onnx: no such file")):
        r = run(*args)
        assert r.returncode == 2 and message in r.stderr, (args, r.stderr[-500:])


def test_rounds_merge_into_the_median_of_their_medians():
    def one(median, steps, peak, others):
        return dict(config="x", batch=4, status="ok", step_median=median, step_s=steps, peak_above_base=peak,
                    load_before=[others, 0, 0], other_cpus_during=others)
    rounds = [one(2.0, [2.0, 2.1], 10, 0.1), one(1.0, [0.9, 1.0], 30, 0.0), one(5.0, [5.0], 20, 0.5)]
    row = compare_torch.merge_rounds(rounds)
    assert row["step_median"] == 2.0 and (row["step_min"], row["step_max"]) == (0.9, 5.0)
    assert row["peak_above_base"] == 30 and row["other_cpus_during"] == 0.5 and row["images_per_s"] == 2.0
    assert row["round_medians"] == [2.0, 1.0, 5.0] and len(row["rounds"]) == 3
    failed = compare_torch.merge_rounds(rounds[:1] + [dict(config="x", batch=4, status="killed (timeout)")])
    assert failed["status"] == "killed (timeout)"
    single = compare_torch.merge_rounds(rounds[:1])
    assert single["step_median"] == 2.0 and "rounds" not in single
