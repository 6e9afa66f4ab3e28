"""The step ledger against a real Redis: what the workers write, what the controller reads, a
Redis that stops answering mid-run, and the job-wide summary a continuing controller takes over."""

from __future__ import annotations

import json
import os
import signal

import pytest

from longrun import keys
from longrun.goodput.accounting import GoodputAccount, Restore
from longrun.goodput.ledger import TIMEOUT_S, LedgerReader, StepLedger, step_ledger_client
from longrun.goodput.summary import read_summary
from longrun.goodput.tracker import GoodputTracker
from longrun.kinds import JobState as S
from longrun.services import EmbeddedRedis


class Clock:
    def __init__(self, now: float = 1000.0):
        self.now = now

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> float:
        self.now += seconds
        return self.now


def test_every_rank_records_its_last_step_and_the_lowest_one_every_step(redis_server, redis_client):
    clock = Clock()
    ranks = [StepLedger(step_ledger_client(redis_server.url), "led", 3, rank, clock=clock)
             for rank in range(2)]
    for ledger in ranks:
        ledger.restored(7, "memory", 0.25) if ledger.rank == 0 else ledger.restored(None, "none", 0.25)
    for step in (8, 9):
        clock.advance(1.0)
        for ledger in ranks:
            ledger.step(step, checkpoint_s=0.5 if step == 9 else 0.0, data_s=0.1)
    read = LedgerReader("led").read(redis_client, 3, done=True)
    assert [(r.step, r.end, r.seconds, r.checkpoint_s, r.data_s) for r in read.steps] == [
        (8, 1001.0, 1.0, 0.0, 0.1), (9, 1002.0, 1.0, 0.5, 0.1)]  # rank 0's only
    assert read.restored == {0: Restore(7, "memory", 0.25, 1000.0), 1: Restore(None, "none", 0.25, 1000.0)}
    assert read.done == {0: 9, 1: 9} and read.last_done == 9
    # The reader consumes what it read: the list does not grow for a week.
    assert redis_client.llen(keys.ledger_steps_key("led", 3)) == 0
    assert LedgerReader("led").read(redis_client, 3).steps == []
    # Everything is the attempt's: deleted with it.
    keys.delete_attempt_keys(redis_client, "led", 3)
    assert not redis_client.keys("longrun:led:*")


@pytest.fixture
def own_redis():
    """A Redis this test may freeze without stalling the module's."""
    with EmbeddedRedis() as server:
        yield server


def test_a_redis_that_stops_answering_neither_fails_nor_stalls_training(own_redis):
    clock, monotonic = Clock(), Clock(0.0)
    ledger = StepLedger(step_ledger_client(own_redis.url), "blip", 0, 0, clock=clock, monotonic=monotonic,
                        max_pending=4)
    ledger.restored(None, "none", 0.0)
    clock.advance(1.0)
    ledger.step(1)
    assert ledger.unsent == 0
    # A step waits at most one try of the ledger's timeout: the client gives up after TIMEOUT_S
    # and never retries by itself (the ledger retries, on a later step).
    options = ledger.client.connection_pool.connection_kwargs
    assert options["socket_timeout"] == options["socket_connect_timeout"] == TIMEOUT_S
    assert ledger.client.get_retry().get_retries() == 0
    transactions = []  # every round trip the ledger tries is one transaction
    pipeline = ledger.client.pipeline
    ledger.client.pipeline = lambda *a, **kw: transactions.append(a) or pipeline(*a, **kw)
    os.kill(own_redis.process.pid, signal.SIGSTOP)
    try:
        clock.advance(1.0)
        ledger.step(2)  # one try, given up at the timeout; the record is kept
        assert len(transactions) == 1 and ledger.failures == 1 and ledger.unsent == 2
        for step in range(3, 8):  # within the retry pause: no Redis round trip at all
            clock.advance(1.0)
            ledger.step(step)
        assert len(transactions) == 1
        assert ledger.failures == 1 and ledger.dropped == 2  # a bounded buffer: 4 records kept
    finally:
        os.kill(own_redis.process.pid, signal.SIGCONT)
    monotonic.advance(60.0)  # past the retry pause
    clock.advance(1.0)
    ledger.step(8)
    assert ledger.unsent == 0 and len(transactions) == 2
    client = own_redis.client()
    read = LedgerReader("blip").read(client, 0, done=True)
    client.close()
    # Steps 2 to 4 fell off the buffer (Redis may have applied the write of step 2 whose reply
    # timed out, and then it is there), 5 to 8 went with step 8's write.
    steps = {r.step for r in read.steps}
    assert {1, 5, 6, 7, 8} <= steps <= {1, 2, 5, 6, 7, 8} and read.done == {0: 8} and ledger.dropped == 3
    # Each record's seconds run from the record before it on the rank, sent or not.
    assert {r.seconds for r in read.steps} == {1.0}
    account = GoodputAccount(1000.0)
    account.moved(S.RUNNING, 1000.0, attempt=0)
    account.steps(0, read.steps)
    assert account.buckets()["productive"] == pytest.approx(8.0)  # each step once; the dropped ones' time too


def test_the_tracker_reads_the_ledger_before_the_attempt_keys_go_and_persists_the_summary(redis_server,
                                                                                         redis_client):
    clock = Clock()
    tracker = GoodputTracker("trk", redis_client, redis_client, wall=clock)
    tracker.resume(None, None)
    workers = [StepLedger(redis_server.client(), "trk", 0, rank, clock=clock) for rank in range(2)]
    tracker.moved(S.PLACING, clock.advance(1.0), attempt=0, world_size=2)
    tracker.moved(S.RUNNING, clock.advance(1.0), attempt=0, world_size=2)
    clock.advance(1.0)
    for w in workers:
        w.restored(None, "storage", 0.5)
    for step in (1, 2, 3):
        clock.advance(1.0)
        for w in workers:
            w.step(step)
    tracker.poll(0)
    assert tracker.recovery(0) == (0, 0)
    assert read_summary(redis_client, "trk").buckets["productive"] == pytest.approx(3.0)
    clock.advance(0.5)
    workers[1].step(4)  # rank 1 finished step 4; rank 0 died before it could record it
    tracker.declared(clock.advance(1.0), "dead")
    tracker.ending(0)  # the controller's order: workers stopped, ledger read, then keys deleted
    keys.delete_attempt_keys(redis_client, "trk", 0)
    tracker.moved(S.RECOVERING, clock.advance(0.5), attempt=0, world_size=2, cause="dead")
    tracker.moved(S.PLACING, clock.advance(1.0), attempt=1, world_size=2)
    tracker.moved(S.RUNNING, clock.advance(1.0), attempt=1, world_size=2)
    workers = [StepLedger(redis_server.client(), "trk", 1, rank, clock=clock) for rank in range(2)]
    clock.advance(1.0)
    for w in workers:
        w.restored(2, "storage", 0.5)
    tracker.poll(1)
    assert tracker.recovery(1) == (2, 2)  # rank 1 had finished step 4; storage had step 2
    clock.advance(1.0)
    for w in workers:
        w.step(3)
    tracker.ending(1)
    tracker.moved(S.PREEMPTED, clock.advance(0.5), attempt=1, world_size=2)
    summary = read_summary(redis_client, "trk")
    assert summary.state == "PREEMPTED" and summary.wall_s == pytest.approx(clock.now - 1000.0)
    assert summary.buckets["redone"] == pytest.approx(1.0)  # step 3's first record; step 4 had none
    assert summary.faults == [{"attempt": 0, "kind": "dead", "declared_at": 1007.5, "last_step": 4,
                               "restored_step": 2, "steps_lost": 2, "restored_from": "storage"}]
    # A rerun of the preempted job continues the summary; one of a finished job starts fresh.
    again = GoodputTracker("trk", redis_client, redis_client, wall=clock)
    again.resume("PREEMPTED", 1)
    assert again.summary().buckets["redone"] == pytest.approx(1.0)
    assert [f["kind"] for f in again.summary().faults] == ["dead", "preempted"]
    fresh = GoodputTracker("trk", redis_client, redis_client, wall=clock)
    fresh.resume("SUCCEEDED", 1)
    assert read_summary(redis_client, "trk") is None and fresh.summary().wall_s == 0.0


def test_a_controller_that_dies_mid_attempt_is_taken_over_from_what_it_left_in_redis(redis_server,
                                                                                     redis_client):
    clock = Clock()
    first = GoodputTracker("died", redis_client, redis_client, wall=clock, window_steps=2)
    first.resume(None, None)
    workers = [StepLedger(redis_server.client(), "died", 0, rank, clock=clock) for rank in range(2)]
    first.moved(S.PLACING, clock.advance(1.0), attempt=0, world_size=2)
    first.moved(S.RUNNING, clock.advance(1.0), attempt=0, world_size=2)
    clock.advance(1.0)
    for w in workers:
        w.restored(None, "none", 0.0)  # startup 1000..1003
    for step in (1, 2, 3):  # 1003..1006
        clock.advance(1.0)
        for w in workers:
            w.step(step)
    first.poll(0)  # read and persisted at 1006; the detail beside it keeps the window (2 steps)
    detail = json.loads(redis_client.get(keys.job_goodput_detail_key("died")))
    assert [step for step, _ in detail["detail"]] == [2, 3] and detail["span"]["attempt"] == 0
    clock.advance(0.5)
    for step in (4, 5):  # 1006..1007.5..1008.5: the controller was SIGKILLed and never read these
        clock.advance(1.0)
        for w in workers:
            w.step(step)
    clock.advance(10.0)  # no controller until 1018.5
    second = GoodputTracker("died", redis_client, redis_client, wall=clock)
    second.resume("RUNNING", 0)
    taken_over = second.summary()
    assert_near(taken_over.buckets, productive=5.5, startup=3.0, controller_down=10.0)
    assert taken_over.wall_s == pytest.approx(18.5)
    assert taken_over.unaccounted_s == pytest.approx(0.0, abs=1e-6)
    keys.delete_attempts_before(redis_client, "died", 1)  # the controller's next move
    second.moved(S.PLACING, clock.advance(1.0), attempt=1, world_size=2)
    second.moved(S.RUNNING, clock.advance(1.0), attempt=1, world_size=2)
    workers = [StepLedger(redis_server.client(), "died", 1, rank, clock=clock) for rank in range(2)]
    clock.advance(1.0)
    for w in workers:
        w.restored(2, "storage", 0.5)
    second.poll(1)
    assert second.recovery(1) == (2, 3)  # step 5 was reached under the dead controller
    clock.advance(1.0)
    for w in workers:
        w.step(3)
    second.ending(1)
    second.moved(S.SUCCEEDED, clock.advance(0.5), attempt=1, world_size=2)
    summary = read_summary(redis_client, "died")
    # Steps 3 to 5 of attempt 0 (1 + 1.5 + 1 s) were trained again: redone, not productive twice.
    assert_near(summary.buckets, productive=2.0 + 1.0, redone=3.5, startup=3.0 + 2.5, restore_storage=0.5,
                controller_down=10.0, shutdown=0.5)
    assert summary.faults == [{"attempt": 0, "kind": "controller_lost", "declared_at": 1018.5, "last_step": 5,
                               "restored_step": 2, "steps_lost": 3, "restored_from": "storage"}]
    assert summary.wall_s == pytest.approx(clock.now - 1000.0)
    assert summary.unaccounted_s == pytest.approx(0.0, abs=1e-6)


def assert_near(got: dict[str, float], **want: float) -> None:
    assert {b: round(s, 6) for b, s in got.items() if s} == want, got


def test_the_clock_starts_when_the_run_was_launched_and_its_service_start_up_is_startup(redis_client):
    """`longrun run` starts Redis and Ray before its controller: the controller's clock starts at
    the launch, so those seconds are start-up and the wall time is the run's, not the
    controller's (the soak's own clock of the run agrees with it)."""
    clock = Clock()
    launched = clock.now
    clock.advance(4.0)  # Redis and Ray starting
    tracker = GoodputTracker("launched", redis_client, redis_client, wall=clock, started_at=launched)
    tracker.resume(None, None)
    tracker.moved(S.PLACING, clock.advance(1.0), attempt=0, world_size=1)
    summary = tracker.summary()
    assert summary.buckets["startup"] == pytest.approx(5.0)
    assert sum(summary.buckets.values()) == pytest.approx(5.0) and summary.origin == launched
    # Not given: the clock starts with the controller, as before.
    late = GoodputTracker("late", redis_client, redis_client, wall=clock)
    late.resume(None, None)
    clock.advance(2.0)
    assert sum(late.summary().buckets.values()) == pytest.approx(2.0)
