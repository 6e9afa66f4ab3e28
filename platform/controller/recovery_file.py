"""The recovery policy's memory, kept in the checkpoint root beside the fences.

    <root>/recovery.json   {"job": "...", "restarts_total": 3, "restarts": [...],
                            "evicted": {"node id": "why"}, "skips": [[12, 12]]}

The policy decides from what the job record in Redis holds: how many restarts the job spent
(its budget), the recent restarts (the storm and repeat rules), the nodes it evicted and the
data windows it skips. `longrun run`'s embedded Redis keeps nothing once it stops, and any
Redis without persistence forgets on a restart, so running the same command again would start
with a fresh budget, place on an evicted node and replay a poison window. So the controller
writes them here after every decision that changes them (one small JSON object, replaced
whole: `layout.replace_file`), and a controller that finds no record of its job in Redis
reads them back before it places anything. A job that ends SUCCEEDED or FAILED forgets them,
as its record in Redis is reset then: its name starts afresh. The file names its job: another
job given the same root does not inherit it.
"""

from __future__ import annotations

import contextlib
import json
import logging
from dataclasses import asdict, dataclass, field
from typing import Any

import fsspec

from longrun.checkpoint.layout import replace_file
from longrun.checkpoint.stored import read_stored
from longrun.controller.job_state import JobRecordStore

log = logging.getLogger(__name__)

RECOVERY_FILE = "recovery.json"


@dataclass(frozen=True)
class RecoveryMemory:
    job: str
    restarts_total: int = 0  # every restart the job carried out: what its budget counts
    restarts: list[dict[str, Any]] = field(default_factory=list)  # the kept history, oldest first
    evicted: dict[str, str] = field(default_factory=dict)  # node id -> why it was evicted
    skips: list[tuple[int, int]] = field(default_factory=list)  # [first, last] steps not trained on

    @property
    def empty(self) -> bool:
        return not (self.restarts_total or self.restarts or self.evicted or self.skips)

    def describe(self) -> str:
        windows = ", ".join(f"{a}-{b}" for a, b in self.skips) or "none"
        return (f"{self.restarts_total} restart(s) spent, {len(self.evicted)} node(s) evicted, "
                f"data windows skipped: {windows}")


def _root(url: str) -> tuple[fsspec.AbstractFileSystem, str]:
    fs, root = fsspec.core.url_to_fs(url)
    return fs, root.rstrip("/")


def write_memory(url: str, memory: RecoveryMemory) -> None:
    """Keep `memory` under the checkpoint root at `url` (created when missing)."""
    fs, root = _root(url)
    fs.makedirs(root, exist_ok=True)
    data = asdict(memory) | {"skips": [list(w) for w in memory.skips]}
    replace_file(fs, f"{root}/{RECOVERY_FILE}", json.dumps(data, indent=1).encode())


def read_memory(url: str, job: str) -> RecoveryMemory | None:
    """What `job` kept under the checkpoint root at `url`; None when nothing (or another job's).
    A file that cannot be read is reported and treated as absent: the budget starts afresh."""
    fs, root = _root(url)
    path = f"{root}/{RECOVERY_FILE}"
    try:
        data = json.loads(read_stored(fs, path))  # never through a link or from a FIFO
        memory = RecoveryMemory(
            job=str(data["job"]), restarts_total=int(data["restarts_total"]),
            restarts=[dict(r) for r in data["restarts"]],
            evicted={str(k): str(v) for k, v in data["evicted"].items()},
            skips=sorted((int(a), int(b)) for a, b in data["skips"]))
    except FileNotFoundError:
        return None
    except (OSError, ValueError, TypeError, KeyError, AttributeError) as exc:
        log.warning("%s cannot be read (%s): the restart budget, evicted nodes and skipped data windows "
                    "of earlier runs are not known; starting without them", path, exc)
        return None
    if memory.job != job:
        log.info("%s is job %r's, not %r's: not inherited", path, memory.job, job)
        return None
    return memory


def forget_memory(url: str, job: str) -> None:
    """Remove `job`'s file (a finished job's name starts afresh); another job's stays."""
    if read_memory(url, job) is None:
        return
    fs, root = _root(url)
    with contextlib.suppress(FileNotFoundError):
        fs.rm_file(f"{root}/{RECOVERY_FILE}")


class RecoveryKeeper:
    """The controller's copy of what its job record holds for the policy, kept under the
    checkpoint root at `url`; failures to write or remove it are logged (Redis still has it)."""

    def __init__(self, url: str, record: JobRecordStore):
        self.url, self.record = url, record

    def keep(self) -> None:
        """Write what the record holds now (after a decision changed it)."""
        record = self.record
        memory = RecoveryMemory(record.job, record.restart_count(), record.restarts(), record.evicted(),
                                record.skips())
        try:
            write_memory(self.url, memory)
        except OSError as exc:  # only a rerun after Redis forgot would miss it
            log.warning("the recovery policy's memory was not written under %s (%s): a rerun with a "
                        "Redis that forgot this job would start with a fresh restart budget", self.url, exc)

    def recall(self) -> RecoveryMemory | None:
        """Put what was kept back into the record (which has none of it); what, or None."""
        memory = read_memory(self.url, self.record.job)
        if memory is None or memory.empty:
            return None
        self.record.restore_policy(memory.restarts_total, memory.restarts, memory.evicted, memory.skips)
        return memory

    def forget(self) -> None:
        try:
            forget_memory(self.url, self.record.job)
        except OSError as exc:
            log.warning("the recovery policy's memory under %s was not removed (%s)", self.url, exc)
