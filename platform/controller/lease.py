"""One controller per job name: a lease in Redis that the running controller renews.

Two controllers under one job name would each take the other's live record for a dead
controller's: delete its rendezvous, heartbeat and ledger keys, number attempts into the same
namespace and apply retention in the same checkpoint directory. It happens without anyone
meaning it: Ctrl-C on `longrun submit` leaves the Ray job running, and the user submits again.

So a controller takes `longrun:{job}:controller` (SET NX with an expiry) before it touches the
job record, and a thread of its own renews the expiry while it runs. A second controller that
finds the key watches its expiry for a renewal interval: renewed means a live controller holds
it, and the second is refused with a sentence naming the holder; a key that is never renewed
is a dead controller's (killed, its host lost), which expires within `ttl_s` and is then taken
over, as a resubmitted job must. The renewal is compare-and-expire (a Lua script), so a
controller never extends a lease another has taken since; one that finds its lease gone (Redis
restarted without it) takes it again if it is free.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable

import redis

from longrun import keys

log = logging.getLogger(__name__)

TTL_S = 10.0  # a dead controller's lease is taken over at most this long after it died

# Extend the expiry only if the lease is still this holder's.
_RENEW = """
if redis.call('get', KEYS[1]) == ARGV[1] then
    return redis.call('pexpire', KEYS[1], ARGV[2])
end
return 0
"""
_RELEASE = """
if redis.call('get', KEYS[1]) == ARGV[1] then
    return redis.call('del', KEYS[1])
end
return 0
"""


class ControllerRunning(RuntimeError):
    """Another live controller holds this job name."""


class ControllerLease:
    def __init__(self, client: redis.Redis, job: str, *, ttl_s: float = TTL_S,
                 renew_every_s: float | None = None, clock: Callable[[], float] = time.monotonic):
        self.client, self.job, self.key = client, job, keys.job_controller_key(job)
        self.ttl_ms = int(ttl_s * 1000)
        self.renew_every_s = renew_every_s if renew_every_s is not None else ttl_s / 5
        self.value = json.dumps({"id": uuid.uuid4().hex, "host": socket.gethostname(), "pid": os.getpid(),
                                 "since": time.time()})
        self.clock = clock
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def acquire(self) -> None:
        """Take the lease, waiting out a dead holder's expiry; ControllerRunning when a live
        controller renews it."""
        last_ttl: int | None = None
        deadline = self.clock() + self.ttl_ms / 1000 + 2 * self.renew_every_s
        while True:
            if self.client.set(self.key, self.value, nx=True, px=self.ttl_ms):
                break
            holder, ttl = self.client.get(self.key), self.client.pttl(self.key)
            if holder is not None and ttl > 0:
                if last_ttl is not None and ttl > last_ttl:
                    raise ControllerRunning(self._refusal(holder))
                last_ttl = ttl
            if self.clock() > deadline:  # renewed so slowly that it never showed: still someone's
                raise ControllerRunning(self._refusal(holder))
            # Redis offers no notification of an expiry worth relying on (keyspace events are
            # off by default): look again within a renewal interval.
            self._stop.wait(min(self.renew_every_s / 2, max(ttl, 1) / 1000))
        self._thread = threading.Thread(target=self._renew, name=f"longrun-lease-{self.job}", daemon=True)
        self._thread.start()

    def release(self) -> None:
        """Stop renewing and give the lease back (only if it is still this controller's); the
        client is closed."""
        self._stop.set()
        try:
            if self._thread is not None:
                self._thread.join()
                self._thread = None
                self.client.eval(_RELEASE, 1, self.key, self.value)
        except redis.RedisError as exc:  # it expires on its own
            log.warning("controller lease of %s not released (%s); it expires in %.0f s", self.job, exc,
                        self.ttl_ms / 1000)
        finally:
            self.client.close()

    def _renew(self) -> None:
        while not self._stop.wait(self.renew_every_s):
            try:
                # Not renewed: gone (a Redis restarted without it; taken back if free) or, if the
                # store lost it long enough for another to take it, another controller's.
                if (not self.client.eval(_RENEW, 1, self.key, self.value, self.ttl_ms)
                        and not self.client.set(self.key, self.value, nx=True, px=self.ttl_ms)):
                    log.error("the controller lease of job %s is held by another controller: %s",
                              self.job, self.client.get(self.key))
            except redis.RedisError as exc:  # the store away: the next interval tries again
                log.warning("controller lease of %s not renewed (%s)", self.job, exc)

    def _refusal(self, holder: bytes | str | None) -> str:
        try:
            who = json.loads(holder) if holder else {}
        except ValueError:
            who = {}
        since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(who["since"])) if "since" in who else "?"
        where = f"on {who.get('host', '?')} (pid {who.get('pid', '?')}, since {since})"
        return (f"job {self.job!r} is already running: its controller {where} holds the job's lease and "
                "renews it. Find it with `longrun list` (`longrun status ID` follows it, `longrun stop ID` "
                "stops it), or run this config under another job.name.")
