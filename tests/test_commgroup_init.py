"""World and group bring-up across real processes (gloo on CPU, RedisStore on a real Redis)."""

from __future__ import annotations

import time
from datetime import timedelta

import commgroup_workers as w
import pytest
import torch.distributed as dist

from longrun import keys
from longrun.commgroup import (
    LayoutMismatchError,
    NodeSpec,
    ParallelDims,
    RedisStore,
    init_parallel_groups,
    make_layout,
)
from longrun.commgroup.rendezvous import COMPLETE, count_in
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
        # Start the last rank only once the other three are verifiably waiting for it (each
        # counted in: the world's member set holds the ranks that came).
        arrived = keys.store_prefix(w.JOB, 0) + "m:world"
        deadline = time.monotonic() + 60
        while redis_client.scard(arrived) != 3:
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
    # A dead attempt 0 left a complete count-in behind, under another layout: read by the new
    # attempt, it would either refuse the ranks (layout) or let NCCL's barrier pass early.
    dead = RedisStore.for_attempt(redis_server.url, w.JOB, 0)
    for r in range(4):
        count_in(dead, r, 4, "ParallelDims(dp=4)")
    assert dead.check([COMPLETE])
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


def test_a_rank_started_with_another_layout_is_refused_before_torch_is_touched(redis_server, redis_client):
    # Rank 0 of attempt 5 counted in with the 2 x 2 layout; rank 1 comes with dp 4.
    count_in(RedisStore.for_attempt(redis_server.url, w.JOB, 5), 0, 4, repr(w.world4_layout().dims))
    other = make_layout([NodeSpec("node-a"), NodeSpec("node-b")], 2, ParallelDims(dp=4))
    start = time.monotonic()
    with pytest.raises(LayoutMismatchError, match=r"rank 1 was started with parallel layout .*dp=4"):
        init_parallel_groups(redis_server.url, job=w.JOB, attempt=5, rank=1, layout=other,
                             timeout=timedelta(seconds=60))
    assert time.monotonic() - start < 10  # at once, not after the 60 s timeout
    assert not dist.is_initialized()
