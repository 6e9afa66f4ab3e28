"""Reading a checkpoint's DCP records with several readers, verified while they read.

Every record a restore needs is read as its byte range, in chunks, by a few threads at once
(`os.preadv` on a local or shared disk, ranged GETs through fsspec on an object store), while
the calling thread hashes each record's chunks in order as they arrive (`checksum.py`; xxh3
and the reads both release the GIL), so verifying costs no pass of its own.

A record this longrun wrote says where its tensor's bytes lie (`StoredItem.data`, from
`records.py`): they are read straight into a new tensor of the record's shape (in pinned
memory when the restore targets a GPU, so the copy to the device is one DMA), and its few
hundred bytes of zip around them only hashed; nothing is unpickled. Records of older
checkpoints are read whole and unpickled with `torch.load(weights_only=True)` once verified.
Nothing is copied into the live state here (`resharding.apply_reads` does that, once every
rank has verified its part).
"""

from __future__ import annotations

import io
import math
import os
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import IO

import fsspec
import torch
from torch import Tensor
from torch.distributed.checkpoint.metadata import MetadataIndex

from longrun.checkpoint import checksum
from longrun.checkpoint.dcp_format import StoredItem
from longrun.checkpoint.records import tensor_bytes
from longrun.checkpoint.stored import is_local, open_stored
from longrun.safe_files import UnsafePath

CHUNK_BYTES = 16 << 20
READ_THREADS = 4  # reads are I/O (the GIL is released): enough to keep a disk or a store busy


class CorruptShardError(ValueError):
    """A file or record is missing, truncated or does not match the manifest's checksum."""


@dataclass
class _Target:
    """Where one record's bytes go: its segments in file order, and what they become."""

    index: MetadataIndex
    stored: StoredItem
    path: str
    segments: list[memoryview]
    tensor: Tensor | None  # the record's tensor, filled by the reads (None: unpickled after)


def _target(index: MetadataIndex, stored: StoredItem, path: str, pin: bool) -> _Target:
    if stored.data is None:  # an older record: read whole, unpickled once verified
        return _Target(index, stored, path, [memoryview(bytearray(stored.length))], None)
    start, length = stored.data
    needed = math.prod(stored.sizes) * stored.dtype.itemsize
    if length != needed or start + length > stored.length:  # before the allocation (table_of checks too)
        raise CorruptShardError(f"{path}: the record at byte {stored.offset} says its tensor has "
                                f"{length} bytes, its shape {tuple(stored.sizes)} {stored.dtype} needs "
                                f"{needed}")
    tensor = torch.empty(stored.sizes, dtype=stored.dtype, pin_memory=pin)
    tail = stored.length - start - length
    return _Target(index, stored, path, [memoryview(bytearray(start)), tensor_bytes(tensor),
                                         memoryview(bytearray(tail))], tensor)


def _pread_into(fd: int, view: memoryview, offset: int, where: str) -> None:
    while view:
        got = os.preadv(fd, [view], offset)
        if got == 0:
            raise CorruptShardError(f"{where} is truncated (it ends before byte {offset})")
        view, offset = view[got:], offset + got


def _fetch_into(fs: fsspec.AbstractFileSystem, path: str, view: memoryview, offset: int) -> None:
    data = fs.cat_file(path, start=offset, end=offset + len(view))
    if len(data) != len(view):
        raise CorruptShardError(f"{path} is truncated (it ends before byte {offset + len(data)})")
    view[:] = data


def read_verified(fs: fsspec.AbstractFileSystem, step_dir: str, records: dict[MetadataIndex, StoredItem],
                  wanted: set[MetadataIndex], *, pin: bool = False,
                  threads: int = READ_THREADS) -> dict[MetadataIndex, Tensor]:
    """Every record in `wanted`, read, verified and turned into a host tensor: {record: tensor}.
    Raises CorruptShardError on a missing file or a record that does not match its checksum."""
    order = sorted(wanted, key=lambda i: (records[i].relative_path, records[i].offset))
    local = is_local(fs)
    files: dict[str, IO[bytes]] = {}
    try:
        _check_sizes(fs, step_dir, records, order, files)  # before anything is allocated
        targets = [_target(i, records[i], f"{step_dir}/{records[i].relative_path}", pin) for i in order]
        with ThreadPoolExecutor(threads, thread_name_prefix="longrun-ckpt-read") as pool:
            def read(t: _Target, view: memoryview, at: int) -> Future:
                if local:
                    return pool.submit(_pread_into, files[t.path].fileno(), view, at, t.path)
                return pool.submit(_fetch_into, fs, t.path, view, at)

            chunks = [_submit_chunks(t, read) for t in targets]
            try:
                return {t.index: _verify(t, parts) for t, parts in zip(targets, chunks, strict=True)}
            finally:
                for parts in chunks:
                    for future, _ in parts:
                        future.cancel()
    finally:
        for f in files.values():
            f.close()


def check_sizes(fs: fsspec.AbstractFileSystem, step_dir: str, records: dict[MetadataIndex, StoredItem],
                wanted: set[MetadataIndex]) -> None:
    """CorruptShardError unless every file holding a record in `wanted` is there, a regular file
    (on a local disk) and long enough for its records: what a reader checks before it allocates
    anything the manifest's shapes ask for (`record_bounds.py` bounds those by its files' sizes)."""
    files: dict[str, IO[bytes]] = {}
    try:
        _check_sizes(fs, step_dir, records, wanted, files)
    finally:
        for f in files.values():
            f.close()


def _check_sizes(fs: fsspec.AbstractFileSystem, step_dir: str, records: dict[MetadataIndex, StoredItem],
                 wanted: Iterable[MetadataIndex], files: dict[str, IO[bytes]]) -> None:
    ends: dict[str, int] = {}  # file -> the byte its last wanted record ends at
    for index in wanted:
        r = records[index]
        path = f"{step_dir}/{r.relative_path}"
        ends[path] = max(ends.get(path, 0), r.offset + r.length)
    for path, end in sorted(ends.items()):
        size = _stored_size(fs, path, files)
        if size < end:
            raise CorruptShardError(f"{path} is truncated (it ends at byte {size}, its records in the "
                                    f"manifest at byte {end})")


def _stored_size(fs: fsspec.AbstractFileSystem, path: str, files: dict[str, IO[bytes]]) -> int:
    """The size of `path` on storage; on a local disk the file is opened into `files` (a regular
    file only: a link or a FIFO there is refused, never followed or waited on)."""
    try:
        if not is_local(fs):
            return int(fs.size(path))
        files[path] = open_stored(fs, path)
        return os.fstat(files[path].fileno()).st_size
    except FileNotFoundError:
        raise CorruptShardError(f"{path} is missing") from None
    except UnsafePath as exc:
        raise CorruptShardError(str(exc)) from None


def _submit_chunks(t: _Target, read: Callable[[_Target, memoryview, int], Future]
                   ) -> list[tuple[Future, memoryview]]:
    parts, at = [], t.stored.offset
    for segment in t.segments:
        for start in range(0, len(segment), CHUNK_BYTES):
            view = segment[start:start + CHUNK_BYTES]
            parts.append((read(t, view, at + start), view))
        at += len(segment)
    return parts


def _verify(t: _Target, parts: list[tuple[Future, memoryview]]) -> Tensor:
    """Hash `t`'s chunks in order as their reads finish; its tensor once they match."""
    h = checksum.verifier(t.stored.checksum)
    for future, view in parts:
        try:
            future.result()
        except FileNotFoundError:
            raise CorruptShardError(f"{t.path} is missing") from None
        h.update(view)
    if not checksum.matches(t.stored.checksum, h):
        raise CorruptShardError(f"{t.path}: the record at byte {t.stored.offset} ({t.stored.length} "
                                "bytes) does not match its checksum")
    if t.tensor is not None:
        return t.tensor
    return torch.load(io.BytesIO(t.segments[0]), map_location="cpu", weights_only=True)
