"""A model's initial weights, a function of the job's seed, each parameter's name and each row's
index alone: so every rank fills only the pieces it holds, and the model starts bitwise the
same at any layout (one process, DDP, FSDP, TP, PP and their mixes) and on any device.

    init_pieces(local_pieces(model), cfg.model, seed=cfg.job.seed)

Why rows. A rank's piece of a weight is a block of its rows and columns (`parallel/pieces.py`).
Each row of the whole weight has its own generator, seeded from (seed, name, row); a rank draws
the rows its block overlaps and keeps its columns. Row-wise tensor parallelism (attention's
`wo`, the MLP's `w2`) holds 1/tp of each row, so its ranks draw tp times what they keep for
those two weights; every other piece draws exactly its own elements. Megatron seeds each
tensor-parallel partition instead, which ties the values to the TP degree; torchtitan's
DTensor random ops are layout-independent only on CUDA's Philox. A counter-based draw per
element would waste nothing, but measured here it was 20x slower than torch's own generator
per row (4.5 vs 87 million values per second on one core).

The values: Normal(0, 0.02) for the embedding, the output layer and the projections into the
attention and MLP; the projections that write into the residual stream (attention `wo`, MLP
`w2`) at 0.02 / sqrt(2 n_layers), so the stream's variance does not grow with depth (GPT-2);
norm gains 1. Drawn in fp32 on the host, then copied into the piece (on its device, in its
dtype): the same values on a CPU and a GPU.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Iterable

import torch

from longrun.config.sections import ModelSection
from longrun.parallel.pieces import Piece

STD = 0.02
# Module names (the last part before ".weight") and how each starts.
NORMAL = frozenset({"tok_embeddings", "output", "wq", "wk", "wv", "w1", "w3"})
RESIDUAL = frozenset({"wo", "w2"})  # write into the residual stream: scaled by depth
ONES = frozenset({"attention_norm", "ffn_norm", "norm"})
CHUNK_BYTES = 64 << 20  # rows drawn at a time before copying into the piece

_MASK = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15


def _mix64(z: int) -> int:
    """SplitMix64's finaliser: neighbouring rows get unrelated seeds."""
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK
    return z ^ (z >> 31)


def parameter_key(seed: int, name: str) -> int:
    """A 64-bit key per (job seed, parameter name): the whole model's name, so a pipeline
    stage's `layers.5` draws what an unsplit model's `layers.5` draws."""
    return int.from_bytes(hashlib.blake2b(f"{seed}\0{name}".encode(), digest_size=8).digest(), "little")


def row_seed(key: int, row: int) -> int:
    """The seed of one row's generator (below 2**63, which every torch generator accepts)."""
    return _mix64((key + (row + 1) * _GOLDEN) & _MASK) >> 1


def initial_std(name: str, model: ModelSection) -> float | None:
    """The standard deviation parameter `name` starts with; None: a norm gain, all ones."""
    module = name.split(".")[-2]  # "layers.3.attention.wq.weight" -> "wq"
    if module in ONES:
        return None
    if module in RESIDUAL:
        return STD / math.sqrt(2 * model.n_layers)
    if module in NORMAL:
        return STD
    raise ValueError(f"no initialisation is defined for parameter {name!r}")


def init_pieces(pieces: Iterable[Piece], model: ModelSection, seed: int) -> int:
    """Fill each piece with its block of the initial weights; the number of values drawn."""
    drawn = 0
    with torch.no_grad():
        for piece in pieces:
            std = initial_std(piece.name, model)
            if std is None:
                piece.local.fill_(1.0)
            else:
                drawn += _fill_normal_rows(piece, parameter_key(seed, piece.name), std)
    return drawn


def _fill_normal_rows(piece: Piece, key: int, std: float) -> int:
    if len(piece.shape) != 2:
        raise ValueError(f"{piece.name}: row-seeded initialisation takes a matrix, not shape {piece.shape}")
    rows, cols = piece.local.shape
    if rows == 0 or cols == 0:  # more shards than rows: this rank holds none of them
        return 0
    first_row, first_col = piece.offset
    whole_cols = piece.shape[1]
    chunk = max(1, min(rows, CHUNK_BYTES // (4 * whole_cols)))
    buffer = torch.empty(chunk, whole_cols, dtype=torch.float32)
    generator = torch.Generator()
    for start in range(0, rows, chunk):
        n = min(chunk, rows - start)
        for i in range(n):
            generator.manual_seed(row_seed(key, first_row + start + i))
            buffer[i].normal_(0.0, std, generator=generator)
        piece.local[start:start + n].copy_(buffer[:n, first_col:first_col + cols])
    return rows * whole_cols
