"""The training itself: a Llama-style model over packed documents, the data pipeline, the
learning-rate schedule and the step loop (single process; parallelism is layered on top)."""

from longrun.trainer.data import (
    Corpus,
    DataError,
    DocumentSampler,
    FileCorpus,
    JsonlCorpus,
    SyntheticCorpus,
    build_corpus,
)
from longrun.trainer.model import Transformer, packed_causal_attention
from longrun.trainer.packing import (
    IGNORE_INDEX,
    MicroBatch,
    Prefetcher,
    build_micro_batch,
    packed_micro_batches,
)
from longrun.trainer.schedule import build_scheduler, lr_multiplier, lr_schedule
from longrun.trainer.tokenizer import ByteTokenizer
from longrun.trainer.trainer import (
    NonFiniteError,
    NonFiniteGradientError,
    NonFiniteLossError,
    ProgressPrinter,
    StepMetrics,
    Trainer,
    build_optimizer,
)

__all__ = [
    "IGNORE_INDEX",
    "ByteTokenizer",
    "Corpus",
    "DataError",
    "DocumentSampler",
    "FileCorpus",
    "JsonlCorpus",
    "MicroBatch",
    "NonFiniteError",
    "NonFiniteGradientError",
    "NonFiniteLossError",
    "Prefetcher",
    "ProgressPrinter",
    "StepMetrics",
    "SyntheticCorpus",
    "Trainer",
    "Transformer",
    "build_corpus",
    "build_micro_batch",
    "build_optimizer",
    "build_scheduler",
    "lr_multiplier",
    "lr_schedule",
    "packed_causal_attention",
    "packed_micro_batches",
]
