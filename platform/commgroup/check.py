"""Prove every group works and holds exactly the ranks it should.

Each group all-gathers its members' global ranks: a group that formed with the wrong members,
or cannot move data, fails here rather than in the middle of a training step. It is also what
"usable" means when group bring-up is timed (a first collective done on each group).
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from longrun.commgroup.groups import ParallelGroups


class GroupCheckError(RuntimeError):
    pass


def check_groups(groups: ParallelGroups, device: torch.device | None = None) -> dict[str, float]:
    """Run the membership all-gather on every group; returns seconds per group name."""
    device = device or torch.device("cpu")
    seconds: dict[str, float] = {}
    for name, pg in groups.all_groups().items():
        expected = groups.ranks[name]
        start = time.perf_counter()
        mine = torch.tensor([groups.rank], dtype=torch.int64, device=device)
        gathered = torch.empty(len(expected), dtype=torch.int64, device=device)
        dist.all_gather_single(gathered, mine, group=pg)
        got = gathered.tolist()
        seconds[name] = time.perf_counter() - start
        if got != expected:
            raise GroupCheckError(
                f"group {name} on rank {groups.rank} holds ranks {got}, expected {expected}")
    return seconds
