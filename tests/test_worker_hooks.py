"""StepHooks, the object the trainer calls around each step: what it publishes, in which phase.

The case that matters most: a blocking checkpoint save (async_save false, or when_busy wait
behind a slow write) that takes longer than the rank's learned, step-sized hang timeout. The
hooks publish phase "checkpoint" for its whole length, so the controller's monitor judges it by
the hard ceiling and does not call it a hang. Real Redis and real heartbeats; the save is a
double that blocks until the test releases it, so its length is decided by the test, not by
the disk.
"""

from __future__ import annotations

import threading
import time
from dataclasses import replace

from longrun.config.sections import HealthSection
from longrun.health.heartbeat import HeartbeatPublisher, read_heartbeats
from longrun.health.monitor import FaultKind, HealthMonitor
from longrun.kinds import Phase
from longrun.observability.metrics import WorkerMetrics
from longrun.trainer import StepMetrics
from longrun.worker.hooks import StepHooks

HEALTH = HealthSection(heartbeat_interval_s=0.05, heartbeat_timeout_s=5, hang_timeout_s=120,
                       hang_safety_factor=5, hang_min_s=2)


class BlockingSave:
    """A checkpointer whose save at `step` blocks until released."""

    def __init__(self, step: int):
        self.step = step
        self.saving, self.release = threading.Event(), threading.Event()

    def due(self, step: int) -> bool:
        return step == self.step

    def save(self, trainer) -> float:
        self.saving.set()
        assert self.release.wait(timeout=60), "the test never released the save"
        return 42.0

    def before_update(self) -> None:
        pass


class NoTrainer:
    last_plan = None
    layout = "single"

    def state_bytes(self) -> dict[str, int]:
        return {"parameters": 1024}


def metrics_of(step: int) -> StepMetrics:
    return StepMetrics(step=step, loss=2.0, grad_norm=1.0, lr=1e-3, tokens=64, tokens_per_s=640.0,
                       step_time_s=0.1, data_wait_s=0.0, mfu=None, memory_bytes=0)


def wait_for_phase(client, phase: str) -> dict:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        beats = read_heartbeats(client, "hooks", 0, range(1))
        if beats[0] is not None and beats[0].phase == phase:
            return beats
        time.sleep(0.01)  # the publisher thread writes every 50 ms; nothing to wait on but Redis
    raise AssertionError(f"the heartbeat never showed phase {phase!r}")


def test_a_blocking_save_longer_than_the_learned_timeout_is_not_a_hang(redis_client):
    beat = HeartbeatPublisher(redis_client, "hooks", 0, 0, HEALTH.heartbeat_interval_s,
                              HEALTH.heartbeat_timeout_s).start()
    metrics = WorkerMetrics("hooks", 0)
    save = BlockingSave(step=4)
    hooks = StepHooks(beat, metrics, checkpointer=save)
    hooks.trainer = NoTrainer()
    monitor = HealthMonitor(1, HEALTH, started_at=0.0)
    try:
        for step in range(1, 4):  # three 0.1 s steps, one per second of the monitor's clock
            hooks.phase(Phase.OPTIMIZER)  # where the trainer is when its step ends
            hooks.after_step(metrics_of(step))
            beat.publish_now()
            assert monitor.observe(read_heartbeats(redis_client, "hooks", 0, range(1)), now=step) == []
        learned = monitor.hang_timeout_s(0)
        assert learned < 10  # step-sized: a save this long would be a hang if judged by it

        hooks.phase(Phase.OPTIMIZER)
        stepping = threading.Thread(target=hooks.after_step, args=(metrics_of(4),))
        stepping.start()
        assert save.saving.wait(timeout=30)
        beats = wait_for_phase(redis_client, Phase.CHECKPOINT)
        assert beats[0].step == 4
        # Far past the learned timeout, inside the hard ceiling: the save is no hang...
        assert monitor.observe(beats, now=4 + 10 * learned) == []
        assert monitor.hang_timeout_s(0) == HEALTH.hang_timeout_s
        # ...while the same stall in a step phase would be one (so this test can fail).
        control = HealthMonitor(1, HEALTH, started_at=0.0)
        for step in range(1, 5):
            control.observe({0: replace(beats[0], step=step, phase=str(Phase.OPTIMIZER))}, now=step)
        stalled = {0: replace(beats[0], phase=str(Phase.OPTIMIZER))}
        assert [f.kind for f in control.observe(stalled, now=4 + 10 * learned)] == [FaultKind.HANG]

        save.release.set()
        stepping.join(timeout=30)
        assert not stepping.is_alive()
    finally:
        save.release.set()
        beat.stop()
        metrics.close()


class DeferredCopy:
    """A checkpointer whose save returned at once and whose copy, overlapping the next step, the
    update waits for until the test releases it (the CPU path since issue 39)."""

    def __init__(self):
        self.copying = True
        self.waiting, self.release = threading.Event(), threading.Event()

    def due(self, step: int) -> bool:
        return False

    def before_update(self) -> None:
        self.waiting.set()
        assert self.release.wait(timeout=60), "the test never released the copy"
        self.copying = False


def test_the_update_waiting_for_a_saves_copy_is_in_the_checkpoint_phase(redis_client):
    """The hour soak at 512 MB: a save's copy ran beside the next step on 2 busy cores and the
    update waited for it longer than the learned hang timeout, in phase 'optimizer', where it
    was declared a hang. The wait is the save's: the heartbeat says 'checkpoint' while it lasts
    (judged by the ceiling), then the update goes on in 'optimizer'."""
    beat = HeartbeatPublisher(redis_client, "hooks", 0, 0, HEALTH.heartbeat_interval_s,
                              HEALTH.heartbeat_timeout_s).start()
    metrics = WorkerMetrics("hooks", 0)
    copy = DeferredCopy()
    hooks = StepHooks(beat, metrics, checkpointer=copy)
    hooks.trainer = NoTrainer()
    try:
        hooks.phase(Phase.OPTIMIZER)  # the trainer enters the update, then calls before_update
        updating = threading.Thread(target=hooks.before_update)
        updating.start()
        assert copy.waiting.wait(timeout=30)
        assert wait_for_phase(redis_client, Phase.CHECKPOINT)[0].phase == Phase.CHECKPOINT
        copy.release.set()
        updating.join(timeout=30)
        assert not updating.is_alive()
        beat.publish_now()
        assert read_heartbeats(redis_client, "hooks", 0, range(1))[0].phase == Phase.OPTIMIZER
        hooks.before_update()  # nothing copying: the phase is left alone
        assert hooks._phase == Phase.OPTIMIZER
    finally:
        copy.release.set()
        beat.stop()
        metrics.close()


def test_the_first_step_publishes_the_state_each_rank_holds_under_its_layout(redis_client):
    beat = HeartbeatPublisher(redis_client, "hooks-state", 0, 0, HEALTH.heartbeat_interval_s,
                              HEALTH.heartbeat_timeout_s).start()
    metrics = WorkerMetrics("hooks-state", 0)
    hooks = StepHooks(beat, metrics)
    hooks.trainer = NoTrainer()
    try:
        hooks.after_step(metrics_of(1))
        value = metrics.registry.get_sample_value(
            "longrun_train_state_bytes", {"job": "hooks-state", "attempt": "0", "rank": "0", "node": "",
                                          "node_id": "", "kind": "parameters", "layout": "single"})
        assert value == 1024
    finally:
        beat.stop()
        metrics.close()
