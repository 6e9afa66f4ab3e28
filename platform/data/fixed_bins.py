"""A step's global batch drawn straight into a fixed number of micro-batches, for pipeline
parallelism, whose schedule runs the same count every step.

    batches = pipeline_batches(corpus, sampler, micro_batches=M * span, micro_batch_tokens=4096)
    batch = next(batches)            # a GlobalBatch whose .micro_batches are M x span, none empty
    batch.micro_batches[rank::span]  # this rank's M (`step.pipeline_step`)

A pipeline schedule sizes its receive buffers once, so every micro-batch costs a whole
`micro_batch_tokens` forward and backward whatever it holds, and one with no document (what
padding a step up to the schedule's count used to add) is a whole micro-batch of compute for
nothing. So the count is fixed for the job (`config.memory.pipeline_micro_batches`) and the draw
fills exactly that many bins. Documents in the one global order go first-fit into the bins
(`FixedBins`). When one fits in none, everything drawn so far and it are packed again largest
first (first-fit decreasing, which fits more). Only when that fails too is the step full: the
document is held for the next step, and the state recorded is the one from before drawing it
(as in `global_batches`), so a resumed run draws it again first.

An empty bin takes any document (data.micro_batch_tokens holds the longest), so the draw never
stops while a bin is empty: every micro-batch of every rank carries real tokens. Documents are
never cut (that would change what their tokens attend to) nor reordered across steps.
Everything depends only on the lengths in draw order, so every rank of the span draws the same
bins without talking to the others, and no token is read to choose them.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

import numpy as np

from longrun.data.corpus import Corpus
from longrun.data.packing import GlobalBatch

if TYPE_CHECKING:
    from longrun.data.documents import DocumentSampler
    from longrun.data.mixture import MixtureSampler


class FixedBins:
    """`count` bins of `capacity` tokens each, filled in draw order (first-fit) and packed again
    largest first when a document fits in none. It reads lengths and says which bin each
    document goes to."""

    def __init__(self, count: int, capacity: int):
        if count < 1 or capacity < 1:
            raise ValueError(f"need at least one bin of at least one token, got {count} of {capacity}")
        self.count, self.capacity = count, capacity
        self.lengths: list[int] = []
        self.bin_of: list[int] = []  # each document's bin, in draw order
        self._room = np.full(count, capacity, dtype=np.int64)

    def add(self, length: int) -> bool:
        """Place the next document, of `length` tokens. False, with nothing changed, when the
        bins cannot hold it with the documents already in them."""
        if length > self.capacity:
            raise ValueError(f"a document of {length} tokens does not fit data.micro_batch_tokens "
                             f"({self.capacity}); raise micro_batch_tokens to at least model.max_seq_len")
        k = _first_fit(self._room, length)
        if k is not None:
            self._room[k] -= length
            self.bin_of.append(k)
        else:
            repacked = _first_fit_decreasing([*self.lengths, length], self.count, self.capacity)
            if repacked is None:
                return False
            self._room, self.bin_of = repacked
        self.lengths.append(length)
        return True

    def bins(self) -> tuple[tuple[int, ...], ...]:
        """Each bin's documents (positions in draw order, ascending)."""
        out: list[list[int]] = [[] for _ in range(self.count)]
        for i, k in enumerate(self.bin_of):
            out[k].append(i)
        return tuple(tuple(b) for b in out)


def _first_fit(room: np.ndarray, length: int) -> int | None:
    fits = room >= length
    k = int(fits.argmax())
    return k if fits[k] else None


def _first_fit_decreasing(lengths: list[int], count: int,
                          capacity: int) -> tuple[np.ndarray, list[int]] | None:
    """(room left per bin, bin of each document) packing `lengths` longest first (ties: the
    earlier document first) into `count` bins; None when they do not fit."""
    room = np.full(count, capacity, dtype=np.int64)
    bin_of = [0] * len(lengths)
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        k = _first_fit(room, lengths[i])
        if k is None:
            return None
        room[k] -= lengths[i]
        bin_of[i] = k
    return room, bin_of


def pipeline_batches(corpus: Corpus, sampler: DocumentSampler | MixtureSampler, micro_batches: int,
                     micro_batch_tokens: int) -> Iterator[GlobalBatch]:
    """Endless global batches, each the documents in sampler order that `FixedBins` fits into
    `micro_batches` bins of `micro_batch_tokens` (every rank's micro-batches of a step
    together), with those bins in `GlobalBatch.micro_batches`. The document that ends a batch
    is held for the next one; the state recorded is the one from before drawing it. Lengths
    come from `corpus.chunk_lengths`: no tokens are read."""
    lengths = corpus.chunk_lengths
    pending: tuple[int, int, dict] | None = None  # (index, length, sampler state before it)
    while True:
        bins = FixedBins(micro_batches, micro_batch_tokens)
        indices: list[int] = []
        while True:
            if pending is None:
                state = sampler.state_dict()
                doc = next(sampler)
                pending = (doc, int(lengths[doc]), state)
            if not bins.add(pending[1]):
                break
            indices.append(pending[0])
            pending = None
        chosen = np.array(indices, dtype=np.int64)
        yield GlobalBatch(chosen, lengths[chosen].astype(np.int64), pending[2], micro_batches=bins.bins())
