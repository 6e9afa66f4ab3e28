"""Stage 1 of a save: copy the training state into host memory (the only part training waits for).

The state is a nested structure of dicts, lists and tuples whose leaves are tensors or plain
values (`Trainer.state_dict()`). Tensors are copied into host buffers that are allocated on the
first save and reused by every later one (same path, shape and dtype), so a steady-state save
allocates nothing. On a GPU the buffers are pinned and the copies run on a side CUDA stream;
the trainer keeps computing and waits for the copy only just before the optimizer next changes
the weights (`Snapshot.wait()`). On the CPU the copy is a memcpy that `stage(defer=True)` leaves
to whoever calls `Snapshot.copy()` (the checkpoint writer's thread), so there too it overlaps the
next step's forward and backward, which read the weights but do not change them.

Buffers are reused, so a snapshot's tensors stay valid only until the next `stage()`: the
writer must be done with one save before the next is staged (the `Checkpointer` enforces it).
"""

from __future__ import annotations

import copy
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor


def _done() -> threading.Event:
    event = threading.Event()
    event.set()
    return event


@dataclass
class HostCopy:
    """A copy into host memory that may still be running: on a CUDA stream (`_event` marks its
    end) or, on the CPU, left to whoever calls `copy()` (`_copy`; `_copied` is set once it ran)."""

    _copy: Callable[[], None] | None = field(default=None, repr=False, kw_only=True)
    _copied: threading.Event = field(default_factory=_done, repr=False, kw_only=True)
    _event: torch.cuda.Event | None = field(default=None, repr=False, kw_only=True)

    def __post_init__(self) -> None:
        if self._copy is not None:
            self._copied = threading.Event()

    def copy(self) -> None:
        """Run a deferred copy now (at most once; a no-op when there is none left)."""
        try:
            if self._copy is not None:
                self._copy()
        finally:
            self._copy = None
            self._copied.set()

    def wait(self) -> None:
        """Block until the copy is complete."""
        self._copied.wait()
        if self._event is not None:
            self._event.synchronize()
            self._event = None


@dataclass
class Snapshot(HostCopy):
    """A host copy of a state tree. `tree` mirrors the source with tensors replaced by host
    tensors; `nbytes` is the bytes copied."""

    tree: Any
    nbytes: int

    @property
    def ready(self) -> bool:
        return self._copied.is_set() and (self._event is None or self._event.query())


def map_tree(tree: Any, on_tensor: Callable[[str, Tensor], Any], path: str = "") -> Any:
    """Rebuild `tree` with each tensor replaced by on_tensor(path, tensor); other leaves are
    deep-copied so the result shares nothing mutable with the source."""
    if isinstance(tree, Tensor):
        return on_tensor(path, tree)
    if isinstance(tree, dict):
        return {k: map_tree(v, on_tensor, f"{path}/{k}") for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        items = [map_tree(v, on_tensor, f"{path}/{i}") for i, v in enumerate(tree)]
        return items if isinstance(tree, list) else tuple(items)
    return copy.deepcopy(tree)


def tensors_of(tree: Any) -> list[tuple[str, Tensor]]:
    """Every tensor leaf with its path, in a deterministic order (the tree's own)."""
    found: list[tuple[str, Tensor]] = []
    map_tree(tree, lambda path, t: found.append((path, t)))
    return found


class HostStager:
    """Copies state trees into reusable host buffers (pinned for GPU sources)."""

    def __init__(self) -> None:
        self._buffers: dict[str, Tensor] = {}
        self._stream: torch.cuda.Stream | None = None

    @property
    def buffer_bytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self._buffers.values())

    def _buffer(self, path: str, src: Tensor) -> Tensor:
        buf = self._buffers.get(path)
        if buf is None or buf.shape != src.shape or buf.dtype != src.dtype:
            # Pinned memory makes the device-to-host copy asynchronous and about twice as fast;
            # it is worth allocating only because it is allocated once.
            buf = torch.empty(src.shape, dtype=src.dtype, device="cpu",
                              pin_memory=src.is_cuda)
            self._buffers[path] = buf
        return buf

    def stage(self, state: Any, *, defer: bool = False) -> Snapshot:
        """Copy `state` into the host buffers. On the CPU with `defer`, only the buffers are
        laid out: the copy runs when `Snapshot.copy()` is called (from another thread)."""
        nbytes = 0
        on_gpu = False
        # Tied weights (the embedding doubling as the output layer) appear twice in a
        # state_dict as views of one storage: copy and write them once, and torch.save keeps
        # the two names pointing at one tensor.
        staged: dict[tuple, Tensor] = {}

        def copy_out(path: str, src: Tensor) -> Tensor:
            nonlocal nbytes, on_gpu
            src = src.detach()
            alias = (src.untyped_storage().data_ptr(), src.device, src.storage_offset(),
                     tuple(src.shape), src.stride(), src.dtype)
            if alias in staged and src.numel() > 0:
                return staged[alias]
            buf = staged[alias] = self._buffer(path, src)
            nbytes += buf.numel() * buf.element_size()
            if defer and not src.is_cuda:
                pairs.append((buf, src))
                return buf
            if src.is_cuda:
                on_gpu = True
                # Tell the caching allocator the side stream still reads this memory.
                src.record_stream(torch.cuda.current_stream())
            buf.copy_(src, non_blocking=src.is_cuda)
            return buf

        pairs: list[tuple[Tensor, Tensor]] = []  # the CPU copies left for later, with `defer`

        def copy_all() -> None:
            for buf, src in pairs:
                buf.copy_(src)

        if not torch.cuda.is_available():
            tree = map_tree(state, copy_out)
            return Snapshot(tree, nbytes, _copy=copy_all if pairs else None)
        if self._stream is None:
            self._stream = torch.cuda.Stream()
        # The side stream must see every kernel that produced the state (the optimizer step).
        self._stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self._stream):
            tree = map_tree(state, copy_out)
            event = None
            if on_gpu:
                event = torch.cuda.Event()
                event.record(self._stream)
        return Snapshot(tree, nbytes, _event=event, _copy=copy_all if pairs else None)
