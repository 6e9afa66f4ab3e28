"""Group bring-up: longrun (RedisStore + barrier-free groups) vs PyTorch's default path.

    unshare --net -- sh -c 'ip link set lo up && exec .venv/bin/python bench/group_init.py'
    unshare --net -- sh -c 'ip link set lo up && exec .venv/bin/python bench/group_init.py --quick'
    unshare --net -- sh -c 'ip link set lo up && exec .venv/bin/python bench/group_init.py --only store'

Four measurements, each side by side in one run (gloo on CPU, spawned processes):
  fresh  - from "every process has imported torch" to "every group usable" (a first
           all-gather done on each), longrun vs TCPStore + `new_group` for every group by
           every rank in the same order. Both create the same de-duplicated group set
           (tp/cp/pp/dp/dp_cp + dynamic-CP power-of-two groups); the same processes run both
           paths, alternating which goes first.
  reform - one rank is SIGKILLed; from the failure decision to every group usable again:
           longrun's survivors abort their groups and re-form under a new attempt with one
           freshly spawned replacement, vs killing every process and respawning the world
           on the default path.
  store  - 1,024 / 4,096 / 16,384 simulated ranks (2 processes x 16 threads, each thread a
           client) issuing the store traffic of world + group initialisation: longrun's real
           count-in on Redis (one script, one XREAD per rank, nothing per group) vs torch's
           per-group pattern on TCPStore (libuv; per group the root publishes an id, members
           read it, count in, and wait for it to be complete); also longrun's protocol on
           TCPStore and longrun plus per-group NCCL ids; with where the time went (server
           CPU, commands, the client processes' CPU).
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


def default_bringup(layout, rank: int, port: int):
    """TCPStore on rank 0, then every rank creates every group in the same order."""
    import torch.distributed as dist

    world = layout.world_size
    store = dist.TCPStore("127.0.0.1", port, world, rank == 0, TIMEOUT, wait_for_workers=False,
                          use_libuv=True)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=TIMEOUT)
    created = {tuple(range(world)): dist.group.WORLD}
    # The group set longrun forms (tp/cp/pp/dp/dp_cp + dynamic-CP sizes), in its canonical order.
    everything = [g for _name, groups in layout.named_groups for g in groups]
    for g in everything:
        if tuple(g) not in created:
            created[tuple(g)] = dist.new_group(g, timeout=TIMEOUT)  # non-members must call too
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
    for rep in range(reps + 1):
        order = ("ours", "default") if rep % 2 == 0 else ("default", "ours")
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
                named = default_bringup(layout, rank, ports[rep])
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
    ports = [listen_port() for _ in range(reps + 1)]
    with World(fresh_worker, world, args=(url, ports, reps, barrier)) as ranks:
        rows = ranks.run(world * (reps + 1) * 2, timeout=3600)
    times = {"ours": [], "default": []}
    breakdown = []
    for path in times:
        for rep in range(1, reps + 1):
            mine = [r for r in rows if r[0] == path and r[1] == rep]
            times[path].append(max(r[4] for r in mine) - min(r[3] for r in mine))
            if path == "ours":
                breakdown.append(max(mine, key=lambda r: r[4] - r[3])[5].summary())
    ours, theirs = statistics.median(times["ours"]), statistics.median(times["default"])
    log(f"fresh world {world}: longrun {ours:.3f} s, torch default {theirs:.3f} s "
        f"(x{theirs / ours:.2f}); slowest longrun rank: {breakdown[0]}")
    return {"world": world, "ours_s": round(ours, 4), "torch_default_s": round(theirs, 4),
            "ratio": round(theirs / ours, 3), "reps": reps, "ours_breakdown": breakdown[0]}


def measure_reform(world: int, url: str, reps: int) -> dict:
    runs = [reform_once(world, url, rep) for rep in range(reps)]
    ours = statistics.median(r[0] for r in runs)
    respawn = statistics.median(r[1] for r in runs)
    log(f"reform world {world} (median of {reps}): longrun {ours:.2f} s, kill-all + respawn {respawn:.2f} s "
        f"(x{respawn / ours:.1f}); runs {[(round(a, 2), round(b, 2)) for a, b in runs]}")
    return {"world": world, "ours_s": round(ours, 3), "respawn_s": round(respawn, 3),
            "speedup": round(respawn / ours, 2), "reps": reps}


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
        reform_reps = 1 if args.quick else 3
        reform = measure_reform(reform_world, server.url, reform_reps) if "reform" in only else None
        store = [measure_store(n, server.url, store_reps) for n in store_ranks] if "store" in only else []
        reform_store = ([measure_reform_store(n, server.url, store_reps) for n in store_ranks]
                        if "reform-store" in only else [])
    print_table(fresh, reform, store, reform_store)
    print(json.dumps({"reform": reform, "fresh": fresh[-1] if fresh else None,
                      "store": store[-1] if store else None,
                      "reform_store": reform_store[-1] if reform_store else None,
                      "fresh_all": fresh, "store_all": store, "reform_store_all": reform_store}))


def print_table(fresh: list[dict], reform: dict | None, store: list[dict], reform_store: list[dict]) -> None:
    print(f"{'measurement':<28}{'longrun':>12}{'baseline':>12}{'ratio':>8}")
    for f in fresh:
        print(f"{'fresh world ' + str(f['world']):<28}{f['ours_s']:>11.3f}s{f['torch_default_s']:>11.3f}s"
              f"{f['ratio']:>8.2f}")
    if reform:
        label = f"reform world {reform['world']}"
        print(f"{label:<28}{reform['ours_s']:>11.2f}s{reform['respawn_s']:>11.2f}s{reform['speedup']:>8.2f}")
    for s in store:  # baseline: TCPStore with torch's per-group pattern
        print(f"{'store ' + str(s['ranks']) + ' ranks':<28}{s['redis_s']:>11.2f}s"
              f"{s['tcpstore_s']:>11.2f}s{s['ratio']:>8.2f}")
        print(f"{'  same protocol on TCPStore':<28}{s['redis_s']:>11.2f}s"
              f"{s['tcpstore_same_protocol_s']:>11.2f}s{s['ratio_same_protocol']:>8.2f}")
        print(f"{'  + per-group NCCL ids':<28}{s['redis_with_group_ids_s']:>11.2f}s"
              f"{s['tcpstore_s']:>11.2f}s{s['tcpstore_s'] / s['redis_with_group_ids_s']:>8.2f}")
    for s in reform_store:
        print(f"{'reform-store ' + str(s['ranks']) + ' ranks':<28}{s['redis_s']:>11.2f}s"
              f"{s['tcpstore_s']:>11.2f}s{s['ratio']:>8.2f}")


if __name__ == "__main__":
    main()
