"""Peer memory snapshots: the state of recent steps in host memory on two nodes, for restores
that lose (almost) no step (Gemini, SOSP'23; torchft's peer transfer).

    snapshots = MemorySnapshots(send, every=None, part=Part(1, 2, (3, 7)), agree=all_max)
    snapshots.observe_step(seconds)                  # each step's time (the `auto` interval)
    if snapshots.due(step): snapshots.take(trainer)  # a host copy, the rest in the background
    snapshots.before_update()                        # the copy is done before the weights change

One copy per shard: the ranks of a replica group hold the same model and optimizer pieces, so
each snapshots and sends only its `part` of them (`snapshot_blob.py`: a byte range of the
shard's tensors, plus its own RNG streams and plain values); a restore reassembles the parts.
A snapshot is one flat host buffer, the blob that is sent: the host copy into it is the only
one the worker makes. On a GPU it runs on a side stream, on the CPU in the send thread; either
way it overlaps the next step's forward and backward, and the trainer waits for it only before
the optimizer next changes the weights (`before_update`). Then the send thread checksums the
blob (xxh3 per chunk) and hands it to `send` (`worker/snapshot_transfer.py`: chunk by chunk to
two keepers). The buffer is allocated on the first snapshot and reused.

Host memory is budgeted before anything is allocated: a snapshot costs its node, per rank, the
worker's buffer, the chunks in transit (at most a part), the four copies the keepers hold (the
last two steps, of this node's ranks and of the previous node's) and the checkpoint stager's
copy of the whole shard. A state over the budget turns snapshots off, with nothing allocated.

Never wait: at most one send is in flight, and a snapshot due while one is still running is
skipped and counted (`on_drop`, the dropped-snapshots metric), never waited for. So that every
rank still holds the same steps (a step one rank skipped is one no restore can use), the ranks
decide together: each due snapshot begins with one tiny all-reduce (`agree`, element-wise max
over the job's ranks) of "ready / busy / off" and the interval this rank proposes; one busy
rank makes every rank skip, one rank without room or keepers turns snapshots off everywhere.

`every=None` is the `auto` interval (`snapshot_interval.py`): snapshots start at every step
while the first send is measured (a step that finds it still running is skipped without being
counted), then each snapshot's agreement sets the interval to the slowest rank's proposal, so
it follows sends that get slower. `on_interval(k)` is told each change (the metric).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from longrun.checkpoint.sharding import localize
from longrun.checkpoint.snapshot_blob import (
    ALONE,
    CHUNK_BYTES,
    Blob,
    Part,
    SnapshotBuffer,
    SnapshotError,
    Staged,
    chunk_digest,
    open_snapshot,
    plan_snapshot,
    read_parts,
    read_snapshot,
    serialize,
)
from longrun.checkpoint.snapshot_interval import AutoInterval

log = logging.getLogger(__name__)

Send = Callable[[int, Blob, str], None]  # (step, snapshot blob, its chunked xxh3 digest)
Agree = Callable[[list[int]], list[int]]  # the element-wise maximum over every rank of the job

# Per rank, the host copies of its snapshot a node holds while snapshots run: the worker's
# buffer, the chunks in transit (at most a part), 2 steps x 2 keepers (this node's, the next
# node's: each node's keeper holds its own ranks' and the previous node's), and the checkpoint
# stager's buffer, which holds the whole shard, not a part (`MemorySnapshots.host_bytes`).
HOST_COPIES_PER_RANK = 1 + 1 + 2 * 2 + 1
READY, BUSY, OFF = 0, 1, 2  # what a rank says before a snapshot; the job does the worst


def state_bytes(state, part: Part = ALONE) -> int:
    """The bytes one snapshot of `state` takes (what the budget is checked against); nothing
    is copied or allocated."""
    return plan_snapshot(*localize(state), part).nbytes


class MemorySnapshots:
    def __init__(self, send: Send | None, every: int | None, *, part: Part = ALONE,
                 host_budget_bytes: int | None = None, agree: Agree | None = None,
                 on_drop: Callable[[int, str], None] | None = None,
                 on_interval: Callable[[int], None] | None = None,
                 clock: Callable[[], float] = time.perf_counter, chunk_bytes: int = CHUNK_BYTES):
        """`send`: to the keepers (None: none reachable, so no rank snapshots). `every`: take a
        snapshot every this many steps; None: `auto`. `part`: this rank's share of its shard.
        `host_budget_bytes`: the host memory this rank's share of its node may give to
        snapshots, all copies counted; over it, snapshots turn off with a warning before
        anything is allocated (storage checkpoints still run). `agree`: the job's element-wise
        max (None: this rank alone). `on_drop(step, why)`: each snapshot skipped or not stored.
        `clock`: what a send's seconds are measured with (`auto`). `chunk_bytes`: the unit of
        checksums and transfers."""
        if every is not None and every < 1:
            raise ValueError(f"memory snapshots every {every} steps: use 1 or more, or auto (0 turns "
                             "them off before this object is made)")
        self.send, self.part, self.budget = send, part, host_budget_bytes
        self.agree = agree or (lambda values: values)
        self.on_drop, self.on_interval, self.clock = on_drop, on_interval, clock
        self.chunk_bytes = chunk_bytes
        self.auto = AutoInterval() if every is None else None
        self.every = every or 1  # auto: every step until the first send is measured
        self.decided = every is not None
        self.buffer = SnapshotBuffer()
        self.enabled = True
        self.sent_step: int | None = None  # the newest step whose snapshot reached the keepers
        self.taken = self.skipped = self.failed = 0
        self._thread: threading.Thread | None = None
        self._pending: Staged | None = None  # a host copy the optimizer must not overtake

    @property
    def dropped(self) -> int:
        """Snapshots that did not reach the keepers: skipped, or failed on the way."""
        return self.skipped + self.failed

    def due(self, step: int) -> bool:
        return self.enabled and step % self.every == 0

    @property
    def busy(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def observe_step(self, seconds: float) -> None:
        """A training step's wall time (what the `auto` interval is measured against)."""
        if self.auto is not None:
            self.auto.observe_step(seconds)

    def take(self, trainer) -> bool:
        """Snapshot `trainer`'s state (its part of it) and send it in the background; False
        when turned off or skipped. Every rank calls it at the same steps (`due`): it begins
        with the job's agreement."""
        if not self.enabled:
            return False
        plan, mine = None, READY
        if self.send is None:
            mine = OFF
        elif self.busy:
            mine = BUSY
        else:
            plan = plan_snapshot(*localize(trainer.state_dict()), self.part)
            if self.budget is not None and self.host_bytes(plan) > self.budget:
                mine = OFF
                log.warning("memory snapshots off: with every copy counted (%d of this rank's %.2f GB "
                            "part: the worker's, in transit, the keepers'; and the checkpoint's %.2f GB) "
                            "they would take %.1f GB of host memory, over the %.1f GB this node can "
                            "spare per rank; storage checkpoints go on", HOST_COPIES_PER_RANK - 1,
                            plan.nbytes / 1e9, plan.whole_bytes / 1e9, self.host_bytes(plan) / 1e9,
                            self.budget / 1e9)
        # the job's interval now, so a shorter one waits for the dead band
        proposal = self.auto.proposal(self.every if self.decided else None) if self.auto else 0
        code, proposal = self.agree([mine, proposal])
        if proposal:
            self._set_interval(proposal)
        if code == OFF:
            self.enabled = False
            self.buffer.release()
            if mine != OFF:
                log.warning("memory snapshots off: another rank has no room for them or no keeper to "
                            "send to (its log says which); storage checkpoints go on")
            return False
        if code == BUSY:
            self._skip(trainer.step, "this rank's previous snapshot is still being sent" if mine == BUSY
                       else "another rank's previous snapshot is still being sent")
            return False
        staged = self.buffer.fill(plan, defer=True)  # the CPU copy runs in the send thread
        self._pending = staged
        self.taken += 1
        self._thread = threading.Thread(target=self._send, args=(trainer.step, staged, self.clock()),
                                        name="longrun-memory-snapshot", daemon=True)
        self._thread.start()
        return True

    def host_bytes(self, plan) -> int:
        """The host memory this rank's snapshots cost its node, every copy counted."""
        return plan.nbytes * (HOST_COPIES_PER_RANK - 1) + plan.whole_bytes

    def _set_interval(self, every: int) -> None:
        if self.decided and every == self.every:
            return
        self.every, self.decided = every, True
        auto = self.auto
        log.info("memory snapshots every %d step(s) (auto: this rank's send %.2f s, its step %.2f s; "
                 "the slowest rank's sets it)", every, auto.send_s or 0.0, auto.step_s or 0.0)
        if self.on_interval is not None:
            self.on_interval(every)

    def _skip(self, step: int, why: str) -> None:
        if not self.decided:  # auto, still measuring the first send: no interval to keep yet
            return
        self.skipped += 1
        if self.skipped & (self.skipped - 1) == 0:  # 1, 2, 4, ...: the operator's signal, not a flood
            log.warning("memory snapshot of step %d skipped: %s (%d skipped so far); training goes on, "
                        "a restart may lose more steps%s", step, why, self.skipped,
                        "" if self.auto else "; raise checkpoint.memory_interval_steps (now "
                        f"{self.every}) or set it to auto")
        self._tell(step, why)

    def _tell(self, step: int, why: str) -> None:
        if self.on_drop is not None:
            try:
                self.on_drop(step, why)
            except Exception:  # a metrics hook must not stop training
                log.exception("memory snapshot on_drop hook failed")

    @property
    def copying(self) -> bool:
        """A snapshot's host copy may still be running (before_update waits for it)."""
        return self._pending is not None

    def before_update(self) -> None:
        """Call right before the optimizer changes the weights: a copy still running (the send
        thread's on the CPU, a side stream's on a GPU) finishes first."""
        if self._pending is not None:
            self._pending.wait()
            self._pending = None

    def _send(self, step: int, staged: Staged, started: float) -> None:
        try:
            staged.copy()
            blob = staged.blob()
            self.send(step, blob, chunk_digest(blob, self.chunk_bytes))
            self.sent_step = step
            if self.auto is not None:
                self.auto.observe_send(self.clock() - started)
        except Exception as exc:  # a snapshot is a shortcut: its failure costs only the shortcut
            self.failed += 1
            log.warning("memory snapshot of step %d not stored (%s: %s); training goes on (a restart may "
                        "lose more steps)", step, type(exc).__name__, exc)
            self._tell(step, f"not stored ({type(exc).__name__}: {exc})")

    def wait(self) -> None:
        if self._thread is not None:
            self._thread.join()


__all__ = ["HOST_COPIES_PER_RANK", "Blob", "MemorySnapshots", "Part", "SnapshotError", "open_snapshot",
           "read_parts", "read_snapshot", "serialize", "state_bytes"]
