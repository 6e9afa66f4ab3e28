"""Data parallelism across real processes (gloo on CPU): the same gradients as one process on
the whole batch, bitwise-exact resume at 4 ranks, and communication launched during backward."""

from __future__ import annotations

import pytest
import trainer_workers as w
from worlds import run_world as _run_world


@pytest.mark.parametrize("world", [2, 4])
def test_data_parallel_gradients_equal_one_process_on_the_whole_batch(world, tmp_path):
    out = _run_world(w.gradients_match_one_process, world, tmp_path, per_rank=2)
    for rank, accum, loss, ref_loss, worst_rel_err in out:
        # Summation order differs (per rank, then across ranks), so float tolerance, not bits.
        assert worst_rel_err < 1e-5, (rank, accum, worst_rel_err)
        assert loss == pytest.approx(ref_loss, rel=1e-6), (rank, accum)
    assert {accum for _, accum, *_ in out} == {1, 2}


def test_resume_under_data_parallelism_is_bitwise_at_four_ranks(tmp_path):
    out = _run_world(w.resume_is_bitwise, 4, tmp_path)
    # One data position in the one global order, the same on every rank, naming no rank.
    positions = [r[4] for r in out]
    assert all(p == positions[0] for p in positions) and "dp_rank" not in positions[0]
    assert positions[0]["index"] > 0
    for rank, equal, straight_loss, resumed_loss, _ in out:
        assert equal, f"rank {rank}: resumed weights differ from the uninterrupted run"
        assert resumed_loss == straight_loss
    assert len({r[2] for r in out}) == 1  # the reported loss is the global one on every rank


def test_gradient_sync_starts_before_backward_ends(tmp_path):
    out = _run_world(w.communication_overlaps_backward, 2, tmp_path)
    for _, events in out:
        assert events.count("first-layer-grad") == 1
        launched_before = events.index("first-layer-grad")
        # Several buckets, and at least one all-reduce was in flight while the first layer's
        # gradient (computed near the very end of backward) was still to come.
        assert events.count("allreduce") > 2, events
        assert launched_before >= 1, events
