"""Weights of a local Hugging Face Llama directory as a longrun state_dict: `model.init_from`.

    state = load_hf_weights("llama-hf", cfg.model)    # checks config.json and every shape
    Transformer(cfg.model).load_state_dict(state)
    load_hf_pieces("llama-hf", cfg.model, local_pieces(parallel.module))   # a rank's slices only

Reads `model.safetensors`, or the shards a `model.safetensors.index.json` lists, with
safetensors (memory-mapped, one tensor or one block at a time); nothing is downloaded.
"""

from __future__ import annotations

import json
import os

import torch
from safetensors import safe_open

from longrun.config.sections import ModelSection
from longrun.interop.hf import (
    WEIGHTS_FILE,
    WEIGHTS_INDEX_FILE,
    HFError,
    check_fits,
    hf_names,
)
from longrun.parallel.pieces import Piece
from longrun.safe_files import (
    UnsafeName,
    UnsafePath,
    checked_member_name,
    open_regular_file,
    read_regular_file,
)

# Buffers some older exports saved next to the weights; longrun derives them from the config.
_DERIVED_SUFFIXES = ("rotary_emb.inv_freq",)


def weight_files(hf_dir: str) -> dict[str, str]:
    """HF tensor name -> the safetensors file holding it. The index's file names must be plain
    names in `hf_dir`, and every file a regular one (a link to one is fine: a hub cache's are),
    never a FIFO or a device: HFError otherwise."""
    index = os.path.join(hf_dir, WEIGHTS_INDEX_FILE)
    single = os.path.join(hf_dir, WEIGHTS_FILE)
    if os.path.isfile(index):
        try:
            weight_map = json.loads(read_regular_file(index, follow_links=True))["weight_map"]
            files = {name: checked_member_name(file, hf_dir, index) for name, file in weight_map.items()}
        except (UnsafeName, UnsafePath) as exc:  # "../x", "/x": another directory's files; a FIFO
            raise HFError(str(exc)) from None
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
            raise HFError(f"{index} is not a safetensors index with a weight_map ({exc})") from None
        for file in sorted(set(files.values())):
            _check_regular(os.path.join(hf_dir, file))
        return {name: os.path.join(hf_dir, file) for name, file in files.items()}
    if os.path.isfile(single):
        _check_regular(single)
        with safe_open(single, framework="pt") as f:
            return dict.fromkeys(f.keys(), single)
    found = sorted(n for n in os.listdir(hf_dir) if n.endswith((".bin", ".pt", ".pth")))
    hint = (f"; it has {', '.join(found)}: save it with safetensors "
            "(save_pretrained(..., safe_serialization=True))" if found else "")
    raise HFError(f"{hf_dir} has neither {WEIGHTS_FILE} nor {WEIGHTS_INDEX_FILE}{hint}")


def _check_regular(path: str) -> None:
    """HFError unless `path` is (or links to) a regular file: safetensors' open of a FIFO waits
    for a writer forever. A missing one is left to the reader, which names it."""
    try:
        open_regular_file(path, follow_links=True).close()
    except FileNotFoundError:
        pass
    except UnsafePath as exc:
        raise HFError(str(exc)) from None


def expected_shapes(model: ModelSection) -> dict[str, tuple[int, ...]]:
    """longrun name -> the shape the job's model gives it (as `Transformer` builds it)."""
    d, hd, ff = model.dim, model.head_dim, model.hidden_dim
    shapes: dict[str, tuple[int, ...]] = {
        "tok_embeddings.weight": (model.vocab_size, d), "norm.weight": (d,),
        "output.weight": (model.vocab_size, d)}
    layer = {"attention.wq.weight": (model.n_heads * hd, d),
             "attention.wk.weight": (model.kv_heads * hd, d),
             "attention.wv.weight": (model.kv_heads * hd, d),
             "attention.wo.weight": (d, model.n_heads * hd),
             "feed_forward.w1.weight": (ff, d), "feed_forward.w3.weight": (ff, d),
             "feed_forward.w2.weight": (d, ff),
             "attention_norm.weight": (d,), "ffn_norm.weight": (d,)}
    for i in range(model.n_layers):
        shapes.update({f"layers.{i}.{k}": v for k, v in layer.items()})
    return shapes


def _hf_layout(hf_dir: str, model: ModelSection) -> tuple[dict[str, str], dict[str, str]]:
    """(longrun name -> HF name, HF name -> its safetensors file) of the HF Llama in `hf_dir`,
    checked against `model` from the files' headers alone (no tensor is read): HFError naming
    the problem if its config.json differs, a tensor is missing or extra, or a shape is off.
    With tied embeddings the output layer is the embedding (HF leaves `lm_head.weight` out)."""
    check_fits(hf_dir, model)
    files = weight_files(hf_dir)
    names = hf_names(model.n_layers)
    if model.tie_embeddings:
        del names["output.weight"]
    missing = sorted(theirs for theirs in names.values() if theirs not in files)
    known = {*names.values(), "lm_head.weight"}
    extra = sorted(n for n in files if n not in known and not n.endswith(_DERIVED_SUFFIXES))
    if missing or extra:
        shown = [f"missing {', '.join(missing)}"] if missing else []
        shown += [f"not in a longrun model: {', '.join(extra)}"] if extra else []
        raise HFError(f"the weights in {hf_dir} do not fit the job's model: {'; '.join(shown)}")
    shapes = expected_shapes(model)
    wrong = []
    for path, ours_in_file in _by_file(names, files).items():  # each shard opened once
        with safe_open(path, framework="pt") as f:
            for ours in ours_in_file:
                shape = tuple(f.get_slice(names[ours]).get_shape())
                if shape != shapes[ours]:
                    wrong.append(f"{names[ours]} is {list(shape)}, the job's model needs "
                                 f"{list(shapes[ours])}")
    if wrong:
        raise HFError(f"the weights in {hf_dir} do not fit the job's model: {'; '.join(wrong)}")
    return names, files


def _by_file(names: dict[str, str], files: dict[str, str]) -> dict[str, list[str]]:
    by_file: dict[str, list[str]] = {}
    for ours, theirs in names.items():
        by_file.setdefault(files[theirs], []).append(ours)
    return by_file


def load_hf_weights(hf_dir: str, model: ModelSection) -> dict[str, torch.Tensor]:
    """The whole weights of the HF Llama in `hf_dir` under longrun's names, in their stored
    dtype (`load_state_dict` casts), checked as `_hf_layout` says. A training rank reads only
    its slices instead (`load_hf_pieces`)."""
    hf_dir = os.fspath(hf_dir)
    names, files = _hf_layout(hf_dir, model)
    state = {}
    for path, ours_in_file in _by_file(names, files).items():
        with safe_open(path, framework="pt") as f:
            for ours in ours_in_file:
                state[ours] = f.get_tensor(names[ours])
    if model.tie_embeddings:
        state["output.weight"] = state["tok_embeddings.weight"]
    return state


def read_slice(f, name: str, index: tuple[slice, ...]) -> torch.Tensor:
    """The block `index` of tensor `name` in the open safetensors file `f`: only its bytes are
    read (a memory-mapped file's pages outside the block are never touched)."""
    return f.get_slice(name)[index]


def load_hf_pieces(hf_dir: str, model: ModelSection, pieces: list[Piece]) -> int:
    """Fill each of this rank's pieces (`parallel/pieces.py`) from the HF Llama in `hf_dir`,
    reading only the block each piece holds: a rank of a sharded 70B job reads its own
    gigabytes, not the whole model's. Checked first as `_hf_layout` says (headers only).
    Returns the bytes read."""
    hf_dir = os.fspath(hf_dir)
    names, files = _hf_layout(hf_dir, model)
    by_name = {piece.name: piece for piece in pieces}
    unknown = sorted(set(by_name) - set(names))
    if unknown:
        raise HFError(f"the job's model has parameters no HF Llama holds: {', '.join(unknown)}")
    read = 0
    wanted = {ours: theirs for ours, theirs in names.items() if ours in by_name}
    with torch.no_grad():
        for path, ours_in_file in _by_file(wanted, files).items():
            with safe_open(path, framework="pt") as f:
                for ours in ours_in_file:
                    piece = by_name[ours]
                    if piece.local.numel() == 0:
                        continue
                    block = read_slice(f, names[ours], piece.index)
                    read += block.numel() * block.element_size()
                    piece.local.copy_(block)
    return read
