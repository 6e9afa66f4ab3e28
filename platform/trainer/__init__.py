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

from longrun.trainer.errors import NonFiniteError, NonFiniteGradientError, NonFiniteLossError
from longrun.trainer.model import Transformer, packed_causal_attention
from longrun.trainer.optim import build_optimizer
from longrun.trainer.progress import ProgressPrinter, StepMetrics
from longrun.trainer.schedule import build_scheduler, lr_multiplier, lr_schedule
from longrun.trainer.trainer import Trainer

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
