"""The training itself, one rank's view; it never talks to Ray.

    trainer.py       Trainer: the step (data -> forward/backward -> clip -> optimizer), train, state
    step.py          StepWork: what one step computes on this rank, the same shape for every layout
    parallelize.py   every parallelism applied to the model in one fixed order
    parallel_model.py   what the step asks of a layout; data_parallel.py: DDP with a summing
                     hook and a fixed bucket layout; sharded_model.py: DTensor weights
    tensor_parallel.py, fsdp.py, activation_checkpointing.py   TP with sequence parallel and a
                     vocabulary-parallel loss; FSDP2/HSDP per block; recompute per block
    feed.py          StepFeed: the sampler, packing or CP planning in a prefetch thread, the position
    model.py, packed_attention.py   Llama-style decoder over packed variable-length documents;
                     causal attention per document
    data.py, packing.py, tokenizer.py   corpora, the resumable sampler, packing with prefetch
    corpus.py        Corpus: documents as chunks of at most max_seq_len (BOS/EOS)
    token_corpus.py, mixture.py   prepared token shards; a weighted, resumable mixture of them
    schedule.py, optim.py   the LR schedule, AdamW
    progress.py, errors.py, runtime.py, flops.py   step metrics and the progress line, NaN
                     errors, device/seeds/RNG state, peak FLOP/s for MFU
    cp/              context parallelism and the dynamic-CP planner
"""

from longrun.trainer.data import (
    Corpus,
    DataError,
    DocumentSampler,
    FileCorpus,
    JsonlCorpus,
    SyntheticCorpus,
    build_corpus,
)
from longrun.trainer.errors import NonFiniteError, NonFiniteGradientError, NonFiniteLossError
from longrun.trainer.mixture import MixtureSampler, build_sampler
from longrun.trainer.model import Transformer, packed_causal_attention
from longrun.trainer.optim import build_optimizer
from longrun.trainer.packing import (
    IGNORE_INDEX,
    MicroBatch,
    Prefetcher,
    build_micro_batch,
    packed_micro_batches,
)
from longrun.trainer.progress import ProgressPrinter, StepMetrics
from longrun.trainer.schedule import build_scheduler, lr_multiplier, lr_schedule
from longrun.trainer.token_corpus import TokenCorpus, open_token_corpus
from longrun.trainer.tokenizer import ByteTokenizer
from longrun.trainer.trainer import Trainer

__all__ = [
    "IGNORE_INDEX",
    "ByteTokenizer",
    "Corpus",
    "DataError",
    "DocumentSampler",
    "FileCorpus",
    "JsonlCorpus",
    "MicroBatch",
    "MixtureSampler",
    "NonFiniteError",
    "NonFiniteGradientError",
    "NonFiniteLossError",
    "Prefetcher",
    "ProgressPrinter",
    "StepMetrics",
    "SyntheticCorpus",
    "TokenCorpus",
    "Trainer",
    "Transformer",
    "build_corpus",
    "build_micro_batch",
    "build_optimizer",
    "build_sampler",
    "build_scheduler",
    "lr_multiplier",
    "lr_schedule",
    "open_token_corpus",
    "packed_causal_attention",
    "packed_micro_batches",
]
