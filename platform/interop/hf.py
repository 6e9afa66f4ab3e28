"""longrun's decoder as a Hugging Face `LlamaForCausalLM`: tensor names and `config.json`.

    longrun checkpoint export runs/tiny/checkpoints --format hf --out tiny-hf   # hf_export.py
    model: {init_from: tiny-hf, ...}                                           # hf_import.py

The two models compute the same function, so the mapping is a renaming: longrun's rotary
embedding already rotates the pairs (x[i], x[i + D/2]) as HF Llama's `rotate_half` does, with
the same inverse frequencies, and grouped-query attention repeats each KV head over
consecutive query heads in both (SDPA's `enable_gqa`, HF's `repeat_kv`). No q/k permutation.

This module is torch-free: config validation (`config/checks.py`) reads a `config.json`
before anything heavy is imported.
"""

from __future__ import annotations

import json
import math
import os
from typing import Any

from pydantic import ValidationError

from longrun.config.sections import ModelSection
from longrun.kinds import FaultKind
from longrun.safe_files import UnsafePath, read_regular_file

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
WEIGHTS_INDEX_FILE = "model.safetensors.index.json"
ARCHITECTURE = "LlamaForCausalLM"

# longrun name -> HF name; "{i}" is the layer index.
GLOBAL_NAMES = {
    "tok_embeddings.weight": "model.embed_tokens.weight",
    "norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
LAYER_NAMES = {
    "attention.wq.weight": "self_attn.q_proj.weight",
    "attention.wk.weight": "self_attn.k_proj.weight",
    "attention.wv.weight": "self_attn.v_proj.weight",
    "attention.wo.weight": "self_attn.o_proj.weight",
    "feed_forward.w1.weight": "mlp.gate_proj.weight",
    "feed_forward.w3.weight": "mlp.up_proj.weight",
    "feed_forward.w2.weight": "mlp.down_proj.weight",
    "attention_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
}


class HFError(ValueError):
    """A Hugging Face directory that longrun cannot read, or one that does not fit the job."""

    fault_kind = FaultKind.FATAL  # recurs on any node: the controller ends the job, no restart


def hf_names(n_layers: int) -> dict[str, str]:
    """Every longrun state_dict name of an `n_layers` model -> its HF `LlamaForCausalLM` name."""
    names = dict(GLOBAL_NAMES)
    for i in range(n_layers):
        for ours, theirs in LAYER_NAMES.items():
            names[f"layers.{i}.{ours}"] = f"model.layers.{i}.{theirs}"
    return names


def hf_config(model: ModelSection, *, dtype: str, bos: int | None = None,
              eos: int | None = None, pad: int | None = None) -> dict[str, Any]:
    """The `config.json` of `model` as a `LlamaForCausalLM`. The rotary base is written both
    at the top level (transformers 4 and most inference servers) and in `rope_parameters`
    (transformers 5)."""
    return {
        "architectures": [ARCHITECTURE],
        "model_type": "llama",
        "vocab_size": model.vocab_size,
        "hidden_size": model.dim,
        "intermediate_size": model.hidden_dim,
        "num_hidden_layers": model.n_layers,
        "num_attention_heads": model.n_heads,
        "num_key_value_heads": model.kv_heads,
        "head_dim": model.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": model.max_seq_len,
        "rms_norm_eps": model.norm_eps,
        "rope_theta": model.rope_theta,
        "rope_scaling": None,
        "rope_parameters": {"rope_type": "default", "rope_theta": model.rope_theta},
        "attention_bias": False,
        "attention_dropout": 0.0,
        "mlp_bias": False,
        "initializer_range": 0.02,
        "tie_word_embeddings": model.tie_embeddings,
        "torch_dtype": dtype,
        "use_cache": True,
        "bos_token_id": bos,
        "eos_token_id": eos,
        "pad_token_id": pad,
    }


def generation_config(cfg: dict[str, Any]) -> dict[str, Any]:
    """`generation_config.json`: the special token ids generation needs (eos stops it)."""
    ids = {k: cfg[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if cfg.get(k) is not None}
    return {"_from_model_config": True, **ids}


# -- reading an HF config --------------------------------------------------------------------


def read_hf_config(hf_dir: str) -> dict[str, Any]:
    """The `config.json` of a local HF directory, refused unless it describes a model longrun's
    decoder can compute: a Llama (SiLU, no biases, plain rotary)."""
    path = os.path.join(hf_dir, CONFIG_FILE)
    if not os.path.isdir(hf_dir):
        raise HFError(f"{hf_dir} is not a directory (a Hugging Face model directory with "
                      f"{CONFIG_FILE} and {WEIGHTS_FILE} is expected)")
    try:
        cfg = json.loads(read_regular_file(path, follow_links=True))  # a hub cache links its files
    except FileNotFoundError:
        raise HFError(f"{hf_dir} has no {CONFIG_FILE}; is it a Hugging Face model directory?") from None
    except UnsafePath as exc:  # a FIFO would block the read, a device never end it
        raise HFError(str(exc)) from None
    except (OSError, ValueError) as exc:
        raise HFError(f"{path} is not readable JSON ({exc})") from None
    if not isinstance(cfg, dict):
        raise HFError(f"{path} is not a JSON object")
    kind, archs = cfg.get("model_type"), cfg.get("architectures") or []
    if kind != "llama" and ARCHITECTURE not in archs:
        raise HFError(f"{path} describes a {kind or 'model of unknown type'} "
                      f"({', '.join(archs) or 'no architectures'}); longrun reads Llama models "
                      f"(model_type llama, {ARCHITECTURE})")
    problems = []
    if cfg.get("hidden_act", "silu") != "silu":
        problems.append(f"hidden_act {cfg['hidden_act']!r} (longrun's MLP is SwiGLU: silu)")
    for bias in ("attention_bias", "mlp_bias"):
        if cfg.get(bias):
            problems.append(f"{bias} true (longrun's projections have no bias)")
    rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    kind = rope.get("rope_type", rope.get("type", "default")) if isinstance(rope, dict) else rope
    if kind != "default":
        problems.append(f"rope type {kind!r} (longrun's rotary embedding is the default, unscaled one)")
    heads, dim = cfg.get("num_attention_heads"), cfg.get("hidden_size")
    if isinstance(heads, int) and isinstance(dim, int) and heads and "head_dim" in cfg \
            and cfg["head_dim"] * heads != dim:
        problems.append(f"head_dim {cfg['head_dim']} with hidden_size {dim} and {heads} heads "
                        "(longrun's head_dim is hidden_size / num_attention_heads)")
    if problems:
        raise HFError(f"{path} has what longrun's decoder cannot compute: {'; '.join(problems)}")
    return cfg


def rope_theta_of(cfg: dict[str, Any]) -> float:
    rope = cfg.get("rope_parameters")
    if isinstance(rope, dict) and "rope_theta" in rope:
        return float(rope["rope_theta"])
    return float(cfg.get("rope_theta", 10000.0))


def _hf_values(cfg: dict[str, Any]) -> dict[str, Any]:
    """The values a longrun model section takes, by its field names (LlamaConfig's defaults
    where config.json leaves a key out)."""
    try:
        return {
            "vocab_size": cfg["vocab_size"], "dim": cfg["hidden_size"],
            "n_layers": cfg["num_hidden_layers"], "n_heads": cfg["num_attention_heads"],
            "n_kv_heads": cfg.get("num_key_value_heads") or cfg["num_attention_heads"],
            "ffn_dim": cfg["intermediate_size"],
            "max_seq_len": cfg.get("max_position_embeddings", 2048),
            "rope_theta": rope_theta_of(cfg), "norm_eps": cfg.get("rms_norm_eps", 1e-6),
            "tie_embeddings": bool(cfg.get("tie_word_embeddings", False)),
        }
    except KeyError as exc:
        raise HFError(f"{CONFIG_FILE} has no {exc.args[0]!r}") from None


def model_section_from_hf(hf_dir: str) -> dict[str, Any]:
    """A `model:` section for a job config that starts from `hf_dir` (init_from included):
    what to paste into the YAML. HFError if the model is not one longrun can run."""
    cfg = read_hf_config(hf_dir)
    values = _hf_values(cfg) | {"init_from": hf_dir}
    try:
        return ModelSection(**values).model_dump(mode="json")
    except ValidationError as exc:
        problems = "; ".join(e["msg"] for e in exc.errors())
        raise HFError(f"{os.path.join(hf_dir, CONFIG_FILE)}: {problems}") from None


# HF config key, longrun field, the value the job has.
_COMPARED = (
    ("hidden_size", "dim", lambda m: m.dim),
    ("num_hidden_layers", "n_layers", lambda m: m.n_layers),
    ("num_attention_heads", "n_heads", lambda m: m.n_heads),
    ("num_key_value_heads", "n_kv_heads", lambda m: m.kv_heads),
    ("intermediate_size", "ffn_dim", lambda m: m.hidden_dim),
    ("vocab_size", "vocab_size", lambda m: m.vocab_size),
    ("rms_norm_eps", "norm_eps", lambda m: m.norm_eps),
    ("rope_theta", "rope_theta", lambda m: m.rope_theta),
    ("tie_word_embeddings", "tie_embeddings", lambda m: m.tie_embeddings),
)


def config_mismatches(hf_dir: str, cfg: dict[str, Any], model: ModelSection) -> list[str]:
    """Each way the HF config differs from the job's model section, as 'hidden_size 256 in
    /x/config.json, model.dim 128 in the job'. max_seq_len may differ (a job may train on
    shorter or longer sequences than the model was trained on)."""
    theirs, path = _hf_values(cfg), os.path.join(hf_dir, CONFIG_FILE)
    out = []
    for key, field, ours in _COMPARED:
        a, b = theirs[field], ours(model)
        same = math.isclose(a, b, rel_tol=1e-9) if isinstance(b, float) else a == b
        if not same:
            out.append(f"{key} {json.dumps(a)} in {path}, model.{field} {json.dumps(b)} in the job")
    return out


def check_fits(hf_dir: str, model: ModelSection) -> dict[str, Any]:
    """The HF config of `hf_dir`, or HFError naming every difference from `model`."""
    cfg = read_hf_config(hf_dir)
    mismatches = config_mismatches(hf_dir, cfg, model)
    if mismatches:
        raise HFError(f"model.init_from {hf_dir} does not fit the job's model: "
                      f"{'; '.join(mismatches)}. Set the model section to match (longrun's "
                      "`model_section_from_hf` in longrun.interop.hf writes one)")
    return cfg


def init_from_problem(model: ModelSection) -> str | None:
    """Why `model.init_from` cannot start this model, or None: for `config validate`, `run` and
    `submit`, before anything starts. A directory that is not here is left to the trainer (a
    submitted job may name a path on the cluster)."""
    hf_dir = model.init_from
    if not hf_dir or not os.path.isdir(hf_dir):
        return None
    try:
        cfg = read_hf_config(hf_dir)
        mismatches = config_mismatches(hf_dir, cfg, model)
    except HFError as exc:
        return str(exc)
    if mismatches:
        return f"{hf_dir} does not fit this model section: {'; '.join(mismatches)}"
    return None
