"""The worker's side of peer memory snapshots: sending each step's state to two keepers, and
restoring from them after a fault (the keepers and the plan are controller/keepers.py; the
snapshot itself is checkpoint/memory.py).

    sender = snapshot_sender(rank, targets)          # send(step, blob, digest) to both keepers
    restored = restore_from_memory(trainer, rank, plan, world_group)   # or None: use storage

A restore is all or nothing: every rank fetches and verifies its snapshot, and if any one
cannot (a keeper gone, a checksum off), all of them restore from storage instead.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import ray
import torch.distributed as dist

from longrun.checkpoint.memory import MemorySnapshots, read_snapshot
from longrun.checkpoint.restore import all_ranks_ok
from longrun.checkpoint.sharding import globalize
from longrun.config import JobConfig

log = logging.getLogger(__name__)

FETCH_TIMEOUT_S = 120.0
HOST_SHARE = 0.5  # of a node's memory that its keeper may fill


def snapshot_sender(rank: int, targets: list[str]):
    keepers = [ray.get_actor(name) for name in targets]

    def send(step: int, blob: bytes, digest: str) -> None:
        ref = ray.put(blob)  # one copy in the object store, read by both keepers
        ray.get([k.put.remote(rank, step, ref, digest) for k in keepers])
    return send


def memory_snapshots(cfg: JobConfig, rank: int, plan: dict[str, Any]) -> MemorySnapshots | None:
    """This rank's snapshotter, for the controller's `plan` (keepers to send to, interval);
    None when its keepers cannot be found (snapshots are a shortcut: training goes on, and
    restarts read storage)."""
    try:
        send = snapshot_sender(rank, plan["targets"])
    except ValueError as exc:  # Ray's word for a named actor it cannot find
        log.warning("memory snapshots off on rank %d: %s", rank, exc)
        return None
    every = cfg.checkpoint.memory_interval_steps or 1  # null: every step, if it fits (the budget)
    node_memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    # A keeper holds two steps of its node's ranks and of the previous node's.
    budget = None if cfg.checkpoint.memory_interval_steps else int(
        node_memory * HOST_SHARE / (4 * cfg.cluster.workers_per_node))
    return MemorySnapshots(send, every, host_budget_bytes=budget)


def restore_from_memory(trainer, rank: int, restore: dict[str, Any],
                        world_group: dist.ProcessGroup | None) -> int | None:
    """Load the step `restore` names from the keepers into `trainer`; the step, or None when
    any rank could not (then nothing was loaded anywhere). Collective over `world_group`."""
    state, problems = None, []
    for name in restore["keepers"][str(rank)]:  # this node's copy, then the peer's
        try:
            keeper = ray.get_actor(name)
            blob, digest = ray.get(keeper.get.remote(rank, restore["step"]), timeout=FETCH_TIMEOUT_S)
            state = read_snapshot(blob, digest)
            break
        except Exception as exc:  # a keeper gone with its node, a checksum off: the next copy
            problems.append(f"{name}: {type(exc).__name__}: {exc}")
    problem = "; ".join(problems) if state is None else None
    if not all_ranks_ok(problem is None, world_group):
        log.warning("memory snapshot of step %d unusable (%s); restoring from storage", restore["step"],
                    problem or "another rank could not read or verify its snapshot")
        return None
    trainer.load_state_dict(globalize(state, trainer.state_dict()))
    return int(state["step"])
