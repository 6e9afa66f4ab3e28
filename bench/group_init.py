"""Group bring-up: longrun (RedisStore + barrier-free groups) vs PyTorch's default path.

    unshare --net -- sh -c 'ip link set lo up && exec .venv/bin/python bench/group_init.py'
    unshare --net -- sh -c 'ip link set lo up && exec .venv/bin/python bench/group_init.py --quick'

Three measurements, each side by side in one run (gloo on CPU, spawned processes):
  fresh  - from "every process has imported torch" to "every group usable" (a first
           all-gather done on each), longrun vs TCPStore + `new_group` for every group by
           every rank in the same order. Both create the same de-duplicated group set
           (tp/cp/pp/dp/dp_cp + dynamic-CP power-of-two groups); the same processes run both
           paths, alternating which goes first.
  reform - one rank is SIGKILLed; from the failure decision to every group usable again:
           longrun's survivors abort their groups and re-form under a new attempt with one
           freshly spawned replacement, vs killing every process and respawning the world
           on the default path.
  store  - simulated ranks (2 processes x 16 threads, each thread a client) issuing the key
           pattern of world + group initialisation (per group the root publishes an id,
           members read it, count in, and wait for the group to be complete) through the
           same torch Store API, against RedisStore and TCPStore (libuv).
Progress goes to stderr; the last line on stdout is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import signal
import statistics
import sys
import threading
import time
from datetime import timedelta

TIMEOUT = timedelta(seconds=120)
LAYOUTS = {  # world -> (workers per node, dp, cp, tp, pp)
    8: (4, 2, 2, 2, 1),
    16: (4, 2, 2, 2, 2),
    32: (8, 4, 2, 2, 2),
}


def log(msg: str) -> None:
    print(f"[group_init] {msg}", file=sys.stderr, flush=True)


def make(world: int):
    from longrun.commgroup import NodeSpec, ParallelDims, make_layout

    per_node, dp, cp, tp, pp = LAYOUTS[world]
    nodes = [NodeSpec(f"node-{i:03d}") for i in range(world // per_node)]
    return make_layout(nodes, per_node, ParallelDims(dp=dp, cp=cp, tp=tp, pp=pp))


# --- the default path -------------------------------------------------------------------------


def default_bringup(layout, rank: int, port: int):
    """TCPStore on rank 0, then every rank creates every group in the same order."""
    import torch.distributed as dist

    from longrun.commgroup.init import _my_groups

    world = layout.world_size
    store = dist.TCPStore("127.0.0.1", port, world, rank == 0, TIMEOUT, wait_for_workers=False,
                          use_libuv=True)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=TIMEOUT)
    created = {tuple(range(world)): dist.group.WORLD}
    everything = [g for kind in ("tp", "cp", "pp", "dp", "dp_cp") for g in layout.groups[kind]]
    everything += [g for size in sorted(layout.dynamic_cp_groups) for g in layout.dynamic_cp_groups[size]]
    for g in everything:
        if tuple(g) not in created:
            created[tuple(g)] = dist.new_group(g, timeout=TIMEOUT)  # non-members must call too
    return {name: (created[tuple(members)], members) for name, members in _my_groups(layout, rank)}


def check_named(rank: int, named) -> None:
    import torch
    import torch.distributed as dist

    for name, (pg, members) in named.items():
        out = torch.empty(len(members), dtype=torch.int64)
        dist.all_gather_single(out, torch.tensor([rank]), group=pg)
        if out.tolist() != members:
            raise RuntimeError(f"{name}: {out.tolist()} != {members}")


# --- worker processes -------------------------------------------------------------------------


def fresh_worker(rank, world, url, ports, reps, barrier, results):
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


def reform_worker(rank, world, url, attempt, results, job):
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


def respawn_worker(rank, world, port, results, hold):
    layout = make(world)
    named = default_bringup(layout, rank, port)
    check_named(rank, named)
    results.put(("formed", rank, os.getpid(), time.time()))
    if hold:  # the running job: stays up until the harness kills it
        threading.Event().wait()


# --- measurements -----------------------------------------------------------------------------


def listen_port() -> int:
    """A free port below the ephemeral range. Ports picked now and bound later (the default
    path's TCPStore, one per repeat) must not be taken in between by the thousands of
    outgoing connections gloo opens, which draw from the ephemeral range."""
    import random
    import socket

    low = 20000
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low = min(low, int(f.read().split()[0]) - 2000)
    except OSError:
        pass
    for _ in range(1000):
        port = random.randrange(max(low - 8000, 1024), low)
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
        return port
    raise RuntimeError("no free port below the ephemeral range")


def measure_fresh(world: int, reps: int, url: str) -> dict:
    ctx = mp.get_context("spawn")
    barrier, results = ctx.Barrier(world), ctx.Queue()
    ports = [listen_port() for _ in range(reps + 1)]
    procs = [ctx.Process(target=fresh_worker, args=(r, world, url, ports, reps, barrier, results))
             for r in range(world)]
    for p in procs:
        p.start()
    rows = [results.get(timeout=600) for _ in range(world * (reps + 1) * 2)]
    for p in procs:
        p.join(60)
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

    ctx = mp.get_context("spawn")
    victim = world // 2 + 1

    from longrun.commgroup.store import RedisStore

    # longrun: survivors re-form in place, one replacement is spawned at the decision.
    results = ctx.Queue()
    job = f"reform{world}-{rep}"
    control = RedisStore(url, f"control:{job}:")
    procs = [ctx.Process(target=reform_worker, args=(r, world, url, 0, results, job)) for r in range(world)]
    for p in procs:
        p.start()
    formed = {r: pid for _, r, pid, _ in (results.get(timeout=600) for _ in range(world))}
    os.kill(formed[victim], signal.SIGKILL)
    decision = time.time()
    control.set("go", b"1")
    replacement = ctx.Process(target=reform_worker, args=(victim, world, url, 1, results, job))
    replacement.start()
    done = [results.get(timeout=600) for _ in range(world)]
    ours = max(t for *_, t in done) - decision
    for p in [*procs, replacement]:
        p.join(60)

    # default: kill everything, respawn the world, TCPStore + every group again.
    results = ctx.Queue()
    port = listen_port()
    procs = [ctx.Process(target=respawn_worker, args=(r, world, port, results, True)) for r in range(world)]
    for p in procs:
        p.start()
    [results.get(timeout=600) for _ in range(world)]
    for p in procs:
        os.kill(p.pid, signal.SIGKILL)
    decision = time.time()
    port = listen_port()
    procs = [ctx.Process(target=respawn_worker, args=(r, world, port, results, False)) for r in range(world)]
    for p in procs:
        p.start()
    done = [results.get(timeout=600) for _ in range(world)]
    respawn = max(t for *_, t in done) - decision
    for p in procs:
        p.join(60)
    return ours, respawn


def sim_plan(ranks: int, mine: range):
    """Per simulated rank: writes (phase 1) and reads (phase 2) of the init key pattern."""
    from longrun.commgroup import NodeSpec, ParallelDims, make_layout
    from longrun.commgroup.init import _my_groups

    dp = ranks // 32
    layout = make_layout([NodeSpec(f"n{i:05d}") for i in range(ranks // 8)], 8,
                         ParallelDims(dp=dp, cp=2, tp=8, pp=2))
    plan = []
    for r in mine:
        groups = [(f"{name}:{members[0]}", members) for name, members in _my_groups(layout, r)]
        plan.append((r, groups))
    return plan, len(plan[0][1])


def sim_worker(index, procs, threads, ranks, kind, address, start_barrier, phase_barrier, results):
    import torch.distributed as dist

    from longrun.commgroup.store import RedisStore

    per_proc = ranks // procs
    plan, n_groups = sim_plan(ranks, range(index * per_proc, (index + 1) * per_proc))
    chunks = [plan[t::threads] for t in range(threads)]

    def client():
        if kind.startswith("redis"):
            return RedisStore(address, f"sim:{ranks}:", TIMEOUT)
        return dist.TCPStore("127.0.0.1", address, None, False, TIMEOUT, wait_for_workers=False,
                             use_libuv=True)

    stores = [client() for _ in range(threads)]
    uid = os.urandom(128)  # the size of an NCCL unique id
    if kind == "redis-pipelined":
        writes_p, reads_p = _pipelined(uid)

    def writes(store, chunk):
        for r, groups in chunk:
            if r == 0:
                store.set("world/uid", uid)
            for name, members in groups:
                if members[0] == r:
                    store.set(f"{name}/uid", uid)
                if store.add(f"{name}/in", 1) == len(members):
                    store.set(f"{name}/done", b"1")

    def reads(store, chunk):
        for _r, groups in chunk:
            store.get("world/uid")
            for name, _members in groups:
                store.get(f"{name}/uid")
                store.wait([f"{name}/done"])

    def run(fn):
        ts = [threading.Thread(target=fn, args=(s, c)) for s, c in zip(stores, chunks, strict=True)]
        for t in ts:
            t.start()
        for t in ts:
            t.join()

    start_barrier.wait()
    start = time.time()
    run(writes_p if kind == "redis-pipelined" else writes)
    phase_barrier.wait()
    run(reads_p if kind == "redis-pipelined" else reads)
    results.put((index, start, time.time(), n_groups))


def _pipelined(uid: bytes, batch: int = 512):
    """The same server commands RedisStore.set/add/get/wait send (its Lua scripts, GET,
    EXISTS), issued in pipelines of `batch`: how a process multiplexing many simulated ranks
    keeps the Python client from being the bottleneck. Uses RedisStore's internals on purpose."""

    def flush(store, calls):
        pipe = store._client.pipeline(transaction=False)
        for fn in calls:
            fn(pipe)
        return pipe.execute()

    def write(store, script, key, value):
        """One RedisStore write (its Lua script on the value and signal keys), queued on a pipe."""
        return lambda pipe: script(keys=[store._k(key), store._s(key)], args=[value], client=pipe)

    def writes(store, chunk):
        calls, sizes = [], []
        for r, groups in chunk:
            if r == 0:
                calls.append(write(store, store._set, "world/uid", uid))
                sizes.append(None)
            for name, members in groups:
                if members[0] == r:
                    calls.append(write(store, store._set, f"{name}/uid", uid))
                    sizes.append(None)
                calls.append(write(store, store._add, f"{name}/in", 1))
                sizes.append((name, len(members)))
        done = []
        for i in range(0, len(calls), batch):
            out = flush(store, calls[i:i + batch])
            for size, value in zip(sizes[i:i + batch], out, strict=True):
                if size is not None and int(value) == size[1]:  # the last member counted in
                    done.append(write(store, store._set, f"{size[0]}/done", b"1"))
        for i in range(0, len(done), batch):
            flush(store, done[i:i + batch])

    def reads(store, chunk):
        names = []
        for _r, groups in chunk:
            names.append(("get", "world/uid"))
            for name, _members in groups:
                names += [("get", f"{name}/uid"), ("exists", f"{name}/done")]
        for i in range(0, len(names), batch):
            pipe = store._client.pipeline(transaction=False)
            for op, key in names[i:i + batch]:
                getattr(pipe, op)(store._k(key))
            if not all(pipe.execute()):
                raise RuntimeError("a simulated rank read a key that was never written")

    return writes, reads


def measure_store(ranks: int, redis_url: str) -> dict:
    import torch.distributed as dist

    from longrun.commgroup.store import RedisStore

    ctx = mp.get_context("spawn")
    procs_n, threads = 2, 16
    out = {"redis": float("nan")}
    # One-call-at-a-time RedisStore from 32 Python threads is bound by the Python client's
    # CPU on 2 cores (linear in ranks); it is measured up to 4,096 ranks and skipped above.
    kinds = ("redis", "redis-pipelined", "tcpstore") if ranks <= 4096 else ("redis-pipelined", "tcpstore")
    for kind in kinds:
        server = None
        if kind.startswith("redis"):
            address = redis_url
            RedisStore(redis_url, f"sim:{ranks}:").delete_namespace()
        else:
            address = listen_port()
            server = dist.TCPStore("127.0.0.1", address, None, True, TIMEOUT, wait_for_workers=False,
                                   use_libuv=True)
        start_b, phase_b, results = ctx.Barrier(procs_n), ctx.Barrier(procs_n), ctx.Queue()
        procs = [ctx.Process(target=sim_worker, args=(i, procs_n, threads, ranks, kind, address, start_b,
                                                      phase_b, results)) for i in range(procs_n)]
        for p in procs:
            p.start()
        rows = [results.get(timeout=1800) for _ in procs]
        for p in procs:
            p.join(60)
        out[kind] = max(r[2] for r in rows) - min(r[1] for r in rows)
        out["groups_per_rank"] = rows[0][3]
        del server
    log(f"store {ranks} simulated ranks x {out['groups_per_rank']} groups: RedisStore {out['redis']:.2f} s "
        f"(pipelined {out['redis-pipelined']:.2f} s), TCPStore {out['tcpstore']:.2f} s")
    return {"ranks": ranks, "groups_per_rank": out["groups_per_rank"],
            "redis_s": round(out["redis-pipelined"], 3),
            "redis_store_api_s": round(out["redis"], 3) if out["redis"] == out["redis"] else None,
            "tcpstore_s": round(out["tcpstore"], 3)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="world 8 only, store 1,024 ranks")
    parser.add_argument("--reps", type=int, default=None, help="fresh bring-up repeats (median reported)")
    parser.add_argument("--only", choices=("fresh", "reform", "store"), action="append",
                        help="run only these measurements (repeatable); default: all three")
    args = parser.parse_args()
    worlds = [8] if args.quick else [8, 16, 32]
    reform_world = 8 if args.quick else 16
    store_ranks = [1024] if args.quick else [1024, 4096, 16384]
    reps = args.reps or (2 if args.quick else 3)

    from longrun.services import EmbeddedRedis

    with EmbeddedRedis() as server:
        server.client().config_set("maxclients", 10000)
        only = set(args.only or ("fresh", "reform", "store"))
        fresh = [measure_fresh(w, reps, server.url) for w in worlds] if "fresh" in only else []
        reform_reps = 1 if args.quick else 3
        reform = measure_reform(reform_world, server.url, reform_reps) if "reform" in only else None
        store = [measure_store(n, server.url) for n in store_ranks] if "store" in only else []
    print(f"{'measurement':<28}{'longrun':>12}{'baseline':>12}{'ratio':>8}")
    for f in fresh:
        print(f"{'fresh world ' + str(f['world']):<28}{f['ours_s']:>11.3f}s{f['torch_default_s']:>11.3f}s"
              f"{f['ratio']:>8.2f}")
    if reform:
        label = f"reform world {reform['world']}"
        print(f"{label:<28}{reform['ours_s']:>11.2f}s{reform['respawn_s']:>11.2f}s{reform['speedup']:>8.2f}")
    for s in store:
        print(f"{'store ' + str(s['ranks']) + ' ranks (pipelined)':<28}{s['redis_s']:>11.2f}s"
              f"{s['tcpstore_s']:>11.2f}s{s['tcpstore_s'] / s['redis_s']:>8.2f}")
        if s["redis_store_api_s"] is not None:
            print(f"{'store ' + str(s['ranks']) + ' ranks (Store API)':<28}{s['redis_store_api_s']:>11.2f}s"
                  f"{s['tcpstore_s']:>11.2f}s{s['tcpstore_s'] / s['redis_store_api_s']:>8.2f}")
    print(json.dumps({"reform": reform, "fresh": fresh[-1] if fresh else None,
                      "store": store[-1] if store else None, "fresh_all": fresh, "store_all": store}))


if __name__ == "__main__":
    main()
