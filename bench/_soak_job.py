"""The soak's job (not a bench itself): a small model sized to a given training state on the
simulated cluster, paced inside each step, and the uninterrupted reference run of the same
steps at the same layout.

The job spans 2 of the cluster's 3 nodes (one rank each, dp 2): the third is the spare a lost
node's ranks move to, so no fault changes the layout and the final weights can be compared bit
for bit with a run that had no fault.

The state (fp32 weights and AdamW's two moments, 12 bytes a parameter, sharded over the two
ranks) is sized by the feed-forward width of a 2-layer model of width 128: what a snapshot
copies and sends, a checkpoint writes and a restore reads is then that many MB, while the
model's arithmetic stays a few short matmuls over 32-token micro-batches."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

JOB = "soak"
REFERENCE_JOB = "soak-reference"
NODES, CPUS_PER_NODE = 3, 2  # the simulated cluster: one node more than the job needs
JOB_NODES = 2
INTERVAL_STEPS = 10  # a storage checkpoint every 10 steps; memory snapshots at the `auto` interval
KEEP_LAST = 3
MAX_ATTEMPTS = 200  # pacing is listed for this many attempts (attempts count on across reruns)
DIM, LAYERS, VOCAB = 128, 2, 260
# The learned hang timeout's floor. A frozen worker is found by its heartbeats (3 s), not by
# this; what this guards is a live rank's step, which on 2 cores shared with a save's writer
# threads, a snapshot's send and three keepers ran to 6-8 s at 512 MB (the default 10 s floor
# sits at the edge of that; 5 s, the soak's old value, declared healthy ranks hung).
HANG_MIN_S = 20.0
BYTES_PER_PARAMETER = 12  # fp32 weights + AdamW's exp_avg and exp_avg_sq


def parameters(ffn_dim: int) -> int:
    """The model's parameters (tied embeddings; see trainer/model.py)."""
    layer = 4 * DIM * DIM + 3 * DIM * ffn_dim + 2 * DIM
    return VOCAB * DIM + LAYERS * layer + DIM


def ffn_for(state_mb: float) -> int:
    """The feed-forward width (a multiple of 64) whose training state is closest to `state_mb`."""
    fixed = parameters(0)
    per_column = LAYERS * 3 * DIM
    want = state_mb * 2**20 / BYTES_PER_PARAMETER
    return max(64, round((want - fixed) / per_column / 64) * 64)


def state_mb_of(ffn_dim: int) -> float:
    """The whole job's training state in MiB (each of the two ranks holds half)."""
    return round(parameters(ffn_dim) * BYTES_PER_PARAMETER / 2**20, 1)


def _base(name: str, out: Path, steps: int, ffn_dim: int) -> dict[str, Any]:
    return {
        "job": {"name": name, "seed": 11, "output_dir": str(out)},
        "cluster": {"nodes": JOB_NODES, "workers_per_node": 1, "device": "cpu"},
        "parallelism": {"dp": JOB_NODES},
        "model": {"dim": DIM, "n_layers": LAYERS, "n_heads": 4, "max_seq_len": 32, "vocab_size": VOCAB,
                  "ffn_dim": ffn_dim},
        "data": {"source": "synthetic", "micro_batch_tokens": 32, "prefetch": 1,
                 "synthetic": {"min_len": 4, "max_len": 32, "mean": 16, "sigma": 0.8}},
        "training": {"steps": steps, "lr": 3e-3, "warmup_steps": 4, "log_every": 10},
    }


def soak_job(out: Path, steps: int, *, ray_address: str, redis_url: str, checkpoint_dir: Path,
             pace_s: float, ffn_dim: int) -> dict[str, Any]:
    """The job under test. Pacing: every rank sleeps `pace_s` inside every step, before the
    optimizer update (the `slow` fault kind with `in_step`), where a larger model's forward and
    backward would spend it: the step's snapshot copy overlaps it, and a fault from outside
    lands in it, in the update, the save or the snapshot by their real shares of the step.
    Listed for every attempt since each listed fault fires in its own attempt only. Without
    pacing an hour would be tens of thousands of steps and the uninterrupted reference an hour
    too."""
    pacing = [{"rank": r, "step": 0, "kind": "slow", "seconds": pace_s, "in_step": True, "attempt": a}
              for a in range(MAX_ATTEMPTS) for r in range(JOB_NODES)]
    base = _base(JOB, out, steps, ffn_dim)
    return base | {
        "cluster": base["cluster"] | {"address": ray_address, "redis_url": redis_url},
        # Memory snapshots at the default `auto` interval: every step where a send fits in one,
        # longer where it does not (a fixed interval of 1 skipped the snapshots whose predecessor's
        # send outlasted a step, so a fault could lose two steps against a bound of one).
        "checkpoint": {"dir": str(checkpoint_dir), "interval_steps": INTERVAL_STEPS, "keep_last": KEEP_LAST,
                       "memory_interval_steps": "auto"},
        # A tiny job's sub-second steps allow a fast heartbeat (as bench/recovery.py's).
        # A dead controller's lease outlives it by store_patience_s + 10 s before its rerun may
        # take the job over: 15 s rides out the soak's Redis outages (2-6 s) and keeps the wait short.
        "health": {"heartbeat_interval_s": 0.5, "heartbeat_timeout_s": 3.0, "hang_min_s": HANG_MIN_S,
                   "store_patience_s": 15.0, "faults": pacing},
        # An hour with a fault every 2 minutes is 30 restarts: a budget for a long job, not a
        # test's. The grace bounds the save a SIGTERM asks for.
        "recovery": {"max_restarts": 1000, "max_restarts_in_window": 1000, "restart_backoff_s": 1.0,
                     "preemption_grace_s": 60.0},
    }


def reference_job(out: Path, steps: int, *, ray_address: str, ffn_dim: int) -> dict[str, Any]:
    """The same steps, seed, data and layout, unpaced and fault-free, with one checkpoint at the
    end (checkpoints and snapshots do not touch the training arithmetic) and its own embedded
    Redis."""
    base = _base(REFERENCE_JOB, out, steps, ffn_dim)
    return base | {
        "cluster": base["cluster"] | {"address": ray_address},
        "checkpoint": {"interval_steps": steps, "keep_last": 1, "memory_interval_steps": 0},
        "recovery": {"max_restarts": 0},
    }


def write_job(path: Path, job: dict[str, Any]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(job, sort_keys=False))
    return path
