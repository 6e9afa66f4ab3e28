"""Validation data: a share of the training corpus held out by document, or a corpus of its own.

    train, held = split_by_document(corpus, 0.01)   # two views; no source document in both
    corpus = CorpusView(corpus, items)              # the items (chunks) `items` of `corpus`, renumbered

A long source document is cut into several chunks (`corpus.py`); holding out chunks would let the
model train on one half of a document and be validated on the other. So the split is by source
document: every chunk of a held-out document is in the held-out view, and none in the training
view, which is what the training sampler then draws from (its `num_docs` is the view's length).

Which documents are held out depends on the corpus alone, not on the job's seed (`SPLIT_SEED`):
jobs with different seeds validate on the same documents and their curves compare. The choice is
`ceil(share x documents)` of them by one seeded permutation, at least one, and at least one is
left to train on.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from longrun.config.sections import DataSection, ModelSection, ValidationSection
from longrun.data.corpus import Corpus, SpecialTokens
from longrun.data.documents import build_corpus
from longrun.data.errors import DataError

SPLIT_SEED = 0x7A11D  # fixed: the held-out documents must not move with job.seed


class CorpusView:
    """The chunks `items` (ascending indices into `base`) of a corpus, as a corpus of their own:
    item i of the view is `base[items[i]]`. What the samplers and the batch builders use of a
    corpus (`len`, indexing, `chunk_lengths`, `part_sizes` of a mixture) is renumbered."""

    def __init__(self, base: Corpus, items: np.ndarray):
        self.base = base
        self.items = np.asarray(items, dtype=np.int64)
        self.tokenizer, self.max_seq_len = base.tokenizer, base.max_seq_len
        # Its per-epoch orders are of another length than the base's: computed, not shared.
        self.index_cache = None
        lengths = base.chunk_lengths[self.items]
        lengths.flags.writeable = False
        self._lengths = lengths
        sizes = getattr(base, "part_sizes", None)
        if sizes is not None:  # a mixture's datasets are consecutive ranges of items: count each
            edges = np.concatenate(([0], np.cumsum(sizes)))
            self.part_sizes = np.diff(np.searchsorted(self.items, edges)).astype(np.int64)

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> np.ndarray:
        return self.base[int(self.items[i])]

    @property
    def chunk_lengths(self) -> np.ndarray:
        return self._lengths

    def document_of(self, i: int) -> int:
        """The source document of the view's item `i` (the base corpus's numbering)."""
        return self.base.document_of(int(self.items[i]))


def split_by_document(corpus: Corpus, share: float) -> tuple[CorpusView, CorpusView]:
    """(training view, held-out view) of `corpus`: `share` of its source documents held out."""
    n = corpus.num_documents
    if n < 2:
        raise DataError(f"the training data has {n} document(s) and validation.held_out needs at least 2 "
                        "(one to train on, one to validate on); give validation.path instead")
    held = min(max(math.ceil(share * n), 1), n - 1)
    chosen = np.zeros(n, dtype=bool)
    chosen[np.random.default_rng(SPLIT_SEED).permutation(n)[:held]] = True
    held_item = chosen[corpus.chunk_documents]
    return CorpusView(corpus, np.flatnonzero(~held_item)), CorpusView(corpus, np.flatnonzero(held_item))


def validation_split(data: DataSection, model: ModelSection, validation: ValidationSection,
                     corpus: Corpus, tokenizer: SpecialTokens, seed: int) -> tuple[Any, Any]:
    """(what training draws from, what validation evaluates; None: validation is off), each a
    `Corpus` or a `CorpusView` of one. With
    `validation.held_out` the training corpus loses the held-out documents; with `validation.path`
    it is unchanged and the validation corpus is that path, read as `data.source` reads."""
    if not validation.enabled:
        return corpus, None
    if validation.held_out is not None:
        return split_by_document(corpus, validation.held_out)
    own = data.model_copy(update={"path": validation.path, "mix": None})
    return corpus, build_corpus(own, model, tokenizer, seed)
