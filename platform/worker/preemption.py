"""Stopping on request with nothing lost: every rank saves at the same step boundary, then stops.

The controller asks by writing "now" to the attempt's preempt key (a signal reached it, or Ray
is draining a node). Each rank, at every step boundary, runs one script on that key: the first
rank to see "now" after finishing step k replaces it with k + 1, and every rank saves and stops
when it has finished the step the key names.

Why k + 1 and not k: when one rank is at the boundary after step k, a faster peer may already
be inside step k + 1, but none can be past it (step k + 1's collectives need this rank), and
this rank writes k + 1 before it enters step k + 1. So every rank reads the key after the write
by the time it finishes step k + 1, nobody has passed it, and all save the same step. The key
is written once and never lowered; a rank that reads a step ahead of its own keeps training.
"""

from __future__ import annotations

import logging
import time

import redis

from longrun import keys

log = logging.getLogger(__name__)

READ_RETRY_S = 20.0

# GET the key; "now" becomes the step after the caller's (ARGV[1]). Returns the step or nil.
_CLAIM = """
local v = redis.call('GET', KEYS[1])
if v == 'now' then
  redis.call('SET', KEYS[1], ARGV[1])
  return ARGV[1]
end
return v
"""


class Preempted(Exception):  # not an error: the requested way to stop
    """Raised after the step a stop request named: its checkpoint is committed."""

    def __init__(self, step: int):
        super().__init__(f"stopped on request after step {step}, its checkpoint committed")
        self.step = step


def request(client: redis.Redis, job: str, attempt: int) -> None:
    """Ask the attempt's ranks to save at the next step boundary they can agree on, and stop."""
    client.set(keys.preempt_key(job, attempt), "now", nx=True)


class PreemptionWatch:
    """Asked at every step boundary: is this the step to save at and stop?"""

    def __init__(self, client: redis.Redis, job: str, attempt: int):
        self._key = keys.preempt_key(job, attempt)
        self._claim = client.register_script(_CLAIM)
        self.target: int | None = None

    def stop_after(self, step: int) -> bool:
        """Whether every rank stops after `step` (which this rank has just finished). The key
        must be read at every boundary (a rank that missed the one its peers stop at would
        train on into a step they never join), so an unreachable Redis is retried for up to
        READ_RETRY_S and then fails this rank (a restart), never skipped."""
        if self.target is None:
            deadline = time.monotonic() + READ_RETRY_S
            while True:
                try:
                    found = self._claim(keys=[self._key], args=[step + 1])
                    break
                except (redis.RedisError, OSError) as exc:
                    if time.monotonic() > deadline:
                        raise RuntimeError(f"cannot read the stop request from Redis for {READ_RETRY_S:g} s "
                                           f"({exc})") from exc
                    log.warning("could not read the stop request (%s); retrying", exc)
                    time.sleep(0.5)  # Redis restarting: the claim must happen at this boundary
            if found is None:
                return False
            self.target = int(found)
        # <=, not ==: a target inside a skipped window is passed, not matched (no rank trains
        # it, so the first step every rank trains after it is where they all stop).
        return self.target <= step
