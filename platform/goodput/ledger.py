"""The step ledger: the ground truth of what every attempt trained, written by the workers and
read by the controller.

Heartbeats are published on a timer, so the last step or two of a dying attempt may never be
seen in one; the ledger is written synchronously at the end of every step (StepHooks), before
the next begins. Under the attempt's prefix (keys.py; deleted with the attempt, after the
controller's last read):

    ledger:done       hash   rank -> the last step that rank finished (every rank)
    ledger:steps      list   one JSON StepRecord per step of the lowest rank: its end, the wall
                             seconds since the record before (or since training began), the
                             seconds blocked on a checkpoint, a snapshot, a validation pass and
                             the data, and its
                             metrics (the driver's progress line; observability/progress.py)
    ledger:restored   hash   rank -> JSON Restore: the step restored (null: none), its source,
                             seconds, the bytes of state restored, and `at`, when it finished:
                             the time training began

A Redis blip must neither fail nor stall training: the ledger's client gives up after
`TIMEOUT_S` (a training rank's is its one shared connection, which gives up after 2 s:
worker/redis_links.py), and what it could not send (step records up to `MAX_PENDING`, the newest `done`,
the restore) goes with the next step's write; after a failure it waits `retry_s` (doubling,
capped) before trying again, so a Redis that is away costs a step one short timeout now and
then, not one per step. A reply lost after Redis applied the write means a record sent twice:
the reader keeps the first of each step.

The controller (`LedgerReader`) consumes the steps list: it reads up to `batch` records and
trims what it read, so a week-long attempt does not pile records up in Redis.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from longrun import keys
from longrun.goodput.accounting import Restore, StepRecord

log = logging.getLogger(__name__)

TIMEOUT_S = 0.5  # a step waits at most this long on a Redis that does not answer
MAX_PENDING = 10_000  # step records kept while Redis is away; older ones are dropped (and counted)
MAX_LIST = 100_000  # the steps list's bound when no controller consumes it
RETRY_S, RETRY_CAP_S = 1.0, 8.0


def step_ledger_client(url: str, timeout_s: float = TIMEOUT_S) -> redis.Redis:
    """A client that fails within `timeout_s` and never retries by itself (the ledger does)."""
    return redis.Redis.from_url(url, retry=Retry(NoBackoff(), 0), socket_connect_timeout=timeout_s,
                                socket_timeout=timeout_s)


class StepLedger:
    """One rank's side of the ledger. Not thread-safe: called from the training thread only."""

    def __init__(self, client: redis.Redis, job: str, attempt: int, rank: int, *,
                 clock: Callable[[], float] = time.time, monotonic: Callable[[], float] = time.monotonic,
                 max_pending: int = MAX_PENDING, retry_s: float = RETRY_S):
        self.client, self.rank = client, rank
        self.clock, self.monotonic = clock, monotonic
        self.writes_steps = rank == 0  # the lowest rank: one record per step is enough for the timeline
        self._done_key = keys.ledger_done_key(job, attempt)
        self._steps_key = keys.ledger_steps_key(job, attempt)
        self._restored_key = keys.ledger_restored_key(job, attempt)
        self._pending: deque[str] = deque()
        self._max_pending = max_pending
        self._done: int | None = None  # unsent: the newest step finished
        self._restored: str | None = None  # unsent: the restore record
        self._last_end = clock()  # until the restore says when training began
        self._retry_s, self._retry_at = retry_s, 0.0
        self._first_retry_s = retry_s
        self.dropped = 0  # step records dropped because Redis stayed away too long
        self.failures = 0  # writes that failed (and were kept for the next step)

    def restored(self, step: int | None, source: str, seconds: float, nbytes: int | None = None) -> None:
        """This rank restored `step` (None: nothing to resume from) from `source` in `seconds`
        (`nbytes`: the state it holds, by which the controller learns the storage rate);
        training begins now."""
        at = self.clock()
        self._last_end = at
        self._restored = Restore(step, source, seconds, at, nbytes).to_json()
        self.flush()

    def step(self, step: int, *, checkpoint_s: float = 0.0, snapshot_s: float = 0.0,
             data_s: float = 0.0, validation_s: float = 0.0, metrics: dict[str, Any] | None = None) -> None:
        """This rank finished `step`, everything due after it included; `metrics`: what it
        trained (None: a skipped step)."""
        end = self.clock()
        if self.writes_steps:
            if len(self._pending) >= self._max_pending:
                self._pending.popleft()
                self.dropped += 1
            self._pending.append(StepRecord(step, end, end - self._last_end, checkpoint_s, snapshot_s,
                                            data_s, validation_s, metrics).to_json())
        self._last_end = end
        self._done = step
        self.flush()

    @property
    def unsent(self) -> int:
        return len(self._pending) + (self._done is not None) + (self._restored is not None)

    def flush(self) -> bool:
        """Send what is unsent, in one transaction; False when Redis did not take it (kept)."""
        if not self.unsent:
            return True
        if self.monotonic() < self._retry_at:
            return False
        records = list(self._pending)
        try:
            with self.client.pipeline(transaction=True) as pipe:
                if self._restored is not None:
                    pipe.hset(self._restored_key, str(self.rank), self._restored)
                if records:
                    pipe.rpush(self._steps_key, *records)
                    pipe.ltrim(self._steps_key, -MAX_LIST, -1)
                if self._done is not None:
                    pipe.hset(self._done_key, str(self.rank), self._done)
                pipe.execute()
        except (redis.RedisError, OSError) as exc:
            self.failures += 1
            self._retry_at = self.monotonic() + self._retry_s
            self._retry_s = min(self._retry_s * 2, RETRY_CAP_S)
            if self.failures == 1:
                log.warning("step ledger not written (%s); kept for the next step", exc)
            return False
        for _ in records:
            self._pending.popleft()
        self._done = self._restored = None
        self._retry_s = self._first_retry_s
        return True


@dataclass
class LedgerRead:
    """What one read of an attempt's ledger found."""

    steps: list[StepRecord] = field(default_factory=list)  # new records of the lowest rank
    restored: dict[int, Restore] = field(default_factory=dict)  # rank -> its restore (all so far)
    done: dict[int, int] | None = None  # rank -> last step finished (only when asked for)

    @property
    def last_done(self) -> int | None:
        return max(self.done.values(), default=None) if self.done else None


class LedgerReader:
    """The controller's side: new step records (consumed), restores, and the last steps done."""

    def __init__(self, job: str, batch: int = 10_000):
        self.job, self.batch = job, batch

    def read(self, client: redis.Redis, attempt: int, *, restores: bool = True, done: bool = False,
             everything: bool = False) -> LedgerRead:
        """Read `attempt`'s ledger: the step records not read before (all of them with
        `everything`, else at most `batch`), the restores (with `restores`) and the last step
        each rank finished (with `done`). Raises redis errors (the caller decides)."""
        out = LedgerRead()
        steps_key = keys.ledger_steps_key(self.job, attempt)
        while True:
            raw = client.lrange(steps_key, 0, self.batch - 1)
            if raw:
                client.ltrim(steps_key, len(raw), -1)  # only this reader removes; workers append
            out.steps += [StepRecord.from_json(r) for r in raw]
            if not everything or len(raw) < self.batch:
                break
        if restores:
            out.restored = {int(rank): Restore.from_json(value) for rank, value in
                            client.hgetall(keys.ledger_restored_key(self.job, attempt)).items()}
        if done:
            out.done = {int(rank): int(value) for rank, value in
                        client.hgetall(keys.ledger_done_key(self.job, attempt)).items()}
        return out
