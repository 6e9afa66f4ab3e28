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

Each snapshot's buffer is a mapping of its own (`_buffer`), handed back to the system when the
snapshot is dropped. From the heap, a rank's part below glibc's largest mmap threshold (32 MiB)
lands in one of the 32 serving threads' arenas, whose freed holes are kept and rarely fit the
next buffer: the quick soak's keepers (16 MiB parts) grew 410 -> 671 MiB in 4 minutes.
"""

from __future__ import annotations

import mmap
import threading
from dataclasses import dataclass, field
from typing import Any

import numpy as np

KEEP_STEPS = 2  # per rank: the newest complete snapshot survives while the next is sent
THREADS = 32  # calls a keeper serves at once: chunks of every rank sending to it


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
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._held: dict[int, dict[int, tuple[np.ndarray, str]]] = {}  # rank -> step -> (blob, digest)
        self._receiving: dict[int, _Receiving] = {}  # rank -> its send in flight (one at most)

    def put_chunk(self, rank: int, step: int, offset: int, chunk: Any, nbytes: int, digest: str) -> None:
        """Bytes [offset, offset + len(chunk)) of `rank`'s snapshot of `step` (`nbytes` long,
        `digest` its checksum): complete once every byte has come."""
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
        with self._lock:
            return {rank: sorted(steps) for rank, steps in self._held.items()}

    def nbytes(self) -> int:
        with self._lock:
            return (sum(blob.size for steps in self._held.values() for blob, _ in steps.values())
                    + sum(e.buf.size for e in self._receiving.values()))
