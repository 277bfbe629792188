"""lowmem.data.images on small generated JPEG/PNG folders (skipped without Pillow).

Scanning and its errors (empty class, mismatched classes, missing splits,
unreadable files: named, or skipped and counted); the eval transform
against a direct NumPy crop; random-resized-crop boxes within torchvision's
bounds; order and augmentation independent of the worker count and resumable
from a saved position; normalisation computed exactly; bounded prefetch;
a network trains on a folder.
"""
import os

import numpy as np
import pytest

Image = pytest.importorskip("PIL.Image")

from lowmem.data import datasets as data, decode, images
from lowmem.data.transforms import normalize              # noqa: E402
from lowmem import nn  # noqa: E402
from lowmem.data.files import DataError                         # noqa: E402
from lowmem.core.engine import Engine                        # noqa: E402
from lowmem.train.optim import SGD                            # noqa: E402

COLOURS = {"bird": (200, 40, 40), "cat": (40, 200, 40), "dog": (40, 40, 200)}


def make_image(path, rng, colour, size, mode="RGB"):
    w, h = size
    a = np.clip(np.array(colour)[None, None] + rng.normal(0, 30, (h, w, 3)), 0, 255).astype(np.uint8)
    im = Image.fromarray(a)
    if mode != "RGB":
        im = im.convert(mode)
    im.save(path, quality=90) if path.endswith(".jpg") else im.save(path)


def make_folders(root, per_class=(6, 3), seed=0):
    """root/{train,val}/{bird,cat,dog}: JPEGs and PNGs of assorted sizes, a grey and a palette image."""
    rng = np.random.default_rng(seed)
    for split, n in zip(("train", "val"), per_class):
        for c, colour in COLOURS.items():
            os.makedirs(os.path.join(root, split, c))
            for i in range(n):
                ext = ".jpg" if i % 2 == 0 else ".png"
                mode = "L" if i == 1 else "P" if i == 3 else "RGB"
                size = (int(rng.integers(20, 60)), int(rng.integers(20, 60)))
                make_image(os.path.join(root, split, c, f"{i:03d}{ext}"), rng, colour, size, mode)
            with open(os.path.join(root, split, c, "notes.txt"), "w") as f:
                f.write("not an image")
    return root


@pytest.fixture
def folders(tmp_path):
    return make_folders(str(tmp_path / "photos"))


# ------------------------------------------------------------------- scanning

def test_scan_classes_labels_and_files(folders):
    d = images.load_image_folders(folders, size=16)
    assert d.classes == ["bird", "cat", "dog"] and d.num_classes == 3 and d.input_shape == (3, 16, 16)
    assert len(d.train) == 18 and len(d.val) == 9
    assert np.array_equal(d.train.labels, np.repeat([0, 1, 2], 6))
    assert all(p.endswith((".jpg", ".png")) for p, _ in d.train.samples)


def test_missing_folders_are_named(tmp_path, folders):
    with pytest.raises(DataError, match="no such directory"):
        images.load_image_folders(tmp_path / "nowhere", 16)
    os.rename(os.path.join(folders, "val"), os.path.join(folders, "valid"))
    with pytest.raises(DataError, match="no val/ folder.*ImageFolder layout"):
        images.load_image_folders(folders, 16)
    os.makedirs(tmp_path / "flat" / "train")
    os.makedirs(tmp_path / "flat" / "val")
    with pytest.raises(DataError, match="no class folders"):
        images.load_image_folders(tmp_path / "flat", 16)


def test_empty_class_is_named(folders):
    empty = os.path.join(folders, "train", "cat")
    for f in os.listdir(empty):
        if not f.endswith(".txt"):
            os.remove(os.path.join(empty, f))
    with pytest.raises(DataError, match="class 'cat' is empty.*train/cat"):
        images.load_image_folders(folders, 16)


def test_mismatched_classes_are_listed(folders):
    os.rename(os.path.join(folders, "val", "dog"), os.path.join(folders, "val", "wolf"))
    with pytest.raises(DataError, match=r"only here \['wolf'\], missing here \['dog'\]"):
        images.load_image_folders(folders, 16)


def corrupt(folders):
    path = os.path.join(folders, "train", "cat", "002.jpg")
    with open(path, "wb") as f:
        f.write(b"\xff\xd8\xff garbage, not a JPEG")
    return path


def test_unreadable_file_is_named_or_skipped_and_counted(folders):
    bad = corrupt(folders)
    d = images.load_image_folders(folders, 16, mean=[0.5] * 3, std=[0.25] * 3)
    loader = d.loader("train", 6, shuffle=False, drop_last=False)
    with pytest.raises(DataError, match=f"unreadable image {bad}.*skip_bad=True"):
        list(loader)
    skipping = d.loader("train", 6, shuffle=False, drop_last=False, skip_bad=True)
    batches = list(skipping)
    assert sum(len(y) for _, y in batches) == 18 and skipping.skipped == [bad]
    y = np.concatenate([y for _, y in batches])
    assert y[8] == 1                           # replaced by the next image of the split (cat/003)


def test_verify_checks_every_file_up_front(folders):
    bad = corrupt(folders)
    with pytest.raises(DataError, match=f"unreadable image {bad}"):
        images.load_image_folders(folders, 16, verify=True)
    d = images.load_image_folders(folders, 16, verify=True, skip_bad=True)
    assert d.train.skipped == [bad] and len(d.train) == 17


def test_bad_loader_arguments(folders):
    d = images.load_image_folders(folders, 16, mean=[0.5] * 3, std=[0.25] * 3)
    for kw, words in ((dict(batch_size=0), "batch_size"), (dict(batch_size=4, workers=0), "workers"),
                      (dict(batch_size=4, dtype="int8"), "dtype"), (dict(batch_size=40), "no batch of 40")):
        with pytest.raises(DataError, match=words):
            d.loader("train", **kw)
    with pytest.raises(DataError, match="mean and std"):
        images.ImageLoader(d.train, 4, 16)
    with pytest.raises(DataError, match="split"):
        d.loader("test", 4)
    with pytest.raises(DataError, match="3 values"):
        images.ImageLoader(d.train, 4, 16, mean=[0.5], std=[0.2])


# ----------------------------------------------------------------- transforms

def test_eval_transform_is_resize_then_centre_crop(tmp_path):
    """A square image of exactly the resize size: eval is a plain centre crop, pixel for pixel."""
    root = tmp_path / "sq"
    rng = np.random.default_rng(0)
    arrays = {}
    for split in ("train", "val"):
        os.makedirs(root / split / "a")
        a = rng.integers(0, 256, (18, 18, 3), dtype=np.uint8)     # 16 / 0.875 = 18.3 -> 18
        Image.fromarray(a).save(root / split / "a" / "x.png")
        arrays[split] = a
    d = images.load_image_folders(root, 16, mean=[0, 0, 0], std=[1, 1, 1])
    (x, y), = list(d.loader("val", 1, dtype="uint8"))
    np.testing.assert_array_equal(x[0], arrays["val"][1:17, 1:17].transpose(2, 0, 1))


def test_sixteen_bit_images_are_scaled_not_clipped(tmp_path):
    # Pillow opens a 16-bit grey PNG as mode I;16 (a 16-bit TIFF as I;16, a 32-bit integer one as I);
    # its own convert("RGB") clips every value above 255, so a 16-bit photo came out almost all white.
    # Expected: value v of 0..65535 becomes round(v * 255 / 65535), the same in all three channels.
    rng = np.random.default_rng(0)
    a = rng.integers(0, 65536, (16, 16)).astype(np.uint16)
    Image.fromarray(a).save(tmp_path / "grey16.png")
    Image.fromarray(a.astype(np.int32)).save(tmp_path / "grey32.tif")
    expected = ((a.astype(np.int64) * 255 + 32767) // 65535).astype(np.uint8)
    for name, mode in (("grey16.png", "I;16"), ("grey32.tif", "I")):
        with Image.open(tmp_path / name) as im:
            assert im.mode == mode
        for channels, pil_mode in ((3, "RGB"), (1, "L")):
            out = np.empty((channels, 16, 16), np.uint8)
            decode.decode(out, str(tmp_path / name), 16, False, None, pil_mode, resize=16)
            for c in range(channels):
                np.testing.assert_array_equal(out[c], expected)


def test_random_resized_crop_boxes_follow_torchvision_bounds():
    rng = np.random.default_rng(0)
    for w, h in ((64, 48), (500, 375), (33, 90)):
        for _ in range(300):
            x0, y0, x1, y1 = decode.random_resized_crop_box(w, h, rng)
            assert 0 <= x0 < x1 <= w and 0 <= y0 < y1 <= h
            cw, ch = x1 - x0, y1 - y0
            assert 0.08 * w * h * 0.8 <= cw * ch <= w * h          # area scale 0.08..1 (rounding)
            if (cw, ch) != (w, h):
                assert 0.7 <= cw / ch <= 1.45                        # aspect 3/4..4/3 (rounding)
    x0, y0, x1, y1 = decode.random_resized_crop_box(400, 4, rng)      # no try fits: centre crop, ratio 4/3
    assert (x1 - x0, y1 - y0) == (5, 4) and x0 == (400 - 5) // 2


def test_train_transform_flips_about_half_the_time(tmp_path):
    """Left half black, right half white: a crop that spans both shows which way round it is."""
    a = np.zeros((40, 40, 3), np.uint8)
    a[:, 20:] = 255
    path = str(tmp_path / "half.png")
    Image.fromarray(a).save(path)
    out = np.empty((3, 16, 16), np.uint8)
    seen = []
    for seed in range(400):
        decode.decode(out, path, 16, True, np.random.default_rng(seed))
        left, right = out[:, :, :4].mean(), out[:, :, -4:].mean()
        if abs(left - right) > 100:
            seen.append(left > right)                  # white on the left: flipped
    assert len(seen) > 100 and 0.4 < np.mean(seen) < 0.6


def test_train_batches_differ_between_epochs(folders):
    d = images.load_image_folders(folders, 16, mean=[0.5] * 3, std=[0.25] * 3)
    loader = d.loader("train", 6, dtype="uint8", seed=1)
    e0 = np.concatenate([x for x, _ in loader])
    e1 = np.concatenate([x for x, _ in loader])
    assert e0.shape == (18, 3, 16, 16) and e0.dtype == np.uint8
    assert not np.array_equal(e0, e1)


def test_grey_output_and_colour_inputs(folders):
    d = images.load_image_folders(folders, 12, channels=1)
    assert d.mean.shape == (1,) and d.input_shape == (1, 12, 12)
    x, y = next(iter(d.loader("val", 3)))
    assert x.shape == (3, 1, 12, 12) and x.dtype == np.float32


# ------------------------------------------------- order, workers, resume, stats

def epoch_batches(loader):
    return [(x.copy(), y.copy()) for x, y in loader]


def test_order_and_augmentation_do_not_depend_on_workers(folders):
    d = images.load_image_folders(folders, 16, mean=[0.5] * 3, std=[0.25] * 3)
    one = epoch_batches(d.loader("train", 4, seed=3, workers=1, prefetch=1))
    four = epoch_batches(d.loader("train", 4, seed=3, workers=4))
    assert len(one) == 4                                  # 18 // 4, drop_last
    for (a, ya), (b, yb) in zip(one, four):
        np.testing.assert_array_equal(a, b)
        np.testing.assert_array_equal(ya, yb)
    other = epoch_batches(d.loader("train", 4, seed=4))
    assert not all(np.array_equal(a[1], b[1]) for a, b in zip(one, other))


def test_position_resumes_exactly(folders):
    d = images.load_image_folders(folders, 16, mean=[0.5] * 3, std=[0.25] * 3)
    full = d.loader("train", 4, seed=2)
    reference = epoch_batches(full) + epoch_batches(full)            # two epochs
    first = d.loader("train", 4, seed=2)
    got = []
    for x, y in first:
        got.append((x.copy(), y.copy()))
        if len(got) == 2:
            break
    state = first.state_dict()
    assert (state["epoch"], state["batch"]) == (0, 2)
    second = d.loader("train", 4, seed=2, workers=2)
    second.load_state_dict(state)
    got += epoch_batches(second) + epoch_batches(second)
    assert len(got) == len(reference)
    for (a, ya), (b, yb) in zip(got, reference):
        np.testing.assert_array_equal(a, b)
        np.testing.assert_array_equal(ya, yb)
    with pytest.raises(DataError, match="seed"):
        d.loader("train", 4, seed=9).load_state_dict(state)


def test_normalisation_is_computed_exactly_and_applied(folders):
    d = images.load_image_folders(folders, 16)
    raw = np.concatenate([x for x, _ in images.ImageLoader(d.train, 6, 16, train=False, dtype="uint8")])
    mean, std = data.channel_mean_std(raw)
    np.testing.assert_allclose(d.mean, mean, rtol=1e-6)
    np.testing.assert_allclose(d.std, std, rtol=1e-6)
    (x, _), = [next(iter(d.loader("val", 9)))]
    (u, _), = [next(iter(d.loader("val", 9, dtype="uint8")))]
    np.testing.assert_allclose(x, normalize(np.empty(u.shape, np.float32), u, d.mean, d.std))
    given = images.load_image_folders(folders, 16, mean=[0.1, 0.2, 0.3], std=[1, 2, 3])
    assert given.mean.tolist() == pytest.approx([0.1, 0.2, 0.3])
    with pytest.raises(DataError, match="both mean and std"):
        images.load_image_folders(folders, 16, mean=[0.1, 0.2, 0.3])


def test_prefetch_is_bounded(folders, monkeypatch):
    d = images.load_image_folders(folders, 16, mean=[0.5] * 3, std=[0.25] * 3)
    loader = d.loader("train", 2, prefetch=3, workers=2)
    submitted = []
    real = images.ImageLoader._submit

    def counting(self, *a):
        submitted.append(a[-1])
        return real(self, *a)

    monkeypatch.setattr(images.ImageLoader, "_submit", counting)
    for consumed, _ in enumerate(loader, 1):
        assert len(submitted) - consumed <= 3 - 1         # after a batch is taken, at most 2 queued
    assert submitted == list(range(len(loader)))


# --------------------------------------------------------------- with the engine

def test_a_network_trains_on_an_image_folder(tmp_path):
    root = make_folders(str(tmp_path / "p"), per_class=(16, 4))
    d = images.load_image_folders(root, 16)
    g = nn.Graph("tiny", d.input_shape, d.num_classes)
    x = g.bn_relu(g.conv(g.input, 8, 3, stride=2))
    net = g.head(g.bn_relu(g.conv(x, 8, 3)))
    eng = Engine(net, 12, d.input_shape, mode="approx", bits=4)
    opt = SGD(net.parameters(), lr=0.1, momentum=0.9)
    train = d.loader("train", 12, seed=0)
    losses = [float(np.mean([eng.train_step(x, y, opt) for x, y in train])) for _ in range(5)]
    assert losses[-1] < 0.5 * losses[0], losses
    correct = sum(int((eng.predict(x).argmax(1) == y).sum()) for x, y in d.loader("val", 12))
    assert correct >= 10                                   # of 12 validation images


def test_the_trainer_loop_runs_on_folder_loaders(tmp_path):
    """The interface the trainer uses (len, set_epoch, iteration, state_dict; uint8 batches it
    normalises itself): Trainer.fit runs two epochs with the loaders in place of its
    BatchIterators and checkpoints the loader's position. (Until `--dataset folder` is wired in,
    the trainer is built on a same-sized stand-in Dataset whose iterators are then replaced.)"""
    from lowmem.train.checkpoint import load_checkpoint
    from lowmem.train.config import TrainConfig
    from lowmem.train.trainer import Trainer
    root = make_folders(str(tmp_path / "p"), per_class=(16, 4))
    d = images.load_image_folders(root, 16)
    u8 = np.zeros((48,) + d.input_shape, np.uint8)
    stand_in = data.Dataset("folder", u8, np.zeros(48, np.int64), u8[:12], np.zeros(12, np.int64),
                            d.num_classes, d.mean, d.std)
    cfg = TrainConfig(dataset="synthetic", depth=8, batch=12, epochs=2, augment=False, lr=0.05,
                      out=str(tmp_path / "run"), progress=False)
    t = Trainer(cfg, dataset=stand_in, log=lambda *a: None)
    t.batches = d.loader("train", 12, seed=cfg.seed, dtype="uint8")
    t.test_batches = d.loader("val", 12, dtype="uint8")
    result = t.fit()
    assert result.status == "finished" and t.iteration == 8
    assert t.history[-1]["test_acc"] > 0.5
    meta = load_checkpoint(os.path.join(cfg.out, "checkpoint.ckpt"))[1]
    assert meta["batches"] == t.batches.state_dict() and (meta["batches"]["epoch"], meta["batches"]["batch"]) == (2, 0)


def test_lowmem_train_dataset_folder_trains_and_resumes(tmp_path, capsys):
    """`lowmem train --dataset folder --data DIR`: the folder's classes, random-resized crops decoded
    on worker threads; a run stopped after one epoch and resumed ends bitwise where one run does."""
    from lowmem.tools import cli
    from lowmem.train.checkpoint import load_checkpoint
    root = make_folders(str(tmp_path / "p"), per_class=(16, 4))
    args = ["train", "--dataset", "folder", "--data", root, "--image-size", "16", "--depth", "8",
            "--batch", "12", "--lr", "0.05", "--schedule", "constant", "--warmup-iters", "0",
            "--workers", "2", "--no-progress"]
    assert cli.main(args + ["--epochs", "2", "--out", str(tmp_path / "one")]) == 0
    out = capsys.readouterr().out
    assert "final test accuracy" in out and "input (3, 16, 16)" in out
    assert cli.main(args + ["--epochs", "1", "--out", str(tmp_path / "two")]) == 0
    assert cli.main(["train", "--out", str(tmp_path / "two"), "--resume", "--epochs", "2", "--no-progress"]) == 0
    a, b = (load_checkpoint(str(tmp_path / r / "checkpoint.ckpt"))[0] for r in ("one", "two"))
    for k in a:
        np.testing.assert_array_equal(a[k], b[k], err_msg=k)
    assert cli.main(["train", "--dataset", "folder", "--out", str(tmp_path / "x")]) == 2     # no --data
    assert "--data DIR" in capsys.readouterr().err


# --------------------------------------------------- every batch size, every worker count

def make_tiny_folder(root, n=70, side=8, seed=0):
    """root/<two classes>/*.png: n tiny images of distinct random pixels (n does not divide evenly)."""
    rng = np.random.default_rng(seed)
    for i in range(n):
        c = ("a", "b")[i % 2]
        os.makedirs(os.path.join(root, c), exist_ok=True)
        Image.fromarray(rng.integers(0, 256, (side, side, 3), dtype=np.uint8)).save(
            os.path.join(root, c, f"{i:03d}.png"))
    return images.ImageFolder(root)


def test_every_batch_size_and_worker_count_gives_the_one_worker_samples(tmp_path):
    # The last chunk of a batch is short whenever the batch does not divide by the worker count;
    # each worker must decode exactly its slice of the batch (a loader that did not raised
    # IndexError for 43 of the batch sizes 1-64 with 4 workers). Per-sample augmentation depends only on the
    # sample's position in the epoch, so all batchings of an epoch concatenate to the same arrays.
    # Worker counts: 1, the small ones (every remainder of a batch size up to 64 by 2-5, 7 and 8) and 16
    # (more workers than most batches have samples).
    folder = make_tiny_folder(str(tmp_path / "tiny"))
    ref = images.ImageLoader(folder, len(folder), 8, train=True, drop_last=False, seed=5, workers=1,
                             dtype="uint8")
    (x1, y1), = list(ref)
    for b in range(1, 65):
        for w in (1, 2, 3, 4, 5, 7, 8, 16):
            loader = images.ImageLoader(folder, b, 8, train=True, drop_last=False, seed=5, workers=w,
                                        dtype="uint8", prefetch=2)
            batches = list(loader)
            assert [len(y) for _, y in batches] == [b] * (70 // b) + ([70 % b] if 70 % b else []), (b, w)
            assert np.array_equal(np.concatenate([y for _, y in batches]), y1), (b, w)
            assert np.array_equal(np.concatenate([x for x, _ in batches]), x1), (b, w)


def test_channel_stats_with_any_worker_count(tmp_path):
    # the statistics pass reads batches of 64: with 70 images its second batch is short
    folder = make_tiny_folder(str(tmp_path / "tiny"))
    expected = images.channel_stats(folder, 8, workers=1)
    for w in range(1, 17):
        mean, std = images.channel_stats(folder, 8, workers=w)
        np.testing.assert_array_equal(mean, expected[0])
        np.testing.assert_array_equal(std, expected[1])


def test_the_statistics_pass_is_streamed_and_bounded(tmp_path):
    """channel_stats holds at most images.stats_memory_bytes (a few batches of
    about STATS_BATCH_BYTES each, whatever the folder) and its histograms copy no whole batch;
    an unstreamed pass read every training image in batches of 64 with 2x4 batches in flight
    (+2 GB at 1024x1024)."""
    import tracemalloc
    folder = make_tiny_folder(str(tmp_path / "tiny"))
    expected = images.channel_stats(folder, 8, workers=1)        # small: the bound is not the point
    tracemalloc.start()
    try:
        mean, std = images.channel_stats(folder, 256)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    bound = images.stats_memory_bytes(256, 3, workers=4)
    assert bound < len(folder) * 3 * 256 * 256 / 2               # well under the decoded folder
    assert peak <= bound + (256 << 10), (peak, bound)
    assert mean.shape == std.shape == (3,) and np.all(std > 0)
    assert np.all(np.abs(mean - expected[0]) < 0.05)               # same pixels, resized


# ------------------------------------------------- hidden files, --skip-bad

def test_hidden_files_are_ignored(folders):
    """macOS copies leave ._name.jpg AppleDouble files (not images) beside the real ones."""
    for split in ("train", "val"):
        for c in COLOURS:
            with open(os.path.join(folders, split, c, "._000.jpg"), "wb") as f:
                f.write(b"\x00\x05\x16\x07AppleDouble resource fork")
            with open(os.path.join(folders, split, c, ".hidden.png"), "wb") as f:
                f.write(b"not a png")
    d = images.load_image_folders(folders, 16)
    assert len(d.train) == 18 and len(d.val) == 9
    assert not any(os.path.basename(p).startswith(".") for p, _ in d.train.samples + d.val.samples)
    assert sum(len(y) for _, y in d.loader("val", 4)) == 9


def test_the_unreadable_image_error_names_the_flag(folders):
    corrupt(folders)
    d = images.load_image_folders(folders, 16, mean=[0.5] * 3, std=[0.25] * 3)
    with pytest.raises(DataError, match="lowmem train --skip-bad"):
        list(d.loader("train", 6, shuffle=False))


def test_lowmem_train_skip_bad(tmp_path, capsys):
    """--skip-bad reaches the statistics pass and both loaders: a corrupt training image is
    replaced, not fatal; without the flag the run stops with one line naming the flag."""
    from lowmem.tools import cli
    root = make_folders(str(tmp_path / "p"), per_class=(4, 2))
    corrupt(root)
    args = ["train", "--dataset", "folder", "--data", root, "--image-size", "16", "--depth", "8",
            "--batch", "6", "--epochs", "1", "--workers", "2", "--no-progress"]
    rc = cli.main(args + ["--out", str(tmp_path / "a")])
    err = capsys.readouterr().err
    assert rc == 1 and "Traceback" not in err and "--skip-bad" in err.strip().splitlines()[-1]
    assert cli.main(args + ["--skip-bad", "--out", str(tmp_path / "b")]) == 0
    assert "final test accuracy" in capsys.readouterr().out


# ------------------------------------------------ the trainer on image folders

FOLDER_TRAIN = ["train", "--dataset", "folder", "--image-size", "16", "--depth", "8", "--batch", "12",
                "--lr", "0.05", "--workers", "2", "--no-progress"]


def test_folder_runs_honour_no_augment_and_the_limits(tmp_path):
    """--no-augment: the eval transform (no random crop or flip), still shuffled; --limit-train /
    --limit-test: seeded subsets of the splits (neither may be ignored)."""
    from lowmem.train.config import TrainConfig
    from lowmem.train.trainer import Trainer
    root = make_folders(str(tmp_path / "p"), per_class=(16, 4))
    cfg = TrainConfig(dataset="folder", data_dir=root, image_size=16, depth=8, batch=12, epochs=1,
                      augment=False, limit_train=30, limit_test=5, workers=2, progress=False)
    t = Trainer(cfg, log=lambda *a: None)
    assert (len(t.data.train), len(t.data.val)) == (30, 5) and len(t.batches) == 2
    assert not t.batches.train and t.batches.shuffle and t.batches.drop_last       # eval transform, shuffled
    assert len({lab for _, lab in t.data.train.samples}) == 3                    # a subset of every class
    again = Trainer(cfg, log=lambda *a: None)
    assert again.data.train.samples == t.data.train.samples                      # the same subset each time
    xb, _ = next(iter(t.batches))
    xb2, _ = next(iter(again.batches))
    np.testing.assert_array_equal(xb, xb2)                                       # no random crop or flip
    t.close(), again.close()


def test_a_bad_val_image_stops_the_run_before_its_first_epoch(tmp_path, capsys):
    """Found at start-up, so no epoch is lost and no folder needs --overwrite."""
    from lowmem.tools import cli
    root = make_folders(str(tmp_path / "p"), per_class=(16, 4))
    bad = os.path.join(root, "val", "cat", "002.jpg")
    with open(bad, "r+b") as f:                                  # a JPEG cut off half-way
        f.truncate(os.path.getsize(bad) // 2)
    out = tmp_path / "run"
    assert cli.main(FOLDER_TRAIN + ["--data", root, "--epochs", "1", "--out", str(out)]) == 1
    err = capsys.readouterr().err
    assert f"unreadable image {bad}" in err
    assert not out.exists()                                      # nothing trained, nothing written


def test_class_names_and_preprocessing_travel_with_the_weights(tmp_path, capsys):
    """The checkpoint and both exports hold the classes, image size and mean/std;
    a resume after a class folder was renamed is refused naming it; `lowmem predict` on an exported
    model prints class names."""
    from lowmem.formats import metadata
    from lowmem.tools import cli
    from lowmem.train.checkpoint import load_checkpoint
    root = make_folders(str(tmp_path / "p"), per_class=(16, 4))
    run = tmp_path / "run"
    assert cli.main(FOLDER_TRAIN + ["--data", root, "--epochs", "2", "--out", str(run)]) == 0
    info = load_checkpoint(str(run / "checkpoint.ckpt"))[1]["data"]
    assert info["classes"] == ["bird", "cat", "dog"] and info["image_size"] == 16 and info["resize"] == 18
    assert len(info["mean"]) == len(info["std"]) == 3
    written = {}
    for suffix in (".safetensors", ".onnx"):
        if suffix == ".onnx":
            pytest.importorskip("onnx")
            pytest.importorskip("onnxruntime")
        pytest.importorskip("safetensors")
        model = str(tmp_path / ("model" + suffix))
        assert cli.main(["export", str(run), model]) == 0
        meta = metadata.read_metadata(model)
        assert {k: meta[k] for k in info} == info and (meta["model"], meta["depth"]) == ("preact-cifar", 8)
        written[suffix] = model
    capsys.readouterr()
    photos = [os.path.join(root, "val", c, "000.jpg") for c in ("bird", "cat", "dog")]
    for model in [str(run)] + list(written.values()):
        assert cli.main(["predict", model] + photos) == 0
        lines = capsys.readouterr().out.splitlines()
        assert [line.split(": ")[0] for line in lines] == photos
        assert all(line.split(": ")[1].split(" (")[0] in info["classes"] for line in lines)
    os.rename(os.path.join(root, "train", "bird"), os.path.join(root, "train", "zebra"))
    os.rename(os.path.join(root, "val", "bird"), os.path.join(root, "val", "zebra"))
    assert cli.main(["train", "--out", str(run), "--resume", "--epochs", "3", "--no-progress"]) == 1
    err = capsys.readouterr().err
    assert "the class folders changed since it was saved (train/bird renamed to train/zebra)" in err


def test_bits_auto_on_an_image_folder_measures_its_first_batches(tmp_path, capsys):
    """--bits auto with --dataset folder: the widths are measured on the first batches the training
    loader yields (eval transform), stored, and a resume continues with them."""
    import json
    from lowmem.tools import cli
    root = make_folders(str(tmp_path / "p"), per_class=(8, 2))
    out = tmp_path / "run"
    argv = FOLDER_TRAIN + ["--data", root, "--epochs", "1", "--bits", "auto", "--avg-bits", "2", "--batch", "8",
                           "--out", str(out)]
    assert cli.main(argv) == 0, capsys.readouterr().err
    printed = capsys.readouterr().out
    assert "bits auto (2 bits on average), measured on 3 training batches" in printed
    config = json.loads((out / "config.json").read_text())
    assert isinstance(config["bits"], dict) and len(config["bits"]) == 7 and config["avg_bits"] == 2
    assert cli.main(argv[:-2] + ["--out", str(out), "--resume", "--epochs", "2"]) == 0
    assert json.loads((out / "config.json").read_text())["bits"] == config["bits"]
