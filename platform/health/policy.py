"""Recovery policy: from what went wrong (incidents) and what was already tried (restart history)
to one decision: continue, restart, evict a node and restart, or give up.

Pure functions with no I/O and no clock: the controller passes `now`, keeps the history (in Redis,
via `RestartRecord.to_dict`) and executes the decision. So every rule is tested without Ray, and
replaying an input gives the same decision.

Incidents usually come in groups (a dead rank takes its peers' collectives down and they report
exceptions too), so the most specific incident picks the rule (`PRECEDENCE`), while evictions and
the restore point take every incident into account. The restart budget is checked last and only
when the chosen rule would restart: reporting a straggler never spends it.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, replace
from typing import Any

from longrun.config.sections import RecoverySection
from longrun.kinds import FaultKind

# Most specific first; the first kind present picks the rule (see kinds.FaultKind).
PRECEDENCE = tuple(str(kind) for kind in FaultKind.precedence())
# Ranks on one node that died or hung this often within restart_window_s (this time included) get
# the node evicted: once is bad luck (a crash, an OOM), twice on the same machine is the machine.
REPEATS_BEFORE_EVICTION = 2
MAX_BACKOFF_S = 60.0
_BAD_LOSS = frozenset({"nan", "loss_spike"})
_NODE_FAULTS = frozenset({"dead", "hang"})
_MAX_DETAIL = 160  # characters of a detail quoted in a reason; a traceback belongs in the logs


class Action(enum.StrEnum):
    CONTINUE = "continue"
    RESTART = "restart"
    EVICT_AND_RESTART = "evict_and_restart"
    GIVE_UP = "give_up"


_RESTARTS = frozenset({Action.RESTART, Action.EVICT_AND_RESTART})


@dataclass(frozen=True)
class Incident:
    """One fault the controller observed; `kind` is one of PRECEDENCE."""

    kind: str
    rank: int | None = None
    node: str | None = None  # Ray node id of the rank (or the node itself), if known
    step: int | None = None  # last step seen; for nan/loss_spike the bad step
    at: float = 0.0  # controller clock, seconds
    detail: str = ""  # exception text, diagnostics reason, ...

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
    def of(cls, decision: Decision, *, at: float) -> RestartRecord:
        """The record to keep once `decision` has been carried out."""
        if decision.action not in _RESTARTS or decision.cause is None:
            raise ValueError(f"only a restart decision with a cause is recorded, not {decision.action}")
        c = decision.cause
        return cls(at=at, cause=c.kind, step=c.step, rank=c.rank, node=c.node)


@dataclass(frozen=True)
class _Facts:
    incidents: tuple[Incident, ...]  # most specific first, duplicates dropped
    history: tuple[RestartRecord, ...]  # oldest first
    recovery: RecoverySection
    now: float

    @property
    def recent(self) -> tuple[RestartRecord, ...]:
        return _recent(self.history, self.recovery, self.now)


def decide(incidents: Sequence[Incident], history: Sequence[RestartRecord], recovery: RecoverySection,
           *, now: float, failed_diagnostics: Mapping[str, str] | None = None) -> Decision:
    """What to do about `incidents`, given the restarts in `history`.

    `failed_diagnostics` (node id -> reason) counts as one diagnostics_failed incident per node.
    """
    facts = _gather(incidents, history, recovery, now, failed_diagnostics or {})
    if not facts.incidents:
        return Decision(Action.CONTINUE, "no incidents: 0 reported, continue.")
    primary, *others = facts.incidents
    decision = _RULES[primary.kind](primary, facts)
    if decision.action not in _RESTARTS:
        return decision
    decision = _fold_in(decision, others, facts)
    if decision.action not in _RESTARTS:
        return decision
    return _within_budget(decision, facts)


def restart_budget_left(history: Sequence[RestartRecord], recovery: RecoverySection,
                        now: float) -> tuple[int, int]:
    """(restarts left in total, restarts left in the current window), for status output."""
    in_window = len(_recent(tuple(history), recovery, now))
    return (max(0, recovery.max_restarts - len(history)),
            max(0, recovery.max_restarts_in_window - in_window))


# --- the rules: each looks at the incident that picked it and returns a decision before budget ---

def _rule_node_lost(i: Incident, f: _Facts) -> Decision:
    if i.node is None:
        return Decision(Action.RESTART, f"node lost: {_who(i)} lost its node (id unknown, "
                        f"{_count(f, 'node_lost')} reported); restart on the remaining nodes.", cause=i)
    return Decision(Action.EVICT_AND_RESTART, f"node lost: node {i.node} left the cluster "
                    f"({_count(f, 'node_lost')} lost); evict it and restart.", evict_nodes=(i.node,), cause=i)


def _rule_failed_diagnostics(i: Incident, f: _Facts) -> Decision:
    failed = _count(f, "diagnostics_failed")
    what = f"node {i.node or '(unknown)'} failed its self-check ({_clip(i.detail)}), {failed} node(s) failed"
    if not f.recovery.evict_on_failed_diagnostics or i.node is None:
        # A restart would land on the same broken node again.
        flag = _flag(f.recovery.evict_on_failed_diagnostics)
        return Decision(Action.GIVE_UP, f"failed diagnostics: {what}, and it cannot be evicted "
                        f"(recovery.evict_on_failed_diagnostics = {flag}); giving up.", cause=i)
    return Decision(Action.EVICT_AND_RESTART, f"failed diagnostics: {what}; evict and restart "
                    "(recovery.evict_on_failed_diagnostics = true).", evict_nodes=(i.node,), cause=i)


def _rule_dead_or_hang(i: Incident, f: _Facts) -> Decision:
    verb = "died" if i.kind == "dead" else "hung"
    what = f"{_who(i)} {verb}{_at_step(i)}"
    repeats = _repeats_on_node(i, f)
    if repeats >= REPEATS_BEFORE_EVICTION:
        window = f.recovery.restart_window_s
        return Decision(Action.EVICT_AND_RESTART, f"repeated fault on node: {what}, {repeats} dead/hung "
                        f"ranks on node {i.node} within {window:g} s; evict it and restart.",
                        evict_nodes=(i.node,), cause=i)
    return Decision(Action.RESTART, f"{'dead' if i.kind == 'dead' else 'hung'} rank: {what} "
                    f"({_count(f, i.kind)} {i.kind} reported); restart.", cause=i)


def _rule_bad_loss(i: Incident, f: _Facts) -> Decision:
    name = "non-finite loss" if i.kind == "nan" else "loss spike"
    if i.step is None:
        return Decision(Action.RESTART, f"{name}: step unknown ({_count(f, i.kind)} reported); "
                        "restart from the newest checkpoint.", cause=i)
    # Counted with this one included, so skip_after_spikes = 1 skips at once and 2 retries the data once.
    seen = 1 + sum(1 for r in f.history if r.cause in _BAD_LOSS and r.step == i.step)
    limit = f.recovery.skip_after_spikes
    if seen >= limit:
        return Decision(Action.RESTART, f"repeated bad loss at the same data: {name} at step {i.step}, "
                        f"seen {seen} times (recovery.skip_after_spikes = {limit}); restart from before "
                        f"step {i.step} and skip step {i.step}'s data.",
                        resume_before_step=i.step, skip_steps=(i.step, i.step), cause=i)
    return Decision(Action.RESTART, f"{name}: at step {i.step}, seen {seen} time(s) of {limit} before its "
                    f"data is skipped; restart from the newest checkpoint before step {i.step}.",
                    resume_before_step=i.step, cause=i)


def _rule_fatal(i: Incident, f: _Facts) -> Decision:
    # It would recur on any node and in any attempt (a config, data or checkpoint mismatch, an
    # import or syntax error in user code): restarting only spends the budget and buries it.
    # The original message is the point, so it is quoted whole (one line), not clipped.
    message = " ".join(i.detail.split()) or "no message"
    return Decision(Action.GIVE_UP, f"fatal error: {_who(i)} failed{_at_step(i)} in a way no restart "
                    f"can fix ({message}); giving up.", cause=i)


def _rule_exception(i: Incident, f: _Facts) -> Decision:
    last = f.history[-1] if f.history else None
    if last is not None and last.cause == "exception" and last.step is not None:
        again = [e for e in f.incidents if e.kind == "exception" and e.step == last.step]
        if again:
            # Replaying from a checkpoint reached the same failure: deterministic, so user code.
            e = again[0]
            return Decision(Action.GIVE_UP, f"the same exception at step {e.step} after a restart: a bug, "
                            f"not a fault; giving up ({_who(e)}: {_clip(e.detail)}).", cause=e)
    return Decision(Action.RESTART, f"worker exception: {_who(i)} raised{_at_step(i)} "
                    f"({_clip(i.detail)}), {_count(f, 'exception')} rank(s) raised; restart.", cause=i)


def _rule_straggler(i: Incident, f: _Facts) -> Decision:
    if f.recovery.evict_stragglers and i.node is not None:
        return Decision(Action.EVICT_AND_RESTART, f"straggler: {_who(i)} is slow ({_clip(i.detail)}); "
                        "evict its node and restart (recovery.evict_stragglers = true).",
                        evict_nodes=(i.node,), cause=i)
    slow = [x for x in f.incidents if x.kind == "straggler"]
    ranks = ", ".join(str(x.rank) for x in slow if x.rank is not None) or "unknown"
    why = ("recovery.evict_stragglers = false" if not f.recovery.evict_stragglers
           else "its node is unknown, so it cannot be evicted")
    return Decision(Action.CONTINUE, f"stragglers reported only: {len(slow)} straggler(s) (ranks {ranks}); "
                    f"continue, since {why}.", cause=i)


_RULES: dict[str, Callable[[Incident, _Facts], Decision]] = {
    "node_lost": _rule_node_lost,
    "diagnostics_failed": _rule_failed_diagnostics,
    "fatal": _rule_fatal,
    "dead": _rule_dead_or_hang,
    "hang": _rule_dead_or_hang,
    "nan": _rule_bad_loss,
    "loss_spike": _rule_bad_loss,
    "exception": _rule_exception,
    "straggler": _rule_straggler,
}


# --- combining and budgeting ---

def _fold_in(decision: Decision, others: Sequence[Incident], f: _Facts) -> Decision:
    """The primary rule's restart, plus every other incident's evictions and restore point."""
    verdicts = [_RULES[i.kind](i, f) for i in others]
    for v in verdicts:
        # A node that fails self-check and may not be evicted blocks any restart, whatever came first.
        if v.action is Action.GIVE_UP and v.cause is not None and v.cause.kind == "diagnostics_failed":
            return v
    restarts = [decision, *(v for v in verdicts if v.action in _RESTARTS)]
    evict = sorted({n for v in restarts for n in v.evict_nodes})
    extra = [n for n in evict if n not in decision.evict_nodes]
    reason = decision.reason if not extra else _extend(
        decision.reason, f"also evicting {', '.join(extra)} for {len(verdicts)} other incident(s)")
    # Restore before the earliest bad step any incident saw; its skip window comes with it.
    bad = min((v for v in restarts if v.resume_before_step is not None),
              key=lambda v: v.resume_before_step, default=None)
    return replace(decision, reason=reason, evict_nodes=tuple(evict),
                   action=Action.EVICT_AND_RESTART if evict else Action.RESTART,
                   resume_before_step=bad.resume_before_step if bad else None,
                   skip_steps=bad.skip_steps if bad else None)


def _within_budget(decision: Decision, f: _Facts) -> Decision:
    r, used, recent = f.recovery, len(f.history), len(f.recent)
    cause = _cause(decision.cause)
    if used >= r.max_restarts:
        return Decision(Action.GIVE_UP, f"restart budget spent: {used} restarts (recovery.max_restarts = "
                        f"{r.max_restarts}); last cause: {cause}.", cause=decision.cause)
    if recent >= r.max_restarts_in_window:
        return Decision(Action.GIVE_UP, f"restart storm: {recent} restarts in the last "
                        f"{r.restart_window_s:g} s (recovery.max_restarts_in_window = "
                        f"{r.max_restarts_in_window}); last cause: {cause}.", cause=decision.cause)
    # Doubling per recent restart gives a flapping dependency (storage, the store) time to recover.
    backoff = min(MAX_BACKOFF_S, r.restart_backoff_s * 2.0 ** min(recent, 1000))
    return replace(decision, backoff_s=backoff, reason=_extend(
        decision.reason, f"this is restart {used + 1} of {r.max_restarts}, {recent + 1} of "
        f"{r.max_restarts_in_window} within {r.restart_window_s:g} s, after {backoff:g} s backoff"))


# --- helpers ---

def _gather(incidents: Sequence[Incident], history: Sequence[RestartRecord], recovery: RecoverySection,
            now: float, failed_diagnostics: Mapping[str, str]) -> _Facts:
    named = {i.node for i in incidents if i.kind == "diagnostics_failed"}
    extra = [Incident("diagnostics_failed", node=node, at=now, detail=why)
             for node, why in sorted(failed_diagnostics.items()) if node not in named]
    return _Facts(incidents=tuple(sorted(set(incidents) | set(extra), key=_order)),
                  history=tuple(sorted(history, key=lambda r: r.at)), recovery=recovery, now=now)


def _order(i: Incident) -> tuple:
    # Total order over every field: the same incidents in any order pick the same primary.
    return (PRECEDENCE.index(i.kind), i.rank is None, i.rank or 0, i.node is None, i.node or "",
            i.step is None, i.step or 0, i.at, i.detail)


def _recent(history: tuple[RestartRecord, ...] | Sequence[RestartRecord], recovery: RecoverySection,
            now: float) -> tuple[RestartRecord, ...]:
    return tuple(r for r in history if now - r.at < recovery.restart_window_s)


def _repeats_on_node(i: Incident, f: _Facts) -> int:
    """Dead/hung occurrences on i's node within the window, this one included; 0 if not localised."""
    if i.node is None:
        return 0
    # A hang reported on several nodes at once is the job hanging (a stuck collective), not a node.
    if i.kind == "hang" and len({x.node for x in f.incidents if x.kind == "hang"}) > 1:
        return 0
    return 1 + sum(1 for r in f.recent if r.cause in _NODE_FAULTS and r.node == i.node)


def _count(f: _Facts, kind: str) -> int:
    return sum(1 for i in f.incidents if i.kind == kind)


def _who(i: Incident) -> str:
    if i.rank is not None:
        return f"rank {i.rank}" + (f" on node {i.node}" if i.node else "")
    return f"node {i.node}" if i.node else "an unknown rank"


def _at_step(i: Incident) -> str:
    return f" at step {i.step}" if i.step is not None else ""


def _cause(i: Incident | None) -> str:
    if i is None:
        return "unknown"
    where = f" on rank {i.rank}" if i.rank is not None else f" on node {i.node}" if i.node else ""
    return f"{i.kind}{where}{_at_step(i)}"


def _flag(value: bool) -> str:
    return "true" if value else "false"


def _clip(text: str) -> str:
    """The last non-empty line of `text` (a traceback's exception line), collapsed and bounded."""
    lines = [line for line in text.splitlines() if line.strip()]
    line = " ".join(lines[-1].split()).rstrip(".") if lines else "no detail"
    return line if len(line) <= _MAX_DETAIL else line[: _MAX_DETAIL - 3] + "..."


def _extend(reason: str, more: str) -> str:
    return f"{reason[:-1]}; {more}."
