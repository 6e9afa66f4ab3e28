"""Weights of a local Hugging Face Llama directory as a longrun state_dict: `model.init_from`.

    state = load_hf_weights("llama-hf", cfg.model)    # checks config.json and every shape
    Transformer(cfg.model).load_state_dict(state)

Reads `model.safetensors`, or the shards a `model.safetensors.index.json` lists, with
safetensors (memory-mapped, one tensor at a time); nothing is downloaded.
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

# Buffers some older exports saved next to the weights; longrun derives them from the config.
_DERIVED_SUFFIXES = ("rotary_emb.inv_freq",)


def weight_files(hf_dir: str) -> dict[str, str]:
    """HF tensor name -> the safetensors file holding it."""
    index = os.path.join(hf_dir, WEIGHTS_INDEX_FILE)
    single = os.path.join(hf_dir, WEIGHTS_FILE)
    if os.path.isfile(index):
        try:
            with open(index, encoding="utf-8") as f:
                weight_map = json.load(f)["weight_map"]
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise HFError(f"{index} is not a safetensors index with a weight_map ({exc})") from None
        return {name: os.path.join(hf_dir, file) for name, file in weight_map.items()}
    if os.path.isfile(single):
        with safe_open(single, framework="pt") as f:
            return dict.fromkeys(f.keys(), single)
    found = sorted(n for n in os.listdir(hf_dir) if n.endswith((".bin", ".pt", ".pth")))
    hint = (f"; it has {', '.join(found)}: save it with safetensors "
            "(save_pretrained(..., safe_serialization=True))" if found else "")
    raise HFError(f"{hf_dir} has neither {WEIGHTS_FILE} nor {WEIGHTS_INDEX_FILE}{hint}")


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


def load_hf_weights(hf_dir: str, model: ModelSection) -> dict[str, torch.Tensor]:
    """The weights of the HF Llama in `hf_dir` under longrun's names, in their stored dtype
    (`load_state_dict` casts). HFError naming the problem if its config.json differs from
    `model`, a tensor is missing or extra, or a shape is off. With tied embeddings the output
    matrix is the embedding (HF leaves `lm_head.weight` out of tied checkpoints)."""
    hf_dir = os.fspath(hf_dir)
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
    state, wrong = {}, []
    by_file: dict[str, list[str]] = {}
    for ours, theirs in names.items():
        by_file.setdefault(files[theirs], []).append(ours)
    for path, ours_in_file in by_file.items():  # each shard opened once
        with safe_open(path, framework="pt") as f:
            for ours in ours_in_file:
                tensor = f.get_tensor(names[ours])
                if tuple(tensor.shape) != shapes[ours]:
                    wrong.append(f"{names[ours]} is {list(tensor.shape)}, the job's model needs "
                                 f"{list(shapes[ours])}")
                state[ours] = tensor
    if wrong:
        raise HFError(f"the weights in {hf_dir} do not fit the job's model: {'; '.join(wrong)}")
    if model.tie_embeddings:
        state["output.weight"] = state["tok_embeddings.weight"]
    return state
