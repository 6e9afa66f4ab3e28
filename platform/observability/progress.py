"""The job's one progress line per step, printed by the driver, not by every rank.

Ranks used to print their own line each step through Ray's log forwarding, which folds identical
lines ("[repeated 28x across cluster]") and prints 64 lines a step at 64 ranks. The lowest rank's
step record (its metrics ride on the step ledger, goodput/ledger.py) is the job's progress; the
controller formats it here and hands it to the same writer as its state lines, so the user sees
one ordered stream:

    state RUNNING: training
    step 10/60  loss 4.1234  grad_norm 1.23  lr 3.0e-04  tok/s 12,345  mem 0.65GiB  eta 0:00:30
      layout fsdp2  attempt 0   (one line)

Torch-free: the controller imports it (the trainer's standalone ProgressPrinter shares `format_step`).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Mapping
from datetime import timedelta
from typing import Any


def hms(seconds: float) -> str:
    return str(timedelta(seconds=round(max(seconds, 0.0))))


def format_step(m: Mapping[str, Any], total_steps: int, *, eta_s: float | None = None,
                elapsed_s: float | None = None, layout: str | None = None,
                attempt: int | None = None) -> str:
    """`step 12/100  loss 4.1234  [val_loss 4.3210]  grad_norm 1.23  lr 3.0e-04  tok/s 12,345  mfu 41.0%
    mem 0.65GiB  [elapsed 0:00:05]  eta 0:00:30  [layout]  [attempt N]`, from a step's metrics by name."""
    parts = [f"step {m['step']}/{total_steps}", f"loss {m['loss']:.4f}"]
    if m.get("val_loss") is not None:  # a validation pass followed this step
        parts.append(f"val_loss {m['val_loss']:.4f}")
    parts += [f"grad_norm {m['grad_norm']:.2f}", f"lr {m['lr']:.1e}", f"tok/s {m['tokens_per_s']:,.0f}"]
    if m.get("mfu") is not None:
        parts.append(f"mfu {100 * m['mfu']:.1f}%")
    if m.get("memory_bytes") is not None:
        parts.append(f"mem {m['memory_bytes'] / 2**30:.2f}GiB")
    if elapsed_s is not None:
        parts.append(f"elapsed {hms(elapsed_s)}")
    if eta_s is not None:
        parts.append(f"eta {hms(eta_s)}")
    if layout:
        parts.append(f"layout {layout}")
    if attempt is not None:
        parts.append(f"attempt {attempt}")
    return "  ".join(parts)


class StepLine(str):
    """A progress line that also carries its numbers, for a live display (a plain `str` to
    every other writer)."""

    step: int
    total: int
    loss: float
    eta_s: float
    attempt: int

    def __new__(cls, text: str, *, step: int, total: int, loss: float, eta_s: float, attempt: int):
        line = super().__new__(cls, text)
        line.step, line.total, line.loss, line.eta_s, line.attempt = step, total, loss, eta_s, attempt
        return line


class ProgressDisplay:
    """Turns the lowest rank's step records into progress lines: every `every` steps and the
    last; a step redone after a fault is printed again (it is news: the job is catching up),
    marked by its attempt. The eta comes from the wall seconds of the last `window` records
    (checkpoints and data waits included: what the remaining steps will really take)."""

    def __init__(self, total_steps: int, write: Callable[[str], None], *, every: int = 1,
                 window: int = 50, clock: Callable[[], float] = time.time):
        self.total_steps, self.write, self.every, self.clock = total_steps, write, every, clock
        self._recent: deque[float] = deque(maxlen=window)
        self.layout: str | None = None
        self.printed = 0

    def steps(self, attempt: int, records: list[Mapping[str, Any]]) -> None:
        for r in records:
            self._recent.append(max(float(r.get("seconds", 0.0)), 0.0))
            metrics = r.get("metrics")
            step = int(r["step"])
            if metrics is None or not (step % self.every == 0 or step >= self.total_steps):
                continue  # a skipped step's data trained nothing: no metrics to show
            eta = sum(self._recent) / len(self._recent) * max(self.total_steps - step, 0)
            text = format_step({"step": step, **metrics}, self.total_steps, layout=self.layout, eta_s=eta,
                               attempt=attempt)
            self.write(StepLine(text, step=step, total=self.total_steps, loss=metrics["loss"], eta_s=eta,
                                attempt=attempt))
            self.printed += 1
