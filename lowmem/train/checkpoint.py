"""Checkpoints: named arrays plus JSON metadata in one self-checking file.

What is saved: a dict of named numeric arrays (parameters, optimizer moments,
...) as raw C-order bytes with their dtype and shape, and a JSON `meta` dict
(epoch, step, config, an RNG `bit_generator.state` with its big ints, ...).
Nothing is pickled, so loading a file, even a hostile one, never runs code;
only bool/int/uint/float/complex dtypes are accepted in either direction.

File layout (all integers little-endian):

    [0, 28)         prefix: b"LOWMEMCK", version u32, header bytes H u64,
                    payload bytes P u64
    [28, 28+H)      header: ASCII JSON {"meta": ..., "arrays": [{"name",
                    "dtype", "shape", "offset", "nbytes"}, ...]}, padded with
                    spaces so the payload starts on a 64-byte boundary
    [28+H, 28+H+P)  payload: each array's bytes at its `offset` (a multiple of
                    64, zero padding between), so loaded arrays are aligned
    last 32 bytes   SHA-256 of every byte before it

Why atomic: a crash, a full disk or Ctrl-C in the middle of a save must not
cost the previous checkpoint. `save_checkpoint` writes a temporary file next
to the target, fsyncs it, `os.replace`s it onto the target (atomic on POSIX
and Windows) and fsyncs the directory so the rename itself is durable: one
`lowmem.system.atomic.atomic_write`, the same every lowmem file goes through.

Guaranteed: `path` holds either the old complete checkpoint or the new one,
never a mix; `load_checkpoint` returns data only after magic, version, sizes
and checksum agree, so truncation or any changed byte raises
`CheckpointError` instead of handing back silently wrong weights.
Not guaranteed: protection against deliberate tampering (SHA-256 with no key
is a checksum, not a signature: whoever can edit the file can recompute it);
cleanup after SIGKILL or power loss mid-save (a stray `<path>.tmp-*` file may
remain; the target is still intact); meta round trips only as JSON does
(tuples come back as lists, dict keys as strings); portability of the bytes
across machines of different byte order beyond what the dtype string says.
"""
import hashlib
import json
import os
import struct

import numpy

from ..system.atomic import atomic_write, fsync_directory  # noqa: F401 (fsync_directory: re-exported)

MAGIC = b"LOWMEMCK"
VERSION = 1
_PREFIX = struct.Struct("<8sIQQ")   # magic, version, header bytes, payload bytes
_DIGEST = 32                        # SHA-256 bytes at the end of the file
_ALIGN = 64                         # payload and array offsets are multiples of this
_KINDS = "biufc"                    # bool, int, uint, float, complex: plain bytes, no objects


class CheckpointError(ValueError):
    """A file that is missing, not a checkpoint, or damaged."""


def _fail(path, problem):
    return CheckpointError(f"checkpoint {os.fspath(path)!r}: {problem}")


def _pad(n):
    """Bytes needed to bring offset n up to the next multiple of _ALIGN."""
    return -n % _ALIGN


# ----------------------------------------------------------------------------- save

def save_checkpoint(path, arrays, meta=None):
    """Atomically write `arrays` (dict name -> array) and `meta` (JSON dict) to `path`.

    Arrays may be NumPy arrays, anything `numpy.asarray` takes, or CuPy arrays
    (copied to the host one at a time with `.get()` while writing). Everything
    is validated before the disk is touched. On any exception the temporary
    file is removed, the checkpoint already at `path` is left as it was, and
    the exception propagates.
    """
    path = os.fspath(path)
    if meta is not None and not isinstance(meta, dict):
        raise TypeError(f"checkpoint meta must be a dict (JSON object), got {type(meta).__name__}")
    # Pass 1: dtypes, shapes and the header; CuPy arrays stay on the device.
    arrays = {name: a if hasattr(a, "get") else numpy.asarray(a) for name, a in arrays.items()}
    entries, offset = [], 0
    for name, a in arrays.items():
        if not isinstance(name, str):
            raise TypeError(f"array names must be str, got {name!r}")
        dtype = numpy.dtype(a.dtype)
        if dtype.kind not in _KINDS:
            raise TypeError(f"array {name!r}: dtype {dtype} cannot be checkpointed "
                            f"(only bool, int, uint, float, complex)")
        nbytes = int(numpy.prod(a.shape, dtype=numpy.int64)) * dtype.itemsize
        offset += _pad(offset)
        entries.append({"name": name, "dtype": dtype.str, "shape": [int(d) for d in a.shape],
                        "offset": offset, "nbytes": nbytes})
        offset += nbytes
    payload_nbytes = offset
    header = json.dumps({"meta": {} if meta is None else meta, "arrays": entries}).encode("ascii")
    header += b" " * _pad(_PREFIX.size + len(header))

    # Pass 2: stream prefix, header and arrays into lowmem.system.atomic's temporary file, hashing as we go.
    def write(f):
        sha = hashlib.sha256()

        def put(b):
            sha.update(b)
            f.write(b)

        put(_PREFIX.pack(MAGIC, VERSION, len(header), payload_nbytes))
        put(header)
        written = 0
        for a, e in zip(arrays.values(), entries):
            put(bytes(e["offset"] - written))
            host = a.get() if hasattr(a, "get") else a
            put(numpy.ascontiguousarray(host).reshape(-1).view(numpy.uint8))
            written = e["offset"] + e["nbytes"]
        f.write(sha.digest())

    atomic_write(path, write, what="checkpoint")


# ----------------------------------------------------------------------------- load

def _open(path):
    try:
        return open(path, "rb")
    except FileNotFoundError:
        raise _fail(path, "no such file") from None
    except OSError as e:
        raise _fail(path, f"cannot be read ({e.strerror or e})") from e


def _read_prefix(f, path):
    """Check magic, version and file size; return (header bytes, payload bytes, file size)."""
    size = os.fstat(f.fileno()).st_size
    raw = f.read(_PREFIX.size)
    minimum = _PREFIX.size + _DIGEST
    if raw[:len(MAGIC)] != MAGIC:
        if len(raw) < len(MAGIC) and MAGIC.startswith(raw):    # incl. an empty file
            raise _fail(path, f"truncated (expected at least {minimum} bytes, found {size})")
        raise _fail(path, "not a lowmem checkpoint (bad magic bytes)")
    if len(raw) < _PREFIX.size:
        raise _fail(path, f"truncated (expected at least {minimum} bytes, found {size})")
    _, version, header_nbytes, payload_nbytes = _PREFIX.unpack(raw)
    if version != VERSION:
        raise _fail(path, f"unsupported format version {version} "
                          f"(this lowmem reads version {VERSION})")
    expected = minimum + header_nbytes + payload_nbytes
    if size < expected:
        raise _fail(path, f"truncated (expected {expected} bytes, found {size})")
    if size > expected:
        raise _fail(path, f"wrong size (expected {expected} bytes, found {size}): "
                          f"file is corrupted or was altered")
    return header_nbytes, payload_nbytes, size


def _parse_header(raw, path, payload_nbytes):
    """JSON header -> (meta, entries), each entry checked against the payload size."""
    try:
        header = json.loads(raw.decode("ascii"))
        meta, entries = header["meta"], header["arrays"]
        if not isinstance(meta, dict):
            raise ValueError(f"meta is a JSON {type(meta).__name__}, not an object")
        for e in entries:
            dtype = numpy.dtype(e["dtype"])
            shape = tuple(int(d) for d in e["shape"])
            count = int(numpy.prod(shape, dtype=numpy.int64))
            if (dtype.kind not in _KINDS or min(shape, default=0) < 0
                    or e["nbytes"] != count * dtype.itemsize
                    or not 0 <= e["offset"] <= payload_nbytes - e["nbytes"]):
                raise ValueError(f"bad entry {e}")
            e["dtype"], e["shape"] = dtype, shape
    except (ValueError, KeyError, TypeError, UnicodeDecodeError) as err:
        raise _fail(path, f"malformed header ({err})") from err
    return meta, entries


def load_checkpoint(path):
    """Read a checkpoint; returns (arrays, meta) with arrays a dict name -> numpy.ndarray.

    The whole file is read into one buffer and verified (magic, version, size,
    SHA-256) before anything is parsed. The arrays are writable, aligned views
    into that buffer with the saved dtype and shape (no second copy), so
    keeping any one of them keeps the whole buffer alive. Every failure raises
    `CheckpointError` naming the file and the problem.
    """
    with _open(path) as f:
        header_nbytes, payload_nbytes, size = _read_prefix(f, path)
        buf = numpy.empty(size, dtype=numpy.uint8)
        f.seek(0)
        if f.readinto(memoryview(buf)) != size:     # the file shrank under us
            raise _fail(path, f"truncated while reading (expected {size} bytes)")
    if hashlib.sha256(buf[:-_DIGEST]).digest() != buf[-_DIGEST:].tobytes():
        raise _fail(path, "checksum mismatch: file is corrupted or was altered")
    start = _PREFIX.size + header_nbytes
    meta, entries = _parse_header(buf[_PREFIX.size:start].tobytes(), path, payload_nbytes)
    arrays = {}
    for e in entries:
        lo = start + e["offset"]
        arrays[e["name"]] = buf[lo:lo + e["nbytes"]].view(e["dtype"]).reshape(e["shape"])
    return arrays, meta


def checkpoint_info(path):
    """Meta and array layout without reading the payload or verifying the checksum.

    Returns {"version", "nbytes" (file size), "meta", "arrays": {name: {"dtype",
    "shape", "nbytes"}}}. Magic, version and size are checked; use
    `load_checkpoint` to know the contents are intact.
    """
    with _open(path) as f:
        header_nbytes, payload_nbytes, size = _read_prefix(f, path)
        meta, entries = _parse_header(f.read(header_nbytes), path, payload_nbytes)
    return {"version": VERSION, "nbytes": size, "meta": meta,
            "arrays": {e["name"]: {"dtype": e["dtype"].str, "shape": e["shape"],
                                   "nbytes": e["nbytes"]} for e in entries}}
