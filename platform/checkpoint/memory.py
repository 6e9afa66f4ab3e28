"""Peer memory snapshots: every step's state in host memory on two nodes, for restores that lose
no step (Gemini, SOSP'23; torchft's peer transfer).

    snapshots = MemorySnapshots(send, every=1)       # send(step, blob, digest): to two keepers
    if snapshots.due(step): snapshots.take(trainer)  # a host copy now, the rest in the background
    state = read_snapshot(blob, digest)              # verified, then the tensors copied out

A snapshot is one flat host buffer (`SnapshotBuffer`): every tensor of this rank's state (its
pieces: DTensors as local tensors, `sharding.py`) copied once into its own slice, then a small
header (the state's structure and plain values, each tensor's dtype, shape and place, and where
each piece sits in the whole tensor) and a trailer. That copy is the only one the worker makes:
it is the blob that is checksummed (SHA-256) and handed to `send` (which copies it once into
Ray's object store, from where the keepers take their own copies), with no `torch.save` stream,
`BytesIO` or `getvalue()` in between. The buffer is allocated on the first snapshot (pinned on a
GPU, where the copy runs on a side stream and the trainer waits for it only before the optimizer
next changes the weights, `before_update`) and reused while the state's size stays the same.

Host memory is budgeted before anything is allocated: a snapshot costs its node, per rank, the
worker's buffer, the object store's transient copy, the four copies the keepers hold (the last
two steps, of this node's ranks and of the previous node's) and the checkpoint stager's buffer
(`HOST_COPIES_PER_RANK`). A state over the budget turns snapshots off, with nothing allocated.

At most one snapshot is in flight. One due while the previous is still being sent waits for it,
up to `wait_s`: waiting keeps every rank's snapshots of the same steps (a step one rank skipped is
one no restore can use). A send that outlasts that (a slow keeper) is not allowed to stall
training: the new snapshot is dropped (a warning, `on_drop`, the dropped-snapshots metric) and
training goes on; the send itself gives up after its own timeout (`worker/snapshots.py`).
"""

from __future__ import annotations

import hashlib
import io
import logging
import struct
import threading
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from longrun.checkpoint.sharding import localize
from longrun.checkpoint.snapshot import HostCopy, map_tree

log = logging.getLogger(__name__)

Blob = Any  # bytes-like: bytes, bytearray or a uint8 numpy array (what crosses Ray)
Send = Callable[[int, Blob, str], None]  # (step, snapshot blob, its SHA-256 hex digest)

# Per rank, the host copies of its state a node holds while snapshots run: the worker's buffer,
# the object store's copy in transit, 2 steps x 2 keepers (this node's, the next node's: each
# node's keeper holds its own ranks' and the previous node's), the checkpoint stager's buffer.
HOST_COPIES_PER_RANK = 1 + 1 + 2 * 2 + 1
ALIGN = 64  # every tensor's slice starts here: any dtype can view it
MAGIC = b"LRSNAP01"
_TRAILER = struct.Struct("<Q8s")  # header length, magic
_TENSOR = "__longrun_snapshot_tensor__"  # a tensor's place in the header's structure


class SnapshotError(ValueError):
    """A memory snapshot that does not match its checksum or cannot be read."""


def _aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


@dataclass
class _Plan:
    """What one snapshot of a state holds, before anything is copied."""

    sources: list[Tensor]  # each distinct tensor once (tied weights are one)
    header: bytes
    data_bytes: int

    @property
    def nbytes(self) -> int:
        return self.data_bytes + len(self.header) + _TRAILER.size


def _plan(state: Any, where: dict[str, dict[str, Any]]) -> _Plan:
    sources: list[Tensor] = []
    specs: list[dict[str, Any]] = []
    seen: dict[tuple, int] = {}
    offset = 0

    def mark(_path: str, t: Tensor) -> dict[str, int]:
        nonlocal offset
        t = t.detach()
        # Tied weights (the embedding doubling as the output layer) are views of one storage:
        # one slice, and the restored state names one tensor twice, as torch.save would.
        alias = (t.untyped_storage().data_ptr(), t.device, t.storage_offset(), tuple(t.shape),
                 t.stride(), t.dtype)
        if alias not in seen or t.numel() == 0:
            seen[alias] = len(sources)
            sources.append(t)
            nbytes = t.numel() * t.element_size()
            specs.append({"dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape),
                          "offset": offset, "bytes": nbytes})
            offset += _aligned(nbytes)
        return {_TENSOR: seen[alias]}

    tree = map_tree(state, mark)
    buf = io.BytesIO()
    torch.save({"state": tree, "tensors": specs, "where": where}, buf)
    return _Plan(sources, buf.getvalue(), offset)


def state_bytes(state: Any) -> int:
    """The bytes one snapshot of `state` takes (what the budget is checked against); nothing
    is copied or allocated."""
    return _plan(*localize(state)).nbytes


@dataclass
class Staged(HostCopy):
    """A snapshot copied (or, on a GPU, being copied) into the buffer: `blob()` once `wait()`."""

    flat: Tensor
    nbytes: int

    def blob(self) -> Blob:
        """The snapshot's bytes, a view of the buffer (valid until the next `fill`)."""
        self.wait()
        return self.flat[:self.nbytes].numpy()


class SnapshotBuffer:
    """One flat host buffer, reused by every snapshot of the same size (pinned for GPU state)."""

    def __init__(self) -> None:
        self._flat: Tensor | None = None
        self._stream: torch.cuda.Stream | None = None

    @property
    def nbytes(self) -> int:
        return 0 if self._flat is None else self._flat.numel()

    def fill(self, plan: _Plan) -> Staged:
        on_gpu = any(t.is_cuda for t in plan.sources)
        if self._flat is None or self._flat.numel() != plan.nbytes or self._flat.is_pinned() != on_gpu:
            self._flat = None  # the old buffer goes before the new one comes
            # Exactly the size used; pinned makes the device-to-host copy asynchronous.
            self._flat = torch.empty(plan.nbytes, dtype=torch.uint8, pin_memory=on_gpu)
        flat, event = self._flat, None

        def copy_all() -> None:
            start = 0
            for src in plan.sources:
                nbytes = src.numel() * src.element_size()
                if nbytes:
                    dst = flat[start:start + nbytes].view(src.dtype).view(src.shape)
                    if src.is_cuda:
                        src.record_stream(torch.cuda.current_stream())
                    dst.copy_(src, non_blocking=src.is_cuda)
                start += _aligned(nbytes)
            end = plan.data_bytes + len(plan.header)
            flat[plan.data_bytes:end].copy_(torch.frombuffer(bytearray(plan.header), dtype=torch.uint8))
            flat[end:].copy_(torch.frombuffer(bytearray(_TRAILER.pack(len(plan.header), MAGIC)),
                                              dtype=torch.uint8))

        if not on_gpu:
            copy_all()
        else:
            if self._stream is None:
                self._stream = torch.cuda.Stream()
            # The side stream must see every kernel that produced the state (the optimizer step).
            self._stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(self._stream):
                copy_all()
                event = torch.cuda.Event()
                event.record(self._stream)
        return Staged(flat, plan.nbytes, _event=event)

    def release(self) -> None:
        self._flat = None


def digest_of(blob: Blob) -> str:
    return hashlib.sha256(memoryview(blob).cast("B")).hexdigest()


def serialize(state: Any, where: dict[str, dict[str, Any]] | None = None) -> tuple[bytes, str]:
    """A snapshot of `state` (local tensors) as bytes, and its digest (tests, tools)."""
    blob = bytes(SnapshotBuffer().fill(_plan(state, where or {})).blob())
    return blob, digest_of(blob)


def read_snapshot(blob: Blob, digest: str) -> dict[str, Any]:
    """The state in `blob` (tensors of their own, on the CPU), after checking it against
    `digest` (a snapshot is verified before use, as a checkpoint shard is)."""
    return open_snapshot(blob, digest)[0]


def open_snapshot(blob: Blob, digest: str) -> tuple[dict[str, Any], dict[str, dict[str, Any]]]:
    """(the state, where each of its DTensor pieces sits in the whole: `sharding.localize`),
    verified as `read_snapshot` does."""
    view = memoryview(blob).cast("B")
    found = hashlib.sha256(view).hexdigest()
    if found != digest:
        raise SnapshotError(f"the snapshot does not match its checksum ({found[:12]} != {digest[:12]})")
    try:
        header_len, magic = _TRAILER.unpack(view[len(view) - _TRAILER.size:])
        if magic != MAGIC:
            raise ValueError("not a longrun memory snapshot")
        start = len(view) - _TRAILER.size - header_len
        header = torch.load(io.BytesIO(view[start:start + header_len].tobytes()), map_location="cpu",
                            weights_only=True)
        tensors = [_tensor_at(view, spec) for spec in header["tensors"]]
    except Exception as exc:
        raise SnapshotError(f"the snapshot cannot be read ({type(exc).__name__}: {exc})") from exc

    def unmark(node: Any) -> Any:
        if isinstance(node, dict):
            if set(node) == {_TENSOR}:
                return tensors[node[_TENSOR]]
            return {k: unmark(v) for k, v in node.items()}
        if isinstance(node, (list, tuple)):
            items = [unmark(v) for v in node]
            return items if isinstance(node, list) else tuple(items)
        return node

    return unmark(header["state"]), header["where"]


def _tensor_at(view: memoryview, spec: dict[str, Any]) -> Tensor:
    dtype = getattr(torch, spec["dtype"])
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype {spec['dtype']!r}")
    if spec["bytes"] == 0:
        return torch.empty(spec["shape"], dtype=dtype)
    with warnings.catch_warnings():  # a read-only buffer: the clone below is what is kept
        warnings.simplefilter("ignore", UserWarning)
        raw = torch.frombuffer(view, dtype=torch.uint8, count=spec["bytes"], offset=spec["offset"])
    return raw.clone().view(dtype).view(spec["shape"])  # its own, aligned memory


class MemorySnapshots:
    def __init__(self, send: Send, every: int, *, host_budget_bytes: int | None = None,
                 wait_s: float | None = None, on_drop: Callable[[int, str], None] | None = None):
        """`every`: take a snapshot every this many steps. `host_budget_bytes`: the host memory
        this rank's share of its node may give to snapshots, all copies counted
        (`HOST_COPIES_PER_RANK`); over it, snapshots turn off with a warning before anything is
        allocated (storage checkpoints still run). `wait_s`: how long a snapshot due while the
        previous one is still being sent waits for it before it is dropped (None: no limit).
        `on_drop(step, why)`: told of every snapshot dropped (the metric)."""
        if every < 1:
            raise ValueError(f"memory snapshots every {every} steps: use 1 or more (0 turns them off "
                             "before this object is made)")
        self.send, self.every, self.budget = send, every, host_budget_bytes
        self.wait_s, self.on_drop = wait_s, on_drop
        self.buffer = SnapshotBuffer()
        self.enabled = True
        self.sent_step: int | None = None  # the newest step whose snapshot reached the keepers
        self.waited = self.failed = self.dropped = 0  # takes that waited; sends that failed; dropped
        self._thread: threading.Thread | None = None
        self._pending: Staged | None = None  # a host copy the optimizer must not overtake

    def due(self, step: int) -> bool:
        return self.enabled and step % self.every == 0

    @property
    def busy(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def take(self, trainer) -> bool:
        """Copy `trainer`'s state to host memory and send it in the background (after the
        previous one is through); False when turned off or dropped."""
        if not self.enabled:
            return False
        if self.busy and not self._wait_for_previous(trainer.step):
            return False
        plan = _plan(*localize(trainer.state_dict()))
        if self.budget is not None and plan.nbytes * HOST_COPIES_PER_RANK > self.budget:
            self.enabled = False
            log.warning("memory snapshots off: with every copy counted (%d of %.2f GB: the worker's, "
                        "the object store's, the keepers' and the checkpoint's) one rank's would take "
                        "%.1f GB of host memory, over the %.1f GB this node can spare per rank; storage "
                        "checkpoints go on", HOST_COPIES_PER_RANK, plan.nbytes / 1e9,
                        plan.nbytes * HOST_COPIES_PER_RANK / 1e9, self.budget / 1e9)
            return False
        staged = self.buffer.fill(plan)
        self._pending = staged
        self._thread = threading.Thread(target=self._send, args=(trainer.step, staged),
                                        name="longrun-memory-snapshot", daemon=True)
        self._thread.start()
        return True

    def _wait_for_previous(self, step: int) -> bool:
        """Wait for the send in flight, up to wait_s; False (this snapshot dropped) when it is
        still not through: a slow keeper must not hold training."""
        started = time.perf_counter()
        self.waited += 1
        self._thread.join(self.wait_s)
        took = time.perf_counter() - started
        if self._thread.is_alive():
            self._drop(step, f"the previous snapshot was still being sent after {took:.1f} s (a slow "
                             "keeper?)")
            return False
        if self.waited == 1:  # once: the operator's knob, not a flood
            log.warning("memory snapshot of step %d waited %.2f s for the previous one to be sent; "
                        "raise checkpoint.memory_interval_steps (now %d) so that training does not",
                        step, took, self.every)
        return True

    def _drop(self, step: int, why: str) -> None:
        self.dropped += 1
        log.warning("memory snapshot of step %d dropped: %s; training goes on (a restart may lose "
                    "more steps); raise checkpoint.memory_interval_steps if this repeats", step, why)
        if self.on_drop is not None:
            try:
                self.on_drop(step, why)
            except Exception:  # a metrics hook must not stop training
                log.exception("memory snapshot on_drop hook failed")

    def before_update(self) -> None:
        """Call right before the optimizer changes the weights: a copy still in flight (GPU)
        must finish first."""
        if self._pending is not None:
            self._pending.wait()
            self._pending = None

    def _send(self, step: int, staged: Staged) -> None:
        try:
            blob = staged.blob()
            self.send(step, blob, digest_of(blob))
            self.sent_step = step
        except Exception as exc:  # a snapshot is a shortcut: its failure costs only the shortcut
            self.failed += 1
            self._drop(step, f"not stored ({type(exc).__name__}: {exc})")

    def wait(self) -> None:
        if self._thread is not None:
            self._thread.join()
