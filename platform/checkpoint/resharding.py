"""Reading a checkpoint's tensors into whatever pieces this rank holds now, at any layout.

The saved pieces (any layout) and the pieces this rank needs (its DTensors' local slices, or
whole tensors) are both boxes in the global tensor; DCP's resharding planner
(`create_read_items_for_chunk_list`) gives the overlaps. Each overlapping record is read as a
byte range of its file (never the whole file), by several readers, checked against the checksum
the manifest keeps for it while it is read (`record_read.py`), and the overlap copied into its
target.
A restore reads and verifies every record first (`read_records`) and copies the overlaps into
the live state (`apply_reads`) only once every rank has read and verified its part, so a
corrupt checkpoint leaves the trainer as it was.
"""

from __future__ import annotations

from dataclasses import dataclass

import fsspec
import torch
from torch import Tensor
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, Metadata, MetadataIndex
from torch.distributed.checkpoint.planner import ReadItem
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

from longrun.checkpoint.dcp_format import StoredItem, coverage_problem
from longrun.checkpoint.record_read import CorruptShardError, check_sizes, read_verified

__all__ = ["CorruptShardError", "PieceMismatchError", "Wanted", "apply_reads", "plan_reads",
           "read_pieces", "read_records", "read_whole"]


class PieceMismatchError(ValueError):
    """What this rank needs is not in the checkpoint, or has another shape or dtype."""


@dataclass
class Wanted:
    """A piece to fill: `buffer` (the piece's shape: a live local tensor, or a new host one) at
    `offsets` in the whole tensor of shape `global_shape`."""

    fqn: str
    buffer: Tensor
    offsets: tuple[int, ...]
    global_shape: tuple[int, ...]


def _box(t: Tensor, offsets, lengths) -> Tensor:
    for dim, (start, length) in enumerate(zip(offsets, lengths, strict=True)):
        t = t.narrow(dim, start, length)
    return t


def plan_reads(metadata: Metadata, wanted: list[Wanted]) -> list[ReadItem]:
    """The reads that fill every `wanted` buffer (DCP's resharding planner). Raises
    PieceMismatchError when a piece is not in the checkpoint or has another shape or dtype."""
    reads: list[ReadItem] = []
    for w in wanted:
        md = metadata.state_dict_metadata.get(w.fqn)
        if md is None:
            raise PieceMismatchError(f"{w.fqn} is not in the checkpoint")
        if tuple(md.size) != tuple(w.global_shape) or md.properties.dtype != w.buffer.dtype:
            raise PieceMismatchError(
                f"{w.fqn} is {tuple(md.size)} {md.properties.dtype} in the checkpoint, "
                f"{tuple(w.global_shape)} {w.buffer.dtype} in this job")
        if w.buffer.numel() == 0:
            continue
        chunk = ChunkStorageMetadata(torch.Size(w.offsets), w.buffer.shape)
        mine = create_read_items_for_chunk_list(w.fqn, md, [chunk])
        # Every value of the target exactly once: a checkpoint with a gap (or a piece placed at a
        # wrong offset) would otherwise leave the live tensor's old values there, silently.
        problem = coverage_problem(tuple(w.buffer.shape),
                                   [(tuple(r.dest_offsets), tuple(r.lengths)) for r in mine])
        if problem is not None:
            raise PieceMismatchError(f"the saved pieces of {w.fqn} read into this rank's piece at "
                                     f"{tuple(w.offsets)} of {tuple(w.buffer.shape)} {problem}")
        reads += mine
    return reads


def read_records(fs: fsspec.AbstractFileSystem, step_dir: str, records: dict[MetadataIndex, StoredItem],
                 reads: list[ReadItem], *, pin: bool = False) -> dict[MetadataIndex, Tensor]:
    """Every record `reads` (from `plan_reads`) touch, read as a byte range of its file by several
    readers, verified and loaded: {record: tensor} (in pinned memory with `pin`, for a GPU
    target). Raises CorruptShardError on a bad record. Nothing is copied anywhere yet
    (`apply_reads`)."""
    return read_verified(fs, step_dir, records, {item.storage_index for item in reads}, pin=pin)


def apply_reads(loaded: dict[MetadataIndex, Tensor], reads: list[ReadItem], wanted: list[Wanted]) -> None:
    """Copy each read's overlap from its loaded record into its `wanted` tensor."""
    by_name = {w.fqn: w for w in wanted}
    for item in reads:
        target = by_name[item.dest_index.fqn].buffer
        _box(target, item.dest_offsets, item.lengths).copy_(
            _box(loaded[item.storage_index], item.storage_offsets, item.lengths))


def read_pieces(fs: fsspec.AbstractFileSystem, step_dir: str,
                records: dict[MetadataIndex, StoredItem], wanted: list[Wanted],
                reads: list[ReadItem]) -> int:
    """`read_records` then `apply_reads`; returns the bytes read."""
    loaded = read_records(fs, step_dir, records, reads)
    apply_reads(loaded, reads, wanted)
    return sum(records[index].length for index in loaded)


def read_whole(fs: fsspec.AbstractFileSystem, step_dir: str, metadata: Metadata,
               records: dict[MetadataIndex, StoredItem], prefix: str) -> dict[str, Tensor]:
    """Every tensor whose name starts with `prefix`, whole (its pieces put together), keyed by
    the rest of its name: consolidated weights from a checkpoint of any layout (an export).
    The files are checked against the manifest's sizes before the tensors are allocated."""
    check_sizes(fs, step_dir, records, {index for index in records if index.fqn.startswith(prefix)})
    wanted = [Wanted(fqn, torch.empty(md.size, dtype=md.properties.dtype), (0,) * len(md.size),
                     tuple(md.size))
              for fqn, md in metadata.state_dict_metadata.items() if fqn.startswith(prefix)]
    read_pieces(fs, step_dir, records, wanted, plan_reads(metadata, wanted))
    return {w.fqn.removeprefix(prefix): w.buffer for w in wanted}
