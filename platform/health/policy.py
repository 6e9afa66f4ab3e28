"""Recovery policy: from what went wrong (incidents) and what was already tried (restart history)
to one decision: continue, restart, evict a node and restart, or give up.

Pure functions with no I/O and no clock: the controller passes `now`, keeps the history (in Redis,
via `RestartRecord.to_dict`) and executes the decision. So every rule is tested without Ray, and
replaying an input gives the same decision.

Incidents usually come in groups (a dead rank takes its peers' collectives down and they report
exceptions too), so the most specific incident picks the rule (`PRECEDENCE`, one rule per kind in
`rules.py`), while evictions and the restore point take every incident into account. The restart
budget is checked last and only when the chosen rule would restart: reporting a straggler never
spends it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace

from longrun.config.sections import RecoverySection
from longrun.health.decisions import PRECEDENCE, RESTARTS, Action, Decision, Incident, RestartRecord
from longrun.health.rules import REPEATS_BEFORE_EVICTION, RULES, Facts, cause_text, extend, recent

__all__ = ["MAX_BACKOFF_S", "PRECEDENCE", "REPEATS_BEFORE_EVICTION", "Action", "Decision", "Incident",
           "RestartRecord", "decide", "restart_budget_left"]

MAX_BACKOFF_S = 60.0


def decide(incidents: Sequence[Incident], history: Sequence[RestartRecord], recovery: RecoverySection,
           *, now: float, failed_diagnostics: Mapping[str, str] | None = None,
           spare_nodes: int | None = None, restarts_total: int | None = None,
           reached_step: int | None = None, can_shrink: bool = False) -> Decision:
    """What to do about `incidents`, given the restarts in `history`.

    `failed_diagnostics` (node id -> reason) counts as one diagnostics_failed incident per node.
    `spare_nodes`: live nodes, beyond the job's and never evicted, that could take one of its
    nodes' place (None: unknown); a node is evicted for repeated faults only where one can.
    `restarts_total`: every restart so far, when `history` keeps only the recent ones (None:
    `history` is all of them); recovery.max_restarts counts it. `reached_step`: the newest step
    the job reached, what a fault that names no step of its own (a dead process) is placed at
    when the backoff asks whether the job got further than its last fault. `can_shrink`: the job
    is elastic and runs above a size it could shrink to (a slow node is evicted only where a spare
    or a shrink can take its place).
    """
    facts = _gather(incidents, history, recovery, now, failed_diagnostics or {}, spare_nodes, can_shrink)
    used = max(len(history), restarts_total or 0)
    if not facts.incidents:
        return Decision(Action.CONTINUE, "no incidents: 0 reported, continue.")
    primary, *others = facts.incidents
    decision = RULES[primary.kind](primary, facts)
    if decision.action not in RESTARTS:
        return decision
    decision = _fold_in(decision, others, facts)
    if decision.action not in RESTARTS:
        return decision
    return _within_budget(decision, facts, used, reached_step)


def restart_budget_left(history: Sequence[RestartRecord], recovery: RecoverySection,
                        now: float, restarts_total: int | None = None) -> tuple[int, int]:
    """(restarts left in total, restarts left in the current window), for status output."""
    in_window = len(recent(tuple(history), recovery, now))
    return (max(0, recovery.max_restarts - max(len(history), restarts_total or 0)),
            max(0, recovery.max_restarts_in_window - in_window))


def _fold_in(decision: Decision, others: Sequence[Incident], f: Facts) -> Decision:
    """The primary rule's restart, plus every other incident's evictions and restore point."""
    verdicts = [RULES[i.kind](i, f) for i in others]
    for v in verdicts:
        # A node that fails self-check and may not be evicted blocks any restart, whatever came first.
        if v.action is Action.GIVE_UP and v.cause is not None and v.cause.kind == "diagnostics_failed":
            return v
    restarts = [decision, *(v for v in verdicts if v.action in RESTARTS)]
    evict = sorted({n for v in restarts for n in v.evict_nodes})
    extra = [n for n in evict if n not in decision.evict_nodes]
    reason = decision.reason if not extra else extend(
        decision.reason, f"also evicting {', '.join(extra)} for {len(verdicts)} other incident(s)")
    # Restore before the earliest bad step any incident saw; its skip window comes with it.
    bad = min((v for v in restarts if v.resume_before_step is not None),
              key=lambda v: v.resume_before_step, default=None)
    return replace(decision, reason=reason, evict_nodes=tuple(evict),
                   action=Action.EVICT_AND_RESTART if evict else Action.RESTART,
                   resume_before_step=bad.resume_before_step if bad else None,
                   skip_steps=bad.skip_steps if bad else None)


def _within_budget(decision: Decision, f: Facts, used: int, reached_step: int | None = None) -> Decision:
    r, in_window = f.recovery, len(f.recent)
    cause = cause_text(decision.cause)
    if used >= r.max_restarts:
        return Decision(Action.GIVE_UP, f"restart budget spent: {used} restarts (recovery.max_restarts = "
                        f"{r.max_restarts}); last cause: {cause}.", cause=decision.cause)
    if in_window >= r.max_restarts_in_window:
        return Decision(Action.GIVE_UP, f"restart storm: {in_window} restarts in the last "
                        f"{r.restart_window_s:g} s (recovery.max_restarts_in_window = "
                        f"{r.max_restarts_in_window}); last cause: {cause}.", cause=decision.cause)
    # Doubling per restart that got no further gives a flapping dependency (storage, the store)
    # time to recover; a job that trains past its last fault starts again from the base backoff,
    # or a long job with a fault every few minutes would spend its hour waiting.
    fault_step = decision.cause.step if decision.cause is not None else None
    stalled = _restarts_without_progress(f.recent, reached_step if fault_step is None else fault_step)
    backoff = min(MAX_BACKOFF_S, r.restart_backoff_s * 2.0 ** min(stalled, 1000))
    return replace(decision, backoff_s=backoff, reason=extend(
        decision.reason, f"this is restart {used + 1} of {r.max_restarts}, {in_window + 1} of "
        f"{r.max_restarts_in_window} within {r.restart_window_s:g} s, after {backoff:g} s backoff"))


def _restarts_without_progress(recent_restarts: Sequence[RestartRecord], fault_step: int | None) -> int:
    """How many of the newest recent restarts in a row were followed by a fault at no later
    step (the job never got past where it had failed). A step that is not known counts as no
    progress: the backoff errs on the side of waiting."""
    stalled, later = 0, fault_step
    for record in sorted(recent_restarts, key=lambda r: r.at, reverse=True):
        if later is not None and record.step is not None and later > record.step:
            break
        stalled, later = stalled + 1, record.step
    return stalled


def _gather(incidents: Sequence[Incident], history: Sequence[RestartRecord], recovery: RecoverySection,
            now: float, failed_diagnostics: Mapping[str, str], spare_nodes: int | None,
            can_shrink: bool = False) -> Facts:
    named = {i.node for i in incidents if i.kind == "diagnostics_failed"}
    extra = [Incident("diagnostics_failed", node=node, at=now, detail=why)
             for node, why in sorted(failed_diagnostics.items()) if node not in named]
    return Facts(incidents=tuple(sorted(set(incidents) | set(extra), key=_order)),
                 history=tuple(sorted(history, key=lambda r: r.at)), recovery=recovery, now=now,
                 spare_nodes=spare_nodes, can_shrink=can_shrink)


def _order(i: Incident) -> tuple:
    # Total order over every field: the same incidents in any order pick the same primary.
    return (PRECEDENCE.index(i.kind), i.rank is None, i.rank or 0, i.node is None, i.node or "",
            i.step is None, i.step or 0, i.at, i.detail)
