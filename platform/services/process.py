"""Child server processes that never outlive longrun.

Each server runs in its own session (so one signal reaches it and everything it spawned)
and, on Linux, with a parent-death signal (so even a SIGKILLed longrun takes it down).
`stop()` is polite first (SIGTERM to the group), then firm (SIGKILL), and is registered
with atexit so an interpreter that exits without calling it still cleans up.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import os
import signal
import subprocess
import sys
import threading
import weakref
from collections.abc import Sequence
from pathlib import Path

_PR_SET_PDEATHSIG = 1
_live: weakref.WeakSet[ManagedProcess] = weakref.WeakSet()
_live_lock = threading.Lock()


class ServiceError(RuntimeError):
    """A server could not be started, or died; the message says what to do."""


def _die_with_parent() -> None:  # runs in the child between fork and exec
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)


class ManagedProcess:
    """A server subprocess in its own process group, logged to a file, stopped for sure.

    Start it from a long-lived thread: Linux delivers the parent-death signal when the
    *thread* that forked the child exits.
    """

    def __init__(self, name: str, argv: Sequence[str], log_path: Path, env: dict | None = None):
        self.name = name
        self.argv = list(argv)
        self.log_path = log_path
        self._log = open(log_path, "ab")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            self.argv,
            stdin=subprocess.DEVNULL,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            preexec_fn=_die_with_parent,
            env=env,
        )
        with _live_lock:
            _live.add(self)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc.poll() is None

    def log_tail(self, lines: int = 20) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return ""
        return "\n".join(text.splitlines()[-lines:])

    def stop(self, grace_s: float = 5.0) -> int | None:
        """Stop the whole process group; returns the exit code of the leader."""
        if self.proc.poll() is None:
            self._signal_group(signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout=grace_s)
        # Children that ignored SIGTERM, or that the leader left behind (possibly in another
        # process group of the same session), get SIGKILL.
        self._signal_group(signal.SIGKILL)
        kill_pids(pids_in_session(self.proc.pid))
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=grace_s)
        with _live_lock:
            _live.discard(self)
        if not self._log.closed:
            self._log.close()
        return self.proc.returncode

    def _signal_group(self, sig: int) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, sig)


@atexit.register
def _stop_all() -> None:
    with _live_lock:
        procs = list(_live)
    for proc in procs:
        proc.stop(grace_s=2.0)


def _proc_entries():
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and int(entry.name) != os.getpid():
            yield entry


def pids_in_session(sid: int) -> list[int]:
    """Live processes whose session id is `sid` (Linux /proc; empty elsewhere)."""
    found = []
    for entry in _proc_entries() if Path("/proc").is_dir() else ():
        try:
            # Fields after the parenthesised command name: state ppid pgrp session ...
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if int(fields[3]) == sid and fields[0] != "Z":
            found.append(int(entry.name))
    return found


def pids_mentioning(text: str) -> list[int]:
    """Processes whose command line contains `text` (Linux /proc; empty elsewhere)."""
    found = []
    for entry in _proc_entries() if Path("/proc").is_dir() else ():
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if text in cmdline:
            found.append(int(entry.name))
    return found


def kill_pids(pids: list[int]) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)
