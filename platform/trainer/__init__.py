"""The training itself, one rank's view: the model, the step and the loop. It never talks to Ray.

    trainer.py       Trainer: the step (data -> forward/backward -> clip -> optimizer), train, state
    step.py          StepWork: what one step computes on this rank, the same shape for every layout
    feed.py          StepFeed: one global batch per step (longrun.data) turned into this rank's
                     StepWork (split, or CP-planned) in a prefetch thread; the sampler position
    model.py, packed_attention.py   Llama-style decoder over packed variable-length documents;
                     causal attention per document
    schedule.py, optim.py   the LR schedule, AdamW
    progress.py, errors.py, runtime.py, flops.py   step metrics and the progress line, NaN
                     errors, device/seeds/RNG state, peak FLOP/s for MFU
    cp/              context parallelism and the dynamic-CP planner

Where the batches come from is `longrun.data`; how the model is spread over ranks is
`longrun.parallel`.
"""

import importlib
from typing import Any

# Imported on first use (PEP 562): `longrun.parallel` builds on `trainer.model`, and the trainer
# on `longrun.parallel`; importing the model must not import the trainer (and so parallelize
# and the pipeline) half-way through.
_WHERE = {
    "NonFiniteError": "errors", "NonFiniteGradientError": "errors", "NonFiniteLossError": "errors",
    "Transformer": "model", "packed_causal_attention": "model",
    "build_optimizer": "optim",
    "ProgressPrinter": "progress", "StepMetrics": "progress",
    "build_scheduler": "schedule", "lr_multiplier": "schedule", "lr_schedule": "schedule",
    "Trainer": "trainer",
}


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_WHERE[name]}"), name)


__all__ = [
    "NonFiniteError",
    "NonFiniteGradientError",
    "NonFiniteLossError",
    "ProgressPrinter",
    "StepMetrics",
    "Trainer",
    "Transformer",
    "build_optimizer",
    "build_scheduler",
    "lr_multiplier",
    "lr_schedule",
    "packed_causal_attention",
]
