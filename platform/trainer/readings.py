"""A step's numbers, read from the device one step late.

    readings = StepReadings.capture(loss, grad_norm, bad, timer)   # queued: no waiting
    ...                                                             # the next step is queued
    loss, grad_norm, bad, seconds = readings.read()                 # done by now: no stall

Reading a value the GPU computes (`.item()`, `float()`) makes the host wait until the GPU has
run everything queued before it, and the GPU then idles while the host catches up: issue 40's
eager step made six such synchronisations (the loss, the gradient norm, a synchronise to time
the step). Now the step copies its loss, gradient norm and non-finite flag into pinned host
memory with a non-blocking copy and records an event; the trainer reads them once the next
step's forward and backward are queued (`Trainer.train`), when the event has long passed or
the GPU still has a whole step of work queued behind it. The step's time is the GPU's, between
two events around it. On the CPU everything has already run: reading costs nothing.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass
class StepTimer:
    """A step's wall time: CUDA events around it on the GPU (the device's timeline, idle gaps
    included), the host clock elsewhere. `pause_s`: host time inside the step spent on other
    work (the previous step's hooks), left out of the host-clock figure."""

    started: float
    start: torch.cuda.Event | None = None
    end: torch.cuda.Event | None = None
    ended: float | None = None
    pause_s: float = 0.0

    @classmethod
    def begin(cls, device: torch.device) -> StepTimer:
        timer = cls(time.perf_counter())
        if device.type == "cuda":
            timer.start = torch.cuda.Event(enable_timing=True)
            timer.start.record()
        return timer

    def stop(self) -> None:
        self.ended = time.perf_counter()
        if self.start is not None:
            self.end = torch.cuda.Event(enable_timing=True)
            self.end.record()

    def seconds(self) -> float:
        """The step's time (on CUDA: once the end event has passed, see `StepReadings.read`)."""
        if self.start is not None and self.end is not None:
            return self.start.elapsed_time(self.end) / 1e3
        assert self.ended is not None, "the step has not stopped its timer"
        return self.ended - self.started - self.pause_s


@dataclass
class StepReadings:
    """The loss, gradient norm and non-finite flag of one step, on their way to the host."""

    values: Tensor  # float32 [3] on the host: loss, grad norm, non-finite flag
    copied: torch.cuda.Event | None  # when the copy into `values` is done (None: it is)
    timer: StepTimer

    @classmethod
    def capture(cls, loss: Tensor, grad_norm: Tensor, bad: Tensor, timer: StepTimer) -> StepReadings:
        on_device = torch.stack((loss.detach().float(), grad_norm.detach().float().to(loss.device),
                                 bad.float()))
        if on_device.device.type != "cuda":
            return cls(on_device, None, timer)
        host = torch.empty(3, dtype=torch.float32, pin_memory=True)
        host.copy_(on_device, non_blocking=True)
        copied = torch.cuda.Event()
        copied.record()
        return cls(host, copied, timer)

    def ready(self) -> bool:
        """Whether `read` would return without waiting for the device."""
        done = self.copied is None or self.copied.query()
        return done and (self.timer.end is None or self.timer.end.query())

    def read(self) -> tuple[float, float, bool, float]:
        """(loss, grad norm, non-finite, step seconds); waits for the step's end if needed."""
        if self.copied is not None:
            self.copied.synchronize()
        if self.timer.end is not None:
            self.timer.end.synchronize()
        loss, grad_norm, bad = self.values.tolist()
        return loss, grad_norm, bool(bad), self.timer.seconds()

    def stream_after(self) -> torch.cuda.Stream | None:
        """On CUDA, a side stream that has seen this step's kernels and none queued after them
        (the next step's forward and backward), for work that belongs between the two steps;
        None elsewhere."""
        if self.timer.end is None:
            return None
        stream = torch.cuda.Stream()
        stream.wait_event(self.timer.end)
        return stream
