"""Elastic continuation for real, on a simulated 3-node Ray cluster with no spare node: a
3-rank job (one per node) loses a node mid-run and continues on the 2 left without waiting for
placement (recovery.shrink_after_s = 0), restoring from storage at the smaller layout (never
from the old layout's memory snapshots); when a node joins again it grows back to 3 at a
checkpoint taken at the next step boundary, and finishes. Training across the resizes is right:
each segment's weights equal, bitwise, those of a plain run at that segment's layout started
from the same checkpoint (the shrunk 2 ranks from the shrink's restore point, the grown 3 from
the grow's checkpoint), so the final weights are what those reference runs reach.

Busy is not gone (issue 26, hole 1): when the node comes back but another job (a placement
group here) holds its CPU, the job keeps training on 2 nodes, asks for no grow while the node
is busy, and finishes SUCCEEDED with no restart budget spent on the wait.

Paced by holds, not sleeps: every rank holds at step 3 of the first attempt (after the step-2
checkpoint) while the node is removed, and at step 5 of the shrunk attempt while the node is
given back, so each change lands mid-run on the first try.
"""

from __future__ import annotations

import json
import shutil
import threading
import time
from pathlib import Path

import fsspec
import pytest
import torch
from clusters import committed_weights, simulated_cluster

from longrun.checkpoint.layout import LATEST, committed_steps, step_dir_name
from longrun.config import JobConfig, config_from_dict
from longrun.controller.controller import Controller, job_status
from longrun.controller.elastic import resized
from longrun.controller.job_state import JobRecordStore
from longrun.controller.placement import alive_nodes
from longrun.controller.workers import RayLauncher

STEPS = 8
SHRUNK_HOLD = 5  # the shrunk attempt (1) holds here until the node is back and the grow is asked


def job(tmp_path, name: str = "elastic", **recovery):
    def hold(rank: int, step: int, attempt: int, release: str) -> dict:
        return {"rank": rank, "step": step, "attempt": attempt, "kind": "hold",
                "release_file": str(tmp_path / release)}

    return config_from_dict({
        "job": {"name": name, "seed": 7, "output_dir": str(tmp_path)},
        "cluster": {"nodes": 3, "workers_per_node": 1, "device": "cpu"},
        "parallelism": {"dp": 3},
        "model": {"dim": 64, "n_layers": 2, "n_heads": 4, "max_seq_len": 64},
        "data": {"source": "synthetic", "micro_batch_tokens": 128, "prefetch": 1,
                 "synthetic": {"min_len": 8, "max_len": 64, "mean": 24, "sigma": 0.8}},
        "training": {"steps": STEPS, "grad_accum": 2, "lr": 3e-3, "warmup_steps": 2, "log_every": 100},
        "checkpoint": {"interval_steps": 2, "keep_last": 10},
        # Held ranks are judged by the hard ceiling only.
        "health": {"heartbeat_interval_s": 0.5, "heartbeat_timeout_s": 3.0, "hang_timeout_s": 120,
                   "hang_min_s": 5,
                   # Attempt 0's hold is never released: its ranks go with the restart.
                   "faults": [hold(r, 3, 0, "never") for r in range(3)]
                   + [hold(r, SHRUNK_HOLD, 1, "release") for r in range(2)]},
        "recovery": {"restart_backoff_s": 0.0, "diagnostics": [], "min_nodes": 2, "shrink_after_s": 0.0}
        | recovery,
    })


def _wait(what: str, ready, timeout: float = 240.0) -> None:
    deadline = time.monotonic() + timeout
    while not ready():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


def _committed(fs, root: str) -> list[int]:
    try:
        return committed_steps(fs, root)
    except OSError:  # nothing written yet
        return []


def _events(redis_client, kind: str, job_name: str = "elastic") -> list[dict]:
    return [e for e in job_status(redis_client, job_name, events=500)["events"] if e["type"] == kind]


class Background:
    """A controller running its job in a thread; `wait` fails early if the job failed."""

    def __init__(self, cfg: JobConfig, redis_url: str, **kw):
        self.result: dict = {}
        self.failure: list[BaseException] = []
        # No warm spares: each resize places from scratch, and spares would only compete for
        # the two cores.
        self.controller = Controller(cfg, redis_url, launch=RayLauncher(spares=False), **kw)
        self.thread = threading.Thread(target=self._run)
        self.thread.start()

    def _run(self) -> None:
        try:
            self.result.update(self.controller.run())
        except BaseException as exc:  # surfaced by the assertions
            self.failure.append(exc)

    def wait(self, what: str, ready) -> None:
        _wait(what, lambda: self.failure or ready())
        assert not self.failure, self.failure


def _reference_run(cfg: JobConfig, redis_url: str, tmp_path, name: str, source: str, step: int,
                   **checkpoint) -> JobConfig:
    """`cfg`'s layout run plainly (no faults, not elastic) under its own name from a copy of
    checkpoint `step` under `source`, to the end; its config."""
    data = cfg.model_dump(mode="json")
    data["job"] |= {"name": name, "output_dir": str(tmp_path / name)}
    data["health"]["faults"] = []
    data["recovery"]["min_nodes"] = None
    data["checkpoint"] |= checkpoint
    ref = config_from_dict(data)
    Path(ref.checkpoint_dir).mkdir(parents=True)
    shutil.copytree(f"{source}/{step_dir_name(step)}", f"{ref.checkpoint_dir}/{step_dir_name(step)}")
    Path(ref.checkpoint_dir, LATEST).write_text(step_dir_name(step))
    summary = Controller(ref, redis_url, launch=RayLauncher(spares=False), serve_metrics=False).run()
    assert summary["step"] == STEPS and summary["resumed_from"] == step, summary
    return ref


def _assert_same_weights(got: dict, want: dict, what: str) -> None:
    assert got.keys() == want.keys()
    for name in want:
        assert torch.equal(got[name], want[name]), f"{name} differs from the reference at {what}"


@pytest.fixture(scope="module")
def cluster():
    with simulated_cluster(3, 1) as (c, _):
        yield c


def test_a_job_shrinks_on_a_lost_node_and_grows_back_at_a_checkpoint(cluster, redis_server, redis_client,
                                                                     tmp_path):
    cfg = job(tmp_path)
    store = JobRecordStore(redis_client, cfg.job.name)
    fs, root = fsspec.core.url_to_fs(cfg.checkpoint_dir)
    run = Background(cfg, redis_server.url)
    try:
        run.wait("step 3 and the step-2 checkpoint", lambda: (
            (r := store.read()) is not None and r.step >= 3 and 2 in _committed(fs, root)))
        victim = json.loads(store.read().fields["nodes"])[-1]  # rank 2's node
        cluster.remove_node(next(n for n in cluster.list_all_nodes() if n.node_id == victim))
        run.wait("the shrunk attempt to reach its hold", lambda: (
            (r := store.read()) is not None and r.attempt == 1 and r.step >= SHRUNK_HOLD))
        cluster.add_node(num_cpus=1)  # capacity is back
        run.wait("the grow request", lambda: _events(redis_client, "grow_requested"))
        (tmp_path / "release").touch()
        run.thread.join(300)
    finally:
        (tmp_path / "release").touch()  # never leave ranks held
        run.thread.join(300)
    assert not run.thread.is_alive()
    assert not run.failure, run.failure
    result = run.result
    assert result["step"] == STEPS and result["nodes"] == 3
    assert result["restarts"] == 1  # the lost node; the grow spent no restart budget
    grown_from = SHRUNK_HOLD + 1  # the grow's checkpoint: the step after the hold
    assert result["resumed_from"] == grown_from

    resized_events = _events(redis_client, "resized")
    assert [(e["direction"], e["from_nodes"], e["nodes"], e["world_size"], e["attempt"])
            for e in resized_events] == [("shrink", 3, 2, 2, 1), ("grow", 2, 3, 3, 2)]
    # No waiting for placement: the shrunk attempt was placed right after the fault.
    assert not _events(redis_client, "waiting_for_nodes")
    # The shrunk attempt restored the step-2 checkpoint from storage, or the memory snapshots of
    # step 3 the keepers held for the 3-rank layout, resharded to 2 ranks (issue 26, hole 9).
    recovered = {e["attempt"]: e for e in _events(redis_client, "recovered")}
    shrunk_from = recovered[1]["resumed_from"]
    assert shrunk_from in (2, 3) and recovered[2]["resumed_from"] == grown_from
    restarts = store.restarts()
    assert [(r["cause"], r["node"]) for r in restarts] == [("node_lost", victim)]
    assert job_status(redis_client, "elastic")["fields"]["size"] == "3 of 3 node(s), 3 rank(s)"

    # Training across the resizes is right: the shrunk segment equals a plain 2-rank run from the
    # checkpoint it restored, at the grow's checkpoint; the grown segment equals a plain 3-rank
    # run from that checkpoint, at the end. (Across a layout change the float sums are ordered
    # differently, so a run that never resized is no bitwise reference; test_reshard_resume.py
    # shows such a run trains the same samples in the same order on the same curve.)
    committed = set(_committed(fs, root))
    assert {grown_from, STEPS} <= committed
    shrink_source = cfg.checkpoint_dir
    if shrunk_from not in committed:
        # Restored from memory: a snapshot holds the 3-rank state of that step, which is what a
        # plain 3-rank run from the checkpoint before it reaches there (committed every step here).
        before = max(step for step in committed if step < shrunk_from)
        full = _reference_run(cfg, redis_server.url, tmp_path, "elastic-ref-full", cfg.checkpoint_dir,
                              before, interval_steps=1)
        shrink_source = full.checkpoint_dir
    shrunk = _reference_run(resized(cfg, 2), redis_server.url, tmp_path, "elastic-ref-shrunk",
                            shrink_source, shrunk_from)
    _assert_same_weights(committed_weights(cfg.checkpoint_dir, grown_from),
                         committed_weights(shrunk.checkpoint_dir, grown_from), f"step {grown_from}")
    grown = _reference_run(cfg, redis_server.url, tmp_path, "elastic-ref-grown", cfg.checkpoint_dir,
                           grown_from)
    _assert_same_weights(committed_weights(cfg.checkpoint_dir, STEPS),
                         committed_weights(grown.checkpoint_dir, STEPS), f"step {STEPS}")


def _busy_view(node_id: str) -> bool:
    """Whether Ray's view of free resources (what the controller reads) shows `node_id` busy."""
    return any(n.node_id == node_id and n.available.get("CPU", 0.0) < 1.0 for n in alive_nodes())


@pytest.mark.slow  # the suite's time: growing back is in the default run above
def test_a_node_that_comes_back_busy_is_not_grown_onto_and_the_job_finishes_on_fewer(
        cluster, redis_server, redis_client, tmp_path):
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group

    # One restart allowed, spent on the lost node: a wait on the busy node that spent budget
    # (growing onto it, timing out, an "exception" restart) would fail the job.
    cfg = job(tmp_path, name="elastic-busy", max_restarts=1)
    store = JobRecordStore(redis_client, cfg.job.name)
    fs, root = fsspec.core.url_to_fs(cfg.checkpoint_dir)
    before = {n.node_id for n in alive_nodes()}
    run = Background(cfg, redis_server.url, placement_timeout_s=20.0)
    other_job = None
    try:
        run.wait("step 3 and the step-2 checkpoint", lambda: (
            (r := store.read()) is not None and r.step >= 3 and 2 in _committed(fs, root)))
        victim = json.loads(store.read().fields["nodes"])[-1]
        cluster.remove_node(next(n for n in cluster.list_all_nodes() if n.node_id == victim))
        run.wait("the shrunk attempt to reach its hold", lambda: (
            (r := store.read()) is not None and r.attempt == 1 and r.step >= SHRUNK_HOLD))
        # Another job waits for a core; the node that comes back is where it gets one.
        other_job = placement_group([{"CPU": 1.0}], strategy="STRICT_PACK", name="another-job")
        back = cluster.add_node(num_cpus=1)
        assert back.node_id not in before
        ready, _ = ray.wait([other_job.ready()], timeout=120)
        assert ready, "the other job's placement group was never placed on the returned node"
        _wait("Ray to show the returned node busy", lambda: _busy_view(back.node_id))
        busy_since = time.time()
        (tmp_path / "release").touch()
        run.thread.join(300)
    finally:
        (tmp_path / "release").touch()
        run.thread.join(300)
        if other_job is not None:
            remove_placement_group(other_job)
    assert not run.thread.is_alive()
    assert not run.failure, run.failure
    result = run.result
    assert result["step"] == STEPS and result["nodes"] == 2  # kept training on fewer nodes
    assert result["restarts"] == 1  # the lost node only
    assert [r["cause"] for r in store.restarts()] == ["node_lost"]
    status = job_status(redis_client, cfg.job.name, events=500)
    assert status["state"] == "SUCCEEDED"
    assert status["fields"]["size"] == "2 of 3 node(s), 2 rank(s)"
    # Once the node is busy in Ray's view, no grow is asked for. (A poll in the moment between
    # the node joining and the other job taking it may ask one; its placement then times out and
    # the job goes on at 2 nodes, as the counts above check.)
    asked = [e for e in status["events"] if e["type"] == "grow_requested"]
    assert all(e["at"] < busy_since for e in asked), asked
    assert [e["direction"] for e in status["events"] if e["type"] == "resized"] == ["shrink"]
    assert not [e for e in status["events"] if e["type"] == "fault" and e["attempt"] > 0]
