"""Bringing the world up fast: rank layout, Redis rendezvous store, barrier-free group creation
(every group: tp, cp, pp, dp, the dp x cp span, dynamic-CP and USP sub-groups)."""

from longrun.commgroup.check import GroupCheckError, check_groups
from longrun.commgroup.groups import InitTimings, ParallelGroups, form_groups
from longrun.commgroup.init import init_parallel_groups
from longrun.commgroup.rendezvous import LayoutMismatchError, RendezvousError
from longrun.commgroup.store import RedisStore, StoreConnectionError, StoreTimeoutError
from longrun.commgroup.topology import (
    GROUP_KINDS,
    NodeSpec,
    RankCoords,
    RankLayout,
    make_layout,
    single_node_layout,
)
from longrun.parallel.dims import ParallelDims

__all__ = [
    "GROUP_KINDS",
    "GroupCheckError",
    "InitTimings",
    "LayoutMismatchError",
    "NodeSpec",
    "ParallelDims",
    "ParallelGroups",
    "RankCoords",
    "RankLayout",
    "RedisStore",
    "RendezvousError",
    "StoreConnectionError",
    "StoreTimeoutError",
    "check_groups",
    "form_groups",
    "init_parallel_groups",
    "make_layout",
    "single_node_layout",
]
