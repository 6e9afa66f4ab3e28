"""One index file: named numpy arrays behind a self-describing header, written atomically and
memory-mapped read-only.

    b"LONGRUN-INDEX/1\\n"     16 bytes of magic
    uint64 (little-endian)    length H of the header
    H bytes of JSON           {"format", "key_sha256", "key", "data_bytes", "arrays": [{"name",
                              "dtype", "shape", "offset"}, ...]}
    the arrays' bytes         from the first 64-byte boundary after the header, each at an
                              aligned offset (counted from there), in the order listed

The header names what the file was built from (`key`, and the sha256 of its canonical JSON)
and how many bytes of arrays follow it, so a reader trusts a file only when it describes exactly the data
it was asked for and is as long as its header says: a file cut short by a full disk or a copy,
or one whose header was overwritten, is reported as unusable (and rebuilt by the caller), never
read. Bit rot inside the arrays under an intact header is not detected (checking it would mean
reading the whole index on every rank, which is what the file is there to avoid).

A file is written to a temporary name in its directory, fsynced and renamed into place, so a
reader sees no file or a whole one. Reading maps the file once (mmap, read-only) and returns
arrays that are views of the mapping: every process mapping one file shares the same page-cache
pages, and a file replaced later leaves existing mappings intact (they hold the old inode).
"""

from __future__ import annotations

import hashlib
import json
import mmap
import os
import uuid
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from longrun.data.shards import fsync_dir
from longrun.safe_files import create

MAGIC = b"LONGRUN-INDEX/1\n"
FORMAT = "longrun-index/1"
_ALIGN = 64
_LENGTH = np.dtype("<u8")
_MAX_HEADER = 1 << 24  # a header is a few hundred bytes per array; more means a damaged file


def key_sha256(key: Mapping[str, Any]) -> str:
    """The digest that names what an index was built from (canonical JSON of `key`)."""
    return hashlib.sha256(json.dumps(key, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def _aligned(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


def _data_start(header_length: int) -> int:
    """Where the arrays begin: after the magic, the length and the header, aligned."""
    return _aligned(len(MAGIC) + _LENGTH.itemsize + header_length)


def _header(key: Mapping[str, Any], arrays: Mapping[str, np.ndarray]) -> bytes:
    # Offsets count from the start of the arrays, so the header does not depend on its own length.
    entries, at = [], 0
    for name, array in arrays.items():
        entries.append({"name": name, "dtype": array.dtype.str, "shape": list(array.shape), "offset": at})
        at = _aligned(at + array.nbytes)
    return json.dumps({"format": FORMAT, "key_sha256": key_sha256(key), "key": key,
                       "data_bytes": at, "arrays": entries}, sort_keys=True).encode()


def write_index(path: Path, key: Mapping[str, Any], arrays: Mapping[str, np.ndarray]) -> None:
    """Write `arrays` as the index of `key` at `path`, atomically (temp file, fsync, rename)."""
    arrays = {name: np.ascontiguousarray(a, dtype=np.asarray(a).dtype.newbyteorder("<"))
              for name, a in arrays.items()}
    header = _header(key, arrays)
    start = _data_start(len(header))
    described = json.loads(header)
    # Unique per writer: two processes building at once (no lock on this file system) never
    # write into one temporary file; whichever renames last wins, with identical content.
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp")
    try:
        with create(tmp) as f:  # a new file: never through a link planted in a shared data dir
            f.write(MAGIC)
            f.write(np.array([len(header)], dtype=_LENGTH).tobytes())
            f.write(header)
            for entry, array in zip(described["arrays"], arrays.values(), strict=True):
                f.write(b"\0" * (start + entry["offset"] - f.tell()))
                f.write(array.data)
            f.write(b"\0" * (start + described["data_bytes"] - f.tell()))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    fsync_dir(path.parent)


class UnusableIndex(Exception):
    """An index file that is there but cannot be trusted; the message says why."""


def _parse_header(data: mmap.mmap, size: int, expected_sha256: str) -> tuple[dict[str, Any], int]:
    """The header of a mapped index file and where its arrays start; UnusableIndex if it does
    not describe the index asked for, whole."""
    at = len(MAGIC) + _LENGTH.itemsize
    if size < at or data[:len(MAGIC)] != MAGIC:
        raise UnusableIndex("it does not start with the index magic")
    length = int(np.frombuffer(data, dtype=_LENGTH, count=1, offset=len(MAGIC))[0])
    if length > min(_MAX_HEADER, size - at):
        raise UnusableIndex(f"its header length ({length}) runs past the end of the file")
    try:
        header = json.loads(bytes(data[at:at + length]))
    except ValueError:
        raise UnusableIndex("its header is not valid JSON") from None
    if not isinstance(header, dict) or header.get("format") != FORMAT:
        raise UnusableIndex(f"it is not a {FORMAT} file")
    if header.get("key_sha256") != expected_sha256:
        raise UnusableIndex("it was built from other data")
    start = _data_start(length)
    expected = start + header.get("data_bytes", -1)
    if size != expected:
        raise UnusableIndex(f"it is {size} bytes, its header says {expected} (truncated or damaged)")
    return header, start


def _view(data: mmap.mmap, entry: Any, start: int, size: int) -> np.ndarray:
    try:
        dtype, shape = np.dtype(entry["dtype"]), tuple(int(n) for n in entry["shape"])
        at = start + int(entry["offset"])
    except (KeyError, TypeError, ValueError):
        raise UnusableIndex(f"its header describes an array incompletely ({entry!r})") from None
    count = int(np.prod(shape, dtype=np.int64))
    if min(shape, default=0) < 0 or at < start or at + count * dtype.itemsize > size:
        raise UnusableIndex(f"its array {entry.get('name')!r} runs past the end of the file")
    if count == 0:
        return np.zeros(shape, dtype=dtype)
    return np.frombuffer(data, dtype=dtype, count=count, offset=at).reshape(shape)


def read_index(path: Path, key: Mapping[str, Any]) -> dict[str, np.ndarray] | None:
    """The arrays of the index of `key` at `path` as read-only views of one shared mapping;
    None when there is no such file; UnusableIndex when there is one that cannot be trusted."""
    try:
        f = open(path, "rb")  # noqa: SIM115  (the mapping outlives the file object)
    except FileNotFoundError:
        return None
    with f:
        size = os.fstat(f.fileno()).st_size
        if size == 0:
            raise UnusableIndex("it is empty")
        # Mapped from the descriptor that was opened: a rename over `path` meanwhile cannot
        # put another file under the header that is checked.
        data = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    header, start = _parse_header(data, size, key_sha256(key))
    arrays = {}
    for entry in header["arrays"]:
        array = _view(data, entry, start, size)
        array.flags.writeable = False
        arrays[str(entry["name"])] = array
    return arrays
