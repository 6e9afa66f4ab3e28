"""Sharded state (DTensors) in and out of checkpoint files.

Under FSDP and tensor parallelism the trainer's state holds DTensors: each rank has its own
piece of every weight and optimizer moment. A checkpoint keeps exactly those pieces: on save,
`localize` swaps every DTensor for its local tensor and records where that piece sits in the
whole (global shape, offset, placements), so a file says what it holds without the mesh that
wrote it; on restore, `globalize` wraps each piece back onto the live DTensor it belongs to,
after checking that it is the piece this rank holds now.
"""

from __future__ import annotations

from typing import Any

from torch import Tensor
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

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
        where[path] = {"global_shape": list(t.shape), "local_shape": list(shape),
                       "offset": list(offset), "placements": [str(p) for p in t.placements],
                       "mesh_dims": list(t.device_mesh.mesh_dim_names or ())}
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


def assemble(pieces: list[tuple[dict[str, Tensor], dict[str, dict[str, Any]]]],
             prefix: str = "/model/") -> dict[str, Tensor]:
    """Whole tensors from the pieces of several files: each (a state dict of local tensors,
    the `where` that `localize` recorded, whose paths carry `prefix`). A tensor with no `where`
    entry is whole already. Raises ValueError if the pieces leave part of a tensor uncovered."""
    import torch

    whole: dict[str, Tensor] = {}
    placed: dict[str, dict[tuple[int, ...], int]] = {}  # name -> offset -> values placed there
    for state, where in pieces:
        for name, local in state.items():
            meta = where.get(prefix + name)
            if meta is None:
                whole.setdefault(name, local)
                continue
            if name not in whole:
                whole[name] = torch.empty(meta["global_shape"], dtype=local.dtype)
                placed[name] = {}
            offset = tuple(meta["offset"])
            if offset in placed[name]:
                continue  # the same piece from another file (replicated across TP ranks)
            region = tuple(slice(o, o + n) for o, n in zip(offset, local.shape, strict=True))
            whole[name][region] = local
            placed[name][offset] = local.numel()
    for name, at in placed.items():
        if sum(at.values()) != whole[name].numel():
            raise ValueError(f"the checkpoint's pieces of {name} hold {sum(at.values())} of its "
                             f"{whole[name].numel()} values; a piece is missing")
    return whole
