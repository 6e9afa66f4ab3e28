"""The job record in Redis: state, attempt, progress and an event log.

It lives under the job's prefix (not an attempt's) so it survives restarts, and it is what
`longrun status` reads. Writes are single round trips (a pipeline per update).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Any

import redis

from longrun import keys
from longrun.controller.state import JobState, Transition

MAX_EVENTS = 1000  # a week-long job restarts hundreds of times; keep the log bounded
# The restart history keeps what the policy reads: the restarts within recovery.restart_window_s
# (the storm rule, repeats on a node) and the newest few whatever their age (the last cause, a
# loss spike seen again at the same step). The total, which the budget counts, is a number in
# the record (RESTARTS_TOTAL), so a job that restarts for a month keeps a short list.
RESTARTS_KEPT_MIN = 16
RESTARTS_KEPT_MAX = 1000  # however long the window: a hard bound
RESTARTS_TOTAL = "restarts_total"


@dataclass(frozen=True)
class JobRecord:
    job: str
    state: JobState
    attempt: int
    step: int
    updated_at: float
    fields: dict[str, str]


class JobRecordStore:
    def __init__(self, client: redis.Redis, job: str):
        self.client = client
        self.job = job
        self.record_key = keys.job_record_key(job)
        self.events_key = keys.job_events_key(job)
        self.restarts_key = keys.job_restarts_key(job)
        self.evicted_key = keys.job_evicted_key(job)
        self.skips_key = keys.job_skips_key(job)

    def record_transition(self, move: Transition, attempt: int) -> None:
        event = {"type": "transition", "from": move.source, "to": move.target,
                 "reason": move.reason, "attempt": attempt, "at": move.at}
        with self.client.pipeline() as pipe:
            pipe.hset(self.record_key, mapping={
                "state": str(move.target), "attempt": attempt, "updated_at": move.at,
                "reason": move.reason,
            })
            pipe.rpush(self.events_key, json.dumps(event))
            pipe.ltrim(self.events_key, -MAX_EVENTS, -1)
            pipe.execute()

    def update(self, **fields: Any) -> None:
        """Progress fields (step, loss, ...), stored as strings next to the state."""
        mapping = {k: v if isinstance(v, str) else json.dumps(v) for k, v in fields.items()}
        mapping["updated_at"] = json.dumps(time.time())
        self.client.hset(self.record_key, mapping=mapping)

    def read(self) -> JobRecord | None:
        raw = self.client.hgetall(self.record_key)
        if not raw:
            return None
        data = {k.decode(): v.decode() for k, v in raw.items()}
        return JobRecord(
            job=self.job,
            state=JobState(data.get("state", JobState.PENDING)),
            attempt=int(data.get("attempt", 0)),
            step=int(float(data.get("step", 0))),
            updated_at=float(data.get("updated_at", 0.0)),
            fields=data,
        )

    def event(self, kind: str, attempt: int, message: str, **extra: Any) -> None:
        """An event that is not a state change (a fault seen, a decision, an eviction)."""
        entry = {"type": kind, "attempt": attempt, "reason": message, "at": time.time(), **extra}
        with self.client.pipeline() as pipe:
            pipe.rpush(self.events_key, json.dumps(entry))
            pipe.ltrim(self.events_key, -MAX_EVENTS, -1)
            pipe.execute()

    def add_restart(self, record: dict[str, Any], window_s: float | None = None) -> None:
        """Count a restart and keep its record, with the ones before it still within `window_s`
        seconds of it (and the newest RESTARTS_KEPT_MIN whatever their age); the list is
        appended in time order, so what goes is a prefix."""
        with self.client.pipeline() as pipe:
            pipe.rpush(self.restarts_key, json.dumps(record))
            pipe.ltrim(self.restarts_key, -RESTARTS_KEPT_MAX, -1)
            pipe.hincrby(self.record_key, RESTARTS_TOTAL, 1)
            pipe.execute()
        if window_s is None:
            return
        kept = self.restarts()
        stale = 0
        while len(kept) - stale > RESTARTS_KEPT_MIN and record["at"] - kept[stale]["at"] >= window_s:
            stale += 1
        if stale:
            self.client.ltrim(self.restarts_key, stale, -1)

    def restarts(self) -> list[dict[str, Any]]:
        """The restarts kept (see add_restart), oldest first; `restart_count` is how many there were."""
        return [json.loads(item) for item in self.client.lrange(self.restarts_key, 0, -1)]

    def restart_count(self) -> int:
        """Every restart this job carried out (a record written before the count existed: its list)."""
        total = self.client.hget(self.record_key, RESTARTS_TOTAL)
        return int(total) if total is not None else self.client.llen(self.restarts_key)

    def add_skip(self, first: int, last: int) -> None:
        self.client.sadd(self.skips_key, f"{first}-{last}")

    def skips(self) -> list[tuple[int, int]]:
        """Every data window skipped so far, in step order."""
        return sorted(tuple(int(x) for x in item.decode().split("-")) for item in
                      self.client.smembers(self.skips_key))

    def evict(self, node: str, reason: str) -> None:
        self.client.hset(self.evicted_key, node, reason)

    def evicted(self) -> dict[str, str]:
        return {k.decode(): v.decode() for k, v in self.client.hgetall(self.evicted_key).items()}

    def restore_policy(self, restarts_total: int, restarts: list[dict[str, Any]], evicted: dict[str, str],
                       skips: list[tuple[int, int]]) -> None:
        """Put back what the policy decides from (kept beside the checkpoints while Redis forgot:
        `recovery_file.py`), into a record that has none of it."""
        with self.client.pipeline() as pipe:
            pipe.delete(self.restarts_key, self.evicted_key, self.skips_key)
            if restarts:
                pipe.rpush(self.restarts_key, *(json.dumps(r) for r in restarts))
            pipe.hset(self.record_key, RESTARTS_TOTAL, restarts_total)
            if evicted:
                pipe.hset(self.evicted_key, mapping=evicted)
            if skips:
                pipe.sadd(self.skips_key, *(f"{first}-{last}" for first, last in skips))
            pipe.execute()

    def reset(self) -> None:
        """Forget a finished job's history, so its name can be reused from scratch."""
        self.client.delete(self.record_key, self.events_key, self.restarts_key, self.evicted_key,
                           self.skips_key)

    def events(self, last: int = 50) -> list[dict]:
        return [json.loads(item) for item in self.client.lrange(self.events_key, -last, -1)]


def job_status(client: redis.Redis, job: str, events: int = 10) -> dict[str, Any]:
    """What `longrun status` shows: state, attempt, step, evicted nodes and the last events."""
    store = JobRecordStore(client, job)
    record = store.read()
    if record is None:
        return {"job": job, "state": None}
    return {"job": job, "state": str(record.state), "attempt": record.attempt, "step": record.step,
            "fields": {k: v for k, v in record.fields.items()
                       if k not in ("state", "attempt", "step", RESTARTS_TOTAL)},
            "evicted": store.evicted(), "restarts": store.restart_count(),
            "events": store.events(events)}
