"""Training from prepared token shards (`longrun data prepare`): nothing is tokenised at train time.

`data.source: tokens` reads one prepared directory (`data.path`) or several (`data.mix`), which
are then one corpus, directory after directory, so that a document index names one document
of one directory and `part_sizes` tells the mixture sampler (`mixture.py`) where each
directory's chunks lie. Documents longer than model.max_seq_len are split by `Corpus`.

Opening checks what the config check could not yet see (the directories may have been made
after the config was validated): every shard's size (by `TokenShards`), that the shards were
made with the job's tokenizer (data.tokenizer), that a mixture's directories share one
tokenizer, and that model.vocab_size covers the tokenizer's ids. Opening hashes nothing, so
start-up does not grow with the data set: a shard no verification mark vouches for (see
`longrun.data.verification`) is hashed when this rank first reads from it, in the prefetch
thread, before its tokens reach a batch; a rank never hashes a shard it does not read.

Nor does opening make a rank hold arrays of one entry per document: the documents' lengths
(over every shard of every directory) and the chunk table are indexes built once, by the first
process that opens the data set, in `<first directory>/.longrun-index/` (`index_cache.py`),
and memory-mapped by every other; the sampler keeps each epoch's order there too (`orders.py`).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from longrun.config.sections import DataSection, ModelSection
from longrun.config.vocabulary import BYTE_TOKENIZER_SHA256
from longrun.data.corpus import Corpus, SpecialTokens, check_max_seq_len, chunk_table
from longrun.data.errors import DataError
from longrun.data.index_cache import Arrays, IndexCache
from longrun.data.index_file import key_sha256
from longrun.data.shards import TokenShards

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ShardSpecials:
    """BOS and EOS as the shards' manifest records them: the ids their tokenizer gave."""

    BOS: int
    EOS: int


# Bumped when what the document index records changes: older index files are then rebuilt.
INDEX_VERSION = 1


def documents_key(shards: list[TokenShards]) -> dict:
    """What the document index of `shards` is built from: each directory's manifest and the
    size and mtime of its .idx files when opened (a rewritten one makes another index)."""
    def idx_stamps(part: TokenShards) -> str:
        stamps = {name: st for name, st in part.stamps.items() if name.endswith(".idx")}
        return hashlib.sha256(json.dumps(stamps, sort_keys=True).encode()).hexdigest()
    return {"kind": "token-documents", "version": INDEX_VERSION,
            "dirs": [{"path": str(Path(part.path).resolve()), "manifest_sha256": part.manifest_sha256,
                      "idx_stamps_sha256": idx_stamps(part)} for part in shards]}


def document_lengths(shards: list[TokenShards]) -> Arrays:
    """Every document's token count, directory after directory, shard after shard."""
    content = np.empty(sum(part.num_documents for part in shards), dtype=np.int64)
    at = 0
    for part in shards:
        for shard in range(part.num_shards):
            lengths = part.shard_lengths(shard)
            content[at:at + len(lengths)] = lengths
            at += len(lengths)
    return {"content": content}


class TokenCorpus(Corpus):
    """The documents of one or more prepared directories, read from memory-mapped shards.

    Its indexes live in `index_dir` when given, else in the first directory (`IndexCache.beside`)."""

    def __init__(self, shards: list[TokenShards], max_seq_len: int, names: list[str] | None = None,
                 *, index_dir: str | os.PathLike | None = None):
        if not shards:
            raise ValueError("a token corpus needs at least one prepared directory")
        check_max_seq_len(max_seq_len)  # before an index is built for nothing
        self.shards = shards
        self.names = names or [f"dataset {i}" for i in range(len(shards))]
        self.index_cache = IndexCache.beside(shards[0].path, index_dir)
        record = shards[0].manifest["tokenizer"]
        key = documents_key(shards)
        content = self.index_cache.arrays("token-documents", key, lambda: document_lengths(shards))["content"]
        chunks = self.index_cache.arrays(
            "chunks", {"kind": "chunks", "documents": key_sha256(key), "max_seq_len": max_seq_len},
            lambda: chunk_table(content, max_seq_len))
        # The first document of each directory, and (last) the number of documents.
        self._first_doc = np.concatenate(([0], np.cumsum([part.num_documents for part in shards])))
        super().__init__(content, max_seq_len, ShardSpecials(BOS=int(record["bos"]), EOS=int(record["eos"])),
                         chunks)
        # Chunks are ordered by document, so each directory's chunks are one contiguous range.
        self.part_sizes = np.diff(np.searchsorted(self._doc, self._first_doc)).astype(np.int64)

    def _read(self, doc: int, start: int, stop: int) -> np.ndarray:
        part = int(np.searchsorted(self._first_doc, doc, side="right")) - 1
        return self.shards[part].read(doc - int(self._first_doc[part]), start, stop)


def _short(sha: str) -> str:
    return f"{str(sha)[:12]}..."


def open_token_corpus(data: DataSection, model: ModelSection, tokenizer: SpecialTokens, *,
                      index_dir: str | os.PathLike | None = None) -> TokenCorpus:
    """The corpus of `data.path` or `data.mix`, checked against the job's tokenizer and model;
    its indexes in `index_dir`, by default in the (first) prepared directory."""
    names = data.token_dirs
    shards = [TokenShards(name) for name in names]
    # The named tokenizer's (BPE: its file's; 'byte' named explicitly: the byte tokenizer's);
    # with data.tokenizer unset the shards' own is taken as given.
    expected = getattr(tokenizer, "sha256", None) or (
        BYTE_TOKENIZER_SHA256 if data.tokenizer == "byte" else None)
    for name, part in zip(names, shards, strict=True):
        if part.unverified_shards:
            logger.warning("%d of %d shard(s) in %s carry no verification mark: each is hashed when this "
                           "rank first reads from it; run `longrun data inspect %s --verify` once to "
                           "record the mark", part.unverified_shards, len(part.manifest["shards"]),
                           name, name)
        if expected is not None and part.tokenizer_sha256 != expected:
            raise DataError(
                f"the shards in {name} were prepared with another tokenizer (sha256 "
                f"{_short(part.tokenizer_sha256)}) than data.tokenizer "
                f"{getattr(tokenizer, 'path', data.tokenizer)} (sha256 {_short(expected)}); prepare "
                "them again with `longrun data prepare ... --tokenizer` it, or set data.tokenizer "
                "to the one they were made with")
        if part.tokenizer_sha256 != shards[0].tokenizer_sha256:
            raise DataError(
                f"the shards in {name} were prepared with another tokenizer (sha256 "
                f"{_short(part.tokenizer_sha256)}) than those in {names[0]} (sha256 "
                f"{_short(shards[0].tokenizer_sha256)}); a mixture needs one tokenizer")
        if model.vocab_size < part.vocab_size:
            raise DataError(
                f"model.vocab_size = {model.vocab_size} is smaller than the vocabulary of the "
                f"tokenizer the shards in {name} were prepared with ({part.vocab_size} ids); set "
                f"model.vocab_size to at least {part.vocab_size}, or leave it out to follow the tokenizer")
    return TokenCorpus(shards, model.max_seq_len, names, index_dir=index_dir)
