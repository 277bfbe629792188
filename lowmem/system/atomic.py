"""One way to replace a file so that a crash never leaves it half-written.

    atomic_write("runs/c10/config.json", text)              # str or bytes
    atomic_write(path, lambda f: f.write(...), what="checkpoint")   # stream into the open file

Every file lowmem writes for keeps (checkpoints, metrics, exported models,
downloads, result files) goes through `atomic_write`:

1. write everything into a temporary file beside the target
   (`<path>.tmp-<pid>-<random>`, opened with "x" so no other writer's file is
   ever clobbered; same folder, hence same file system, so the rename below
   is a rename and not a copy);
2. flush and fsync it: the bytes are on disk before any name points at them;
3. `os.replace` it onto the target: atomic on POSIX and Windows, so a reader
   sees the old complete file or the new complete one, never a mix;
4. fsync the folder, so the rename itself survives a power cut.

Any exception on the way (a full disk, Ctrl-C, an error raised by the
writer) removes the temporary file and leaves the old target untouched; an
OSError is re-raised naming the file (`cannot write <what> '<path>': <why>`,
errno kept). Not covered: SIGKILL or a power cut in the middle, which can
leave a stray `<path>.tmp-*` (the target is still intact; lowmem's run folder
treats such files as its own).
"""
import os
import secrets


def atomic_write(path, data, what=None, binary=None):
    """Replace `path` with `data` atomically (module docstring).

    data: str (written as UTF-8 text), bytes-like, or a callable writer(f)
    that writes into the open temporary file f (binary unless binary=False).
    what: a word for error messages ("checkpoint"). Returns path."""
    path = os.fspath(path)
    if binary is None:
        binary = not isinstance(data, str)
    tmp = f"{path}.tmp-{os.getpid()}-{secrets.token_hex(4)}"
    try:
        with open(tmp, "xb" if binary else "x", **({} if binary else {"encoding": "utf-8"})) as f:
            if callable(data):
                data(f)
            else:
                f.write(data)
            f.flush()
            os.fsync(f.fileno())            # data on disk before the name points at it
        os.replace(tmp, path)
    except BaseException as e:              # includes KeyboardInterrupt
        try:
            os.unlink(tmp)
        except OSError:                     # never made (no folder, a file where one should be)
            pass
        if isinstance(e, OSError):          # a full disk says which file it was writing (the target,
            why = f"cannot write {what + ' ' if what else ''}{path!r}: {e.strerror or e}"   # not tmp)
            raise (OSError(e.errno, why) if e.errno is not None else OSError(why)) from e
        raise
    fsync_directory(os.path.dirname(os.path.abspath(path)))
    return path


def fsync_directory(directory):
    """Make a rename in `directory` durable (POSIX); Windows cannot open a directory, so skip it there."""
    if os.name == "nt":
        return
    fd = os.open(directory, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    except OSError:     # some file systems refuse fsync on directories; the rename is done
        pass
    finally:
        os.close(fd)
