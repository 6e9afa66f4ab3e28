"""Indexes built once and memory-mapped by every other process: where they live, who builds.

A corpus of N documents needs arrays of N entries (document lengths, byte offsets, the chunk
table, each epoch's permutation). Computed on every rank, that is N x 8 bytes per array per
rank, and for the `text` source a parse of the whole file per rank. Instead the first process
to need an index builds it and writes it as a file (`index_file.py`); every other one maps that
file read-only, so the ranks of a node share one copy in the page cache and none holds a
private one.

Where: `<directory of the data>/.longrun-index/` (beside a .jsonl file, inside a prepared
directory). On a shared file system that is once per job (every node finds what the first
built) and once per data set version (the next job, and every restart, reuses it). A hidden
name keeps it out of the directory walks of the text source and `data prepare`. When that
directory cannot be written (read-only data), `$XDG_CACHE_HOME/longrun/index/` (default
`~/.cache/longrun/index/`): once per node. When neither can, the index is computed in memory,
as before, with a warning. An index file already present in any of them is used even when it
cannot be written (an administrator may build it for read-only data).

Who: a build takes an exclusive flock(2) on `<index>.lock`; the other processes block on it
and, once it is released, find the finished file and map it. The kernel releases the lock
when its holder exits however it exits, so a builder that dies leaves no stale lock: the next
waiter finds no file and builds. The wait has no timeout of its own: it ends when the builder
ends, and a builder that hangs is the setup phase's hang ceiling's to catch (it names the
rank). Where the file system refuses locks, every process builds to its own temporary file and
the atomic rename makes the last one win; the contents are identical, so that is only work.
A file that is there but unusable (truncated, another version, a damaged header) is rebuilt.
Nothing is ever deleted: `rm -rf .longrun-index` is safe whenever no job is starting.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import socket
import time
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import numpy as np

from longrun.data.index_file import UnusableIndex, key_sha256, read_index, write_index
from longrun.file_lock import NO_LOCKS, holder_of
from longrun.safe_files import open_lock

logger = logging.getLogger(__name__)

SIDECAR = ".longrun-index"
SUFFIX = ".lri"

Arrays = dict[str, np.ndarray]


def user_cache_dir() -> Path:
    """`$XDG_CACHE_HOME/longrun/index`, by default `~/.cache/longrun/index`."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "longrun" / "index"


class IndexCache:
    """Index files of one data set: `arrays(name, key, build)` maps the index of `key`,
    building it (once, see the module doc) when no usable one exists.

    `directories` are tried in order: the first holding a usable index is read; the first
    that can be written gets a new one. `built` lists the index files this object built
    (what a test counts, and what the log line reports)."""

    def __init__(self, directories: list[Path]):
        self.directories = [Path(d) for d in directories]
        self.built: list[Path] = []

    @classmethod
    def beside(cls, data: str | os.PathLike, explicit: str | os.PathLike | None = None) -> IndexCache:
        """The cache of a data set at `data` (a file: beside it; a directory: inside it), or in
        `explicit` alone when given."""
        if explicit is not None:
            return cls([Path(explicit)])
        data = Path(data).resolve()
        home = data if data.is_dir() else data.parent
        return cls([home / SIDECAR, user_cache_dir()])

    def arrays(self, name: str, key: Mapping[str, Any], build: Callable[[], Arrays]) -> Arrays:
        """The arrays of index `name` built from `key` (anything JSON that names the data and
        how it was indexed), memory-mapped read-only; `build()` computes them when needed."""
        file_name = f"{name}-{key_sha256(key)[:32]}{SUFFIX}"
        for directory in self.directories:
            found = _usable(directory / file_name, key)
            if found is not None:
                return found
        for directory in self.directories:
            with contextlib.ExitStack() as held:
                try:
                    directory.mkdir(parents=True, exist_ok=True)
                    held.enter_context(_locked(directory / (file_name + ".lock")))
                except OSError as exc:  # read-only, not a directory, no permission: the next one
                    logger.debug("cannot keep index %s in %s: %s", name, directory, exc)
                    continue
                return self._build_once(directory / file_name, key, build)
        logger.warning("no writable place for the index %s (tried %s): every process computes it "
                       "in its own memory; make one of them writable", name,
                       ", ".join(str(d) for d in self.directories))
        return build()

    def _build_once(self, path: Path, key: Mapping[str, Any], build: Callable[[], Arrays]) -> Arrays:
        # Under the lock: a process that held it before us may have finished the file.
        found = _usable(path, key, warn=False)  # (a damaged one was named before the lock)
        if found is not None:
            return found
        began = time.monotonic()
        arrays = build()
        try:
            write_index(path, key, arrays)
        except OSError as exc:  # a full disk: this process goes on with what it built
            logger.warning("could not write the index %s (%s); this process keeps it in memory",
                           path, exc)
            return arrays
        self.built.append(path)
        logger.info("built the index %s (%d entries) in %.1f s", path,
                    max((len(a) for a in arrays.values()), default=0), time.monotonic() - began)
        # Served from the file, like every other process: the built arrays are freed.
        return _usable(path, key, warn=False) or arrays


def _usable(path: Path, key: Mapping[str, Any], *, warn: bool = True) -> Arrays | None:
    """The index at `path` if it is there and describes `key` whole; None otherwise."""
    try:
        return read_index(path, key)
    except UnusableIndex as exc:
        if warn:
            logger.warning("the index %s cannot be used (%s): building it again", path, exc)
    except OSError as exc:  # unreadable (permissions): as good as absent
        logger.debug("cannot read the index %s: %s", path, exc)
    return None


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    """An exclusive flock on `path` (created), released on exit; no lock (with a debug line)
    where the file system does not support them. OSError when `path` cannot be created."""
    fd = open_lock(path)  # never through a link planted in the shared data directory
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            logger.info("waiting for %s to finish building %s", _holder(fd), path.with_suffix(""))
            fcntl.flock(fd, fcntl.LOCK_EX)  # blocks until the builder finishes or dies
        except OSError as exc:
            if exc.errno not in NO_LOCKS:
                raise
            logger.debug("no file locks on %s (%s): building without one", path.parent, exc)
        with contextlib.suppress(OSError):  # a name for whoever waits; the lock works without it
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"pid {os.getpid()} on {socket.gethostname()}\n".encode(), 0)
        yield
    finally:
        os.close(fd)  # releases the lock; the file stays (removing it would race a new locker)


def _holder(fd: int) -> str:
    return holder_of(fd) or "another process"
