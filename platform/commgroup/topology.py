"""Rank layout: which rank runs where, and the rank lists of every parallel group.

Ranks are numbered with tensor parallelism fastest, then context, then pipeline, and data
parallelism outermost (Meta's order for Llama 3): TP needs the most bandwidth and stays
inside a node; DP needs the least and spans racks. Nodes are ordered by (zone, rack, name)
before ranks are dealt out, so one model replica occupies neighbouring nodes.

    rank = ((dp_i * pp + pp_i) * cp + cp_i) * tp + tp_i

Pure functions over plain data; `commgroup.init` turns the rank lists into process groups.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from itertools import product

GROUP_KINDS = ("tp", "cp", "pp", "dp", "dp_cp")


@dataclass(frozen=True)
class NodeSpec:
    name: str
    rack: str = ""
    zone: str = ""


@dataclass(frozen=True)
class ParallelDims:
    dp: int = 1
    cp: int = 1
    tp: int = 1
    pp: int = 1

    def __post_init__(self):
        for name in ("dp", "cp", "tp", "pp"):
            if getattr(self, name) < 1:
                raise ValueError(f"parallel size {name} must be >= 1, got {getattr(self, name)}")

    @property
    def world_size(self) -> int:
        return self.dp * self.cp * self.tp * self.pp


@dataclass(frozen=True)
class RankCoords:
    dp: int
    pp: int
    cp: int
    tp: int


@dataclass(frozen=True)
class Layout:
    dims: ParallelDims
    nodes: tuple[NodeSpec, ...]  # in placement order
    workers_per_node: int

    @property
    def world_size(self) -> int:
        return self.dims.world_size

    def node_of(self, rank: int) -> NodeSpec:
        return self.nodes[rank // self.workers_per_node]

    def local_rank(self, rank: int) -> int:
        return rank % self.workers_per_node

    def coords(self, rank: int) -> RankCoords:
        d = self.dims
        rank, tp = divmod(rank, d.tp)
        rank, cp = divmod(rank, d.cp)
        dp, pp = divmod(rank, d.pp)
        return RankCoords(dp=dp, pp=pp, cp=cp, tp=tp)

    def rank_of(self, c: RankCoords) -> int:
        d = self.dims
        return ((c.dp * d.pp + c.pp) * d.cp + c.cp) * d.tp + c.tp

    @cached_property
    def groups(self) -> dict[str, list[list[int]]]:
        """Rank lists of every group of each kind; each rank is in exactly one per kind."""
        d = self.dims
        varying = {"tp": ("tp",), "cp": ("cp",), "pp": ("pp",), "dp": ("dp",), "dp_cp": ("dp", "cp")}
        sizes = {"dp": d.dp, "pp": d.pp, "cp": d.cp, "tp": d.tp}
        out: dict[str, list[list[int]]] = {}
        for kind, inner in varying.items():
            fixed = [a for a in ("dp", "pp", "cp", "tp") if a not in inner]
            groups = []
            for outer in product(*(range(sizes[a]) for a in fixed)):
                base = dict(zip(fixed, outer, strict=True))
                members = []
                for pos in product(*(range(sizes[a]) for a in inner)):
                    members.append(self.rank_of(RankCoords(**base, **dict(zip(inner, pos, strict=True)))))
                groups.append(members)
            out[kind] = groups
        return out

    @cached_property
    def dynamic_cp_groups(self) -> dict[int, list[list[int]]]:
        """For dynamic context parallelism: the dp x cp ranks of each (pp, tp) position split
        into contiguous CP sub-groups of every power-of-two size that divides dp x cp.
        Contiguous in (dp, cp) order, so groups no larger than cp stay inside one replica."""
        span = self.dims.dp * self.dims.cp
        out: dict[int, list[list[int]]] = {}
        size = 1
        while size <= span:
            if span % size == 0:
                out[size] = [g[i:i + size] for g in self.groups["dp_cp"] for i in range(0, span, size)]
            size *= 2
        return out

    @cached_property
    def _membership(self) -> dict[str, list[int]]:
        """kind (or "dcp<size>") -> for each rank, the index of its group of that kind."""
        index: dict[str, list[int]] = {}
        named = [(kind, self.groups[kind]) for kind in GROUP_KINDS]
        named += [(f"dcp{size}", groups) for size, groups in self.dynamic_cp_groups.items()]
        for name, groups in named:
            where = [0] * self.world_size
            for i, group in enumerate(groups):
                for r in group:
                    where[r] = i
            index[name] = where
        return index

    def _check_rank(self, rank: int) -> None:
        if not 0 <= rank < self.world_size:
            raise KeyError(f"rank {rank} is not in the world of {self.world_size}")

    def group_of(self, kind: str, rank: int) -> list[int]:
        self._check_rank(rank)
        return self.groups[kind][self._membership[kind][rank]]

    def dynamic_cp_group_of(self, size: int, rank: int) -> list[int]:
        self._check_rank(rank)
        if size not in self.dynamic_cp_groups:
            raise KeyError(f"no dynamic-CP groups of size {size}; sizes: {sorted(self.dynamic_cp_groups)}")
        return self.dynamic_cp_groups[size][self._membership[f"dcp{size}"][rank]]

    def tp_crosses_nodes(self) -> bool:
        return any(len({self.node_of(r) for r in g}) > 1 for g in self.groups["tp"])


def make_layout(nodes: list[NodeSpec], workers_per_node: int, dims: ParallelDims) -> Layout:
    if workers_per_node < 1:
        raise ValueError(f"workers_per_node must be >= 1, got {workers_per_node}")
    if len({n.name for n in nodes}) != len(nodes):
        raise ValueError("node names must be unique")
    capacity = len(nodes) * workers_per_node
    if capacity != dims.world_size:
        raise ValueError(
            f"{len(nodes)} nodes x {workers_per_node} workers = {capacity} slots, but dp x cp x tp x pp "
            f"= {dims.world_size} ranks; the two must match"
        )
    ordered = tuple(sorted(nodes, key=lambda n: (n.zone, n.rack, n.name)))
    return Layout(dims=dims, nodes=ordered, workers_per_node=workers_per_node)
