"""A rank's DCP data file laid out before a byte is written, then written by several threads.

A record is what `torch.save(piece)` writes (DCP's FileSystemWriter writes one per tensor): a
zip holding a small pickle and the tensor's storage. The storage is the bulk; the rest is a
few hundred bytes. `torch.save` under `torch.serialization.skip_data()` writes the record
without the storage (it seeks over it), which gives, for the cost of a pickle, the record's
exact bytes on either side of one hole: the head, where the storage goes, and the tail. So
every record's bytes and offset in the file are known up front, and:

- the file is written by a few threads at once, each `pwrite`-ing chunks at their offsets (a
  local or shared disk; writes release the GIL), instead of one thread pushing `torch.save`'s
  output through Python;
- the checksums (`checksum.py`: each record's, and the whole file's) are computed on another
  thread from the same memory while the writes run, never in a pass of their own;
- the manifest records where the storage lies in each record (`data`), so a restore reads it
  straight into a tensor (`record_read.py`) instead of unpickling a copy.

The bytes are exactly `torch.save`'s except for the zip's CRC-32 fields, which stay zero
(`torch.load` and `dcp.load` do not check them; `checksum.py` guards the bytes instead). A piece
whose tensor does not own exactly its storage (a view) is copied into one that does first, as
`torch.save` would otherwise write the whole storage. On a store without positional writes
(an object store through fsspec) the file is streamed front to back instead, hashed on the way.
"""

from __future__ import annotations

import io
import os
from collections.abc import Iterator
from concurrent.futures import FIRST_EXCEPTION, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from longrun.checkpoint import checksum
from longrun.checkpoint.manifest import ShardInfo

CHUNK_BYTES = 16 << 20  # one pwrite: large enough to amortise the call, small enough to spread
WRITE_THREADS = 4  # writes are I/O (the GIL is released); more did not help a single disk


class _HoleRecorder(io.RawIOBase):
    """A file-like that keeps what torch.save writes, and where, and where it seeks over
    storage bytes. Writes are kept as they come, not in a buffer as long as the file: the
    tail lies past a hole as large as the tensor, and zero-filling that for every record
    cost as much as writing the checkpoint."""

    def __init__(self) -> None:
        super().__init__()
        self.writes: list[tuple[int, bytes]] = []  # (position, bytes) of each write
        self.pos = 0
        self.end = 0
        self.holes: list[tuple[int, int]] = []  # (position, length) of each skipped storage

    def writable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def write(self, data: Any) -> int:
        data = bytes(memoryview(data).cast("B"))
        self.writes.append((self.pos, data))
        self.pos += len(data)
        self.end = max(self.end, self.pos)
        return len(data)

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        if whence == io.SEEK_CUR:
            if offset:
                self.holes.append((self.pos, offset))
            self.pos += offset
        elif whence == io.SEEK_SET:
            self.pos = offset
        else:
            self.pos = self.end + offset
        return self.pos

    def tell(self) -> int:
        return self.pos

    def span(self, start: int, stop: int) -> bytes | None:
        """The bytes written in [start, stop), zeros where nothing was; None when a write
        crosses either edge (the span does not stand apart from its neighbours)."""
        out = bytearray(stop - start)
        for at, data in self.writes:
            if at >= stop or at + len(data) <= start:
                continue
            if at < start or at + len(data) > stop:
                return None
            out[at - start:at - start + len(data)] = data
        return bytes(out)


def _compact(t: Tensor) -> Tensor:
    """`t` itself when it owns exactly its storage (what torch.save writes), else a copy."""
    t = t.detach()
    if t.is_contiguous() and t.storage_offset() == 0 and \
            t.untyped_storage().nbytes() == t.numel() * t.element_size():
        return t
    return t.clone(memory_format=torch.contiguous_format)


def tensor_bytes(t: Tensor) -> memoryview:
    """The bytes of a contiguous host tensor, without a copy (any dtype: seen as uint8)."""
    if t.numel() == 0:
        return memoryview(b"")
    return memoryview(t.reshape(-1).view(torch.uint8).numpy())


@dataclass
class Record:
    """One piece's record: `head` + the storage's bytes + `tail`, at `offset` in its file."""

    fqn: str
    piece: dict[str, Any]  # {"tensor", "offsets", "global_shape", "path"}
    tensor: Tensor  # compact: its bytes are the record's storage
    head: bytes
    tail: bytes
    offset: int = 0
    # Whether the storage lies between head and tail; False only where torch.save did not
    # leave one hole of the storage's size, and then `head` is the whole record.
    split: bool = True

    @property
    def data_bytes(self) -> int:
        return self.tensor.numel() * self.tensor.element_size() if self.split else 0

    @property
    def length(self) -> int:
        return len(self.head) + self.data_bytes + len(self.tail)

    def segments(self) -> list[memoryview]:
        data = tensor_bytes(self.tensor) if self.split else memoryview(b"")
        return [memoryview(self.head), data, memoryview(self.tail)]

    def item(self, digest: str) -> dict[str, Any]:
        """The record's entry in the manifest (and DCP's metadata): `dcp_format.table_of`."""
        piece, t = self.piece, self.tensor
        item = {"fqn": self.fqn, "path": list(piece["path"]), "offsets": list(piece["offsets"]),
                "sizes": list(t.shape), "global_shape": list(piece["global_shape"]),
                "dtype": str(t.dtype).removeprefix("torch."), "offset": self.offset,
                "length": self.length, "checksum": digest}
        if self.split:
            item["data"] = [len(self.head), self.data_bytes]
        return item


def _whole_record(fqn: str, piece: dict[str, Any], tensor: Tensor) -> Record:
    whole = io.BytesIO()
    torch.save(tensor, whole)
    return Record(fqn, piece, tensor, whole.getvalue(), b"", split=False)


def _record(fqn: str, piece: dict[str, Any]) -> Record:
    tensor = _compact(piece["tensor"])
    out = _HoleRecorder()
    with torch.serialization.skip_data():
        torch.save(tensor, out)
    nbytes = tensor.numel() * tensor.element_size()
    if nbytes == 0 and not out.holes:
        raw = out.span(0, out.end)
        return Record(fqn, piece, tensor, raw, b"") if raw is not None else _whole_record(fqn, piece, tensor)
    if len(out.holes) != 1 or out.holes[0][1] != nbytes:  # not the one storage: torch.save's bytes
        return _whole_record(fqn, piece, tensor)
    start = out.holes[0][0]
    head, tail = out.span(0, start), out.span(start + nbytes, out.end)
    if head is None or tail is None:  # something was written into the hole after all
        return _whole_record(fqn, piece, tensor)
    return Record(fqn, piece, tensor, head, tail)


def lay_out(pieces: dict[str, dict[str, Any]]) -> list[Record]:
    """Every piece's record, back to back from offset 0, in the order given."""
    records, offset = [], 0
    for fqn, piece in pieces.items():
        record = _record(fqn, piece)
        record.offset = offset
        offset += record.length
        records.append(record)
    return records


def _chunks(records: list[Record]) -> Iterator[tuple[int, memoryview]]:
    """(file offset, bytes) of every write, each at most CHUNK_BYTES."""
    for record in records:
        at = record.offset
        for segment in record.segments():
            for start in range(0, len(segment), CHUNK_BYTES):
                part = segment[start:start + CHUNK_BYTES]
                yield at + start, part
            at += len(segment)


def _pwrite_all(fd: int, data: memoryview, offset: int) -> None:
    while data:  # a pwrite may write less than asked (signals, the 2 GiB cap per call)
        done = os.pwrite(fd, data, offset)
        data, offset = data[done:], offset + done


def _hash_file(records: list[Record]) -> str:
    h = checksum.hasher()
    for record in records:
        for segment in record.segments():
            h.update(segment)
    return checksum.tagged(h)


def _record_digests(records: list[Record]) -> list[str]:
    digests = []
    for record in records:
        h = checksum.hasher()
        for segment in record.segments():
            h.update(segment)
        digests.append(checksum.tagged(h))
    return digests


def write_local(path: str, records: list[Record], threads: int = WRITE_THREADS) -> ShardInfo:
    """Write `records` into a new file at `path` on a local (or shared, POSIX) disk: chunks
    written by `threads` threads at their offsets while this thread hashes each record and one
    worker the whole file, then one fsync. Raises the first write error (say ENOSPC)."""
    total = sum(r.length for r in records)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        with ThreadPoolExecutor(max(2, threads + 1), thread_name_prefix="longrun-ckpt-write") as pool:
            whole = pool.submit(_hash_file, records)  # first, so it starts beside the writes
            writes: list[Future] = [pool.submit(_pwrite_all, fd, part, at) for at, part in _chunks(records)]
            try:
                digests = _record_digests(records)
            finally:
                done, pending = wait(writes, return_when=FIRST_EXCEPTION)
                for future in pending:  # a write failed: the rest need not run
                    future.cancel()
            for future in done:
                future.result()
            file_digest = whole.result()
        os.fsync(fd)
    finally:
        os.close(fd)
    return ShardInfo(file_digest, total, [r.item(d) for r, d in zip(records, digests, strict=True)])


def write_stream(f: Any, records: list[Record]) -> ShardInfo:
    """Write `records` front to back into the binary file-like `f` (an object store's upload),
    hashing each segment on the way."""
    whole, items = checksum.hasher(), []
    for record in records:
        h = checksum.hasher()
        for segment in record.segments():
            h.update(segment)
            whole.update(segment)
            f.write(segment)
        items.append(record.item(checksum.tagged(h)))
    return ShardInfo(checksum.tagged(whole), sum(r.length for r in records), items)
