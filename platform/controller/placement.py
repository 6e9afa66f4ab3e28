"""Placing a job's workers on a Ray cluster: one bundle per worker, ordered by node.

The communication layout (`commgroup/topology.py`) numbers ranks node by node: tensor
parallelism inside a node, data parallelism outermost. So the controller picks the nodes
itself, `cluster.nodes` of them with room for `cluster.workers_per_node` workers each, never
an evicted one, and reserves them in ONE placement group: bundle i is rank i's, and each
bundle carries a label selector pinning it to its node (`ray.io/node-id`). The reservation is
all or nothing (Ray's placement group), a rank's node is known before any process starts,
and a re-placement after an eviction simply chooses again without the evicted nodes.

Two ways placement can fail, told apart because the controller reacts differently:
- `PlacementImpossible`: the cluster does not have enough eligible nodes at all (counting
  total resources, not free ones). Waiting will not help; the message says what is missing.
- `PlacementTimeout`: the nodes exist but their resources are busy; the controller may wait
  and retry within its budget.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import ray
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from longrun.config import JobConfig

NODE_ID_LABEL = "ray.io/node-id"


class PlacementImpossible(RuntimeError):
    """The cluster can never hold this job (not enough eligible nodes). `available`: how many
    eligible nodes it has (what an elastic job could continue on), when known."""

    def __init__(self, message: str, available: int | None = None):
        super().__init__(message)
        self.available = available


class PlacementTimeout(TimeoutError):
    """Eligible nodes exist but did not free enough resources in time."""


def worker_bundle(cfg: JobConfig) -> dict[str, float]:
    """One worker's resources: an accelerator each on CUDA, a core each on CPU."""
    if cfg.cluster.device == "cuda":
        return {"CPU": 1.0, "GPU": 1.0}
    return {"CPU": 1.0}


@dataclass(frozen=True)
class NodeInfo:
    node_id: str
    address: str
    total: dict[str, float]
    available: dict[str, float]

    def fits(self, bundle: dict[str, float], count: int, *, free: bool) -> bool:
        pool = self.available if free else self.total
        return all(pool.get(name, 0.0) >= amount * count for name, amount in bundle.items())


def alive_nodes() -> list[NodeInfo]:
    """The cluster's live nodes with their total and currently free resources, in a stable
    order (by address, then id) so that placement is reproducible."""
    # Free resources per node have no public API; this only orders the choice (free nodes
    # first), so if a Ray upgrade removes it placement still works, just less eagerly.
    try:
        from ray._private.state import available_resources_per_node

        available = {k: dict(v) for k, v in available_resources_per_node().items()}
    except (ImportError, AttributeError):  # pragma: no cover
        available = {}
    nodes = [
        NodeInfo(n["NodeID"], n["NodeManagerAddress"], dict(n["Resources"]),
                 available.get(n["NodeID"], {}))
        for n in ray.nodes() if n["Alive"]
    ]
    return sorted(nodes, key=lambda n: (n.address, n.node_id))


def choose_nodes(cfg: JobConfig, nodes: Iterable[NodeInfo], evicted: Iterable[str] = ()) -> list[NodeInfo]:
    """`cluster.nodes` nodes for the job: never evicted ones, preferring nodes whose
    resources are free now. Raises PlacementImpossible when too few nodes could ever fit."""
    bundle, per_node, wanted = worker_bundle(cfg), cfg.cluster.workers_per_node, cfg.cluster.nodes
    banned = set(evicted)
    candidates = [n for n in nodes if n.node_id not in banned]
    able = [n for n in candidates if n.fits(bundle, per_node, free=False)]
    if len(able) < wanted:
        need = ", ".join(f"{amount * per_node:g} {name}" for name, amount in bundle.items())
        raise PlacementImpossible(
            f"the job needs {wanted} node(s) with {need} each ({per_node} worker(s) per node, "
            f"cluster.nodes x cluster.workers_per_node = {cfg.world_size}); the cluster has "
            f"{len(able)} such node(s) among {len(candidates)} live and not evicted"
            + (f" ({len(banned)} evicted)" if banned else "")
            + "; add nodes or lower cluster.nodes / cluster.workers_per_node",
            available=len(able),
        )
    # Free nodes first (stable within each class), so the reservation can succeed at once.
    ready = [n for n in able if n.fits(bundle, per_node, free=True)]
    busy = [n for n in able if not n.fits(bundle, per_node, free=True)]
    return (ready + busy)[:wanted]


def spare_nodes(cfg: JobConfig, nodes: Iterable[NodeInfo], evicted: Iterable[str] = ()) -> int:
    """How many live, never evicted nodes could hold a node's share of the job beyond the
    `cluster.nodes` it needs: whether losing one of its nodes leaves a place to go."""
    bundle, banned = worker_bundle(cfg), set(evicted)
    able = [n for n in nodes if n.node_id not in banned and n.fits(bundle, cfg.cluster.workers_per_node,
                                                                    free=False)]
    return max(0, len(able) - cfg.cluster.nodes)


@dataclass
class Placement:
    group: PlacementGroup
    node_ids: tuple[str, ...]  # node of each node index; rank r lives on node_ids[r // per_node]
    workers_per_node: int

    def node_of(self, rank: int) -> str:
        return self.node_ids[rank // self.workers_per_node]

    def strategy(self, rank: int) -> PlacementGroupSchedulingStrategy:
        """Schedule rank `rank`'s actor into its bundle."""
        return PlacementGroupSchedulingStrategy(placement_group=self.group, placement_group_bundle_index=rank)

    def remove(self) -> None:
        remove_placement_group(self.group)


def place(cfg: JobConfig, *, evicted: Iterable[str] = (), timeout_s: float = 60.0,
          name: str = "") -> Placement:
    """Reserve the job's workers on chosen nodes (see the module docstring)."""
    nodes = choose_nodes(cfg, alive_nodes(), evicted)
    per_node = cfg.cluster.workers_per_node
    bundles = [worker_bundle(cfg) for _ in range(cfg.world_size)]
    selectors = [{NODE_ID_LABEL: nodes[r // per_node].node_id} for r in range(cfg.world_size)]
    group = placement_group(bundles, strategy="PACK", name=name, bundle_label_selector=selectors)
    ready, _ = ray.wait([group.ready()], timeout=timeout_s)
    if not ready:
        remove_placement_group(group)
        raise PlacementTimeout(
            f"{cfg.world_size} worker(s) on nodes {', '.join(n.address for n in nodes)} could not be "
            f"reserved within {timeout_s:g} s: their resources are in use"
        )
    return Placement(group, tuple(n.node_id for n in nodes), per_node)


def bundle_nodes(placement: Placement) -> list[str]:
    """The node id each bundle was actually reserved on (Ray's own record)."""
    table: dict[str, Any] = ray.util.placement_group_table(placement.group)
    nodes = table["bundles_to_node_id"]
    return [nodes[i] for i in range(len(nodes))]
