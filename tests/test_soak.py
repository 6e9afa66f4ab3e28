"""The soak (bench/soak.py): one job on a simulated 3-node Ray cluster through faults injected
from outside longrun at seeded random times, ending with the weights of an uninterrupted run.

The default run has the bounded soak (three faults of different kinds: a worker SIGKILLed by
pid, Redis SIGKILLed and restarted, the checkpoint disk full during a save); the full fault mix
(each of the seven kinds once, about 5 minutes) is marked slow. LONGRUN_SOAK_SEED replays one."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

BENCH = Path(__file__).resolve().parents[1] / "bench"
sys.path.insert(0, str(BENCH))

from _soak_harness import Plan  # noqa: E402
from _soak_report import fault_outcomes, goodput_summary  # noqa: E402


def soak(*args: str, timeout: float) -> dict:
    seed = os.environ.get("LONGRUN_SOAK_SEED", str(random.randrange(1 << 16)))
    print(f"LONGRUN_SOAK_SEED={seed}")
    done = subprocess.run([sys.executable, str(BENCH / "soak.py"), "--seed", seed, *args],
                          capture_output=True, text=True, timeout=timeout)
    assert done.stdout.strip(), f"seed {seed}: no report\n{done.stderr[-6000:]}"
    result = json.loads(done.stdout.strip().splitlines()[-1])
    result["_log"] = f"seed {seed}\n{done.stderr[-6000:]}"
    return result


def assert_survived_losing_at_most_a_step(result: dict, kinds: int) -> None:
    log = result["_log"]
    assert result["failure"] is None, log
    assert result["faults"] == result["faults_planned"] == kinds, log
    injected = [o for o in result["fault_log"] if o["injected"]]
    assert len({o["kind"] for o in injected}) == kinds, log
    for fault in injected:
        assert fault["survived"], (fault, log)
        # From the ledger: the newest step the failing attempt finished minus the restored one.
        assert fault["steps_lost"] is not None and fault["steps_lost"] <= 1, (fault, log)
    # The goodput record exists, every second of the controller's wall time is in one bucket,
    # and the controller's time is inside the soak's own clock.
    assert result["buckets"] is not None and result["buckets_add_up"], log
    assert result["record_wall_s"] <= result["wall_s"] + 1.0, log
    assert 0 < result["goodput"] <= 1, log
    assert result["final_checkpoint"] is True, log  # the job's last step was committed
    assert result["bitwise_equal"] is True, log


@pytest.mark.timeout(600)
def test_a_bounded_soak_survives_three_kinds_of_fault_and_ends_bitwise_equal():
    result = soak("--bounded", timeout=540)
    assert_survived_losing_at_most_a_step(result, 3)
    assert result["redis_restarts"] == 1, result["_log"]


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_the_quick_soak_survives_every_kind_of_fault_and_ends_bitwise_equal():
    result = soak("--quick", timeout=1700)
    assert_survived_losing_at_most_a_step(result, 7)


# -- the report's arithmetic, without a cluster ---------------------------------------------------

def _injected(kind: str, wall: float, step: int) -> SimpleNamespace:
    return SimpleNamespace(kind=kind, at_s=wall - 1000, wall=wall, step=step, detail="", error=None)


def test_each_declared_fault_is_charged_to_the_injection_before_it():
    injected = [_injected("worker_kill", 1010, 20), _injected("redis_kill", 1050, 40),
                _injected("run_sigterm", 1090, 60)]
    goodput = {"faults": [
        {"kind": "dead", "attempt": 0, "declared_at": 1013.5, "last_step": 21, "restored_step": 21,
         "steps_lost": 0},
        {"kind": "preempted", "attempt": 2, "declared_at": 1095.0, "last_step": 62, "restored_step": 61,
         "steps_lost": 1}]}
    outcomes = fault_outcomes(injected, goodput, steps_done=100, finished=True)
    assert [o["steps_lost"] for o in outcomes] == [0, 0, 1]  # Redis: none declared, none restored
    assert [len(o["declared"]) for o in outcomes] == [1, 0, 1]
    assert all(o["survived"] for o in outcomes)
    assert not any(o["survived"] for o in fault_outcomes(injected, goodput, steps_done=100, finished=False))
    # A fault at or after the job's last step was not survived: the job never trained past it.
    short = fault_outcomes(injected, goodput, steps_done=60, finished=True)
    assert [o["survived"] for o in short] == [1, 1, 0]


def test_goodput_is_productive_time_over_the_soaks_own_clock():
    record = {"buckets": {"productive": 80.0, "startup": 10.0, "backoff": 5.0}, "wall_s": 95.0,
              "goodput": 80 / 95}
    runs = [(1000.0, 1040.0), (1045.0, 1100.0)]  # a SIGTERM at 1040 and a rerun
    summary = goodput_summary(record, 100.0, runs)
    assert summary["goodput"] == 0.8 and summary["buckets_add_up"]
    assert summary["buckets"]["outside_controller"] == 5.0  # between the runs, outside any controller
    # Buckets that do not sum to the record's wall time, or more time than the runs lived: wrong.
    assert not goodput_summary(record | {"wall_s": 120.0}, 130.0, runs)["buckets_add_up"]
    assert not goodput_summary(record, 100.0, [(1000.0, 1080.0)])["buckets_add_up"]
    assert goodput_summary(None, 100.0, runs)["goodput"] is None


def test_the_plan_cycles_through_every_kind_and_outlasts_its_faults():
    plan = Plan.of(60, seed=3)
    assert len(plan.kinds) == 29 and len(set(plan.kinds)) == 7
    assert set(plan.kinds[:7]) == set(plan.kinds[7:14])  # each kind once per round
    assert plan.every_s == 120
    # The job's paced steps outlast the last fault's slot (less what the faults cost).
    assert plan.steps * plan.pace_s > len(plan.kinds) * plan.every_s - len(plan.kinds) * 12 - 60
    assert Plan.of(60, seed=3).kinds == plan.kinds and Plan.of(60, seed=4).kinds != plan.kinds
