"""`checkpoint.memory_interval_steps: auto`: how often a rank can snapshot without ever waiting.

    auto = AutoInterval()
    auto.observe_step(0.8); auto.observe_send(2.1)   # seconds, as they are measured
    auto.proposal()                                  # 4: a send fits in 4 steps, with headroom

A snapshot is sent in the background while training goes on; the next one is due `k` steps
later, and if the send is still running then, that snapshot is skipped (`memory.py`). The
interval is therefore the smallest `k` whose compute time covers a send:
`k * step_s >= send_s * HEADROOM`. The headroom keeps the ordinary jitter of both from turning
every other snapshot into a skip. `step_s` is the median of the last `WINDOW` steps (the first
step of an attempt, with its warm-up, does not set it for long); `send_s` is the slowest of the
last `SENDS` sends (each from the host copy to the keepers' receipt), so a proposal follows
sends that get slower at once. It goes down more reluctantly, with a dead band: a shorter
interval must cover the slowest of the last `SENDS_DOWN` sends with `DOWN_MARGIN` more headroom.
Without it, sends that straddle a boundary (1.8-3.4 s against 2.1 s steps in the hour soak) flip
the interval at every agreement (85 choices, mostly 2 <-> 3, in 23 attempts), and each step down
that the next slow send undoes costs a skipped snapshot. Every rank proposes its own; the job
takes the largest (`MemorySnapshots`' agreement), so the slowest rank's sends fit too. Pure: no
clock, no I/O.
"""

from __future__ import annotations

import math
import statistics
from collections import deque

HEADROOM = 1.25
WINDOW = 8  # steps
SENDS = 4  # an interval goes up on the slowest of these...
SENDS_DOWN = 12  # ...and down only when the slowest of these fits a shorter one
DOWN_MARGIN = 1.25  # with this much more headroom


def choose_interval(send_s: float, step_s: float, headroom: float = HEADROOM) -> int:
    """The smallest interval (steps, at least 1) whose compute time covers one send."""
    if step_s <= 0:
        return 1
    return max(1, math.ceil(send_s * headroom / step_s - 1e-9))


class AutoInterval:
    """One rank's measurements and the interval they call for."""

    def __init__(self, headroom: float = HEADROOM, window: int = WINDOW, sends: int = SENDS):
        self.headroom = headroom
        self._steps: deque[float] = deque(maxlen=window)
        self._sends: deque[float] = deque(maxlen=max(sends, SENDS_DOWN))
        self._recent = sends

    def observe_step(self, seconds: float) -> None:
        """One training step's wall time."""
        if seconds > 0 and math.isfinite(seconds):
            self._steps.append(seconds)

    def observe_send(self, seconds: float) -> None:
        """One snapshot's send, from its host copy to the keepers' receipt."""
        self._sends.append(seconds)

    @property
    def send_s(self) -> float | None:
        """The slowest of the recent sends: what an interval must cover."""
        return max(list(self._sends)[-self._recent:]) if self._sends else None

    @property
    def step_s(self) -> float | None:
        return statistics.median(self._steps) if self._steps else None

    def proposal(self, current: int | None = None) -> int:
        """The interval this rank's measurements call for; 0 until a step and a send were
        measured. `current`: the job's interval now (None: none chosen yet). A longer one is
        proposed at once; a shorter one only past the dead band, else `current` is kept."""
        if self.send_s is None or self.step_s is None:
            return 0
        up = choose_interval(self.send_s, self.step_s, self.headroom)
        if current is None or up >= current:
            return up
        down = choose_interval(max(self._sends), self.step_s, self.headroom * DOWN_MARGIN)
        return max(up, min(current, down))
