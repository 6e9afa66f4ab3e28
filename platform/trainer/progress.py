"""What a step reports: `StepMetrics`, and the one-line-per-step progress printer."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta


@dataclass
class StepMetrics:
    step: int  # 1-based count of optimizer steps done
    loss: float  # mean token loss of the step
    grad_norm: float  # global norm before clipping
    lr: float  # learning rate this step used
    tokens: int  # input tokens in the step
    tokens_per_s: float
    step_time_s: float  # data wait included; tokens and tokens_per_s are this rank's
    data_wait_s: float  # time blocked on the data pipeline
    mfu: float | None  # model FLOPs utilisation; None without a peak FLOPs figure
    memory_bytes: int  # peak CUDA memory allocated this step, or the process's peak RSS on CPU


def _hms(seconds: float) -> str:
    return str(timedelta(seconds=round(max(seconds, 0.0))))


class ProgressPrinter:
    """One line per `every` steps (and the last), like torchtitan's:
    step 12/100  loss 4.1234  grad_norm 1.23  lr 3.0e-04  tok/s 12,345  elapsed 0:00:05  eta 0:00:30
    The eta extrapolates the mean step time of the steps this printer has seen; `layout` (the
    parallel layout's name, e.g. "fsdp2.tp2") ends the line when given."""

    def __init__(self, total_steps: int, every: int = 1,
                 write: Callable[[str], None] | None = None,
                 clock: Callable[[], float] = time.monotonic, layout: str | None = None):
        self.total_steps, self.every, self.clock = total_steps, every, clock
        self.layout = layout
        self.write = write or (lambda line: print(line, file=sys.stdout, flush=True))
        self._start: float | None = None
        self._first_step = 0

    def __call__(self, m: StepMetrics) -> None:
        now = self.clock()
        if self._start is None:  # count from the start of the first step seen
            self._start, self._first_step = now - m.step_time_s, m.step - 1
        if m.step % self.every == 0 or m.step >= self.total_steps:
            self.write(self.format(m, now - self._start))

    def format(self, m: StepMetrics, elapsed_s: float) -> str:
        done = max(m.step - self._first_step, 1)
        eta = elapsed_s / done * max(self.total_steps - m.step, 0)
        parts = [
            f"step {m.step}/{self.total_steps}", f"loss {m.loss:.4f}",
            f"grad_norm {m.grad_norm:.2f}", f"lr {m.lr:.1e}", f"tok/s {m.tokens_per_s:,.0f}",
        ]
        if m.mfu is not None:
            parts.append(f"mfu {100 * m.mfu:.1f}%")
        parts.append(f"mem {m.memory_bytes / 2**30:.2f}GiB")
        parts += [f"elapsed {_hms(elapsed_s)}", f"eta {_hms(eta)}"]
        if self.layout:
            parts.append(f"layout {self.layout}")
        return "  ".join(parts)
