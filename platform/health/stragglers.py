"""Stragglers found and explained: what slow ranks cost the job, and why they are slow.

    report = attribute(step_times, nodes, stages, work_costs, factor=1.5)
    report.slowdown          # 0.23: the job runs 23% slower than with every rank at the median
    report.slow              # (SlowRank(rank=24, node="n3", blame="node", ratio=1.6, ...), ...)
    report.sentence()        # one line for `longrun status` and the event log

Synchronous training runs at the pace of its slowest rank, so a job's step time is the slowest
rank's, and the what-if "every rank at the median" is what it could run at: `slowdown` is the
difference, reported for every job whether or not any rank crosses the straggler line. ByteDance's
study of its fleet (OSDI'25) found 42.5% of jobs slowed by at least 10%, mostly by uneven pipeline
stages and uneven sequence lengths rather than bad hardware; only bad hardware is worth evicting
a node for, so each slow rank is given one cause. A rank is slow when its time is above
`factor` x the median, or when its pipeline stage's median is above `factor` x the median of the
other stages' and its own time above that line too (with two stages, half the ranks are one
stage and the job's median sits between them: no baseline for either).

- **stage**: its pipeline stage is slow as a whole: the stage's median step time, over the
  median of the other stages' medians, accounts for at least `EXPLAINS` (3/4) of the rank's excess
  over those other stages. A slow stage is a property of the split (layers per stage, the
  embedding or LM head on an end stage), and another node would run it as slowly. A stage that
  sits on one node only is that node slow, unless the stage's work cost is as far above the other
  stages' as its time (a heavier split): otherwise a bad node in a small pipeline job could never
  be named.
- **data**: its work cost (the trainer's cost model: the dynamic-CP planner's predicted seconds,
  else its documents' attention-aware FLOPs; `Heartbeat.work_cost`) over the median cost of its
  peers (its pipeline stage's ranks, which hold the same share of the layers; all ranks without
  stages) accounts for at least 3/4 of its time excess. Its micro-batches are expensive (long
  documents: attention is quadratic), and another node would train them as slowly.
- **node**: more than half of its node's ranks (and at least two) are slow with neither
  explanation: ranks sharing a host slow together is the host (thermal throttling, a slow NIC or
  PCIe switch, a noisy neighbour), the one case where eviction helps.
- **rank**: slow alone with normal data on a node whose other ranks are fine: a suspect GPU or
  process (rank 0's extra duties look like this too). A node of one rank gives no "together"
  evidence, so its slow rank is blamed here as well.

"Accounts for 3/4 of the excess" rather than "is as large": step time is affine in the work
(fixed per-step costs do not grow with the data), so a data-caused slowdown shows a cost excess
at least as large as its time excess, while a cost only slightly above the median next to a much
slower step explains little of it. Stage is judged before data (an uneven split raises every rank
of the stage, whatever its data), data before node (eight slow ranks of a node with expensive
data are still the data's), and a node needs most of its ranks so that one unlucky rank's data or
a lone bad GPU do not get a healthy node evicted.

The input is per-rank step times the caller made robust (the median of each rank's last few
steps; NaN where unknown). Under synchronous collectives the time to use is a rank's own
busy time, not its wall step time, which includes waiting for the slowest peer. Pure: no I/O,
no clock; vectorised (numpy), a few milliseconds at 16,384 ranks.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

__all__ = ["BLAMES", "EXPLAINS", "MIN_RANKS", "NodeIndex", "SlowRank", "StragglerReport", "attribute"]

BLAMES = ("node", "data", "stage", "rank")  # most actionable first; the metric's label values
EXPLAINS = 0.75  # share of a rank's time excess its stage or data must account for
MIN_RANKS = 3  # with fewer known times the median is no baseline (as the monitor's straggler rule)
MAX_CLAUSES = 4  # findings named in the sentence; the rest are counted
MAX_RANGES = 6  # rank ranges listed in a clause


class SlowRank(NamedTuple):
    """One slow rank and its cause. Immutable like a frozen dataclass, and built ~4x faster: a
    whole slow pipeline stage at 16,384 ranks is 4,096 of them per poll."""

    rank: int
    node: str | None
    stage: int | None
    blame: str  # "node" | "data" | "stage" | "rank"
    ratio: float  # its step time / the median
    detail: str  # one sentence naming the evidence
    cost_ratio: float | None = None  # its work cost / its peers' median cost (None: unknown)


@dataclass(frozen=True)
class StragglerReport:
    step_time_s: float  # the job's step time as run: the slowest rank's (synchronous training)
    median_s: float  # the what-if: every rank at the median
    slowdown: float  # step_time_s / median_s - 1 (0.12 = 12% slower than it could run)
    slow: tuple[SlowRank, ...]  # by rank
    factor: float = 0.0  # the straggler factor it was judged with
    ranks: int = 0  # ranks whose step time was known
    stages: tuple[tuple[int, float], ...] = ()  # slow stages: (stage, its time over the other stages')

    def by_blame(self) -> dict[str, int]:
        """Slow ranks per cause, every cause present (0 where none)."""
        counts = dict.fromkeys(BLAMES, 0)
        for s in self.slow:
            counts[s.blame] += 1
        return counts

    def sentence(self, names: Mapping[str, str] | None = None) -> str:
        """One line for status and events, e.g. "runs 23% slower than with every rank at the median
        (1.23 s vs 1.00 s): node n3 (ranks 24-31) slow together 1.60x; rank 7's data costs 1.30x".
        `names`: node id -> the name a person reads ("host (address)"), where known."""
        if self.ranks == 0:
            return "no step times reported yet"
        head = (f"runs {self.slowdown:.0%} slower than with every rank at the median "
                f"({_seconds(self.step_time_s)} vs {_seconds(self.median_s)})")
        clauses = self._clauses(names or {})
        if not clauses:
            limit = f"{self.factor:g}x " if self.factor else ""
            return f"{head}; no rank is slower than {limit}the median"
        if len(clauses) > MAX_CLAUSES:
            clauses = [*clauses[:MAX_CLAUSES], f"and {len(clauses) - MAX_CLAUSES} more"]
        return f"{head}: {'; '.join(clauses)}"

    def _clauses(self, names: Mapping[str, str]) -> list[str]:
        groups: dict[tuple[str, object], list[SlowRank]] = {}
        for s in self.slow:
            key = s.node if s.blame == "node" else s.stage if s.blame == "stage" else None
            groups.setdefault((s.blame, key), []).append(s)
        nodes = sorted((g for (blame, _), g in groups.items() if blame == "node"),
                       key=lambda g: (-_median([s.ratio for s in g]), g[0].rank))
        clauses = [f"node {names.get(g[0].node, g[0].node)} (ranks {_ranges([s.rank for s in g])}) slow "
                   f"together {_median([s.ratio for s in g]):.2f}x" for g in nodes]
        for stage, ratio in sorted(self.stages, key=lambda x: -x[1]):
            members = groups.get(("stage", stage), [])
            where = f" (ranks {_ranges([s.rank for s in members])})" if members else ""
            clauses.append(f"pipeline stage {stage}{where} {ratio:.2f}x the other stages")
        data = groups.get(("data", None), [])
        if len(data) == 1:
            s = data[0]
            clauses.append(f"rank {s.rank}'s data costs {s.cost_ratio:.2f}x the median "
                           f"(it runs {s.ratio:.2f}x)")
        elif data:
            costs = [s.cost_ratio for s in data if s.cost_ratio is not None]
            clauses.append(f"{len(data)} ranks' data costs up to {max(costs):.2f}x the median "
                           f"(ranks {_ranges([s.rank for s in data])})")
        alone = groups.get(("rank", None), [])
        if len(alone) == 1:
            s = alone[0]
            where = f" on node {names.get(s.node, s.node)}" if s.node else ""
            clauses.append(f"rank {s.rank}{where} slow alone {s.ratio:.2f}x with normal data")
        elif alone:
            clauses.append(f"{len(alone)} ranks slow alone with normal data, up to "
                           f"{max(s.ratio for s in alone):.2f}x (ranks {_ranges([s.rank for s in alone])})")
        return clauses


@dataclass(frozen=True, eq=False)
class NodeIndex:
    """Each rank's node as an integer code (-1: unknown) and the codes' names. Build it once per
    attempt (`NodeIndex.of(nodes)`) and pass it to `attribute` in place of the names."""

    codes: np.ndarray  # int64 per rank
    names: tuple[str, ...]

    @classmethod
    def of(cls, nodes: Sequence[str | None]) -> NodeIndex:
        # A dict, not np.unique: sorting 16,384 56-character Ray node ids costs ~9 ms, this ~1.5 ms.
        seen: dict[str, int] = {}
        codes = np.fromiter((-1 if n is None else seen.setdefault(n, len(seen)) for n in nodes),
                            dtype=np.int64, count=len(nodes))
        return cls(codes, tuple(seen))


def attribute(step_times: np.ndarray, nodes: Sequence[str | None] | NodeIndex, stages: np.ndarray | None,
              work_costs: np.ndarray | None, factor: float) -> StragglerReport:
    """The what-if slowdown of one poll and the cause of each slow rank (see the module docstring).

    `step_times[r]`: rank r's robust recent step time (NaN: unknown); `nodes[r]`: its node (None:
    unknown), or a `NodeIndex` built once per attempt; `stages[r]`: its pipeline stage (-1: none);
    `work_costs[r]`: its data's cost in the trainer's cost-model units (NaN: unknown); `factor`:
    health.straggler_factor.
    """
    if not factor > 1.0:
        raise ValueError(f"factor must be > 1, got {factor!r}")
    t = np.asarray(step_times, dtype=np.float64)
    n = t.shape[0]
    node_column = nodes.codes if isinstance(nodes, NodeIndex) else nodes
    for name, column in (("nodes", node_column), ("stages", stages), ("work_costs", work_costs)):
        if column is not None and len(column) != n:
            raise ValueError(f"{name} has {len(column)} entries for {n} step times")
    known = np.isfinite(t) & (t > 0)
    k = int(np.count_nonzero(known))
    if k == 0:
        return StragglerReport(0.0, 0.0, 0.0, (), factor, 0)
    tk = t[known]
    median, worst = float(np.median(tk)), float(tk.max())
    slowdown = worst / median - 1.0
    if k < MIN_RANKS:
        return StragglerReport(worst, median, slowdown, (), factor, k)
    w = None if work_costs is None else np.asarray(work_costs, dtype=np.float64)
    st = _Stages.of(t, known, stages, w, factor)
    slow = known & (t > factor * median)
    if st is not None:
        slow |= st.slow
    if not slow.any():
        return StragglerReport(worst, median, slowdown, (), factor, k)

    index = nodes if isinstance(nodes, NodeIndex) else NodeIndex.of(nodes)
    ids = np.flatnonzero(slow)
    ts = t[ids]
    # A rank's excess over what it should take: the other stages' pace in a pipeline, else the median.
    base = st.others_of_rank[ids] if st is not None else median
    excess = ts / base - 1.0
    blame = np.full(len(ids), "", dtype="<U5")
    if st is not None:
        blame[st.explains(ids, excess, index.codes, known)] = "stage"
    cost = _peer_cost_ratios(w, st)
    cr = cost[ids] if cost is not None else np.full(len(ids), np.nan)
    blame[(blame == "") & (cr - 1.0 >= EXPLAINS * excess)] = "data"
    node_detail, per_node = _blame_nodes(ids, ts, cr, blame, index, known, median)
    blame[blame == ""] = "rank"

    out = []
    stage_of = ([None] * len(ids) if stages is None
                else [x if x >= 0 else None for x in np.asarray(stages)[ids].tolist()])
    for r, b, code, ratio, c, s in zip(ids.tolist(), blame.tolist(), index.codes[ids].tolist(),
                                       (ts / median).tolist(), cr.tolist(), stage_of, strict=True):
        c = c if c == c else None  # NaN: unknown
        node = index.names[code] if code >= 0 else None
        if b == "node":
            detail = node_detail[code]
        elif b == "stage":
            detail = st.details[s]
        elif b == "data":
            detail = (f"rank {r}'s data costs {c:.2f}x its peers' median and it runs {ratio:.2f}x the "
                      "median step time")
        else:
            detail = _alone(r, ratio, c, node, int(per_node[code]) - 1 if code >= 0 else 0)
        out.append(SlowRank(r, node, s, b, ratio, detail, c))
    stages_out = tuple(sorted(st.named.items())) if st is not None else ()
    return StragglerReport(worst, median, slowdown, tuple(out), factor, k, stages_out)


def _blame_nodes(ids: np.ndarray, ts: np.ndarray, cr: np.ndarray, blame: np.ndarray, index: NodeIndex,
                 known: np.ndarray, median: float) -> tuple[dict[int, str], np.ndarray]:
    """Blame "node" (in place) where most of a node's known ranks, and at least two, are slow
    with neither explanation; the evidence per blamed node, and known ranks per node."""
    codes, groups = index.codes, max(len(index.names), 1)
    known_codes = codes[known]
    per_node = np.bincount(known_codes[known_codes >= 0], minlength=groups)
    rc = codes[ids]
    open_ = (blame == "") & (rc >= 0)
    if not open_.any():
        return {}, per_node
    slow_per_node = np.bincount(rc[open_], minlength=groups)
    together = (slow_per_node >= 2) & (2 * slow_per_node > per_node)
    on_node = open_ & together[np.where(rc >= 0, rc, 0)]
    blame[on_node] = "node"
    details = {}
    for code in np.flatnonzero(together).tolist():
        members = on_node & (rc == code)
        costs = cr[members]
        data = (f", their data {float(np.nanmedian(costs)):.2f}x their peers' median cost"
                if np.isfinite(costs).any() else "")
        details[code] = (f"node {index.names[code]}: {int(slow_per_node[code])} of its {int(per_node[code])} "
                         f"ranks (ranks {_ranges(ids[members].tolist())}) slow together, "
                         f"{float(np.median(ts[members])) / median:.2f}x the median step time{data}")
    return details, per_node


def _alone(rank: int, ratio: float, cost: float | None, node: str | None, others: int) -> str:
    data = f"its data costs {cost:.2f}x its peers' median" if cost is not None else "its data cost is unknown"
    where = (f"the {others} other rank(s) on node {node} are not slow with it" if others > 0
             else f"it is alone on node {node}" if node else "its node is unknown")
    return (f"rank {rank} runs {ratio:.2f}x the median step time on its own: {data} and {where} "
            "(a suspect GPU or process)")


def _peer_cost_ratios(w: np.ndarray | None, st: _Stages | None) -> np.ndarray | None:
    """Each rank's work cost over the median of its peers' (its stage's ranks, which hold the same
    share of the layers; every rank without stages); NaN where unknown."""
    if w is None:
        return None
    ok = np.isfinite(w) & (w > 0)
    if np.count_nonzero(ok) < MIN_RANKS:
        return None
    overall = float(np.median(w[ok]))
    out = np.full(len(w), np.nan)
    if st is None or st.cost_medians is None:
        out[ok] = w[ok] / overall
        return out
    medians = np.where(np.isfinite(st.cost_medians), st.cost_medians, overall)
    peer = np.where(st.group >= 0, medians[np.maximum(st.group, 0)], overall)
    out[ok] = w[ok] / peer[ok]
    return out


# ---- pipeline stages ------------------------------------------------------------------------------


@dataclass
class _Stages:
    """The stages' step-time medians, and what they say about each rank."""

    ids: np.ndarray  # the stage numbers present (among ranks with a known time), sorted
    ratio: np.ndarray  # per stage: its median time over the median of the other stages' medians
    cost_ratio: np.ndarray | None  # per stage: the same of work costs (None: not known for every stage)
    cost_medians: np.ndarray | None  # per stage: the median work cost (NaN: none known)
    group: np.ndarray  # per rank: index into ids (-1: no stage, or a stage no known time has)
    others_of_rank: np.ndarray  # per rank: the other stages' median time (the job's median where no stage)
    slow: np.ndarray  # per rank: in a stage > factor x the others, and itself above that line
    details: dict[int, str]  # stage -> the evidence, for the stages blamed
    named: dict[int, float]  # stage -> ratio, for the stages blamed

    @classmethod
    def of(cls, t: np.ndarray, known: np.ndarray, stages: np.ndarray | None, w: np.ndarray | None,
           factor: float) -> _Stages | None:
        if stages is None:
            return None
        s = np.asarray(stages, dtype=np.int64)
        staged = known & (s >= 0)
        ids = np.unique(s[staged])
        if len(ids) < 2:
            return None
        pos = np.searchsorted(ids, s)
        group = np.where((s >= 0) & (pos < len(ids)) & (ids[np.minimum(pos, len(ids) - 1)] == s), pos, -1)
        meds = _medians_by(group, t, known, fill=np.nan)
        others = _others(meds)
        ratio = meds / others
        cost_ratio = cost_meds = None
        if w is not None:
            cost_meds = _medians_by(group, w, np.isfinite(w) & (w > 0), fill=np.nan)
            if np.isfinite(cost_meds).all():
                cost_ratio = cost_meds / _others(cost_meds)
        in_stage = group >= 0
        g = np.maximum(group, 0)
        others_of_rank = np.where(in_stage, others[g], float(np.median(t[known])))
        slow = known & in_stage & (ratio[g] > factor) & (t > factor * others_of_rank)
        return cls(ids, ratio, cost_ratio, cost_meds, group, others_of_rank, slow, {}, {})

    def explains(self, ids: np.ndarray, excess: np.ndarray, codes: np.ndarray,
                 known: np.ndarray) -> np.ndarray:
        """Which of the slow ranks `ids` (with their time `excess` over the other stages) their
        stage explains; the evidence of each stage blamed goes into `details`."""
        j = self.group[ids]
        r = np.where(j >= 0, self.ratio[np.maximum(j, 0)], 1.0)
        candidate = (j >= 0) & (r > 1.0) & (r - 1.0 >= EXPLAINS * excess)
        for stage_j in np.unique(j[candidate]).tolist():
            members = (self.group == stage_j) & known
            on = np.unique(codes[members])
            spread = int(np.count_nonzero(on >= 0))
            ratio = float(self.ratio[stage_j])
            cost = float(self.cost_ratio[stage_j]) if self.cost_ratio is not None else math.nan
            if spread == 1 and not cost - 1.0 >= EXPLAINS * (ratio - 1.0):
                # One node holds the stage: its pace is the node's, unless the split gives it more
                # work. (Nodes unknown: nothing speaks for a node.)
                candidate &= j != stage_j
                continue
            stage = int(self.ids[stage_j])
            work = f", its work cost {cost:.2f}x theirs" if cost == cost else ""
            self.details[stage] = (f"pipeline stage {stage} runs {ratio:.2f}x the median step time of the "
                                   f"other stages ({int(members.sum())} ranks on {spread} node(s){work}): "
                                   "an uneven split, not a node")
            self.named[stage] = ratio
        return candidate


def _others(medians: np.ndarray) -> np.ndarray:
    """Per group: the median of the other groups' medians."""
    return np.array([np.median(np.delete(medians, j)) for j in range(len(medians))])


def _medians_by(group: np.ndarray, values: np.ndarray, ok: np.ndarray, fill: float) -> np.ndarray:
    """The median of `values[ok]` per group (`group`: -1 for none; few groups: pipeline stages);
    `fill` for a group with none. One stable sort of the group numbers, a partition per group."""
    groups = int(group.max()) + 1 if len(group) else 0
    out = np.full(max(groups, 0), fill, dtype=np.float64)
    use = np.flatnonzero(ok & (group >= 0))
    if not len(use):
        return out
    g = group[use]
    order = np.argsort(g, kind="stable")
    v = values[use][order]
    bounds = np.concatenate(([0], np.cumsum(np.bincount(g, minlength=groups))))
    for j in range(groups):
        if bounds[j + 1] > bounds[j]:
            out[j] = np.median(v[bounds[j]:bounds[j + 1]])
    return out


# ---- words ----------------------------------------------------------------------------------------


def _ranges(ranks: Sequence[int]) -> str:
    """"3, 7, 24-31" (sorted; at most MAX_RANGES pieces, then ", ...")."""
    pieces: list[str] = []
    rs = sorted(ranks)
    i = 0
    while i < len(rs):
        if len(pieces) == MAX_RANGES:
            return ", ".join(pieces) + ", ..."
        j = i
        while j + 1 < len(rs) and rs[j + 1] == rs[j] + 1:
            j += 1
        pieces.append(str(rs[i]) if i == j else f"{rs[i]}-{rs[j]}")
        i = j + 1
    return ", ".join(pieces)


def _median(values: Sequence[float]) -> float:
    return float(np.median(values))


def _seconds(s: float) -> str:
    return f"{s:.2f} s" if s >= 0.1 else f"{s * 1000:.1f} ms"
