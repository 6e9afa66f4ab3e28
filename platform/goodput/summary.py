"""The job-wide goodput summary in Redis (`longrun:{job}:goodput`), and how it reads to a person.

A hash, rewritten by the controller at every poll and at every move:

    buckets     JSON {bucket: seconds}, every bucket of accounting.BUCKETS
    goodput     productive / wall_s
    wall_s      the job's wall time by the clock: updated_at (once the job ended: its end,
                accounted_to) - origin - paused_s
    origin      when the job's first controller started (kept by every controller after it)
    paused_s    the time the job lay preempted between runs (a deliberate stop: off the clock)
    accounted_to  the moment the buckets account up to (a running attempt: its newest step
                record); they must sum to accounted_to - origin - paused_s (`unaccounted_s`)
    faults      JSON list of the last 100 faults: {"attempt", "kind", "declared_at", "last_step",
                "restored_step", "steps_lost", "restored_from"}
    updated_at  when it was written (wall clock)
    last_step   the newest step trained on the job's current path
    state       the controller's state when it was written, and `attempt` its attempt

`longrun status` and the job's last line show `describe()`: goodput and its top three losses.

Beside it, `longrun:{job}:goodput:detail` (JSON, bounded by the account's window) holds what only
a controller taking over after this one's death needs: the per-step productive seconds a restore
could still move to redone, and the running attempt's span.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from longrun import keys
from longrun.goodput.accounting import BUCKETS, LOSSES
from longrun.kinds import JobState


@dataclass
class GoodputSummary:
    buckets: dict[str, float]
    faults: list[dict[str, Any]] = field(default_factory=list)
    updated_at: float = 0.0
    last_step: int = 0
    state: str | None = None
    attempt: int | None = None
    origin: float | None = None  # None: a summary from before the clock was kept (wall = the sum)
    paused_s: float = 0.0
    accounted_to: float | None = None

    @property
    def wall_s(self) -> float:
        """The job's wall time by the clock: up to when this was written, or up to its end once it
        ended (its terminal move, which is what the buckets account up to)."""
        if self.origin is None:
            return sum(self.buckets.values())
        ended = self.state is not None and JobState(self.state).terminal and self.accounted_to is not None
        return (self.accounted_to if ended else self.updated_at) - self.origin - self.paused_s

    @property
    def unaccounted_s(self) -> float:
        """Clock seconds up to `accounted_to` that no bucket holds (negative: counted twice);
        0 up to float rounding when the account is right."""
        if self.origin is None or self.accounted_to is None:
            return 0.0
        return self.accounted_to - self.origin - self.paused_s - sum(self.buckets.values())

    @property
    def goodput(self) -> float:
        wall = self.wall_s
        return self.buckets.get("productive", 0.0) / wall if wall > 0 else 0.0

    def top_losses(self, n: int = 3) -> list[tuple[str, float]]:
        """The `n` largest buckets that are not productive time (none that are empty)."""
        found = sorted(((b, self.buckets.get(b, 0.0)) for b in LOSSES), key=lambda item: -item[1])
        return [(b, s) for b, s in found[:n] if s > 0]

    def describe(self) -> str:
        """`goodput 93.4% of 6m 52s; lost to redone 12.0 s, startup 9.1 s, detection 4.0 s`."""
        text = f"goodput {self.goodput:.1%} of {duration(self.wall_s)}"
        losses = self.top_losses()
        if losses:
            text += "; lost to " + ", ".join(f"{b} {duration(s)}" for b, s in losses)
        lost = [f["steps_lost"] for f in self.faults if f.get("steps_lost") is not None]
        if lost:
            text += f"; {len(lost)} fault(s), {sum(lost)} step(s) redone"
        return text

    def to_hash(self) -> dict[str, str]:
        return {"buckets": json.dumps({b: round(self.buckets.get(b, 0.0), 6) for b in BUCKETS}),
                "goodput": repr(round(self.goodput, 6)), "wall_s": repr(round(self.wall_s, 6)),
                "faults": json.dumps(self.faults), "updated_at": repr(self.updated_at),
                "last_step": str(self.last_step), "state": self.state or "",
                "attempt": "" if self.attempt is None else str(self.attempt),
                "origin": "" if self.origin is None else repr(self.origin), "paused_s": repr(self.paused_s),
                "accounted_to": "" if self.accounted_to is None else repr(self.accounted_to)}

    @classmethod
    def from_hash(cls, raw: dict[Any, Any]) -> GoodputSummary:
        d = {_text(k): _text(v) for k, v in raw.items()}
        return cls(buckets={b: float(s) for b, s in json.loads(d.get("buckets", "{}")).items()},
                   faults=json.loads(d.get("faults", "[]")), updated_at=float(d.get("updated_at") or 0.0),
                   last_step=int(d.get("last_step") or 0), state=d.get("state") or None,
                   attempt=int(d["attempt"]) if d.get("attempt") else None,
                   origin=float(d["origin"]) if d.get("origin") else None,
                   paused_s=float(d.get("paused_s") or 0.0),
                   accounted_to=float(d["accounted_to"]) if d.get("accounted_to") else None)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> GoodputSummary:
        """From the journal's copy (dataclasses.asdict of one); fields it lacks take their defaults."""
        return cls(**{k: d[k] for k in cls.__dataclass_fields__ if d.get(k) is not None})


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def duration(seconds: float) -> str:
    """12.3 s, 6m 52s, 2h 03m."""
    if seconds < 60:
        return f"{seconds:.1f} s"
    minutes, secs = divmod(round(seconds), 60)
    if minutes < 60:
        return f"{minutes}m {secs:02d}s"
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h {minutes:02d}m"


def write_summary(client: Any, job: str, summary: GoodputSummary) -> None:
    client.hset(keys.job_goodput_key(job), mapping=summary.to_hash())


def read_summary(client: Any, job: str) -> GoodputSummary | None:
    raw = client.hgetall(keys.job_goodput_key(job))
    return GoodputSummary.from_hash(raw) if raw else None


def delete_summary(client: Any, job: str) -> None:
    client.delete(keys.job_goodput_key(job), keys.job_goodput_detail_key(job))


def write_detail(client: Any, job: str, detail: dict[str, Any]) -> None:
    client.set(keys.job_goodput_detail_key(job), json.dumps(detail))


def read_detail(client: Any, job: str) -> dict[str, Any]:
    raw = client.get(keys.job_goodput_detail_key(job))
    return json.loads(raw) if raw else {}
