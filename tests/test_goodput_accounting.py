"""Goodput accounting on hand-made timelines: every second of wall time in exactly one bucket."""

from __future__ import annotations

import pytest

from longrun.goodput.accounting import BUCKETS, Carried, GoodputAccount, Restore, Span, StepRecord
from longrun.goodput.summary import GoodputSummary, duration
from longrun.kinds import JobState as S


def records(first: int, last: int, start: float, each: float = 1.0, **parts: float) -> list[StepRecord]:
    """Steps first..last of `each` seconds, back to back from `start`."""
    return [StepRecord(step, start + (i + 1) * each, each, **parts)
            for i, step in enumerate(range(first, last + 1))]


def placed(account: GoodputAccount, at: float, attempt: int) -> None:
    """PLACING at `at`, RENDEZVOUS one second later, RUNNING half a second after that."""
    account.moved(S.PLACING, at, attempt=attempt)
    account.moved(S.RENDEZVOUS, at + 1.0, attempt=attempt)
    account.moved(S.RUNNING, at + 1.5, attempt=attempt)


def assert_buckets(got: dict[str, float], **want: float) -> None:
    assert set(got) == set(BUCKETS)
    for bucket in BUCKETS:
        assert got[bucket] == pytest.approx(want.get(bucket, 0.0), abs=1e-9), (bucket, got)


def test_a_fault_restored_from_memory_loses_the_step_another_rank_finished():
    a = GoodputAccount(0.0)
    placed(a, 1.0, 0)  # startup 0..2.5
    a.began(0, Restore(None, "none", 0.5, at=4.0))  # setup 2.5..4: startup (nothing restored)
    a.steps(0, records(1, 5, 4.0, data_s=0.1))  # 4..9: 5 steps, 0.1 s data wait each
    a.declared(11.0, "dead")
    a.attempt_ended(0, last_done=6)  # rank 1 finished step 6; rank 0's record of it never came
    a.moved(S.RECOVERING, 12.0, attempt=0, cause="dead")  # detection 9..11, backoff 11..12
    a.moved(S.PLACING, 15.0, attempt=1)  # backoff 12..15
    a.moved(S.RENDEZVOUS, 16.0, attempt=1)
    a.moved(S.RUNNING, 16.5, attempt=1)
    a.began(1, Restore(5, "memory", 1.0, at=18.5))  # startup 16.5..17.5, restore 17.5..18.5
    a.resumed(1, 5, "memory")
    a.steps(1, records(6, 8, 18.5, checkpoint_s=0.25))
    a.moved(S.SUCCEEDED, 22.0, attempt=1)  # shutdown 21.5..22
    b = a.buckets()
    assert_buckets(b, productive=5 * 0.9 + 3 * 0.75, startup=2.5 + 1.5 + 1.5 + 1.0, data_wait=0.5,
                   checkpoint=0.75, detection=2.0, backoff=4.0, restore_memory=1.0, shutdown=0.5)
    assert sum(b.values()) == pytest.approx(22.0)
    [fault] = a.faults
    assert (fault.attempt, fault.kind, fault.declared_at, fault.last_step) == (0, "dead", 11.0, 6)
    assert (fault.restored_step, fault.steps_lost, fault.restored_from) == (5, 1, "memory")
    assert a.goodput() == pytest.approx(b["productive"] / 22.0)


def test_a_restore_from_storage_moves_the_lost_steps_to_redone():
    a = GoodputAccount(0.0)
    placed(a, 0.0, 0)
    a.steps(0, records(1, 6, 2.0))  # no restore record read: training began at the first record's start
    a.attempt_ended(0, last_done=6)
    a.declared(9.0, "hang")
    a.moved(S.RECOVERING, 9.5, attempt=0, cause="hang")
    placed(a, 10.0, 1)
    a.began(1, Restore(2, "storage", 2.0, at=14.0))  # RUNNING from 11.5; restore 12..14
    a.resumed(1, 2, "storage")  # steps 3..6 of attempt 0 were lost
    a.steps(1, records(3, 6, 14.0))
    a.moved(S.SUCCEEDED, 18.0, attempt=1)
    b = a.buckets()
    assert_buckets(b, productive=2 + 4, redone=4, startup=1.5 + 0.5 + 1.5 + 0.5, detection=1.0, backoff=1.0,
                   restore_storage=2.0)
    assert sum(b.values()) == pytest.approx(18.0)
    assert (a.faults[0].last_step, a.faults[0].restored_step, a.faults[0].steps_lost) == (6, 2, 4)


def test_steps_trained_again_are_redone_even_when_the_restore_record_is_missing():
    a = GoodputAccount(0.0)
    placed(a, 0.0, 0)
    a.steps(0, records(1, 4, 2.0))
    a.attempt_ended(0, last_done=4)
    a.moved(S.RECOVERING, 6.0, attempt=0, cause="dead")
    placed(a, 6.0, 1)
    a.steps(1, records(3, 4, 8.0))  # steps 3 and 4 again: the first records of them were lost work
    a.moved(S.SUCCEEDED, 10.0, attempt=1)
    b = a.buckets()
    assert b["redone"] == pytest.approx(2.0) and b["productive"] == pytest.approx(4.0)
    assert sum(b.values()) == pytest.approx(10.0)


def test_a_restart_from_scratch_redoes_everything():
    a = GoodputAccount(0.0)
    placed(a, 0.0, 0)
    a.steps(0, records(1, 3, 2.0))
    a.attempt_ended(0, last_done=3)
    a.moved(S.RECOVERING, 5.0, attempt=0, cause="dead")
    placed(a, 5.0, 1)
    a.began(1, Restore(None, "none", 0.1, at=7.0))
    a.resumed(1, None, "none")
    assert a.buckets()["redone"] == pytest.approx(3.0) and a.buckets()["productive"] == 0.0
    assert a.faults[0].steps_lost == 3


def test_a_preemption_saves_and_a_rerun_continues_the_same_account():
    a = GoodputAccount(0.0)
    placed(a, 0.0, 0)
    a.steps(0, records(1, 3, 2.0))
    a.moved(S.PREEMPTING, 4.5, attempt=0)
    a.steps(0, records(4, 4, 5.0))  # the step they agreed to stop at: still productive
    a.attempt_ended(0, last_done=4)
    a.moved(S.PREEMPTED, 8.0, attempt=0)  # the save after step 4: 6..8
    first = a.buckets()
    assert_buckets(first, productive=4.0, startup=2.0, preemption_save=2.0)
    # The rerun: a new controller continues from what the first persisted.
    carried = Carried(first, [f.to_dict() for f in a.faults], a.frontier, ended="PREEMPTED", ended_at=8.0,
                      attempt=0)
    b = GoodputAccount(100.0, carried=carried)
    placed(b, 100.0, 1)
    b.began(1, Restore(4, "storage", 0.5, at=102.0))
    b.resumed(1, 4, "storage")
    b.steps(1, records(5, 6, 102.0))
    b.moved(S.SUCCEEDED, 104.0, attempt=1)
    total = b.buckets()
    assert sum(total.values()) == pytest.approx(8.0 + 4.0)  # the time between the runs is no one's
    assert total["productive"] == pytest.approx(6.0) and total["restore_storage"] == pytest.approx(0.5)
    [stop] = b.faults
    assert (stop.kind, stop.last_step, stop.restored_step, stop.steps_lost) == ("preempted", 4, 4, 0)
    # The clock agrees: 104 s since the first start, less the 92 s the job lay preempted.
    assert (b.origin, b.paused_s, b.wall(104.0)) == (0.0, 92.0, 12.0)


def carried_after_death(a: GoodputAccount, persisted_at: float, last_done: int,
                        unread: list[StepRecord]) -> Carried:
    """What a controller taking over finds after `a`'s controller died: the summary and detail
    it persisted at `persisted_at`, and the ledger records of its attempt it never read."""
    detail = a.carried_detail()
    return Carried(a.buckets(persisted_at), [f.to_dict() for f in a.faults], max(a.frontier, last_done),
                   ended="controller_lost", ended_at=persisted_at, attempt=0, origin=a.origin,
                   paused_s=a.paused_s, accounted_to=a.accounted_to(persisted_at),
                   detail=[tuple(d) for d in detail["detail"]],
                   span=Span.from_dict(detail["span"]) if detail["span"] else None, steps=unread)


def test_a_dead_controller_is_a_fault_its_downtime_a_bucket_and_an_older_restore_redoes_its_steps():
    a = GoodputAccount(0.0)
    placed(a, 0.0, 0)  # startup 0..1.5
    a.began(0, Restore(None, "none", 0.0, at=2.0))  # startup 1.5..2
    a.steps(0, records(1, 4, 2.0))  # 2..6, read and persisted at 6.5; then SIGKILL
    assert a.accounted_to(6.5) == 6.0  # the running attempt: up to its newest record
    # Its workers trained steps 5 and 6 (8.0) before Ray reaped them; the next controller starts at 20.
    b = GoodputAccount(20.0, carried=carried_after_death(a, 6.5, 6, records(5, 6, 6.0)))
    placed(b, 20.0, 1)  # startup 20..21.5
    b.began(1, Restore(2, "storage", 1.0, at=23.0))  # startup 21.5..22, restore 22..23
    b.resumed(1, 2, "storage")  # steps 3..6, trained under the dead controller, were lost
    b.steps(1, records(3, 6, 23.0))
    b.moved(S.SUCCEEDED, 27.5, attempt=1)  # shutdown 27..27.5
    total = b.buckets()
    assert_buckets(total, productive=2.0 + 4.0, redone=4.0, startup=2.0 + 2.0, restore_storage=1.0,
                   controller_down=20.0 - 8.0, shutdown=0.5)
    [death] = b.faults
    assert (death.attempt, death.kind, death.declared_at, death.last_step) == (0, "controller_lost", 20.0, 6)
    assert (death.restored_step, death.steps_lost, death.restored_from) == (2, 4, "storage")
    # The wall time is the clock's, from the first controller's start; the buckets fill it.
    assert b.wall(27.5) == 27.5 and sum(total.values()) == pytest.approx(b.accounted_to(27.5) - b.origin)
    assert b.goodput() == pytest.approx(6.0 / 27.5)


def test_a_controller_dead_outside_running_is_down_from_its_last_summary():
    a = GoodputAccount(100.0)
    placed(a, 100.0, 0)
    a.steps(0, records(1, 2, 102.0))
    a.attempt_ended(0, last_done=2)
    a.moved(S.RECOVERING, 105.0, attempt=0, cause="dead")  # detection 104..105
    # Persisted during the backoff at 106 (buckets up to then), then killed; a rerun at 130.
    b = GoodputAccount(130.0, carried=carried_after_death(a, 106.0, 2, []))
    total = b.buckets(130.0)
    assert total["controller_down"] == pytest.approx(24.0) and total["backoff"] == pytest.approx(1.0)
    assert sum(total.values()) == pytest.approx(b.wall(130.0)) == pytest.approx(30.0)
    assert [f.kind for f in b.faults] == ["dead", "controller_lost"]
    placed(b, 130.0, 1)
    b.began(1, Restore(1, "memory", 0.5, at=132.0))
    b.resumed(1, 1, "memory")  # both faults resolve at the one restore
    assert [(f.restored_step, f.steps_lost) for f in b.faults] == [(1, 1), (1, 1)]
    assert b.buckets()["redone"] == pytest.approx(1.0)  # step 2's time, carried in the detail


def test_an_elastic_job_waiting_for_nodes_and_growing_back():
    a = GoodputAccount(0.0)
    a.moved(S.PLACING, 1.0, attempt=0)
    a.waiting(3.0)
    assert a.buckets(now=7.0)["waiting_for_nodes"] == pytest.approx(4.0)  # provisional, while it waits
    a.moved(S.RENDEZVOUS, 9.0, attempt=0)
    a.moved(S.RUNNING, 9.5, attempt=0)
    a.steps(0, records(1, 2, 10.0))
    a.attempt_ended(0, last_done=2)
    a.moved(S.RECOVERING, 13.0, attempt=0, resize=True)  # a grow: save at step 2 and stop (12..13)
    a.moved(S.PLACING, 13.0, attempt=1)
    a.moved(S.RENDEZVOUS, 14.0, attempt=1)
    a.moved(S.RUNNING, 14.0, attempt=1)
    a.began(1, Restore(2, "storage", 1.0, at=16.0))
    a.resumed(1, 2, "storage")
    a.moved(S.STOPPED, 16.5, attempt=1)
    b = a.buckets()
    assert_buckets(b, productive=2.0, startup=1 + 2 + 0.5 + 0.5 + 1 + 1, waiting_for_nodes=6.0,
                   preemption_save=1.0, restore_storage=1.0, shutdown=0.5)
    assert sum(b.values()) == pytest.approx(16.5)
    assert not a.faults  # a resize is not a fault


def test_a_fault_before_training_began_is_detection_then_backoff():
    a = GoodputAccount(0.0)
    placed(a, 0.0, 0)  # RUNNING at 1.5; a worker dies while setting up
    a.declared(4.0, "dead")
    a.moved(S.RECOVERING, 5.0, attempt=0, cause="dead")
    assert_buckets(a.buckets(), startup=1.5, detection=2.5, backoff=1.0)
    assert a.faults[0].last_step == 0


def test_a_fault_the_policy_gives_up_on_ends_in_shutdown():
    a = GoodputAccount(0.0)
    placed(a, 0.0, 0)
    a.steps(0, records(1, 1, 2.0))
    a.declared(5.0, "fatal")
    a.moved(S.FAILED, 6.0, attempt=0, cause="fatal")
    assert_buckets(a.buckets(), startup=2.0, productive=1.0, detection=2.0, shutdown=1.0)
    assert a.faults[0].restored_step is None and a.faults[0].steps_lost is None


def test_repeated_records_count_once_and_a_skewed_clock_is_clipped():
    a = GoodputAccount(0.0)
    placed(a, 0.0, 0)
    a.steps(0, records(1, 3, 2.0))
    a.steps(0, records(2, 3, 3.0))  # sent twice after a lost reply
    a.steps(0, [StepRecord(4, 6.5, 1.5)])  # ends after the controller saw the job end
    a.moved(S.SUCCEEDED, 6.0, attempt=0)
    b = a.buckets()
    assert b["productive"] == pytest.approx(4.0) and sum(b.values()) == pytest.approx(6.0)


def test_per_step_detail_is_bounded_for_a_long_job():
    a = GoodputAccount(0.0, window_steps=3)
    placed(a, 0.0, 0)
    a.steps(0, records(1, 10_000, 2.0, each=0.01))
    assert len(a._detail) == 3  # a week-long job keeps sums, not every step
    a.attempt_ended(0, last_done=10_000)
    a.moved(S.RECOVERING, 102.0, attempt=0, cause="dead")
    placed(a, 102.0, 1)
    a.resumed(1, 9_990, "storage")  # older than the window: only the detail kept moves
    b = a.buckets()
    assert b["redone"] == pytest.approx(0.03)
    assert a.faults[0].steps_lost == 10  # steps lost come from step numbers, not the detail
    # A running attempt is accounted up to its newest step record (none yet: its start).
    assert sum(a.buckets(now=110.0).values()) == pytest.approx(103.5)


def test_the_fault_list_is_bounded():
    a = GoodputAccount(0.0, max_faults=5)
    t = 0.0
    for n in range(12):
        placed(a, t, n)
        a.moved(S.RECOVERING, t + 2.0, attempt=n, cause="dead")
        t += 2.0
    assert len(a.faults) == 5 and a.faults[-1].attempt == 11


def test_summary_describes_goodput_and_the_top_three_losses():
    spent = {"productive": 90.0, "redone": 4.0, "startup": 3.0, "detection": 2.0, "backoff": 1.0}
    s = GoodputSummary(buckets=dict.fromkeys(BUCKETS, 0.0) | spent,
                       faults=[{"steps_lost": 1}, {"steps_lost": 0}])
    assert s.goodput == pytest.approx(0.9) and s.wall_s == pytest.approx(100.0)
    assert s.top_losses() == [("redone", 4.0), ("startup", 3.0), ("detection", 2.0)]
    assert s.describe() == ("goodput 90.0% of 1m 40s; lost to redone 4.0 s, startup 3.0 s, detection 2.0 s; "
                            "2 fault(s), 1 step(s) redone")
    again = GoodputSummary.from_hash({k.encode(): v.encode() for k, v in s.to_hash().items()})
    assert again.buckets == s.buckets and again.faults == s.faults
    assert duration(7385) == "2h 03m"
