"""`JobConfig`: the whole job, composed of the per-component sections, plus the checks that
span sections. A cross-section problem names the field to change and says how."""

from __future__ import annotations

import hashlib
import json
from pathlib import PurePosixPath

import yaml
from pydantic import Field, model_validator

from longrun.config.sections import (
    CheckpointSection,
    ClusterSection,
    DataSection,
    HealthSection,
    JobSection,
    ModelSection,
    ObservabilitySection,
    ParallelismSection,
    RecoverySection,
    Section,
    TrainingSection,
)


class JobConfig(Section):
    job: JobSection
    cluster: ClusterSection = Field(default_factory=ClusterSection)
    parallelism: ParallelismSection = Field(default_factory=ParallelismSection)
    model: ModelSection = Field(default_factory=ModelSection)
    data: DataSection = Field(default_factory=DataSection)
    training: TrainingSection = Field(default_factory=TrainingSection)
    checkpoint: CheckpointSection = Field(default_factory=CheckpointSection)
    health: HealthSection = Field(default_factory=HealthSection)
    recovery: RecoverySection = Field(default_factory=RecoverySection)
    observability: ObservabilitySection = Field(default_factory=ObservabilitySection)

    @model_validator(mode="after")
    def _consistent(self) -> JobConfig:
        problems = cross_section_problems(self)
        if problems:
            # One line per problem, each led by its dotted path; the loader splits them back.
            raise ValueError("\n".join(f"{path}: {why}" for path, why in problems))
        return self

    # -- derived values ------------------------------------------------------------------------
    @property
    def world_size(self) -> int:
        return self.cluster.world_size

    @property
    def run_dir(self) -> str:
        return str(PurePosixPath(self.job.output_dir) / self.job.name)

    @property
    def checkpoint_dir(self) -> str:
        return self.checkpoint.dir or str(PurePosixPath(self.run_dir) / "checkpoints")

    def to_yaml(self) -> str:
        """The resolved config (defaults filled in), loadable again with `load_config`."""
        return yaml.safe_dump(self.model_dump(mode="json"), sort_keys=False)

    def fingerprint(self, *sections: str) -> str:
        """A short hash of the named sections (all when none), e.g. to refuse a checkpoint
        whose model shape or parallel layout differs from this job's."""
        data = self.model_dump(mode="json")
        chosen = {k: data[k] for k in (sections or data.keys())}
        blob = json.dumps(chosen, sort_keys=True, separators=(",", ":")).encode()
        return hashlib.sha256(blob).hexdigest()[:16]


def cross_section_problems(cfg: JobConfig) -> list[tuple[str, str]]:
    """Checks that need more than one section. Returns (dotted path, reason) pairs."""
    problems: list[tuple[str, str]] = []
    par, cl = cfg.parallelism, cfg.cluster

    if par.world_size != cl.world_size:
        problems.append((
            "parallelism",
            f"dp x cp x tp x pp = {par.dp} x {par.cp} x {par.tp} x {par.pp} = {par.world_size} "
            f"ranks, but the cluster has nodes x workers_per_node = {cl.nodes} x "
            f"{cl.workers_per_node} = {cl.world_size} workers; change parallelism.dp to "
            f"{_suggest_dp(cfg)} or resize cluster.nodes / cluster.workers_per_node",
        ))
    if par.tp > cl.workers_per_node or cl.workers_per_node % par.tp:
        problems.append((
            "parallelism.tp",
            f"tensor parallelism stays inside a node, so tp ({par.tp}) must divide "
            f"cluster.workers_per_node ({cl.workers_per_node})",
        ))
    if cfg.observability.metrics_port and cl.workers_per_node > 1:
        problems.append((
            "observability.metrics_port",
            f"{cl.workers_per_node} workers share a node and cannot all bind port "
            f"{cfg.observability.metrics_port}; leave it 0 (each worker takes a free port and "
            "the controller's /sd lists them)",
        ))
    if par.dynamic_cp and par.cp & (par.cp - 1):
        problems.append((
            "parallelism.cp",
            f"dynamic CP uses power-of-two CP groups; cp ({par.cp}) must be 1, 2, 4, 8, ...",
        ))
    if par.cp_impl == "ulysses" and cfg.model.n_heads % par.cp:
        problems.append((
            "parallelism.cp_impl",
            f"Ulysses splits the attention heads across the CP group: model.n_heads "
            f"({cfg.model.n_heads}) must be divisible by cp ({par.cp}); use cp_impl 'usp' or 'ring'",
        ))
    if cfg.model.n_heads % par.tp:
        problems.append((
            "parallelism.tp",
            f"model.n_heads ({cfg.model.n_heads}) must be divisible by tp ({par.tp})",
        ))
    # The widest CP group: static CP's cp, or for dynamic CP the largest power of two dividing
    # dp x cp. A sequence split over w ranks is padded to a multiple of 2w (zigzag halves).
    span = par.dp * par.cp
    widest = (span & -span) if par.dynamic_cp else par.cp
    share = cfg.model.max_seq_len if widest == 1 else -(-cfg.model.max_seq_len // (2 * widest)) * 2
    if cfg.data.micro_batch_tokens < share:
        problems.append((
            "data.micro_batch_tokens",
            f"a micro-batch of {cfg.data.micro_batch_tokens} tokens per rank cannot hold one "
            f"sequence of model.max_seq_len ({cfg.model.max_seq_len}) split over {widest} ranks "
            f"(the widest CP group: {share} tokens each); raise micro_batch_tokens to {share} or "
            "lower max_seq_len",
        ))
    if cfg.training.warmup_steps > cfg.training.steps:
        problems.append((
            "training.warmup_steps",
            f"warmup ({cfg.training.warmup_steps}) is longer than the run "
            f"(training.steps = {cfg.training.steps})",
        ))
    for i, fault in enumerate(cfg.health.faults):
        if fault.rank >= cl.world_size:
            problems.append((
                f"health.faults[{i}].rank",
                f"rank {fault.rank} does not exist in a world of {cl.world_size} ranks",
            ))
    return problems


def _suggest_dp(cfg: JobConfig) -> str:
    inner = cfg.parallelism.tp * cfg.parallelism.cp * cfg.parallelism.pp
    workers = cfg.cluster.world_size
    if workers % inner == 0:
        return str(workers // inner)
    return f"a value with dp x {inner} = {workers} (none exists: {workers} is not a multiple of {inner})"
