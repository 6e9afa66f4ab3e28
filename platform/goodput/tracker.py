"""The controller's goodput: the step ledger read as the job runs, the account kept, the summary
persisted. Torch-free; the controller drives it through a listener (controller/listeners.py).

    tracker = GoodputTracker(job, client, quick, wall=time.time, window_steps=4096)
    tracker.resume(previous_state, previous_attempt)   # PENDING: continue the job's summary or start fresh
    tracker.moved(target, at, attempt=n, world_size=w, resize=False, cause=None)   # every move
    tracker.poll(n)       # each heartbeat interval: new step records and restores (fails fast)
    tracker.ending(n)     # the attempt's workers are gone, its keys not yet deleted: the rest
    tracker.recovery(n)   # (step restored, steps lost) once every rank of attempt n restored
    tracker.summary()     # GoodputSummary: buckets, goodput, faults, the clock they add up to
    tracker.storage_rate  # bytes/s per rank of the last restore from storage (its slowest rank's)

Polls read through the controller's fail-fast client (a miss is read next time: records stay in
Redis until read); the read at an attempt's end goes through the patient one, because the keys
are deleted right after it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any, Protocol

import redis

from longrun import keys
from longrun.goodput.accounting import Carried, GoodputAccount, Restore, Span, StepRecord
from longrun.goodput.ledger import LedgerRead, LedgerReader
from longrun.goodput.summary import (
    GoodputSummary,
    delete_summary,
    read_detail,
    read_summary,
    write_detail,
    write_summary,
)
from longrun.kinds import CONTROLLER_LOST, JobState

log = logging.getLogger(__name__)


class LedgerSubscriber(Protocol):
    def resumed(self, attempt: int, step: int | None, source: str, seconds: float) -> None: ...
    def steps(self, attempt: int, records: list[StepRecord]) -> None: ...


class GoodputTracker:
    def __init__(self, job: str, client: Any, quick: Any, *, wall: Callable[[], float],
                 window_steps: int = 4096, max_faults: int = 100, started_at: float | None = None):
        """`started_at`: when the run that made this controller was launched (`longrun run`
        starts Redis and Ray first), so that those seconds are start-up, not outside every
        bucket; now if not given."""
        self.job, self.client, self.quick, self.wall = job, client, quick, wall
        self.reader = LedgerReader(job)
        self._window, self._max_faults = window_steps, max_faults
        now = wall()
        self.account = GoodputAccount(now if started_at is None else min(started_at, now),
                                      window_steps=window_steps, max_faults=max_faults)
        self.attempt: int | None = None  # the attempt whose ledger is read
        self._world = 0
        self._restores: dict[int, Restore] = {}  # rank -> restore, of the attempt read
        self._resumed = False  # every rank of the attempt read has restored (applied)
        self._recovery: dict[int, tuple[int, int]] = {}  # attempt -> (step restored, steps lost)
        # The storage rate per rank the job's last restore from storage measured (its slowest
        # rank's: the one the others waited for), kept in Redis across controllers; what the
        # restore's start-up deadline is sized by (health/startup.py). None: nothing measured.
        self.storage_rate: float | None = None
        self._detail_written: object = None  # what the detail key holds (written when it changes)
        # Told what the ledger says as it is read, in order: `resumed(attempt, step, source, s)`
        # once every rank restored, then `steps(attempt, records)` (the progress line, the
        # journal, TensorBoard): the records are consumed here, so this is their one reader.
        self.subscribers: list[LedgerSubscriber] = []

    # -- the controller's life ----------------------------------------------------------------
    def resume(self, previous_state: str | None, previous_attempt: int | None) -> None:
        """At PENDING, before the previous run's attempt keys are deleted: a job continued after
        PREEMPTED (a SIGTERM and a rerun are one job) or after its controller died continues
        the persisted summary; a new job, or one whose name ended SUCCEEDED, FAILED or STOPPED,
        starts fresh."""
        carried = None
        state = JobState(previous_state) if previous_state else None
        try:
            if state is not None and (state is JobState.PREEMPTED or not state.terminal):
                carried = self._carried(state, previous_attempt)
                rate = self.client.get(keys.job_storage_rate_key(self.job))
                self.storage_rate = float(rate) if rate else None
            else:
                delete_summary(self.client, self.job)
                self.client.delete(keys.job_storage_rate_key(self.job))
        except (redis.RedisError, ValueError) as exc:
            log.warning("goodput summary of the previous run not read: %s", exc)
        self.account = GoodputAccount(self.account.started_at, window_steps=self._window,
                                      max_faults=self._max_faults, carried=carried)

    def _carried(self, state: JobState, attempt: int | None) -> Carried | None:
        summary = read_summary(self.client, self.job)
        if summary is None:
            return None
        detail = read_detail(self.client, self.job)
        last_step, span, records = summary.last_step, None, []
        if not state.terminal and attempt is not None:
            # The previous controller died: its attempt's ledger knows steps it never read.
            read = self.reader.read(self.client, attempt, restores=False, done=True, everything=True)
            last_step = max(last_step, read.last_done or 0)
            records = read.steps
            if detail.get("span") and detail["span"].get("attempt") == attempt:
                span = Span.from_dict(detail["span"])
        return Carried(summary.buckets, summary.faults, last_step,
                       ended=str(state) if state is JobState.PREEMPTED else CONTROLLER_LOST,
                       ended_at=summary.updated_at, attempt=attempt, origin=summary.origin,
                       paused_s=summary.paused_s, accounted_to=summary.accounted_to,
                       detail=[tuple(d) for d in detail.get("detail", [])], span=span, steps=records)

    def moved(self, target: JobState, at: float, *, attempt: int, world_size: int, resize: bool = False,
              cause: str | None = None) -> None:
        self.account.moved(target, at, attempt=attempt, resize=resize, cause=cause)
        if target is JobState.RUNNING:
            self.attempt, self._world = attempt, world_size
            self._restores, self._resumed = {}, False
        self.persist(self.quick if not JobState(target).terminal else self.client)

    def waiting(self) -> None:
        self.account.waiting(self.wall())

    def declared(self, at: float, kind: str) -> None:
        self.account.declared(at, kind)

    def poll(self, attempt: int) -> None:
        """New ledger records of the running attempt (fail fast: a miss is read next poll)."""
        if attempt != self.attempt:
            return
        try:
            read = self.reader.read(self.quick, attempt, restores=not self._resumed)
        except (redis.RedisError, OSError) as exc:
            log.debug("step ledger not read this poll: %s", exc)
            return
        self._apply(attempt, read)
        self.persist(self.quick)

    def ending(self, attempt: int) -> None:
        """The attempt's workers are stopped and its keys about to be deleted: read the rest."""
        if attempt != self.attempt:
            return
        try:
            read = self.reader.read(self.client, attempt, restores=not self._resumed, done=True,
                                    everything=True)
        except (redis.RedisError, OSError) as exc:
            log.warning("the step ledger of attempt %d could not be read before its keys go: %s",
                        attempt, exc)
            return
        self._apply(attempt, read, final=True)
        self.account.attempt_ended(attempt, read.last_done)

    def recovery(self, attempt: int) -> tuple[int, int] | None:
        """(the step every rank of `attempt` restored at least, steps lost since the newest step
        the job had reached), once the ledger knows every rank's restore; None before."""
        return self._recovery.get(attempt)

    def summary(self) -> GoodputSummary:
        account, now = self.account, self.wall()
        return GoodputSummary(buckets=account.buckets(now), faults=[f.to_dict() for f in account.faults],
                              updated_at=now, last_step=account.frontier, state=str(account.state),
                              attempt=self.attempt, origin=account.origin, paused_s=account.paused_s,
                              accounted_to=account.accounted_to(now))

    def persist(self, client: Any) -> GoodputSummary:
        summary = self.summary()
        if summary.state and JobState(summary.state).terminal and abs(summary.unaccounted_s) > 1.0:
            log.warning("goodput buckets miss %.1f s of the job's %.1f s by the clock (a bug in "
                        "goodput/accounting.py)", summary.unaccounted_s, summary.wall_s)
        detail = self.account.carried_detail()
        try:
            with client.pipeline(transaction=True) as pipe:  # the two agree, or neither is written
                write_summary(pipe, self.job, summary)
                if detail != self._detail_written:  # a step or a move since the last write
                    write_detail(pipe, self.job, detail)
                pipe.execute()
            self._detail_written = detail
        except (redis.RedisError, OSError) as exc:  # reporting must not stop the job
            log.warning("goodput summary not written: %s", exc)
        return summary

    # -- the pieces ---------------------------------------------------------------------------
    def _apply(self, attempt: int, read: LedgerRead, final: bool = False) -> None:
        if read.restored and not self._resumed:
            self._restores.update(read.restored)
            lowest_rank = min(self._restores)
            if lowest_rank == 0:
                self.account.began(attempt, self._restores[0])
            # All ranks restore the same step or none does; the lowest counts. At the end, with
            # steps trained, a restore that never reached Redis must not hold the faults open.
            if len(self._restores) >= self._world or (final and (read.steps or read.last_done)):
                self._resume(attempt)
        self.account.steps(attempt, read.steps)
        if read.steps:
            for subscriber in self.subscribers:
                subscriber.steps(attempt, read.steps)

    def _measured(self, rate: float) -> None:
        self.storage_rate = rate
        try:
            self.quick.set(keys.job_storage_rate_key(self.job), repr(rate))
        except (redis.RedisError, OSError) as exc:  # kept in memory; a later controller assumes one
            log.warning("the measured storage rate was not written to Redis: %s", exc)

    def _resume(self, attempt: int) -> None:
        restores = list(self._restores.values())
        step = min((r.step or 0) for r in restores)
        sources = {r.source for r in restores if (r.step or 0) == step}
        source = "storage" if "storage" in sources else sources.pop()
        reached = self.account.frontier
        self.account.resumed(attempt, step, source)
        self._recovery = {attempt: (step, max(0, reached - step))}
        self._resumed = True
        restored = step if any(r.step is not None for r in restores) else None
        seconds = max(r.seconds for r in restores)  # the slowest rank's restore held the others
        rates = [r.storage_rate for r in restores if r.storage_rate is not None]
        if rates:
            self._measured(min(rates))
        for subscriber in self.subscribers:
            subscriber.resumed(attempt, restored, source, seconds)
