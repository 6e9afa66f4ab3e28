"""How much accelerator memory one rank needs, from the config alone (torch-free).

    plan = memory_plan(cfg.model, cfg.dims, cfg.training, cfg.data, reshard_after_forward=True)
    plan.total_bytes, plan.rows()        # what `longrun config plan` prints
    plan_problem(cfg)                    # why it does not fit cluster.device_memory_gb, and the knob

The estimate has five parts, per rank:

- **parameters, gradients, optimizer state**: 4 + 4 + 8 bytes per parameter held (fp32
  weights, fp32 gradients, AdamW's two fp32 moments); a rank holds 1/(fsdp x tp) of every
  weight under FSDP and TP (the norms, replicated across TP, are negligible), all of it under
  plain data parallelism.
- **gathered weights** (FSDP only): the unsharded parameters of the block being computed and
  of the one prefetched (all blocks when `fsdp_reshard_after_forward` is false), the root's
  embedding and output layer, and a block's unsharded gradients before they are
  reduce-scattered; in the parameter dtype (bf16 under mixed precision on a GPU), per TP shard.
- **activations** at the token budget (`data.micro_batch_tokens` per rank): what backward
  keeps of one micro-batch. Per token and layer this implementation keeps about 9 x dim +
  2 x kv_dim + 4 x ffn_dim values (measured through autograd's saved-tensor hooks; the test
  holds the estimate to the measurement), plus the output layer's log-probabilities
  (vocab_size per token). Sequence parallelism divides a block's share by tp, except the
  gathered inputs of the column-parallel projections (2 x dim); full checkpointing keeps only
  each block's input plus one block being recomputed; selective keeps the matmul, attention
  and collective outputs (about 5 x dim + 2 x kv_dim + 2 x ffn_dim); a budget b keeps b of the
  way from full's to none's, and recomputes the rest of one block at a time (the partitioner's
  own definition of its budget; its choices are its own, so this is the estimate's shape only).
- **pipeline stages**: a rank holds its stages' blocks (`parallelism.pp_layers` or the even
  split), the embedding on the first stage and the final norm and output layer on the last;
  its activations are those of its own layers for the micro-batches its schedule keeps in
  flight (`schedules.micro_batches_in_flight`: p - r for 1F1B at rank r, all for GPipe, the
  interleaved warm-up otherwise), and the output layer's log-probabilities on the last stage
  only. The plan of a pipeline job is its fullest rank's; `stage_plans` gives every one.
- Nothing for the allocator's fragmentation, the CUDA context or communication buffers: leave
  headroom (`plan_problem` asks for 10%).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING

from longrun.config.sections import DataSection, ModelSection, ParallelismSection, TrainingSection
from longrun.parallel.dims import ParallelDims
from longrun.parallel.schedules import micro_batches_in_flight, stage_layers, stages_of_rank, total_stages

if TYPE_CHECKING:
    from longrun.config.job import JobConfig

GB = 1e9
HEADROOM = 0.9  # of cluster.device_memory_gb the estimate may use


def parameter_counts(m: ModelSection) -> tuple[int, int, int]:
    """(whole model, one transformer block, the root: embedding + final norm + output layer)
    parameter counts; a tied embedding is counted once."""
    kv = m.kv_heads * m.head_dim
    block = (2 * m.dim * m.dim + 2 * m.dim * kv  # wq, wo; wk, wv
             + 3 * m.dim * m.hidden_dim + 2 * m.dim)  # w1, w3, w2; two norms
    root = m.vocab_size * m.dim * (1 if m.tie_embeddings else 2) + m.dim
    return m.n_layers * block + root, block, root


def kept_values_per_token_and_layer(m: ModelSection, tp: int, checkpointing: str,
                                    budget: float = 1.0) -> float:
    """Values one transformer block keeps from a micro-batch's forward until its backward, per
    token (see the module docstring); what autograd's saved-tensor hooks see outside any
    checkpointed region. Under "budget" the partitioner keeps `budget` of the way from what
    full checkpointing keeps to what none does (its own definition of the budget)."""
    kv = m.kv_heads * m.head_dim
    gathered = 2 * m.dim * (1 - 1 / tp)  # inputs of the column-parallel projections, all tokens
    if checkpointing == "full":
        return m.dim / tp  # the block's input (sequence-sharded under TP)
    if checkpointing == "selective":
        return (5 * m.dim + 2 * kv + 2 * m.hidden_dim) / tp + gathered
    everything = (9 * m.dim + 2 * kv + 4 * m.hidden_dim) / tp + gathered
    if checkpointing == "budget":
        least = m.dim / tp
        return least + budget * (everything - least)
    return everything


def root_values_per_token(m: ModelSection, tp: int) -> float:
    """What the output layer keeps per token: log-probabilities (vocabulary-parallel), final norm."""
    return m.vocab_size / tp + 3 * m.dim


def kept_values_per_token(m: ModelSection, tp: int, checkpointing: str, budget: float = 1.0) -> float:
    """Values kept from a micro-batch's forward until its backward, per token, by the whole model."""
    return (m.n_layers * kept_values_per_token_and_layer(m, tp, checkpointing, budget)
            + root_values_per_token(m, tp))


def recomputed_values_per_token(m: ModelSection, tp: int, checkpointing: str, budget: float = 1.0) -> float:
    """Under full checkpointing, the one block whose forward backward recomputes at a time;
    under a budget, the share of it that was not kept."""
    if checkpointing not in ("full", "budget"):
        return 0.0
    kv = m.kv_heads * m.head_dim
    block = (9 * m.dim + 2 * kv + 4 * m.hidden_dim) / tp + 2 * m.dim * (1 - 1 / tp)
    return block if checkpointing == "full" else (1 - budget) * block


def activation_values_per_token(m: ModelSection, tp: int, checkpointing: str, budget: float = 1.0) -> float:
    """Peak activation values per token: what is kept, plus under full checkpointing (or a
    budget) the one block whose forward backward recomputes at a time."""
    return (kept_values_per_token(m, tp, checkpointing, budget)
            + recomputed_values_per_token(m, tp, checkpointing, budget))


@dataclass(frozen=True)
class MemoryPlan:
    """Estimated bytes one rank needs, by part."""

    parameters: float
    gradients: float
    optimizer: float
    gathered: float
    activations: float
    tokens_per_rank: int
    pp_rank: int | None = None  # the pipeline rank this plan is of (None: no pipeline)
    layers: int | None = None  # the transformer blocks that rank holds
    in_flight: float = 1.0  # micro-batches whose activations it keeps at its peak

    @property
    def total_bytes(self) -> float:
        return self.parameters + self.gradients + self.optimizer + self.gathered + self.activations

    def rows(self) -> list[tuple[str, float]]:
        flight = f" x {self.in_flight:g} micro-batches in flight" if self.pp_rank is not None else ""
        return [("parameters", self.parameters), ("gradients", self.gradients),
                ("optimizer state", self.optimizer), ("gathered weights (FSDP)", self.gathered),
                (f"activations ({self.tokens_per_rank} tokens{flight})", self.activations),
                ("total", self.total_bytes)]


def memory_plan(m: ModelSection, dims: ParallelDims, training: TrainingSection, data: DataSection, *,
                reshard_after_forward: bool = True, on_gpu: bool = True,
                parallelism: ParallelismSection | None = None) -> MemoryPlan:
    """The estimate for one rank of this layout (`on_gpu`: bf16 is the compute dtype when
    training.dtype says so; on CPU everything is fp32); under pipeline parallelism the fullest
    pipeline rank's (`parallelism` gives its virtual stages and blocks per stage)."""
    if dims.pp > 1:
        plans = stage_plans(m, dims, training, data, reshard_after_forward=reshard_after_forward,
                            on_gpu=on_gpu, parallelism=parallelism)
        return max(plans, key=lambda p: p.total_bytes)
    total, block, root = parameter_counts(m)
    return _plan(m, dims, training, data, params=total, blocks=m.n_layers, block=block, root=root,
                 output=True, in_flight=1.0, reshard_after_forward=reshard_after_forward, on_gpu=on_gpu)


def stage_plans(m: ModelSection, dims: ParallelDims, training: TrainingSection, data: DataSection, *,
                reshard_after_forward: bool = True, on_gpu: bool = True,
                parallelism: ParallelismSection | None = None) -> list[MemoryPlan]:
    """The estimate for each pipeline rank, first to last."""
    par = parallelism or ParallelismSection(pp=dims.pp)
    _, block, _ = parameter_counts(m)
    embedding, output = m.vocab_size * m.dim, m.vocab_size * m.dim + m.dim
    schedule, virtual = training.pp_schedule, par.pp_virtual_stages
    n_stages = total_stages(schedule, dims.pp, virtual)
    ranges = stage_layers(m.n_layers, n_stages, par.pp_layers)
    micro_batches = pipeline_micro_batches(training, data, dims)
    plans = []
    for r in range(dims.pp):
        stages = stages_of_rank(r, dims.pp, virtual, schedule)
        blocks = sum(len(ranges[s]) for s in stages)
        first, last = 0 in stages, n_stages - 1 in stages
        root = embedding * first + output * last
        flight = micro_batches_in_flight(schedule, dims.pp, micro_batches, r, virtual)
        plan = _plan(m, dims, training, data, params=blocks * block + root, blocks=blocks, block=block,
                     root=root, output=last, in_flight=flight, reshard_after_forward=False, on_gpu=on_gpu)
        plans.append(dataclasses.replace(plan, pp_rank=r, layers=blocks, in_flight=flight))
    return plans


def pipeline_micro_batches(training: TrainingSection, data: DataSection, dims: ParallelDims) -> int:
    """Micro-batches every pipeline runs per step, fixed for the job: grad_accum, or the whole
    micro-batches per rank the global batch holds. The feed packs each step's global batch
    into exactly this many per rank (`data/fixed_bins.py`); the config check holds it to what
    the schedule runs (`schedules.micro_batches_to_run`)."""
    if training.global_batch_tokens is None:
        return training.grad_accum
    return max(1, training.global_batch_tokens // (data.micro_batch_tokens * dims.span))


def _plan(m: ModelSection, dims: ParallelDims, training: TrainingSection, data: DataSection, *,
          params: int, blocks: int, block: int, root: int, output: bool, in_flight: float,
          reshard_after_forward: bool, on_gpu: bool) -> MemoryPlan:
    """One rank holding `params` parameters: `blocks` transformer blocks of `block` each and
    `root` in the embedding and output layer (`output`: it computes the logits)."""
    held = params / (dims.fsdp * dims.tp)
    half = on_gpu and training.dtype == "bfloat16"
    compute_bytes = 2 if half else 4
    gathered = 0.0
    if dims.fsdp > 1:
        live_blocks = blocks if not reshard_after_forward else min(2, blocks)
        # Gathered weights in the parameter dtype; a block's full gradients in fp32.
        gathered = (live_blocks * block + root) * compute_bytes / dims.tp + block * 4 / dims.tp
    tokens, ac = data.micro_batch_tokens, training.activation_checkpointing
    budget = training.activation_memory_budget
    per_token = blocks * kept_values_per_token_and_layer(m, dims.tp, ac, budget) + \
        (root_values_per_token(m, dims.tp) if output else 0.0)
    per_token = per_token * in_flight + recomputed_values_per_token(m, dims.tp, ac, budget)
    activations = tokens * per_token * compute_bytes
    return MemoryPlan(parameters=held * 4, gradients=held * 4, optimizer=held * 8, gathered=gathered,
                      activations=activations, tokens_per_rank=tokens)


def plan_for(cfg: JobConfig) -> MemoryPlan:
    return memory_plan(cfg.model, cfg.dims, cfg.training, cfg.data,
                       reshard_after_forward=cfg.parallelism.fsdp_reshard_after_forward,
                       on_gpu=cfg.cluster.device != "cpu", parallelism=cfg.parallelism)


def _alternatives(cfg: JobConfig) -> list[tuple[str, MemoryPlan]]:
    """Single changes that keep the world size, each with its estimate, best first."""
    m, dims, tr, data = cfg.model, cfg.dims, cfg.training, cfg.data
    raf = cfg.parallelism.fsdp_reshard_after_forward
    on_gpu = cfg.cluster.device != "cpu"
    out = []
    for mode in ("selective", "full"):
        if tr.activation_checkpointing != mode:
            plan = memory_plan(m, dims, tr.model_copy(update={"activation_checkpointing": mode}), data,
                               reshard_after_forward=raf, on_gpu=on_gpu, parallelism=cfg.parallelism)
            out.append((f"training.activation_checkpointing: {mode}", plan))
    if not raf and dims.fsdp > 1:
        out.append(("parallelism.fsdp_reshard_after_forward: true",
                    memory_plan(m, dims, tr, data, reshard_after_forward=True, on_gpu=on_gpu,
                                parallelism=cfg.parallelism)))
    factor = 2
    while dims.dp % factor == 0:
        moved = dataclasses.replace(dims, dp=dims.dp // factor, fsdp=dims.fsdp * factor)
        out.append((f"parallelism.fsdp: {moved.fsdp} with dp: {moved.dp} (shard the weights, "
                    "gradients and optimizer state instead of replicating them)",
                    memory_plan(m, moved, tr, data, reshard_after_forward=raf, on_gpu=on_gpu,
                                parallelism=cfg.parallelism)))
        factor *= 2
    return out


def plan_problem(cfg: JobConfig) -> str | None:
    """Why this layout does not fit cluster.device_memory_gb (and the change that would make
    it fit), or None when it fits or no device memory is configured."""
    limit = cfg.cluster.device_memory_gb
    if limit is None:
        return None
    plan = plan_for(cfg)
    budget = limit * GB * HEADROOM
    if plan.total_bytes <= budget:
        return None
    biggest = max(plan.rows()[:-1], key=lambda row: row[1])
    why = (f"the estimated {plan.total_bytes / GB:.1f} GB per rank (largest part: {biggest[0]}, "
           f"{biggest[1] / GB:.1f} GB) exceeds 90% of cluster.device_memory_gb ({limit:g} GB)")
    fits = [(knob, p) for knob, p in _alternatives(cfg) if p.total_bytes <= budget]
    if fits:
        knob, p = fits[0]
        return f"{why}; set {knob} ({p.total_bytes / GB:.1f} GB per rank); see `longrun config plan`"
    return (f"{why}, and no single change of activation checkpointing or sharding fits; raise "
            "parallelism.tp or fsdp (more workers), or lower data.micro_batch_tokens; see "
            "`longrun config plan`")
