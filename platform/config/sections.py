"""Per-component configuration models.

Each section is a small pydantic model that validates its own fields; checks that span
sections (world size against the cluster, sequence length against the token budget) live
in `longrun.config.checks`. Every model forbids unknown keys so a typo is an error, not a
silently ignored setting.
"""

from __future__ import annotations

import math
import os
import re
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, field_serializer, field_validator, model_validator

from longrun.config.identity import ACCEPTABLE, GROUPS
from longrun.parallel.dims import CPImpl
from longrun.parallel.schedules import PipelineSchedule
from longrun.redis_password import (
    REDIS_SCHEMES,
    REFERENCE,
    RedisPasswordError,
    as_reference,
    password_of,
    refuse_placeholder,
    resolve,
)

PositiveInt = Annotated[int, Field(gt=0)]
NonNegativeInt = Annotated[int, Field(ge=0)]
PositiveFloat = Annotated[float, Field(gt=0)]
NonNegativeFloat = Annotated[float, Field(ge=0)]

# Every count and duration has an upper bound. Past it a value is a typo or hostile, and it
# would fail far from the line that set it: `health.heartbeat_timeout_s: 1e308` validated, then
# overflowed in every worker turning it into a Redis expiry in milliseconds. A week bounds
# every duration (the longest defaults are 30 minutes), 2^31 - 1 every count (int32: numpy
# columns, torch sizes); rates and sizes must be finite.
MAX_SECONDS = 7 * 24 * 3600.0
MAX_COUNT = 2**31 - 1
Count = Annotated[int, Field(gt=0, le=MAX_COUNT)]
NonNegativeCount = Annotated[int, Field(ge=0, le=MAX_COUNT)]
Duration = Annotated[float, Field(gt=0, le=MAX_SECONDS)]
NonNegativeDuration = Annotated[float, Field(ge=0, le=MAX_SECONDS)]
FinitePositive = Annotated[float, Field(gt=0, allow_inf_nan=False)]
FiniteNonNegative = Annotated[float, Field(ge=0, allow_inf_nan=False)]
Factor = Annotated[float, Field(gt=1, allow_inf_nan=False)]

_JOB_NAME = re.compile(r"^[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?$")


class Section(BaseModel):
    """Base for every section: unknown keys are errors, values are re-validated on assignment."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, frozen=False)


class JobSection(Section):
    name: str = Field(description="Lowercase letters, digits and '-' (used in keys, paths, labels).")
    seed: Annotated[int, Field(ge=0, le=2**63 - 1)] = Field(
        0, description="Seed for weight init and data order.")
    output_dir: str = Field("runs", description="Directory under which runs/<name>/ is created.")

    @field_validator("name")
    @classmethod
    def _dns_like(cls, v: str) -> str:
        if not _JOB_NAME.match(v):
            raise ValueError(
                f"{v!r} is not a valid job name; use 1-63 lowercase letters, digits and '-', "
                "starting and ending with a letter or digit (e.g. 'llama-1b-pretrain')"
            )
        return v


class ClusterSection(Section):
    address: str | None = Field(
        None, description="Ray cluster address (ray://host:10001 or auto); null starts a local Ray."
    )
    redis_url: str | None = Field(
        None, repr=False, description="redis:// or rediss:// URL for rendezvous and job state; null "
        "embeds one. Write its password as ${LONGRUN_REDIS_PASSWORD} to take it from that variable "
        "(or from the 0600 file $LONGRUN_REDIS_PASSWORD_FILE names); files longrun writes always "
        "hold that reference, never the password."
    )
    nodes: Count = Field(1, description="Number of nodes the job spans.")
    workers_per_node: Count = Field(1, description="Workers per node: one per accelerator.")
    device: Literal["auto", "cpu", "cuda"] = Field("auto", description="auto: cuda when present.")
    device_memory_gb: FinitePositive | None = Field(
        None, description="Memory of one accelerator in GB; when set, a layout whose estimated "
        "per-rank memory (`longrun config plan`) does not fit is refused before anything is placed.")
    peak_tflops: FinitePositive | None = Field(
        None, description="One accelerator's dense peak TFLOP/s in the training dtype, for MFU; "
        "null: looked up for known GPUs (H100, H200, A100), none on CPU (MFU not reported).")

    @field_validator("redis_url")
    @classmethod
    def _password_from_the_environment(cls, v: str | None) -> str | None:
        if v is not None and not v.startswith(REDIS_SCHEMES):
            # unix:// was parsed as TCP localhost:6379 by the store's client, which then sent the
            # password there; and no worker on another node could reach a socket file anyway.
            raise ValueError(
                "must be a redis:// or rediss:// URL (unix sockets and other schemes are not "
                "supported: workers on every node connect to it over TCP); give the server's host "
                "and port, e.g. redis://:${LONGRUN_REDIS_PASSWORD}@HOST:6379/0")
        # Lenient: a worker's copy of the config may lack the variable (the controller hands
        # workers the URL itself); `runnable_problems` refuses an unresolved one where it runs.
        try:
            if (written := password_of(v)) is not None and written != REFERENCE:
                refuse_placeholder(written, "cluster.redis_url")
            return resolve(v, strict=False)
        except RedisPasswordError as exc:
            raise ValueError(str(exc)) from None

    @field_serializer("redis_url")
    def _password_as_reference(self, v: str | None) -> str | None:
        return as_reference(v)  # every dump (written config, shipped config, fingerprint)

    @property
    def workers(self) -> int:
        """Worker slots: one rank each (the parallel dims must multiply to this)."""
        return self.nodes * self.workers_per_node


class ParallelismSection(Section):
    dp: Count = Field(1, description="Data-parallel degree (outermost): replicas of the model.")
    fsdp: Count = Field(1, description="Ranks sharding one replica's parameters, gradients "
                              "and optimizer state (FSDP2); with dp > 1 as well: HSDP, sharded "
                              "inside a replica and replicated across.")
    fsdp_reshard_after_forward: bool = Field(
        True, description="Free each block's gathered parameters after its forward and gather "
        "them again in backward (less memory); false keeps them until backward (less traffic).")
    tp: Count = Field(1, description="Tensor-parallel degree (kept inside a node).")
    cp: Count = Field(1, description="Context-parallel degree (static upper bound).")
    pp: Count = Field(1, description="Pipeline-parallel degree: the model cut into this many "
                            "ranks' worth of stages by transformer blocks (embedding on the first, "
                            "norm and output on the last).")
    pp_virtual_stages: Count = Field(
        1, description="Stages per pipeline rank for the multi-stage schedules (interleaved_1f1b, "
        "looped_bfs, interleaved_zero_bubble; zbv_zero_bubble holds 2): more stages, a smaller bubble.")
    pp_layers: list[Count] | None = Field(
        None, description="Transformer blocks of each stage, first to last (pp x virtual stages "
        "counts summing to model.n_layers); null: an even split, the remainder to the first stages.")
    cp_impl: CPImpl = Field("ring", description="Attention across a CP group: ring, ulysses "
                            "(heads split by all-to-all) or usp (Ulysses inside, ring across).")
    dynamic_cp: bool = Field(False, description="Choose the CP size per micro-batch with the solver.")


class ModelSection(Section):
    vocab_size: Count = Field(260, description="256 byte values + the byte tokenizer's special tokens.")
    dim: Count = 128
    n_layers: Count = 2
    n_heads: Count = 4
    n_kv_heads: Count | None = Field(None, description="Grouped-query attention; null = n_heads.")
    ffn_dim: Count | None = Field(None, description="SwiGLU hidden size; null = 8/3 dim rounded to 64.")
    max_seq_len: Annotated[int, Field(ge=2, le=MAX_COUNT)] = Field(
        256, description="Longest document chunk, in tokens.")
    rope_theta: FinitePositive = 10000.0
    norm_eps: FinitePositive = 1e-5
    tie_embeddings: bool = True
    init_from: str | None = Field(
        None, description="A local Hugging Face Llama directory (config.json, model.safetensors) "
        "whose weights start the job instead of a random initialisation; its config must match "
        "this section. A job resuming from a checkpoint takes the checkpoint's weights instead.")

    @model_validator(mode="after")
    def _shapes(self) -> ModelSection:
        if self.dim % self.n_heads:
            raise ValueError(f"dim ({self.dim}) must be divisible by n_heads ({self.n_heads})")
        if (self.dim // self.n_heads) % 2:
            raise ValueError(
                f"head dimension dim/n_heads = {self.dim // self.n_heads} must be even for rotary "
                "embeddings; change dim or n_heads"
            )
        kv = self.kv_heads
        if kv > self.n_heads or self.n_heads % kv:
            raise ValueError(f"n_kv_heads ({kv}) must divide n_heads ({self.n_heads})")
        return self

    @property
    def kv_heads(self) -> int:
        return self.n_kv_heads or self.n_heads

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @property
    def hidden_dim(self) -> int:
        if self.ffn_dim is not None:
            return self.ffn_dim
        return 64 * -(-(8 * self.dim // 3) // 64)


class LengthDistribution(Section):
    """Lognormal document lengths, clipped to [min_len, max_len] (Dynamic-CP's benchmark shape)."""

    min_len: Count = 128
    max_len: Count = 8192
    mean: FinitePositive = 1024.0
    sigma: FinitePositive = 1.5

    @model_validator(mode="after")
    def _ordered(self) -> LengthDistribution:
        if self.min_len > self.max_len:
            raise ValueError(f"min_len ({self.min_len}) must not exceed max_len ({self.max_len})")
        if not self.min_len <= self.mean <= self.max_len:
            raise ValueError(f"mean ({self.mean}) must lie within [min_len, max_len]")
        return self


class MixItem(Section):
    """One dataset of a mixture: a prepared directory and its relative share of documents."""

    path: str = Field(description="A directory made by `longrun data prepare`.")
    weight: float = Field(description="Relative share of the documents drawn, a long "
                          "document counted once per max_seq_len chunk (> 0; normalised "
                          "over the mixture, so 0.7 and 0.3 or 7 and 3 mean the same).")

    @field_validator("path")
    @classmethod
    def _home(cls, path: str) -> str:
        return os.path.expanduser(path)

    @model_validator(mode="after")
    def _positive_weight(self) -> MixItem:
        if not (math.isfinite(self.weight) and self.weight > 0):
            raise ValueError(
                f"the mixture weight of {self.path!r} is {self.weight}; every weight must be a "
                "positive number (a dataset not to draw from is left out of data.mix)")
        return self


class DataSection(Section):
    source: Literal["text", "synthetic", "tokens"] = Field(
        "text", description="text: files read at train time (byte tokenizer only); synthetic: "
        "random documents; tokens: token shards made by `longrun data prepare` (data.path or data.mix).")
    path: str | None = Field(
        "stdlib",
        description="text: a directory of files, a .jsonl file with a 'text' field, or 'stdlib' "
        "(the running Python's standard library sources: a real code corpus on any machine); "
        "tokens: the --out directory of `longrun data prepare`.",
    )
    tokenizer: str | None = Field(
        None, description="A local tokenizer.json, or a directory holding one (a Hugging Face "
        "tokenizer directory); null or 'byte': the byte tokenizer. model.vocab_size follows it "
        "unless set. Token shards must have been prepared with the same tokenizer.")
    mix: list[MixItem] | None = Field(
        None, description="source tokens: several prepared directories drawn from by weight, "
        "e.g. [{path: web, weight: 0.7}, {path: code, weight: 0.3}] (instead of data.path).")
    include: list[str] = Field(["*.py"], description="Glob patterns for files inside a directory.")
    synthetic: LengthDistribution = Field(default_factory=LengthDistribution)
    micro_batch_tokens: Count = Field(
        2048, description="Token budget of one micro-batch per rank (under context parallelism: "
        "the most tokens any rank holds). A step's global batch is training.global_batch_tokens "
        "(by default dp x fsdp x cp x grad_accum of these budgets), split among the ranks.")
    prefetch: Annotated[int, Field(ge=0, le=1024)] = Field(
        4, description="Steps' data prepared ahead by a background thread (each held in memory).")

    @model_validator(mode="before")
    @classmethod
    def _no_stdlib_default_for_tokens(cls, data: object) -> object:
        # 'stdlib' is the text source's default; token shards have no default directory.
        if isinstance(data, dict) and data.get("source") == "tokens" and "path" not in data:
            data = {**data, "path": None}
        return data

    @field_validator("path", "tokenizer")
    @classmethod
    def _home(cls, path: str | None) -> str | None:
        # '~/tok' means the same to the config check and to every process that opens it.
        return os.path.expanduser(path) if path else path

    @model_validator(mode="after")
    def _source_needs(self) -> DataSection:
        if self.source == "text" and not self.path:
            raise ValueError("source 'text' needs data.path (a directory, a .jsonl file, or 'stdlib')")
        if self.mix is not None and self.source != "tokens":
            raise ValueError(f"mix (of prepared token shards) needs source 'tokens', not "
                             f"{self.source!r}")
        if self.source == "tokens":
            if self.mix is not None and self.path:
                raise ValueError("source 'tokens' takes data.path (one prepared directory) or "
                                 "data.mix (several), not both")
            if self.mix is None and not self.path:
                raise ValueError("source 'tokens' needs data.path (the --out directory of `longrun "
                                 "data prepare`) or data.mix (several such directories with weights)")
            if self.mix is not None and not self.mix:
                raise ValueError("data.mix is empty; list at least one {path, weight}")
        return self

    @property
    def uses_byte_tokenizer(self) -> bool:
        return self.tokenizer in (None, "byte")

    @property
    def token_dirs(self) -> list[str]:
        """source tokens: the prepared directories, in mixture order (one without a mixture)."""
        if self.source != "tokens":
            return []
        return [item.path for item in self.mix] if self.mix is not None else [str(self.path)]


class TrainingSection(Section):
    steps: Count = 100
    grad_accum: Count = Field(
        1, description="Micro-batches per optimizer step at the configured layout: with "
        "global_batch_tokens unset, it sizes the global batch.")
    global_batch_tokens: Annotated[int, Field(gt=0, le=2**48)] | None = Field(
        None, description="The token budget of one optimizer step over all ranks; null: "
        "data.micro_batch_tokens x grad_accum x the data span (dp x fsdp x cp ranks). Set it "
        "explicitly, or the controller pins it, so that a job resumed at another world size "
        "keeps the same global batch and optimizer trajectory.")
    lr: FinitePositive = 3e-4
    min_lr_ratio: Annotated[float, Field(ge=0, le=1)] = 0.1
    warmup_steps: NonNegativeCount = 10
    lr_schedule: Literal["cosine", "linear", "wsd", "constant"] = Field(
        "cosine", description="After warmup: cosine or linear decay to lr x min_lr_ratio at the "
        "last step; wsd (warmup-stable-decay): the peak until the last decay_steps steps, then a "
        "linear decay to lr x min_lr_ratio (a run extended by raising steps before its decay "
        "began goes on at the peak, without a jump); constant: the peak to the end.")
    decay_steps: Count | None = Field(
        None, description="wsd: how many of the last steps decay; null: decay_fraction of the "
        "steps after warmup.")
    decay_fraction: Annotated[float, Field(gt=0, le=1)] = Field(
        0.2, description="wsd with decay_steps null: the share of the steps after warmup that decay.")
    weight_decay: FiniteNonNegative = 0.1
    betas: tuple[Annotated[float, Field(gt=0, lt=1)], Annotated[float, Field(gt=0, lt=1)]] = (0.9, 0.95)
    grad_clip: FiniteNonNegative = Field(1.0, description="Max global grad norm; 0 disables clipping.")
    dtype: Literal["float32", "bfloat16"] = "float32"
    activation_checkpointing: Literal["none", "full", "selective", "budget"] = Field(
        "none", description="Per transformer block: none; full (keep only each block's input and "
        "recompute the rest in backward); selective (keep matmul, attention and collective "
        "outputs, recompute the cheap elementwise work, chosen op by op as the block runs); budget "
        "(compiled blocks or model only: the compiler's partitioner keeps what fits in "
        "activation_memory_budget and recomputes the cheapest of the rest, decided once per graph "
        "with no per-op cost at run time).")
    activation_memory_budget: Annotated[float, Field(gt=0, lt=1)] = Field(
        0.5, description="activation_checkpointing: budget: the share of the activations a compiled "
        "graph may keep, between what full checkpointing keeps (0) and what it keeps without "
        "checkpointing (1); the partitioner recomputes the ops with the fewest FLOPs per byte first "
        "(elementwise work before matmuls).")
    compile: Literal["auto", "none", "blocks", "model"] = Field(
        "auto", description="torch.compile: none (eager); blocks (each transformer block compiled on "
        "its own, attention left eager: torchtitan's regional compilation, composed with TP, FSDP, PP "
        "and activation checkpointing); model (the whole model, one graph per stretch between "
        "attentions; not with pipeline stages); auto (the default): blocks on CUDA, measured 1.33x "
        "eager's throughput on an H200 (docs/benchmarks.md), none on the CPU, where compiling takes "
        "longer than a short job trains.")
    grad_sync_bucket_mb: FinitePositive = Field(
        25.0, description="Data-parallel gradient bucket size; smaller starts communication sooner."
    )
    log_every: Count = Field(
        1, description="The job's progress line (printed by the driver) every this many steps, and the last.")
    pp_schedule: PipelineSchedule = Field(
        "1f1b", description="Pipeline schedule (parallelism.pp > 1): gpipe, 1f1b, interleaved_1f1b, "
        "looped_bfs, interleaved_zero_bubble or zbv_zero_bubble (torch.distributed.pipelining's).")


class ValidationSection(Section):
    """The loss on held-out data every `interval_steps` steps (trainer/validation.py). Off until
    interval_steps is set; then its data is `path` or a `held_out` share of the training data."""

    interval_steps: Count | None = Field(
        None, description="Run a validation pass after every this many steps (and never when null, the "
        "default). Every pass evaluates the same held-out tokens, from the start of the held-out "
        "stream, so passes compare with each other and a resumed job computes the same losses.")
    steps: Count = Field(
        1, description="Global batches per pass, each training.global_batch_tokens tokens drawn and "
        "split the way training's are, at the job's layout.")
    path: str | None = Field(
        None, description="Its own data, read as data.source reads (text: a directory, a .jsonl file; "
        "tokens: a `longrun data prepare` directory made with the same tokenizer).")
    held_out: Annotated[float, Field(gt=0, le=0.5, allow_inf_nan=False)] | None = Field(
        None, description="Instead of path: this share of the training data's documents (chosen by "
        "a fixed seed, the same for every job seed), never trained on. Changes what trains, so a "
        "checkpoint written without it resumes only with checkpoint.accept_changes.")

    @field_validator("path")
    @classmethod
    def _home(cls, path: str | None) -> str | None:
        return os.path.expanduser(path) if path else path

    @model_validator(mode="after")
    def _one_source(self) -> ValidationSection:
        if self.path is not None and self.held_out is not None:
            raise ValueError("give validation.path (its own data) or validation.held_out (a share of "
                             "the training data), not both")
        if self.interval_steps is not None and self.path is None and self.held_out is None:
            raise ValueError("validation needs data: set validation.path (its own data) or "
                             "validation.held_out (e.g. 0.01 of the training documents)")
        if self.interval_steps is None and (self.path is not None or self.held_out is not None):
            raise ValueError("validation has data but no validation.interval_steps; set it (e.g. 100) "
                             "to run validation, or remove the validation section")
        return self

    @property
    def enabled(self) -> bool:
        return self.interval_steps is not None


class CheckpointSection(Section):
    dir: str | None = Field(None, description="fsspec URL; null = <output_dir>/<job>/checkpoints.")
    interval_steps: Count = 50
    memory_interval_steps: NonNegativeInt | Literal["auto"] | None = Field(
        "auto", description="Peer memory snapshots (controller jobs): every this many steps each rank's "
        "state (its replicas dividing it: one copy per shard) is also kept in host memory on its node "
        "and the next one, so a restart after a fault loses at most that many steps. auto (or null): "
        "the smallest interval whose send fits in its steps' compute time, measured on the job's "
        "first steps and followed as it changes; 0: off. A snapshot due while the previous one is "
        "still being sent is skipped (counted), never waited for.")
    keep_last: Count = Field(3, description="Committed checkpoints kept (the newest is never deleted).")
    async_save: bool = Field(True, description="Write in the background; false waits for each commit.")
    when_busy: Literal["wait", "skip"] = Field(
        "wait", description="A save due while the previous one is still being written: wait for it, or skip."
    )
    commit_timeout_s: Duration = Field(
        600.0, description="How long the committing rank waits for every rank's shards."
    )
    restore_timeout_s: Duration = Field(
        600.0, description="How long a restoring rank waits for every rank to say whether it read "
        "and verified its part of a checkpoint; then the ranks that did not answer are named.")
    accept_changes: list[str] = Field(
        default_factory=list, description="Resume from a checkpoint although these settings differ "
        "from the job that wrote it: groups (data, tokenizer, training) or keys (e.g. training.lr, "
        "job.seed, data.path). Without it such a resume is refused before anything starts, naming "
        "each difference (config/identity.py). Accepted data, seed or tokenizer changes start the "
        "new data from its beginning. Remove it once resumed, so a later change is refused again.")

    @field_validator("accept_changes")
    @classmethod
    def _known_names(cls, names: list[str]) -> list[str]:
        unknown = [n for n in names if n not in ACCEPTABLE]
        if unknown:
            keys = ", ".join(k for keys in GROUPS.values() for k in keys)
            raise ValueError(f"{', '.join(map(repr, unknown))} cannot be accepted: name a group "
                             f"({', '.join(GROUPS)}) or one of its keys ({keys})")
        return list(dict.fromkeys(names))


FaultKind = Literal["kill", "hang", "raise", "nan", "slow", "hold", "fail_save"]


class FaultSpec(Section):
    """One injected fault: on `rank`, when it reaches `step`, do `kind` (off unless listed)."""

    rank: NonNegativeCount
    step: NonNegativeCount
    kind: FaultKind
    seconds: NonNegativeDuration = Field(0.0, description="Duration for 'slow' (extra time per step).")
    in_step: bool = Field(
        False, description="For 'slow': spend the time inside each step, before the optimizer update "
        "(where a larger model's compute would be, beside the snapshot's copy), not after the step.")
    attempt: NonNegativeCount = Field(
        0, description="Only in this attempt, so a restart does not re-fire it.")
    release_file: str | None = Field(
        None, description="For 'hold': the rank waits (phase 'held', judged by the hard hang ceiling) "
        "until this file exists.")

    @model_validator(mode="after")
    def _hold_needs_a_release(self) -> FaultSpec:
        if (self.kind == "hold") != (self.release_file is not None):
            raise ValueError("release_file is required for a 'hold' fault and only for it: the held "
                             "rank waits until that file exists")
        if self.in_step and self.kind != "slow":
            raise ValueError("in_step applies to a 'slow' fault only; remove it from this fault")
        return self


Seconds = Duration | Literal["auto"]


class StartupSection(Section):
    """How long each part of an attempt's start may take before the rank is declared hung,
    naming the phase (health/startup.py computes 'auto' and says from what; `longrun config
    plan` prints the table). The hang timeout covers training steps only."""

    placement_s: Seconds = Field(
        "auto", description="Reserving the nodes and starting every rank's process (a wait for busy "
        "nodes is retried, not a restart). auto: 120 s plus 20 ms per rank.")
    setup_s: Seconds = Field(
        "auto", description="A rank's own start: imports, device, metrics server. auto: 300 s.")
    rendezvous_s: Seconds = Field(
        "auto", description="Forming every communication group, once every rank is in it. auto: 120 s "
        "plus 10 ms per rank.")
    build_s: Seconds = Field(
        "auto", description="The model built on the meta device, parallelized and this rank's pieces "
        "allocated. auto: 60 s plus 3x the rank's state at 1 GB/s, at least the floor.")
    restore_s: Seconds = Field(
        "auto", description="Reading and verifying a checkpoint or memory snapshot. auto: 60 s plus 3x "
        "the rank's parameters and optimizer state at the storage rate (measured by an earlier "
        "attempt's restore, else storage_mb_per_s), at least the floor.")
    init_s: Seconds = Field(
        "auto", description="The initial weights when nothing was restored. auto: 3x the rank's "
        "parameters at 100 MB/s (model.init_from: at the storage rate), at least the floor.")
    calibration_s: Seconds = Field(
        "auto", description="Dynamic context parallelism's cost model (only under CP). auto: 3x about "
        "60 micro-batch passes at the estimated speed, at least the floor.")
    first_step_s: Seconds = Field(
        "auto", description="The attempt's first step: first collectives, warm-up. auto: 180 s plus 3x "
        "the step's FLOPs per rank at 10% of cluster.peak_tflops (40 TFLOP/s on cuda, 0.02 on cpu "
        "when unset), at least the floor.")
    storage_mb_per_s: FinitePositive = Field(
        100.0, description="The storage rate per rank (MB/s) the restore's deadline assumes until a "
        "restore of this job has measured one.")
    floor_s: Duration = Field(
        120.0, description="No 'auto' deadline is shorter than this (nor than health.hang_timeout_s).")


class HealthSection(Section):
    heartbeat_interval_s: Duration = 1.0
    heartbeat_timeout_s: Duration = 5.0
    hang_timeout_s: Duration = Field(
        120.0, description="Hard ceiling: no step progress for this long is a hang, whatever the step "
        "times. Training steps only: each start-up phase has its own deadline (health.startup).")
    startup: StartupSection = Field(default_factory=StartupSection)
    collective_timeout_s: Duration = Field(
        1800.0, description="Every process group's timeout: a collective (or group bring-up) waiting "
        "this long for a peer fails. A backstop: a stuck rank is declared by its hang timeout or "
        "start-up deadline first. Longer than any start-up phase, since a rank's first collectives "
        "may wait for a peer still restoring or building.")
    hang_safety_factor: Factor = Field(
        5.0, description="Once step times are known, no progress for this x the slowest recent step "
        "(but at least hang_min_s) is a hang.")
    hang_min_s: Duration = Field(10.0, description="Floor of the learned hang timeout.")
    straggler_factor: Factor = Field(1.5, description="Step time x median.")
    straggler_patience: Count = Field(
        5, description="Consecutive steps above straggler_factor x median before a rank is a straggler.")
    loss_spike_factor: Factor = Field(
        10.0, description="A loss above this x the median of recent losses is a spike.")
    store_outage_grace_s: NonNegativeDuration = Field(
        10.0, description="After Redis comes back, how long workers get to re-publish heartbeats "
        "before a missing one counts as dead.")
    node_agents: Literal["auto", "on", "off"] = Field(
        "auto", description="Heartbeats through one agent per node, which publishes one record for "
        "its ranks and sees a rank's process exit (health/node_agent.py): 'auto' from "
        "64 ranks on, 'on' or 'off' for any size.")
    store_patience_s: Duration = Field(
        60.0, description="How long job-state writes and checkpoint commit reports retry while Redis "
        "is unreachable (a restart, a failover) before the error is raised. A controller that could "
        "not renew its lease for this long stops; the lease expires 10 s later, and only then may "
        "another controller take the job over.")
    faults: list[FaultSpec] = Field(default_factory=list)

    @model_validator(mode="after")
    def _timeouts(self) -> HealthSection:
        if self.heartbeat_timeout_s <= self.heartbeat_interval_s:
            raise ValueError(
                f"heartbeat_timeout_s ({self.heartbeat_timeout_s}) must exceed heartbeat_interval_s "
                f"({self.heartbeat_interval_s}); at least 3x the interval is usual"
            )
        return self


class RecoverySection(Section):
    max_restarts: NonNegativeCount = 10
    max_restarts_in_window: Count = Field(5, description="At most this many restarts ...")
    restart_window_s: Duration = Field(3600.0, description="... within this many seconds.")
    restart_backoff_s: NonNegativeDuration = Field(
        1.0, description="Wait before a restart; doubled per restart in a row that got no further "
        "than the fault before it (at most 60 s), back to this once the job trains past it.")
    evict_on_failed_diagnostics: bool = True
    evict_stragglers: bool = Field(
        True, description="Evict the node of stragglers blamed on their node (health/stragglers.py: its "
        "ranks slow together with normal data) when a spare node or a shrink can take its place; "
        "stragglers of their data, pipeline stage or alone on a node are only reported. false: report all.")
    skip_after_spikes: Count = Field(
        2, description="Loss spikes at the same step before its data window is skipped on restart.")
    preemption_grace_s: Duration = Field(
        120.0, description="After a stop request (SIGTERM or SIGINT to the controller, `longrun stop`, "
        "a drained node): how long the workers get to save a checkpoint at the next step boundary "
        "and commit it before everything is stopped anyway.")
    diagnostics: list[Literal["compute", "memory", "collective", "store"]] = Field(
        default_factory=lambda: ["compute", "memory", "collective", "store"]
    )
    min_nodes: Count | None = Field(
        None, description="Elastic continuation: when a lost or evicted node leaves too few to "
        "place the job's cluster.nodes within shrink_after_s, continue on the nodes left, down to "
        "this many (parallelism.dp shrinks first, then parallelism.fsdp; the global batch stays the "
        "same), and grow back to cluster.nodes at a checkpoint once they can be placed again. "
        "null: not elastic; a job whose nodes cannot all be placed fails (after node_wait_s).")
    node_wait_s: NonNegativeDuration = Field(
        600.0, description="A job that is not elastic and has run before: how long to wait for "
        "nodes to replace lost or evicted ones when too few are left to place it, before failing "
        "(a replacement node often joins within minutes); 0: fail at once. A job's first placement "
        "never waits: a cluster too small for it fails with the reason.")
    shrink_after_s: NonNegativeDuration = Field(
        60.0, description="With min_nodes set: how long to wait for the job's full node count to "
        "become placeable before continuing on fewer nodes (or failing, below min_nodes).")


class ObservabilitySection(Section):
    metrics_port: Annotated[int, Field(ge=0, le=65535)] = Field(
        0, description="Each worker's /metrics port; 0 picks a free one (several workers share a node).")
    metrics_host: str = Field("127.0.0.1", description="Bind address of /metrics (worker and "
                              "controller); 0.0.0.0 on a real cluster, advertised as the node's IP.")
    controller_port: Annotated[int, Field(ge=0, le=65535)] = Field(
        0, description="The controller's /metrics and /sd (Prometheus http_sd) port; 0 picks a free one.")
    file_sd_path: str | None = Field(
        None, description="Also write the scrape targets to this Prometheus file_sd JSON file.")
    linger_s: NonNegativeDuration = Field(
        30.0, description="After the job ends FAILED, how long the controller keeps serving /metrics "
        "(if anything scraped it) so Prometheus records the final state and the alert fires.")
    grafana_url: str | None = Field(
        None, description="The Grafana that `longrun dashboards push --config JOB.yaml` uploads the "
        "dashboards to (--grafana-url and $GRAFANA_URL come first).")
    log_level: Literal["debug", "info", "warning", "error"] = "info"
    tensorboard: bool = Field(
        True, description="The controller writes TensorBoard event files to <output_dir>/<job>/tb/: "
        "loss, grad norm, lr, tokens/s, MFU, step time, data wait, checkpoint and restore seconds, "
        "and the job's events as text (`tensorboard --logdir <output_dir>/<job>/tb`).")
    wandb: Literal["off", "offline", "online"] = Field(
        "off", description="Also log the step metrics and events to Weights & Biases, where the "
        "`wandb` package is installed: offline (files under <output_dir>/<job>/wandb, `wandb sync` "
        "later) or online (needs WANDB_API_KEY on the controller's machine).")
