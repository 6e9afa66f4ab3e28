"""`longrun data prepare`: tokenise text, jsonl and parquet inputs into token shards.

    longrun data prepare corpus/ extra.jsonl web.parquet --tokenizer runs/tok --out data/web

The main process streams the documents (`sources.py`) in input order, worker processes encode
batches of them (`encoding.py`), and the main process appends the results in order to one shard
at a time (`shards.py`). A shard closes once it holds `shard_documents` documents or
`shard_tokens` tokens, so where every shard ends depends on the documents alone: the output is
byte-identical whatever the number of workers and however often the run was interrupted.

Resume: the manifest is rewritten after every finished shard and records the tokenizer, an
inputs fingerprint (paths, sizes, modification times) and the options. Rerunning the same
command verifies the shards it lists, skips their documents and goes on; a half-written shard
(never listed) is written again. A directory made with another tokenizer, other inputs or
other options is refused rather than mixed. One run at a time writes a directory (`out_lock.py`),
and nothing under it is ever read as input.

Bad text in a record (invalid UTF-8, a lone surrogate escape) is replaced with U+FFFD and
counted (manifest "replaced", and the summary names the first file and line); strict=True
(`--strict`) refuses it instead. A finished directory gets its verification mark
(`verification.py`): every shard was hashed as it was written or re-hashed on resume, so a
training job opening it hashes nothing.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, Progress, TaskProgressColumn, TextColumn, TimeElapsedColumn

from longrun.data.encoding import EncoderPool
from longrun.data.errors import DataError
from longrun.data.out_lock import LOCK_FILE, locked_out_dir
from longrun.data.shards import (
    FORMAT,
    MANIFEST,
    ShardWriter,
    check_shard,
    dtype_name,
    read_manifest,
    read_manifest_and_digest,
    token_dtype,
    write_manifest,
)
from longrun.data.sources import (
    MAX_DOCUMENT_BYTES,
    Document,
    SourceStats,
    inputs_fingerprint,
    iter_documents,
    resolve_inputs,
)
from longrun.data.tokenizers import load_tokenizer, tokenizer_identity
from longrun.data.verification import shard_stamps, write_mark
from longrun.safe_files import remove_stale_temps

DEFAULT_SHARD_TOKENS = 1 << 27  # 128 Mi tokens: 256 MiB per uint16 shard
BATCH_CHARS = 1 << 18  # text per batch sent to a worker: large enough to amortise the pipe


@dataclass
class PrepareRun:
    """One run of prepare: the manifest and what this run did (for the summary)."""

    manifest: dict[str, Any]
    resumed_shards: int = 0  # shards a previous run had finished
    redone_shards: list[str] = field(default_factory=list)  # listed but failed verification
    documents: int = 0  # written by this run
    tokens: int = 0
    seconds: float = 0.0
    stats: SourceStats = field(default_factory=SourceStats)  # what reading skipped or replaced


def prepare(inputs: Sequence[str], tokenizer_spec: str | None, out_dir: str, *, workers: int = 2,
            shard_tokens: int = DEFAULT_SHARD_TOKENS, shard_documents: int | None = None,
            progress: bool = True, text_column: str = "text",
            patterns: Sequence[str] = ("*",), strict: bool = False,
            max_document_bytes: int = MAX_DOCUMENT_BYTES) -> dict[str, Any]:
    """Tokenise `inputs` into shards under `out_dir` (resuming what is there); the manifest."""
    return run_prepare(inputs, tokenizer_spec, out_dir, workers=workers, shard_tokens=shard_tokens,
                       shard_documents=shard_documents, progress=progress, text_column=text_column,
                       patterns=patterns, strict=strict, max_document_bytes=max_document_bytes).manifest


def run_prepare(inputs: Sequence[str], tokenizer_spec: str | None, out_dir: str, *, workers: int = 2,
                shard_tokens: int = DEFAULT_SHARD_TOKENS, shard_documents: int | None = None,
                progress: bool = True, text_column: str = "text",
                patterns: Sequence[str] = ("*",), strict: bool = False,
                max_document_bytes: int = MAX_DOCUMENT_BYTES) -> PrepareRun:
    if workers < 0:
        raise DataError(f"--workers {workers}: give 0 (encode in this process) or more")
    if shard_tokens < 1 or (shard_documents is not None and shard_documents < 1):
        raise DataError(f"shards must hold at least one token and one document (--shard-tokens "
                        f"{shard_tokens}, --shard-documents {shard_documents})")
    start = time.monotonic()
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise DataError(f"--out {out} is a file, not a directory")
    tok = load_tokenizer(tokenizer_spec)
    if max_document_bytes < 1:
        raise DataError(f"--max-document-mb must be positive (got {max_document_bytes / (1 << 20):g})")
    stats = SourceStats()
    files = resolve_inputs(inputs, patterns=patterns, exclude=out_dir, stats=stats)
    docs = iter_documents(files, text_column=text_column, stats=stats, strict=strict,
                          max_document_bytes=max_document_bytes)
    first = next(docs)  # an empty input fails here, before anything is written
    docs = itertools.chain([first], docs)

    dtype = token_dtype(tok.vocab_size)
    fresh = {"format": FORMAT, "tokenizer": tokenizer_identity(tok), "dtype": dtype_name(dtype),
             "documents": 0, "tokens": 0, "shards": [], "complete": False,
             "inputs": {"files": len(files), "bytes": sum(f.size for f in files),
                        "fingerprint": inputs_fingerprint(files)},
             "options": {"text_column": text_column, "shard_tokens": shard_tokens,
                         "shard_documents": shard_documents, "patterns": list(patterns)}}
    with locked_out_dir(out):
        remove_stale_temps(out)  # a run killed mid-write left them; the lock says none is writing
        manifest, redone = _start_or_resume(out, fresh, getattr(tok, "path", "byte"))
        run = PrepareRun(manifest, resumed_shards=len(manifest["shards"]), redone_shards=redone,
                         stats=stats)
        if not manifest["complete"]:
            with EncoderPool(workers, fresh["tokenizer"]["kind"], getattr(tok, "json", None),
                             dtype.str) as pool:
                _encode(run, out, docs, pool, dtype, total_bytes=float(fresh["inputs"]["bytes"]),
                        shard_documents=shard_documents, shard_tokens=shard_tokens, progress=progress)
        # Every listed shard was hashed: as it was written, or verified on resume just now.
        _, digest = read_manifest_and_digest(out)
        write_mark(out, digest, shard_stamps(out, run.manifest), by="data prepare")
    run.seconds = time.monotonic() - start
    return run


def _encode(run: PrepareRun, out: Path, docs: Iterator[Document], pool: EncoderPool, dtype, *,
            total_bytes: float, shard_documents: int | None, shard_tokens: int, progress: bool) -> None:
    """Encode and write every document after those the manifest lists; complete the manifest."""
    manifest, stats = run.manifest, run.stats
    with _progress(progress, total_bytes) as bar:
        skipped_bytes = sum(d.nbytes for d in itertools.islice(docs, manifest["documents"]))
        if stats.documents < manifest["documents"]:
            raise DataError(f"{out} lists {manifest['documents']} documents but the inputs now hold "
                            f"{stats.documents}: prepare into a new directory")
        bar.advance(skipped_bytes)
        encoding_start = time.monotonic()
        writer: ShardWriter | None = None

        def finish_shard() -> None:
            nonlocal writer
            entry = writer.finish()
            manifest["shards"].append(entry)
            manifest["documents"] += entry["documents"]
            manifest["tokens"] += entry["tokens"]
            write_manifest(out, manifest)
            writer = None

        try:
            for (ids, lengths), nbytes in pool.map(_batches(docs)):
                pos = tpos = 0
                while pos < len(lengths):
                    if writer is None:
                        writer = ShardWriter(out, len(manifest["shards"]), dtype)
                    take = _documents_that_fit(writer, lengths[pos:], shard_documents, shard_tokens)
                    count = int(lengths[pos:pos + take].sum())
                    writer.add(ids[tpos:tpos + count], lengths[pos:pos + take])
                    pos, tpos = pos + take, tpos + count
                    run.documents += take
                    run.tokens += count
                    if _full(writer, shard_documents, shard_tokens):
                        finish_shard()
                bar.report(nbytes, run.tokens, encoding_start)
            if writer is not None:
                finish_shard()
        except BaseException:
            if writer is not None:
                writer.abort()
            raise
    manifest["complete"] = True
    manifest["skipped"] = {"binary_files": stats.binary_files, "empty_documents": stats.empty_documents}
    if stats.special_files:  # FIFOs, sockets, devices in a walked directory: named only when met
        manifest["skipped"]["special_files"] = stats.special_files
    manifest["replaced"] = {"characters": stats.replaced_characters, "documents": stats.replaced_documents,
                            "first": stats.first_replaced}
    write_manifest(out, manifest)


def _documents_that_fit(writer: ShardWriter, lengths, shard_documents: int | None, shard_tokens: int) -> int:
    """How many of the next documents go into this shard: up to the one that fills it."""
    take = len(lengths)
    if shard_documents is not None:
        take = min(take, shard_documents - writer.documents)
    ends = writer.tokens + lengths[:take].cumsum()
    filled = int((ends < shard_tokens).sum())  # documents before the one reaching shard_tokens
    return min(take, filled + 1)


def _full(writer: ShardWriter, shard_documents: int | None, shard_tokens: int) -> bool:
    return writer.tokens >= shard_tokens or writer.documents >= (shard_documents or float("inf"))


def _batches(docs: Iterator[Document]) -> Iterator[tuple[list[str], float]]:
    texts: list[str] = []
    chars, nbytes = 0, 0.0
    for doc in docs:
        texts.append(doc.text)
        chars += len(doc.text)
        nbytes += doc.nbytes
        if chars >= BATCH_CHARS:
            yield texts, nbytes
            texts, chars, nbytes = [], 0, 0.0
    if texts:
        yield texts, nbytes


_IDENTITY_KEYS = ("format", "tokenizer", "dtype")
_OPTION_FLAGS = {"text_column": "--text-column", "shard_tokens": "--shard-tokens",
                 "shard_documents": "--shard-documents", "patterns": "--glob"}


def _start_or_resume(out: Path, fresh: dict[str, Any],
                     tokenizer_path: str) -> tuple[dict[str, Any], list[str]]:
    """The manifest to continue from: a new one for an empty or missing directory, the existing
    one (its listed shards verified) when it was made from the same tokenizer, inputs and
    options; DataError otherwise. Also the listed shards that failed verification."""
    old = read_manifest(out) if out.is_dir() else None
    if old is None:
        if out.is_dir() and any(p.name != LOCK_FILE for p in out.iterdir()):
            raise DataError(f"--out {out} is not empty and has no {MANIFEST}: it is not a prepared "
                            "token directory; give a new or empty directory")
        out.mkdir(parents=True, exist_ok=True)
        write_manifest(out, fresh)
        return fresh, []
    if old["tokenizer"]["sha256"] != fresh["tokenizer"]["sha256"]:
        raise DataError(
            f"{out} was prepared with another tokenizer ({old['tokenizer']['kind']}, sha256 "
            f"{old['tokenizer']['sha256']}) than {tokenizer_path} ({fresh['tokenizer']['kind']}, sha256 "
            f"{fresh['tokenizer']['sha256']}); prepare into a new --out, or delete {out} to start over")
    for key in _IDENTITY_KEYS:
        if old.get(key) != fresh[key]:
            raise DataError(f"{out} was prepared with {key} {old.get(key)!r}, now {fresh[key]!r}; "
                            "prepare into a new --out")
    for key, value in fresh["options"].items():
        if old["options"].get(key) != value:
            raise DataError(f"{out} was prepared with {_OPTION_FLAGS[key]} {old['options'].get(key)!r}, "
                            f"now {value!r}; rerun with the same options, or prepare into a new --out")
    if old["inputs"] != fresh["inputs"]:
        was, now = old["inputs"], fresh["inputs"]
        raise DataError(
            f"{out} was prepared from other inputs ({was['files']} files, {was['bytes']:,} bytes, "
            f"fingerprint {was['fingerprint'][:12]}; now {now['files']} files, {now['bytes']:,} bytes, "
            f"{now['fingerprint'][:12]}): an input was added, removed or modified since; "
            "prepare into a new --out, or delete it to start over")
    return _verified(out, old)


def _verified(out: Path, manifest: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """Keep the listed shards up to the first one that fails its checksum; later ones are redone
    (the inputs are unchanged, so redoing them gives the same bytes)."""
    itemsize = token_dtype(manifest["tokenizer"]["vocab_size"]).itemsize
    for i, entry in enumerate(manifest["shards"]):
        if check_shard(out, entry, itemsize, verify=True) is not None:
            redo = [e["name"] for e in manifest["shards"][i:]]
            manifest["shards"] = manifest["shards"][:i]
            manifest["documents"] = sum(e["documents"] for e in manifest["shards"])
            manifest["tokens"] = sum(e["tokens"] for e in manifest["shards"])
            manifest["complete"] = False
            manifest.pop("skipped", None)
            manifest.pop("replaced", None)
            write_manifest(out, manifest)
            return manifest, redo
    return manifest, []


class _Bar:
    """The progress bar (input bytes read), with documents, tokens and tokens/s; or nothing."""

    def __init__(self, progress: Progress | None, total: float):
        self._progress = progress
        self._task = progress.add_task("tokenising", total=total, tokens=0, rate="") if progress else None

    def advance(self, nbytes: float) -> None:
        if self._progress:
            self._progress.advance(self._task, nbytes)

    def report(self, nbytes: float, tokens: int, start: float) -> None:
        """After a batch is written: its input bytes, this run's tokens so far, since when."""
        if self._progress:
            rate = tokens / max(time.monotonic() - start, 1e-9)
            self._progress.update(self._task, advance=nbytes, tokens=tokens, rate=f"{rate:,.0f} tok/s")

    def __enter__(self) -> _Bar:
        if self._progress:
            self._progress.start()
        return self

    def __exit__(self, exc_type, *_) -> None:
        if self._progress:
            if exc_type is None:  # done: skipped binary files count as read
                self._progress.update(self._task, completed=self._progress.tasks[0].total)
            self._progress.stop()


def _progress(enabled: bool, total: float) -> _Bar:
    if not enabled:
        return _Bar(None, total)
    progress = Progress(TextColumn("{task.description}"), BarColumn(), TaskProgressColumn(),
                        TextColumn("{task.fields[tokens]:,} tokens  {task.fields[rate]}"),
                        TimeElapsedColumn(), console=Console(stderr=True))
    return _Bar(progress, total)

