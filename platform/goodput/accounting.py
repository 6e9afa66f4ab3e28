"""Where a job's wall time went: every second in exactly one bucket. Pure: no I/O, no clock.

    account = GoodputAccount(started_at=t0)
    account.moved(JobState.PLACING, t1, attempt=0)        # every move of the controller
    account.moved(JobState.RUNNING, t2, attempt=0)
    account.began(0, Restore(step=None, source="none", seconds=0.0, at=t3))   # rank 0's restore
    account.steps(0, [StepRecord(step=1, end=t4, seconds=t4 - t3), ...])     # rank 0's steps
    account.declared(t5, "dead"); account.attempt_ended(0, last_done=7)
    account.moved(JobState.RECOVERING, t6, attempt=0, cause="dead")
    ...
    account.resumed(1, step=5, source="memory")   # the lowest step any rank of attempt 1 restored
    account.buckets(now)    # {bucket: seconds}, summing to the wall time accounted so far
    account.accounted_to(now)   # ... which is the clock from account.origin to here (less paused_s)

The controller's states give the outline: PENDING, PLACING, DIAGNOSING and RENDEZVOUS are
startup (PLACING after an elastic job began waiting for nodes is waiting_for_nodes),
RECOVERING is backoff. An attempt's time in RUNNING (and PREEMPTING, which continues it) is
split by the step ledger its lowest rank wrote (goodput/ledger.py): before training began, the
restore (by source, its own seconds) and startup; then each step record (from the end of the
one before) as its checkpoint, snapshot, validation and data-wait parts and productive time; after the
last record, by how the attempt ended: detection from there to the fault's declaration and
backoff on to the next placement after a fault; shutdown after success or a stop;
preemption_save after a stop request or a grow (the save at the agreed step).

When an attempt restores step r, the productive time of every earlier record of a step after
r moves to redone: that work was lost. Steps lost per fault are the newest step any rank
finished in the failing attempt (the ledger's `done`) minus the step the next attempt restored.

One job, several controllers (`Carried`): a rerun after PREEMPTED or after its controller died
continues the buckets, the faults and the per-step detail the previous one persisted, so a
restore of an older step still moves that work to redone. After a death, the ledger records the
dead controller never read continue its attempt's span, the death is a fault (`controller_lost`)
and the time from the last moment accounted to the new controller's start is controller_down.
The wall time is the clock's: from the first controller's start (`origin`) to now, less the time
the job lay preempted between runs (`paused_s`, a deliberate stop); the buckets are accumulated
separately and must add up to it (`accounted_to` - `origin` - `paused_s`), which is checked.

A week-long job must not grow this object: per-step detail is kept only for the newest
`window_steps` steps (the ones a restore could still send back; default a few checkpoint
intervals), older steps are only sums, and the fault list keeps the last `max_faults`.
Clocks: worker and controller times are compared directly; a record that ends after its attempt
did (clock skew) is clipped from its productive time so the buckets still add up.
"""

from __future__ import annotations

import json
from collections import deque
from dataclasses import asdict, dataclass, field
from typing import Any

from longrun.kinds import CONTROLLER_LOST, JobState

BUCKETS = ("productive", "redone", "startup", "restore_memory", "restore_storage", "checkpoint",
           "snapshot", "validation", "data_wait", "detection", "backoff", "controller_down",
           "waiting_for_nodes", "preemption_save", "shutdown")
LOSSES = BUCKETS[1:]  # everything that is not productive
RESTORE_SOURCES = ("memory", "storage", "none")

_RUNNING = frozenset({JobState.RUNNING, JobState.PREEMPTING})
_OUTSIDE_RUNNING = {JobState.PENDING: "startup", JobState.PLACING: "startup", JobState.DIAGNOSING: "startup",
                    JobState.RENDEZVOUS: "startup", JobState.RECOVERING: "backoff"}


@dataclass(frozen=True)
class StepRecord:
    """One step of an attempt's lowest rank: when it ended, the wall seconds since the record
    before it (or since training began), and how much of that was spent blocked on a checkpoint,
    a memory snapshot and the data."""

    step: int
    end: float
    seconds: float
    checkpoint_s: float = 0.0
    snapshot_s: float = 0.0
    data_s: float = 0.0
    validation_s: float = 0.0  # a validation pass after the step (trainer/validation.py)
    # The step's training metrics by name (StepMetrics.report(): loss, grad_norm, lr, tokens,
    # tokens_per_s, ...), for the driver's progress line and the journal; None for a step whose
    # data was skipped.
    metrics: dict[str, Any] | None = None

    @property
    def start(self) -> float:
        return self.end - self.seconds

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, raw: str | bytes) -> StepRecord:
        d = json.loads(raw)
        return cls(step=int(d["step"]), end=float(d["end"]), seconds=float(d["seconds"]),
                   checkpoint_s=float(d.get("checkpoint_s", 0.0)), snapshot_s=float(d.get("snapshot_s", 0.0)),
                   data_s=float(d.get("data_s", 0.0)), validation_s=float(d.get("validation_s", 0.0)),
                   metrics=d.get("metrics"))


@dataclass(frozen=True)
class Restore:
    """What a rank restored at its attempt's start: `step` (None: nothing), from `source`, in
    `seconds`; `at` is when it finished, which is when training began on that rank."""

    step: int | None
    source: str
    seconds: float
    at: float
    nbytes: int | None = None  # the state it restored (None: unknown): with `seconds`, a storage rate

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, raw: str | bytes) -> Restore:
        d = json.loads(raw)
        step, nbytes = d.get("step"), d.get("nbytes")
        return cls(step=None if step is None else int(step), source=str(d.get("source", "none")),
                   seconds=float(d.get("seconds", 0.0)), at=float(d["at"]),
                   nbytes=None if nbytes is None else int(nbytes))

    @property
    def storage_rate(self) -> float | None:
        """Bytes per second of a restore from storage (None: not one, or not measured)."""
        if self.source != "storage" or self.step is None or not self.nbytes or self.seconds <= 0:
            return None
        return self.nbytes / self.seconds


@dataclass
class Fault:
    """A fault that ended an attempt, and what it cost in steps once the next restore is known."""

    attempt: int
    kind: str
    declared_at: float
    last_step: int  # the newest step any rank of the failing attempt finished
    restored_step: int | None = None  # the step the next attempt restored (None: not yet)
    steps_lost: int | None = None
    restored_from: str | None = None  # "memory" or "storage" (or "none": trained from scratch)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Fault:
        return cls(**{k: d.get(k) for k in cls.__dataclass_fields__})


@dataclass
class Span:
    """One attempt's time in RUNNING and PREEMPTING (persisted, less its restore, so a controller
    that takes over after a death continues it from the ledger)."""

    attempt: int
    start: float
    cursor: float | None = None  # attributed up to here (None: training has not begun per the ledger)
    restore: Restore | None = None  # rank 0's, for the timeline
    last_step: int | None = None  # the newest step recorded (records are deduplicated by step)
    productive: float = 0.0  # this span's productive seconds, so a skewed clock can be clipped
    declared_at: float | None = None
    kind: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return {k: v for k, v in asdict(self).items() if k != "restore"}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Span:
        return cls(**{k: d[k] for k in cls.__dataclass_fields__ if k in d and k != "restore"})


@dataclass
class Carried:
    """What a continuing controller takes over from the persisted summary (a SIGTERM and a
    rerun are one job): the buckets, the recent faults, the newest step, and how the previous
    run ended (PREEMPTED: its restart is a preemption whose cost the next restore tells)."""

    buckets: dict[str, float] = field(default_factory=dict)
    faults: list[dict[str, Any]] = field(default_factory=list)
    last_step: int = 0
    ended: str | None = None
    ended_at: float | None = None
    attempt: int | None = None
    origin: float | None = None  # the first controller's start (None: a summary from before the clock)
    paused_s: float = 0.0  # the time the job lay preempted between runs: off the clock
    accounted_to: float | None = None  # the buckets account up to here (None: ended_at)
    detail: list[tuple[int, float]] = field(default_factory=list)  # (step, productive s), the window
    span: Span | None = None  # the attempt the previous controller was running, if it died there
    steps: list[StepRecord] = field(default_factory=list)  # that attempt's records it never read


class GoodputAccount:
    def __init__(self, started_at: float, *, window_steps: int = 4096, max_faults: int = 100,
                 carried: Carried | None = None):
        if window_steps < 1:
            raise ValueError(f"window_steps must be >= 1, got {window_steps}")
        self.started_at = started_at  # this controller's start
        self.origin = started_at  # the job's: where its wall clock starts
        self.paused_s = 0.0
        self.seconds = dict.fromkeys(BUCKETS, 0.0)
        self.faults: deque[Fault] = deque(maxlen=max_faults)
        self.frontier = 0  # the newest step trained on the job's current path
        self._pending: list[Fault] = []  # faults whose next restore is not known yet
        self.state = JobState.PENDING
        self._since = started_at
        self._waiting_since: float | None = None
        self._span: Span | None = None
        self._detail: deque[tuple[int, float]] = deque()  # (step, productive seconds), step order
        self._window = window_steps
        self._resumed: dict[int, int] = {}  # attempt -> the lowest step it restored (applied)
        if carried is not None:
            self._continue(carried)

    def _continue(self, carried: Carried) -> None:
        """Take over from the controller before this one (see the module's docstring)."""
        now = self.started_at
        for bucket, seconds in carried.buckets.items():
            if bucket in self.seconds:
                self.seconds[bucket] += float(seconds)
        self.faults.extend(Fault.from_dict(f) for f in carried.faults)
        for fault in reversed(self.faults):  # the newest ones the next restore still has to resolve
            if fault.steps_lost is not None:
                break
            self._pending.insert(0, fault)
        self.frontier = carried.last_step
        self._detail.extend((int(step), float(s)) for step, s in carried.detail[-self._window:])
        last = carried.accounted_to if carried.accounted_to is not None else carried.ended_at or now
        # A summary written before the clock was persisted: its buckets were its wall time.
        self.origin = carried.origin if carried.origin is not None else last - sum(self.seconds.values())
        self.paused_s = carried.paused_s
        attempt = carried.attempt if carried.attempt is not None else -1
        if carried.ended == JobState.PREEMPTED:  # the stop is the "fault"; the rerun's restore its cost
            self.paused_s += max(0.0, now - last)  # stopped on purpose: off the clock
            fault = Fault(attempt, "preempted", carried.ended_at or now, carried.last_step)
        else:  # its controller died: what its attempt trained meanwhile, then nothing ran
            if carried.span is not None:
                last = self._continue_span(carried.span, carried.steps, now)
            self.seconds["controller_down"] += max(0.0, now - min(last, now))
            fault = Fault(attempt, CONTROLLER_LOST, now, self.frontier)
        self.faults.append(fault)
        self._pending.append(fault)

    def _continue_span(self, span: Span, records: list[StepRecord], now: float) -> float:
        """The dead controller's running attempt, on from where it was accounted, by the ledger
        records it never read; returns up to when that accounts (its newest record)."""
        for r in sorted(records, key=lambda r: r.step):
            if span.last_step is not None and r.step <= span.last_step:
                continue
            if span.cursor is None:
                self._begin(span, r.start)
            self._record(span, r)
        return self._tail_start(span, now)

    # -- the controller's moves ----------------------------------------------------------------
    def moved(self, target: JobState, at: float, *, attempt: int, resize: bool = False,
              cause: str | None = None) -> None:
        """The controller moved into `target` at `at` (its wall clock), during `attempt`.
        `resize`: a move into RECOVERING that is an elastic grow, not a fault; `cause`: the
        kind of fault a move into RECOVERING or FAILED answers."""
        target = JobState(target)
        at = max(at, self._since)
        if self.state in _RUNNING:
            if target is not JobState.PREEMPTING:  # PREEMPTING continues the attempt's span
                self._close_span(at, target, resize, cause)
        elif not self.state.terminal:
            self._add_outside(self.state, self._since, at)
        self.state, self._since = target, at
        self._waiting_since = None
        if target is JobState.RUNNING:
            self._span = Span(attempt, at)

    def waiting(self, at: float) -> None:
        """An elastic job in PLACING began waiting for nodes (time from here is waiting_for_nodes)."""
        if self.state is JobState.PLACING and self._waiting_since is None:
            self._waiting_since = max(at, self._since)

    def declared(self, at: float, kind: str) -> None:
        """A fault of the running attempt was declared (the policy decides next)."""
        if self._span is not None:
            self._span.declared_at, self._span.kind = at, kind

    # -- the step ledger ----------------------------------------------------------------------
    def began(self, attempt: int, restore: Restore) -> None:
        """Rank 0 of `attempt` restored (or found nothing) and began training at `restore.at`."""
        span = self._span_of(attempt)
        if span is None or span.restore is not None:
            return
        span.restore = restore
        if span.cursor is None:
            self._begin(span, restore.at)

    def resumed(self, attempt: int, step: int | None, source: str) -> None:
        """Every rank of `attempt` restored; `step` is the lowest (None: trained from scratch).
        Work on steps after it is redone, and the faults before it get their cost."""
        step = step or 0
        if self._resumed.get(attempt, step + 1) <= step:
            return  # a lower step was already applied
        self._resumed[attempt] = step
        for old in [a for a in self._resumed if a < attempt]:
            del self._resumed[old]
        self._redo_after(step)
        span = self._span_of(attempt)
        self.frontier = max(step, span.last_step or 0) if span is not None else step
        for fault in self._pending:
            fault.restored_step, fault.restored_from = step, source
            fault.steps_lost = max(0, fault.last_step - step)
        self._pending = []

    def steps(self, attempt: int, records: list[StepRecord]) -> None:
        """New step records of `attempt`'s lowest rank (any order; repeats are ignored)."""
        span = self._span_of(attempt)
        if span is None:
            return
        for r in sorted(records, key=lambda r: r.step):
            if span.last_step is not None and r.step <= span.last_step:
                continue  # sent twice (a reply lost in a Redis blip)
            if span.cursor is None:
                self._begin(span, r.start)
            self._record(span, r)

    def attempt_ended(self, attempt: int, last_done: int | None) -> None:
        """The attempt's workers are gone; `last_done` is the newest step any rank finished."""
        if last_done is not None and self._span is not None and self._span.attempt == attempt:
            self.frontier = max(self.frontier, last_done)

    # -- reading ------------------------------------------------------------------------------
    def buckets(self, now: float | None = None) -> dict[str, float]:
        """Seconds per bucket so far. With `now`, the current state's time up to `now` too when
        its bucket is already known (anything outside RUNNING); a running attempt is accounted
        up to its newest step record."""
        out = dict(self.seconds)
        if now is not None and not self.state.terminal and self.state not in _RUNNING:
            for bucket, seconds in self._outside(self.state, self._since, max(now, self._since)):
                out[bucket] += seconds
        return out

    def accounted_to(self, now: float) -> float:
        """The moment `buckets(now)` account up to: `now` outside RUNNING, a running attempt's
        newest step record (or its start, before training began), a terminal state's move."""
        span = self._span
        if self.state in _RUNNING and span is not None:
            return span.cursor if span.cursor is not None else span.start
        return self._since if self.state.terminal else max(now, self._since)

    def wall(self, now: float) -> float:
        """The job's wall time by the clock: from its first controller's start, less paused_s."""
        return now - self.origin - self.paused_s

    def goodput(self, now: float | None = None) -> float:
        """Productive seconds over the clock's wall time up to `now` (None: up to what is accounted)."""
        wall = self.wall(self.accounted_to(self._since) if now is None else now)
        return self.buckets(now)["productive"] / wall if wall > 0 else 0.0

    def carried_detail(self) -> dict[str, Any]:
        """What a controller taking over after this one's death needs beyond the summary: the
        per-step detail of the window and the running attempt's span (JSON-ready, bounded)."""
        span = self._span if self.state in _RUNNING else None
        return {"detail": [[step, round(s, 6)] for step, s in self._detail],
                "span": span.to_dict() if span is not None else None}

    # -- the pieces ---------------------------------------------------------------------------
    def _span_of(self, attempt: int) -> Span | None:
        span = self._span
        return span if span is not None and span.attempt == attempt else None

    def _outside(self, state: JobState, start: float, end: float) -> list[tuple[str, float]]:
        bucket = _OUTSIDE_RUNNING.get(state)
        if bucket is None or end <= start:
            return []
        waiting = self._waiting_since
        if state is JobState.PLACING and waiting is not None and waiting < end:
            return [("startup", max(0.0, waiting - start)), ("waiting_for_nodes", end - max(waiting, start))]
        return [(bucket, end - start)]

    def _add_outside(self, state: JobState, start: float, end: float) -> None:
        for bucket, seconds in self._outside(state, start, end):
            self.seconds[bucket] += seconds

    def _begin(self, span: Span, began: float) -> None:
        """Training began at `began`: the time before it is the restore (its own seconds, just
        before `began`) and startup (placement was outside RUNNING; this is process start,
        groups, building the model)."""
        began = max(began, span.start)
        restore = span.restore
        restore_s = 0.0
        if restore is not None and restore.step is not None and restore.source in ("memory", "storage"):
            restore_s = min(max(restore.seconds, 0.0), began - span.start)
            self.seconds[f"restore_{restore.source}"] += restore_s
        self.seconds["startup"] += began - span.start - restore_s
        span.cursor = began

    def _record(self, span: Span, r: StepRecord) -> None:
        span.last_step = r.step
        took = max(0.0, r.end - span.cursor)
        span.cursor = max(span.cursor, r.end)
        parts = {}
        left = took
        for bucket, seconds in (("checkpoint", r.checkpoint_s), ("snapshot", r.snapshot_s),
                                ("validation", r.validation_s), ("data_wait", r.data_s)):
            parts[bucket] = min(max(seconds, 0.0), left)
            left -= parts[bucket]
        for bucket, seconds in parts.items():
            self.seconds[bucket] += seconds
        self.seconds["productive"] += left
        span.productive += left
        self._redo_after(r.step - 1)  # a step trained again: its earlier record was lost work
        self._detail.append((r.step, left))
        while len(self._detail) > self._window:
            self._detail.popleft()  # too old to be sent back by any restore we keep detail for
        self.frontier = max(self.frontier, r.step)

    def _tail_start(self, span: Span, at: float) -> float:
        """Where the span's time is accounted up to, no later than `at` (the controller's clock):
        when the workers' clock ran ahead of it, the excess is clipped from productive time."""
        tail_start = span.cursor if span.cursor is not None else span.start
        if tail_start > at:
            clip = min(tail_start - at, span.productive, self.seconds["productive"])
            self.seconds["productive"] -= clip
            span.productive -= clip
            tail_start = at
        return tail_start

    def _redo_after(self, step: int) -> None:
        while self._detail and self._detail[-1][0] > step:
            _, seconds = self._detail.pop()
            self.seconds["productive"] -= seconds
            self.seconds["redone"] += seconds

    def _close_span(self, at: float, target: JobState, resize: bool, cause: str | None) -> None:
        span, self._span = self._span, None
        if span is None:
            return
        if span.cursor is None and span.restore is not None:
            self._begin(span, span.restore.at)
        tail_start = self._tail_start(span, at)
        fault = (target is JobState.RECOVERING and not resize) or target is JobState.FAILED
        if fault:
            declared = min(max(span.declared_at or at, tail_start), at)
            self.seconds["detection"] += declared - tail_start
            after = "backoff" if target is JobState.RECOVERING else "shutdown"
            self.seconds[after] += at - declared
            record = Fault(span.attempt, cause or span.kind or "unknown", span.declared_at or at,
                           self.frontier)
            self.faults.append(record)
            self._pending.append(record)
        elif target is JobState.PREEMPTED or (target is JobState.RECOVERING and resize):
            self.seconds["preemption_save"] += at - tail_start
        else:  # SUCCEEDED, STOPPED
            self.seconds["shutdown"] += at - tail_start
