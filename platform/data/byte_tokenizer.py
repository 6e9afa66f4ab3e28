"""A byte-level tokenizer: nothing to download, any text (any bytes) encodes losslessly.

Ids 0..255 are the UTF-8 bytes; 256, 257, 258 are BOS, EOS and PAD. A model's vocabulary may
be larger than 259 (the default 260 is a multiple of 4); ids above PAD are never produced.
One token per byte also means a file's token count is its size, which `longrun.data.documents`
uses to index a corpus without reading it.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np


class ByteTokenizer:
    BOS = 256
    EOS = 257
    PAD = 258
    MIN_VOCAB = 259

    def __init__(self, vocab_size: int = 260):
        if vocab_size < self.MIN_VOCAB:
            raise ValueError(
                f"model.vocab_size = {vocab_size} is too small for the byte tokenizer, which "
                f"needs {self.MIN_VOCAB} ids (256 bytes + BOS, EOS, PAD); set model.vocab_size "
                f"to at least {self.MIN_VOCAB} (260 is the default)"
            )
        self.vocab_size = vocab_size

    def encode(self, text: str, *, bos: bool = False, eos: bool = False) -> list[int]:
        ids = list(text.encode("utf-8"))
        return ([self.BOS] if bos else []) + ids + ([self.EOS] if eos else [])

    def encode_bytes(self, data: bytes) -> np.ndarray:
        """Raw bytes (e.g. a slice of a file) as an int64 id array, without decoding."""
        return np.frombuffer(data, dtype=np.uint8).astype(np.int64)

    def decode(self, ids: Iterable[int]) -> str:
        """Text of the byte ids; special ids are dropped, invalid UTF-8 becomes U+FFFD (a model
        can emit a byte sequence that is not valid UTF-8)."""
        out = bytearray()
        for i in ids:
            i = int(i)
            if not 0 <= i < self.vocab_size:
                raise ValueError(f"token id {i} is outside the vocabulary [0, {self.vocab_size})")
            if i < 256:
                out.append(i)
        return out.decode("utf-8", errors="replace")
