"""World and group bring-up across real processes (gloo on CPU, RedisStore on a real Redis)."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import time

import commgroup_workers as w
import pytest

from longrun import keys
from longrun.commgroup import RedisStore
from longrun.commgroup.store import delete_attempt_keys

ctx = mp.get_context("spawn")


def _collect(results, n, timeout=120):
    return sorted((results.get(timeout=timeout) for _ in range(n)), key=lambda r: r[0])


def _join(procs, timeout=60):
    for p in procs:
        p.join(timeout)
        assert p.exitcode is not None, "a worker hung"


def _start(target, ranks, *args):
    procs = [ctx.Process(target=target, args=(r, *args)) for r in ranks]
    for p in procs:
        p.start()
    return procs


def test_world_of_four_every_group_proves_its_membership(redis_server, redis_client):
    results = ctx.Queue()
    procs = _start(w.form_and_check, range(4), redis_server.url, 0, 60, results)
    out = _collect(results, 4)
    _join(procs)
    assert [r[1] for r in out] == ["ok"] * 4, out
    # tp/pp are size 1 here, so every kind and dynamic size was formed and checked.
    assert out[0][2] == sorted(["tp", "cp", "pp", "dp", "dp_cp", "dcp1", "dcp2", "dcp4"])


def test_a_late_rank_is_waited_for(redis_server, redis_client):
    results = ctx.Queue()
    early = _start(w.form_and_check, range(3), redis_server.url, 0, 60, results)
    # Start the last rank only once the other three are verifiably waiting for it.
    arrived = [keys.store_prefix(w.JOB, 0) + f"k:arrive/{r}" for r in range(3)]
    deadline = time.monotonic() + 60
    while redis_client.exists(*arrived) != 3:
        assert time.monotonic() < deadline, "the first three ranks never checked in"
        time.sleep(0.02)  # polling Redis for the other processes' progress
    late = _start(w.form_and_check, [3], redis_server.url, 0, 60, results)
    out = _collect(results, 4)
    _join(early + late)
    assert [r[1] for r in out] == ["ok"] * 4, out


def test_a_rank_that_never_comes_is_named_within_the_timeout(redis_server, redis_client):
    results = ctx.Queue()
    start = time.monotonic()
    procs = _start(w.form_and_check, [0, 1, 3], redis_server.url, 0, 3, results)
    out = _collect(results, 3)
    _join(procs)
    assert time.monotonic() - start < 60
    for rank, kind, message, missing in out:
        assert kind == "RendezvousError", (rank, kind, message)
        assert missing == [2] and "rank(s) [2] did not join within 3 s" in message


def test_a_new_attempt_ignores_a_dead_attempts_keys(redis_server, redis_client):
    # A dead attempt 0 left its rendezvous half done: three arrivals and an open gate.
    dead = RedisStore.for_attempt(redis_server.url, w.JOB, 0)
    for r in range(3):
        dead.set(f"arrive/{r}", b"1")
    dead.add("arrived", 3)
    dead.set("all_arrived", b"1")
    results = ctx.Queue()
    procs = _start(w.form_and_check, range(4), redis_server.url, 1, 60, results)
    out = _collect(results, 4)
    _join(procs)
    assert [r[1] for r in out] == ["ok"] * 4, out
    assert redis_client.keys(keys.attempt_prefix(w.JOB, 0) + "*")
    delete_attempt_keys(redis_client, w.JOB, 0)
    delete_attempt_keys(redis_client, w.JOB, 1)
    assert redis_client.keys(keys.job_prefix(w.JOB) + "*") == []


@pytest.mark.timeout(240)
def test_survivors_reform_in_place_with_a_replacement(redis_server, redis_client):
    results, pids = ctx.Queue(), ctx.Queue()
    procs = _start(w.train_until_failure_then_reform, range(4), redis_server.url, results, pids)
    by_rank = dict(pids.get(timeout=120) for _ in range(4))
    os.kill(by_rank[2], signal.SIGKILL)  # rank 2 dies mid-training
    procs[2].join(30)
    replacement = _start(w.join_as_replacement, [2], redis_server.url, results)
    out = _collect(results, 4, timeout=180)
    _join([p for i, p in enumerate(procs) if i != 2] + replacement)
    assert all(kind == "reformed" for _, kind, *_ in out), out
    assert all(total == 4 for _, _, total, _ in out)  # the re-formed world has all four ranks
    assert all(steps > 0 for rank, _, _, steps in out if rank != 2)  # they trained before the failure
