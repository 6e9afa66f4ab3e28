"""What the recovery policy learned survives a Redis that forgot it (issue 42, door 11).

The restart count (the budget), the evicted nodes and the skipped data windows are kept in the
checkpoint root beside the fences (`controller/recovery_file.py`). A controller that finds no
record of its job in Redis (`longrun run`'s embedded Redis is a new one each time) reads them
back before it places anything: the rerun keeps its budget, avoids the evicted node and does
not train on a skipped window again. A PREEMPTED job run again continues; a job that ended
SUCCEEDED or FAILED leaves its name to a fresh start. Each controller here talks to a Redis of
its own, started for it and stopped after, as `longrun run`'s is.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

from controller_fakes import WORLD, drive_to_running, finished, job, make_rig

from longrun.controller.controller import job_status
from longrun.controller.recovery_file import (
    RECOVERY_FILE,
    RecoveryMemory,
    forget_memory,
    read_memory,
    write_memory,
)
from longrun.controller.state import JobState
from longrun.controller.workers import RankEnded
from longrun.services import EmbeddedRedis


@contextlib.contextmanager
def fresh_redis() -> Iterator[EmbeddedRedis]:
    """A Redis that knows nothing, as each `longrun run` starts one."""
    with EmbeddedRedis() as server:
        yield server


def status(server: EmbeddedRedis, name: str) -> dict:
    with server.client() as client:
        return job_status(client, name, events=100)


def test_the_policy_file_round_trips_and_belongs_to_its_job(tmp_path):
    memory = RecoveryMemory("job-a", restarts_total=3,
                            restarts=[{"at": 1000.0, "cause": "dead", "node": "node-x", "step": 40}],
                            evicted={"node-x": "failed its self-check"}, skips=[(12, 12), (40, 41)])
    for url in (str(tmp_path / "ckpt"), "memory://policy-ckpt"):  # a disk, an object store
        write_memory(url, memory)
        assert read_memory(url, "job-a") == memory
        assert read_memory(url, "job-b") is None  # another job given the same root inherits nothing
        forget_memory(url, "job-b")  # nor removes it
        assert read_memory(url, "job-a") == memory
        forget_memory(url, "job-a")
        assert read_memory(url, "job-a") is None
    (tmp_path / "ckpt" / RECOVERY_FILE).write_text('{"job": "job-a", "restarts_total": ')  # cut short
    assert read_memory(str(tmp_path / "ckpt"), "job-a") is None  # reported; the budget starts afresh


def test_a_fresh_redis_reads_back_the_budget_the_evictions_and_the_skipped_windows(tmp_path):
    cfg = job("policy-fresh", output_dir=str(tmp_path), skip_after_spikes=1, max_restarts=2)
    with fresh_redis() as first:
        make, launcher, *_ = make_rig(first.url)
        launcher.diagnostics[0] = {3: "compute check: 12% off the CPU reference"}  # node-b's rank
        c = make(cfg)
        for want in (JobState.PLACING, JobState.DIAGNOSING, JobState.RECOVERING,  # node-b evicted
                     JobState.PLACING, JobState.DIAGNOSING, JobState.RENDEZVOUS, JobState.RUNNING):
            assert c.step() is want
        launcher.groups[-1].script.append([RankEnded(1, kind="nan", step=6, detail="rank 1: NaN loss")])
        assert c.step() is JobState.RECOVERING  # from before step 6, skipping its data
        before = status(first, cfg.job.name)
        assert before["restarts"] == 2 and set(before["evicted"]) == {"node-b"}
    # ... and `longrun run` ended there, its Redis with it. The same command again:
    with fresh_redis() as second:
        make, launcher, *_ = make_rig(second.url)
        c = make(cfg)
        assert c.step() is JobState.PLACING
        after = status(second, cfg.job.name)
        assert after["restarts"] == 2 and after["evicted"] == before["evicted"]
        recalled = [e for e in after["events"] if e["type"] == "policy_recalled"]
        assert len(recalled) == 1 and recalled[0]["skips"] == [[6, 6]], after["events"]
        assert c.step() is JobState.DIAGNOSING
        assert launcher.calls[-1]["evicted"] == {"node-b"} and launcher.skips[-1] == [(6, 6)]
        for want in (JobState.RENDEZVOUS, JobState.RUNNING):
            assert c.step() is want
        # Both restarts of recovery.max_restarts = 2 were spent before Redis forgot them.
        launcher.groups[-1].script.append([RankEnded(0, kind="dead", detail="rank 0's process died")])
        assert c.step() is JobState.FAILED
        assert "restart budget spent: 2 restarts" in c.failure
    assert not Path(cfg.checkpoint_dir, RECOVERY_FILE).exists()  # a failed job's name starts afresh


def _restart_then(c, launcher) -> None:
    """A dead rank and the restart it costs, then the new attempt trains."""
    drive_to_running(c)
    launcher.groups[-1].script.append([RankEnded(2, kind="dead", detail="rank 2's process died")])
    for want in (JobState.RECOVERING, JobState.PLACING, JobState.DIAGNOSING, JobState.RENDEZVOUS,
                 JobState.RUNNING):
        assert c.step() is want


def test_a_preempted_job_run_again_keeps_its_budget_and_a_finished_one_starts_afresh(tmp_path):
    cfg = job("policy-preempted", output_dir=str(tmp_path))
    with fresh_redis() as first:
        make, launcher, *_ = make_rig(first.url)
        c = make(cfg)
        _restart_then(c, launcher)
        c.request_preemption("SIGTERM received")
        assert c.step() is JobState.PREEMPTING
        launcher.groups[-1].script.append([finished(r, step=6, preempted=True) for r in range(WORLD)])
        assert c.step() is JobState.PREEMPTED
        # With the same Redis, too, a preempted job run again is the same job.
        again = make(cfg)
        assert again.step() is JobState.PLACING and status(first, cfg.job.name)["restarts"] == 1
    with fresh_redis() as second:  # "run the same command to resume"
        make, launcher, *_ = make_rig(second.url)
        c = make(cfg)
        assert c.step() is JobState.PLACING and status(second, cfg.job.name)["restarts"] == 1
        for want in (JobState.DIAGNOSING, JobState.RENDEZVOUS, JobState.RUNNING):
            assert c.step() is want
        launcher.groups[-1].script.append([finished(r) for r in range(WORLD)])
        assert c.step() is JobState.SUCCEEDED and c.summary["restarts"] == 1
    with fresh_redis() as third:  # a finished job's name starts afresh
        make, launcher, *_ = make_rig(third.url)
        c = make(cfg)
        assert c.step() is JobState.PLACING and status(third, cfg.job.name)["restarts"] == 0
