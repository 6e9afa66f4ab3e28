"""What hears the controller: the event log, metrics, service discovery, the progress record,
goodput.

The controller decides and moves; it does not write metrics or discovery files itself. Every
move, event, heartbeat snapshot and attempt end goes to its `Listeners`, and each listener
does its own part (as Ray Train v2's controller callbacks do). A new consumer (a webhook, an
audit log) is one more listener, not one more line in every state handler.

    listeners = standard_listeners(cfg, record, print, metrics, targets, progress, warm_spares, goodput)
    listeners.moved(move, attempt)   # every listener hears it

`ending` is heard once an attempt's workers are stopped and before its Redis keys are deleted
(the last chance to read what they wrote: the step ledger); `ended` after.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import replace
from typing import Any

import numpy as np
import redis

from longrun.config import JobConfig
from longrun.controller.attempt import Attempt
from longrun.controller.job_state import JobRecordStore
from longrun.controller.state import JobState, Transition
from longrun.goodput.accounting import StepRecord
from longrun.goodput.tracker import GoodputTracker
from longrun.health.decisions import PRECEDENCE
from longrun.health.node_beats import Beats
from longrun.health.policy import Action, Incident
from longrun.health.stragglers import StragglerReport
from longrun.node_names import NodeNames
from longrun.observability.controller_metrics import ControllerMetrics
from longrun.observability.discovery import write_file_sd

log = logging.getLogger(__name__)

LAST_LINES = 10  # of a rank at fault, in its fault event
CONSOLE_LINES = 3  # of those, on the console (of the most telling fault only)
# (attempt, rank) -> (the rank's log file, its last lines): controller/rank_logs.py
LastLines = Callable[[int, int], tuple[str, list[str]]]
# A straggler event whose only news is that slow data came or went: at most this often.
STRAGGLER_EVENT_EVERY_S = 300.0
_NO_FINDINGS: tuple = (frozenset(), frozenset(), frozenset(), False)


class Listener:
    """Every hook does nothing unless a listener overrides it."""

    def moved(self, move: Transition, attempt: Attempt) -> None: ...
    def event(self, kind: str, attempt: Attempt, message: str, extra: dict[str, Any]) -> None: ...
    def declared(self, attempt: Attempt, incidents: list[Incident], wall: float) -> None: ...
    def diagnosed(self, reports: list[dict[str, Any]]) -> None: ...
    # One poll's heartbeats (health/node_beats.py): columns for every rank; `beats.live()` builds
    # Heartbeat objects, which costs ~80 ms at 16,384 ranks: listeners use the columns.
    def heartbeats(self, attempt: Attempt, beats: Beats, wall: float) -> None: ...
    # The straggler report of a poll (health/stragglers.py): what slow ranks cost, and why.
    def stragglers(self, attempt: Attempt, report: StragglerReport, wall: float) -> None: ...
    def trained(self, attempt: Attempt) -> None: ...
    def ending(self, attempt: Attempt) -> None: ...
    def ended(self, attempt: Attempt) -> None: ...
    # What the step ledger says, as the goodput tracker reads it (by attempt number):
    def resumed(self, attempt: int, step: int | None, source: str, seconds: float) -> None: ...
    def steps(self, attempt: int, records: list[StepRecord]) -> None: ...


class Listeners(Listener):
    """Hands every hook to each listener in turn, with the nodes in its words named as a person
    reads them (`names`: node_names.py): a reason, an event's message, a fault's detail. The
    fields that identify a node (an event's `node`, an incident's) keep its id."""

    def __init__(self, listeners: Iterable[Listener], names: NodeNames | None = None):
        self.listeners = list(listeners)
        self.names = names if names is not None else NodeNames()

    def moved(self, move: Transition, attempt: Attempt) -> None:
        self._all("moved", (replace(move, reason=self.names.in_text(move.reason)), attempt))

    def event(self, kind: str, attempt: Attempt, message: str, extra: dict[str, Any]) -> None:
        if extra.get("node") in self.names.table:
            extra = extra | {"node_name": self.names.name(extra["node"])}
        self._all("event", (kind, attempt, self.names.in_text(message), extra))

    def declared(self, attempt: Attempt, incidents: list[Incident], wall: float) -> None:
        named = [replace(i, detail=self.names.in_text(i.detail)) for i in incidents]
        self._all("declared", (attempt, named, wall))

    def diagnosed(self, reports: list[dict[str, Any]]) -> None:
        self._all("diagnosed", ([r | {"node_name": self.names.name(r["node"])} for r in reports],))

    def heartbeats(self, *args: Any) -> None:
        self._all("heartbeats", args)

    def stragglers(self, *args: Any) -> None:
        self._all("stragglers", args)

    def trained(self, *args: Any) -> None:
        self._all("trained", args)

    def ending(self, *args: Any) -> None:
        self._all("ending", args)

    def ended(self, *args: Any) -> None:
        self._all("ended", args)

    def resumed(self, *args: Any) -> None:
        self._all("resumed", args)

    def steps(self, *args: Any) -> None:
        self._all("steps", args)

    def _all(self, hook: str, args: tuple[Any, ...]) -> None:
        for listener in self.listeners:
            getattr(listener, hook)(*args)


class EventLog(Listener):
    """The job's event log in Redis (what `longrun status` shows) and the operator's lines."""

    def __init__(self, record: JobRecordStore, on_event: Callable[[str], None],
                 last_lines: LastLines | None = None):
        self.record, self.on_event, self.last_lines = record, on_event, last_lines
        self._stragglers: tuple = _NO_FINDINGS  # what the last "stragglers" event reported
        self._stragglers_at: float | None = None

    def moved(self, move: Transition, attempt: Attempt) -> None:
        self.record.record_transition(move, attempt.number)
        self.on_event(f"state {move.target}: {move.reason}")

    def event(self, kind: str, attempt: Attempt, message: str, extra: dict[str, Any]) -> None:
        self.record.event(kind, attempt.number, message, **extra)
        self.on_event(f"{kind}: {message}")

    def declared(self, attempt: Attempt, incidents: list[Incident], wall: float) -> None:
        # The most telling fault first (a dead rank explains its peers' errors): only its last
        # lines go to the console; every fault's go to the record.
        incidents = sorted(incidents, key=lambda i: PRECEDENCE.index(i.kind))
        for n, i in enumerate(incidents):
            if i.rank is None or self.last_lines is None:
                self.event("fault", attempt, i.detail, fault_extra(i, names=node_names_of(attempt)))
                continue
            # Where to look: the rank's log file, and its last lines in the event (what
            # `longrun status` shows; the node may be gone, the record is not).
            path, lines = self.last_lines(attempt.number, i.rank)
            extra = fault_extra(i, path, node_names_of(attempt))
            self.record.event("fault", attempt.number, i.detail, **extra, last_lines=lines[-LAST_LINES:])
            node = extra.get("node_name") or i.node  # where to look, unless the detail says it
            where = f"rank {i.rank} was on node {node}, " if node and node not in i.detail else ""
            self.on_event(f"fault: {i.detail}; {where}its last lines are in {path}")
            for line in lines[-CONSOLE_LINES:] if n == 0 else ():  # a record's first line; all in the file
                self.on_event(f"  rank {i.rank}| {first_line(line)}")

    def stragglers(self, attempt: Attempt, report: StragglerReport, wall: float) -> None:
        # An event when what is found changes (a node, stage or lone rank named or cleared),
        # not every poll: the numbers move each step, the record's `stragglers` field has them.
        # Slow data comes and goes with the batches, so it is news at most every
        # STRAGGLER_EVENT_EVERY_S.
        key = straggler_findings(report)
        if key == self._stragglers:
            return
        if (key[:3] == self._stragglers[:3] and self._stragglers_at is not None
                and wall - self._stragglers_at < STRAGGLER_EVENT_EVERY_S):
            return
        self._stragglers, self._stragglers_at = key, wall
        self.event("stragglers", attempt, report.sentence(node_names_of(attempt)),
                   {"slowdown": round(report.slowdown, 4), "slow_ranks": report.by_blame()})

    def ended(self, attempt: Attempt) -> None:
        self._stragglers, self._stragglers_at = _NO_FINDINGS, None  # the next attempt starts afresh

    def resumed(self, attempt: int, step: int | None, source: str, seconds: float) -> None:
        if step is None:
            return
        message = resumed_message(step, source, seconds)
        self.record.event("resumed", attempt, message, step=step, source=source, seconds=round(seconds, 3))
        self.on_event(message)


def straggler_findings(report: StragglerReport) -> tuple:
    """What a straggler report found, without its numbers: the slow nodes, the slow stages, the
    ranks slow alone, and whether any rank is slow from its data."""
    found = {b: set() for b in ("node", "stage", "rank")}
    data = False
    for s in report.slow:
        if s.blame == "data":
            data = True
        else:
            found[s.blame].add(s.node if s.blame == "node" else s.stage if s.blame == "stage" else s.rank)
    found["stage"] |= {stage for stage, _ in report.stages}
    return (frozenset(found["node"]), frozenset(found["stage"]), frozenset(found["rank"]), data)


def first_line(text: str, limit: int = 240) -> str:
    """A log record's first line, cut at `limit` characters: one console line per record."""
    line = text.split("\n", 1)[0]
    cut = len(line) > limit or "\n" in text
    return line[:limit] + (" ..." if cut else "")


def fault_extra(incident: Incident, log_file: str | None = None,
                names: Mapping[str, str] | None = None) -> dict[str, Any]:
    """A declared fault's fields in the event log and the journal: its node by id, and by name
    where `names` (node id -> "host (address)") knows it."""
    extra = {"fault": incident.kind, "rank": incident.rank, "node": incident.node, "step": incident.step}
    if names and incident.node in names:
        extra["node_name"] = names[incident.node]
    return extra | {"log_file": log_file} if log_file else extra


def node_names_of(attempt: Attempt) -> Mapping[str, str]:
    """The names of the attempt's nodes (none before it is placed)."""
    return attempt.group.node_names if attempt.group is not None else {}


def resumed_message(step: int, source: str, seconds: float) -> str:
    what = "the memory snapshot" if source == "memory" else "the checkpoint"
    return f"resumed from {what} of step {step} (restored in {seconds:.1f} s)"


class MetricsListener(Listener):
    """The controller's Prometheus series (see observability/controller_metrics.py)."""

    def __init__(self, metrics: ControllerMetrics, record: JobRecordStore, cfg: JobConfig):
        self.metrics, self.record, self.total_steps = metrics, record, cfg.training.steps
        # (attempt, each rank's node by name, by id): for the heartbeat series' labels
        self._nodes_of: tuple[int, list[str], list[str]] = (-1, [], [])
        self.metrics.set_size(cfg.cluster.nodes, cfg.world_size)  # until an elastic job resizes

    def moved(self, move: Transition, attempt: Attempt) -> None:
        self.metrics.set_state(str(move.target))
        self.metrics.set_attempt(attempt.number)
        if move.target is JobState.RECOVERING and move.decision.action is not Action.RESIZE:
            self.metrics.restart(move.decision.cause.kind if move.decision.cause else "other")
        if move.target in (JobState.PLACING, JobState.RECOVERING):
            self.metrics.set_evicted(len(self.record.evicted()))
        if move.target is JobState.SUCCEEDED:
            self.metrics.set_step(attempt.summaries[0]["step"], self.total_steps)

    def event(self, kind: str, attempt: Attempt, message: str, extra: dict[str, Any]) -> None:
        if kind == "recovered" and not _resized(attempt):  # a grow is no fault to recover from
            self.metrics.recovery(extra["seconds"], extra["steps_lost"])
        elif kind == "resized":
            self.metrics.resized(extra["direction"], extra["nodes"], extra["world_size"])

    def declared(self, attempt: Attempt, incidents: list[Incident], wall: float) -> None:
        for i in incidents:
            self.metrics.fault(i.kind)
        seen = [attempt.last_beat_at[i.rank] for i in incidents if i.rank in attempt.last_beat_at]
        if seen:  # from the last sign of life of a rank at fault: an upper bound on detection
            self.metrics.detection(max(0.0, wall - min(seen)))

    def diagnosed(self, reports: list[dict[str, Any]]) -> None:
        for report in reports:
            node = report["node"]
            for name, ok, seconds, _detail in report["checks"]:
                self.metrics.diagnostics(report.get("node_name", node), name, ok, seconds, node_id=node)

    def heartbeats(self, attempt: Attempt, beats: Beats, wall: float) -> None:
        cols = beats.columns
        ranks = np.flatnonzero(cols.present)
        if self._nodes_of[0] != attempt.number:  # each rank's node, named once per attempt
            ids = [attempt.group.node_of(r) for r in range(cols.world_size)]
            names = attempt.group.node_names
            self._nodes_of = (attempt.number, [names.get(n, n) for n in ids], ids)
        sent = cols.sent_at[ranks]
        self.metrics.heartbeat_ages(ranks, self._nodes_of[1], np.maximum(0.0, wall - sent), sent,
                                    node_ids=self._nodes_of[2])
        self.metrics.set_step(int(cols.step[ranks].min()), self.total_steps)

    def stragglers(self, attempt: Attempt, report: StragglerReport, wall: float) -> None:
        self.metrics.set_stragglers(report.slowdown, report.by_blame())

    def ended(self, attempt: Attempt) -> None:
        self.metrics.forget_ranks()  # its ranks are gone; the next attempt may place them elsewhere
        self.metrics.set_stragglers(0.0, {})  # and so is their pace


def _resized(attempt: Attempt) -> bool:
    """Whether `attempt` started because an elastic job grew (not after a fault)."""
    decision = attempt.recovery.decision if attempt.recovery is not None else None
    return decision is not None and decision.action is Action.RESIZE


class Discovery(Listener):
    """Prometheus scrape targets follow the attempts: `targets` (the controller's: the live
    attempt's worker endpoints and its own) is served at /sd, and written to
    observability.file_sd_path, when set, whenever it changed."""

    def __init__(self, cfg: JobConfig, targets: Callable[[], list[dict]]):
        self.path, self.targets = cfg.observability.file_sd_path, targets
        self._written: list[dict] | None = None
        self._endpoints_seen = -1

    def moved(self, move: Transition, attempt: Attempt) -> None:
        self._refresh()  # the controller's own target first; then a new attempt or a stopped one

    def heartbeats(self, attempt: Attempt, beats: Beats, wall: float) -> None:
        # Workers publish their endpoints in their heartbeats; rebuilt only when one changed.
        if attempt.endpoints_changed != self._endpoints_seen:
            self._endpoints_seen = attempt.endpoints_changed
            self._refresh()

    def ended(self, attempt: Attempt) -> None:
        self._refresh()  # the attempt's workers leave the targets

    def _refresh(self) -> None:
        if not self.path:
            return
        groups = self.targets()
        if groups == self._written:
            return
        try:
            write_file_sd(self.path, groups)
            self._written = groups
        except OSError as exc:  # discovery is for operators; it must not stop the job
            log.warning("file_sd %s not written: %s", self.path, exc)


class ProgressRecord(Listener):
    """Step, loss and phase in the job record at every poll: best effort, refreshed next poll."""

    def __init__(self, record: JobRecordStore):
        self.record = record  # on the quick client: a miss must not stall the watch

    def heartbeats(self, attempt: Attempt, beats: Beats, wall: float) -> None:
        cols = beats.columns
        ranks = np.flatnonzero(cols.present)
        first = cols.beat(int(ranks[0]))  # the lowest live rank's loss and phase
        try:
            self.record.update(step=int(cols.step[ranks].min()), loss=first.loss, phase=first.phase)
        except (redis.RedisError, OSError) as exc:
            log.warning("job record progress not written: %s", exc)

    def steps(self, attempt: int, records: list[StepRecord]) -> None:
        # The newest validation loss and its step (heartbeats carry only the training loss).
        validated = [r for r in records if (r.metrics or {}).get("val_loss") is not None]
        if not validated:
            return
        newest = validated[-1]
        try:
            self.record.update(val_loss=newest.metrics["val_loss"], val_step=newest.step)
        except (redis.RedisError, OSError) as exc:
            log.warning("job record validation loss not written: %s", exc)

    def stragglers(self, attempt: Attempt, report: StragglerReport, wall: float) -> None:
        # What `longrun status` shows under "stragglers:", the newest poll's.
        try:
            self.record.update(stragglers=report.sentence(node_names_of(attempt)))
        except (redis.RedisError, OSError) as exc:
            log.warning("job record straggler report not written: %s", exc)

    def ended(self, attempt: Attempt) -> None:
        try:  # the ended attempt's pace says nothing about the next one
            self.record.update(stragglers="")
        except (redis.RedisError, OSError) as exc:
            log.warning("job record straggler report not cleared: %s", exc)


class SpareWarmer(Listener):
    """Once an attempt trains, the launcher warms the next one's spares: not earlier, so their
    imports do not slow this attempt's start."""

    def __init__(self, warm: Callable[[], None]):
        self.warm = warm

    def trained(self, attempt: Attempt) -> None:
        self.warm()


class KeeperReviver(Listener):
    """While an attempt trains, the launcher's snapshot keepers are looked at every `every_s` and
    a dead one replaced (`RayLauncher.revive_keepers`), so a keeper lost mid-attempt costs the
    snapshots of seconds, not of the rest of the attempt. From the attempt's first step to its
    end only: its launch (which plans the restore from the keepers and starts them) is over."""

    def __init__(self, revive: Callable[[], None], every_s: float = 5.0,
                 clock: Callable[[], float] = time.monotonic):
        self.revive, self.every_s, self.clock = revive, every_s, clock
        self._last: float | None = None
        self._training = False

    def trained(self, attempt: Attempt) -> None:
        self._training, self._last = True, self.clock()  # the launch just made them: look later

    def ending(self, attempt: Attempt) -> None:
        self._training = False

    def heartbeats(self, attempt: Attempt, beats: Beats, wall: float) -> None:
        now = self.clock()
        if not self._training or now - self._last < self.every_s:
            return
        self._last = now
        self.revive()


class GoodputListener(Listener):
    """Where the job's wall time goes (goodput/): the controller's moves and declared faults,
    the step ledger read each poll and once more before an attempt's keys are deleted, the
    summary persisted in Redis and exported as metrics; the job's goodput line at its end."""

    def __init__(self, tracker: GoodputTracker, metrics: ControllerMetrics, on_event: Callable[[str], None]):
        self.tracker, self.metrics, self.on_event = tracker, metrics, on_event

    def moved(self, move: Transition, attempt: Attempt) -> None:
        decision = move.decision
        self.tracker.moved(move.target, move.at, attempt=attempt.number, world_size=attempt.world_size,
                           resize=decision is not None and decision.action is Action.RESIZE,
                           cause=decision.cause.kind if decision is not None and decision.cause else None)
        summary = self.tracker.summary()
        self.metrics.set_goodput(summary.buckets, summary.wall_s)
        if move.target.terminal or move.target is JobState.RECOVERING:  # also in the log status reads
            self.on_event(summary.describe())

    def event(self, kind: str, attempt: Attempt, message: str, extra: dict[str, Any]) -> None:
        if kind == "waiting_for_nodes":
            self.tracker.waiting()

    def declared(self, attempt: Attempt, incidents: list[Incident], wall: float) -> None:
        if incidents:
            self.tracker.declared(wall, incidents[0].kind)

    def heartbeats(self, attempt: Attempt, beats: Beats, wall: float) -> None:
        self.tracker.poll(attempt.number)
        summary = self.tracker.summary()
        self.metrics.set_goodput(summary.buckets, summary.wall_s)

    def ending(self, attempt: Attempt) -> None:
        self.tracker.ending(attempt.number)


def standard_listeners(cfg: JobConfig, record: JobRecordStore, on_event: Callable[[str], None],
                       metrics: ControllerMetrics, targets: Callable[[], list[dict]],
                       progress: JobRecordStore, warm_spares: Callable[[], None],
                       goodput: GoodputTracker | None = None,
                       last_lines: LastLines | None = None, names: NodeNames | None = None) -> Listeners:
    """What every controller has listening: the event log (and `on_event` lines; a fault names
    its rank's log file and last lines, from `last_lines`), metrics, scrape targets (`targets`),
    progress in the job record (`progress`: on a client that fails fast), the launcher's spares
    (`warm_spares`) and goodput (`goodput`); nodes named by `names` in what they hear."""
    listeners: list[Listener] = [EventLog(record, on_event, last_lines),
                                 MetricsListener(metrics, record, cfg),
                                 Discovery(cfg, targets), ProgressRecord(progress), SpareWarmer(warm_spares)]
    if goodput is not None:
        listeners.append(GoodputListener(goodput, metrics, on_event))
    return Listeners(listeners, names)
