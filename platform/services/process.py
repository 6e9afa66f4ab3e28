"""Child server processes that never outlive longrun.

Each server runs in its own session (so one signal reaches it and everything it spawned)
and, on Linux, with a parent-death signal (so even a SIGKILLed longrun takes it down). A
server that spawns a tree of its own (the Ray head) runs under `sentinel.py`, which takes its
whole session down when longrun dies.
`stop()` is polite first (SIGTERM to the group), then firm (SIGKILL), and is registered
with atexit so an interpreter that exits without calling it still cleans up.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import os
import select
import signal
import subprocess
import sys
import tempfile
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from pathlib import Path

_PR_SET_PDEATHSIG = 1
SENTINEL = Path(__file__).with_name("sentinel.py")
_live: weakref.WeakSet[ManagedProcess] = weakref.WeakSet()
_live_lock = threading.Lock()


class ServiceError(RuntimeError):
    """A server could not be started, or died; the message says what to do."""


def _die_with_parent(sig: int = signal.SIGKILL) -> None:  # runs in the child between fork and exec
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, sig, 0, 0, 0)


def _sentinel_with_parent() -> None:
    _die_with_parent(signal.SIGTERM)  # the sentinel's handler stops its session, then exits


class ManagedProcess:
    """A server subprocess in its own process group, logged to a file, stopped for sure.

    Start it from a long-lived thread: Linux delivers the parent-death signal when the
    *thread* that forked the child exits.
    """

    def __init__(self, name: str, argv: Sequence[str], log_path: Path, env: dict | None = None, *,
                 tree: bool = False):
        """`tree`: the server spawns processes of its own; run it under the sentinel, so they
        all die with longrun (see sentinel.py)."""
        self.name = name
        self.argv = list(argv)
        self.log_path = log_path
        self._log = open(log_path, "ab")  # noqa: SIM115 - closed in stop()
        # The sentinel is stdlib only, run by path in isolated mode: any interpreter runs it,
        # with or without longrun installed.
        launch = [sys.executable, "-I", str(SENTINEL), *self.argv] if tree else self.argv
        self.proc = subprocess.Popen(
            launch,
            stdin=subprocess.DEVNULL,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            preexec_fn=_sentinel_with_parent if tree else _die_with_parent,
            # The sentinel checks it still has this parent once its handler is in place.
            env={**(os.environ if env is None else env), "LONGRUN_SENTINEL_PARENT": str(os.getpid())}
            if tree else env,
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
        kill_until_gone(lambda: pids_in_session(self.proc.pid), timeout_s=grace_s)
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


def kill_until_gone(find: Callable[[], list[int]], timeout_s: float = 10.0) -> list[int]:
    """SIGKILL what `find()` returns and wait for each to exit, until `find()` returns nothing.

    A SIGKILLed process lives on while the kernel tears it down (a raylet with a large address
    space takes a moment), and one that was forking as the signal landed leaves a child the
    first pass did not see: one pass of `kill_pids` can return with both still listed. Waits on
    each process's pidfd (readable when it exits), so no polling. Returns what was still alive
    at the deadline (empty when all went)."""
    deadline = time.monotonic() + timeout_s
    while pids := find():
        if time.monotonic() >= deadline:
            return pids
        for pid in pids:
            _kill_and_wait(pid, deadline)
    return []


def _kill_and_wait(pid: int, deadline: float) -> None:
    try:
        fd = os.pidfd_open(pid)
    except (ProcessLookupError, PermissionError):
        return  # gone already, or not ours to kill
    except OSError:  # no pidfds (old kernel): signal and let the caller's next pass look again
        kill_pids([pid])
        return
    try:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            signal.pidfd_send_signal(fd, signal.SIGKILL)
        select.select([fd], [], [], max(0.0, deadline - time.monotonic()))
    finally:
        os.close(fd)


class EmbeddedServer:
    """A server binary on a loopback port, in a private temporary directory, stopped for sure.

    Subclasses write their files in `_prepare(workdir)` (once), start the process for
    `self.port` in `_launch(workdir)`, check it serves in `_wait_ready()`, and may ask it to
    shut down cleanly in `_shutdown()` before `stop()` makes sure it is gone."""

    name = "server"
    retry_grace_s = 1.0  # stopping a try that never became ready

    def __init__(self, *, host: str, port: int | None, start_timeout_s: float):
        if port is not None and not 0 < port < 65536:
            raise ValueError(f"port must be between 1 and 65535 (or None for a free one), got {port}")
        self.host, self.requested_port, self.start_timeout_s = host, port, start_timeout_s
        self.port: int | None = None
        self.process: ManagedProcess | None = None
        self._workdir: tempfile.TemporaryDirectory | None = None

    def _prepare(self, workdir: Path) -> None:
        pass

    def _launch(self, workdir: Path) -> ManagedProcess:
        raise NotImplementedError

    def _wait_ready(self) -> None:
        raise NotImplementedError

    def _shutdown(self) -> None:
        pass

    def start(self):
        from longrun.services.ports import free_port

        self._workdir = tempfile.TemporaryDirectory(prefix=f"longrun-{self.name}-")
        workdir = Path(self._workdir.name)
        self._prepare(workdir)
        # A clash on a port picked a moment ago is possible; pick again, a few times.
        attempts = 1 if self.requested_port else 3
        last_error = ""
        for _ in range(attempts):
            self.port = self.requested_port or free_port(self.host)
            self.process = self._launch(workdir)
            try:
                self._wait_ready()
                return self
            except ServiceError as exc:
                last_error = str(exc)
                self.process.stop(grace_s=self.retry_grace_s)
        self.port = None
        raise ServiceError(last_error)

    def stop(self) -> None:
        if self.process is not None:
            if self.process.alive():
                self._shutdown()
            self.process.stop()
            self.process = None
        if self._workdir is not None:
            self._workdir.cleanup()
            self._workdir = None
        self.port = None

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
