"""Placing a job's workers on a Ray cluster: one bundle per worker, ordered by node.

The communication layout (`commgroup/topology.py`) numbers ranks node by node: tensor
parallelism inside a node, data parallelism outermost. So the controller picks the nodes
itself, `cluster.nodes` of them with room for `cluster.workers_per_node` workers each, never
an evicted one, and reserves them in ONE placement group: bundle i is rank i's, and each
bundle carries a label selector pinning it to its node (`ray.io/node-id`). The reservation is
all or nothing (Ray's placement group), and a rank's node is known before any process starts.

When some of the job's nodes are lost or evicted and its size stays, only those nodes are
placed again (`place_again`): their replacements are reserved in a group of their own beside
the job's, and the ranks of the nodes that stay keep their bundles, with the warm spares waiting
in them (workers.py). One group for the whole job, not one per node, because that is what
placing costs least at scale (`bench/placement_scale.py`: 17x less GCS CPU at 8,192 bundles); a
replaced node's bundles in the first group stay reserved for its node (a lost node's are Ray's
to forget; an evicted node's hold that node, which the job will not use again, until the job
next places from scratch). A group none of whose bundles serves a rank any more is removed.

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

import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import ray
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from longrun.config import JobConfig
from longrun.node_names import node_name

log = logging.getLogger(__name__)

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
                 held: Iterable[str] = (), taken: Iterable[str] = ()) -> list[NodeInfo]:
    """`cluster.nodes` nodes for the job: never evicted ones, preferring nodes whose
    resources are free now (or `held` by the job's own placement). `taken`: nodes the job keeps
    (a partial re-placement); only the others it still needs are returned. Raises
    PlacementImpossible when too few nodes could ever fit."""
    bundle, per_node, wanted = worker_bundle(cfg), cfg.cluster.workers_per_node, cfg.cluster.nodes
    taken = set(taken)
    banned, held = set(evicted), set(held) | taken
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
    still = wanted - len(taken & {n.node_id for n in able})
    return [n for n in ready + busy if n.node_id not in taken][:still]


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
    """The job's reservation: `groups` (the whole job's first, then one per partial
    re-placement still in use), and for each rank its `slots` entry (group index, bundle index).
    Rank r lives on node_ids[r // workers_per_node]."""

    groups: list[PlacementGroup]
    node_ids: tuple[str, ...]  # node of each node index
    workers_per_node: int
    names: dict[str, str] = field(default_factory=dict)  # node id -> "host (address)"
    slots: list[tuple[int, int]] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.slots:  # one group for the whole job: bundle r is rank r's
            self.slots = [(0, r) for r in range(len(self.node_ids) * self.workers_per_node)]

    def node_of(self, rank: int) -> str:
        return self.node_ids[rank // self.workers_per_node]

    def ranks_on(self, index: int) -> range:
        """The ranks of node index `index`."""
        return range(index * self.workers_per_node, (index + 1) * self.workers_per_node)

    def strategy(self, rank: int) -> PlacementGroupSchedulingStrategy:
        """Schedule rank `rank`'s actor into its bundle."""
        group, bundle = self.slots[rank]
        return PlacementGroupSchedulingStrategy(placement_group=self.groups[group],
                                                placement_group_bundle_index=bundle)

    def remove(self) -> None:
        remove_groups(self.groups)


def remove_groups(groups: Iterable[PlacementGroup]) -> None:
    """Remove each group; one that cannot be (gone with its nodes already) is logged, and the
    others are still removed."""
    for group in groups:
        try:
            remove_placement_group(group)
        except Exception as exc:  # Ray's errors for a group it no longer has
            log.warning("removing a placement group: %s", exc)


def _reserve(cfg: JobConfig, nodes: list[NodeInfo], name: str, deadline: float, timeout_s: float,
             evicted: Iterable[str], held: Iterable[str],
             cancelled: Callable[[], bool] | None) -> PlacementGroup | None:
    """One group of `cluster.workers_per_node` bundles on each of `nodes`, in their order, once
    it is ready; None when one of the nodes died while it waited (choose again)."""
    per_node = cfg.cluster.workers_per_node
    count = len(nodes) * per_node
    bundles = [worker_bundle(cfg) for _ in range(count)]
    selectors = [{NODE_ID_LABEL: nodes[b // per_node].node_id} for b in range(count)]
    group = placement_group(bundles, strategy="PACK", name=name, bundle_label_selector=selectors)
    while True:
        left = deadline - time.monotonic()
        ready, _ = ray.wait([group.ready()], timeout=max(0.0, min(RECHECK_S, left)))
        if ready:
            return group
        if cancelled is not None and cancelled():
            remove_placement_group(group)
            raise PlacementCancelled(f"placing {count} worker(s) given up: the job was asked to stop")
        now = alive_nodes()  # a pending group holds nothing (all or nothing): the view is the others'
        if left <= 0:
            remove_placement_group(group)
            raise PlacementTimeout(
                f"{count} worker(s) on nodes {', '.join(n.name for n in nodes)} could not "
                f"be reserved within {timeout_s:g} s (the placement deadline, "
                "health.startup.placement_s): their resources are in use",
                available=placeable_nodes(cfg, now, evicted, held),
                existing=len(eligible_nodes(cfg, now, evicted)),
            )
        alive = {n.node_id for n in now}
        if any(n.node_id not in alive for n in nodes):
            remove_placement_group(group)  # pinned to a node that died: choose again
            return None


def place(cfg: JobConfig, *, evicted: Iterable[str] = (), timeout_s: float = 60.0,
          name: str = "", held: Iterable[str] = (), cancelled: Callable[[], bool] | None = None) -> Placement:
    """Reserve the job's workers on chosen nodes (see the module docstring). `held`: the nodes
    of the job's own placement, just given back. `cancelled`: asked between looks at a pending
    reservation; True gives it up (PlacementCancelled): a stop request must not wait out the
    timeout, or a scheduler's grace period runs out first."""
    deadline = time.monotonic() + timeout_s
    while True:
        nodes = choose_nodes(cfg, alive_nodes(), evicted, held)
        group = _reserve(cfg, nodes, name, deadline, timeout_s, evicted, (), cancelled)
        if group is not None:
            return Placement([group], tuple(n.node_id for n in nodes), cfg.cluster.workers_per_node,
                             {n.node_id: n.name for n in nodes})


def place_again(placement: Placement, cfg: JobConfig, indices: Iterable[int], *, evicted: Iterable[str] = (),
                timeout_s: float = 60.0, name: str = "",
                cancelled: Callable[[], bool] | None = None) -> Placement:
    """The job's placement with the nodes at `indices` (lost or evicted) replaced by others,
    reserved together in a group of their own; every other rank keeps its bundle (see the module
    docstring). `placement` is left as it was, groups included: on success the caller drops it
    for the returned one, whose groups no longer in use are removed here; on a raise (the
    errors of `place`, counted as a whole placement would) nothing new is held."""
    indices = sorted(set(indices))
    kept = [node for i, node in enumerate(placement.node_ids) if i not in indices]
    deadline = time.monotonic() + timeout_s
    while True:
        nodes = choose_nodes(cfg, alive_nodes(), evicted, taken=kept)
        group = _reserve(cfg, nodes, name, deadline, timeout_s, evicted, kept, cancelled)
        if group is not None:
            break
    node_ids, names = list(placement.node_ids), dict(placement.names)
    groups, slots = [*placement.groups, group], list(placement.slots)
    per_node = placement.workers_per_node
    for j, (index, node) in enumerate(zip(indices, nodes, strict=True)):
        node_ids[index], names[node.node_id] = node.node_id, node.name
        for k, rank in enumerate(placement.ranks_on(index)):
            slots[rank] = (len(groups) - 1, j * per_node + k)
    used = sorted({g for g, _ in slots})
    remove_groups(old for g, old in enumerate(groups) if g not in used)  # no rank uses them any more
    renumber = {g: i for i, g in enumerate(used)}
    return Placement([groups[g] for g in used], tuple(node_ids), per_node,
                     {n: names[n] for n in node_ids}, [(renumber[g], b) for g, b in slots])


def bundle_nodes(placement: Placement) -> list[str]:
    """The node id each rank's bundle was actually reserved on (Ray's own record)."""
    tables: list[dict[str, Any]] = [ray.util.placement_group_table(g)["bundles_to_node_id"]
                                    for g in placement.groups]
    return [tables[g][b] for g, b in placement.slots]
