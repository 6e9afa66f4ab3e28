"""Elastic continuation, the controller's side: the configs a job may run at, and how long it
has been short of nodes. What to do is health/scaling.py's decision; the controller carries it
out (controller.py).

`resized(cfg, n)` is the job at n nodes: cluster.nodes = n, parallelism.dp (then fsdp) shrunk
so the world still fills the nodes, and training.global_batch_tokens pinned to the configured
job's global batch, so every size trains the same batches with the same optimizer trajectory
(the trainer splits one global batch over however many ranks there are). It is validated like
any config: a size another check refuses (a CP budget, a head count) is no size at all.

    sizing = Sizing.of(cfg)                   # None when recovery.min_nodes is unset
    decision, smaller = sizing.short(available=2, now=clock())  # WAIT, SHRINK (+ its config), GIVE_UP
    sizing.short(available=1, now=clock(), existing=3)          # WAIT: two nodes are busy, not gone
    sizing.running(current=2, available=3)    # GROW once the configured size fits again
"""

from __future__ import annotations

import logging
from dataclasses import replace

from longrun.config import ConfigError, JobConfig, config_from_dict
from longrun.health.scaling import Resize, ScalingPolicy, SizeDecision, shrunk_degrees

__all__ = ["Sizing", "candidate_sizes", "layout_key", "resized"]
log = logging.getLogger(__name__)


def layout_key(cfg: JobConfig) -> tuple:
    """What a rank's state depends on: its world and parallel degrees. Two configs with the same
    key hold the same per-rank pieces (memory snapshots of one fit the other)."""
    return (cfg.cluster.nodes, cfg.cluster.workers_per_node, tuple(sorted(cfg.dims.degrees.items())))


def candidate_sizes(cfg: JobConfig) -> frozenset[int]:
    """Node counts from recovery.min_nodes up to (not including) cluster.nodes whose world the
    data-parallel degrees can express (`shrunk_degrees`); empty when not elastic."""
    least = cfg.recovery.min_nodes
    if least is None:
        return frozenset()
    dims, per_node = cfg.dims, cfg.cluster.workers_per_node
    fixed = dims.cp * dims.tp * dims.pp
    return frozenset(n for n in range(least, cfg.cluster.nodes)
                     if shrunk_degrees(dims.dp, dims.fsdp, fixed, n * per_node) is not None)


def resized(cfg: JobConfig, nodes: int) -> JobConfig:
    """`cfg` at `nodes` nodes (see the module docstring); ConfigError when the smaller layout
    is refused, ValueError when the data-parallel degrees cannot express it."""
    if nodes == cfg.cluster.nodes:
        return cfg
    dims, per_node = cfg.dims, cfg.cluster.workers_per_node
    workers = nodes * per_node
    degrees = shrunk_degrees(dims.dp, dims.fsdp, dims.cp * dims.tp * dims.pp, workers)
    if degrees is None:
        raise ValueError(f"{workers} ranks on {nodes} node(s) cannot be laid out by shrinking "
                         f"parallelism.dp ({dims.dp}) and parallelism.fsdp ({dims.fsdp}) alone")
    data = cfg.model_dump(mode="json")
    data["cluster"]["nodes"] = nodes
    data["parallelism"]["dp"], data["parallelism"]["fsdp"] = degrees
    # The configured job's batch, resolved at its own layout: not the smaller world's default.
    data["training"]["global_batch_tokens"] = cfg.global_batch_tokens
    # The size is the controller's to choose; a derived config is one fixed size (its own
    # elastic settings would be checked against the shrunk degrees, which is not the question).
    data["recovery"]["min_nodes"] = None
    # Injected faults (tests) of ranks the smaller world does not have cannot fire.
    data["health"]["faults"] = [f for f in data["health"]["faults"] if f["rank"] < workers]
    return config_from_dict(data, source=f"job {cfg.job.name} resized to {nodes} node(s)")


class Sizing:
    """One elastic job's sizes across attempts: the policy, the smaller configs it picks from,
    and since when the configured size could not be placed (monotonic seconds)."""

    def __init__(self, cfg: JobConfig):
        self.cfg = cfg
        self.policy = ScalingPolicy(cfg.cluster.nodes, cfg.recovery.min_nodes, cfg.recovery.shrink_after_s,
                                    candidate_sizes(cfg))
        self.short_since: float | None = None
        self._layouts: dict[int, JobConfig] = {cfg.cluster.nodes: cfg}

    @classmethod
    def of(cls, cfg: JobConfig) -> Sizing | None:
        return cls(cfg) if cfg.recovery.min_nodes is not None else None

    def short(self, available: int | None, now: float, *, existing: int | None = None,
              since: float | None = None) -> tuple[SizeDecision, JobConfig | None]:
        """The configured size could not be placed (now, on the monotonic clock; the try began
        at `since`, so a placement that timed out counts its wait): `available` nodes can be
        placed now, `existing` exist at all (busy ones included). The policy's decision, with
        the config to run when it is SHRINK. A size whose config is refused is dropped and the
        policy asked again (it then picks a smaller one or gives up)."""
        if self.short_since is None:
            self.short_since = now if since is None else since
        while True:
            decision = self.policy.short(available, now - self.short_since, existing)
            if decision.action is not Resize.SHRINK:
                return decision, None
            try:
                return decision, self.layout(decision.nodes)
            except (ConfigError, ValueError) as exc:
                log.warning("job %s cannot run on %d node(s): %s", self.cfg.job.name, decision.nodes, exc)
                self.policy = replace(self.policy, sizes=self.policy.sizes - {decision.nodes})

    def placed_in_full(self) -> None:
        """The configured size was placed: the job is no longer short of nodes."""
        self.short_since = None

    def running(self, current: int, available: int | None) -> SizeDecision:
        return self.policy.running(current, available)

    def layout(self, nodes: int) -> JobConfig:
        if nodes not in self._layouts:
            self._layouts[nodes] = resized(self.cfg, nodes)
        return self._layouts[nodes]
