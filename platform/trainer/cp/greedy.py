"""The dynamic-CP planner's greedy pass: place each sequence where its micro-batch's slowest
group grows least (see `greedy`); `cp/planner.py` runs it a few ways and keeps the best.

Free ranks of each micro-batch are a buddy allocator over aligned power-of-two blocks, and the
open groups of each CP size sit in a heap by predicted time, so a pass over thousands of
sequences stays fast enough to plan every step in the prefetch thread.
"""

from __future__ import annotations

import heapq

import numpy as np

from longrun.trainer.cp.cost import CostModel, positive_part

Spot = tuple[float, int, int, int, int, float, int | None]  # (inc, variant, mb, cp, share, t, gid)


class FillingMicroBatch:
    """A micro-batch being filled.

    Free ranks are kept as a buddy allocator that never frees: blocks start as the binary
    decomposition of n_ranks (aligned by construction) and a request takes the smallest free
    block that is big enough, splitting it in halves. That keeps at most one free block per
    size, so a request of size c succeeds exactly when `free >= c`: no fragmentation.
    """

    __slots__ = ("blocks", "free", "heaps", "max_t")

    def __init__(self, n_ranks: int) -> None:
        self.blocks: dict[int, int] = {}  # block size -> first rank
        pos = 0
        for bit in range(n_ranks.bit_length() - 1, -1, -1):
            if n_ranks >> bit & 1:
                self.blocks[1 << bit] = pos
                pos += 1 << bit
        self.free = n_ranks
        self.max_t = 0.0
        # Per CP size, open groups keyed by (time, first_rank, group id, version); the least
        # loaded group is the first to try when a sequence joins. Stale versions are skipped.
        self.heaps: dict[int, list[tuple[float, int, int, int]]] = {}

    def allocate(self, c: int) -> int:
        size = c
        while size not in self.blocks:
            size *= 2
        first = self.blocks.pop(size)
        while size > c:  # keep the low half, free the high half
            size //= 2
            self.blocks[size] = first + size
        self.free -= c
        return first


class Packer:
    """One greedy pass over the sequences in a fixed order (see `plan_dynamic`)."""

    _LOOKAHEAD = 4  # groups popped from a heap while looking for one with room

    def __init__(self, n_ranks: int, budget: int, cost: CostModel, prefer_join: bool, thresholds: dict):
        self.n_ranks, self.budget, self.cost = n_ranks, budget, cost
        self.prefer_join = prefer_join
        self.thresholds = thresholds  # cp -> smallest per-rank share any remaining sequence can have
        self.mbs: list[FillingMicroBatch] = []
        # Group store, indexed by group id.
        self.g_cp: list[int] = []
        self.g_first: list[int] = []
        self.g_mb: list[int] = []
        self.g_n: list[int] = []
        self.g_q: list[int] = []
        self.g_ver: list[int] = []
        self.g_seqs: list[list[int]] = []
        # Micro-batches still worth scanning per CP size; rebuilt lazily, pruned while scanning.
        self.live: dict[int, list[int]] = {}
        self.seen: dict[int, int] = {}

    def candidate(self, j: int, c: int, s: int, t_alone: float) -> tuple[float, float, int | None] | bool:
        """Best spot for a sequence of per-rank share `s` in a size-c group of micro-batch j:
        (increase of the micro-batch's max time, new group time, group id or None for a new
        group). False when nothing fits now; True when nothing of size c ever will again."""
        mb = self.mbs[j]
        heap = mb.heaps.get(c)
        gid = None
        if heap:
            g_n, g_ver = self.g_n, self.g_ver
            # Drop stale entries, and groups no remaining sequence fits into, for good.
            limit = self.budget - self.thresholds[c]
            while heap and (heap[0][3] != g_ver[heap[0][2]] or g_n[heap[0][2]] > limit):
                heapq.heappop(heap)
            if heap:
                gid = heap[0][2] if g_n[heap[0][2]] + s <= self.budget else self._look_further(heap, s)
        can_open = mb.free >= c
        if gid is None:
            if can_open:
                return positive_part(t_alone - mb.max_t), t_alone, None
            return not heap
        t = self.cost.time_from_sums(c, self.g_n[gid] + s, self.g_q[gid] + s * s)
        inc = positive_part(t - mb.max_t)
        if can_open:
            inc_open = positive_part(t_alone - mb.max_t)
            if inc_open < inc or (inc_open == inc and not self.prefer_join):
                return inc_open, t_alone, None
        return inc, t, gid

    def _look_further(self, heap: list, s: int) -> int | None:
        """The least loaded group lacks room: try the next few, then give up (a heuristic)."""
        g_n, g_ver, budget = self.g_n, self.g_ver, self.budget
        popped, found = [], None
        while heap and len(popped) < self._LOOKAHEAD:
            entry = heapq.heappop(heap)
            popped.append(entry)
            if entry[3] == g_ver[entry[2]] and g_n[entry[2]] + s <= budget:
                found = entry[2]
                break
        for entry in popped:
            heapq.heappush(heap, entry)
        return found

    def best_spot(self, v: int, c: int, s: int, t_alone: float, best: Spot | None) -> Spot | None:
        """`best`, or a better spot for variant `v` (CP size c, share s) in the micro-batches
        still open to size c; stops at the first spot that costs nothing."""
        ids = self.live.setdefault(c, [])
        # Micro-batches opened since this list was last refreshed join at the end.
        ids.extend(range(self.seen.get(c, 0), len(self.mbs)))
        self.seen[c] = len(self.mbs)
        keep = []
        for pos, j in enumerate(ids):
            cand = self.candidate(j, c, s, t_alone)
            if cand is True:
                continue  # full for this CP size, for good
            keep.append(j)
            if cand is False:
                continue
            inc, t, gid = cand
            if best is None or (inc, v) < (best[0], best[1]):
                best = (inc, v, j, c, s, t, gid)
            if inc == 0.0:
                keep.extend(ids[pos + 1 :])
                break
        self.live[c] = keep
        return best

    def place(self, index: int, j: int, c: int, s: int, t: float, gid: int | None) -> None:
        if j == len(self.mbs):
            self.mbs.append(FillingMicroBatch(self.n_ranks))
        mb = self.mbs[j]
        if gid is None:
            gid = len(self.g_cp)
            self.g_cp.append(c)
            self.g_first.append(mb.allocate(c))
            self.g_mb.append(j)
            self.g_n.append(0)
            self.g_q.append(0)
            self.g_ver.append(0)
            self.g_seqs.append([])
        self.g_n[gid] += s
        self.g_q[gid] += s * s
        self.g_ver[gid] += 1
        self.g_seqs[gid].append(index)
        heapq.heappush(mb.heaps.setdefault(c, []), (t, self.g_first[gid], gid, self.g_ver[gid]))
        mb.max_t = max(mb.max_t, t)

    def predicted_s(self) -> float:
        return sum(mb.max_t for mb in self.mbs)

    def groups(self) -> list[list[tuple[int, int, list[int]]]]:
        out: list[list[tuple[int, int, list[int]]]] = [[] for _ in self.mbs]
        for gid, j in enumerate(self.g_mb):
            out[j].append((self.g_cp[gid], self.g_first[gid], self.g_seqs[gid]))
        return out


def _thresholds(cps: tuple[np.ndarray, np.ndarray], shares: tuple[np.ndarray, np.ndarray],
                budget: int, allow_up: bool) -> dict[int, int]:
    """CP size -> the smallest per-rank share any sequence can have in a group of that size."""
    thresholds: dict[int, int] = {}
    pairs = zip(cps, shares, strict=True) if allow_up else ((cps[0], shares[0]),)
    for c_arr, s_arr in pairs:
        for c in np.unique(c_arr[c_arr > 0]).tolist():
            thresholds[c] = min(thresholds.get(c, budget), int(s_arr[c_arr == c].min()))
    return thresholds


def greedy(
    order: np.ndarray,
    cps: tuple[np.ndarray, np.ndarray],
    shares: tuple[np.ndarray, np.ndarray],
    alone: tuple[np.ndarray, np.ndarray],
    n_ranks: int,
    budget: int,
    cost: CostModel,
    *,
    prefer_join: bool,
    allow_up: bool,
    m_target: int,
) -> Packer:
    """Place each sequence, in `order`, where its micro-batch's max time grows least.

    Candidates in each micro-batch: join the least loaded group of the sequence's CP size that
    has room, or open a group on free ranks; with `allow_up`, also the next CP size, tried only
    when the smallest size would raise a micro-batch's max (splitting then shortens the
    critical path). Ties go to the earliest micro-batch, which packs the costliest sequences
    together: the sum of per-micro-batch maxima is lowest when similar work shares a
    micro-batch. A new micro-batch costs its first sequence's time, except that the first
    `m_target` ones come free (when the budget forces that many, their max is paid anyway).
    """
    (c_lo, c_hi), (s_lo, s_hi), (t_lo, t_hi) = cps, shares, alone
    packer = Packer(n_ranks, budget, cost, prefer_join, _thresholds(cps, shares, budget, allow_up))
    for i in order.tolist():
        variants = [(int(c_lo[i]), int(s_lo[i]), float(t_lo[i]))]
        if allow_up and c_hi[i] > 0:
            variants.append((int(c_hi[i]), int(s_hi[i]), float(t_hi[i])))
        best: Spot | None = None
        for v, (c, s, t_alone) in enumerate(variants):
            if best is not None and best[0] == 0.0:
                break  # the smallest CP size fits without cost: never split further
            best = packer.best_spot(v, c, s, t_alone, best)
        new_cost = 0.0 if len(packer.mbs) < m_target else variants[0][2]
        if best is None or best[0] > new_cost:
            c, s, t_alone = variants[0]
            best = (t_alone, 0, len(packer.mbs), c, s, t_alone, None)
        _, _, j, c, s, t, gid = best
        packer.place(i, j, c, s, t, gid)
    return packer
