"""Checkpoint saves: how long training is blocked per save, longrun vs the usual ways.

    .venv/bin/python bench/checkpoint.py            # ~1.2 GB state (model + AdamW), 3 reps
    .venv/bin/python bench/checkpoint.py --quick    # ~0.3 GB state, 2 reps

The state is a real `Trainer` (Llama-style model, dim 1024, 8 layers, fp32, AdamW: weights plus
two moments) after one training step, so the optimizer state exists and `Checkpointer.save`
runs the exact path training uses. Side by side in one process, alternating the order of the
methods across reps (medians reported):
  longrun    - `Checkpointer.save(trainer)`: blocking = from the call until the snapshot is
               complete (`before_update()` returns; on the CPU that is when save() returns);
               end-to-end = until `flush()` returns (shards written, hashed, fsynced,
               manifest written, renamed: committed). The previous save is always flushed
               outside the timed region (steady state); the first save (buffer allocation)
               is a warm-up, reported apart.
  sync       - `torch.save(trainer.state_dict(), f)` into a file opened here, flush, fsync of
               the file and of its directory (a checkpoint must be durable).
  dcp        - `torch.distributed.checkpoint.async_save(trainer.state_dict(), checkpoint_id=dir)`
               as documented (no stager given: it makes a fresh DefaultStager, so it allocates
               its staging copy on every save) in a single-process gloo group; blocking = until
               async_save returns, end-to-end = until its future is done (FileSystemWriter
               fsyncs its files). The same state dict longrun saves (model, optimizer with
               param_groups, scheduler, data position, RNG) passed as a plain dict.
  dcp_cached - the same with one `DefaultStager` reused across saves (async_stager=), which
               caches its staging storages the way longrun reuses its host buffers (pinned on
               a GPU). DCP's asynchronous staging (use_async_staging) is not measured: like
               longrun's GPU path it moves the wait to before the next optimizer step, which
               needs a real step between save and wait to mean anything.
  memcpy     - the floor: `copy_` of every tensor of the same state into host buffers
               preallocated once (pinned on a GPU), no tree walking.
Every method builds `trainer.state_dict()` inside its timed region (training would have to).
Restore: `Checkpointer.restore(fresh_trainer)` with the shard files evicted from the page cache
first (posix_fadvise DONTNEED: read from disk), and again warm; for comparison
`torch.load` of the sync file + `load_state_dict`, cold. Targets (the issue): longrun blocking
<= 10% of sync, <= DCP async_save, <= 2x the memcpy floor.
On a GPU (`--device cuda`, or auto) the state lives on the device and every copy is
device-to-host (longrun and the floor into pinned buffers). Timings on a shared machine are
noisy: the summary prints the load average, and `--threads 1` avoids the intra-op copy threads
stalling on a busy core; `--reps` for more repeats.
The methods themselves are in bench/_checkpoint_methods.py.
Progress goes to stderr; the last line on stdout is one JSON object.
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import tempfile
import time
from typing import Any

import torch
from _checkpoint_methods import METHODS, Bench
from _common import logger, parser

log = logger("checkpoint")


def gb(n: float) -> str:
    return f"{n / 1e9:.2f} GB"


def job_config(root: str, layers: int, dim: int, device: str):
    from longrun.config import JobConfig

    return JobConfig.model_validate({
        "job": {"name": "bench-checkpoint", "output_dir": root},
        "cluster": {"device": device},
        "model": {"dim": dim, "n_layers": layers, "n_heads": dim // 128, "max_seq_len": 64},
        # One tiny step only creates the optimizer state: short synthetic documents.
        "data": {"source": "synthetic", "micro_batch_tokens": 64, "prefetch": 1,
                 "synthetic": {"min_len": 8, "max_len": 64, "mean": 32, "sigma": 0.5}},
        "training": {"steps": 10, "warmup_steps": 1},
        "checkpoint": {"dir": os.path.join(root, "longrun"), "keep_last": 1},
    })


# --- main -------------------------------------------------------------------------------------


def build(root: str, layers: int, dim: int, device: str):
    from longrun.checkpoint import Checkpointer
    from longrun.trainer import Trainer

    cfg = job_config(root, layers, dim, device)
    start = time.perf_counter()
    trainer = Trainer(cfg, progress=False)
    log(f"model: {trainer.model.num_params():,} parameters on {trainer.device}; one training step "
        f"to create the optimizer state ...")
    trainer.train_step()
    trainer.close()  # stop the data thread: nothing runs beside the measurements
    fresh = Trainer(cfg, progress=False)  # restore target: same shapes, no optimizer state yet
    log(f"trainers ready in {time.perf_counter() - start:.1f} s")
    return trainer, fresh, Checkpointer(cfg)


def main() -> None:
    cli = parser(__doc__)
    cli.add_argument("--quick", action="store_true", help="~0.3 GB state (2 layers), 2 reps")
    cli.add_argument("--reps", type=int, default=None, help="repeats per method (median reported)")
    cli.add_argument("--layers", type=int, default=None, help="model layers (default 8; quick 2)")
    cli.add_argument("--dim", type=int, default=1024, help="model width (a multiple of 128)")
    cli.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                     help="where the training state lives (cuda: device-to-pinned-host staging)")
    cli.add_argument("--threads", type=int, default=None,
                     help="torch intra-op threads (default: torch's own, one per core)")
    cli.add_argument("--dir", default=None,
                     help="local-disk directory for the checkpoints (default: the temp dir)")
    args = cli.parse_args()
    reps = args.reps or (2 if args.quick else 3)
    layers = args.layers or (2 if args.quick else 8)
    if args.threads:
        torch.set_num_threads(args.threads)
    load_before = os.getloadavg()[0]
    parent = args.dir or tempfile.gettempdir()
    os.makedirs(parent, exist_ok=True)
    root = tempfile.mkdtemp(prefix="longrun-bench-ckpt-", dir=parent)
    try:
        summary, breakdown, nbytes, device = run(root, layers, args.dim, args.device, reps)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    report(summary, breakdown, nbytes, reps, device, (load_before, os.getloadavg()[0]))


def run(root: str, layers: int, dim: int, device: str, reps: int):
    """Every method, `reps` times, in a one-process gloo group (DCP needs one)."""
    import torch.distributed as dist

    try:
        dist.init_process_group("gloo", store=dist.FileStore(os.path.join(root, "store"), 1),
                                rank=0, world_size=1)
        trainer, fresh, ckpt = build(root, layers, dim, device)
        tensors = state_tensors(trainer)
        nbytes = sum(t.numel() * t.element_size() for _, t in tensors)
        free = shutil.disk_usage(root).free
        if free < 3 * nbytes:
            raise SystemExit(f"only {gb(free)} free under {root}; the benchmark needs 3x the state "
                             f"({gb(3 * nbytes)}): pass --dir on a larger local disk")
        log(f"state: {gb(nbytes)} in {len(tensors)} tensors; {gb(free)} free "
            f"under {root}; {reps} reps, torch {torch.__version__}, {torch.get_num_threads()} threads")
        bench = Bench(trainer, fresh, ckpt, root)
        summary = measure(bench, reps)
        breakdown = bench.breakdown(reps)
        ckpt.close()
        bench.stager.close()
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    return summary, breakdown, nbytes, str(trainer.device)


def state_tensors(trainer) -> list[Any]:
    from longrun.checkpoint.snapshot import tensors_of

    return tensors_of(trainer.state_dict())


def measure(bench: Bench, reps: int) -> dict[str, Any]:
    # Warm-ups: each path's first call pays one-time costs (longrun and dcp_cached allocate
    # their buffers, memcpy touches its pages for the first time, DCP imports its planner).
    for method in METHODS:
        row = bench.run(method)
        bench.first[method] = row["blocking_s"]
        log(f"warm-up {method:<10} blocking {row['blocking_s']:.3f} s")
    for rep in range(reps):
        order = METHODS[rep % len(METHODS):] + METHODS[:rep % len(METHODS)]
        if rep % 2:
            order = order[::-1]
        for method in order:
            row = bench.run(method)
            bench.rows[method].append(row)
            shown = ", ".join(f"{k} {v:.3f}" for k, v in row.items())
            log(f"rep {rep + 1}/{reps} {method:<10} {shown}")
    return {m: {k: statistics.median(r[k] for r in rows) for k in rows[0]}
            for m, rows in bench.rows.items()} | {"first": bench.first, "raw": bench.rows}


def report(s: dict[str, Any], breakdown: dict[str, float], nbytes: int, reps: int, device: str,
           load: tuple[float, float]) -> None:
    ours, sync, dcp, cached, floor = (s[m]["blocking_s"] for m in METHODS)
    vs_sync, vs_dcp, vs_memcpy = ours / sync, ours / dcp, ours / floor
    targets = {"vs_sync<=0.10": vs_sync <= 0.10, "vs_dcp<=1": vs_dcp <= 1.0,
               "vs_memcpy<=2": vs_memcpy <= 2.0}
    rate = nbytes / 1e9
    cpus = os.cpu_count() or 1
    print(f"state {gb(nbytes)} on {device}, median of {reps} reps (first = warm-up save); "
          f"{torch.get_num_threads()} torch threads, {cpus} CPUs, "
          f"load average {load[0]:.1f} -> {load[1]:.1f}")
    if max(load) > cpus:
        print(f"warning: the machine was busy (load average above {cpus} CPUs): other processes "
              "share these cores, so every time below is inflated and noisy")
    print(f"{'method':<28}{'blocking':>10}{'GB/s':>8}{'first':>9}{'end-to-end':>12}{'restore':>10}")
    labels = {"longrun": "longrun Checkpointer.save", "sync": "torch.save + fsync",
              "dcp": "DCP async_save", "dcp_cached": "DCP async_save, reused stager",
              "memcpy": "memcpy floor"}
    for m in METHODS:
        row = s[m]
        e2e = f"{row['e2e_s']:>11.3f}s" if "e2e_s" in row else f"{'':>12}"
        restore = f"{row['restore_s']:>9.3f}s" if "restore_s" in row else ""
        print(f"{labels[m]:<28}{row['blocking_s']:>9.3f}s{rate / row['blocking_s']:>8.2f}"
              f"{s['first'][m]:>8.3f}s{e2e}{restore}")
    print(f"longrun: restore warm {s['longrun']['restore_warm_s']:.3f} s; write on the writer thread "
          f"{s['longrun']['write_s']:.3f} s; breakdown (writer idle): trainer.state_dict() "
          f"{breakdown['state_dict_s'] * 1e3:.1f} ms, HostStager.stage {breakdown['stage_s']:.3f} s")
    print(f"ratios: blocking/sync {vs_sync:.3f} (target <= 0.10), blocking/DCP {vs_dcp:.3f} "
          f"(<= 1; vs reused-stager DCP {ours / cached:.3f}), blocking/memcpy {vs_memcpy:.3f} (<= 2)")
    print("targets: " + ", ".join(f"{k} {'met' if v else 'MISSED'}" for k, v in targets.items()))
    r = lambda x: round(x, 4)  # noqa: E731
    print(json.dumps({
        "state_bytes": nbytes, "device": device, "reps": reps, "threads": torch.get_num_threads(),
        "loadavg": [round(x, 2) for x in load],
        "blocking_s": r(ours), "sync_s": r(sync), "dcp_blocking_s": r(dcp), "memcpy_s": r(floor),
        "vs_sync": r(vs_sync), "vs_dcp": r(vs_dcp), "vs_memcpy": r(vs_memcpy),
        "restore_s": r(s["longrun"]["restore_s"]),
        "restore_warm_s": r(s["longrun"]["restore_warm_s"]),
        "sync_restore_s": r(s["sync"]["restore_s"]),
        "first_blocking_s": r(s["first"]["longrun"]), "save_return_s": r(s["longrun"]["save_return_s"]),
        "e2e_s": r(s["longrun"]["e2e_s"]), "write_s": r(s["longrun"]["write_s"]),
        "dcp_e2e_s": r(s["dcp"]["e2e_s"]), "dcp_cached_blocking_s": r(cached),
        "dcp_cached_e2e_s": r(s["dcp_cached"]["e2e_s"]), "vs_dcp_cached": r(ours / cached),
        "state_dict_s": r(breakdown["state_dict_s"]), "stage_s": r(breakdown["stage_s"]),
        "targets_met": targets,
        "raw_blocking_s": {m: [r(x["blocking_s"]) for x in rows] for m, rows in s["raw"].items()},
    }))


if __name__ == "__main__":
    main()
