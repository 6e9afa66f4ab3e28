"""The words of recovery: what went wrong (`Incident`), what to do about it (`Decision`),
and what was done (`RestartRecord`, the restart budget's memory, kept in Redis by the
controller). Plain frozen data with checks; the rules that map one to the other are in
`rules.py`, their combination and the budget in `policy.py`.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

from longrun.kinds import FaultKind

# Most specific first; the first kind present picks the rule (see kinds.FaultKind).
PRECEDENCE = tuple(str(kind) for kind in FaultKind.precedence())


class Action(enum.StrEnum):
    CONTINUE = "continue"
    RESTART = "restart"
    EVICT_AND_RESTART = "evict_and_restart"
    GIVE_UP = "give_up"
    # Not a fault's answer: an elastic job grows back (health/scaling.py). It restarts the job
    # at another size without spending the restart budget.
    RESIZE = "resize"


RESTARTS = frozenset({Action.RESTART, Action.EVICT_AND_RESTART})


@dataclass(frozen=True)
class Incident:
    """One fault the controller observed; `kind` is one of PRECEDENCE."""

    kind: str
    rank: int | None = None
    node: str | None = None  # Ray node id of the rank (or the node itself), if known
    step: int | None = None  # last step seen; for nan/loss_spike the bad step
    at: float = 0.0  # controller clock, seconds
    detail: str = ""  # exception text, diagnostics reason, ...
    blame: str | None = None  # a straggler's attributed cause: "node", "data", "stage" or "rank"

    def __post_init__(self) -> None:
        if self.kind not in PRECEDENCE:
            raise ValueError(f"unknown incident kind {self.kind!r}; use one of {', '.join(PRECEDENCE)}")


@dataclass(frozen=True)
class Decision:
    action: Action
    reason: str  # one sentence for `longrun status`, naming the rule and its numbers
    evict_nodes: tuple[str, ...] = ()
    resume_before_step: int | None = None  # restore the newest checkpoint before this step; None = newest
    skip_steps: tuple[int, int] | None = None  # data window [first, last] to skip after the restart
    backoff_s: float = 0.0
    cause: Incident | None = None  # the incident whose rule fired: what `RestartRecord.of` records

    def __post_init__(self) -> None:
        # The reason is shown on one status line and kept in the job's event log.
        if "\n" in self.reason or not self.reason.endswith("."):
            raise ValueError(f"a decision's reason must be one sentence ending in '.': {self.reason!r}")
        if self.evict_nodes and self.action is not Action.EVICT_AND_RESTART:
            raise ValueError(f"only {Action.EVICT_AND_RESTART} evicts nodes, not {self.action}")


@dataclass(frozen=True)
class RestartRecord:
    """One restart that was carried out. rank and node (of the cause) feed the repeated-node rule."""

    at: float
    cause: str  # incident kind
    step: int | None = None
    rank: int | None = None
    node: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> RestartRecord:
        return cls(at=float(data["at"]), cause=str(data["cause"]), step=data.get("step"),
                   rank=data.get("rank"), node=data.get("node"))

    @classmethod
    def of(cls, decision: Decision, *, at: float, reached_step: int | None = None) -> RestartRecord:
        """The record to keep once `decision` has been carried out; its step is the cause's, or
        where the job had got to (`reached_step`) when the cause names none (a dead process)."""
        if decision.action not in RESTARTS or decision.cause is None:
            raise ValueError(f"only a restart decision with a cause is recorded, not {decision.action}")
        c = decision.cause
        return cls(at=at, cause=c.kind, step=c.step if c.step is not None else reached_step, rank=c.rank,
                   node=c.node)
