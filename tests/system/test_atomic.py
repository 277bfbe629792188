"""lowmem.system.atomic.atomic_write: the target holds the old file or the new one, never a mix, and no
temporary file stays behind, whatever fails on the way."""
import os

import pytest

from lowmem.system.atomic import atomic_write


def test_writes_text_bytes_and_a_streaming_writer(tmp_path):
    atomic_write(tmp_path / "a.txt", "héllo\n")
    atomic_write(tmp_path / "b.bin", b"\x00\x01")
    atomic_write(tmp_path / "c.bin", lambda f: [f.write(bytes([i])) for i in range(3)])
    assert (tmp_path / "a.txt").read_text(encoding="utf-8") == "héllo\n"
    assert (tmp_path / "b.bin").read_bytes() == b"\x00\x01"
    assert (tmp_path / "c.bin").read_bytes() == b"\x00\x01\x02"
    assert sorted(os.listdir(tmp_path)) == ["a.txt", "b.bin", "c.bin"]


def test_a_crash_mid_write_keeps_the_old_file_intact(tmp_path):
    path = tmp_path / "f"
    atomic_write(path, b"old contents")

    def dies_half_way(f):
        f.write(b"new contents, first half ")
        assert [n for n in os.listdir(tmp_path) if n != "f"][0].startswith("f.tmp-")   # beside the target
        raise KeyboardInterrupt                     # even Ctrl-C cleans up

    with pytest.raises(KeyboardInterrupt):
        atomic_write(path, dies_half_way)
    assert path.read_bytes() == b"old contents"
    assert os.listdir(tmp_path) == ["f"]


@pytest.mark.parametrize("where", ["fsync", "replace"])
def test_a_failing_fsync_or_rename_names_the_file_and_keeps_the_old_one(tmp_path, monkeypatch, where):
    path = tmp_path / "m.json"
    atomic_write(path, "old")

    def full_disk(*a):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, where, full_disk)
    with pytest.raises(OSError) as info:
        atomic_write(path, "new", what="metrics")
    monkeypatch.undo()
    assert info.value.errno == 28
    assert str(info.value) == f"[Errno 28] cannot write metrics {str(path)!r}: No space left on device"
    assert path.read_text() == "old" and os.listdir(tmp_path) == ["m.json"]


def test_the_rename_is_made_durable_by_a_directory_fsync(tmp_path, monkeypatch):
    synced, real = [], os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: synced.append(os.path.isdir(f"/proc/self/fd/{fd}"))
                        or real(fd))
    atomic_write(tmp_path / "x", "1")
    assert synced[-1] is True or os.name == "nt"     # the file first, then its folder
    assert synced[0] is False


@pytest.mark.parametrize("where", ["a folder", "no folder", "under a file"])
def test_a_target_that_cannot_be_a_file_is_named_not_its_temporary(tmp_path, where):
    """The error names the target the caller gave, never the temporary beside it (whose own
    cleanup fails the same way under a file)."""
    (tmp_path / "dir").mkdir()
    (tmp_path / "file").write_text("x")
    path = {"a folder": tmp_path / "dir", "no folder": tmp_path / "missing" / "x",
            "under a file": tmp_path / "file" / "x"}[where]
    with pytest.raises(OSError) as info:
        atomic_write(path, "new", what="figure")
    assert f"cannot write figure {str(path)!r}" in str(info.value) and ".tmp-" not in str(info.value)
    assert sorted(os.listdir(tmp_path)) == ["dir", "file"] and os.listdir(tmp_path / "dir") == []
