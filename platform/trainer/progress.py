"""What a step reports: `StepMetrics`, and the one-line-per-step printer of a trainer run on its
own (in a job, ranks print no step lines: the driver shows the job's, observability/progress.py)."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

from longrun.observability.progress import format_step


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
    # The global batch's tokens (loss tokens, every rank of the span together) and their rate:
    # the job's throughput, which the driver's progress line shows. 0: not known.
    global_tokens: int = 0
    global_tokens_per_s: float = 0.0
    # torch.compile's recompilations in this process so far (training.compile; 0 when eager):
    # after the first step a steady job adds none.
    recompiles: int = 0
    # The validation pass after this step (validation.interval_steps): its mean token loss on
    # the held-out data, None when none was due; and its seconds (a goodput bucket of their own).
    val_loss: float | None = None
    validation_s: float = 0.0

    def report(self) -> dict[str, float | int | None]:
        """What the driver shows of this step (rides on the step ledger to the controller):
        the job's tokens and rate where known, this rank's otherwise."""
        out = asdict(self)
        del out["step"], out["global_tokens"], out["global_tokens_per_s"], out["recompiles"]
        del out["validation_s"]  # on the step record itself (goodput), not among its metrics
        if self.val_loss is None:
            del out["val_loss"]
        if self.global_tokens:
            out["tokens"], out["tokens_per_s"] = self.global_tokens, self.global_tokens_per_s
        return out


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
        return format_step(asdict(m), self.total_steps, elapsed_s=elapsed_s, eta_s=eta, layout=self.layout)
