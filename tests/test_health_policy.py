"""The recovery policy, rule by rule and in combination; pure functions, so no Ray and no Redis."""

from __future__ import annotations

import json
import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from longrun.config.sections import RecoverySection
from longrun.health.policy import (
    MAX_BACKOFF_S,
    PRECEDENCE,
    Action,
    Decision,
    Incident,
    RestartRecord,
    decide,
    restart_budget_left,
)

NOW = 100_000.0
BASE = dict(max_restarts=10, max_restarts_in_window=5, restart_window_s=3600.0, restart_backoff_s=1.0,
            evict_on_failed_diagnostics=True, evict_stragglers=False, skip_after_spikes=2)


def recovery(**overrides) -> RecoverySection:
    return RecoverySection(**{**BASE, **overrides})


def past(n: int, *, every_s: float = 60.0, cause: str = "dead", step: int | None = 10,
         node: str | None = None) -> list[RestartRecord]:
    """n earlier restarts, the newest `every_s` before NOW."""
    return [RestartRecord(at=NOW - every_s * (n - k), cause=cause, step=step, rank=0, node=node)
            for k in range(n)]


def one_sentence(reason: str) -> None:
    assert "\n" not in reason and reason.endswith("."), reason
    assert re.search(r"\d", reason), f"a reason names its numbers: {reason!r}"


# --- single rules ---

def test_no_incidents_continue():
    d = decide([], [], recovery(), now=NOW)
    assert d.action is Action.CONTINUE and d.evict_nodes == () and d.backoff_s == 0
    one_sentence(d.reason)


@pytest.mark.parametrize("kind", ["dead", "hang"])
def test_dead_or_hung_rank_restarts(kind):
    d = decide([Incident(kind, rank=3, node="n1", step=40, at=NOW)], [], recovery(), now=NOW)
    assert d.action is Action.RESTART and d.evict_nodes == () and d.resume_before_step is None
    assert d.backoff_s == 1.0 and d.cause.rank == 3
    assert "rank 3 on node n1" in d.reason and "restart 1 of 10" in d.reason
    one_sentence(d.reason)


def test_repeated_dead_on_same_node_within_window_evicts():
    now_dead = [Incident("dead", rank=3, node="n1", step=40, at=NOW)]
    d = decide(now_dead, past(1, node="n1"), recovery(), now=NOW)
    assert d.action is Action.EVICT_AND_RESTART and d.evict_nodes == ("n1",)
    assert "repeated fault on node" in d.reason and "2 dead/hung ranks on node n1 within 3600 s" in d.reason
    # Outside the window, or on another node, it is bad luck again: a plain restart.
    assert decide(now_dead, past(1, every_s=4000, node="n1"), recovery(), now=NOW).action is Action.RESTART
    assert decide(now_dead, past(1, node="n2"), recovery(), now=NOW).action is Action.RESTART


def test_repeated_deaths_on_the_only_node_restart_on_it():
    """A process killed from outside twice looks like a bad node; with nowhere else to go,
    evicting it would end a recoverable job, so the job restarts on it (self-checks first)."""
    now_dead = [Incident("dead", rank=1, node="n1", step=40, at=NOW)]
    d = decide(now_dead, past(1, node="n1"), recovery(), now=NOW, spare_nodes=0)
    assert d.action is Action.RESTART and d.evict_nodes == ()
    assert "no other node can take its place; restart on it" in d.reason
    assert decide(now_dead, past(1, node="n1"), recovery(), now=NOW, spare_nodes=1).evict_nodes == ("n1",)


def test_job_wide_hang_blames_no_node():
    hung = [Incident("hang", rank=r, node=f"n{r // 2}", step=40, at=NOW) for r in range(4)]
    d = decide(hung, past(1, cause="hang", node="n0"), recovery(), now=NOW)
    assert d.action is Action.RESTART and d.evict_nodes == ()


def test_node_lost_evicts_and_explains_its_dead_ranks():
    incidents = [Incident("node_lost", node="n1", at=NOW)]
    incidents += [Incident("dead", rank=r, node="n1", step=40, at=NOW) for r in (2, 3)]
    incidents += [Incident("exception", rank=r, node="n0", step=40, at=NOW, detail="NCCL timeout")
                  for r in (0, 1)]
    d = decide(incidents, [], recovery(), now=NOW)
    assert d.action is Action.EVICT_AND_RESTART and d.evict_nodes == ("n1",)
    assert d.cause.kind == "node_lost" and d.reason.startswith("node lost: node n1")
    one_sentence(d.reason)


def test_node_lost_without_id_restarts():
    d = decide([Incident("node_lost", rank=5, at=NOW)], [], recovery(), now=NOW)
    assert d.action is Action.RESTART and d.evict_nodes == ()


def test_failed_diagnostics_alone():
    failed = {"n2": "memory check: 3 GiB free of 80", "n1": "collective check timed out"}
    d = decide([], [], recovery(), now=NOW, failed_diagnostics=failed)
    assert d.action is Action.EVICT_AND_RESTART and d.evict_nodes == ("n1", "n2")
    assert "2 node(s) failed" in d.reason
    one_sentence(d.reason)
    d = decide([], [], recovery(evict_on_failed_diagnostics=False), now=NOW, failed_diagnostics=failed)
    assert d.action is Action.GIVE_UP and d.evict_nodes == ()
    assert "recovery.evict_on_failed_diagnostics = false" in d.reason
    one_sentence(d.reason)


def test_failed_diagnostics_as_incident_and_as_mapping_agree():
    inc = [Incident("diagnostics_failed", node="n1", at=NOW, detail="compute check: wrong result")]
    by_incident = decide(inc, [], recovery(), now=NOW)
    by_mapping = decide([], [], recovery(), now=NOW, failed_diagnostics={"n1": "compute check: wrong result"})
    assert by_incident.action == by_mapping.action and by_incident.evict_nodes == by_mapping.evict_nodes
    # Both named: one node, not two incidents.
    both = decide(inc, [], recovery(), now=NOW, failed_diagnostics={"n1": "compute check: wrong result"})
    assert "1 node(s) failed" in both.reason


def test_dead_rank_on_node_that_failed_diagnostics_evicts_it():
    dead = [Incident("dead", rank=3, node="n1", step=40, at=NOW)]
    d = decide(dead, [], recovery(), now=NOW, failed_diagnostics={"n1": "memory check failed"})
    assert d.action is Action.EVICT_AND_RESTART and d.evict_nodes == ("n1",)
    d = decide(dead, [], recovery(evict_on_failed_diagnostics=False), now=NOW,
               failed_diagnostics={"n1": "memory check failed"})
    assert d.action is Action.GIVE_UP


def test_exception_restarts_once_then_same_step_is_a_bug():
    boom = [Incident("exception", rank=1, node="n0", step=40, at=NOW,
                     detail="Traceback (most recent call last):\n  File 'x.py'\nValueError: shapes differ.\n",
                     )]
    first = decide(boom, [], recovery(), now=NOW)
    assert first.action is Action.RESTART and "ValueError: shapes differ" in first.reason
    one_sentence(first.reason)
    history = [RestartRecord.of(first, at=NOW - 100)]
    again = decide(boom, history, recovery(), now=NOW)
    assert again.action is Action.GIVE_UP
    assert again.reason.startswith("the same exception at step 40 after a restart: a bug, not a fault")
    one_sentence(again.reason)
    # At another step, or after a restart for another cause, it may still be a fault.
    assert decide(boom, past(1, cause="exception", step=39), recovery(), now=NOW).action is Action.RESTART
    assert decide(boom, past(1, cause="dead", step=40), recovery(), now=NOW).action is Action.RESTART


def test_a_fatal_error_gives_up_at_once_with_its_whole_message():
    message = ("rank 2 raised DataError: cannot resume the data order: the saved sampler has "
               "num_docs = 20, this one 31 (the data, seed or data-parallel layout changed)")
    fatal = Incident("fatal", rank=2, node="n1", step=0, at=NOW, detail=message)
    echoes = [Incident("exception", rank=3, node="n1", at=NOW, detail="rank 3 raised RuntimeError: gloo"),
              Incident("dead", rank=0, node="n0", step=5, at=NOW)]
    for incidents in ([fatal], [fatal, *echoes]):
        d = decide(incidents, [], recovery(), now=NOW)  # the whole budget is left
        assert d.action is Action.GIVE_UP and d.cause == fatal and d.backoff_s == 0
        assert message in d.reason and "restart 1 of" not in d.reason
        one_sentence(d.reason)


def test_dead_rank_beats_its_peers_exceptions_at_the_same_step():
    incidents = [Incident("exception", rank=r, node="n0", step=40, at=NOW, detail="gloo closed")
                 for r in (0, 1)]
    incidents.append(Incident("dead", rank=2, node="n1", step=40, at=NOW))
    d = decide(incidents, past(1, cause="exception", step=40), recovery(), now=NOW)
    assert d.action is Action.RESTART and d.cause.kind == "dead"


@pytest.mark.parametrize("kind", ["nan", "loss_spike"])
def test_bad_loss_restores_before_the_bad_step(kind):
    d = decide([Incident(kind, step=120, at=NOW)], [], recovery(), now=NOW)
    assert d.action is Action.RESTART and d.resume_before_step == 120 and d.skip_steps is None
    assert "step 120" in d.reason
    one_sentence(d.reason)


def test_repeated_spikes_at_the_same_step_skip_the_data_window():
    spike = [Incident("loss_spike", step=120, at=NOW)]
    # skip_after_spikes counts this spike too: 2 means the data gets one retry, then is skipped.
    d = decide(spike, past(1, cause="nan", step=120), recovery(skip_after_spikes=2), now=NOW)
    assert d.resume_before_step == 120 and d.skip_steps == (120, 120)
    assert "seen 2 times (recovery.skip_after_spikes = 2)" in d.reason
    one_sentence(d.reason)
    three = recovery(skip_after_spikes=3)
    assert decide(spike, past(1, cause="nan", step=120), three, now=NOW).skip_steps is None
    assert decide(spike, past(1, cause="loss_spike", step=99), recovery(), now=NOW).skip_steps is None
    assert decide(spike, [], recovery(skip_after_spikes=1), now=NOW).skip_steps == (120, 120)


def test_stragglers_are_reported_unless_eviction_is_on():
    slow = [Incident("straggler", rank=r, node=f"n{r}", step=40, at=NOW, detail="step 2.1x median")
            for r in (5, 3)]
    d = decide(slow, [], recovery(), now=NOW)
    assert d.action is Action.CONTINUE and d.backoff_s == 0
    assert "2 straggler(s) (ranks 3, 5)" in d.reason
    one_sentence(d.reason)
    d = decide(slow, [], recovery(evict_stragglers=True), now=NOW)
    assert d.action is Action.EVICT_AND_RESTART and d.evict_nodes == ("n3", "n5")
    unknown = [Incident("straggler", rank=3, at=NOW)]
    assert decide(unknown, [], recovery(evict_stragglers=True), now=NOW).action is Action.CONTINUE


# --- budget and interplay ---

def test_budget_spent_gives_up_with_the_last_cause():
    d = decide([Incident("hang", rank=3, node="n1", at=NOW)], past(10, every_s=4000), recovery(), now=NOW)
    assert d.action is Action.GIVE_UP
    assert d.reason == ("restart budget spent: 10 restarts (recovery.max_restarts = 10); "
                        "last cause: hang on rank 3.")
    none_allowed = decide([Incident("dead", rank=0, at=NOW)], [], recovery(max_restarts=0), now=NOW)
    assert none_allowed.action is Action.GIVE_UP


@pytest.mark.parametrize("incident", [
    Incident("node_lost", node="n1"), Incident("diagnostics_failed", node="n1", detail="memory"),
    Incident("dead", rank=1), Incident("hang", rank=1), Incident("nan", step=7),
    Incident("loss_spike", step=7), Incident("exception", rank=1, step=7, detail="boom"),
    Incident("straggler", rank=1, node="n1"),
])
def test_budget_beats_every_rule_that_would_restart(incident):
    d = decide([incident], past(3, every_s=4000), recovery(max_restarts=3, evict_stragglers=True), now=NOW)
    assert d.action is Action.GIVE_UP and d.reason.startswith("restart budget spent: 3 restarts")
    assert d.evict_nodes == () and d.skip_steps is None


def test_continue_does_not_need_or_spend_budget():
    slow = [Incident("straggler", rank=3, node="n3", at=NOW)]
    history = past(10, every_s=10)
    assert restart_budget_left(history, recovery(), NOW) == (0, 0)
    d = decide(slow, history, recovery(), now=NOW)
    assert d.action is Action.CONTINUE
    with pytest.raises(ValueError, match="only a restart decision"):
        RestartRecord.of(d, at=NOW)


def test_storm_within_window_vs_spaced_restarts():
    dead = [Incident("dead", rank=0, node="n0", at=NOW)]
    storm = decide(dead, past(5, every_s=60), recovery(), now=NOW)
    assert storm.action is Action.GIVE_UP
    assert storm.reason == ("restart storm: 5 restarts in the last 3600 s "
                            "(recovery.max_restarts_in_window = 5); last cause: dead on rank 0.")
    spaced = decide(dead, past(5, every_s=3601), recovery(), now=NOW)
    assert spaced.action is Action.RESTART and spaced.backoff_s == 1.0
    assert "this is restart 6 of 10, 1 of 5 within 3600 s" in spaced.reason


def test_backoff_doubles_per_recent_restart_and_is_capped():
    dead = [Incident("dead", rank=0, at=NOW)]
    roomy = recovery(max_restarts=100, max_restarts_in_window=50)
    waits = [decide(dead, past(n), roomy, now=NOW).backoff_s for n in range(8)]
    assert waits == [1, 2, 4, 8, 16, 32, MAX_BACKOFF_S, MAX_BACKOFF_S]
    assert decide(dead, past(3), recovery(restart_backoff_s=0.0), now=NOW).backoff_s == 0.0


def test_backoff_starts_again_from_the_base_once_the_job_trains_past_its_last_fault():
    roomy = recovery(max_restarts=100, max_restarts_in_window=50)
    # A fault every minute, each further on than the last: the job trains between them.
    progressing = [RestartRecord(at=NOW - 60.0 * (4 - k), cause="dead", step=10 * (k + 1), rank=0)
                   for k in range(4)]
    assert decide([Incident("dead", rank=0, step=55, at=NOW)], progressing, roomy, now=NOW).backoff_s == 1.0
    # The same faults, but this one came before the job got past step 40: it doubles per
    # restart back to the last one that was followed by progress (40 > 30).
    assert decide([Incident("dead", rank=0, step=40, at=NOW)], progressing, roomy, now=NOW).backoff_s == 2.0
    # A dead process names no step: where the job had got to stands in for it.
    dead = [Incident("dead", rank=0, at=NOW)]
    assert decide(dead, progressing, roomy, now=NOW, reached_step=55).backoff_s == 1.0
    assert decide(dead, progressing, roomy, now=NOW).backoff_s == 2.0  # unknown: no further than the last
    restart = decide(dead, [], roomy, now=NOW, reached_step=55)
    assert RestartRecord.of(restart, at=NOW, reached_step=55).step == 55
    stuck = [RestartRecord(at=NOW - 60.0 * (4 - k), cause="dead", step=40, rank=0) for k in range(4)]
    assert decide([Incident("dead", rank=0, step=40, at=NOW)], stuck, roomy, now=NOW).backoff_s == 16.0


def test_evictions_are_the_union_and_restore_point_survives():
    incidents = [
        Incident("nan", step=120, at=NOW),
        Incident("straggler", rank=6, node="n3", at=NOW),
        Incident("node_lost", node="n1", at=NOW),
        Incident("dead", rank=1, node="n0", at=NOW),
    ]
    d = decide(incidents, past(1, node="n0"), recovery(evict_stragglers=True), now=NOW,
               failed_diagnostics={"n2": "store unreachable"})
    assert d.action is Action.EVICT_AND_RESTART and d.cause.kind == "node_lost"
    assert d.evict_nodes == ("n0", "n1", "n2", "n3")
    assert d.resume_before_step == 120
    assert "also evicting n0, n2, n3" in d.reason
    one_sentence(d.reason)


def test_nan_with_straggler_eviction_keeps_restore_point():
    incidents = [Incident("straggler", rank=6, node="n3", at=NOW), Incident("nan", step=120, at=NOW)]
    d = decide(incidents, [], recovery(evict_stragglers=True), now=NOW)
    assert d.action is Action.EVICT_AND_RESTART and d.evict_nodes == ("n3",) and d.resume_before_step == 120


def test_failed_diagnostics_without_eviction_blocks_a_node_lost_restart():
    d = decide([Incident("node_lost", node="n1", at=NOW)], [], recovery(evict_on_failed_diagnostics=False),
               now=NOW, failed_diagnostics={"n2": "compute check failed"})
    assert d.action is Action.GIVE_UP and "failed diagnostics" in d.reason


def test_restart_budget_left():
    history = past(3, every_s=4000) + past(2, every_s=60)
    assert restart_budget_left(history, recovery(), NOW) == (5, 3)
    assert restart_budget_left([], recovery(), NOW) == (10, 5)
    assert restart_budget_left(past(12), recovery(), NOW) == (0, 0)


# --- records and validation ---

def test_restart_record_round_trips_through_json():
    d = decide([Incident("dead", rank=3, node="n1", step=40, at=NOW)], [], recovery(), now=NOW)
    record = RestartRecord.of(d, at=NOW)
    assert record == RestartRecord(at=NOW, cause="dead", step=40, rank=3, node="n1")
    assert RestartRecord.from_dict(json.loads(json.dumps(record.to_dict()))) == record
    assert RestartRecord.from_dict({"at": 5, "cause": "nan"}) == RestartRecord(at=5.0, cause="nan")


def test_bad_inputs_are_refused():
    with pytest.raises(ValueError, match="unknown incident kind 'oom'"):
        Incident("oom", rank=1)
    with pytest.raises(ValueError, match="one sentence"):
        Decision(Action.RESTART, "two\nlines.")
    with pytest.raises(ValueError, match="evicts nodes"):
        Decision(Action.RESTART, "x 1.", evict_nodes=("n1",))


# --- properties over arbitrary inputs ---

incident_st = st.builds(
    Incident,
    kind=st.sampled_from(PRECEDENCE),
    rank=st.none() | st.integers(0, 7),
    node=st.none() | st.sampled_from(["n0", "n1", "n2"]),
    step=st.none() | st.integers(0, 50),
    at=st.floats(NOW - 100, NOW),
    detail=st.text(max_size=300),
)
record_st = st.builds(
    RestartRecord,
    at=st.floats(NOW - 20_000, NOW),
    cause=st.sampled_from(PRECEDENCE),
    step=st.none() | st.integers(0, 50),
    rank=st.none() | st.integers(0, 7),
    node=st.none() | st.sampled_from(["n0", "n1", "n2"]),
)
recovery_st = st.builds(
    recovery,
    max_restarts=st.integers(0, 12),
    max_restarts_in_window=st.integers(1, 6),
    restart_window_s=st.sampled_from([60.0, 3600.0]),
    restart_backoff_s=st.sampled_from([0.0, 1.0, 10.0]),
    evict_on_failed_diagnostics=st.booleans(),
    evict_stragglers=st.booleans(),
    skip_after_spikes=st.integers(1, 3),
)


@settings(max_examples=300, deadline=None)
@given(incidents=st.lists(incident_st, max_size=8), history=st.lists(record_st, max_size=12),
       rec=recovery_st, diag=st.dictionaries(st.sampled_from(["n0", "n1", "n2"]), st.text(max_size=40),
                                             max_size=2), data=st.data())
def test_decisions_are_deterministic_and_well_formed(incidents, history, rec, diag, data):
    d = decide(incidents, history, rec, now=NOW, failed_diagnostics=diag)
    shuffled = decide(data.draw(st.permutations(incidents)), history, rec, now=NOW, failed_diagnostics=diag)
    assert d == shuffled
    one_sentence(d.reason)
    assert (d.action is Action.EVICT_AND_RESTART) == bool(d.evict_nodes)
    assert list(d.evict_nodes) == sorted(set(d.evict_nodes))
    assert 0.0 <= d.backoff_s <= MAX_BACKOFF_S
    total_left, window_left = restart_budget_left(history, rec, NOW)
    if d.action in (Action.RESTART, Action.EVICT_AND_RESTART):
        assert total_left > 0 and window_left > 0
        RestartRecord.of(d, at=NOW)
    else:
        assert d.backoff_s == 0.0 and d.resume_before_step is None and d.skip_steps is None
    if not incidents and not diag:
        assert d.action is Action.CONTINUE
