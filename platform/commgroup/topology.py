"""Rank layout: which rank runs where, and the rank lists of every parallel group.

Ranks are numbered with tensor parallelism fastest, then context, then pipeline, then FSDP
sharding, and data-parallel replicas outermost (Meta's order for Llama 3): TP needs the most
bandwidth and stays inside a node; DP needs the least and spans racks. Nodes are ordered by
(zone, rack, name) before ranks are dealt out, so one model replica occupies neighbouring nodes.

    rank = (((dp_i * fsdp + fsdp_i) * pp + pp_i) * cp + cp_i) * tp + tp_i

Besides one group per axis there is the span (`dp_cp`: dp x fsdp x cp, the ranks that reduce
gradients together), the ranks holding the same shard of the weights (`replicate`: dp x cp,
the outer dimension of the HSDP mesh; the span itself when nothing is sharded), dynamic CP's
aligned power-of-two sub-groups of the span (`dcp<size>`), and for USP attention each CP
group's Ulysses sub-groups (`uly<size>`: consecutive ranks) and the rings across them
(`ring<size>`). Every name's groups partition the world.

Pure functions over plain data; `commgroup.groups` turns the rank lists into process groups.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from itertools import product

from longrun.parallel.dims import AXES as _AXES
from longrun.parallel.dims import ParallelDims, RankCoords, coords_of, leads_its_stage

__all__ = ["GROUP_KINDS", "NodeSpec", "RankCoords", "RankLayout", "coords_of", "leads_its_stage",
           "make_layout", "single_node_layout"]

GROUP_KINDS = ("tp", "cp", "pp", "fsdp", "replicate", "dp", "dp_cp")
_VARYING = {"tp": ("tp",), "cp": ("cp",), "pp": ("pp",), "fsdp": ("fsdp",), "dp": ("dp",),
            "replicate": ("dp", "cp"), "dp_cp": ("dp", "fsdp", "cp")}


@dataclass(frozen=True)
class NodeSpec:
    name: str
    rack: str = ""
    zone: str = ""


@dataclass(frozen=True)
class RankLayout:
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
        return coords_of(self.dims, rank)

    def rank_of(self, c: RankCoords) -> int:
        rank = 0
        for axis in _AXES:
            rank = rank * getattr(self.dims, axis) + getattr(c, axis)
        return rank

    @cached_property
    def groups(self) -> dict[str, list[list[int]]]:
        """Rank lists of every group of each kind; each rank is in exactly one per kind."""
        sizes = {axis: getattr(self.dims, axis) for axis in _AXES}
        out: dict[str, list[list[int]]] = {}
        for kind, inner in _VARYING.items():
            fixed = [a for a in _AXES if a not in inner]
            groups = []
            for outer in product(*(range(sizes[a]) for a in fixed)):
                base = dict(zip(fixed, outer, strict=True))
                groups.append([self.rank_of(RankCoords(**base, **dict(zip(inner, pos, strict=True))))
                               for pos in product(*(range(sizes[a]) for a in inner))])
            out[kind] = groups
        return out

    @cached_property
    def dynamic_cp_groups(self) -> dict[int, list[list[int]]]:
        """For dynamic context parallelism: each span (`dp_cp` group) split into contiguous CP
        sub-groups of every power-of-two size that divides it. Contiguous in (dp, fsdp, cp)
        order, so groups no larger than cp stay inside one replica (and the size-cp ones are
        the `cp` groups). Laid out for every job, so static and dynamic runs form alike."""
        span = self.dims.span
        return {size: [g[i:i + size] for g in self.groups["dp_cp"] for i in range(0, span, size)]
                for size in self.dims.dynamic_cp_sizes}

    def cp_groups(self, size: int) -> list[list[int]]:
        """The CP groups of `size` ranks a run attends over: static CP's `cp` groups or
        dynamic CP's aligned sub-groups of the span."""
        if size == self.dims.cp:
            return self.groups["cp"]
        if size not in self.dynamic_cp_groups:
            raise KeyError(f"no CP groups of size {size}; sizes: {list(self.dims.cp_sizes)}")
        return self.dynamic_cp_groups[size]

    @cached_property
    def attention_groups(self) -> dict[str, list[list[int]]]:
        """USP's sub-groups of each CP size the run uses: `uly<size>`, the u consecutive ranks
        that exchange heads by all-to-all, and `ring<size>`, the ranks at the same offset in
        the other such groups. Pure ring or pure Ulysses needs none (the CP group is enough)."""
        out: dict[str, list[list[int]]] = {}
        for size in self.dims.cp_sizes:
            u = self.dims.ulysses_degree(size)
            if 1 < u < size:
                blocks = self.cp_groups(size)
                out[f"uly{size}"] = [g[i:i + u] for g in blocks for i in range(0, size, u)]
                out[f"ring{size}"] = [g[j::u] for g in blocks for j in range(u)]
        return out

    @cached_property
    def _by_name(self) -> dict[str, list[list[int]]]:
        """Every group's rank lists by name, in the canonical order (see `named_groups`)."""
        named = {kind: self.groups[kind] for kind in GROUP_KINDS}
        named.update((f"dcp{size}", groups) for size, groups in sorted(self.dynamic_cp_groups.items()))
        named.update(self.attention_groups)  # by size, ascending; each size's uly before its ring
        return named

    @cached_property
    def named_groups(self) -> list[tuple[str, list[list[int]]]]:
        """(name, rank lists) of every group to form, in the one canonical order all ranks
        follow. Shard groups are formed only where the weights are DTensors (fsdp or tp > 1:
        the device mesh needs one, of a single rank when fsdp is 1)."""
        return [(name, groups) for name, groups in self._by_name.items()
                if name != "fsdp" or self.dims.sharded]

    @cached_property
    def _membership(self) -> dict[str, list[int]]:
        """group name -> for each rank, the index of its group of that name."""
        index: dict[str, list[int]] = {}
        for name, groups in self._by_name.items():
            where = [0] * self.world_size
            for i, group in enumerate(groups):
                for r in group:
                    where[r] = i
            index[name] = where
        return index

    def _check_rank(self, rank: int) -> None:
        if not 0 <= rank < self.world_size:
            raise KeyError(f"rank {rank} is not in the world of {self.world_size}")

    def group_of(self, name: str, rank: int) -> list[int]:
        self._check_rank(rank)
        if name not in self._by_name:
            raise KeyError(f"no group named {name!r}; names: {list(self._by_name)}")
        return self._by_name[name][self._membership[name][rank]]

    def dynamic_cp_group_of(self, size: int, rank: int) -> list[int]:
        self._check_rank(rank)
        if size not in self.dynamic_cp_groups:
            raise KeyError(f"no dynamic-CP groups of size {size}; sizes: {sorted(self.dynamic_cp_groups)}")
        return self.group_of(f"dcp{size}", rank)

    def groups_of(self, rank: int) -> list[tuple[str, list[int]]]:
        """(name, ranks) of every group `rank` belongs to, in the canonical global order."""
        self._check_rank(rank)
        return [(name, groups[self._membership[name][rank]]) for name, groups in self.named_groups]

    def communicators_of(self, rank: int) -> list[tuple[str, list[int]]]:
        """The part of `groups_of(rank)` that needs a communicator of its own, in order: a
        rank list met before under another name shares that one, and a world-sized list is the
        world. Equal in names on every rank (tests/test_topology.py), which is what NCCL needs:
        with the world bound to a device, each new group is an ncclCommSplit of the world's
        communicator, a call every rank of the world makes, matched by its position in each
        rank's sequence; members-only creation stays correct only while the k-th call of every
        rank is the same group name."""
        seen = {tuple(range(self.world_size))}
        out = []
        for name, members in self.groups_of(rank):
            if tuple(members) not in seen:
                seen.add(tuple(members))
                out.append((name, members))
        return out

    def shard_index(self, rank: int) -> int:
        """Which piece of the weights `rank` holds (0 .. dims.shards - 1): its FSDP shard and
        TP shard; equal on every rank of its `replicate` group."""
        c = self.coords(rank)
        return c.fsdp * self.dims.tp + c.tp

    def mesh(self, pp: int = 0) -> list[list[list[int]]]:
        """Pipeline stage `pp`'s ranks as a 3-D array [replicate][shard][tp]: what the device
        mesh of sharded training is built on (each stage shards over its own ranks). Row i of
        the replicate axis is the i-th rank of each `replicate` group, in (dp, cp) order."""
        d = self.dims
        if not 0 <= pp < d.pp:
            raise ValueError(f"no pipeline stage {pp} in a pipeline of {d.pp}")
        return [[[self.rank_of(RankCoords(dp=i // d.cp, pp=pp, cp=i % d.cp, tp=t, fsdp=s))
                  for t in range(d.tp)] for s in range(d.fsdp)] for i in range(d.dp * d.cp)]

    def tp_crosses_nodes(self) -> bool:
        return any(len({self.node_of(r) for r in g}) > 1 for g in self.groups["tp"])


def make_layout(nodes: list[NodeSpec], workers_per_node: int, dims: ParallelDims) -> RankLayout:
    if workers_per_node < 1:
        raise ValueError(f"workers_per_node must be >= 1, got {workers_per_node}")
    if len({n.name for n in nodes}) != len(nodes):
        raise ValueError("node names must be unique")
    capacity = len(nodes) * workers_per_node
    if capacity != dims.world_size:
        raise ValueError(
            f"{len(nodes)} nodes x {workers_per_node} workers = {capacity} slots, but dp x fsdp x "
            f"cp x tp x pp = {dims.world_size} ranks; the two must match"
        )
    ordered = tuple(sorted(nodes, key=lambda n: (n.zone, n.rack, n.name)))
    return RankLayout(dims=dims, nodes=ordered, workers_per_node=workers_per_node)


def single_node_layout(dims: ParallelDims) -> RankLayout:
    """Every rank on one node: a world formed on one machine (tests, benchmarks)."""
    return make_layout([NodeSpec("local")], dims.world_size, dims)
