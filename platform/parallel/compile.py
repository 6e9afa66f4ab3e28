"""`training.compile`: the model's elementwise work fused by `torch.compile`.

    training.compile: auto | none | blocks | model     (auto: blocks on CUDA, none elsewhere)

An eager step spends about as much device time in unfused elementwise kernels (RMSNorm,
rotary, SwiGLU, residual adds, casts) as in its matmuls, and launches thousands of them
(issue 40's profile: 8,800 launches per step). Compiling fuses them:

- **blocks** (torchtitan's regional compilation): each transformer block compiled on its own.
  Every block has the same code, so one compilation serves them all and a deep model compiles
  in the time of one block. Composes with every parallelism (see `parallelize.py`'s order).
- **model**: the whole model, so the fusion also crosses block boundaries (a block's residual
  add with the next block's norm) and takes in the embedding, the final norm and the output
  layer. A pipeline rank holds only its stages, so it is refused there (config checks).

Either way the attention is not traced (`model.attend` is `torch.compiler.disable`d): its layout
is host bookkeeping that changes every micro-batch, and its kernel (flash, varlen, the CP ring)
is fused already. Each compiled block is then two graphs, before and after the attention.

`Module.compile` compiles in place: the module tree and parameter names stay those of the eager
model, so initial weights (seeded by name) and checkpoints do not depend on compiling.

**Shapes are dynamic from the first call** (`dynamic=True`): the packed stream's length changes
with every micro-batch, and with static shapes dynamo would compile once per length seen, then
switch to a dynamic graph after its second length, so which kernels a step runs would depend on
the lengths that came before it. A process resumed from a checkpoint would then run other
kernels than the process that wrote it and drift from it by float rounding; with dynamic shapes
from the start every process runs the same graphs and a compiled job resumes bitwise.
Parameters stay static (dynamo's default), so weight shapes are specialised.

Recompilations are counted (`compile_counts`): after the first step there should be none; a
job that keeps recompiling pays seconds per step and is told so in its log.
"""

from __future__ import annotations

import logging
import re
import threading
from dataclasses import dataclass

import torch

from longrun.trainer.model import blocks

MODES = ("none", "blocks", "model")


def resolved_mode(mode: str, device: torch.device) -> str:
    """training.compile for `device`: "auto" is blocks on CUDA (measured faster: 48.1% MFU
    against 36.3% eager for the 1B bench on an H200) and none elsewhere."""
    if mode == "auto":
        return "blocks" if torch.device(device).type == "cuda" else "none"
    return mode
log = logging.getLogger(__name__)


def apply_compile(model: torch.nn.Module, mode: str) -> None:
    """Compile `model`'s blocks (or the whole of it) in place ("none" leaves it eager)."""
    if mode not in MODES:
        raise ValueError(f"training.compile must be one of {MODES}, got {mode!r}")
    if mode == "none":
        return
    _watch()
    if mode == "blocks":
        for block in blocks(model):
            block.compile(dynamic=True)
    else:
        model.compile(dynamic=True)


@dataclass(frozen=True)
class CompileCounts:
    compilations: int  # graphs compiled by dynamo in this process (first compilations included)
    recompilations: int  # of those, a frame compiled again because its guards failed


_lock = threading.Lock()
_counts = {"compilations": 0, "recompilations": 0}
_watching = False
# Dynamo's compile id is "frame/attempt" (with an optional "_restart" and a compiled-autograd
# prefix): an attempt above 0 is that frame compiled again.
_COMPILE_ID = re.compile(r"(\d+)/(\d+)")


def compile_counts() -> CompileCounts:
    """Dynamo's compilations and recompilations in this process so far (dynamo's caches are
    per process, so are these counts)."""
    with _lock:
        return CompileCounts(**_counts)


def _on_compile_end(*args) -> None:
    compile_id = str(getattr(args[0], "compile_id", "")) if args else ""
    found = _COMPILE_ID.search(compile_id)
    with _lock:
        _counts["compilations"] += 1
        if found is not None and int(found.group(2)) > 0:
            _counts["recompilations"] += 1


def _watch() -> None:
    """Count dynamo's compilations from now on (once per process)."""
    global _watching
    with _lock:
        if _watching:
            return
        _watching = True
    from torch._dynamo.callback import on_compile_end

    on_compile_end(_on_compile_end)
