from __future__ import annotations

import pytest

from longrun.controller.job_state import MAX_EVENTS, JobRecordStore
from longrun.controller.state import InvalidTransition, JobState, JobStateMachine
from longrun.health.policy import Action, Decision, Incident

RESTART = Decision(Action.RESTART, "dead rank: rank 1 died; restart.", backoff_s=2.0,
                   cause=Incident("dead", rank=1))


def _decision_for(target: JobState) -> Decision | None:
    return RESTART if target is JobState.RECOVERING else None


def test_happy_path_and_recovery_cycle():
    m = JobStateMachine()
    for target in (JobState.PLACING, JobState.DIAGNOSING, JobState.RENDEZVOUS, JobState.RUNNING,
                   JobState.RECOVERING, JobState.PLACING, JobState.RENDEZVOUS, JobState.RUNNING,
                   JobState.SUCCEEDED):
        m.transition(target, reason=f"to {target}", decision=_decision_for(target))
    assert m.state is JobState.SUCCEEDED and m.state.terminal
    assert [t.target for t in m.history][-1] is JobState.SUCCEEDED
    assert m.history[4].source is JobState.RUNNING and m.history[4].target is JobState.RECOVERING


def test_recovering_carries_its_decision():
    m = JobStateMachine(state=JobState.RUNNING)
    with pytest.raises(InvalidTransition, match="must carry the decision"):
        m.transition(JobState.RECOVERING, "no decision")
    m.transition(JobState.RECOVERING, "dead rank", decision=RESTART)
    assert m.decision is RESTART and m.decision.backoff_s == 2.0
    m.transition(JobState.PLACING, "placing")
    assert m.decision is None
    with pytest.raises(InvalidTransition, match="carries no decision"):
        m.transition(JobState.DIAGNOSING, "checks", decision=RESTART)


@pytest.mark.parametrize("path", [
    [JobState.RUNNING],                                        # skips placement
    [JobState.PLACING, JobState.SUCCEEDED],                    # success without running
    [JobState.PLACING, JobState.FAILED, JobState.PLACING],     # leaves a terminal state
])
def test_invalid_transitions_raise(path):
    m = JobStateMachine()
    with pytest.raises(InvalidTransition, match="is not allowed"):
        for target in path:
            m.transition(target)


def test_any_live_state_can_fail_or_stop():
    for state in (s for s in JobState if not s.terminal):
        for end in (JobState.FAILED, JobState.STOPPED):
            assert JobStateMachine(state=state).can(end)


def test_job_record_survives_in_redis(redis_client):
    store = JobRecordStore(redis_client, "job-a")
    m = JobStateMachine()
    store.record_transition(m.transition(JobState.PLACING, "placing 4 workers"), attempt=0)
    store.update(step=12, loss=3.5)
    store.record_transition(m.transition(JobState.RENDEZVOUS, "forming groups"), attempt=1)
    rec = JobRecordStore(redis_client, "job-a").read()  # a new reader, as after a controller crash
    assert rec.state is JobState.RENDEZVOUS and rec.attempt == 1 and rec.step == 12
    assert float(rec.fields["loss"]) == 3.5
    events = store.events()
    assert [e["to"] for e in events] == ["PLACING", "RENDEZVOUS"]
    assert events[0]["reason"] == "placing 4 workers"
    assert JobRecordStore(redis_client, "job-b").read() is None


def test_event_log_is_bounded(redis_client):
    store = JobRecordStore(redis_client, "busy")
    m = JobStateMachine(state=JobState.PLACING)
    for i in range(MAX_EVENTS + 20):
        target = JobState.RECOVERING if m.state is JobState.PLACING else JobState.PLACING
        store.record_transition(m.transition(target, f"#{i}", decision=_decision_for(target)), attempt=i)
    assert redis_client.llen(store.events_key) == MAX_EVENTS
    assert store.events(last=1)[0]["reason"] == f"#{MAX_EVENTS + 19}"
