"""Bring a world and all its parallel groups up, without global barriers.

    groups = init_parallel_groups(redis_url, job="llama", attempt=3, rank=r, layout=layout)
    dist.all_reduce(grad, group=groups.dp_cp)
    ...
    groups.teardown()   # abort, never a hanging destroy; then re-form under attempt 4

1. Connect to the attempt's `RedisStore` (a fresh namespace per attempt: no stale keys).
2. Count in (`commgroup.rendezvous`): one round trip joins the attempt and checks that all
   ranks share one layout; nothing per group (a complete world means complete groups). A
   rank that never comes is named in the error, instead of surfacing as a gloo or NCCL
   timeout on some opaque key.
3. `init_process_group` on that store (gloo's per-peer reads batched: `reading_ahead`).
4. Every group this rank belongs to (`commgroup.groups`): barrier-free, members only, in one
   canonical global order, gloo's reads batched the same way.

On GPU the world is initialised eagerly with `device_id`, which lets torch derive each new
NCCL communicator with ncclCommSplit from the world's instead of a fresh bootstrap, and the
communicators are configured non-blocking so their initialisations overlap. Each group gets
options of its own: torch writes the group's timeout, name, ranks and split colour into the
options object it is given and the group keeps a pointer to it, so one object shared by every
group would leave them all reading the last group's fields.

`timeout` is every group's (the world's and each new group's: the job's
`health.collective_timeout_s`) and the store's wait for a peer's keys.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from datetime import timedelta

import torch
import torch.distributed as dist

from longrun.commgroup.groups import InitTimings, ParallelGroups, create_groups
from longrun.commgroup.rendezvous import RendezvousError, await_world, count_in, missing_ranks
from longrun.commgroup.store import RedisStore, StoreLinks, StoreTimeoutError
from longrun.commgroup.topology import RankLayout

__all__ = ["InitTimings", "ParallelGroups", "RendezvousError", "init_parallel_groups"]

log = logging.getLogger(__name__)


def _rendezvous_error(store: RedisStore, missing: list[int], world_size: int,
                      timeout: timedelta) -> RendezvousError:
    return RendezvousError(
        f"rank(s) {missing} did not join within {timeout.total_seconds():g} s "
        f"({world_size - len(missing)} of {world_size} arrived, store {store.namespace!r}); "
        "check that those workers started and can reach Redis",
        missing_ranks=missing,
    )


def _await_everyone(store: RedisStore, world_size: int, timeout: timedelta) -> None:
    """A world barrier, used only before NCCL's world init (a rank missing there would hang
    inside NCCL rather than time out in the store): one XREAD on the count-in's record."""
    try:
        await_world(store, timeout)
    except StoreTimeoutError:
        raise _rendezvous_error(store, missing_ranks(store, world_size), world_size, timeout) from None


def _world_options(backend: str, device: torch.device | None) -> tuple[dict, Callable[[], object] | None]:
    """(init_process_group keyword arguments, a maker of each new group's options) of a backend."""
    if backend != "nccl":
        return {}, None
    if device is None:
        raise ValueError("the nccl backend needs the rank's CUDA device")

    def nccl_options() -> object:
        # A fresh object per group: torch writes the group's own fields into it and keeps it.
        options = dist.ProcessGroupNCCL.Options()
        options.config.blocking = 0  # non-blocking communicator init: inits overlap
        return options

    return {"device_id": device}, nccl_options  # eager init: new groups split from the world's


def _init_world(store: RedisStore, backend: str, rank: int, world_size: int, timeout: timedelta,
                **kwargs) -> dist.ProcessGroup:
    """`init_process_group` on the attempt's store; a rank that never came is named."""
    try:
        with store.reading_ahead(world_size):
            dist.init_process_group(backend, store=store, rank=rank, world_size=world_size,
                                    timeout=timeout, **kwargs)
    except Exception as exc:
        missing = missing_ranks(store, world_size)
        if dist.is_initialized():
            dist.destroy_process_group()
        if missing:
            raise _rendezvous_error(store, missing, world_size, timeout) from exc
        raise
    return dist.group.WORLD


def init_parallel_groups(
    redis_url: str,
    *,
    job: str,
    attempt: int,
    rank: int,
    layout: RankLayout,
    backend: str = "gloo",
    timeout: timedelta = timedelta(minutes=5),
    device: torch.device | None = None,
    links: StoreLinks | None = None,
) -> ParallelGroups:
    """Count in, form the world and every group of `layout` this rank belongs to, each with
    `timeout`. `links`: connections the store borrows (a training rank's; the store opens its
    own otherwise)."""
    if dist.is_initialized():
        raise RuntimeError("torch.distributed is already initialised in this process; call "
                           "ParallelGroups.teardown() on the previous world first")
    world_size = layout.world_size
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is outside the world of {world_size}")
    world_kwargs, group_options = _world_options(backend, device)
    timings = InitTimings()
    start = time.perf_counter()

    store = RedisStore.for_attempt(redis_url, job, attempt, timeout, links=links)
    timings.store_connect_s = time.perf_counter() - start

    t = time.perf_counter()
    # Every rank counts in (one round trip), so a rank that never comes can be named. Only
    # NCCL waits for everyone here; gloo's rendezvous runs entirely through this store, so a
    # missing rank surfaces as a store timeout inside init_process_group, named there, and the
    # world pays no extra global barrier.
    count_in(store, rank, world_size, repr(layout.dims))
    if backend == "nccl":
        _await_everyone(store, world_size, timeout)
    timings.arrival_s = time.perf_counter() - t

    t = time.perf_counter()
    world = _init_world(store, backend, rank, world_size, timeout, **world_kwargs)
    timings.world_init_s = time.perf_counter() - t

    named, ranks, timings.groups_s = create_groups(layout, rank, world, timeout=timeout,
                                                   make_options=group_options, store=store)
    timings.total_s = time.perf_counter() - start
    log.info("rank %d attempt %d: world of %d up (%s)", rank, attempt, world_size, timings.summary())
    return ParallelGroups(rank=rank, attempt=attempt, layout=layout, store=store, world=world,
                          named=named, ranks=ranks, timings=timings, backend=backend)
