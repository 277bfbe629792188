"""Images per second of lowmem.data.images' loader alone, against the engine's training step rate.

    python benchmarks/image_loader.py                       # 64x64 and 224x224, workers 1, 2, 4
    python benchmarks/image_loader.py --sizes 224 --workers 2 --images 256 --engine-steps 2

For each output size the script writes a folder of JPEGs into a temporary
directory: for 64x64 outputs, 64x64 sources (Tiny-ImageNet's size); for
224x224, 500x375 sources (about ImageNet's mean size), smooth random
content at JPEG quality 90. It then times

* the loader: training transform (random-resized-crop + flip, decode on
  `workers` threads, bounded prefetch, normalised float32 batches), one full
  pass after a warm-up batch, for each worker count;
* the engine: pre-activation ResNet-18 (ImageNet layout) at that input,
  approx 4-bit, float32, forward + backward + SGD on random data, after a
  warm-up step (numba compiles in the warm-up).

The loader keeps up when its images/s exceeds the engine's; the two then
overlap (the loader decodes while the engine steps). Timings are wall
clock on whatever else the machine is doing: run it on a quiet machine and
read the load average printed with the results.
"""
import argparse
import json
import os
import tempfile
import time

import numpy as np


def make_jpegs(root, n, size, classes=10, seed=0):
    from PIL import Image
    rng = np.random.default_rng(seed)
    w, h = size
    for c in range(classes):
        for split in ("train", "val"):
            os.makedirs(os.path.join(root, split, f"class{c:02d}"), exist_ok=True)
    for i in range(n):
        small = rng.integers(0, 256, (max(2, h // 16), max(2, w // 16), 3), dtype=np.uint8)
        im = Image.fromarray(small).resize((w, h), Image.BICUBIC)     # smooth content, like photos
        c = i % classes
        im.save(os.path.join(root, "train", f"class{c:02d}", f"{i:05d}.jpg"), quality=90)
        if i < classes:
            im.save(os.path.join(root, "val", f"class{c:02d}", f"{i:05d}.jpg"), quality=90)


def time_loader(data, batch, workers):
    loader = data.loader("train", batch, seed=0, workers=workers)
    it = iter(loader)
    next(it)                                          # warm-up: threads started, first batch
    t, n = time.perf_counter(), 0
    for x, _ in it:
        n += len(x)
    return n / (time.perf_counter() - t), n


def time_engine(shape, batch, steps):
    import lowmem as lm
    net = lm.models.preact_resnet_imagenet(18, num_classes=10)
    eng = lm.Engine(net, batch, shape, mode="approx", bits=4)
    opt = lm.SGD(net.parameters(), lr=0.01, momentum=0.9, weight_decay=5e-4)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((batch,) + shape).astype(np.float32)
    y = rng.integers(0, 10, batch)
    eng.train_step(x, y, opt)                         # warm-up
    t = time.perf_counter()
    for _ in range(steps):
        eng.train_step(x, y, opt)
    return steps * batch / (time.perf_counter() - t)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--sizes", type=int, nargs="+", default=[64, 224])
    p.add_argument("--images", type=int, default=None, help="images per folder (default: 1024 at 64, 256 at 224)")
    p.add_argument("--workers", type=int, nargs="+", default=[1, 2, 4])
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--engine-steps", type=int, default=3, help="timed engine steps (0: skip the engine)")
    p.add_argument("--json", default=None, help="also write the results here")
    args = p.parse_args()
    from lowmem.data import images
    results = {"load_before": os.getloadavg(), "cpus": os.cpu_count(), "runs": []}
    for size in args.sizes:
        source = (64, 64) if size <= 64 else (500, 375)
        n = args.images or (1024 if size <= 64 else 256)
        with tempfile.TemporaryDirectory() as root:
            make_jpegs(root, n, source)
            data = images.load_image_folders(root, size, mean=[0.5] * 3, std=[0.25] * 3)
            for w in args.workers:
                rate, count = time_loader(data, args.batch, w)
                r = {"size": size, "source": source, "workers": w, "images": count, "loader_img_s": round(rate, 1)}
                results["runs"].append(r)
                print(f"loader  {size}x{size} from {source[0]}x{source[1]} JPEG, {w} worker(s): "
                      f"{rate:8.1f} images/s ({count} images)", flush=True)
        if args.engine_steps:
            rate = time_engine((3, size, size), args.batch, args.engine_steps)
            results["runs"].append({"size": size, "engine": "preact-resnet18-imagenet approx4 float32",
                                    "batch": args.batch, "engine_img_s": round(rate, 2)})
            print(f"engine  {size}x{size} ResNet-18 approx 4-bit, batch {args.batch}: {rate:8.2f} images/s",
                  flush=True)
    results["load_after"] = os.getloadavg()
    print(f"load average before {results['load_before']}, after {results['load_after']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
