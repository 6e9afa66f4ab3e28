"""Bringing the world up fast: rank layout, rendezvous store, barrier-free group creation."""

from longrun.commgroup.topology import GROUP_KINDS, Layout, NodeSpec, ParallelDims, RankCoords, make_layout

__all__ = ["GROUP_KINDS", "Layout", "NodeSpec", "ParallelDims", "RankCoords", "make_layout"]
