"""Documents from the inputs of `data prepare` and `tokenizer train`, streamed.

An input is a file, a directory (walked recursively in sorted order, hidden entries skipped,
file names filtered by glob patterns) or a glob pattern. Each file is read by its suffix:

- `.jsonl` / `.ndjson`: one JSON object per line, the document in its text field;
- `.parquet`: the text column, read one record batch at a time (pyarrow);
- anything else: one text file is one document; files found in a directory that are not
  UTF-8 text (a NUL byte or invalid UTF-8 in the first 8 KiB, git's heuristic) are skipped.

Bad text in a record does not stop the run: an invalid UTF-8 sequence (in a text or jsonl file)
and a lone surrogate (a JSON escape like "\\ud800", half a UTF-16 pair, common in scraped
jsonl) each become U+FFFD, counted in `SourceStats` with the file and line of the first. With
strict=True (`--strict`) the first one is refused instead, naming its file and line.

Nothing reads a whole input into memory: documents are yielded one at a time, so inputs larger
than memory stream through, and one document (a text file, a jsonl line) may hold at most
`max_document_bytes` (256 MiB unless told otherwise): a larger one is refused naming its file
and line, never read whole (a multi-GB line would exhaust memory). Only regular files are read:
a FIFO, socket or device found in a walked directory would block the run forever or never end,
so it is skipped and counted (`SourceStats.special_files`), and one named on the command line
is refused. The order is fixed by the inputs (sorted directory walks, file order, line or row
order), which is what makes prepared shards reproducible.
"""

from __future__ import annotations

import codecs
import fnmatch
import glob
import hashlib
import json
import os
import re
import stat
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import pyarrow as pa
import pyarrow.parquet as pq

from longrun.data.errors import DataError

SNIFF_BYTES = 8192
MAX_DOCUMENT_BYTES = 256 << 20  # the default cap on one document (--max-document-mb)
PARQUET_BATCH_ROWS = 1024
JSONL_SUFFIXES = (".jsonl", ".ndjson")
REPLACEMENT = "\ufffd"
NEWLINE = b"\n"
_ENCODED_REPLACEMENT = REPLACEMENT.encode("utf-8")
# A str from json.loads holds a surrogate only where an escape named half of a pair alone (a
# whole pair decodes to one character); no UTF-8 encoder or tokenizer accepts one.
_SURROGATE = re.compile("[\ud800-\udfff]")
# Where one can come from: an escape \uD800-\uDFFF (raw surrogate bytes are invalid UTF-8,
# replaced when decoded). Scanning the bytes for it first is ~6x faster than the text.
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")
_STRICT_HINT = ("fix the input, or leave out --strict to replace each such character with U+FFFD "
                "(counted in the summary)")


@dataclass(frozen=True)
class InputFile:
    path: str  # absolute
    kind: str  # "text" | "jsonl" | "parquet"
    size: int
    mtime_ns: int
    named: bool  # given on the command line (so a binary file is an error, not skipped)


class Document(NamedTuple):
    text: str
    nbytes: float  # input bytes this document accounts for: what a progress bar advances by


@dataclass
class SourceStats:
    """What reading skipped, for the summary."""

    documents: int = 0
    binary_files: int = 0
    empty_documents: int = 0
    replaced_characters: int = 0  # invalid UTF-8 sequences and lone surrogates, each now U+FFFD
    replaced_documents: int = 0
    first_replaced: str | None = None  # "FILE line N" of the first one
    special_files: int = 0  # FIFOs, sockets and devices found in walked directories: not read
    first_special: str | None = None

    _last_replaced: str | None = None

    def replaced(self, where: str, characters: int) -> None:
        self.replaced_characters += characters
        if where != self._last_replaced:  # a record with bad bytes and a lone surrogate is one
            self.replaced_documents += 1
            self._last_replaced = where
        if self.first_replaced is None:
            self.first_replaced = where

    def special(self, path: str) -> None:
        self.special_files += 1
        if self.first_special is None:
            self.first_special = path

    def special_summary(self) -> str:
        """The files skipped for not being regular files, as a warning says it; empty when none."""
        if not self.special_files:
            return ""
        return (f"skipped {self.special_files:,} file(s) that are not regular files (a FIFO, socket or "
                f"device would block or never end; first: {self.first_special})")

    def summary(self) -> str:
        """What was replaced, where first, as the summary says it; empty when nothing was."""
        if not self.replaced_characters:
            return ""
        return (f"replaced {self.replaced_characters:,} invalid character(s) with U+FFFD in "
                f"{self.replaced_documents:,} document(s) (first: {self.first_replaced})")


class _Policy:
    """One policy for bad text everywhere: replace and count, or (strict) refuse naming where."""

    def __init__(self, stats: SourceStats, strict: bool):
        self.stats, self.strict = stats, strict

    def decode(self, data: bytes, where: Callable[[int], str]) -> str:
        """`data` as UTF-8; `where(offset)` names the place of an invalid byte at `offset`."""
        try:
            return data.decode("utf-8")
        except UnicodeDecodeError as exc:
            if self.strict:
                raise DataError(f"{where(exc.start)}: invalid UTF-8 (byte 0x{data[exc.start]:02x}); "
                                f"{_STRICT_HINT}") from None
            text = data.decode("utf-8", errors="replace")
            # Each invalid sequence became one U+FFFD; the input's own U+FFFDs (EF BF BD, never
            # part of an invalid sequence) are not replacements.
            self.stats.replaced(where(exc.start),
                                text.count(REPLACEMENT) - data.count(_ENCODED_REPLACEMENT))
            return text

    def without_surrogates(self, text: str, where: str) -> str:
        found = _SURROGATE.search(text)
        if found is None:
            return text
        if self.strict:
            raise DataError(f"{where}: a lone surrogate U+{ord(found.group()):04X} (a \\u escape of half "
                            f"a UTF-16 pair, not a character); {_STRICT_HINT}")
        text, count = _SURROGATE.subn(REPLACEMENT, text)
        self.stats.replaced(where, count)
        return text


def _kind(path: str) -> str:
    lower = path.lower()
    if lower.endswith(JSONL_SUFFIXES):
        return "jsonl"
    if lower.endswith(".parquet"):
        return "parquet"
    return "text"


def _input_file(path: str, named: bool) -> InputFile:
    st = os.stat(path)
    return InputFile(os.path.abspath(path), _kind(path), st.st_size, st.st_mtime_ns, named)


def _inside(path: str, directory: str | None) -> bool:
    """Whether `path` is `directory` or lies under it (after symlinks are resolved)."""
    if directory is None:
        return False
    real = os.path.realpath(path)
    return real == directory or real.startswith(directory.rstrip(os.sep) + os.sep)


def _regular(path: str) -> bool:
    """Whether `path` is (or links to) a regular file; False when it vanished."""
    try:
        return stat.S_ISREG(os.stat(path).st_mode)
    except OSError:
        return False


def _walk(root: str, patterns: Sequence[str], exclude: str | None, stats: SourceStats) -> Iterator[str]:
    if _inside(root, exclude):
        return
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if not d.startswith(".")
                             and not _inside(os.path.join(dirpath, d), exclude))
        for name in sorted(filenames):
            if not name.startswith(".") and any(fnmatch.fnmatch(name, p) for p in patterns):
                path = os.path.join(dirpath, name)
                if _regular(path):
                    yield path
                elif os.path.exists(path):
                    stats.special(path)


def resolve_inputs(inputs: Sequence[str], *, patterns: Sequence[str] = ("*",),
                   exclude: str | None = None, stats: SourceStats | None = None) -> list[InputFile]:
    """Every file the inputs name, in reading order; DataError for an input that names nothing.
    `exclude`: a directory never read from, whether walked into, matched by a glob or named
    (prepare's output, when it sits inside an input: its shards are not documents, and they
    change between a run and its resume). Files that are not regular files are counted in
    `stats` and left out; one named on the command line is refused."""
    exclude = os.path.realpath(exclude) if exclude else None
    stats = stats if stats is not None else SourceStats()
    if not inputs:
        raise DataError("empty input: no input files or directories given")
    files: list[InputFile] = []
    for item in inputs:
        if os.path.isdir(item):
            files.extend(_input_file(p, named=False) for p in _walk(item, patterns, exclude, stats))
        elif os.path.isfile(item):
            if _inside(item, exclude):
                raise DataError(f"input {item!r} is inside the output directory {exclude}, whose files "
                                "are written by this command: give inputs outside --out")
            files.append(_input_file(item, named=True))
        elif glob.has_magic(item):
            found = sorted(p for p in glob.glob(item, recursive=True) if not _inside(p, exclude))
            for p in found:
                if not os.path.isdir(p) and not _regular(p):
                    stats.special(p)
            matched = [p for p in found if _regular(p)]
            if not matched:
                raise DataError(f"empty input: the pattern {item!r} matches no file"
                                + (f" outside the output directory {exclude}" if exclude else ""))
            files.extend(_input_file(p, named=False) for p in matched)
        elif os.path.exists(item):
            raise DataError(f"input {item!r} is not a regular file (a FIFO, socket or device); give "
                            "files, directories or glob patterns")
        else:
            raise DataError(f"input {item!r} does not exist (give files, directories or glob patterns)")
    if not files:
        raise DataError(f"empty input: no file in {', '.join(map(repr, inputs))} matches "
                        f"{', '.join(map(repr, patterns))}")
    return files


def inputs_fingerprint(files: Sequence[InputFile]) -> str:
    """sha256 over every file's path, size and modification time: changes when any input does
    (cheap to recompute on resume: a stat per file, no reading)."""
    h = hashlib.sha256()
    for f in files:
        h.update(f"{f.path}\0{f.size}\0{f.mtime_ns}\n".encode())
    return h.hexdigest()


def looks_like_text(head: bytes, size: int) -> bool:
    """True if `head`, the first bytes of a file of `size` bytes, hold no NUL byte and decode as
    UTF-8 (a multi-byte character cut at the end of `head` is allowed, and only then)."""
    if b"\0" in head:
        return False
    try:
        # final=False: a multi-byte character cut at the sniff boundary is not an error.
        codecs.getincrementaldecoder("utf-8")().decode(head, final=len(head) >= size)
    except UnicodeDecodeError:
        return False
    return True


def _open_input(f: InputFile):
    """`f` opened for reading, refused unless it is still a regular file: it was one when listed,
    but may have been replaced since, and opening a FIFO would block."""
    fd = os.open(f.path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise DataError(f"{f.path} is no longer a regular file (a FIFO, socket or device); remove it "
                        "from the inputs")
    os.set_blocking(fd, True)
    return os.fdopen(fd, "rb")


def _too_large(where: str, limit: int, what: str) -> DataError:
    return DataError(f"{where} is larger than the {limit / (1 << 20):g} MiB one document may hold "
                     f"(--max-document-mb); {what}, or raise --max-document-mb")


def _read_text(f: InputFile, policy: _Policy, limit: int) -> Iterator[Document]:
    with _open_input(f) as fh:
        head = fh.read(SNIFF_BYTES)
        if not looks_like_text(head, f.size):
            if f.named:
                raise DataError(f"{f.path} is not UTF-8 text (a NUL byte or invalid UTF-8 in its first "
                                f"{SNIFF_BYTES} bytes); only text, .jsonl and .parquet files can be read")
            policy.stats.binary_files += 1
            return
        # A text file is one document; past the sniff, a stray invalid byte is a bad record.
        # Read to one byte past the cap at most: the file may have grown since it was listed.
        data = head + fh.read(max(limit + 1 - len(head), 0))
        if len(data) > limit:
            raise _too_large(f.path, limit, "split it into smaller files")

    def where(offset: int) -> str:
        return f"{f.path} line {data.count(NEWLINE, 0, offset) + 1}"

    yield Document(policy.decode(data, where), f.size)


def _describe_fields(obj: dict) -> str:
    return ", ".join(json.dumps(k) for k in list(obj)[:20]) or "no fields"


def _lines(fh, limit: int, path: str) -> Iterator[tuple[int, bytes]]:
    """(number, line) of a file, each read with a bound: a line over `limit` bytes is refused
    once its first `limit` + 1 bytes are read, never read whole."""
    line_no = 0
    while line := fh.readline(limit + 1):
        line_no += 1
        if len(line) > limit:
            raise _too_large(f"{path} line {line_no}", limit, "split that record")
        yield line_no, line


def _read_jsonl(f: InputFile, column: str, policy: _Policy, limit: int) -> Iterator[Document]:
    with _open_input(f) as fh:
        for line_no, line in _lines(fh, limit, f.path):
            if not line.strip():
                continue
            where = f"{f.path} line {line_no}"
            if line_no == 1 and line.startswith(codecs.BOM_UTF8):
                line = line[len(codecs.BOM_UTF8):]  # what json.loads of the bytes skipped
            try:
                obj = json.loads(policy.decode(line, lambda _, where=where: where))
            except ValueError as exc:
                raise DataError(f"{where} is not valid JSON ({exc})") from None
            if not isinstance(obj, dict):
                raise DataError(f"{where} is a JSON {type(obj).__name__}, not an object with a "
                                f"{json.dumps(column)} field")
            if column not in obj:
                raise DataError(f"{where} has no {json.dumps(column)} field (it has: "
                                f"{_describe_fields(obj)}); set --text-column to the field with the text")
            text = obj[column]
            if text is not None and not isinstance(text, str):
                raise DataError(f"{where}: the {json.dumps(column)} field is a {type(text).__name__}, "
                                "not a string")
            if text and _SURROGATE_ESCAPE.search(line):
                text = policy.without_surrogates(text, where)
            yield Document(text or "", len(line))


def _read_parquet(f: InputFile, column: str) -> Iterator[Document]:
    try:
        pf = pq.ParquetFile(f.path)
    except (pa.ArrowException, OSError) as exc:
        raise DataError(f"{f.path} is not a readable parquet file ({exc})") from None
    names = pf.schema_arrow.names
    if column not in names:
        raise DataError(f"{f.path} has no column {json.dumps(column)} (it has: "
                        f"{', '.join(json.dumps(n) for n in names) or 'no columns'}); "
                        "set --text-column to the column that holds the text")
    kind = pf.schema_arrow.field(column).type
    if not (pa.types.is_string(kind) or pa.types.is_large_string(kind)):
        raise DataError(f"{f.path}: column {json.dumps(column)} holds {kind}, not strings")
    per_row = f.size / max(pf.metadata.num_rows, 1)
    batches = pf.iter_batches(batch_size=PARQUET_BATCH_ROWS, columns=[column])
    while True:
        try:
            batch = next(batches, None)
        except (pa.ArrowException, OSError) as exc:  # a corrupt page, found only when read
            raise DataError(f"{f.path} is damaged: a part of it cannot be read ({exc})") from None
        if batch is None:
            return
        for text in batch.column(0).to_pylist():
            yield Document(text or "", per_row)


def _named_os_errors(f: InputFile, docs: Iterator[Document]) -> Iterator[Document]:
    try:
        yield from docs
    except OSError as exc:  # unreadable, vanished, a disk error: name the file
        raise DataError(f"cannot read {f.path}: {exc.strerror or exc}") from None


def iter_documents(files: Sequence[InputFile], *, text_column: str = "text",
                   stats: SourceStats | None = None, strict: bool = False,
                   max_document_bytes: int = MAX_DOCUMENT_BYTES) -> Iterator[Document]:
    """The documents of `files` in order, empty ones skipped; DataError if there is none at all
    ("empty input"), raised when the stream ends. Bad text is replaced and counted in `stats`,
    or with `strict` refused naming its file and line; a text file or jsonl line over
    `max_document_bytes` is refused naming its file and line."""
    stats = stats if stats is not None else SourceStats()
    policy = _Policy(stats, strict)
    for f in files:
        if f.kind == "jsonl":
            docs = _read_jsonl(f, text_column, policy, max_document_bytes)
        elif f.kind == "parquet":
            docs = _read_parquet(f, text_column)  # Arrow strings are valid UTF-8: checked on write
        else:
            docs = _read_text(f, policy, max_document_bytes)
        for doc in _named_os_errors(f, docs):
            if not doc.text:
                stats.empty_documents += 1
                continue
            stats.documents += 1
            yield doc
    if stats.documents == 0:
        raise DataError(f"empty input: {len(files)} file(s) hold no document"
                        + (f" ({stats.binary_files} binary file(s) skipped)" if stats.binary_files else "")
                        + (f" ({stats.empty_documents} empty document(s))" if stats.empty_documents else ""))


def read_texts(inputs: Sequence[str], *, patterns: Sequence[str] = ("*",), text_column: str = "text",
               stats: SourceStats | None = None, strict: bool = False,
               max_document_bytes: int = MAX_DOCUMENT_BYTES) -> Iterator[str]:
    """Just the texts of the inputs, in order (what training a tokenizer reads)."""
    stats = stats if stats is not None else SourceStats()
    files = resolve_inputs(inputs, patterns=patterns, stats=stats)
    for doc in iter_documents(files, text_column=text_column, stats=stats, strict=strict,
                              max_document_bytes=max_document_bytes):
        yield doc.text
