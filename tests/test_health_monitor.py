"""HealthMonitor: pure fault detection driven by hand-built heartbeat snapshots and made-up times.

Run: python -m pytest -q tests/test_health_monitor.py
"""

from __future__ import annotations

import pytest

from longrun.config.sections import HealthSection
from longrun.health.heartbeat import Heartbeat
from longrun.health.monitor import Fault, FaultKind, HealthMonitor

HEALTH = HealthSection(
    heartbeat_interval_s=1, heartbeat_timeout_s=5, hang_timeout_s=60, hang_safety_factor=5, hang_min_s=2,
    straggler_factor=1.5, straggler_patience=3, loss_spike_factor=10, store_outage_grace_s=10,
)


def beat(rank: int, step: int, *, phase: str = "forward", step_time: float | None = 1.0,
         loss: float | None = 2.0, sent_at: float = 0.0) -> Heartbeat:
    return Heartbeat(rank=rank, step=step, phase=phase, loss=loss, loss_finite=loss is not None,
                     step_time_s=step_time, sent_at=sent_at)


def everyone(world: int, step: int, **fields) -> dict[int, Heartbeat | None]:
    return {r: beat(r, step, **fields) for r in range(world)}


def kinds(faults: list[Fault]) -> list[tuple[FaultKind, int | None]]:
    return [(f.kind, f.rank) for f in faults]


def learned_monitor() -> HealthMonitor:
    """One rank that ran 0.2 s steps (5 per 1 s poll) up to step 30 at t=6: its timeout is learned."""
    monitor = HealthMonitor(1, HEALTH, started_at=0.0)
    for t in range(7):
        assert monitor.observe({0: beat(0, 5 * t, step_time=0.2)}, now=float(t)) == []
    return monitor


def test_unseen_rank_gets_the_startup_grace_then_is_dead():
    monitor = HealthMonitor(2, HEALTH, started_at=100.0, startup_grace_s=30.0)
    assert monitor.observe({0: beat(0, 0), 1: None}, now=110.0) == []
    assert monitor.observe({0: beat(0, 0)}, now=129.0) == []  # an absent rank counts as missing too
    [fault] = monitor.observe({0: beat(0, 0), 1: None}, now=131.0)
    assert (fault.kind, fault.rank, fault.step, fault.detected_at) == (FaultKind.DEAD, 1, None, 131.0)
    assert "startup grace" in fault.detail


def test_a_dead_rank_is_reported_once_until_a_new_process_publishes():
    monitor = HealthMonitor(2, HEALTH, started_at=0.0)
    assert monitor.observe({0: beat(0, 7), 1: beat(1, 7, sent_at=1.0)}, now=1.0) == []
    [fault] = monitor.observe({0: beat(0, 7), 1: None}, now=2.0)
    assert (fault.kind, fault.rank, fault.step) == (FaultKind.DEAD, 1, 7)
    assert "last seen 1.0 s ago at step 7" in fault.detail
    for now in (3.0, 4.0, 5.0):
        assert monitor.observe({0: beat(0, 7), 1: None}, now=now) == []
    # A restarted process publishes a newer heartbeat; when it vanishes again that is news.
    assert monitor.observe({0: beat(0, 7), 1: beat(1, 0, sent_at=6.0)}, now=6.0) == []
    assert kinds(monitor.observe({0: beat(0, 7), 1: None}, now=7.0)) == [(FaultKind.DEAD, 1)]


def test_store_outage_judges_nothing_then_tolerates_missing_keys_for_the_grace():
    monitor = HealthMonitor(2, HEALTH, started_at=0.0)
    for t in range(3):
        assert monitor.observe(everyone(2, t), now=float(t)) == []
    for t in range(3, 41):
        assert monitor.store_unreachable(now=float(t)) is None
    # Redis came back empty at t=41: workers get store_outage_grace_s (10 s) to re-publish.
    for now in (41.0, 45.0, 50.9):
        assert monitor.observe({0: None, 1: None}, now=now) == []
    # Rank 0 re-published in time; rank 1 did not.
    faults = monitor.observe({0: beat(0, 3), 1: None}, now=51.5)
    assert kinds(faults) == [(FaultKind.DEAD, 1)]


def test_hang_timeout_is_learned_from_fast_steps_and_floored():
    monitor = HealthMonitor(1, HEALTH, started_at=0.0)
    monitor.observe({0: beat(0, 0, step_time=0.2)}, now=0.0)
    monitor.observe({0: beat(0, 5, step_time=0.2)}, now=1.0)
    assert monitor.hang_timeout_s(0) == 60  # one advance seen: still the hard ceiling
    monitor = learned_monitor()
    assert monitor.hang_timeout_s(0) == 2  # 5 x 0.2 s = 1 s, below the 2 s floor
    assert monitor.observe({0: beat(0, 30, step_time=0.2)}, now=8.0) == []  # stalled 2.0 s: not over
    [fault] = monitor.observe({0: beat(0, 30, step_time=0.2)}, now=8.5)
    assert (fault.kind, fault.rank, fault.step) == (FaultKind.HANG, 0, 30)
    assert "learned" in fault.detail
    assert monitor.observe({0: beat(0, 30, step_time=0.2)}, now=9.5) == []  # once per (rank, step)


def test_slow_steps_teach_a_longer_timeout_from_wall_time():
    monitor = HealthMonitor(1, HEALTH, started_at=0.0)
    # The worker claims 0.2 s steps, but the monitor sees one step per 3 s: the larger counts.
    for i in range(4):
        assert monitor.observe({0: beat(0, i, step_time=0.2)}, now=3.0 * i) == []
    assert monitor.hang_timeout_s(0) == 15
    assert monitor.observe({0: beat(0, 3, step_time=0.2)}, now=23.0) == []
    assert kinds(monitor.observe({0: beat(0, 3, step_time=0.2)}, now=25.0)) == [(FaultKind.HANG, 0)]


def test_a_hung_pipeline_rank_is_reported_with_its_stage():
    """A rank of a pipeline names its stage in its heartbeat, and the hang report says which."""
    monitor = HealthMonitor(2, HEALTH, started_at=0.0)
    stuck = {r: Heartbeat(rank=r, step=4, phase="pipeline", step_time_s=1.0, pp_stage=r) for r in range(2)}
    assert monitor.observe(stuck, now=0.0) == []
    faults = monitor.observe(stuck, now=61.0)  # past the hard ceiling (no step time learned)
    assert kinds(faults) == [(FaultKind.HANG, 0), (FaultKind.HANG, 1)]
    assert "rank 1 (pipeline stage 1) made no progress past step 4 in phase 'pipeline'" in faults[1].detail


@pytest.mark.parametrize("phase", ["checkpoint", "held"])
def test_checkpoint_phase_gets_the_hard_ceiling(phase):
    monitor = learned_monitor()
    saving = {0: beat(0, 30, phase=phase, step_time=0.2)}
    assert monitor.observe(saving, now=7.0) == []
    assert monitor.hang_timeout_s(0) == 60
    assert monitor.observe(saving, now=40.0) == []  # far past the 2 s learned timeout
    # Leaving the checkpoint restarts the step-sized clock instead of counting the save.
    assert monitor.observe({0: beat(0, 30, step_time=0.2)}, now=50.0) == []
    assert monitor.hang_timeout_s(0) == 2
    assert kinds(monitor.observe({0: beat(0, 30, step_time=0.2)}, now=52.5)) == [(FaultKind.HANG, 0)]
    # A save that never ends is still caught by the ceiling.
    monitor = learned_monitor()
    assert monitor.observe(saving, now=66.0) == []
    [fault] = monitor.observe(saving, now=66.5)
    assert fault.kind == FaultKind.HANG and "hard ceiling" in fault.detail


def test_hang_clock_stands_still_during_a_store_outage():
    monitor = learned_monitor()  # last progress seen at t=6, timeout 2 s
    for t in range(7, 31):
        monitor.store_unreachable(now=float(t))
    assert monitor.observe({0: beat(0, 30, step_time=0.2)}, now=31.0) == []
    assert monitor.observe({0: beat(0, 30, step_time=0.2)}, now=33.0) == []
    assert kinds(monitor.observe({0: beat(0, 30, step_time=0.2)}, now=33.5)) == [(FaultKind.HANG, 0)]


def slow_rank_3(step: int, slow: float = 2.0) -> dict[int, Heartbeat | None]:
    return {r: beat(r, step, step_time=slow if r == 3 else 1.0) for r in range(4)}


def test_straggler_after_patience_and_again_after_recovery():
    monitor = HealthMonitor(4, HEALTH, started_at=0.0)
    now = 0.0

    def poll(snapshot):
        nonlocal now
        now += 1.0
        return [f for f in monitor.observe(snapshot, now=now) if f.kind == FaultKind.STRAGGLER]

    assert poll(slow_rank_3(1)) == []
    assert poll(slow_rank_3(1)) == [] and poll(slow_rank_3(1)) == []  # the same step counts once
    assert poll(slow_rank_3(2)) == []
    [fault] = poll(slow_rank_3(3))
    assert (fault.rank, fault.step) == (3, 3) and "2.0x the median 1.00 s" in fault.detail
    assert poll(slow_rank_3(4)) == [] and poll(slow_rank_3(5)) == []  # reported once per streak
    assert poll(slow_rank_3(6, slow=1.0)) == []  # recovered
    assert poll(slow_rank_3(7)) == [] and poll(slow_rank_3(8)) == []
    assert kinds(poll(slow_rank_3(9))) == [(FaultKind.STRAGGLER, 3)]


def test_no_straggler_with_two_ranks():
    monitor = HealthMonitor(2, HEALTH, started_at=0.0)
    for step in range(1, 11):
        snapshot = {0: beat(0, step, step_time=1.0), 1: beat(1, step, step_time=5.0)}
        assert monitor.observe(snapshot, now=float(step)) == []


def test_nan_is_job_wide_and_reported_once_per_step():
    monitor = HealthMonitor(3, HEALTH, started_at=0.0)
    snapshot = {0: beat(0, 10), 1: beat(1, 10, loss=None), 2: beat(2, 10, loss=None)}
    [fault] = monitor.observe(snapshot, now=1.0)
    assert (fault.kind, fault.rank, fault.step) == (FaultKind.NAN, None, 10)
    assert "rank 1 and 1 other rank(s)" in fault.detail
    assert monitor.observe(snapshot, now=2.0) == []
    later = {r: beat(r, 11, loss=None) for r in range(3)}
    assert [(f.kind, f.step) for f in monitor.observe(later, now=3.0)] == [(FaultKind.NAN, 11)]


def test_loss_spike_stands_out_from_ordinary_noise():
    monitor = HealthMonitor(2, HEALTH, started_at=0.0)
    noisy = [2.0, 2.6, 1.7, 2.3, 1.9, 2.8, 2.1, 1.6, 2.4, 2.2]
    for step, loss in enumerate(noisy, start=1):
        assert monitor.observe(everyone(2, step, loss=loss), now=float(step)) == []
    assert monitor.observe(everyone(2, 11, loss=15.0), now=11.0) == []  # 7x: noise, not a spike
    [fault] = monitor.observe(everyone(2, 12, loss=30.0), now=12.0)
    assert (fault.kind, fault.rank, fault.step) == (FaultKind.LOSS_SPIKE, None, 12)
    assert monitor.observe(everyone(2, 12, loss=30.0), now=13.0) == []  # once per step
    # Spikes stay out of the window: a run of them is not taken as the new normal.
    for step in range(13, 30):
        assert kinds(monitor.observe(everyone(2, step, loss=30.0), now=float(step + 1))) == [
            (FaultKind.LOSS_SPIKE, None)]


def test_loss_spike_needs_enough_history_and_uses_the_lowest_rank_with_a_loss():
    monitor = HealthMonitor(2, HEALTH, started_at=0.0)
    for step in range(1, 8):
        assert monitor.observe(everyone(2, step, loss=2.0), now=float(step)) == []
    assert monitor.observe(everyone(2, 8, loss=100.0), now=8.0) == []  # 7 losses: too few to judge
    monitor = HealthMonitor(2, HEALTH, started_at=0.0)
    for step in range(1, 10):
        assert monitor.observe(everyone(2, step, loss=2.0), now=float(step)) == []
    snapshot = {0: Heartbeat(rank=0, step=10, phase="forward", step_time_s=1.0), 1: beat(1, 10, loss=50.0)}
    assert kinds(monitor.observe(snapshot, now=10.0)) == [(FaultKind.LOSS_SPIKE, None)]


def test_actor_died_is_a_dead_fault_with_the_reason_and_not_repeated():
    monitor = HealthMonitor(2, HEALTH, started_at=0.0)
    monitor.observe({0: beat(0, 4, sent_at=1.0), 1: beat(1, 4, sent_at=1.0)}, now=1.0)
    fault = monitor.actor_died(1, now=2.0, reason="node 10.0.0.7 lost")
    assert (fault.kind, fault.rank, fault.step, fault.detected_at) == (FaultKind.DEAD, 1, 4, 2.0)
    assert "node 10.0.0.7 lost" in fault.detail
    # The lingering key, then its expiry, are the same death: no second report.
    assert monitor.observe({0: beat(0, 5, sent_at=3.0), 1: beat(1, 4, sent_at=1.0)}, now=3.0) == []
    assert monitor.observe({0: beat(0, 6, sent_at=4.0), 1: None}, now=4.0) == []


def test_faults_come_back_in_kind_then_rank_order():
    monitor = HealthMonitor(4, HEALTH, started_at=0.0, startup_grace_s=0.0)
    snapshot = {0: beat(0, 1, loss=None), 1: None, 2: beat(2, 1, loss=None), 3: None}
    assert kinds(monitor.observe(snapshot, now=1.0)) == [
        (FaultKind.DEAD, 1), (FaultKind.DEAD, 3), (FaultKind.NAN, None)]


def test_a_4096_rank_poll_works():
    world = 4096
    monitor = HealthMonitor(world, HEALTH, started_at=0.0)
    found: list[Fault] = []
    for step in range(1, 5):
        snapshot = {r: beat(r, step, step_time=3.0 if r == 1234 else 1.0) for r in range(world)}
        snapshot[4000] = None
        found += monitor.observe(snapshot, now=200.0 + step)
    assert kinds(found) == [(FaultKind.DEAD, 4000), (FaultKind.STRAGGLER, 1234)]


def test_a_finished_rank_is_not_judged_when_its_heartbeat_expires():
    from longrun.config.sections import HealthSection
    from longrun.health.heartbeat import Heartbeat
    from longrun.health.monitor import HealthMonitor

    health = HealthSection(heartbeat_interval_s=1, heartbeat_timeout_s=5)
    monitor = HealthMonitor(2, health, started_at=0.0, startup_grace_s=10)
    beats = {0: Heartbeat(rank=0, step=5, sent_at=1.0), 1: Heartbeat(rank=1, step=5, sent_at=1.0)}
    assert monitor.observe(beats, now=1.0) == []
    monitor.finished(0)
    faults = monitor.observe({0: None, 1: None}, now=2.0)  # both keys gone; only rank 1 is dead
    assert [(f.kind, f.rank) for f in faults] == [("dead", 1)]


def test_loss_history_survives_a_long_rollback():
    """A resume far behind the last step seen (a long checkpoint interval) judges the first
    steps after it against the steps before the checkpoint, not against the old attempt's."""
    health = HealthSection(loss_spike_factor=10.0)
    first = HealthMonitor(1, health, started_at=0.0)
    for step in range(1, 1001):
        first.observe({0: Heartbeat(rank=0, step=step, phase="forward", loss=2.0)}, float(step))
    second = HealthMonitor(1, health, started_at=0.0, loss_history=first.loss_history)
    faults = second.observe({0: Heartbeat(rank=0, step=901, phase="forward", loss=50.0)}, 1.0)
    assert [f.kind for f in faults] == ["loss_spike"] and faults[0].step == 901


def test_a_hang_is_timed_from_when_the_step_completed_not_from_the_poll_that_saw_it():
    # The step-2 beat reaches the poll at t=10 (wall 1010), but the step completed at wall 1005:
    # with the hard ceiling of 60 s, the hang is due at t=65, not t=70.
    for dated, due in ((True, 65.5), (False, 70.5)):
        monitor = HealthMonitor(1, HEALTH, started_at=0.0)
        assert monitor.observe({0: beat(0, 1)}, now=0.0, wall=1000.0) == []
        step2 = Heartbeat(rank=0, step=2, phase="forward", loss=2.0, step_time_s=None,
                          stepped_at=1005.0 if dated else None)
        assert monitor.observe({0: step2}, now=10.0, wall=1010.0) == []
        assert monitor.observe({0: step2}, now=due - 1.0, wall=1000.0 + due - 1.0) == []
        assert kinds(monitor.observe({0: step2}, now=due, wall=1000.0 + due)) == [(FaultKind.HANG, 0)]


def test_a_completion_time_from_a_clock_far_off_moves_progress_back_by_a_heartbeat_timeout_at_most():
    monitor = HealthMonitor(1, HEALTH, started_at=0.0)
    assert monitor.observe({0: beat(0, 1)}, now=0.0, wall=1000.0) == []
    skewed = Heartbeat(rank=0, step=2, phase="forward", loss=2.0, step_time_s=None, stepped_at=0.0)
    assert monitor.observe({0: skewed}, now=10.0, wall=1010.0) == []
    # Dated 5 s (the heartbeat timeout) before the poll, never 1,010 s: due at 10 - 5 + 60.
    assert monitor.observe({0: skewed}, now=64.5, wall=1064.5) == []
    assert kinds(monitor.observe({0: skewed}, now=65.5, wall=1065.5)) == [(FaultKind.HANG, 0)]
