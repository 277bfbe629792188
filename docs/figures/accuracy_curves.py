"""Redraw docs/accuracy_curves.png and docs/accuracy_noise.png from the accuracy study's results.

    python docs/figures/accuracy_curves.py [--results benchmarks/results/accuracy/results.json] [--out docs]

The study itself (benchmarks/accuracy.py) draws the same figures when it runs;
this only replots its saved results.json (no training). Needs matplotlib.
"""
import argparse
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

import accuracy  # noqa: E402


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--results", default=os.path.join(ROOT, "benchmarks", "results", "accuracy", "results.json"))
    p.add_argument("--out", default=os.path.join(ROOT, "docs"))
    a = p.parse_args()
    results = json.load(open(a.results))
    labels = sorted({k.split("|")[0] for k in results["runs"]})
    seeds = sorted({int(k.split("|")[1]) for k in results["runs"]})
    modes = []
    for lab in labels:
        m, _, b = lab.partition(" ")
        modes.append((m, int(b.split("-")[0]) if b else 4))
    modes.sort(key=lambda mb: (mb[0] != "exact", mb[0], -mb[1]))
    print("wrote", accuracy.plots(results, modes, seeds, a.out, "accuracy"))


if __name__ == "__main__":
    main()
