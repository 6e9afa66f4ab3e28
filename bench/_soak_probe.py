"""What the soak watches while it runs (not a bench itself): host memory by role, Redis keys,
the job record, and the job's goodput record.

Only processes under the soak's own process tree are looked at: the machine may run other
clusters whose workers carry the same names."""

from __future__ import annotations

import contextlib
import json
import os
import statistics
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import psutil
import redis

from longrun import keys

ROLES = ("controller", "workers", "keepers")


def role_of(proc: psutil.Process, controller_pid: int | None) -> str | None:
    """controller (`longrun run`), workers (TrainWorker actors, spares included), keepers."""
    if proc.pid == controller_pid:
        return "controller"
    try:
        head = (proc.cmdline() or [""])[0]
    except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
        return None
    if head.startswith("ray::TrainWorker"):
        return "workers"
    if head.startswith("ray::SnapshotKeeper"):
        return "keepers"
    return None


def processes(role: str, controller_pid: int | None) -> list[psutil.Process]:
    found = []
    for proc in psutil.Process(os.getpid()).children(recursive=True):
        if role_of(proc, controller_pid) == role:
            found.append(proc)
    return found


def training_workers() -> list[psutil.Process]:
    """This soak's worker processes now training (Ray titles them after the task they run)."""
    found = []
    for proc in processes("workers", None):
        with contextlib.suppress(psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            if proc.cmdline()[0].startswith("ray::TrainWorker.run") and proc.status() != psutil.STATUS_ZOMBIE:
                found.append(proc)
    return sorted(found, key=lambda p: p.pid)


def spare_workers() -> list[psutil.Process]:
    """This soak's warm spares: worker processes started and idle, waiting for an attempt."""
    found = []
    for proc in processes("workers", None):
        with contextlib.suppress(psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            busy = proc.cmdline()[0].startswith("ray::TrainWorker.")  # titled after the method it runs
            if not busy and proc.status() != psutil.STATUS_ZOMBIE:
                found.append(proc)
    return sorted(found, key=lambda p: p.pid)


@dataclass
class Sample:
    at: float  # seconds since the soak started
    rss_mb: dict[str, float]  # each role's processes together
    redis_keys: int | None
    state: str | None  # the job's, when sampled (None: Redis down)
    controller_torch: bool = False  # torch's library is mapped into the controller (it never should be)
    # Each role's largest process: what a leak shows in. The roles' process counts change (a lost
    # node's replacement gets a keeper, an eviction leaves one), which moves the sums, not this.
    rss_largest_mb: dict[str, float] = field(default_factory=dict)


@dataclass
class Probe:
    """Samples RSS by role and Redis's key count every `every_s` on a thread of its own (the
    main loop blocks while a fault is injected); `controller_pid` and `redis_url` follow the
    reruns and Redis restarts."""

    started: float
    every_s: float = 5.0
    controller_pid: int | None = None
    redis_url: str | None = None
    job: str | None = None
    samples: list[Sample] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def start(self) -> Probe:
        self._thread = threading.Thread(target=self._loop, name="soak-probe", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(30)

    def _loop(self) -> None:
        while not self._stop.wait(self.every_s):
            self.samples.append(self.sample())

    def sample(self) -> Sample:
        rss, largest = dict.fromkeys(ROLES, 0.0), dict.fromkeys(ROLES, 0.0)
        for proc in psutil.Process(os.getpid()).children(recursive=True):
            role = role_of(proc, self.controller_pid)
            if role is not None:
                with contextlib.suppress(psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
                    mb = proc.memory_info().rss / 2**20
                    rss[role] += mb
                    largest[role] = max(largest[role], mb)
        record = read_record(self.redis_url, self.job) if self.job else None
        return Sample(time.monotonic() - self.started, rss, redis_keys(self.redis_url),
                      (record or {}).get("state"), torch_loaded(self.controller_pid), largest)


def torch_loaded(pid: int | None) -> bool:
    """Whether process `pid` has torch's shared library mapped (it imported torch)."""
    if pid is None:
        return False
    try:
        with open(f"/proc/{pid}/maps") as maps:
            return any("libtorch" in line for line in maps)
    except OSError:
        return False


def redis_keys(url: str | None) -> int | None:
    """DBSIZE of the soak's Redis (it holds this job only); None while it is down."""
    if url is None:
        return None
    try:
        client = redis.Redis.from_url(url, socket_timeout=2, socket_connect_timeout=2)
        try:
            return int(client.dbsize())
        finally:
            client.close()
    except (redis.RedisError, OSError):
        return None


def flatness(samples: list[Sample], warm_from: float, value) -> dict[str, float | None]:
    """How a sampled quantity moved after warm-up, while the job was training (not between
    attempts or runs, nor after its end): the median of the samples in the first and last
    quarters after `warm_from` (medians, because a restart briefly runs two worker groups and
    two sets of attempt keys), their difference, and the maximum."""
    points = [(s.at, v) for s in samples
              if s.at >= warm_from and s.state == "RUNNING" and (v := value(s)) is not None]
    if len(points) < 4:
        return {"start": None, "end": None, "growth": None, "max": max((v for _, v in points), default=None)}
    quarter = max(1, len(points) // 4)
    start = statistics.median(v for _, v in points[:quarter])
    end = statistics.median(v for _, v in points[-quarter:])
    return {"start": round(start, 1), "end": round(end, 1), "growth": round(end - start, 1),
            "max": round(max(v for _, v in points), 1)}


def read_goodput(url: str | None, job: str) -> dict[str, Any] | None:
    """The job's goodput record (`longrun:{job}:goodput`), decoded; None when absent or Redis
    is down."""
    if url is None:
        return None
    try:
        client = redis.Redis.from_url(url, socket_timeout=3, decode_responses=True)
        try:
            raw = client.hgetall(f"{keys.job_prefix(job)}goodput")
        finally:
            client.close()
    except (redis.RedisError, OSError):
        return None
    if not raw:
        return None
    decoded: dict[str, Any] = {}
    for key, value in raw.items():
        try:
            decoded[key] = json.loads(value)
        except ValueError:
            decoded[key] = value
    return decoded


def read_record(url: str | None, job: str) -> dict[str, str] | None:
    """The job record's fields (state, attempt, step, nodes, ...); None when Redis is down."""
    if url is None:
        return None
    try:
        client = redis.Redis.from_url(url, socket_timeout=3, decode_responses=True)
        try:
            return client.hgetall(keys.job_record_key(job)) or None
        finally:
            client.close()
    except (redis.RedisError, OSError):
        return None
