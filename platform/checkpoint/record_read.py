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
import os
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import fsspec
import torch
from fsspec.implementations.local import LocalFileSystem
from torch import Tensor
from torch.distributed.checkpoint.metadata import MetadataIndex

from longrun.checkpoint import checksum
from longrun.checkpoint.dcp_format import StoredItem
from longrun.checkpoint.records import tensor_bytes

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
    tensor = torch.empty(stored.sizes, dtype=stored.dtype, pin_memory=pin)
    if length != tensor.numel() * tensor.element_size() or start + length > stored.length:
        raise CorruptShardError(f"{path}: the record at byte {stored.offset} says its tensor has "
                                f"{length} bytes, its shape {tuple(stored.sizes)} {stored.dtype} needs "
                                f"{tensor.numel() * tensor.element_size()}")
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
    targets = [_target(i, records[i], f"{step_dir}/{records[i].relative_path}", pin) for i in order]
    local = isinstance(fs, LocalFileSystem)
    fds: dict[str, int] = {}
    try:
        if local:
            for t in targets:
                if t.path not in fds:
                    try:
                        fds[t.path] = os.open(t.path, os.O_RDONLY)
                    except FileNotFoundError:
                        raise CorruptShardError(f"{t.path} is missing") from None
        with ThreadPoolExecutor(threads, thread_name_prefix="longrun-ckpt-read") as pool:
            def read(t: _Target, view: memoryview, at: int) -> Future:
                if local:
                    return pool.submit(_pread_into, fds[t.path], view, at, t.path)
                return pool.submit(_fetch_into, fs, t.path, view, at)

            chunks = [_submit_chunks(t, read) for t in targets]
            try:
                return {t.index: _verify(t, parts) for t, parts in zip(targets, chunks, strict=True)}
            finally:
                for parts in chunks:
                    for future, _ in parts:
                        future.cancel()
    finally:
        for fd in fds.values():
            os.close(fd)


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
