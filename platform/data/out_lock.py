"""One `data prepare` per output directory: an exclusive lock on `<out>/.prepare.lock`.

Two runs writing one directory would interleave shards and manifests (each resumes from what
the other half-wrote). The lock is `file_lock`'s flock(2): a SIGKILLed run never leaves a stale
lock, and the file holds nothing but the holder's name. A clean exit removes the file. The lock
file is never opened through a symbolic link: --out may be a shared directory.
"""

from __future__ import annotations

import contextlib
import os
import socket
from collections.abc import Iterator
from pathlib import Path

from longrun import file_lock
from longrun.data.errors import DataError
from longrun.safe_files import UnsafePath

LOCK_FILE = ".prepare.lock"


@contextlib.contextmanager
def locked_out_dir(out: Path) -> Iterator[None]:
    """Hold `out`'s lock (creating `out`) for the block; DataError naming the holder if another
    run holds it."""
    out.mkdir(parents=True, exist_ok=True)
    path = out / LOCK_FILE
    try:
        fd = file_lock.take(path, f"pid {os.getpid()} on {socket.gethostname()}\n")
    except UnsafePath as exc:
        raise DataError(f"{exc}; nothing was written") from None
    except file_lock.LockHeld as held:
        holder = held.holder or "a process that has not written its name yet"
        raise DataError(f"another `longrun data prepare` ({holder}) is writing {out}: wait for it to "
                        "finish (rerun this command then: it resumes), or give another --out") from None
    try:
        yield
    finally:
        file_lock.release(fd, path)
