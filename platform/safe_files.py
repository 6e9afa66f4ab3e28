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

Reading what others wrote (a checkpoint directory, a Hugging Face model directory) has its own
traps: a name taken from a file (a manifest's list, an index's `weight_map`) may climb out of
its directory (`../`, `/etc/...`: `checked_member_name` refuses it), and a FIFO blocks its
reader forever while a device such as /dev/zero never ends; a link planted where a file of the
directory belongs leads to either. So such files are opened with `open_regular_file`: no link
at the name unless the caller allows one (O_NOFOLLOW), and only a regular file (O_NONBLOCK so a
FIFO cannot block the open, then fstat).

Anything refused raises `UnsafePath` (an OSError, so best-effort writers keep going), or
`UnsafeName` (a ValueError) for a name.
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


_WRITE_REMEDY = "remove it and run again (longrun does not write through links or into special files)"
_READ_REMEDY = "put the file itself there (longrun reads only regular files, never through a link)"


class UnsafePath(OSError):
    """A path longrun writes to or reads is a symbolic link or not a regular file; the message
    says what to do."""

    def __init__(self, path: str | os.PathLike, what: str = "a symbolic link or not a regular file",
                 remedy: str = _WRITE_REMEDY):
        super().__init__(f"{path} is {what}; {remedy}")
        self.path = str(path)


class UnsafeName(ValueError):
    """A file name read from a file (a manifest, an index) that would lead out of its directory."""


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


def _open_regular(path: str | os.PathLike, flags: int, mode: int = 0, *, follow_links: bool = False,
                  refusal: tuple[str, str] = ("a symbolic link or not a regular file", _WRITE_REMEDY)) -> int:
    nofollow = 0 if follow_links else os.O_NOFOLLOW
    try:
        fd = os.open(path, flags | nofollow | os.O_NONBLOCK | os.O_CLOEXEC, mode)
    except OSError as exc:
        if exc.errno == errno.ELOOP and not follow_links:  # a symbolic link at `path`
            raise UnsafePath(path, *refusal) from None
        raise
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise UnsafePath(path, *refusal)
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


def open_regular_file(path: str | os.PathLike, *, follow_links: bool = False) -> IO[bytes]:
    """`path` opened to read (binary, unbuffered), refused with UnsafePath unless it is a
    regular file: never a FIFO (whose open or read would wait for a writer forever) nor a device
    (/dev/zero never ends), and, unless `follow_links`, never a symbolic link at `path` itself.
    FileNotFoundError as open() raises it."""
    st = os.stat(path, follow_symlinks=follow_links)  # before the open: a device is never opened
    what = ("a FIFO, socket or device, not a regular file" if follow_links
            else "a symbolic link, FIFO or device, not a regular file")
    if not stat.S_ISREG(st.st_mode):
        raise UnsafePath(path, what, _READ_REMEDY)
    fd = _open_regular(path, os.O_RDONLY, follow_links=follow_links, refusal=(what, _READ_REMEDY))
    return os.fdopen(fd, "rb", buffering=0)


def read_regular_file(path: str | os.PathLike, *, follow_links: bool = False) -> bytes:
    """The whole of `path`, opened as `open_regular_file` opens it."""
    with open_regular_file(path, follow_links=follow_links) as f:
        return f.read()


def checked_member_name(name: object, directory: str | os.PathLike, listed_in: str | os.PathLike) -> str:
    """`name`, read from the file `listed_in` (a manifest's list of files, an index's weight
    map), when it is a plain file name in `directory`; UnsafeName when it could lead anywhere
    else: a '/' (an absolute path, or one into another directory), '..', '.', '' or a NUL."""
    if isinstance(name, str) and name not in ("", ".", "..") and "/" not in name and "\0" not in name:
        return name
    raise UnsafeName(f"{listed_in} names the file {name!r}, which is not a plain file name in "
                     f"{directory} (a '/', '..' or an absolute path leads out of it); {listed_in} was "
                     "damaged or tampered with: restore it from a good copy")
