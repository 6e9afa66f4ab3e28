"""One `data prepare` per output directory: an exclusive lock on `<out>/.prepare.lock`.

Two runs writing one directory would interleave shards and manifests (each resumes from what
the other half-wrote). The lock is flock(2): the kernel releases it when its holder dies,
however it dies, so a SIGKILLed run never leaves a stale lock; the file left behind holds
nothing but the last holder's name. A clean exit removes the file. Because a file may be
removed between another run's open and its lock, a run that got the lock checks that the
path still names the file it locked, and otherwise tries again on the new one. The lock file
is never opened through a symbolic link (`safe_files.open_lock`): --out may be a shared directory,
and a link planted there would have this run truncate the file it points to.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import socket
from collections.abc import Iterator
from pathlib import Path

from longrun.data.errors import DataError
from longrun.safe_files import UnsafePath, open_lock

LOCK_FILE = ".prepare.lock"


def _holder(fd: int) -> str:
    with contextlib.suppress(OSError):
        text = os.pread(fd, 200, 0).decode("utf-8", errors="replace").strip()
        if text:
            return text
    return "a process that has not written its name yet"


@contextlib.contextmanager
def locked_out_dir(out: Path) -> Iterator[None]:
    """Hold `out`'s lock (creating `out`) for the block; DataError naming the holder if another
    run holds it."""
    out.mkdir(parents=True, exist_ok=True)
    path = out / LOCK_FILE
    while True:
        try:
            fd = open_lock(path)
        except UnsafePath as exc:
            raise DataError(f"{exc}; nothing was written") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _holder(fd)
            os.close(fd)
            raise DataError(f"another `longrun data prepare` ({holder}) is writing {out}: wait for it to "
                            "finish (rerun this command then: it resumes), or give another --out") from None
        try:
            same = os.stat(path).st_ino == os.fstat(fd).st_ino
        except FileNotFoundError:  # removed by the holder that just finished
            same = False
        if same:
            break
        os.close(fd)
    try:
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"pid {os.getpid()} on {socket.gethostname()}\n".encode(), 0)
        yield
    finally:
        # Removed while still held, so no other run can have locked this file in between.
        with contextlib.suppress(OSError):
            os.unlink(path)
        os.close(fd)
