"""The restart history in Redis stays bounded for a job that restarts for weeks (issue 26, 10b):
the list keeps the restarts the policy's window reads (and the newest few), the total is a
count in the job record, and the restart budget and `longrun status` still count every one."""

from __future__ import annotations

from longrun.config import config_from_dict
from longrun.controller.job_state import RESTARTS_KEPT_MIN, JobRecordStore, job_status
from longrun.health.policy import Action, Incident, RestartRecord, decide, restart_budget_left

WINDOW_S = 600.0


def recovery(max_restarts: int):
    return config_from_dict({"job": {"name": "t"}, "recovery": {
        "max_restarts": max_restarts, "max_restarts_in_window": 5, "restart_window_s": WINDOW_S,
        "restart_backoff_s": 0.0}}).recovery


def dead(at: float) -> Incident:
    return Incident(kind="dead", rank=1, node=f"node-{int(at)}", step=None, at=at, detail="rank 1 died")


def test_the_restart_list_keeps_the_window_and_the_count_keeps_every_restart(redis_client):
    store = JobRecordStore(redis_client, "history")
    store.update(step=0)  # the record exists, as it does once a job has placed
    rec = recovery(max_restarts=1000)
    at = 1_000_000.0
    for _ in range(200):  # one restart every 5 minutes: 2 per window
        decision = decide([dead(at)], [RestartRecord.from_dict(r) for r in store.restarts()], rec, now=at,
                          restarts_total=store.restart_count())
        assert decision.action is Action.RESTART, decision.reason
        store.add_restart(RestartRecord.of(decision, at=at).to_dict(), window_s=WINDOW_S)
        at += 300.0
    kept = store.restarts()
    assert len(kept) == RESTARTS_KEPT_MIN  # not 200
    assert [r["at"] for r in kept] == sorted(r["at"] for r in kept)  # the newest, in order
    assert kept[-1]["at"] == at - 300.0
    assert store.restart_count() == 200
    assert job_status(redis_client, "history")["restarts"] == 200
    assert "restarts_total" not in job_status(redis_client, "history")["fields"]


def test_the_budget_counts_restarts_the_list_no_longer_holds(redis_client):
    store = JobRecordStore(redis_client, "budget")
    rec = recovery(max_restarts=20)
    at = 1_000_000.0
    for _ in range(20):
        record = {"at": at, "cause": "dead", "step": None, "rank": 1, "node": "n"}
        store.add_restart(record, window_s=WINDOW_S)
        at += 3600.0  # far apart: no storm, each leaves the window before the next
    history = [RestartRecord.from_dict(r) for r in store.restarts()]
    assert len(history) == RESTARTS_KEPT_MIN < 20
    decision = decide([dead(at)], history, rec, now=at, restarts_total=store.restart_count())
    assert decision.action is Action.GIVE_UP and "restart budget spent: 20 restarts" in decision.reason
    assert restart_budget_left(history, rec, at, restarts_total=store.restart_count()) == (0, 5)


def test_a_burst_within_the_window_is_kept_whole(redis_client):
    store = JobRecordStore(redis_client, "burst")
    at = 1_000_000.0
    for i in range(RESTARTS_KEPT_MIN + 4):
        store.add_restart({"at": at + i, "cause": "dead"}, window_s=WINDOW_S)
    assert len(store.restarts()) == RESTARTS_KEPT_MIN + 4  # all within the window: the storm rule reads them
    store.add_restart({"at": at + WINDOW_S + 10, "cause": "dead"}, window_s=WINDOW_S)
    assert len(store.restarts()) == RESTARTS_KEPT_MIN  # the window moved past the burst
    assert store.restart_count() == RESTARTS_KEPT_MIN + 5
