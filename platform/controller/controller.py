"""The job controller: place, diagnose, rendezvous, run, watch, and recover, attempt after attempt.

    PENDING -> PLACING -> DIAGNOSING -> RENDEZVOUS -> RUNNING -> SUCCEEDED
                  ^                                    |
                  +------------- RECOVERING <----------+

`step()` does the work of the current state once and makes the move it leads to; `run()`
steps until a terminal state. Each state's handler is short and named after the state, so
the controller can be driven one transition at a time against a fake worker group
(tests/test_controller_steps.py) and read as the diagram above.

One attempt is one worker group (actors in one placement group, see `workers.py`). While it
runs, each RUNNING step polls for one heartbeat interval: the group tells which ranks ended
(and how), the heartbeats tell the monitor who is dead, hung, slow or producing NaNs. Faults
go to the policy, which answers continue, restart (optionally evicting nodes) or give up. A
restart stops the whole group and starts the next attempt from the newest committed
checkpoint under a new attempt id (fresh rendezvous namespace, fresh heartbeat keys), on
nodes that exclude every evicted one.

Everything the next controller needs lives in Redis under the job's prefix: the record (state,
attempt, step), the event log, the restart history (the budget's memory) and the evicted
nodes. A controller that dies and is started again with the same job name continues with the
next attempt instead of starting over. Those writes go through a patient client that rides
out a Redis restart; the heartbeat reads fail fast and tell the monitor the store was away.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import redis

from longrun.config import JobConfig
from longrun.controller.job_state import JobRecordStore
from longrun.controller.placement import PlacementImpossible, PlacementTimeout
from longrun.controller.state import JobState, JobStateMachine
from longrun.controller.workers import Launcher, LaunchFailed, RankEnded, RayLauncher, WorkerGroup
from longrun.health.heartbeat import Heartbeat, read_heartbeats
from longrun.health.monitor import HealthMonitor
from longrun.health.policy import Action, Decision, Incident, RestartRecord, decide
from longrun.kinds import STARTING_PHASES
from longrun.observability.controller_metrics import ControllerMetrics
from longrun.observability.discovery import advertised_address, target_groups, write_file_sd
from longrun.services.redis_client import patient_client, quick_client

log = logging.getLogger(__name__)



class JobFailed(RuntimeError):
    """The job ended in FAILED; the message is the reason an operator reads."""


class StoreUnavailable(RuntimeError):
    """Redis stayed unreachable past health.store_patience_s: the job record cannot be kept."""


class Controller:
    def __init__(self, cfg: JobConfig, redis_url: str, *, poll_s: float | None = None,
                 on_event: Callable[[str], None] | None = None, placement_timeout_s: float = 120.0,
                 diagnostics_timeout_s: float = 300.0, launch: Launcher | None = None,
                 clock: Callable[[], float] = time.monotonic, wall: Callable[[], float] = time.time,
                 sleep: Callable[[float], None] = time.sleep, serve_metrics: bool = True):
        self.cfg = cfg
        self.redis_url = redis_url
        self.client = patient_client(redis_url, cfg.health.store_patience_s)  # the record path
        self.watch_client = quick_client(redis_url)  # heartbeats: a miss is retried next poll
        self.record = JobRecordStore(self.client, cfg.job.name)
        self.progress_record = JobRecordStore(self.watch_client, cfg.job.name)  # best effort, every poll
        self.machine = JobStateMachine()
        self.poll_s = poll_s or cfg.health.heartbeat_interval_s
        self.placement_timeout_s = placement_timeout_s
        self.diagnostics_timeout_s = diagnostics_timeout_s
        self.on_event = on_event or (lambda line: log.info("%s", line))
        self.launch = launch or RayLauncher()
        self.clock, self.wall, self.sleep = clock, wall, sleep
        self.attempt_number = 0
        self.group: WorkerGroup | None = None
        self.monitor: HealthMonitor | None = None  # one per attempt: what it learned survives a CONTINUE
        self.summaries: dict[int, dict] = {}
        self.summary: dict[str, Any] | None = None  # set on SUCCEEDED
        self.failure: str | None = None  # set on FAILED
        self._resume_before: int | None = None
        self._backoff_s = 0.0
        self._held: list[Incident] = []  # exceptions waiting for their cause to show itself
        self._settle_until: float | None = None
        self._declared_at: float | None = None  # wall time of the fault the recovery answers
        self._store_lost_at: float | None = None  # wall time the heartbeat reads started failing
        self._trained = False  # the current attempt has completed a step on every rank
        # Operators' view: /metrics and /sd (the workers' scrape targets follow restarts).
        self.metrics = ControllerMetrics(cfg.job.name)
        self._endpoints: dict[int, tuple[str, str]] = {}  # rank -> (metrics host:port, node)
        self._last_beat_at: dict[int, float] = {}  # rank -> sent_at of its newest heartbeat
        self._address: str | None = None
        if serve_metrics:
            obs = cfg.observability
            port = self.metrics.serve(obs.metrics_host, obs.controller_port, targets=self.targets)
            self._address = advertised_address(obs.metrics_host, port)
            self.on_event(f"metrics: http://{self._address}/metrics, service discovery "
                          f"http://{self._address}/sd")

    # -- bookkeeping -------------------------------------------------------------------------
    def _move(self, target: JobState, reason: str) -> None:
        self.record.record_transition(self.machine.transition(target, reason), self.attempt_number)
        self.metrics.set_state(str(target))
        self.metrics.set_attempt(self.attempt_number)
        self.on_event(f"state {target}: {reason}")

    def targets(self) -> list[dict]:
        """The Prometheus scrape targets now: this attempt's workers and the controller."""
        return target_groups(self.cfg.job.name, self.attempt_number, dict(self._endpoints), self._address)

    def _targets_changed(self) -> None:
        if self.cfg.observability.file_sd_path:
            try:
                write_file_sd(self.cfg.observability.file_sd_path, self.targets())
            except OSError as exc:  # discovery is for operators; it must not stop the job
                log.warning("file_sd %s not written: %s", self.cfg.observability.file_sd_path, exc)

    def _linger(self) -> None:
        """A FAILED job keeps /metrics up a little (if anything scrapes it), so Prometheus
        records the final state and the job-failed alert can fire."""
        server, linger = self.metrics.server, self.cfg.observability.linger_s
        if server is not None and server.scrapes and linger:
            self.on_event(f"metrics: serving the final state for {linger:g} s more")
            self.sleep(linger)

    def _event(self, kind: str, message: str, **extra: Any) -> None:
        self.record.event(kind, self.attempt_number, message, **extra)
        self.on_event(f"{kind}: {message}")

    def _history(self) -> list[RestartRecord]:
        return [RestartRecord.from_dict(r) for r in self.record.restarts()]

    def _decide(self, incidents: list[Incident], failed_nodes: dict[str, str]) -> Decision:
        return decide(incidents, self._history(), self.cfg.recovery, now=self.wall(),
                      failed_diagnostics=failed_nodes)

    # -- driving -----------------------------------------------------------------------------
    def run(self) -> dict[str, Any]:
        """Run the job to its end; the summary of rank 0, or JobFailed with the reason."""
        try:
            while not self.machine.state.terminal:
                self.step()
            if self.machine.state is JobState.FAILED:
                self._linger()
        except KeyboardInterrupt:
            self._stop_group()
            self._move(JobState.STOPPED, "interrupted by the user")
            raise
        except redis.RedisError as exc:
            raise StoreUnavailable(
                f"Redis stayed unreachable for more than health.store_patience_s "
                f"({self.cfg.health.store_patience_s:g} s), so the job record could not be written "
                f"({type(exc).__name__}: {exc}). Start the controller again with the same job name "
                "once Redis is back: it continues from the record and the newest checkpoint.") from exc
        finally:
            # Each release runs even if one before it fails: actors or a placement group left
            # behind would hold the cluster.
            try:
                self._stop_group()
            finally:
                try:
                    self.launch.release()
                finally:
                    self.client.close()
                    self.watch_client.close()
                    self.metrics.close()
        if self.machine.state is JobState.FAILED:
            raise JobFailed(self.failure)
        assert self.summary is not None
        return self.summary

    def step(self) -> JobState:
        """Do the current state's work once; the state it led to."""
        handler = {
            JobState.PENDING: self._on_pending,
            JobState.PLACING: self._on_placing,
            JobState.DIAGNOSING: self._on_diagnosing,
            JobState.RENDEZVOUS: self._on_rendezvous,
            JobState.RUNNING: self._on_running,
            JobState.RECOVERING: self._on_recovering,
        }.get(self.machine.state)
        if handler is not None:
            handler()
        return self.machine.state

    # -- one handler per state -----------------------------------------------------------------
    def _on_pending(self) -> None:
        self._resume_point()
        self.record.update(steps=self.cfg.training.steps, world_size=self.cfg.world_size)
        self.metrics.set_evicted(len(self.record.evicted()))
        self._targets_changed()
        self._move(JobState.PLACING, self._placing_reason())

    def _on_placing(self) -> None:
        try:
            self.group = self.launch(self.cfg, attempt=self.attempt_number, redis_url=self.redis_url,
                                     evicted=self.record.evicted(), timeout_s=self.placement_timeout_s,
                                     resume_before_step=self._resume_before, skip_steps=self.record.skips())
        except PlacementImpossible as exc:
            self._fail(str(exc))
            return
        except (PlacementTimeout, LaunchFailed) as exc:
            self._handle(self._decide([Incident(kind="exception", rank=None, node=None, step=None,
                                                at=self.wall(), detail=str(exc))], {}))
            return
        self.summaries = {}
        self.record.update(nodes=list(self.group.node_ids))
        if self.cfg.recovery.diagnostics:
            self._move(JobState.DIAGNOSING, f"self-checks: {', '.join(self.cfg.recovery.diagnostics)}")
        else:
            self._move(JobState.RENDEZVOUS, self._rendezvous_reason())

    def _on_diagnosing(self) -> None:
        reports = self.group.diagnose(self.diagnostics_timeout_s)
        for report in reports:
            for name, ok, seconds, _detail in report["checks"]:
                self.metrics.diagnostics(report["node"], name, ok, seconds)
        failed = {r["node"]: f"rank {r['rank']}: {r['reason']}" for r in reports if not r["ok"]}
        for node, reason in failed.items():
            self._event("diagnostics_failed", f"node {node[:12]} failed its self-check ({reason})",
                        node=node)
        if failed:
            self._handle(self._decide([], failed))
        else:
            self._move(JobState.RENDEZVOUS, self._rendezvous_reason())

    def _on_rendezvous(self) -> None:
        self.group.start()
        history = self.monitor.loss_history if self.monitor is not None else None
        self.monitor = HealthMonitor(self.cfg.world_size, self.cfg.health, started_at=self.clock(),
                                     loss_history=history)
        self._held, self._settle_until, self._trained = [], None, False
        self._move(JobState.RUNNING, "training")

    def _on_running(self) -> None:
        incidents = self._poll()
        if incidents is None:
            return
        if not incidents:
            self._succeed()
            return
        declared = self.wall()
        for incident in incidents:
            self.metrics.fault(incident.kind)
            self._event("fault", incident.detail, fault=incident.kind, rank=incident.rank,
                        node=incident.node, step=incident.step)
        seen = [self._last_beat_at[i.rank] for i in incidents if i.rank in self._last_beat_at]
        if seen:  # from the last sign of life of a rank at fault: an upper bound on detection
            self.metrics.detection(max(0.0, declared - min(seen)))
        decision = self._decide(incidents, {})
        if decision.action is Action.CONTINUE:
            self._event("decision", decision.reason)  # reported; keep watching this attempt
            return
        self._handle(decision)

    def _on_recovering(self) -> None:
        if self._backoff_s:
            self.sleep(self._backoff_s)  # pacing restarts is the point here, not synchronisation
        self.attempt_number += 1
        self._move(JobState.PLACING, self._placing_reason())

    # -- the pieces ---------------------------------------------------------------------------
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

    def _placing_reason(self) -> str:
        return (f"placing {self.cfg.world_size} worker(s) on {self.cfg.cluster.nodes} node(s), "
                f"{len(self.record.evicted())} evicted")

    def _rendezvous_reason(self) -> str:
        return f"forming groups of {self.cfg.world_size} rank(s)"

    def _poll(self) -> list[Incident] | None:
        """One heartbeat interval of watching. [] when every rank finished, the incidents when
        something needs a decision, None to keep watching."""
        ended = self.group.poll(self.poll_s)
        now, wall = self.clock(), self.wall()  # the monitor's clock; the policy's (persisted)
        incidents = [self._incident(e, wall) for e in ended if not e.finished]
        for e in ended:
            if e.finished:
                self.summaries[e.rank] = e.summary
                self.monitor.finished(e.rank)
        try:
            beats = read_heartbeats(self.watch_client, self.cfg.job.name, self.attempt_number,
                                    range(self.cfg.world_size))
        except (redis.RedisError, OSError) as exc:
            self.monitor.store_unreachable(now)
            if self._store_lost_at is None:
                self._store_lost_at = wall
                log.warning("Redis unreachable (%s); judging paused until it is back", exc)
            beats = None
        if beats is not None:
            if self._store_lost_at is not None:
                away, self._store_lost_at = wall - self._store_lost_at, None
                self._event("store_outage", f"Redis was unreachable for about {away:.1f} s; heartbeat "
                            f"judging was paused and missing heartbeats get "
                            f"{self.cfg.health.store_outage_grace_s:g} s to return", seconds=round(away, 3))
            incidents += [Incident(kind=str(f.kind), rank=f.rank,
                                   node=self.group.node_of(f.rank) if f.rank is not None else None,
                                   step=f.step, at=wall, detail=f.detail)
                          for f in self.monitor.observe(beats, now)]
            self._progress(beats)
        incidents = self._held + incidents
        if incidents:
            # An exception on a healthy rank is usually the echo of a peer's death (its
            # collective failed): give the cause up to a heartbeat timeout to show itself,
            # so the policy blames the dead rank's node, not the messenger.
            if any(i.kind != "exception" for i in incidents):
                return incidents
            self._settle_until = self._settle_until or now + self.cfg.health.heartbeat_timeout_s
            if now >= self._settle_until or not self.group.running():
                return incidents  # waited long enough, or every rank has told its story
            self._held = incidents
            return None
        return None if self.group.running() else []

    def _incident(self, ended: RankEnded, wall: float) -> Incident:
        return Incident(kind=ended.kind, rank=ended.rank, node=self.group.node_of(ended.rank),
                        step=ended.step, at=wall, detail=ended.detail)

    def _progress(self, beats: dict[int, Heartbeat | None]) -> None:
        live = [b for b in beats.values() if b is not None]
        if not live:
            return
        first = min(live, key=lambda b: b.rank)
        wall = self.wall()
        endpoints = dict(self._endpoints)
        for b in live:
            node = self.group.node_of(b.rank)
            self._last_beat_at[b.rank] = b.sent_at
            self.metrics.heartbeat_age(b.rank, node, max(0.0, wall - b.sent_at), sent_at=b.sent_at)
            if b.metrics_addr:
                endpoints[b.rank] = (b.metrics_addr, node)
        if endpoints != self._endpoints:
            self._endpoints = endpoints
            self._targets_changed()
        self.metrics.set_step(min(b.step for b in live), self.cfg.training.steps)
        try:
            self.progress_record.update(step=min(b.step for b in live), loss=first.loss, phase=first.phase)
        except (redis.RedisError, OSError) as exc:  # progress is refreshed next poll; not worth a stall
            log.warning("job record progress not written: %s", exc)
        if self._trained or not self._first_step_done(live):
            return
        self._trained = True
        self.launch.warm_spares()  # now, so the spares' imports do not slow this attempt's start
        if self._declared_at is not None:
            took = self.wall() - self._declared_at
            self._declared_at = None
            self.metrics.recovery(took)
            self._event("recovered", f"attempt {self.attempt_number} completed its first step "
                        f"{took:.1f} s after the fault was declared", seconds=round(took, 3))

    def _first_step_done(self, live: list[Heartbeat]) -> bool:
        """Every rank of the new attempt has trained a step past where it resumed."""
        return len(live) == self.cfg.world_size and all(
            b.phase not in STARTING_PHASES and b.step > b.resumed_from for b in live)

    def _handle(self, decision: Decision) -> None:
        """Carry out a decision that ends the attempt: restart (maybe evicting) or give up."""
        self._event("decision", decision.reason, action=str(decision.action))
        self._stop_group()
        if decision.action is Action.GIVE_UP:
            self._fail(decision.reason)
            return
        for node in decision.evict_nodes:
            self.record.evict(node, decision.reason)
            self._event("evicted", f"node {node[:12]} will not be used again", node=node)
        restart = RestartRecord.of(decision, at=self.wall())
        self.record.add_restart(restart.to_dict())
        self.metrics.restart(restart.cause)
        self.metrics.set_evicted(len(self.record.evicted()))
        self._resume_before, self._backoff_s = decision.resume_before_step, decision.backoff_s
        if decision.skip_steps is not None:  # kept for every later attempt, in the job record
            self.record.add_skip(*decision.skip_steps)
        self._declared_at = self.wall()  # recovery is timed from here to the next first step
        self._move(JobState.RECOVERING, decision.reason)

    def _fail(self, reason: str) -> None:
        self._stop_group()
        self.failure = reason
        self._move(JobState.FAILED, reason)

    def _stop_group(self) -> None:
        if self.group is not None:
            group, self.group = self.group, None
            group.stop()
            # Its ranks are gone: their targets and per-rank series must not linger.
            self._endpoints, self._last_beat_at = {}, {}
            self.metrics.forget_ranks()
            self._targets_changed()

    def _succeed(self) -> None:
        summary = self.summaries[0]
        self.record.update(step=summary["step"], loss=summary["loss"])
        self._stop_group()
        self._move(JobState.SUCCEEDED, f"finished {summary['step']} steps in attempt {self.attempt_number}")
        self.metrics.set_step(summary["step"], self.cfg.training.steps)
        self.summary = summary | {"attempt": self.attempt_number, "restarts": len(self.record.restarts()),
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
