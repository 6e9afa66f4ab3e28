"""The job controller: place, diagnose, rendezvous, run, watch, and recover, attempt after attempt.

    PENDING -> PLACING -> DIAGNOSING -> RENDEZVOUS -> RUNNING -> SUCCEEDED
                  ^                                    |
                  +------------- RECOVERING <----------+

`step()` does the current state's work once and makes the move it leads to; `run()` steps to
a terminal state. One handler per state, so the controller can be driven one transition at a
time against a fake worker group (tests/test_controller_steps.py).

An `Attempt` (attempt.py) is one worker group (workers.py) and what is learned while it runs;
each RUNNING step watches it for one heartbeat interval (watch.py). Faults go to the policy:
continue, restart (maybe evicting nodes) or give up. A restart moves into RECOVERING carrying
its decision, stops the group, deletes the attempt's Redis keys, and places the next attempt
(fresh rendezvous namespace and heartbeat keys) away from every evicted node; it resumes from
the newest committed checkpoint. An error that would recur on any node (`fatal`) ends the job
at once, and so does a checkpoint it cannot resume from, found before anything is placed
(precheck.py). The controller decides and moves; the event log, metrics, service discovery
and the progress record listen (listeners.py).

A stop request (`request_preemption`: a signal to `longrun run` or to a submitted job, or Ray
draining one of the job's nodes) moves a RUNNING job to PREEMPTING: the workers save at a step
boundary they agree on (worker/preemption.py) and stop, and the job ends PREEMPTED with that
checkpoint committed, or when `recovery.preemption_grace_s` runs out. Running the same job
again resumes from it.

An elastic job (`recovery.min_nodes`, controller/elastic.py, health/scaling.py) that cannot
place its configured nodes waits up to `recovery.shrink_after_s` for them, then continues on
the nodes it has, with smaller data-parallel degrees and the same global batch. While it runs
short, every poll asks whether the configured size could be placed again; once it could, the
workers save at an agreed step boundary (the preemption mechanism, for a "grow") and the job
restarts at its configured size: RUNNING -> RECOVERING (a resize, not a fault: no restart
budget spent) -> PLACING.

What the next controller needs lives in Redis under the job's prefix (record, events, restart
history, evictions), written through a client that rides out a Redis restart: a controller
started again with the same job name continues with the next attempt. What the recovery policy
decides from (restarts spent, evictions, skipped data windows) is kept beside the checkpoints
too (recovery_file.py), for a Redis that forgot the job.

One controller runs a job name (a lease in Redis, lease.py; a controller that loses it stops)
and one writes a checkpoint directory (owner.lock in it, checkpoint/owner.py): a second is
refused before anything is placed, with a sentence naming the one that runs.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from typing import Any

import redis

from longrun import keys
from longrun.checkpoint.owner import CheckpointDirInUse, ForeignOwner, Ownership
from longrun.config import JobConfig
from longrun.controller.attempt import Attempt
from longrun.controller.elastic import Sizing, layout_key
from longrun.controller.job_state import JobRecordStore, job_status
from longrun.controller.lease import ControllerLease, ControllerRunning, lease_ttl_s
from longrun.controller.listeners import KeeperReviver, standard_listeners
from longrun.controller.placement import PlacementCancelled, PlacementImpossible, PlacementTimeout
from longrun.controller.precheck import checkpoint_problem, fence_rollback, sweep_partial_saves
from longrun.controller.rank_logs import RankLogs
from longrun.controller.ray_deaths import WorkerDeath
from longrun.controller.recovery_file import RecoveryKeeper
from longrun.controller.state import JobState, JobStateMachine
from longrun.controller.user_view import user_view_listeners
from longrun.controller.watch import Watcher
from longrun.controller.workers import Launcher, LaunchFailed, RayLauncher, WorkerGroup
from longrun.goodput.tracker import GoodputTracker
from longrun.health.policy import Action, Decision, Incident, RestartRecord, decide
from longrun.health.scaling import Resize
from longrun.health.startup import StartupDeadlines, startup_deadlines
from longrun.kinds import StartupPhase
from longrun.node_names import NodeNames
from longrun.observability.controller_metrics import ControllerMetrics
from longrun.observability.discovery import advertised_address, target_groups
from longrun.safe_files import UnsafePath
from longrun.services.redis_client import patient_client, quick_client
from longrun.worker import preemption

__all__ = ["Controller", "JobFailed", "StoreUnavailable", "job_status"]
log = logging.getLogger(__name__)


class JobFailed(RuntimeError):
    """The job ended in FAILED; the message is the reason an operator reads."""


class StoreUnavailable(RuntimeError):
    """Redis stayed unreachable past health.store_patience_s: the job record cannot be kept."""


RUN_FILES_PREFIX = "files: "  # the line naming the job's files (`longrun logs --rank` reads it)
BACKOFF_SLICE_S = 1.0  # a restart's backoff is slept in slices, so a stop request is heard


class Controller:
    def __init__(self, cfg: JobConfig, redis_url: str, *, poll_s: float | None = None,
                 on_event: Callable[[str], None] | None = None, placement_timeout_s: float | None = None,
                 diagnostics_timeout_s: float = 300.0, launch: Launcher | None = None,
                 clock: Callable[[], float] = time.monotonic, wall: Callable[[], float] = time.time,
                 sleep: Callable[[float], None] = time.sleep, serve_metrics: bool = True,
                 worker_deaths: Callable[[], list[WorkerDeath]] | None = None,
                 launched_at: float | None = None):
        self.cfg = cfg
        self.redis_url = redis_url
        self.client = patient_client(redis_url, cfg.health.store_patience_s)  # the record path
        self.watch_client = quick_client(redis_url)  # heartbeats: a miss is retried next poll
        self.record = JobRecordStore(self.client, cfg.job.name)
        self.policy_memory = RecoveryKeeper(cfg.checkpoint_dir, self.record)  # recovery_file.py
        self.machine = JobStateMachine()
        self.placement_timeout_s = placement_timeout_s  # None: the placement phase's deadline
        self.diagnostics_timeout_s = diagnostics_timeout_s
        self.launch = launch or RayLauncher()
        self.clock, self.wall, self.sleep = clock, wall, sleep
        self.on_event = on_event or (lambda line: log.info("%s", line))
        # Ray's reports of worker processes that died (controller/ray_deaths.py), and the pids of
        # every attempt's ranks, whose deaths their faults report already.
        self.worker_deaths = worker_deaths
        self._rank_pids: set[int] = set()
        self.attempt = Attempt(0)
        self.summary: dict[str, Any] | None = None  # set on SUCCEEDED and PREEMPTED
        self.failure: str | None = None  # set on FAILED
        self.stop_request: str | None = None  # why the job was asked to stop (request_preemption)
        self.lease_lost: str | None = None  # why this controller's lease was lost (it then stops)
        self.ownership: Ownership | None = None  # its checkpoint root, held while run() runs
        self._preempt_deadline: float | None = None
        # Elastic continuation: None unless recovery.min_nodes is set. `layout` is the config
        # the current (or last) attempt runs: cfg itself, or a smaller one after a shrink.
        self.sizing = Sizing.of(cfg)
        self.layout = cfg
        self._resize_reason: str | None = None  # why the next layout change happens
        self._waiting_for_nodes = False  # this placement has reported its wait (once per wait)
        self._short_since: float | None = None  # when too few nodes were first left to place it
        # Operators' view: /metrics and /sd (the workers' scrape targets follow restarts).
        self.metrics = ControllerMetrics(cfg.job.name)
        self._address: str | None = None
        if serve_metrics:
            obs = cfg.observability
            port = self.metrics.serve(obs.metrics_host, obs.controller_port, targets=self.targets)
            self._address = advertised_address(obs.metrics_host, port)
        # Where the wall time goes, from the workers' step ledger (goodput/); a job-wide summary.
        # Its clock starts when the run was launched (`launched_at`: before Redis and Ray).
        self.goodput = GoodputTracker(cfg.job.name, self.client, self.watch_client, wall=wall,
                                      window_steps=max(4096, 2 * cfg.checkpoint.interval_steps),
                                      started_at=launched_at)
        # The ranks' log lines into files, and the warnings they share printed once.
        rank_logs = RankLogs(cfg.job.name, cfg.run_dir, self.watch_client, self.client, self.on_event)
        # Nodes as a person reads them ("host (address)"), learnt from each placement.
        self.names = NodeNames()
        self.listeners = standard_listeners(cfg, self.record, self.on_event, self.metrics, self.targets,
                                            JobRecordStore(self.watch_client, cfg.job.name),
                                            self.launch.warm_spares, self.goodput, rank_logs.last_lines,
                                            names=self.names)
        self.listeners.listeners.append(rank_logs)
        revive = getattr(self.launch, "revive_keepers", None)  # launchers without keepers lack it
        if revive is not None:
            self.listeners.listeners.append(KeeperReviver(revive))
        # What the user looks at: the progress line, the journal, TensorBoard.
        self.listeners.listeners += user_view_listeners(
            cfg, self.on_event, lambda: self.layout.dims.layout_name, self.goodput)
        self.goodput.subscribers.append(self.listeners)  # the step ledger's records, as they are read
        self.watcher = Watcher(cfg, self.watch_client, self.listeners,
                               poll_s=poll_s or cfg.health.heartbeat_interval_s, clock=clock, wall=wall,
                               ledger=self.goodput)
        if self._address:
            self.on_event(f"metrics: http://{self._address}/metrics, service discovery "
                          f"http://{self._address}/sd")
        run_dir = os.path.abspath(cfg.run_dir)
        self.on_event(f"{RUN_FILES_PREFIX}ranks' logs in {os.path.join(run_dir, 'logs')}"
                      + (f", TensorBoard in {os.path.join(run_dir, 'tb')}" if cfg.observability.tensorboard
                         else "")
                      + f"; `longrun report {run_dir}` draws the job")

    @property
    def attempt_number(self) -> int:
        return self.attempt.number

    @property
    def group(self) -> WorkerGroup | None:
        return self.attempt.group

    def targets(self) -> list[dict]:
        """The Prometheus scrape targets now: the live attempt's workers and the controller."""
        endpoints = dict(self.attempt.endpoints) if self.attempt.live else {}
        return target_groups(self.cfg.job.name, self.attempt.number, endpoints, self._address,
                             names=self.names.table)

    # -- driving -----------------------------------------------------------------------------
    def run(self) -> dict[str, Any]:
        """Run the job to its end; the summary of rank 0, or JobFailed with the reason (touching
        nothing when a live controller runs this job name or owns its checkpoint directory; and
        when this controller's lease is lost, after its workers were stopped)."""
        # Its own clients: taken and given back as patiently as the record is written, renewed
        # (in a thread of its own) by one that fails fast, so that losing it is noticed in time.
        patience = self.cfg.health.store_patience_s
        lease = ControllerLease(patient_client(self.redis_url, patience), self.cfg.job.name,
                                ttl_s=lease_ttl_s(patience), give_up_s=patience,
                                renew_client=quick_client(self.redis_url), on_lost=self._lease_lost)
        try:
            try:
                lease.acquire()
            except ControllerRunning as exc:
                raise JobFailed(str(exc)) from exc
            self.ownership = self._own_checkpoint_dir()  # before anything is written there
            while not self.machine.state.terminal:
                self.step()
            self._fold_worker_deaths()  # before the job's last line
            if self.machine.state is JobState.FAILED:
                self._linger()
        except KeyboardInterrupt:
            self._end_attempt()
            self._move(JobState.STOPPED, "interrupted by the user")
            raise
        except redis.RedisError as exc:
            raise StoreUnavailable(
                f"Redis stayed unreachable for more than health.store_patience_s "
                f"({self.cfg.health.store_patience_s:g} s), so the job record could not be written "
                f"({type(exc).__name__}: {exc}). Start the controller again with the same job name "
                "once Redis is back: it continues from the record and the newest checkpoint.") from exc
        finally:
            try:
                self._release()
            finally:
                try:
                    if self.ownership is not None:  # its workers are stopped: none writes there now
                        self.ownership, ownership = None, self.ownership
                        ownership.release()
                finally:
                    lease.release()
        if self.machine.state is JobState.FAILED:
            raise JobFailed(self.failure)
        assert self.summary is not None  # SUCCEEDED, PREEMPTED, or STOPPED on request
        return self.summary

    def _own_checkpoint_dir(self) -> Ownership:
        """Take the checkpoint root for this controller (`checkpoint/owner.py`); JobFailed with
        the refusal, nothing written, when another controller owns it."""
        where = self.cfg.checkpoint_dir
        try:
            return Ownership.take(where, self.cfg.job.name)
        except (CheckpointDirInUse, UnsafePath) as exc:
            raise JobFailed(str(exc)) from None
        except OSError as exc:
            raise JobFailed(f"the checkpoint directory {where} cannot be written ({exc}); point "
                            "checkpoint.dir at a directory this user can write") from None

    def _lease_lost(self, reason: str) -> None:
        """From the lease's thread: the next step stops the job (placements and backoffs under
        way give up at their next look)."""
        self.lease_lost = reason

    def _stopping(self) -> bool:
        """Whether a wait under way (a placement, a backoff) should end: a stop was asked for or
        the lease was lost."""
        return self.stop_request is not None or self.lease_lost is not None

    def request_preemption(self, reason: str) -> None:
        """Ask the job to stop with its work saved (safe from a signal handler: the next
        `step()` acts on it)."""
        if self.stop_request is None:
            self.stop_request = reason

    def step(self) -> JobState:
        """Do the current state's work once; the state it led to."""
        self._fold_worker_deaths()
        state = self.machine.state
        if self.lease_lost is not None and not state.terminal:
            # Another controller may run this job now: stop the workers (run()'s release) and
            # write nothing more to the record, which may be that controller's.
            raise JobFailed(f"{self.lease_lost}; this controller stopped its workers and ends here "
                            "(`longrun status` shows who runs the job now; if nobody does, run it "
                            "again: it continues from its newest checkpoint)")
        if self.stop_request is not None and not state.terminal:
            if self._forced():
                self._stop_now()
                return self.machine.state
            if state is not JobState.PREEMPTING:
                self._preempt()
                return self.machine.state
        handler = {
            JobState.PENDING: self._on_pending,
            JobState.PLACING: self._on_placing,
            JobState.DIAGNOSING: self._on_diagnosing,
            JobState.RENDEZVOUS: self._on_rendezvous,
            JobState.RUNNING: self._on_running,
            JobState.RECOVERING: self._on_recovering,
            JobState.PREEMPTING: self._on_preempting,
        }.get(self.machine.state)
        if handler is not None:
            handler()
        return self.machine.state

    # -- one handler per state -----------------------------------------------------------------
    def _on_pending(self) -> None:
        self._resume_point()
        self.client.delete(keys.job_stop_key(self.cfg.job.name))  # a mark of an earlier run
        self.record.update(steps=self.cfg.training.steps, world_size=self.cfg.world_size)
        problem = checkpoint_problem(self.cfg)
        if problem is not None:
            self._fail(problem)
            return
        sweep_partial_saves(self.cfg)  # no worker of this job is alive yet
        self._move(JobState.PLACING, self._placing_reason())

    def _on_placing(self) -> None:
        try:
            layout = self._place()
        except PlacementImpossible as exc:
            self._fail(str(exc))
            return
        except PlacementCancelled:
            return  # the next step acts on the stop request
        except LaunchFailed as exc:
            self._handle(self._decide([Incident(kind=exc.kind, rank=None, node=None, step=None,
                                                at=self.wall(), detail=str(exc))], {}))
            return
        if layout is None:
            return  # short of nodes and waiting for them: placing again at the next step
        self._waiting_for_nodes = False
        if layout_key(layout) != layout_key(self.layout) and not self._resize(layout):
            return
        self.names.learn(self.attempt.group.node_names)
        self._rank_pids.update(self.attempt.group.pids.values())
        self.record.update(nodes=list(self.attempt.group.node_ids), node_names=self.names.table,
                           size=self._size_text())
        if self.cfg.recovery.diagnostics:
            self._move(JobState.DIAGNOSING, f"self-checks: {', '.join(self.cfg.recovery.diagnostics)}")
        else:
            self._move(JobState.RENDEZVOUS, self._rendezvous_reason())

    def _on_diagnosing(self) -> None:
        reports = self.attempt.group.diagnose(self.diagnostics_timeout_s)
        self.listeners.diagnosed(reports)
        failed = {r["node"]: f"rank {r['rank']}: {r['reason']}" for r in reports if not r["ok"]}
        for node, reason in failed.items():
            self._event("diagnostics_failed", f"node {node} failed its self-check ({reason})",
                        node=node)
        if failed:
            self._handle(self._decide([], failed))
        else:
            self._move(JobState.RENDEZVOUS, self._rendezvous_reason())

    def _on_rendezvous(self) -> None:
        deadlines = self.deadlines(self.layout)
        self.on_event(f"start-up deadlines: {deadlines.summary()} (`longrun config plan` says why)")
        self.attempt.group.start()
        self.attempt.watch(self.layout.world_size, self.cfg.health, self.clock(), deadlines=deadlines)
        self._move(JobState.RUNNING, "training")

    def deadlines(self, layout: JobConfig) -> StartupDeadlines:
        """Each start-up phase's deadline at `layout`, the restore's sized by the storage rate
        this job's last restore from storage measured (health/startup.py)."""
        return startup_deadlines(layout, storage_bytes_per_s=self.goodput.storage_rate)

    def _on_running(self) -> None:
        incidents = self.watcher.poll(self.attempt)
        if incidents is None:
            draining = self.attempt.group.draining()
            if draining:
                nodes = ", ".join(sorted(draining))  # named by the listeners
                self.request_preemption(f"Ray is draining node(s) {nodes} (a preemption or scale-down "
                                        "notice)")
            elif self.sizing is not None:
                self._consider_growing()
            return
        if not incidents:
            if self.attempt.grow is not None and self.attempt.summaries[0].get("preempted"):
                self._grow()
            else:  # no grow asked, or the last step came before the request did
                self._succeed()
            return
        self.listeners.declared(self.attempt, incidents, self.wall())
        decision = self._decide(incidents, {})
        if decision.action is Action.CONTINUE:
            self._event("decision", decision.reason)  # reported; keep watching this attempt
            return
        self._handle(decision)

    def _on_recovering(self) -> None:
        recovery = self.machine.history[-1]  # the move into RECOVERING, carrying its decision
        left = recovery.decision.backoff_s
        while left > 0 and not self._stopping():  # a stop request cuts the wait short
            self.sleep(min(left, BACKOFF_SLICE_S))  # pacing restarts is the point, not synchronisation
            left -= BACKOFF_SLICE_S
        if self._stopping():
            return  # the next step() stops the job
        self.attempt = self.attempt.next(recovery, keys.allocate_attempt(self.client, self.cfg.job.name,
                                                                        at_least=self.attempt.number + 1))
        if self.ownership is not None:
            try:  # on an object store a later controller may have taken the root (owner.py)
                self.ownership.verify(f"placing attempt {self.attempt.number}")
            except ForeignOwner as exc:
                self._fail(str(exc))
                return
        sweep_partial_saves(self.cfg)  # the last attempt's workers were stopped: none is saving
        self._move(JobState.PLACING, self._placing_reason())

    def _on_preempting(self) -> None:
        incidents = self.watcher.poll(self.attempt)
        if incidents is None:  # still saving
            if self.clock() < self._preempt_deadline:
                return
            self._preempted(f"the workers did not finish saving within recovery.preemption_grace_s "
                            f"({self.cfg.recovery.preemption_grace_s:g} s); running the job again resumes "
                            "from its newest committed checkpoint")
            return
        if incidents:
            self._preempted(f"a rank failed while saving ({incidents[0].detail}); running the job "
                            "again resumes from its newest committed checkpoint")
            return
        summary = self.attempt.summaries[0]
        if not summary.get("preempted"):  # the last step came before the stop request did
            self._succeed()
            return
        self._preempted(f"the checkpoint of step {summary['step']} is committed; running the job "
                        "again resumes from it", summary)

    # -- elastic continuation -------------------------------------------------------------------
    def _launch(self, layout: JobConfig) -> WorkerGroup:
        timeout_s = self.placement_timeout_s or self.deadlines(layout).seconds(StartupPhase.PLACEMENT)
        return self.launch(layout, attempt=self.attempt.number, redis_url=self.redis_url,
                           evicted=self.record.evicted(), timeout_s=timeout_s,
                           resume_before_step=self.attempt.resume_before_step, skip_steps=self.record.skips(),
                           cancelled=self._stopping)

    def _place(self) -> JobConfig | None:
        """Place this attempt at the configured size, always tried first (so a restart grows
        back when it can). Busy is not gone: nodes that exist but whose resources another job
        holds (PlacementTimeout) are waited for (None: placing again at the next step), and a
        wait never spends the restart budget. An elastic job short of nodes, missing or busy,
        asks the scaling policy: wait, continue on the nodes that can be placed now (the
        smaller config), or give up (PlacementImpossible, only when too few nodes exist at all;
        a job that is not elastic waits recovery.node_wait_s for replacements first, once it has
        run)."""
        started = self.clock()
        try:
            self.attempt.group = self._launch(self.cfg)
        except PlacementTimeout as exc:
            if self.sizing is None:
                self._report_wait(f"{exc}; waiting for them to free up (a placement wait spends no "
                                  "restart budget; `longrun stop` ends it)", available=exc.available)
                return None  # the placement's own timeout paced this try
            return self._place_smaller(exc, started)
        except PlacementImpossible as exc:
            if self.sizing is None:
                return self._wait_for_replacements(exc)
            return self._place_smaller(exc, started)
        self._short_since = None
        if self.sizing is not None:
            self.sizing.placed_in_full()
        return self.cfg

    def _wait_for_replacements(self, short: PlacementImpossible) -> None:
        """Too few nodes are left to place a job that is not elastic. Once it has run, a node
        lost or evicted leaves a gap that a replacement usually fills within minutes (an
        autoscaler, KubeRay, an operator): wait recovery.node_wait_s for one, as for busy nodes,
        then fail with the reason. A first placement fails at once: that cluster is too small."""
        wait = self.cfg.recovery.node_wait_s
        if self.attempt.number == 0 or wait <= 0:
            raise short
        now = self.clock()
        if self._short_since is None:
            self._short_since = now
        waited = now - self._short_since
        if waited >= wait:
            raise PlacementImpossible(f"{short}; no node joined to take the place of the lost or evicted "
                                      f"ones within recovery.node_wait_s ({wait:g} s)",
                                      short.available, short.existing) from short
        self._report_wait(f"{short}; waiting up to {wait - waited:.0f} s for nodes to replace the lost or "
                          "evicted ones (recovery.node_wait_s; a wait spends no restart budget)",
                          available=short.available)
        self.sleep(BACKOFF_SLICE_S)  # pacing the retries; a stop request is heard next step
        return None

    def _place_smaller(self, short: PlacementImpossible | PlacementTimeout,
                       started: float) -> JobConfig | None:
        """The configured size could not be placed (`short` says how many nodes can be now and
        how many exist): the scaling policy's answer, carried out."""
        decision, smaller = self.sizing.short(short.available, self.clock(), existing=short.existing,
                                              since=started)
        if decision.action is Resize.GIVE_UP:
            raise PlacementImpossible(f"{short}; elastic continuation: {decision.reason}",
                                      short.available, short.existing) from short
        if decision.action is Resize.WAIT:
            self._report_wait(decision.reason, available=short.available)
            self.sleep(BACKOFF_SLICE_S)  # pacing the retries; a stop request is heard next step
            return None
        try:
            self.attempt.group = self._launch(smaller)
        except (PlacementImpossible, PlacementTimeout) as again:  # fewer since a moment ago
            log.warning("placing %d node(s) failed too (%s); deciding again", decision.nodes, again)
            return None
        self._resize_reason = decision.reason
        return smaller

    def _report_wait(self, reason: str, **extra: Any) -> None:
        """One event per wait for nodes (the tries that follow it are not news)."""
        if not self._waiting_for_nodes:
            self._waiting_for_nodes = True
            self._event("waiting_for_nodes", reason, **extra)

    def _resize(self, layout: JobConfig) -> bool:
        """The attempt just placed runs at another layout than the last one (a shrink, or a grow
        back): record it, once the newest checkpoint is known to restore at it. False when it
        cannot (the job failed with the checkpoint's reason)."""
        before, nodes = self.layout, layout.cluster.nodes
        direction = "shrink" if nodes < before.cluster.nodes else "grow"
        problem = checkpoint_problem(layout)
        if problem is not None:
            self._fail(f"cannot {direction} to {nodes} node(s) ({layout.world_size} ranks): {problem}")
            return False
        why = self._resize_reason or f"the configured {nodes} node(s) could be placed again"
        self._resize_reason = None
        old, new = before.parallelism, layout.parallelism
        self._event("resized", (
            f"{direction}: {before.cluster.nodes} -> {nodes} node(s), {before.world_size} -> "
            f"{layout.world_size} rank(s), dp x fsdp {old.dp} x {old.fsdp} -> {new.dp} x {new.fsdp}, "
            f"global batch {self.cfg.global_batch_tokens} tokens kept; {why}"),
            direction=direction, nodes=nodes, world_size=layout.world_size,
            from_nodes=before.cluster.nodes)
        self.layout = layout
        self.record.update(world_size=layout.world_size)
        return True

    def _consider_growing(self) -> None:
        """While the job runs short: once the configured size could be placed again, ask the
        ranks to save at the next agreed step boundary and stop (the preemption mechanism);
        `_grow` restarts the job at the configured size when they have."""
        current = self.layout.cluster.nodes
        if self.attempt.grow is not None or current >= self.cfg.cluster.nodes:
            return
        spare = self.launch.spare_nodes(self.layout, self.record.evicted())
        decision = self.sizing.running(current, None if spare is None else current + spare)
        if decision.action is not Resize.GROW:
            return
        try:
            preemption.request(self.watch_client, self.cfg.job.name, self.attempt.number)
        except redis.RedisError as exc:  # asked again at the next poll
            log.warning("grow request not written to Redis (%s); trying again", exc)
            return
        self.attempt.grow = decision
        self._event("grow_requested", decision.reason, nodes=decision.nodes)

    def _grow(self) -> None:
        summary, grow = self.attempt.summaries[0], self.attempt.grow
        self.record.update(step=summary["step"], loss=summary["loss"])
        self._resize_reason = f"capacity is back, and the checkpoint of step {summary['step']} is committed"
        self._end_attempt()
        decision = Decision(Action.RESIZE, f"grow: {grow.reason}")
        self._move(JobState.RECOVERING, f"grow: the checkpoint of step {summary['step']} is committed; "
                   f"placing the configured {grow.nodes} node(s)", decision)

    def _size_text(self) -> str:
        return (f"{self.layout.cluster.nodes} of {self.cfg.cluster.nodes} node(s), "
                f"{self.layout.world_size} rank(s)")

    # -- the pieces ---------------------------------------------------------------------------
    def _preempt(self) -> None:
        """Act on a stop request: a running attempt saves at its next agreed step boundary
        (PREEMPTING); between attempts nothing trains, but the memory snapshots may hold steps
        newer than the newest checkpoint: they are committed before the keepers go, then it stops."""
        reason = f"asked to stop: {self.stop_request}"
        if self.machine.state is not JobState.RUNNING:
            self._preempted(f"{reason}; {self._keep_snapshots()}")
            return
        preemption.request(self.watch_client, self.cfg.job.name, self.attempt.number)
        self._preempt_deadline = self.clock() + self.cfg.recovery.preemption_grace_s
        self._move(JobState.PREEMPTING, f"{reason}; saving a checkpoint at the next step boundary "
                   f"(within {self.cfg.recovery.preemption_grace_s:g} s)")

    def _keep_snapshots(self) -> str:
        """Commit what the snapshot keepers hold beyond the newest checkpoint (the release lets
        them go); says what running the job again resumes from."""
        persist = getattr(self.launch, "persist_snapshots", None)  # launchers without keepers lack it
        if persist is None:
            return ("nothing trained since the newest committed checkpoint, which running the job "
                    "again resumes from")
        before = self.attempt.resume_before_step
        if self.machine.state is JobState.RECOVERING:  # the next attempt's, which was not made yet
            decision = self.machine.history[-1].decision
            before = decision.resume_before_step if decision is not None else None
        try:
            step, stored = persist(before_step=before, timeout_s=self.cfg.recovery.preemption_grace_s)
        except Exception as exc:  # the keepers gone or too slow: say what is lost
            log.warning("memory snapshots not committed: %s", exc)
            return (f"the memory snapshots newer than the newest committed checkpoint could not be saved "
                    f"({type(exc).__name__}: {str(exc)[:200]}); running the job again resumes from that "
                    "checkpoint, and the steps after it are trained again")
        if step is None:
            at = f" (step {stored})" if stored else ""
            return (f"no memory snapshot is newer than the newest committed checkpoint{at}, which running "
                    "the job again resumes from")
        self._event("snapshot_committed", f"the memory snapshot of step {step} was committed as a "
                    f"checkpoint before the keepers were let go (the newest before was step {stored})",
                    step=step, previous=stored)
        return (f"the memory snapshot of step {step} (newer than the newest checkpoint, step {stored}) is "
                "committed as a checkpoint, which running the job again resumes from")

    def _forced(self) -> bool:
        """Whether an operator asked to stop without saving (`longrun stop --force`)."""
        try:
            return self.watch_client.get(keys.job_stop_key(self.cfg.job.name)) == b"force"
        except redis.RedisError:
            return False

    def _stop_now(self) -> None:
        reason = "stopped at once on request (longrun stop --force): nothing saved since the newest " \
                 "committed checkpoint, which running the job again resumes from"
        self._end_attempt()
        self._move(JobState.STOPPED, reason)
        self.summary = {"stopped": True, "reason": reason, "attempt": self.attempt.number}

    def _preempted(self, reason: str, summary: dict[str, Any] | None = None) -> None:
        self._end_attempt()
        self._move(JobState.PREEMPTED, reason)
        self.summary = (summary or {}) | {"preempted": True, "reason": reason,
                                          "attempt": self.attempt.number,
                                          "restarts": self.record.restart_count()}

    def _resume_point(self) -> None:
        """Pick the attempt number, from the store's counter (`keys.allocate_attempt`). Attempt
        ids are never reused under one job name (stale keys of an old attempt must not meet a
        new one). A previous controller that did not finish, or whose job was PREEMPTED or
        STOPPED (run again to resume), is continued: same history, same evictions, the next
        attempt, and what its attempts left in Redis is deleted. A job that SUCCEEDED or FAILED
        leaves its name to a new run with a clean history. Without a record in Redis, what the
        job kept beside its checkpoints is read back (`_recall_policy`)."""
        previous = self.record.read()
        # Goodput continues after PREEMPTED (a SIGTERM and a rerun are one job) or a lost
        # controller, whose last attempt's ledger it reads before the keys below are deleted.
        self.goodput.resume(previous.state if previous else None, previous.attempt if previous else None)
        job = self.cfg.job.name
        if previous is None:
            self.attempt = Attempt(keys.allocate_attempt(self.client, job))
            self._recall_policy()  # a Redis that forgot: what was kept beside the checkpoints
            return
        self.attempt = Attempt(keys.allocate_attempt(self.client, job, at_least=previous.attempt + 1))
        keys.delete_attempts_before(self.client, self.cfg.job.name, self.attempt.number)
        if previous.state in (JobState.SUCCEEDED, JobState.FAILED):  # PREEMPTED and STOPPED resume
            self.record.reset()
            self.policy_memory.forget()
            return
        self._event("resume", f"a previous controller ran attempts up to {previous.attempt} "
                    f"(last state {previous.state}); continuing with attempt {self.attempt.number}")

    def _decide(self, incidents: list[Incident], failed_nodes: dict[str, str]) -> Decision:
        history = [RestartRecord.from_dict(r) for r in self.record.restarts()]
        return decide(incidents, history, self.cfg.recovery, now=self.wall(), failed_diagnostics=failed_nodes,
                      spare_nodes=self.launch.spare_nodes(self.layout, self.record.evicted()),
                      restarts_total=self.record.restart_count(), reached_step=self._reached(),
                      can_shrink=self._can_shrink())

    def _can_shrink(self) -> bool:
        """An elastic job running above a size it could continue at: a slow node can be evicted."""
        nodes = self.layout.cluster.nodes
        return self.sizing is not None and any(n < nodes for n in self.sizing.policy.sizes)

    def _reached(self) -> int:
        """The newest step the job got to: this attempt's, or the last one's if it trained none."""
        return max(self.attempt.reached, self.attempt.lost_from or 0)

    def _handle(self, decision: Decision) -> None:
        """Carry out a decision that ends the attempt: restart (maybe evicting) or give up."""
        self._event("decision", decision.reason, action=str(decision.action))
        self._end_attempt()
        if decision.action is Action.GIVE_UP:
            self._fail(decision.reason, decision)
            return
        for node in decision.evict_nodes:
            self.record.evict(node, decision.reason)
            self._event("evicted", f"node {node} will not be used again", node=node)
        restart = RestartRecord.of(decision, at=self.wall(), reached_step=self._reached())
        self.record.add_restart(restart.to_dict(), window_s=self.cfg.recovery.restart_window_s)
        if decision.skip_steps is not None:  # kept for every later attempt, in the job record
            self.record.add_skip(*decision.skip_steps)
        self.policy_memory.keep()  # beside the checkpoints too, for a Redis that forgets
        if decision.resume_before_step is not None:  # the spiked path's checkpoints, for good
            fence_rollback(self.cfg, decision.resume_before_step, decision.reason)
        self._move(JobState.RECOVERING, decision.reason, decision)

    def _recall_policy(self) -> None:
        """Put back the restart budget spent, the evicted nodes and the skipped data windows
        this job kept beside its checkpoints into a Redis that has no record of it (the
        embedded one of a new `longrun run`, one restarted without persistence)."""
        memory = self.policy_memory.recall()
        if memory is not None:
            self._event("policy_recalled", f"Redis held no record of this job; what its recovery policy "
                        f"learned was read back from {self.cfg.checkpoint_dir}: {memory.describe()}",
                        restarts=memory.restarts_total, evicted=sorted(memory.evicted),
                        skips=[list(w) for w in memory.skips])

    def _succeed(self) -> None:
        summary = self.attempt.summaries[0]
        self.record.update(step=summary["step"], loss=summary["loss"])
        self._end_attempt()
        self.policy_memory.forget()  # a finished job's name starts afresh
        self._move(JobState.SUCCEEDED, f"finished {summary['step']} steps in attempt {self.attempt.number}")
        self.summary = summary | {"attempt": self.attempt.number, "restarts": self.record.restart_count(),
                                  "evicted": sorted(self.record.evicted()),
                                  "nodes": self.layout.cluster.nodes}

    def _fail(self, reason: str, decision: Decision | None = None) -> None:
        self._end_attempt()
        self.policy_memory.forget()  # a failed job's name starts afresh, as its record does
        self.failure = self.names.in_text(reason)  # what `longrun run` prints
        self._move(JobState.FAILED, reason, decision)

    def _end_attempt(self) -> None:
        """Stop the attempt's workers, let the listeners read what they left (the step ledger),
        then delete its Redis keys: its rendezvous store, heartbeats, self-check stores, commit
        and step ledgers are never read again."""
        group, self.attempt.group = self.attempt.group, None
        if group is None:
            return
        group.stop()
        self.listeners.ending(self.attempt)
        try:
            keys.delete_attempt_keys(self.client, self.cfg.job.name, self.attempt.number)
        except redis.RedisError as exc:  # tidying up must not hide why the attempt ended
            log.warning("attempt %d's Redis keys not deleted: %s", self.attempt.number, exc)
        self.listeners.ended(self.attempt)

    def _fold_worker_deaths(self) -> None:
        """Ray's reports of worker processes that died: nothing for a rank's (its fault says it),
        one line for any other."""
        for death in self.worker_deaths() if self.worker_deaths is not None else ():
            if death.pid not in self._rank_pids:
                self.on_event(death.line(self.names))

    def _move(self, target: JobState, reason: str, decision: Decision | None = None) -> None:
        move = self.machine.transition(target, reason, at=self.wall(), decision=decision)
        self.listeners.moved(move, self.attempt)

    def _event(self, kind: str, message: str, **extra: Any) -> None:
        self.listeners.event(kind, self.attempt, message, extra)

    def _placing_reason(self) -> str:
        return (f"placing {self.cfg.world_size} worker(s) on {self.cfg.cluster.nodes} node(s), "
                f"{len(self.record.evicted())} evicted")

    def _rendezvous_reason(self) -> str:
        return f"forming groups of {self.layout.world_size} rank(s)"

    def _linger(self) -> None:
        """A FAILED job keeps /metrics up a little (if anything scrapes it), so Prometheus
        records the final state and the job-failed alert can fire."""
        server, linger = self.metrics.server, self.cfg.observability.linger_s
        if server is not None and server.scrapes and linger:
            self.on_event(f"metrics: serving the final state for {linger:g} s more")
            self.sleep(linger)

    def _release(self) -> None:
        # Each release runs even if one before it fails: actors or a placement group left
        # behind would hold the cluster.
        try:
            self._end_attempt()
        finally:
            try:
                self.launch.release()
            finally:
                self.client.close()
                self.watch_client.close()
                self.metrics.close()
