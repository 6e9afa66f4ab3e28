"""Fault injection: the faults fault tolerance is proven against, fired for real.

Configured in `health.faults` (off unless listed): on `rank`, once it has completed `step`
optimizer steps in attempt `attempt`, do `kind`:

- kill   SIGKILL this process: no cleanup, no last heartbeat (a crashed host or an OOM kill);
- hang   SIGSTOP this process: every thread freezes, heartbeats included (a wedged driver);
- raise  raise `InjectedFault` from the training loop (a software error);
- nan    poison one weight with NaN, so the next step's loss is NaN (silent data corruption);
- slow   sleep `seconds` after every step from then on (a straggler: thermal throttling, a
         slow link); with `in_step`, inside every step instead, before the optimizer update
         (`before_update`): the time a larger model's compute takes, which the step's snapshot
         copy overlaps and a fault from outside lands in (bench/soak.py's pacing);
- hold   wait, in phase "held", until `release_file` exists: a breakpoint an outside observer
         releases (a test holds every rank at one step until Prometheus has scraped it). The
         monitor judges a held rank by the hard hang ceiling, like a checkpoint;
- fail_save  this rank's next checkpoint save fails with ENOSPC in its writer (a full disk),
         after `step`: armed at step N, the save of the next step due fails.

Each fault fires in one attempt only, so the restart it causes does not fire it again. Removing
a whole node is done from outside (the test removes the Ray node).
"""

from __future__ import annotations

import logging
import os
import signal
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from longrun.config.sections import FaultSpec

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)
HOLD_POLL_S = 0.05


class InjectedFault(RuntimeError):
    """Raised by a `raise` fault."""


class FaultInjector:
    """The faults of one rank in one attempt; `after_step` is the trainer's per-step hook."""

    def __init__(self, specs: Sequence[FaultSpec], rank: int, attempt: int,
                 model: torch.nn.Module | None = None,
                 on_fire: Callable[[FaultSpec, int], None] | None = None,
                 on_phase: Callable[[str], None] | None = None,
                 on_fail_save: Callable[[str], None] | None = None):
        self.pending = sorted((s for s in specs if s.rank == rank and s.attempt == attempt),
                              key=lambda s: s.step)
        self.rank, self.attempt, self.model = rank, attempt, model
        # Told (spec, step) just before a fault fires: the worker records it in the job's event
        # log, so detection latency can be measured from the moment of the fault itself.
        self.on_fire = on_fire
        self.on_phase = on_phase or (lambda phase: None)  # the heartbeat's phase, for 'hold'
        self.on_fail_save = on_fail_save  # arms the checkpoint writer, for 'fail_save'
        self.slow_s = 0.0
        self.slow_in_step = False

    def __bool__(self) -> bool:
        return bool(self.pending) or self.slow_s > 0

    def after_step(self, step: int) -> None:
        """Call with the number of steps completed; fires what is due."""
        while self.pending and self.pending[0].step <= step:
            self._fire(self.pending.pop(0), step)
        if self.slow_s and not self.slow_in_step:
            time.sleep(self.slow_s)

    def before_update(self) -> None:
        """The trainer's hook before each optimizer update: an `in_step` slow fault's time."""
        if self.slow_s and self.slow_in_step:
            time.sleep(self.slow_s)

    def _fire(self, spec: FaultSpec, step: int) -> None:
        # Logged and flushed first: the kill and stop faults leave no other trace in the log.
        log.warning("injecting fault %s on rank %d at step %d (attempt %d)", spec.kind, self.rank,
                    step, self.attempt)
        for handler in logging.getLogger().handlers:
            handler.flush()
        if self.on_fire is not None:
            self.on_fire(spec, step)
        if spec.kind == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        elif spec.kind == "hang":
            os.kill(os.getpid(), signal.SIGSTOP)
        elif spec.kind == "raise":
            raise InjectedFault(f"injected fault on rank {self.rank} at step {step}")
        elif spec.kind == "nan":
            if self.model is None:
                raise ValueError("a 'nan' fault needs the model to poison")
            import torch
            from torch.distributed.tensor import DTensor

            with torch.no_grad():  # this rank's own piece of a sharded (DTensor) weight
                held = (p.to_local() if isinstance(p, DTensor) else p for p in self.model.parameters())
                next(t for t in held if t.numel() > 0).view(-1)[0] = float("nan")
        elif spec.kind == "slow":
            self.slow_s, self.slow_in_step = spec.seconds, spec.in_step
        elif spec.kind == "hold":
            self._hold(spec.release_file)
        elif spec.kind == "fail_save":
            if self.on_fail_save is None:
                raise ValueError("a 'fail_save' fault needs the checkpoint writer to arm")
            self.on_fail_save(f"injected fault on rank {self.rank} after step {step}")
        else:  # the config's Literal makes this unreachable; a new kind must be handled here
            raise ValueError(f"unknown fault kind {spec.kind!r}")

    def _hold(self, release_file: str) -> None:
        self.on_phase("held")
        # The release comes from another process through the file system, which offers no
        # portable notification: poll its existence.
        while not os.path.exists(release_file):
            time.sleep(HOLD_POLL_S)
        log.warning("rank %d released from its hold by %s", self.rank, release_file)
