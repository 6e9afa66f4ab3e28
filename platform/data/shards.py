"""Prepared token shards: the on-disk format, its writer and its reader.

A directory made by `longrun data prepare`:

    manifest.json       {"format": "longrun-tokens/1", "tokenizer": {...}, "dtype", "documents",
                         "tokens", "shards": [{"name", "documents", "tokens", "bin_sha256",
                         "idx_sha256"}, ...], "complete", "inputs", "options"}
    shard-00000.bin     the documents' token ids back to back (no BOS/EOS), little-endian
                        uint16 when the vocabulary fits 65536 ids, else uint32
    shard-00000.idx     little-endian uint64 token offsets of the n documents into the .bin (n+1, 0 first)

    verified.json       which shard files are known to match their sha256 (`verification.py`)

The manifest is replaced atomically and lists only finished shards (written, fsynced, renamed
from .tmp), so whatever a crash leaves behind, the manifest never names a partial file.
`TokenShards` reads them through np.memmap, the .idx files too: nothing is loaded until a
document is read, every process opening a directory shares the pages of its index files, and
opening hashes nothing (only sizes are checked): a shard the verification mark does not vouch
for is hashed the first time this process reads from it, before its tokens are returned.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import threading
from pathlib import Path
from typing import Any

import numpy as np

from longrun.data.errors import DataError
from longrun.data.verification import Stamps, manifest_sha256, read_mark, stamp
from longrun.safe_files import fresh, replace_file

FORMAT = "longrun-tokens/1"
MANIFEST = "manifest.json"
INDEX_DTYPE = np.dtype("<u8")
HASH_CHUNK = 1 << 22


def token_dtype(vocab_size: int) -> np.dtype:
    return np.dtype("<u2") if vocab_size <= 1 << 16 else np.dtype("<u4")


def dtype_name(dtype: np.dtype) -> str:
    return {2: "uint16", 4: "uint32"}[np.dtype(dtype).itemsize]


def shard_name(index: int) -> str:
    return f"shard-{index:05d}"


def fsync_dir(path: Path) -> None:
    """Make a directory's entries (a file created or renamed in it) durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(HASH_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def read_manifest(directory: str | os.PathLike) -> dict[str, Any] | None:
    """The manifest of a prepared directory, None when it has none (yet)."""
    return read_manifest_and_digest(directory)[0]


def read_manifest_and_digest(directory: str | os.PathLike) -> tuple[dict[str, Any] | None, str | None]:
    """The manifest and the sha256 of its bytes (what the verification mark is keyed by)."""
    path = Path(directory) / MANIFEST
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return None, None
    try:
        manifest = json.loads(data)
    except ValueError as exc:
        raise DataError(f"{path} is not valid JSON ({exc}); it is not a prepared token directory") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        found = manifest.get("format") if isinstance(manifest, dict) else None
        raise DataError(f"{path} is not a {FORMAT} manifest (format: {found!r})")
    return manifest, manifest_sha256(data)


def write_manifest(directory: str | os.PathLike, manifest: dict[str, Any]) -> str:
    """Replace manifest.json atomically: a reader sees the old one or the new one, whole.
    Returns the sha256 of the bytes written."""
    directory = Path(directory)
    data = (json.dumps(manifest, indent=1) + "\n").encode("utf-8")
    replace_file(directory / MANIFEST, data)  # a new temporary name: never through a planted link
    fsync_dir(directory)
    return manifest_sha256(data)


class ShardWriter:
    """One shard being written: documents appended in order, `finish()` makes it durable."""

    def __init__(self, directory: str | os.PathLike, index: int, dtype: np.dtype):
        self.directory = Path(directory)
        self.name = shard_name(index)
        self.dtype = np.dtype(dtype)
        self.documents = 0
        self.tokens = 0
        self._offsets = [0]
        self._hash = hashlib.sha256()
        self._bin_tmp = self.directory / f"{self.name}.bin.tmp"
        # Open until finish() or abort(); what an interrupted run left there is removed first,
        # and the file is created afresh (a link planted there is not written through).
        self._bin = fresh(self._bin_tmp)

    def add(self, tokens: np.ndarray, lengths: np.ndarray) -> None:
        """Append documents: `tokens` their ids back to back, `lengths` each one's count."""
        data = np.ascontiguousarray(tokens, dtype=self.dtype)
        self._bin.write(data.data)
        self._hash.update(data.data)
        ends = self.tokens + np.cumsum(lengths, dtype=np.int64)
        self._offsets.extend(ends.tolist())
        self.documents += len(lengths)
        self.tokens += int(data.size)

    def finish(self) -> dict[str, Any]:
        """Write the index, fsync both files, rename them into place; the manifest entry."""
        self._bin.flush()
        os.fsync(self._bin.fileno())
        self._bin.close()
        index = np.asarray(self._offsets, dtype=INDEX_DTYPE).tobytes()
        idx_tmp = self.directory / f"{self.name}.idx.tmp"
        with fresh(idx_tmp) as f:
            f.write(index)
            f.flush()
            os.fsync(f.fileno())
        os.replace(self._bin_tmp, self.directory / f"{self.name}.bin")
        os.replace(idx_tmp, self.directory / f"{self.name}.idx")
        fsync_dir(self.directory)
        return {"name": self.name, "documents": self.documents, "tokens": self.tokens,
                "bin_sha256": self._hash.hexdigest(), "idx_sha256": hashlib.sha256(index).hexdigest()}

    def abort(self) -> None:
        self._bin.close()
        self._bin_tmp.unlink(missing_ok=True)


def _check_sizes(directory: Path, entry: dict[str, Any], itemsize: int) -> tuple[str | None, Stamps]:
    """What is wrong with the sizes of one listed shard's files (or None), and their stamps."""
    stamps: Stamps = {}
    for suffix, count, size, key in ((".bin", entry["tokens"], itemsize, "bin_sha256"),
                                     (".idx", entry["documents"] + 1, INDEX_DTYPE.itemsize, "idx_sha256")):
        path = directory / f"{entry['name']}{suffix}"
        expected = count * size
        try:
            st = path.stat()
        except FileNotFoundError:
            return f"shard {path} is missing (expected sha256 {entry[key]})", stamps
        if st.st_size != expected:
            return (f"shard {path} is truncated or corrupt: {st.st_size} bytes, expected {expected} "
                    f"(expected sha256 {entry[key]})"), stamps
        stamps[path.name] = stamp(st)
    return None, stamps


def _check_hashes(directory: Path, entry: dict[str, Any]) -> str | None:
    for suffix, key in ((".bin", "bin_sha256"), (".idx", "idx_sha256")):
        path = directory / f"{entry['name']}{suffix}"
        # Looked up at call time (not bound at import): tests inject a slow or failing read here.
        if (found := file_sha256(path)) != entry[key]:
            return f"shard {path} is corrupt: sha256 {found}, expected sha256 {entry[key]}"
    return None


def check_shard(directory: Path, entry: dict[str, Any], itemsize: int, *, verify: bool) -> str | None:
    """What is wrong with one listed shard (a sentence naming it and its expected sha256), or None."""
    problem, _ = _check_sizes(directory, entry, itemsize)
    if problem is None and verify:
        problem = _check_hashes(directory, entry)
    return problem


def _corrupt_index(directory: Path, entry: dict[str, Any]) -> str:
    return (f"shard {directory / entry['name']}.idx is corrupt: its offsets do not run from 0 to "
            f"{entry['tokens']} (expected sha256 {entry['idx_sha256']})")


def _memmap(path: Path, dtype: np.dtype, count: int) -> np.ndarray:
    if count == 0:  # np.memmap refuses empty files
        return np.zeros(0, dtype=dtype)
    return np.memmap(path, dtype=dtype, mode="r", shape=(count,))


VERIFY_MODES = ("lazy", "all", "sizes")
_REPREPARE = "; rerun `longrun data prepare` into a new directory"


class TokenShards:
    """The documents of a prepared directory, read through memory maps.

    Sizes are always checked when opened. `verify` says when sha256s are:
    - "lazy" (training): opening hashes nothing; a shard the verification mark does not vouch
      for (no mark, a mark of another manifest, or its file changed since) is hashed the first
      time it is read from, in the reading thread, before any of its tokens are returned. A
      process hashes only the shards it reads, each at most once.
    - "all" (`data inspect --verify`): every shard is hashed now.
    - "sizes": never.
    DataError names the shard file and its expected sha256."""

    def __init__(self, path: str | os.PathLike, *, verify: str = "lazy"):
        if verify not in VERIFY_MODES:
            raise ValueError(f"verify must be one of {VERIFY_MODES}, not {verify!r}")
        self.path = str(path)
        directory = Path(path)
        manifest, digest = read_manifest_and_digest(directory)
        if manifest is None:
            raise DataError(f"{directory} has no {MANIFEST}: not a prepared token directory "
                            "(make one with `longrun data prepare INPUT... --tokenizer TOK --out DIR`)")
        if not manifest.get("complete"):
            raise DataError(f"{directory} is not finished ({len(manifest['shards'])} shard(s) so far): "
                            "rerun the same `longrun data prepare` command to complete it")
        self.manifest = manifest
        self.manifest_sha256 = digest
        self.tokenizer_sha256 = manifest["tokenizer"]["sha256"]
        self.vocab_size = int(manifest["tokenizer"]["vocab_size"])
        self.dtype = np.dtype({"uint16": "<u2", "uint32": "<u4"}[manifest["dtype"]])
        self.stamps: Stamps = {}  # every shard file's [size, mtime_ns] when opened
        marked = read_mark(directory, digest) if verify == "lazy" else {}
        self._verified: set[int] = set()  # shards known good: nothing to hash before reading them
        self._verify_lock = threading.Lock()
        self._bins: list[np.ndarray] = []
        self._offsets: list[np.ndarray] = []
        for i, entry in enumerate(manifest["shards"]):
            problem, stamps = _check_sizes(directory, entry, self.dtype.itemsize)
            if problem is None and verify == "all":
                problem = _check_hashes(directory, entry)
            if problem:
                raise DataError(problem + _REPREPARE)
            self.stamps.update(stamps)
            if verify != "lazy" or all(marked.get(name) == st for name, st in stamps.items()):
                self._verified.add(i)
            # Mapped, not read: a rank holds no private copy of the offsets, and opening reads
            # two of them (the rest are checked where they are turned into lengths).
            offsets = np.memmap(directory / f"{entry['name']}.idx", dtype=INDEX_DTYPE, mode="r",
                                shape=(entry["documents"] + 1,))
            if int(offsets[0]) != 0 or int(offsets[-1]) != entry["tokens"]:
                raise DataError(_corrupt_index(directory, entry))
            self._offsets.append(offsets)
            self._bins.append(_memmap(directory / f"{entry['name']}.bin", self.dtype, entry["tokens"]))
        counts = [int(entry["documents"]) for entry in manifest["shards"]]
        self._first_doc = np.concatenate([[0], np.cumsum(counts, dtype=np.int64)])

    @property
    def num_shards(self) -> int:
        return len(self._offsets)

    def shard_lengths(self, shard: int) -> np.ndarray:
        """The token counts of one shard's documents (int64); DataError when its offsets go
        backwards (a corrupt .idx)."""
        lengths = np.diff(np.asarray(self._offsets[shard], dtype=np.int64))
        if len(lengths) and lengths.min() < 0:
            raise DataError(_corrupt_index(Path(self.path), self.manifest["shards"][shard]))
        return lengths

    @functools.cached_property
    def lengths(self) -> np.ndarray:
        """Every document's token count, in a private array (training maps them from an index
        file instead: `token_corpus.py`)."""
        if not self._offsets:
            return np.zeros(0, dtype=np.int64)
        return np.concatenate([self.shard_lengths(i) for i in range(self.num_shards)])

    @property
    def unverified_shards(self) -> int:
        """Shards that will be hashed when first read (no verification mark vouches for them)."""
        return len(self._offsets) - len(self._verified)

    def _verify(self, shard: int) -> None:
        with self._verify_lock:  # two threads reading one new shard hash it once
            if shard in self._verified:
                return
            problem = _check_hashes(Path(self.path), self.manifest["shards"][shard])
            if problem:
                raise DataError(problem + _REPREPARE)
            self._verified.add(shard)

    @property
    def num_documents(self) -> int:
        return int(self._first_doc[-1])

    @property
    def num_tokens(self) -> int:
        return int(self.manifest["tokens"])

    def read(self, doc: int, start: int, stop: int) -> np.ndarray:
        """Token ids [start, stop) of document `doc` (BOS/EOS not included), as int64."""
        if not 0 <= doc < self.num_documents:
            raise IndexError(f"document {doc} is outside [0, {self.num_documents})")
        shard = int(np.searchsorted(self._first_doc, doc, side="right")) - 1
        local = doc - int(self._first_doc[shard])
        base, end = int(self._offsets[shard][local]), int(self._offsets[shard][local + 1])
        if not 0 <= start <= stop <= end - base:
            raise IndexError(f"tokens [{start}, {stop}) are outside document {doc} (length {end - base})")
        if shard not in self._verified:
            self._verify(shard)
        return np.asarray(self._bins[shard][base + start: base + stop], dtype=np.int64)
