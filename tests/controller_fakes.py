"""Fakes for stepping the controller without Ray: a worker group whose polls return scripted
rank endings, a launcher that hands one out per attempt, a clock the polls advance, and
heartbeats published into a real Redis as the workers would."""

from __future__ import annotations

import tempfile

from longrun.config import config_from_dict
from longrun.controller.controller import Controller
from longrun.controller.state import JobState
from longrun.controller.workers import RankEnded
from longrun.health.heartbeat import HeartbeatPublisher

WORLD = 4
NODES = ("node-a", "node-b")
# Where a job without an output_dir of its own keeps its journal and TensorBoard files: not the
# repository's runs/ (removed when the test process ends).
_OUTPUT = tempfile.TemporaryDirectory(prefix="longrun-fakes-")


def job(name: str, output_dir: str | None = None, **recovery):
    return config_from_dict({
        "job": {"name": name, "output_dir": output_dir or _OUTPUT.name},
        "cluster": {"nodes": 2, "workers_per_node": 2, "device": "cpu"},
        "parallelism": {"dp": WORLD},
        "training": {"steps": 10},
        "health": {"heartbeat_interval_s": 1.0, "heartbeat_timeout_s": 5.0, "hang_timeout_s": 30,
                   "hang_min_s": 10},
        "recovery": {"restart_backoff_s": 2.0} | recovery,
    })


class Clock:
    def __init__(self):
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


class FakeGroup:
    """One attempt: `script` holds what each poll returns (rank endings); polls advance the clock."""

    def __init__(self, attempt: int, clock: Clock, diagnostics=None):
        self.attempt, self.clock = attempt, clock
        self.node_ids = NODES
        self.node_names: dict[str, str] = {}  # named by their ids, unless a test names them
        self.pids: dict[int, int] = {}
        self.diagnostics = diagnostics or {}  # rank -> failure reason
        self.script: list[list[RankEnded]] = []
        self.started = self.stopped = False
        self.pending = set(range(WORLD))
        self.drained: dict[str, float] = {}  # node -> deadline: Ray's drain notices

    def node_of(self, rank: int) -> str:
        return NODES[rank // 2]

    def diagnose(self, timeout_s: float):
        return [{"node": self.node_of(r), "rank": r, "ok": r not in self.diagnostics,
                 "reason": self.diagnostics.get(r, ""), "checks": []} for r in range(WORLD)]

    def start(self) -> None:
        self.started = True

    def running(self) -> int:
        return len(self.pending)

    def poll(self, timeout_s: float) -> list[RankEnded]:
        self.clock.t += timeout_s
        ended = self.script.pop(0) if self.script else []
        self.pending -= {e.rank for e in ended}
        return ended

    def draining(self) -> dict[str, float]:
        return dict(self.drained)

    def stop(self) -> None:
        self.stopped = True


class Launcher:
    """Hands out a FakeGroup per attempt, or raises what `failures` lists for that attempt."""

    def __init__(self, clock: Clock):
        self.clock = clock
        self.calls: list[dict] = []
        self.groups: list[FakeGroup] = []
        self.failures: dict[int, Exception] = {}
        self.diagnostics: dict[int, dict[int, str]] = {}
        self.skips: list[list[tuple[int, int]]] = []
        self.warmed: list[int] = []  # attempts whose spares were asked for
        self.released = 0
        self.spare = 1  # nodes that could replace one of the job's

    def spare_nodes(self, cfg, evicted) -> int:
        return self.spare

    def warm_spares(self) -> None:
        self.warmed.append(self.calls[-1]["attempt"])

    def release(self) -> None:
        self.released += 1

    def __call__(self, cfg, *, attempt, redis_url, evicted, resume_before_step, timeout_s, skip_steps=(),
                 cancelled=None):
        self.calls.append({"attempt": attempt, "evicted": set(evicted), "resume_before": resume_before_step})
        self.skips.append(skip_steps)
        if attempt in self.failures:
            raise self.failures[attempt]
        group = FakeGroup(attempt, self.clock, self.diagnostics.get(attempt))
        self.groups.append(group)
        return group


def make_rig(redis_url: str):
    """(make a controller for a config, the launcher, the clock, the backoffs slept)."""
    clock = Clock()
    launcher = Launcher(clock)
    sleeps: list[float] = []

    def make(cfg, **kw):
        return Controller(cfg, redis_url, launch=launcher, clock=clock, sleep=sleeps.append, **kw)

    return make, launcher, clock, sleeps


def beat(redis_client, cfg, attempt: int, rank: int, **fields) -> None:
    """Publish one heartbeat as rank `rank` of `attempt` would."""
    pub = HeartbeatPublisher(redis_client, cfg.job.name, attempt, rank, interval_s=1.0, timeout_s=60.0)
    pub.update(**fields)
    pub.publish_now()


def beat_all(redis_client, cfg, attempt: int, **fields) -> None:
    for rank in range(WORLD):
        beat(redis_client, cfg, attempt, rank, **fields)


def finished(rank: int, step: int = 10, preempted: bool = False) -> RankEnded:
    return RankEnded(rank, summary={"rank": rank, "step": step, "loss": 2.0, "resumed_from": 0,
                                    "preempted": preempted})


def drive_to_running(c: Controller) -> None:
    for want in (JobState.PLACING, JobState.DIAGNOSING, JobState.RENDEZVOUS, JobState.RUNNING):
        assert c.step() is want
