"""Ring attention: K and V blocks travel around a CP group, with the transfers under compute.

Each rank attends its queries to one block per step and merges the partial results through
their log-sum-exp (the blockwise softmax of flash attention), so no rank holds the whole
sequence's K/V. The transfer of the next block is posted *before* the current block is
computed: communication runs under compute. Backward sends K/V around again, and the dK/dV of
each block travel one step behind it, every rank adding its share, until they arrive back at
the block's owner. The per-block work is a block kernel's (`cp/flash.py`, `cp/kernel.py`):
the ring only moves K/V and dK/dV, token-major, and hands the kernel its blocks.

Message order: NCCL ignores tags and matches point-to-point messages by their order per pair
of peers, and a send may block until its receive is posted, so every send is posted in one
batch with the receive that its ring neighbours post at the same point. Per neighbour pair the
order is K/V of step 0, dK/dV of step 0, K/V of step 1, ... on both sides. gloo matches by
tag; K/V and dK/dV carry different ones.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from longrun.trainer.cp.flash import KernelChoice, block_kernel
from longrun.trainer.cp.layout import TokenStream

_KV_TAG, _DKV_TAG = 17, 18  # distinct tags: gloo matches messages by (peer, tag)


@dataclass
class Ring:
    """A ring of attention participants: `streams[i]` is what member i holds (its queries and
    its K/V block); this process is member `rank`. group None: a ring of one (no transfers).
    `kernel` picks the block kernel (`cp/flash.py`'s `block_kernel`)."""

    group: dist.ProcessGroup | None
    rank: int
    streams: tuple[TokenStream, ...]
    device: torch.device
    kernel: KernelChoice = "auto"
    _plans: dict[tuple[str, int], Any] = field(default_factory=dict, repr=False)

    @property
    def size(self) -> int:
        return len(self.streams)

    def plan(self, kernel, src: int):
        """How this member's queries meet member `src`'s keys under `kernel` (computed once per
        micro-batch, shared by all layers, forward and backward)."""
        key = (kernel.name, src)
        if key not in self._plans:
            self._plans[key] = kernel.plan(self.streams[self.rank], self.streams[src], self.device)
        return self._plans[key]

    def _peer(self, offset: int) -> int:
        return dist.get_global_rank(self.group, (self.rank + offset) % self.size)

    def post(self, send: Tensor | None, recv: Tensor | None, tag: int) -> list[dist.Work]:
        """Send to the next member and/or receive from the previous one, without waiting."""
        ops = []
        if send is not None:
            ops.append(dist.P2POp(dist.isend, send, self._peer(1), self.group, tag))
        if recv is not None:
            ops.append(dist.P2POp(dist.irecv, recv, self._peer(-1), self.group, tag))
        return dist.batch_isend_irecv(ops) if ops else []


def _wait(works: list[dist.Work]) -> None:
    for w in works:
        w.wait()


class _RingAttention(torch.autograd.Function):
    # The trainer runs forward under autocast and backward outside it; the kernel must compute
    # the same scores in both (the saved log-sum-exp has to match them), so autocast is off
    # inside and the precision is the kernel's: float32 math, or flash in the inputs' dtype
    # with out and lse merged in float32. K/V travel token-major [2, T, KV, D] in their dtype.

    @staticmethod
    def forward(ctx, q: Tensor, k: Tensor, v: Tensor, ring: Ring, kernel) -> Tensor:
        with torch.autocast(q.device.type, enabled=False):
            kvh, d = k.shape[1], k.shape[2]
            kv = torch.stack((k, v))
            p = kernel.forward_start(q, kvh)
            for step in range(ring.size):
                src = (ring.rank - step) % ring.size
                works, nxt = [], None
                if step < ring.size - 1:  # the next block is on the wire while this one computes
                    nxt = kv.new_empty(2, len(ring.streams[(src - 1) % ring.size]), kvh, d)
                    works = ring.post(kv, nxt, _KV_TAG)
                kernel.forward_block(p, kv[0], kv[1], ring.plan(kernel, src))
                _wait(works)
                if nxt is not None:
                    kv = nxt
            ctx.save_for_backward(q, k, v, p.out, p.lse)
            ctx.ring, ctx.kernel = ring, kernel
            return kernel.output(p, q)

    @staticmethod
    def backward(ctx, dout: Tensor):
        with torch.autocast(dout.device.type, enabled=False):
            return _RingAttention._backward(ctx, dout)

    @staticmethod
    def _backward(ctx, dout: Tensor):
        q, k, v, out, lse = ctx.saved_tensors
        ring: Ring = ctx.ring
        kernel = ctx.kernel
        kvh, d = k.shape[1], k.shape[2]
        g = kernel.backward_start(q, dout, out, lse)
        kv = torch.stack((k, v))
        dkv_works: list[dist.Work] = []
        incoming: Tensor | None = None  # dK/dV accumulated so far for the block held next
        for step in range(ring.size):
            src = (ring.rank - step) % ring.size
            kv_works, nxt = [], None
            if step < ring.size - 1:
                nxt = kv.new_empty(2, len(ring.streams[(src - 1) % ring.size]), kvh, d)
                kv_works = ring.post(kv, nxt, _KV_TAG)
            mine = torch.zeros(kv.shape, dtype=torch.float32, device=kv.device)
            kernel.backward_block(g, kv[0], kv[1], ring.plan(kernel, src), mine[0], mine[1])
            _wait(dkv_works)  # the previous step's send has left; this block's sum has come
            if incoming is not None:
                mine += incoming
            if ring.size > 1:
                # On to the next member (the block's owner after the last step), in one batch
                # with the receive of what the previous member sends at this same point: the
                # sum for the block held next, or at the end this member's own.
                after = (ring.rank - step - 1) % ring.size
                incoming = mine.new_empty(2, len(ring.streams[after]), kvh, d)
                dkv_works = ring.post(mine, incoming, _DKV_TAG)
            else:
                incoming = mine
            _wait(kv_works)
            if nxt is not None:
                kv = nxt
        _wait(dkv_works)
        return kernel.dq(g, q), incoming[0].to(k.dtype), incoming[1].to(v.dtype), None, None


def ring_attention(q: Tensor, k: Tensor, v: Tensor, ring: Ring) -> Tensor:
    """Causal attention of this member's queries q [T, H, D] over the whole ring's keys
    k/v [T, KV, D] (KV divides H); returns [T, H, D] in q's dtype."""
    return _RingAttention.apply(q, k, v, ring, block_kernel(ring.kernel, q))
