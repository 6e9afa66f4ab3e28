"""The controller on a simulated 3-node Ray cluster with a real Redis: a 4-worker job (2 nodes
x 2 workers, one spare node) survives a SIGKILLed worker and a SIGSTOPped (hung) one, and
finishes with exactly the weights of an uninterrupted run; a spent restart budget ends in
FAILED with the reason."""

from __future__ import annotations

import os

import pytest
import torch

from longrun.config import config_from_dict
from longrun.controller.controller import Controller, JobFailed, job_status

STEPS = 8


def job(name: str, tmp_path, faults=(), **recovery):
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
                   "hang_min_s": 5, "faults": list(faults)},
        "recovery": {"restart_backoff_s": 0.0} | recovery,
    })


def final_weights(cfg) -> dict[str, torch.Tensor]:
    path = os.path.join(cfg.checkpoint_dir, f"step-{STEPS:08d}", "model-00000.pt")
    return torch.load(path, weights_only=True)["model"]


@pytest.fixture(scope="module")
def cluster():
    import ray
    from ray.cluster_utils import Cluster

    os.environ["OMP_NUM_THREADS"] = "1"  # 4 workers share 2 cores; raylets pass it on
    c = Cluster(initialize_head=True, head_node_args={"num_cpus": 0})
    for _ in range(3):
        c.add_node(num_cpus=2)
    c.wait_for_nodes()
    ray.init(address=c.address)
    yield c
    ray.shutdown()
    c.shutdown()


@pytest.fixture(scope="module")
def reference(cluster, redis_server, tmp_path_factory):
    cfg = job("reference", tmp_path_factory.mktemp("ref"))
    summary = Controller(cfg, redis_server.url).run()
    assert summary["step"] == STEPS and summary["restarts"] == 0
    return final_weights(cfg)


def _assert_same_weights(got, want):
    assert got.keys() == want.keys()
    for name in want:
        assert torch.equal(got[name], want[name]), f"{name} differs from the uninterrupted run"


@pytest.mark.parametrize("kind, rank", [("kill", 1), ("hang", 2)])
def test_a_lost_worker_is_replaced_and_nothing_committed_is_lost(kind, rank, cluster, reference,
                                                                 redis_server, redis_client, tmp_path):
    cfg = job(f"fault-{kind}", tmp_path, faults=[{"rank": rank, "step": 3, "kind": kind}])
    lines: list[str] = []
    summary = Controller(cfg, redis_server.url, on_event=lines.append).run()
    assert summary["step"] == STEPS
    assert summary["restarts"] == 1 and summary["attempt"] == 1
    assert summary["resumed_from"] == 2  # the newest checkpoint committed before the fault
    _assert_same_weights(final_weights(cfg), reference)
    status = job_status(redis_client, cfg.job.name, events=100)
    assert status["state"] == "SUCCEEDED" and status["attempt"] == 1
    faults = [e for e in status["events"] if e["type"] == "fault"]
    assert faults and faults[0]["fault"] == "dead" and faults[0]["rank"] == rank, faults
    assert any(e["type"] == "decision" and "restart" in e["reason"] for e in status["events"])


def test_the_restart_budget_ends_in_failed_with_the_reason(cluster, redis_server, redis_client, tmp_path):
    cfg = job("no-budget", tmp_path, faults=[{"rank": 0, "step": 2, "kind": "raise"}], max_restarts=0)
    with pytest.raises(JobFailed, match="restart budget spent"):
        Controller(cfg, redis_server.url).run()
    status = job_status(redis_client, cfg.job.name)
    assert status["state"] == "FAILED"
    assert "restart budget" in status["fields"]["reason"]
