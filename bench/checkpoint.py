"""Checkpoint saves and restores: how long training is blocked per save, how long a save takes to
commit and a restore to read, longrun vs the usual ways, and the disk's own rates as the floor.

    .venv/bin/python bench/checkpoint.py                  # ~4 GB state (issue 39), 3 reps
    .venv/bin/python bench/checkpoint.py --state-gb 1.2   # another size (layers chosen to fit)
    .venv/bin/python bench/checkpoint.py --quick          # ~0.3 GB state, 2 reps (a smoke run)

The state is a real `Trainer` (Llama-style model, dim 1024, fp32, AdamW: weights plus two
moments; `--state-gb` picks the number of layers, `--layers` sets it) after one training step,
so the optimizer state exists and `Checkpointer.save` runs the exact path training uses. In
one process, in three phases (below), alternating the order of a phase's methods across reps
(medians reported):
  longrun    - `Checkpointer.save(trainer)`, then one real training step (`train_step`: data,
               forward, backward, the trainer's before_update hooks, the optimizer). save()
               lays out the staging buffers and returns (`save_return_s`); the copy runs beside
               the step's forward and backward (the writer's thread on the CPU, a side stream on
               a GPU), and the step's update waits for what is left of it in the hook save()
               registered (`update_wait_s`, from the checkpointer's own `last_blocking_s`).
               blocking = save_return_s + update_wait_s (`blocking_s`); the step's own time
               (`step_s`) is reported beside a step with no save (`step_alone_s`, the step
               between reps), so a reader sees what the copy hid behind and what it slowed.
               End-to-end = from the call until the writer's on_saved hook (files written by
               several threads, checksummed while written, fsynced, manifest written last:
               committed). The previous save is always flushed outside the timed region (steady
               state); the first save (buffer allocation) is a warm-up, reported apart. Restore:
               `Checkpointer.restore` into a worker's new trainer (built anew, no weights set:
               what a restarted worker restores into), cold (files evicted from the page cache:
               read from disk), then again into the same trainer, warm.
  sync       - `torch.save(trainer.state_dict(), f)` into a file opened here, flush, fsync of
               the file and of its directory (a checkpoint must be durable); restore: `torch.load`
               + `load_state_dict` into a worker's new trainer, cold.
  dcp        - `torch.distributed.checkpoint.async_save(trainer.state_dict(), checkpoint_id=dir)`
               as documented (no stager given: it makes a fresh DefaultStager, so it allocates
               its staging copy on every save) in a single-process gloo group; blocking = until
               async_save returns (its staging is synchronous: complete by then), end-to-end =
               until its future is done (FileSystemWriter fsyncs its files). The same state
               dict longrun saves (model, optimizer with param_groups, scheduler, data position,
               RNG) passed as a plain dict.
  dcp_cached - the same with one `DefaultStager` reused across saves (async_stager=), as DCP
               documents for repeated saves; its restore is `dcp.load` into a worker's new
               trainer's state dict + `load_state_dict`, cold.
  dcp_async_staging - DCP on longrun's terms: one reused `DefaultStager(StagingOptions(
               use_async_staging=True, use_shared_memory=False, pinned and non-blocking copies
               on a GPU))`, so async_save returns an AsyncSaveResponse while its thread copies;
               the same real step follows, with a before_update hook that waits for the
               response's staging_completion before the update. blocking = async_save's return
               + that wait; end-to-end = until upload_completion; restore = dcp.load, cold.
  memcpy     - the blocking floor: `copy_` of every tensor of the same state into host buffers
               allocated once (pinned on a GPU), no tree walking, the same intra-op threads;
               the fastest rep is reported (a floor), not the median.
  disk       - the disk floor, `dd`-style: the state's bytes (the memcpy buffers) written to one
               file in 64 MB sequential writes, fsynced (`disk_write_s`); then read back cold
               (evicted from the page cache) twice: into the same buffers, whose pages were
               touched before (`disk_read_s`: the disk alone), and into one fresh anonymous
               mapping never touched (`disk_read_fresh_s`: the disk plus the first touch of
               every page, which every real restore pays, reading into a new process's memory).
               No serialisation, no checksum: what the disk itself allows.
Every save method builds `trainer.state_dict()` inside its timed region (training would have to),
and every restore its target's (which gives a new optimizer its state). Every method starts on a
quiet machine (`os.sync()` first: no writeback of the previous method's files beside it), and
one training step runs between reps, so each rep saves weights no earlier save held. Each
restore is checked against the weights its save held (an xxHash3 of each, taken just before the
save, outside the timed regions: the step after a save changes them).
Phases: (longrun, sync, dcp), (dcp_cached, dcp_async_staging), (memcpy, disk), each starting with
a step (not timed); what a phase keeps between saves (longrun's staging buffers, DCP's reused
stagers, the floors' buffers) is freed before the next, so on the CPU host memory holds the
trainer's state (its weights, moments and gradients: 1.33x), at most two of those, and one
restore's target and reads (torch.load's: its loaded state beside its target, about 2.3x). The
JSON reports the process's peak RSS (`peak_rss_bytes`, beside `baseline_rss_bytes`: its RSS
just before the state was built): measured at 0.04-0.3 GB, about 0.1 GB + 4.4x the state above
the process's high-water mark before the state (the baseline before 2026-11-29).
Ratios (seconds, ours over theirs; the last JSON line): `blocking_vs_sync`; `blocking_vs_dcp`
(the headline: against the DCP variant with the least blocking, named in `blocking_dcp_best`),
with `_fresh`, `_cached` and `_async_staging` against each; `e2e_vs_dcp` (the headline: DCP with
its stager reused, as documented for repeated saves; `_fresh`, `_async_staging` beside it),
`restore_vs_dcp_load` (the headline restore), `restore_vs_torch_load`, `blocking_vs_memcpy` and
`stage_vs_memcpy` (longrun's copy itself, timed alone, against the floor),
`e2e_vs_disk`, `restore_vs_disk` and `restore_vs_disk_fresh` (against each read floor above);
`methods` holds every method's medians. Targets (issue 39, state >= 4 GB): blocking <= 0.10 of
sync; end-to-end and cold restore no slower than DCP's, and each within 1.5x of the disk floor;
and the floor below longrun's copy (`stage_vs_memcpy` >= 1; its blocking is below the floor
since the copy overlaps the next step).
On a GPU (`--device cuda`, or auto) the state lives on the device and every copy is
device-to-host (longrun and the floor into pinned buffers). Timings on a shared machine are noisy:
the summary prints the load average; `--threads 1` avoids the intra-op copy threads stalling on
a busy core; `--reps` for more repeats. Run it alone.
The methods themselves are in bench/_checkpoint_methods.py.
Progress goes to stderr; the last line on stdout is one JSON object.
"""

from __future__ import annotations

import json
import os
import resource
import shutil
import statistics
import tempfile
import time
from typing import Any

import torch
from _checkpoint_methods import METHODS, PHASES, Bench, fingerprint
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
        # Far more steps than the bench trains (a step per rep and phase, and one after every
        # longrun and async-staging save), so the schedule never ends: every step moves the weights.
        "training": {"steps": 1000, "warmup_steps": 1},
        "checkpoint": {"dir": os.path.join(root, "longrun"), "keep_last": 1},
    })


# --- main -------------------------------------------------------------------------------------


def layers_for(state_gb: float, dim: int) -> int:
    """The layers whose weights and two AdamW moments (12 bytes a parameter, about 12 dim^2
    parameters a block; the embeddings are small beside them) take about `state_gb` GB."""
    return max(1, round(state_gb * 1e9 / 12 / (12 * dim * dim)))


def build(root: str, layers: int, dim: int, device: str):
    from longrun.trainer import Trainer

    cfg = job_config(root, layers, dim, device)
    start = time.perf_counter()
    trainer = Trainer(cfg, progress=False)
    log(f"model: {trainer.model.num_params():,} parameters on {trainer.device}; one training step "
        f"to create the optimizer state ...")
    trainer.train_step()
    trainer.close()  # stop the data thread: nothing runs beside the measurements
    trainer.optimizer.zero_grad(set_to_none=True)  # no gradients held between the measurements
    log(f"trainer ready in {time.perf_counter() - start:.1f} s")

    def restore_target() -> Trainer:
        # What a restarted worker restores into (worker/setup.py): the same shapes, built
        # anew, no weights set and no optimizer state yet. Each method restores into its own.
        target = Trainer(cfg, progress=False, init_weights=False)
        target.close()
        return target

    return trainer, restore_target, cfg


def main() -> None:
    cli = parser(__doc__)
    cli.add_argument("--quick", action="store_true", help="~0.3 GB state (2 layers), 2 reps")
    cli.add_argument("--state-gb", type=float, default=4.0,
                     help="the state's size in GB (weights + AdamW moments; default 4): sets --layers")
    cli.add_argument("--reps", type=int, default=None, help="repeats per method (median reported)")
    cli.add_argument("--layers", type=int, default=None,
                     help="model layers (default: from --state-gb; quick 2)")
    cli.add_argument("--dim", type=int, default=1024, help="model width (a multiple of 128)")
    cli.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                     help="where the training state lives (cuda: device-to-pinned-host staging)")
    cli.add_argument("--threads", type=int, default=None,
                     help="torch intra-op threads (default: torch's own, one per core)")
    cli.add_argument("--dir", default=None,
                     help="local-disk directory for the checkpoints (default: the temp dir)")
    args = cli.parse_args()
    reps = args.reps or (2 if args.quick else 3)
    layers = args.layers or (2 if args.quick else layers_for(args.state_gb, args.dim))
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
        # What the process holds now (torch and longrun imported, no state yet): not the
        # high-water mark, which an import's transient memory can already hold above it.
        baseline = current_rss_bytes()
        trainer, restore_target, cfg = build(root, layers, dim, device)
        tensors = state_tensors(trainer)
        nbytes = sum(t.numel() * t.element_size() for _, t in tensors)
        free = shutil.disk_usage(root).free
        if free < 4 * nbytes:  # longrun's two revisions at most, a DCP save, the floor's file
            raise SystemExit(f"only {gb(free)} free under {root}; the benchmark needs 4x the state "
                             f"({gb(4 * nbytes)}): pass --dir on a larger local disk")
        log(f"state: {gb(nbytes)} in {len(tensors)} tensors; {gb(free)} free "
            f"under {root}; {reps} reps, torch {torch.__version__}, {torch.get_num_threads()} threads")
        bench = Bench(trainer, restore_target, cfg, root)
        summary, breakdown = measure(bench, reps)
        summary["dcp_stager_closed"] = bench.stager_closed  # saves that could not reuse it
        summary["rss"] = {"baseline": baseline, "peak": peak_rss_bytes()}
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    return summary, breakdown, nbytes, str(trainer.device)


def state_tensors(trainer) -> list[Any]:
    from longrun.checkpoint.snapshot import tensors_of

    return tensors_of(trainer.state_dict())


def train_between(bench: Bench) -> float:
    """One training step, so every rep saves and restores weights no earlier save held (a
    restore that returned an older save's, or a snapshot that skipped a copy, fails the rep's
    weight check); its seconds, a step with no save beside it. Raises if the step left the
    weights as they were."""
    before = fingerprint(bench.trainer)
    took = bench.step()
    if fingerprint(bench.trainer) == before:
        raise RuntimeError("a training step left the weights unchanged: the reps would save the same state")
    return took


def blocking_parts(rows: list[dict[str, float]]) -> dict[str, float]:
    """The median rep's blocking with its two parts (save's return, the update's wait) from
    that same rep (the two middle ones averaged when the count is even), so that the reported
    parts add up to the reported blocking, which is the median as for every other figure."""
    ranked = sorted(rows, key=lambda row: row["blocking_s"])
    middle = ranked[(len(ranked) - 1) // 2:len(ranked) // 2 + 1]
    parts = ("blocking_s", "save_return_s", "update_wait_s")
    return {k: statistics.mean(row[k] for row in middle) for k in parts}


def peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def current_rss_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def measure(bench: Bench, reps: int) -> tuple[dict[str, Any], dict[str, float]]:
    steps_alone: list[float] = []
    breakdown: dict[str, float] = {}
    for phase in PHASES:
        # A step first, not timed: the previous phase's release gave the gradients' pages back
        # to the system, and the first step to touch them again is slower than training's.
        train_between(bench)
        # Warm-ups: each path's first call pays one-time costs (longrun and the reused DCP
        # stagers allocate their buffers, memcpy touches its pages, DCP imports its planner).
        for method in phase:
            row = bench.run(method)
            bench.first[method] = row["blocking_s"]
            log(f"warm-up {method:<17} blocking {row['blocking_s']:.3f} s; peak RSS {gb(peak_rss_bytes())}")
        for rep in range(reps):
            steps_alone.append(train_between(bench))
            order = phase[rep % len(phase):] + phase[:rep % len(phase)]
            if rep % 2:
                order = order[::-1]
            for method in order:
                row = bench.run(method)
                bench.rows[method].append(row)
                shown = ", ".join(f"{k} {v:.3f}" for k, v in row.items())
                log(f"rep {rep + 1}/{reps} {method:<17} {shown}; peak RSS {gb(peak_rss_bytes())}")
        if "longrun" in phase:
            breakdown = bench.breakdown(reps)  # while longrun's stager still holds its buffers
        bench.release(phase)
        log(f"phase {', '.join(phase)} done: peak RSS so far {gb(peak_rss_bytes())}")
    summary = {m: {k: statistics.median(r[k] for r in rows) for k in rows[0]}
               for m, rows in bench.rows.items()}
    for method in ("longrun", "dcp_async_staging"):
        summary[method] |= blocking_parts(bench.rows[method])
    summary["memcpy"]["blocking_s"] = min(r["blocking_s"] for r in bench.rows["memcpy"])  # a floor
    summary["step_alone_s"] = statistics.median(steps_alone)
    return summary | {"first": bench.first, "raw": bench.rows}, breakdown


def report(s: dict[str, Any], breakdown: dict[str, float], nbytes: int, reps: int, device: str,
           load: tuple[float, float]) -> None:
    ours, sync, dcp, cached, staged, floor = (
        s[m]["blocking_s"] for m in ("longrun", "sync", "dcp", "dcp_cached", "dcp_async_staging", "memcpy"))
    e2e, restore = s["longrun"]["e2e_s"], s["longrun"]["restore_s"]
    disk_write, disk_read, disk_fresh = (s["disk"][k] for k in ("e2e_s", "restore_s", "restore_fresh_s"))
    # The headline blocking is against DCP's best variant (each with its copy's whole cost to
    # training: the asynchronous staging's wait before the update included); end-to-end and the
    # restore against the reused stager (its documented way for repeated saves) and dcp.load.
    # The others are reported beside them.
    best_dcp = min(("dcp", "dcp_cached", "dcp_async_staging"), key=lambda m: s[m]["blocking_s"])
    ratios = {"blocking_vs_sync": ours / sync, "blocking_vs_dcp": ours / s[best_dcp]["blocking_s"],
              "blocking_vs_dcp_fresh": ours / dcp, "blocking_vs_dcp_cached": ours / cached,
              "blocking_vs_dcp_async_staging": ours / staged,
              "blocking_vs_memcpy": ours / floor, "stage_vs_memcpy": breakdown["stage_s"] / floor,
              "e2e_vs_dcp": e2e / s["dcp_cached"]["e2e_s"],
              "e2e_vs_dcp_fresh": e2e / s["dcp"]["e2e_s"],
              "e2e_vs_dcp_async_staging": e2e / s["dcp_async_staging"]["e2e_s"],
              "e2e_vs_disk": e2e / disk_write,
              "restore_vs_dcp_load": restore / s["dcp_cached"]["restore_s"],
              "restore_vs_torch_load": restore / s["sync"]["restore_s"],
              "restore_vs_disk": restore / disk_read, "restore_vs_disk_fresh": restore / disk_fresh}
    targets = {"blocking_vs_sync<=0.10": ratios["blocking_vs_sync"] <= 0.10,
               # A floor is a floor: longrun's copy itself (its blocking no longer holds it, the
               # copy overlapping the next step) takes no less than the bare copy_ of the same bytes.
               "stage_vs_memcpy>=1": ratios["stage_vs_memcpy"] >= 1.0,
               "e2e_vs_dcp<=1": ratios["e2e_vs_dcp"] <= 1.0, "e2e_vs_disk<=1.5": ratios["e2e_vs_disk"] <= 1.5,
               "restore_vs_dcp_load<=1": ratios["restore_vs_dcp_load"] <= 1.0,
               "restore_vs_disk<=1.5": ratios["restore_vs_disk"] <= 1.5}
    rate = nbytes / 1e9
    cpus = os.cpu_count() or 1
    print(f"state {gb(nbytes)} on {device}, median of {reps} reps (first = warm-up save); "
          f"{torch.get_num_threads()} torch threads, {cpus} CPUs, "
          f"load average {load[0]:.1f} -> {load[1]:.1f}")
    if max(load) > cpus:
        print(f"warning: the machine was busy (load average above {cpus} CPUs): other processes "
              "share these cores, so every time below is inflated and noisy")
    print(f"{'method':<30}{'blocking':>10}{'first':>9}{'end-to-end':>12}{'GB/s':>7}{'restore':>10}{'GB/s':>7}")
    labels = {"longrun": "longrun Checkpointer.save", "sync": "torch.save + fsync / torch.load",
              "dcp": "DCP async_save", "dcp_cached": "DCP async_save (reused) / load",
              "dcp_async_staging": "DCP async staging / load",
              "memcpy": "memcpy floor", "disk": "disk floor (write / read)"}
    for m in METHODS:
        row = s[m]
        e2e_col = f"{row['e2e_s']:>11.3f}s{rate / row['e2e_s']:>7.2f}" if "e2e_s" in row else f"{'':>19}"
        restore_col = (f"{row['restore_s']:>9.3f}s{rate / row['restore_s']:>7.2f}"
                       if "restore_s" in row else "")
        first = s["first"].get(m)
        print(f"{labels[m]:<30}{row['blocking_s']:>9.3f}s{first if first is not None else 0:>8.3f}s"
              f"{e2e_col}{restore_col}")
    print(f"longrun: restore warm {s['longrun']['restore_warm_s']:.3f} s; write on the writer thread "
          f"{s['longrun']['write_s']:.3f} s; breakdown (writer idle): trainer.state_dict() "
          f"{breakdown['state_dict_s'] * 1e3:.1f} ms, HostStager.stage {breakdown['stage_s']:.3f} s")
    for m in ("longrun", "dcp_async_staging"):
        row = s[m]
        print(f"{labels[m]}: returns after {row['save_return_s']:.3f} s, the next update waits "
              f"{row['update_wait_s']:.3f} s for its copy, which ran beside that step's forward and "
              f"backward (the step: {row['step_s']:.3f} s; a step with no save: {s['step_alone_s']:.3f} s)")
    print(f"disk floor: cold read into touched buffers {disk_read:.3f} s, into fresh memory "
          f"{disk_fresh:.3f} s; peak RSS {gb(s['rss']['peak'])} ({s['rss']['peak'] / nbytes:.2f}x "
          f"the state; {gb(s['rss']['baseline'])} before it was built)")
    print(f"headline, against DCP's best ({best_dcp}) and its reused stager and dcp.load: "
          f"blocking {ratios['blocking_vs_dcp']:.3f}, "
          f"end-to-end {ratios['e2e_vs_dcp']:.3f}, cold restore {ratios['restore_vs_dcp_load']:.3f}")
    print("ratios (ours over theirs, seconds): " + ", ".join(f"{k} {v:.3f}" for k, v in ratios.items()))
    print("targets: " + ", ".join(f"{k} {'met' if v else 'MISSED'}" for k, v in targets.items()))
    r = lambda x: round(x, 4)  # noqa: E731
    print(json.dumps({
        "state_gb": round(nbytes / 1e9, 3), "state_bytes": nbytes, "device": device, "reps": reps,
        "threads": torch.get_num_threads(), "loadavg": [round(x, 2) for x in load],
        **{k: r(v) for k, v in ratios.items()},
        "blocking_s": r(ours), "sync_s": r(sync), "dcp_blocking_s": r(dcp), "memcpy_s": r(floor),
        "e2e_s": r(e2e), "write_s": r(s["longrun"]["write_s"]), "dcp_e2e_s": r(s["dcp"]["e2e_s"]),
        "dcp_cached_blocking_s": r(cached), "dcp_cached_e2e_s": r(s["dcp_cached"]["e2e_s"]),
        "restore_s": r(restore), "restore_warm_s": r(s["longrun"]["restore_warm_s"]),
        "sync_restore_s": r(s["sync"]["restore_s"]), "dcp_load_s": r(s["dcp_cached"]["restore_s"]),
        "disk_write_s": r(disk_write), "disk_read_s": r(disk_read),
        "first_blocking_s": r(s["first"]["longrun"]), "save_return_s": r(s["longrun"]["save_return_s"]),
        "update_wait_s": r(s["longrun"]["update_wait_s"]), "step_s": r(s["longrun"]["step_s"]),
        "step_alone_s": r(s["step_alone_s"]), "blocking_dcp_best": best_dcp,
        "dcp_async_staging_blocking_s": r(staged),
        "dcp_async_staging_e2e_s": r(s["dcp_async_staging"]["e2e_s"]),
        "dcp_async_staging_load_s": r(s["dcp_async_staging"]["restore_s"]),
        "disk_read_fresh_s": r(disk_fresh), "peak_rss_bytes": s["rss"]["peak"],
        "peak_rss_vs_state": round(s["rss"]["peak"] / nbytes, 3), "baseline_rss_bytes": s["rss"]["baseline"],
        "state_dict_s": r(breakdown["state_dict_s"]), "stage_s": r(breakdown["stage_s"]),
        "dcp_stager_closed": s["dcp_stager_closed"], "targets_met": targets,
        "trained_between_reps": True, "headline_dcp": "dcp_cached (one DefaultStager reused) and dcp.load",
        "methods": {m: {k: r(v) for k, v in s[m].items()} for m in METHODS},
        "raw_blocking_s": {m: [r(x["blocking_s"]) for x in rows] for m, rows in s["raw"].items()},
    }))


if __name__ == "__main__":
    main()
