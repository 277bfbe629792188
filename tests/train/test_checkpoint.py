"""Checkpoint format: exact round trip, atomic save, every kind of damage detected."""
import json
import os

import numpy
import pytest

from lowmem.train import checkpoint
from lowmem.train.checkpoint import CheckpointError, checkpoint_info, load_checkpoint, save_checkpoint


def sample_arrays():
    rng = numpy.random.default_rng(0)
    return {
        "conv1.w": rng.standard_normal((4, 3, 3, 3)).astype(numpy.float32),
        "fc.w": rng.standard_normal((5, 7)),                                # float64
        "fc.w.T": rng.standard_normal((7, 5)).T,                            # not C-contiguous
        "steps": numpy.arange(-3, 9, dtype=numpy.int64).reshape(3, 4),
        "packed": rng.integers(0, 256, size=37, dtype=numpy.uint8),       # odd size: padding
        "mask": rng.random((2, 3)) > 0.5,
        "lr": numpy.array(0.125),                                            # 0-d
        "step": numpy.int64(12345),                                          # numpy scalar -> 0-d
        "empty": numpy.zeros((0, 3), dtype=numpy.float32),
        "half_be": numpy.array([1.5, -2.0], dtype=">f2"),                    # non-native order
        "z": numpy.array([1 + 2j, -3j], dtype=numpy.complex128),
    }


def sample_meta():
    return {
        "epoch": 3,
        "rng": numpy.random.default_rng(1).bit_generator.state,             # 128-bit ints
        "history": {"loss": [2.3, 1.7, 0.9], "lr": [0.1, 0.1, 0.01]},
        "config": {"model": "resnet8", "bits": 4, "nested": {"deep": [1, [2, {"x": None}]]}},
        "huge": 2 ** 200 + 1,
        "name": "ünïcode ✓",
    }


def assert_same(loaded, original):
    assert list(loaded) == list(original)       # order kept
    for name, a in original.items():
        a = numpy.asarray(a)
        b = loaded[name]
        assert b.dtype == a.dtype and b.shape == a.shape, name
        assert numpy.array_equal(b, a), name


def make(tmp_path, name="model.ckpt"):
    path = tmp_path / name
    save_checkpoint(path, sample_arrays(), sample_meta())
    return path


# ----------------------------------------------------------------------------- round trip

def test_round_trip_exact(tmp_path):
    path = make(tmp_path)
    arrays, meta = load_checkpoint(path)
    assert_same(arrays, sample_arrays())
    assert meta == sample_meta()
    assert meta["rng"]["state"]["state"] > 2 ** 64                      # big int survived


def test_loaded_arrays_are_writable_and_aligned(tmp_path):
    arrays, _ = load_checkpoint(make(tmp_path))
    for name, a in arrays.items():
        assert a.flags.writeable and a.flags.aligned and a.flags.c_contiguous, name
    arrays["conv1.w"][...] = 0                                           # no error


def test_restored_rng_continues_the_same_stream(tmp_path):
    rng = numpy.random.default_rng(7)
    rng.standard_normal(10)
    save_checkpoint(tmp_path / "c", {}, {"rng": rng.bit_generator.state})
    expected = rng.standard_normal(5)
    _, meta = load_checkpoint(tmp_path / "c")
    restored = numpy.random.default_rng()
    restored.bit_generator.state = meta["rng"]
    assert numpy.array_equal(restored.standard_normal(5), expected)


def test_empty_checkpoint_and_default_meta(tmp_path):
    save_checkpoint(tmp_path / "c", {})
    assert load_checkpoint(tmp_path / "c") == ({}, {})


def test_device_arrays_are_copied_with_get(tmp_path):
    class FakeDeviceArray:              # the part of the CuPy interface save uses
        def __init__(self, a):
            self.dtype, self.shape, self._a = a.dtype, a.shape, a

        def get(self):
            return self._a.copy()

    x = numpy.arange(6, dtype=numpy.float32).reshape(2, 3)
    save_checkpoint(tmp_path / "c", {"x": FakeDeviceArray(x)}, {})
    assert_same(load_checkpoint(tmp_path / "c")[0], {"x": x})


def test_overwrite_replaces_previous(tmp_path):
    path = make(tmp_path)
    save_checkpoint(path, {"only": numpy.ones(2)}, {"v": 2})
    arrays, meta = load_checkpoint(path)
    assert list(arrays) == ["only"] and meta == {"v": 2}


def test_checkpoint_info_reads_no_payload(tmp_path):
    path = make(tmp_path)
    info = checkpoint_info(path)
    assert info["meta"] == sample_meta()
    assert info["nbytes"] == os.path.getsize(path)
    assert info["arrays"]["conv1.w"] == {"dtype": "<f4", "shape": (4, 3, 3, 3),
                                         "nbytes": 4 * 27 * 4}
    assert info["arrays"]["lr"]["shape"] == ()
    # A damaged payload goes unnoticed by info (it does not read it) but not by load.
    flip_byte(path, os.path.getsize(path) - 40)
    checkpoint_info(path)
    with pytest.raises(CheckpointError, match="checksum"):
        load_checkpoint(path)


def test_unsupported_dtype_rejected_before_writing(tmp_path):
    path = make(tmp_path)
    with pytest.raises(TypeError, match="object"):
        save_checkpoint(path, {"o": numpy.array([{"a": 1}], dtype=object)}, {})
    with pytest.raises(TypeError):                          # meta not JSON
        save_checkpoint(path, {}, {"f": lambda: 0})
    assert_same(load_checkpoint(path)[0], sample_arrays())
    assert os.listdir(tmp_path) == ["model.ckpt"]


# ----------------------------------------------------------------------------- atomic save

def test_crash_in_fsync_keeps_previous_checkpoint(tmp_path, monkeypatch):
    path = make(tmp_path)

    def broken_fsync(fd):
        raise OSError("disk on fire")

    monkeypatch.setattr(os, "fsync", broken_fsync)
    with pytest.raises(OSError, match="disk on fire"):
        save_checkpoint(path, {"new": numpy.zeros(10)}, {"v": "new"})
    monkeypatch.undo()
    arrays, meta = load_checkpoint(path)
    assert_same(arrays, sample_arrays())
    assert meta == sample_meta()
    assert os.listdir(tmp_path) == ["model.ckpt"]          # temp file removed


def test_crash_midway_through_payload_keeps_previous_checkpoint(tmp_path):
    path = make(tmp_path)

    class DyingDeviceArray:             # fails after the header and one array are written
        dtype, shape = numpy.dtype(numpy.float32), (1000,)

        def get(self):
            [tmp] = [n for n in os.listdir(tmp_path) if n != "model.ckpt"]
            assert tmp.startswith("model.ckpt.tmp-")            # half-written, beside the target
            raise KeyboardInterrupt                             # even Ctrl-C cleans up

    big = numpy.ones(100_000)
    with pytest.raises(KeyboardInterrupt):
        save_checkpoint(path, {"big": big, "dies": DyingDeviceArray()}, {"v": "new"})
    assert_same(load_checkpoint(path)[0], sample_arrays())
    assert os.listdir(tmp_path) == ["model.ckpt"]


def test_crash_in_replace_keeps_previous_checkpoint(tmp_path, monkeypatch):
    path = make(tmp_path)

    def broken_replace(src, dst):
        assert os.path.dirname(os.path.abspath(src)) == str(tmp_path)   # temp beside target
        raise OSError("rename failed")

    monkeypatch.setattr(os, "replace", broken_replace)
    with pytest.raises(OSError, match="rename failed"):
        save_checkpoint(path, {}, {"v": "new"})
    monkeypatch.undo()
    assert load_checkpoint(path)[1] == sample_meta()
    assert os.listdir(tmp_path) == ["model.ckpt"]


def test_first_save_crash_leaves_nothing(tmp_path, monkeypatch):
    def broken_fsync(fd):
        raise OSError("boom")

    monkeypatch.setattr(os, "fsync", broken_fsync)
    with pytest.raises(OSError):
        save_checkpoint(tmp_path / "c", sample_arrays(), {})
    assert os.listdir(tmp_path) == []


# ----------------------------------------------------------------------------- damage

def flip_byte(path, i):
    data = bytearray(path.read_bytes())
    data[i] ^= 0x01
    path.write_bytes(bytes(data))


def header_range(path):
    """(start, end) of the JSON header bytes."""
    _, _, header_nbytes, _ = checkpoint._PREFIX.unpack(path.read_bytes()[:checkpoint._PREFIX.size])
    return checkpoint._PREFIX.size, checkpoint._PREFIX.size + header_nbytes


@pytest.mark.parametrize("keep", [0, 3, 8, 20, 27, 28, 100, "header_end", "mid_payload", "minus1"])
def test_truncated_file(tmp_path, keep):
    path = make(tmp_path)
    data = path.read_bytes()
    keep = {"header_end": header_range(path)[1], "mid_payload": len(data) // 2 + 7,
            "minus1": len(data) - 1}.get(keep, keep)
    path.write_bytes(data[:keep])
    pattern = r"truncated \(expected (at least )?\d+ bytes, found %d\)" % keep
    with pytest.raises(CheckpointError, match=pattern) as e:
        load_checkpoint(path)
    assert str(path) in str(e.value)
    with pytest.raises(CheckpointError, match="truncated"):
        checkpoint_info(path)


def test_trailing_bytes_detected(tmp_path):
    path = make(tmp_path)
    with open(path, "ab") as f:
        f.write(b"\0")
    with pytest.raises(CheckpointError, match="wrong size"):
        load_checkpoint(path)


def test_flipped_byte_anywhere_in_header_or_payload(tmp_path):
    path = make(tmp_path)
    good = path.read_bytes()
    h0, h1 = header_range(path)
    rng = numpy.random.default_rng(3)
    positions = [h0, h0 + 1, (h0 + h1) // 2, h1 - 1, h1, len(good) - 33, len(good) - 1]
    positions += list(rng.integers(h0, len(good), size=20))
    for i in positions:
        path.write_bytes(good)
        flip_byte(path, int(i))
        with pytest.raises(CheckpointError,
                           match="checksum mismatch: file is corrupted or was altered"):
            load_checkpoint(path)


def test_every_prefix_byte_change_detected(tmp_path):
    path = make(tmp_path)
    good = path.read_bytes()
    for i in range(checkpoint._PREFIX.size):
        path.write_bytes(good)
        flip_byte(path, i)
        with pytest.raises(CheckpointError):
            load_checkpoint(path)


def test_not_a_checkpoint(tmp_path):
    junk = [b"hello world, this is a text file\n" * 10, b"PK\x03\x04" + bytes(100),
            numpy.random.default_rng(0).bytes(1000), b"xyz"]
    for i, content in enumerate(junk):
        path = tmp_path / f"f{i}"
        path.write_bytes(content)
        with pytest.raises(CheckpointError, match="not a lowmem checkpoint"):
            load_checkpoint(path)
        with pytest.raises(CheckpointError, match="not a lowmem checkpoint"):
            checkpoint_info(path)


def test_numpy_npz_is_not_a_checkpoint(tmp_path):
    numpy.savez(tmp_path / "w.npz", a=numpy.ones(3))
    with pytest.raises(CheckpointError, match="not a lowmem checkpoint"):
        load_checkpoint(tmp_path / "w.npz")


def test_missing_file(tmp_path):
    path = tmp_path / "nope.ckpt"
    with pytest.raises(CheckpointError, match="no such file") as e:
        load_checkpoint(path)
    assert str(path) in str(e.value)
    with pytest.raises(CheckpointError, match="no such file"):
        checkpoint_info(path)


def test_unsupported_version(tmp_path):
    path = make(tmp_path)
    data = bytearray(path.read_bytes())
    data[8:12] = (2).to_bytes(4, "little")
    path.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="unsupported format version 2"):
        load_checkpoint(path)


def test_checkpoint_error_is_value_error():
    assert issubclass(CheckpointError, ValueError)


def rewrite(path, mutate_header):
    """Re-sign a checkpoint after editing its header (what a forger could do)."""
    import hashlib
    data = path.read_bytes()
    h0, h1 = header_range(path)
    header = json.loads(data[h0:h1])
    mutate_header(header)
    new = json.dumps(header).encode().ljust(h1 - h0)
    assert len(new) == h1 - h0
    body = data[:h0] + new + data[h1:-32]
    path.write_bytes(body + hashlib.sha256(body).digest())


@pytest.mark.parametrize("mutate", [
    lambda h: h["arrays"][0].update(dtype="|O"),                     # object dtype: never
    lambda h: h["arrays"][0].update(dtype="|V4"),
    lambda h: h["arrays"][0].update(nbytes=h["arrays"][0]["nbytes"] + 4),
    lambda h: h["arrays"][0].update(offset=10 ** 9),                 # points outside the payload
    lambda h: h["arrays"][0].update(shape=[-1, 3]),
    lambda h: h.pop("meta"),
    lambda h: h.update(meta=[1, 2]),                                 # meta must be an object
    lambda h: h.update(meta="checkpoint"),
])
def test_resigned_malformed_header_rejected(tmp_path, mutate):
    path = make(tmp_path)
    rewrite(path, mutate)
    with pytest.raises(CheckpointError, match="malformed header"):
        load_checkpoint(path)


@pytest.mark.parametrize("meta", [[1, 2], "text", 3])
def test_meta_must_be_a_dict(tmp_path, meta):
    with pytest.raises(TypeError, match="checkpoint meta must be a dict"):
        save_checkpoint(tmp_path / "x.ckpt", {}, meta)
    assert os.listdir(tmp_path) == []


def test_a_failed_write_names_the_checkpoint(tmp_path, monkeypatch):
    path = make(tmp_path)

    def full_disk(fd):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "fsync", full_disk)
    with pytest.raises(OSError) as info:
        save_checkpoint(path, {"new": numpy.zeros(10)}, {"v": "new"})
    assert info.value.errno == 28
    assert str(info.value) == f"[Errno 28] cannot write checkpoint {str(path)!r}: No space left on device"
    monkeypatch.undo()
    assert load_checkpoint(path)[1] == sample_meta()
