"""What the job's user looks at, fed by the controller's listeners: the one progress line per
step, the journal beside the checkpoints (for `longrun report`), TensorBoard, Weights & Biases.

All three hear the lowest rank's step records as the goodput tracker reads them from the step
ledger (the ground truth: heartbeats are sampled on a timer and skip steps), and the
controller's moves and events. None of them may stop the job: a failure to write is logged.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import asdict
from typing import Any

from longrun.config import JobConfig
from longrun.controller.attempt import Attempt
from longrun.controller.listeners import Listener, fault_extra, node_names_of, resumed_message
from longrun.controller.rank_logs import rank_log_path
from longrun.controller.state import Transition
from longrun.goodput.accounting import StepRecord
from longrun.goodput.tracker import GoodputTracker
from longrun.health.policy import Incident
from longrun.observability.journal import JournalWriter, newest_trained_step
from longrun.observability.progress import ProgressDisplay
from longrun.observability.tensorboard import TensorBoardWriter
from longrun.observability.wandb_log import WandbRun

log = logging.getLogger(__name__)


def _flat(record: StepRecord) -> dict[str, Any]:
    """A step record as one flat journal line: the ledger's fields and the step's metrics."""
    out = asdict(record)
    metrics = out.pop("metrics") or {}
    return out | metrics


class ProgressLines(Listener):
    """The job's progress line, every training.log_every steps, to the controller's writer (the
    same one as its state lines, so the user reads them in order)."""

    def __init__(self, cfg: JobConfig, write: Callable[[str], None], layout: Callable[[], str]):
        self.display = ProgressDisplay(cfg.training.steps, write, every=cfg.training.log_every)
        self.layout = layout  # the running attempt's layout (an elastic job's changes)

    def moved(self, move: Transition, attempt: Attempt) -> None:
        self.display.layout = self.layout()

    def steps(self, attempt: int, records: list[StepRecord]) -> None:
        self.display.steps(attempt, [asdict(r) for r in records])


class SnapshotInterval(Listener):
    """A line when the ranks choose the interval of their memory snapshots, or change it
    (`checkpoint.memory_interval_steps: auto`: it rides on the lowest rank's step records)."""

    def __init__(self, write: Callable[[str], None]):
        self.write, self.every = write, None

    def steps(self, attempt: int, records: list[StepRecord]) -> None:
        for r in records:
            every = (r.metrics or {}).get("snapshot_every")
            if every is not None and every != self.every:
                self.write(f"memory snapshots every {every} step(s) from step {r.step}: the smallest "
                           "interval whose send fits in its steps' compute (auto)")
                self.every = every


class JournalListener(Listener):
    """Every move, event, step record and the goodput summary into the job's journal."""

    def __init__(self, journal: JournalWriter, goodput: GoodputTracker | None, run_dir: str):
        self.journal, self.goodput, self.run_dir = journal, goodput, run_dir

    def moved(self, move: Transition, attempt: Attempt) -> None:
        self.journal.event({"type": "transition", "from": move.source, "to": move.target,
                            "reason": move.reason, "attempt": attempt.number, "at": move.at})
        if self.goodput is not None:
            self.journal.goodput(asdict(self.goodput.summary()))

    def event(self, kind: str, attempt: Attempt, message: str, extra: dict[str, Any]) -> None:
        self._event(kind, attempt.number, message, extra)

    def declared(self, attempt: Attempt, incidents: list[Incident], wall: float) -> None:
        for i in incidents:
            path = rank_log_path(self.run_dir, attempt.number, i.rank) if i.rank is not None else None
            extra = fault_extra(i, path, node_names_of(attempt))
            self._event("fault", attempt.number, i.detail, extra, at=wall)

    def resumed(self, attempt: int, step: int | None, source: str, seconds: float) -> None:
        if step is not None:
            self._event("resumed", attempt, resumed_message(step, source, seconds),
                        {"step": step, "source": source, "seconds": round(seconds, 3)})

    def steps(self, attempt: int, records: list[StepRecord]) -> None:
        self.journal.steps(attempt, [_flat(r) for r in records])

    def ended(self, attempt: Attempt) -> None:
        if self.goodput is not None:
            self.journal.goodput(asdict(self.goodput.summary()))

    def _event(self, kind: str, attempt: int, message: str, extra: dict[str, Any],
               at: float | None = None) -> None:
        self.journal.event({"type": kind, "attempt": attempt, "reason": message,
                            "at": time.time() if at is None else at, **extra})


class TensorBoardListener(Listener):
    """Step scalars and the job's events as text, into <output_dir>/<job>/tb/."""

    def __init__(self, writer: TensorBoardWriter):
        self.writer = writer

    def moved(self, move: Transition, attempt: Attempt) -> None:
        self.writer.event(f"attempt {attempt.number}: state {move.target}: {move.reason}", move.at)
        if move.target.terminal:
            self.writer.close()  # flushed: the job is over
        else:
            self.writer.flush()

    def event(self, kind: str, attempt: Attempt, message: str, extra: dict[str, Any]) -> None:
        self.writer.event(f"attempt {attempt.number}: {kind}: {message}")

    def declared(self, attempt: Attempt, incidents: list[Incident], wall: float) -> None:
        for i in incidents:
            self.writer.event(f"attempt {attempt.number}: fault {i.kind} (rank {i.rank}): {i.detail}", wall)

    def resumed(self, attempt: int, step: int | None, source: str, seconds: float) -> None:
        if step is not None:
            self.writer.restored(seconds, source)

    def steps(self, attempt: int, records: list[StepRecord]) -> None:
        for r in records:
            self.writer.step(r.step, r.metrics, checkpoint_s=r.checkpoint_s, validation_s=r.validation_s,
                             wall=r.end)


class WandbListener(Listener):
    """Step metrics and events to Weights & Biases (observability.wandb)."""

    def __init__(self, run: WandbRun):
        self.run = run

    def moved(self, move: Transition, attempt: Attempt) -> None:
        if move.target.terminal:
            self.run.event(f"attempt {attempt.number}: state {move.target}: {move.reason}")
            self.run.close()

    def declared(self, attempt: Attempt, incidents: list[Incident], wall: float) -> None:
        for i in incidents:
            self.run.event(f"attempt {attempt.number}: fault {i.kind} (rank {i.rank}): {i.detail}")

    def steps(self, attempt: int, records: list[StepRecord]) -> None:
        for r in records:
            self.run.step(r.step, r.metrics)


def user_view_listeners(cfg: JobConfig, write: Callable[[str], None], layout: Callable[[], str],
                        goodput: GoodputTracker | None) -> list[Listener]:
    """The progress line, the journal, and TensorBoard and W&B where configured."""
    listeners: list[Listener] = [ProgressLines(cfg, write, layout),
                                 JournalListener(JournalWriter(cfg.run_dir), goodput, cfg.run_dir)]
    if cfg.checkpoint.memory_interval_steps in (None, "auto"):
        listeners.append(SnapshotInterval(write))
    # Read the journal once: the newest step a rerun's curves continue from.
    written = newest_trained_step(cfg.run_dir) if cfg.observability.tensorboard or \
        cfg.observability.wandb != "off" else 0
    if cfg.observability.tensorboard:
        try:
            listeners.append(TensorBoardListener(TensorBoardWriter(cfg.run_dir, written=written)))
        except (ImportError, OSError) as exc:  # the job trains without its curves
            log.warning("TensorBoard event files not written: %s", exc)
    if cfg.observability.wandb != "off":
        try:
            run = WandbRun(cfg.job.name, cfg.run_dir, cfg.observability.wandb, cfg.model_dump(mode="json"),
                           written=written)
            listeners.append(WandbListener(run))
        except ImportError:
            log.warning("observability.wandb is %s but the wandb package is not installed here; "
                        "`pip install wandb` on the controller's machine", cfg.observability.wandb)
        except Exception as exc:  # W&B's own errors: the job trains without it
            log.warning("Weights & Biases not started: %s", exc)
    return listeners
