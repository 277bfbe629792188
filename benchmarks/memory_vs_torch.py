"""Memory of one training step at ImageNet size: PyTorch (torchvision's layouts) against lowmem's plan and measured peak.

    python benchmarks/memory_vs_torch.py                                  # ResNet-50, DenseNet-121, b32
    python benchmarks/memory_vs_torch.py --models resnet50 --batch 32 --out benchmarks/results/memory_vs_torch.json

Each configuration runs in its own fresh process, float32, CPU, input 3x224x224, 1000 classes:

  torch           tests/torchvision_layout.py's module (torchvision's modules, written again), one
                  step of forward + cross-entropy + backward + SGD (momentum 0.9). Reported: the peak
                  resident memory of the process during the step above its resident memory just before
                  it (benchmarks/harness.py: the high-water mark VmHWM, reset to the resident size just
                  before the step, minus that size; the model, its parameters, the input batch and
                  PyTorch's libraries are already loaded, so the difference is what the step itself
                  allocates: activations kept for backward, gradients, momentum, temporaries).
  lowmem exact / approx 4-bit
                  lowmem's registry network of the same layout (`--model resnet|densenet`), one
                  Engine.train_step with SGD (momentum 0.9). Reported: the plan's total bytes, the
                  measured peak of NumPy's allocations during the step (tracemalloc: the Engine's
                  buffers, the gradients and momentum, the temporaries; the same scope as the plan), and
                  the same peak-RSS difference as for torch (it also counts the parameters'
                  gradients and momentum, and any allocator slack; a warm-up step at batch 1 on 64x64
                  inputs runs first so that the compiled kernels are not counted).

The peak-RSS difference is the only figure measured the same way on both sides; it counts every
page touched during the step. Memory only: no timings are reported (the machine may be shared).
Each configuration runs in a fresh process under the harness's watchdog (--mem-limit).
The JSON keeps every figure in MiB.
"""
import argparse
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, os.path.join(HERE, "..", "tests"))        # torchvision_layout.py

import harness                                                # noqa: E402 (benchmarks/harness.py)

MODELS = {"resnet18": ("resnet", 18), "resnet50": ("resnet", 50), "densenet121": ("densenet", 121),
          "mobilenet_v2": ("mobilenet", 2)}


def step_peak_mib(step):
    """Run step() and return the process's peak resident MiB during it above its resident MiB just before."""
    base = harness.rss_now()
    harness.reset_peak()
    step()
    return (harness.rss_peak() - base) / 2**20


def run_torch(name, batch, shape):
    import torch
    import torchvision_layout as tv
    torch.set_num_threads(1)
    torch.manual_seed(0)
    family, depth = MODELS[name]
    model = {"resnet": lambda: tv.resnet(depth, 1000), "densenet": lambda: tv.densenet(depth, 1000),
             "mobilenet": lambda: tv.mobilenet_v2(1000)}[family]().train()
    x = torch.randn((batch,) + shape)
    y = torch.randint(0, 1000, (batch,))
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)

    def step():
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    return {"step_rss_MiB": step_peak_mib(step), "params_MiB": sum(p.numel() for p in model.parameters()) * 4 / 2**20}


def run_lowmem(name, mode, batch, shape):
    from lowmem import models
    from lowmem.system import threads
    from lowmem.tools import peak_memory
    threads.configure(1)
    family, depth = MODELS[name]
    m, bits = ("approx", 4) if mode == "approx4" else ("exact", 4)
    # warm-up at batch 1 and a small input: the compiled kernels' memory is not the step's
    peak_memory.measure_peak(models.build_model(family, depth), 1, (shape[0], 64, 64), mode=m, bits=bits, steps=1)
    import gc
    gc.collect()
    net = models.build_model(family, depth)
    measured = []
    step_rss = step_peak_mib(lambda: measured.append(peak_memory.measure_peak(net, batch, shape, mode=m, bits=bits, steps=1)))
    return {"plan_MiB": measured[0].plan_bytes / 2**20, "measured_MiB": measured[0].peak_bytes / 2**20,
            "step_rss_MiB": step_rss}


def one(spec, batch, shape):
    kind, name, mode = spec.split(":")
    return run_torch(name, batch, shape) if kind == "torch" else run_lowmem(name, mode, batch, shape)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--models", default="resnet50,densenet121")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--input", default="3x224x224")
    p.add_argument("--out", default=None, help="JSON file (kept between runs: finished entries are not rerun)")
    p.add_argument("--mem-limit", type=harness.parse_bytes, default=harness.parse_bytes("21GiB"),
                   help="kill a configuration's process whose RSS passes this (default: 21GiB)")
    p.add_argument("--one", default=None, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    shape = tuple(int(v) for v in a.input.split("x"))
    if a.one:
        harness.result_line(one(a.one, a.batch, shape))
        return
    for name in a.models.split(","):
        if name not in MODELS:
            p.error(f"--models: unknown model {name!r}; known: {', '.join(MODELS)}")
    results = {}
    if a.out and os.path.exists(a.out):
        with open(a.out) as f:
            results = json.load(f)
    results.setdefault("config", {"batch": a.batch, "input": a.input, "dtype": "float32", "device": "cpu"})
    print(f"input {a.input}, batch {a.batch}, float32, CPU; one training step per fresh process (MiB)")
    for name in a.models.split(","):
        for spec in (f"torch:{name}:plain", f"lowmem:{name}:exact", f"lowmem:{name}:approx4"):
            if spec not in results:
                out, err, code, watch = harness.run_fresh(
                    [sys.executable, os.path.abspath(__file__), "--batch", str(a.batch), "--input", a.input,
                     "--one", spec], harness.Supervision(mem_limit=a.mem_limit))
                res = harness.read_result(out)
                if res is None:
                    sys.exit(f"{spec} failed (exit {code}{'; ' + watch['killed'] if watch['killed'] else ''}):\n"
                             f"{err[-2000:]}")
                results[spec] = res
                if a.out:
                    tmp = a.out + ".tmp"
                    with open(tmp, "w") as f:
                        json.dump(results, f, indent=1)
                    os.replace(tmp, a.out)
            print(f"{spec:28s} " + ", ".join(f"{k} {v:,.1f}" for k, v in results[spec].items()), flush=True)
        t = results[f"torch:{name}:plain"]["step_rss_MiB"]
        ap = results[f"lowmem:{name}:approx4"]
        print(f"{name}: lowmem approx 4-bit plan / torch step peak = {ap['plan_MiB'] / t:.3f}; "
              f"measured RSS / torch = {ap['step_rss_MiB'] / t:.3f}", flush=True)


if __name__ == "__main__":
    main()
