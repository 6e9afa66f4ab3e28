"""Packing documents into batches under a token budget, and prefetching them.

A micro-batch is one 1-D stream of whole documents (`cu_seqlens` marks where each starts), at
most `micro_batch_tokens` long. A step's *global batch* (`global_batches`) is chosen the same
way over all ranks: documents taken in the one global sampler order and never split or
reordered (next-fit) up to the global token budget, from their lengths alone (no tokens are
read), so a step's documents are a function of the sampler position and the budget, not of
the number of ranks. `step.py` then splits a global batch among the ranks, and each rank reads
only its own documents.

Resumability with a prefetcher running ahead: each `GlobalBatch` (and `MicroBatch` from
`packed_micro_batches`) carries `sampler_state`, the sampler position from which the documents
*after* it are drawn. Whoever consumes them saves the state of the last one consumed, never the
live sampler's, which the background thread has already advanced.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Generic, TypeVar

import numpy as np
import torch
from torch import Tensor

from longrun.data.corpus import Corpus

if TYPE_CHECKING:
    from longrun.data.documents import DocumentSampler
    from longrun.data.mixture import MixtureSampler

IGNORE_INDEX = -100


@dataclass
class MicroBatch:
    tokens: Tensor  # int64 [T]
    targets: Tensor  # int64 [T]: the next token within the document, IGNORE_INDEX at its end
    positions: Tensor  # int64 [T]: offset of each token inside its document
    cu_seqlens: Tensor  # int32 [n_docs + 1]
    n_docs: int
    n_tokens: int  # targets that count in the loss (T - n_docs)
    max_seqlen: int
    sampler_state: dict[str, Any] | None = field(default=None, compare=False)
    # The corpus index of each document, where the builder knew it: which data a step trained.
    doc_ids: tuple[int, ...] | None = field(default=None, compare=False)

    @property
    def seq_lens(self) -> np.ndarray:
        return np.diff(self.cu_seqlens.cpu().numpy())

    def to(self, device: torch.device | str, non_blocking: bool = False) -> MicroBatch:
        """Move the per-token tensors. `cu_seqlens` stays on the host: the model plans the
        attention from it in Python and copies what a kernel needs itself; a device copy
        would cost a device-to-host sync every forward."""
        move = {"device": device, "non_blocking": non_blocking}
        return replace(
            self,
            tokens=self.tokens.to(**move),
            targets=self.targets.to(**move),
            positions=self.positions.to(**move),
        )


def build_micro_batch(docs: list[np.ndarray], sampler_state: dict | None = None,
                      doc_ids: Sequence[int] | None = None) -> MicroBatch:
    """Concatenate documents (int arrays, each at least 1 token) into one packed micro-batch;
    `doc_ids`: their corpus indices, when known."""
    if not docs:
        raise ValueError("a micro-batch needs at least one document")
    lengths = np.array([len(d) for d in docs], dtype=np.int64)
    if (lengths == 0).any():
        raise ValueError("documents must not be empty")
    tokens = np.concatenate(docs).astype(np.int64, copy=False)
    cu = np.concatenate(([0], np.cumsum(lengths)))
    targets = np.empty_like(tokens)
    targets[:-1] = tokens[1:]
    targets[cu[1:] - 1] = IGNORE_INDEX  # a document's last token predicts nothing
    positions = np.arange(len(tokens)) - np.repeat(cu[:-1], lengths)
    return MicroBatch(
        tokens=torch.from_numpy(tokens),
        targets=torch.from_numpy(targets),
        positions=torch.from_numpy(positions),
        cu_seqlens=torch.from_numpy(cu.astype(np.int32)),
        n_docs=len(docs),
        n_tokens=len(tokens) - len(docs),
        max_seqlen=int(lengths.max()),
        sampler_state=sampler_state,
        doc_ids=None if doc_ids is None else tuple(int(i) for i in doc_ids),
    )


@dataclass(frozen=True)
class GlobalBatch:
    """One step's documents over all ranks, before any is read: corpus indices in sampler order."""

    indices: np.ndarray  # int64 [n_docs]
    lengths: np.ndarray  # int64 [n_docs]: tokens of each (BOS/EOS included)
    sampler_state: dict[str, Any]  # where the data goes on after this batch
    # Its micro-batches (positions into `indices`, each in global order) when the draw packed it
    # into a fixed count (`fixed_bins.pipeline_batches`, under pipeline parallelism); None: the
    # step packs it (`step.data_parallel_step`).
    micro_batches: tuple[tuple[int, ...], ...] | None = None

    @property
    def tokens(self) -> int:
        return int(self.lengths.sum())

    @property
    def loss_tokens(self) -> int:
        """Targets that count in the loss: a document's last token predicts nothing."""
        return self.tokens - len(self.lengths)


def global_batches(corpus: Corpus, sampler: DocumentSampler | MixtureSampler, token_budget: int, *,
                   budget_name: str = "training.global_batch_tokens") -> Iterator[GlobalBatch]:
    """Endless batches of at most `token_budget` tokens, documents in sampler order (next-fit).

    A document that does not fit is held for the next batch; the state recorded is the one
    from *before* drawing it, so a restored sampler draws it again first. Lengths come from
    `corpus.chunk_lengths`: choosing a batch reads no tokens."""
    lengths = corpus.chunk_lengths
    pending: tuple[int, int, dict] | None = None  # (index, length, sampler state before it)
    while True:
        indices: list[int] = []
        used = 0
        while used < token_budget:
            if pending is None:
                state = sampler.state_dict()
                doc = next(sampler)
                if lengths[doc] > token_budget:
                    raise ValueError(
                        f"a document of {lengths[doc]} tokens does not fit {budget_name} "
                        f"({token_budget}); raise it to at least model.max_seq_len")
                pending = (doc, int(lengths[doc]), state)
            if used + pending[1] > token_budget:
                break
            indices.append(pending[0])
            used += pending[1]
            pending = None
        chosen = np.array(indices, dtype=np.int64)
        yield GlobalBatch(chosen, lengths[chosen].astype(np.int64),
                          pending[2] if pending else sampler.state_dict())


def packed_micro_batches(
    corpus: Corpus, sampler: DocumentSampler | MixtureSampler, token_budget: int
) -> Iterator[MicroBatch]:
    """Endless micro-batches of at most `token_budget` tokens, documents in sampler order:
    `global_batches` of one rank, read and packed."""
    for batch in global_batches(corpus, sampler, token_budget, budget_name="data.micro_batch_tokens"):
        yield build_micro_batch([corpus[int(i)] for i in batch.indices], batch.sampler_state,
                                batch.indices)


T = TypeVar("T")


class _Failure:
    def __init__(self, exc: BaseException):
        self.exc = exc


_END = object()


class Prefetcher(Generic[T]):
    """Runs `source` in a background thread, up to `depth` items ahead (a bounded queue).

    `next()` returns items in order and sets `last_wait_s`, how long the consumer waited: the
    data phase of a step. An exception raised by the source is re-raised by `next()` in the
    consumer, original type and traceback. `close()` (or leaving a `with` block) stops and
    joins the thread. depth 0 runs the source inline (no thread). The thread is a daemon only
    as a backstop for an interpreter exit without `close()`; `close()` always joins it."""

    _POLL_S = 0.05  # how often a producer blocked on a full queue checks for close()

    def __init__(self, source: Iterable[T], depth: int, name: str = "longrun-prefetch"):
        self._source = iter(source)
        self.depth = depth
        self.last_wait_s = 0.0
        self._done = False
        self._stop = threading.Event()
        self._queue: queue.Queue = queue.Queue(maxsize=max(depth, 1))
        self._thread: threading.Thread | None = None
        if depth > 0:
            self._thread = threading.Thread(target=self._produce, name=name, daemon=True)
            self._thread.start()

    @property
    def thread(self) -> threading.Thread | None:
        return self._thread

    def _produce(self) -> None:
        try:
            for item in self._source:
                if not self._put(item):
                    return
            self._put(_END)
        except BaseException as exc:
            self._put(_Failure(exc))

    def _put(self, item: object) -> bool:
        while not self._stop.is_set():
            try:
                self._queue.put(item, timeout=self._POLL_S)
                return True
            except queue.Full:
                continue
        return False

    def __iter__(self) -> Prefetcher[T]:
        return self

    def __next__(self) -> T:
        if self._stop.is_set():
            raise RuntimeError("the prefetcher is closed")
        if self._done:
            raise StopIteration
        start = time.perf_counter()
        try:
            item = next(self._source) if self._thread is None else self._queue.get()
        except StopIteration:
            item = _END
        finally:
            self.last_wait_s = time.perf_counter() - start
        if item is _END:
            self._done = True
            raise StopIteration
        if isinstance(item, _Failure):
            self._done = True
            raise item.exc
        return item

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            while self._thread.is_alive():
                try:  # unblock a producer waiting on a full queue
                    while True:
                        self._queue.get_nowait()
                except queue.Empty:
                    pass
                self._thread.join(timeout=self._POLL_S)
        close_source = getattr(self._source, "close", None)
        if close_source is not None:
            close_source()  # a generator: release what it holds, in this (the owning) thread

    def __enter__(self) -> Prefetcher[T]:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
