"""The soak (bench/soak.py): one job on a simulated 3-node Ray cluster through faults injected
from outside longrun at seeded random times, ending with the weights of an uninterrupted run.

The default run has the bounded soak (three faults of different kinds: a worker SIGKILLed by
pid, Redis SIGKILLed and restarted, the checkpoint disk full during a save and through the
restart); the full fault mix (each kind once, about 5 minutes) is marked slow. LONGRUN_SOAK_SEED
replays one. Below them, the report's arithmetic, the soak's outside view of the steps and its
pacing inside the step, each without a cluster."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

BENCH = Path(__file__).resolve().parents[1] / "bench"
sys.path.insert(0, str(BENCH))

from _soak_faults import KINDS, Deferred, Faults  # noqa: E402
from _soak_harness import Plan, Soak  # noqa: E402
from _soak_job import ffn_for, soak_job, state_mb_of  # noqa: E402
from _soak_report import fault_outcomes, goodput_summary, snapshot_intervals, targets  # noqa: E402
from _soak_steps import StepWatch  # noqa: E402


def soak(*args: str, timeout: float) -> dict:
    seed = os.environ.get("LONGRUN_SOAK_SEED", str(random.randrange(1 << 16)))
    print(f"LONGRUN_SOAK_SEED={seed}")
    done = subprocess.run([sys.executable, str(BENCH / "soak.py"), "--seed", seed, *args],
                          capture_output=True, text=True, timeout=timeout)
    assert done.stdout.strip(), f"seed {seed}: no report\n{done.stderr[-6000:]}"
    result = json.loads(done.stdout.strip().splitlines()[-1])
    result["_log"] = f"seed {seed}\n{done.stderr[-6000:]}"
    return result


def assert_survived_within_bounds(result: dict, kinds: int) -> None:
    log = result["_log"]
    assert result["failure"] is None, log
    assert result["faults"] == result["faults_planned"] == kinds, log
    injected = [o for o in result["fault_log"] if o["injected"]]
    assert len({o["kind"] for o in injected}) == kinds, log
    assert sum(v["injected"] for v in result["faults_by_kind"].values()) == kinds, log
    for fault in injected:
        assert fault["survived"], (fault, log)
        # From the ledger: the newest step the failing attempt finished minus the restored one,
        # at most one where a memory snapshot survives the fault, an interval (or two, past a
        # corrupted checkpoint) where only storage does ...
        assert fault["steps_lost"] <= fault["steps_lost_bound"], (fault, log)
        # ... and the soak's own count, from the step each rank reported just before the fault
        # and the step the next attempt restored, says the same within the step a surviving
        # rank may finish after the look.
        assert fault["steps_lost_outside"] is not None and fault["steps_lost_agree"], (fault, log)
    assert {kind: len(lost) for kind, lost in result["steps_lost_by_kind"].items()} == \
        {kind: v["injected"] for kind, v in result["faults_by_kind"].items()}, log
    # Every corrupted checkpoint was read by a storage restore, found damaged and skipped.
    corrupt = [o for o in injected if o["kind"] == "checkpoint_corrupt"]
    assert all(o["corruption_detected"] is True for o in corrupt), (corrupt, log)
    # The job's buckets add up to its wall time by its clock, and its goodput agrees with the
    # one the soak measured by its own clock (which counts every rerun's start-up) within 2%.
    assert result["buckets_add_up"], log
    assert result["goodput_agree"], (result["goodput_clock"], result["goodput_ledger"], log)
    assert result["record_wall_s"] <= result["wall_s"], log
    assert result["final_checkpoint"] is True, log  # the job's last step was committed
    assert result["bitwise_equal"] is True, log


@pytest.mark.timeout(600)
def test_a_bounded_soak_survives_three_kinds_of_fault_and_ends_bitwise_equal():
    result = soak("--bounded", timeout=540)
    assert_survived_within_bounds(result, 3)
    assert result["redis_restarts"] == 1, result["_log"]
    assert result["state_mb"] == pytest.approx(16, rel=0.05), result["_log"]


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_the_quick_soak_survives_every_kind_of_fault_and_ends_bitwise_equal():
    result = soak("--quick", timeout=1700)
    assert_survived_within_bounds(result, len(KINDS))
    assert result["state_mb"] == pytest.approx(32, rel=0.05), result["_log"]
    # A SIGTERM's exit (75) and a SIGKILL's (-9), each rerun; the last run ends the job.
    assert result["runs"] == 3 and sorted(result["exit_codes"]) == [-9, 0, 75], result["_log"]


# -- the report's arithmetic, without a cluster ---------------------------------------------------

def _injected(kind: str, wall: float, step: int, *, attempt: int = 0, reported: int | None = None,
              corrupted: int | None = None) -> SimpleNamespace:
    return SimpleNamespace(kind=kind, at_s=wall - 1000, wall=wall, step=step, detail="", error=None,
                           attempt=attempt, hit_wall=wall, reported=reported, corrupted=corrupted)


def test_each_declared_fault_is_charged_to_the_injection_before_it():
    injected = [_injected("worker_kill", 1010, 20, reported=21),
                _injected("redis_kill", 1050, 40, attempt=1, reported=40),
                _injected("run_sigterm", 1090, 60, attempt=1, reported=62)]
    goodput = {"faults": [
        {"kind": "dead", "attempt": 0, "declared_at": 1013.5, "last_step": 21, "restored_step": 21,
         "steps_lost": 0},
        {"kind": "preempted", "attempt": 2, "declared_at": 1095.0, "last_step": 62, "restored_step": 61,
         "steps_lost": 1}]}
    restores = [SimpleNamespace(wall=1020.0, attempt=1, step=21),
                SimpleNamespace(wall=1100.0, attempt=2, step=61)]
    outcomes = fault_outcomes(injected, goodput, steps_done=100, finished=True, restores=restores)
    assert [o["steps_lost"] for o in outcomes] == [0, 0, 1]  # Redis: none declared, none restored
    assert [o["steps_lost_outside"] for o in outcomes] == [0, 0, 1]
    assert all(o["steps_lost_agree"] for o in outcomes)
    assert [len(o["declared"]) for o in outcomes] == [1, 0, 1]
    assert all(o["survived"] for o in outcomes)
    assert not any(o["survived"] for o in fault_outcomes(injected, goodput, steps_done=100, finished=False))
    # A fault at or after the job's last step was not survived: the job never trained past it.
    short = fault_outcomes(injected, goodput, steps_done=60, finished=True)
    assert [o["survived"] for o in short] == [1, 1, 0]
    # The soak saw rank 0 report step 25 before the kill, the ledger says 21: they disagree.
    seen_more = fault_outcomes([_injected("worker_kill", 1010, 20, reported=25)], goodput, steps_done=100,
                               finished=True, restores=restores)
    assert seen_more[0]["steps_lost_outside"] == 4 and seen_more[0]["steps_lost_agree"] is False


def test_a_fault_declared_while_the_next_injection_waits_is_charged_to_the_one_that_caused_it():
    # The quick soak (seed 41): disk_full's failed save was declared after checkpoint_corrupt's
    # injection began but before it struck (it waited for a committed checkpoint); charged by
    # when each fault struck, the memory restore it caused is disk_full's, and the corruption's
    # first restore is the storage restore that skipped the corrupted step.
    disk = _injected("disk_full", 1010, 6, reported=6)
    corrupt = _injected("checkpoint_corrupt", 1030, 19, attempt=1, reported=31, corrupted=30)
    corrupt.hit_wall = 1040.0
    goodput = {"faults": [
        {"kind": "exception", "attempt": 0, "declared_at": 1032.0, "last_step": 19, "restored_step": 19,
         "steps_lost": 0, "restored_from": "memory"},
        {"kind": "dead", "attempt": 1, "declared_at": 1041.0, "last_step": 31, "restored_step": 20,
         "steps_lost": 11, "restored_from": "storage"}]}
    outcomes = fault_outcomes([disk, corrupt], goodput, steps_done=100, finished=True,
                              log_text="checkpoint step 30 is unusable")
    assert [[f["kind"] for f in o["declared"]] for o in outcomes] == [["exception"], ["dead"]]
    assert [o["steps_lost"] for o in outcomes] == [0, 11]
    assert outcomes[1]["corruption_detected"] is True


def test_steps_a_struck_attempt_finished_after_the_blow_are_checked_against_its_last_report():
    # A removed node's processes train on for a while: the ledger counts those steps as lost.
    goodput = {"faults": [{"kind": "dead", "attempt": 2, "declared_at": 1015.0, "last_step": 43,
                           "restored_step": 40, "steps_lost": 3, "restored_from": "storage"}]}
    restores = [SimpleNamespace(wall=1030.0, attempt=3, step=40)]
    fault = _injected("node_loss", 1010, 41, attempt=2, reported=41)
    fault.reported_end = 43
    (outcome,) = fault_outcomes([fault], goodput, steps_done=100, finished=True, restores=restores)
    lost = (outcome["steps_lost"], outcome["steps_lost_outside"], outcome["steps_lost_outside_end"])
    assert lost == (3, 1, 3)
    assert outcome["steps_lost_agree"] and outcome["steps_lost"] > outcome["steps_lost_bound"]
    fault.reported_end = 41  # the soak saw nothing after the blow: the ledger's 3 disagrees
    (outcome,) = fault_outcomes([fault], goodput, steps_done=100, finished=True, restores=restores)
    assert outcome["steps_lost_agree"] is False


def test_steps_lost_are_bounded_by_what_survives_each_kind_of_fault():
    goodput = {"faults": [
        {"kind": "controller_lost", "attempt": 3, "declared_at": 1012.0, "last_step": 47, "restored_step": 40,
         "steps_lost": 7, "restored_from": "storage"},
        {"kind": "dead", "attempt": 4, "declared_at": 1052.0, "last_step": 90, "restored_step": 88,
         "steps_lost": 2, "restored_from": "memory"}]}
    injected = [_injected("controller_kill", 1010, 47), _injected("worker_kill", 1050, 90)]
    outcomes = fault_outcomes(injected, goodput, steps_done=200, finished=True, interval=10)
    # A killed controller's keepers outlive it: one step, as for a worker (it was an interval).
    assert [(o["steps_lost"], o["steps_lost_bound"]) for o in outcomes] == [(7, 1), (2, 1)]
    result = {"fault_log": outcomes, "faults": 2, "goodput_clock": 0.9, "goodput_agree": True,
              "redis_keys": {"growth": 0, "start": 20}, "bitwise_equal": True,
              "rss_mb": {role: {"growth": 1.0, "start": 100.0}
                         for role in ("controller", "workers", "keepers")}}
    assert targets(result)["steps_lost_within_bounds"] is False  # the worker kill lost 2 > 1
    assert targets(result)["every_corruption_detected"] is None  # none injected


def test_a_snapshot_covered_fault_may_lose_the_interval_in_force_when_it_struck(tmp_path):
    # The soak's job takes memory snapshots at the `auto` interval; the ranks log each interval
    # they agree on. A fault may lose the interval in force when it struck (or the one that just
    # replaced it: the newest snapshot may have been taken at it), not more.
    def line(clock: str, k: int) -> str:
        return (f"2026-11-29 11:20:{clock} INFO longrun.checkpoint.memory: "
                f"memory snapshots every {k} step(s) "
                "(auto: this rank's send 1.90 s, its step 2.10 s; the slowest rank's sets it)\n")
    logs = tmp_path / "logs"
    for attempt, rank, chosen in ((0, 0, [("01,000", 3), ("11,500", 2), ("21,000", 2)]),
                                  (0, 1, [("01,000", 3)]), (2, 0, [("50,000", 1)])):
        path = logs / f"attempt-{attempt}" / f"rank-{rank}.log"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("2026-11-29 11:20:00,000 INFO longrun.worker: training begins\n"
                        + "".join(line(clock, k) for clock, k in chosen))
    (logs / "attempt-1").mkdir()  # struck while it still measured its first send: chose none
    (logs / "attempt-1" / "rank-0.log").write_text("nothing chosen yet\n")
    intervals = snapshot_intervals(logs)
    zero = time.mktime(time.strptime("2026-11-29 11:20:00", "%Y-%m-%d %H:%M:%S"))
    assert [(a, round(wall - zero, 1), k) for a, wall, k in intervals] == [(0, 1.0, 3), (0, 11.5, 2),
                                                                           (0, 21.0, 2), (2, 50.0, 1)]
    struck = [(0, 5.0), (0, 15.0), (0, 25.0), (1, 40.0), (2, 55.0)]  # (attempt, seconds after 11:20)
    goodput = {"faults": [
        {"kind": "dead", "attempt": a, "declared_at": zero + at + 2, "last_step": 10 + i,
         "restored_step": 10 + i - 3, "steps_lost": 3, "restored_from": "memory"}
        for i, (a, at) in enumerate(struck)]}
    injected = [_injected("worker_kill", zero + at, 10 + i, attempt=a) for i, (a, at) in enumerate(struck)]
    outcomes = fault_outcomes(injected, goodput, steps_done=100, finished=True, memory_intervals=intervals)
    # 3 in force; 2 just replaced 3; 2 after 2; attempt 1 keeps attempt 0's; 1 just replaced 2.
    assert [o["snapshot_interval"] for o in outcomes] == [3, 3, 2, 2, 2]
    assert [o["steps_lost"] <= o["steps_lost_bound"] for o in outcomes] == [True, True, False, False, False]
    # Without any chosen interval (snapshots every step), one step is the bound.
    assert {o["steps_lost_bound"] for o in fault_outcomes(injected, goodput, steps_done=100,
                                                          finished=True)} == {1}


def test_a_corruption_counts_as_detected_only_when_a_storage_restore_skipped_it():
    log = "... checkpoint step 30 is unusable (a shard's checksum does not match); falling back ..."
    skipped = {"faults": [{"kind": "dead", "attempt": 2, "declared_at": 1011.0, "last_step": 34,
                           "restored_step": 20, "steps_lost": 14, "restored_from": "storage"}]}
    corrupt = [_injected("checkpoint_corrupt", 1010, 34, corrupted=30)]
    (outcome,) = fault_outcomes(corrupt, skipped, steps_done=100, finished=True, log_text=log)
    assert outcome["corruption_detected"] is True
    assert outcome["steps_lost"] <= outcome["steps_lost_bound"] == 20
    # Restored from memory, or from the corrupted step itself, or no rank said so: not detected.
    memory = {"faults": [skipped["faults"][0] | {"restored_step": 34, "restored_from": "memory"}]}
    read_it = {"faults": [skipped["faults"][0] | {"restored_step": 30}]}
    for goodput, text in ((memory, log), (read_it, log), (skipped, "")):
        (outcome,) = fault_outcomes(corrupt, goodput, steps_done=100, finished=True, log_text=text)
        assert outcome["corruption_detected"] is False


def test_goodput_by_the_soaks_clock_must_agree_with_the_jobs_within_two_percent():
    record = {"buckets": {"productive": 80.0, "startup": 10.0, "backoff": 5.0}, "wall_s": 95.0,
              "goodput": 80 / 95}
    runs = [(1000.0, 1040.0), (1045.0, 1100.0)]  # a SIGTERM at 1040 and a rerun
    summary = goodput_summary(record, 96.0, runs)
    assert summary["goodput_clock"] == round(80 / 96, 4) and summary["goodput_ledger"] == round(80 / 95, 4)
    assert summary["goodput_agree"] and summary["buckets_add_up"]
    assert summary["buckets"]["outside_controller"] == 1.0  # between the runs, outside any controller
    # Five seconds in no controller's record out of a hundred: the two no longer agree.
    assert not goodput_summary(record, 100.0, runs)["goodput_agree"]
    # Buckets that do not sum to the record's wall time, or more time than the runs lived: wrong.
    assert not goodput_summary(record | {"wall_s": 120.0}, 130.0, runs)["buckets_add_up"]
    assert not goodput_summary(record, 100.0, [(1000.0, 1080.0)])["buckets_add_up"]
    assert goodput_summary(None, 100.0, runs)["goodput_clock"] is None


def test_the_plan_cycles_through_every_kind_and_outlasts_its_faults():
    plan = Plan.of(60, seed=3)
    assert len(plan.kinds) == 29 and set(plan.kinds) == set(KINDS)
    n = len(KINDS)
    assert set(plan.kinds[:n]) == set(plan.kinds[n:2 * n])  # each kind once per round
    assert plan.every_s == 120
    # The job's paced steps outlast the last fault's slot (less what the faults cost).
    assert plan.steps * plan.step_s > len(plan.kinds) * plan.every_s - len(plan.kinds) * 12 - 60
    assert plan.state_mb == 512 and Plan.of(60, seed=3, state_mb=32).steps > plan.steps
    assert Plan.of(60, seed=3).kinds == plan.kinds and Plan.of(60, seed=4).kinds != plan.kinds


def test_the_state_is_sized_to_the_megabytes_asked_for(tmp_path):
    for mb in (16, 32, 256, 1024):
        assert state_mb_of(ffn_for(mb)) == pytest.approx(mb, rel=0.02)
    assert ffn_for(256) > ffn_for(32) and ffn_for(256) % 64 == 0
    # The job paces every rank inside its step, in every attempt.
    job = soak_job(tmp_path, 100, ray_address="127.0.0.1:1", redis_url="redis://127.0.0.1:1/0",
                   checkpoint_dir=tmp_path / "c", pace_s=1.0, ffn_dim=ffn_for(256))
    pacing = job["health"]["faults"]
    assert {(f["rank"], f["in_step"]) for f in pacing} == {(0, True), (1, True)}
    assert job["model"]["ffn_dim"] == ffn_for(256)
    from longrun.config import config_from_dict

    assert config_from_dict(job).model.ffn_dim == ffn_for(256)  # a job longrun accepts


def test_in_step_pacing_sleeps_before_the_update_not_after_the_step(monkeypatch):
    from longrun.config.sections import FaultSpec
    from longrun.health import faults

    slept: list[tuple[str, float]] = []
    where = ["after_step"]
    monkeypatch.setattr(faults.time, "sleep", lambda s: slept.append((where[0], s)))
    injector = faults.FaultInjector([FaultSpec(rank=0, step=0, kind="slow", seconds=0.5, in_step=True)], 0, 0)
    injector.after_step(1)
    where[0] = "before_update"
    injector.before_update()
    assert slept == [("before_update", 0.5)]
    # Without in_step the old straggler: after the step, never inside it.
    slept.clear()
    plain = faults.FaultInjector([FaultSpec(rank=0, step=0, kind="slow", seconds=0.5)], 0, 0)
    plain.before_update()
    where[0] = "after_step"
    plain.after_step(1)
    assert slept == [("after_step", 0.5)]
    with pytest.raises(ValueError, match="in_step applies to a 'slow' fault only"):
        FaultSpec(rank=0, step=0, kind="kill", in_step=True)


def test_the_soak_reads_each_ranks_last_step_and_each_restore_from_the_ledger(redis_server):
    from longrun.goodput.ledger import StepLedger, step_ledger_client

    watch = StepWatch(redis_server.url, "soak")
    assert watch.last_reported(0) is None  # nothing reported yet
    ranks = [StepLedger(step_ledger_client(redis_server.url), "soak", 0, r) for r in (0, 1)]
    for ledger in ranks:
        ledger.restored(None, "none", 0.0)
    for step in range(1, 6):
        ranks[0].step(step)
    ranks[1].step(4)
    watch.look(0)
    assert watch.last_reported(0) == 5 and [(r.attempt, r.step) for r in watch.restores] == [(0, None)]
    # The next attempt, still starting: what it restored, once it says; before, the last attempt's.
    assert watch.last_reported(1) == 5
    for r in (0, 1):
        StepLedger(step_ledger_client(redis_server.url), "soak", 1, r).restored(4, "memory", 0.2)
    assert watch.last_reported(1) == 4
    assert [(r.attempt, r.step) for r in watch.restores] == [(0, None), (1, 4)]


def test_a_wait_inside_one_fault_carries_out_the_second_half_of_another():
    # The quick soak (seed 41) once held its disk full for 300 s: checkpoint_corrupt waited for a
    # committed checkpoint while the earlier disk_full's "free the disk" waited for the soak's
    # loop, so none could commit. A wait inside an injection now tends the earlier faults' halves.
    world = Soak.__new__(Soak)  # only what tend() and the wait use
    freed, committed = [], []
    world.deferred = [Deferred("the disk freed", lambda: True, lambda: freed.append(True)),
                      Deferred("not yet", lambda: False, lambda: freed.append(False))]
    world.runner = SimpleNamespace(poll=lambda: None)
    faults = Faults(world, random.Random(0))

    def checkpoint():  # a checkpoint can commit only once the disk has room
        committed.append(bool(freed))
        return committed[-1] and ["step-10"]

    assert faults._wait("a committed checkpoint", checkpoint) == ["step-10"]
    assert freed == [True] and [d.what for d in world.deferred] == ["not yet"]
    assert committed == [True]  # tended before the first look
