"""Stopping on request with nothing lost: the step boundary every rank agrees to save at (real
Redis, ranks simulated), and the controller's PREEMPTING state against a fake worker group."""

from __future__ import annotations

import pytest
from controller_fakes import WORLD, drive_to_running, finished, job, make_rig

from longrun import keys
from longrun.controller.state import JobState
from longrun.controller.workers import RankEnded
from longrun.worker.preemption import PreemptionWatch, request


@pytest.fixture
def rig(redis_server):
    return make_rig(redis_server.url)


def test_ranks_agree_on_one_step_whatever_boundary_saw_the_request_first(redis_client):
    """Rank 1 is a step ahead of ranks 0 and 2 (a peer can be inside the next step, never past
    it). The request lands while rank 1 is at boundary 7 and the others at boundary 6."""
    watches = [PreemptionWatch(redis_client, "agree", 0) for _ in range(3)]
    assert not any(w.stop_after(s) for w, s in zip(watches, (5, 6, 5), strict=True))  # no request yet
    request(redis_client, "agree", 0)
    assert not watches[1].stop_after(7)  # the first to see it names the step after its own: 8
    assert redis_client.get(keys.preempt_key("agree", 0)) == b"8"
    assert not watches[0].stop_after(6) and not watches[2].stop_after(6)  # ahead of them: train on
    assert not watches[0].stop_after(7) and not watches[2].stop_after(7)
    assert [w.stop_after(8) for w in watches] == [True, True, True]  # all save step 8
    assert {w.target for w in watches} == {8}
    request(redis_client, "agree", 0)  # asked again: the agreed step stays
    assert redis_client.get(keys.preempt_key("agree", 0)) == b"8"


def test_a_running_job_saves_at_a_step_boundary_and_ends_preempted(rig, redis_client):
    make, launcher, *_ = rig
    cfg = job("preempt-run")
    c = make(cfg)
    drive_to_running(c)
    group = launcher.groups[0]
    c.request_preemption("SIGTERM received")
    assert c.step() is JobState.PREEMPTING
    assert redis_client.get(keys.preempt_key(cfg.job.name, 0)) == b"now"  # the workers' request
    assert not group.stopped  # they are saving: not killed
    assert c.step() is JobState.PREEMPTING  # a poll with nothing ended yet
    group.script.append([finished(r, step=6, preempted=True) for r in range(WORLD)])
    assert c.step() is JobState.PREEMPTED and group.stopped
    assert c.summary["preempted"] and c.summary["step"] == 6
    assert "the checkpoint of step 6 is committed" in c.summary["reason"]
    assert not redis_client.exists(keys.preempt_key(cfg.job.name, 0))  # the attempt's keys went


def test_a_save_that_outlasts_the_grace_is_stopped_anyway(rig):
    make, launcher, clock, _ = rig
    cfg = job("preempt-grace", preemption_grace_s=5.0)
    c = make(cfg)
    drive_to_running(c)
    c.request_preemption("SIGTERM received")
    assert c.step() is JobState.PREEMPTING
    while c.step() is JobState.PREEMPTING:  # each poll advances the fake clock by a second
        assert clock.t < 1100
    assert c.machine.state is JobState.PREEMPTED and launcher.groups[0].stopped
    assert "did not finish saving within recovery.preemption_grace_s (5 s)" in c.summary["reason"]


def test_a_rank_failing_while_saving_ends_preempted_not_restarted(rig):
    make, launcher, *_ = rig
    c = make(job("preempt-fail"))
    drive_to_running(c)
    c.request_preemption("SIGTERM received")
    c.step()
    launcher.groups[0].script.append([RankEnded(1, kind="dead", detail="rank 1's process died")])
    assert c.step() is JobState.PREEMPTED
    assert "rank 1's process died" in c.summary["reason"] and len(launcher.groups) == 1


def test_the_last_step_before_the_request_is_a_success(rig):
    make, launcher, *_ = rig
    c = make(job("preempt-late"))
    drive_to_running(c)
    c.request_preemption("SIGTERM received")
    c.step()
    launcher.groups[0].script.append([finished(r) for r in range(WORLD)])  # trained to the end
    assert c.step() is JobState.SUCCEEDED


def test_a_request_before_training_stops_at_once(rig):
    make, launcher, *_ = rig
    c = make(job("preempt-early"))
    assert c.step() is JobState.PLACING
    c.request_preemption("SIGINT received")
    assert c.step() is JobState.PREEMPTED and not launcher.calls  # nothing placed, nothing lost
    assert "nothing trained since the newest committed checkpoint" in c.summary["reason"]


def test_a_drained_node_preempts_the_job(rig, redis_client):
    make, launcher, *_ = rig
    cfg = job("preempt-drain")
    c = make(cfg)
    drive_to_running(c)
    launcher.groups[0].drained = {"node-b": 1_900_000_000.0}
    assert c.step() is JobState.RUNNING  # the notice is read in this poll ...
    assert c.step() is JobState.PREEMPTING  # ... and acted on in the next step
    assert "Ray is draining node(s) node-b" in c.machine.history[-1].reason
    assert redis_client.get(keys.preempt_key(cfg.job.name, 0)) == b"now"


def test_a_forced_stop_kills_at_once_without_saving(rig, redis_server, redis_client):
    from longrun.submit import request_force_stop

    make, launcher, *_ = rig
    cfg = job("preempt-force")
    c = make(cfg)
    drive_to_running(c)
    c.request_preemption("SIGTERM received")
    assert c.step() is JobState.PREEMPTING  # saving ...
    request_force_stop(redis_server.url, cfg.job.name)  # ... when the operator insists
    assert c.step() is JobState.STOPPED and launcher.groups[0].stopped
    assert c.summary["stopped"] and "nothing saved" in c.summary["reason"]
    # The mark does not outlive the run: the next run of the job starts clean.
    again = make(cfg)
    assert again.step() is JobState.PLACING
    assert not redis_client.exists(keys.job_stop_key(cfg.job.name))
