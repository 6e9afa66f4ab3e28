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
- `PlacementTimeout`: the nodes exist but their resources are busy (another job holds them).
  Busy is not gone: the controller waits for them (an elastic job continues on the nodes that
  can be placed), and a wait spends no restart budget.
Both carry `available`, the eligible nodes that could take a node's share of the job now
(free resources), which is what an elastic job can continue on.

What "could be placed now" means is free resources (`NodeInfo.available`), never totals: a
node another job fills is no spare and no reason to grow (`spare_nodes`, `placeable_nodes`).
The nodes of the job's own placement (`held`) count as free to it: it gives them back before
placing again, and Ray's view of free resources trails that release.

Ray's view of which nodes live trails too: a node lost a moment ago (the fault the job is
restarting from) is still listed alive until the control store's health checks give up on it,
and a reservation pinned to it would wait out the whole timeout. So a pending reservation looks
again every few seconds, and one whose node has died since is dropped and chosen anew.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import ray
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from longrun.config import JobConfig
from longrun.node_names import node_name

NODE_ID_LABEL = "ray.io/node-id"
RECHECK_S = 2.0  # how often a pending reservation looks whether one of its nodes has died


class PlacementCancelled(RuntimeError):
    """A pending placement given up because the job was asked to stop meanwhile."""


class PlacementImpossible(RuntimeError):
    """The cluster can never hold this job (not enough eligible nodes). `available`: how many
    eligible nodes could take a node's share now (what an elastic job can continue on), and
    `existing`: how many there are, busy ones included; None when not known."""

    def __init__(self, message: str, available: int | None = None, existing: int | None = None):
        super().__init__(message)
        self.available = available
        self.existing = available if existing is None else existing


class PlacementTimeout(TimeoutError):
    """Eligible nodes exist but did not free enough resources in time. `available`: how many
    could take a node's share when the wait ended (None: unknown); `existing`: how many exist."""

    def __init__(self, message: str, available: int | None = None, existing: int | None = None):
        super().__init__(message)
        self.available = available
        self.existing = existing


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
    host: str = ""  # its host name, as Ray reports it

    @property
    def name(self) -> str:
        """"host (address)": what a person reads (node_names.py)."""
        return node_name(self.host, self.address)

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
                 available.get(n["NodeID"], {}), host=n.get("NodeManagerHostname", ""))
        for n in ray.nodes() if n["Alive"]
    ]
    return sorted(nodes, key=lambda n: (n.address, n.node_id))


def eligible_nodes(cfg: JobConfig, nodes: Iterable[NodeInfo], evicted: Iterable[str] = ()) -> list[NodeInfo]:
    """Live, never evicted nodes whose total resources hold a node's share of the job."""
    bundle, banned = worker_bundle(cfg), set(evicted)
    return [n for n in nodes if n.node_id not in banned
            and n.fits(bundle, cfg.cluster.workers_per_node, free=False)]


def _free(cfg: JobConfig, node: NodeInfo, held: Iterable[str]) -> bool:
    """Whether `node` could take a node's share of the job now: its free resources hold it, or
    the job's own placement (given back before placing again) holds the node."""
    return node.node_id in set(held) or node.fits(worker_bundle(cfg), cfg.cluster.workers_per_node, free=True)


def placeable_nodes(cfg: JobConfig, nodes: Iterable[NodeInfo], evicted: Iterable[str] = (),
                    held: Iterable[str] = ()) -> int:
    """How many eligible nodes could take a node's share of the job now (see the module docstring)."""
    held = set(held)
    return sum(1 for n in eligible_nodes(cfg, nodes, evicted) if _free(cfg, n, held))


def choose_nodes(cfg: JobConfig, nodes: Iterable[NodeInfo], evicted: Iterable[str] = (),
                 held: Iterable[str] = ()) -> list[NodeInfo]:
    """`cluster.nodes` nodes for the job: never evicted ones, preferring nodes whose
    resources are free now (or `held` by the job's own placement). Raises PlacementImpossible
    when too few nodes could ever fit."""
    bundle, per_node, wanted = worker_bundle(cfg), cfg.cluster.workers_per_node, cfg.cluster.nodes
    banned, held = set(evicted), set(held)
    nodes = list(nodes)
    candidates = [n for n in nodes if n.node_id not in banned]
    able = eligible_nodes(cfg, nodes, banned)
    ready = [n for n in able if _free(cfg, n, held)]
    if len(able) < wanted:
        need = ", ".join(f"{amount * per_node:g} {name}" for name, amount in bundle.items())
        raise PlacementImpossible(
            f"the job needs {wanted} node(s) with {need} each ({per_node} worker(s) per node, "
            f"cluster.nodes x cluster.workers_per_node = {cfg.world_size}); the cluster has "
            f"{len(able)} such node(s) among {len(candidates)} live and not evicted"
            + (f" ({len(banned)} evicted)" if banned else "")
            + "; add nodes or lower cluster.nodes / cluster.workers_per_node",
            available=len(ready), existing=len(able),
        )
    # Free nodes first (stable within each class), so the reservation can succeed at once.
    busy = [n for n in able if n not in ready]
    return (ready + busy)[:wanted]


def spare_nodes(cfg: JobConfig, nodes: Iterable[NodeInfo], evicted: Iterable[str] = (),
                own: Iterable[str] = ()) -> int:
    """How many live, never evicted nodes beyond the job's own could take a node's share of it
    now: whether losing one of its nodes leaves a place to go, and whether a job running short
    could be placed at its full size again. Free resources, not totals: a node that another
    job keeps busy is no spare. `own`: the nodes of the job's placement (the job's nodes are
    the first `cluster.nodes` free ones when it holds none)."""
    own = set(own)
    free = [n for n in eligible_nodes(cfg, nodes, evicted) if n.node_id not in own and _free(cfg, n, ())]
    return len(free) if own else max(0, len(free) - cfg.cluster.nodes)


@dataclass
class Placement:
    group: PlacementGroup
    node_ids: tuple[str, ...]  # node of each node index; rank r lives on node_ids[r // per_node]
    workers_per_node: int
    names: dict[str, str] = field(default_factory=dict)  # node id -> "host (address)"

    def node_of(self, rank: int) -> str:
        return self.node_ids[rank // self.workers_per_node]

    def strategy(self, rank: int) -> PlacementGroupSchedulingStrategy:
        """Schedule rank `rank`'s actor into its bundle."""
        return PlacementGroupSchedulingStrategy(placement_group=self.group, placement_group_bundle_index=rank)

    def remove(self) -> None:
        remove_placement_group(self.group)


def place(cfg: JobConfig, *, evicted: Iterable[str] = (), timeout_s: float = 60.0,
          name: str = "", held: Iterable[str] = (), cancelled: Callable[[], bool] | None = None) -> Placement:
    """Reserve the job's workers on chosen nodes (see the module docstring). `held`: the nodes
    of the job's own placement, just given back. `cancelled`: asked between looks at a pending
    reservation; True gives it up (PlacementCancelled): a stop request must not wait out the
    timeout, or a scheduler's grace period runs out first."""
    deadline = time.monotonic() + timeout_s
    per_node = cfg.cluster.workers_per_node
    while True:
        nodes = choose_nodes(cfg, alive_nodes(), evicted, held)
        bundles = [worker_bundle(cfg) for _ in range(cfg.world_size)]
        selectors = [{NODE_ID_LABEL: nodes[r // per_node].node_id} for r in range(cfg.world_size)]
        group = placement_group(bundles, strategy="PACK", name=name, bundle_label_selector=selectors)
        while True:
            left = deadline - time.monotonic()
            ready, _ = ray.wait([group.ready()], timeout=max(0.0, min(RECHECK_S, left)))
            if ready:
                return Placement(group, tuple(n.node_id for n in nodes), per_node,
                                 {n.node_id: n.name for n in nodes})
            if cancelled is not None and cancelled():
                remove_placement_group(group)
                raise PlacementCancelled(f"placing {cfg.world_size} worker(s) given up: the job was asked "
                                         "to stop")
            now = alive_nodes()  # a pending group holds nothing (all or nothing): the view is the others'
            if left <= 0:
                remove_placement_group(group)
                raise PlacementTimeout(
                    f"{cfg.world_size} worker(s) on nodes {', '.join(n.name for n in nodes)} could not "
                    f"be reserved within {timeout_s:g} s (the placement deadline, "
                    "health.startup.placement_s): their resources are in use",
                    available=placeable_nodes(cfg, now, evicted),
                    existing=len(eligible_nodes(cfg, now, evicted)),
                )
            alive = {n.node_id for n in now}
            if any(n.node_id not in alive for n in nodes):
                remove_placement_group(group)  # pinned to a node that died: choose again
                break


def bundle_nodes(placement: Placement) -> list[str]:
    """The node id each bundle was actually reserved on (Ray's own record)."""
    table: dict[str, Any] = ray.util.placement_group_table(placement.group)
    nodes = table["bundles_to_node_id"]
    return [nodes[i] for i in range(len(nodes))]
