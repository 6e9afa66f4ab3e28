"""`JobConfig`: the whole job, composed of the per-component sections, validated by the checks
that span sections (`checks.py`). A cross-section problem names the field to change and says how."""

from __future__ import annotations

import hashlib
import json
from pathlib import PurePosixPath

import yaml
from pydantic import Field, model_validator

from longrun.config.checks import cross_section_problems
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
    ValidationSection,
)
from longrun.config.vocabulary import resolve_vocabulary
from longrun.parallel.dims import ParallelDims, parallel_dims

__all__ = ["JobConfig", "cross_section_problems"]


# From this many ranks on, health.node_agents 'auto' uses the agents: below it the per-rank keys
# cost the controller little (a 64-rank poll reads 64 keys) and need no actor per node.
NODE_AGENTS_FROM_RANKS = 64


def uses_node_agents(choice: str, world_size: int) -> bool:
    """health.node_agents for a world of `world_size` ranks (an elastic job's attempt may be smaller)."""
    return choice == "on" or (choice == "auto" and world_size >= NODE_AGENTS_FROM_RANKS)


class JobConfig(Section):
    job: JobSection
    cluster: ClusterSection = Field(default_factory=ClusterSection)
    parallelism: ParallelismSection = Field(default_factory=ParallelismSection)
    model: ModelSection = Field(default_factory=ModelSection)
    data: DataSection = Field(default_factory=DataSection)
    training: TrainingSection = Field(default_factory=TrainingSection)
    validation: ValidationSection = Field(default_factory=ValidationSection)
    checkpoint: CheckpointSection = Field(default_factory=CheckpointSection)
    health: HealthSection = Field(default_factory=HealthSection)
    recovery: RecoverySection = Field(default_factory=RecoverySection)
    observability: ObservabilitySection = Field(default_factory=ObservabilitySection)

    @model_validator(mode="after")
    def _consistent(self) -> JobConfig:
        # The vocabulary first: it may set model.vocab_size, which the layout checks read.
        problems = resolve_vocabulary(self) + cross_section_problems(self)
        if problems:
            # One line per problem, each led by its dotted path; the loader splits them back.
            raise ValueError("\n".join(f"{path}: {why}" for path, why in problems))
        return self

    # -- derived values ------------------------------------------------------------------------
    @property
    def dims(self) -> ParallelDims:
        """The parallel layout (`longrun.parallel.dims`): world, span, CP group sizes."""
        return parallel_dims(self)

    @property
    def global_batch_tokens(self) -> int:
        """The token budget of one optimizer step over all ranks: training.global_batch_tokens,
        or by default data.micro_batch_tokens x grad_accum x the span (dp x fsdp x cp), the
        batch the configured layout would pack (`trainer/feed.py` draws it)."""
        explicit = self.training.global_batch_tokens
        if explicit is not None:
            return explicit
        return self.data.micro_batch_tokens * self.training.grad_accum * self.dims.span

    @property
    def world_size(self) -> int:
        return self.dims.world_size

    @property
    def node_agents(self) -> bool:
        """Whether heartbeats go through one agent per node (health.node_agents)."""
        return uses_node_agents(self.health.node_agents, self.world_size)

    @property
    def run_dir(self) -> str:
        return str(PurePosixPath(self.job.output_dir) / self.job.name)

    @property
    def checkpoint_dir(self) -> str:
        return self.checkpoint.dir or str(PurePosixPath(self.run_dir) / "checkpoints")

    def to_yaml(self, *, pin_vocabulary: bool = True) -> str:
        """The resolved config (defaults filled in), loadable again with `load_config`. Without
        `pin_vocabulary`, a model.vocab_size neither given nor resolved from a tokenizer is left
        out, to be resolved where the config is loaded next (a submitted job's cluster)."""
        data = self.model_dump(mode="json")
        if not pin_vocabulary and "vocab_size" not in self.model.model_fields_set:
            del data["model"]["vocab_size"]
        return yaml.safe_dump(data, sort_keys=False)

    def fingerprint(self, *sections: str) -> str:
        """A short hash of the named sections (all when none), e.g. to refuse a checkpoint
        whose model shape or parallel layout differs from this job's."""
        data = self.model_dump(mode="json")
        chosen = {k: data[k] for k in (sections or data.keys())}
        blob = json.dumps(chosen, sort_keys=True, separators=(",", ":")).encode()
        return hashlib.sha256(blob).hexdigest()[:16]
