"""Training documents and the order they are drawn in.

A `Corpus` is an indexable list of training documents ("chunks"): each source document is
wrapped as BOS + tokens + EOS and cut into pieces of at most model.max_seq_len tokens (only the
first piece has BOS, only the last EOS). Sources: real text (a directory of files, a .jsonl file
with a "text" field, or 'stdlib': the running interpreter's standard library, a long-tailed code
corpus on every machine) or synthetic documents with lognormal lengths.

The corpus is indexed from document lengths (plus an 8 KiB sniff per file to skip files that
are not text); tokens are read only when a chunk is drawn, so the 30 MB standard library
indexes in a fraction of a second.

`DocumentSampler` decides the order: a seeded permutation per epoch, sharded across data-parallel
ranks, with a position that `state_dict()` captures exactly.
"""

from __future__ import annotations

import codecs
import json
import logging
import math
import os
import sysconfig
from pathlib import Path, PurePosixPath
from typing import Any

import numpy as np

from longrun.config.sections import DataSection, LengthDistribution, ModelSection
from longrun.kinds import FaultKind
from longrun.trainer.tokenizer import ByteTokenizer

logger = logging.getLogger(__name__)


class DataError(ValueError):
    """The data source cannot be used as configured; the message says what to change."""

    fault_kind = FaultKind.FATAL  # recurs on any node: the controller ends the job, no restart


class Corpus:
    """Chunked documents; subclasses provide `_read(doc, start, stop)`: token ids
    [start, stop) of source document `doc` (BOS/EOS excluded)."""

    def __init__(self, content_lengths: np.ndarray, max_seq_len: int, tokenizer: ByteTokenizer):
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


# How much of each file is sniffed to tell text from binary. Like git's heuristic (a NUL in the
# first 8000 bytes means binary) plus a UTF-8 check: one open and one read of at most 8 KiB per
# file bounds the indexing cost no matter how large the files are.
_SNIFF_BYTES = 8192


def _looks_like_text(path: Path, size: int) -> bool:
    """True if the first _SNIFF_BYTES of `path` hold no NUL byte and decode as UTF-8. A
    multi-byte character cut by the sniff boundary is allowed (final=False), and only then."""
    with open(path, "rb") as f:
        head = f.read(_SNIFF_BYTES)
    if b"\0" in head:
        return False
    try:
        codecs.getincrementaldecoder("utf-8")().decode(head, final=len(head) >= size)
    except UnicodeDecodeError:
        return False
    return True


def _some(paths: list[PurePosixPath], limit: int = 3) -> str:
    names = ", ".join(str(p) for p in paths[:limit])
    return names + (f" (and {len(paths) - limit} more)" if len(paths) > limit else "")


_WARNED: set[tuple[str, tuple]] = set()


class FileCorpus(Corpus):
    """Files under `root` whose relative path matches one of `include` (PurePath.match:
    '*.py' matches at any depth), sorted by relative path. Hidden directories and the names in
    `skip_dirs` are not entered. Empty files are skipped, and so are files that are not text
    (a NUL byte or invalid UTF-8 in their first 8 KiB): those are listed in `skipped_binary`
    and named in one warning."""

    def __init__(
        self,
        root: str | Path,
        include: list[str],
        max_seq_len: int,
        tokenizer: ByteTokenizer,
        skip_dirs: frozenset[str] = frozenset(),
    ):
        self.root = Path(root)
        found = []
        for parent, dirs, files in os.walk(self.root):
            dirs[:] = [d for d in dirs if not d.startswith(".") and d not in skip_dirs]
            for name in files:
                rel = PurePosixPath(Path(parent, name).relative_to(self.root).as_posix())
                if any(rel.match(pattern) for pattern in include):
                    found.append(rel)
        found.sort()
        self.files: list[PurePosixPath] = []
        self.skipped_binary: list[PurePosixPath] = []
        sizes = []
        for rel in found:
            size = os.stat(self.root / rel).st_size
            if size == 0:
                continue
            if not _looks_like_text(self.root / rel, size):
                self.skipped_binary.append(rel)
                continue
            self.files.append(rel)
            sizes.append(size)
        if not self.files and self.skipped_binary:
            raise DataError(
                f"the files matching data.include {include} under {self.root} are not text "
                f"(a NUL byte or invalid UTF-8 in the first {_SNIFF_BYTES} bytes): "
                f"{_some(self.skipped_binary)}; point data.path at UTF-8 text files or narrow "
                "data.include to them"
            )
        if not self.files:
            raise DataError(
                f"no non-empty files matching data.include {include} under {self.root}; "
                "check data.path and data.include"
            )
        warning_key = (str(self.root), tuple(self.skipped_binary))
        if self.skipped_binary and warning_key not in _WARNED:
            _WARNED.add(warning_key)  # once per process: a benchmark may build several corpora
            logger.warning(
                "skipped %d of %d files matching data.include under %s that are not text "
                "(a NUL byte or invalid UTF-8 in the first %d bytes): %s",
                len(self.skipped_binary), len(self.skipped_binary) + len(self.files),
                self.root, _SNIFF_BYTES, _some(self.skipped_binary),
            )
        # One byte is one token (ByteTokenizer), so a file's size is its token count.
        super().__init__(np.array(sizes), max_seq_len, tokenizer)

    def _read(self, doc: int, start: int, stop: int) -> np.ndarray:
        path = self.root / self.files[doc]
        with open(path, "rb") as f:
            f.seek(start)
            data = f.read(stop - start)
        if len(data) != stop - start:
            raise DataError(f"{path} changed size while training; the corpus must not change")
        return self.tokenizer.encode_bytes(data)


class JsonlCorpus(Corpus):
    """One document per non-blank line of a .jsonl file: the line's "text" string."""

    def __init__(self, path: str | Path, max_seq_len: int, tokenizer: ByteTokenizer):
        self.path = Path(path)
        self._texts: list[bytes] = []
        with open(self.path, "rb") as f:
            for lineno, line in enumerate(f, start=1):
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                except (json.JSONDecodeError, UnicodeDecodeError) as exc:
                    raise DataError(f"{self.path} line {lineno} is not valid JSON: {exc}") from None
                text = record.get("text") if isinstance(record, dict) else None
                if not isinstance(text, str):
                    raise DataError(
                        f"{self.path} line {lineno} has no \"text\" string field; every line "
                        'must be a JSON object like {"text": "..."}'
                    )
                self._texts.append(text.encode("utf-8"))
        if not self._texts:
            raise DataError(f"{self.path} holds no documents (no non-blank lines)")
        super().__init__(np.array([len(t) for t in self._texts]), max_seq_len, tokenizer)

    def _read(self, doc: int, start: int, stop: int) -> np.ndarray:
        return self.tokenizer.encode_bytes(self._texts[doc][start:stop])


class SyntheticCorpus(Corpus):
    """`num_docs` documents of random byte ids whose lengths (BOS and EOS included) follow a
    lognormal clipped to [min_len, max_len]. Document d's tokens come from its own generator
    seeded by (seed, d), so any chunk is produced without generating the others."""

    def __init__(
        self,
        dist: LengthDistribution,
        max_seq_len: int,
        tokenizer: ByteTokenizer,
        seed: int,
        num_docs: int = 4096,
    ):
        self.seed = seed
        # A lognormal's mean is exp(mu + sigma^2 / 2), so mu = ln(mean) - sigma^2 / 2 makes the
        # unclipped mean equal dist.mean while sigma alone sets the tail. Clipping then moves
        # the realised mean a little (up from min_len, down from max_len).
        mu = math.log(dist.mean) - dist.sigma**2 / 2
        rng = np.random.default_rng([seed, 0x5EED])
        lengths = np.clip(np.rint(rng.lognormal(mu, dist.sigma, num_docs)), dist.min_len, dist.max_len)
        self.lengths = lengths.astype(np.int64)
        super().__init__(np.maximum(self.lengths - 2, 0), max_seq_len, tokenizer)

    def _read(self, doc: int, start: int, stop: int) -> np.ndarray:
        rng = np.random.default_rng([self.seed, doc])
        return rng.integers(0, 256, size=int(self._content[doc]), dtype=np.int64)[start:stop]


# The standard library directory of some installs (pyenv, python.org builds) contains
# site-packages: that is whatever happens to be installed, not the standard library.
_NOT_STDLIB = frozenset({"site-packages", "dist-packages", "__pycache__"})


def build_corpus(
    data: DataSection, model: ModelSection, tokenizer: ByteTokenizer, seed: int
) -> Corpus:
    if data.source == "synthetic":
        return SyntheticCorpus(data.synthetic, model.max_seq_len, tokenizer, seed)
    if data.path == "stdlib":
        root = sysconfig.get_paths()["stdlib"]
        return FileCorpus(root, data.include, model.max_seq_len, tokenizer, _NOT_STDLIB)
    path = Path(data.path).expanduser()
    if not path.exists():
        raise FileNotFoundError(
            f"data.path {data.path!r} does not exist; give a directory, a .jsonl file, or "
            "'stdlib' (the Python standard library)"
        )
    if path.is_dir():
        return FileCorpus(path, data.include, model.max_seq_len, tokenizer)
    if path.suffix == ".jsonl":
        return JsonlCorpus(path, model.max_seq_len, tokenizer)
    raise DataError(
        f"data.path {data.path!r} is a file but not .jsonl; give a directory, a .jsonl file "
        "with a \"text\" field per line, or 'stdlib'"
    )


class DocumentSampler:
    """An endless stream of document indices for one data-parallel rank.

    Epoch e visits a permutation seeded by (seed, e); rank r takes every dp_size-th entry from
    r, after dropping the tail that does not divide evenly, so all ranks see the same number
    of documents per epoch and no document twice. The position is (epoch, index), which is
    all `state_dict()` needs: a restored sampler yields exactly the same documents onward.
    Seeded by its own generator, independent of torch's RNG (model init, dropout)."""

    def __init__(self, num_docs: int, *, seed: int, dp_rank: int = 0, dp_size: int = 1,
                 shuffle: bool = True):
        if not 0 <= dp_rank < dp_size:
            raise ValueError(f"dp_rank ({dp_rank}) must lie in [0, dp_size = {dp_size})")
        if num_docs < dp_size:
            raise DataError(
                f"the corpus has {num_docs} documents, fewer than the {dp_size} data-parallel "
                "ranks; use more data or fewer ranks"
            )
        self.num_docs, self.seed, self.shuffle = num_docs, seed, shuffle
        self.dp_rank, self.dp_size = dp_rank, dp_size
        self.per_rank = num_docs // dp_size
        self.epoch, self.index = 0, 0
        self._order_epoch, self._order = -1, np.empty(0, dtype=np.int64)

    def _shard(self, epoch: int) -> np.ndarray:
        if self._order_epoch != epoch:
            # A (seed, epoch) pair rather than seed + epoch: seed 1 epoch 0 != seed 0 epoch 1.
            perm = (np.random.default_rng([self.seed, epoch]).permutation(self.num_docs)
                    if self.shuffle else np.arange(self.num_docs))
            self._order = perm[: self.per_rank * self.dp_size][self.dp_rank :: self.dp_size]
            self._order_epoch = epoch
        return self._order

    def __iter__(self) -> DocumentSampler:
        return self

    def __next__(self) -> int:
        if self.index >= self.per_rank:
            self.epoch, self.index = self.epoch + 1, 0
        doc = int(self._shard(self.epoch)[self.index])
        self.index += 1
        return doc

    def state_dict(self) -> dict[str, Any]:
        return {
            "epoch": self.epoch, "index": self.index, "seed": self.seed,
            "num_docs": self.num_docs, "dp_rank": self.dp_rank, "dp_size": self.dp_size,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        mine = self.state_dict()
        for key in ("seed", "num_docs", "dp_rank", "dp_size"):
            if state[key] != mine[key]:
                raise DataError(
                    f"cannot resume the data order: the saved sampler has {key} = {state[key]}, "
                    f"this one {mine[key]} (the data, seed or data-parallel layout changed)"
                )
        self.epoch, self.index = int(state["epoch"]), int(state["index"])
