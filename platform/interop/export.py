"""Taking the weights out of a checkpoint: what `longrun checkpoint export` runs.

    longrun checkpoint export runs/tiny/checkpoints --out tiny.safetensors

An export holds the model's `state_dict` alone, loadable without longrun: safetensors (the
model config, step and config fingerprint in its metadata) or a plain `torch.save` file; or
`--format hf`, a Hugging Face Llama directory (hf_export.py). The
checkpoint root is only read (catalog.py finds the step); the export is written under a
temporary name and moved into place.
"""

from __future__ import annotations

import io
import os
import posixpath
import tempfile

import fsspec
import torch
from fsspec.implementations.local import LocalFileSystem

from longrun.checkpoint.catalog import (
    load_model_weights,
    open_root,
    resolve_step,
    summarize_weights,
)
from longrun.checkpoint.layout import step_dir_name
from longrun.checkpoint.restore import read_manifest
from longrun.interop.hf_export import export_hf
from longrun.interop.weights_file import (
    ExportError,
    ExportFormat,
    ExportResult,
    infer_format,
    safetensors_metadata,
    unshare,
)
from longrun.safe_files import umask

__all__ = ["ExportError", "ExportFormat", "ExportResult", "export_weights"]

def export_weights(url: str, out: str, *, step: int | None = None, fmt: str | None = None,
                   overwrite: bool = False, tokenizer: str | None = None) -> ExportResult:
    """Write the model weights of a committed step (default: the newest) to one file, `out`
    (a path or fsspec URL). Written under a temporary name and moved into place, so a failed
    export never leaves a partial file under `out`. Format "hf": a Hugging Face directory
    (`hf_export.export_hf`, which alone takes `tokenizer`)."""
    fmt = infer_format(out, fmt)
    if fmt == "hf":
        return export_hf(url, out, step=step, tokenizer=tokenizer, overwrite=overwrite)
    out_fs, out_path = fsspec.core.url_to_fs(out)
    if out_fs.exists(out_path) and not overwrite:
        raise ExportError(f"{out} exists; pass --force to replace it")
    fs, root = open_root(url)
    step = resolve_step(fs, root, step)
    manifest = read_manifest(fs, root, step)
    weights = load_model_weights(fs, root, step, manifest)
    summary = summarize_weights(weights, manifest.model)
    if not all(isinstance(v, torch.Tensor) for v in weights.values()):
        raise ExportError("the model state_dict holds values that are not tensors; "
                          "export it with --format torch")
    source = f"{url.rstrip('/')}/{step_dir_name(step)}"
    local = isinstance(out_fs, LocalFileSystem)
    if local:
        parent = os.path.dirname(os.path.abspath(out_path))
        os.makedirs(parent, exist_ok=True)
        # A new file of a random name (mkstemp), not a fixed `.partial` one that could have been
        # planted as a link to someone's file; the writers below then open only what we created.
        fd, tmp = tempfile.mkstemp(prefix=f".{os.path.basename(out_path)}.", suffix=".partial", dir=parent)
        os.fchmod(fd, 0o666 & ~umask())
        os.close(fd)
    else:
        tmp = f"{out_path}.partial"
        out_fs.makedirs(posixpath.dirname(out_path), exist_ok=True)
    try:
        if fmt == "safetensors":
            from safetensors.torch import save, save_file

            tensors, metadata = unshare(weights), safetensors_metadata(manifest, source)
            if local:
                save_file(tensors, tmp, metadata=metadata)
            else:
                out_fs.pipe_file(tmp, save(tensors, metadata=metadata))
        elif local:
            torch.save(dict(weights), tmp)
        else:
            buf = io.BytesIO()
            torch.save(dict(weights), buf)
            out_fs.pipe_file(tmp, buf.getvalue())
        out_fs.mv(tmp, out_path)
    finally:
        if out_fs.exists(tmp):
            out_fs.rm(tmp)
    return ExportResult(out, fmt, step, source, summary.tensors, summary.parameters,
                        int(out_fs.size(out_path)))
