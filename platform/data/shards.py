"""Prepared token shards: the on-disk format, its writer and its reader.

A directory made by `longrun data prepare`:

    manifest.json       {"format": "longrun-tokens/1", "tokenizer": {...}, "dtype", "documents",
                         "tokens", "shards": [{"name", "documents", "tokens", "bin_sha256",
                         "idx_sha256"}, ...], "complete", "inputs", "options"}
    shard-00000.bin     the documents' token ids back to back (no BOS/EOS), little-endian
                        uint16 when the vocabulary fits 65536 ids, else uint32
    shard-00000.idx     little-endian uint64 token offsets of the n documents into the .bin (n+1, 0 first)

The manifest is replaced atomically and lists only finished shards (written, fsynced, renamed
from .tmp), so whatever a crash leaves behind, the manifest never names a partial file.
`TokenShards` reads them through np.memmap: nothing is loaded until a document is read.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

import numpy as np

from longrun.data.errors import DataError

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


def _fsync_dir(path: Path) -> None:
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
    path = Path(directory) / MANIFEST
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return None
    try:
        manifest = json.loads(text)
    except ValueError as exc:
        raise DataError(f"{path} is not valid JSON ({exc}); it is not a prepared token directory") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        found = manifest.get("format") if isinstance(manifest, dict) else None
        raise DataError(f"{path} is not a {FORMAT} manifest (format: {found!r})")
    return manifest


def write_manifest(directory: str | os.PathLike, manifest: dict[str, Any]) -> None:
    """Replace manifest.json atomically: a reader sees the old one or the new one, whole."""
    directory = Path(directory)
    tmp = directory / (MANIFEST + ".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(manifest, f, indent=1)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, directory / MANIFEST)
    _fsync_dir(directory)


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
        # Open until finish() or abort(); "wb" truncates what an interrupted run left.
        self._bin = open(self._bin_tmp, "wb")  # noqa: SIM115

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
        with open(idx_tmp, "wb") as f:
            f.write(index)
            f.flush()
            os.fsync(f.fileno())
        os.replace(self._bin_tmp, self.directory / f"{self.name}.bin")
        os.replace(idx_tmp, self.directory / f"{self.name}.idx")
        _fsync_dir(self.directory)
        return {"name": self.name, "documents": self.documents, "tokens": self.tokens,
                "bin_sha256": self._hash.hexdigest(), "idx_sha256": hashlib.sha256(index).hexdigest()}

    def abort(self) -> None:
        self._bin.close()
        self._bin_tmp.unlink(missing_ok=True)


def check_shard(directory: Path, entry: dict[str, Any], itemsize: int, *, verify: bool) -> str | None:
    """What is wrong with one listed shard (a sentence naming it and its expected sha256), or None."""
    for suffix, count, size, key in ((".bin", entry["tokens"], itemsize, "bin_sha256"),
                                     (".idx", entry["documents"] + 1, INDEX_DTYPE.itemsize, "idx_sha256")):
        path = directory / f"{entry['name']}{suffix}"
        expected = count * size
        try:
            actual = path.stat().st_size
        except FileNotFoundError:
            return f"shard {path} is missing (expected sha256 {entry[key]})"
        if actual != expected:
            return (f"shard {path} is truncated or corrupt: {actual} bytes, expected {expected} "
                    f"(expected sha256 {entry[key]})")
        if verify and (found := file_sha256(path)) != entry[key]:
            return f"shard {path} is corrupt: sha256 {found}, expected sha256 {entry[key]}"
    return None


def _memmap(path: Path, dtype: np.dtype, count: int) -> np.ndarray:
    if count == 0:  # np.memmap refuses empty files
        return np.zeros(0, dtype=dtype)
    return np.memmap(path, dtype=dtype, mode="r", shape=(count,))


class TokenShards:
    """The documents of a prepared directory, read through memory maps.

    With verify=True every shard's sha256 is checked when opened (a read of every byte once);
    sizes are always checked. DataError names the shard and its expected sha256."""

    def __init__(self, path: str | os.PathLike, *, verify: bool = True):
        self.path = str(path)
        directory = Path(path)
        manifest = read_manifest(directory)
        if manifest is None:
            raise DataError(f"{directory} has no {MANIFEST}: not a prepared token directory "
                            "(make one with `longrun data prepare INPUT... --tokenizer TOK --out DIR`)")
        if not manifest.get("complete"):
            raise DataError(f"{directory} is not finished ({len(manifest['shards'])} shard(s) so far): "
                            "rerun the same `longrun data prepare` command to complete it")
        self.manifest = manifest
        self.tokenizer_sha256 = manifest["tokenizer"]["sha256"]
        self.vocab_size = int(manifest["tokenizer"]["vocab_size"])
        self.dtype = np.dtype({"uint16": "<u2", "uint32": "<u4"}[manifest["dtype"]])
        self._bins: list[np.ndarray] = []
        self._offsets: list[np.ndarray] = []
        for entry in manifest["shards"]:
            problem = check_shard(directory, entry, self.dtype.itemsize, verify=verify)
            if problem:
                raise DataError(problem + "; rerun `longrun data prepare` into a new directory")
            offsets = np.fromfile(directory / f"{entry['name']}.idx", dtype=INDEX_DTYPE).astype(np.int64)
            if offsets[0] != 0 or offsets[-1] != entry["tokens"] or np.any(np.diff(offsets) < 0):
                raise DataError(f"shard {directory / entry['name']}.idx is corrupt: its offsets do not "
                                f"run from 0 to {entry['tokens']} (expected sha256 {entry['idx_sha256']})")
            self._offsets.append(offsets)
            self._bins.append(_memmap(directory / f"{entry['name']}.bin", self.dtype, entry["tokens"]))
        counts = [len(o) - 1 for o in self._offsets]
        self._first_doc = np.concatenate([[0], np.cumsum(counts, dtype=np.int64)])
        self.lengths = (np.concatenate([np.diff(o) for o in self._offsets]) if self._offsets
                        else np.zeros(0, dtype=np.int64))

    @property
    def num_documents(self) -> int:
        return len(self.lengths)

    @property
    def num_tokens(self) -> int:
        return int(self.manifest["tokens"])

    def read(self, doc: int, start: int, stop: int) -> np.ndarray:
        """Token ids [start, stop) of document `doc` (BOS/EOS not included), as int64."""
        if not 0 <= doc < self.num_documents:
            raise IndexError(f"document {doc} is outside [0, {self.num_documents})")
        length = int(self.lengths[doc])
        if not 0 <= start <= stop <= length:
            raise IndexError(f"tokens [{start}, {stop}) are outside document {doc} (length {length})")
        shard = int(np.searchsorted(self._first_doc, doc, side="right")) - 1
        base = int(self._offsets[shard][doc - self._first_doc[shard]])
        return np.asarray(self._bins[shard][base + start: base + stop], dtype=np.int64)
