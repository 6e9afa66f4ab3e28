"""What the soak reports (not a bench itself): each injected fault's outcome from the goodput
ledger beside the soak's own count of its steps lost, goodput by the soak's clock beside the
job's, and the issue's targets."""

from __future__ import annotations

import re
import time
from pathlib import Path
from typing import Any

from _soak_steps import steps_lost_outside

DECLARED_FIELDS = ("kind", "attempt", "last_step", "restored_step", "steps_lost", "restored_from")
BUCKETS_TOLERANCE_S = 2.0  # the record is written on a timer: its sum may trail its wall time a little
GOODPUT_AGREEMENT = 0.02  # the soak's clock and the job's ledger agree within 2% of the ledger's figure
GOODPUT_TARGET = 0.85
# Steps a fault may lose (the issue's targets): the memory snapshots' interval where a snapshot
# survives it (one step where they are taken every step; a SIGKILLed `longrun run` included: its
# keepers outlive it since 2026-11-29, when its bound was a checkpoint interval); two checkpoint
# intervals where the newest checkpoint is corrupted and skipped (the fault kills every keeper,
# so only storage survives).
CORRUPT_KINDS = {"checkpoint_corrupt": 2}
# What a rank logs each time the job's snapshot interval is chosen (checkpoint/memory.py).
INTERVAL_LINE = re.compile(r"memory snapshots every (\d+) step")


def steps_lost_bound(kind: str, interval: int, memory_every: int = 1) -> int:
    if kind in CORRUPT_KINDS:
        return CORRUPT_KINDS[kind] * interval
    return memory_every


def snapshot_intervals(logs_dir: Path) -> list[tuple[int, float, int]]:
    """Each memory snapshot interval the job chose, as (attempt, wall time, interval) in order:
    `auto` sets it from the measured send and step (every rank takes the slowest one's, so the
    ranks log the same choices), read from the rank logs (`<run_dir>/logs/attempt-A/rank-R.log`,
    whose lines begin with their local time)."""
    chosen: set[tuple[int, float, int]] = set()
    for log in sorted(Path(logs_dir).glob("attempt-*/rank-*.log")):
        attempt = log.parent.name.split("-", 1)[1]
        if not attempt.isdigit():
            continue
        for line in log.read_text(errors="replace").splitlines():
            found = INTERVAL_LINE.search(line)
            if found is None:
                continue
            try:
                at = time.mktime(time.strptime(line[:19], "%Y-%m-%d %H:%M:%S")) + float("0." + line[20:23])
            except ValueError:
                continue
            chosen.add((int(attempt), round(at, 1), int(found.group(1))))
    return sorted(chosen)


def interval_in_force(intervals: list[tuple[int, float, int]], attempt: int | None, at: float) -> int:
    """The snapshot interval a fault in `attempt` at wall time `at` may cost: the larger of the
    last one chosen before it and the one that replaced (a shortened interval's newest snapshot
    may have been taken at the longer one). An attempt struck while it still measured its first
    send keeps the last attempt's; 1 where none was chosen (snapshots every step meanwhile)."""
    before = [k for a, wall, k in intervals
              if attempt is None or a < attempt or (a == attempt and wall <= at)]
    return max(before[-2:], default=1)


def _declared(goodput: dict[str, Any] | None) -> list[dict[str, Any]]:
    faults = (goodput or {}).get("faults") or []
    return sorted((f for f in faults if isinstance(f, dict)), key=lambda f: float(f.get("declared_at", 0)))


def corruption_detected(fault, mine: list[dict[str, Any]], log_text: str) -> bool | None:
    """A corrupted checkpoint step was read and skipped: the first restore after it came from
    storage at an older step, and a rank said the step was unusable. None: not a corruption."""
    if fault.corrupted is None:
        return None
    restores = [f for f in mine if f.get("restored_step") is not None or f.get("restored_from")]
    if not restores:
        return False
    first = restores[0]
    older = first.get("restored_step") is not None and int(first["restored_step"]) < fault.corrupted
    return bool(older and first.get("restored_from") == "storage"
                and f"checkpoint step {fault.corrupted} is unusable" in log_text)


def fault_outcomes(injected, goodput: dict[str, Any] | None, *, steps_done: int, finished: bool,
                   restores=(), interval: int = 10, log_text: str = "",
                   memory_intervals: list[tuple[int, float, int]] = ()) -> list[dict[str, Any]]:
    """Per injected fault: the faults the controller declared between it and the next one
    (the ledger's steps lost and restored step), the steps lost by the soak's own reading
    (`restores`: each attempt's restored step as the soak saw it), whether it was injected, and
    whether the job survived it: finished, having trained past the step the fault hit.
    `interval`: the checkpoint interval; `memory_intervals`: each attempt's memory snapshot
    interval (`snapshot_intervals`), which bounds what a fault covered by a snapshot may lose."""
    declared = _declared(goodput)
    outcomes = []

    def struck(fault) -> float:
        # When it hit, not when its injection began: an injection may wait (for a committed
        # checkpoint, a worker to start) while the last fault's consequences are still declared.
        return fault.hit_wall or fault.wall

    for i, fault in enumerate(injected):
        until = struck(injected[i + 1]) if i + 1 < len(injected) else float("inf")
        mine = [f for f in declared if struck(fault) <= float(f.get("declared_at", 0)) < until]
        lost = [int(f["steps_lost"]) for f in mine if f.get("steps_lost") is not None]
        hit = fault.error is None
        # No fault declared (a Redis restart ridden out, a dead spare or keeper replaced, a
        # preemption that saved its step): nothing was restored, so nothing was redone.
        ledger = max(lost) if lost else (0 if hit else None)
        since = struck(fault)
        every = interval_in_force(memory_intervals, fault.attempt, since)
        outside = (steps_lost_outside(fault.reported, fault.attempt, since, until, list(restores))
                   if hit else None)
        # The struck attempt may finish steps after the blow (a removed node's processes train on
        # until they notice): the ledger counts those as lost too. Read from outside as well.
        end = getattr(fault, "reported_end", None)
        outside_end = steps_lost_outside(max(end or 0, fault.reported or 0), fault.attempt, since, until,
                                         list(restores)) if hit and fault.reported is not None else None
        outcomes.append({
            "kind": fault.kind, "at_s": round(fault.at_s, 1), "step": fault.step, "detail": fault.detail,
            "error": fault.error, "injected": int(hit),
            "survived": int(hit and finished and steps_done > fault.step),
            "declared": [{k: f.get(k) for k in DECLARED_FIELDS} for f in mine],
            "steps_lost": ledger,
            "steps_lost_outside": outside, "reported_before": fault.reported,
            "steps_lost_outside_end": outside_end, "reported_end": end,
            # The ledger's count against the soak's over the struck attempt's whole life (a rank
            # may finish the step it was in after the soak's last look: one step), and never
            # fewer than the soak saw finished before the blow.
            "steps_lost_agree": None if ledger is None or outside is None or outside_end is None
            else abs(ledger - outside_end) <= 1 and outside <= ledger + 1,
            "snapshot_interval": every,
            "steps_lost_bound": steps_lost_bound(fault.kind, interval, every),
            "corrupted_step": fault.corrupted,
            "corruption_detected": corruption_detected(fault, mine, log_text),
        })
    return outcomes


def by_kind(outcomes: list[dict[str, Any]]) -> tuple[dict[str, dict[str, int]], dict[str, list]]:
    """Faults injected and survived by kind, and each kind's steps lost (the ledger's), in order."""
    counts: dict[str, dict[str, int]] = {}
    lost: dict[str, list] = {}
    for o in outcomes:
        entry = counts.setdefault(o["kind"], {"injected": 0, "survived": 0})
        entry["injected"] += o["injected"]
        entry["survived"] += o["survived"]
        if o["injected"]:
            lost.setdefault(o["kind"], []).append(o["steps_lost"])
    return counts, lost


def goodput_summary(goodput: dict[str, Any] | None, wall_s: float,
                    runs: list[tuple[float, float]]) -> dict[str, Any]:
    """Goodput by the soak's clock (`goodput_clock`: the record's productive seconds over the
    time from the first `longrun run`'s launch to the last one's exit) beside the job's own
    (`goodput_ledger`: over the job's wall time by its clock, from its first controller's
    start). The record's buckets must add up to its wall time (measured by the clock since issue
    41, not their sum), which must fit inside the time its `longrun run` processes lived
    (`runs`: launch and exit times), and the two goodputs agree within 2%."""
    if not goodput or not isinstance(goodput.get("buckets"), dict):
        return {"goodput_clock": None, "goodput_ledger": None, "goodput_agree": False, "buckets": None,
                "record_wall_s": None, "record_buckets_sum_s": None, "runs_s": None, "buckets_add_up": False,
                "wall_s": round(wall_s, 2)}
    buckets = {k: round(float(v), 2) for k, v in goodput["buckets"].items()}
    record_wall = float(goodput.get("wall_s", 0.0))
    record_sum = sum(buckets.values())
    lived = sum(end - start for start, end in runs)
    clock = round(buckets.get("productive", 0.0) / wall_s, 4) if wall_s else None
    ledger = float(goodput["goodput"]) if goodput.get("goodput") is not None else None
    return {
        "goodput_clock": clock, "goodput_ledger": None if ledger is None else round(ledger, 4),
        "goodput_agree": clock is not None and ledger is not None
        and abs(clock - ledger) <= GOODPUT_AGREEMENT * ledger,
        "buckets": buckets | {"outside_controller": round(max(0.0, wall_s - record_wall), 2)},
        "record_wall_s": round(record_wall, 2), "record_buckets_sum_s": round(record_sum, 2),
        "runs_s": round(lived, 2),
        "buckets_add_up": abs(record_sum - record_wall) <= BUCKETS_TOLERANCE_S
        and record_wall <= lived + BUCKETS_TOLERANCE_S,
        "wall_s": round(wall_s, 2),
    }


# Flat: grew by at most 10% of the role's own level after warm-up, or this many MiB for a small one.
RSS_FLOOR_MB = {"controller": 20.0, "workers": 50.0, "keepers": 50.0}


def _flat(growth: float | None, start: float | None, floor: float) -> bool | None:
    if growth is None or start is None:
        return None
    return growth <= max(floor, 0.10 * start)


def targets(result: dict[str, Any]) -> dict[str, bool | None]:
    """The issue's targets, met or not; None: not measured."""
    injected = [o for o in result["fault_log"] if o["injected"]]
    corruptions = [o["corruption_detected"] for o in injected if o["corrupted_step"] is not None]
    clock = result.get("goodput_clock")
    return {
        f"goodput_clock_at_least_{GOODPUT_TARGET}": None if clock is None else clock >= GOODPUT_TARGET,
        "goodput_clock_and_ledger_agree": result.get("goodput_agree"),
        "steps_lost_within_bounds": None if not injected else all(
            o["steps_lost"] is not None and o["steps_lost"] <= o["steps_lost_bound"] for o in injected),
        "steps_lost_ledger_and_outside_agree": None if not injected else all(
            o["steps_lost_agree"] is not False for o in injected),
        "every_corruption_detected": None if not corruptions else all(corruptions),
        "redis_keys_flat": _flat(result["redis_keys"]["growth"], result["redis_keys"]["start"], 10),
        **{f"rss_flat_{role}": _flat(result["rss_mb"][role]["growth"], result["rss_mb"][role]["start"], floor)
           for role, floor in RSS_FLOOR_MB.items()},
        "bitwise_equal": result.get("bitwise_equal"),
        "every_fault_survived": result["faults"] > 0 and all(o["survived"] for o in injected),
    }
