"""One holder at a time for a directory: an exclusive flock(2) on a file in it, the holder's
name written inside.

flock is released by the kernel when its holder dies, however it dies, so a SIGKILLed holder
never leaves a stale lock; the file it leaves holds only the last holder's name, which the next
holder writes over. The file is opened without following links (`safe_files.open_lock`): it
lives in directories others may write, and a link planted there would have the holder truncate
the file it points to. A holder that removes the file when done (`release`) opens a race:
another process may have opened the old file just before and locks it just after, holding a
lock on a name that no longer exists. So whoever gets the lock checks that the path still names
the file it locked, and otherwise tries again on the new one.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os

from longrun.safe_files import open_lock, open_regular_file

# errnos with which a file system says it does not do flock (Lustre without -o flock, some FUSE).
NO_LOCKS = frozenset({errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL})


class LockHeld(Exception):
    """Another process holds the lock; `holder` is what it wrote in the file ('' if nothing yet)."""

    def __init__(self, path: str | os.PathLike, holder: str):
        super().__init__(f"{path} is held by {holder or 'a process that has not written its name yet'}")
        self.holder = holder


def holder_of(fd: int, limit: int = 4096) -> str:
    """What the lock file's holder wrote in it ('' when nothing, or unreadable)."""
    with contextlib.suppress(OSError):
        return os.pread(fd, limit, 0).decode("utf-8", errors="replace").strip()
    return ""


def held_by(path: str | os.PathLike) -> str | None:
    """What the holder of `path`'s lock wrote in it ('' if nothing yet) while one holds it; None
    when nobody does, there is no such file, or the file system has no locks. It only looks:
    nothing is created, written or removed. The look is a shared lock tried and let go at once,
    so a `take` at that very moment may find it held (one of two starting at once is refused
    either way). `safe_files.UnsafePath` when `path` is a link or not a regular file."""
    try:
        f = open_regular_file(path)
    except FileNotFoundError:
        return None
    with f:
        try:
            fcntl.flock(f.fileno(), fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return holder_of(f.fileno())
        except OSError as exc:
            if exc.errno in NO_LOCKS:
                return None
            raise
    return None  # closing the file let go of the shared lock


def take(path: str | os.PathLike, name: str) -> int:
    """Lock `path` (created when missing) without waiting, and write `name` in it. Returns the
    descriptor: the lock lasts while it is open. LockHeld when another process holds it;
    `safe_files.UnsafePath` when `path` is a link or not a regular file; an OSError whose errno
    is in NO_LOCKS where the file system has no locks."""
    while True:
        fd = open_lock(path)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            held = LockHeld(path, holder_of(fd))
            os.close(fd)
            raise held from None
        except BaseException:
            os.close(fd)
            raise
        if _names(path, fd):
            break
        os.close(fd)  # removed or replaced between our open and our lock: lock the new one
    try:
        os.ftruncate(fd, 0)
        os.pwrite(fd, name.encode("utf-8"), 0)
        os.fsync(fd)  # a reader on another host of a shared file system sees the name
    except BaseException:
        release(fd, path)
        raise
    return fd


def release(fd: int, path: str | os.PathLike) -> None:
    """Remove the lock file while still holding it (no one can have locked it in between), if
    the path still names it, then let go."""
    try:
        if _names(path, fd):
            with contextlib.suppress(OSError):
                os.unlink(path)
    finally:
        os.close(fd)


def _names(path: str | os.PathLike, fd: int) -> bool:
    """Whether `path` is the very file open as `fd`."""
    try:
        here = os.stat(path, follow_symlinks=False)
    except FileNotFoundError:
        return False
    mine = os.fstat(fd)
    return (here.st_dev, here.st_ino) == (mine.st_dev, mine.st_ino)
