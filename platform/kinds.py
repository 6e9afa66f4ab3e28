"""The shared vocabulary: job states, fault kinds and step phases, in one torch-free place.

The controller, the health monitor and policy, the workers, the metrics labels and `longrun
status` all speak these words; defining them once is what keeps a new fault kind or phase
from being known to the policy but unknown to the dashboards. Plain `StrEnum`s: each member
is its string, so it travels through Redis, JSON and Prometheus labels unchanged.

    from longrun.kinds import FaultKind, JobState, Phase
    JobState.RUNNING.terminal        # False
    FaultKind.precedence()           # most specific first: what the policy's rules key on
    Phase.CHECKPOINT in SLOW_PHASES  # True: judged by the hard hang ceiling
"""

from __future__ import annotations

import enum


class JobState(enum.StrEnum):
    PENDING = "PENDING"
    PLACING = "PLACING"
    DIAGNOSING = "DIAGNOSING"
    RENDEZVOUS = "RENDEZVOUS"
    RUNNING = "RUNNING"
    RECOVERING = "RECOVERING"
    PREEMPTING = "PREEMPTING"  # asked to stop (a signal, a drained node): saving at a step boundary
    SUCCEEDED = "SUCCEEDED"
    FAILED = "FAILED"
    STOPPED = "STOPPED"
    PREEMPTED = "PREEMPTED"  # stopped with its work saved: the same command resumes it

    @property
    def terminal(self) -> bool:
        return self in TERMINAL_STATES


TERMINAL_STATES = frozenset({JobState.SUCCEEDED, JobState.FAILED, JobState.STOPPED, JobState.PREEMPTED})


class FaultKind(enum.StrEnum):
    """What went wrong, most specific first (declaration order is the policy's precedence: a
    lost node explains its dead ranks, a dead rank explains its peers' exceptions, and a
    straggler explains nothing else)."""

    NODE_LOST = "node_lost"  # Ray reported the node itself gone
    DIAGNOSTICS_FAILED = "diagnostics_failed"  # a node failed its self-check
    FATAL = "fatal"  # an error that recurs on any node (config, data or checkpoint mismatch, user code)
    DEAD = "dead"  # a rank's process is gone
    HANG = "hang"  # a rank made no progress within its timeout
    NAN = "nan"  # a non-finite loss or gradient
    LOSS_SPIKE = "loss_spike"
    EXCEPTION = "exception"  # any other error a rank raised
    STRAGGLER = "straggler"

    @classmethod
    def precedence(cls) -> tuple[FaultKind, ...]:
        return tuple(cls)


# Restart causes that are not faults of a rank: the placement could not be made in time.
PLACEMENT_CAUSE = "placement"


class Phase(enum.StrEnum):
    """Where a rank is: published in its heartbeat, timed in the phase histogram."""

    STARTING = "starting"
    SETUP = "setup"
    DIAGNOSTICS = "diagnostics"
    RENDEZVOUS = "rendezvous"
    RESTORE = "restore"
    DATA = "data"
    PLAN = "plan"
    PIPELINE = "pipeline"  # the pipeline schedule: every micro-batch's forward and backward, interleaved
    FORWARD = "forward"
    BACKWARD = "backward"
    SYNC = "sync"
    OPTIMIZER = "optimizer"
    CHECKPOINT = "checkpoint"  # a blocking save: the step is waiting for it
    HELD = "held"  # a `hold` fault: waiting for an outside release
    DONE = "done"
    FAILED = "failed"


# The parts of one training step, in order (what the step-time panel stacks).
STEP_PHASES = (Phase.DATA, Phase.PLAN, Phase.PIPELINE, Phase.FORWARD, Phase.BACKWARD, Phase.SYNC,
               Phase.OPTIMIZER)
# Phases whose length has nothing to do with a step: a step-sized learned hang timeout would call
# a long save or restore a hang, so these are judged by the hard ceiling.
SLOW_PHASES = frozenset({Phase.STARTING, Phase.SETUP, Phase.DIAGNOSTICS, Phase.RENDEZVOUS,
                         Phase.RESTORE, Phase.CHECKPOINT, Phase.HELD})
# Phases in which a rank has not yet trained a step of the current attempt.
STARTING_PHASES = frozenset({Phase.STARTING, Phase.SETUP, Phase.RENDEZVOUS, Phase.RESTORE})
