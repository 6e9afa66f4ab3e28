"""One node's keeper of peer memory snapshots: the blobs of the ranks that send to it.

    keeper.put_chunk(rank, step, offset, chunk, nbytes, digest)   # a send, one chunk a call
    keeper.describe(rank, step); keeper.get_chunk(rank, step, offset, n)   # a restore, likewise
    keeper.holdings()                                             # rank -> the steps complete

A snapshot arrives a chunk at a time (`worker/snapshot_transfer.py`), from many ranks at once:
`Keepers` makes this a threaded Ray actor (`THREADS`), each call copying its chunk into the
rank's buffer outside the lock, so ranks' sends (and a node's two keepers' shares of them) do
not queue behind one another. No call depends on another's order: the first chunk of a step
to arrive opens its buffer, the last one completes it; only complete snapshots are listed.

It holds the last `KEEP_STEPS` snapshots each rank sent, by arrival, not by step number (after
a rollback the new path's steps are lower): when a rank's next snapshot starts to arrive the
oldest goes, so the newest complete one survives while the next is sent, and no more than
KEEP_STEPS buffers per rank exist at once (what the host budget counts, `checkpoint/memory.py`).
A chunk of an older step than one the rank already sent belongs to a send it abandoned (timed
out) and is ignored. Plain class; numpy only (no torch: the controller imports this module).

A keeper outlives the controller that started it (a detached Ray actor, in a namespace of its
own so that the next controller of the job finds it by name: `controller/keepers.py`): the
snapshots of a job whose controller was killed are restored by its next one. It carries a `tag`
(the job's identity and layout) that the next controller checks before it trusts them. One no
controller has called for `orphan_after_s` ends itself: a killed controller that is never rerun
must not leave every node holding a state's worth of memory.

Each snapshot's buffer is a mapping of its own (`_buffer`), handed back to the system when the
snapshot is dropped. From the heap, a rank's part below glibc's largest mmap threshold (32 MiB)
lands in one of the 32 serving threads' arenas, whose freed holes are kept and rarely fit the
next buffer: the quick soak's keepers (16 MiB parts) grew 410 -> 671 MiB in 4 minutes.
"""

from __future__ import annotations

import logging
import mmap
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

KEEP_STEPS = 2  # per rank: the newest complete snapshot survives while the next is sent
THREADS = 32  # calls a keeper serves at once: chunks of every rank sending to it
KEEPER_NAMESPACE = "longrun-keepers"  # Ray namespace of the keepers: every controller's driver finds them

log = logging.getLogger(__name__)


def _buffer(nbytes: int) -> np.ndarray:
    """`nbytes` of memory that go back to the system when the array is dropped (see above)."""
    if nbytes == 0:
        return np.empty(0, dtype=np.uint8)
    return np.frombuffer(mmap.mmap(-1, nbytes), dtype=np.uint8)


def keeper_name(job: str, node_id: str) -> str:
    """The keeper's Ray actor name on a node: what the controller starts it as, and what the
    ranks look it up by (their own node's first when restoring)."""
    return f"longrun-{job}-keeper-{node_id[:16]}"


@dataclass
class _Receiving:
    step: int
    digest: str
    buf: np.ndarray
    offsets: set[int] = field(default_factory=set)  # chunks taken (a repeat is ignored)
    received: int = 0


class SnapshotKeeper:
    """`tag`: what the snapshots it holds are of (see the module docstring); `orphan_after_s`:
    end the process after this long without a call (None: never). `clock`, and `end` (how the
    process ends): for tests."""

    def __init__(self, tag: str = "", orphan_after_s: float | None = None,
                 clock: Callable[[], float] = time.monotonic, end: Callable[[int], Any] = os._exit) -> None:
        self._lock = threading.Lock()
        self._held: dict[int, dict[int, tuple[np.ndarray, str]]] = {}  # rank -> step -> (blob, digest)
        self._receiving: dict[int, _Receiving] = {}  # rank -> its send in flight (one at most)
        self._tag, self._clock, self._end = tag, clock, end
        self._contact = clock()  # the last call's time
        self._stop = threading.Event()
        if orphan_after_s is not None:
            threading.Thread(target=self._watch, args=(orphan_after_s,), daemon=True,
                             name="longrun-keeper-orphan").start()

    def touch(self) -> str:
        """A controller's call that it still holds this keeper; the keeper's tag."""
        self._contact = self._clock()
        return self._tag

    def retag(self, tag: str) -> None:
        """The snapshots from now on are of `tag` (a layout change, with everything held dropped)."""
        self._contact = self._clock()
        self._tag = tag

    def orphaned(self, after_s: float) -> bool:
        """No call for longer than `after_s`: the controller that held it is gone for good."""
        return self._clock() - self._contact > after_s

    def _watch(self, after_s: float) -> None:
        while not self._stop.wait(min(after_s / 4, 30.0)):
            if self.orphaned(after_s):
                log.warning("no controller has called this snapshot keeper for %.0f s: it ends, and "
                            "its %.1f MB of snapshots with it", after_s, self.nbytes() / 1e6)
                self._end(0)
                return

    def close(self) -> None:
        """Stop watching (tests; a keeper's process ends with it otherwise)."""
        self._stop.set()

    def put_chunk(self, rank: int, step: int, offset: int, chunk: Any, nbytes: int, digest: str) -> None:
        """Bytes [offset, offset + len(chunk)) of `rank`'s snapshot of `step` (`nbytes` long,
        `digest` its checksum): complete once every byte has come."""
        self._contact = self._clock()
        data = np.frombuffer(memoryview(chunk).cast("B"), dtype=np.uint8)
        with self._lock:
            held = self._held.setdefault(rank, {})
            entry = self._receiving.get(rank)
            if entry is None or (entry.step, entry.digest, entry.buf.size) != (step, digest, nbytes):
                newest = max([*held, *([entry.step] if entry else [])], default=None)
                if newest is not None and step < newest:
                    return  # a late chunk of a send its rank gave up on
                while len(held) >= KEEP_STEPS:  # room for this one; dicts keep arrival order
                    del held[next(iter(held))]
                entry = self._receiving[rank] = _Receiving(step, digest, _buffer(nbytes))
            if offset in entry.offsets:
                return
            entry.offsets.add(offset)
        entry.buf[offset:offset + data.size] = data  # outside the lock: other ranks' chunks copy meanwhile
        with self._lock:
            entry.received += data.size
            if entry.received == entry.buf.size and self._receiving.get(rank) is entry:
                del self._receiving[rank]
                self._keep(rank, step, entry.buf, digest)

    def put(self, rank: int, step: int, blob: Any, digest: str) -> None:
        """A whole snapshot at once (tools, tests): a copy of its own, whatever arrived (a
        read-only view of the object store's copy goes once the sender drops it)."""
        data = np.frombuffer(memoryview(blob).cast("B"), dtype=np.uint8)
        copy = _buffer(data.size)
        copy[:] = data
        with self._lock:
            self._keep(rank, step, copy, digest)

    def _keep(self, rank: int, step: int, blob: np.ndarray, digest: str) -> None:
        steps = self._held.setdefault(rank, {})
        steps.pop(step, None)  # a step sent again (a replay) counts as the newest arrival
        steps[step] = (blob, digest)
        while len(steps) > KEEP_STEPS:
            del steps[next(iter(steps))]

    def drop_after(self, step: int) -> None:
        """Forget every snapshot of a step after `step` (the step the next attempt resumes
        from), sent or still arriving: what came after it was trained on a path the job has left."""
        with self._lock:
            for steps in self._held.values():
                for late in [s for s in steps if s > step]:
                    del steps[late]
            for rank in [r for r, e in self._receiving.items() if e.step > step]:
                del self._receiving[rank]

    def get(self, rank: int, step: int) -> tuple[np.ndarray, str]:
        """The whole blob and its digest (small snapshots, tests; a restore takes chunks)."""
        with self._lock:
            return self._held[rank][step]

    def describe(self, rank: int, step: int) -> tuple[int, str]:
        """(bytes, digest) of `rank`'s snapshot of `step`; KeyError when not held."""
        with self._lock:
            blob, digest = self._held[rank][step]
        return blob.size, digest

    def get_chunk(self, rank: int, step: int, offset: int, nbytes: int) -> np.ndarray:
        with self._lock:
            blob, _ = self._held[rank][step]
        return blob[offset:offset + nbytes]

    def holdings(self) -> dict[int, list[int]]:
        """rank -> the steps held complete for it."""
        self._contact = self._clock()
        with self._lock:
            return {rank: sorted(steps) for rank, steps in self._held.items()}

    def nbytes(self) -> int:
        with self._lock:
            return (sum(blob.size for steps in self._held.values() for blob, _ in steps.values())
                    + sum(e.buf.size for e in self._receiving.values()))
