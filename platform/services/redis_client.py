"""Redis clients that ride out a Redis restart, for the writes that must not be lost.

Two kinds of Redis traffic live in a job, and they want opposite behaviour when Redis goes
away for a few seconds (a restart, a failover):

- the watch path (heartbeats published and read every interval) must fail fast: a missed
  beat is harmless, the next interval tries again, and the monitor knows the store was
  unreachable rather than the ranks dead;
- the record path (the controller's job state and event log, a checkpoint's commit reports)
  must wait and retry: dropping those would lose an event or abort a commit.

`patient_client` is the second kind: redis-py's own retry with exponential backoff, sized so
that the retries span about `patience_s` seconds before the error reaches the caller.
`PatientCalls` is the same patience around a client whose connection is shared (redis-py's
retry holds the connection through its backoff; this gives it back between tries).
"""

from __future__ import annotations

import time

import redis
from redis.backoff import ExponentialBackoff
from redis.retry import Retry

BACKOFF_BASE_S = 0.05
BACKOFF_CAP_S = 1.0


def retries_for(patience_s: float, base_s: float = BACKOFF_BASE_S, cap_s: float = BACKOFF_CAP_S) -> int:
    """How many doubling waits (base, 2 base, ..., capped at cap) add up to `patience_s`."""
    waited, wait, retries = 0.0, base_s, 0
    while waited < patience_s:
        waited += wait
        wait = min(wait * 2, cap_s)
        retries += 1
    return retries


def patient_client(url: str, patience_s: float) -> redis.Redis:
    """A client whose commands retry connection errors for about `patience_s` seconds."""
    retry = Retry(ExponentialBackoff(cap=BACKOFF_CAP_S, base=BACKOFF_BASE_S), retries_for(patience_s))
    # A socket timeout too: a half-open connection (a partition, a frozen server) must turn
    # into a retried error, not a call blocked forever.
    return redis.Redis.from_url(url, retry=retry, socket_connect_timeout=1.0, socket_timeout=10.0,
                                retry_on_error=[redis.ConnectionError, redis.TimeoutError])


def quick_client(url: str) -> redis.Redis:
    """A client that fails at once when Redis is away (the watch path)."""
    return redis.Redis.from_url(url, retry=Retry(ExponentialBackoff(), 0), socket_connect_timeout=2.0,
                                socket_timeout=5.0)


class PatientCalls:
    """A client's commands retried on connection errors for about `patience_s` seconds, like
    `patient_client`'s, but by the caller: the connection goes back to its pool between tries,
    so a client whose one connection is shared (a training rank's: worker/redis_links.py) is not
    held through an outage. Pipelines are recorded and replayed whole on each try (redis-py
    empties a pipeline that failed)."""

    def __init__(self, client: redis.Redis, patience_s: float, *, sleep=None):
        self._client, self.patience_s = client, patience_s
        self._sleep = sleep or time.sleep

    def call(self, method: str, *args, **kwargs):
        return self.retrying(lambda: getattr(self._client, method)(*args, **kwargs))

    def retrying(self, attempt):
        deadline, wait = time.monotonic() + self.patience_s, BACKOFF_BASE_S
        while True:
            try:
                return attempt()
            except (redis.ConnectionError, redis.TimeoutError):
                if time.monotonic() + wait > deadline:
                    raise
                self._sleep(wait)
                wait = min(wait * 2, BACKOFF_CAP_S)

    def pipeline(self, transaction: bool = True) -> _PatientPipeline:
        return _PatientPipeline(self, transaction)

    def __getattr__(self, name: str):
        found = getattr(self._client, name)
        if not callable(found) or name in ("register_script", "close"):
            return found
        return lambda *args, **kwargs: self.call(name, *args, **kwargs)


class _PatientPipeline:
    def __init__(self, patient: PatientCalls, transaction: bool):
        self._patient, self._transaction = patient, transaction
        self._calls: list[tuple[str, tuple, dict]] = []

    def __enter__(self) -> _PatientPipeline:
        return self

    def __exit__(self, *exc) -> None:
        self._calls.clear()

    def __getattr__(self, name: str):
        def queue(*args, **kwargs) -> _PatientPipeline:
            self._calls.append((name, args, kwargs))
            return self
        return queue

    def execute(self) -> list:
        def attempt() -> list:
            with self._patient._client.pipeline(transaction=self._transaction) as pipe:
                for name, args, kwargs in self._calls:
                    getattr(pipe, name)(*args, **kwargs)
                return pipe.execute()
        try:
            return self._patient.retrying(attempt)
        finally:
            self._calls.clear()
