"""Redraw an accuracy study's curves and noise plot (docs/<stem>_curves.png, <stem>_noise.png) from its results.

    python docs/figures/accuracy_curves.py [--results benchmarks/results/accuracy_bits14/results.json]
        [--out docs] [--stem accuracy] [--modes exact,approx8,approx4,approx2,auto2,auto2s,approx2s]

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
    p.add_argument("--results", default=os.path.join(ROOT, "benchmarks", "results", "accuracy_bits14",
                                                     "results.json"))
    p.add_argument("--out", default=os.path.join(ROOT, "docs"))
    p.add_argument("--stem", default="accuracy")
    p.add_argument("--modes", default="exact,approx8,approx4,approx2,auto2,auto2s,approx2s",
                   help="the study's --modes, in its order (benchmarks/accuracy.py)")
    a = p.parse_args()
    results = json.load(open(a.results))
    seeds = sorted({int(k.split("|")[1]) for k in results["runs"]})
    modes = [accuracy.parse_mode(m) for m in a.modes.split(",")]
    print("wrote", accuracy.plots(results, modes, seeds, a.out, a.stem))


if __name__ == "__main__":
    main()
