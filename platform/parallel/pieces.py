"""This rank's piece of each parameter, and where that piece sits in the whole tensor.

    for piece in local_pieces(model):          # after parallelize, on any layout
        piece.local.copy_(whole_values(piece.name)[piece.index])

Whatever the layout, a rank holds of each parameter one rectangular block of the whole
tensor: the whole of it (one process, DDP), a block of rows (FSDP's `Shard(0)`, column-wise
TP), of columns (row-wise TP), or of both (FSDP x TP, where FSDP shards TP's local rows:
torch's `_StridedShard`, still one block of consecutive rows). DTensor computes the block's
shape and offset from the mesh and the placements; pipeline parallelism keeps the whole
model's names (`layers.5`, not `stage1.layers.1`). So anything that fills parameters from a
description of the *whole* model (a seeded initialisation, a Hugging Face file) fills each
rank's pieces alone, and the result does not depend on the layout.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset


@dataclass(frozen=True)
class Piece:
    """`local` holds `whole[offset[0]:offset[0] + local.shape[0], offset[1]:...]` of the
    parameter called `name` in the whole model, whose shape is `shape`."""

    name: str
    local: Tensor  # shares the parameter's storage: writing it writes the parameter
    shape: tuple[int, ...]
    offset: tuple[int, ...]

    @property
    def index(self) -> tuple[slice, ...]:
        """The block of the whole tensor this piece holds, as an index."""
        return tuple(slice(o, o + n) for o, n in zip(self.offset, self.local.shape, strict=True))

    @property
    def nbytes(self) -> int:
        return self.local.numel() * self.local.element_size()


def local_pieces(module: nn.Module) -> list[Piece]:
    """Every parameter of `module` (a tied one once, under its first name) as this rank's piece."""
    pieces = []
    with torch.no_grad():
        for name, param in module.named_parameters():
            if isinstance(param, DTensor):
                local = param.to_local()
                shape, offset = compute_local_shape_and_global_offset(
                    param.shape, param.device_mesh, param.placements)
                if tuple(shape) != tuple(local.shape):
                    # A placement whose local part is not one block of the whole: filling it
                    # block-wise would scramble it, so say so rather than guess.
                    raise NotImplementedError(
                        f"{name}: placements {param.placements} give a local tensor of shape "
                        f"{tuple(local.shape)}, not the block {tuple(shape)} DTensor reports")
                pieces.append(Piece(name, local, tuple(param.shape), tuple(offset)))
            else:
                pieces.append(Piece(name, param.data, tuple(param.shape), (0,) * param.dim()))
    return pieces
