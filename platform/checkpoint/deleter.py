"""Deleting old checkpoints on a thread of their own, so the writer is free for the next save.

Retention removes a step's manifest first, on the writer's thread (from then on the step does not
count as committed, and a crash leaves an uncommitted directory that the next retention sweeps),
and hands the rest to this thread. The rest is the bulk: freeing a multi-GB file took 2.8 s on
this machine's disk, and on an object store every object is a request. A save waiting behind
that would be skipped or wait for nothing it needs.
"""

from __future__ import annotations

import logging
import queue
import threading

import fsspec

log = logging.getLogger(__name__)

_STOP = object()


class BackgroundDeleter:
    """Removes directories handed to `submit`, one after another, on a daemon thread."""

    def __init__(self, fs: fsspec.AbstractFileSystem) -> None:
        self.fs = fs
        self._queue: queue.Queue = queue.Queue()
        self._thread = threading.Thread(target=self._run, name="longrun-ckpt-delete", daemon=True)
        self._thread.start()

    def submit(self, path: str) -> None:
        self._queue.put(path)

    def wait(self, timeout: float | None = None) -> bool:
        """Until everything submitted so far is removed; False if `timeout` ran out first."""
        done = threading.Event()
        self._queue.put(done)
        return done.wait(timeout)

    def close(self, timeout: float | None = None) -> None:
        self._queue.put(_STOP)
        self._thread.join(timeout)

    def _run(self) -> None:
        while (item := self._queue.get()) is not _STOP:
            if isinstance(item, threading.Event):
                item.set()
                continue
            try:
                self.fs.rm(item, recursive=True)
            except FileNotFoundError:
                pass  # a later retention or an attempt's sweep got there first
            except Exception as exc:  # left for the next retention, which sweeps uncommitted dirs
                log.warning("could not delete old checkpoint %s: %s", item, exc)
