"""What the keepers hold, committed as a checkpoint from every node at once.

    step = commit_in_parallel(cfg, restore, {keeper name: node id}, timeout_s=300)

Each rank's snapshot is written by a committer on a node whose keeper holds it (`assign`: of
those, the one given the fewest ranks so far, so each node writes about its own share): one
short-lived actor per node, all at once, each reading its ranks' blobs from its own node's
keeper (shared memory, not the network; the first replica of a divided shard also reads the
other replicas' parts) and writing their files. They report to one commit ledger (a
`LocalCommitLedger` in an actor of its own), and the committer holding rank 0 commits once every
rank has reported (`checkpoint/memory_commit.py`). A committer that fails reports its ranks'
failure, so the commit is aborted at once rather than waited out. The committers run in
processes of their own because committing reads and writes tensors (torch): the controller
never does.
"""

from __future__ import annotations

from typing import Any

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from longrun.checkpoint.commit import LocalCommitLedger
from longrun.config import JobConfig
from longrun.failures import carried


class SnapshotCommitter:
    """Plain class; `commit_in_parallel` makes it a short-lived Ray actor on one node."""

    @carried  # its errors may be torch's: they reach the controller torch-free
    def commit(self, config: dict[str, Any], restore: dict[str, Any], ranks: list[int], ledger: Any,
               keeper: str) -> int:
        from longrun.worker.snapshots import ActorLedger, commit_from_keepers  # torch: here only

        return commit_from_keepers(config, restore, ranks, ActorLedger(ledger), prefer=keeper)


def assign(restore: dict[str, Any], node_of: dict[str, str]) -> dict[str, list[int]]:
    """node -> the ranks its committer writes: each rank to a node whose keeper (`node_of`:
    keeper name -> node) holds its snapshot, the one with the fewest ranks so far."""
    by_node: dict[str, list[int]] = {}
    for rank, names in sorted(((int(r), names) for r, names in restore["keepers"].items())):
        nodes = [node_of[name] for name in names if name in node_of]
        if not nodes:
            raise ValueError(f"no live keeper holds rank {rank}'s snapshot of step {restore['step']}")
        node = min(nodes, key=lambda n: (len(by_node.get(n, ())), nodes.index(n)))
        by_node.setdefault(node, []).append(rank)
    return by_node


def commit_in_parallel(cfg: JobConfig, restore: dict[str, Any], node_of: dict[str, str], *,
                       timeout_s: float) -> int:
    """Commit the snapshots of `restore["step"]` (every rank's, from the keepers it lists;
    `node_of`: keeper name -> node) under cfg.checkpoint_dir, a committer per node; the step.
    Raises (RayError, GetTimeoutError, or a committer's error) when it could not."""
    by_node = assign(restore, node_of)
    keeper_on = {node: name for name, node in node_of.items()}
    # Threaded: rank 0's writer waits in it while the other committers report.
    ledger = ray.remote(num_cpus=0, max_restarts=0,
                        max_concurrency=len(by_node) + 4)(LocalCommitLedger).remote()
    actor = ray.remote(num_cpus=0, max_restarts=0)(SnapshotCommitter)
    committers = []
    try:
        refs = []
        for node, ranks in by_node.items():
            committers.append(actor.options(
                scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False)).remote())
            refs.append(committers[-1].commit.remote(cfg.model_dump(mode="json"), restore, ranks, ledger,
                                                     keeper_on[node]))
        return max(ray.get(refs, timeout=timeout_s))
    finally:
        for one in [*committers, ledger]:
            ray.kill(one, no_restart=True)
