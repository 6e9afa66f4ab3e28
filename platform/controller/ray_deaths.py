"""Ray's own report of a worker process that died, taken off the console and folded into
longrun's.

When a worker process dies while it runs a task (a rank SIGKILLed, an OOM kill), the raylet
sends the driver an error, and Ray's driver prints it to stdout: "(raylet) A worker died or
was killed while executing a task by an unexpected system error. ... Worker PID: ... Worker
exit type: SYSTEM_ERROR Worker exit detail: ... the OOM killer ...", a paragraph of ids and
guesses. longrun reports the death of a rank in its own words (the fault, the rank's log file
and last lines), so the paragraph reads as a second failure, and since stdout is buffered when
piped it often lands after the job's last line.

`WorkerDeaths` takes those errors from Ray's driver instead of printing them (every other
message Ray sends the driver prints as before) and keeps them for the controller, which drops
the ones of its own ranks (their fault says it) and folds any other into one line.

Ray has no public hook for it: the driver's error thread (`ray._private.worker.
listen_error_messages`) prints through the module's `print_to_stdstream`, which is wrapped
while the job runs. If a Ray upgrade renames it, nothing is wrapped and the paragraph prints as
before (tests/test_user_view_job.py, which SIGKILLs a rank, says so).
"""

from __future__ import annotations

import logging
import re
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from longrun.node_names import NodeNames

log = logging.getLogger(__name__)

_DIED = "A worker died or was killed"
# The fields of the raylet's message, in its order (node_manager.cc): "... Worker PID: 123 ...".
_FIELDS = ("Lease ID", "RayTask ID", "Worker ID", "Node ID", "Worker IP address", "Worker port", "Worker PID",
           "Worker exit type", "Worker exit detail")
_FIELD = re.compile(r"\b(" + "|".join(map(re.escape, _FIELDS)) + r"): ")


@dataclass(frozen=True)
class WorkerDeath:
    """One worker process Ray saw die, as its message tells it (None: not said)."""

    pid: int | None
    node_id: str | None
    address: str | None
    exit_type: str | None
    detail: str  # the exit detail's first sentence

    def line(self, names: NodeNames) -> str:
        """One line for the console, the node named as a person reads it."""
        where = names.name(self.node_id) if self.node_id else self.address or "an unknown node"
        what = ", ".join(x for x in (self.exit_type, self.detail) if x)
        said = f" ({what})" if what else ""
        return f"ray: a worker process (pid {self.pid or '?'}) on {where} died{said}"


def parse_death(message: str) -> WorkerDeath | None:
    """The death Ray's message reports; None when it reports something else."""
    if _DIED not in message:
        return None
    marks = list(_FIELD.finditer(message))
    ends = [m.start() for m in marks[1:]] + [len(message)]
    fields = {m.group(1): message[m.end():end].strip() for m, end in zip(marks, ends, strict=True)}
    pid = fields.get("Worker PID", "")
    detail = " ".join(fields.get("Worker exit detail", "").split())
    return WorkerDeath(pid=int(pid) if pid.isdigit() else None, node_id=fields.get("Node ID") or None,
                       address=fields.get("Worker IP address") or None,
                       exit_type=fields.get("Worker exit type") or None,
                       detail=detail.split(". ", 1)[0].rstrip("."))


class WorkerDeaths:
    """While entered, Ray's worker-death errors to this driver are kept here (`take`) instead of
    printed. Enter it before `ray.init` and leave it after `ray.shutdown` (which stops Ray's
    error thread), or a death reported in between prints as before."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._kept: list[WorkerDeath] = []
        self._module: Any = None
        self._original: Callable[..., None] | None = None

    def __enter__(self) -> WorkerDeaths:
        import ray._private.worker as driver

        original = getattr(driver, "print_to_stdstream", None)
        if original is None:  # a Ray that prints another way: its paragraph shows as before
            log.warning("Ray's driver has no print_to_stdstream; its worker-death messages print unfolded")
            return self
        self._module, self._original = driver, original
        driver.print_to_stdstream = self._print
        return self

    def __exit__(self, *exc: object) -> None:
        if self._module is not None and self._module.print_to_stdstream == self._print:
            self._module.print_to_stdstream = self._original
        self._module = None

    def take(self) -> list[WorkerDeath]:
        """The deaths reported since the last take, oldest first."""
        with self._lock:
            kept, self._kept = self._kept, []
        return kept

    def _print(self, data: dict[str, Any], *args: Any, **kwargs: Any) -> None:
        """Ray's print_to_stdstream: a raylet's worker-death lines kept, the rest printed."""
        lines = data.get("lines") or []
        deaths = [parse_death(line) for line in lines] if data.get("pid") == "raylet" else []
        found = [d for d in deaths if d is not None]
        if found:
            with self._lock:
                self._kept.extend(found)
            lines = [line for line, death in zip(lines, deaths, strict=True) if death is None]
            if not lines:
                return
            data = data | {"lines": lines}
        self._original(data, *args, **kwargs)
