"""What every export shares, whichever format it writes: its result, its error, the format's name
from the file's, and safetensors' two rules (no shared storage; string metadata).

`export.py` writes one file and dispatches `--format hf` to `hf_export.py`, which writes a
directory; both take these from here, so the two no longer import each other.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from typing import Any, Literal

import torch

from longrun.checkpoint.manifest import Manifest

# "hf" is a directory (a Hugging Face model, hf_export.py); the others one file.
ExportFormat = Literal["safetensors", "torch", "hf"]
FORMAT_BY_SUFFIX: dict[str, ExportFormat] = {
    ".safetensors": "safetensors", ".pt": "torch", ".pth": "torch"}


class ExportError(ValueError):
    """The export cannot be written as asked (unknown format, the file exists)."""


@dataclass
class ExportResult:
    out: str
    format: ExportFormat
    step: int
    source: str
    tensors: int
    parameters: int
    bytes: int  # the size of the written file

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def infer_format(out: str, fmt: str | None) -> ExportFormat:
    if fmt is not None:
        if fmt not in ("safetensors", "torch", "hf"):
            raise ExportError(f"unknown export format {fmt!r}; use safetensors, torch or hf")
        return fmt  # type: ignore[return-value]
    suffix = os.path.splitext(out)[1].lower()
    if suffix not in FORMAT_BY_SUFFIX:
        raise ExportError(f"cannot tell the format from the name {out!r}; end it in .safetensors "
                          "or .pt, or pass --format safetensors|torch (or hf: a Hugging Face directory)")
    return FORMAT_BY_SUFFIX[suffix]


def unshare(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Contiguous tensors that share no memory: safetensors refuses tensors that share storage
    (a tied embedding/output matrix), so each later name gets a copy; every name survives, so
    `load_state_dict(strict=True)` on the model works as with torch's own state_dict."""
    seen: set[tuple[str, int]] = set()
    out = {}
    for key, t in weights.items():
        ident = (str(t.device), t.untyped_storage().data_ptr())
        t = t.detach()
        if t.numel() and ident in seen:
            t = t.clone(memory_format=torch.contiguous_format)
        else:
            seen.add(ident)
            t = t.contiguous()
        out[key] = t
    return out


def safetensors_metadata(manifest: Manifest, source: str) -> dict[str, str]:
    return {
        "format": "pt",  # what Hugging Face loaders expect of a torch-saved safetensors file
        "step": str(manifest.step),
        "model_config": json.dumps(manifest.model, sort_keys=True),
        "config_fingerprint": manifest.config_fingerprint,
        "source": source,
    }
