"""One controller per job name (controller/lease.py), on a real Redis: a second controller for
a live lease is refused with a sentence naming the holder and touches nothing of the running
job; a dead controller's lease (never renewed) is taken over once it expires; a lease Redis
lost is taken back by its holder; a finished controller gives its lease back. A holder proven
dead on this machine (its pid gone, a zombie, or reused) is taken over at once; one on another
host or boot, or one that lives, is not. Attempt numbers come from a counter in Redis: never
handed out twice, whoever asks."""

from __future__ import annotations

import itertools
import json
import logging
import os
import signal
import subprocess
import sys
import time
from contextlib import contextmanager

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


def impatient_lease(redis_server, name: str) -> ControllerLease:
    """A lease whose every wait is over at once (its clock jumps past any deadline after its first
    reading): it takes a free or proven-dead holder's lease, and is refused any other."""
    return ControllerLease(redis_server.client(), name, ttl_s=TTL_S,
                           clock=itertools.chain([0.0], itertools.repeat(1e9)).__next__)


# A controller in a process of its own: it takes the lease, says so, and holds it until killed.
HOLDER = """
import sys
import redis
from longrun.controller.lease import ControllerLease
ControllerLease(redis.Redis.from_url(sys.argv[1]), sys.argv[2], ttl_s=float(sys.argv[3])).acquire()
print("acquired", flush=True)
sys.stdin.read()
"""


@contextmanager
def holder_process(redis_server, name: str, ttl_s: float):
    proc = subprocess.Popen([sys.executable, "-c", HOLDER, redis_server.url, name, str(ttl_s)],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline() == "acquired\n"
        yield proc
    finally:
        proc.kill()
        proc.wait()
        proc.stdin.close()
        proc.stdout.close()


def holder_value(**changes) -> str:
    """A lease value as a controller in this process writes it, with `changes`."""
    return json.dumps({**json.loads(ControllerLease(None, "value").value), **changes})


def is_ours(redis_client, key: str, taker: ControllerLease) -> bool:
    return json.loads(redis_client.get(key))["id"] == json.loads(taker.value)["id"]


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


@pytest.mark.parametrize("reaped", [True, False], ids=["reaped", "zombie"])
def test_a_controller_killed_on_this_machine_is_taken_over_without_waiting(redis_server, redis_client, caplog,
                                                                            reaped):
    key = keys.job_controller_key("lease-killed")
    with holder_process(redis_server, "lease-killed", ttl_s=60.0) as proc:
        held = json.loads(redis_client.get(key))
        proc.send_signal(signal.SIGKILL)
        if reaped:
            proc.wait()
        else:  # exited, and left unreaped by its parent (this test): a zombie is dead too
            os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOWAIT)
        assert redis_client.pttl(key) > 30_000  # far from expiring
        taker = impatient_lease(redis_server, "lease-killed")
        with caplog.at_level(logging.WARNING, logger="longrun.controller.lease"):
            taker.acquire()  # an impatient lease that waited would have been refused
        try:
            assert is_ours(redis_client, key, taker)
            said = [r.getMessage() for r in caplog.records if "is dead" in r.getMessage()]
            assert len(said) == 1 and f"(pid {held['pid']}," in said[0] and "without waiting" in said[0]
        finally:
            taker.release()


def test_a_live_controller_in_another_process_is_still_refused(redis_server, redis_client):
    key = keys.job_controller_key("lease-other-live")
    with holder_process(redis_server, "lease-other-live", ttl_s=TTL_S) as proc:
        held = redis_client.get(key)
        with pytest.raises(ControllerRunning, match=rf"its controller on .+ \(pid {proc.pid}, since"):
            lease(redis_server, "lease-other-live").acquire()
        assert redis_client.get(key) == held


@pytest.fixture(scope="module")
def dead_pid() -> int:
    """The pid of a process that ran on this machine and ended (reaped)."""
    proc = subprocess.Popen([sys.executable, "-c", ""])
    proc.wait()
    return proc.pid


def test_a_holder_whose_process_ended_is_taken_at_once(redis_server, redis_client, dead_pid):
    key = keys.job_controller_key("lease-ended")
    here = json.loads(holder_value())
    for ended in ({"pid": dead_pid},  # gone
                  {"started": here["started"] + 1}):  # this process's pid, taken after the holder's ended
        redis_client.set(key, holder_value(id="ended", **ended), px=60_000)
        taker = impatient_lease(redis_server, "lease-ended")
        taker.acquire()
        try:
            assert is_ours(redis_client, key, taker)
        finally:
            taker.release()


@pytest.mark.parametrize("changes", [
    {"host": "elsewhere"},
    {"boot_id": "another-boot"},
    {"boot_id": None},  # a holder that could not read its boot id
    {"pid_ns": "pid:[1]"},  # another container on this kernel: its pids are not ours to look up
    {"started": None},
], ids=["another-host", "another-boot", "no-boot-id", "another-pid-namespace", "no-start-time"])
def test_a_holder_whose_death_is_not_proven_here_is_waited_out(redis_server, redis_client, caplog,
                                                                dead_pid, changes):
    key = keys.job_controller_key("lease-unproven")
    unproven = holder_value(id="unproven", pid=dead_pid, **changes)
    redis_client.set(key, unproven, px=int(TTL_S * 1000))
    with pytest.raises(ControllerRunning):  # it would have waited
        impatient_lease(redis_server, "lease-unproven").acquire()
    assert redis_client.get(key).decode() == unproven
    taker = lease(redis_server, "lease-unproven")
    with caplog.at_level(logging.WARNING, logger="longrun.controller.lease"):
        taker.acquire()  # once it expired
    try:
        assert is_ours(redis_client, key, taker)
        assert not any("is dead" in r.getMessage() for r in caplog.records)
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
