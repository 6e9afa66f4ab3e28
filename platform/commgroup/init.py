"""Bring a world and all its parallel groups up, without global barriers.

    groups = init_parallel_groups(redis_url, job="llama", attempt=3, rank=r, layout=layout)
    dist.all_reduce(grad, group=groups.dp_cp)
    ...
    groups.teardown()   # abort, never a hanging destroy; then re-form under attempt 4

1. Connect to the attempt's `RedisStore` (a fresh namespace per attempt: no stale keys).
2. Arrival: every rank checks in (one pipelined write); the last one to arrive opens the
   gate. A rank that never comes is named in the error, instead of surfacing as a gloo or
   NCCL timeout on some opaque key.
3. `init_process_group` on that store.
4. Every group this rank belongs to, created with `use_local_synchronization=True`: only the
   members meet (group names are hashes of the member ranks, so non-members need not call
   at all), and no group waits for the whole world, unlike torch's default `new_group`,
   which ends each group with a store barrier over every rank. Groups are created in one
   canonical global order, which is what makes this deadlock-free: the lowest-numbered
   group not yet complete always has all its members working on it. Rank lists shared by
   several kinds (tp of size 1 and cp of size 1, dp_cp and the largest dynamic-CP group)
   become one communicator; a group spanning the world reuses the world's.

On GPU the world is initialised eagerly with `device_id`, which lets torch derive each new
NCCL communicator with ncclCommSplit from the world's instead of a fresh bootstrap, and the
communicators are configured non-blocking so their initialisations overlap. On gloo,
creating groups from several threads was measured slower (its rendezvous calls back into
Python for every store operation, contending for the GIL), so groups are created in order.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist

from longrun.commgroup.store import RedisStore, StoreTimeoutError
from longrun.commgroup.topology import GROUP_KINDS, Layout

log = logging.getLogger(__name__)


class RendezvousError(RuntimeError):
    """The world could not be formed; the message names the ranks that are missing."""

    def __init__(self, message: str, missing_ranks: list[int] | None = None):
        super().__init__(message)
        self.missing_ranks = missing_ranks or []


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
    layout: Layout
    store: RedisStore
    world: dist.ProcessGroup
    by_kind: dict[str, dist.ProcessGroup]
    dynamic_cp: dict[int, dist.ProcessGroup]  # CP size -> this rank's sub-group of that size
    ranks: dict[str, list[int]]  # group name -> member ranks
    timings: InitTimings
    backend: str

    @property
    def tp(self) -> dist.ProcessGroup:
        return self.by_kind["tp"]

    @property
    def cp(self) -> dist.ProcessGroup:
        return self.by_kind["cp"]

    @property
    def pp(self) -> dist.ProcessGroup:
        return self.by_kind["pp"]

    @property
    def dp(self) -> dist.ProcessGroup:
        return self.by_kind["dp"]

    @property
    def dp_cp(self) -> dist.ProcessGroup:
        return self.by_kind["dp_cp"]

    def all_groups(self) -> dict[str, dist.ProcessGroup]:
        named = dict(self.by_kind)
        named.update({f"dcp{size}": pg for size, pg in self.dynamic_cp.items()})
        return named

    def teardown(self) -> None:
        """Drop every communicator of this world so a new attempt can form. Aborts rather than
        destroys where the backend can hang on a dead peer (NCCL); safe to call after a
        collective failed because a peer died."""
        if not dist.is_initialized():
            return
        if self.backend == "nccl":
            dist.distributed_c10d._abort_process_group()
        else:
            dist.destroy_process_group()
        self.store.close()


def _my_groups(layout: Layout, rank: int) -> list[tuple[str, list[int]]]:
    """(name, ranks) of every group `rank` belongs to, in the canonical global order."""
    named = [(kind, layout.group_of(kind, rank)) for kind in GROUP_KINDS]
    sizes = sorted(layout.dynamic_cp_groups)
    named += [(f"dcp{size}", layout.dynamic_cp_group_of(size, rank)) for size in sizes]
    return named


def _missing_ranks(store: RedisStore, world_size: int) -> list[int]:
    return [r for r in range(world_size) if not store.check([f"arrive/{r}"])]


def _rendezvous_error(store: RedisStore, missing: list[int], world_size: int,
                      timeout: timedelta) -> RendezvousError:
    return RendezvousError(
        f"rank(s) {missing} did not join within {timeout.total_seconds():g} s "
        f"({world_size - len(missing)} of {world_size} arrived, store {store.namespace!r}); "
        "check that those workers started and can reach Redis",
        missing_ranks=missing,
    )


def _await_everyone(store: RedisStore, world_size: int, timeout: timedelta) -> None:
    """A world barrier, used only before NCCL's world init: a rank missing there would hang
    inside NCCL rather than time out in the store."""
    if store.add("arrived", 1) == world_size:
        store.set("all_arrived", b"1")
    try:
        store.wait(["all_arrived"], timeout)
    except StoreTimeoutError:
        raise _rendezvous_error(store, _missing_ranks(store, world_size), world_size, timeout) from None


def init_parallel_groups(
    redis_url: str,
    *,
    job: str,
    attempt: int,
    rank: int,
    layout: Layout,
    backend: str = "gloo",
    timeout: timedelta = timedelta(minutes=5),
    device: torch.device | None = None,
) -> ParallelGroups:
    if dist.is_initialized():
        raise RuntimeError("torch.distributed is already initialised in this process; call "
                           "ParallelGroups.teardown() on the previous world first")
    world_size = layout.world_size
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is outside the world of {world_size}")
    timings = InitTimings()
    start = time.perf_counter()

    store = RedisStore.for_attempt(redis_url, job, attempt, timeout)
    timings.store_connect_s = time.perf_counter() - start

    t = time.perf_counter()
    # Every rank records that it arrived, so a rank that never comes can be named. Only NCCL
    # waits for everyone here; gloo's rendezvous runs entirely through this store, so a
    # missing rank surfaces as a store timeout inside init_process_group, named below, and
    # the world pays no extra global barrier.
    store.set(f"arrive/{rank}", b"1")
    if backend == "nccl":
        _await_everyone(store, world_size, timeout)
    timings.arrival_s = time.perf_counter() - t

    t = time.perf_counter()
    kwargs = {}
    group_options = None
    if backend == "nccl":
        if device is None:
            raise ValueError("the nccl backend needs the rank's CUDA device")
        kwargs["device_id"] = device  # eager init: new groups split from the world's communicator
        group_options = dist.ProcessGroupNCCL.Options()
        group_options.config.blocking = 0  # non-blocking communicator init: inits overlap
    try:
        dist.init_process_group(backend, store=store, rank=rank, world_size=world_size,
                                timeout=timeout, **kwargs)
    except Exception as exc:
        missing = _missing_ranks(store, world_size)
        if dist.is_initialized():
            dist.destroy_process_group()
        if missing:
            raise _rendezvous_error(store, missing, world_size, timeout) from exc
        raise
    world = dist.group.WORLD
    timings.world_init_s = time.perf_counter() - t

    by_list: dict[tuple[int, ...], dist.ProcessGroup] = {tuple(range(world_size)): world}
    by_kind: dict[str, dist.ProcessGroup] = {}
    dynamic: dict[int, dist.ProcessGroup] = {}
    ranks: dict[str, list[int]] = {}
    for name, members in _my_groups(layout, rank):
        key = tuple(members)
        if key not in by_list:
            t = time.perf_counter()
            by_list[key] = dist.new_group(members, timeout=timeout, use_local_synchronization=True,
                                          pg_options=group_options, group_desc=name)
            timings.groups_s[name] = time.perf_counter() - t
        pg = by_list[key]
        ranks[name] = members
        if name.startswith("dcp"):
            dynamic[int(name[3:])] = pg
        else:
            by_kind[name] = pg
    timings.total_s = time.perf_counter() - start
    log.info("rank %d attempt %d: world of %d up (%s)", rank, attempt, world_size, timings.summary())
    return ParallelGroups(rank=rank, attempt=attempt, layout=layout, store=store, world=world,
                          by_kind=by_kind, dynamic_cp=dynamic, ranks=ranks, timings=timings,
                          backend=backend)
