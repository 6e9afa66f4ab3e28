"""Memory snapshots committed as a checkpoint (issue 26, holes 2 and 9): what the keepers hold
survives a stop between attempts and reaches another layout, through the same writer, commit
and resharding restore as any checkpoint. At the same layout the result is the snapshot, bit
for bit (training on from it equals training straight through); at another layout every tensor
of the model and optimizer, whole, equals the snapshotted one."""

from __future__ import annotations

import pytest
import sharded_workers as w
import snapshot_workers as sw
import torch
from worlds import run_world

from longrun.checkpoint import Checkpointer
from longrun.checkpoint.layout import committed_steps
from longrun.checkpoint.memory import open_snapshot, serialize
from longrun.checkpoint.memory_commit import commit_snapshots
from longrun.checkpoint.sharding import localize
from longrun.checkpoint.writer import CheckpointWriteError
from longrun.config import config_from_dict
from longrun.trainer import Trainer


def _cfg(tmp_path, steps: int):
    return config_from_dict({
        "job": {"name": "snap-commit", "seed": 5, "output_dir": str(tmp_path)},
        "cluster": {"device": "cpu"},
        "model": {"dim": 32, "n_layers": 1, "n_heads": 2, "max_seq_len": 32},
        "data": {"source": "synthetic", "micro_batch_tokens": 64, "prefetch": 1,
                 "synthetic": {"min_len": 8, "max_len": 32, "mean": 16, "sigma": 0.8}},
        "training": {"steps": steps, "lr": 3e-3, "warmup_steps": 1, "log_every": 100},
        "checkpoint": {"interval_steps": 100},
    })


def _reader(blobs: dict[int, tuple[bytes, str]]):
    def read(rank: int) -> dict:
        state, where = open_snapshot(*blobs[rank])
        return {"state": state, "where": where}
    return read


def test_a_committed_snapshot_resumes_bitwise_like_the_run_it_came_from(tmp_path):
    cfg = _cfg(tmp_path, steps=5)
    with Trainer(cfg, progress=False) as straight:
        straight.train()
        want = {k: v.clone() for k, v in straight.model.state_dict().items()}
    with Trainer(cfg, progress=False) as first:
        first.train(steps=3)
        blob = serialize(*localize(first.state_dict()))
    commit_snapshots(cfg, 3, _reader({0: blob}))
    ckpt = Checkpointer(cfg)
    assert committed_steps(ckpt.fs, ckpt.root) == [3]
    with Trainer(cfg, progress=False) as resumed:
        assert ckpt.restore(resumed).step == 3
        resumed.train()
        got = resumed.model.state_dict()
    ckpt.close()
    assert all(torch.equal(got[k], v) for k, v in want.items())


def test_a_snapshot_that_cannot_be_read_commits_nothing(tmp_path):
    cfg = _cfg(tmp_path, steps=2)

    def unreadable(rank: int) -> dict:
        raise ValueError("the keeper is gone")

    with pytest.raises(CheckpointWriteError, match="the keeper is gone"):
        commit_snapshots(cfg, 2, unreadable)
    ckpt = Checkpointer(cfg)
    assert committed_steps(ckpt.fs, ckpt.root) == []
    ckpt.close()


def test_fsdp_snapshots_committed_restore_whole_on_one_rank(tmp_path, redis_server):
    """The shrink of hole 9 in small: two FSDP ranks' snapshots, committed, restored at one rank
    (whole weights) through the resharding restore: every tensor equals the snapshotted one."""
    root = str(tmp_path / "ckpt")
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "snap").mkdir()
    out = run_world(sw.snapshot_at_layout, 2, tmp_path / "snap", args=({"fsdp": 2}, root, 3))
    assert out == [(0, "saved"), (1, "saved")]
    blobs = {r: ((tmp_path / f"snapshot-{r}.bin").read_bytes(),
                 (tmp_path / f"snapshot-{r}.sha256").read_text()) for r in range(2)}
    commit_snapshots(w.layout_config({"fsdp": 2}, 2, checkpoint={"dir": root}, training={"steps": 3}), 3,
                     _reader(blobs))
    (tmp_path / "restore").mkdir()
    (row,) = run_world(w.restore_at_layout, 1, tmp_path / "restore",
                       args=({}, redis_server.url, root, "sharded"))
    rank, step, same, _, _, resharded, skipped = row
    assert (rank, step, resharded, skipped) == (0, 3, True, [])
    assert same, "the restored state differs from the snapshotted one"
