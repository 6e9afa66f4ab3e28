"""What the soak reports (not a bench itself): each injected fault's outcome from the goodput
ledger, the goodput buckets over the soak's own wall clock, and the issue's targets."""

from __future__ import annotations

from typing import Any

DECLARED_FIELDS = ("kind", "attempt", "last_step", "restored_step", "steps_lost")
BUCKETS_TOLERANCE_S = 2.0  # the record is written on a timer: its sum may trail its wall time a little


def _declared(goodput: dict[str, Any] | None) -> list[dict[str, Any]]:
    faults = (goodput or {}).get("faults") or []
    return sorted((f for f in faults if isinstance(f, dict)), key=lambda f: float(f.get("declared_at", 0)))


def fault_outcomes(injected, goodput: dict[str, Any] | None, *, steps_done: int,
                   finished: bool) -> list[dict[str, Any]]:
    """Per injected fault: the faults the controller declared between it and the next one
    (the ledger's steps lost and restored step), whether it was injected, and whether the job
    survived it: finished, having trained past the step the fault hit."""
    declared = _declared(goodput)
    outcomes = []
    for i, fault in enumerate(injected):
        until = injected[i + 1].wall if i + 1 < len(injected) else float("inf")
        mine = [f for f in declared if fault.wall <= float(f.get("declared_at", 0)) < until]
        lost = [int(f["steps_lost"]) for f in mine if f.get("steps_lost") is not None]
        hit = fault.error is None
        outcomes.append({
            "kind": fault.kind, "at_s": round(fault.at_s, 1), "step": fault.step, "detail": fault.detail,
            "error": fault.error, "injected": int(hit),
            "survived": int(hit and finished and steps_done > fault.step),
            "declared": [{k: f.get(k) for k in DECLARED_FIELDS} for f in mine],
            # No fault declared (a Redis restart ridden out, a corrupted checkpoint never read, a
            # preemption that saved its step): nothing was restored, so nothing was redone.
            "steps_lost": max(lost) if lost else (0 if hit else None),
        })
    return outcomes


def goodput_summary(goodput: dict[str, Any] | None, wall_s: float,
                    runs: list[tuple[float, float]]) -> dict[str, Any]:
    """Goodput over the soak's wall clock. The record's buckets cover the time its controllers
    ran; what the soak saw outside them (each `longrun run`'s start before its controller and
    exit after it, the gap between a SIGTERMed run's exit and its rerun) is
    `outside_controller`. `buckets_add_up`: the record's buckets sum to its wall time, and that
    fits inside the time its `longrun run` processes lived (`runs`: launch and exit times)."""
    if not goodput or not isinstance(goodput.get("buckets"), dict):
        return {"goodput": None, "goodput_record": None, "buckets": None, "record_wall_s": None,
                "record_buckets_sum_s": None, "runs_s": None, "buckets_add_up": False}
    buckets = {k: round(float(v), 2) for k, v in goodput["buckets"].items()}
    record_wall = float(goodput.get("wall_s", 0.0))
    record_sum = sum(buckets.values())
    lived = sum(end - start for start, end in runs)
    return {
        "goodput": round(buckets.get("productive", 0.0) / wall_s, 4) if wall_s else None,
        "goodput_record": float(goodput["goodput"]) if goodput.get("goodput") is not None else None,
        "buckets": buckets | {"outside_controller": round(max(0.0, wall_s - record_wall), 2)},
        "record_wall_s": round(record_wall, 2), "record_buckets_sum_s": round(record_sum, 2),
        "runs_s": round(lived, 2),
        "buckets_add_up": abs(record_sum - record_wall) <= BUCKETS_TOLERANCE_S
        and record_wall <= lived + BUCKETS_TOLERANCE_S,
        "wall_s": round(wall_s, 2),
    }


def _flat(growth: float | None, start: float | None, floor: float) -> bool | None:
    if growth is None or start is None:
        return None
    return growth <= max(floor, 0.10 * start)


def targets(result: dict[str, Any]) -> dict[str, bool | None]:
    """The issue's targets (tiny model, a fault every 2 minutes), met or not; None: not measured."""
    lost = result.get("steps_lost_max")
    return {
        "goodput_at_least_0.90": None if result.get("goodput") is None else result["goodput"] >= 0.90,
        "at_most_1_step_lost_per_fault": None if lost is None else lost <= 1,
        # Flat: grew by at most 10% of the level after warm-up (or 10 keys / 50 MiB, for small levels).
        "redis_keys_flat": _flat(result["redis_keys"]["growth"], result["redis_keys"]["start"], 10),
        "rss_flat": _flat(result["rss_mb"]["total"]["growth"], result["rss_mb"]["total"]["start"], 50),
        "bitwise_equal": result.get("bitwise_equal"),
        "every_fault_survived": result["faults"] > 0 and all(
            o["survived"] for o in result["fault_log"] if o["injected"]),
    }
