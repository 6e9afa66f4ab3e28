"""A job trained at 4, then 2, then 3 ranks (FSDP, two layout changes through checkpoints)
trains each sample exactly once, in the order of an uninterrupted 4-rank run, and follows its
loss curve (issue 18): resharding restores the weights and the optimizer, the data position
is one position in one global order, and `training.global_batch_tokens` keeps the batch.

`segment` runs in spawned ranks; the assertions stay in the test."""

from __future__ import annotations

import traceback
from collections import Counter

import pytest
from sharded_workers import _trainer, layout_config
from test_global_data_worlds import GLOBAL_TOKENS, train_and_record
from trainer_workers import _join
from worlds import run_world

STEPS = 6
SEGMENTS = [(4, 2), (2, 4), (3, 6)]  # (ranks, train until this step), each from the last checkpoint


def segment(rank: int, world: int, init_file: str, results, redis_url: str, root: str, job: str,
            attempt: int, until: int) -> None:
    """FSDP over `world` ranks: restore the newest checkpoint under `root` (if any), train to
    step `until` recording each step's loss and documents, and checkpoint there."""
    try:
        dist = _join(rank, world, init_file)
        import redis

        from longrun.checkpoint import Checkpointer, RedisCommitLedger
        from longrun.commgroup import form_groups, single_node_layout
        from longrun.worker.setup import replicas_of

        cfg = layout_config({"fsdp": world}, world, job={"name": job},
                            checkpoint={"dir": root, "interval_steps": STEPS},
                            training={"steps": STEPS, "global_batch_tokens": GLOBAL_TOKENS})
        groups = form_groups(single_node_layout(cfg.dims), rank)
        replicas = replicas_of(groups)
        with _trainer(cfg, groups) as trainer:
            ckpt = Checkpointer(cfg, rank=rank, world_size=world, dp_rank=replicas.rank,
                                dp_size=replicas.size,
                                ledger=RedisCommitLedger(redis.Redis.from_url(redis_url), job, attempt))
            restored = ckpt.restore(trainer, world_group=dist.group.WORLD, dp_group=replicas.group)
            trainer.before_update.append(ckpt.before_update)
            losses, trained, _ = train_and_record(trainer, steps=until - trainer.step)
            ckpt.save_now(trainer)
            ckpt.close()
        results.put((rank, restored.step if restored else 0, losses, trained))
        dist.barrier()
        dist.destroy_process_group()
    except Exception:
        results.put((rank, "error", traceback.format_exc()))


def _world(tmp_path, name, world, redis_url, root, job, attempt, until):
    where = tmp_path / name
    where.mkdir()
    return run_world(segment, world, where, args=(redis_url, root, job, attempt, until), timeout=180)


def test_four_then_two_then_three_ranks_train_every_sample_once_on_the_same_curve(tmp_path,
                                                                                   redis_server):
    straight = _world(tmp_path, "straight", 4, redis_server.url, str(tmp_path / "straight-ckpt"),
                      "straight", 0, STEPS)
    ref_losses = straight[0][2]
    ref_trained = [sorted(i for *_, trained in straight for i in trained[step]) for step in range(STEPS)]
    root = str(tmp_path / "elastic-ckpt")
    losses: list[float] = []
    trained: list[list[int]] = []
    start = 0
    for attempt, (world, until) in enumerate(SEGMENTS):
        out = _world(tmp_path, f"segment-{attempt}", world, redis_server.url, root, "elastic",
                     attempt, until)
        assert {restored for _, restored, *_ in out} == {start}, out  # resumed where the last left
        assert all(row[2] == out[0][2] for row in out)  # the global loss, the same on every rank
        losses += out[0][2]
        for step in range(until - start):
            counts = Counter(i for *_, mine in out for i in mine[step])
            assert set(counts.values()) == {1}, (start + step + 1, counts.most_common(3))
            trained.append(sorted(counts))
        start = until
    # Every sample exactly once, in the order of the uninterrupted run (the sample ledger) ...
    assert trained == ref_trained
    # ... and the same loss curve, within float summation order.
    assert losses == pytest.approx(ref_losses, rel=1e-4)
