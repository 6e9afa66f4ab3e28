"""How the documents of a packed micro-batch are split over a context-parallel group.

Every document is split on its own (never the packed stream as a whole), so each rank holds a
slice of every document and the ranks' work stays equal whatever the mix of lengths:

- **zigzag** (the default, for causal masks): a document is padded to a multiple of 2 x cp and
  cut into 2 x cp equal chunks; rank r holds chunks r and 2cp-1-r. Under a causal mask the
  early chunks attend to little and the late ones to a lot, so pairing chunk r with its
  mirror gives every rank the same amount of attention work (a plain split would leave the
  last rank with about 2cp-1 times the first one's).
- **contiguous**: padded to a multiple of cp, rank r holds chunk r (for comparison and for
  non-causal uses).

A rank's local stream is document-major: the tokens of document 0 it holds, then those of
document 1, and so on, so each document's local tokens are one contiguous run. Padding tokens
carry their would-be position (>= the document's length); attention masks them out as keys,
their queries see nothing, and their targets are ignored by the loss, so they change no
result and receive no gradient.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import numpy as np
import torch
from torch import Tensor

from longrun.data.packing import IGNORE_INDEX, MicroBatch


@dataclass(frozen=True)
class TokenStream:
    """The tokens some attention participant holds: for each, its document and its position
    inside that document, document-major. Padding has position >= its document's length."""

    doc: np.ndarray  # int64 [n]
    pos: np.ndarray  # int64 [n]
    lengths: np.ndarray  # int64 [n_docs]: real length of every document of the micro-batch

    def __len__(self) -> int:
        return len(self.doc)

    @cached_property
    def valid(self) -> np.ndarray:
        return self.pos < self.lengths[self.doc]

    @cached_property
    def segments(self) -> dict[int, slice]:
        """Document id -> the contiguous run of this stream holding its tokens."""
        if len(self.doc) == 0:
            return {}
        cuts = np.flatnonzero(np.diff(self.doc)) + 1
        starts = np.concatenate(([0], cuts))
        ends = np.concatenate((cuts, [len(self.doc)]))
        if len(np.unique(self.doc[starts])) != len(starts):
            raise ValueError("a token stream must be document-major (one run per document)")
        return {int(self.doc[s]): slice(int(s), int(e)) for s, e in zip(starts, ends, strict=True)}

    def concat_doc_major(self, others: list[TokenStream]) -> tuple[TokenStream, np.ndarray]:
        """`self` followed by `others`, reordered document-major (stable: a document's tokens
        keep their order). Returns the stream and the permutation applied to the
        concatenation (what an all-gathered tensor must be indexed with)."""
        doc = np.concatenate([self.doc] + [o.doc for o in others])
        pos = np.concatenate([self.pos] + [o.pos for o in others])
        order = np.argsort(doc, kind="stable")
        return TokenStream(doc[order], pos[order], self.lengths), order


@dataclass(frozen=True)
class ShardLayout:
    """The split of one micro-batch's documents over a CP group of `cp` ranks."""

    lengths: np.ndarray  # int64 [n_docs]
    cp: int
    zigzag: bool = True

    def __post_init__(self) -> None:
        if self.cp < 1:
            raise ValueError(f"cp must be at least 1, got {self.cp}")
        if len(self.lengths) == 0 or (np.asarray(self.lengths) <= 0).any():
            raise ValueError("a CP micro-batch needs at least one document and no empty ones")

    @classmethod
    def of(cls, mb: MicroBatch, cp: int, zigzag: bool = True) -> ShardLayout:
        return cls(mb.seq_lens.astype(np.int64), cp, zigzag)

    @cached_property
    def chunk(self) -> np.ndarray:
        """Per document, the length of one chunk (2cp chunks zigzag, cp contiguous)."""
        parts = 2 * self.cp if self.zigzag else self.cp
        return -(-self.lengths // parts)

    @property
    def local_tokens(self) -> int:
        """Tokens every rank of the group holds (equal on all ranks by construction)."""
        per_doc = 2 * self.chunk if self.zigzag else self.chunk
        return int(per_doc.sum())

    def stream(self, rank: int) -> TokenStream:
        if not 0 <= rank < self.cp:
            raise ValueError(f"rank {rank} is not in a CP group of {self.cp}")
        docs, positions = [], []
        for d, h in enumerate(self.chunk.tolist()):
            if self.zigzag:
                mirror = 2 * self.cp - 1 - rank
                pos = np.concatenate((np.arange(rank * h, (rank + 1) * h),
                                      np.arange(mirror * h, (mirror + 1) * h)))
            else:
                pos = np.arange(rank * h, (rank + 1) * h)
            docs.append(np.full(len(pos), d, dtype=np.int64))
            positions.append(pos)
        return TokenStream(np.concatenate(docs), np.concatenate(positions).astype(np.int64),
                           self.lengths)

    @cached_property
    def streams(self) -> tuple[TokenStream, ...]:
        return tuple(self.stream(r) for r in range(self.cp))

    def global_index(self, rank: int) -> np.ndarray:
        """For each local token of `rank`, its index in the packed (unpadded) micro-batch, or
        -1 for padding."""
        s = self.streams[rank]
        starts = np.concatenate(([0], np.cumsum(self.lengths)[:-1]))
        return np.where(s.valid, starts[s.doc] + s.pos, -1)

    def shard(self, mb: MicroBatch, rank: int) -> LocalShard:
        """The part of `mb` that `rank` trains on."""
        idx = torch.from_numpy(self.global_index(rank))
        pad = idx < 0
        take = idx.clamp(min=0)
        tokens = mb.tokens.index_select(0, take).masked_fill(pad, 0)
        targets = mb.targets.index_select(0, take).masked_fill(pad, IGNORE_INDEX)
        # Rotary angles for padding are irrelevant (masked out); position 0 is always in range.
        positions = mb.positions.index_select(0, take).masked_fill(pad, 0)
        return LocalShard(tokens=tokens, targets=targets, positions=positions, layout=self,
                          rank=rank, n_tokens=int((targets != IGNORE_INDEX).sum()))


@dataclass
class LocalShard:
    """One rank's part of a micro-batch under context parallelism."""

    tokens: Tensor  # int64 [local_tokens], padding holds token 0
    targets: Tensor  # IGNORE_INDEX at padding and at each document's last token
    positions: Tensor  # rotary positions (0 at padding)
    layout: ShardLayout
    rank: int
    n_tokens: int  # targets that count in the loss on this rank

    def to(self, device: torch.device | str, non_blocking: bool = False) -> LocalShard:
        move = {"device": device, "non_blocking": non_blocking}
        return LocalShard(self.tokens.to(**move), self.targets.to(**move),
                          self.positions.to(**move), self.layout, self.rank, self.n_tokens)
