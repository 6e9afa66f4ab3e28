"""`Corpus`: training documents as an indexable list of chunks of at most model.max_seq_len.

Each source document is wrapped as BOS + tokens + EOS and cut into pieces of at most
max_seq_len tokens (only the first piece has BOS, only the last EOS), from its length alone:
tokens are read only when a chunk is drawn. Subclasses say where the tokens come from (files
of text in `documents.py`, prepared token shards in `token_corpus.py`).
"""

from __future__ import annotations

from typing import Protocol

import numpy as np

from longrun.data.errors import DataError


class SpecialTokens(Protocol):
    """What a corpus needs of a tokenizer: the ids that open and close a document."""

    BOS: int
    EOS: int


class Corpus:
    """Chunked documents; subclasses provide `_read(doc, start, stop)`: token ids
    [start, stop) of source document `doc` (BOS/EOS excluded)."""

    def __init__(self, content_lengths: np.ndarray, max_seq_len: int, tokenizer: SpecialTokens):
        if max_seq_len < 2:
            raise DataError(f"model.max_seq_len ({max_seq_len}) must be at least 2 to learn anything")
        self.tokenizer = tokenizer
        self.max_seq_len = max_seq_len
        self._content = np.asarray(content_lengths, dtype=np.int64)
        total = self._content + 2  # BOS and EOS
        n_chunks = -(-total // max_seq_len)
        self._doc = np.repeat(np.arange(len(total)), n_chunks)
        first = np.cumsum(n_chunks) - n_chunks
        self._start = (np.arange(len(self._doc)) - first[self._doc]) * max_seq_len
        self._stop = np.minimum(self._start + max_seq_len, total[self._doc])

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
        return self._stop - self._start

    def __getitem__(self, i: int) -> np.ndarray:
        doc, start, stop = int(self._doc[i]), int(self._start[i]), int(self._stop[i])
        n = int(self._content[doc])
        # Stream offset p holds content token p - 1 (offset 0 is BOS, n + 1 is EOS).
        parts = [np.array([self.tokenizer.BOS])] if start == 0 else []
        parts.append(self._read(doc, max(start - 1, 0), min(stop - 1, n)))
        if stop == n + 2:
            parts.append(np.array([self.tokenizer.EOS]))
        return np.concatenate(parts).astype(np.int64, copy=False)

    def _read(self, doc: int, start: int, stop: int) -> np.ndarray:
        raise NotImplementedError
