"""Resharding restore and save blocking, longrun vs torch's distributed checkpoint (issue 18).

    .venv/bin/python bench/reshard.py            # ~0.23 GB state (dim 512, 6 layers), 5 reps
    .venv/bin/python bench/reshard.py --quick    # ~0.02 GB state (dim 256, 2 layers), 2 reps

The state is a real `Trainer` (Llama-style model, fp32, AdamW: weights plus two moments) after
one training step, sharded by FSDP2 over gloo on the CPU. Two worlds of spawned ranks, one run:

Save, FSDP 4 (a world of 4), the same state every time, methods interleaved (the order rotates
and reverses across reps; medians of the slowest rank's time per rep):
  longrun    `Checkpointer.save(trainer)` + `before_update()` (blocking: the snapshot into
             host buffers), then `flush()` (end-to-end: every rank's pieces written, hashed,
             fsynced, reported to the Redis commit ledger; rank 0 wrote DCP's `.metadata` and
             the manifest and renamed the directory: committed). First save (buffers allocated)
             is a warm-up, not counted.
  dcp_async  `torch.distributed.checkpoint.async_save(trainer.state_dict(), checkpoint_id=dir)`
             as documented (default thread checkpointer and stager): blocking = until it
             returns (collective planning + staging copy), end-to-end = its future done.
  dcp_sync   `dcp.save(trainer.state_dict(), checkpoint_id=dir)`: the synchronous save the
             issue's ratio is taken against (blocking = end-to-end).
  memcpy     the floor: `copy_` of this rank's pieces into buffers allocated once.
Then, with the writer idle, longrun's blocking part split: `trainer.state_dict()`, choosing
this rank's pieces (`files_of`), the copy into its reused host buffers (`HostStager.stage`).
Every method builds `trainer.state_dict()` (torch's `get_state_dict`) inside its timed region.
The last longrun checkpoint and the last `dcp.save` directory hold the same state; they are
what the restore world reads.

Restore, FSDP 2 (a world of 2: a new layout, each rank holds half of every tensor, the saved
files hold quarters), into one fresh trainer, page cache evicted before every read
(posix_fadvise DONTNEED: the files come from the disk), methods interleaved:
  longrun        `Checkpointer.restore(trainer, world_group, dp_group)`: manifest, the
                 records this rank's pieces overlap read as byte ranges, each verified
                 (SHA-256) and `torch.load`ed, broadcast over the replica group (here of one
                 rank: FSDP 2 at world 2 has no replicas, so no broadcast), the all-rank
                 agreement, then `trainer.load_state_dict` (data position, scheduler too).
  dcp            torch's documented path: `get_state_dict(model, optimizer)`,
                 `dcp.load({"model", "optimizer"}, checkpoint_id=dcp_dir)` (FileSystemReader,
                 DCP's resharding planner), `set_state_dict(...)`. Loads model and optimizer
                 only (no data position or scheduler), and verifies nothing.
  dcp_on_longrun the same `dcp.load` reading longrun's own step directory (it is DCP's format;
                 its `.metadata` holds the tensors, so the optimizer's `state` part is loaded
                 and its param_groups kept from the target).
Before each restore every local piece of the model and optimizer is zeroed; after it, every
piece must equal, bit for bit, what the first (warm-up) longrun restore gave, and the global
sums of every tensor must match those of the saving world. Reported: seconds per method, the
bytes longrun read per rank, the ratio dcp / longrun (issue target: restore no slower than
DCP, ratio >= 1), and where longrun's restore time went (its functions timed in place: records
read, SHA-256, torch.load of each record, broadcast, load_state_dict). Save: longrun blocking /
synchronous dcp.save (issue target <= 0.04) and / async_save's blocking.
On a 2-core machine four ranks share two cores, so every time here is a CPU-bound, noisy
number: the summary prints the load average.
Progress goes to stderr; the last line on stdout is one JSON object.
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import tempfile
import time
import traceback
from typing import Any

from _common import evict, logger, parser

from longrun.testing.worlds import World

log = logger("reshard")
SAVE_METHODS = ("longrun", "dcp_async", "dcp_sync", "memcpy")
RESTORE_METHODS = ("longrun", "dcp", "dcp_on_longrun")
SAVE_WORLD, RESTORE_WORLD = 4, 2
JOB = "bench-reshard"


def config(args, parallelism: dict, world: int, ckpt_root: str):
    from longrun.config import config_from_dict

    return config_from_dict({
        "job": {"name": JOB, "seed": 7},
        "cluster": {"device": "cpu", "workers_per_node": world},
        "parallelism": parallelism,
        "model": {"dim": args.dim, "n_layers": args.layers, "n_heads": args.dim // 64,
                  "max_seq_len": 64},
        # One tiny step only creates the optimizer state: short synthetic documents.
        "data": {"source": "synthetic", "micro_batch_tokens": 64, "prefetch": 1,
                 "synthetic": {"min_len": 8, "max_len": 64, "mean": 32, "sigma": 0.5}},
        "training": {"steps": 10, "warmup_steps": 1},
        "checkpoint": {"dir": ckpt_root, "keep_last": 1},
    })


def join(rank: int, world: int, init_file: str):
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)  # up to 4 ranks share the cores; more threads only thrash
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    return dist


def build(args, parallelism: dict, rank: int, world: int, ckpt_root: str):
    from longrun.commgroup import form_groups, single_node_layout
    from longrun.trainer import Trainer
    from longrun.worker.setup import replicas_of

    cfg = config(args, parallelism, world, ckpt_root)
    groups = form_groups(single_node_layout(cfg.dims), rank)
    trainer = Trainer(cfg, "cpu", dp_group=groups.dp_cp, mesh=groups.device_mesh("cpu"), progress=False)
    return cfg, trainer, replicas_of(groups)


def local(t):
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


def pieces(trainer) -> dict[str, Any]:
    """This rank's piece of every model and optimizer tensor, by checkpoint name."""
    from longrun.checkpoint.dcp_format import fqn_of, tensor_leaves

    return {fqn_of(path): t for path, t in tensor_leaves(trainer.state_dict())}


def sums(trainer) -> dict[str, tuple[float, bool]]:
    """Per tensor: the float64 sum of this rank's piece, and whether it is a piece (a DTensor,
    summed over ranks) or whole on every rank."""
    import torch
    from torch.distributed.tensor import DTensor

    return {k: (float(local(t).to(torch.float64).sum()), isinstance(t, DTensor))
            for k, t in pieces(trainer).items()}


def global_sums(per_rank: list[dict[str, tuple[float, bool]]]) -> dict[str, float]:
    return {k: (sum(r[k][0] for r in per_rank) if sharded else per_rank[0][k][0])
            for k, (_, sharded) in per_rank[0].items()}


def du(path: str) -> int:
    return sum(os.path.getsize(os.path.join(d, n)) for d, _, names in os.walk(path) for n in names)


def order_of(methods: tuple[str, ...], rep: int) -> tuple[str, ...]:
    k = rep % len(methods)
    order = methods[k:] + methods[:k]
    return order[::-1] if rep % 2 else order


# --- the saving world (FSDP 4) ----------------------------------------------------------------


def save_main(rank: int, world: int, init_file: str, results, args, redis_url: str, root: str) -> None:
    try:
        results.put(("save", rank, save_rank(rank, world, init_file, args, redis_url, root)))
    except Exception:
        results.put(("error", rank, traceback.format_exc()))


def save_rank(rank: int, world: int, init_file: str, args, redis_url: str, root: str) -> dict[str, Any]:
    dist = join(rank, world, init_file)
    import redis
    import torch
    import torch.distributed.checkpoint as dcp

    from longrun.checkpoint import Checkpointer, RedisCommitLedger

    ckpt_root, dcp_root = f"{root}/longrun", f"{root}/dcp"
    cfg, trainer, replicas = build(args, {"fsdp": world}, rank, world, ckpt_root)
    trainer.train_step()  # creates the optimizer state
    trainer.close()  # stop the data thread: nothing runs beside the measurements
    ckpt = Checkpointer(cfg, rank=rank, world_size=world, dp_rank=replicas.rank, dp_size=replicas.size,
                        ledger=RedisCommitLedger(redis.Redis.from_url(redis_url), JOB, 0))
    nbytes = sum(local(t).numel() * local(t).element_size() for t in pieces(trainer).values())

    def fresh_dir(name: str) -> str:
        path = f"{dcp_root}/{name}"
        if rank == 0:
            shutil.rmtree(path, ignore_errors=True)
        dist.barrier()
        return path

    def longrun() -> dict[str, float]:
        ckpt.flush()  # steady state: the previous save is committed
        dist.barrier()
        start = time.perf_counter()
        ckpt.save(trainer)
        ckpt.before_update()
        blocking = time.perf_counter() - start
        result = ckpt.flush()
        e2e = time.perf_counter() - start
        if result is None or not result.committed:
            raise RuntimeError(f"the longrun save did not commit: {result}")
        dist.barrier()  # rank 0's commit (and its `latest`) is done before anything else starts
        return {"blocking_s": blocking, "e2e_s": e2e}

    def dcp_async() -> dict[str, float]:
        path = fresh_dir("async")
        start = time.perf_counter()
        future = dcp.async_save(trainer.state_dict(), checkpoint_id=path)
        blocking = time.perf_counter() - start
        future.result()
        e2e = time.perf_counter() - start
        dist.barrier()
        return {"blocking_s": blocking, "e2e_s": e2e}

    def dcp_sync() -> dict[str, float]:
        path = fresh_dir("sync")
        start = time.perf_counter()
        dcp.save(trainer.state_dict(), checkpoint_id=path)
        blocking = time.perf_counter() - start
        dist.barrier()
        return {"blocking_s": blocking, "e2e_s": blocking}

    sources = [local(t).detach() for t in pieces(trainer).values()]
    buffers = [torch.empty_like(t) for t in sources]

    def memcpy() -> dict[str, float]:
        dist.barrier()
        start = time.perf_counter()
        for dst, src in zip(buffers, sources, strict=True):
            dst.copy_(src)
        blocking = time.perf_counter() - start
        dist.barrier()
        return {"blocking_s": blocking, "e2e_s": blocking}

    run = {"longrun": longrun, "dcp_async": dcp_async, "dcp_sync": dcp_sync, "memcpy": memcpy}
    first = {m: run[m]()["blocking_s"] for m in SAVE_METHODS}  # warm-ups
    if rank == 0:
        log(f"save world: {nbytes / 1e6:.1f} MB of state per rank at FSDP {world}; warm-up blocking "
            + ", ".join(f"{m} {s:.3f} s" for m, s in first.items()))
    rows: dict[str, list[dict[str, float]]] = {m: [] for m in SAVE_METHODS}
    for rep in range(args.reps):
        for method in order_of(SAVE_METHODS, rep):
            row = run[method]()
            rows[method].append(row)
            if rank == 0:
                log(f"save rep {rep + 1}/{args.reps} {method:<10} blocking {row['blocking_s']:.3f} s, "
                    f"end-to-end {row['e2e_s']:.3f} s (rank 0)")
    ckpt.flush()
    # Where longrun's blocking time goes (writer idle): building the state dict (torch's
    # get_state_dict), choosing this rank's pieces, and the copy into the reused host buffers.
    parts: dict[str, list[float]] = {"state_dict_s": [], "files_of_s": [], "stage_s": []}
    for _ in range(args.reps):
        start = time.perf_counter()
        state = trainer.state_dict()
        built = time.perf_counter()
        files = ckpt.files_of(state)
        chosen = time.perf_counter()
        ckpt.stager.stage(files).wait()
        parts["state_dict_s"].append(built - start)
        parts["files_of_s"].append(chosen - built)
        parts["stage_s"].append(time.perf_counter() - chosen)
    ckpt.close()
    if rank == 0:
        shutil.rmtree(f"{dcp_root}/async", ignore_errors=True)
    out = {"rows": rows, "first": first, "state_bytes": nbytes, "sums": sums(trainer),
           "step": trainer.step, "blocking_parts": {k: statistics.median(v) for k, v in parts.items()}}
    dist.barrier()
    dist.destroy_process_group()
    return out


# --- the restoring world (FSDP 2) -------------------------------------------------------------


class Timers:
    """longrun's restore functions, timed where they run (patched in this rank's process)."""

    def __init__(self) -> None:
        import longrun.checkpoint.resharding as resharding
        import longrun.checkpoint.restore as restore

        self.s: dict[str, float] = {}
        timers = self

        def timed(name, fn):
            def wrapper(*a, **kw):
                start = time.perf_counter()
                try:
                    return fn(*a, **kw)
                finally:
                    timers.s[name] = timers.s.get(name, 0.0) + time.perf_counter() - start
            return wrapper

        # The records are read by several threads and hashed as they arrive (record_read.py):
        # hashing is not a part of its own to time, only the whole read.
        resharding.read_verified = timed("records_s", resharding.read_verified)
        restore.read_records = timed("read_pieces_s", restore.read_records)
        restore.apply_reads = timed("apply_s", restore.apply_reads)
        restore._read_candidate = timed("read_candidate_s", restore._read_candidate)
        restore.read_manifest = timed("manifest_s", restore.read_manifest)
        restore.load_shard = timed("train_state_s", restore.load_shard)  # train-state.pt, verified
        restore.table_of = timed("table_s", restore.table_of)
        restore.plan_reads = timed("plan_s", restore.plan_reads)
        restore.broadcast_in_place = timed("broadcast_s", restore.broadcast_in_place)
        restore.all_ranks_ok = timed("agreement_s", restore.all_ranks_ok)

    def wrap(self, obj, attr: str, name: str) -> None:
        fn = getattr(obj, attr)

        def wrapper(*a, **kw):
            start = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                self.s[name] = self.s.get(name, 0.0) + time.perf_counter() - start
        setattr(obj, attr, wrapper)

    def take(self) -> dict[str, float]:
        out, self.s = self.s, {}
        return out


def restore_main(rank: int, world: int, init_file: str, results, args, root: str, step: int) -> None:
    try:
        results.put(("restore", rank, restore_rank(rank, world, init_file, args, root, step)))
    except Exception:
        results.put(("error", rank, traceback.format_exc()))


def restore_rank(rank: int, world: int, init_file: str, args, root: str, step: int) -> dict[str, Any]:
    dist = join(rank, world, init_file)
    import fsspec
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    from longrun.checkpoint import Checkpointer, LocalCommitLedger
    from longrun.checkpoint.layout import step_dir as committed_step_dir

    ckpt_root, dcp_dir = f"{root}/longrun", f"{root}/dcp/sync"
    # Every rep saved the same step: the committed one is its newest revision (step-N.R), not step-N.
    step_dir = committed_step_dir(fsspec.filesystem("file"), ckpt_root, step)
    cfg, trainer, replicas = build(args, {"fsdp": world}, rank, world, ckpt_root)
    trainer.close()
    # This world only restores: the ledger, which commits saves, is never used.
    ckpt = Checkpointer(cfg, rank=rank, world_size=world, dp_rank=replicas.rank, dp_size=replicas.size,
                        ledger=LocalCommitLedger())
    timers = Timers()
    timers.wrap(trainer, "load_state_dict", "load_state_dict_s")
    model, optimizer = trainer.model, trainer.optimizer

    def longrun() -> dict[str, float]:
        start = time.perf_counter()
        restored = ckpt.restore(trainer, world_group=dist.group.WORLD, dp_group=replicas.group)
        took = time.perf_counter() - start
        if restored is None or restored.step != step or restored.skipped:
            raise RuntimeError(f"longrun restored {restored}")
        return {"s": took, "bytes_read": restored.bytes_read} | timers.take()

    def dcp_load(checkpoint_id: str, tensors_only: bool) -> dict[str, float]:
        start = time.perf_counter()
        msd, osd = get_state_dict(model, optimizer)
        # longrun's `.metadata` holds the tensors; the plain values live in its train-state.pt
        state = {"model": msd, "optimizer": {"state": osd["state"]} if tensors_only else osd}
        got = time.perf_counter()
        dcp.load(state, checkpoint_id=checkpoint_id)
        loaded = time.perf_counter()
        set_state_dict(model, optimizer, model_state_dict=msd, optim_state_dict=osd)
        end = time.perf_counter()
        return {"s": end - start, "load_s": loaded - got, "set_state_dict_s": end - loaded}

    run = {"longrun": longrun, "dcp": lambda: dcp_load(dcp_dir, False),
           "dcp_on_longrun": lambda: dcp_load(step_dir, True)}
    folder = {"longrun": step_dir, "dcp": dcp_dir, "dcp_on_longrun": step_dir}

    def measured(method: str) -> dict[str, float]:
        with torch.no_grad():
            for t in pieces(trainer).values():
                local(t).zero_()
        if rank == 0:
            evict(folder[method])
        dist.barrier()
        row = run[method]()
        dist.barrier()
        return row

    measured("longrun")  # warm-up; its result is the reference every later restore must equal
    timers.take()
    reference = {k: local(t).detach().clone() for k, t in pieces(trainer).items()}
    restored_sums = sums(trainer)
    for method in RESTORE_METHODS[1:]:  # warm-ups of the others
        measured(method)
    rows: dict[str, list[dict[str, float]]] = {m: [] for m in RESTORE_METHODS}
    mismatched: list[str] = []
    for rep in range(args.reps):
        for method in order_of(RESTORE_METHODS, rep):
            row = measured(method)
            got = pieces(trainer)
            if got.keys() != reference.keys() or not all(torch.equal(local(got[k]), reference[k])
                                                          for k in reference):
                mismatched.append(f"{method} rep {rep + 1}")
            rows[method].append(row)
            if rank == 0:
                log(f"restore rep {rep + 1}/{args.reps} {method:<14} {row['s']:.3f} s (rank 0)")
    out = {"rows": rows, "sums": restored_sums, "mismatched": mismatched,
           "state_bytes": sum(t.numel() * t.element_size() for t in reference.values())}
    ckpt.writer.close()
    dist.barrier()
    dist.destroy_process_group()
    return out


# --- main -------------------------------------------------------------------------------------


def run_world(target, size: int, root: str, name: str, args: tuple, timeout: float) -> list[dict]:
    os.makedirs(f"{root}/{name}-world", exist_ok=True)
    with World(target, size, workdir=f"{root}/{name}-world", args=args) as world:
        out = world.run(timeout=timeout)
    errors = [f"rank {rank}:\n{text}" for kind, rank, text in out if kind == "error"]
    if errors:
        raise RuntimeError("\n".join(errors))
    return [r for _, _, r in sorted(out, key=lambda x: x[1])]


DERIVED = ("file_reads_s", "buffers_rest_s", "copies_s", "after_s")


def derived(row: dict[str, float]) -> dict[str, float]:
    """A longrun restore row with the parts its timers give by difference."""
    g = row.get
    known = sum(g(k, 0.0) for k in ("manifest_s", "train_state_s", "table_s", "plan_s", "read_pieces_s"))
    return row | {
        "file_reads_s": g("records_s", 0.0),
        "buffers_rest_s": g("read_candidate_s", 0.0) - known,
        "copies_s": g("apply_s", 0.0),
        "after_s": row["s"] - g("read_candidate_s", 0.0) - g("agreement_s", 0.0) - g("broadcast_s", 0.0)
        - g("apply_s", 0.0) - g("load_state_dict_s", 0.0)}


def median_of_slowest(per_rank: list[dict], method: str, key: str) -> float:
    """Per rep the slowest rank's value (the world waits for it), then the median over reps."""
    reps = len(per_rank[0]["rows"][method])
    return statistics.median(max(r["rows"][method][i][key] for r in per_rank) for i in range(reps))


def main() -> None:
    cli = parser(__doc__)
    cli.add_argument("--quick", action="store_true", help="~0.02 GB state (dim 256, 2 layers), 2 reps")
    cli.add_argument("--reps", type=int, default=None, help="repeats per method (default 5; quick 2)")
    cli.add_argument("--dim", type=int, default=None, help="model width (default 512; quick 256)")
    cli.add_argument("--layers", type=int, default=None, help="model layers (default 6; quick 2)")
    cli.add_argument("--dir", default=None, help="local-disk directory for the checkpoints (default: temp)")
    args = cli.parse_args()
    args.reps = args.reps or (2 if args.quick else 5)
    args.dim = args.dim or (256 if args.quick else 512)
    args.layers = args.layers or (2 if args.quick else 6)
    from longrun.services import EmbeddedRedis

    load_before = os.getloadavg()[0]
    started = time.perf_counter()
    parent = args.dir or tempfile.gettempdir()
    os.makedirs(parent, exist_ok=True)
    root = tempfile.mkdtemp(prefix="longrun-bench-reshard-", dir=parent)
    try:
        with EmbeddedRedis() as server:
            log(f"saving at FSDP {SAVE_WORLD} (world {SAVE_WORLD}): dim {args.dim}, {args.layers} layers, "
                f"{args.reps} reps ...")
            saved = run_world(save_main, SAVE_WORLD, root, "save", (args, server.url, root), 1800)
        step = saved[0]["step"]
        sizes = {"longrun_bytes": du(f"{root}/longrun"), "dcp_bytes": du(f"{root}/dcp/sync")}
        log(f"restoring at FSDP {RESTORE_WORLD} (world {RESTORE_WORLD}) ...")
        restored = run_world(restore_main, RESTORE_WORLD, root, "restore", (args, root, step), 1800)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    report(args, saved, restored, sizes, (load_before, os.getloadavg()[0]), time.perf_counter() - started)


def report(args, saved: list[dict], restored: list[dict], sizes: dict[str, int],
           load: tuple[float, float], wall: float) -> None:
    import torch

    want, got = global_sums([r["sums"] for r in saved]), global_sums([r["sums"] for r in restored])
    same_sums = want.keys() == got.keys() and all(
        abs(got[k] - want[k]) <= 1e-9 * max(1.0, abs(want[k])) for k in want)
    mismatched = [m for r in restored for m in r["mismatched"]]
    if not same_sums or mismatched:
        raise SystemExit(f"restores differ from the saved state: sums equal {same_sums}, "
                         f"pieces differing after {mismatched}")
    state = sum(r["state_bytes"] for r in saved)
    save = {m: {k: median_of_slowest(saved, m, k) for k in ("blocking_s", "e2e_s")} for m in SAVE_METHODS}
    rest = {m: median_of_slowest(restored, m, "s") for m in RESTORE_METHODS}
    parts = ("s", "read_candidate_s", "manifest_s", "train_state_s", "table_s", "plan_s", "read_pieces_s",
             "records_s", "agreement_s", "broadcast_s", "load_state_dict_s")
    breakdown = [{p: statistics.median(derived(row).get(p, 0.0) for row in r["rows"]["longrun"])
                  for p in (*parts, *DERIVED)} for r in restored]
    dcp_parts = [{p: statistics.median(row[p] for row in r["rows"]["dcp"])
                  for p in ("s", "load_s", "set_state_dict_s")} for r in restored]
    read_per_rank = [int(statistics.median(row["bytes_read"] for row in r["rows"]["longrun"]))
                     for r in restored]
    ours, sync = save["longrun"]["blocking_s"], save["dcp_sync"]["blocking_s"]
    asynch = save["dcp_async"]["blocking_s"]
    vs_dcp = rest["dcp"] / rest["longrun"]
    targets = {"restore_no_slower_than_dcp": vs_dcp >= 1.0, "blocking_vs_sync<=0.04": ours / sync <= 0.04}
    cpus = os.cpu_count() or 1
    print(f"state {state / 1e9:.3f} GB (model + AdamW), dim {args.dim}, {args.layers} layers; saved at "
          f"FSDP {SAVE_WORLD}, restored at FSDP {RESTORE_WORLD}; median of {args.reps} reps of the slowest "
          f"rank; {cpus} CPUs, load average {load[0]:.1f} -> {load[1]:.1f}; {wall:.0f} s in all")
    print(f"{'save at FSDP 4':<34}{'blocking':>10}{'end-to-end':>12}")
    labels = {"longrun": "longrun Checkpointer.save", "dcp_async": "DCP async_save",
              "dcp_sync": "DCP save (sync)", "memcpy": "memcpy floor (no save)"}
    for m in SAVE_METHODS:
        print(f"{labels[m]:<34}{save[m]['blocking_s']:>9.3f}s{save[m]['e2e_s']:>11.3f}s")
    print("longrun blocking, per rank (medians, writer idle): " + "; ".join(
        f"{rank}: trainer.state_dict() {b['state_dict_s']:.3f} s, files_of {b['files_of_s']:.3f} s, "
        f"stage {b['stage_s']:.3f} s" for rank, b in enumerate(r["blocking_parts"] for r in saved)))
    print(f"{'restore at FSDP 2 (cold cache)':<34}{'seconds':>10}")
    labels = {"longrun": "longrun Checkpointer.restore", "dcp": "DCP load (dcp.save's files)",
              "dcp_on_longrun": "DCP load (longrun's files)"}
    for m in RESTORE_METHODS:
        print(f"{labels[m]:<34}{rest[m]:>9.3f}s")
    print(f"longrun read per rank: {', '.join(f'{b / 1e6:.1f} MB' for b in read_per_rank)} of "
          f"{sizes['longrun_bytes'] / 1e6:.1f} MB on disk (DCP's directory "
          f"{sizes['dcp_bytes'] / 1e6:.1f} MB)")
    for rank, b in enumerate(breakdown):
        print(f"longrun restore, rank {rank} (medians): {b['s']:.3f} s\n"
              f"  read this step {b['read_candidate_s']:.3f} s: manifest {b['manifest_s']:.3f}, "
              f"train-state.pt {b['train_state_s']:.3f}, record table {b['table_s']:.3f}, "
              f"plan {b['plan_s']:.3f}, "
              f"buffers+rest {b['buffers_rest_s']:.3f}, read_pieces {b['read_pieces_s']:.3f} "
              f"(records read and verified by several readers {b['file_reads_s']:.3f})\n"
              f"  agreement {b['agreement_s']:.3f} s (waits for the slower rank), overlaps copied into "
              f"the live state {b['copies_s']:.3f} s, broadcast {b['broadcast_s']:.3f} s, "
              f"template + rest {b['after_s']:.3f} s, "
              f"load_state_dict {b['load_state_dict_s']:.3f} s")
    for rank, b in enumerate(dcp_parts):
        print(f"DCP load, rank {rank} (medians): {b['s']:.3f} s = dcp.load {b['load_s']:.3f} s, "
              f"set_state_dict {b['set_state_dict_s']:.3f} s, the rest get_state_dict")
    print(f"ratios: restore dcp/longrun {vs_dcp:.2f} (target >= 1), dcp-on-longrun-files/longrun "
          f"{rest['dcp_on_longrun'] / rest['longrun']:.2f}; save blocking/sync dcp.save {ours / sync:.3f} "
          f"(target <= 0.04), blocking/async_save {ours / asynch:.3f}")
    print("targets: " + ", ".join(f"{k} {'met' if v else 'MISSED'}" for k, v in targets.items()))
    r = lambda x: round(x, 4)  # noqa: E731
    print(json.dumps({
        "state_bytes": state, "dim": args.dim, "layers": args.layers, "reps": args.reps,
        "save_fsdp": SAVE_WORLD, "restore_fsdp": RESTORE_WORLD, "torch": torch.__version__,
        "loadavg": [round(x, 2) for x in load], "wall_s": round(wall, 1),
        "restore_s": r(rest["longrun"]), "dcp_load_s": r(rest["dcp"]),
        "dcp_load_longrun_files_s": r(rest["dcp_on_longrun"]), "restore_vs_dcp": r(vs_dcp),
        "bytes_read_per_rank": read_per_rank, **sizes,
        "restore_breakdown": [{k: r(v) for k, v in b.items()} for b in breakdown],
        "dcp_load_breakdown": [{k: r(v) for k, v in b.items()} for b in dcp_parts],
        "blocking_s": r(ours), "e2e_s": r(save["longrun"]["e2e_s"]),
        "memcpy_s": r(save["memcpy"]["blocking_s"]),
        "blocking_parts": [{k: r(v) for k, v in x["blocking_parts"].items()} for x in saved],
        "dcp_async_blocking_s": r(asynch), "dcp_async_e2e_s": r(save["dcp_async"]["e2e_s"]),
        "dcp_sync_s": r(sync), "blocking_vs_sync": r(ours / sync), "blocking_vs_async": r(ours / asynch),
        "targets_met": targets, "bitwise_equal": True,
        "raw_restore_s": {m: [r(max(x["rows"][m][i]["s"] for x in restored)) for i in range(args.reps)]
                          for m in RESTORE_METHODS},
        "raw_blocking_s": {m: [r(max(x["rows"][m][i]["blocking_s"] for x in saved)) for i in range(args.reps)]
                           for m in SAVE_METHODS},
    }))


if __name__ == "__main__":
    main()
