"""The shared vocabulary: job states, fault kinds and step phases, in one torch-free place.

The controller, the health monitor and policy, the workers, the metrics labels and `longrun
status` all speak these words; defining them once is what keeps a new fault kind or phase
from being known to the policy but unknown to the dashboards. Plain `StrEnum`s: each member
is its string, so it travels through Redis, JSON and Prometheus labels unchanged.

    from longrun.kinds import FaultKind, JobState, Phase
    JobState.RUNNING.terminal        # False
    FaultKind.precedence()           # most specific first: what the policy's rules key on
    Phase.CHECKPOINT in SLOW_PHASES  # True: judged by the hard hang ceiling
    STARTUP_OF[Phase.BUILD]          # StartupPhase.BUILD: judged by the build's own deadline
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
# The job's own controller died (a SIGKILL, its host lost): the next controller records it as a
# fault of the attempt it was running (goodput/accounting.py), the time without one as controller_down.
CONTROLLER_LOST = "controller_lost"


class Phase(enum.StrEnum):
    """Where a rank is: published in its heartbeat, timed in the phase histogram."""

    STARTING = "starting"
    SETUP = "setup"  # the rank's own start: imports, device, metrics server, Redis clients
    DIAGNOSTICS = "diagnostics"
    RENDEZVOUS = "rendezvous"
    BUILD = "build"  # the model on the meta device, parallelized, this rank's pieces given memory
    RESTORE = "restore"
    INIT = "init"  # the initial weights (seeded, or model.init_from), when nothing was restored
    CALIBRATION = "calibration"  # dynamic context parallelism's cost model, measured or read
    DATA = "data"
    PLAN = "plan"
    PIPELINE = "pipeline"  # the pipeline schedule: every micro-batch's forward and backward, interleaved
    FORWARD = "forward"
    BACKWARD = "backward"
    SYNC = "sync"
    OPTIMIZER = "optimizer"
    CHECKPOINT = "checkpoint"  # a blocking save: the step is waiting for it
    VALIDATION = "validation"  # a pass over held-out data after a step (trainer/validation.py)
    HELD = "held"  # a `hold` fault: waiting for an outside release
    DONE = "done"
    FAILED = "failed"


# The parts of one training step, in order (what the step-time panel stacks).
STEP_PHASES = (Phase.DATA, Phase.PLAN, Phase.PIPELINE, Phase.FORWARD, Phase.BACKWARD, Phase.SYNC,
               Phase.OPTIMIZER)
# Phases whose length has nothing to do with a step: a step-sized learned hang timeout would call
# a long save or restore a hang. The start-up ones are judged by their own deadlines
# (`STARTUP_OF`), the others (a blocking save, a validation pass, a held rank) by the hard ceiling.
SLOW_PHASES = frozenset({Phase.STARTING, Phase.SETUP, Phase.DIAGNOSTICS, Phase.RENDEZVOUS, Phase.BUILD,
                         Phase.RESTORE, Phase.INIT, Phase.CALIBRATION, Phase.CHECKPOINT, Phase.VALIDATION,
                         Phase.HELD})
# Phases in which a rank has not yet trained a step of the current attempt.
STARTING_PHASES = frozenset({Phase.STARTING, Phase.SETUP, Phase.RENDEZVOUS, Phase.BUILD, Phase.RESTORE,
                             Phase.INIT, Phase.CALIBRATION})


class StartupPhase(enum.StrEnum):
    """The parts of an attempt's start, in order, each with its own deadline (health/startup.py;
    `health.startup.<phase>_s`). A rank past its phase's deadline is a hang that names the phase;
    the hang timeout (`health.hang_timeout_s`, and the one learned from step times) covers
    training steps only."""

    PLACEMENT = "placement"  # the controller reserves the nodes and starts the ranks' processes
    SETUP = "setup"  # each rank: imports, device, metrics server, Redis clients
    RENDEZVOUS = "rendezvous"  # every communication group formed
    BUILD = "build"  # the model built on the meta device, parallelized, this rank's pieces allocated
    RESTORE = "restore"  # a memory snapshot or the newest committed checkpoint read and verified
    INIT = "init"  # the initial weights, only when nothing was restored
    CALIBRATION = "calibration"  # dynamic context parallelism's cost model (only under CP)
    FIRST_STEP = "first_step"  # the attempt's first training step (first collectives, warm-up)


# The heartbeat phase -> the start-up phase whose deadline judges it. A rank in a step's phases
# before it has completed a step of its attempt is in FIRST_STEP (the monitor tells it apart by
# its step); placement happens before any rank beats.
STARTUP_OF = {Phase.STARTING: StartupPhase.SETUP, Phase.SETUP: StartupPhase.SETUP,
              Phase.RENDEZVOUS: StartupPhase.RENDEZVOUS, Phase.BUILD: StartupPhase.BUILD,
              Phase.RESTORE: StartupPhase.RESTORE, Phase.INIT: StartupPhase.INIT,
              Phase.CALIBRATION: StartupPhase.CALIBRATION}
