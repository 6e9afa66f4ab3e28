"""The controller's state machine, one transition at a time, against a fake worker group.

No Ray here: the launcher hands out `FakeGroup`s whose polls return scripted rank endings,
the heartbeats are real keys in a real Redis (published by the test as the workers would),
and the monitor's clock is a fake one the polls advance. Each test steps the controller and
checks the state it moved to, what it asked of the group, and what it wrote to the job record.
"""

from __future__ import annotations

import time

import pytest
from controller_fakes import (
    NODES,
    WORLD,
    Clock,
    Launcher,
    beat,
    beat_all,
    drive_to_running,
    finished,
    job,
    make_rig,
)

from longrun.controller.controller import Controller, JobFailed, job_status
from longrun.controller.placement import PlacementCancelled, PlacementImpossible, PlacementTimeout
from longrun.controller.state import JobState
from longrun.controller.workers import RankEnded


@pytest.fixture
def rig(redis_server):
    return make_rig(redis_server.url)


def test_happy_path_one_transition_at_a_time(rig, redis_client):
    make, launcher, *_ = rig
    cfg = job("steps-happy")
    c = make(cfg)
    assert c.machine.state is JobState.PENDING
    assert c.step() is JobState.PLACING and not launcher.calls  # placing is announced, then done
    assert c.step() is JobState.DIAGNOSING
    assert launcher.calls == [{"attempt": 0, "evicted": set(), "resume_before": None}]
    group = launcher.groups[0]
    assert c.step() is JobState.RENDEZVOUS and not group.started
    assert c.step() is JobState.RUNNING and group.started
    beat_all(redis_client, cfg, 0, step=4, phase="forward", loss=2.5)
    assert c.step() is JobState.RUNNING  # a poll with nothing ended: keep watching
    assert job_status(redis_client, cfg.job.name)["step"] == 4
    group.script.append([finished(r) for r in range(WORLD)])
    assert c.step() is JobState.SUCCEEDED and group.stopped
    assert c.step() is JobState.SUCCEEDED  # terminal: stepping again does nothing
    assert c.summary["step"] == 10 and c.summary["attempt"] == 0 and c.summary["restarts"] == 0
    status = job_status(redis_client, cfg.job.name, events=20)
    assert [e["to"] for e in status["events"] if e["type"] == "transition"] == [
        "PLACING", "DIAGNOSING", "RENDEZVOUS", "RUNNING", "SUCCEEDED"]


def test_no_diagnostics_goes_straight_to_rendezvous(rig):
    make, *_ = rig
    c = make(job("steps-nodiag", diagnostics=[]))
    assert c.step() is JobState.PLACING
    assert c.step() is JobState.RENDEZVOUS


def test_a_stop_request_cuts_a_restarts_backoff_short(rig, redis_client):
    make, launcher, _, sleeps = rig
    c = make(job("steps-stop-backoff"))
    drive_to_running(c)
    launcher.groups[0].script.append([RankEnded(2, kind="dead", detail="rank 2's process died")])
    assert c.step() is JobState.RECOVERING
    c.sleep = lambda s: (sleeps.append(s), c.request_preemption("SIGTERM"))  # arrives while waiting
    assert c.step() is JobState.RECOVERING and sleeps == [1.0]  # 1 s of the 2 s backoff, no launch
    assert len(launcher.calls) == 1
    while not c.step().terminal:
        pass
    assert c.machine.state is JobState.PREEMPTED and len(launcher.calls) == 1


def test_a_stop_request_gives_up_a_pending_placement(rig, redis_client):
    make, *_ = rig
    c = make(job("steps-stop-placing"))
    assert c.step() is JobState.PLACING
    asked = []

    def placing(cfg, *, cancelled=None, **kw):
        # A reservation waiting on busy nodes when the scheduler's SIGTERM arrives: the
        # placement must hear of it at its next look, not after its timeout.
        c.request_preemption("SIGTERM")
        asked.append(cancelled is not None and cancelled())
        raise PlacementCancelled("placing 4 worker(s) given up: the job was asked to stop")
    c.launch = placing
    assert c.step() is JobState.PLACING and asked == [True]
    while not c.step().terminal:
        pass
    assert c.machine.state is JobState.PREEMPTED
    events = job_status(redis_client, c.cfg.job.name, events=50)["events"]
    assert not any(e["type"] == "decision" for e in events)  # no fault, no restart: a stop


def test_a_dead_rank_restarts_under_the_next_attempt_after_the_backoff(rig, redis_client):
    make, launcher, _, sleeps = rig
    cfg = job("steps-dead")
    c = make(cfg)
    drive_to_running(c)
    group = launcher.groups[0]
    group.script.append([RankEnded(2, kind="dead", detail="rank 2's process died")])
    assert c.step() is JobState.RECOVERING
    assert group.stopped and c.group is None
    assert not sleeps  # the backoff is paced by RECOVERING's own step
    assert c.step() is JobState.PLACING and sum(sleeps) == 2.0
    assert c.attempt_number == 1
    assert c.step() is JobState.DIAGNOSING
    assert launcher.calls[-1] == {"attempt": 1, "evicted": set(), "resume_before": None}
    status = job_status(redis_client, cfg.job.name, events=50)
    assert status["restarts"] == 1 and status["attempt"] == 1
    fault = next(e for e in status["events"] if e["type"] == "fault")
    assert (fault["fault"], fault["rank"], fault["node"]) == ("dead", 2, "node-b")


def test_a_failed_self_check_evicts_its_node_and_replaces_without_it(rig, redis_client):
    make, launcher, *_ = rig
    cfg = job("steps-diag")
    launcher.diagnostics[0] = {3: "compute check: 12% off the CPU reference"}
    c = make(cfg)
    assert c.step() is JobState.PLACING
    assert c.step() is JobState.DIAGNOSING
    assert c.step() is JobState.RECOVERING
    assert launcher.groups[0].stopped and not launcher.groups[0].started
    assert c.step() is JobState.PLACING
    assert c.step() is JobState.DIAGNOSING
    assert launcher.calls[-1]["evicted"] == {"node-b"}
    status = job_status(redis_client, cfg.job.name, events=50)
    assert "node-b" in status["evicted"]
    assert any(e["type"] == "diagnostics_failed" and e["node"] == "node-b" for e in status["events"])


def test_a_job_that_can_never_be_placed_fails_with_the_reason(rig, redis_client):
    make, launcher, *_ = rig
    cfg = job("steps-impossible")
    launcher.failures[0] = PlacementImpossible("the job needs 2 node(s); the cluster has 1")
    c = make(cfg)
    with pytest.raises(JobFailed, match="the cluster has 1"):
        c.run()
    assert c.machine.state is JobState.FAILED and len(launcher.calls) == 1
    assert launcher.released == 1  # run() gives the placement (and any spares) back
    assert "the cluster has 1" in job_status(redis_client, cfg.job.name)["fields"]["reason"]


@pytest.mark.parametrize("joins", [True, False])
def test_a_job_short_of_nodes_after_a_loss_waits_for_a_replacement_then_fails(joins, rig, redis_client):
    """Too few nodes left after a fault (a node lost while another was evicted): a job that has
    run waits recovery.node_wait_s for a replacement instead of failing at once (the soak of
    2026-11-26 failed 2 s before one joined); past the wait it fails with the reason."""
    make, launcher, clock, sleeps = rig
    cfg = job(f"steps-short-{str(joins).lower()}", node_wait_s=60.0)
    c = make(cfg)
    drive_to_running(c)
    launcher.failures[1] = PlacementImpossible("the job needs 2 node(s); the cluster has 1 such node(s)",
                                               available=1, existing=1)
    launcher.groups[0].script.append([RankEnded(3, kind="dead", detail="rank 3's process died")])
    assert c.step() is JobState.RECOVERING
    while c.machine.state is JobState.RECOVERING:
        c.step()
    assert c.machine.state is JobState.PLACING
    slept = len(sleeps)
    for _ in range(3):  # short of a node: placing again, not failing, no restart spent
        clock.t += 10.0
        assert c.step() is JobState.PLACING
    assert sleeps[slept:] == [1.0] * 3  # each try paced, not a busy loop
    events = job_status(redis_client, cfg.job.name, events=100)["events"]
    waits = [e for e in events if e["type"] == "waiting_for_nodes"]
    assert len(waits) == 1 and "recovery.node_wait_s" in waits[0]["reason"], waits
    if joins:
        del launcher.failures[1]  # a replacement node joined
        assert c.step() is JobState.DIAGNOSING and launcher.calls[-1]["attempt"] == 1
        assert job_status(redis_client, cfg.job.name)["restarts"] == 1
        return
    clock.t += 45.0  # the shortage began 20 s ago (the first of the three tries): now 65 s, past the 60
    with pytest.raises(JobFailed, match=r"within recovery\.node_wait_s \(60 s\)"):
        c.run()
    assert c.machine.state is JobState.FAILED


def test_busy_resources_are_waited_for_not_a_restart_or_a_failure(rig, redis_client):
    make, launcher, *_ = rig
    launcher.failures[0] = PlacementTimeout("could not be reserved within 120 s")
    c = make(job("steps-busy"))
    assert c.step() is JobState.PLACING
    assert c.step() is JobState.PLACING  # busy is not gone: placing again, no restart
    del launcher.failures[0]  # the other job let go
    assert c.step() is JobState.DIAGNOSING and launcher.calls[-1]["attempt"] == 0
    assert job_status(redis_client, "steps-busy")["restarts"] == 0


def test_an_exception_waits_for_its_cause_and_the_dead_peer_is_blamed(rig, redis_client):
    make, launcher, *_ = rig
    cfg = job("steps-echo")
    c = make(cfg)
    drive_to_running(c)
    group = launcher.groups[0]
    group.script += [[RankEnded(1, kind="exception", detail="rank 1 raised RuntimeError: gloo")],
                     [RankEnded(3, kind="dead", detail="rank 3's process died")]]
    assert c.step() is JobState.RUNNING  # held: the exception may be an echo
    assert not [e for e in job_status(redis_client, cfg.job.name, 50)["events"] if e["type"] == "fault"]
    assert c.step() is JobState.RECOVERING
    restart = redis_client.lrange(c.record.restarts_key, 0, -1)
    assert b'"cause": "dead"' in restart[0] and b'"rank": 3' in restart[0]


def test_a_lone_exception_is_decided_after_the_heartbeat_timeout(rig, redis_client):
    make, launcher, *_ = rig
    cfg = job("steps-lone")
    c = make(cfg)
    drive_to_running(c)
    beat_all(redis_client, cfg, 0, step=2, phase="forward")
    launcher.groups[0].script.append([RankEnded(0, kind="exception", detail="rank 0 raised ValueError")])
    states = [c.step()]
    while states[-1] is JobState.RUNNING:
        beat_all(redis_client, cfg, 0, step=2, phase="forward")  # its peers are alive
        states.append(c.step())
    # The exception is held for heartbeat_timeout_s (5 s of 1 s polls), then decided.
    assert states[-1] is JobState.RECOVERING and 4 <= len(states) <= 7, states


def test_a_hang_is_declared_from_heartbeats_that_stop_advancing(rig, redis_client):
    make, *_ = rig
    cfg = job("steps-hang")
    c = make(cfg)
    drive_to_running(c)
    for step in range(1, 6):  # the monitor learns 1 s steps
        beat_all(redis_client, cfg, 0, step=step, phase="forward", step_time_s=1.0)
        assert c.step() is JobState.RUNNING
    polls = 0
    while c.machine.state is JobState.RUNNING and polls < 40:
        beat_all(redis_client, cfg, 0, step=5, phase="backward", step_time_s=1.0)  # alive, stuck
        c.step()
        polls += 1
    assert c.machine.state is JobState.RECOVERING
    # The learned timeout (max(hang_min_s 10, 5 x 1 s)), well before the 30 s ceiling.
    assert 10 <= polls <= 12, polls
    fault = next(e for e in job_status(redis_client, cfg.job.name, 50)["events"] if e["type"] == "fault")
    assert fault["fault"] == "hang" and fault["step"] == 5


def test_nan_resumes_before_the_poisoned_step(rig, redis_client):
    make, launcher, *_ = rig
    cfg = job("steps-nan")
    c = make(cfg)
    drive_to_running(c)
    launcher.groups[0].script.append([RankEnded(1, kind="nan", step=6, detail="rank 1 raised NonFinite")])
    assert c.step() is JobState.RECOVERING
    c.step()
    c.step()
    assert launcher.calls[-1]["resume_before"] == 6


def test_a_spent_budget_gives_up(rig, redis_client):
    make, launcher, *_ = rig
    cfg = job("steps-budget", max_restarts=1)
    c = make(cfg)
    for attempt in range(2):
        drive_to_running(c) if attempt == 0 else [c.step() for _ in range(4)]
        launcher.groups[-1].script.append([RankEnded(0, kind="dead", detail="rank 0's process died")])
        c.step()
    assert c.machine.state is JobState.FAILED and launcher.groups[-1].stopped
    assert "restart budget" in c.failure
    with pytest.raises(JobFailed, match="restart budget"):
        c.run()


def test_a_straggler_is_reported_and_the_attempt_keeps_running(rig, redis_client):
    make, launcher, *_ = rig
    cfg = job("steps-straggler")
    c = make(cfg)
    drive_to_running(c)
    for step in range(1, 12):
        for rank in range(WORLD):
            beat(redis_client, cfg, 0, rank, step=step, phase="forward",
                 step_time_s=3.0 if rank == 1 else 1.0)
        assert c.step() is JobState.RUNNING
    events = job_status(redis_client, cfg.job.name, 50)["events"]
    assert any(e["type"] == "fault" and e["fault"] == "straggler" and e["rank"] == 1 for e in events)
    assert any(e["type"] == "decision" and "straggler" in e["reason"] for e in events)
    assert not launcher.groups[0].stopped


def _restarted_after_a_death(rig, name: str, wall: Clock | None = None):
    """A job whose rank 0 died in attempt 0, stepped until attempt 1 runs. With `wall` (the
    controller's wall clock), 2 s pass on it between the declaration and the relaunch."""
    make, launcher, *_ = rig
    cfg = job(name)
    c = make(cfg) if wall is None else make(cfg, wall=wall)
    drive_to_running(c)
    launcher.groups[0].script.append([RankEnded(0, kind="dead", detail="rank 0's process died")])
    c.step()
    if wall is not None:
        wall.t += 2.0
    for _ in range(4):
        c.step()
    assert c.machine.state is JobState.RUNNING and c.attempt_number == 1
    return c, cfg, launcher


def _wall() -> Clock:
    """A wall clock the test moves by hand, starting at the real time (heartbeats carry theirs)."""
    wall = Clock()
    wall.t = time.time()
    return wall


def test_recovery_is_measured_to_the_first_step_of_the_new_attempt(rig, redis_client):
    wall = _wall()
    c, cfg, launcher = _restarted_after_a_death(rig, "steps-recovered", wall)
    beat_all(redis_client, cfg, 1, step=4, resumed_from=4, phase="restore")
    wall.t += 3.0
    c.step()
    events = job_status(redis_client, cfg.job.name, 50)["events"]
    assert not any(e["type"] == "recovered" for e in events)  # restored is not yet a step
    beat_all(redis_client, cfg, 1, step=5, resumed_from=4, phase="forward")
    wall.t += 1.25
    c.step()
    recovered = [e for e in job_status(redis_client, cfg.job.name, 50)["events"] if e["type"] == "recovered"]
    assert len(recovered) == 1 and recovered[0]["attempt"] == 1 and recovered[0]["seconds"] >= 0
    # From the fault's declaration (not the relaunch, nor the restore) to the poll that saw the
    # first step: 2 + 3 + 1.25 s on the controller's wall clock.
    assert recovered[0]["seconds"] == pytest.approx(6.25)
    # Spares for the next restart are warmed once the attempt trains, not during its start-up.
    assert launcher.warmed == [1]


def test_an_attempt_that_finishes_before_a_poll_sees_its_first_step_still_reports_its_recovery(
        rig, redis_client):
    # A short remainder after a fault: the ranks restore, train to the end and finish between two
    # polls (with node agents a finished rank leaves its node's record at once), so no heartbeat
    # ever shows a step past the restore. The recovery is reported from the ranks' summaries.
    wall = _wall()
    c, cfg, launcher = _restarted_after_a_death(rig, "steps-recovered-at-end", wall)
    beat_all(redis_client, cfg, 1, step=8, resumed_from=8, phase="restore")
    c.step()
    done = {"step": 10, "loss": 2.0, "resumed_from": 8, "preempted": False}
    launcher.groups[1].script.append([RankEnded(r, summary={"rank": r} | done) for r in range(4)])
    wall.t += 4.5
    c.step()
    recovered = [e for e in job_status(redis_client, cfg.job.name, 50)["events"] if e["type"] == "recovered"]
    assert len(recovered) == 1, recovered
    assert (recovered[0]["attempt"], recovered[0]["resumed_from"], recovered[0]["at_end"]) == (1, 8, True)
    assert recovered[0]["seconds"] >= 0
    assert recovered[0]["seconds"] == pytest.approx(2.0 + 4.5)  # the declaration to the summaries
    assert "before a heartbeat showed its first step" in recovered[0]["reason"]
    assert launcher.warmed == []  # no spares for an attempt that has ended


def test_a_new_controller_continues_an_unfinished_job(rig, redis_client):
    make, launcher, *_ = rig
    cfg = job("steps-resume")
    first = make(cfg)
    drive_to_running(first)  # ... and then its process dies: nothing more is written
    second = make(cfg)
    assert second.step() is JobState.PLACING and second.attempt_number == 1
    assert second.step() is JobState.DIAGNOSING and launcher.calls[-1]["attempt"] == 1
    assert any(e["type"] == "resume" for e in job_status(redis_client, cfg.job.name, 50)["events"])


def test_a_spike_that_returns_at_the_same_data_is_skipped_on_the_next_attempt(rig, redis_client):
    make, launcher, *_ = rig
    cfg = job("steps-spike")  # recovery.skip_after_spikes = 2: retry the data once, then skip it
    c = make(cfg)
    drive_to_running(c)

    def train_to_spike(attempt: int, first: int) -> None:
        for step in range(first, 13):
            beat_all(redis_client, cfg, attempt, step=step, phase="forward",
                     loss=80.0 if step == 12 else 2.0 + 0.01 * step, step_time_s=1.0)
            if c.step() is not JobState.RUNNING:
                return

    train_to_spike(0, 1)
    assert c.machine.state is JobState.RECOVERING
    for _ in range(3):
        c.step()
    assert launcher.calls[-1]["resume_before"] == 12 and launcher.skips[-1] == []  # retry the data once
    c.step()
    train_to_spike(1, 9)  # resumed from the checkpoint of step 8: the spike comes back at step 12
    assert c.machine.state is JobState.RECOVERING
    for _ in range(3):
        c.step()
    assert launcher.calls[-1]["resume_before"] == 12 and launcher.skips[-1] == [(12, 12)]
    # A later, unrelated restart still skips it, whichever checkpoint it resumes from.
    c.step()
    launcher.groups[-1].script.append([RankEnded(0, kind="dead", detail="rank 0's process died")])
    c.step()
    for _ in range(3):
        c.step()
    assert launcher.calls[-1]["attempt"] == 3 and launcher.skips[-1] == [(12, 12)]


def test_metrics_and_scrape_targets_follow_the_attempts(rig, redis_client):
    make, launcher, *_ = rig
    cfg = job("steps-metrics")
    wall = _wall()
    c = make(cfg, wall=wall)
    value = c.metrics.registry.get_sample_value
    drive_to_running(c)
    assert value("longrun_job_state", {"job": cfg.job.name, "longrun_job_state": "RUNNING"}) == 1
    sent_from = time.time()
    for rank in range(WORLD):
        beat(redis_client, cfg, 0, rank, step=2, phase="forward", metrics_addr=f"127.0.0.1:{9100 + rank}")
    sent_to = time.time()
    wall.t = sent_to + 30.0  # the poll reads the beats 30 s after the last was sent
    c.step()
    workers = [g for g in c.targets() if g["labels"]["role"] == "worker"]
    assert [g["targets"] for g in workers] == [[f"127.0.0.1:{9100 + r}"] for r in range(WORLD)]
    assert {g["labels"]["node"] for g in workers} == set(NODES) and workers[0]["labels"]["attempt"] == "0"
    # `node` by name, `node_id` by id: the fakes' nodes have no names, so both are the id.
    age = {"job": cfg.job.name, "rank": "3", "node": "node-b", "node_id": "node-b"}
    assert value("longrun_heartbeat_age_seconds", age) >= 0
    # The age is the controller's wall clock minus the beat's own send time, which lies between
    # the two readings around the publishing.
    assert 30.0 <= value("longrun_heartbeat_age_seconds", age) <= 30.0 + (sent_to - sent_from)
    launcher.groups[0].script.append([RankEnded(3, kind="dead", detail="rank 3's process died")])
    assert c.step() is JobState.RECOVERING
    assert value("longrun_job_restarts_total", {"job": cfg.job.name, "cause": "dead"}) == 1
    assert value("longrun_job_faults_total", {"job": cfg.job.name, "kind": "dead"}) == 1
    assert value("longrun_fault_detection_seconds_count", {"job": cfg.job.name}) == 1
    # The dead attempt's workers leave the targets (and their per-rank series go).
    assert [g["labels"]["role"] for g in c.targets()] == ["controller"]
    assert value("longrun_heartbeat_age_seconds", age) is None
    c.step()
    assert value("longrun_job_attempt", {"job": cfg.job.name}) == 1


def test_workers_that_do_not_start_are_a_restart_not_a_crash(rig):
    from longrun.controller.workers import LaunchFailed

    make, launcher, *_ = rig
    launcher.failures[0] = LaunchFailed("attempt 0's workers did not start: ActorDiedError")
    c = make(job("steps-launch"))
    assert c.step() is JobState.PLACING
    assert c.step() is JobState.RECOVERING
    assert c.step() is JobState.PLACING and c.attempt_number == 1
    assert c.step() is JobState.DIAGNOSING


def test_redis_gone_past_the_patience_is_a_clear_error(tmp_path):
    from longrun.config import config_from_dict
    from longrun.controller.controller import StoreUnavailable
    from longrun.services import EmbeddedRedis

    server = EmbeddedRedis().start()
    cfg = config_from_dict({"job": {"name": "steps-no-redis"}, "parallelism": {"dp": 1},
                            "health": {"store_patience_s": 0.3}})
    clock = Clock()
    c = Controller(cfg, server.url, launch=Launcher(clock), clock=clock, sleep=lambda s: None,
                   serve_metrics=False)
    assert c.step() is JobState.PLACING
    server.stop()  # and it does not come back
    with pytest.raises(StoreUnavailable, match=r"store_patience_s .* Start the controller again"):
        c.run()


def test_partial_saves_are_swept_before_every_attempt_is_placed(rig, tmp_path):
    """Issue 39: a save a crash left without its manifest is removed while no worker is alive
    (before the first attempt, and again before a restart's), so a disk it filled is freed
    before anyone writes; committed steps stay."""
    import fsspec

    from longrun.checkpoint import layout

    make, launcher, _, _ = rig
    cfg = job("steps-sweep", str(tmp_path))
    fs, root = fsspec.core.url_to_fs(cfg.checkpoint_dir)

    def leave(step: int, committed: bool) -> None:
        fs.makedirs(f"{root}/{layout.step_dir_name(step)}", exist_ok=True)
        fs.pipe_file(f"{root}/{layout.step_dir_name(step)}/__0_0.distcp", b"half")
        if committed:
            fs.pipe_file(f"{root}/{layout.step_dir_name(step)}/{layout.MANIFEST}", b"{}")

    leave(2, committed=True)
    leave(3, committed=False)
    c = make(cfg)
    assert c.step() is JobState.PLACING
    assert layout.uncommitted_dirs(fs, root) == [] and layout.committed_steps(fs, root) == [2]
    for want in (JobState.DIAGNOSING, JobState.RENDEZVOUS, JobState.RUNNING):
        assert c.step() is want
    leave(5, committed=False)  # the attempt's workers die mid-save
    launcher.groups[0].script.append([RankEnded(1, kind="dead", detail="rank 1's process died")])
    assert c.step() is JobState.RECOVERING
    assert layout.uncommitted_dirs(fs, root) == [f"{root}/{layout.step_dir_name(5)}"]
    assert c.step() is JobState.PLACING
    assert layout.uncommitted_dirs(fs, root) == [] and layout.committed_steps(fs, root) == [2]
