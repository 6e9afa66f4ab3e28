"""The heartbeat agents: one actor per node the job uses (health/node_agent.py), pinned to it.

Like the snapshot keepers they outlive attempts (an agent serves whichever attempt its ranks
beat for, so a restart on the same nodes starts none), and they are the controller's: they go
when it goes. Before an attempt's workers start, every node of its placement has a live agent
that answers, with both its threads running: a rank's first beat must find someone listening.
An agent that died (with its node, or killed) or whose thread died is replaced at the next
attempt; while the attempt runs, its death reads as its node's (the node's record expires and
the controller declares the node lost).

The agents believe beats only from the processes the controller registers (`expect`: each
rank's pid, as its actor reported it, for this attempt), and each agent's socket address, random
per agent, reaches the workers through the controller (`addresses`).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

import ray
from ray.exceptions import RayError
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from longrun.config import JobConfig
from longrun.health.node_agent import NodeAgent

log = logging.getLogger(__name__)


def agent_name(job: str, node: str) -> str:
    return f"longrun-{job}-agent-{node[:16]}"


class Agents:
    def __init__(self, cfg: JobConfig, redis_url: str):
        self.job, self.redis_url = cfg.job.name, redis_url
        self.interval_s, self.timeout_s = cfg.health.heartbeat_interval_s, cfg.health.heartbeat_timeout_s
        self._actors: dict[str, Any] = {}
        self.addresses: dict[str, str] = {}  # node -> its agent's socket address

    def ensure(self, node_ids: Iterable[str], timeout_s: float = 60.0) -> None:
        """A live, answering agent on each of `node_ids` (those that died or whose threads died
        are replaced); agents on nodes the job no longer uses are let go."""
        nodes = list(node_ids)
        for node in [n for n in self._actors if n not in nodes]:
            ray.kill(self._actors.pop(node), no_restart=True)
            self.addresses.pop(node, None)
        for node, actor in list(self._actors.items()):
            try:
                health = ray.get(actor.ping.remote(), timeout=timeout_s)
            except (RayError, ray.exceptions.GetTimeoutError) as exc:
                health = {"alive": False, "why": exc}
            if not health.get("alive"):
                log.warning("heartbeat agent on node %s is gone or broken (%s); starting another",
                            node[:12], health.get("why", "a thread of it died"))
                ray.kill(self._actors.pop(node), no_restart=True)
                self.addresses.pop(node, None)
        cls = ray.remote(num_cpus=0, max_restarts=0, max_concurrency=2)(NodeAgent)
        started = []
        for node in nodes:
            if node not in self._actors:
                self._actors[node] = cls.options(
                    name=agent_name(self.job, node), get_if_exists=True,
                    scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False),
                ).remote(self.job, node, self.redis_url, self.interval_s, self.timeout_s)
                started.append(node)
        for node, health in zip(started, ray.get([self._actors[n].ping.remote() for n in started],
                                                 timeout=timeout_s), strict=True):
            self.addresses[node] = health["address"]

    def expect(self, attempt: int, ranks: dict[str, dict[int, tuple[int, int]]],
               timeout_s: float = 60.0) -> None:
        """Tell each node's agent the ranks of `attempt` on it (node -> rank -> (pid, node
        index)): before the workers start, so their first beats count."""
        ray.get([self._actors[node].expect.remote(attempt, mine) for node, mine in ranks.items()],
                timeout=timeout_s)

    def forget(self, attempt: int, timeout_s: float = 10.0) -> None:
        """Every agent stops publishing `attempt` (ended): before its keys are deleted. One that
        does not answer is replaced at the next placement (`ensure`)."""
        refs = [actor.forget.remote(attempt) for actor in self._actors.values()]
        try:
            ray.get(refs, timeout=timeout_s)
        except (RayError, ray.exceptions.GetTimeoutError) as exc:
            log.warning("a heartbeat agent did not confirm the end of attempt %d (%s)", attempt, exc)

    def close(self) -> None:
        for actor in self._actors.values():
            ray.kill(actor, no_restart=True)
        self._actors.clear()
        self.addresses.clear()
