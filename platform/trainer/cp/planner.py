"""Dynamic context parallelism: a planner that picks, per micro-batch, how the ranks split into
context-parallel (CP) groups and which sequences each group trains; static CP as the baseline.

A global batch of variable-length sequences runs on `n_ranks` ranks. In every micro-batch the
ranks are partitioned into groups of power-of-two size c, each an aligned block
[k*c, (k+1)*c) (the sub-groups the communication layer creates up front). A group of size 1
trains its sequences alone; a bigger group runs ring attention over zigzag chunks, so each rank
holds `padded_tokens_per_rank(L, c)` tokens of a sequence of length L. Short sequences thus
avoid all communication and only long ones pay for it. All ranks step through the micro-batches
in lock-step, so a micro-batch lasts as long as its slowest group, and the planner minimises
the sum of those maxima under a per-rank token budget (the cost model: `cp/cost.py`; the
greedy pass: `cp/greedy.py`; what a plan is: `cp/plan.py`).

    python -c "import numpy as np; from longrun.trainer.cp.planner import *; \
        print(plan_dynamic(megatron_lengths(4096, np.random.default_rng(0)), 64, 2048, \
        CostModel(1e-6, 1e-9, 1.2e-9, 1e-4, 1e-9, 256, 4, 1e-3)).summary())"
"""


from __future__ import annotations

import bisect
import heapq
import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from longrun.parallel.dims import is_power_of_two, padded_tokens_per_rank
from longrun.trainer.cp.cost import CostModel, padded_shares
from longrun.trainer.cp.greedy import Packer, greedy
from longrun.trainer.cp.plan import (
    MicroBatchPlan,
    Plan,
    PlannedGroup,
    SequenceTooLongError,
    build_plan,
    check_inputs,
)

__all__ = [
    "CostModel",
    "MicroBatchPlan",
    "Plan",
    "PlannedGroup",
    "SequenceTooLongError",
    "megatron_lengths",
    "padded_tokens_per_rank",
    "plan_dynamic",
    "plan_static",
]

# ---------------------------------------------------------------------------------------------
# Dynamic planner


@dataclass(frozen=True)
class _SizeTable:
    """Per power-of-two CP size (row k: c = 2**k <= max_cp) and sequence (column): its
    per-rank share and its time alone in a group of that size (inf where the share exceeds
    the budget)."""

    sizes: np.ndarray
    shares: np.ndarray
    times: np.ndarray

    @classmethod
    def of(cls, lengths: np.ndarray, budget: int, max_cp: int, cost: CostModel) -> _SizeTable:
        sizes = [1 << k for k in range(max_cp.bit_length())]
        shares = np.stack([padded_shares(lengths, c) for c in sizes])
        times = np.stack([cost.sequence_times(lengths, c) for c in sizes])
        times[shares > budget] = np.inf
        return cls(np.array(sizes, dtype=np.int64), shares, times)

    @property
    def fits(self) -> np.ndarray:
        return np.isfinite(self.times)

    def rows_under(self, target: float) -> np.ndarray:
        """Per sequence, the row of the smallest CP size that runs it alone within `target`
        seconds, or else of its fastest size. target=inf gives the smallest size that fits."""
        ok = self.fits & (self.times <= target)
        return np.where(ok.any(axis=0), ok.argmax(axis=0), self.times.argmin(axis=0))


def _greedy_pass(table: _SizeTable, rows: np.ndarray, n_ranks: int, budget: int, cost: CostModel,
                 *, prefer_join: bool, allow_up: bool, spare: int | None) -> Packer:
    """One greedy pass with each sequence at its row's CP size (and the next size up)."""
    cols = np.arange(table.times.shape[1])
    # The next size up, where there is one and the share still fits (0 = none).
    up = np.minimum(rows + 1, len(table.sizes) - 1)
    c_hi = np.where((up > rows) & table.fits[up, cols], table.sizes[up], 0)
    c_lo, s_lo, t_lo = table.sizes[rows], table.shares[rows, cols], table.times[rows, cols]
    # No plan has fewer micro-batches than the rank-tokens needed over those available;
    # `spare` more may come free, or none with spare=None.
    m_min = -(-int((c_lo * s_lo).sum()) // (n_ranks * budget))
    # Largest CP size first (they need aligned blocks of free ranks), then costliest first.
    order = np.lexsort((cols, -t_lo, -c_lo))
    return greedy(order, (c_lo, c_hi), (s_lo, table.shares[up, cols]), (t_lo, table.times[up, cols]),
                  n_ranks, budget, cost, prefer_join=prefer_join, allow_up=allow_up,
                  m_target=0 if spare is None else m_min + spare)


# One greedy, a few ways (each a guess that wins on some batches; measured on Megatron-like
# batches, this set lands within about 1% of trying all of them). The best plan wins, the
# first among equals, so the result is deterministic.
_PASSES = (
    {"prefer_join": False, "allow_up": True, "spare": 0},
    {"prefer_join": True, "allow_up": False, "spare": 1},
    {"prefer_join": True, "allow_up": True, "spare": None},
)


def _best_packing(table: _SizeTable, n_ranks: int, budget: int, cost: CostModel) -> Packer:
    """A micro-batch lasts as long as its slowest group, so splitting the longest sequences
    over more ranks than they need can pay: walk down a ladder of per-sequence time targets
    (each sequence gets the smallest CP size that meets it), halving while it still helps."""
    cols = np.arange(table.times.shape[1])
    fastest = table.times.argmin(axis=0)
    rows = table.rows_under(math.inf)
    target = float(table.times[rows, cols].max())
    best: Packer | None = None
    while True:
        level = min((_greedy_pass(table, rows, n_ranks, budget, cost, **p) for p in _PASSES),
                    key=Packer.predicted_s)
        if best is not None and level.predicted_s() >= best.predicted_s():
            return best
        best = level
        while not np.array_equal(rows, fastest):
            target /= 2
            new_rows = table.rows_under(target)
            if not np.array_equal(new_rows, rows):
                rows = new_rows
                break
        else:
            return best


def plan_dynamic(
    lengths: Sequence[int] | np.ndarray,
    n_ranks: int,
    token_budget: int,
    cost: CostModel,
    *,
    max_cp: int | None = None,
) -> Plan:
    """Split a global batch into micro-batches and per-micro-batch CP groups, minimising the
    predicted time (sum over micro-batches of the slowest group) with no rank holding more
    than `token_budget` tokens in any micro-batch. Deterministic for a given input.
    `max_cp`: the largest CP group (default: the largest power of two <= n_ranks)."""
    arr = check_inputs(lengths, n_ranks, token_budget)
    n_ranks, token_budget = int(n_ranks), int(token_budget)
    if max_cp is None:
        max_cp = 1 << (n_ranks.bit_length() - 1)
    if not is_power_of_two(max_cp) or max_cp > n_ranks:
        raise ValueError(f"max_cp must be a power of two <= n_ranks ({n_ranks}), got {max_cp}")
    if arr.size == 0:
        return Plan((), n_ranks, token_budget)

    table = _SizeTable.of(arr, token_budget, max_cp, cost)
    fits = table.fits
    if not fits.any(axis=0).all():
        bad = int(np.flatnonzero(~fits.any(axis=0))[0])
        raise SequenceTooLongError(bad, int(arr[bad]), max_cp, token_budget)
    best = _best_packing(table, n_ranks, token_budget, cost)
    plan = build_plan(best.groups(), arr, n_ranks, token_budget, cost)
    # The uniform plan a static system would run is a plan too: never do worse than it. (It
    # wins when a batch holds sequences of many sizes with little to gain from splitting.)
    uniform_cp = int(table.sizes[fits.argmax(axis=0).max()])
    if n_ranks % uniform_cp == 0:
        uniform = plan_static(arr, n_ranks, token_budget, cost, uniform_cp)
        if uniform.predicted_s < plan.predicted_s:
            return uniform
    return plan


# ---------------------------------------------------------------------------------------------
# Static baseline


def plan_static(
    lengths: Sequence[int] | np.ndarray, n_ranks: int, token_budget: int, cost: CostModel, cp: int
) -> Plan:
    """What a static-CP system runs: every group has size `cp`, sequences packed by tokens
    alone (it has no cost model) into the fewest micro-batches the budget allows, each sequence
    on the least loaded group so the groups are balanced by tokens."""
    arr = check_inputs(lengths, n_ranks, token_budget)
    n_ranks, token_budget = int(n_ranks), int(token_budget)
    if not is_power_of_two(cp) or n_ranks % cp:
        raise ValueError(f"static cp must be a power of two dividing n_ranks ({n_ranks}), got {cp}")
    if arr.size == 0:
        return Plan((), n_ranks, token_budget)
    shares = padded_shares(arr, cp)
    if (shares > token_budget).any():
        bad = int(np.flatnonzero(shares > token_budget)[0])
        raise SequenceTooLongError(bad, int(arr[bad]), cp, token_budget)
    order = np.lexsort((np.arange(len(arr)), -shares)).tolist()
    per_mb = n_ranks // cp

    # Best-fit decreasing gives (close to) the fewest bins of `token_budget` tokens per rank.
    bins = _best_fit_decreasing([int(shares[i]) for i in order], token_budget)
    n_mbs = -(-bins // per_mb)
    # Spread over all n_mbs * per_mb groups, each sequence to the least loaded one; if that
    # cannot fit a sequence, take one more micro-batch (rare: the bin count is near optimal).
    while True:
        assignment = _least_loaded(order, shares, n_mbs * per_mb, token_budget)
        if assignment is not None:
            break
        n_mbs += 1
    groups: list[list[tuple[int, int, list[int]]]] = [
        [(cp, k * cp, []) for k in range(per_mb)] for _ in range(n_mbs)
    ]
    for i, b in zip(order, assignment, strict=True):
        groups[b // per_mb][b % per_mb][2].append(i)
    return build_plan(groups, arr, n_ranks, token_budget, cost)


def _best_fit_decreasing(sizes: list[int], capacity: int) -> int:
    """Number of bins best-fit decreasing needs for `sizes` (already sorted, largest first)."""
    room: list[int] = []  # free space of each open bin, sorted ascending
    for size in sizes:
        k = bisect.bisect_left(room, size)
        if k == len(room):
            bisect.insort(room, capacity - size)
        else:
            left = room.pop(k) - size
            bisect.insort(room, left)
    return len(room)


def _least_loaded(order: list[int], shares: np.ndarray, n_bins: int, capacity: int) -> list[int] | None:
    heap = [(0, b) for b in range(n_bins)]
    out = []
    for i in order:
        load, b = heapq.heappop(heap)
        if load + int(shares[i]) > capacity:
            return None
        out.append(b)
        heapq.heappush(heap, (load + int(shares[i]), b))
    return out


# ---------------------------------------------------------------------------------------------
# The benchmark's length distribution


def megatron_lengths(
    n: int,
    rng: np.random.Generator,
    *,
    min_len: int = 128,
    max_len: int = 8192,
    mean: float = 1024,
    sigma: float = 1.5,
) -> np.ndarray:
    """Megatron Dynamic-CP's benchmark lengths: lognormal with mean `mean` before clipping
    (E[X] = exp(mu + sigma^2 / 2) fixes mu), clipped to [min_len, max_len]."""
    mu = math.log(mean) - sigma**2 / 2
    raw = rng.lognormal(mean=mu, sigma=sigma, size=n)
    return np.clip(np.rint(raw), min_len, max_len).astype(np.int64)
