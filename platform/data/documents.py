"""Training documents and the order they are drawn in.

A `Corpus` (`corpus.py`) is an indexable list of training documents ("chunks"): each source
document is wrapped as BOS + tokens + EOS and cut into pieces of at most model.max_seq_len
tokens. Sources: real text (a directory of files, a .jsonl file with a "text" field, or
'stdlib': the running interpreter's standard library, a long-tailed code corpus on every
machine), synthetic documents with lognormal lengths, or token shards prepared by `longrun data
prepare` (`token_corpus.py`; the only source for a BPE tokenizer).

The corpus is indexed from document lengths (plus an 8 KiB sniff per file to skip files that
are not text); tokens are read only when a chunk is drawn, so the 30 MB standard library
indexes in a fraction of a second. A .jsonl file (`jsonl_corpus.py`) and prepared shards are
indexed once per data set version and the index memory-mapped by every rank (`index_cache.py`).

`DocumentSampler` decides the order: one seeded permutation of all documents per epoch, the
same on every rank, with a position that `state_dict()` captures exactly and that fits any
world size (a mixture of several prepared datasets: `mixture.py`). Every rank draws each step's
whole global batch from it; `step.py` splits the batch among the ranks.
"""

from __future__ import annotations

import logging
import math
import os
import stat
import sysconfig
from pathlib import Path, PurePosixPath
from typing import Any

import numpy as np

from longrun.config.sections import DataSection, LengthDistribution, ModelSection
from longrun.data.byte_tokenizer import ByteTokenizer
from longrun.data.corpus import Corpus, SpecialTokens
from longrun.data.errors import DataError
from longrun.data.jsonl_corpus import JsonlCorpus
from longrun.data.orders import SharedOrders, epoch_permutation
from longrun.data.sources import looks_like_text
from longrun.data.token_corpus import open_token_corpus

# Re-exported: DataError, Corpus and JsonlCorpus were defined here first, and callers import
# them from here.
__all__ = ["Corpus", "DataError", "DocumentSampler", "FileCorpus", "JsonlCorpus", "SyntheticCorpus",
           "build_corpus"]

logger = logging.getLogger(__name__)


# How much of each file is sniffed to tell text from binary. Like git's heuristic (a NUL in the
# first 8000 bytes means binary) plus a UTF-8 check: one open and one read of at most 8 KiB per
# file bounds the indexing cost no matter how large the files are.
_SNIFF_BYTES = 8192


def _looks_like_text(path: Path, size: int) -> bool:
    with open(path, "rb") as f:
        return looks_like_text(f.read(_SNIFF_BYTES), size)


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
            st = os.stat(self.root / rel)
            if not stat.S_ISREG(st.st_mode):
                # A FIFO, socket or device: opening it would block or never end.
                logger.warning("skipped %s under %s: not a regular file", rel, self.root)
                continue
            size = st.st_size
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


class SyntheticCorpus(Corpus):
    """`num_docs` documents of random byte ids whose lengths (BOS and EOS included) follow a
    lognormal clipped to [min_len, max_len]. Document d's tokens come from its own generator
    seeded by (seed, d), so any chunk is produced without generating the others."""

    def __init__(
        self,
        dist: LengthDistribution,
        max_seq_len: int,
        tokenizer: SpecialTokens,
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
    data: DataSection, model: ModelSection, tokenizer: SpecialTokens, seed: int
) -> Corpus:
    if data.source == "tokens":
        return open_token_corpus(data, model, tokenizer)
    if data.source == "synthetic":
        return SyntheticCorpus(data.synthetic, model.max_seq_len, tokenizer, seed)
    if not isinstance(tokenizer, ByteTokenizer):
        # Text is indexed by file sizes (one byte, one token) and read by byte ranges.
        raise DataError(
            f"the text source reads files one byte per token, so it cannot use the tokenizer "
            f"{getattr(tokenizer, 'path', tokenizer)}; tokenise the text once with `longrun data "
            "prepare INPUT... --tokenizer TOKENIZER --out DIR` and train with data.source 'tokens', "
            "data.path DIR")
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
        return JsonlCorpus(path, model.max_seq_len, tokenizer)  # its index beside the file
    raise DataError(
        f"data.path {data.path!r} is a file but not .jsonl; give a directory, a .jsonl file "
        "with a \"text\" field per line, or 'stdlib'"
    )


def refuse_per_rank_position(state: dict[str, Any]) -> None:
    """A position saved by an earlier longrun, in which each data-parallel rank had its own
    share of the order, names no point of the one global order: refuse it."""
    if int(state.get("dp_size", 1)) > 1:
        raise DataError(
            f"cannot resume the data order: the saved position was written by an earlier longrun "
            f"with per-rank data positions (dp_size = {state['dp_size']}, one position per "
            "data-parallel rank); this longrun keeps one global position and cannot tell where that "
            "run stood in it. Finish that run with the longrun that wrote it, or start a new run")


class DocumentSampler:
    """An endless stream of document indices: the one global order, identical on every rank.

    Epoch e visits a permutation of all documents seeded by (seed, e). The position is
    (epoch, index), which is all `state_dict()` needs: a restored sampler yields exactly the
    same documents onward, at any world size (nothing in it names a rank or a layout). Seeded
    by its own generator, independent of torch's RNG (model init, dropout). With `orders`
    (the corpus's `SharedOrders`) the permutation is mapped from a file one process wrote
    instead of computed by every rank: the same values (`orders.py`)."""

    def __init__(self, num_docs: int, *, seed: int, shuffle: bool = True,
                 orders: SharedOrders | None = None):
        if num_docs < 1:
            raise DataError("the corpus has no documents; use more data")
        self.num_docs, self.seed, self.shuffle = num_docs, seed, shuffle
        self.orders = orders
        self.epoch, self.index = 0, 0
        self._order_epoch, self._order = -1, np.empty(0, dtype=np.int64)

    def _permutation(self, epoch: int) -> np.ndarray:
        if self._order_epoch != epoch:
            # The last epoch's order is not held while the next is made (nor kept if that fails).
            self._order_epoch, self._order = -1, None
            if not self.shuffle:
                self._order = np.arange(self.num_docs)
            elif self.orders is not None:
                self._order = self.orders.permutation(self.seed, epoch, self.num_docs)
            else:
                self._order = epoch_permutation(self.seed, epoch, self.num_docs)
            self._order_epoch = epoch
        return self._order

    def __iter__(self) -> DocumentSampler:
        return self

    def __next__(self) -> int:
        if self.index >= self.num_docs:
            self.epoch, self.index = self.epoch + 1, 0
        doc = int(self._permutation(self.epoch)[self.index])
        self.index += 1
        return doc

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "index": self.index, "seed": self.seed, "num_docs": self.num_docs}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if "parts" in state:
            raise DataError("cannot resume the data order: the saved position is of a mixture "
                            f"of {len(state['parts'])} datasets, this job reads one (data.mix was removed)")
        refuse_per_rank_position(state)
        mine = self.state_dict()
        for key in ("seed", "num_docs"):
            if state[key] != mine[key]:
                raise DataError(
                    f"cannot resume the data order: the saved sampler has {key} = {state[key]}, "
                    f"this one {mine[key]} (the data or the seed changed)"
                )
        self.epoch, self.index = int(state["epoch"]), int(state["index"])
