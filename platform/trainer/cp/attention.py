"""Context-parallel attention: ring (zigzag), Ulysses and their hybrid USP, with overlap.

Each rank of a CP group holds a slice of every document (`cp/layout.py`); attention still has
to see whole documents. Three ways to get there:

- **Ring** (`cp/ring.py`). K and V blocks travel around the group; each rank attends its
  queries to one block per step and merges the partial results through their log-sum-exp,
  with the next block's transfer under the current block's compute.
- **Ulysses** (`cp/ulysses.py`). One all-to-all turns "my tokens, all heads" into "all
  tokens, my heads"; each rank runs ordinary attention over whole documents for H/cp heads,
  and a second all-to-all turns it back. Cheap on fast links, but the degree is bounded by
  the head count.
- **USP.** Ulysses inside groups of `u` ranks (usually one node: the all-to-all wants
  bandwidth), ring across the cp/u such groups. Works for any head count and topology.

All three run the same block kernel: flash (`cp/flash.py`) by default, the float32 math kernel
(`cp/kernel.py`) where flash does not apply or when asked for (`kernel="math"`). The process
groups come from commgroup (`commgroup.groups`: the CP group, and USP's Ulysses and ring
sub-groups), formed with every other group of the attempt; this package never creates one.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist
from torch import Tensor

from longrun.parallel.dims import CPImpl
from longrun.trainer.cp.flash import FLASH, KERNEL_CHOICES, MATH, KernelChoice, flash_unavailable
from longrun.trainer.cp.layout import ShardLayout
from longrun.trainer.cp.ring import Ring, ring_attention
from longrun.trainer.cp.ulysses import HeadsToSeq, SeqToHeads

__all__ = ["CPGroups", "CPImpl", "ContextParallelAttention", "ring_attention"]


@dataclass(frozen=True)
class CPGroups:
    """The process groups one CP group of `size` ranks attends with. ring: the whole CP group
    (ulysses None); ulysses: the whole group all-to-all (ring None); usp: `ulysses` holds this
    rank's u consecutive CP ranks, `ring` the ranks at the same offset in the other such
    groups. CP-rank j = ring_index * u + ulysses_index."""

    impl: CPImpl
    size: int
    rank: int  # in the CP group
    ulysses_size: int
    ulysses: dist.ProcessGroup | None
    ring: dist.ProcessGroup | None

    @classmethod
    def alone(cls) -> CPGroups:
        """A CP group of one: the rank attends its documents by itself."""
        return cls("ring", 1, 0, 1, None, None)


class ContextParallelAttention:
    """Attention for one micro-batch on one rank of a CP group; what the model's attention
    layers call instead of single-process attention. Built per micro-batch (the masks depend
    on the documents) and shared by all layers."""

    def __init__(self, layout: ShardLayout, groups: CPGroups, device: torch.device,
                 kernel: KernelChoice = "auto"):
        if layout.cp != groups.size:
            raise ValueError(f"layout for CP {layout.cp} used with a CP group of {groups.size}")
        if kernel not in KERNEL_CHOICES:
            raise ValueError(f"the CP block kernel must be one of {KERNEL_CHOICES}, got {kernel!r}")
        self.layout, self.groups = layout, groups
        u = groups.ulysses_size
        ring_index = groups.rank // u
        # Each ring member holds the (document-major) union of its Ulysses group's tokens.
        members = []
        self._order: Tensor | None = None
        self._inverse: Tensor | None = None
        for r in range(groups.size // u):
            own = layout.streams[r * u:(r + 1) * u]
            if u == 1:
                members.append(own[0])
                continue
            stream, order = own[0].concat_doc_major(list(own[1:]))
            members.append(stream)
            if r == ring_index:
                self._order = torch.from_numpy(order).to(device)
                self._inverse = torch.from_numpy(np.argsort(order)).to(device)
        self.ring = Ring(groups.ring if groups.size // u > 1 else None, ring_index, tuple(members),
                         device, kernel)
        # Every step's plan now, before the first layer runs (not inside its ring loop), for
        # the kernel flash-capable inputs get; a fallback's plans are made on first use.
        flash_fits = kernel != "math" and flash_unavailable(device, torch.bfloat16, 128) is None
        likely = FLASH if flash_fits else MATH
        for src in range(self.ring.size):
            self.ring.plan(likely, src)

    def attend(self, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        """q [T, H, D], k/v [T, KV, D]: this rank's shard; returns its attention output."""
        g = self.groups
        if g.ulysses_size == 1:
            return ring_attention(q, k, v, self.ring)
        u = g.ulysses_size
        if k.shape[1] % u:  # KV heads do not split u ways: repeat each just enough that they do
            rep = u // math.gcd(k.shape[1], u)  # divides H/KV because u divides H
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        q, k, v = (SeqToHeads.apply(x, g.ulysses) for x in (q, k, v))
        q, k, v = (x.index_select(0, self._order) for x in (q, k, v))
        o = ring_attention(q, k, v, self.ring).index_select(0, self._inverse)
        return HeadsToSeq.apply(o, g.ulysses)
