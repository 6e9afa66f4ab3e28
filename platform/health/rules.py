"""The recovery rules: one per fault kind, each looking at the incident that picked it (the
most specific one present) and the facts (every incident, the restart history), and returning
a decision before the budget is applied. Pure; `policy.decide` combines and budgets them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from longrun.config.sections import RecoverySection
from longrun.health.decisions import Action, Decision, Incident, RestartRecord

# Ranks on one node that died or hung this often within restart_window_s (this time included) get
# the node evicted: once is bad luck (a crash, an OOM), twice on the same machine is likely the
# machine; but only where another node can take its place. A process killed from outside looks
# the same and is no evidence against the node: with no replacement, the job restarts on it
# (its self-checks run before training resumes, and failing them evicts it).
REPEATS_BEFORE_EVICTION = 2
_BAD_LOSS = frozenset({"nan", "loss_spike"})
_NODE_FAULTS = frozenset({"dead", "hang"})
_MAX_DETAIL = 160  # characters of a detail quoted in a reason; a traceback belongs in the logs
_MAX_RANKS = 12  # stragglers named in a reason (a slow pipeline stage is thousands at scale)


@dataclass(frozen=True)
class Facts:
    incidents: tuple[Incident, ...]  # most specific first, duplicates dropped
    history: tuple[RestartRecord, ...]  # oldest first
    recovery: RecoverySection
    now: float
    spare_nodes: int | None = None  # live nodes that could replace one of the job's (None: unknown)
    # The job is elastic (recovery.min_nodes) and runs above a size it could shrink to: it can go
    # on without a node that has no replacement. The controller's `decide(..., can_shrink=...)`.
    can_shrink: bool = False

    @property
    def recent(self) -> tuple[RestartRecord, ...]:
        return recent(self.history, self.recovery, self.now)


# --- one rule per fault kind ---

def _rule_node_lost(i: Incident, f: Facts) -> Decision:
    if i.node is None:
        return Decision(Action.RESTART, f"node lost: {who(i)} lost its node (id unknown, "
                        f"{_count(f, 'node_lost')} reported); restart on the remaining nodes.", cause=i)
    return Decision(Action.EVICT_AND_RESTART, f"node lost: node {i.node} left the cluster "
                    f"({_count(f, 'node_lost')} lost); evict it and restart.", evict_nodes=(i.node,), cause=i)


def _rule_failed_diagnostics(i: Incident, f: Facts) -> Decision:
    failed = _count(f, "diagnostics_failed")
    what = f"node {i.node or '(unknown)'} failed its self-check ({clip(i.detail)}), {failed} node(s) failed"
    if not f.recovery.evict_on_failed_diagnostics or i.node is None:
        # A restart would land on the same broken node again.
        flag = _flag(f.recovery.evict_on_failed_diagnostics)
        return Decision(Action.GIVE_UP, f"failed diagnostics: {what}, and it cannot be evicted "
                        f"(recovery.evict_on_failed_diagnostics = {flag}); giving up.", cause=i)
    return Decision(Action.EVICT_AND_RESTART, f"failed diagnostics: {what}; evict and restart "
                    "(recovery.evict_on_failed_diagnostics = true).", evict_nodes=(i.node,), cause=i)


def _rule_dead_or_hang(i: Incident, f: Facts) -> Decision:
    verb = "died" if i.kind == "dead" else "hung"
    what = f"{who(i)} {verb}{at_step(i)}"
    repeats = _repeats_on_node(i, f)
    if repeats >= REPEATS_BEFORE_EVICTION:
        window = f.recovery.restart_window_s
        seen = f"{what}, {repeats} dead/hung ranks on node {i.node} within {window:g} s"
        if f.spare_nodes == 0:
            return Decision(Action.RESTART, f"repeated fault on node: {seen}, but no other node can take "
                            "its place; restart on it (its self-checks run first, and evict it if they "
                            "fail).", cause=i)
        return Decision(Action.EVICT_AND_RESTART, f"repeated fault on node: {seen}; evict it and restart.",
                        evict_nodes=(i.node,), cause=i)
    return Decision(Action.RESTART, f"{'dead' if i.kind == 'dead' else 'hung'} rank: {what} "
                    f"({_count(f, i.kind)} {i.kind} reported); restart.", cause=i)


def _rule_bad_loss(i: Incident, f: Facts) -> Decision:
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


def _rule_fatal(i: Incident, f: Facts) -> Decision:
    # It would recur on any node and in any attempt (a config, data or checkpoint mismatch, an
    # import or syntax error in user code): restarting only spends the budget and buries it.
    # The original message is the point, so it is quoted whole (one line), not clipped.
    message = " ".join(i.detail.split()) or "no message"
    return Decision(Action.GIVE_UP, f"fatal error: {who(i)} failed{at_step(i)} in a way no restart "
                    f"can fix ({message}), {_count(f, 'fatal')} rank(s) reported one; giving up.", cause=i)


def _rule_exception(i: Incident, f: Facts) -> Decision:
    last = f.history[-1] if f.history else None
    if last is not None and last.cause == "exception" and last.step is not None:
        again = [e for e in f.incidents if e.kind == "exception" and e.step == last.step]
        if again:
            # Replaying from a checkpoint reached the same failure: deterministic, so user code.
            e = again[0]
            return Decision(Action.GIVE_UP, f"the same exception at step {e.step} after a restart: a bug, "
                            f"not a fault; giving up ({who(e)}: {clip(e.detail)}).", cause=e)
    return Decision(Action.RESTART, f"worker exception: {who(i)} raised{at_step(i)} "
                    f"({clip(i.detail)}), {_count(f, 'exception')} rank(s) raised; restart.", cause=i)


def _rule_straggler(i: Incident, f: Facts) -> Decision:
    """Act only on a slow node (health/stragglers.py): its ranks slow together with normal data.
    Slow data or an uneven pipeline stage would be as slow on any node, and a rank slow alone on
    an otherwise normal node (a suspect GPU, or rank 0's extra duties) is no case against the
    node: those are reported, never evicted. An unattributed straggler (`blame` None: a monitor
    that did not attribute) keeps the switch's old meaning: its node is evicted. Evicting needs
    somewhere to go: a spare node (`spare_nodes` > 0, or unknown) or an elastic job that can
    shrink (`can_shrink`); without either the job would stop until a node joined, which costs
    more than a slow node. The new placement runs its self-checks before it trains."""
    slow = [x for x in f.incidents if x.kind == "straggler"]
    ranks = [str(x.rank) for x in slow if x.rank is not None]
    shown = ", ".join(ranks[:_MAX_RANKS]) + (", ..." if len(ranks) > _MAX_RANKS else "")
    listed = f"{len(slow)} straggler(s) (ranks {shown or 'unknown'})"
    suspects = [x for x in slow if x.blame in (None, "node") and x.node is not None]
    nodes = sorted({x.node for x in suspects})
    if f.recovery.evict_stragglers and nodes and (f.spare_nodes != 0 or f.can_shrink):
        if f.spare_nodes is not None and f.spare_nodes < len(nodes) and not f.can_shrink:
            nodes = nodes[: f.spare_nodes]  # as many as can be replaced; the rest stay reported
        cause = next(x for x in suspects if x.node in nodes)
        where = ("the job is elastic and can continue on fewer nodes" if f.can_shrink and not f.spare_nodes
                 else f"{f.spare_nodes} spare node(s) can take their place" if f.spare_nodes
                 else "Ray could not count the spare nodes just now (only a count of 0 holds an "
                 "eviction back)")
        return Decision(Action.EVICT_AND_RESTART, f"straggler node: {who(cause)} is slow "
                        f"({clip(cause.detail)}), {listed}; evict {', '.join(nodes)} and restart, since "
                        f"{where} (recovery.evict_stragglers = true; the new placement runs its self-checks "
                        "before training).", evict_nodes=tuple(nodes), cause=cause)
    return Decision(Action.CONTINUE, f"stragglers reported only: {listed}{_straggler_causes(slow)}; "
                    f"continue, since {_why_not_evicted(slow, nodes, f)}.", cause=i)


def _straggler_causes(slow: list[Incident]) -> str:
    counts = {b: sum(1 for x in slow if x.blame == b) for b in ("node", "data", "stage", "rank")}
    words = {"node": "on a slow node", "data": "slow from their data", "stage": "in a slow pipeline stage",
             "rank": "slow alone with normal data"}
    parts = [f"{n} {words[b]}" for b, n in counts.items() if n]
    return f", {', '.join(parts)}" if parts else ""


def _why_not_evicted(slow: list[Incident], nodes: list[str], f: Facts) -> str:
    why = []
    if nodes:
        if not f.recovery.evict_stragglers:
            why.append(f"node(s) {', '.join(nodes)} are not evicted with recovery.evict_stragglers = false")
        else:
            why.append(f"no spare node can take the place of {', '.join(nodes)} and the job cannot shrink "
                       "(recovery.min_nodes), so it trains on there rather than stop until a node joins")
    elif any(x.blame in (None, "node") for x in slow):
        why.append("recovery.evict_stragglers = false" if not f.recovery.evict_stragglers
                   else "its node is unknown, so it cannot be evicted")
    if any(x.blame in ("data", "stage") for x in slow):
        why.append("slow data or an uneven pipeline stage runs as slowly on any node, so nothing is evicted "
                   "for it")
    if any(x.blame == "rank" for x in slow):
        why.append("a rank slow alone on an otherwise normal node is a suspect GPU or process, no case "
                   "against the node")
    return "; ".join(why) or "nothing is to be evicted"


RULES: dict[str, Callable[[Incident, Facts], Decision]] = {
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


def recent(history: tuple[RestartRecord, ...] | Sequence[RestartRecord], recovery: RecoverySection,
            now: float) -> tuple[RestartRecord, ...]:
    return tuple(r for r in history if now - r.at < recovery.restart_window_s)


def _repeats_on_node(i: Incident, f: Facts) -> int:
    """Dead/hung occurrences on i's node within the window, this one included; 0 if not localised."""
    if i.node is None:
        return 0
    # A hang reported on several nodes at once is the job hanging (a stuck collective), not a node.
    if i.kind == "hang" and len({x.node for x in f.incidents if x.kind == "hang"}) > 1:
        return 0
    return 1 + sum(1 for r in f.recent if r.cause in _NODE_FAULTS and r.node == i.node)


def _count(f: Facts, kind: str) -> int:
    return sum(1 for i in f.incidents if i.kind == kind)


def who(i: Incident) -> str:
    if i.rank is not None:
        return f"rank {i.rank}" + (f" on node {i.node}" if i.node else "")
    return f"node {i.node}" if i.node else "an unknown rank"


def at_step(i: Incident) -> str:
    return f" at step {i.step}" if i.step is not None else ""


def cause_text(i: Incident | None) -> str:
    if i is None:
        return "unknown"
    where = f" on rank {i.rank}" if i.rank is not None else f" on node {i.node}" if i.node else ""
    return f"{i.kind}{where}{at_step(i)}"


def _flag(value: bool) -> str:
    return "true" if value else "false"


def clip(text: str) -> str:
    """The last non-empty line of `text` (a traceback's exception line), collapsed and bounded."""
    lines = [line for line in text.splitlines() if line.strip()]
    line = " ".join(lines[-1].split()).rstrip(".") if lines else "no detail"
    return line if len(line) <= _MAX_DETAIL else line[: _MAX_DETAIL - 3] + "..."


def extend(reason: str, more: str) -> str:
    return f"{reason[:-1]}; {more}."
