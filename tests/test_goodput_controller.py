"""The controller's goodput, stepped against a fake worker group with a fake clock and a real
Redis: the step ledger the ranks write decides the steps a fault lost (not the heartbeats), and
the summary in Redis accounts for every second of the job."""

from __future__ import annotations

import pytest
from controller_fakes import WORLD, beat_all, drive_to_running, finished, job, make_rig

from longrun.controller.controller import job_status
from longrun.controller.state import JobState
from longrun.controller.workers import RankEnded
from longrun.goodput.accounting import BUCKETS
from longrun.goodput.ledger import StepLedger
from longrun.goodput.summary import read_summary


@pytest.fixture
def rig(redis_server):
    return make_rig(redis_server.url)


def ledgers(redis_client, cfg, attempt: int, clock) -> list[StepLedger]:
    return [StepLedger(redis_client, cfg.job.name, attempt, rank, clock=clock) for rank in range(WORLD)]


def test_a_step_the_heartbeats_never_showed_is_counted_lost_from_the_ledger(rig, redis_client):
    make, launcher, clock, _ = rig
    cfg = job("goodput-ledger")
    c = make(cfg, wall=clock)
    started = clock.t
    drive_to_running(c)
    ranks = ledgers(redis_client, cfg, 0, clock)
    for r in ranks:
        r.restored(None, "none", 0.0)
    for step in range(1, 6):
        clock.t += 0.5
        for r in ranks:
            r.step(step)
    beat_all(redis_client, cfg, 0, step=5, phase="forward")
    c.step()
    clock.t += 0.5
    ranks[1].step(6)  # rank 1 finished step 6; rank 0 died before its next heartbeat or record
    launcher.groups[0].script.append([RankEnded(0, kind="dead", detail="rank 0's process died")])
    assert c.step() is JobState.RECOVERING
    for _ in range(4):
        c.step()
    assert c.machine.state is JobState.RUNNING and c.attempt_number == 1
    ranks = ledgers(redis_client, cfg, 1, clock)
    clock.t += 0.5  # the workers start, join their groups, and restore
    for r in ranks:
        r.restored(5, "memory", 0.25)  # the peers' memory held step 5
    clock.t += 0.5
    for r in ranks:
        r.step(6)
    beat_all(redis_client, cfg, 1, step=6, resumed_from=5, phase="forward")
    c.step()
    events = job_status(redis_client, cfg.job.name, 100)["events"]
    [recovered] = [e for e in events if e["type"] == "recovered"]
    assert (recovered["resumed_from"], recovered["steps_lost"], recovered["source"]) == (5, 1, "ledger")
    assert "1 step(s) of work lost" in recovered["reason"]
    launcher.groups[1].script.append([finished(rank, step=10) for rank in range(WORLD)])
    assert c.step() is JobState.SUCCEEDED
    summary = read_summary(redis_client, cfg.job.name)
    assert summary.faults == [{"attempt": 0, "kind": "dead", "declared_at": summary.faults[0]["declared_at"],
                               "last_step": 6, "restored_step": 5, "steps_lost": 1,
                               "restored_from": "memory"}]
    assert set(summary.buckets) == set(BUCKETS)
    assert summary.wall_s == pytest.approx(clock.t - started, abs=1e-5)  # every second, once
    assert summary.buckets["productive"] == pytest.approx(3.0, abs=1e-5)  # steps 1-5 and 6
    assert summary.buckets["restore_memory"] == pytest.approx(0.25, abs=1e-5)
    assert summary.buckets["detection"] > 0  # from rank 0's last record to the declaration
    assert summary.buckets["backoff"] == 0  # the fake's backoff sleeps take no time
    assert summary.state == "SUCCEEDED" and 0 < summary.goodput < 1
