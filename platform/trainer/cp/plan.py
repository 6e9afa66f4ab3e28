"""What a context-parallel plan is: per micro-batch, the ranks cut into CP groups, each with the
sequences it trains and its predicted time. Built by `cp/planner.py` (dynamic or static),
read by `cp/batches.py` (each rank keeps its own groups) and the trainer.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from longrun.trainer.cp.cost import CostModel


@dataclass(frozen=True)
class PlannedGroup:
    """One CP group in one micro-batch: ranks [first_rank, first_rank + cp) train `sequences`
    (indices into the planned lengths). An idle group has no sequences and costs nothing."""

    cp: int
    first_rank: int
    sequences: tuple[int, ...]
    predicted_s: float

    @property
    def ranks(self) -> range:
        return range(self.first_rank, self.first_rank + self.cp)


@dataclass(frozen=True)
class MicroBatchPlan:
    groups: tuple[PlannedGroup, ...]  # sorted by first_rank; together they cover every rank once

    @property
    def predicted_s(self) -> float:
        return max((g.predicted_s for g in self.groups), default=0.0)

    def group_of(self, rank: int) -> PlannedGroup:
        for g in self.groups:
            if g.first_rank <= rank < g.first_rank + g.cp:
                return g
        raise IndexError(f"rank {rank} is in no group of this micro-batch")


@dataclass(frozen=True)
class Plan:
    micro_batches: tuple[MicroBatchPlan, ...]
    n_ranks: int
    token_budget: int

    @property
    def predicted_s(self) -> float:
        """Lock-step: a micro-batch ends when its slowest group does."""
        return sum(mb.predicted_s for mb in self.micro_batches)

    def for_rank(self, rank: int) -> list[PlannedGroup]:
        """The group `rank` belongs to in each micro-batch, in order."""
        if not 0 <= rank < self.n_ranks:
            raise IndexError(f"rank {rank} is outside [0, {self.n_ranks})")
        return [mb.group_of(rank) for mb in self.micro_batches]

    def summary(self) -> dict[str, Any]:
        histogram: dict[int, int] = {}
        for mb in self.micro_batches:
            for g in mb.groups:
                if g.sequences:
                    histogram[g.cp] = histogram.get(g.cp, 0) + len(g.sequences)
        return {
            "micro_batches": len(self.micro_batches),
            "sequences_per_cp": dict(sorted(histogram.items())),
            "predicted_s": self.predicted_s,
        }


class SequenceTooLongError(ValueError):
    def __init__(self, index: int, length: int, max_cp: int, token_budget: int) -> None:
        self.index, self.length, self.max_cp = index, length, max_cp
        self.limit = _max_length(max_cp, token_budget)
        super().__init__(
            f"sequence {index} has {length} tokens, but the largest context-parallel size allowed, "
            f"{max_cp}, fits at most {self.limit} tokens per sequence (token_budget={token_budget} "
            f"per rank); raise token_budget or max_cp, or cap sequence lengths at {self.limit}"
        )


def _max_length(cp: int, token_budget: int) -> int:
    """Longest sequence whose per-rank share in some group of size <= cp fits the budget."""
    best = token_budget
    c = 2
    while c <= cp:
        best = max(best, 2 * c * (token_budget // 2))
        c *= 2
    return best


def check_inputs(lengths: Sequence[int] | np.ndarray, n_ranks: int, token_budget: int) -> np.ndarray:
    if not isinstance(n_ranks, int | np.integer) or n_ranks < 1:
        raise ValueError(f"n_ranks must be a positive integer, got {n_ranks!r}")
    if not isinstance(token_budget, int | np.integer) or token_budget < 1:
        raise ValueError(f"token_budget must be a positive integer, got {token_budget!r}")
    arr = np.asarray(lengths)
    if arr.size == 0:
        return np.zeros(0, dtype=np.int64)
    if arr.ndim != 1 or not np.issubdtype(arr.dtype, np.integer):
        raise ValueError("lengths must be a flat sequence of integers")
    arr = arr.astype(np.int64)
    if arr.min() < 1:
        bad = int(np.argmin(arr))
        raise ValueError(f"sequence {bad} has length {int(arr[bad])}; every sequence needs >= 1 token")
    return arr


def build_plan(
    mbs: list[list[tuple[int, int, list[int]]]],
    lengths: np.ndarray,
    n_ranks: int,
    token_budget: int,
    cost: CostModel,
) -> Plan:
    """Groups given as (cp, first_rank, sequence indices) per micro-batch -> a Plan with exact
    predicted times and idle size-1 groups on every uncovered rank."""
    out = []
    for groups in mbs:
        covered = np.zeros(n_ranks, dtype=bool)
        built = []
        for cp, first, seqs in groups:
            covered[first : first + cp] = True
            seqs = sorted(seqs)
            built.append(PlannedGroup(cp, first, tuple(seqs), cost.group_time(lengths[seqs], cp)))
        built += [PlannedGroup(1, int(r), (), 0.0) for r in np.flatnonzero(~covered)]
        built.sort(key=lambda g: g.first_rank)
        out.append(MicroBatchPlan(tuple(built)))
    return Plan(tuple(out), n_ranks, token_budget)
