"""The `store` measurement of bench/group_init.py (run that script; this file is not a bench).

Simulated ranks (2 processes x 16 threads, each thread a client) issue the key pattern of world
+ group initialisation (per group the root publishes an id, members read it, count in, and wait
for the group to be complete) through the same torch Store API, against RedisStore and
TCPStore (libuv).
"""

from __future__ import annotations

import os
import threading
import time
from datetime import timedelta

from _common import listen_port, logger

from longrun.testing.worlds import CONTEXT, World

TIMEOUT = timedelta(seconds=120)
log = logger("group_init")


def sim_plan(ranks: int, mine: range):
    """Per simulated rank: writes (phase 1) and reads (phase 2) of the init key pattern."""
    from longrun.commgroup import NodeSpec, ParallelDims, make_layout

    dp = ranks // 32
    layout = make_layout([NodeSpec(f"n{i:05d}") for i in range(ranks // 8)], 8,
                         ParallelDims(dp=dp, cp=2, tp=8, pp=2))
    plan = []
    for r in mine:
        groups = [(f"{name}:{members[0]}", members) for name, members in layout.groups_of(r)]
        plan.append((r, groups))
    return plan, len(plan[0][1])


def sim_worker(index, procs, init_file, results, threads, ranks, kind, address, start_barrier,
               phase_barrier):
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
        start_b, phase_b = CONTEXT.Barrier(procs_n), CONTEXT.Barrier(procs_n)
        with World(sim_worker, procs_n, args=(threads, ranks, kind, address, start_b, phase_b)) as world:
            rows = world.run(timeout=1800)
        out[kind] = max(r[2] for r in rows) - min(r[1] for r in rows)
        out["groups_per_rank"] = rows[0][3]
        del server
    log(f"store {ranks} simulated ranks x {out['groups_per_rank']} groups: RedisStore {out['redis']:.2f} s "
        f"(pipelined {out['redis-pipelined']:.2f} s), TCPStore {out['tcpstore']:.2f} s")
    return {"ranks": ranks, "groups_per_rank": out["groups_per_rank"],
            "redis_s": round(out["redis-pipelined"], 3),
            "redis_store_api_s": round(out["redis"], 3) if out["redis"] == out["redis"] else None,
            "tcpstore_s": round(out["tcpstore"], 3)}
