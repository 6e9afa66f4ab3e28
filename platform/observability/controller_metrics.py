"""Controller-side Prometheus metrics: the job's state, faults, restarts and recovery times.

Every series carries `job`; none carries `attempt` (the attempt is the value of
longrun_job_attempt): the controller outlives attempts, and a counter split by attempt could
not be summed with increase() across a restart. Causes, kinds, checks and phases come from
the closed vocabularies in vocab.py, and every known value is created at 0 up front, so a
dashboard query returns data (a zero) before the first fault.

    metrics = ControllerMetrics("my-run")
    port = metrics.serve("0.0.0.0", 9400, targets=lambda: target_groups(...))  # /metrics and /sd
    metrics.set_state("RUNNING"); metrics.set_attempt(2); metrics.restart("hang")
    metrics.set_goodput({"productive": 90.0, "redone": 4.0, ...})   # longrun_goodput_ratio 0.9...
    metrics.set_stragglers(0.23, {"node": 8})  # longrun_straggler_slowdown_ratio, longrun_slow_ranks
    metrics.close()
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
from prometheus_client import CollectorRegistry, Counter, Enum, Gauge, Histogram

from longrun.controller.state import JobState
from longrun.goodput.accounting import BUCKETS
from longrun.observability.heartbeat_series import HeartbeatSeries
from longrun.observability.server import ObservabilityServer
from longrun.observability.vocab import (
    CONTROLLER_LABELS,
    DIAGNOSTIC_CHECKS,
    FAULT_KINDS,
    INIT_PHASES,
    STRAGGLER_BLAMES,
    bounded,
    fault_kind,
)

JOB_STATES = tuple(s.value for s in JobState)
# From a missed heartbeat (seconds) to a hang caught by the hard ceiling (minutes).
DETECTION_BUCKETS = (0.5, 1, 2, 5, 10, 20, 30, 60, 120, 300, 600)
# Fault detected -> training again: seconds on a warm cluster, many minutes with a new node.
RECOVERY_BUCKETS = (1, 2, 5, 10, 20, 30, 60, 120, 300, 600, 1200, 1800, 3600)
# An elastic job's resizes (recovery.min_nodes): onto fewer nodes, and back to its configured size.
RESIZE_DIRECTIONS = ("shrink", "grow")


class ControllerMetrics:
    def __init__(self, job: str, *, registry: CollectorRegistry | None = None):
        self.registry = r = registry or CollectorRegistry()
        self.job = job
        labels = CONTROLLER_LABELS
        # An Enum exports one series per state (1 for the current one), labelled by its own
        # name: longrun_job_state{job="...", longrun_job_state="RUNNING"} 1.
        self.state = Enum("longrun_job_state", "The controller's state.", labels, states=list(JOB_STATES),
                          registry=r)
        self.attempt = Gauge("longrun_job_attempt", "Current attempt (0 = the first run).", labels,
                             registry=r)
        self.step = Gauge("longrun_job_step", "Newest step the workers reported.", labels, registry=r)
        self.planned = Gauge("longrun_job_planned_steps", "Steps the job is configured to train.", labels,
                             registry=r)
        self.restarts = Counter("longrun_job_restarts", "Restarts, by the fault that caused them.",
                                (*labels, "cause"), registry=r)
        self.faults = Counter("longrun_job_faults", "Faults detected, by kind (reported or acted upon).",
                              (*labels, "kind"), registry=r)
        self.detection_time = Histogram("longrun_fault_detection_seconds",
                                        "From the fault (last sign of health) to its detection.", labels,
                                        buckets=DETECTION_BUCKETS, registry=r)
        self.recovery_time = Histogram("longrun_recovery_duration_seconds",
                                       "From a fault's detection to training again.", labels,
                                       buckets=RECOVERY_BUCKETS, registry=r)
        # prometheus-client appends _total: exported as longrun_job_steps_lost_total.
        self.steps_lost = Counter("longrun_job_steps_lost", "Steps of training redone after faults (0 per "
                                  "fault is the goal).", labels, registry=r)
        self.last_steps_lost = Gauge("longrun_job_last_fault_steps_lost",
                                     "Steps redone after the most recent fault.", labels, registry=r)
        self.evicted = Gauge("longrun_job_evicted_nodes", "Nodes evicted from the job.", labels, registry=r)
        # prometheus-client appends _total: exported as longrun_elastic_resizes_total.
        self.resizes = Counter("longrun_elastic_resizes", "Elastic resizes: continuing on fewer nodes "
                               "(shrink) or back at the configured size (grow).", (*labels, "direction"),
                               registry=r)
        self.nodes = Gauge("longrun_job_nodes", "Nodes the job runs on now (fewer than configured while an "
                           "elastic job is shrunk).", labels, registry=r)
        self.world_size = Gauge("longrun_job_world_size", "Ranks the job runs with now.", labels, registry=r)
        # Per rank, built at scrape time (observability/heartbeat_series.py: 16,384 ranks a poll).
        self.heartbeats = HeartbeatSeries(job, labels, r)
        self.diag_ok = Gauge("longrun_diagnostics_ok", "Last diagnostic result per node and check (1 = ok).",
                             (*labels, "node", "node_id", "check"), registry=r)
        self.diag_time = Gauge("longrun_diagnostics_duration_seconds",
                               "Duration of the last diagnostic per node and check.",
                               (*labels, "node", "node_id", "check"), registry=r)
        self.goodput = Gauge("longrun_goodput_ratio", "Share of the job's wall time that trained steps "
                             "which count (productive seconds over the job's wall time by the clock).",
                             labels,
                             registry=r)
        # A gauge, though its values are totals: a fault moves seconds from productive to
        # redone once the next attempt says where it resumed (a counter must never fall), and a
        # controller continuing a preempted job starts from the job's persisted totals.
        self.job_seconds = Gauge("longrun_job_seconds_total", "The job's wall time so far, by where it "
                                 "went (goodput/accounting.py: every second in exactly one bucket).",
                                 (*labels, "bucket"), registry=r)
        self.group_init_time = Gauge("longrun_group_init_seconds",
                                     "Communication-group bring-up time of the current attempt (rank 0), "
                                     "per phase.", (*labels, "phase"), registry=r)
        # health/stragglers.py's report of each poll: the what-if and the slow ranks' causes.
        self.straggler_slowdown = Gauge("longrun_straggler_slowdown_ratio",
                                        "How much slower the job steps than with every rank at the median "
                                        "step time (0.12 = 12% slower; the slowest rank sets the pace).",
                                        labels, registry=r)
        self.slow_ranks = Gauge("longrun_slow_ranks", "Ranks slower than health.straggler_factor x the "
                                "median, by cause: node (its node's ranks slow together), data (its "
                                "micro-batches cost more), stage (an uneven pipeline stage), rank (alone).",
                                (*labels, "blame"), registry=r)
        # Created up front: a series that exists at 0 answers queries before anything happens.
        self.state.labels(job).state(JobState.PENDING.value)
        for gauge in (self.attempt, self.step, self.planned, self.evicted, self.last_steps_lost, self.nodes,
                      self.world_size):
            gauge.labels(job).set(0)
        self.steps_lost.labels(job)
        self.goodput.labels(job).set(0)
        self.set_stragglers(0.0, {})
        for bucket in BUCKETS:
            self.job_seconds.labels(job, bucket).set(0)
        for direction in RESIZE_DIRECTIONS:
            self.resizes.labels(job, direction)
        for kind in FAULT_KINDS:
            self.restarts.labels(job, kind)
            self.faults.labels(job, kind)
        self.detection_time.labels(job)
        self.recovery_time.labels(job)
        self._server: ObservabilityServer | None = None
        self.port: int | None = None

    def set_state(self, state: str) -> None:
        if str(state) not in JOB_STATES:  # a bug in the caller, not an operator's input
            raise ValueError(f"unknown job state {state!r}; expected one of {', '.join(JOB_STATES)}")
        self.state.labels(self.job).state(str(state))

    def set_attempt(self, n: int) -> None:
        self.attempt.labels(self.job).set(n)

    def set_step(self, step: int, total: int) -> None:
        self.step.labels(self.job).set(step)
        self.planned.labels(self.job).set(total)

    def restart(self, cause: str) -> None:
        """A restart decided because of `cause` (a fault kind; unknown ones count as "other")."""
        self.restarts.labels(self.job, fault_kind(cause)).inc()

    def fault(self, kind: str) -> None:
        self.faults.labels(self.job, fault_kind(kind)).inc()

    def detection(self, seconds: float) -> None:
        self.detection_time.labels(self.job).observe(seconds)

    def recovery(self, seconds: float, steps_lost: int = 0) -> None:
        self.recovery_time.labels(self.job).observe(seconds)
        self.steps_lost.labels(self.job).inc(steps_lost)
        self.last_steps_lost.labels(self.job).set(steps_lost)

    def set_goodput(self, buckets: dict[str, float], wall_s: float | None = None) -> None:
        """The job's seconds per goodput bucket so far (every bucket of accounting.BUCKETS), and
        its goodput over `wall_s`, its wall time by the clock (None: the buckets' sum)."""
        wall = sum(buckets.values()) if wall_s is None else wall_s
        for bucket in BUCKETS:
            self.job_seconds.labels(self.job, bucket).set(buckets.get(bucket, 0.0))
        self.goodput.labels(self.job).set(buckets.get("productive", 0.0) / wall if wall > 0 else 0.0)

    def set_stragglers(self, slowdown: float, slow_ranks: dict[str, int]) -> None:
        """The newest straggler report: its what-if slowdown and slow ranks per cause (a cause
        absent from `slow_ranks` is 0)."""
        self.straggler_slowdown.labels(self.job).set(slowdown)
        for blame in STRAGGLER_BLAMES:
            self.slow_ranks.labels(self.job, blame).set(slow_ranks.get(blame, 0))

    def set_evicted(self, count: int) -> None:
        self.evicted.labels(self.job).set(count)

    def set_size(self, nodes: int, world_size: int) -> None:
        """The nodes and ranks the job runs with now."""
        self.nodes.labels(self.job).set(nodes)
        self.world_size.labels(self.job).set(world_size)

    def resized(self, direction: str, nodes: int, world_size: int) -> None:
        """An elastic resize to `nodes` nodes and `world_size` ranks ("shrink" or "grow")."""
        if direction not in RESIZE_DIRECTIONS:  # a bug in the caller, not an operator's input
            raise ValueError(f"unknown resize direction {direction!r}; expected one of {RESIZE_DIRECTIONS}")
        self.resizes.labels(self.job, direction).inc()
        self.set_size(nodes, world_size)

    def heartbeat_age(self, rank: int, node: str, seconds: float, sent_at: float | None = None,
                      node_id: str | None = None) -> None:
        """`node`: the rank's node as a person reads it ("host (address)"), `node_id` its Ray id
        (None: `node` is the id)."""
        self.heartbeats.set(rank, node, seconds, sent_at, node_id)

    def heartbeat_ages(self, ranks: np.ndarray, nodes: Sequence[str], ages: np.ndarray,
                       sent_at: np.ndarray, node_ids: Sequence[str] | None = None) -> None:
        """Many ranks' at once (`nodes[r]`: rank r's node by name, `node_ids[r]` by id), without a
        loop over them."""
        self.heartbeats.set_many(ranks, nodes, ages, sent_at, node_ids)

    def forget_ranks(self) -> None:
        """Drop every rank's heartbeat series (an attempt ended): a rank that is gone must not
        keep showing its last age, and the next attempt may place it on another node."""
        self.heartbeats.clear()

    def diagnostics(self, node: str, check: str, ok: bool, seconds: float,
                    node_id: str | None = None) -> None:
        """`node` by name, `node_id` by Ray id (None: `node` is the id)."""
        check = bounded(check, DIAGNOSTIC_CHECKS, "diagnostic check")
        node_id = node if node_id is None else node_id
        self.diag_ok.labels(self.job, node, node_id, check).set(1 if ok else 0)
        self.diag_time.labels(self.job, node, node_id, check).set(seconds)

    def group_init(self, phase: str, seconds: float) -> None:
        self.group_init_time.labels(self.job, bounded(phase, INIT_PHASES, "init phase")).set(seconds)

    def serve(self, host: str = "127.0.0.1", port: int = 0, *,
              targets: Callable[[], list[dict]] | None = None) -> int:
        """Serve /metrics (and /sd when `targets` is given: the job's http_sd target groups,
        see discovery.target_groups); returns the bound port."""
        self._server = ObservabilityServer(self.registry, targets=targets, host=host, port=port)
        self.port = self._server.port
        return self.port

    @property
    def server(self) -> ObservabilityServer | None:
        return self._server

    def close(self) -> None:
        if self._server is not None:
            self._server.close()
            self._server = None
