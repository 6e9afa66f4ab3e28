"""The steps the soak sees from outside the job (not a bench itself): the step each rank's
process reported last, and the step each attempt restored, read from the step ledger's keys in
Redis (goodput/ledger.py) that the ranks write at the end of every step and when training
begins. The controller's goodput record says how many steps a fault lost by its own reading;
the soak's reading of the same keys, taken at the moment of each fault, is the cross-check."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field

import redis

from longrun import keys


@dataclass
class Restored:
    wall: float  # when the soak first saw it
    attempt: int
    step: int | None  # None: the attempt started from nothing


@dataclass
class StepWatch:
    """Looked at by the soak's loop every tick (`look`) and at each fault (`last_reported`)."""

    url: str
    job: str
    restores: list[Restored] = field(default_factory=list)
    _seen_restore: set[int] = field(default_factory=set)
    _last: dict[int, int] = field(default_factory=dict)  # attempt -> newest step any rank finished

    def _client(self) -> redis.Redis:
        return redis.Redis.from_url(self.url, socket_timeout=1, socket_connect_timeout=1,
                                    decode_responses=True)

    def look(self, attempt: int | None) -> None:
        """Read the running attempt's finished steps and its restore, if there is one yet."""
        if attempt is None:
            return
        try:
            client = self._client()
            try:
                self._read(client, attempt)
            finally:
                client.close()
        except (redis.RedisError, OSError):
            pass  # Redis is down (a fault of the soak's own): look again next tick

    def _read(self, client: redis.Redis, attempt: int) -> None:
        done = client.hgetall(keys.ledger_done_key(self.job, attempt))
        if done:
            self._last[attempt] = max([self._last.get(attempt, 0), *(int(v) for v in done.values())])
        if attempt not in self._seen_restore:
            restored = client.hgetall(keys.ledger_restored_key(self.job, attempt))
            if restored:
                steps = [json.loads(v).get("step") for v in restored.values()]
                step = None if any(s is None for s in steps) else min(int(s) for s in steps)
                self._seen_restore.add(attempt)
                self.restores.append(Restored(time.time(), attempt, step))

    def training_began(self, attempt: int) -> bool:
        """Whether the attempt's ranks said training began (their restore is on the ledger)."""
        try:
            client = self._client()
            try:
                return bool(client.exists(keys.ledger_restored_key(self.job, attempt)))
            finally:
                client.close()
        except (redis.RedisError, OSError):
            return True  # unknown: do not count a kill as one during start-up

    def last_seen(self, attempt: int | None) -> int | None:
        """The newest step any rank of `attempt` was seen to report, by the soak's looks."""
        return None if attempt is None else self._last.get(attempt)

    def last_reported(self, attempt: int | None) -> int | None:
        """The newest step any rank reported finishing, read now (the moment before a fault):
        the running attempt's, else (an attempt still starting) the step it restored, else the
        newest seen in any attempt before it."""
        self.look(attempt)
        if attempt is not None and attempt in self._last:
            return self._last[attempt]
        restored = [r.step for r in self.restores if r.attempt == attempt]
        if restored:
            return restored[0] or 0
        older = [step for a, step in self._last.items() if attempt is None or a < attempt]
        return max(older) if older else None


def steps_lost_outside(last: int | None, attempt: int | None, since: float, until: float,
                       restores: list[Restored]) -> int | None:
    """Steps a fault lost by the soak's own reading: the step last reported before it minus the
    step restored by the first attempt after it that restored (seen between the fault and the
    next); 0 when no attempt restored in that window (the job rode it out); None when nothing
    was reported before the fault."""
    if last is None:
        return None
    after = [r for r in restores if since <= r.wall < until and (attempt is None or r.attempt > attempt)]
    if not after:
        return 0
    return max(0, last - (after[0].step or 0))
