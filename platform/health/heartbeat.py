"""Worker heartbeats: a small thread that publishes the worker's latest progress to Redis.

At scale (health.node_agents) the beat goes to the node's agent instead (`link`: a datagram
to health/node_agent.py), which publishes one record for all of the node's ranks.

The training loop only updates an in-memory snapshot (no I/O on the step's critical path);
the thread publishes it every `interval_s` with an expiry of `timeout_s`, so a worker that
dies or freezes stops refreshing its key and the key vanishes on its own: a missing key is
a dead or hung process, an unchanging `step` with a fresh key is a hang inside training.
"""

from __future__ import annotations

import json
import os
import socket
import threading
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import redis

from longrun import keys


@dataclass
class Heartbeat:
    rank: int
    step: int = 0  # optimizer steps completed
    # setup, rendezvous, build, restore, init, calibration (the start: kinds.StartupPhase), then
    # data, forward, backward, sync, optimizer, checkpoint, ...
    phase: str = "starting"
    loss: float | None = None  # the last step's global loss; None if not finite
    loss_finite: bool = True  # False when the last step's loss was NaN/inf
    step_time_s: float | None = None
    tokens_per_s: float | None = None
    memory_bytes: int | None = None
    attempt: int = 0
    resumed_from: int = 0  # the checkpoint step this attempt restored (0: none)
    metrics_addr: str | None = None  # host:port of the worker's /metrics, for service discovery
    pp_stage: int | None = None  # the rank's pipeline position (None: no pipeline stages)
    # What the rank's share of the last step's data should cost, in the units of the trainer's
    # cost model (tokens, or modelled seconds under dynamic CP): a slow rank whose work cost is
    # as far above the median as its step time is slow because of its data, not its node.
    work_cost: float | None = None
    stepped_at: float | None = None  # wall clock when `step` completed: a hang is timed from it
    pid: int = field(default_factory=os.getpid)
    host: str = field(default_factory=socket.gethostname)
    sent_at: float = 0.0  # wall clock of the publisher


class AgentLink:
    """A worker's end: sends each heartbeat to its node's agent, at the address the controller
    gave the worker (node_agent.new_agent_address). A datagram that cannot be sent (the agent not
    up yet, or gone) is dropped: the next interval sends a newer one. The agent knows this
    process by its pid, which the kernel attaches to every datagram."""

    def __init__(self, address: str, node: int):
        self.address, self.node = address, node
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)

    def send(self, beat: dict[str, Any]) -> None:
        self._sock.sendto(json.dumps({"node": self.node, "beat": beat}).encode(), self.address)

    def close(self) -> None:
        self._sock.close()


class HeartbeatPublisher:
    def __init__(self, client: redis.Redis, job: str, attempt: int, rank: int,
                 interval_s: float, timeout_s: float, link: AgentLink | None = None):
        self.client, self.link = client, link
        self.key = keys.heartbeat_key(job, attempt, rank)
        self.interval_s = interval_s
        self.timeout_ms = int(timeout_s * 1000)
        self._beat = Heartbeat(rank=rank, attempt=attempt)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"heartbeat-{rank}", daemon=True)
        self.errors = 0

    def start(self) -> HeartbeatPublisher:
        self.publish_now()  # the controller sees the worker before the first interval ends
        self._thread.start()
        return self

    def update(self, **fields) -> None:
        with self._lock:
            for name, value in fields.items():
                setattr(self._beat, name, value)

    def publish_now(self) -> None:
        with self._lock:
            self._beat.sent_at = time.time()
            beat = asdict(self._beat)
        if self.link is None:
            self.client.set(self.key, json.dumps(beat), px=self.timeout_ms)
            return
        try:
            self.link.send(beat)
        except OSError:
            self.errors += 1  # the agent is not up yet or is gone: the next interval sends a newer beat

    def stop(self, final_phase: str | None = None) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()
        if final_phase is not None:
            self.update(phase=final_phase)
            self.publish_now()

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.publish_now()
            except (redis.RedisError, OSError):
                # A Redis blip must not kill training; the controller notices a stale key.
                self.errors += 1


def read_heartbeats(client: redis.Redis, job: str, attempt: int, ranks: range) -> dict[int, Heartbeat | None]:
    """The latest heartbeat of each rank (None where the key expired or never existed)."""
    raw = client.mget([keys.heartbeat_key(job, attempt, r) for r in ranks])
    return {r: _parse(v) if v else None for r, v in zip(ranks, raw, strict=True)}


def _parse(raw: bytes) -> Heartbeat:
    data = json.loads(raw)
    known = Heartbeat.__dataclass_fields__
    return Heartbeat(**{k: v for k, v in data.items() if k in known})  # newer fields: ignored
