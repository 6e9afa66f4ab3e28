"""Run a command so that everything it starts dies with the process that started it.

    python -I .../longrun/services/sentinel.py COMMAND [ARGS...]    (standard library only)

`ManagedProcess` starts a server in a session of its own with a parent-death signal, which
reaches only the process it started. That is enough for a single process (redis-server); a
`ray start --head --block` spawns a GCS, a raylet, agents and workers, and when longrun is
SIGKILLed some of them (the dashboard and runtime-env agents) outlive it by minutes. This
sentinel is the session's leader instead: it runs the command as its child, and when longrun
dies (the parent-death signal, SIGTERM, is handled here) or the command ends, it stops every
other process of its session: SIGTERM, a short grace, then SIGKILL.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

GRACE_S = 3.0


def _session() -> list[int]:
    """The other live processes of this session (Linux /proc)."""
    me, sid, found = os.getpid(), os.getsid(0), []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == me:
            continue
        try:
            # Fields after the parenthesised command name: state ppid pgrp session ...
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if int(fields[3]) == sid and fields[0] != "Z":
            found.append(int(entry.name))
    return found


PARENT_ENV = "LONGRUN_SENTINEL_PARENT"  # the pid that started the sentinel


def _signal(pids: list[int], sig: int) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, sig)


def stop_session(grace_s: float = GRACE_S) -> None:
    _signal(_session(), signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while _session() and time.monotonic() < deadline:
        time.sleep(0.05)  # processes exiting on their own: nothing to wait on but /proc
    _signal(_session(), signal.SIGKILL)


def main(argv: list[str]) -> int:
    if not argv:
        print("usage: python -I sentinel.py COMMAND [ARGS...]", file=sys.stderr)
        return 2
    def on_term(signum: int, frame: object) -> None:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # the session-wide SIGTERM reaches us too
        stop_session()
        os._exit(128 + signum)

    # The handler first, then the check, then the command: longrun dying at any moment of the
    # start-up (its parent-death SIGTERM) takes down whatever has started by then.
    signal.signal(signal.SIGTERM, on_term)
    parent = os.environ.get(PARENT_ENV)
    if parent is not None and os.getppid() != int(parent):  # died before prctl took effect
        return 1
    child = subprocess.Popen(argv)
    code = child.wait()
    stop_session()  # whatever the command left behind
    return code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
