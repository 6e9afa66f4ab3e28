"""The worker's side of peer memory snapshots: sending each step's state to two keepers,
restoring from them after a fault, and turning what they hold into a committed checkpoint (the
keepers and the plan are controller/keepers.py; the snapshot itself is checkpoint/memory.py).

    sender = snapshot_sender(rank, targets, timeout_s)   # send(step, blob, digest) to both keepers
    restored = restore_from_memory(trainer, rank, plan, world_group)   # or None: use storage
    step = commit_from_keepers(config, plan)             # the plan's step, committed to storage

A restore is all or nothing: every rank fetches and verifies its snapshot, and if any one
cannot (a keeper gone, a checksum off), all of them restore from storage instead.

A restore at another layout (an elastic job that shrank or grew) and a stop request between
attempts both go through `commit_from_keepers`: the old layout's snapshots of one step are
written as a committed checkpoint, through the checkpoint writer and commit, which any layout
restores by resharding (checkpoint/resharding.py), as it would any checkpoint.
"""

from __future__ import annotations

import contextlib
import logging
import os
from typing import Any

import ray
import torch.distributed as dist

from longrun.checkpoint.memory import HOST_COPIES_PER_RANK, MemorySnapshots, open_snapshot
from longrun.checkpoint.memory_commit import commit_snapshots
from longrun.checkpoint.restore import all_ranks_ok
from longrun.checkpoint.sharding import globalize
from longrun.config import JobConfig

log = logging.getLogger(__name__)

FETCH_TIMEOUT_S = 120.0
HOST_SHARE = 0.5  # of a node's memory that its snapshots (every copy, `HOST_COPIES_PER_RANK`) may fill


class SendTimeout(RuntimeError):
    """A keeper did not take a snapshot in time (the snapshot is dropped)."""


def snapshot_sender(rank: int, targets: list[str], timeout_s: float | None = None):
    """send(step, blob, digest): one copy into the object store, taken by both keepers; raises
    SendTimeout when they have not within `timeout_s` (a slow keeper never holds the sender)."""
    keepers = [ray.get_actor(name) for name in targets]

    def send(step: int, blob, digest: str) -> None:
        ref = ray.put(blob)  # one copy in the object store, read by both keepers
        puts = [k.put.remote(rank, step, ref, digest) for k in keepers]
        try:
            ray.get(puts, timeout=timeout_s)
        except ray.exceptions.GetTimeoutError:
            for put in puts:  # not waited on any more; a late arrival is harmless to the keeper
                with contextlib.suppress(Exception):  # already running: it may still land
                    ray.cancel(put)
            raise SendTimeout(f"the keepers did not take it within {timeout_s:g} s") from None
    return send


def snapshot_wait_s(cfg: JobConfig) -> float:
    """How long a snapshot may hold a step (waiting for the previous send) and a send may wait
    for its keepers: well under the shortest hang timeout, so a slow keeper costs snapshots,
    never a restart."""
    return min(cfg.health.hang_min_s, cfg.health.hang_timeout_s) / 2


def memory_snapshots(cfg: JobConfig, rank: int, plan: dict[str, Any],
                     on_drop=None) -> MemorySnapshots | None:
    """This rank's snapshotter, for the controller's `plan` (keepers to send to, interval);
    None when its keepers cannot be found (snapshots are a shortcut: training goes on, and
    restarts read storage). `on_drop(step, why)`: told of each snapshot dropped."""
    wait_s = snapshot_wait_s(cfg)
    try:
        send = snapshot_sender(rank, plan["targets"], timeout_s=wait_s)
    except ValueError as exc:  # Ray's word for a named actor it cannot find
        log.warning("memory snapshots off on rank %d: %s", rank, exc)
        return None
    every = cfg.checkpoint.memory_interval_steps or 1  # null: every step, if it fits (the budget)
    node_memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    budget = int(node_memory * HOST_SHARE / cfg.cluster.workers_per_node)  # every copy counted
    return MemorySnapshots(send, every, host_budget_bytes=budget, wait_s=wait_s, on_drop=on_drop)


def fetch_snapshot(rank: int, step: int, names: list[str]) -> tuple[dict[str, Any] | None, list[str]]:
    """Rank `rank`'s snapshot of `step` ({"state", "where"}), read and verified from the
    first of the keepers `names` that has a good copy; (None, the problems) when none has."""
    problems = []
    for name in names:  # this node's copy, then the peer's
        try:
            keeper = ray.get_actor(name)
            blob, digest = ray.get(keeper.get.remote(rank, step), timeout=FETCH_TIMEOUT_S)
            state, where = open_snapshot(blob, digest)
            return {"state": state, "where": where}, problems
        except Exception as exc:  # a keeper gone with its node, a checksum off: the next copy
            problems.append(f"{name}: {type(exc).__name__}: {exc}")
    return None, problems


def restore_from_memory(trainer, rank: int, restore: dict[str, Any],
                        world_group: dist.ProcessGroup | None) -> int | None:
    """Load the step `restore` names from the keepers into `trainer`; the step, or None when
    any rank could not (then nothing was loaded anywhere). Collective over `world_group`."""
    snapshot, problems = fetch_snapshot(rank, restore["step"], restore["keepers"][str(rank)])
    problem = "; ".join(problems) if snapshot is None else None
    if not all_ranks_ok(problem is None, world_group):
        log.warning("memory snapshot of step %d unusable (%s); restoring from storage", restore["step"],
                    problem or "another rank could not read or verify its snapshot")
        return None
    state = snapshot["state"]
    trainer.load_state_dict(globalize(state, trainer.state_dict()))
    return int(state["step"])


class SnapshotUnreadable(RuntimeError):
    """No keeper has a good copy of some rank's snapshot: nothing can be committed."""


def commit_from_keepers(config: dict[str, Any], restore: dict[str, Any]) -> int:
    """Write the snapshots of `restore["step"]` (every rank of the layout `config` describes,
    from the keepers `restore` lists) as a committed checkpoint in the job's checkpoint dir;
    the step. Raises (and commits nothing) when a rank's snapshot cannot be read."""
    cfg = JobConfig.model_validate(config)
    step = int(restore["step"])

    def read(rank: int) -> dict[str, Any]:
        snapshot, problems = fetch_snapshot(rank, step, restore["keepers"].get(str(rank), []))
        if snapshot is None:
            raise SnapshotUnreadable(f"rank {rank}'s snapshot of step {step}: " + ("; ".join(problems)
                                     or "no keeper holds it"))
        return snapshot

    commit_snapshots(cfg, step, read)
    return step


__all__ = ["HOST_COPIES_PER_RANK", "SendTimeout", "commit_from_keepers", "memory_snapshots",
           "restore_from_memory", "snapshot_sender"]
