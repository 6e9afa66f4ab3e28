"""Model and optimizer tensors in the file format of torch's distributed checkpoint (DCP).

A checkpoint's tensors are the pieces the ranks hold (whole tensors without sharding; under
FSDP and tensor parallelism each rank's slice of each DTensor). Each piece is written once: by
the lowest rank holding it (the replica leader, first along every mesh dimension the tensor is
replicated over). A rank's pieces go into one file, `__<rank>_0.distcp`, each as its own
`torch.save` record, exactly as DCP's FileSystemWriter writes them (laid out first and written by
several threads: `records.py`), and the record's place in the file (offset, length), its place
in the whole tensor (offsets, sizes), its checksum and where its tensor's bytes lie are reported
with the rank's files (`ShardInfo.items`). At commit the coordinator turns the reports
into DCP's `.metadata`, so `torch.distributed.checkpoint.load(state_dict, checkpoint_id=step_dir)`
loads a longrun checkpoint's tensors as is (the plain values live in `train-state.pt`);
longrun itself reads the same table from its manifest (`resharding.py`), never unpickling
`.metadata`.

Names follow DCP's flattening: the path of a tensor in the trainer's state joined by dots
(`model.layers.0.attention.wq.weight`, `optimizer.state.<fqn>.exp_avg`).

Why not `dcp.save` itself: its planning is a collective over the process group (every save
would gather plans on one rank while training runs), and its writer knows nothing of the
two-stage snapshot, the commit ledger or the checksums. The format is DCP's; the pipeline
stays ours.
"""

from __future__ import annotations

import math
import pickle
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.tensor import DTensor, Replicate
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from longrun.checkpoint.manifest import ShardInfo
from longrun.checkpoint.record_bounds import overlap_problem, record_problem
from longrun.checkpoint.snapshot import map_tree

DCP_KEYS = ("model", "optimizer")  # the parts of the trainer state stored in DCP's format
METADATA_FILE = ".metadata"  # DCP's name
DCP_VERSION = "1.0.0"  # torch.distributed.checkpoint.filesystem.CURRENT_DCP_VERSION


def data_file_name(rank: int) -> str:
    """DCP's own naming (`__<rank>_<file>.distcp`): one file per rank."""
    return f"__{rank}_0.distcp"


def fqn_of(path: tuple[str | int, ...]) -> str:
    return ".".join(str(p) for p in path)


@dataclass
class Piece:
    """One tensor piece a rank holds: where it sits in the whole tensor."""

    fqn: str
    path: tuple[str | int, ...]  # in the trainer state (DCP's planner_data)
    local: Tensor  # this rank's piece (a local tensor, never a DTensor)
    offsets: tuple[int, ...]
    global_shape: tuple[int, ...]
    writer: bool  # whether this rank is the one that writes it


def _walk(tree: Any, path: tuple[str | int, ...], out: list[tuple[tuple, Tensor]]) -> None:
    if isinstance(tree, Tensor):
        out.append((path, tree))
    elif isinstance(tree, dict):
        for k, v in tree.items():
            _walk(v, (*path, k), out)
    elif isinstance(tree, list):
        for i, v in enumerate(tree):
            _walk(v, (*path, i), out)


def tensor_leaves(state: dict[str, Any]) -> list[tuple[tuple[str | int, ...], Tensor]]:
    """(path, tensor) of every tensor in `state`'s model and optimizer, in the tree's order."""
    found: list[tuple[tuple, Tensor]] = []
    for key in DCP_KEYS:
        _walk(state[key], (key,), found)
    return found


def pieces_of(state: dict[str, Any], *, rank: int, replica_leader: bool,
              writes_whole: bool | None = None) -> list[Piece]:
    """Every tensor piece of `state`'s model and optimizer this rank holds. `replica_leader`:
    this rank is the first of the ranks holding the same pieces (dp and cp replicas).
    `writes_whole`: this rank writes the tensors every rank of its pipeline stage holds whole
    (the first rank of its stage; default: rank 0, the only stage's first)."""
    if writes_whole is None:
        writes_whole = rank == 0
    pieces = []
    for path, t in tensor_leaves(state):
        if isinstance(t, DTensor):
            _, offset = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)
            coordinate = t.device_mesh.get_coordinate() or []
            # A piece replicated along a mesh dimension is written by that dimension's first rank.
            first = all(coordinate[d] == 0 for d, p in enumerate(t.placements) if isinstance(p, Replicate))
            local = t.to_local()
            writer = replica_leader and first and local.numel() > 0
            pieces.append(Piece(fqn_of(path), path, local, tuple(offset), tuple(t.shape), writer))
        else:  # whole, and the same on every rank of the stage: its first rank writes it
            pieces.append(Piece(fqn_of(path), path, t, (0,) * t.dim(), tuple(t.shape), writes_whole))
    return pieces


def dtype_of(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None) if isinstance(name, str) else None
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown tensor dtype {name!r} in a checkpoint manifest")
    return dtype


@dataclass
class StoredItem:
    relative_path: str
    offset: int
    length: int
    checksum: str  # "xxh3_128:<hex>", or a bare SHA-256 in checkpoints written before xxh3
    sizes: tuple[int, ...] = ()  # the piece's shape
    dtype: torch.dtype = torch.float32
    # [start, length] of the tensor's bytes within the record (records.py); None in records
    # written before longrun recorded it, which are read whole and unpickled.
    data: tuple[int, int] | None = None


def table_of(files: dict[str, ShardInfo]) -> tuple[Metadata, dict[MetadataIndex, StoredItem]]:
    """DCP's metadata and the records by their index, from the manifest's files. Raises
    ValueError, before anything is allocated, when a record does not fit its file or holds a
    tensor larger than itself (`record_bounds.py`), when the pieces of a tensor do not cover it
    exactly once (a missing, doubled or overlapping piece: `coverage_problem`), or when two
    files disagree about a tensor's shape or dtype."""
    tensors: dict[str, TensorStorageMetadata] = {}
    planner_data: dict[str, tuple] = {}
    records: dict[MetadataIndex, StoredItem] = {}
    for name in sorted(files):
        items = files[name].items or []
        for item in items:
            _check_record(name, files[name].bytes, item)
        problem = overlap_problem(items)
        if problem is not None:
            raise ValueError(f"{name} {problem}; {_DAMAGED}")
        for item in items:
            fqn, shape, dtype = item["fqn"], torch.Size(item["global_shape"]), dtype_of(item["dtype"])
            md = tensors.setdefault(fqn, TensorStorageMetadata(TensorProperties(dtype=dtype), shape, []))
            if md.size != shape or md.properties.dtype != dtype:
                raise ValueError(f"the pieces of {fqn} disagree: {tuple(md.size)} {md.properties.dtype} "
                                 f"vs {tuple(shape)} {dtype} in {name}")
            offsets = torch.Size(item["offsets"])
            index = MetadataIndex(fqn, offsets)
            if index in records:
                raise ValueError(f"the piece of {fqn} at {tuple(offsets)} is stored twice")
            md.chunks.append(ChunkStorageMetadata(offsets, torch.Size(item["sizes"])))
            planner_data[fqn] = tuple(item["path"])
            data = item.get("data")
            records[index] = StoredItem(name, item["offset"], item["length"],
                                        item.get("checksum") or item["sha256"], tuple(item["sizes"]),
                                        dtype, tuple(data) if data is not None else None)
    for fqn, md in tensors.items():
        problem = coverage_problem(tuple(md.size), [(tuple(c.offsets), tuple(c.sizes)) for c in md.chunks])
        if problem is not None:
            raise ValueError(f"the pieces of {fqn} {problem}")
    storage = {index: _StorageInfo(r.relative_path, r.offset, r.length) for index, r in records.items()}
    return Metadata(tensors, planner_data=planner_data, storage_data=storage,
                    version=DCP_VERSION), records


_DAMAGED = "the manifest was damaged or tampered with: restore it from a good copy, or use another step"


def _check_record(name: str, file_bytes: int, item: Any) -> None:
    """ValueError unless `item` is a record that fits in its file `name` (`record_bounds.py`)."""
    if not isinstance(item, dict) or not isinstance(item.get("fqn"), str) or \
            not isinstance(item.get("path"), list) or \
            not isinstance(item.get("checksum") or item.get("sha256"), str):
        raise ValueError(f"{name} lists a record without a tensor name, path or checksum; {_DAMAGED}")
    dtype = dtype_of(item.get("dtype"))
    problem = record_problem(item, file_bytes, dtype.itemsize)
    if problem is not None:
        raise ValueError(f"the record of {item['fqn']} in {name} {problem}; {_DAMAGED}")


Box = tuple[tuple[int, ...], tuple[int, ...]]  # (offsets, sizes) in a tensor of some shape


def _overlap(a: Box, b: Box) -> bool:
    return all(max(ao, bo) < min(ao + asz, bo + bsz)
               for ao, asz, bo, bsz in zip(a[0], a[1], b[0], b[1], strict=True))


def coverage_problem(shape: tuple[int, ...], boxes: list[Box]) -> str | None:
    """Why `boxes` do not cover a tensor of `shape` exactly once (a phrase: "overlap at ...",
    "leave N of its M values uncovered", "reach outside ..."), or None when they do. Volume
    alone is not enough: one doubled and one missing piece hold as many values as the tensor.
    Boxes inside the tensor that are pairwise disjoint and as large together as the tensor
    cover it exactly. Disjointness by a sweep along the first dimension: a box is compared only
    with the boxes whose rows it shares (the pieces of one row of a sharded matrix)."""
    for offsets, sizes in boxes:
        if len(offsets) != len(shape) or len(sizes) != len(shape) or \
                any(o < 0 or n < 0 or o + n > d for o, n, d in zip(offsets, sizes, shape, strict=True)):
            return f"reach outside the tensor's {tuple(shape)}: a piece at {tuple(offsets)} of {tuple(sizes)}"
    solid = sorted((b for b in boxes if all(n > 0 for n in b[1])), key=lambda b: b[0])
    if shape:
        active: list[Box] = []  # boxes whose rows reach the current one
        for box in solid:
            active = [a for a in active if a[0][0] + a[1][0] > box[0][0]]
            for other in active:
                if _overlap(other, box):
                    return (f"overlap: the piece at {other[0]} of {other[1]} and the one at {box[0]} "
                            f"of {box[1]} share values")
            active.append(box)
    elif len(solid) > 1:
        return "overlap: a scalar stored more than once"
    covered, total = sum(math.prod(b[1]) for b in solid), math.prod(shape)
    if covered != total:
        return f"leave {total - covered} of its {total} values uncovered (a piece is missing)"
    return None


def metadata_bytes(files: dict[str, ShardInfo]) -> bytes:
    """DCP's `.metadata` file for a checkpoint of these files (pickled, as DCP writes it)."""
    metadata, _ = table_of(files)
    return pickle.dumps(metadata)


def skeleton(state: Any) -> Any:
    """`state` with every tensor replaced by an empty placeholder: the structure and the plain
    values (optimizer hyper-parameters, the scheduler, the data position), without the bytes."""
    return map_tree(state, lambda _p, _t: torch.empty(0))
