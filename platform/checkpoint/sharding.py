"""Sharded state (DTensors) in and out of a peer memory snapshot, at the same layout.

Under FSDP and tensor parallelism the trainer's state holds DTensors: each rank has its own
piece of every weight and optimizer moment. A memory snapshot (`memory.py`) keeps exactly this
rank's pieces for the same rank of the same layout: `localize` swaps every DTensor for its
local tensor and records where that piece sits in the whole; `globalize` wraps each piece back
onto the live DTensor it belongs to, after checking that it is the piece this rank holds now.
(Checkpoints on storage restore at any layout: `dcp_format.py`, `resharding.py`; a snapshot
reaches another layout as one: `snapshot_pieces` gives the pieces with their places in the whole,
which `memory_commit.py` writes as a committed checkpoint.)
"""

from __future__ import annotations

from typing import Any

from torch import Tensor
from torch.distributed.tensor import DTensor, Replicate
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from longrun.checkpoint.dcp_format import tensor_leaves
from longrun.checkpoint.restore import CheckpointMismatchError
from longrun.checkpoint.snapshot import map_tree, tensors_of


def localize(state: Any) -> tuple[Any, dict[str, dict[str, Any]]]:
    """(`state` with every DTensor replaced by its local tensor, {path: where that piece
    sits}). The local tensors are the live ones (not copies), as with any state_dict."""
    where: dict[str, dict[str, Any]] = {}

    def local(path: str, t: Tensor) -> Tensor:
        if not isinstance(t, DTensor):
            return t
        shape, offset = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)
        coordinate = t.device_mesh.get_coordinate() or []
        where[path] = {"global_shape": list(t.shape), "local_shape": list(shape),
                       "offset": list(offset), "placements": [str(p) for p in t.placements],
                       "mesh_dims": list(t.device_mesh.mesh_dim_names or ()),
                       # The first rank along every mesh dimension the piece is replicated on
                       # (HSDP's replicas, TP's replicated norms): the one that writes it once.
                       "writes": all(coordinate[d] == 0 for d, p in enumerate(t.placements)
                                     if isinstance(p, Replicate))}
        return t.to_local()

    return map_tree(state, local), where


def globalize(loaded: Any, live: Any) -> Any:
    """`loaded` (a restored state, local tensors) with each piece that is a DTensor in `live`
    (the trainer's current state) wrapped as one with the live placements. Raises
    CheckpointMismatchError when a piece's shape is not the one this rank holds."""
    targets = {path: t for path, t in tensors_of(live) if isinstance(t, DTensor)}

    def wrap(path: str, t: Tensor) -> Tensor:
        ref = targets.get(path)
        if ref is None:
            return t
        local = ref.to_local()
        if tuple(t.shape) != tuple(local.shape):
            raise CheckpointMismatchError(
                f"the checkpoint's piece of {path.lstrip('/')} has shape {tuple(t.shape)}, but this "
                f"rank holds {tuple(local.shape)} of {tuple(ref.shape)}; it was written with "
                "another layout or model")
        return DTensor.from_local(t.to(local.device), ref.device_mesh, ref.placements,
                                  run_check=False, shape=ref.shape, stride=ref.stride())

    return map_tree(loaded, wrap)


SnapshotPiece = tuple[tuple, Tensor, tuple, tuple, bool | None]


def snapshot_pieces(state: Any, where: dict[str, dict[str, Any]]) -> list[SnapshotPiece]:
    """The tensor pieces of a snapshot's model and optimizer (`state` as `localize` left it,
    `where` what it recorded): (path in the state, local tensor, its offsets in the whole
    tensor, the whole tensor's shape, whether this rank is the first along the mesh dimensions
    the piece is replicated on); a tensor that was no DTensor is whole (and None for the last)."""
    pieces = []
    for path, t in tensor_leaves(state):
        geometry = where.get("/" + "/".join(str(p) for p in path))
        if geometry is None:
            pieces.append((path, t, (0,) * t.dim(), tuple(t.shape), None))
        else:
            if list(t.shape) != list(geometry["local_shape"]):
                raise CheckpointMismatchError(
                    f"the snapshot's piece of {'.'.join(map(str, path))} has shape {tuple(t.shape)}, "
                    f"its record says {tuple(geometry['local_shape'])}")
            pieces.append((path, t, tuple(geometry["offset"]), tuple(geometry["global_shape"]),
                           bool(geometry.get("writes", True))))
    return pieces
