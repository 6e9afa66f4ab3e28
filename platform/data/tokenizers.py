"""Tokenizers: the byte tokenizer, or a byte-level BPE from a local `tokenizer.json`.

    tok = load_tokenizer("runs/tok")          # a directory holding tokenizer.json, or the file
    tok = load_tokenizer(None)                # the byte tokenizer (the tiny demo)
    train_bpe(["corpus/"], 8192, "runs/tok")  # as `longrun tokenizer train corpus/ --vocab-size 8192 ...`

A BPE tokenizer is read with `tokenizers.Tokenizer` from a local file, never from a hub. It
must have the special tokens "<s>", "</s>" and "<pad>" (BOS, EOS, PAD of the packed documents).
`BPETokenizer.save` writes what Hugging Face's `AutoTokenizer.from_pretrained(DIR)` reads, so a
model exported with it is usable downstream. A tokenizer is identified by the sha256 of its
tokenizer.json bytes: prepared shards record it, and training refuses shards made with another.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from longrun.config.vocabulary import BYTE_TOKENIZER_SHA256
from longrun.data.byte_tokenizer import ByteTokenizer
from longrun.data.errors import DataError
from longrun.data.sources import MAX_DOCUMENT_BYTES, SourceStats, read_texts
from longrun.safe_files import replace_file

BOS_TOKEN, EOS_TOKEN, PAD_TOKEN = "<s>", "</s>", "<pad>"
SPECIAL_TOKENS = (BOS_TOKEN, EOS_TOKEN, PAD_TOKEN)  # trained first: ids 0, 1, 2
TOKENIZER_FILE = "tokenizer.json"


class TokenizerError(DataError):
    """A tokenizer that cannot be loaded or trained as asked; the message says why."""


def _special_token_names(folder: Path) -> dict[str, str]:
    """BOS/EOS/PAD token strings: as a Hugging Face tokenizer directory names them
    (tokenizer_config.json, else special_tokens_map.json), else longrun's own."""
    names = {"bos": BOS_TOKEN, "eos": EOS_TOKEN, "pad": PAD_TOKEN}
    for name in ("special_tokens_map.json", "tokenizer_config.json"):  # the latter wins
        try:
            config = json.loads((folder / name).read_text(encoding="utf-8"))
        except (OSError, ValueError):
            continue
        for role in names:
            value = config.get(f"{role}_token") if isinstance(config, dict) else None
            value = value.get("content") if isinstance(value, dict) else value
            if isinstance(value, str) and value:
                names[role] = value
    return names


class BPETokenizer:
    """A `tokenizers.Tokenizer` with longrun's special tokens; the ByteTokenizer's duck type."""

    kind = "bpe"

    def __init__(self, path: str | os.PathLike):
        self.path = str(path)
        try:
            raw = Path(self.path).read_bytes()
            self._tok = Tokenizer.from_str(raw.decode("utf-8"))
        except Exception as exc:  # OSError, bad UTF-8, or tokenizers' plain Exception for bad JSON
            raise TokenizerError(f"cannot load the tokenizer {self.path}: {exc}") from None
        self.sha256 = hashlib.sha256(raw).hexdigest()
        self._json = raw.decode("utf-8")
        # Text is text: a document containing "<s>" must not put a BOS into the stream.
        self._tok.encode_special_tokens = True
        self.tokens = _special_token_names(Path(self.path).parent)
        ids = {role: self._tok.token_to_id(t) for role, t in self.tokens.items()}
        if ids["eos"] is None:
            raise TokenizerError(
                f"the tokenizer {self.path} has no end-of-document token {self.tokens['eos']!r}; name "
                "its EOS as eos_token in tokenizer_config.json beside it, or train one with "
                "`longrun tokenizer train`")
        # Many tokenizers have no PAD (GPT-2, Llama 3) and some no BOS (GPT-2 uses one token
        # for both): EOS stands in. Padding is never a training target, and a document start
        # marked by EOS is what such models were trained with.
        for role in ("bos", "pad"):
            if ids[role] is None:
                ids[role], self.tokens[role] = ids["eos"], self.tokens["eos"]
        self.BOS, self.EOS, self.PAD = ids["bos"], ids["eos"], ids["pad"]
        # Added tokens may leave holes in the id space: the model must cover the largest id.
        largest = max(self._tok.get_vocab(with_added_tokens=True).values())
        self.vocab_size = max(self._tok.get_vocab_size(with_added_tokens=True), largest + 1)

    def __repr__(self) -> str:
        return f"BPETokenizer({self.path!r}, vocab_size={self.vocab_size})"

    @property
    def json(self) -> str:
        """The tokenizer.json text (what worker processes rebuild the tokenizer from)."""
        return self._json

    def encode(self, text: str, *, bos: bool = False, eos: bool = False) -> list[int]:
        ids = self._tok.encode(text, add_special_tokens=False).ids
        return ([self.BOS] if bos else []) + ids + ([self.EOS] if eos else [])

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [e.ids for e in self._tok.encode_batch_fast(texts, add_special_tokens=False)]

    def decode(self, ids: Iterable[int]) -> str:
        ids = [int(i) for i in ids]
        for i in ids:
            if not 0 <= i < self.vocab_size:
                raise ValueError(f"token id {i} is outside the vocabulary [0, {self.vocab_size})")
        return self._tok.decode(ids, skip_special_tokens=True)

    def save(self, out_dir: str | os.PathLike) -> list[str]:
        """tokenizer.json (these exact bytes: the sha256 stays), tokenizer_config.json and
        special_tokens_map.json, what `transformers.AutoTokenizer.from_pretrained` reads."""
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        specials = {f"{role}_token": token for role, token in self.tokens.items()}
        config = {"tokenizer_class": "PreTrainedTokenizerFast", **specials,
                  "add_bos_token": True, "add_eos_token": False,  # as the post-processor does
                  "split_special_tokens": True,  # as longrun encodes: "<s>" in text is text
                  # Byte-level BPE decodes losslessly; HF's clean-up would alter spaces.
                  "clean_up_tokenization_spaces": False}
        files = {TOKENIZER_FILE: self._json,
                 "tokenizer_config.json": json.dumps(config, indent=2) + "\n",
                 "special_tokens_map.json": json.dumps(specials, indent=2) + "\n"}
        written = []
        for name, text in files.items():
            path = out / name
            replace_file(path, text, sync=False)
            written.append(str(path))
        return written


def tokenizer_file(spec: str | os.PathLike) -> Path:
    """The tokenizer.json a spec names: the file itself or the one in a directory."""
    path = Path(spec)
    if path.is_dir():
        if not (path / TOKENIZER_FILE).is_file():
            raise TokenizerError(
                f"{path} has no {TOKENIZER_FILE}: give a directory saved by a Hugging Face fast "
                "tokenizer or by `longrun tokenizer train`, or the tokenizer.json file itself")
        return path / TOKENIZER_FILE
    if not path.is_file():
        raise TokenizerError(f"no tokenizer at {str(spec)!r}: give a tokenizer.json file, a directory "
                             "holding one, or 'byte'")
    return path


def load_tokenizer(spec: str | None, vocab_size: int | None = None) -> ByteTokenizer | BPETokenizer:
    """The byte tokenizer for None or "byte", else the BPE tokenizer of a local tokenizer.json
    (or a directory holding one). `vocab_size` is the model's: it may pad the vocabulary, never
    cut it (TokenizerError naming both)."""
    if spec is None or str(spec) == "byte":
        return ByteTokenizer(vocab_size or 260)
    tok = BPETokenizer(tokenizer_file(spec))
    if vocab_size is not None and vocab_size < tok.vocab_size:
        raise TokenizerError(
            f"model.vocab_size = {vocab_size} is smaller than the vocabulary of the tokenizer "
            f"{tok.path} ({tok.vocab_size} ids); leave model.vocab_size unset to follow the "
            f"tokenizer, or set it to at least {tok.vocab_size}")
    return tok


def tokenizer_identity(tok: Any) -> dict[str, Any]:
    """What prepared shards record about their tokenizer (manifest "tokenizer")."""
    kind = getattr(tok, "kind", "byte")
    sha = tok.sha256 if kind == "bpe" else BYTE_TOKENIZER_SHA256
    return {"kind": kind, "sha256": sha, "vocab_size": int(tok.vocab_size),
            "bos": int(tok.BOS), "eos": int(tok.EOS), "pad": int(tok.PAD)}


def train_bpe(inputs: list[str], vocab_size: int, out_dir: str, *, progress: bool = True,
              patterns: Sequence[str] = ("*",), text_column: str = "text",
              overwrite: bool = False, strict: bool = False,
              stats: SourceStats | None = None,
              max_document_bytes: int = MAX_DOCUMENT_BYTES) -> BPETokenizer:
    """Train a byte-level BPE on the documents of `inputs` (read like `data prepare` reads them:
    bad text replaced and counted in `stats`, or refused with `strict`), save it to `out_dir`
    (Hugging Face layout) and return it loaded from there. An existing tokenizer there is
    replaced only with overwrite=True: shards made with it would no longer match."""
    out = Path(out_dir)
    if (out / TOKENIZER_FILE).exists() and not overwrite:
        raise TokenizerError(f"{out / TOKENIZER_FILE} exists: data prepared with it would no longer match; "
                             "give another --out (or --force to replace it)")
    floor = 256 + len(SPECIAL_TOKENS)
    if vocab_size < floor:
        raise TokenizerError(f"--vocab-size {vocab_size} is too small: a byte-level BPE needs at least "
                             f"{floor} ids (256 bytes + {', '.join(SPECIAL_TOKENS)})")
    tok = Tokenizer(models.BPE())
    # No prefix space: encode(text) then decode gives the text back exactly.
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    # Every document longrun trains on starts with BOS; a Hugging Face pipeline calling the
    # exported tokenizer with its defaults (add_special_tokens=True) must add it the same way.
    # longrun itself encodes with add_special_tokens=False and adds BOS/EOS where it chunks.
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS_TOKEN} $A", pair=f"{BOS_TOKEN} $A {BOS_TOKEN} $B:1",
        special_tokens=[(BOS_TOKEN, SPECIAL_TOKENS.index(BOS_TOKEN))])
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(SPECIAL_TOKENS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=progress)
    texts = read_texts(inputs, patterns=patterns, text_column=text_column, stats=stats, strict=strict,
                       max_document_bytes=max_document_bytes)
    tok.train_from_iterator(texts, trainer)
    out.mkdir(parents=True, exist_ok=True)
    # A new name of our own (not save()'s tokenizer.json): the library's save follows links.
    fd, tmp = tempfile.mkstemp(prefix=".tokenizer.trained.", suffix=".tmp", dir=out)
    os.close(fd)
    try:
        tok.save(tmp)
        trained = BPETokenizer(Path(tmp))
        trained.save(out)
    finally:
        os.unlink(tmp)
    return BPETokenizer(out / TOKENIZER_FILE)
