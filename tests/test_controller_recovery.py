"""The controller on a simulated 3-node Ray cluster with a real Redis: a 4-worker job (2 nodes
x 2 workers, one spare node) survives a SIGKILLed worker and a SIGSTOPped (hung) one, and
finishes with exactly the weights of an uninterrupted run; a spent restart budget ends in
FAILED with the reason."""

from __future__ import annotations

import json
import os
import shutil
import time

import pytest
import torch
from clusters import committed_weights, simulated_cluster

from longrun.config import config_from_dict
from longrun.controller.controller import Controller, JobFailed, job_status
from longrun.controller.job_state import JobRecordStore
from longrun.goodput.summary import read_summary

STEPS = 8


def job(name: str, tmp_path, faults=(), node_agents="off", store_patience_s=60.0, **recovery):
    return config_from_dict({
        "job": {"name": name, "seed": 7, "output_dir": str(tmp_path)},
        "cluster": {"nodes": 2, "workers_per_node": 2, "device": "cpu"},
        "parallelism": {"dp": 4},
        "model": {"dim": 64, "n_layers": 2, "n_heads": 4, "max_seq_len": 64},
        "data": {"source": "synthetic", "micro_batch_tokens": 128, "prefetch": 1,
                 "synthetic": {"min_len": 8, "max_len": 64, "mean": 24, "sigma": 0.8}},
        "training": {"steps": STEPS, "lr": 3e-3, "warmup_steps": 2, "log_every": 100},
        "checkpoint": {"interval_steps": 2, "keep_last": 10},
        "health": {"heartbeat_interval_s": 0.5, "heartbeat_timeout_s": 3.0, "hang_timeout_s": 60,
                   "hang_min_s": 5, "faults": list(faults), "node_agents": node_agents,
                   "store_patience_s": store_patience_s},
        "recovery": {"restart_backoff_s": 0.0} | recovery,
    })


@pytest.fixture(scope="module")
def cluster():
    with simulated_cluster(3, 2) as (c, _):
        yield c


@pytest.fixture(scope="module")
def reference(cluster, redis_server, tmp_path_factory):
    cfg = job("reference", tmp_path_factory.mktemp("ref"))
    summary = Controller(cfg, redis_server.url).run()
    assert summary["step"] == STEPS and summary["restarts"] == 0
    return committed_weights(cfg.checkpoint_dir, STEPS)


def _assert_same_weights(got, want):
    assert got.keys() == want.keys()
    for name in want:
        assert torch.equal(got[name], want[name]), f"{name} differs from the uninterrupted run"


# A SIGKILL through the node agents (the per-rank path's SIGKILL is in test_memory_snapshots and the
# chaos test), a SIGSTOP through the per-rank keys.
@pytest.mark.parametrize("kind, rank, agents", [("kill", 1, "on"), ("hang", 2, "off")])
def test_a_lost_worker_is_replaced_and_nothing_committed_is_lost(kind, rank, agents, cluster, reference,
                                                                 redis_server, redis_client, tmp_path):
    # agents "on": the heartbeats go through one agent per node (health/node_agent.py), as at scale.
    cfg = job(f"fault-{kind}-agents-{agents}", tmp_path, faults=[{"rank": rank, "step": 3, "kind": kind}],
              node_agents=agents)
    lines: list[str] = []
    summary = Controller(cfg, redis_server.url, on_event=lines.append).run()
    assert summary["step"] == STEPS
    assert summary["restarts"] == 1 and summary["attempt"] == 1
    # The newest checkpoint committed before the fault (2), or the peers' memory snapshot of
    # step 3 when it reached them before the fault fired after that step (never less).
    assert summary["resumed_from"] in (2, 3)
    _assert_same_weights(committed_weights(cfg.checkpoint_dir, STEPS), reference)
    status = job_status(redis_client, cfg.job.name, events=100)
    assert status["state"] == "SUCCEEDED" and status["attempt"] == 1
    faults = [e for e in status["events"] if e["type"] == "fault"]
    # The lost rank is named (its peers' failed collectives may be reported too).
    assert any(e["fault"] == "dead" and e["rank"] == rank for e in faults), faults
    assert any(e["type"] == "decision" and "restart" in e["reason"] for e in status["events"])
    # Every rank's beats reached the controller in the new attempt (through the agents where on).
    assert any(e["type"] == "recovered" for e in status["events"]), status["events"]
    # Both attempts' rendezvous store, heartbeats, self-check stores and commit ledgers are gone.
    assert not list(redis_client.scan_iter(match=f"longrun:{cfg.job.name}:a[0-9]*")), "attempt keys left"


def test_the_restart_budget_ends_in_failed_with_the_reason(cluster, redis_server, redis_client, tmp_path):
    cfg = job("no-budget", tmp_path, faults=[{"rank": 0, "step": 2, "kind": "raise"}], max_restarts=0)
    with pytest.raises(JobFailed, match="restart budget spent"):
        Controller(cfg, redis_server.url).run()
    status = job_status(redis_client, cfg.job.name)
    assert status["state"] == "FAILED"
    assert "restart budget" in status["fields"]["reason"]


def test_nan_restarts_from_the_checkpoint_before_it(cluster, reference, redis_server, redis_client,
                                                     tmp_path):
    cfg = job("fault-nan", tmp_path, faults=[{"rank": 1, "step": 3, "kind": "nan"}])
    summary = Controller(cfg, redis_server.url).run()
    assert summary["step"] == STEPS and summary["restarts"] == 1 and summary["resumed_from"] == 2
    _assert_same_weights(committed_weights(cfg.checkpoint_dir, STEPS), reference)
    faults = [e for e in job_status(redis_client, cfg.job.name, events=100)["events"]
              if e["type"] == "fault"]
    # Seen by the monitor (heartbeats: after step 3) and by Ray (the step-4 exception).
    assert {e["fault"] for e in faults} == {"nan"} and {e["step"] for e in faults} <= {3, 4}, faults


_CONTROLLER = """
import sys, ray
from longrun.config import load_config
from longrun.controller.controller import Controller
ray.init(address=sys.argv[1])
Controller(load_config(sys.argv[2]), sys.argv[3]).run()
"""


def _wait_for_step(redis_client, job: str, step: int, timeout: float = 300) -> None:
    import time

    store, deadline = JobRecordStore(redis_client, job), time.monotonic() + timeout
    while (record := store.read()) is None or record.step < step:
        assert time.monotonic() < deadline, f"{job} never reached step {step}"
        time.sleep(0.1)


def _wait_for_commit(checkpoint_dir: str, step: int, timeout: float = 300) -> None:
    import time

    import fsspec

    from longrun.checkpoint.layout import committed_steps

    fs, root = fsspec.core.url_to_fs(checkpoint_dir)
    deadline = time.monotonic() + timeout
    while step not in committed_steps(fs, root):
        assert time.monotonic() < deadline, f"step {step} was never committed under {checkpoint_dir}"
        time.sleep(0.1)
        fs.invalidate_cache()


def test_a_killed_controller_is_resubmitted_and_resumes(cluster, reference, redis_server, redis_client,
                                                         tmp_path):
    import subprocess
    import sys

    # A short store patience: a dead controller's lease expires store_patience_s + 10 s after its
    # last renewal, and the resubmitted controller waits that out.
    cfg = job("controller-killed", tmp_path, faults=[{"rank": 0, "step": 5, "kind": "slow", "seconds": 1.0}],
              store_patience_s=5.0)
    path = tmp_path / "job.yaml"
    path.write_text(cfg.to_yaml())
    first = subprocess.Popen([sys.executable, "-c", _CONTROLLER, cluster.address, str(path),
                              redis_server.url])
    try:
        _wait_for_step(redis_client, cfg.job.name, 5)
        # Step 4's save commits in the background, after step 5 may have started: kill the
        # controller once it is committed, which is what the resume below must not lose.
        _wait_for_commit(cfg.checkpoint_dir, 4)
    finally:
        first.kill()  # the controller dies; Ray reaps the actors it owned
        first.wait()
    restarted = time.time()  # the second controller starts after this
    summary = Controller(cfg, redis_server.url).run()
    finished = time.time()
    assert summary["step"] == STEPS and summary["attempt"] >= 1 and summary["resumed_from"] >= 4
    _assert_same_weights(committed_weights(cfg.checkpoint_dir, STEPS), reference)
    events = job_status(redis_client, cfg.job.name, events=100)["events"]
    assert any(e["type"] == "resume" for e in events), events
    # Goodput spans both controllers: the death is a fault, the time without a controller its own
    # bucket, and the buckets fill the wall time by the clock from the first controller's start.
    goodput = read_summary(redis_client, cfg.job.name)
    assert goodput.buckets["controller_down"] > 0, goodput
    assert [f["kind"] for f in goodput.faults] == ["controller_lost"], goodput.faults
    # The death is declared by the controller that took over (after it started, before it
    # ended), charged the steps the dead one's attempt finished past the step restored, and the
    # gap it left ends at that declaration, after the first controller's start.
    [lost] = goodput.faults
    assert restarted <= lost["declared_at"] <= finished, (lost, restarted, finished)
    assert lost["last_step"] >= 5 and lost["restored_step"] == summary["resumed_from"], (lost, summary)
    assert lost["steps_lost"] == lost["last_step"] - lost["restored_step"], lost
    assert goodput.buckets["controller_down"] <= lost["declared_at"] - goodput.origin, goodput
    assert sum(goodput.buckets.values()) == pytest.approx(goodput.wall_s, rel=0.02), goodput
    assert goodput.unaccounted_s == pytest.approx(0.0, abs=0.01 * goodput.wall_s), goodput


@pytest.mark.slow  # the suite's time: a removed node is in tests/test_memory_snapshots.py and a spare
# taking a lost node's place in tests/test_placement_node_loss.py, both in the default run
def test_a_removed_node_is_replaced_by_the_spare(cluster, reference, redis_server, redis_client, tmp_path):
    import threading

    cfg = job("node-removed", tmp_path, faults=[{"rank": 0, "step": 3, "kind": "slow", "seconds": 1.0}])
    result: dict = {}
    controller = Controller(cfg, redis_server.url)
    thread = threading.Thread(target=lambda: result.update(controller.run()))
    thread.start()
    _wait_for_step(redis_client, cfg.job.name, 3)
    victim = json.loads(JobRecordStore(redis_client, cfg.job.name).read().fields["nodes"])[0]
    node = next(n for n in cluster.list_all_nodes() if n.node_id == victim)
    cluster.remove_node(node)
    try:
        thread.join(600)
    finally:
        # Leave the module's cluster as it was found: 3 worker nodes (the chaos run may evict one).
        cluster.add_node(num_cpus=2)
        cluster.wait_for_nodes()
    assert not thread.is_alive()
    assert result["step"] == STEPS and result["restarts"] >= 1
    final_nodes = json.loads(JobRecordStore(redis_client, cfg.job.name).read().fields["nodes"])
    assert victim not in final_nodes
    _assert_same_weights(committed_weights(cfg.checkpoint_dir, STEPS), reference)
    # Ray's word that the node died makes the node the cause (not its ranks' deaths), once.
    restarts = JobRecordStore(redis_client, cfg.job.name).restarts()
    assert (restarts[0]["cause"], restarts[0]["node"]) == ("node_lost", victim), restarts
    faults = [e for e in job_status(redis_client, cfg.job.name, events=200)["events"] if e["type"] == "fault"]
    assert [e["node"] for e in faults if e["fault"] == "node_lost"] == [victim], faults


def _text_corpus(directory, files: int):
    directory.mkdir()
    for i in range(files):
        body = f"def f{i}(x):\n    return x * {i} + {i * 7}\n"
        (directory / f"doc{i:03d}.py").write_text(body * (1 + i % 5))
    return str(directory)


def test_data_changed_in_place_ends_the_job_at_once_with_the_real_cause(cluster, redis_server, redis_client,
                                                                         tmp_path):
    """Resuming after the data changed can never work on any node: the job ends FAILED after
    one attempt with the sampler's own message, not after a storm of restarts. The corpus is
    rewritten at the same path, which the settings recorded in the checkpoint cannot show (a
    changed data.path is refused before placement: tests/test_hostile_resume_identity.py)."""

    def cfg_for(path: str, steps: int):
        return config_from_dict({
            "job": {"name": "data-changed", "seed": 7, "output_dir": str(tmp_path)},
            "cluster": {"nodes": 1, "workers_per_node": 1, "device": "cpu"},
            "parallelism": {"dp": 1},
            "model": {"dim": 32, "n_layers": 1, "n_heads": 2, "max_seq_len": 64},
            "data": {"source": "text", "path": path, "micro_batch_tokens": 128, "prefetch": 1},
            "training": {"steps": steps, "warmup_steps": 1, "log_every": 100},
            "checkpoint": {"interval_steps": 2},
            "recovery": {"restart_backoff_s": 0.0, "diagnostics": []},
        })

    first = Controller(cfg_for(_text_corpus(tmp_path / "corpus", 20), 2), redis_server.url).run()
    assert first["step"] == 2
    shutil.rmtree(tmp_path / "corpus")
    with pytest.raises(JobFailed, match="cannot resume the data order") as failed:
        Controller(cfg_for(_text_corpus(tmp_path / "corpus", 31), 4), redis_server.url).run()
    assert "num_docs" in str(failed.value) and "fatal error" in str(failed.value)
    status = job_status(redis_client, "data-changed", events=100)
    assert status["state"] == "FAILED" and status["restarts"] == 0
    assert [e["fault"] for e in status["events"] if e["type"] == "fault"] == ["fatal"]


def test_a_redis_restart_mid_run_is_ridden_out_without_a_false_fault(cluster, reference, tmp_path):
    """Redis is SIGKILLed while the job trains (and commits a checkpoint) and comes back a few
    seconds later on the same port with the same password and its append-only file: the
    heartbeats and the job record reconnect, no rank is declared dead, nothing restarts,
    and the weights are those of the uninterrupted run."""
    import signal
    import threading
    import time

    from longrun.services import EmbeddedRedis
    from longrun.services.ports import free_port

    port, password, data = free_port(), "restart-me", tmp_path / "redis-data"
    server = EmbeddedRedis(port=port, password=password, persist_dir=data).start()
    url = server.url
    cfg = job("redis-restart", tmp_path, faults=[{"rank": 0, "step": 2, "kind": "slow", "seconds": 1.0}])
    result: dict = {}
    errors: list[BaseException] = []

    def run() -> None:
        try:
            result.update(Controller(cfg, url).run())
        except BaseException as exc:  # surfaced by the assertions below
            errors.append(exc)

    thread = threading.Thread(target=run)
    thread.start()
    try:
        watcher = server.client(socket_timeout=5)
        _wait_for_step(watcher, cfg.job.name, 3)
        watcher.close()
        os.kill(server.process.pid, signal.SIGKILL)  # a crash: no shutdown, no final save
        server.stop()
        time.sleep(4.0)  # the outage itself (the fault being injected), longer than heartbeat_timeout_s
        server = EmbeddedRedis(port=port, password=password, persist_dir=data).start()
        thread.join(600)
        assert not thread.is_alive() and not errors, errors
        assert result["step"] == STEPS and result["restarts"] == 0 and result["attempt"] == 0
        _assert_same_weights(committed_weights(cfg.checkpoint_dir, STEPS), reference)
        client = server.client()
        events = job_status(client, cfg.job.name, events=200)["events"]
        client.close()
        outages = [e for e in events if e["type"] == "store_outage"]
        assert outages and outages[0]["seconds"] >= 3.0, events  # the controller saw it ...
        assert not [e for e in events if e["type"] == "fault"], events  # ... and blamed no rank
        assert [e["to"] for e in events if e["type"] == "transition"][-1] == "SUCCEEDED"
    finally:
        thread.join(600)
        server.stop()


def chaos_faults(seed: int, count: int) -> list[dict]:
    """One fault per attempt (each fault fires only in its own attempt), at random ranks,
    steps and kinds. A step the attempt resumed past fires at its first completed step."""
    import random

    rng = random.Random(seed)
    faults = [{"rank": rng.randrange(4), "step": rng.randrange(1, STEPS), "attempt": attempt,
               "kind": rng.choice(["kill", "hang", "raise", "nan"])} for attempt in range(count)]
    # One NaN at most: two on the same step (a restart resumes just before it) are, rightly,
    # read by the policy as bad data, whose window it skips: not the uninterrupted run's weights.
    for later in [f for f in faults if f["kind"] == "nan"][1:]:
        later["kind"] = rng.choice(["kill", "hang", "raise"])
    return faults


@pytest.mark.slow  # the suite's time: the default run's bounded soak (tests/test_soak.py) injects
# faults at random moments and compares bitwise; each kind here has its own test above
def test_chaos_random_faults_until_the_end_lose_nothing(cluster, reference, redis_server, redis_client,
                                                        tmp_path):
    """A bounded chaos run (3 faults; LONGRUN_CHAOS_FAULTS for more, LONGRUN_CHAOS_SEED to
    replay one): every fault is detected and recovered from, each costs exactly one restart,
    and the job ends with the uninterrupted run's weights. (The cluster has one spare node:
    with more faults, two evictions for repeated deaths on a node can leave too few nodes.)"""
    import time

    seed = int(os.environ.get("LONGRUN_CHAOS_SEED", time.time_ns() % 100_000))
    count = int(os.environ.get("LONGRUN_CHAOS_FAULTS", 3))
    faults = chaos_faults(seed, count)
    replay = f"replay with LONGRUN_CHAOS_SEED={seed}: {faults}"
    cfg = job("chaos", tmp_path, faults=faults, max_restarts=count, max_restarts_in_window=count)
    try:
        summary = Controller(cfg, redis_server.url).run()
    except JobFailed as exc:
        raise AssertionError(f"{exc}; {replay}") from exc
    assert summary["step"] == STEPS, replay
    _assert_same_weights(committed_weights(cfg.checkpoint_dir, STEPS), reference)
    events = job_status(redis_client, cfg.job.name, events=1000)["events"]
    injected = [e for e in events if e["type"] == "fault_injected"]
    # Each attempt's fault fires unless the attempt resumed at the end already (a fault that
    # fired after the last step's checkpoint, or a memory snapshot that put the restart past
    # the next fault's step and its first step was the last): so the faults that fired are
    # the first ones, one per attempt, and each cost exactly one restart.
    assert injected and [e["attempt"] for e in injected] == list(range(len(injected))), replay
    assert summary["restarts"] == summary["attempt"] == len(injected), replay
    for spec, fired in zip(faults, injected, strict=False):
        assert (fired["fault"], fired["rank"]) == (spec["kind"], spec["rank"]), replay
