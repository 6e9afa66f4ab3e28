"""One poll's heartbeats as columns: an array per field, indexed by rank.

The monitor judges 16,384 ranks about once a second. As objects (a `Heartbeat` per rank, a
Python loop over them) that costs 100-150 ms a poll on a 2-vCPU box, most of it building and
walking the objects; as columns the common case (every rank beating, most advancing) is a few
numpy expressions, and Python runs only for the ranks that need a sentence (a fault). Both
ways in arrive here: per-rank JSON beats (`from_beats`, small jobs and tests) and per-node
binary records (`node_beats.decode`, one agent per node at scale), so one code path judges.

A missing beat (expired key, a rank its node's agent no longer hears) is `present == False`;
an unknown number is NaN (floats) or the sentinel `NONE` (integers).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from longrun.health.heartbeat import Heartbeat
from longrun.kinds import SLOW_PHASES, STARTING_PHASES, STARTUP_OF, Phase, StartupPhase

NONE = -1  # an unknown integer (a pipeline stage where there is none)

# Phase codes: the known phases first, in a fixed order (the per-node record carries the code,
# so both ends agree on it); a phase this table does not know (a newer worker) gets a code of
# its own for as long as this process lives and is judged like any step phase.
_PHASES: list[str] = [str(p) for p in Phase]
_CODES: dict[str, int] = {name: i for i, name in enumerate(_PHASES)}
SLOW_CODES = np.array(sorted(_CODES[str(p)] for p in SLOW_PHASES), dtype=np.int16)
STARTING_CODES = np.array(sorted(_CODES[str(p)] for p in STARTING_PHASES), dtype=np.int16)
# Start-up phases by index (StartupPhase's order): what a rank's phase code is judged by.
STARTUP_PHASES = tuple(StartupPhase)
FIRST_STEP = STARTUP_PHASES.index(StartupPhase.FIRST_STEP)
_STARTUP_BY_CODE = np.full(len(_PHASES), NONE, np.int16)
for _phase, _startup in STARTUP_OF.items():
    _STARTUP_BY_CODE[_CODES[str(_phase)]] = STARTUP_PHASES.index(_startup)
# Phases that are no part of a step: a rank in one is not in its first step either.
_NOT_A_STEP = np.union1d(SLOW_CODES, [_CODES[str(Phase.DONE)], _CODES[str(Phase.FAILED)]])


def phase_code(name: str) -> int:
    code = _CODES.get(name)
    if code is None:
        code = _CODES[name] = len(_PHASES)
        _PHASES.append(name)
    return code


def phase_name(code: int) -> str:
    return _PHASES[code] if 0 <= code < len(_PHASES) else "unknown"


def startup_stint(phase: np.ndarray, step: np.ndarray, resumed_from: np.ndarray) -> np.ndarray:
    """The start-up phase (an index into STARTUP_PHASES) each rank is in, NONE where it is past
    its start: its heartbeat phase's (setup, rendezvous, build, restore, init, calibration), or
    the first step for a rank in a step's phases that has trained no step of its attempt yet."""
    known = phase < len(_STARTUP_BY_CODE)  # a code this table has not seen: a newer worker's step phase
    stint = np.where(known, _STARTUP_BY_CODE[np.where(known, phase, 0)], NONE).astype(np.int16)
    first = (stint == NONE) & ~np.isin(phase, _NOT_A_STEP) & (step <= resumed_from)
    stint[first] = FIRST_STEP
    return stint


@dataclass
class BeatColumns:
    """Every rank's newest heartbeat, as arrays of length world_size."""

    present: np.ndarray  # bool: a fresh beat of this rank was read
    step: np.ndarray  # int64: optimizer steps completed
    phase: np.ndarray  # int16: phase_code(...)
    loss: np.ndarray  # float64: the last step's global loss, NaN where not finite or unknown
    loss_finite: np.ndarray  # bool: False when the last step's loss was NaN/inf
    step_time_s: np.ndarray  # float64, NaN unknown
    sent_at: np.ndarray  # float64: the publisher's wall clock
    resumed_from: np.ndarray  # int64
    pp_stage: np.ndarray  # int16, NONE where the job has no pipeline
    work_cost: np.ndarray  # float64, NaN unknown
    stepped_at: np.ndarray  # float64: the publisher's wall clock when `step` completed, NaN unknown

    @classmethod
    def empty(cls, world_size: int) -> BeatColumns:
        return cls(present=np.zeros(world_size, bool), step=np.zeros(world_size, np.int64),
                   phase=np.zeros(world_size, np.int16), loss=np.full(world_size, np.nan),
                   loss_finite=np.ones(world_size, bool), step_time_s=np.full(world_size, np.nan),
                   sent_at=np.zeros(world_size), resumed_from=np.zeros(world_size, np.int64),
                   pp_stage=np.full(world_size, NONE, np.int16), work_cost=np.full(world_size, np.nan),
                   stepped_at=np.full(world_size, np.nan))

    @classmethod
    def from_beats(cls, beats: Mapping[int, Heartbeat | None], world_size: int) -> BeatColumns:
        """Columns from per-rank heartbeats (rank -> beat; None or absent where missing)."""
        cols = cls.empty(world_size)
        for rank, b in beats.items():
            if b is None or not 0 <= rank < world_size:
                continue
            cols.present[rank] = True
            cols.step[rank] = b.step
            cols.phase[rank] = phase_code(b.phase)
            cols.loss[rank] = np.nan if b.loss is None else b.loss
            cols.loss_finite[rank] = b.loss_finite
            cols.step_time_s[rank] = np.nan if b.step_time_s is None else b.step_time_s
            cols.sent_at[rank] = b.sent_at
            cols.resumed_from[rank] = b.resumed_from
            cols.pp_stage[rank] = NONE if b.pp_stage is None else b.pp_stage
            cols.work_cost[rank] = np.nan if b.work_cost is None else b.work_cost
            cols.stepped_at[rank] = np.nan if b.stepped_at is None else b.stepped_at
        return cols

    @property
    def world_size(self) -> int:
        return len(self.present)

    def beat(self, rank: int, attempt: int = 0) -> Heartbeat:
        """Rank `rank`'s beat as a `Heartbeat` (a present rank's; for the few that need one)."""
        return Heartbeat(
            rank=rank, step=int(self.step[rank]), phase=phase_name(int(self.phase[rank])),
            loss=None if np.isnan(self.loss[rank]) else float(self.loss[rank]),
            loss_finite=bool(self.loss_finite[rank]),
            step_time_s=None if np.isnan(self.step_time_s[rank]) else float(self.step_time_s[rank]),
            attempt=attempt, resumed_from=int(self.resumed_from[rank]),
            pp_stage=None if self.pp_stage[rank] == NONE else int(self.pp_stage[rank]),
            work_cost=None if np.isnan(self.work_cost[rank]) else float(self.work_cost[rank]),
            stepped_at=None if np.isnan(self.stepped_at[rank]) else float(self.stepped_at[rank]),
            sent_at=float(self.sent_at[rank]), pid=0, host="")
