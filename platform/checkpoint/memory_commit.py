"""Peer memory snapshots of one step, every rank's, written as a committed checkpoint.

    commit_snapshots(cfg, step, read)                        # read(rank) -> read_parts(...) of it
    commit_snapshots(cfg, step, read, ranks=mine, ledger=shared)   # one node's ranks of the job

What the keepers hold is lost with them: when a job stops between attempts, and when an elastic
job changes its layout (a snapshot fits only the rank of the layout that took it), the newest
step every rank has a snapshot of is made a checkpoint instead. It goes through the same files,
writer, ledger and commit as any save (`writer.py`), written as the ranks of the snapshots'
layout would have (each piece once: by the first of its replicas, part 0 of a divided shard,
and the first rank along any mesh dimension it is replicated on; a whole tensor by its stage's
first rank; rank 0 the structure and the data position, each later pipeline stage's first rank
its stage's structure; every rank its RNG streams), so it restores at any layout by resharding
(`resharding.py`) and a restore at the same layout is bitwise the snapshot. The rule needs no
other rank's snapshot, so the ranks can be written by several processes at once (one per node,
`controller/snapshot_commit.py`) sharing one commit ledger; rank 0's writer commits once every
rank has reported. In one process the ranks are read and written one at a time (rank 0's
snapshot is held to the end: its writer commits).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import fsspec

from longrun.checkpoint.commit import CommitLedger, LocalCommitLedger
from longrun.checkpoint.dcp_format import data_file_name, fqn_of
from longrun.checkpoint.lineage import current_lineage
from longrun.checkpoint.manifest import Manifest, rank_shard_name
from longrun.checkpoint.sharding import snapshot_pieces
from longrun.checkpoint.snapshot import Snapshot
from longrun.checkpoint.stage_structure import structure_files
from longrun.checkpoint.writer import CheckpointWriteError, CheckpointWriter, SaveJob
from longrun.config import JobConfig
from longrun.config.identity import job_identity
from longrun.config.vocabulary import tokenizer_record
from longrun.parallel.dims import coords_of, leads_its_stage

log = logging.getLogger(__name__)

Read = Callable[[int], dict[str, Any]]  # rank -> {"state", "where", "part"} (memory.read_parts)


def _files(cfg: JobConfig, rank: int, snapshot: dict[str, Any], written: set[tuple]) -> dict[str, Any]:
    """{file name: content} of `rank`, as `Checkpointer.files_of` makes them; `written`: the
    pieces written so far in this process (a replica's copy is written once)."""
    state = snapshot["state"]
    files: dict[str, Any] = {rank_shard_name(rank): {"rng": state["rng"]}}
    leads_replicas, leads_stage = snapshot.get("part", 0) == 0, leads_its_stage(cfg.dims, rank)
    mine = {}
    if leads_replicas or leads_stage:  # another replica's part holds no piece this rank writes
        for path, tensor, offsets, global_shape, first in snapshot_pieces(state, snapshot["where"]):
            key = (fqn_of(path), offsets)
            writes = leads_stage if first is None else leads_replicas and first
            if not writes or tensor.numel() == 0 or key in written:
                continue
            written.add(key)
            mine[key[0]] = {"tensor": tensor, "offsets": offsets, "global_shape": global_shape, "path": path}
    if mine:
        files[data_file_name(rank)] = mine
    files.update(structure_files(state, rank=rank, stage=coords_of(cfg.dims, rank).pp,
                                 leads_stage=leads_stage))
    return files


def commit_snapshots(cfg: JobConfig, step: int, read: Read, *, ranks: list[int] | None = None,
                     ledger: CommitLedger | None = None) -> None:
    """Commit the snapshots of `step` of every rank of `cfg`'s layout (the one they were taken
    at) under cfg.checkpoint_dir; `ranks`: only these here (the others are written elsewhere,
    reporting to the same `ledger`), the commit by whoever writes rank 0. Raises
    CheckpointWriteError (nothing committed, as after any failed save) when a rank cannot be
    read or written."""
    fs, root = fsspec.core.url_to_fs(cfg.checkpoint_dir)
    world, written = cfg.world_size, set()
    ranks = sorted(range(world) if ranks is None else ranks)
    ledger = ledger or LocalCommitLedger()

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
                                tokenizer=tokenizer_record(cfg), identity=job_identity(cfg),
                                lineage=current_lineage(fs, root.rstrip("/")))  # as a save now would
        return SaveJob(step, Snapshot(_files(cfg, rank, snapshot, written), 0), manifest)

    # The coordinator first: it writes its files, then waits in its own thread for the others.
    coordinator = writer(0) if 0 in ranks else None
    try:
        if coordinator is not None:
            coordinator.submit(job(0, read(0)))
        for rank in (r for r in ranks if r != 0):
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
        if coordinator is not None:
            coordinator.close()  # its commit was aborted by the failed rank's report (or never began)
        raise CheckpointWriteError(f"step {step} not committed: {exc}") from exc
    if coordinator is None:
        return
    coordinator.close()
    coordinator.raise_if_failed()
    log.info("memory snapshots of step %d committed as a checkpoint under %s", step, cfg.checkpoint_dir)
