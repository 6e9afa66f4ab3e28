"""StepHooks and the step ledger: each step goes on record before injected faults fire (so a rank
killed right after a step has it on record), with the seconds it was blocked on the data, a
checkpoint and a snapshot. Doubles only: the ledger's Redis side is in test_goodput_ledger.py."""

from __future__ import annotations

import pytest

from longrun.kinds import Phase
from longrun.observability.metrics import WorkerMetrics
from longrun.trainer import StepMetrics
from longrun.worker import hooks as hooks_module
from longrun.worker.hooks import StepHooks


class Counter:
    """perf_counter, advanced by the test and by the doubles' "work"."""

    def __init__(self):
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


class Beat:
    def update(self, **fields) -> None: ...


class Ledger:
    def __init__(self):
        self.calls: list[tuple] = []
        self.metrics = []

    def restored(self, step, source, seconds) -> None:
        self.calls.append(("restored", step, source, seconds))

    def step(self, step, metrics=None, **blocked) -> None:
        self.calls.append(("step", step, {k: round(v, 6) for k, v in blocked.items()}))
        self.metrics.append(metrics)

    metrics: list  # what each step record carries for the driver's progress line


class Save:
    def __init__(self, counter: Counter):
        self.counter = counter

    def due(self, step: int) -> bool:
        return step == 2

    def save(self, trainer) -> float:
        self.counter.t += 0.3  # a blocking host copy
        return 0.3

    def before_update(self) -> None:
        self.counter.t += 0.05  # the previous copy finishing before the weights change


class Faults:
    def __init__(self, ledger: Ledger):
        self.ledger, self.seen = ledger, []

    def after_step(self, step: int) -> None:
        self.seen.append((step, self.ledger.calls[-1][:2]))


class NoTrainer:
    last_plan = None
    layout = "single"

    def state_bytes(self) -> dict[str, int]:
        return {"parameters": 1}


def metrics_of(step: int) -> StepMetrics:
    return StepMetrics(step=step, loss=2.0, grad_norm=1.0, lr=1e-3, tokens=64, tokens_per_s=640.0,
                       step_time_s=0.1, data_wait_s=0.0, mfu=None, memory_bytes=0)


def test_each_step_is_on_the_ledger_before_faults_fire_with_its_blocked_seconds(monkeypatch):
    counter = Counter()
    monkeypatch.setattr(hooks_module.time, "perf_counter", counter)
    ledger = Ledger()
    faults = Faults(ledger)
    hooks = StepHooks(Beat(), WorkerMetrics("gp", 0), checkpointer=Save(counter), faults=faults)
    hooks.ledger, hooks.trainer = ledger, NoTrainer()
    hooks.restored(None, 0.0, source="storage", seconds=0.5)
    assert ledger.calls == []  # the initial weights (or CP's calibration) come before training
    hooks.begin_training()
    assert ledger.calls == [("restored", None, "none", 0.5)]  # nothing restored: source "none"
    for step in (1, 2):
        hooks.phase(Phase.DATA)
        counter.t += 0.2  # waiting for the batch
        hooks.phase(Phase.FORWARD)
        counter.t += 1.0
        hooks.before_update()
        hooks.after_step(metrics_of(step))
    assert ledger.calls[1:] == [
        ("step", 1, {"data_s": 0.2, "checkpoint_s": 0.05, "snapshot_s": 0.0}),
        ("step", 2, {"data_s": 0.2, "checkpoint_s": 0.35, "snapshot_s": 0.0}),  # the save at step 2
    ]
    assert faults.seen == [(1, ("step", 1)), (2, ("step", 2))]
    # Each trained step's metrics ride on its record: the driver's progress line comes from them.
    assert [m["loss"] for m in ledger.metrics] == [2.0, 2.0] and ledger.metrics[0]["tokens"] == 64


def test_a_skipped_step_goes_on_the_ledger_too():
    ledger = Ledger()
    hooks = StepHooks(Beat(), WorkerMetrics("gp", 0))
    hooks.ledger = ledger
    hooks.after_skipped_step(7)
    assert [c[:2] for c in ledger.calls] == [("step", 7)]
    assert ledger.metrics == [None]  # nothing trained: no metrics to show
    assert ledger.calls[0][2]["checkpoint_s"] == pytest.approx(0.0, abs=1e-3)
