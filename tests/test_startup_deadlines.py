"""Start-up with deadlines that fit it (issue 38): each start-up phase has its own deadline,
sized from the rank's state and the measured storage rate; a rank past it is a hang that names
the phase; the hang timeout covers training steps only.

Run: python -m pytest -q tests/test_startup_deadlines.py
"""

from __future__ import annotations

import pytest
from controller_fakes import Clock, Launcher, beat_all, drive_to_running, job

from longrun.config import config_from_dict
from longrun.config.loader import load_config
from longrun.config.sections import HealthSection
from longrun.controller.controller import Controller
from longrun.controller.state import JobState
from longrun.goodput.ledger import StepLedger
from longrun.goodput.tracker import GoodputTracker
from longrun.health.heartbeat import Heartbeat
from longrun.health.monitor import FaultKind, HealthMonitor
from longrun.health.startup import Deadline, StartupDeadlines, startup_deadlines
from longrun.kinds import JobState as S
from longrun.kinds import StartupPhase

HEALTH = HealthSection(heartbeat_interval_s=1, heartbeat_timeout_s=5, hang_timeout_s=60, hang_safety_factor=5,
                       hang_min_s=2)
# Small on purpose, every phase different, so a test can tell which one judged.
DEADLINES = StartupDeadlines(tuple(Deadline(phase, seconds, f"why {phase}") for phase, seconds in
                                   zip(StartupPhase, (100, 110, 120, 30, 40, 50, 60, 200), strict=True)))


def beat(rank: int, phase: str, step: int = 0, resumed_from: int = 0, step_time: float | None = None):
    return Heartbeat(rank=rank, step=step, phase=phase, resumed_from=resumed_from, step_time_s=step_time,
                     loss=2.0)


def kinds(faults):
    return [(f.kind, f.rank) for f in faults]


def cfg_70b(**health):
    cfg = load_config("examples/llama-70b-pp.yaml")
    return cfg.model_copy(update={"health": cfg.health.model_copy(update=health)}) if health else cfg


def test_every_phase_has_a_deadline_in_order_sized_by_the_state_and_the_storage_rate(repo_root, monkeypatch):
    monkeypatch.chdir(repo_root)
    cfg = cfg_70b()
    assumed = startup_deadlines(cfg)
    assert [row.phase for row in assumed] == list(StartupPhase)
    restore = assumed[StartupPhase.RESTORE]
    # 6.8 GB of parameters and optimizer state per rank at the assumed 100 MB/s, three times over.
    assert restore.seconds == pytest.approx(60 + 3 * 6.81e9 / 100e6, rel=0.01)
    assert "6.81 GB" in restore.why and "nothing measured yet" in restore.why
    # A restore measured at 1 GB/s shortens it (to the floor), and says where the rate came from.
    measured = startup_deadlines(cfg, storage_bytes_per_s=1e9)[StartupPhase.RESTORE]
    assert measured.seconds == pytest.approx(120) and "measured" in measured.why
    slower = startup_deadlines(cfg, storage_bytes_per_s=20e6)[StartupPhase.RESTORE]
    assert slower.seconds > restore.seconds
    # A bigger model per rank (fewer shards) gets more time to build and restore.
    whole = cfg.parallelism.model_copy(update={"fsdp": 1, "dp": 4})
    unsharded = cfg.model_copy(update={"parallelism": whole})
    assert startup_deadlines(unsharded)[StartupPhase.RESTORE].seconds > restore.seconds
    # No context parallelism: calibration does not run.
    assert "not run" in assumed[StartupPhase.CALIBRATION].why


def test_deadlines_have_floors_and_settings_win(repo_root, monkeypatch):
    monkeypatch.chdir(repo_root)
    tiny = load_config("examples/tiny.yaml")
    rows = startup_deadlines(tiny)
    # A tiny job gets at least what every start-up phase had before: the hard ceiling (120 s).
    assert min(row.seconds for row in rows) >= 120
    patient = tiny.model_copy(update={"health": tiny.health.model_copy(update={"hang_timeout_s": 400.0})})
    assert min(row.seconds for row in startup_deadlines(patient)) >= 400
    set_build = config_from_dict({"job": {"name": "set"},
                                  "health": {"startup": {"build_s": 45, "floor_s": 10}}})
    build = startup_deadlines(set_build)[StartupPhase.BUILD]
    assert (build.seconds, build.configured, build.why) == (45, True, "health.startup.build_s")


def test_a_start_up_phase_past_its_deadline_is_a_hang_that_names_the_phase():
    monitor = HealthMonitor(2, HEALTH, started_at=0.0, deadlines=DEADLINES)
    assert monitor.observe({0: beat(0, "build"), 1: beat(1, "build")}, now=0.0) == []
    assert monitor.observe({0: beat(0, "restore"), 1: beat(1, "build")}, now=10.0) == []
    # Rank 1 builds for 31 s against the build's 30 s (far past no hang timeout: none applies).
    [fault] = monitor.observe({0: beat(0, "restore"), 1: beat(1, "build")}, now=31.0)
    assert (fault.kind, fault.rank, fault.step) == (FaultKind.HANG, 1, 0)
    assert "rank 1 spent 31 s in phase 'build' (deadline 30 s: why build)" in fault.detail
    assert monitor.hang_timeout_s(1) == 30
    assert monitor.observe({0: beat(0, "restore"), 1: beat(1, "build")}, now=40.0) == []  # once a stint


def test_a_rank_waiting_for_a_peer_still_in_an_earlier_phase_is_not_charged_for_the_wait():
    monitor = HealthMonitor(2, HEALTH, started_at=0.0, deadlines=DEADLINES)
    monitor.observe({0: beat(0, "restore"), 1: beat(1, "build")}, now=0.0)
    # Rank 0 has been in the restore for 45 s (deadline 40 s) but waits for rank 1's build.
    assert monitor.observe({0: beat(0, "restore"), 1: beat(1, "build")}, now=25.0) == []
    assert monitor.observe({0: beat(0, "restore"), 1: beat(1, "restore")}, now=29.0) == []
    assert monitor.observe({0: beat(0, "restore"), 1: beat(1, "restore")}, now=68.0) == []
    # Its clock started when rank 1 reached the restore too (t=29): both are over at t=69.1.
    faults = monitor.observe({0: beat(0, "restore"), 1: beat(1, "restore")}, now=69.1)
    assert kinds(faults) == [(FaultKind.HANG, 0), (FaultKind.HANG, 1)]
    assert "in phase 'restore' (deadline 40 s" in faults[0].detail


def test_the_first_step_has_its_deadline_and_later_steps_the_hang_timeout():
    monitor = HealthMonitor(1, HEALTH, started_at=0.0, deadlines=DEADLINES)
    # Restored step 7: until step 8 is done the rank is in its first step (deadline 200 s), far
    # past the 60 s hard ceiling that judges steps.
    assert monitor.observe({0: beat(0, "restore")}, now=0.0) == []
    assert monitor.observe({0: beat(0, "forward", step=7, resumed_from=7)}, now=5.0) == []
    assert monitor.observe({0: beat(0, "backward", step=7, resumed_from=7)}, now=150.0) == []
    [fault] = monitor.observe({0: beat(0, "sync", step=7, resumed_from=7)}, now=205.5)
    assert fault.kind == FaultKind.HANG
    assert "in its first step (phase 'sync', step 7) (deadline 200 s: why first_step)" in fault.detail
    # A step that hangs after the first is still caught by the hang timeout.
    monitor = HealthMonitor(1, HEALTH, started_at=0.0, deadlines=DEADLINES)
    assert monitor.observe({0: beat(0, "forward", step=7, resumed_from=7)}, now=0.0) == []
    assert monitor.observe({0: beat(0, "forward", step=8, resumed_from=7, step_time=1.0)}, now=100.0) == []
    assert monitor.hang_timeout_s(0) == 60
    assert monitor.observe({0: beat(0, "backward", step=8, resumed_from=7, step_time=1.0)}, now=159.0) == []
    [fault] = monitor.observe({0: beat(0, "backward", step=8, resumed_from=7, step_time=1.0)}, now=160.5)
    assert fault.kind == FaultKind.HANG and "made no progress past step 8" in fault.detail
    assert "hard ceiling" in fault.detail


def test_the_controller_places_within_the_placement_deadline_and_judges_phases_by_theirs(redis_server,
                                                                                       redis_client):
    timeouts: list[float] = []

    class TimedLauncher(Launcher):
        def __call__(self, cfg, *, timeout_s, **kw):
            timeouts.append(timeout_s)
            return super().__call__(cfg, timeout_s=timeout_s, **kw)

    clock = Clock()
    cfg = job("startup-steps")
    cfg = cfg.model_copy(update={"health": cfg.health.model_copy(update={
        "startup": cfg.health.startup.model_copy(update={"build_s": 20.0, "placement_s": 77.0})})})
    c = Controller(cfg, redis_server.url, launch=TimedLauncher(clock), clock=clock, sleep=lambda s: None)
    drive_to_running(c)
    assert timeouts == [77.0]
    assert c.attempt.monitor.deadlines[StartupPhase.BUILD].seconds == 20.0
    beat_all(redis_client, cfg, 0, phase="build")
    started = clock.t
    while c.step() is JobState.RUNNING:  # one poll a second (the fake clock) while every rank builds
        assert clock.t - started <= 25, "no rank was declared past the build's deadline"
    assert c.machine.state is JobState.RECOVERING and clock.t - started > 20
    faults = [e for e in c.record.events(50) if e["type"] == "fault"]
    assert len(faults) == 4
    assert "in phase 'build' (deadline 20 s: health.startup.build_s)" in faults[0]["reason"]


def test_the_storage_rate_a_restore_measured_is_kept_for_the_next_controller(redis_server, redis_client):
    now = [1000.0]
    tracker = GoodputTracker("rate", redis_client, redis_client, wall=lambda: now[0])
    tracker.resume(None, None)
    tracker.moved(S.RUNNING, now[0], attempt=0, world_size=2)
    for rank, seconds in ((0, 2.0), (1, 4.0)):  # 4 GB each: rank 1 at 1 GB/s is the slowest
        StepLedger(redis_server.client(), "rate", 0, rank, clock=lambda: now[0]).restored(
            5, "storage", seconds, nbytes=4_000_000_000)
    tracker.poll(0)
    assert tracker.storage_rate == pytest.approx(1e9)
    again = GoodputTracker("rate", redis_client, redis_client, wall=lambda: now[0])
    again.resume("RUNNING", 0)  # a controller continuing the job
    assert again.storage_rate == pytest.approx(1e9)
    fresh = GoodputTracker("rate", redis_client, redis_client, wall=lambda: now[0])
    fresh.resume("SUCCEEDED", 0)  # the name starts a new job: nothing measured
    assert fresh.storage_rate is None


def test_config_plan_shows_how_the_job_starts(cli, repo_root, monkeypatch):
    monkeypatch.chdir(repo_root)
    code, out, _ = cli("config", "plan", "examples/llama-70b-pp.yaml")
    assert code == 0
    for phase in StartupPhase:
        assert f"{phase} " in out
    assert "health.collective_timeout_s 1800 s" in out and "6.81 GB" in out
