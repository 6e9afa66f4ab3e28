"""The job's journal: what happened, kept beside its checkpoints, for the report and TensorBoard.

The job record in Redis is bounded and lives as long as its Redis; the journal is a few
append-only files in the job's directory (`<output_dir>/<job>/journal/`) that outlive both, are
readable without any server, and are appended to by every controller that runs the job (a
SIGTERM and a rerun, a controller restarted after its death):

    steps.jsonl    one line per step record of the lowest rank, every attempt's (a step redone
                   after a fault appears again, under its new attempt): the step ledger's fields
                   (end, seconds, checkpoint_s, snapshot_s, data_s) and the step's metrics (loss,
                   grad_norm, lr, tokens, tokens_per_s, mfu, step_time_s, data_wait_s,
                   memory_bytes; absent for a step whose data was skipped)
    events.jsonl   one line per state change and event, in the job record's shape: {"at",
                   "attempt", "type": "transition" | kind, "reason", "to" (transitions), ...}
    goodput.json   the newest goodput summary (buckets of wall seconds, faults)

Writing is best effort: a full disk must not stop the job (the job record and metrics still
say what happened), so a failed write is logged once per file and retried with the next line.
The controller writes, torch-free; `read_journal` is what the report and tests read.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from longrun.safe_files import open_append, replace_file

log = logging.getLogger(__name__)

STEPS, EVENTS, GOODPUT = "steps.jsonl", "events.jsonl", "goodput.json"


def journal_dir(run_dir: str | os.PathLike) -> Path:
    return Path(run_dir) / "journal"


class JournalWriter:
    """Appends to one job's journal; every method is best effort (see the module's doc)."""

    def __init__(self, run_dir: str | os.PathLike):
        self.dir = journal_dir(run_dir)
        self._failed: set[str] = set()

    def step(self, attempt: int, record: dict[str, Any]) -> None:
        self._append(STEPS, [{"attempt": attempt, **record}])

    def steps(self, attempt: int, records: list[dict[str, Any]]) -> None:
        self._append(STEPS, [{"attempt": attempt, **r} for r in records])

    def event(self, entry: dict[str, Any]) -> None:
        self._append(EVENTS, [entry])

    def goodput(self, summary: dict[str, Any]) -> None:
        def write() -> None:  # a reader never sees half a summary; a planted link is replaced
            replace_file(self.dir / GOODPUT, json.dumps(summary), sync=False)
        self._guard(GOODPUT, write)

    def _append(self, name: str, entries: list[dict[str, Any]]) -> None:
        if not entries:
            return

        def write() -> None:
            with open_append(self.dir / name) as f:  # never through a link planted in the run dir
                f.write("".join(json.dumps(e, default=str) + "\n" for e in entries))
        self._guard(name, write)

    def _guard(self, name: str, write) -> None:
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
            write()
            self._failed.discard(name)
        except OSError as exc:
            if name not in self._failed:
                self._failed.add(name)
                log.warning("journal %s not written (%s); the job goes on", self.dir / name, exc)


@dataclass
class Journal:
    """A job's journal as read back: steps and events in the order written."""

    run_dir: Path
    steps: list[dict[str, Any]] = field(default_factory=list)
    events: list[dict[str, Any]] = field(default_factory=list)
    goodput: dict[str, Any] | None = None

    @property
    def empty(self) -> bool:
        return not self.steps and not self.events


def _lines(path: Path) -> list[dict[str, Any]]:
    """The JSON lines of `path`; a torn last line (a controller killed mid-write) is skipped."""
    if not path.exists():
        return []
    out = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return out


def newest_trained_step(run_dir: str | os.PathLike) -> int:
    """The newest step with a loss in the journal (0: none): where a rerun's curves go on from."""
    return max((int(r["step"]) for r in _lines(journal_dir(run_dir) / STEPS) if r.get("loss") is not None),
               default=0)


def read_journal(run_dir: str | os.PathLike) -> Journal:
    d = journal_dir(run_dir)
    goodput = None
    if (d / GOODPUT).exists():
        try:
            goodput = json.loads((d / GOODPUT).read_text())
        except json.JSONDecodeError:
            goodput = None
    return Journal(Path(run_dir), _lines(d / STEPS), _lines(d / EVENTS), goodput)
