"""The `store` and `reform-store` measurements of bench/group_init.py (run that script; this
file is not a bench).

Simulated ranks (2 processes x 16 threads, each thread one store client serving its share of
the ranks one after another) issue the store traffic of world + group initialisation at
16,384-GPU scale (NCCL with the world initialised eagerly: groups are split from the world's
communicator, so torch adds no per-group keys; torch's world init publishes one id that every
rank reads):

  redis          longrun's real code per simulated rank: `rendezvous.count_in` (one script:
                 the rank joins the attempt, its layout is checked), `rendezvous.await_world`
                 (one XREAD), and the world id (rank 0 sets it, every rank gets it).
  redis-ids      the same, plus what torch adds per group where groups are not split from the
                 world: the group's root sets its NCCL id, every member gets it (Store API).
  tcpstore       the per-group pattern torch's default path gives (the baseline the issue
                 measured): per group the root publishes an id, members read it, count in
                 (`add`) and wait for the group to be complete, on TCPStore (libuv).
  tcpstore-set   longrun's protocol on TCPStore through the Store API (`add` to count in, the
                 last rank `set`s the record, `wait` for it): store against store.

Phase 1 (every rank's writes) and phase 2 (every rank's reads) are separated by a barrier, as
the world's init separates them in a real rank; a thread serves many ranks, so a rank's read
never waits for a write queued behind it on the same thread. What the harness adds over real
ranks (each with its own process, core and connection) is 8,192 ranks' client work on one
process and its GIL; `where` in the result separates the server's CPU from the clients'.

`reform-store`: after a 16,384-rank attempt formed, one rank dies and every group re-forms under
the next attempt: the controller deletes the dead attempt's keys (its `_end_attempt`), then every
rank (16,383 survivors and one replacement) counts in under the new namespace.
"""

from __future__ import annotations

import os
import resource
import threading
import time
from datetime import timedelta

from _common import listen_port, logger

from longrun.testing.worlds import CONTEXT, World

TIMEOUT = timedelta(seconds=120)
JOB = "sim"
log = logger("group_init")


def sim_layout(ranks: int):
    from longrun.commgroup import NodeSpec, ParallelDims, make_layout

    return make_layout([NodeSpec(f"n{i:05d}") for i in range(ranks // 8)], 8,
                       ParallelDims(dp=ranks // 32, cp=2, tp=8, pp=2))


def sim_plan(ranks: int, mine: range, kind: str):
    """Per simulated rank: (rank, [(group id, members)]) of the groups whose keys it touches:
    every named group for the baseline (as the issue measured it), the distinct member lists
    longrun forms (`groups.create_groups`: not the world, not single ranks) for redis-ids,
    none for longrun's own protocol."""
    layout = sim_layout(ranks)
    plan = []
    for r in mine:
        named = [(f"{name}:{members[0]}", members) for name, members in layout.groups_of(r)]
        if kind == "tcpstore":
            plan.append((r, named))
        elif kind == "redis-ids":
            seen, distinct = {tuple(range(ranks))}, []
            for gid, members in named:
                if len(members) > 1 and tuple(members) not in seen:
                    seen.add(tuple(members))
                    distinct.append((gid, members))
            plan.append((r, distinct))
        else:
            plan.append((r, []))
    return plan, repr(layout.dims)


def _cpu_s() -> float:
    use = resource.getrusage(resource.RUSAGE_SELF)
    return use.ru_utime + use.ru_stime


def sim_worker(index, procs, init_file, results, threads, ranks, kind, address, attempt,
               start_barrier, phase_barrier):
    import torch.distributed as dist

    from longrun.commgroup import rendezvous
    from longrun.commgroup.store import RedisStore

    per_proc = ranks // procs
    plan, dims = sim_plan(ranks, range(index * per_proc, (index + 1) * per_proc), kind)
    chunks = [plan[t::threads] for t in range(threads)]
    ours = kind.startswith("redis")

    def client():
        if ours:
            return RedisStore.for_attempt(address, f"{JOB}{ranks}", attempt, TIMEOUT)
        return dist.TCPStore("127.0.0.1", address, None, False, TIMEOUT, wait_for_workers=False,
                             use_libuv=True)

    stores = [client() for _ in range(threads)]
    if ours:
        for s in stores:
            s.check(["warm"])  # open each thread's lean connection before the clock starts
    uid = os.urandom(128)  # the size of an NCCL unique id

    def writes(store, chunk):
        for r, groups in chunk:
            if ours:
                rendezvous.count_in(store, r, ranks, dims)
            elif kind == "tcpstore-set" and store.add("world/in", 1) == ranks:
                store.set(rendezvous.COMPLETE, b"1")
            if r == 0:
                store.set("world/uid", uid)  # torch's world init: rank 0's id
            for gid, members in groups:
                if members[0] == r:
                    store.set(f"{gid}/uid", uid)
                if kind == "tcpstore" and store.add(f"{gid}/in", 1) == len(members):
                    store.set(f"{gid}/done", b"1")

    def reads(store, chunk):
        for _r, groups in chunk:
            if ours:
                rendezvous.await_world(store, TIMEOUT)
            elif kind == "tcpstore-set":
                store.wait([rendezvous.COMPLETE])
            store.get("world/uid")
            for gid, _members in groups:
                store.get(f"{gid}/uid")
                if kind == "tcpstore":
                    store.wait([f"{gid}/done"])

    def run(fn):
        ts = [threading.Thread(target=fn, args=(s, c)) for s, c in zip(stores, chunks, strict=True)]
        for t in ts:
            t.start()
        for t in ts:
            t.join()

    start_barrier.wait()
    start, cpu = time.time(), _cpu_s()
    run(writes)
    mid, mid_cpu = time.time(), _cpu_s()
    phase_barrier.wait()
    after_barrier = time.time()
    run(reads)
    end = time.time()
    groups = len(plan[0][1])
    results.put({"index": index, "start": start, "end": end, "groups": groups,
                 "writes_s": mid - start, "reads_s": end - after_barrier,
                 "cpu_s": _cpu_s() - cpu, "writes_cpu_s": mid_cpu - cpu})
    for s in stores:
        if ours:
            s.close()


def _redis_stats(client) -> tuple[float, dict[str, tuple[int, int]]]:
    """(server CPU seconds so far, {command: (calls, microseconds)})."""
    cpu = client.info("cpu")
    stats = client.info("commandstats")
    return (cpu["used_cpu_user"] + cpu["used_cpu_sys"],
            {k.removeprefix("cmdstat_"): (v["calls"], v["usec"]) for k, v in stats.items()})


def _delta(before, after) -> dict:
    cpu = after[0] - before[0]
    commands = {}
    for name, (calls, usec) in after[1].items():
        c0, u0 = before[1].get(name, (0, 0))
        if calls - c0:
            commands[name] = {"calls": calls - c0, "server_s": round((usec - u0) / 1e6, 3)}
    # Round trips are the clients' commands; SADD, SCARD, SET and XADD run inside the scripts
    # (commandstats counts both), connection set-up and this harness's INFO are left out.
    trips = sum(commands.get(c, {"calls": 0})["calls"] for c in ("evalsha", "xread", "exists", "mget"))
    return {"server_cpu_s": round(cpu, 3), "round_trips": trips, "commands": commands}


def run_sim(ranks: int, kind: str, address, attempt: int = 0, threads: int = 16, procs: int = 2,
            redis_client=None) -> dict:
    """One simulated bring-up of `kind`: wall seconds, phases and where the CPU went."""
    start_b, phase_b = CONTEXT.Barrier(procs), CONTEXT.Barrier(procs)
    before = _redis_stats(redis_client) if redis_client is not None else None
    parent_cpu = _cpu_s()
    with World(sim_worker, procs, args=(threads, ranks, kind, address, attempt, start_b, phase_b)) as world:
        rows = world.run(timeout=1800)
    out = {"wall_s": max(r["end"] for r in rows) - min(r["start"] for r in rows),
           "groups_per_rank": rows[0]["groups"],
           "writes_s": max(r["writes_s"] for r in rows), "reads_s": max(r["reads_s"] for r in rows),
           "client_cpu_s": round(sum(r["cpu_s"] for r in rows), 3)}
    if before is not None:
        out.update(_delta(before, _redis_stats(redis_client)))
    else:  # TCPStore's server is a libuv thread of this (otherwise idle) process
        out["server_cpu_s"] = round(_cpu_s() - parent_cpu, 3)
    return out


def _tcpstore_server(port: int):
    import torch.distributed as dist

    return dist.TCPStore("127.0.0.1", port, None, True, TIMEOUT, wait_for_workers=False, use_libuv=True)


def measure_store(ranks: int, redis_url: str, reps: int = 1) -> dict:
    """longrun's group-set rendezvous on Redis vs the per-group pattern on TCPStore (and the
    group-set protocol on TCPStore), median of `reps` each, alternating the order."""
    from longrun.commgroup.store import RedisStore
    from longrun.services.redis_client import quick_client

    client = quick_client(redis_url)
    runs: dict[str, list[dict]] = {"redis": [], "tcpstore": [], "tcpstore-set": [], "redis-ids": []}
    for rep in range(reps):
        order = list(runs) if rep % 2 == 0 else list(reversed(runs))
        for kind in order:
            if kind.startswith("redis"):
                RedisStore.for_attempt(redis_url, f"{JOB}{ranks}", 0).delete_namespace()
                runs[kind].append(run_sim(ranks, kind, redis_url, redis_client=client))
            else:
                port = listen_port()
                server = _tcpstore_server(port)
                runs[kind].append(run_sim(ranks, kind, port))
                del server
    RedisStore.for_attempt(redis_url, f"{JOB}{ranks}", 0).delete_namespace()
    med = {kind: _median_run(rs) for kind, rs in runs.items()}
    ours, theirs = med["redis"]["wall_s"], med["tcpstore"]["wall_s"]
    same, ids = med["tcpstore-set"]["wall_s"], med["redis-ids"]["wall_s"]
    log(f"store {ranks} simulated ranks: longrun on Redis {ours:.2f} s ({med['redis']['round_trips']} "
        f"round trips, server CPU {med['redis']['server_cpu_s']:.2f} s, clients' CPU "
        f"{med['redis']['client_cpu_s']:.2f} s); TCPStore per-group pattern {theirs:.2f} s "
        f"({med['tcpstore']['groups_per_rank']} groups/rank); longrun's protocol on TCPStore {same:.2f} s; "
        f"longrun + per-group NCCL ids ({med['redis-ids']['groups_per_rank']} groups/rank) {ids:.2f} s")
    return {"ranks": ranks, "groups_per_rank": med["tcpstore"]["groups_per_rank"],
            "redis_s": round(ours, 3), "tcpstore_s": round(theirs, 3), "ratio": round(theirs / ours, 3),
            "tcpstore_same_protocol_s": round(same, 3), "ratio_same_protocol": round(same / ours, 3),
            "redis_with_group_ids_s": round(ids, 3),
            "distinct_groups_per_rank": med["redis-ids"]["groups_per_rank"],
            "reps": reps, "where": {kind: _rounded(m) for kind, m in med.items()}}


def measure_reform_store(ranks: int, redis_url: str, reps: int = 1) -> dict:
    """The store side of re-forming every group under a new attempt after one rank died:
    deleting the dead attempt's keys, then every rank's count-in and await under the next."""
    from longrun import keys
    from longrun.commgroup.store import RedisStore
    from longrun.services.redis_client import quick_client

    client = quick_client(redis_url)
    job = f"{JOB}{ranks}"
    runs, deletes, tcp = [], [], []
    for rep in range(reps):
        base = 10 * rep
        RedisStore.for_attempt(redis_url, job, base).delete_namespace()
        run_sim(ranks, "redis", redis_url, attempt=base)  # the attempt that then loses a rank
        start = time.perf_counter()
        removed = keys.delete_attempt_keys(client, job, base)  # the controller's _end_attempt
        deletes.append((time.perf_counter() - start, removed))
        runs.append(run_sim(ranks, "redis", redis_url, attempt=base + 1, redis_client=client))
        if client.keys(keys.attempt_prefix(job, base) + "*"):
            raise RuntimeError("the dead attempt's keys survived its end")
        keys.delete_attempt_keys(client, job, base + 1)
        # TCPStore lived in a rank (rank 0, or the dead one): a new server, every key again.
        port = listen_port()
        server = _tcpstore_server(port)
        tcp.append(run_sim(ranks, "tcpstore", port))
        del server
    rekey = _median_run(runs)
    delete_s = sorted(d for d, _ in deletes)[len(deletes) // 2]
    total = delete_s + rekey["wall_s"]
    theirs = _median_run(tcp)["wall_s"]
    log(f"reform-store {ranks} simulated ranks: delete the dead attempt's {deletes[0][1]} keys "
        f"{delete_s:.2f} s + re-key every group {rekey['wall_s']:.2f} s = {total:.2f} s; "
        f"TCPStore (new server, per-group pattern) {theirs:.2f} s")
    return {"ranks": ranks, "redis_s": round(total, 3), "delete_old_attempt_s": round(delete_s, 3),
            "old_attempt_keys": deletes[0][1], "rekey_s": round(rekey["wall_s"], 3),
            "tcpstore_s": round(theirs, 3), "ratio": round(theirs / total, 3), "reps": reps,
            "where": _rounded(rekey)}


def _median_run(rows: list[dict]) -> dict:
    return sorted(rows, key=lambda r: r["wall_s"])[len(rows) // 2]


def _rounded(row: dict) -> dict:
    return {k: round(v, 3) if isinstance(v, float) else v for k, v in row.items()}
