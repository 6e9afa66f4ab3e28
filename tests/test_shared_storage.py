"""A checkpoint directory that is not one directory on every node is refused before a step is
trained (checkpoint/shared.py): each node new to the job leaves a probe there, and the
controller must read every one back. On a simulated cluster the nodes share this host's disk, so
a per-process store (fsspec's memory://) stands in for a path that is each node's own."""

from __future__ import annotations

import pytest
from clusters import simulated_cluster

from longrun.checkpoint.shared import unseen_probes, write_probe
from longrun.config import config_from_dict
from longrun.controller.controller import Controller, JobFailed, job_status


def test_probes_are_seen_in_a_shared_directory_and_cleaned_up(tmp_path):
    write_probe(str(tmp_path), "t1", "node-a")
    write_probe(str(tmp_path), "t1", "node-b")
    assert unseen_probes(str(tmp_path), "t1", ["node-a", "node-b"]) == []
    assert not (tmp_path / ".longrun-probes").exists()  # found, then removed: only checkpoints there


def test_a_probe_written_elsewhere_is_unseen(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    write_probe(str(tmp_path / "a"), "t2", "node-a")  # node a's own disk
    write_probe(str(tmp_path / "b"), "t2", "node-b")
    assert unseen_probes(str(tmp_path / "b"), "t2", ["node-a", "node-b"]) == ["node-a"]


def test_a_commit_refuses_pieces_written_where_the_coordinator_cannot_see_them(tmp_path):
    """Two ranks whose checkpoint.dir resolves to two places (each node its own disk): rank 1's
    report arrives, its file is elsewhere; the commit fails naming it and commits nothing."""
    import fsspec
    import torch

    from longrun.checkpoint import (
        CheckpointWriteError,
        CheckpointWriter,
        HostStager,
        LocalCommitLedger,
        Manifest,
    )
    from longrun.checkpoint.layout import committed_steps
    from longrun.checkpoint.manifest import rank_shard_name
    from longrun.checkpoint.writer import SaveJob

    fs, ledger = fsspec.filesystem("file"), LocalCommitLedger()
    roots = [str(tmp_path / "node-0"), str(tmp_path / "node-1")]
    writers = [CheckpointWriter(fs, roots[rank], rank=rank, world_size=2, ledger=ledger, keep_last=2,
                                commit_timeout_s=30.0) for rank in (0, 1)]
    for rank in (1, 0):
        snapshot = HostStager().stage({rank_shard_name(rank): {"x": torch.ones(4) * rank}})
        manifest = None if rank else Manifest(step=3, world_size=2, dp_size=2, model={},
                                              config_fingerprint="f")
        writers[rank].submit(SaveJob(3, snapshot, manifest))
    for writer in writers:
        writer.wait_idle()
    writers[1].raise_if_failed()  # rank 1 wrote its file, on its own disk
    with pytest.raises(CheckpointWriteError, match=r"rank-00001\.pt \(missing\)\. checkpoint\.dir must be "
                       r"one directory every node shares"):
        writers[0].raise_if_failed()
    for writer in writers:
        writer.close()
    assert committed_steps(fs, roots[0]) == []


@pytest.mark.timeout(300)
def test_a_checkpoint_dir_the_nodes_do_not_share_fails_the_job_before_a_step(redis_server, redis_client,
                                                                            tmp_path):
    cfg = config_from_dict({
        "job": {"name": "not-shared", "output_dir": str(tmp_path)},
        "cluster": {"nodes": 2, "workers_per_node": 1, "device": "cpu"},
        "parallelism": {"dp": 2},
        "model": {"dim": 32, "n_layers": 1, "n_heads": 2, "max_seq_len": 32},
        "data": {"source": "synthetic", "micro_batch_tokens": 64},
        "training": {"steps": 4, "warmup_steps": 1},
        # Each process its own store: what a node-local path is on a real cluster.
        "checkpoint": {"dir": "memory://not-shared/checkpoints", "memory_interval_steps": 0},
    })
    refused = r"checkpoint.dir memory://not-shared/checkpoints is not one directory shared by every node"
    with simulated_cluster(2, 1), pytest.raises(JobFailed, match=refused):
        Controller(cfg, redis_server.url).run()
    status = job_status(redis_client, cfg.job.name, events=100)
    assert status["state"] == "FAILED" and status["step"] == 0  # refused before any step trained
    assert not any(e["type"] == "decision" and "restart" in e["reason"] and "this is restart" in e["reason"]
                   for e in status["events"])  # at once, not after restarts
