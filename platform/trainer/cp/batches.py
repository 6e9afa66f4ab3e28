"""Planned micro-batches for context parallelism: global batches in, this rank's work out.

With context parallelism the unit of data is a *global* batch shared by all dp x cp ranks (the
"span"), as it is without (`step.py`): every rank draws the same documents' lengths
(`packing.global_batches`), the planner partitions the ranks into CP groups per micro-batch and
assigns documents to groups (`cp/planner.py`), and each rank reads and keeps what its group
trains, cut to its own shard when the group has more than one rank. Because every rank
computes the same plan from the same lengths, no rank has to tell another what to do.
Planning runs in the prefetch thread, so the plan of the next global batch is made while the
current one trains.

Static CP is the same machinery with every group of the configured size (`plan_static`), so
static and dynamic runs differ only in the plan.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
import torch.distributed as dist

from longrun.data.corpus import Corpus
from longrun.data.packing import GlobalBatch, MicroBatch, build_micro_batch
from longrun.parallel.dims import ParallelDims
from longrun.trainer.cp.attention import ContextParallelAttention, CPGroups
from longrun.trainer.cp.flash import KernelChoice
from longrun.trainer.cp.layout import LocalShard, ShardLayout
from longrun.trainer.cp.planner import CostModel, Plan, PlannedGroup, plan_dynamic, plan_static

if TYPE_CHECKING:
    from longrun.commgroup.groups import ParallelGroups


@dataclass
class ContextParallelSetup:
    """Everything a trainer needs to run context parallelism on this rank."""

    dims: ParallelDims  # the job's layout: span, static cp or dynamic sizes, attention impl
    span_group: dist.ProcessGroup | None  # the span's ranks: gradients are summed over it
    span_rank: int
    groups: dict[int, CPGroups]  # CP size -> this rank's groups of that size
    cost: CostModel
    # Under tensor parallelism, this rank's TP group: its members train the same micro-batches
    # in lock-step, so they must plan with one cost model (see calibration.load_or_calibrate).
    tp_group: dist.ProcessGroup | None = None
    kernel: KernelChoice = "auto"  # the block kernel (`cp/flash.py`): flash where it applies

    @property
    def span_size(self) -> int:
        return self.dims.span

    @property
    def max_cp(self) -> int:
        return self.dims.widest_cp

    def plan(self, lengths: np.ndarray, token_budget: int) -> Plan:
        if self.dims.dynamic_cp:
            return plan_dynamic(lengths, self.span_size, token_budget, self.cost, max_cp=self.max_cp)
        return plan_static(lengths, self.span_size, token_budget, self.cost, self.dims.cp)


def cp_groups_for(groups: ParallelGroups, size: int, dims: ParallelDims | None = None) -> CPGroups:
    """This rank's groups for attention over a CP group of `size` ranks, as the dims (by
    default the layout's) ask: the whole CP group for ring or Ulysses, USP's sub-groups."""
    if size == 1:
        return CPGroups.alone()
    dims = dims or groups.layout.dims
    whole = groups.cp_group(size)
    rank, u = dist.get_rank(whole), dims.ulysses_degree(size)
    impl = dims.attention_impl(size)
    if impl == "ring":
        return CPGroups(impl, size, rank, 1, None, whole)
    if impl == "ulysses":
        return CPGroups(impl, size, rank, u, whole, None)
    ulysses, ring = groups.attention_groups(size)
    if ulysses is None or ring is None:
        raise ValueError(f"USP over {size} ranks needs Ulysses and ring sub-groups that this layout "
                         f"({groups.layout.dims}) did not form; form the groups for these dims")
    return CPGroups(impl, size, rank, u, ulysses, ring)


def setup_from_parallel_groups(groups: ParallelGroups, *, cost: CostModel,
                               dims: ParallelDims | None = None) -> ContextParallelSetup:
    """The setup over the groups commgroup brought up for this attempt (the CP package creates
    none): the span group (dp_cp), and per CP size the run uses its CP group, with USP's
    Ulysses and ring sub-groups, for the attention `parallelism.cp_impl` asks for. `dims`:
    plan with other dims over the same groups (e.g. static and dynamic CP side by side on
    one world); by default the layout's."""
    dims = dims or groups.layout.dims
    if dims.span != groups.layout.dims.span:
        raise ValueError(f"dims with a span of {dims.span} ranks over groups whose span is "
                         f"{groups.layout.dims.span}")
    span = groups.dp_cp
    return ContextParallelSetup(dims, span if dims.span > 1 else None, dist.get_rank(span),
                                {size: cp_groups_for(groups, size, dims) for size in dims.cp_sizes}, cost,
                                tp_group=groups.tp if groups.layout.dims.tp > 1 else None)


def one_rank_setup(cost: CostModel, dims: ParallelDims | None = None) -> ContextParallelSetup:
    """The setup of a world of one rank (dynamic CP by default): every document trains
    without CP, through the same planned path; no process group."""
    dims = dims or ParallelDims(dynamic_cp=True)
    if dims.span != 1:
        raise ValueError(f"a one-rank setup needs a span of 1 rank, got {dims.span}; form the "
                         "groups with commgroup and use setup_from_parallel_groups")
    return ContextParallelSetup(dims, None, 0, {1: CPGroups.alone()}, cost)


@dataclass
class RankMicroBatch:
    """This rank's part of one planned micro-batch."""

    group: PlannedGroup  # its CP group in this micro-batch (cp, first rank, documents)
    batch: MicroBatch | None  # the group's documents packed; None when the group is idle
    shard: LocalShard | None  # this rank's slice of `batch` when the group has cp > 1

    @property
    def idle(self) -> bool:
        return self.batch is None


@dataclass
class PlannedStep:
    micro_batches: list[RankMicroBatch]  # the same count on every rank (lock-step)
    loss_tokens: int  # loss tokens of the whole global batch, known to every rank
    tokens: int  # tokens of the whole global batch
    plan: Plan
    sampler_state: dict[str, Any] | None  # where the data goes on after this global batch


def split_documents(batch: MicroBatch) -> list[np.ndarray]:
    bounds = batch.cu_seqlens.numpy()
    tokens = batch.tokens.numpy()
    return [tokens[a:b] for a, b in itertools.pairwise(bounds)]


def plan_step(docs: list[np.ndarray], setup: ContextParallelSetup, token_budget: int,
              sampler_state: dict[str, Any] | None = None) -> PlannedStep:
    """Plan one global batch of documents (in memory) and keep this rank's micro-batches."""
    lengths = np.array([len(d) for d in docs], dtype=np.int64)
    return _plan(lengths, docs.__getitem__, setup, token_budget, sampler_state)


def plan_global_batch(batch: GlobalBatch, corpus: Corpus, setup: ContextParallelSetup,
                      token_budget: int) -> PlannedStep:
    """Plan one global batch from its lengths; read only the documents this rank's groups train."""
    return _plan(batch.lengths, lambda i: corpus[int(batch.indices[i])], setup, token_budget,
                 batch.sampler_state, batch.indices)


def _plan(lengths: np.ndarray, read: Callable[[int], np.ndarray], setup: ContextParallelSetup,
          token_budget: int, sampler_state: dict[str, Any] | None,
          doc_ids: np.ndarray | None = None) -> PlannedStep:
    plan = setup.plan(lengths, token_budget)
    mine = []
    for group in plan.for_rank(setup.span_rank):
        if not group.sequences:
            mine.append(RankMicroBatch(group, None, None))
            continue
        ids = None if doc_ids is None else doc_ids[list(group.sequences)]
        batch = build_micro_batch([read(i) for i in group.sequences], doc_ids=ids)
        shard = None
        if group.cp > 1:
            shard = ShardLayout.of(batch, group.cp).shard(batch, setup.span_rank - group.first_rank)
        mine.append(RankMicroBatch(group, batch, shard))
    return PlannedStep(mine, loss_tokens=int(lengths.sum() - len(lengths)), tokens=int(lengths.sum()),
                       plan=plan, sampler_state=sampler_state)


def planned_steps(global_batches: Iterator[GlobalBatch], corpus: Corpus, setup: ContextParallelSetup,
                  token_budget: int) -> Iterator[PlannedStep]:
    """Global batches (`packing.global_batches`) -> this rank's planned steps."""
    for batch in global_batches:
        yield plan_global_batch(batch, corpus, setup, token_budget)


def cp_attention_for(rmb: RankMicroBatch, setup: ContextParallelSetup, device: torch.device):
    """The attention object the model uses for this micro-batch (None: plain packed)."""
    if rmb.shard is None:
        return None
    return ContextParallelAttention(rmb.shard.layout, setup.groups[rmb.group.cp], device,
                                    setup.kernel)
