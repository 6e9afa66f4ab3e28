"""A simulated fleet: N ranks on N/8 nodes beating into a real Redis, watched by the real
controller-side code, with faults injected at random times and their detection timed.

    fleet = Fleet(FleetSpec(ranks=4096, seed=1), redis_url)
    report = fleet.run()          # FleetReport: each fault's detection, poll times, CPU, Redis

Two processes, so the controller's CPU is its own. The *fleet* process plays every rank and
every node's agent: ranks step at their own pace (log-normal step times), and each node's
record (health/node_beats.py, the format the real agents publish) goes to Redis every
interval, or at once when one of its ranks dies (the real agent looks at its ranks' processes
every 0.1 s and publishes on a death; the fleet ticks as often). The *controller* side, in the
calling process, runs the controller's own `Watcher` each poll (the per-node reader, the
monitor, a silent agent declared as its node, the straggler report) with the listeners whose
work grows with the ranks (the per-rank heartbeat series, the job record's progress), then the
policy's `decide`; it times each poll and notes when each injected fault is first declared.

Faults (`FaultPlan.kind`), each at a random moment after the warm-up, on a random rank or node:
- dead: the rank's process exits (its agent leaves it out of the next record);
- hang: the rank keeps beating but its step stops;
- nan: the rank reports a non-finite loss from its next step on;
- straggler: the rank's steps take `slow_factor` x as long;
- slow_data: the rank's steps take `slow_factor` x as long, and so does its data's cost;
- slow_node: every rank of the node takes `slow_factor` x as long;
- node: the node's agent stops publishing (a lost node, or a dead agent).
The moment a fault is injected is ground truth written by the fleet to Redis (wall clock, one
host), so detection latency is measured from the fault itself, not from a signal on a timer.
"""

from __future__ import annotations

import json
import multiprocessing
import statistics
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
import redis

from longrun import keys
from longrun.config import JobConfig, config_from_dict
from longrun.config.sections import HealthSection, RecoverySection
from longrun.controller.attempt import Attempt
from longrun.controller.job_state import JobRecordStore
from longrun.controller.listeners import Listeners, MetricsListener, ProgressRecord
from longrun.controller.watch import Watcher
from longrun.health.beat_columns import phase_code
from longrun.health.decisions import Incident
from longrun.health.node_beats import ROW, encode
from longrun.health.policy import decide
from longrun.kinds import FaultKind
from longrun.observability.controller_metrics import ControllerMetrics

KINDS = ("dead", "hang", "nan", "straggler", "slow_data", "slow_node", "node")
TICK_S = 0.1  # the fleet's clock: a real agent looks at its ranks' processes this often
# What each injected kind is declared as (a slow node is declared on its ranks).
DECLARED_AS = {"dead": FaultKind.DEAD, "hang": FaultKind.HANG, "nan": FaultKind.NAN,
               "straggler": FaultKind.STRAGGLER, "slow_data": FaultKind.STRAGGLER,
               "slow_node": FaultKind.STRAGGLER, "node": FaultKind.NODE_LOST}


@dataclass(frozen=True)
class FaultPlan:
    kind: str
    at_s: float  # seconds after the fleet starts
    rank: int  # the rank (for node faults: a rank of the node)


@dataclass(frozen=True)
class FleetSpec:
    ranks: int
    per_node: int = 8
    interval_s: float = 1.0  # heartbeat interval = the controller's poll
    timeout_s: float = 5.0
    step_s: float = 1.0  # median step time
    step_sigma: float = 0.05  # log-normal spread of step times
    hang_min_s: float = 10.0
    straggler_patience: int = 5
    slow_factor: float = 2.0
    warmup_s: float = 8.0  # before the first fault: every rank seen, hang timeouts learned
    spacing_s: float = 20.0  # between faults: each is declared before the next
    kinds: tuple[str, ...] = ("dead", "hang", "nan", "straggler", "node")
    seed: int = 0
    job: str = "fleet"

    def __post_init__(self) -> None:
        if self.ranks % self.per_node:
            raise ValueError(f"ranks ({self.ranks}) must be a multiple of per_node ({self.per_node})")
        unknown = set(self.kinds) - set(KINDS)
        if unknown:
            raise ValueError(f"unknown fault kind(s) {sorted(unknown)}; use {', '.join(KINDS)}")

    @property
    def nodes(self) -> int:
        return self.ranks // self.per_node

    def job_config(self) -> JobConfig:
        """A job of this many ranks, heartbeats through node agents, as the controller reads it."""
        return config_from_dict({
            "job": {"name": self.job}, "cluster": {"nodes": self.nodes, "workers_per_node": self.per_node},
            "parallelism": {"dp": self.ranks},
            "health": self.health.model_dump() | {"node_agents": "on"}})

    @property
    def health(self) -> HealthSection:
        return HealthSection(heartbeat_interval_s=self.interval_s, heartbeat_timeout_s=self.timeout_s,
                             hang_min_s=self.hang_min_s, straggler_patience=self.straggler_patience)

    def plan(self) -> list[FaultPlan]:
        """One fault of each kind, in a random order, at random moments within their slots, on
        ranks of distinct nodes."""
        rng = np.random.default_rng(self.seed)
        order = rng.permutation(len(self.kinds))
        nodes = rng.choice(self.nodes, size=len(self.kinds), replace=False)
        return [FaultPlan(self.kinds[k], self.warmup_s + i * self.spacing_s + float(rng.uniform(0, 2)),
                          int(nodes[i]) * self.per_node + int(rng.integers(self.per_node)))
                for i, k in enumerate(order)]

    @property
    def duration_s(self) -> float:
        """Until the last fault had time to be declared: its slot, or the longest detection."""
        slowest = max(self.hang_min_s, self.timeout_s,
                      self.straggler_patience * self.step_s * self.slow_factor) + 3 * self.interval_s
        return self.warmup_s + (len(self.kinds) - 1) * self.spacing_s + 2.0 + max(self.spacing_s, slowest)


@dataclass
class Detection:
    kind: str
    rank: int
    injected_at: float  # wall clock
    declared_at: float | None = None
    declared_kind: str | None = None
    declared_rank: int | None = None
    declared_node: str | None = None
    action: str | None = None  # what the policy decided on it
    blame: str | None = None  # a straggler's attributed cause (node, data, stage, rank)
    detail: str | None = None  # the monitor's words (a hang's: the timeout it applied, and why)

    @property
    def latency_s(self) -> float | None:
        return None if self.declared_at is None else self.declared_at - self.injected_at


@dataclass
class FleetReport:
    ranks: int
    nodes: int
    polls: int
    poll_ms: list[float] = field(default_factory=list)  # wall time of each poll (Redis included)
    poll_cpu_ms: list[float] = field(default_factory=list)  # the controller's CPU time of each poll
    cpu_s: float = 0.0
    wall_s: float = 0.0
    redis_bytes: int = 0
    redis_commands_per_s: float = 0.0
    detections: list[Detection] = field(default_factory=list)
    false_alarms: list[str] = field(default_factory=list)

    @property
    def cpu_share(self) -> float:
        return self.cpu_s / self.wall_s if self.wall_s else 0.0

    def latency(self, kind: str) -> float | None:
        found = [d.latency_s for d in self.detections if d.kind == kind and d.latency_s is not None]
        return found[0] if found else None

    def summary(self) -> dict[str, Any]:
        out = {"ranks": self.ranks, "nodes": self.nodes, "polls": self.polls,
               "poll_ms_p50": _at(self.poll_ms, 50), "poll_ms_p99": _at(self.poll_ms, 99),
               "poll_cpu_ms_p50": _at(self.poll_cpu_ms, 50), "poll_cpu_ms_p99": _at(self.poll_cpu_ms, 99),
               "controller_cpu_share": round(self.cpu_share, 4),
               "redis_mib": round(self.redis_bytes / 2**20, 1),
               "redis_commands_per_s": round(self.redis_commands_per_s, 1),
               "false_alarms": len(self.false_alarms)}
        for d in self.detections:
            out[f"detect_{d.kind}_s"] = None if d.latency_s is None else round(d.latency_s, 3)
        return out


def _at(values: Sequence[float], q: float) -> float | None:
    return round(float(np.percentile(values, q)), 2) if len(values) else None


def _truth_key(job: str) -> str:
    return f"{keys.job_prefix(job)}fleet:truth"


# ---- the fleet process ---------------------------------------------------------------------

def play_fleet(spec: FleetSpec, redis_url: str, ready: Any, go: Any, start: Any) -> None:
    """Play every rank and agent until the spec's duration is over (run in its own process):
    tell `ready` once imported, then begin at the wall time `start` holds once `go` is set."""
    client = redis.Redis.from_url(redis_url)
    ready.set()
    go.wait()
    start_wall = start.value
    rng = np.random.default_rng(spec.seed + 1)
    n, per = spec.ranks, spec.per_node
    base = spec.step_s * rng.lognormal(0.0, spec.step_sigma, n)  # each rank's own pace
    factor = np.ones(n)
    step = np.zeros(n, np.int64)
    step_started = np.full(n, start_wall)
    alive, hung, nan = np.ones(n, bool), np.zeros(n, bool), np.zeros(n, bool)
    agent_up = np.ones(spec.nodes, bool)
    cost = np.ones(n)
    rows = np.zeros(n, ROW)
    rows["rank"] = np.arange(n)
    rows["pp_stage"] = -1
    rows["phase"] = phase_code("forward")
    plans = sorted(spec.plan(), key=lambda p: p.at_s)
    key = [keys.node_beats_key(spec.job, 0, node) for node in range(spec.nodes)]
    px = int(spec.timeout_s * 1000)
    next_publish = start_wall + spec.interval_s * rng.random(spec.nodes)  # each agent's own phase
    while (now := time.time()) < start_wall + spec.duration_s:
        urgent: set[int] = set()
        while plans and now >= start_wall + plans[0].at_s:
            p = plans.pop(0)
            node = p.rank // per
            if p.kind == "dead":
                alive[p.rank] = False
                urgent.add(node)
            elif p.kind == "hang":
                hung[p.rank] = True
            elif p.kind == "nan":
                nan[p.rank] = True
            elif p.kind in ("straggler", "slow_data"):
                factor[p.rank] = spec.slow_factor
                if p.kind == "slow_data":
                    cost[p.rank] = spec.slow_factor
            elif p.kind == "slow_node":
                factor[node * per:(node + 1) * per] = spec.slow_factor
            elif p.kind == "node":
                agent_up[node] = False
            client.hset(_truth_key(spec.job), f"{p.kind}:{p.rank}", repr(now))
        took = base * factor
        done = alive & ~hung & (now - step_started >= took)
        step[done] += 1
        step_started[done] = now
        rows["step"] = step
        rows["step_time_s"] = took
        rows["work_cost"] = cost * 1000.0
        rows["loss_finite"] = ~(nan & (step > 0))
        rows["loss"] = np.where(rows["loss_finite"], 2.0, np.nan)
        rows["sent_at"] = now
        rows["stepped_at"] = step_started  # when each rank's newest step completed
        # Each agent publishes on its own clock (started at its own moment): a tick publishes the
        # nodes whose turn it is, not all 2,048 at once, and a node with a new death at once.
        due = np.flatnonzero(now >= next_publish)
        next_publish[due] = now + spec.interval_s
        pipe = client.pipeline(transaction=False)
        for node in sorted(set(due.tolist()) | urgent):
            if agent_up[node]:
                mine = rows[node * per:(node + 1) * per]
                pipe.set(key[node], encode(node, now, mine[alive[node * per:(node + 1) * per]]), px=px)
        pipe.execute()
        time.sleep(max(0.0, TICK_S - (time.time() - now)))


# ---- the controller's side -------------------------------------------------------------------

class FleetGroup:
    """The worker group as the watcher sees it: `poll` waits for the next interval (as Ray's
    wait on the ranks' runs does) and no rank ever ends; node `node-K` holds ranks 8K..8K+7."""

    def __init__(self, spec: FleetSpec, start_wall: float):
        self.spec, self.waited_s = spec, 0.0
        self.node_ids = tuple(f"node-{k}" for k in range(spec.nodes))
        self.node_names: dict[str, str] = {}  # named by their ids
        self.pids: dict[int, int] = {}
        self._next = time.monotonic() + max(0.0, start_wall - time.time())

    def node_of(self, rank: int) -> str:
        return self.node_ids[rank // self.spec.per_node]

    def poll(self, timeout_s: float) -> list:
        began = time.monotonic()
        time.sleep(max(0.0, self._next - began))
        self._next = max(self._next + timeout_s, time.monotonic())
        self.waited_s = time.monotonic() - began
        return []

    def running(self) -> int:
        return self.spec.ranks


class Fleet:
    def __init__(self, spec: FleetSpec, redis_url: str):
        self.spec, self.redis_url = spec, redis_url

    def run(self, progress: Any = None) -> FleetReport:
        spec = self.spec
        client = redis.Redis.from_url(self.redis_url)
        client.delete(_truth_key(spec.job))
        mp = multiprocessing.get_context("spawn")
        ready, go, start = mp.Event(), mp.Event(), mp.Value("d", 0.0)
        proc = mp.Process(target=play_fleet, args=(spec, self.redis_url, ready, go, start), daemon=True)
        proc.start()
        if not ready.wait(timeout=300):
            proc.kill()
            raise RuntimeError("the fleet process did not start within 300 s")
        start_wall = start.value = time.time() + 0.2  # both sides begin together
        go.set()
        try:
            report = self._watch(client, start_wall, progress)
        finally:
            proc.join(timeout=10.0)  # its loop ends with the watcher's
            if proc.is_alive():
                proc.kill()
                proc.join()
        if proc.exitcode not in (0, -9):  # it raised: what the watcher saw was no fleet at all
            raise RuntimeError(f"the fleet process failed (exit code {proc.exitcode}): see its traceback")
        return report

    def _watch(self, client: redis.Redis, start_wall: float, progress: Any) -> FleetReport:
        spec = self.spec
        group = FleetGroup(spec, start_wall)
        cfg = spec.job_config()
        # The controller's own pieces: its watcher, listeners that scale with the ranks (the
        # per-rank heartbeat series, the job record's progress, straggler reports), the policy.
        record = JobRecordStore(client, spec.job)
        metrics = MetricsListener(ControllerMetrics(spec.job), record, cfg)
        listeners = Listeners([metrics, ProgressRecord(record)])
        watcher = Watcher(cfg, client, listeners, poll_s=spec.interval_s, clock=time.monotonic,
                          wall=time.time)
        attempt = Attempt(0)
        attempt.group = group
        attempt.watch(spec.ranks, spec.health, time.monotonic())
        attempt.monitor.startup_grace_s = spec.warmup_s
        report = FleetReport(spec.ranks, spec.nodes, 0)
        declared: list[tuple[float, Incident, str]] = []
        time.sleep(max(0.0, start_wall - time.time()))
        stats0, cpu0, wall0 = client.info("stats"), time.process_time(), time.time()
        while time.time() < start_wall + spec.duration_s:
            t0, c0 = time.perf_counter(), time.process_time()
            incidents = watcher.poll(attempt) or []  # waits in group.poll for the next interval
            took, cpu = time.perf_counter() - t0 - group.waited_s, time.process_time() - c0
            if incidents:
                # The policy's answer to each incident on its own: the fleet never restarts, so a
                # fault still in force (a NaN every step) would otherwise answer for the next one.
                wall = time.time()
                recovery = RecoverySection()
                declared += [(wall, i, str(decide([i], [], recovery, now=wall, spare_nodes=1).action))
                             for i in incidents]
                took, cpu = time.perf_counter() - t0 - group.waited_s, time.process_time() - c0
            report.poll_ms.append(took * 1000)
            report.poll_cpu_ms.append(cpu * 1000)
            report.polls += 1
            if progress is not None and report.polls % 10 == 0:
                progress(f"{spec.ranks} ranks: {report.polls} polls, p50 "
                         f"{statistics.median(report.poll_ms):.1f} ms, {len(declared)} incident(s)")
        report.cpu_s, report.wall_s = time.process_time() - cpu0, time.time() - wall0
        stats1 = client.info("stats")
        report.redis_commands_per_s = (stats1["total_commands_processed"]
                                       - stats0["total_commands_processed"]) / report.wall_s
        report.redis_bytes = int(client.info("memory")["used_memory"])
        self._match(report, client, declared)
        return report

    def _match(self, report: FleetReport, client: redis.Redis, declared: Sequence[tuple]) -> None:
        """Each injected fault against the first incident that names it; the rest are false alarms."""
        truth = {k.decode(): float(v) for k, v in client.hgetall(_truth_key(self.spec.job)).items()}
        per = self.spec.per_node
        used: set[int] = set()
        for plan in sorted(self.spec.plan(), key=lambda p: p.at_s):
            d = Detection(plan.kind, plan.rank, truth.get(f"{plan.kind}:{plan.rank}", float("nan")))
            for i, (wall, incident, action) in enumerate(declared):
                if i in used or incident.kind != DECLARED_AS[plan.kind]:
                    continue
                same_node = incident.node == f"node-{plan.rank // per}"
                if incident.rank == plan.rank or (plan.kind in ("node", "slow_node") and same_node) or (
                        plan.kind == "nan" and incident.step is not None):
                    d.declared_at, d.declared_kind, d.action = wall, incident.kind, action
                    d.blame, d.detail = incident.blame, incident.detail
                    d.declared_rank, d.declared_node = incident.rank, incident.node
                    used.add(i)
                    break
            report.detections.append(d)
        report.false_alarms = [f"{inc.kind} rank {inc.rank}: {inc.detail}"
                               for i, (_, inc, _) in enumerate(declared)
                               if i not in used and not _echo(inc, report.detections, per)]


def _echo(incident: Incident, detections: Sequence[Detection], per: int) -> bool:
    """An incident that follows from a fault already matched (the ranks of a lost node, a slow
    node's other ranks, the NaN reported again on a later step): not a false alarm."""
    for d in detections:
        if d.declared_at is None:
            continue
        if d.kind == "nan" and incident.kind == FaultKind.NAN:
            return True
        if incident.rank is None:
            continue
        if d.kind in ("node", "slow_node") and incident.rank // per == d.rank // per:
            return True
        if d.kind in ("dead", "hang") and incident.rank == d.rank:
            return True
    return False


def to_json(report: FleetReport) -> str:
    return json.dumps({"summary": report.summary(), "detections": [asdict(d) for d in report.detections],
                       "false_alarms": report.false_alarms})
