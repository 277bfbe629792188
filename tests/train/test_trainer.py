"""The training loop: schedule, run directory, checkpoints that survive every failure, exact resume.

Most tests train preact_resnet_cifar(8) on 16x16 synthetic images (8 steps an
epoch, well under a second); the last one trains on real Fashion-MNIST.
"""
import json
import math
import os
import signal

import numpy
import pytest

from lowmem.system import atomic
from lowmem.train.checkpoint import CheckpointError, load_checkpoint
from lowmem.data.datasets import Dataset, channel_mean_std, synthetic
from lowmem.models import preact_resnet_cifar
from lowmem.tools import cli
from lowmem.tools.options import EXIT_DIVERGED, EXIT_ERROR, EXIT_OK, EXIT_TIME_LIMIT, EXIT_USAGE
from lowmem.train.checkpoint import save_checkpoint
from lowmem.train.config import ConfigError, TrainConfig, lr_at
from lowmem.train.rundir import read_metrics
from lowmem.train.trainer import (CHECKPOINT, METRICS, ResumeError, Trainer, TrainingDiverged,
                                  load_model_state)

STEPS = 8       # per epoch: 128 training images, batch 16
RUN_FILES = ["checkpoint.ckpt", "config.json", "lowmem-run.json", "metrics.jsonl", "plan.txt"]


@pytest.fixture(scope="module")
def tiny_data():
    x, y, xt, yt = synthetic(128, 40, shape=(3, 16, 16), seed=3)
    return Dataset("synthetic", x, y, xt, yt, 10, *channel_mean_std(x))


def tiny_config(out=None, **kw):
    return TrainConfig(**{"dataset": "synthetic", "depth": 8, "batch": 16, "epochs": 2, "lr": 0.05,
                          "progress": False, "out": None if out is None else str(out), **kw})


def quiet(*_):
    pass


def train(data, out=None, resume=False, **kw):
    cfg_kw = {k: v for k, v in kw.items() if k not in ("on_step", "on_epoch")}
    hooks = {k: v for k, v in kw.items() if k in ("on_step", "on_epoch")}
    trainer = Trainer(tiny_config(out, **cfg_kw), dataset=data, resume=resume, log=quiet, **hooks)
    return trainer, trainer.fit()


def full_state(trainer):
    """Parameters, BN statistics and momentum buffers as host copies."""
    d = trainer.net.state_dict()
    d.update({"momentum/" + p.name: numpy.array(p.state["momentum"]) for p in trainer.net.parameters()})
    return d


def assert_bitwise(a, b):
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].dtype == b[k].dtype and a[k].tobytes() == b[k].tobytes(), k


def run_train(argv):
    """`lowmem train argv...` in-process; returns the exit status."""
    return cli.main(["train", *argv])


# ----------------------------------------------------------------------------- schedule

def test_step_schedule_is_the_papers_recipe():
    cfg = TrainConfig(lr=0.1, schedule="step", warmup_iters=400)
    total = 64000
    assert lr_at(0, total, cfg) == lr_at(399, total, cfg) == 0.01
    assert lr_at(400, total, cfg) == lr_at(31999, total, cfg) == 0.1
    assert lr_at(32000, total, cfg) == lr_at(47999, total, cfg) == 0.01
    assert lr_at(48000, total, cfg) == lr_at(63999, total, cfg) == 0.001


def test_cosine_schedule_and_default_warmup():
    cfg = TrainConfig(lr=0.2, schedule="cosine")              # warm-up: 400, capped at 5% of the run
    assert lr_at(0, 64000, cfg) == lr_at(399, 64000, cfg) == pytest.approx(0.02)
    assert lr_at(400, 64000, cfg) == pytest.approx(0.2)
    assert lr_at(400 + 31800, 64000, cfg) == pytest.approx(0.1)
    assert lr_at(63999, 64000, cfg) < 1e-6
    assert lr_at(4, 100, cfg) == pytest.approx(0.02) and lr_at(5, 100, cfg) == pytest.approx(0.2)


# ----------------------------------------------------------------------------- a run

def test_run_directory_metrics_and_checkpoint(tiny_data, tmp_path):
    trainer, result = train(tiny_data, tmp_path)
    assert result.status == "finished" and result.iteration == 2 * STEPS
    assert sorted(os.listdir(tmp_path)) == RUN_FILES
    assert json.loads((tmp_path / "config.json").read_text())["depth"] == 8
    epochs = [r for r in read_metrics(tmp_path) if r["event"] == "epoch"]
    assert [r["epoch"] for r in epochs] == [1, 2] and [r["iteration"] for r in epochs] == [8, 16]
    for r in epochs:
        assert 0 <= r["test_acc"] <= 1 and numpy.isfinite(r["train_loss"]) and r["images_per_s"] > 0
        assert r["planned_bytes"] == trainer.engine.plan.total_bytes
    assert result.test_acc == epochs[-1]["test_acc"]

    arrays, meta = load_checkpoint(tmp_path / CHECKPOINT)
    assert meta["iteration"] == 16 and meta["config"]["mode"] == "approx"
    assert meta["batches"]["epoch"] == 2 and meta["batches"]["batch"] == 0
    assert meta["rng"] == trainer.rng.bit_generator.state and meta["optimizer"]["started"]
    assert_bitwise(arrays, {(k if k.startswith("momentum/") else "net/" + k): v
                            for k, v in full_state(trainer).items()})


def test_evaluation_covers_the_whole_test_split(tiny_data):
    trainer = Trainer(tiny_config(), dataset=tiny_data, log=quiet)
    sizes, predict = [], trainer.engine.predict
    trainer.engine.predict = lambda x: sizes.append(len(x)) or predict(x)
    trainer.evaluate()
    assert sizes == [16, 16, 8]                     # 40 test images: the partial batch counts


def test_batches_go_through_preallocated_arrays(tiny_data):
    trainer = Trainer(tiny_config(), dataset=tiny_data, log=quiet)
    xb, yb = tiny_data.x_train[:16], tiny_data.y_train[:16]
    pipe = trainer.pipeline
    plain = pipe(xb, yb, trainer.rng, train=False)[0].copy()
    x, y = pipe(xb, yb, trainer.rng, train=True)
    assert x.base is pipe.x and pipe.x.shape == (16, 3, 16, 16) and x.dtype == numpy.float32
    assert abs(float(plain.mean())) < 0.2 and abs(float(plain.std()) - 1) < 0.2     # normalised
    assert not numpy.array_equal(x, plain)                                             # augmented
    assert pipe(xb[:5], yb[:5], trainer.rng, train=False)[0].base is pipe.x


def test_a_fresh_run_refuses_to_overwrite_a_checkpoint(tiny_data, tmp_path):
    train(tiny_data, tmp_path, epochs=1)
    with pytest.raises(ResumeError, match="already exists.*--resume"):
        Trainer(tiny_config(tmp_path), dataset=tiny_data, log=quiet)


# ----------------------------------------------------------------------------- resume: bitwise

@pytest.fixture(scope="module")
def uninterrupted(tiny_data):
    trainer, _ = train(tiny_data)
    return full_state(trainer)


def stop_at(iteration, how):
    def on_step(trainer, loss):
        if trainer.iteration == iteration:
            if how == "request":
                trainer.request_stop()
            else:
                os.kill(os.getpid(), how)       # the handler runs now; the step is already done
    return on_step


@pytest.mark.parametrize("stop", ["epoch-end", "mid-epoch", "sigterm", "sigint", "time-limit"])
def test_resume_is_bitwise_identical(tiny_data, tmp_path, uninterrupted, stop):
    handlers = signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)
    kw = {"epoch-end": {"on_step": stop_at(STEPS, "request")},
          "mid-epoch": {"on_step": stop_at(3, "request")},
          "sigterm": {"on_step": stop_at(5, signal.SIGTERM)},
          "sigint": {"on_step": stop_at(11, signal.SIGINT)},
          "time-limit": {"time_limit": 1e-9}}[stop]
    _, first = train(tiny_data, tmp_path, **kw)
    assert first.status == {"sigterm": "signal", "sigint": "signal", "time-limit": "time-limit"}.get(stop, "stopped")
    expected = {"epoch-end": STEPS, "mid-epoch": 3, "sigterm": 5, "sigint": 11, "time-limit": 1}[stop]
    assert first.iteration == expected
    assert load_checkpoint(tmp_path / CHECKPOINT)[1]["iteration"] == expected     # written on the way out
    assert (signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)) == handlers

    trainer, second = train(tiny_data, tmp_path, resume=True)
    assert second.status == "finished" and second.iteration == 2 * STEPS
    assert_bitwise(full_state(trainer), uninterrupted)
    epochs = [r["epoch"] for r in read_metrics(tmp_path) if r["event"] == "epoch"]
    assert epochs == [1, 2]                         # no epoch lost or repeated


# ----------------------------------------------------------------------------- refusing to resume

def test_resume_into_another_architecture_is_refused(tiny_data, tmp_path):
    train(tiny_data, tmp_path, epochs=1)
    with pytest.raises(ResumeError, match=r"different architecture.*depth \(checkpoint 8, this run 14\)"):
        Trainer(tiny_config(tmp_path, depth=14, epochs=2), dataset=tiny_data, resume=True, log=quiet)
    with pytest.raises(ResumeError, match=r"bits \(checkpoint 4, this run 2\)"):
        Trainer(tiny_config(tmp_path, bits=2), dataset=tiny_data, resume=True, log=quiet)
    other = preact_resnet_cifar(14, num_classes=10, in_channels=3)
    with pytest.raises(ResumeError, match=r"preact-resnet8-cifar, not preact-resnet14-cifar.*missing \['layer1.1"):
        load_model_state(tmp_path / CHECKPOINT, other)
    assert run_train(["--out", str(tmp_path), "--resume", "--depth", "14"]) == EXIT_ERROR


@pytest.mark.parametrize("damage", ["truncate", "flip"])
def test_a_damaged_checkpoint_is_refused(tiny_data, tmp_path, damage, capsys):
    train(tiny_data, tmp_path, epochs=1)
    path = tmp_path / CHECKPOINT
    raw = bytearray(path.read_bytes())
    if damage == "truncate":
        raw = raw[:len(raw) // 2]
    else:
        raw[len(raw) // 2] ^= 0x01
    path.write_bytes(bytes(raw))
    message = "truncated" if damage == "truncate" else "checksum mismatch"
    with pytest.raises(CheckpointError, match=message):
        Trainer(tiny_config(tmp_path), dataset=tiny_data, resume=True, log=quiet)
    assert run_train(["--out", str(tmp_path), "--resume"]) == EXIT_ERROR
    assert message in capsys.readouterr().err


# ----------------------------------------------------------------------------- never a bad checkpoint

def test_a_crash_while_writing_keeps_the_last_checkpoint(tiny_data, tmp_path, monkeypatch):
    path = tmp_path / CHECKPOINT

    class Dies:
        """A file that dies after writing 1000 bytes (a crash, a full disk)."""
        def __init__(self, f):
            self.f, self.n = f, 0

        def write(self, b):
            self.n += len(b)
            if self.n > 1000:
                raise OSError(28, "No space left on device (simulated)")
            return self.f.write(b)

        def __getattr__(self, name):
            return getattr(self.f, name)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return self.f.__exit__(*exc)

    def crash_from_now_on(trainer, record):
        monkeypatch.setattr(atomic, "open", lambda *a, **k: Dies(open(*a, **k)), raising=False)

    with pytest.raises(OSError, match="simulated") as info:
        train(tiny_data, tmp_path, on_epoch=crash_from_now_on)
    assert f"cannot write checkpoint {str(path)!r}" in str(info.value)    # the message names the file
    monkeypatch.undo()
    assert sorted(os.listdir(tmp_path)) == RUN_FILES
    assert load_checkpoint(path)[1]["iteration"] == STEPS            # epoch 1's, intact
    trainer, result = train(tiny_data, tmp_path, resume=True)
    assert result.status == "finished"


@pytest.mark.filterwarnings("ignore:overflow:RuntimeWarning", "ignore:invalid:RuntimeWarning")
def test_a_non_finite_loss_stops_and_keeps_the_last_good_checkpoint(tmp_path, capsys):
    out = tmp_path / "run"
    args = ["--dataset", "synthetic", "--limit-train", "128", "--limit-test", "16", "--depth", "8",
            "--batch", "16", "--out", str(out), "--no-progress"]
    assert run_train(args + ["--epochs", "1", "--lr", "0.05"]) == EXIT_OK
    good = (out / CHECKPOINT).read_bytes()
    capsys.readouterr()
    code = run_train(["--out", str(out), "--resume", "--epochs", "4", "--lr", "1e6"])
    assert code == EXIT_DIVERGED
    err = capsys.readouterr().err
    assert "non-finite" in err and "last good checkpoint" in err and str(out / CHECKPOINT) in err
    assert (out / CHECKPOINT).read_bytes() == good
    assert read_metrics(out)[-1]["reason"] == "diverged"


def test_non_finite_parameters_are_never_saved(tiny_data, tmp_path):
    def poison(trainer, loss):
        if trainer.iteration == 2 * STEPS:          # after the last step, before the save
            trainer.net.params["fc.weight"].data[0, 0] = numpy.nan
    with pytest.raises(TrainingDiverged, match="non-finite values in fc.weight"):
        train(tiny_data, tmp_path, on_step=poison)
    arrays, meta = load_checkpoint(tmp_path / CHECKPOINT)
    assert meta["iteration"] == STEPS and numpy.isfinite(arrays["net/fc.weight"]).all()


# ----------------------------------------------------------------------------- the command line

def test_cli_prints_the_plan_trains_and_resumes(tmp_path, capsys):
    out = str(tmp_path / "run")
    args = ["--dataset", "synthetic", "--limit-train", "64", "--limit-test", "20", "--depth", "8",
            "--batch", "16", "--epochs", "1", "--mode", "exact", "--out", out, "--no-progress"]
    assert run_train(args + ["--time-limit", "1e-9"]) == EXIT_TIME_LIMIT      # one step, then stop
    text = capsys.readouterr().out
    assert "preact-resnet8-cifar: 77,850 params, batch 16" in text
    assert "planned memory by kind" in text and "saved" in text and "total" in text
    assert "stopped (time-limit) at epoch 0.25" in text and "--resume" in text
    # --resume takes the settings from the checkpoint; --epochs may grow
    assert run_train(["--out", out, "--resume", "--epochs", "2"]) == EXIT_OK
    text = capsys.readouterr().out
    assert "note: resuming with epochs 2 (checkpoint 1)" in text and "resuming at iteration 1" in text
    assert "final test accuracy" in text
    assert [r["epoch"] for r in read_metrics(out) if r["event"] == "epoch"] == [1, 2]
    assert run_train(args[:-3]) == EXIT_USAGE               # no --out: a bad command line


# ----------------------------------------------------------------------------- the step, the edges

def test_the_step_is_engine_train_step_and_its_error_is_a_divergence(tiny_data, tmp_path, monkeypatch):
    trainer = Trainer(tiny_config(tmp_path), dataset=tiny_data, log=quiet)
    calls, real = [], trainer.engine.train_step

    def train_step(x, labels, opt, **kw):
        calls.append(len(x))
        if len(calls) == STEPS + 3:
            raise FloatingPointError("non-finite loss nan (learning rate too high?)")
        return real(x, labels, opt, **kw)
    monkeypatch.setattr(trainer.engine, "train_step", train_step)
    with pytest.raises(TrainingDiverged, match=r"non-finite loss nan .* at iteration 11 \(epoch 2, step 3"):
        trainer.fit()
    assert calls == [16] * (STEPS + 3)
    assert load_checkpoint(tmp_path / CHECKPOINT)[1]["iteration"] == STEPS        # the last good one
    assert read_metrics(tmp_path)[-1]["reason"] == "diverged"


def strict_records(run_dir):
    """metrics.jsonl parsed as strict JSON: NaN / Infinity are not JSON."""
    def refuse(constant):
        raise AssertionError(f"{constant} in metrics.jsonl")
    return [json.loads(line, parse_constant=refuse) for line in (run_dir / METRICS).read_text().splitlines()]


@pytest.mark.filterwarnings("ignore:overflow:RuntimeWarning", "ignore:invalid:RuntimeWarning")
def test_a_non_finite_test_loss_stops_the_run_and_metrics_stay_strict_json(tiny_data, tmp_path):
    def overflow_the_logits(trainer, loss):         # finite weights, but logits of inf on every image
        if trainer.iteration == STEPS:
            trainer.net.params["fc.weight"].data[0] = 3e38
    with pytest.raises(TrainingDiverged, match="non-finite test loss"):
        train(tiny_data, tmp_path, on_step=overflow_the_logits)
    records = strict_records(tmp_path)
    epoch = [r for r in records if r["event"] == "epoch"]
    assert len(epoch) == 1 and epoch[0]["test_loss"] is None and math.isfinite(epoch[0]["train_loss"])
    assert records[-1]["reason"] == "diverged"
    assert not (tmp_path / CHECKPOINT).exists()                  # that state was never saved


def test_resuming_a_finished_run_says_so_and_writes_nothing(tiny_data, tmp_path, capsys):
    out = tmp_path / "run"
    args = ["--dataset", "synthetic", "--limit-train", "32", "--limit-test", "8", "--depth", "8", "--batch", "16",
            "--out", str(out), "--no-progress"]
    assert run_train(args + ["--epochs", "2"]) == EXIT_OK
    before = {n: (out / n).read_bytes() for n in (CHECKPOINT, METRICS)}
    capsys.readouterr()
    assert run_train(["--out", str(out), "--resume"]) == EXIT_OK              # the same --epochs
    assert "already finished" in capsys.readouterr().out
    assert run_train(["--out", str(out), "--resume", "--epochs", "1"]) == EXIT_ERROR   # fewer
    assert "has already trained 2 epochs (iteration 4), more than epochs=1" in capsys.readouterr().err
    assert {n: (out / n).read_bytes() for n in (CHECKPOINT, METRICS)} == before       # no second record
    assert [r["reason"] for r in strict_records(out) if r["event"] == "stop"] == ["finished"]


def test_a_second_ctrl_c_while_stopping_exits_130_with_a_message(tmp_path, capsys, monkeypatch):
    """The first Ctrl-C stopped the run; the second lands as the stop is reported."""
    def print_(*a, **k):
        if a and str(a[0]).startswith("stopped ("):
            raise KeyboardInterrupt
        print(*a, **k)
    from lowmem.tools.commands import train as train_command
    monkeypatch.setattr(train_command, "print", print_, raising=False)
    args = ["--dataset", "synthetic", "--limit-train", "32", "--limit-test", "8", "--depth", "8", "--batch", "16",
            "--out", str(tmp_path / "run"), "--no-progress", "--time-limit", "1e-9"]
    assert run_train(args) == 130
    assert "aborted by a second Ctrl-C; the last checkpoint (if any) is kept" in capsys.readouterr().err
    assert load_checkpoint(tmp_path / "run" / CHECKPOINT)[1]["iteration"] == 1


def test_a_full_disk_names_the_checkpoint(tmp_path, capsys, monkeypatch):
    real = open

    def full(path, mode="r", *a, **k):
        f = real(path, mode, *a, **k)
        if "x" in mode and os.path.basename(path).startswith(CHECKPOINT):
            f.write = lambda b: (_ for _ in ()).throw(OSError(28, "No space left on device"))
        return f
    monkeypatch.setattr(atomic, "open", full, raising=False)
    out = tmp_path / "run"
    args = ["--dataset", "synthetic", "--limit-train", "32", "--limit-test", "8", "--depth", "8", "--batch", "16",
            "--out", str(out), "--no-progress", "--epochs", "1"]
    assert run_train(args) == EXIT_ERROR
    err = capsys.readouterr().err
    assert f"cannot write checkpoint {str(out / CHECKPOINT)!r}: No space left on device" in err
    assert not [n for n in os.listdir(out) if n.startswith(CHECKPOINT)]    # no half-written file


@pytest.mark.parametrize("damage, words", [
    (lambda m: m.pop("config"), "'config' is missing"),
    (lambda m: m.pop("optimizer"), "'optimizer' is missing"),
    (lambda m: m.pop("epoch_sums"), "'epoch_sums' is missing"),
    (lambda m: m.update(epoch_sums=[1, 2]), "'epoch_sums' is a list, expected a dict"),
    (lambda m: m.update(iteration="8"), "'iteration' is a str"),
    (lambda m: m.update(optimizer={"lr": float("nan"), "started": True}), "SGD lr must be a finite number"),
    (lambda m: m.update(rng={"bit_generator": "nonsense"}), "malformed training metadata"),
])
def test_malformed_checkpoint_metadata_is_a_clear_error(tiny_data, tmp_path, capsys, damage, words):
    train(tiny_data, tmp_path, epochs=1)
    path = tmp_path / CHECKPOINT
    arrays, meta = load_checkpoint(path)
    damage(meta)
    save_checkpoint(path, arrays, meta)                          # a well-formed file with bad contents
    with pytest.raises(CheckpointError, match=words):
        Trainer(tiny_config(tmp_path), dataset=tiny_data, resume=True, log=quiet)
    assert run_train(["--out", str(tmp_path), "--resume"]) == EXIT_ERROR
    err = capsys.readouterr().err
    assert "Traceback" not in err and (words in err or "malformed training metadata" in err), err


def test_config_refuses_what_sgd_and_the_run_folder_would(tmp_path):
    for kw, words in [({"momentum": float("nan")}, "momentum=nan"), ({"momentum": 1.0}, "in \\[0, 1\\)"),
                      ({"weight_decay": float("inf")}, "weight_decay=inf"), ({"lr": float("nan")}, "lr=nan"),
                      ({"out": ""}, "out='': expected a folder name"), ({"model": "vgg"}, "model='vgg'"),
                      ({"bits": 3}, "bits=3"), ({"limit_train": 8}, "limit_train=8: expected at least batch=16"),
                      ({"dataset": "fashion-mnist", "pad_to": 20}, "pad_to=20: expected 0 .* or at least 28"),
                      ({"nesterov": True, "momentum": 0}, "nesterov=True")]:
        with pytest.raises(ConfigError, match=words):
            tiny_config(**kw).validate()


# ----------------------------------------------------------------------------- a real run

FASHION = "/usr/share/datasets/fashion-mnist/train-images-idx3-ubyte.gz"


@pytest.mark.slow
@pytest.mark.skipif(not os.path.exists(FASHION), reason="Fashion-MNIST not installed "
                    "(apt-get install dataset-fashion-mnist)")
def test_fashion_mnist_approx_4bit_learns(tmp_path, capsys):
    """ResNet-8, 4-bit approximate activations, 400 steps of batch 32 on 28x28 Fashion-MNIST."""
    args = ["--dataset", "fashion-mnist", "--pad-to", "0", "--limit-train", "6400", "--limit-test", "2000",
            "--depth", "8", "--mode", "approx", "--bits", "4", "--batch", "32", "--epochs", "2",
            "--lr", "0.1", "--schedule", "cosine", "--no-augment", "--out", str(tmp_path), "--no-progress"]
    assert run_train(args) == EXIT_OK
    final = [r for r in read_metrics(tmp_path) if r["event"] == "epoch"][-1]
    assert final["iteration"] == 400 and final["test_acc"] >= 0.75, final


def test_bits_auto_keeps_the_settings_and_records_the_widths(tiny_data, tmp_path):
    """bits="auto": the widths measured at the start are the trainer's own field; the settings the
    caller passed still say "auto", while config.json and the checkpoint record the widths (so a
    resume continues with them); a second Trainer from the same settings object measures again."""
    cfg = tiny_config(tmp_path / "run", bits="auto", avg_bits=2, epochs=1)
    trainer = Trainer(cfg, dataset=tiny_data, log=quiet)
    assert cfg.bits == "auto" and trainer.config.bits == "auto"
    assert isinstance(trainer.widths, dict) and trainer.widths == trainer.allocation.bits
    assert trainer.run_config.bits == trainer.widths and trainer.engine.unit_bits == trainer.widths
    trainer.fit()
    recorded = json.loads((tmp_path / "run" / "config.json").read_text())
    assert recorded["bits"] == trainer.widths and recorded["avg_bits"] == 2
    assert load_checkpoint(str(tmp_path / "run" / CHECKPOINT))[1]["config"]["bits"] == trainer.widths
    with Trainer(cfg, dataset=tiny_data, overwrite=True, log=quiet) as again:   # measured again, not from cfg
        assert again.allocation is not None and again.widths == trainer.widths
    resumed = Trainer(tiny_config(tmp_path / "run", bits="auto", avg_bits=2, epochs=2), dataset=tiny_data,
                      resume=True, log=quiet)
    assert resumed.allocation is None and resumed.widths == trainer.widths
