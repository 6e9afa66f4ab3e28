"""Controller-side health judgement: which ranks are dead, hung or slow, and whether the loss went bad.

The controller reads every rank's heartbeat from Redis about once per heartbeat interval and
hands the snapshot to `HealthMonitor.observe`, which returns only the faults that are new since
the previous poll. The monitor is pure (no Redis, no Ray, no threads, no sleeping): time is the
clock the caller passes in, so tests drive it with made-up times, and what to do about a fault
is the policy's business, not this module's.

Two clocks appear below. `now` is the caller's clock. The *judging clock* is `now` minus every
second the monitor was blind (Redis unreachable): timeouts that mean "we watched and nothing
happened" run on it, because during an outage we did not watch.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping
from dataclasses import dataclass

from longrun.config.sections import HealthSection
from longrun.health.heartbeat import Heartbeat
from longrun.health.rank_track import RankTrack
from longrun.kinds import FaultKind

__all__ = ["Fault", "FaultKind", "HealthMonitor"]
LOSS_WINDOW = 32  # recent distinct-step losses a new loss is compared against
# Steps of loss history kept (and handed to the next attempt): a resume goes back up to one
# checkpoint interval, and the steps before it must still be there to judge against.
LOSS_HISTORY = 4096
MIN_LOSSES_TO_JUDGE = 8  # with fewer, the median of "recent losses" is mostly warm-up noise
MIN_RANKS_FOR_STRAGGLERS = 3  # with two step times the median is their mean: no outlier to find


@dataclass(frozen=True)
class Fault:
    kind: FaultKind
    rank: int | None  # None for job-wide faults (a NaN or spike in the global loss)
    step: int | None  # the step it concerns: the rank's last step seen, or the NaN/spike step
    detected_at: float  # the monitor's caller clock
    detail: str  # one sentence for operators
    blame: str | None = None  # a straggler's attributed cause (health/stragglers.py)


class HealthMonitor:
    def __init__(self, world_size: int, health: HealthSection, *, started_at: float,
                 startup_grace_s: float = 120.0, loss_history: Mapping[int, float] | None = None):
        if world_size < 1:
            raise ValueError(f"world_size must be at least 1, got {world_size}")
        if startup_grace_s < 0:
            raise ValueError(f"startup_grace_s must be >= 0 seconds, got {startup_grace_s}")
        self.world_size = world_size
        self.health = health
        self.started_at = started_at
        self.startup_grace_s = startup_grace_s
        self._ranks = [RankTrack() for _ in range(world_size)]
        self._blind_s = 0.0  # total seconds the store was unreachable: the judging clock stood still
        self._outage_since: float | None = None
        self._last_poll_at: float | None = None
        self._missing_tolerated_until = -math.inf
        # step -> global loss of the steps judged normal. A restart resumes from a checkpoint,
        # so the controller hands the previous attempt's history on (`loss_history`): a spike
        # right after a resume is judged against the steps before it, not against nothing.
        self._losses: dict[int, float] = dict(loss_history or {})
        self._last_loss_step: int | None = None
        self._nan_steps_reported: set[int] = set()
        self._spike_steps_reported: set[int] = set()

    @property
    def loss_history(self) -> dict[int, float]:
        """The normal steps' losses, for the next attempt's monitor."""
        return dict(self._losses)

    # ---- what the controller calls -------------------------------------------------------

    def observe(self, beats: Mapping[int, Heartbeat | None], now: float) -> list[Fault]:
        """Judge one snapshot of heartbeats (rank -> heartbeat, None or absent when missing)."""
        self._end_outage(now)
        self._last_poll_at = now
        clock = now - self._blind_s
        dead: list[Fault] = []
        hangs: list[Fault] = []
        straggler_candidates: list[tuple[int, RankTrack, Heartbeat]] = []
        step_times: list[float] = []
        nan_steps: dict[int, tuple[int, int]] = {}  # step -> (lowest rank reporting it, how many)
        loss_beat: Heartbeat | None = None
        # One pass over the ranks, constant work each (the window max is cached): the controller
        # polls about once a second with thousands of ranks.
        for rank in range(self.world_size):
            track = self._ranks[rank]
            if track.finished:
                continue
            beat = beats.get(rank)
            if beat is None:
                if not track.dead and (fault := self._judge_missing(rank, track, now, clock)):
                    dead.append(fault)
                continue
            if track.dead:
                # A stale key can outlive its process by up to the heartbeat timeout; only a
                # heartbeat published after the death (a restarted process) brings the rank back.
                if track.dead_sent_at is not None and beat.sent_at <= track.dead_sent_at:
                    continue
                track = self._ranks[rank] = RankTrack()
            track.follow(beat, now, clock, self.health)
            if fault := self._judge_hang(rank, track, now, clock):
                hangs.append(fault)
            if beat.step_time_s is not None:
                step_times.append(beat.step_time_s)
                if track.streak_step != beat.step:
                    straggler_candidates.append((rank, track, beat))
            if not beat.loss_finite:
                first, count = nan_steps.get(beat.step, (rank, 0))
                nan_steps[beat.step] = (first, count + 1)
            elif loss_beat is None and beat.loss is not None and math.isfinite(beat.loss):
                loss_beat = beat  # the global loss is the same on every rank: the lowest live one will do
        return (dead + hangs + self._judge_stragglers(straggler_candidates, step_times, now)
                + self._judge_nan(nan_steps, now) + self._judge_loss(loss_beat, now))

    def finished(self, rank: int) -> None:
        """`rank` completed its work: its heartbeat stops and expires, which is not a death."""
        self._ranks[rank].finished = True

    def store_unreachable(self, now: float) -> None:
        """The controller could not read Redis this poll: judge nothing until it can again."""
        if self._outage_since is None:
            # Blind since the last poll that worked: what happened after it was never seen.
            self._outage_since = self._last_poll_at if self._last_poll_at is not None else now

    def actor_died(self, rank: int, now: float, reason: str) -> Fault:
        """Ray reported the rank's actor or process gone; its heartbeat key may linger until it expires."""
        track = self._ranks[rank]
        track.dead = True
        track.dead_sent_at = track.last_sent_at  # so the lingering key is not taken for a revival
        where = f"last seen at step {track.step}" if track.seen else "before its first heartbeat"
        detail = f"rank {rank} process is gone ({reason}), {where}"
        return Fault(FaultKind.DEAD, rank, track.step, now, detail)

    def hang_timeout_s(self, rank: int) -> float:
        """The current hang timeout of a rank, for status and metrics."""
        return self._ranks[rank].hang_timeout_s(self.health)

    # ---- rules ----------------------------------------------------------------------------

    def _end_outage(self, now: float) -> None:
        if self._outage_since is None:
            return
        # The judging clock skips the outage, so a step that did not advance while we could not
        # see it is no hang and the outage does not eat into a starting rank's grace.
        self._blind_s += max(0.0, now - self._outage_since)
        self._outage_since = None
        # Redis may have come back empty; each worker re-publishes within one interval, so
        # missing keys are no evidence of death for a while.
        self._missing_tolerated_until = now + self.health.store_outage_grace_s

    def _judge_missing(self, rank: int, track: RankTrack, now: float, clock: float) -> Fault | None:
        """DEAD: the heartbeat key expired, so the worker has not refreshed it within the timeout."""
        if now < self._missing_tolerated_until:
            return None
        if track.seen:
            age = now - track.last_seen_at
            detail = (f"rank {rank} stopped sending heartbeats: last seen {age:.1f} s ago at step "
                      f"{track.step}, keys expire after {self.health.heartbeat_timeout_s:.1f} s")
        elif clock - self.started_at > self.startup_grace_s:
            # Never seen: process start, imports and restore get the startup grace first.
            detail = f"rank {rank} sent no heartbeat within the {self.startup_grace_s:.1f} s startup grace"
        else:
            return None
        # Reported once: the rank stays dead until a newer heartbeat shows a restarted process.
        track.dead = True
        track.dead_sent_at = track.last_sent_at
        return Fault(FaultKind.DEAD, rank, track.step, now, detail)

    def _judge_hang(self, rank: int, track: RankTrack, now: float, clock: float) -> Fault | None:
        """HANG: the heartbeat is fresh but the step has not advanced for longer than the timeout."""
        if track.hang_reported_step == track.step:
            return None  # once per (rank, step)
        timeout = track.hang_timeout_s(self.health)
        stalled = clock - track.progress_at
        if stalled <= timeout:
            return None
        track.hang_reported_step = track.step
        basis = "hard ceiling" if timeout == self.health.hang_timeout_s else "learned from its step times"
        return Fault(FaultKind.HANG, rank, track.step, now,
                     f"rank {rank}{_stage(track)} made no progress past step {track.step} in phase "
                     f"'{track.phase}' "
                     f"for {stalled:.1f} s (timeout {timeout:.1f} s, {basis})")

    def _judge_stragglers(self, candidates: list[tuple[int, RankTrack, Heartbeat]],
                          step_times: list[float], now: float) -> list[Fault]:
        """STRAGGLER: slower than factor x the median of live ranks for `patience` distinct steps in a row."""
        if len(step_times) < MIN_RANKS_FOR_STRAGGLERS:
            return []
        median = statistics.median(step_times)  # a C sort of one float per rank: cheap at 4,096
        limit = self.health.straggler_factor * median
        faults = []
        for rank, track, beat in candidates:  # only ranks showing a step not judged before
            track.streak_step = beat.step
            if beat.step_time_s <= limit:
                track.slow_streak = 0
                track.straggling = False  # recovered: a later slow streak is reported again
                continue
            track.slow_streak += 1
            if track.slow_streak >= self.health.straggler_patience and not track.straggling:
                track.straggling = True
                faults.append(Fault(
                    FaultKind.STRAGGLER, rank, beat.step, now,
                    f"rank {rank} took {beat.step_time_s:.2f} s per step, {beat.step_time_s / median:.1f}x "
                    f"the median {median:.2f} s, for {track.slow_streak} steps in a row "
                    f"(limit {self.health.straggler_factor}x)"))
        return faults

    def _judge_nan(self, nan_steps: dict[int, tuple[int, int]], now: float) -> list[Fault]:
        """NAN: any rank reporting a non-finite loss makes a job-wide fault, once per step."""
        faults = []
        for step in sorted(nan_steps):
            if step in self._nan_steps_reported:
                continue
            self._nan_steps_reported.add(step)
            first, count = nan_steps[step]
            others = f" and {count - 1} other rank(s)" if count > 1 else ""
            faults.append(Fault(FaultKind.NAN, None, step, now,
                                f"the loss at step {step} was not finite (reported by rank {first}{others})"))
        return faults

    def _judge_loss(self, beat: Heartbeat | None, now: float) -> list[Fault]:
        """LOSS_SPIKE: the global loss above factor x the median of recent losses, once per step."""
        if beat is None or beat.step == self._last_loss_step:
            return []  # each distinct step is judged (and enters the window) once
        self._last_loss_step = beat.step
        if any(step >= beat.step for step in self._losses):
            # Resumed from a checkpoint: the steps from here on are being trained again; the
            # previous attempt's values for them are not history any more.
            self._losses = {k: v for k, v in self._losses.items() if k < beat.step}
        window = [self._losses[k] for k in sorted(self._losses)[-LOSS_WINDOW:]]
        if len(window) >= MIN_LOSSES_TO_JUDGE:
            median = statistics.median(window)
            factor = self.health.loss_spike_factor
            if median > 0 and beat.loss > factor * median:
                # A spike stays out of the window, or a run of spikes would raise the bar for the next.
                if beat.step in self._spike_steps_reported:
                    return []
                self._spike_steps_reported.add(beat.step)
                return [Fault(FaultKind.LOSS_SPIKE, None, beat.step, now,
                              f"loss {beat.loss:.4g} at step {beat.step} is {beat.loss / median:.1f}x the "
                              f"median {median:.4g} of the last {len(window)} steps (limit {factor}x)")]
        self._losses[beat.step] = beat.loss
        if len(self._losses) > LOSS_HISTORY:  # bounded, yet longer than a checkpoint interval
            for step in sorted(self._losses)[:-LOSS_HISTORY // 2]:
                del self._losses[step]
        return []


def _stage(track: RankTrack) -> str:
    """" (pipeline stage 1)" for a rank of a pipeline; nothing otherwise."""
    return f" (pipeline stage {track.pp_stage})" if track.pp_stage is not None else ""
