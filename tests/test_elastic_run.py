"""Elastic continuation for real, on a simulated 3-node Ray cluster with no spare node: a
3-rank job (one per node) loses a node mid-run and continues on the 2 left without waiting for
placement (recovery.shrink_after_s = 0), restoring from storage at the smaller layout (never
from the old layout's memory snapshots); when a node joins again it grows back to 3 at a
checkpoint taken at the next step boundary, and finishes.

Paced by holds, not sleeps: every rank holds at step 3 of the first attempt (after the step-2
checkpoint) while the node is removed, and at step 5 of the shrunk attempt while the node is
given back, so each change lands mid-run on the first try.
"""

from __future__ import annotations

import json
import threading
import time

import fsspec
import pytest
from clusters import simulated_cluster

from longrun.checkpoint.layout import committed_steps
from longrun.config import config_from_dict
from longrun.controller.controller import Controller, job_status
from longrun.controller.job_state import JobRecordStore
from longrun.controller.workers import RayLauncher

STEPS = 8
SHRUNK_HOLD = 5  # the shrunk attempt (1) holds here until the node is back and the grow is asked


def job(tmp_path):
    def hold(rank: int, step: int, attempt: int, name: str) -> dict:
        return {"rank": rank, "step": step, "attempt": attempt, "kind": "hold",
                "release_file": str(tmp_path / name)}

    return config_from_dict({
        "job": {"name": "elastic", "seed": 7, "output_dir": str(tmp_path)},
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
        "recovery": {"restart_backoff_s": 0.0, "diagnostics": [], "min_nodes": 2, "shrink_after_s": 0.0},
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


def _events(redis_client, kind: str) -> list[dict]:
    return [e for e in job_status(redis_client, "elastic", events=500)["events"] if e["type"] == kind]


@pytest.fixture(scope="module")
def cluster():
    with simulated_cluster(3, 1) as (c, _):
        yield c


def test_a_job_shrinks_on_a_lost_node_and_grows_back_at_a_checkpoint(cluster, redis_server, redis_client,
                                                                     tmp_path):
    cfg = job(tmp_path)
    store = JobRecordStore(redis_client, cfg.job.name)
    fs, root = fsspec.core.url_to_fs(cfg.checkpoint_dir)
    result: dict = {}
    failure: list[BaseException] = []

    def run() -> None:
        try:
            # No warm spares: each resize places from scratch, and spares would only compete
            # for the two cores.
            result.update(Controller(cfg, redis_server.url, launch=RayLauncher(spares=False)).run())
        except BaseException as exc:  # surfaced by the assertions below
            failure.append(exc)

    thread = threading.Thread(target=run)
    thread.start()
    try:
        _wait("step 3 and the step-2 checkpoint", lambda: failure or (
            (r := store.read()) is not None and r.step >= 3 and 2 in _committed(fs, root)))
        assert not failure, failure
        victim = json.loads(store.read().fields["nodes"])[-1]  # rank 2's node
        cluster.remove_node(next(n for n in cluster.list_all_nodes() if n.node_id == victim))
        _wait("the shrunk attempt to reach its hold", lambda: failure or (
            (r := store.read()) is not None and r.attempt == 1 and r.step >= SHRUNK_HOLD))
        assert not failure, failure
        cluster.add_node(num_cpus=1)  # capacity is back
        _wait("the grow request", lambda: failure or _events(redis_client, "grow_requested"))
        (tmp_path / "release").touch()
        thread.join(300)
    finally:
        (tmp_path / "release").touch()  # never leave ranks held
        thread.join(300)
    assert not thread.is_alive()
    assert not failure, failure
    assert result["step"] == STEPS and result["nodes"] == 3
    assert result["restarts"] == 1  # the lost node; the grow spent no restart budget
    assert result["resumed_from"] == SHRUNK_HOLD + 1  # the grow's checkpoint: the step after the hold

    resized = _events(redis_client, "resized")
    assert [(e["direction"], e["from_nodes"], e["nodes"], e["world_size"], e["attempt"])
            for e in resized] == [("shrink", 3, 2, 2, 1), ("grow", 2, 3, 3, 2)]
    # No waiting for placement: the shrunk attempt was placed right after the fault.
    assert not _events(redis_client, "waiting_for_nodes")
    # The shrunk attempt restored the step-2 checkpoint from storage, not the memory snapshots of
    # step 3 the keepers held for the 3-rank layout.
    recovered = {e["attempt"]: e for e in _events(redis_client, "recovered")}
    assert recovered[1]["resumed_from"] == 2 and recovered[2]["resumed_from"] == SHRUNK_HOLD + 1
    restarts = store.restarts()
    assert [(r["cause"], r["node"]) for r in restarts] == [("node_lost", victim)]
    assert job_status(redis_client, "elastic")["fields"]["size"] == "3 of 3 node(s), 3 rank(s)"
