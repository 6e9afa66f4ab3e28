"""What the controller does with faults that are not a crash: an error that would recur on any
node ends the job at once; a checkpoint the job cannot resume from fails it before anything
is placed; a lost node is blamed (and evicted) as a node. And what it leaves behind: nothing
of an ended attempt in Redis. Stepped against the fakes of tests/controller_fakes.py; the
last tests check the pieces that touch Ray or torch on their own.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from controller_fakes import NODES, beat_all, drive_to_running, finished, job, make_rig

from longrun import keys
from longrun.checkpoint.layout import MANIFEST, step_dir_name
from longrun.checkpoint.manifest import Manifest
from longrun.controller.controller import JobFailed, job_status
from longrun.controller.state import JobState
from longrun.controller.workers import LaunchFailed, RankEnded

DATA_ORDER = ("cannot resume the data order: the saved sampler has num_docs = 20, this one 31 "
              "(the data, seed or data-parallel layout changed)")


@pytest.fixture
def rig(redis_server):
    return make_rig(redis_server.url)


def test_a_fatal_error_fails_the_job_at_once_with_the_original_message(rig, redis_client):
    make, launcher, _, sleeps = rig
    cfg = job("faults-fatal")
    c = make(cfg)
    drive_to_running(c)
    # The rank that hit the mismatch, and a peer whose collective failed because of it.
    launcher.groups[0].script.append([
        RankEnded(2, kind="fatal", step=0, detail=f"rank 2 raised DataError: {DATA_ORDER}"),
        RankEnded(3, kind="exception", detail="rank 3 raised RuntimeError: gloo connection closed")])
    assert c.step() is JobState.FAILED
    assert len(launcher.calls) == 1 and launcher.groups[0].stopped and not sleeps
    assert DATA_ORDER in c.failure
    status = job_status(redis_client, cfg.job.name, events=50)
    assert status["restarts"] == 0 and status["attempt"] == 0
    assert DATA_ORDER in status["fields"]["reason"]
    with pytest.raises(JobFailed, match="cannot resume the data order"):
        c.run()


def test_workers_that_reject_the_config_fail_the_job_without_a_restart(rig, redis_client):
    make, launcher, *_ = rig
    cfg = job("faults-fatal-launch")
    launcher.failures[0] = LaunchFailed("attempt 0's workers did not start: ValidationError: model.dim",
                                        kind="fatal")
    c = make(cfg)
    assert c.step() is JobState.PLACING
    assert c.step() is JobState.FAILED and "ValidationError: model.dim" in c.failure
    assert job_status(redis_client, cfg.job.name)["restarts"] == 0


def _write_manifest(cfg, step: int, **model_changes) -> None:
    directory = f"{cfg.checkpoint_dir}/{step_dir_name(step)}"
    os.makedirs(directory)
    manifest = Manifest(step=step, world_size=cfg.world_size, dp_size=cfg.parallelism.dp,
                        model=cfg.model.model_dump(mode="json") | model_changes, config_fingerprint="x")
    with open(f"{directory}/{MANIFEST}", "wb") as f:
        f.write(manifest.to_json())


def test_an_incompatible_checkpoint_fails_before_anything_is_placed(rig, redis_client, tmp_path):
    make, launcher, *_ = rig
    cfg = job("faults-precheck", output_dir=str(tmp_path))
    _write_manifest(cfg, 4)
    _write_manifest(cfg, 8, dim=cfg.model.dim * 2)  # the newest: another model
    c = make(cfg)
    assert c.step() is JobState.FAILED
    assert not launcher.calls  # nothing placed, no attempt spent
    assert "step-00000008" in c.failure and "different model" in c.failure and "dim" in c.failure
    assert "Point checkpoint.dir elsewhere" in job_status(redis_client, cfg.job.name)["fields"]["reason"]


def test_a_compatible_checkpoint_is_placed_as_usual(rig, tmp_path):
    make, launcher, *_ = rig
    cfg = job("faults-precheck-ok", output_dir=str(tmp_path))
    _write_manifest(cfg, 4)
    c = make(cfg)
    assert c.step() is JobState.PLACING
    assert c.step() is JobState.DIAGNOSING and len(launcher.calls) == 1


def test_a_lost_node_is_the_cause_and_is_evicted(rig, redis_client):
    make, launcher, *_ = rig
    cfg = job("faults-node-lost")
    c = make(cfg)
    drive_to_running(c)
    launcher.groups[0].script.append([
        RankEnded(0, kind="node_lost", detail="Ray reports node node-a dead; rank 0's process went with it"),
        RankEnded(1, kind="dead", detail="rank 1's process went with its node node-a")])
    assert c.step() is JobState.RECOVERING
    restarts = [json.loads(r) for r in redis_client.lrange(c.record.restarts_key, 0, -1)]
    assert [(r["cause"], r["node"]) for r in restarts] == [("node_lost", "node-a")]
    assert c.step() is JobState.PLACING
    assert c.step() is JobState.DIAGNOSING and launcher.calls[-1]["evicted"] == {"node-a"}
    events = job_status(redis_client, cfg.job.name, events=50)["events"]
    assert any(e["type"] == "fault" and e["fault"] == "node_lost" and e["node"] == "node-a" for e in events)
    assert any(e["type"] == "evicted" and e["node"] == "node-a" for e in events)


def _attempt_keys(redis_client, name: str) -> list[bytes]:
    return sorted(redis_client.scan_iter(match=keys.job_prefix(name) + "a[0-9]*"))


def _fill_attempt(redis_client, cfg, attempt: int) -> None:
    """What an attempt's workers leave in Redis: heartbeats, rendezvous store keys and their
    signal streams, a self-check store, a commit-ledger hash."""
    beat_all(redis_client, cfg, attempt, step=2, phase="forward")
    prefix = keys.attempt_prefix(cfg.job.name, attempt)
    redis_client.set(keys.store_prefix(cfg.job.name, attempt) + "k:rank0_addr", b"10.0.0.1:1234")
    redis_client.xadd(keys.store_prefix(cfg.job.name, attempt) + "s:rank0_addr", {"v": b"10.0.0.1:1234"})
    redis_client.set(prefix + "diag:0:k:arrive/0", b"1")
    redis_client.hset(prefix + "ckpt:2", "0", b"{}")


def test_ended_attempts_leave_no_keys_behind(rig, redis_client):
    make, launcher, *_ = rig
    cfg = job("faults-keys")
    c = make(cfg)
    drive_to_running(c)
    for attempt in range(3):
        _fill_attempt(redis_client, cfg, attempt)
        # 4 heartbeats, 4 others, and the ranks' log list the controller opened (rank_logs.py)
        assert len(_attempt_keys(redis_client, cfg.job.name)) == 4 + 4 + 1
        launcher.groups[-1].script.append([RankEnded(1, kind="dead", detail="rank 1's process died")])
        assert c.step() is JobState.RECOVERING
        assert _attempt_keys(redis_client, cfg.job.name) == []
        for _ in range(4):
            c.step()
    assert c.machine.state is JobState.RUNNING and c.attempt_number == 3
    _fill_attempt(redis_client, cfg, 3)
    launcher.groups[-1].script.append([finished(r) for r in range(4)])
    assert c.step() is JobState.SUCCEEDED
    assert _attempt_keys(redis_client, cfg.job.name) == []
    # The job-wide record stays: it is what `longrun status` and the next controller read.
    status = job_status(redis_client, cfg.job.name, events=100)
    assert status["state"] == "SUCCEEDED" and status["restarts"] == 3


def test_a_continuing_controller_deletes_what_the_dead_one_left(rig, redis_client):
    make, *_ = rig
    cfg = job("faults-keys-resume")
    drive_to_running(make(cfg))  # ... and its process dies with attempt 0's keys in Redis
    _fill_attempt(redis_client, cfg, 0)
    other = job("faults-keys-resume-other")  # another job's attempt keys are not touched
    _fill_attempt(redis_client, other, 0)
    second = make(cfg)
    assert second.step() is JobState.PLACING and second.attempt_number == 1
    assert _attempt_keys(redis_client, cfg.job.name) == []
    assert len(_attempt_keys(redis_client, other.job.name)) == 8


def test_the_controller_never_imports_torch(tmp_path):
    # ... nor do the writers it runs for the user (TensorBoard's event files, the journal).
    code = ("import longrun.controller.controller, longrun.controller.driver, sys; "
            "from longrun.observability.tensorboard import TensorBoardWriter; "
            f"w = TensorBoardWriter({str(tmp_path)!r}); w.step(1, {{'loss': 1.0}}); w.event('e'); w.close(); "
            "assert 'torch' not in sys.modules, sorted(m for m in sys.modules if m.startswith('torch'))[:3]")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr


def test_errors_are_classified_by_what_they_say_and_by_type():
    from longrun.checkpoint.restore import CheckpointMismatchError
    from longrun.config.loader import ConfigError
    from longrun.controller.outcomes import fault_kind_of
    from longrun.data.documents import DataError
    from longrun.trainer.trainer import NonFiniteLossError

    fatal = [DataError(DATA_ORDER), CheckpointMismatchError("another model"),
             ConfigError("job.yaml", [("model.dim", "must be positive")]), ImportError("no module x"),
             ModuleNotFoundError("No module named 'mymodel'"), SyntaxError("invalid syntax")]
    assert [fault_kind_of(e) for e in fatal] == ["fatal"] * len(fatal)
    assert fault_kind_of(NonFiniteLossError(3, float("nan"))) == "nan"
    assert fault_kind_of(RuntimeError("gloo connection closed")) == "exception"


class _Placement:
    node_ids = NODES

    def node_of(self, rank: int) -> str:
        return NODES[rank // 2]


def test_a_dead_rank_on_a_node_ray_reports_dead_is_node_lost_once(monkeypatch):
    from longrun.controller import workers

    asked: list[set[str]] = []
    monkeypatch.setattr(workers, "dead_nodes", lambda nodes: asked.append(set(nodes)) or {"node-a"})
    group = workers.RayWorkerGroup(_Placement(), actors=[])
    ended = group._blame_lost_nodes([
        RankEnded(0, kind="dead", detail="rank 0's process died"),
        RankEnded(1, kind="dead", detail="rank 1's process died"),
        RankEnded(2, kind="exception", detail="rank 2 raised RuntimeError"),
        RankEnded(3, kind="dead", detail="rank 3's process died")])
    assert asked == [{"node-a", "node-b"}]  # only the nodes of dead ranks are looked up
    assert [(e.rank, e.kind) for e in ended] == [(0, "node_lost"), (1, "dead"), (2, "exception"),
                                                 (3, "dead")]
    assert "node-a" in ended[0].detail and "went with its node node-a" in ended[1].detail
    later = group._blame_lost_nodes([RankEnded(1, kind="dead", detail="rank 1's process died")])
    assert later[0].kind == "dead"  # the node was reported once already
    assert group._blame_lost_nodes([RankEnded(2, kind="exception")]) and len(asked) == 2  # no lookup


def test_a_collective_broken_by_a_dead_peer_reads_as_a_sentence():
    from longrun.controller.outcomes import describe

    gloo = RuntimeError("[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection "
                        "closed by peer [127.0.0.1]:16547. This is typically caused by a remote worker "
                        "crashing. Check the logs of the remote worker before reporting an error. GLHF!")
    said = describe(3, gloo)
    assert said == ("rank 3 lost its connection to a peer in the middle of a collective (RuntimeError): "
                    "a peer's process likely died")
    assert "pair.cc" not in said
    assert describe(1, ValueError("first line\nthe reason")) == "rank 1 raised ValueError: the reason"
