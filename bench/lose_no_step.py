"""What losing no step costs: memory snapshots per step, restores from memory vs storage, and a
preemption save, each beside its baseline in one process; and, at a given state size, the
snapshots' real cost at the `auto` interval and the steps a SIGKILL at a random moment loses.

    .venv/bin/python bench/lose_no_step.py            # tiny and ~1.2 GB states, 3 reps
    .venv/bin/python bench/lose_no_step.py --quick    # tiny and ~0.3 GB states, 2 reps
    RAY_USAGE_STATS_ENABLED=0 unshare --net -- sh -c 'ip link set lo up && exec \
        .venv/bin/python bench/lose_no_step.py --state-gb 4 --kills 3'   # issue 39 (Ray)

For each state (a real `Trainer` after one step: Llama-style model, fp32, AdamW moments):
  step         - one training step (`train_step`), the time a snapshot is measured against;
  snapshot     - `MemorySnapshots.take` and at once `before_update`: the host copy, had nothing
                 overlapped it (in a job it runs beside the next step's forward and backward),
                 and how long the background thread then takes to copy, checksum and hand the
                 state to a keeper (a `SnapshotKeeper` in this process: Ray's transfer to the
                 other node's keeper is not in it);
  restore      - memory: fetch from the keeper, verify, load into a fresh trainer; storage:
                 `Checkpointer.restore` of the same state from a committed checkpoint, with its
                 files evicted from the page cache first (read from disk);
  preemption   - `Checkpointer.save_now` (save at once and wait for the commit: what a stop
                 request does at the agreed step), against a plain `torch.save` + fsync.
Targets (issue 20): the preemption save under 10 s for the 1 GB state; the snapshot's blocking
under 5% of a step where its copy overlaps compute (measured by `--state-gb`).

`--state-gb N` (issue 39) instead trains a model whose state (weights and AdamW moments) is
about N GB in a Ray actor, after 3 steps without snapshots (the baseline), with snapshots at
the `auto` interval sent chunk by chunk to a keeper actor on the same machine (one keeper, not
a job's two); once the interval is chosen and two of its snapshots are through, the actor is
SIGKILLed at a random moment within an interval, and the steps lost are its last finished step
(its ledger, written after each step) minus the newest step the keeper holds. Repeated
`--kills` times, a fresh actor each. Reported: the chosen interval, the snapshot blocking share
of a step (its take plus the wait for its copy before the optimizer, over the steps' time), the
step time against the baseline (the copy and the send share the machine's cores), the steps
lost per kill. Targets (issue 39), state at least 4 GB: blocking under 5% of a step, at most
the interval's steps lost.
Progress goes to stderr; the last line on stdout is one JSON object.
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


def sized(gb: float) -> tuple[int, int]:
    """(dim, layers) of a model whose weights and two AdamW moments (12 bytes a parameter,
    about 12 dim^2 parameters a block) take about `gb` GB."""
    dim = 512 if gb < 1 else 1024 if gb < 16 else 2048
    return dim, max(1, round(gb * 1e9 / 12 / (12 * dim * dim)))


def at_size(gb: float, kills: int, seed: int) -> dict:
    """The snapshots' cost at the `auto` interval and the steps SIGKILLs lose (`--state-gb`)."""
    import random
    import signal
    import sys

    import ray

    from longrun.controller.snapshot_keeper import KEEPER_NAMESPACE, THREADS, SnapshotKeeper

    here = os.path.dirname(os.path.abspath(__file__))
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (here, os.environ.get("PYTHONPATH")) if p)
    from _snapshot_trainee import Trainee  # the actor's module, importable by Ray's workers too

    dim, layers = sized(gb)
    cfg = config(tempfile.mkdtemp(prefix="lose-no-step-"), dim, layers).model_dump(mode="json")
    rng = random.Random(seed)
    # A cluster of its own, never one some other process left in /tmp/ray; and no
    # ~/.ray/auth_token written, which would turn token auth on for every later Ray head here.
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    ray.init(address="local", num_cpus=2, include_dashboard=False, logging_level="WARNING")
    keeper = ray.remote(num_cpus=0, max_concurrency=THREADS)(SnapshotKeeper)  # as `Keepers.ensure` makes it
    keeper = keeper.options(name="bench-keeper", namespace=KEEPER_NAMESPACE).remote()
    trainee = ray.remote(num_cpus=1, max_restarts=0)(Trainee)
    runs = []
    try:
        for kill in range(kills):
            ledger = os.path.join(tempfile.mkdtemp(prefix="lose-no-step-ledger-"), "steps.jsonl")
            actor = trainee.remote(cfg, "bench-keeper", ledger)
            pid = ray.get(actor.pid.remote())
            baseline = statistics.median(ray.get(actor.baseline.remote(3))[1:])
            state_bytes = ray.get(actor.state_bytes.remote())
            ray.get(keeper.drop_after.remote(-1))
            actor.run.remote(10**9)
            rows = _rows_until(ledger, lambda rows: _decided(rows) is not None
                               and rows[-1]["step"] >= _decided(rows) + 3 * rows[-1]["every"])
            every, step_s = rows[-1]["every"], statistics.median(r["step_s"] for r in rows[-5:])
            time.sleep(rng.uniform(0.0, every * step_s))  # the fault's moment: anywhere in an interval
            os.kill(pid, signal.SIGKILL)
            while os.path.exists(f"/proc/{pid}"):  # its last ledger line is written, or never will be
                time.sleep(0.05)
            rows = _read_rows(ledger)
            held = ray.get(keeper.holdings.remote()).get(0, [])
            after = [r for r in rows if r["step"] > _decided(rows)]
            run = {"every": every, "baseline_step_s": baseline,
                   "step_s": statistics.median(r["step_s"] for r in after),
                   "blocking_share": sum(r["blocked_s"] for r in after)
                   / sum(r["step_s"] + r["take_s"] for r in after),
                   "skipped": rows[-1]["skipped"], "last_step": rows[-1]["step"],
                   "restorable_step": max(held, default=0)}
            run["steps_lost"] = run["last_step"] - run["restorable_step"]
            runs.append(run)
            log(f"kill {kill + 1}: every {every} step(s), blocking {100 * run['blocking_share']:.2f}% of a "
                f"step, step {run['step_s']:.2f} s (baseline {baseline:.2f} s), {run['skipped']} skipped; "
                f"killed after step {run['last_step']}, restorable {run['restorable_step']}: "
                f"{run['steps_lost']} step(s) lost")
            ray.kill(actor)
    finally:
        ray.shutdown()
        sys.modules.pop("_snapshot_trainee", None)
    med = statistics.median
    return {"state_gb": gb, "state_bytes": state_bytes, "model": {"dim": dim, "layers": layers},
            "auto_interval": [r["every"] for r in runs],
            "snapshot_blocking_share": round(med(r["blocking_share"] for r in runs), 5),
            "step_s": round(med(r["step_s"] for r in runs), 4),
            "baseline_step_s": round(med(r["baseline_step_s"] for r in runs), 4),
            "steps_lost": [r["steps_lost"] for r in runs], "skipped": [r["skipped"] for r in runs]}


def _read_rows(path: str) -> list[dict]:
    try:
        with open(path) as f:
            return [json.loads(line) for line in f if line.endswith("\n")]
    except FileNotFoundError:
        return []


def _rows_until(path: str, done, timeout_s: float = 3600) -> list[dict]:
    """The ledger's rows once `done(rows)` (polled: another process writes them)."""
    deadline = time.monotonic() + timeout_s
    while True:
        rows = _read_rows(path)
        if rows and done(rows):
            return rows
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path}: not there in {timeout_s:g} s")
        time.sleep(0.1)


def _decided(rows: list[dict]) -> int | None:
    """The step at which the interval was first chosen."""
    return next((r["step"] for r in rows if r["every"] is not None), None)


def main() -> None:
    cli = parser(__doc__.split("\n")[0])
    cli.add_argument("--reps", type=int, default=3)
    cli.add_argument("--quick", action="store_true", help="a 0.3 GB state instead of 1.2 GB, 2 reps")
    cli.add_argument("--state-gb", type=float,
                     help="issue 39: a state of this many GB, the auto interval, SIGKILLs")
    cli.add_argument("--kills", type=int, default=3, help="with --state-gb: SIGKILLs, a fresh rank each")
    cli.add_argument("--seed", type=int, default=0)
    args = cli.parse_args()
    torch.set_num_threads(2)
    if args.state_gb:
        print(json.dumps(at_size(args.state_gb, args.kills, args.seed)))
        return
    big = (512, 8) if args.quick else (1024, 8)
    reps = 2 if args.quick else args.reps
    out = {"tiny": measure("tiny", 128, 2, reps), "large": measure("large", *big, reps)}
    print(json.dumps(out))


if __name__ == "__main__":
    main()
