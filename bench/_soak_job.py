"""The soak's job (not a bench itself): the tiny model on the simulated cluster, paced, and the
uninterrupted reference run of the same steps at the same layout.

The job spans 2 of the cluster's 3 nodes (one rank each, dp 2): the third is the spare a lost
node's ranks move to, so no fault changes the layout and the final weights can be compared bit
for bit with a run that had no fault."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

JOB = "soak"
REFERENCE_JOB = "soak-reference"
NODES, CPUS_PER_NODE = 3, 2  # the simulated cluster: one node more than the job needs
JOB_NODES = 2
INTERVAL_STEPS = 10  # a storage checkpoint every 10 steps; memory snapshots every step
MAX_ATTEMPTS = 200  # pacing is listed for this many attempts of each `longrun run`


def _base(name: str, out: Path, steps: int) -> dict[str, Any]:
    return {
        "job": {"name": name, "seed": 11, "output_dir": str(out)},
        "cluster": {"nodes": JOB_NODES, "workers_per_node": 1, "device": "cpu"},
        "parallelism": {"dp": JOB_NODES},
        "model": {"dim": 64, "n_layers": 2, "n_heads": 4, "max_seq_len": 64},
        "data": {"source": "synthetic", "micro_batch_tokens": 128, "prefetch": 1,
                 "synthetic": {"min_len": 8, "max_len": 64, "mean": 24, "sigma": 0.8}},
        "training": {"steps": steps, "lr": 3e-3, "warmup_steps": 4, "log_every": 10},
    }


def soak_job(out: Path, steps: int, *, ray_address: str, redis_url: str, checkpoint_dir: Path,
             pace_s: float) -> dict[str, Any]:
    """The job under test. Pacing: rank 0 sleeps `pace_s` after every step (the `slow` fault
    kind, a plain sleep outside the step's arithmetic), listed for every attempt since each
    listed fault fires in its own attempt only. A large model's steps take seconds; the tiny
    model's take a few tens of milliseconds, so without pacing an hour would be 100k steps and
    the uninterrupted reference an hour too."""
    pacing = [{"rank": 0, "step": 0, "kind": "slow", "seconds": pace_s, "attempt": a}
              for a in range(MAX_ATTEMPTS)]
    return _base(JOB, out, steps) | {
        "cluster": _base(JOB, out, steps)["cluster"] | {"address": ray_address, "redis_url": redis_url},
        "checkpoint": {"dir": str(checkpoint_dir), "interval_steps": INTERVAL_STEPS, "keep_last": 3,
                       "memory_interval_steps": 1},
        # A tiny job's sub-second steps allow a fast heartbeat (as bench/recovery.py's).
        "health": {"heartbeat_interval_s": 0.5, "heartbeat_timeout_s": 3.0, "hang_min_s": 5.0,
                   "faults": pacing},
        # An hour with a fault every 2 minutes is 30 restarts: a budget for a long job, not a
        # test's. The grace bounds the save a SIGTERM asks for.
        "recovery": {"max_restarts": 1000, "max_restarts_in_window": 1000, "restart_backoff_s": 1.0,
                     "preemption_grace_s": 60.0},
    }


def reference_job(out: Path, steps: int, *, ray_address: str) -> dict[str, Any]:
    """The same steps, seed, data and layout, unpaced and fault-free, with one checkpoint at the
    end (checkpoints and snapshots do not touch the training arithmetic) and its own embedded
    Redis."""
    return _base(REFERENCE_JOB, out, steps) | {
        "cluster": _base(REFERENCE_JOB, out, steps)["cluster"] | {"address": ray_address},
        "checkpoint": {"interval_steps": steps, "keep_last": 1, "memory_interval_steps": 0},
        "recovery": {"max_restarts": 0},
    }


def write_job(path: Path, job: dict[str, Any]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(job, sort_keys=False))
    return path
