"""What the health monitor remembers about every rank between polls, as columns, and how it
learns each rank's hang timeout from its step times. Pure: clocks are passed in (see
monitor.py for the caller's clock and the judging clock).

Columns rather than an object per rank: the monitor follows 16,384 ranks once a second, and
the rules below are the same for every rank, so each is one numpy expression over the ranks
it applies to (beat_columns.py says why).
"""

from __future__ import annotations

import warnings

import numpy as np

from longrun.config.sections import HealthSection
from longrun.health.beat_columns import (
    NONE,
    SLOW_CODES,
    STARTUP_PHASES,
    BeatColumns,
    phase_code,
    startup_stint,
)
from longrun.kinds import Phase

STEP_TIME_WINDOW = 20  # recent step durations a rank's hang timeout is learned from
RECENT_TIMES = 5  # recent reported step times whose median a straggler is explained by
MIN_ADVANCES_TO_LEARN = 2  # step advances seen before the learned timeout replaces the ceiling
NO_STEP = np.iinfo(np.int64).min  # "no step" in an integer column (never judged, never reported)


class RankTracks:
    """Per-rank memory of the monitor; index = rank."""

    def __init__(self, world_size: int):
        n = world_size
        self.seen = np.zeros(n, bool)
        self.step = np.zeros(n, np.int64)
        self.phase = np.full(n, phase_code(Phase.STARTING), np.int16)
        self.pp_stage = np.full(n, NONE, np.int16)
        self.last_seen_at = np.zeros(n)  # caller clock of the last poll that had the rank's beat
        self.last_sent_at = np.full(n, np.nan)  # publisher clock of that beat
        self.progress_at = np.zeros(n)  # judging clock of the last step advance (or exit from a slow phase)
        self.interval_clean = np.zeros(n, bool)  # nothing but steps since progress_at: a step time
        self.advances = np.zeros(n, np.int64)
        # Ring of recent step durations (NaN: empty slot); only its maximum is ever used.
        self.durations = np.full((n, STEP_TIME_WINDOW), np.nan)
        self.next_slot = np.zeros(n, np.int64)
        self.longest = np.full(n, np.nan)  # the window's maximum
        self.learned_timeout_s = np.full(n, np.nan)
        self.hang_reported_step = np.full(n, NO_STEP, np.int64)
        self.dead = np.zeros(n, bool)
        self.dead_sent_at = np.full(n, np.nan)  # the last beat before death; only a newer one revives
        self.slow_streak = np.zeros(n, np.int64)
        self.streak_step = np.full(n, NO_STEP, np.int64)  # the last step judged for straggling
        self.straggling = np.zeros(n, bool)
        self.recent_times = np.full((n, RECENT_TIMES), np.nan)  # ring of reported step times
        self.next_time = np.zeros(n, np.int64)
        self.finished = np.zeros(n, bool)  # completed its work: no longer judged (its beat will expire)
        # The start-up phase each rank is in (an index into STARTUP_PHASES, NONE: past its start),
        # since when (judging clock: the poll that first saw it there), and whether its overrun
        # was reported (once per stint).
        self.stint = np.full(n, NONE, np.int16)
        self.stint_since = np.zeros(n)
        self.stint_reported = np.zeros(n, bool)

    def reset(self, ranks: np.ndarray) -> None:
        """Forget `ranks` (a restarted process beats again): as if never seen."""
        fresh = RankTracks(1)
        for name, column in vars(self).items():
            column[ranks] = getattr(fresh, name)[0]

    def follow(self, cols: BeatColumns, ranks: np.ndarray, now: float, clock: float,
               health: HealthSection, wall: float | None = None) -> None:
        """Update the progress clock and step-time window of `ranks` (indices) from their beats;
        with `wall`, an advance is dated by the step's own completion (`stepped_at`), not by the
        poll that saw it (never later than the poll, never more than a heartbeat timeout before:
        clocks of other hosts may be off)."""
        step, phase = cols.step[ranks], cols.phase[ranks]
        slow_now = np.isin(phase, SLOW_CODES)
        seen = self.seen[ranks]
        first = ~seen
        advanced = seen & (step > self.step[ranks])
        went_back = seen & (step < self.step[ranks])
        # Leaving a checkpoint or restore: the ceiling covered its length; the step-sized timeout
        # starts counting now, or a long save would read as a hang right after it.
        left_slow = seen & ~advanced & ~went_back & np.isin(self.phase[ranks], SLOW_CODES) & ~slow_now

        if advanced.any():
            self._learn_step_time(cols, ranks[advanced], clock, health)
            self.advances[ranks[advanced]] += 1
        # Restored from an earlier checkpoint: progress starts over, and a hang may be reported again.
        self.hang_reported_step[ranks[went_back]] = NO_STEP
        moved = first | advanced | went_back
        self.step[ranks[moved]] = step[moved]
        self.progress_at[ranks[moved | left_slow]] = clock
        if wall is not None and advanced.any():
            lag = np.clip(wall - cols.stepped_at[ranks[advanced]], 0.0, health.heartbeat_timeout_s)
            self.progress_at[ranks[advanced]] = clock - np.nan_to_num(lag, nan=0.0)
        # A first sighting is mid-step (no interval to measure yet); an advance starts a clean
        # interval unless it is in a phase that is not a step.
        self.interval_clean[ranks[moved | left_slow]] = advanced[moved | left_slow]
        self.interval_clean[ranks[slow_now]] = False
        stint = startup_stint(phase, step, cols.resumed_from[ranks])
        changed = stint != self.stint[ranks]
        self.stint_since[ranks[changed]] = clock
        self.stint_reported[ranks[changed]] = False
        self.stint[ranks] = stint
        self.seen[ranks] = True
        self.phase[ranks] = phase
        self.pp_stage[ranks] = cols.pp_stage[ranks]
        self.last_seen_at[ranks] = now
        self.last_sent_at[ranks] = cols.sent_at[ranks]

    def _learn_step_time(self, cols: BeatColumns, ranks: np.ndarray, clock: float,
                         health: HealthSection) -> None:
        # The worker's own step_time_s misses time lost outside its timer (a stuck collective
        # before the timer starts); the wall time between sightings misses nothing but is coarse
        # and covers several steps when they are faster than the poll. Keep the larger.
        reported = cols.step_time_s[ranks]
        between = np.where(self.interval_clean[ranks],
                           (clock - self.progress_at[ranks]) / (cols.step[ranks] - self.step[ranks]), np.nan)
        sample = np.fmax(reported, between)  # NaN only where neither is known
        known = ~np.isnan(sample)
        ranks, sample = ranks[known], sample[known]
        if not len(ranks):
            return
        slot = self.next_slot[ranks]
        evicted = self.durations[ranks, slot]
        self.durations[ranks, slot] = sample
        self.next_slot[ranks] = (slot + 1) % STEP_TIME_WINDOW
        # The window's maximum, kept up to date: a new sample can only raise it, and only where
        # the sample pushed out of the window was the maximum must the window be looked at again.
        longest = np.fmax(self.longest[ranks], sample)
        # (False where the evicted slot was empty: NaN compares False.)
        stale = (evicted >= self.longest[ranks]) & (sample < evicted)
        if stale.any():
            longest[stale] = np.nanmax(self.durations[ranks[stale]], axis=1)
        self.longest[ranks] = longest
        # Progress becomes visible only when the worker publishes and we poll, so a timeout below
        # two heartbeat intervals would flag healthy fast ranks between sightings.
        floor = max(health.hang_min_s, 2 * health.heartbeat_interval_s)
        learned = health.hang_safety_factor * longest
        self.learned_timeout_s[ranks] = np.minimum(health.hang_timeout_s, np.maximum(floor, learned))

    def note_step_times(self, ranks: np.ndarray, times: np.ndarray) -> None:
        """Remember each of `ranks`' step time of a step not seen before."""
        slot = self.next_time[ranks]
        self.recent_times[ranks, slot] = times
        self.next_time[ranks] = (slot + 1) % RECENT_TIMES

    def typical_step_times(self) -> np.ndarray:
        """Each rank's median recent step time (NaN where none is known): one slow step is noise."""
        with np.errstate(all="ignore"), warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)  # all-NaN rows: ranks with no time yet
            return np.nanmedian(self.recent_times, axis=1)

    def startup_order(self, ranks: np.ndarray) -> np.ndarray:
        """How far each of `ranks` got in the start: 0 before its first heartbeat (placement),
        its start-up phase's index, or len(STARTUP_PHASES) once past its first step."""
        return np.where(self.seen[ranks], np.where(self.stint[ranks] >= 0, self.stint[ranks],
                                                   len(STARTUP_PHASES)), 0)

    def hang_timeouts(self, ranks: np.ndarray, health: HealthSection) -> np.ndarray:
        """The hang timeout of each of `ranks`: the hard ceiling until two advances were seen or
        in a phase that is not a step, else the learned one."""
        learned = self.learned_timeout_s[ranks]
        ceiling = (np.isnan(learned) | (self.advances[ranks] < MIN_ADVANCES_TO_LEARN)
                   | np.isin(self.phase[ranks], SLOW_CODES))
        return np.where(ceiling, health.hang_timeout_s, learned)
