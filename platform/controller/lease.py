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

A lease that is lost stops its controller (`on_lost`): one that finds another controller
holding it, or that could not renew it for `give_up_s` (Redis away; the key may expire and be
taken). The expiry outlasts the store patience (`lease_ttl_s`): a controller cut off from Redis
gives up, as its record writes do, after `health.store_patience_s`, and its lease still stands
for STOP_MARGIN_S after that, time to stop its workers before another controller can take the
job over. The price: a dead controller's job is taken over that much later.

Unless its death is proven: a controller rerun on the machine where the last one was killed (the
common case) need not wait that out. The lease records the holder's host, boot id, pid namespace
and pid with its start time (clock ticks after boot); a holder on this host, in this boot and
this pid namespace, whose pid is gone, a zombie, or another process now (a start time of its own:
the pid was reused), is dead. Its lease is deleted only if it is still that holder's
(compare-and-delete) and taken at once. Nothing of the dead controller outlives it to be
stopped: its workers are Ray actors of its driver process, fate-shared with it, and Ray reaps
them. A holder on another host, or one whose death cannot be proven (no boot id, a process
/proc does not show, a value without these fields), is still waited out.
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

# How long a lease stands after its controller gave up renewing it (time to stop its workers).
STOP_MARGIN_S = 10.0
RENEW_EVERY_MAX_S = 2.0  # a second controller learns within this long that the holder lives


def lease_ttl_s(store_patience_s: float) -> float:
    """The expiry of a controller's lease: longer than the store patience, by STOP_MARGIN_S."""
    return store_patience_s + STOP_MARGIN_S


TTL_S = lease_ttl_s(60.0)  # with the default health.store_patience_s


def _read(path: str) -> str | None:
    try:
        with open(path, encoding="ascii") as f:
            return f.read().strip() or None
    except (OSError, ValueError):
        return None


def _stat(pid: int | str) -> tuple[str, int]:
    """A process's state letter and start time (clock ticks after boot: field 22 of
    /proc/PID/stat, counted after the command name, which may hold spaces and parentheses)."""
    with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as f:
        state, *fields = f.read().rsplit(")", 1)[1].split()
    return state, int(fields[18])


def _here() -> dict:
    """What places this process: a host name outlives a reboot (and the pids it handed out), a
    boot id does not; a pid means this process only in its own pid namespace (a container can
    share the host name and the kernel)."""
    try:
        started = _stat("self")[1]
    except (OSError, ValueError, IndexError):
        started = None
    try:
        pid_ns = os.readlink("/proc/self/ns/pid")
    except OSError:
        pid_ns = None
    return {"host": socket.gethostname(), "boot_id": _read("/proc/sys/kernel/random/boot_id"),
            "pid_ns": pid_ns, "pid": os.getpid(), "started": started}


def _ended(pid: int, started: int) -> bool:
    """Whether the process `pid` that started at `started` has ended, on this machine: no process
    has the pid, or a zombie (it exited; its parent has not reaped it), or one that started at
    another time (the pid was reused). False when /proc cannot tell."""
    try:
        state, now_started = _stat(pid)
    except FileNotFoundError:  # gone, or hidden from this user (/proc mounted with hidepid)
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        except PermissionError:
            pass
        return False
    except (OSError, ValueError, IndexError):
        return False
    return state in ("Z", "X") or now_started != started

# Extend the expiry only if the lease is still this holder's.
_RENEW = """
if redis.call('get', KEYS[1]) == ARGV[1] then
    return redis.call('pexpire', KEYS[1], ARGV[2])
end
return 0
"""
# Delete it only if it is still this holder's (given back, or a dead holder's taken over).
_RELEASE = """
if redis.call('get', KEYS[1]) == ARGV[1] then
    return redis.call('del', KEYS[1])
end
return 0
"""


class ControllerRunning(RuntimeError):
    """Another live controller holds this job name."""


class ControllerLease:
    """`client` takes and gives back the lease; `renew_client` (default: `client`) renews it and
    should fail fast, so that `give_up_s` (default: the expiry less STOP_MARGIN_S, or half of
    it) is kept while Redis is away. `on_lost(reason)` is called once, from the renewing
    thread, when the lease is lost."""

    def __init__(self, client: redis.Redis, job: str, *, ttl_s: float = TTL_S,
                 renew_every_s: float | None = None, give_up_s: float | None = None,
                 renew_client: redis.Redis | None = None, on_lost: Callable[[str], None] | None = None,
                 clock: Callable[[], float] = time.monotonic):
        self.client, self.job, self.key = client, job, keys.job_controller_key(job)
        self.renew_client = renew_client or client
        self.ttl_ms = int(ttl_s * 1000)
        # Not renewed for this long: stop, while the lease still stands for the rest of its expiry.
        self.give_up_s = give_up_s if give_up_s is not None else ttl_s - min(STOP_MARGIN_S, ttl_s / 2)
        self.renew_every_s = (renew_every_s if renew_every_s is not None
                              else min(ttl_s / 5, self.give_up_s / 2, RENEW_EVERY_MAX_S))
        if self.give_up_s >= ttl_s:
            raise ValueError(f"a lease must be given up (after {self.give_up_s:g} s unrenewed) before it "
                             f"expires ({ttl_s:g} s)")
        self.on_lost = on_lost or (lambda reason: None)
        self.lost: str | None = None  # why the lease was lost, once it was
        self.here = _here()
        self.value = json.dumps({"id": uuid.uuid4().hex, **self.here, "since": time.time()})
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
            if holder is not None and self._holder_dead(holder):
                if self.client.eval(_RELEASE, 1, self.key, holder):
                    log.warning("the previous controller of job %r, %s, is dead: the job is taken over "
                                "without waiting out its lease (%.0f s left)", self.job,
                                self._holder_text(holder), max(ttl, 0) / 1000)
                continue  # taken now, unless another controller was quicker
            if holder is not None and ttl > 0:
                if last_ttl is not None and ttl > last_ttl:
                    raise ControllerRunning(self._refusal(holder))
                last_ttl = ttl
            if self.clock() > deadline:  # renewed so slowly that it never showed: still someone's
                raise ControllerRunning(self._refusal(holder))
            # Redis offers no notification of an expiry worth relying on (keyspace events are
            # off by default): look again within a renewal interval.
            self._stop.wait(min(self.renew_every_s / 2, max(ttl, 1) / 1000))
        self._renewed_at = self.clock()
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
            if self.renew_client is not self.client:
                self.renew_client.close()

    def _renew(self) -> None:
        while not self._stop.wait(self.renew_every_s):
            try:
                # Not renewed: gone (a Redis restarted without it; taken back if free) or, if the
                # store lost it long enough for another to take it, another controller's.
                client = self.renew_client
                if (client.eval(_RENEW, 1, self.key, self.value, self.ttl_ms)
                        or client.set(self.key, self.value, nx=True, px=self.ttl_ms)):
                    self._renewed_at = self.clock()
                    continue
                holder = client.get(self.key)
            except redis.RedisError as exc:  # the store away: tried again until give_up_s is over
                unrenewed = self.clock() - self._renewed_at
                if unrenewed < self.give_up_s:
                    log.warning("controller lease of %s not renewed (%s)", self.job, exc)
                    continue
                self._lose(f"Redis could not be reached to renew it for {unrenewed:.0f} s (it expires "
                           f"{self.ttl_ms / 1000:g} s after its last renewal, and another controller may "
                           "then take the job over)")
                return
            self._lose(f"another controller holds it now, {self._holder_text(holder)}")
            return

    def _lose(self, why: str) -> None:
        self.lost = f"the controller lease of job {self.job!r} is lost: {why}"
        log.error("%s", self.lost)
        self.on_lost(self.lost)

    def _holder_dead(self, holder: bytes | str) -> bool:
        """Whether the holder's controller provably died: it ran on this host, in this boot and
        pid namespace, and its process has ended."""
        who = _parsed(holder)
        pid, started = who.get("pid"), who.get("started")
        if not (isinstance(pid, int) and pid > 0 and isinstance(started, int)):
            return False
        if any(self.here[k] is None or who.get(k) != self.here[k] for k in ("host", "boot_id", "pid_ns")):
            return False
        return _ended(pid, started)

    @staticmethod
    def _holder_text(holder: bytes | str | None) -> str:
        """Where the controller holding a lease runs: 'on HOST (pid PID, since WHEN)'."""
        who = _parsed(holder)
        since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(who["since"])) if "since" in who else "?"
        return f"on {who.get('host', '?')} (pid {who.get('pid', '?')}, since {since})"

    def _refusal(self, holder: bytes | str | None) -> str:
        where = self._holder_text(holder)
        return (f"job {self.job!r} is already running: its controller {where} holds the job's lease and "
                "renews it. Find it with `longrun list` (`longrun status ID` follows it, `longrun stop ID` "
                "stops it), or run this config under another job.name.")


def _parsed(holder: bytes | str | None) -> dict:
    """A lease's value as written; {} for one that is not (it tells nothing of its holder)."""
    try:
        who = json.loads(holder) if holder else {}
    except ValueError:
        who = {}
    return who if isinstance(who, dict) else {}
