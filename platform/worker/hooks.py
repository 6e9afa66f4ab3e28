"""What happens around a training step: one object the trainer calls at fixed points.

    hooks = StepHooks(beat, metrics, checkpointer, injector)
    hooks.attach(trainer)          # trainer.on_phase -> hooks.phase, before_update -> hooks.before_update
    trainer.train(on_step=hooks.after_step)

The trainer owns the step and knows nothing of Redis, Prometheus or Ray; this object owns
everything around it, in the order it happens:

    phase(name)        each part of the step: into the heartbeat (a hang report says where the
                       rank was) and, when it ends, into the phase histogram
    before_update()    a checkpoint's or snapshot's copy still in flight finishes before the
                       weights change (in phase "checkpoint" while it does: the copy is the
                       save's, and on a busy host it can outlast the step times the learned
                       hang timeout is made of)
    after_step(m)      metrics (after the first step also the training state this rank holds,
                       by kind and layout), heartbeat progress, a checkpoint when one is due (in phase
                       "checkpoint", so a long blocking save is judged by the hard ceiling, not
                       the step-sized hang timeout), a peer memory snapshot when one is due,
                       injected faults, then a stop request: at the
                       step every rank agreed on, save now, wait for the commit and raise
                       `Preempted` (preemption.py)
    after_skipped_step(n)  a step whose data the policy skipped: heartbeat progress and
                       everything due at it as above, without training metrics

Once what is due after a step (checkpoint, snapshot) is done, and before injected faults or a
stop, the step goes into the step ledger (goodput/ledger.py) with the seconds this step spent
blocked on the data, a checkpoint and a snapshot: synchronously, so a rank that dies next has
its last step on record (heartbeats are sent on a timer and can miss it).

Built in the spirit of torchft's Manager: a small surface the training loop calls, rather
than closures threaded through it.
"""

from __future__ import annotations

import math
import time
from typing import TYPE_CHECKING

from longrun.health.faults import FaultInjector
from longrun.health.heartbeat import HeartbeatPublisher
from longrun.kinds import Phase
from longrun.observability.metrics import WorkerMetrics
from longrun.worker.preemption import Preempted, PreemptionWatch

if TYPE_CHECKING:
    from longrun.checkpoint import Checkpointer
    from longrun.checkpoint.memory import MemorySnapshots
    from longrun.checkpoint.writer import SaveResult
    from longrun.goodput.ledger import StepLedger
    from longrun.trainer import StepMetrics, Trainer


class StepHooks:
    def __init__(self, beat: HeartbeatPublisher, metrics: WorkerMetrics,
                 checkpointer: Checkpointer | None = None, faults: FaultInjector | None = None,
                 preemption: PreemptionWatch | None = None):
        self.beat, self.metrics = beat, metrics
        self.checkpointer, self.faults, self.preemption = checkpointer, faults, preemption
        self.snapshots: MemorySnapshots | None = None  # peer memory snapshots, when on
        self.trainer: Trainer | None = None
        self.last: StepMetrics | None = None
        self._phase: str | None = None
        self._phase_since = 0.0
        self.ledger: StepLedger | None = None  # the step ledger, for goodput
        # This step's seconds blocked on the data, a checkpoint and a snapshot (for the ledger).
        self._blocked = dict.fromkeys(("data_s", "checkpoint_s", "snapshot_s"), 0.0)
        self._validation_s = 0.0  # ... and on the validation pass after it, when one ran
        self._restore: tuple[int | None, str, float, int | None] | None = None  # until training begins

    def attach(self, trainer: Trainer) -> StepHooks:
        self.trainer = trainer
        trainer.on_phase = self.phase
        trainer.on_skip = self.after_skipped_step
        trainer.before_update.append(self.before_update)
        return self

    # -- the fixed points of a step ------------------------------------------------------------
    def phase(self, name: str) -> None:
        """The rank enters phase `name`; the one it leaves is timed into the histogram."""
        now = time.perf_counter()
        if self._phase is not None:
            self.metrics.observe_phase(self._phase, now - self._phase_since)
            if self._phase in (Phase.DATA, Phase.PLAN):  # waiting for the next (planned) global batch
                self._blocked["data_s"] += now - self._phase_since
        self._phase, self._phase_since = name, now
        self.beat.update(phase=name)

    def before_update(self) -> None:
        copying = any(getattr(c, "copying", False) for c in (self.checkpointer, self.snapshots))
        if copying:
            self.phase(Phase.CHECKPOINT)  # judged by the hang ceiling, as the save itself is
        if self.checkpointer is not None:
            self._blocked["checkpoint_s"] += _timed(self.checkpointer.before_update)
        if self.snapshots is not None:
            self._blocked["snapshot_s"] += _timed(self.snapshots.before_update)
        if copying:
            self.phase(Phase.OPTIMIZER)

    def after_step(self, m: StepMetrics) -> None:
        first = self.last is None
        self.last = m
        self.metrics.observe_step(m)
        # The validation pass the trainer ran after this step (a test double may not say).
        self._validation_s = getattr(m, "validation_s", 0.0)
        if first and self.trainer is not None:  # the optimizer's state exists from the first step
            self.metrics.observe_state(self.trainer.layout, self.trainer.state_bytes())
        plan = self.trainer.last_plan if self.trainer is not None else None
        if plan is not None:
            sizes = [g.cp for mb in plan.micro_batches for g in mb.groups if g.sequences]
            self.metrics.observe_cp_plan(sizes, plan.predicted_s, m.step_time_s)
        finite = math.isfinite(m.loss)
        # The step's data cost in the trainer's cost model: the straggler attribution tells a
        # rank slowed by its data from one slowed by its node (a test double may not have it).
        cost = getattr(self.trainer, "last_work_cost", None)
        self.beat.update(step=m.step, loss=m.loss if finite else None, loss_finite=finite,
                         step_time_s=m.step_time_s, tokens_per_s=m.tokens_per_s,
                         memory_bytes=m.memory_bytes, work_cost=cost, stepped_at=time.time())
        if self.snapshots is not None:  # what the `auto` snapshot interval is measured against
            self.snapshots.observe_step(m.step_time_s)
        self._step_done(m.step, m.report())

    def after_skipped_step(self, step: int) -> None:
        """A step whose data the policy skipped: no training metrics (nothing was trained),
        but the heartbeat moves on and whatever is due at `step` still happens (a checkpoint
        due inside the window, the last step's included, is written)."""
        self.beat.update(step=step)
        self._step_done(step)

    def _step_done(self, step: int, metrics: dict | None = None) -> None:
        """What is due once `step` is done, trained (with its `metrics`) or skipped."""
        self._blocked["checkpoint_s"] += _timed(self.checkpoint_if_due, step)
        if self.snapshots is not None and self.snapshots.due(step):
            # a host copy; sent to the keepers in the background
            self._blocked["snapshot_s"] += _timed(self.snapshots.take, self.trainer)
        if self.ledger is not None:
            snaps = self.snapshots
            if metrics is not None and snaps is not None and snaps.enabled and snaps.decided:
                # The interval the ranks chose (`auto`): the driver says so when it changes.
                metrics = metrics | {"snapshot_every": snaps.every}
            validated = {"validation_s": self._validation_s} if self._validation_s else {}
            self.ledger.step(step, **self._blocked, **validated, metrics=metrics)
        self._blocked = dict.fromkeys(self._blocked, 0.0)
        self._validation_s = 0.0
        if self.faults is not None:
            if self.snapshots is not None and self.faults.pending and self.faults.pending[0].step <= step:
                # A fault may poison the weights ('nan'): the snapshot's copy of this step,
                # which runs beside the next step, must be done before it does.
                self.snapshots.before_update()
            self.faults.after_step(step)
        if self.preemption is not None and self.preemption.stop_after(step):
            self.phase(Phase.CHECKPOINT)
            if self.checkpointer is not None:
                self.checkpointer.save_now(self.trainer)
            raise Preempted(step)

    def checkpoint_if_due(self, step: int) -> None:
        """Save `step` when a checkpoint is due at it (its writing goes on in the background)."""
        ckpt = self.checkpointer
        if ckpt is None or not ckpt.due(step):
            return
        self.phase(Phase.CHECKPOINT)
        blocking_s = ckpt.save(self.trainer)
        if blocking_s is not None:
            self.metrics.observe_checkpoint(blocking_s=blocking_s)

    # -- around the steps ----------------------------------------------------------------------
    def saved(self, result: SaveResult) -> None:
        """The writer thread finished a save (committed or not)."""
        self.metrics.observe_checkpoint(write_s=result.write_s)
        if result.committed and result.error is None:
            self.metrics.checkpoint_committed(result.step, time.time())

    def restored(self, step: int | None, committed_at: float, *, source: str, seconds: float) -> None:
        """The attempt's restore: from `source`, `step` (None: nothing to resume from). It goes
        on the step ledger when training begins (`begin_training`): what comes between (the
        initial weights when nothing was restored, CP's calibration) is start-up, not a step."""
        self.metrics.observe_restore(source, seconds)
        nbytes = self._restored_bytes() if step is not None else None
        self._restore = (step, "none" if step is None else source, seconds, nbytes)
        if step is None:
            return
        if source == "storage":  # a memory snapshot is no committed checkpoint: the age alert stays true
            self.metrics.checkpoint_committed(step, committed_at)
        self.beat.update(step=step, resumed_from=step)

    def begin_training(self) -> None:
        """Training begins now: the restore goes on the step ledger, dated now (goodput counts
        the time before it, less the restore's own seconds, as start-up)."""
        if self.ledger is None or self._restore is None:
            return
        step, source, seconds, nbytes = self._restore
        self.ledger.restored(step, source, seconds, **({"nbytes": nbytes} if nbytes else {}))
        self._blocked = dict.fromkeys(self._blocked, 0.0)

    def _restored_bytes(self) -> int | None:
        """The parameters and optimizer state this rank holds (what a restore read): with the
        restore's seconds, the storage rate the next attempt's restore deadline is sized by."""
        held = getattr(self.trainer, "state_bytes", None)  # a test double may not have it
        if held is None:
            return None
        state = held()
        return int(state.get("parameters", 0) + state.get("optimizer", 0)) or None


def _timed(call, *args) -> float:
    """Seconds `call(*args)` took."""
    started = time.perf_counter()
    call(*args)
    return time.perf_counter() - started
