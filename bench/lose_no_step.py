"""What losing no step costs: memory snapshots per step, restores from memory vs storage, and a
preemption save, each beside its baseline in one process.

    .venv/bin/python bench/lose_no_step.py            # tiny and ~1.2 GB states, 3 reps
    .venv/bin/python bench/lose_no_step.py --quick    # tiny and ~0.3 GB states, 2 reps

For each state (a real `Trainer` after one step: Llama-style model, fp32, AdamW moments):
  step         - one training step (`train_step`), the time a snapshot is measured against;
  snapshot     - `MemorySnapshots.take` every step: the host copy the step waits for (on a GPU
                 it overlaps the next step and is waited for only before the optimizer), and
                 how long the background thread then takes to serialize, checksum and hand the
                 state to a keeper (a `SnapshotKeeper` in this process: Ray's transfer to the
                 other node's keeper is not in it);
  restore      - memory: fetch from the keeper, verify, load into a fresh trainer; storage:
                 `Checkpointer.restore` of the same state from a committed checkpoint, with its
                 files evicted from the page cache first (read from disk);
  preemption   - `Checkpointer.save_now` (save at once and wait for the commit: what a stop
                 request does at the agreed step), against a plain `torch.save` + fsync.
Targets (issue 20): the snapshot's blocking copy under 5% of a step where it overlaps compute
(a GPU; on this CPU it cannot, see docs/benchmarks.md); the preemption save under 10 s for the
1 GB state. Progress goes to stderr; the last line on stdout is one JSON object.
"""

from __future__ import annotations

import json
import os
import statistics
import tempfile
import time

import torch
from _common import evict, logger, parser

log = logger("lose_no_step")


def config(root: str, dim: int, layers: int):
    from longrun.config import config_from_dict

    return config_from_dict({
        "job": {"name": "lose-no-step", "seed": 0},
        "cluster": {"device": "cpu"},
        "model": {"dim": dim, "n_layers": layers, "n_heads": max(2, dim // 128), "max_seq_len": 256},
        "data": {"source": "synthetic", "micro_batch_tokens": 512, "prefetch": 0},
        "training": {"steps": 1000, "warmup_steps": 1},
        "checkpoint": {"dir": root, "interval_steps": 1000, "keep_last": 2},
    })


def measure(name: str, dim: int, layers: int, reps: int) -> dict:
    from longrun.checkpoint import Checkpointer
    from longrun.checkpoint.memory import MemorySnapshots, read_snapshot
    from longrun.checkpoint.sharding import globalize
    from longrun.controller.keepers import SnapshotKeeper
    from longrun.trainer import Trainer

    root = tempfile.mkdtemp(prefix="lose-no-step-")
    cfg = config(root, dim, layers)
    trainer = Trainer(cfg, progress=False)
    trainer.train_step()  # the optimizer's moments exist from here on
    state_bytes = sum(trainer.state_bytes().values())
    keeper = SnapshotKeeper()
    snaps = MemorySnapshots(lambda step, blob, digest: keeper.put(0, step, blob, digest), every=1)
    step_s, block_s, send_s = [], [], []
    for _ in range(reps + 1):  # the first takes allocate the host buffers: a warm-up
        start = time.perf_counter()
        trainer.train_step()
        step_s.append(time.perf_counter() - start)
        start = time.perf_counter()
        snaps.take(trainer)
        snaps.before_update()
        block_s.append(time.perf_counter() - start)
        snaps.wait()
        send_s.append(time.perf_counter() - start)
    step_s, block_s, send_s = step_s[1:], block_s[1:], send_s[1:]

    ckpt = Checkpointer(cfg)
    preempt_s, sync_s, memory_s, storage_s = [], [], [], []
    for _ in range(reps):
        trainer.train_step()
        start = time.perf_counter()
        ckpt.save_now(trainer)
        preempt_s.append(time.perf_counter() - start)
        start = time.perf_counter()
        path = os.path.join(root, "plain.pt")
        with open(path, "wb") as f:
            torch.save(trainer.state_dict(), f)
            f.flush()
            os.fsync(f.fileno())
        sync_s.append(time.perf_counter() - start)
        snaps.take(trainer)
        snaps.wait()
        with Trainer(cfg, progress=False) as fresh:
            start = time.perf_counter()
            blob, digest = keeper.get(0, trainer.step)
            fresh.load_state_dict(globalize(read_snapshot(blob, digest), fresh.state_dict()))
            memory_s.append(time.perf_counter() - start)
        evict(root)
        with Trainer(cfg, progress=False) as fresh:
            start = time.perf_counter()
            ckpt.restore(fresh)
            storage_s.append(time.perf_counter() - start)
    ckpt.close()
    trainer.close()
    med = statistics.median
    row = {"state_bytes": state_bytes, "step_s": med(step_s), "snapshot_blocking_s": med(block_s),
           "snapshot_blocking_vs_step": med(block_s) / med(step_s), "snapshot_sent_s": med(send_s),
           "restore_memory_s": med(memory_s), "restore_storage_s": med(storage_s),
           "restore_memory_vs_storage": med(memory_s) / med(storage_s),
           "preemption_save_s": med(preempt_s), "sync_save_s": med(sync_s)}
    log(f"{name}: {state_bytes / 1e9:.2f} GB, step {row['step_s']:.3f} s, snapshot blocks "
        f"{row['snapshot_blocking_s']:.3f} s ({100 * row['snapshot_blocking_vs_step']:.1f}% of a step), "
        f"sent after {row['snapshot_sent_s']:.3f} s; restore memory {row['restore_memory_s']:.3f} s vs "
        f"storage {row['restore_storage_s']:.3f} s; preemption save {row['preemption_save_s']:.2f} s "
        f"(torch.save + fsync {row['sync_save_s']:.2f} s)")
    return {k: round(v, 4) if isinstance(v, float) else v for k, v in row.items()}


def main() -> None:
    cli = parser(__doc__.split("\n")[0])
    cli.add_argument("--reps", type=int, default=3)
    cli.add_argument("--quick", action="store_true", help="a 0.3 GB state instead of 1.2 GB, 2 reps")
    args = cli.parse_args()
    torch.set_num_threads(2)
    big = (512, 8) if args.quick else (1024, 8)
    reps = 2 if args.quick else args.reps
    out = {"tiny": measure("tiny", 128, 2, reps), "large": measure("large", *big, reps)}
    print(json.dumps(out))


if __name__ == "__main__":
    main()
