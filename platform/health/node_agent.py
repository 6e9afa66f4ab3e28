"""One agent per node: hears its ranks' heartbeats locally and publishes one record per node.

MegaScale's per-node daemon, for the heartbeat path (node_beats.py says why). Each rank sends
its heartbeat as a datagram to the agent's socket instead of writing a Redis key; the agent
keeps the newest beat of every rank, checks that each rank's process still exists, and every
interval publishes the node's record with an expiry of the heartbeat timeout.

What it adds besides fewer keys: a rank's death is seen by its node, not by a key expiring.
The agent looks at its ranks' processes every `CHECK_S` and publishes at once when one is gone,
so the controller declares a dead rank within a poll of its death (about 1 s) rather than a
heartbeat timeout (5 s). A frozen rank (SIGSTOP) sends nothing, and is left out once its
newest beat is older than the timeout, as its key would have expired.

The agent's socket is an abstract Unix socket (Linux: no file to clean up, private to the
host's network namespace). Such a socket has no permissions: any process on the host can send
to it. So the agent believes only what it can check:

- who sent a datagram: the kernel attaches the sender's pid and uid (SO_PASSCRED), and a beat
  counts only from a process of this user that the controller registered as a rank of the
  current attempt (`expect`), for that rank alone;
- which attempt it is: the controller says so (`expect`, `forget`); a beat's own `attempt` is
  ignored (one with a huge attempt had made the agent drop every real beat);
- what it says: every field is checked before anything is kept (beat_wire.py); a bad datagram
  is counted and dropped, and never ends a thread (`ping` reports whether both still run, so a
  broken agent is replaced).

Its name is random, one per agent (so two runs of one job name on a host never share one), and
the controller hands it to the workers of the node. `AgentLink` (heartbeat.py) is the worker's
end; `NodeAgent` runs in an actor the controller pins to the node (controller/agents.py).
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import socket
import struct
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import redis

from longrun import keys
from longrun.health.beat_wire import BeatRefused, parse_beat
from longrun.health.node_beats import ROSTER_FIELDS, encode, rows_of

log = logging.getLogger(__name__)
CHECK_S = 0.1  # how often the agent looks for its ranks' processes
MAX_DATAGRAM = 65536
_CREDS = struct.Struct("3i")  # struct ucred: pid, uid, gid

__all__ = ["NodeAgent", "NodeBeats", "new_agent_address", "process_alive"]


def new_agent_address(job: str, node_id: str) -> str:
    """A fresh abstract socket name for `job`'s agent on the Ray node `node_id`: random, so two
    runs of one job name on a host never collide (the job and node are there for a person
    reading /proc/net/unix). Within the 107 bytes an abstract name may have."""
    return f"\0longrun-beats/{job[:40]}/{node_id[:12]}/{secrets.token_hex(8)}"


def _sender(ancdata) -> tuple[int, int] | None:
    """(pid, uid) the kernel attached to a datagram, or None when it attached none."""
    for level, kind, data in ancdata:
        if level == socket.SOL_SOCKET and kind == socket.SCM_CREDENTIALS and len(data) >= _CREDS.size:
            pid, uid, _ = _CREDS.unpack_from(data)
            return pid, uid
    return None


@dataclass
class _Rank:
    beat: dict[str, Any]
    heard_at: float  # the agent's monotonic clock
    gone: bool = False  # its process exited


@dataclass
class NodeBeats:
    """What one agent knows of one attempt's ranks on its node. Pure: clocks are passed in."""

    node: int
    timeout_s: float
    ranks: dict[int, _Rank] = field(default_factory=dict)

    def heard(self, beat: dict[str, Any], at: float) -> None:
        rank = int(beat["rank"])
        known = self.ranks.get(rank)
        if known is not None and known.gone and beat.get("pid") == known.beat.get("pid"):
            return  # a datagram that was still in flight when the process went
        self.ranks[rank] = _Rank(beat, at)

    def check(self, alive: Any) -> bool:
        """Mark ranks whose process `alive(pid)` says is gone; True when one newly is."""
        newly = False
        for r in self.ranks.values():
            pid = r.beat.get("pid")
            if not r.gone and pid and not alive(pid):
                r.gone = newly = True
        return newly

    def record(self, now: float, wall: float) -> bytes:
        """The node's record: the ranks alive and heard within the timeout."""
        fresh = [r.beat for _, r in sorted(self.ranks.items())
                 if not r.gone and now - r.heard_at <= self.timeout_s]
        return encode(self.node, wall, rows_of(fresh))

    def roster(self) -> str:
        return json.dumps({rank: {k: r.beat.get(k) for k in ROSTER_FIELDS} for rank, r in self.ranks.items()})


def process_alive(pid: int) -> bool:
    """Whether `pid` is a live process on this host (a zombie is not: it has exited)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] != b"Z"
    except (OSError, IndexError):
        return True  # no /proc here: existence is all we know


class NodeAgent:
    """The agent of one node for one job: a receiving thread and a publishing thread."""

    def __init__(self, job: str, node_id: str, redis_url: str, interval_s: float, timeout_s: float):
        self.job, self.interval_s, self.timeout_s = job, interval_s, timeout_s
        self.client = redis.Redis.from_url(redis_url, socket_timeout=max(1.0, interval_s),
                                           socket_connect_timeout=max(1.0, interval_s))
        self.address = new_agent_address(job, node_id)
        self.host, self._uid = socket.gethostname(), os.getuid()
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self._sock.bind(self.address)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_PASSCRED, 1)  # each datagram's sender
        self._sock.settimeout(0.5)
        self._lock = threading.Lock()
        self._attempt = -1  # the attempt the controller registered ranks for (`expect`)
        self._ended = -1  # the newest attempt the controller said has ended
        self._ranks: dict[int, tuple[int, int]] = {}  # pid -> (rank, node index) of that attempt
        self._publishing = threading.Lock()  # a publish and a forget never interleave
        self._nodes: dict[int, NodeBeats] = {}  # node index -> its ranks (one, unless the layout changed)
        self._stop = threading.Event()
        self._wake = threading.Event()
        self.published = self.errors = self.rounds = 0
        self.refused = 0  # datagrams not from a registered rank, or not a valid beat
        self._threads = [threading.Thread(target=self._receive, name="agent-receive", daemon=True),
                         threading.Thread(target=self._publish_loop, name="agent-publish", daemon=True)]
        for t in self._threads:
            t.start()

    def ping(self) -> dict[str, object]:
        """Its address, and whether both its threads still run (an agent whose thread died
        answers, but hears or publishes nothing: the controller replaces it)."""
        return {"address": self.address, "alive": all(t.is_alive() for t in self._threads)}

    def stats(self) -> dict[str, int]:
        return {"published": self.published, "errors": self.errors, "refused": self.refused,
                "attempt": self._attempt}

    def expect(self, attempt: int, ranks: dict[int, tuple[int, int]]) -> None:
        """`attempt` starts, with these ranks on this node: rank -> (its process's pid, its node
        index). From now on a beat counts only from one of those processes, for its own rank."""
        with self._publishing, self._lock:
            if attempt <= self._ended:
                return  # the controller has moved past it already
            self._attempt = attempt
            self._ranks = {int(pid): (int(rank), int(node)) for rank, (pid, node) in ranks.items()}
            self._nodes = {}
        self._wake.set()

    def forget(self, attempt: int) -> None:
        """`attempt` has ended: publish nothing more of it, and ignore its ranks' late beats. The
        controller deletes an ended attempt's keys once its group stopped; a record published
        after that would bring a key back."""
        with self._publishing, self._lock:
            self._ended = max(self._ended, attempt)
            if self._attempt <= attempt:
                self._nodes, self._ranks = {}, {}

    def close(self) -> None:
        self._stop.set()
        self._wake.set()
        for t in self._threads:
            t.join(timeout=2)
        self._sock.close()

    def _receive(self) -> None:
        space = socket.CMSG_SPACE(_CREDS.size)
        while not self._stop.is_set():
            try:
                data, ancdata, flags, _ = self._sock.recvmsg(MAX_DATAGRAM, space)
            except TimeoutError:
                continue
            except OSError:
                return  # closed
            try:
                self._heard(data, ancdata, flags)
            except Exception:  # whatever a datagram holds, the thread goes on hearing the next
                self.refused += 1
                log.debug("a heartbeat datagram was refused", exc_info=True)

    def _heard(self, data: bytes, ancdata, flags: int) -> None:
        sender = _sender(ancdata)
        with self._lock:
            known = self._ranks.get(sender[0]) if sender and sender[1] == self._uid else None
        if known is None or flags & (socket.MSG_TRUNC | socket.MSG_CTRUNC):
            self.refused += 1  # not a registered rank's process (another user's, another job's)
            return
        rank, node = known
        beat = parse_beat(data)
        if beat["rank"] != rank:
            raise BeatRefused(f"pid {sender[0]} is rank {rank}'s, not rank {beat['rank']}'s")
        beat.update(pid=sender[0], host=self.host)  # what the kernel and this host say
        with self._lock:
            if self._ranks.get(sender[0]) != known:
                return  # the attempt ended while this beat was being read
            nodes = self._nodes.setdefault(node, NodeBeats(node, self.timeout_s))
            first = rank not in nodes.ranks
            nodes.heard(beat, time.monotonic())
        if first:
            self._wake.set()  # a rank's first beat is news: publish it now

    def _publish_loop(self) -> None:
        next_at = time.monotonic()
        while not self._stop.is_set():
            try:
                with self._lock:
                    newly_gone = any(n.check(process_alive) for n in self._nodes.values())
                now = time.monotonic()
                if newly_gone or self._wake.is_set() or now >= next_at:
                    self._wake.clear()
                    self._publish(now)
                    next_at = now + self.interval_s
            except Exception:  # a bug must not silence the node: log it, publish next round
                self.errors += 1
                log.exception("the heartbeat agent's publishing round failed")
                next_at = time.monotonic() + self.interval_s
            self._wake.wait(min(CHECK_S, max(0.0, next_at - time.monotonic())))

    def _publish(self, now: float) -> None:
        self.rounds += 1  # publishing rounds, something to wait on
        with self._publishing:
            with self._lock:
                attempt = self._attempt
                records = {n: (b.record(now, time.time()), b.roster()) for n, b in self._nodes.items()}
            if attempt >= 0 and records:
                self._send(attempt, records)

    def _send(self, attempt: int, records: dict[int, tuple[bytes, str]]) -> None:
        px = int(self.timeout_s * 1000)
        try:
            pipe = self.client.pipeline(transaction=False)
            for node, (record, roster) in records.items():
                pipe.set(keys.node_beats_key(self.job, attempt, node), record, px=px)
                pipe.set(keys.node_roster_key(self.job, attempt, node), roster, px=px)
            pipe.execute()
            self.published += 1
        except (redis.RedisError, OSError) as exc:
            # A Redis blip must not end the agent; the controller pauses judging meanwhile.
            self.errors += 1
            log.debug("publishing the node's beats failed: %s", exc)
