"""Sharded layouts as controller jobs on a simulated multi-node Ray cluster with a real Redis:
a rank SIGKILLed mid-run is replaced and the job finishes with weights bitwise equal to an
uninterrupted run's, for FSDP 2 x TP 2 and for the 64-GPU example's shape scaled to CPU (TP 2
inside a node, dynamic CP with USP attention, FSDP across nodes)."""

from __future__ import annotations

import os
import shutil

import pytest
import torch
from clusters import committed_weights, simulated_cluster

from longrun.config import config_from_dict, load_config
from longrun.config.runnable import check_runnable
from longrun.controller.controller import Controller, job_status

STEPS = 6
LAYOUTS = {
    # name: (cluster, parallelism)
    "fsdp2xtp2": ({"nodes": 2, "workers_per_node": 2}, {"fsdp": 2, "tp": 2}),
    # examples/llama-8b-64gpu.yaml's shape, scaled: tp inside a node, dynamic CP (usp), then
    # the replicas across nodes, sharded (FSDP) rather than replicated.
    "example-scaled": ({"nodes": 2, "workers_per_node": 4},
                       {"fsdp": 2, "cp": 2, "tp": 2, "cp_impl": "usp", "dynamic_cp": True}),
}


def job(name: str, layout: str, out, faults=()):
    cluster, parallelism = LAYOUTS[layout]
    cp = parallelism.get("cp", 1) > 1
    return config_from_dict({
        "job": {"name": name, "seed": 7, "output_dir": str(out)},
        "cluster": cluster | {"device": "cpu", "device_memory_gb": 1},
        "parallelism": parallelism,
        "model": {"dim": 64, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "ffn_dim": 128,
                  "max_seq_len": 128},
        "data": {"source": "synthetic", "micro_batch_tokens": 64 if cp else 128, "prefetch": 1,
                 "synthetic": {"min_len": 8, "max_len": 128, "mean": 40, "sigma": 0.8}},
        "training": {"steps": STEPS, "lr": 3e-3, "warmup_steps": 2, "log_every": 100,
                     "activation_checkpointing": "selective"},
        # Storage only: this is the checkpoint path's test (memory snapshots: test_memory_snapshots).
        "checkpoint": {"interval_steps": 2, "keep_last": 10, "memory_interval_steps": 0},
        "health": {"heartbeat_interval_s": 0.5, "heartbeat_timeout_s": 3.0, "hang_timeout_s": 90,
                   "hang_min_s": 20, "faults": list(faults)},
        "recovery": {"restart_backoff_s": 0.0},
    })


@pytest.fixture(scope="module")
def cluster():
    with simulated_cluster(2, 4) as (c, _):  # up to 8 workers: 2 nodes of 4
        yield c


def test_the_example_layout_is_runnable():
    """The 64-GPU example's layout (TP 8, dynamic CP with USP, DP 4) is one this longrun runs."""
    example = load_config(os.path.join(os.path.dirname(__file__), "..", "examples", "llama-8b-64gpu.yaml"))
    check_runnable(example)
    assert example.dims.tp == 8 and example.dims.dynamic_cp and example.parallelism.cp_impl == "usp"


@pytest.mark.timeout(900)
# Both layouts are `slow` (the suite's time): the default run's bounded version of this
# SIGKILL-and-compare check on a sharded layout is tests/test_pipeline_job.py's pp2 x fsdp2 job,
# and TP's restore is checked bitwise by tests/test_resharding.py.
@pytest.mark.slow
@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_sharded_job_recovers_from_a_sigkill_bitwise(layout, cluster, redis_server, redis_client, tmp_path):
    reference = job(f"ref-{layout}", layout, tmp_path / "ref")
    summary = Controller(reference, redis_server.url).run()
    assert summary["step"] == STEPS and summary["restarts"] == 0
    faulty = job(f"kill-{layout}", layout, tmp_path / "kill", faults=[{"rank": 1, "step": 3, "kind": "kill"}])
    # Dynamic CP plans with a cost model measured once per job; both runs must plan alike.
    calibration = os.path.join(reference.run_dir, "cp-calibration")
    if os.path.isdir(calibration):
        shutil.copytree(calibration, os.path.join(faulty.run_dir, "cp-calibration"))
    summary = Controller(faulty, redis_server.url).run()
    assert summary["step"] == STEPS and summary["restarts"] == 1 and summary["resumed_from"] == 2
    got = committed_weights(faulty.checkpoint_dir, STEPS)
    want = committed_weights(reference.checkpoint_dir, STEPS)
    assert got.keys() == want.keys()
    for name in want:
        assert torch.equal(got[name], want[name]), f"{name} differs from the uninterrupted run"
    events = job_status(redis_client, faulty.job.name, events=100)["events"]
    faults = [e for e in events if e["type"] == "fault"]
    assert any(e["fault"] == "dead" and e["rank"] == 1 for e in faults), faults
