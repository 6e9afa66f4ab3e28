"""Peer memory snapshots: every step's state in host memory on two nodes, for restores that lose
no step (Gemini, SOSP'23; torchft's peer transfer).

    snapshots = MemorySnapshots(send, every=1)       # send(step, blob, digest): to two keepers
    if snapshots.due(step): snapshots.take(trainer)  # a host copy now, the rest in the background
    state = read_snapshot(blob, digest)              # verified, then unpickled tensors only

`take` costs training one host copy (stage 1, `HostStager`, as a checkpoint does: on a GPU it
runs on a side stream and the trainer waits for it only before the optimizer next changes the
weights, `before_update`); a background thread then serializes it (this rank's pieces, DTensors
as local tensors), checksums it (SHA-256) and hands it to `send`, which stores it in this node's
keeper and the next node's. At most one snapshot is in flight: one due while the previous is
still being sent waits for it. Waiting, not skipping, is what keeps every rank's snapshots of
the same steps (a skip would depend on each rank's timing, and a step one rank skipped is
one no restore can use); where the send outlasts the interval, raise
`checkpoint.memory_interval_steps`.
"""

from __future__ import annotations

import hashlib
import io
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import torch

from longrun.checkpoint.sharding import localize
from longrun.checkpoint.snapshot import HostStager, Snapshot

log = logging.getLogger(__name__)

Send = Callable[[int, bytes, str], None]  # (step, serialized state, its SHA-256 hex digest)


class SnapshotError(ValueError):
    """A memory snapshot that does not match its checksum or cannot be read."""


def serialize(state: Any) -> tuple[bytes, str]:
    buf = io.BytesIO()
    torch.save(state, buf)
    blob = buf.getvalue()
    return blob, hashlib.sha256(blob).hexdigest()


def read_snapshot(blob: bytes, digest: str) -> dict[str, Any]:
    """The state in `blob`, after checking it against `digest` (a snapshot is verified before
    use, as a checkpoint shard is)."""
    found = hashlib.sha256(blob).hexdigest()
    if found != digest:
        raise SnapshotError(f"the snapshot does not match its checksum ({found[:12]} != {digest[:12]})")
    try:
        return torch.load(io.BytesIO(blob), map_location="cpu", weights_only=True)
    except Exception as exc:
        raise SnapshotError(f"the snapshot cannot be read ({type(exc).__name__}: {exc})") from exc


class MemorySnapshots:
    def __init__(self, send: Send, every: int, *, host_budget_bytes: int | None = None):
        """`every`: take a snapshot every this many steps. `host_budget_bytes`: the most one
        snapshot may take in host memory (a keeper holds two steps of two ranks' copies); a
        larger one turns snapshots off with a warning (storage checkpoints still run)."""
        if every < 1:
            raise ValueError(f"memory snapshots every {every} steps: use 1 or more (0 turns them off "
                             "before this object is made)")
        self.send, self.every, self.budget = send, every, host_budget_bytes
        self.stager = HostStager()
        self.enabled = True
        self.sent_step: int | None = None  # the newest step whose snapshot reached the keepers
        self.waited = self.failed = 0  # takes that waited for the previous send; sends that failed
        self._thread: threading.Thread | None = None
        self._pending: Snapshot | None = None  # a host copy the optimizer must not overtake

    def due(self, step: int) -> bool:
        return self.enabled and step % self.every == 0

    @property
    def busy(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def take(self, trainer) -> bool:
        """Copy `trainer`'s state to host memory and send it in the background (after the
        previous one is through); False when turned off."""
        if not self.enabled:
            return False
        if self.busy:
            started = time.perf_counter()
            self.waited += 1
            self.wait()
            if self.waited == 1:  # once: the operator's knob, not a flood
                log.warning("memory snapshot of step %d waited %.2f s for the previous one to be sent; "
                            "raise checkpoint.memory_interval_steps (now %d) so that training does not",
                            trainer.step, time.perf_counter() - started, self.every)
        state, _ = localize(trainer.state_dict())
        snapshot = self.stager.stage(state)
        if self.budget is not None and snapshot.nbytes > self.budget:
            self.enabled = False
            log.warning("memory snapshots off: one takes %.1f GB of host memory, over the %.1f GB "
                        "this node can spare; storage checkpoints go on", snapshot.nbytes / 1e9,
                        self.budget / 1e9)
            return False
        self._pending = snapshot
        self._thread = threading.Thread(target=self._send, args=(trainer.step, snapshot),
                                        name="longrun-memory-snapshot", daemon=True)
        self._thread.start()
        return True

    def before_update(self) -> None:
        """Call right before the optimizer changes the weights: a copy still in flight (GPU)
        must finish first."""
        if self._pending is not None:
            self._pending.wait()
            self._pending = None

    def _send(self, step: int, snapshot: Snapshot) -> None:
        try:
            snapshot.wait()
            blob, digest = serialize(snapshot.tree)
            self.send(step, blob, digest)
            self.sent_step = step
        except Exception as exc:  # a snapshot is a shortcut: its failure costs only the shortcut
            self.failed += 1
            log.warning("memory snapshot of step %d not stored: %s", step, exc)

    def wait(self) -> None:
        if self._thread is not None:
            self._thread.join()
