"""Peer memory snapshots of one step, every rank's, written as a committed checkpoint.

    commit_snapshots(cfg, step, read)    # read(rank) -> read_snapshot(...) of that rank

What the keepers hold is lost with them: when a job stops between attempts, and when an elastic
job changes its layout (a snapshot fits only the rank of the layout that took it), the newest
step every rank has a snapshot of is made a checkpoint instead. It goes through the same files,
writer, ledger and commit as any save (`writer.py`), written as the ranks of the snapshots'
layout would have (each piece once, by the lowest rank holding it; rank 0 the structure and the
data position, each later pipeline stage's first rank its stage's structure; every rank its RNG
streams), so it restores at any layout by resharding
(`resharding.py`) and a restore at the same layout is bitwise the snapshot. One rank's snapshot
is read at a time (rank 0's is held to the end: its writer commits).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import fsspec

from longrun.checkpoint.commit import LocalCommitLedger
from longrun.checkpoint.dcp_format import data_file_name, fqn_of
from longrun.checkpoint.lineage import current_lineage
from longrun.checkpoint.manifest import Manifest, rank_shard_name
from longrun.checkpoint.sharding import snapshot_pieces
from longrun.checkpoint.snapshot import Snapshot
from longrun.checkpoint.stage_structure import structure_files
from longrun.checkpoint.writer import CheckpointWriteError, CheckpointWriter, SaveJob
from longrun.config import JobConfig
from longrun.config.vocabulary import tokenizer_record
from longrun.parallel.dims import coords_of, leads_its_stage

log = logging.getLogger(__name__)

Read = Callable[[int], dict[str, Any]]  # rank -> {"state": ..., "where": ...} (memory.read_snapshot)


def _files(cfg: JobConfig, rank: int, snapshot: dict[str, Any], written: set[tuple]) -> dict[str, Any]:
    """{file name: content} of `rank`, as `Checkpointer.files_of` makes them; `written`: the
    pieces lower ranks write (a replica's copy is written once)."""
    state = snapshot["state"]
    files: dict[str, Any] = {rank_shard_name(rank): {"rng": state["rng"]}}
    mine = {}
    for path, tensor, offsets, global_shape in snapshot_pieces(state, snapshot["where"]):
        key = (fqn_of(path), offsets)
        if tensor.numel() == 0 or key in written:
            continue
        written.add(key)
        mine[key[0]] = {"tensor": tensor, "offsets": offsets, "global_shape": global_shape, "path": path}
    if mine:
        files[data_file_name(rank)] = mine
    files.update(structure_files(state, rank=rank, stage=coords_of(cfg.dims, rank).pp,
                                 leads_stage=leads_its_stage(cfg.dims, rank)))
    return files


def commit_snapshots(cfg: JobConfig, step: int, read: Read) -> None:
    """Commit the snapshots of `step` of every rank of `cfg`'s layout (the one they were taken
    at) under cfg.checkpoint_dir. Raises CheckpointWriteError (nothing committed: the step's
    `.tmp` stays behind, as after any failed save) when a rank cannot be read or written."""
    fs, root = fsspec.core.url_to_fs(cfg.checkpoint_dir)
    world, ledger, written = cfg.world_size, LocalCommitLedger(), set()

    def writer(rank: int) -> CheckpointWriter:
        return CheckpointWriter(fs, root.rstrip("/"), rank=rank, world_size=world, ledger=ledger,
                                keep_last=cfg.checkpoint.keep_last,
                                commit_timeout_s=cfg.checkpoint.commit_timeout_s)

    def job(rank: int, snapshot: dict[str, Any]) -> SaveJob:
        if snapshot["state"]["step"] != step:
            raise ValueError(f"rank {rank}'s snapshot is of step {snapshot['state']['step']}, not {step}")
        manifest = None
        if rank == 0:
            dims = cfg.dims
            manifest = Manifest(step=step, world_size=world, dp_size=max(1, world // (dims.shards * dims.pp)),
                                model=cfg.model.model_dump(mode="json"),
                                config_fingerprint=cfg.fingerprint(), layout=dims.degrees,
                                tokenizer=tokenizer_record(cfg),
                                lineage=current_lineage(fs, root.rstrip("/")))  # as a save now would
        return SaveJob(step, Snapshot(_files(cfg, rank, snapshot, written), 0), manifest)

    # The coordinator first: it writes its files, then waits in its own thread for the others.
    coordinator = writer(0)
    try:
        coordinator.submit(job(0, read(0)))
        for rank in range(1, world):
            one = writer(rank)
            try:
                one.submit(job(rank, read(rank)))
                one.wait_idle()
                one.raise_if_failed()
            except BaseException as exc:
                # The coordinator must not wait out commit_timeout_s for a rank that never reports.
                ledger.report(step, rank, None, error=f"{type(exc).__name__}: {exc}")
                raise
            finally:
                one.close()
    except BaseException as exc:
        coordinator.close()  # its commit was aborted by the failed rank's report (or never began)
        raise CheckpointWriteError(f"step {step} not committed: {exc}") from exc
    coordinator.close()
    coordinator.raise_if_failed()
    log.info("memory snapshots of step %d committed as a checkpoint under %s", step, cfg.checkpoint_dir)
