"""The job controller: place, diagnose, rendezvous, run, watch, and recover, attempt after attempt.

    PENDING -> PLACING -> DIAGNOSING -> RENDEZVOUS -> RUNNING -> SUCCEEDED
                  ^                                    |
                  +------------- RECOVERING <----------+

One attempt is one set of worker actors in one placement group. While it runs, the
controller polls every `health.heartbeat_interval_s`: Ray tells it which actors ended (and
how), the heartbeats tell the monitor who is dead, hung, slow or producing NaNs. Faults go to
the policy, which answers continue, restart (optionally evicting nodes) or give up. A restart
kills the whole worker group, returns its placement, and starts the next attempt from the
newest committed checkpoint under a new attempt id (fresh rendezvous namespace, fresh
heartbeat keys), on nodes that exclude every evicted one.

Everything the next controller needs lives in Redis under the job's prefix: the record (state,
attempt, step), the event log, the restart history (the budget's memory) and the evicted
nodes. A controller that dies and is started again with the same job name continues with the
next attempt instead of starting over.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import ray
import redis
from ray.exceptions import RayActorError, RayError, RayTaskError

from longrun.config import JobConfig
from longrun.controller.job_state import JobRecordStore
from longrun.controller.placement import (
    Placement,
    PlacementImpossible,
    PlacementTimeout,
    place,
    worker_bundle,
)
from longrun.controller.state import JobState, JobStateMachine
from longrun.controller.workers import TrainWorker
from longrun.health.heartbeat import read_heartbeats
from longrun.health.monitor import HealthMonitor
from longrun.health.policy import Action, Decision, Incident, RestartRecord, decide

log = logging.getLogger(__name__)


class JobFailed(RuntimeError):
    """The job ended in FAILED; the message is the reason an operator reads."""


@dataclass
class Attempt:
    number: int
    placement: Placement
    actors: list[Any]
    runs: dict[Any, int] = field(default_factory=dict)  # pending run() ref -> rank
    summaries: dict[int, dict] = field(default_factory=dict)
    resume_before_step: int | None = None
    monitor: HealthMonitor | None = None  # one per attempt: what it learned survives a CONTINUE


def worker_options(cfg: JobConfig) -> dict[str, float]:
    """The actor's resources: exactly its placement bundle."""
    bundle = worker_bundle(cfg)
    return {"num_cpus": bundle.get("CPU", 0.0), "num_gpus": bundle.get("GPU", 0.0)}


class Controller:
    def __init__(self, cfg: JobConfig, redis_url: str, *, poll_s: float | None = None,
                 on_event: Callable[[str], None] | None = None, placement_timeout_s: float = 120.0,
                 clock: Callable[[], float] = time.monotonic):
        self.cfg = cfg
        self.redis_url = redis_url
        self.client = redis.Redis.from_url(redis_url)
        self.record = JobRecordStore(self.client, cfg.job.name)
        self.machine = JobStateMachine()
        self.poll_s = poll_s or cfg.health.heartbeat_interval_s
        self.placement_timeout_s = placement_timeout_s
        self.on_event = on_event or (lambda line: log.info("%s", line))
        self.clock = clock
        self.attempt_number = 0

    # -- bookkeeping -------------------------------------------------------------------------
    def _move(self, target: JobState, reason: str) -> None:
        self.record.record_transition(self.machine.transition(target, reason), self.attempt_number)
        self.on_event(f"state {target}: {reason}")

    def _event(self, kind: str, message: str, **extra: Any) -> None:
        self.record.event(kind, self.attempt_number, message, **extra)
        self.on_event(f"{kind}: {message}")

    def _history(self) -> list[RestartRecord]:
        return [RestartRecord.from_dict(r) for r in self.record.restarts()]

    def _resume_point(self) -> None:
        """Pick the attempt number. Attempt ids are never reused under one job name (stale keys
        of an old attempt must not meet a new one). A previous controller that did not finish
        is continued: same history, same evictions, the next attempt. A finished job's name
        starts a new run with a clean history."""
        previous = self.record.read()
        if previous is None:
            return
        self.attempt_number = previous.attempt + 1
        if previous.state.terminal:
            self.record.reset()
            return
        self._event("resume", f"a previous controller ran attempts up to {previous.attempt} "
                    f"(last state {previous.state}); continuing with attempt {self.attempt_number}")

    # -- one attempt -------------------------------------------------------------------------
    def _start_attempt(self, resume_before_step: int | None) -> Attempt:
        evicted = self.record.evicted()
        self._move(JobState.PLACING, f"placing {self.cfg.world_size} worker(s) on "
                   f"{self.cfg.cluster.nodes} node(s), {len(evicted)} evicted")
        placement = place(self.cfg, evicted=evicted, timeout_s=self.placement_timeout_s,
                          name=f"longrun-{self.cfg.job.name}-a{self.attempt_number}")
        actor_cls = ray.remote(max_restarts=0, max_concurrency=2)(TrainWorker)
        config = self.cfg.model_dump(mode="json")
        actors = [
            actor_cls.options(
                name=f"longrun-{self.cfg.job.name}-a{self.attempt_number}-r{rank}",
                scheduling_strategy=placement.strategy(rank), **worker_options(self.cfg),
            ).remote(config, rank, self.attempt_number, self.redis_url, list(placement.node_ids),
                     resume_before_step)
            for rank in range(self.cfg.world_size)
        ]
        self.record.update(nodes=list(placement.node_ids))
        return Attempt(self.attempt_number, placement, actors, resume_before_step=resume_before_step)

    def _diagnose(self, attempt: Attempt) -> dict[str, str]:
        """Node id -> reason, for every node with a failing worker."""
        if not self.cfg.recovery.diagnostics:
            return {}
        self._move(JobState.DIAGNOSING, f"self-checks: {', '.join(self.cfg.recovery.diagnostics)}")
        reports = ray.get([a.diagnose.remote() for a in attempt.actors], timeout=300)
        failed = {r["node"]: f"rank {r['rank']}: {r['reason']}" for r in reports if not r["ok"]}
        for node, reason in failed.items():
            self._event("diagnostics_failed", f"node {node[:12]} failed its self-check ({reason})",
                        node=node)
        return failed

    def _stop_attempt(self, attempt: Attempt) -> None:
        for actor in attempt.actors:
            ray.kill(actor, no_restart=True)
        try:
            attempt.placement.remove()
        except Exception as exc:  # the group may already be gone with its node
            log.warning("removing placement group: %s", exc)

    def _watch(self, attempt: Attempt) -> list[Incident]:
        """Poll until every rank finished (returns []) or something went wrong (the incidents)."""
        if attempt.monitor is None:
            attempt.monitor = HealthMonitor(self.cfg.world_size, self.cfg.health, started_at=self.clock())
        monitor = attempt.monitor
        ranks = range(self.cfg.world_size)
        incidents: list[Incident] = []
        settle_until: float | None = None
        while attempt.runs:
            done, _ = ray.wait(list(attempt.runs), num_returns=len(attempt.runs), timeout=self.poll_s)
            now, wall = self.clock(), time.time()  # the monitor's clock; the policy's (persisted)
            for ref in done:
                rank = attempt.runs.pop(ref)
                incident = self._outcome(attempt, ref, rank, wall)
                if incident is not None:
                    incidents.append(incident)
                else:
                    monitor.finished(rank)
            try:
                beats = read_heartbeats(self.client, self.cfg.job.name, attempt.number, ranks)
            except (redis.RedisError, OSError):
                monitor.store_unreachable(now)
                beats = None
            if beats is not None:
                faults = monitor.observe(beats, now)
                incidents += [Incident(kind=str(f.kind), rank=f.rank,
                                       node=attempt.placement.node_of(f.rank) if f.rank is not None else None,
                                       step=f.step, at=wall, detail=f.detail) for f in faults]
                if any(b is not None for b in beats.values()):
                    self._progress(beats)
            if incidents:
                # An exception on a healthy rank is usually the echo of a peer's death (its
                # collective failed): give the cause up to a heartbeat timeout to show itself,
                # so the policy blames the dead rank's node, not the messenger.
                if any(i.kind != "exception" for i in incidents):
                    return incidents
                settle_until = settle_until or now + self.cfg.health.heartbeat_timeout_s
                if now >= settle_until:
                    return incidents
        return incidents

    def _progress(self, beats) -> None:
        live = [b for b in beats.values() if b is not None]
        first = min(live, key=lambda b: b.rank)
        self.record.update(step=min(b.step for b in live), loss=first.loss, phase=first.phase)

    def _outcome(self, attempt: Attempt, ref, rank: int, now: float) -> Incident | None:
        node = attempt.placement.node_of(rank)
        try:
            attempt.summaries[rank] = ray.get(ref)
            return None
        except RayTaskError as exc:
            cause = exc.cause if getattr(exc, "cause", None) is not None else exc
            kind = "nan" if type(cause).__name__.startswith("NonFinite") else "exception"
            step = getattr(cause, "step", None)
            text = str(cause).strip().splitlines()[-1] if str(cause).strip() else type(cause).__name__
            return Incident(kind=kind, rank=rank, node=node, step=step, at=now,
                            detail=f"rank {rank} raised {type(cause).__name__}: {text}")
        except RayActorError as exc:
            return Incident(kind="dead", rank=rank, node=node, step=None, at=now,
                            detail=f"rank {rank}'s process died ({type(exc).__name__})")
        except RayError as exc:  # e.g. an exception Ray could not bring back: still a failure
            text = str(exc).strip().splitlines()[-1] if str(exc).strip() else type(exc).__name__
            return Incident(kind="exception", rank=rank, node=node, step=None, at=now,
                            detail=f"rank {rank} failed: {text[:300]}")

    # -- the whole job -----------------------------------------------------------------------
    def run(self) -> dict[str, Any]:
        """Run the job to its end; the summary of rank 0, or JobFailed with the reason."""
        self._resume_point()
        self.record.update(steps=self.cfg.training.steps, world_size=self.cfg.world_size)
        resume_before: int | None = None
        try:
            while True:
                try:
                    attempt = self._start_attempt(resume_before)
                except PlacementImpossible as exc:
                    self._move(JobState.FAILED, str(exc))
                    raise JobFailed(str(exc)) from exc
                except PlacementTimeout as exc:
                    decision = self._decide([Incident(kind="exception", rank=None, node=None, step=None,
                                                      at=time.time(), detail=str(exc))], {})
                    self._recover_or_fail(None, decision)
                    continue
                failed_nodes = self._diagnose(attempt)
                if failed_nodes:
                    decision = self._decide([], failed_nodes)
                else:
                    self._move(JobState.RENDEZVOUS, f"forming groups of {self.cfg.world_size} rank(s)")
                    attempt.runs = {a.run.remote(): r for r, a in enumerate(attempt.actors)}
                    self._move(JobState.RUNNING, "training")
                    decision = None
                    while incidents := self._watch(attempt):
                        for incident in incidents:
                            self._event("fault", incident.detail, fault=incident.kind,
                                        rank=incident.rank, node=incident.node, step=incident.step)
                        decision = self._decide(incidents, {})
                        if decision.action is not Action.CONTINUE:
                            break
                        self._event("decision", decision.reason)  # reported; keep watching
                    else:
                        return self._succeed(attempt)
                self._stop_attempt(attempt)
                resume_before = self._recover_or_fail(attempt, decision)
        except KeyboardInterrupt:
            self._move(JobState.STOPPED, "interrupted by the user")
            raise
        finally:
            self.client.close()

    def _decide(self, incidents: list[Incident], failed_nodes: dict[str, str]) -> Decision:
        return decide(incidents, self._history(), self.cfg.recovery, now=time.time(),
                      failed_diagnostics=failed_nodes)

    def _recover_or_fail(self, attempt: Attempt | None, decision: Decision) -> int | None:
        self._event("decision", decision.reason, action=str(decision.action))
        if decision.action is Action.GIVE_UP:
            self._move(JobState.FAILED, decision.reason)
            raise JobFailed(decision.reason)
        for node in decision.evict_nodes:
            self.record.evict(node, decision.reason)
            self._event("evicted", f"node {node[:12]} will not be used again", node=node)
        self.record.add_restart(RestartRecord.of(decision, at=time.time()).to_dict())
        self._move(JobState.RECOVERING, decision.reason)
        if decision.backoff_s:
            time.sleep(decision.backoff_s)  # pacing restarts is the point here, not synchronisation
        self.attempt_number += 1
        return decision.resume_before_step

    def _succeed(self, attempt: Attempt) -> dict[str, Any]:
        summary = attempt.summaries[0]
        self.record.update(step=summary["step"], loss=summary["loss"])
        self._move(JobState.SUCCEEDED, f"finished {summary['step']} steps in attempt {attempt.number}")
        self._stop_attempt(attempt)
        return summary | {"attempt": attempt.number, "restarts": len(self.record.restarts()),
                          "evicted": sorted(self.record.evicted())}


def job_status(client: redis.Redis, job: str, events: int = 10) -> dict[str, Any]:
    """What `longrun status` shows: state, attempt, step, evicted nodes and the last events."""
    store = JobRecordStore(client, job)
    record = store.read()
    if record is None:
        return {"job": job, "state": None}
    return {"job": job, "state": str(record.state), "attempt": record.attempt, "step": record.step,
            "fields": {k: v for k, v in record.fields.items() if k not in ("state", "attempt", "step")},
            "evicted": store.evicted(), "restarts": len(store.restarts()),
            "events": store.events(events)}

