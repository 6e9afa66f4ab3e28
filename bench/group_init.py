"""Group bring-up: longrun (RedisStore + barrier-free groups) vs PyTorch's default path.

    unshare --net -- sh -c 'ip link set lo up && exec .venv/bin/python bench/group_init.py'
    unshare --net -- sh -c 'ip link set lo up && exec .venv/bin/python bench/group_init.py --quick'
    unshare --net -- sh -c 'ip link set lo up && exec .venv/bin/python bench/group_init.py --only store'

Four measurements, each side by side in one run (gloo on CPU, spawned processes). Every row's
JSON names its `baseline`: the torch function whose real behaviour it runs or reproduces, with
TORCH_DIST_INIT_BARRIER as the bench found it (unset: 0, torch's default, no store barrier
after a group is created).
  fresh  - from "every process has imported torch" to "every group usable" (a first
           all-gather done on each), longrun vs TCPStore + torch's own `new_group` for every
           group, two ways: the default (every rank calls it for every group, in one order)
           and `use_local_synchronization=True` (members only, the way longrun calls it).
           All create the same de-duplicated group set (tp/cp/pp/dp/dp_cp + dynamic-CP
           power-of-two groups); the same processes run every path, rotating which goes first.
  reform - one rank is SIGKILLed; from the failure decision to every group usable again:
           longrun's survivors abort their groups and re-form under a new attempt with one
           freshly spawned replacement, vs killing every process and respawning the world
           on the default path. Also timed: spawning processes that import torch and
           longrun, one alone and the whole world at once, which is how much of the respawn
           is interpreters importing torch on this machine's cores (real hosts import in
           parallel, one process per accelerator).
  store  - 1,024 / 4,096 / 16,384 simulated ranks (2 processes x 16 threads, each thread a
           client) issuing the store traffic of world + group initialisation at GPU scale:
           longrun's real count-in on Redis (one script, one XREAD per rank, nothing per group)
           vs torch's real patterns on TCPStore (libuv), read from distributed_c10d.py:
           `split_group` (and `new_group` on a device-bound world: ncclCommSplit, no store
           keys per group), `new_group` bootstrapping each NCCL group (the root sets its id,
           members read it; the same keys with or without use_local_synchronization), and
           `new_group(use_local_synchronization=True)` with TORCH_DIST_INIT_BARRIER=1 (that
           plus a store barrier of the members); also longrun's protocol on TCPStore and
           longrun plus per-group NCCL ids; with where the time went (server CPU, commands,
           the client processes' CPU).
  reform-store - the store side of re-forming every group under a new attempt after one of
           16,384 ranks died: deleting the dead attempt's keys, then every rank re-keys.
Every world is spawned by `longrun.testing.worlds.World` (a rank's own pipe for its results, so
SIGKILLing ranks cannot wedge the harness); the store simulation is in bench/_group_init_store.py.
Progress goes to stderr; the last line on stdout is one JSON object.
"""

from __future__ import annotations

import json
import os
import statistics
import threading
import time
from datetime import timedelta

from _common import listen_port, logger, parser
from _group_init_store import TIMEOUT, measure_reform_store, measure_store

from longrun.testing.worlds import CONTEXT, World

LAYOUTS = {  # world -> (workers per node, dp, cp, tp, pp)
    8: (4, 2, 2, 2, 1),
    16: (4, 2, 2, 2, 2),
    32: (8, 4, 2, 2, 2),
}
log = logger("group_init")


def make(world: int):
    from longrun.commgroup import NodeSpec, ParallelDims, make_layout

    per_node, dp, cp, tp, pp = LAYOUTS[world]
    nodes = [NodeSpec(f"node-{i:03d}") for i in range(world // per_node)]
    return make_layout(nodes, per_node, ParallelDims(dp=dp, cp=cp, tp=tp, pp=pp))


# --- the default path -------------------------------------------------------------------------


BASELINES = {  # path -> the torch function it runs
    "default": "torch.distributed.new_group",
    "local": "torch.distributed.new_group(use_local_synchronization=True)",
}


def default_bringup(layout, rank: int, port: int, local: bool = False):
    """TCPStore on rank 0, then every group created by torch's `new_group` in one order: by
    every rank for every group (the default), or by its members only (`local`)."""
    import torch.distributed as dist

    world = layout.world_size
    store = dist.TCPStore("127.0.0.1", port, world, rank == 0, TIMEOUT, wait_for_workers=False,
                          use_libuv=True)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=TIMEOUT)
    created = {tuple(range(world)): dist.group.WORLD}
    # The group set longrun forms (tp/cp/pp/dp/dp_cp + dynamic-CP sizes), in its canonical order.
    everything = [g for _name, groups in layout.named_groups for g in groups]
    for g in everything:
        if tuple(g) in created or (local and rank not in g):
            continue  # by default non-members must call too; with local synchronisation they need not
        created[tuple(g)] = dist.new_group(g, timeout=TIMEOUT, use_local_synchronization=local)
    return {name: (created[tuple(members)], members) for name, members in layout.groups_of(rank)}


def check_named(rank: int, named) -> None:
    import torch
    import torch.distributed as dist

    for name, (pg, members) in named.items():
        out = torch.empty(len(members), dtype=torch.int64)
        dist.all_gather_single(out, torch.tensor([rank]), group=pg)
        if out.tolist() != members:
            raise RuntimeError(f"{name}: {out.tolist()} != {members}")


# --- worker processes -------------------------------------------------------------------------


def fresh_worker(rank, world, init_file, results, url, ports, reps, barrier):
    import torch.distributed as dist

    from longrun.commgroup import check_groups, init_parallel_groups

    layout = make(world)
    # Round 0 is a warm-up of both paths, not reported: a process's first bring-up pays one-time
    # costs (lazy imports inside torch.distributed, gloo device set-up) that would otherwise
    # land on whichever path happens to run first.
    paths = ("ours", "default", "local")
    for rep in range(reps + 1):
        order = paths[rep % 3:] + paths[:rep % 3]  # each path goes first in turn
        for path in order:
            barrier.wait(timeout=600)  # everyone imported, previous world torn down
            start = time.time()
            if path == "ours":
                groups = init_parallel_groups(url, job=f"bench{world}", attempt=rep, rank=rank, layout=layout,
                                              timeout=TIMEOUT)
                check_groups(groups)
                detail = groups.timings
                end = time.time()
                groups.teardown()
            else:
                named = default_bringup(layout, rank, ports[2 * rep + (path == "local")], path == "local")
                check_named(rank, named)
                detail = None
                end = time.time()
                dist.destroy_process_group()
            results.put((path, rep, rank, start, end, detail))
    barrier.wait(timeout=600)


def reform_worker(rank, world, init_file, results, url, attempt, job):
    """attempt 0: form, report, wait for the failure decision, re-form as attempt 1.
    attempt 1: a replacement spawned at the decision; joins attempt 1 directly.
    The decision comes through Redis, as from the controller (a multiprocessing.Event cannot
    be used: its set() waits for every waiter, and one of them was just SIGKILLed)."""
    import torch.distributed as dist

    from longrun.commgroup import check_groups, init_parallel_groups
    from longrun.commgroup.store import RedisStore

    layout = make(world)
    if attempt == 0:
        groups = init_parallel_groups(url, job=job, attempt=0, rank=rank, layout=layout, timeout=TIMEOUT)
        check_groups(groups)
        results.put(("formed", rank, os.getpid(), time.time()))
        RedisStore(url, f"control:{job}:", timedelta(hours=1)).wait(["go"])
        groups.teardown()  # its peer is dead: abort, never a hanging destroy
    groups = init_parallel_groups(url, job=job, attempt=1, rank=rank, layout=layout, timeout=TIMEOUT)
    check_groups(groups)
    results.put(("reformed", rank, os.getpid(), time.time()))
    dist.barrier()
    groups.teardown()


def respawn_worker(rank, world, init_file, results, port, hold):
    layout = make(world)
    named = default_bringup(layout, rank, port)
    check_named(rank, named)
    results.put(("formed", rank, os.getpid(), time.time()))
    if hold:  # the running job: stays up until the harness kills it
        threading.Event().wait()


# --- measurements -----------------------------------------------------------------------------


def measure_fresh(world: int, reps: int, url: str) -> dict:
    barrier = CONTEXT.Barrier(world)
    ports = [listen_port() for _ in range(2 * (reps + 1))]
    with World(fresh_worker, world, args=(url, ports, reps, barrier)) as ranks:
        rows = ranks.run(world * (reps + 1) * 3, timeout=3600)
    times = {"ours": [], "default": [], "local": []}
    breakdown = []
    for path in times:
        for rep in range(1, reps + 1):
            mine = [r for r in rows if r[0] == path and r[1] == rep]
            times[path].append(max(r[4] for r in mine) - min(r[3] for r in mine))
            if path == "ours":
                breakdown.append(max(mine, key=lambda r: r[4] - r[3])[5].summary())
    ours, theirs = statistics.median(times["ours"]), statistics.median(times["default"])
    local = statistics.median(times["local"])
    log(f"fresh world {world}: longrun {ours:.3f} s, torch new_group {theirs:.3f} s (x{theirs / ours:.2f}), "
        f"members only {local:.3f} s (x{local / ours:.2f}); slowest longrun rank: {breakdown[0]}")
    return {"world": world, "ours_s": round(ours, 4), "baseline": BASELINES["default"],
            "torch_default_s": round(theirs, 4), "ratio": round(theirs / ours, 3),
            "local": {"baseline": BASELINES["local"], "torch_s": round(local, 4),
                      "ratio": round(local / ours, 3)},
            "reps": reps, "ours_breakdown": breakdown[0]}


def measure_reform(world: int, url: str, reps: int) -> dict:
    runs = [reform_once(world, url, rep) for rep in range(reps)]
    ours = statistics.median(r[0] for r in runs)
    respawn = statistics.median(r[1] for r in runs)
    one = statistics.median(spawn_importing(1) for _ in range(reps))
    everyone = statistics.median(spawn_importing(world) for _ in range(reps))
    # On hosts with a core per process the world imports as fast as one process does.
    respawn_parallel = respawn - everyone + one
    log(f"reform world {world} (median of {reps}): longrun {ours:.2f} s, kill-all + respawn {respawn:.2f} s "
        f"(x{respawn / ours:.1f}); runs {[(round(a, 2), round(b, 2)) for a, b in runs]}; spawning "
        f"and importing: one process {one:.2f} s, {world} at once {everyone:.2f} s, so the respawn "
        f"with parallel imports {respawn_parallel:.2f} s (x{respawn_parallel / ours:.1f})")
    return {"world": world, "ours_s": round(ours, 3),
            "baseline": f"kill every process, respawn, TCPStore + {BASELINES['default']}",
            "respawn_s": round(respawn, 3), "speedup": round(respawn / ours, 2), "reps": reps,
            "import_one_s": round(one, 3), "import_world_s": round(everyone, 3),
            "respawn_parallel_import_s": round(respawn_parallel, 3),
            "speedup_parallel_import": round(respawn_parallel / ours, 2)}


def import_worker(rank, world, init_file, results):
    import torch.distributed  # noqa: F401  what a respawned rank imports before its groups

    import longrun.commgroup  # noqa: F401

    results.put(time.time())


def spawn_importing(n: int) -> float:
    """Seconds from spawning `n` processes at once until every one has imported torch and
    longrun's commgroup."""
    start = time.time()
    with World(import_worker, n, timeout=600) as world:
        done = world.run()
    return max(done) - start


def reform_once(world: int, url: str, rep: int) -> tuple[float, float]:
    return reform_in_place(world, url, rep), reform_by_respawn(world)


def reform_in_place(world: int, url: str, rep: int) -> float:
    """longrun: survivors re-form in place, one replacement is spawned at the decision."""
    from longrun.commgroup.store import RedisStore

    victim = world // 2 + 1
    job = f"reform{world}-{rep}"
    control = RedisStore(url, f"control:{job}:")
    with World(reform_worker, world, args=(url, 0, job), timeout=600) as ranks:
        ranks.start()
        ranks.collect(world)  # every rank formed attempt 0
        ranks.kill(victim)
        decision = time.time()
        control.set("go", b"1")
        ranks.start([victim], args=(url, 1, job))
        done = ranks.collect(world)
        ranks.join()
    return max(t for *_, t in done) - decision


def reform_by_respawn(world: int) -> float:
    """The default path: kill every process, respawn the world, TCPStore + every group again."""
    with World(respawn_worker, world, args=(listen_port(), True), timeout=600) as running:
        running.start()
        running.collect(world)  # the job is up
        running.kill_all()
        decision = time.time()
    with World(respawn_worker, world, args=(listen_port(), False), timeout=600) as respawned:
        done = respawned.run()
    return max(t for *_, t in done) - decision


def main() -> None:
    cli = parser(__doc__)
    cli.add_argument("--quick", action="store_true", help="world 8 only, store 1,024 ranks")
    cli.add_argument("--reps", type=int, default=None, help="fresh bring-up repeats (median reported)")
    cli.add_argument("--only", choices=("fresh", "reform", "store", "reform-store"), action="append",
                     help="run only these measurements (repeatable); default: all four")
    cli.add_argument("--store-ranks", default=None,
                     help="simulated ranks of store and reform-store, comma-separated "
                          "(default 1024,4096,16384; --quick: 1024)")
    cli.add_argument("--reform-reps", type=int, default=None,
                     help="re-formation repeats, median reported (default 3; --quick: 1)")
    cli.add_argument("--store-reps", type=int, default=None,
                     help="repeats of each store measurement, median reported (default 3; --quick: 1)")
    args = cli.parse_args()
    worlds = [8] if args.quick else [8, 16, 32]
    reform_world = 8 if args.quick else 16
    store_ranks = [1024] if args.quick else [1024, 4096, 16384]
    if args.store_ranks:
        store_ranks = [int(n) for n in args.store_ranks.split(",")]
    store_reps = args.store_reps or (1 if args.quick else 3)
    reps = args.reps or (2 if args.quick else 3)

    from longrun.services import EmbeddedRedis

    with EmbeddedRedis() as server:
        server.client().config_set("maxclients", 10000)
        only = set(args.only or ("fresh", "reform", "store", "reform-store"))
        fresh = [measure_fresh(w, reps, server.url) for w in worlds] if "fresh" in only else []
        reform_reps = args.reform_reps or (1 if args.quick else 3)
        reform = measure_reform(reform_world, server.url, reform_reps) if "reform" in only else None
        store = [measure_store(n, server.url, store_reps) for n in store_ranks] if "store" in only else []
        reform_store = ([measure_reform_store(n, server.url, store_reps) for n in store_ranks]
                        if "reform-store" in only else [])
    print_table(fresh, reform, store, reform_store)
    print(json.dumps({"torch_dist_init_barrier": os.environ.get("TORCH_DIST_INIT_BARRIER", "0"),
                      "reform": reform, "fresh": fresh[-1] if fresh else None,
                      "store": store[-1] if store else None,
                      "reform_store": reform_store[-1] if reform_store else None,
                      "fresh_all": fresh, "store_all": store, "reform_store_all": reform_store}))


def print_table(fresh: list[dict], reform: dict | None, store: list[dict], reform_store: list[dict]) -> None:
    print(f"{'measurement':<36}{'longrun':>12}{'baseline':>12}{'ratio':>8}")

    def row(label: str, ours: float, theirs: float, ratio: float, digits: int = 3) -> None:
        print(f"{label:<36}{ours:>11.{digits}f}s{theirs:>11.{digits}f}s{ratio:>8.2f}")

    for f in fresh:
        row(f"fresh world {f['world']}, new_group", f["ours_s"], f["torch_default_s"], f["ratio"])
        row("  new_group, members only", f["ours_s"], f["local"]["torch_s"], f["local"]["ratio"])
    if reform:
        row(f"reform world {reform['world']}", reform["ours_s"], reform["respawn_s"], reform["speedup"], 2)
        row("  respawn importing in parallel", reform["ours_s"], reform["respawn_parallel_import_s"],
            reform["speedup_parallel_import"], 2)
    for s in store:
        row(f"store {s['ranks']} ranks, new_group", s["redis_s"], s["tcpstore_s"], s["ratio"], 2)
        for key, label in (("split_group", "split_group"), ("barrier_local", "new_group, local, barrier=1")):
            row(f"  {label}", s["redis_s"], s[key]["tcpstore_s"], s[key]["ratio"], 2)
        row("  same protocol on TCPStore", s["redis_s"], s["tcpstore_same_protocol_s"],
            s["ratio_same_protocol"], 2)
        row("  longrun + per-group ids, new_group", s["redis_with_group_ids_s"], s["tcpstore_s"],
            s["ratio_new_group_vs_ids"], 2)
    for s in reform_store:
        row(f"reform-store {s['ranks']} ranks, new_group", s["redis_s"], s["tcpstore_s"], s["ratio"], 2)
        row("  split_group", s["redis_s"], s["split_group"]["tcpstore_s"], s["split_group"]["ratio"], 2)


if __name__ == "__main__":
    main()
