"""`Corpus`: training documents as an indexable list of chunks of at most model.max_seq_len.

Each source document is wrapped as BOS + tokens + EOS and cut into pieces of at most
max_seq_len tokens (only the first piece has BOS, only the last EOS), from its length alone:
tokens are read only when a chunk is drawn. Subclasses say where the tokens come from (files
of text in `documents.py`, a .jsonl file in `jsonl_corpus.py`, prepared token shards in
`token_corpus.py`).

The chunk table (each chunk's document, start and length) has an entry per chunk; a corpus of
millions of documents passes in a table mapped from an index file (`index_cache.py`) instead
of computing a private copy on every rank, which `chunk_table` then builds once.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Protocol

import numpy as np

from longrun.data.errors import DataError


class SpecialTokens(Protocol):
    """What a corpus needs of a tokenizer: the ids that open and close a document."""

    BOS: int
    EOS: int


def check_max_seq_len(max_seq_len: int) -> None:
    if max_seq_len < 2:
        raise DataError(f"model.max_seq_len ({max_seq_len}) must be at least 2 to learn anything")


def chunk_table(content_lengths: np.ndarray, max_seq_len: int) -> dict[str, np.ndarray]:
    """Every chunk's source document, first stream offset and length (BOS/EOS included), in
    document order: a document of n content tokens is n + 2 stream tokens cut every max_seq_len."""
    check_max_seq_len(max_seq_len)
    total = np.asarray(content_lengths, dtype=np.int64) + 2  # BOS and EOS
    n_chunks = -(-total // max_seq_len)
    doc = np.repeat(np.arange(len(total)), n_chunks)
    first = np.cumsum(n_chunks) - n_chunks
    start = (np.arange(len(doc)) - first[doc]) * max_seq_len
    return {"doc": doc, "start": start, "length": np.minimum(start + max_seq_len, total[doc]) - start}


class Corpus:
    """Chunked documents; subclasses provide `_read(doc, start, stop)`: token ids
    [start, stop) of source document `doc` (BOS/EOS excluded).

    `chunks` is `chunk_table(content_lengths, max_seq_len)` made elsewhere (mapped from an
    index file); computed here when not given. `index_cache` is where a corpus that has one
    keeps its indexes (the sampler keeps its per-epoch orders there too)."""

    index_cache = None  # an IndexCache where the subclass has one

    def __init__(self, content_lengths: np.ndarray, max_seq_len: int, tokenizer: SpecialTokens,
                 chunks: Mapping[str, np.ndarray] | None = None):
        check_max_seq_len(max_seq_len)
        self.tokenizer = tokenizer
        self.max_seq_len = max_seq_len
        self._content = np.asarray(content_lengths, dtype=np.int64)
        chunks = chunk_table(self._content, max_seq_len) if chunks is None else chunks
        self._doc, self._start, self._length = chunks["doc"], chunks["start"], chunks["length"]
        # Shared by every caller of chunk_lengths (and possibly a mapping of a file): read-only.
        self._length.flags.writeable = False

    @property
    def num_documents(self) -> int:
        return len(self._content)

    @property
    def num_tokens(self) -> int:
        return int(self._content.sum() + 2 * len(self._content))

    def __len__(self) -> int:
        return len(self._doc)

    @property
    def chunk_lengths(self) -> np.ndarray:
        """Token count of every item (document chunk), BOS/EOS included, without reading."""
        return self._length

    @property
    def chunk_documents(self) -> np.ndarray:
        """The source document of every item (chunk): which items belong together."""
        return self._doc

    def document_of(self, i: int) -> int:
        """The source document item `i` was cut from."""
        return int(self._doc[i])

    def __getitem__(self, i: int) -> np.ndarray:
        doc, start = int(self._doc[i]), int(self._start[i])
        stop = start + int(self._length[i])
        n = int(self._content[doc])
        # Stream offset p holds content token p - 1 (offset 0 is BOS, n + 1 is EOS).
        parts = [np.array([self.tokenizer.BOS])] if start == 0 else []
        parts.append(self._read(doc, max(start - 1, 0), min(stop - 1, n)))
        if stop == n + 2:
            parts.append(np.array([self.tokenizer.EOS]))
        return np.concatenate(parts).astype(np.int64, copy=False)

    def _read(self, doc: int, start: int, stop: int) -> np.ndarray:
        raise NotImplementedError
