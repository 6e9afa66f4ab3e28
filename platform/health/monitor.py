"""Controller-side health judgement: which ranks are dead, hung or slow, and whether the loss went bad.

The controller reads every rank's heartbeat from Redis about once per heartbeat interval and
hands the snapshot to `HealthMonitor.observe`, which returns only the faults that are new since
the previous poll. The monitor is pure (no Redis, no Ray, no threads, no sleeping): time is the
clock the caller passes in, so tests drive it with made-up times, and what to do about a fault
is the policy's business, not this module's.

Two clocks appear below. `now` is the caller's clock. The *judging clock* is `now` minus every
second the monitor was blind (Redis unreachable): timeouts that mean "we watched and nothing
happened" run on it, because during an outage we did not watch.

Two kinds of "no progress". A rank in a start-up phase (setup, rendezvous, build, restore, init,
calibration, or its attempt's first step) is judged by that phase's deadline (`deadlines`,
health/startup.py), and the clock of a phase starts once every rank has reached it: a rank
waiting for a peer still in an earlier phase is not charged for the wait, the peer is judged by
its own phase. Past its first step, a rank is judged by the hang timeout (learned from its step
times, the hard ceiling until then and in a blocking save). Both are reported as a hang; the
start-up one names the phase and its deadline.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from longrun.config.sections import HealthSection
from longrun.health.beat_columns import FIRST_STEP, NONE, STARTUP_PHASES, BeatColumns, phase_name
from longrun.health.heartbeat import Heartbeat
from longrun.health.rank_track import RankTracks
from longrun.health.startup import StartupDeadlines
from longrun.health.stragglers import NodeIndex, StragglerReport, attribute
from longrun.kinds import FaultKind

__all__ = ["Fault", "FaultKind", "HealthMonitor"]
LOSS_WINDOW = 32  # recent distinct-step losses a new loss is compared against
# Steps of loss history kept (and handed to the next attempt): a resume goes back up to one
# checkpoint interval, and the steps before it must still be there to judge against.
LOSS_HISTORY = 4096
MIN_LOSSES_TO_JUDGE = 8  # with fewer, the median of "recent losses" is mostly warm-up noise
EXPLAIN_EVERY = 10  # polls between explanations of the job's pace when no straggler is new
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
                 startup_grace_s: float = 120.0, loss_history: Mapping[int, float] | None = None,
                 nodes: Sequence[str | None] | None = None, deadlines: StartupDeadlines | None = None):
        if world_size < 1:
            raise ValueError(f"world_size must be at least 1, got {world_size}")
        if startup_grace_s < 0:
            raise ValueError(f"startup_grace_s must be >= 0 seconds, got {startup_grace_s}")
        self.world_size = world_size
        self.health = health
        self.started_at = started_at
        self.startup_grace_s = startup_grace_s
        self._tracks = RankTracks(world_size)
        # Each start-up phase's deadline (None: every phase gets the hard ceiling, as before).
        self.deadlines = deadlines or StartupDeadlines.uniform(
            health.hang_timeout_s, "health.hang_timeout_s (no start-up deadlines were given)")
        self._deadline_s = np.array([self.deadlines.seconds(p) for p in STARTUP_PHASES])
        # Judging clock at which every rank had reached each start-up phase (NaN: not yet).
        self._opened_at = np.full(len(STARTUP_PHASES), np.nan)
        # Which node each rank runs on: a straggler is explained by its node, data or stage.
        self._nodes = NodeIndex.of(list(nodes) if nodes is not None else [None] * world_size)
        self.stragglers: StragglerReport | None = None  # the newest explanation of the job's pace
        self._polls = 0
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

    def observe(self, beats: Mapping[int, Heartbeat | None] | BeatColumns, now: float,
                wall: float | None = None) -> list[Fault]:
        """Judge one snapshot of heartbeats: columns (beat_columns.py), or rank -> heartbeat
        with None or absent where missing. `wall`, the caller's wall clock, lets a step's own
        completion time (`stepped_at`) date its progress: a beat reaches the poll up to an
        interval after the step, and a hang timed from the poll would be declared that late."""
        cols = beats if isinstance(beats, BeatColumns) else BeatColumns.from_beats(beats, self.world_size)
        self._end_outage(now)
        self._last_poll_at = now
        clock = now - self._blind_s
        t = self._tracks
        active = ~t.finished
        missing = active & ~cols.present & ~t.dead
        dead = self._judge_missing(np.flatnonzero(missing), now, clock) if missing.any() else []
        present = active & cols.present
        # A stale key can outlive its process by up to the heartbeat timeout; only a heartbeat
        # published after the death (a restarted process) brings a dead rank back.
        revived = present & t.dead & ~(cols.sent_at <= t.dead_sent_at)
        if revived.any():
            t.reset(np.flatnonzero(revived))
        live = np.flatnonzero(present & ~t.dead)
        t.follow(cols, live, now, clock, self.health, wall)
        self._open_phases(active & ~t.dead, clock)
        starting = t.stint[live] != NONE
        hangs = (self._judge_startup(live[starting], now, clock)
                 + self._judge_hang(live[~starting], now, clock))
        return (dead + hangs + self._judge_stragglers(cols, live, now)
                + self._judge_nan(cols, live, now) + self._judge_loss(cols, live, now))

    def finished(self, rank: int) -> None:
        """`rank` completed its work: its heartbeat stops and expires, which is not a death."""
        self._tracks.finished[rank] = True

    def store_unreachable(self, now: float) -> None:
        """The controller could not read Redis this poll: judge nothing until it can again."""
        if self._outage_since is None:
            # Blind since the last poll that worked: what happened after it was never seen.
            self._outage_since = self._last_poll_at if self._last_poll_at is not None else now

    def actor_died(self, rank: int, now: float, reason: str) -> Fault:
        """Ray reported the rank's actor or process gone; its heartbeat key may linger until it expires."""
        self._mark_dead(rank)
        step = self._step_of(rank)
        where = f"last seen at step {step}" if self._tracks.seen[rank] else "before its first heartbeat"
        return Fault(FaultKind.DEAD, rank, step, now, f"rank {rank} process is gone ({reason}), {where}")

    def node_lost(self, ranks: Sequence[int]) -> None:
        """The ranks of a node whose agent stopped reporting: the node's fault is the caller's to
        declare (one incident for the node, not one per rank), so they are only marked dead."""
        for rank in ranks:
            if not self._tracks.finished[rank]:
                self._mark_dead(rank)

    def hang_timeout_s(self, rank: int) -> float:
        """The current hang timeout of a rank, for status and metrics: its start-up phase's
        deadline while it starts, then the step-sized one."""
        stint = int(self._tracks.stint[rank])
        if stint != NONE:
            return float(self._deadline_s[stint])
        return float(self._tracks.hang_timeouts(np.array([rank]), self.health)[0])

    # ---- rules ----------------------------------------------------------------------------

    def _mark_dead(self, rank: int) -> None:
        t = self._tracks
        t.dead[rank] = True
        t.dead_sent_at[rank] = t.last_sent_at[rank]  # so the lingering key is not taken for a revival

    def _step_of(self, rank: int) -> int | None:
        return int(self._tracks.step[rank]) if self._tracks.seen[rank] else None

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

    def _judge_missing(self, ranks: np.ndarray, now: float, clock: float) -> list[Fault]:
        """DEAD: the heartbeat key expired (or the node's agent no longer hears the rank)."""
        if now < self._missing_tolerated_until:
            return []
        t = self._tracks
        # Never seen: process start, imports and restore get the startup grace first.
        if clock - self.started_at <= self.startup_grace_s:
            ranks = ranks[t.seen[ranks]]
        faults = []
        for rank in ranks.tolist():
            if t.seen[rank]:
                age = now - t.last_seen_at[rank]
                detail = (f"rank {rank} stopped sending heartbeats: last seen {age:.1f} s ago at step "
                          f"{t.step[rank]}, keys expire after {self.health.heartbeat_timeout_s:.1f} s")
            else:
                detail = (f"rank {rank} sent no heartbeat within the {self.startup_grace_s:.1f} s "
                          "startup grace")
            # Reported once: the rank stays dead until a newer heartbeat shows a restarted process.
            self._mark_dead(rank)
            faults.append(Fault(FaultKind.DEAD, rank, self._step_of(rank), now, detail))
        return faults

    def _open_phases(self, watched: np.ndarray, clock: float) -> None:
        """Start the clock of every start-up phase that each watched rank has now reached."""
        ranks = np.flatnonzero(watched)
        reached = int(self._tracks.startup_order(ranks).min()) if len(ranks) else len(STARTUP_PHASES)
        opening = self._opened_at[: reached + 1]
        opening[np.isnan(opening)] = clock

    def _judge_startup(self, ranks: np.ndarray, now: float, clock: float) -> list[Fault]:
        """HANG: a rank longer in a start-up phase than its deadline (once per stint), counted
        from when it entered the phase or, if later, when every rank had reached it."""
        if not len(ranks):
            return []
        t = self._tracks
        stint = t.stint[ranks]
        elapsed = clock - np.maximum(t.stint_since[ranks], self._opened_at[stint])  # NaN: not open yet
        over = (elapsed > self._deadline_s[stint]) & ~t.stint_reported[ranks]
        faults = []
        for i in np.flatnonzero(over).tolist():
            rank = int(ranks[i])
            t.stint_reported[rank] = True
            deadline = self.deadlines[STARTUP_PHASES[stint[i]]]
            where = (f"in its first step (phase '{phase_name(int(t.phase[rank]))}', step {t.step[rank]})"
                     if stint[i] == FIRST_STEP else f"in phase '{deadline.phase}'")
            faults.append(Fault(FaultKind.HANG, rank, int(t.step[rank]), now,
                                f"rank {rank}{_stage(int(t.pp_stage[rank]))} spent {elapsed[i]:.0f} s "
                                f"{where} (deadline {deadline.seconds:.0f} s: {deadline.why})"))
        return faults

    def _judge_hang(self, live: np.ndarray, now: float, clock: float) -> list[Fault]:
        """HANG: the heartbeat is fresh but the step has not advanced for longer than the timeout."""
        t = self._tracks
        timeout = t.hang_timeouts(live, self.health)
        stalled = clock - t.progress_at[live]
        hung = (stalled > timeout) & (t.hang_reported_step[live] != t.step[live])  # once per (rank, step)
        faults = []
        for i in np.flatnonzero(hung).tolist():
            rank = int(live[i])
            t.hang_reported_step[rank] = t.step[rank]
            ceiling = timeout[i] == self.health.hang_timeout_s
            basis = "hard ceiling" if ceiling else "learned from its step times"
            faults.append(Fault(FaultKind.HANG, rank, int(t.step[rank]), now,
                                f"rank {rank}{_stage(int(t.pp_stage[rank]))} made no progress past step "
                                f"{t.step[rank]} in phase '{phase_name(int(t.phase[rank]))}' "
                                f"for {stalled[i]:.1f} s (timeout {timeout[i]:.1f} s, {basis})"))
        return faults

    def _judge_stragglers(self, cols: BeatColumns, live: np.ndarray, now: float) -> list[Fault]:
        """STRAGGLER: slower than factor x the median of live ranks for `patience` distinct steps in a row."""
        t = self._tracks
        timed = live[~np.isnan(cols.step_time_s[live])]
        if len(timed) < MIN_RANKS_FOR_STRAGGLERS:
            return []
        times = cols.step_time_s[timed]
        median = float(np.median(times))
        limit = self.health.straggler_factor * median
        new = t.streak_step[timed] != cols.step[timed]  # only ranks showing a step not judged before
        ranks, times = timed[new], times[new]
        t.streak_step[ranks] = cols.step[ranks]
        t.note_step_times(ranks, times)
        fine, slow = ranks[times <= limit], ranks[times > limit]
        t.slow_streak[fine] = 0
        t.straggling[fine] = False  # recovered: a later slow streak is reported again
        t.slow_streak[slow] += 1
        due = slow[(t.slow_streak[slow] >= self.health.straggler_patience) & ~t.straggling[slow]]
        t.straggling[due] = True
        self._polls += 1
        if len(due) or self._polls % EXPLAIN_EVERY == 1:
            self.stragglers = attribute(t.typical_step_times(), self._nodes, cols.pp_stage, cols.work_cost,
                                        self.health.straggler_factor)
        blames = {s.rank: s for s in self.stragglers.slow} if len(due) else {}
        faults = []
        for rank in due.tolist():
            took = float(cols.step_time_s[rank])
            why = blames.get(rank)
            faults.append(Fault(
                FaultKind.STRAGGLER, rank, int(cols.step[rank]), now,
                f"rank {rank} took {took:.2f} s per step, {took / median:.1f}x "
                f"the median {median:.2f} s, for {t.slow_streak[rank]} steps in a row "
                f"(limit {self.health.straggler_factor}x)" + (f"; {why.blame}: {why.detail}" if why else ""),
                blame=why.blame if why else "rank"))
        return faults

    def _judge_nan(self, cols: BeatColumns, live: np.ndarray, now: float) -> list[Fault]:
        """NAN: any rank reporting a non-finite loss makes a job-wide fault, once per step."""
        bad = live[~cols.loss_finite[live]]
        if not len(bad):
            return []
        faults = []
        steps, first, counts = np.unique(cols.step[bad], return_index=True, return_counts=True)
        for step, i, count in zip(steps.tolist(), first.tolist(), counts.tolist(), strict=True):
            if step in self._nan_steps_reported:
                continue
            self._nan_steps_reported.add(step)
            others = f" and {count - 1} other rank(s)" if count > 1 else ""
            faults.append(Fault(FaultKind.NAN, None, step, now, f"the loss at step {step} was not finite "
                                f"(reported by rank {int(bad[i])}{others})"))
        return faults

    def _judge_loss(self, cols: BeatColumns, live: np.ndarray, now: float) -> list[Fault]:
        """LOSS_SPIKE: the global loss above factor x the median of recent losses, once per step."""
        # The global loss is the same on every rank: the lowest live one reporting a finite one will do.
        finite = live[cols.loss_finite[live] & np.isfinite(cols.loss[live])]
        if not len(finite):
            return []
        rank = int(finite[0])
        step, loss = int(cols.step[rank]), float(cols.loss[rank])
        if step == self._last_loss_step:
            return []  # each distinct step is judged (and enters the window) once
        self._last_loss_step = step
        if any(s >= step for s in self._losses):
            # Resumed from a checkpoint: the steps from here on are being trained again; the
            # previous attempt's values for them are not history any more.
            self._losses = {k: v for k, v in self._losses.items() if k < step}
        window = [self._losses[k] for k in sorted(self._losses)[-LOSS_WINDOW:]]
        if len(window) >= MIN_LOSSES_TO_JUDGE:
            median = statistics.median(window)
            factor = self.health.loss_spike_factor
            if median > 0 and loss > factor * median:
                # A spike stays out of the window, or a run of spikes would raise the bar for the next.
                if step in self._spike_steps_reported:
                    return []
                self._spike_steps_reported.add(step)
                return [Fault(FaultKind.LOSS_SPIKE, None, step, now,
                              f"loss {loss:.4g} at step {step} is {loss / median:.1f}x the "
                              f"median {median:.4g} of the last {len(window)} steps (limit {factor}x)")]
        self._losses[step] = loss
        if len(self._losses) > LOSS_HISTORY:  # bounded, yet longer than a checkpoint interval
            for old in sorted(self._losses)[:-LOSS_HISTORY // 2]:
                del self._losses[old]
        return []


def _stage(pp_stage: int) -> str:
    """" (pipeline stage 1)" for a rank of a pipeline; nothing otherwise."""
    return f" (pipeline stage {pp_stage})" if pp_stage != NONE else ""
