"""The `store` and `reform-store` measurements of bench/group_init.py (run that script; this
file is not a bench).

Simulated ranks (2 processes x 16 threads, each thread one store client serving its share of
the ranks one after another) issue the store traffic of world + group initialisation at
16,384-GPU scale on NCCL. Every kind includes torch's world init: rank 0 publishes the world's
NCCL id, every other rank reads it. What torch does per group, read from the installed
torch's distributed_c10d.py (2.13):

- `split_group`, and `new_group` once the world is bound to its device (`init_process_group(
  device_id=...)`): the group is an ncclCommSplit of the world's communicator; no store key.
- `new_group` on a world not bound to a device: each NCCL group bootstraps itself at its first
  collective (ProcessGroupNCCL's broadcastUniqueNCCLID: the group's rank 0 sets its id under
  the group's prefix, the other members get it). `use_local_synchronization=True` only names
  the group by a hash of its ranks and lets non-members skip the call: the same keys.
- After a group is created `_new_group_with_tag` runs `_store_based_barrier` only when
  TORCH_DIST_INIT_BARRIER=1 (the default is 0 since 2023): over the whole world's store by
  default, over the members (`add` 1, `add` 0 for the count, the last `set`s, the others
  `wait`) with use_local_synchronization=True. The whole-world variant costs world x groups
  round trips (counted in the result, `world_barrier_round_trips`, not simulated).

  redis               longrun's real code per simulated rank: `rendezvous.count_in` (one script:
                      the rank joins the attempt, its layout is checked), `rendezvous.await_world`
                      (one XREAD), and the world id. Its groups are split (no per-group keys).
  redis-ids           the same, plus per-group NCCL ids (for groups that are not split).
  tcpstore-split      torch's `split_group`: the world id only.
  tcpstore-new-group  torch's `new_group`, default or members only: per distinct group (the
                      world and single ranks excluded) the root sets its id, members get it.
  tcpstore-barrier    `new_group(use_local_synchronization=True)` with TORCH_DIST_INIT_BARRIER=1:
                      that plus each group's members counting in with `add` and waiting for
                      the last one's key (what this bench's earlier baseline measured).
  tcpstore-set        longrun's protocol on TCPStore through the Store API (`add` to count in, the
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


BASELINES = {  # kind -> the torch function whose store traffic it reproduces
    "tcpstore-split": "torch.distributed.split_group",
    "tcpstore-new-group": "torch.distributed.new_group (default or use_local_synchronization=True; "
                          "TORCH_DIST_INIT_BARRIER=0)",
    "tcpstore-barrier": "torch.distributed.new_group(use_local_synchronization=True) with "
                        "TORCH_DIST_INIT_BARRIER=1",
}
PER_GROUP = ("redis-ids", "tcpstore-new-group", "tcpstore-barrier")  # kinds with per-group keys


def sim_plan(ranks: int, mine: range, kind: str):
    """Per simulated rank: (rank, [(group id, members)]) of the groups whose keys it touches:
    the distinct member lists (not the world, not single ranks: what longrun's
    `groups.create_groups` forms, and one `new_group` call per list) for the per-group kinds,
    none for the others."""
    layout = sim_layout(ranks)
    plan = []
    for r in mine:
        named = [(f"{name}:{members[0]}", members) for name, members in layout.groups_of(r)]
        if kind in PER_GROUP:
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
                if kind == "tcpstore-barrier" and store.add(f"{gid}/in", 1) == len(members):
                    store.set(f"{gid}/done", b"1")

    def reads(store, chunk):
        for r, groups in chunk:
            if ours:
                rendezvous.await_world(store, TIMEOUT)
            elif kind == "tcpstore-set":
                store.wait([rendezvous.COMPLETE])
            if r != 0:
                store.get("world/uid")
            for gid, members in groups:
                if kind == "tcpstore-barrier":
                    store.add(f"{gid}/in", 0)  # _store_based_barrier reads the count, then waits
                    store.wait([f"{gid}/done"])
                if members[0] != r:  # the root set it
                    store.get(f"{gid}/uid")

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


def _world_groups(ranks: int) -> int:
    """Distinct groups of more than one rank and fewer than all, over the whole world."""
    lists = {tuple(m) for _name, groups in sim_layout(ranks).named_groups for m in groups}
    return sum(1 for m in lists if 1 < len(m) < ranks)


def _vs(ours: float, med: dict, kind: str) -> dict:
    theirs = med[kind]["wall_s"]
    return {"baseline": BASELINES[kind], "tcpstore_s": round(theirs, 3), "ratio": round(theirs / ours, 3),
            "groups_per_rank": med[kind]["groups_per_rank"]}


def measure_store(ranks: int, redis_url: str, reps: int = 1) -> dict:
    """longrun's group-set rendezvous on Redis vs torch's patterns on TCPStore (and the
    group-set protocol on TCPStore, and longrun with per-group ids), median of `reps` each,
    alternating the order. The headline `tcpstore_s` / `ratio` is torch's `new_group`."""
    from longrun.commgroup.store import RedisStore
    from longrun.services.redis_client import quick_client

    client = quick_client(redis_url)
    runs: dict[str, list[dict]] = {kind: [] for kind in (
        "redis", "tcpstore-new-group", "tcpstore-split", "tcpstore-barrier", "tcpstore-set", "redis-ids")}
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
    ours, ids = med["redis"]["wall_s"], med["redis-ids"]["wall_s"]
    same = med["tcpstore-set"]["wall_s"]
    rows = {kind: _vs(ours, med, kind) for kind in BASELINES}
    world_groups = _world_groups(ranks)
    log(f"store {ranks} simulated ranks: longrun on Redis {ours:.2f} s ({med['redis']['round_trips']} "
        f"round trips, server CPU {med['redis']['server_cpu_s']:.2f} s, clients' CPU "
        f"{med['redis']['client_cpu_s']:.2f} s); on TCPStore: "
        + "; ".join(f"{r['baseline']} {r['tcpstore_s']:.2f} s (x{r['ratio']:.2f})" for r in rows.values())
        + f"; longrun's protocol on TCPStore {same:.2f} s; longrun + per-group NCCL ids "
        f"({med['redis-ids']['groups_per_rank']} groups/rank) {ids:.2f} s (torch's new_group / that: "
        f"x{med['tcpstore-new-group']['wall_s'] / ids:.2f})")
    headline = rows["tcpstore-new-group"]
    return {"ranks": ranks, "baseline": headline["baseline"], "groups_per_rank": headline["groups_per_rank"],
            "redis_s": round(ours, 3), "tcpstore_s": headline["tcpstore_s"], "ratio": headline["ratio"],
            "split_group": rows["tcpstore-split"], "barrier_local": rows["tcpstore-barrier"],
            "world_groups": world_groups,
            # TORCH_DIST_INIT_BARRIER=1 without local synchronisation: every rank of the world
            # adds, reads the count and waits once per group (not simulated: world x groups).
            "world_barrier_round_trips": 3 * ranks * world_groups,
            "tcpstore_same_protocol_s": round(same, 3), "ratio_same_protocol": round(same / ours, 3),
            "redis_with_group_ids_s": round(ids, 3),
            "ratio_new_group_vs_ids": round(med["tcpstore-new-group"]["wall_s"] / ids, 3),
            "distinct_groups_per_rank": med["redis-ids"]["groups_per_rank"],
            "reps": reps, "where": {kind: _rounded(m) for kind, m in med.items()}}


def measure_reform_store(ranks: int, redis_url: str, reps: int = 1) -> dict:
    """The store side of re-forming every group under a new attempt after one rank died:
    deleting the dead attempt's keys, then every rank's count-in and await under the next;
    torch: a new TCPStore server (it lived in a rank) and every key again, for `new_group`
    (the headline `tcpstore_s`) and `split_group`."""
    from longrun import keys
    from longrun.commgroup.store import RedisStore
    from longrun.services.redis_client import quick_client

    client = quick_client(redis_url)
    job = f"{JOB}{ranks}"
    runs, deletes = [], []
    tcp: dict[str, list[dict]] = {"tcpstore-new-group": [], "tcpstore-split": []}
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
        for kind, rows in tcp.items():
            port = listen_port()
            server = _tcpstore_server(port)
            rows.append(run_sim(ranks, kind, port))
            del server
    rekey = _median_run(runs)
    delete_s = sorted(d for d, _ in deletes)[len(deletes) // 2]
    total = delete_s + rekey["wall_s"]
    med = {kind: _median_run(rows) for kind, rows in tcp.items()}
    theirs, split = med["tcpstore-new-group"]["wall_s"], med["tcpstore-split"]["wall_s"]
    log(f"reform-store {ranks} simulated ranks: delete the dead attempt's {deletes[0][1]} keys "
        f"{delete_s:.2f} s + re-key every group {rekey['wall_s']:.2f} s = {total:.2f} s; "
        f"TCPStore (new server): new_group {theirs:.2f} s, split_group {split:.2f} s")
    return {"ranks": ranks, "redis_s": round(total, 3), "delete_old_attempt_s": round(delete_s, 3),
            "old_attempt_keys": deletes[0][1], "rekey_s": round(rekey["wall_s"], 3),
            "baseline": BASELINES["tcpstore-new-group"],
            "tcpstore_s": round(theirs, 3), "ratio": round(theirs / total, 3),
            "split_group": {"baseline": BASELINES["tcpstore-split"], "tcpstore_s": round(split, 3),
                            "ratio": round(split / total, 3)},
            "reps": reps, "where": _rounded(rekey)}


def _median_run(rows: list[dict]) -> dict:
    return sorted(rows, key=lambda r: r["wall_s"])[len(rows) // 2]


def _rounded(row: dict) -> dict:
    return {k: round(v, 3) if isinstance(v, float) else v for k, v in row.items()}
