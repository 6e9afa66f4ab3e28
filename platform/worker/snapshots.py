"""The worker's side of peer memory snapshots: sending each snapshot to two keepers, restoring
from them after a fault, and turning what they hold into a committed checkpoint (the keepers
and the plan are controller/keepers.py; the snapshot itself is checkpoint/memory.py; the
transfer, chunk by chunk, worker/snapshot_transfer.py).

    snapshots = memory_snapshots(cfg, rank, plan, groups)        # this rank's part, agreed steps
    restored = restore_from_memory(trainer, rank, plan, world_group, replicate_group, prefer=own_keeper)
                                                                 # or None: use storage
    step = commit_from_keepers(config, plan, ranks, ledger)      # those ranks' files of the step

A restore is all or nothing: every rank fetches and verifies its own blob, the replicas of a
shard swap their parts of it over their group, and if any one cannot (a keeper gone, a checksum
off, parts of different snapshots), all of them restore from storage instead.

A restore at another layout (an elastic job that shrank or grew) and a stop request between
attempts both go through `commit_from_keepers`: the old layout's snapshots of one step are
written as a committed checkpoint, through the checkpoint writer and commit, one process per
node writing its ranks (controller/snapshot_commit.py), which any layout restores by resharding
(checkpoint/resharding.py), as it would any checkpoint.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any

import ray
import torch
import torch.distributed as dist

from longrun.checkpoint.commit import CommitLedger
from longrun.checkpoint.memory import HOST_COPIES_PER_RANK, Agree, MemorySnapshots, Part
from longrun.checkpoint.memory_commit import commit_snapshots
from longrun.checkpoint.restore import BROADCAST_BUCKET_BYTES, all_ranks_ok
from longrun.checkpoint.sharding import globalize
from longrun.checkpoint.snapshot_blob import Exchange, SnapshotError, read_parts
from longrun.config import JobConfig
from longrun.trainer.optim import lay_out_state
from longrun.worker.snapshot_transfer import (
    SendTimeout,
    SnapshotUnavailable,
    blob_getter,
    fetch_blob,
    fetch_snapshot,
    node_object_store_bytes,
    preferred_first,
    snapshot_sender,
    transfer_sizes,
)

log = logging.getLogger(__name__)

HOST_SHARE = 0.5  # of a node's memory that its snapshots (every copy, `HOST_COPIES_PER_RANK`) may fill


def snapshot_timeout_s(cfg: JobConfig) -> float:
    """How long a send may wait for its keepers to take a chunk: well under the shortest hang
    timeout (a send runs beside training, but a keeper that never answers must free it)."""
    return min(cfg.health.hang_min_s, cfg.health.hang_timeout_s) / 2


def job_max(group: dist.ProcessGroup) -> Agree:
    """The element-wise maximum of a few integers over `group` (one all-reduce): how the ranks
    agree on each snapshot."""
    def agree(values: list[int]) -> list[int]:
        flags = torch.tensor(values, dtype=torch.int64)
        if dist.get_backend(group) == "nccl":
            flags = flags.cuda()
        dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=group)
        return [int(v) for v in flags.tolist()]
    return agree


def snapshot_part(rank: int, replicas: list[int] | None) -> Part:
    """This rank's share of its shard: its place among `replicas` (the ranks holding the same
    pieces: commgroup's `replicate` group)."""
    members = tuple(sorted(replicas or [rank]))
    return Part(members.index(rank), len(members), members if len(members) > 1 else ())


def memory_snapshots(cfg: JobConfig, rank: int, plan: dict[str, Any], groups=None, *, on_drop=None,
                     on_interval=None) -> MemorySnapshots:
    """This rank's snapshotter, for the controller's `plan` (keepers to send to) and its
    `groups` (its replicas, and the world the ranks agree over). Every rank gets one: a rank
    whose keepers cannot be found still takes part in the agreement, which turns snapshots off
    for all (a restore needs every rank's). `on_drop(step, why)`: each snapshot skipped or
    lost; `on_interval(k)`: each interval chosen."""
    # Chunks and how many are in flight sized to this node's object store, which a send must
    # never fill (a full store spills to disk and holds the put that filled it).
    chunk_bytes, window = transfer_sizes(node_object_store_bytes())
    try:
        send = snapshot_sender(rank, plan["targets"], timeout_s=snapshot_timeout_s(cfg), window=window)
    except ValueError as exc:  # Ray's word for a named actor it cannot find
        log.warning("memory snapshots off: rank %d cannot reach its keepers (%s)", rank, exc)
        send = None
    every = cfg.checkpoint.memory_interval_steps
    node_memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    budget = int(node_memory * HOST_SHARE / cfg.cluster.workers_per_node)  # every copy counted
    return MemorySnapshots(send, None if every in (None, "auto") else every,
                           part=snapshot_part(rank, groups.ranks["replicate"] if groups else None),
                           host_budget_bytes=budget, agree=job_max(groups.world) if groups else None,
                           on_drop=on_drop, on_interval=on_interval, chunk_bytes=chunk_bytes)


def restore_from_memory(trainer, rank: int, restore: dict[str, Any], world_group: dist.ProcessGroup | None,
                        replicate_group: dist.ProcessGroup | None = None,
                        prefer: str | None = None) -> int | None:
    """Load the step `restore` names from the keepers into `trainer`; the step, or None when
    any rank could not (then nothing was loaded anywhere). Collective over `world_group`.

    Each rank fetches its own blob only (from `prefer`, its node's keeper, when that holds one):
    where a shard's replicas divide its snapshot (`replicate_group`), they swap their parts over
    that group (`replica_exchange`), so the keepers serve each byte of the state once per restore
    instead of once per replica, and the parts cross the training network, not Ray's object
    store. Without the group a rank fetches its replicas' parts from the keepers too."""
    step = int(restore["step"])
    started = time.perf_counter()
    own, problems = fetch_blob(rank, step, preferred_first(restore["keepers"].get(str(rank), []), prefer))
    fetched = time.perf_counter()
    if not all_ranks_ok(own is not None, world_group):
        why = ("; ".join(problems) or "no keeper holds it") if own is None else \
            "another rank could not read or verify its snapshot"
        log.warning("memory snapshot of step %d unusable (%s); restoring from storage", step, why)
        return None

    others = blob_getter(step, restore["keepers"], [], prefer)  # a part no group swaps: from the keepers

    def get(r: int) -> tuple[Any, str]:
        return own if r == rank else others(r)

    try:
        state, _, _ = read_parts(rank, get, verified=True, exchange=replica_exchange(replicate_group))
        problem = None
    except (SnapshotError, SnapshotUnavailable) as exc:  # parts that do not fit together, or one missing
        state, problem = None, f"{type(exc).__name__}: {exc}"
    if not all_ranks_ok(problem is None, world_group):
        log.warning("memory snapshot of step %d unusable (%s); restoring from storage", step,
                    problem or "another rank could not assemble its snapshot")
        return None
    assembled = time.perf_counter()
    lay_out_state(trainer.optimizer)  # a fresh optimizer's state, unfilled: the snapshot's replaces it
    trainer.load_state_dict(globalize(state, trainer.state_dict()))
    done = time.perf_counter()
    # Where a restore's seconds went, in the rank's log.
    log.info("memory snapshot of step %d restored in %.2f s: own part fetched and verified %.2f s, "
             "replicas' parts and every rank's word %.2f s, loaded %.2f s", step, done - started,
             fetched - started, assembled - fetched, done - assembled)
    return int(state["step"])


def replica_exchange(group: dist.ProcessGroup | None) -> Exchange | None:
    """How the replicas of a shard fill in each other's parts of its snapshot (`read_parts`'
    `exchange`): each checks that every replica holds a part of the same snapshot (one small
    all-gather; a mismatch raises on all of them alike), then each part is broadcast from the
    replica holding it, in buckets of at most BROADCAST_BUCKET_BYTES (through the device for
    NCCL). None without replicas."""
    if group is None or dist.get_world_size(group) == 1:
        return None

    def exchange(shared: torch.Tensor, bounds: list[int], header: dict[str, Any]) -> None:
        count = header["part"][1]
        mine = [header["shared_bytes"], header["layout"], header["state"].get("step")]
        theirs: list[Any] = [None] * dist.get_world_size(group)
        dist.all_gather_object(theirs, [list(header["part"]), *mine], group=group)
        for i, other in enumerate(theirs):
            if other != [[i, count], *mine]:
                raise SnapshotError(f"replica {i} of this shard holds no part {i} of the same snapshot "
                                    f"(part {other[0]}, step {other[3]}; this rank's step {mine[2]})")
        on_gpu = dist.get_backend(group) == "nccl"
        device = torch.device("cuda", torch.cuda.current_device()) if on_gpu else None
        for i, holder in enumerate(header["replicas"]):
            for lo in range(bounds[i], bounds[i + 1], BROADCAST_BUCKET_BYTES):
                piece = shared[lo:min(lo + BROADCAST_BUCKET_BYTES, bounds[i + 1])]
                if device is None:
                    dist.broadcast(piece, src=holder, group=group)
                else:
                    moved = piece.to(device)
                    dist.broadcast(moved, src=holder, group=group)
                    piece.copy_(moved)
    return exchange


class SnapshotUnreadable(RuntimeError):
    """No keeper has a good copy of some rank's snapshot: nothing can be committed."""


def commit_from_keepers(config: dict[str, Any], restore: dict[str, Any], ranks: list[int] | None = None,
                        ledger: CommitLedger | None = None, prefer: str | None = None) -> int:
    """Write the snapshots of `restore["step"]` of `ranks` (default: every rank of the layout
    `config` describes) from the keepers `restore` lists (`prefer`: this node's keeper, tried
    first) into the job's checkpoint dir, reporting to `ledger` (shared with the processes
    writing the other ranks); the step. Raises (and commits nothing) when a rank's snapshot
    cannot be read."""
    cfg = JobConfig.model_validate(config)
    step = int(restore["step"])

    def read(rank: int) -> dict[str, Any]:
        # Only the first of a shard's replicas writes its pieces: the others' own blobs suffice.
        snapshot, problems = fetch_snapshot(rank, step, restore["keepers"], full=None, prefer=prefer)
        if snapshot is None:
            raise SnapshotUnreadable(f"rank {rank}'s snapshot of step {step}: " + ("; ".join(problems)
                                     or "no keeper holds it"))
        return snapshot

    commit_snapshots(cfg, step, read, ranks=ranks, ledger=ledger)
    return step


class ActorLedger:
    """A commit ledger held by a Ray actor (`LocalCommitLedger` inside it): the processes that
    write one commit's ranks on several nodes report to it, and rank 0's writer waits on it.
    Every method of the ledger's protocol (`checkpoint/commit.py`) is the actor's, called and
    waited for."""

    shared = True  # every process writing the commit sees the same reports

    def __init__(self, actor):
        self._actor = actor

    def __getattr__(self, name: str):
        method = getattr(self._actor, name)
        return lambda *args, **kwargs: ray.get(method.remote(*args, **kwargs))


__all__ = ["HOST_COPIES_PER_RANK", "ActorLedger", "SendTimeout", "SnapshotUnavailable", "commit_from_keepers",
           "job_max", "memory_snapshots", "replica_exchange", "restore_from_memory", "snapshot_sender"]
