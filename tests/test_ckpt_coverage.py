"""Exact coverage, both ways: the pieces committed for a tensor cover it exactly once (not
merely as many values as it has), and a restore's reads cover each live piece exactly once."""

from __future__ import annotations

import itertools
import random

import pytest
import torch
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    TensorProperties,
    TensorStorageMetadata,
)

from longrun.checkpoint.dcp_format import coverage_problem, table_of
from longrun.checkpoint.manifest import ShardInfo
from longrun.checkpoint.resharding import PieceMismatchError, Wanted, plan_reads


def _files(shape, boxes) -> dict[str, ShardInfo]:
    """A manifest's files with one record per box of a float32 tensor "w" of `shape`."""
    items = [{"fqn": "w", "path": ["model", "w"], "offsets": list(o), "sizes": list(s),
              "global_shape": list(shape), "dtype": "float32", "offset": 100 * i, "length": 100,
              "sha256": "0" * 64} for i, (o, s) in enumerate(boxes)]
    return {"__0_0.distcp": ShardInfo("0" * 64, 100 * len(items), items)}


def test_an_overlapping_piece_and_a_missing_one_do_not_cancel_out_at_commit():
    # Rows 0-1 and 1-2 of a 4 x 2 tensor: 8 values like the tensor, row 1 twice, row 3 never.
    with pytest.raises(ValueError, match=r"pieces of w overlap"):
        table_of(_files((4, 2), [((0, 0), (2, 2)), ((1, 0), (2, 2))]))
    with pytest.raises(ValueError, match=r"leave 2 of its 8 values uncovered"):
        table_of(_files((4, 2), [((0, 0), (3, 2))]))
    metadata, _ = table_of(_files((4, 2), [((0, 0), (3, 2)), ((3, 0), (1, 2))]))  # uneven, exact
    assert len(metadata.state_dict_metadata["w"].chunks) == 2


def test_coverage_of_sharded_grids_and_what_breaks_it():
    rng = random.Random(7)
    for _ in range(200):
        shape = (rng.randint(1, 9), rng.randint(1, 9))
        # An FSDP x TP-like grid with uneven cuts (empty pieces included, as uneven shards give).
        rows = sorted([*rng.choices(range(shape[0] + 1), k=rng.randint(0, 3)), 0, shape[0]])
        cols = sorted([*rng.choices(range(shape[1] + 1), k=rng.randint(0, 3)), 0, shape[1]])
        grid = [((r0, c0), (r1 - r0, c1 - c0)) for r0, r1 in itertools.pairwise(rows)
                for c0, c1 in itertools.pairwise(cols)]
        assert coverage_problem(shape, grid) is None, (shape, grid)
        solid = [i for i, (_, s) in enumerate(grid) if s[0] and s[1]]
        if len(solid) < 2:
            continue
        # Move one solid piece onto another's place: same volume, a gap and an overlap.
        a, b = rng.sample(solid, 2)
        moved = list(grid)
        moved[a] = (grid[b][0], grid[a][1])
        if any(o + n > d for o, n, d in zip(moved[a][0], moved[a][1], shape, strict=True)):
            assert "outside" in coverage_problem(shape, moved)
        else:
            assert "overlap" in coverage_problem(shape, moved)
    assert coverage_problem((), [((), ())]) is None
    assert coverage_problem((), [((), ()), ((), ())]) is not None
    assert coverage_problem((3,), []) == "leave 3 of its 3 values uncovered (a piece is missing)"


def _metadata(shape, boxes) -> Metadata:
    chunks = [ChunkStorageMetadata(torch.Size(o), torch.Size(s)) for o, s in boxes]
    md = TensorStorageMetadata(TensorProperties(dtype=torch.float32), torch.Size(shape), chunks)
    return Metadata({"w": md})


def test_a_restore_whose_reads_leave_part_of_a_live_piece_unfilled_is_refused():
    # A checkpoint (its table not checked, e.g. written before the commit checked coverage)
    # missing rows 2-3: the live piece holding rows 1-3 would keep stale values there.
    metadata = _metadata((4, 2), [((0, 0), (2, 2))])
    wanted = [Wanted("w", torch.zeros(3, 2), (1, 0), (4, 2))]
    with pytest.raises(PieceMismatchError, match=r"w read into this rank's piece at \(1, 0\).*uncovered"):
        plan_reads(metadata, wanted)
    # A piece the live layout places partly outside the tensor (a piece-offset bug).
    whole = _metadata((4, 2), [((0, 0), (4, 2))])
    with pytest.raises(PieceMismatchError):
        plan_reads(whole, [Wanted("w", torch.zeros(2, 2), (3, 0), (4, 2))])
    reads = plan_reads(_metadata((4, 2), [((0, 0), (3, 2)), ((3, 0), (1, 2))]), wanted)
    assert sum(r.lengths[0] * r.lengths[1] for r in reads) == 6
