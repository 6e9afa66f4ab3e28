"""A checkpoint as a Hugging Face model directory: `longrun checkpoint export --format hf`.

    longrun checkpoint export runs/tiny/checkpoints --format hf --out tiny-hf --tokenizer tok/
    AutoModelForCausalLM.from_pretrained("tiny-hf")      # a LlamaForCausalLM, same logits

Writes `config.json`, `generation_config.json`, `model.safetensors` under HF Llama names
(hf.py) and, given a BPE tokenizer, its files (what `AutoTokenizer` reads). The directory is
built beside `out` under a temporary name and renamed into place, so a failed export leaves
nothing under `out`.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from typing import Any

import fsspec
from fsspec.implementations.local import LocalFileSystem
from pydantic import ValidationError

from longrun.checkpoint.catalog import load_model_weights, open_root, resolve_step, summarize_weights
from longrun.checkpoint.layout import step_dir_name
from longrun.checkpoint.restore import read_manifest
from longrun.config.sections import ModelSection
from longrun.data.byte_tokenizer import ByteTokenizer
from longrun.data.tokenizers import load_tokenizer
from longrun.interop.hf import (
    CONFIG_FILE,
    WEIGHTS_FILE,
    generation_config,
    hf_config,
    hf_names,
)
from longrun.interop.weights_file import ExportError, ExportResult, safetensors_metadata, unshare
from longrun.safe_files import UnsafePath, open_regular_file, umask


def _special_ids(tokenizer: str | None, model: ModelSection) -> tuple[Any, tuple]:
    """(the tokenizer to save or None, its (bos, eos, pad) ids). `tokenizer` None: unknown
    (no ids, no files); "byte": longrun's byte tokenizer (ids, nothing to save); else the path
    of a tokenizer.json or a directory holding one."""
    if tokenizer is None:
        return None, (None, None, None)
    if tokenizer == "byte":
        return None, (ByteTokenizer.BOS, ByteTokenizer.EOS, ByteTokenizer.PAD)
    try:
        tok = load_tokenizer(tokenizer)
    except ValueError as exc:  # TokenizerError: not a tokenizer file, or none there
        raise ExportError(str(exc)) from None
    if tok.vocab_size > model.vocab_size:
        raise ExportError(f"the tokenizer {tokenizer} has {tok.vocab_size} tokens, more than the "
                          f"checkpoint's model.vocab_size ({model.vocab_size}); is it the job's?")
    return tok, (tok.BOS, tok.EOS, tok.PAD)


def _recorded_tokenizer(record: dict[str, Any] | None, model: ModelSection) -> tuple[Any, tuple]:
    """The tokenizer the checkpoint says the job trained with (Manifest.tokenizer): its file if
    it is still there and unchanged, else only the special ids the record holds."""
    if record is None:  # a checkpoint from before tokenizers were recorded
        return None, (None, None, None)
    spec = record.get("spec")
    if spec == "byte":
        return _special_ids("byte", model)
    if spec is None:  # trained from shards without naming their tokenizer: their ids only
        return None, (record.get("bos"), record.get("eos"), record.get("pad"))
    # The path comes from the manifest: whoever wrote the checkpoint chose it. Only a regular
    # file is read (a FIFO would block, /dev/zero never end), hashed as it streams.
    try:
        with open_regular_file(str(spec)) as f:
            found = hashlib.file_digest(f, "sha256").hexdigest()
    except (FileNotFoundError, NotADirectoryError):
        raise ExportError(f"the checkpoint was trained with the tokenizer {spec}, which is not there "
                          "any more; pass --tokenizer PATH (a copy of it)") from None
    except UnsafePath:
        raise ExportError(f"the checkpoint names the tokenizer {spec}, which is a symbolic link, FIFO "
                          "or device, not a regular file; pass --tokenizer PATH (the tokenizer.json "
                          "itself)") from None
    except OSError as exc:  # unreadable to this user, say
        raise ExportError(f"cannot read the tokenizer {spec} the checkpoint names ({exc.strerror}); "
                          "pass --tokenizer PATH") from None
    if found != record.get("sha256"):
        raise ExportError(f"the tokenizer {spec} changed since the checkpoint was trained with it "
                          f"(sha256 {found[:12]}... now, {str(record.get('sha256'))[:12]}... then); "
                          "pass --tokenizer PATH to export with a tokenizer anyway")
    return _special_ids(spec, model)


def _check_out(out_dir: str, out: str, overwrite: bool) -> None:
    if os.path.isfile(out_dir):
        raise ExportError(f"{out} is a file; --format hf writes a directory")
    if not os.path.isdir(out_dir) or not os.listdir(out_dir):
        return
    if not overwrite:
        raise ExportError(f"{out} is a directory that is not empty; pass --force to replace it")
    if not os.path.isfile(os.path.join(out_dir, CONFIG_FILE)):
        raise ExportError(f"{out} is not empty and holds no {CONFIG_FILE} (not an earlier export); "
                          "not replacing it even with --force")


def _move_into_place(tmp: str, out_dir: str) -> None:
    """rename(2) replaces an empty directory; a full one (with --force) is moved aside first
    and deleted only once the new one is in place."""
    if os.path.isdir(out_dir) and os.listdir(out_dir):
        old = f"{out_dir}.replaced-{os.getpid()}"
        os.rename(out_dir, old)
        os.rename(tmp, out_dir)
        shutil.rmtree(old)
    else:
        os.replace(tmp, out_dir)


def export_hf(url: str, out: str, *, step: int | None = None, tokenizer: str | None = None,
              overwrite: bool = False) -> ExportResult:
    """Write the weights of a committed step (default: the newest) of the checkpoint root `url`
    as a Hugging Face `LlamaForCausalLM` directory `out` (local). `tokenizer`: see
    `_special_ids`; a BPE tokenizer's files are written beside the weights."""
    out_fs, out_dir = fsspec.core.url_to_fs(out)
    if not isinstance(out_fs, LocalFileSystem):
        raise ExportError(f"--format hf writes a local directory; {out} is not one")
    out_dir = out_dir.rstrip("/")
    _check_out(out_dir, out, overwrite)
    fs, root = open_root(url)
    step = resolve_step(fs, root, step)
    manifest = read_manifest(fs, root, step)
    try:
        model = ModelSection(**manifest.model)
    except ValidationError as exc:
        raise ExportError(f"the checkpoint's model config is not one this longrun reads: {exc}") from None
    if tokenizer is None:
        tok, (bos, eos, pad) = _recorded_tokenizer(manifest.tokenizer, model)
    else:
        tok, (bos, eos, pad) = _special_ids(tokenizer, model)
    weights = load_model_weights(fs, root, step, manifest)
    names = hf_names(model.n_layers)
    if model.tie_embeddings:  # HF ties lm_head to the embedding itself and leaves it out
        del names["output.weight"]
    missing = sorted(set(names) - set(weights))
    extra = sorted(set(weights) - set(names) - {"output.weight"})
    if missing or extra:
        raise ExportError(f"the checkpoint's weights are not longrun's decoder: missing "
                          f"{missing or 'nothing'}, unknown {extra or 'nothing'}")
    tensors = unshare({theirs: weights[ours] for ours, theirs in names.items()})
    dtype = str(tensors["model.embed_tokens.weight"].dtype).removeprefix("torch.")
    config = hf_config(model, dtype=dtype, bos=bos, eos=eos, pad=pad)
    source = f"{url.rstrip('/')}/{step_dir_name(step)}"

    from safetensors.torch import save_file

    parent = os.path.dirname(os.path.abspath(out_dir))
    os.makedirs(parent, exist_ok=True)
    # A new, private directory (mkdtemp): a fixed name could have been planted as a link.
    tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(out_dir)}.partial-", dir=parent)
    os.chmod(tmp, 0o777 & ~umask())
    try:
        for name, content in ((CONFIG_FILE, config), ("generation_config.json", generation_config(config))):
            with open(os.path.join(tmp, name), "w", encoding="utf-8") as f:
                json.dump(content, f, indent=2)
                f.write("\n")
        save_file(tensors, os.path.join(tmp, WEIGHTS_FILE),
                  metadata=safetensors_metadata(manifest, source))
        if tok is not None:
            tok.save(tmp)
        written = sum(os.path.getsize(os.path.join(tmp, n)) for n in os.listdir(tmp))
        _move_into_place(tmp, out_dir)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    summary = summarize_weights(weights, manifest.model)
    return ExportResult(out, "hf", step, source, len(tensors), summary.parameters, written)
