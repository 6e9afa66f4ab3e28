"""Writing into directories that others may share, without writing through what they planted.

A directory longrun writes to may be writable by other users: `data prepare`'s --out on a team's
scratch space, a job's output directory, an export's target in /tmp. A name longrun writes at a
fixed path (`.prepare.lock`, `manifest.json.tmp`, `events.jsonl`) can be created there in advance
as a symbolic link to a file of the victim's, and `open(path, "w")` follows the link and
truncates that file. So, here:

- a temporary file is created afresh, never opened when something is already there
  (O_CREAT | O_EXCL | O_NOFOLLOW: `create`), after a stale one is removed (`fresh`; unlink
  removes a link itself, never its target);
- a file replaced whole is written to a new randomly named file beside it and renamed over it
  (`replace_file`): rename(2) replaces a planted link, it never writes through one;
- a file appended to or locked is opened with O_NOFOLLOW and must be a regular file
  (`open_append`, `open_lock`); O_NONBLOCK keeps a planted FIFO from blocking the open.

Anything refused raises `UnsafePath` (an OSError, so best-effort writers keep going).
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
import tempfile
from pathlib import Path
from typing import IO

_NEW = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC


class UnsafePath(OSError):
    """A path longrun writes to is a symbolic link or not a regular file; the message says what to do."""

    def __init__(self, path: str | os.PathLike, what: str = "a symbolic link or not a regular file"):
        super().__init__(f"{path} is {what}; remove it and run again (longrun does not write through "
                         "links or into special files)")
        self.path = str(path)


def umask() -> int:
    """This process's umask, read without changing it (os.umask would race other threads)."""
    with contextlib.suppress(OSError, ValueError), open("/proc/self/status", encoding="ascii") as f:
        for line in f:
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    return 0o022


def create(path: str | os.PathLike, *, text: bool = False, mode: int = 0o666) -> IO:
    """A new file at `path`, open for writing; FileExistsError when anything (a link included) is there."""
    fd = os.open(path, _NEW, mode)  # O_EXCL: a link at `path`, even a dangling one, is EEXIST
    return os.fdopen(fd, "w" if text else "wb", **({"encoding": "utf-8"} if text else {}))


def fresh(path: str | os.PathLike, *, text: bool = False) -> IO:
    """`create` after removing whatever an interrupted run (or someone else) left at `path`."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
    return create(path, text=text)


def replace_file(path: str | os.PathLike, data: bytes | str, *, sync: bool = True) -> None:
    """Write `data` to `path` as a whole: a reader sees the old file or the new one, never half,
    and a link planted at `path` is replaced, not written through."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        os.fchmod(fd, 0o666 & ~umask())  # mkstemp's 0600 would make the file private
        with os.fdopen(fd, "wb") as f:
            f.write(data.encode("utf-8") if isinstance(data, str) else data)
            if sync:
                f.flush()
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def remove_stale_temps(directory: str | os.PathLike) -> list[str]:
    """Remove what `replace_file` left in `directory` when its process was killed between
    writing and renaming (`.NAME.XXXXXXXX.tmp`). Only for a directory no one else is writing
    now (its writer's lock held); returns the names removed."""
    removed = []
    for entry in os.scandir(directory):
        name = entry.name
        if name.startswith(".") and name.endswith(".tmp") and name.count(".") >= 3 and \
                entry.is_file(follow_symlinks=False):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(entry.path)
                removed.append(name)
    return removed


def _open_regular(path: str | os.PathLike, flags: int, mode: int) -> int:
    try:
        fd = os.open(path, flags | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, mode)
    except OSError as exc:
        if exc.errno == errno.ELOOP:  # a symbolic link at `path`
            raise UnsafePath(path) from None
        raise
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise UnsafePath(path)
    os.set_blocking(fd, True)
    return fd


def open_lock(path: str | os.PathLike, mode: int = 0o644) -> int:
    """A descriptor of the lock file `path` (created when missing), read-write; UnsafePath when
    it is a link or not a regular file."""
    return _open_regular(path, os.O_RDWR | os.O_CREAT, mode)


def open_append(path: str | os.PathLike) -> IO:
    """`path` opened to append text (created when missing); UnsafePath when it is a link or not
    a regular file."""
    fd = _open_regular(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o666)
    return os.fdopen(fd, "a", encoding="utf-8")
