"""Bringing the world up fast: rank layout, Redis rendezvous store, barrier-free group creation."""

from longrun.commgroup.check import GroupCheckError, check_groups
from longrun.commgroup.init import InitTimings, ParallelGroups, RendezvousError, init_parallel_groups
from longrun.commgroup.store import RedisStore, StoreConnectionError, StoreTimeoutError
from longrun.commgroup.topology import GROUP_KINDS, Layout, NodeSpec, ParallelDims, RankCoords, make_layout

__all__ = [
    "GROUP_KINDS",
    "GroupCheckError",
    "InitTimings",
    "Layout",
    "NodeSpec",
    "ParallelDims",
    "ParallelGroups",
    "RankCoords",
    "RedisStore",
    "RendezvousError",
    "StoreConnectionError",
    "StoreTimeoutError",
    "check_groups",
    "init_parallel_groups",
    "make_layout",
]
