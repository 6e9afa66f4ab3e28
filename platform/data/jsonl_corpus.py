"""The `text` source's .jsonl file: one document per non-blank line, the line's "text" string,
read from the file when a chunk of it is drawn.

No rank holds the texts. The file is indexed once (per file version: its path, size and
mtime): one pass that parses every line, because with one byte per token a document's length
is its text's UTF-8 length after JSON decoding (escapes like \\u00e9 make that differ from the
line's). The index holds each document's byte offset and line length in the file and its
content length; it is written beside the file and memory-mapped by every other process
(`index_cache.py`), and so is the chunk table made from it. Reading a chunk reads and parses
its document's one line (pread: no shared file position, so the prefetch thread and others
may read at once). A document is parsed again for each of its chunks: for a corpus of long
documents, tokenising once with `longrun data prepare` is the faster path.
"""

from __future__ import annotations

import json
import os
from array import array
from pathlib import Path

import numpy as np

from longrun.data.byte_tokenizer import ByteTokenizer
from longrun.data.corpus import Corpus, check_max_seq_len, chunk_table
from longrun.data.errors import DataError
from longrun.data.index_cache import Arrays, IndexCache
from longrun.data.index_file import key_sha256

# Bumped when what the scan records or how a line is read changes: older index files are then
# rebuilt instead of read (the version is part of each index's key).
INDEX_VERSION = 1


class _BadLine(ValueError):
    """What is wrong with one line, as the end of a sentence that names the line."""


def _text_bytes(line: bytes) -> bytes:
    """The UTF-8 bytes of one non-blank line's "text" field."""
    try:
        record = json.loads(line)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise _BadLine(f"is not valid JSON: {exc}") from None
    text = record.get("text") if isinstance(record, dict) else None
    if not isinstance(text, str):
        raise _BadLine('has no "text" string field; every line must be a JSON object like {"text": "..."}')
    try:
        return text.encode("utf-8")
    except UnicodeEncodeError:
        raise _BadLine(
            "holds a lone surrogate (a \\u escape of half a UTF-16 pair), which is no character; fix "
            "the line, or prepare the file with `longrun data prepare` (it replaces them with U+FFFD) "
            "and train with data.source 'tokens'") from None


def index_jsonl(path: Path) -> Arrays:
    """Each document's byte offset, line length and content length (UTF-8 bytes of its text),
    in file order, from one streaming pass (one line in memory at a time)."""
    offsets, sizes, contents = array("q"), array("q"), array("q")
    at = 0
    with open(path, "rb") as f:
        for lineno, line in enumerate(f, start=1):
            if line.strip():
                offsets.append(at)
                sizes.append(len(line))
                try:
                    contents.append(len(_text_bytes(line)))
                except _BadLine as exc:
                    raise DataError(f"{path} line {lineno} {exc}") from None
            at += len(line)
    if not offsets:
        raise DataError(f"{path} holds no documents (no non-blank lines)")
    return {name: np.frombuffer(values, dtype=np.int64)
            for name, values in (("offset", offsets), ("line_bytes", sizes), ("content", contents))}


class JsonlCorpus(Corpus):
    """One document per non-blank line of a .jsonl file: the line's "text" string.

    The index lives in `index_dir` when given, else beside the file (see `IndexCache.beside`)."""

    def __init__(self, path: str | Path, max_seq_len: int, tokenizer: ByteTokenizer, *,
                 index_dir: str | Path | None = None):
        check_max_seq_len(max_seq_len)  # before an index is built for nothing
        self.path = Path(path)  # as given, for messages
        self._file = self.path.resolve()  # what is read, whatever the working directory becomes
        self.index_cache = IndexCache.beside(self.path, index_dir)
        before = os.stat(self.path)
        key = {"kind": "jsonl-documents", "version": INDEX_VERSION, "path": str(self._file),
               "size": before.st_size, "mtime_ns": before.st_mtime_ns}

        def build() -> Arrays:
            arrays = index_jsonl(self.path)
            after = os.stat(self.path)
            if (after.st_size, after.st_mtime_ns) != (before.st_size, before.st_mtime_ns):
                raise DataError(f"{self.path} changed while it was being indexed; do not modify the "
                                "data of a job while it starts")
            return arrays

        documents = self.index_cache.arrays("jsonl-documents", key, build)
        self._offset, self._line_bytes = documents["offset"], documents["line_bytes"]
        content = documents["content"]
        chunks = self.index_cache.arrays(
            "chunks", {"kind": "chunks", "documents": key_sha256(key), "max_seq_len": max_seq_len},
            lambda: chunk_table(content, max_seq_len))
        super().__init__(content, max_seq_len, tokenizer, chunks)

    def _read(self, doc: int, start: int, stop: int) -> np.ndarray:
        offset, size = int(self._offset[doc]), int(self._line_bytes[doc])
        fd = os.open(self._file, os.O_RDONLY)
        try:
            line = os.pread(fd, size, offset)
        finally:
            os.close(fd)
        try:
            text = _text_bytes(line)
        except _BadLine:
            text = None  # it parsed when indexed: the file changed (reported just below)
        if text is None or len(line) != size or len(text) != int(self._content[doc]):
            raise DataError(f"{self.path} changed while training (document {doc} at byte {offset} is "
                            "not what was indexed); the corpus must not change during a job")
        return self.tokenizer.encode_bytes(text[start:stop])
