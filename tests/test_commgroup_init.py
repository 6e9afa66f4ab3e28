"""World and group bring-up across real processes (gloo on CPU, RedisStore on a real Redis)."""

from __future__ import annotations

import time

import commgroup_workers as w
import pytest

from longrun import keys
from longrun.commgroup import RedisStore
from longrun.commgroup.store import delete_attempt_keys
from longrun.testing.worlds import World


def _world(target, *args) -> World:
    """Four ranks of `target(rank, 4, init_file, results, *args)`; none started yet."""
    return World(target, 4, args=args, timeout=120)


def test_world_of_four_every_group_proves_its_membership(redis_server, redis_client):
    with _world(w.form_and_check, redis_server.url, 0, 60) as world:
        world.start()
        out = sorted(world.collect(4))
        world.join()
    assert [r[1] for r in out] == ["ok"] * 4, out
    # tp/pp are size 1 here, so every kind and dynamic size was formed and checked (replicate:
    # the ranks holding the same weights, here the span itself; no shard group, nothing sharded).
    assert out[0][2] == sorted(["tp", "cp", "pp", "dp", "replicate", "dp_cp", "dcp1", "dcp2", "dcp4"])


def test_a_late_rank_is_waited_for(redis_server, redis_client):
    with _world(w.form_and_check, redis_server.url, 0, 60) as world:
        world.start(range(3))
        # Start the last rank only once the other three are verifiably waiting for it.
        arrived = [keys.store_prefix(w.JOB, 0) + f"k:arrive/{r}" for r in range(3)]
        deadline = time.monotonic() + 60
        while redis_client.exists(*arrived) != 3:
            assert time.monotonic() < deadline, "the first three ranks never checked in"
            time.sleep(0.02)  # polling Redis for the other processes' progress
        world.start([3])
        out = sorted(world.collect(4))
        world.join()
    assert [r[1] for r in out] == ["ok"] * 4, out


def test_a_rank_that_never_comes_is_named_within_the_timeout(redis_server, redis_client):
    start = time.monotonic()
    with _world(w.form_and_check, redis_server.url, 0, 3) as world:
        world.start([0, 1, 3])
        out = sorted(world.collect(3))
        world.join()
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
    with _world(w.form_and_check, redis_server.url, 1, 60) as world:
        world.start()
        out = sorted(world.collect(4))
        world.join()
    assert [r[1] for r in out] == ["ok"] * 4, out
    assert redis_client.keys(keys.attempt_prefix(w.JOB, 0) + "*")
    delete_attempt_keys(redis_client, w.JOB, 0)
    delete_attempt_keys(redis_client, w.JOB, 1)
    assert redis_client.keys(keys.job_prefix(w.JOB) + "*") == []


@pytest.mark.timeout(240)
def test_survivors_reform_in_place_with_a_replacement(redis_server, redis_client):
    with _world(w.train_until_failure_then_reform, redis_server.url) as world:
        world.start()
        training = world.collect(4)  # every rank is under way
        assert sorted(r[:2] for r in training) == [(r, "training") for r in range(4)], training
        world.kill(2)  # rank 2 dies mid-training
        world.start([2], target=w.join_as_replacement)
        out = sorted(world.collect(4, timeout=180))
        world.join()
    assert all(kind == "reformed" for _, kind, *_ in out), out
    assert all(total == 4 for _, _, total, _ in out)  # the re-formed world has all four ranks
    assert all(steps > 0 for rank, _, _, steps in out if rank != 2)  # they trained before the failure
