"""The model's vocabulary follows the job's tokenizer, and prepared shards must match it.

Resolved when the config is validated, so `longrun config validate` already says what is wrong:

- `model.vocab_size` left unset takes the tokenizer's size: `data.tokenizer`'s, or, without one,
  the size recorded in the prepared shards' manifest. Set smaller than that, it is refused
  (some token ids would have no embedding row); set larger, it is kept (padding).
- Shards prepared with another tokenizer than `data.tokenizer` are refused, naming both, and
  so is a mixture of shards prepared with different tokenizers.
- Text sources are indexed by bytes (one byte, one token), so they take the byte tokenizer
  only; a BPE tokenizer needs the text tokenised once by `longrun data prepare`.

Only JSON is read here (tokenizer.json, manifest.json), never the `tokenizers` library: config
validation stays cheap and torch-free. A prepared directory that does not exist yet is not a
config problem (it may be made later, or live on the cluster): opening the corpus checks it.

One rule for paths of a submitted job (`paths_elsewhere`): `longrun submit` checks what exists
on the submitting machine and leaves what does not to the cluster, which loads the shipped
config again before it runs (a tokenizer there only, like `model.init_from`); and a vocabulary
it could not resolve is not pinned in the shipped config (`JobConfig.to_yaml(pin_vocabulary=False)`).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from longrun.config.job import JobConfig

MANIFEST = "manifest.json"
TOKENIZER_FILE = "tokenizer.json"
# False while `longrun submit` loads a config: a tokenizer not on this machine may be the cluster's.
_PATHS_HERE: ContextVar[bool] = ContextVar("longrun_paths_here", default=True)


@contextmanager
def paths_elsewhere() -> Iterator[None]:
    """Validate configs for a job that runs elsewhere (see the module docstring)."""
    token = _PATHS_HERE.set(False)
    try:
        yield
    finally:
        _PATHS_HERE.reset(token)
# The byte tokenizer has no file; this names its one fixed mapping (ids 0-255 the UTF-8 bytes,
# 256-258 BOS/EOS/PAD) whatever model.vocab_size pads it to, since the ids do not change.
BYTE_TOKENIZER_SHA256 = hashlib.sha256(b"longrun byte tokenizer/1: 0-255 bytes, 256 BOS, 257 EOS, 258 PAD"
                                       ).hexdigest()


class TokenizerFileError(ValueError):
    """data.tokenizer does not name a readable tokenizer.json."""


@dataclass(frozen=True)
class TokenizerFile:
    path: Path
    sha256: str
    vocab_size: int  # one more than the largest token id (model vocabulary and added tokens)


def tokenizer_json(spec: str) -> Path:
    """The tokenizer.json a `data.tokenizer` value names: the file, or the one in a directory."""
    path = Path(spec).expanduser()
    return path / TOKENIZER_FILE if path.is_dir() else path


def read_tokenizer_file(spec: str) -> TokenizerFile:
    path = tokenizer_json(spec)
    if not path.is_file():
        raise TokenizerFileError(
            f"no tokenizer at {path}; give a tokenizer.json file or a directory holding one "
            "(`longrun tokenizer train INPUT... --vocab-size N --out DIR` makes one)")
    blob = path.read_bytes()
    try:
        spec_json = json.loads(blob)
        model = spec_json["model"]
        vocab = model["vocab"]
        # BPE and WordPiece map token -> id; Unigram lists [piece, score] with the index as id.
        ids = list(vocab.values()) if isinstance(vocab, dict) else list(range(len(vocab)))
        ids += [int(t["id"]) for t in spec_json.get("added_tokens") or []]
    except (ValueError, KeyError, TypeError) as exc:
        raise TokenizerFileError(f"{path} is not a tokenizer.json ({type(exc).__name__}: {exc})") from None
    if not ids:
        raise TokenizerFileError(f"{path} has an empty vocabulary")
    return TokenizerFile(path, hashlib.sha256(blob).hexdigest(), max(ids) + 1)


def read_manifest_tokenizer(directory: str) -> dict | None:
    """The `tokenizer` record of a prepared directory's manifest; None where there is none yet
    (or it is unreadable: opening the shards reports that, naming the file)."""
    try:
        record = json.loads((Path(directory).expanduser() / MANIFEST).read_text())["tokenizer"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return record if isinstance(record, dict) else None


def _short(sha: str) -> str:
    return str(sha)[:12]


def resolve_vocabulary(cfg: JobConfig) -> list[tuple[str, str]]:
    """Set `cfg.model.vocab_size` from the tokenizer unless it was given; return the problems
    as (dotted path, reason) pairs."""
    data, problems = cfg.data, []
    tokenizer = None
    if not data.uses_byte_tokenizer:
        try:
            tokenizer = read_tokenizer_file(str(data.tokenizer))
        except TokenizerFileError as exc:
            if _PATHS_HERE.get() or Path(str(data.tokenizer)).expanduser().exists():
                return [("data.tokenizer", str(exc))]
            return []  # on the cluster only: checked there, and the vocabulary resolved there
        if data.source == "text":
            problems.append(("data.tokenizer", (
                "the text source reads files at train time one byte per token, so it takes the "
                "byte tokenizer only; tokenise the text once with `longrun data prepare INPUT... "
                f"--tokenizer {data.tokenizer} --out DIR` and train with source 'tokens', path DIR")))
    size, size_from = (tokenizer.vocab_size, f"data.tokenizer {tokenizer.path}") if tokenizer else (None, "")
    # What the shards must have been made with: the named tokenizer, the byte tokenizer when
    # named explicitly, or (data.tokenizer unset) whatever they record.
    expected = tokenizer.sha256 if tokenizer else BYTE_TOKENIZER_SHA256 if data.tokenizer == "byte" else None
    first: tuple[str, dict] | None = None
    for i, directory in enumerate(data.token_dirs):
        where = "data.path" if data.mix is None else f"data.mix[{i}].path"
        record = read_manifest_tokenizer(directory)
        if record is None:
            continue
        sha = str(record.get("sha256"))
        if expected is not None and sha != expected:
            named = (f"data.tokenizer {tokenizer.path}" if tokenizer
                     else "the byte tokenizer (data.tokenizer: byte)")
            problems.append(("data.tokenizer", (
                f"the shards in {directory} were prepared with another tokenizer (sha256 "
                f"{_short(sha)}...) than {named} (sha256 {_short(expected)}...); prepare them again "
                "with it, or set data.tokenizer to the one they were made with")))
        elif first is not None and sha != str(first[1].get("sha256")):
            problems.append((where, (
                f"the shards in {directory} were prepared with another tokenizer (sha256 "
                f"{_short(sha)}...) than those in {first[0]} (sha256 {_short(first[1].get('sha256'))}...); "
                "a mixture needs one tokenizer")))
        first = first or (directory, record)
        if size is None and isinstance(record.get("vocab_size"), int):
            size = record["vocab_size"]
            size_from = f"the tokenizer the shards in {directory} were prepared with"
    if size is None or problems:
        return problems
    model = cfg.model
    if "vocab_size" not in model.model_fields_set:
        model.vocab_size = size
        return problems
    if model.vocab_size < size:
        problems.append(("model.vocab_size", (
            f"{model.vocab_size} is smaller than the vocabulary of {size_from} ({size} tokens); "
            f"set model.vocab_size to at least {size}, or leave it out to follow the tokenizer")))
    return problems


def tokenizer_record(cfg: JobConfig) -> dict | None:
    """What a checkpoint records of the job's tokenizer, so an export can ship it and check it
    is still the same file: {"spec": "byte" | the tokenizer.json's absolute path | None,
    "sha256", and where only the shards know it (data.tokenizer unset) their "bos", "eos",
    "pad" ids}. None when nothing is known."""
    data = cfg.data
    if not data.uses_byte_tokenizer:
        found = read_tokenizer_file(str(data.tokenizer))  # validated at load: it exists
        return {"spec": str(found.path.resolve()), "sha256": found.sha256}
    if data.tokenizer == "byte" or data.source != "tokens":
        return {"spec": "byte", "sha256": BYTE_TOKENIZER_SHA256}
    record = read_manifest_tokenizer(data.token_dirs[0])
    if record is None:
        return None
    return {"spec": None, "sha256": record.get("sha256"),
            **{k: record[k] for k in ("bos", "eos", "pad") if isinstance(record.get(k), int)}}
