"""One attempt: its worker group and everything the controller learns while watching it.

A restart makes a new `Attempt` (`attempt.next(...)`) instead of resetting fields by hand,
so nothing of a dead attempt leaks into the next one except what is handed on on purpose:
the loss history (a spike right after a resume is judged against the steps before it) and
the move into RECOVERING that the new attempt answers (where it resumes, and the time its
recovery is measured from).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from longrun.config.sections import HealthSection
from longrun.controller.state import Transition
from longrun.controller.workers import WorkerGroup
from longrun.health.beat_columns import STARTING_CODES, BeatColumns
from longrun.health.monitor import HealthMonitor
from longrun.health.policy import Incident
from longrun.health.scaling import SizeDecision
from longrun.health.startup import StartupDeadlines
from longrun.kinds import FaultKind


@dataclass
class Attempt:
    number: int
    recovery: Transition | None = None  # the move into RECOVERING this attempt answers, if any
    loss_history: dict[int, float] = field(default_factory=dict)  # handed on by the previous attempt
    group: WorkerGroup | None = None  # None before placement and once stopped
    monitor: HealthMonitor | None = None  # from RENDEZVOUS on; survives a CONTINUE decision
    summaries: dict[int, dict[str, Any]] = field(default_factory=dict)  # rank -> its run()'s summary
    held: list[Incident] = field(default_factory=list)  # exceptions waiting for their cause
    settle_until: float | None = None  # monitor clock: when held exceptions are decided anyway
    trained: bool = False  # every rank has completed a step of this attempt
    endpoints: dict[int, tuple[str, str]] = field(default_factory=dict)  # rank -> (metrics host:port, node)
    last_beat_at: LastBeats = field(default_factory=lambda: LastBeats())  # rank -> sent_at of its newest beat
    endpoints_changed: int = 0  # bumped whenever `endpoints` changes (scrape targets are rebuilt then only)
    reached: int = 0  # the newest step any rank reported in this attempt
    lost_from: int | None = None  # the step the previous attempt had reached when it failed
    world_size: int = 0  # ranks watched (from RENDEZVOUS on): an elastic job's may be fewer than configured
    grow: SizeDecision | None = None  # a grow asked of this attempt: its ranks save and stop, then resize

    @property
    def resume_before_step(self) -> int | None:
        """Restore the newest checkpoint before this step (the policy's, after a bad loss)."""
        decision = self.recovery.decision if self.recovery is not None else None
        return decision.resume_before_step if decision is not None else None

    @property
    def live(self) -> bool:
        return self.group is not None

    def next(self, recovery: Transition, number: int | None = None) -> Attempt:
        """The attempt that answers `recovery` (the move into RECOVERING that ended this one),
        numbered `number` (the store's next, `keys.allocate_attempt`; default this one's + 1)."""
        history = self.monitor.loss_history if self.monitor is not None else self.loss_history
        reached = max(self.reached, self.lost_from or 0)  # an attempt that never trained lost nothing new
        return Attempt(self.number + 1 if number is None else number, recovery=recovery,
                       loss_history=history, lost_from=reached)

    def watch(self, world_size: int, health: HealthSection, now: float,
              deadlines: StartupDeadlines | None = None) -> None:
        """Start judging this attempt's heartbeats (its ranks were just started); `deadlines`:
        each start-up phase's (health/startup.py; None: the hard hang ceiling for each)."""
        self.world_size = world_size
        nodes = [self.group.node_of(rank) for rank in range(world_size)] if self.group is not None else None
        self.monitor = HealthMonitor(world_size, health, started_at=now, loss_history=self.loss_history,
                                     nodes=nodes, deadlines=deadlines)

    def settle(self, incidents: list[Incident], now: float, patience_s: float) -> list[Incident] | None:
        """The incidents to decide on now, or None to hold them for a later poll.

        An exception on a healthy rank is usually the echo of a peer's death (its collective
        failed): the cause gets up to `patience_s` (a heartbeat timeout) to show itself, so the
        policy blames the dead rank's node, not the messenger. Anything else is decided at once,
        and so is everything once every rank has told its story."""
        incidents, self.held = self.held + incidents, []
        if not incidents or any(i.kind != FaultKind.EXCEPTION for i in incidents):
            return incidents
        self.settle_until = self.settle_until or now + patience_s
        if now >= self.settle_until or not self.group.running():
            return incidents
        self.held = incidents
        return None

    def first_step_done(self, beats: BeatColumns) -> bool:
        """Every rank has trained a step past where this attempt resumed."""
        return bool(beats.present.all() and not np.isin(beats.phase, STARTING_CODES).any()
                    and (beats.step > beats.resumed_from).all())


class LastBeats(Mapping[int, float]):
    """Rank -> the send time of its newest heartbeat in the attempt, kept as a column (updated
    each poll without a Python loop over the ranks); a rank never heard of is absent."""

    def __init__(self) -> None:
        self._at = np.zeros(0)

    def update(self, beats: BeatColumns) -> None:
        if len(self._at) != beats.world_size:
            self._at = np.full(beats.world_size, np.nan)
        self._at[beats.present] = beats.sent_at[beats.present]

    def __getitem__(self, rank: int) -> float:
        at = self._at[rank] if isinstance(rank, int) and 0 <= rank < len(self._at) else np.nan
        if np.isnan(at):  # never heard of, or no rank at all (a job-wide incident's None)
            raise KeyError(rank)
        return float(at)

    def __iter__(self) -> Iterator[int]:
        return iter(np.flatnonzero(~np.isnan(self._at)).tolist())

    def __len__(self) -> int:
        return int(np.count_nonzero(~np.isnan(self._at)))
