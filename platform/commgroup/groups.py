"""Every parallel group a rank belongs to, created on a world that is already up.

    groups = form_groups(layout, rank)          # on a world someone else initialised
    dist.all_reduce(grad, group=groups.dp_cp)
    groups.cp_group(4), groups.attention_groups(4)

Groups are created with `use_local_synchronization=True`: group names are hashes of the member
ranks, so non-members need not call at all, where torch's default `new_group` names groups by a
global counter and needs every rank of the world to call it for every group. (The store
barrier torch can end each group with, over the whole world by default and over the members
with local synchronisation, runs only with TORCH_DIST_INIT_BARRIER=1; torch's default is 0, so
by default neither waits.) Groups are created in one canonical global order (the layout's
`named_groups`), which is what makes this deadlock-free: the groups of each name partition
the world, so the lowest-numbered group not yet complete always has all its members working
on it. Rank lists shared by several names (tp of size 1 and cp of size 1, dp_cp and the
largest dynamic-CP group) become one communicator; a group spanning the world reuses the
world's. That de-duplication is by rank list, yet it comes out the same on every rank
(`RankLayout.communicators_of`, property-tested): on NCCL, with the world bound to its device,
each new group is an ncclCommSplit of the world's communicator that every rank calls, matched by
position, so every rank's k-th new communicator must be the same name's. On gloo, creating
groups from several threads was measured slower (its rendezvous calls back into Python for
every store operation, contending for the GIL), so they are created in order.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from longrun.commgroup.store import RedisStore
from longrun.commgroup.topology import RankLayout


@dataclass
class InitTimings:
    store_connect_s: float = 0.0
    arrival_s: float = 0.0
    world_init_s: float = 0.0
    groups_s: dict[str, float] = field(default_factory=dict)
    total_s: float = 0.0

    def summary(self) -> str:
        groups = sum(self.groups_s.values())
        return (f"store {self.store_connect_s * 1e3:.0f} ms, arrival {self.arrival_s * 1e3:.0f} ms, "
                f"world {self.world_init_s * 1e3:.0f} ms, {len(self.groups_s)} groups "
                f"{groups * 1e3:.0f} ms, total {self.total_s * 1e3:.0f} ms")


@dataclass
class ParallelGroups:
    rank: int
    attempt: int
    layout: RankLayout
    store: RedisStore | None  # None: the world belongs to someone else (see `form_groups`)
    world: dist.ProcessGroup
    named: dict[str, dist.ProcessGroup]  # group name -> this rank's group of that name
    ranks: dict[str, list[int]]  # group name -> member ranks
    timings: InitTimings
    backend: str

    @property
    def tp(self) -> dist.ProcessGroup:
        return self.named["tp"]

    @property
    def cp(self) -> dist.ProcessGroup:
        return self.named["cp"]

    @property
    def pp(self) -> dist.ProcessGroup:
        return self.named["pp"]

    @property
    def dp(self) -> dist.ProcessGroup:
        return self.named["dp"]

    @property
    def dp_cp(self) -> dist.ProcessGroup:
        """The span: dp x fsdp x cp ranks that reduce gradients together."""
        return self.named["dp_cp"]

    @property
    def replicate(self) -> dist.ProcessGroup:
        """The ranks holding the same piece of the weights (dp x cp; the span when nothing is
        sharded): what a checkpoint is written once for and read once for."""
        return self.named["replicate"]

    @property
    def shard_index(self) -> int:
        """Which piece of the weights this rank holds (its FSDP and TP shard)."""
        return self.layout.shard_index(self.rank)

    def device_mesh(self, device_type: str) -> DeviceMesh:
        """The 3-D device mesh ("replicate", "shard", "tp") of sharded training, built on the
        groups already formed (no second rendezvous): TP applies on `mesh["tp"]`, FSDP2 on
        `mesh["replicate", "shard"]` (HSDP) or `mesh["shard"]`. Needs the shard group, which
        is formed where the weights are sharded (fsdp or tp > 1). Under pipeline parallelism
        the mesh is this rank's stage's: every stage shards over its own ranks."""
        if not self.layout.dims.sharded:
            raise ValueError("nothing is sharded in this layout (parallelism.fsdp and tp are 1)")
        return DeviceMesh.from_group([self.named["replicate"], self.named["fsdp"], self.named["tp"]],
                                     device_type, mesh=self.layout.mesh(self.layout.coords(self.rank).pp),
                                     mesh_dim_names=("replicate", "shard", "tp"))

    @property
    def dynamic_cp(self) -> dict[int, dist.ProcessGroup]:
        """CP size -> this rank's dynamic-CP sub-group of that size."""
        return {int(name[3:]): pg for name, pg in self.named.items() if name.startswith("dcp")}

    def cp_group(self, size: int) -> dist.ProcessGroup:
        """This rank's CP group of `size` ranks (static CP's cp group or a dynamic-CP one)."""
        if size == self.layout.dims.cp:
            return self.cp
        if f"dcp{size}" not in self.named:
            raise KeyError(f"no CP group of {size} ranks in this layout; sizes: "
                           f"{sorted({self.layout.dims.cp, *self.dynamic_cp})}")
        return self.named[f"dcp{size}"]

    def attention_groups(self, size: int) -> tuple[dist.ProcessGroup | None, dist.ProcessGroup | None]:
        """(Ulysses, ring) sub-groups of this rank's CP group of `size` under USP; (None, None)
        where the run attends over the whole CP group (pure ring or pure Ulysses)."""
        return self.named.get(f"uly{size}"), self.named.get(f"ring{size}")

    def all_groups(self) -> dict[str, dist.ProcessGroup]:
        return dict(self.named)

    def teardown(self) -> None:
        """Drop every communicator of this world so a new attempt can form. Aborts rather than
        destroys where the backend can hang on a dead peer (NCCL); safe to call after a
        collective failed because a peer died. Groups formed on a world someone else owns
        (`store` None) stay with that world (see `form_groups`) and go when it does."""
        if not dist.is_initialized() or self.store is None:
            return
        if self.backend == "nccl":
            dist.distributed_c10d._abort_process_group()
        else:
            dist.destroy_process_group()
        self.store.close()


def create_groups(layout: RankLayout, rank: int, world: dist.ProcessGroup, *, timeout: timedelta,
                  make_options: Callable[[], Any] | None = None,
                  known: dict[tuple[int, ...], dist.ProcessGroup] | None = None,
                  store: RedisStore | None = None,
                  ) -> tuple[dict[str, dist.ProcessGroup], dict[str, list[int]], dict[str, float]]:
    """This rank's group of every name, in the canonical order: (groups by name, members by
    name, seconds per communicator created), each created with `timeout`. `make_options`: makes
    each new communicator's backend options, a fresh object each (torch writes the group's
    fields into it and keeps it). `known`: communicators of this world by member ranks, reused
    and added to. `store`: the world's RedisStore, whose read-ahead then serves each group's
    gloo rendezvous (every peer's key in one XREAD instead of 2 round trips each)."""
    by_list = known if known is not None else {}
    by_list[tuple(range(layout.world_size))] = world
    named: dict[str, dist.ProcessGroup] = {}
    ranks: dict[str, list[int]] = {}
    seconds: dict[str, float] = {}
    for name, members in layout.communicators_of(rank):  # the same names in the same order on every rank
        key = tuple(members)
        if key not in by_list:  # (formed on this world before: a re-formed world's `known`)
            start = time.perf_counter()
            with store.reading_ahead(len(members)) if store is not None else contextlib.nullcontext():
                options = make_options() if make_options is not None else None
                by_list[key] = dist.new_group(members, timeout=timeout, use_local_synchronization=True,
                                              pg_options=options, group_desc=name)
            seconds[name] = time.perf_counter() - start
    for name, members in layout.groups_of(rank):
        named[name] = by_list[tuple(members)]
        ranks[name] = members
    return named, ranks, seconds


# Communicators formed on worlds this module does not own, by world: torch allows one per
# member list per world (names are hashes of the members, and a destroyed one cannot be formed
# again: its rendezvous keys stay in the world's store), so a later `form_groups` on the same
# world reuses them. The world is held here so its id is not reused while the entry lives.
_FORMED: dict[int, tuple[dist.ProcessGroup, dict[tuple[int, ...], dist.ProcessGroup]]] = {}


def form_groups(layout: RankLayout, rank: int, *,
                timeout: timedelta = timedelta(minutes=5)) -> ParallelGroups:
    """Every group of `layout` on the default world this process already joined (formed by
    someone else, e.g. a test's or a benchmark's rendezvous). Several layouts may be formed on
    one world, one after another on every rank alike; a member list formed before is reused."""
    if not dist.is_initialized() or dist.get_world_size() != layout.world_size:
        raise RuntimeError(f"form_groups needs an initialised world of {layout.world_size} ranks; "
                           "join one first (or use init_parallel_groups, which forms it)")
    start = time.perf_counter()
    world = dist.group.WORLD
    if id(world) not in _FORMED or _FORMED[id(world)][0] is not world:
        _FORMED[id(world)] = (world, {})
    named, ranks, seconds = create_groups(layout, rank, world, timeout=timeout,
                                          known=_FORMED[id(world)][1])
    timings = InitTimings(groups_s=seconds, total_s=time.perf_counter() - start)
    return ParallelGroups(rank=rank, attempt=0, layout=layout, store=None, world=world, named=named,
                          ranks=ranks, timings=timings, backend=dist.get_backend())
