"""The job's life as an explicit state machine (as in Ray Train v2's controller).

The controller asks `JobStateMachine.transition()` to move; a move the diagram does not
allow is a bug in the controller, raised at once rather than recorded as a confusing
history. Pure: no I/O; the caller persists `history` (see `job_state.py`).

A state carries its data: a move into RECOVERING must carry the policy's decision (what the
next attempt resumes from, after what backoff), and `machine.decision` hands it to the step
that carries it out; a move into FAILED may carry the decision that gave up.

    PENDING -> PLACING -> DIAGNOSING -> RENDEZVOUS -> RUNNING -> SUCCEEDED
                  ^                                    |
                  +------------- RECOVERING <----------+   (a fault, within the budget; or an
                                                               elastic job growing back: a resize)
    RUNNING -> PREEMPTING -> PREEMPTED   (a signal or a drained node: save at a step boundary, stop)
    any live state -> FAILED (budget spent, unrecoverable) | STOPPED (user asked) |
                      PREEMPTED (asked to stop before anything new was trained)
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from longrun.health.policy import Decision
from longrun.kinds import TERMINAL_STATES as TERMINAL
from longrun.kinds import JobState

__all__ = ["TERMINAL", "InvalidTransition", "JobState", "JobStateMachine", "Transition"]

_NEXT: dict[JobState, frozenset[JobState]] = {
    JobState.PENDING: frozenset({JobState.PLACING}),
    JobState.PLACING: frozenset({JobState.DIAGNOSING, JobState.RENDEZVOUS, JobState.RECOVERING}),
    JobState.DIAGNOSING: frozenset({JobState.RENDEZVOUS, JobState.RECOVERING}),
    JobState.RENDEZVOUS: frozenset({JobState.RUNNING, JobState.RECOVERING}),
    JobState.RUNNING: frozenset({JobState.SUCCEEDED, JobState.RECOVERING, JobState.PREEMPTING}),
    JobState.RECOVERING: frozenset({JobState.PLACING}),
    JobState.PREEMPTING: frozenset({JobState.SUCCEEDED}),  # the last step came first
}
# Failing, stopping and being preempted are possible from every live state.
for _state in list(_NEXT):
    _NEXT[_state] = _NEXT[_state] | {JobState.FAILED, JobState.STOPPED, JobState.PREEMPTED}


class InvalidTransition(RuntimeError):
    pass


@dataclass(frozen=True)
class Transition:
    source: JobState
    target: JobState
    reason: str
    at: float  # wall clock (seconds since the epoch)
    decision: Decision | None = None  # RECOVERING's (required) or FAILED's: see the module docstring


_CARRIES_A_DECISION = frozenset({JobState.RECOVERING, JobState.FAILED})


@dataclass
class JobStateMachine:
    state: JobState = JobState.PENDING
    history: list[Transition] = field(default_factory=list)

    def can(self, target: JobState) -> bool:
        return target in _NEXT.get(self.state, frozenset())

    @property
    def decision(self) -> Decision | None:
        """The decision the current state carries (RECOVERING always has one), else None."""
        return self.history[-1].decision if self.history else None

    def transition(self, target: JobState, reason: str = "", at: float | None = None, *,
                   decision: Decision | None = None) -> Transition:
        if not self.can(target):
            allowed = ", ".join(sorted(_NEXT.get(self.state, ()))) or "nothing (terminal)"
            raise InvalidTransition(f"{self.state} -> {target} is not allowed; from {self.state}: {allowed}")
        if target is JobState.RECOVERING and decision is None:
            raise InvalidTransition("a move into RECOVERING must carry the decision it carries out")
        if decision is not None and target not in _CARRIES_A_DECISION:
            raise InvalidTransition(f"{target} carries no decision; only RECOVERING and FAILED do")
        move = Transition(self.state, target, reason, time.time() if at is None else at, decision)
        self.history.append(move)
        self.state = target
        return move
