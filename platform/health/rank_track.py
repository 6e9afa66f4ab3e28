"""What the health monitor remembers about one rank between polls, and how it learns the
rank's hang timeout from its step times. Pure: clocks are passed in (see monitor.py for the
caller's clock and the judging clock)."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from longrun.config.sections import HealthSection
from longrun.health.heartbeat import Heartbeat
from longrun.kinds import SLOW_PHASES

STEP_TIME_WINDOW = 20  # recent step durations a rank's hang timeout is learned from
MIN_ADVANCES_TO_LEARN = 2  # step advances seen before the learned timeout replaces the ceiling


@dataclass(slots=True)
class RankTrack:
    """What the monitor remembers about one rank between polls."""

    seen: bool = False
    step: int | None = None
    phase: str = "starting"
    pp_stage: int | None = None  # the rank's pipeline position, as its heartbeat says
    last_seen_at: float = 0.0  # caller clock of the last poll that had this rank's heartbeat
    last_sent_at: float | None = None  # publisher clock of that heartbeat
    progress_at: float = 0.0  # judging clock of the last step advance (or exit from a slow phase)
    interval_clean: bool = False  # nothing but steps since progress_at: the interval is a step time
    advances: int = 0
    durations: deque[float] = field(default_factory=lambda: deque(maxlen=STEP_TIME_WINDOW))
    learned_timeout_s: float | None = None
    hang_reported_step: int | None = None
    dead: bool = False
    dead_sent_at: float | None = None  # the last heartbeat before death; only a newer one revives
    slow_streak: int = 0
    streak_step: int | None = None  # the last step judged for straggling
    straggling: bool = False
    finished: bool = False  # completed its work: no longer judged (its heartbeat will expire)

    def follow(self, beat: Heartbeat, now: float, clock: float, health: HealthSection) -> None:
        """Update a rank's progress clock and step-time window from its latest heartbeat."""
        slow_phase = beat.phase in SLOW_PHASES
        if not self.seen:
            self.seen = True
            self.step = beat.step
            self.progress_at = clock
            self.interval_clean = False  # first sighting is mid-step: no interval to measure yet
        elif beat.step > self.step:
            self._learn_step_time(beat, clock, health)
            self.advances += 1
            self.step = beat.step
            self.progress_at = clock
            self.interval_clean = True
        elif beat.step < self.step:
            # Restored from an earlier checkpoint: progress starts over from here.
            self.step = beat.step
            self.progress_at = clock
            self.interval_clean = False
            self.hang_reported_step = None
        elif self.phase in SLOW_PHASES and not slow_phase:
            # Leaving a checkpoint or restore: the ceiling covered its length; the step-sized
            # timeout starts counting now, or a long save would read as a hang right after it.
            self.progress_at = clock
            self.interval_clean = False
        if slow_phase:
            self.interval_clean = False  # the interval includes non-step work: not a step time
        self.phase = beat.phase
        self.pp_stage = beat.pp_stage
        self.last_seen_at = now
        self.last_sent_at = beat.sent_at

    def _learn_step_time(self, beat: Heartbeat, clock: float, health: HealthSection) -> None:
        # The worker's own step_time_s misses time lost outside its timer (a stuck collective
        # before the timer starts); the wall time between sightings misses nothing but is coarse
        # and covers several steps when they are faster than the poll. Keep the larger.
        samples = [] if beat.step_time_s is None else [beat.step_time_s]
        if self.interval_clean:
            samples.append((clock - self.progress_at) / (beat.step - self.step))
        if not samples:
            return
        self.durations.append(max(samples))
        # Progress becomes visible only when the worker publishes and we poll, so a timeout below
        # two heartbeat intervals would flag healthy fast ranks between sightings.
        floor = max(health.hang_min_s, 2 * health.heartbeat_interval_s)
        learned = health.hang_safety_factor * max(self.durations)
        self.learned_timeout_s = min(health.hang_timeout_s, max(floor, learned))

    def hang_timeout_s(self, health: HealthSection) -> float:
        # Until two advances were seen, or in a phase that is not a step, the hard ceiling applies.
        if (self.learned_timeout_s is None or self.advances < MIN_ADVANCES_TO_LEARN
                or self.phase in SLOW_PHASES):
            return health.hang_timeout_s
        return self.learned_timeout_s
