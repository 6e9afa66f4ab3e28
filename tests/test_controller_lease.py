"""One controller per job name (controller/lease.py), on a real Redis: a second controller for
a live lease is refused with a sentence naming the holder and touches nothing of the running
job; a dead controller's lease (never renewed) is taken over once it expires; a lease Redis
lost is taken back by its holder; a finished controller gives its lease back. Attempt numbers
come from a counter in Redis: never handed out twice, whoever asks."""

from __future__ import annotations

import json
import time

import pytest
from controller_fakes import drive_to_running, finished, job, make_rig

from longrun import keys
from longrun.controller.controller import JobFailed, job_status
from longrun.controller.lease import ControllerLease, ControllerRunning
from longrun.controller.placement import PlacementImpossible
from longrun.controller.state import JobState
from longrun.controller.workers import RankEnded

TTL_S = 3.0  # short, so that expiry and renewal happen within a test; long beside a busy CI thread


def lease(redis_server, name: str) -> ControllerLease:
    return ControllerLease(redis_server.client(), name, ttl_s=TTL_S)


def wait_until(condition, what: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"never: {what}"
        time.sleep(0.05)  # polling Redis, which the lease itself only polls


def test_a_live_lease_refuses_a_second_controller_and_is_free_once_released(redis_server, redis_client):
    first = lease(redis_server, "lease-live")
    first.acquire()
    key = keys.job_controller_key("lease-live")
    held = redis_client.get(key)
    try:
        second = lease(redis_server, "lease-live")
        with pytest.raises(ControllerRunning, match=r"job 'lease-live' is already running: its controller on "
                           r".+ \(pid \d+, since .+\) holds the job's lease"):
            second.acquire()
        assert redis_client.get(key) == held  # the refused one changed nothing
    finally:
        first.release()
    assert redis_client.get(key) is None
    third = lease(redis_server, "lease-live")
    third.acquire()
    try:
        assert json.loads(redis_client.get(key))["id"] == json.loads(third.value)["id"]
    finally:
        third.release()


def test_a_dead_controllers_lease_is_taken_over_once_it_expires(redis_server, redis_client):
    key = keys.job_controller_key("lease-dead")
    # What a SIGKILLed controller leaves: its lease, never renewed again.
    redis_client.set(key, json.dumps({"id": "dead", "host": "h", "pid": 1, "since": 0}), px=int(TTL_S * 1000))
    taker = lease(redis_server, "lease-dead")
    taker.acquire()
    try:
        assert json.loads(redis_client.get(key))["id"] == json.loads(taker.value)["id"]
    finally:
        taker.release()


def test_a_lease_the_store_lost_is_taken_back_and_outlives_its_expiry(redis_server, redis_client):
    holder = lease(redis_server, "lease-lost")
    holder.acquire()
    key = keys.job_controller_key("lease-lost")
    try:
        redis_client.delete(key)  # a Redis restarted without it
        wait_until(lambda: redis_client.get(key) is not None, "the holder took its lease back")
        assert json.loads(redis_client.get(key))["id"] == json.loads(holder.value)["id"]
        # Renewed, not just set once: it is still there after two expiries.
        expired_by = time.monotonic() + 2 * TTL_S
        wait_until(lambda: time.monotonic() > expired_by, "two expiries", timeout=10 * TTL_S)
        assert redis_client.get(key) is not None
    finally:
        holder.release()


def test_a_second_controller_of_a_running_job_is_refused_and_touches_nothing(redis_server, redis_client):
    make, launcher, *_ = make_rig(redis_server.url)
    cfg = job("lease-controllers")
    first = make(cfg)
    drive_to_running(first)  # its attempt 0 trains
    held = lease(redis_server, cfg.job.name)  # the lease its run() holds
    held.acquire()
    try:
        before = job_status(redis_client, cfg.job.name, events=1000)
        with pytest.raises(JobFailed, match="job 'lease-controllers' is already running"):
            make(cfg).run()
        after = job_status(redis_client, cfg.job.name, events=1000)
        assert (after["state"], after["attempt"], after["events"]) == (before["state"], before["attempt"],
                                                                       before["events"])
        assert len(launcher.calls) == 1  # the second placed nothing
        # The first job finishes untouched.
        launcher.groups[0].script.append([finished(r) for r in range(4)])
        assert first.step() is JobState.SUCCEEDED
    finally:
        held.release()


def test_a_controller_holds_the_lease_while_it_runs_and_gives_it_back(redis_server, redis_client):
    make, launcher, *_ = make_rig(redis_server.url)
    cfg = job("lease-run")
    key = keys.job_controller_key(cfg.job.name)
    seen = []
    place = launcher.__class__.__call__

    def placing(self, *args, **kw):
        seen.append(redis_client.get(key))
        return place(self, *args, **kw)
    launcher.__class__ = type("Watching", (launcher.__class__,), {"__call__": placing})
    c = make(cfg)
    launcher.failures[0] = PlacementImpossible("the cluster has 1 node")
    with pytest.raises(JobFailed, match="the cluster has 1 node"):
        c.run()
    assert len(seen) == 1 and seen[0] is not None and json.loads(seen[0])["pid"] > 0
    assert redis_client.get(key) is None  # given back: a rerun need not wait out its expiry


def test_attempt_numbers_come_from_the_store_and_are_never_handed_out_twice(redis_server, redis_client):
    assert [keys.allocate_attempt(redis_client, "attempts") for _ in range(3)] == [0, 1, 2]
    assert keys.allocate_attempt(redis_client, "attempts", at_least=7) == 7  # a record ahead of it
    assert keys.allocate_attempt(redis_client, "attempts", at_least=2) == 8  # never back
    # The controller takes its numbers there: a rerun after a preempted attempt 8 runs 9, and a
    # restart in it 10, even with a number taken in between by someone else.
    make, launcher, *_ = make_rig(redis_server.url)
    cfg = job("attempts")
    redis_client.hset(keys.job_record_key(cfg.job.name), mapping={"state": "PREEMPTED", "attempt": 8})
    c = make(cfg)
    drive_to_running(c)
    assert c.attempt.number == 9
    assert keys.allocate_attempt(redis_client, "attempts") == 10
    launcher.groups[0].script.append([RankEnded(1, kind="dead", detail="rank 1 died")])
    assert c.step() is JobState.RECOVERING
    assert c.step() is JobState.PLACING and c.attempt.number == 11
    c.step()
    assert launcher.calls[-1]["attempt"] == 11
