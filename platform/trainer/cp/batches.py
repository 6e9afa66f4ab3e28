"""Planned micro-batches for context parallelism: global batches in, this rank's work out.

With context parallelism the unit of data is a *global* batch shared by all dp x cp ranks (the
"span"): every rank draws the same documents (cheap: token ids), the planner partitions the
ranks into CP groups per micro-batch and assigns documents to groups (`cp/planner.py`), and
each rank keeps what its group trains, cut to its own shard when the group has more than one
rank. Because every rank computes the same plan from the same lengths, no rank has to tell
another what to do. Planning runs in the prefetch thread, so the plan of the next global batch
is made while the current one trains.

Static CP is the same machinery with every group of the configured size (`plan_static`), so
static and dynamic runs differ only in the plan.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
import torch.distributed as dist

from longrun.config import JobConfig
from longrun.trainer.cp.attention import CPGroups, CPImpl, build_cp_groups, usp_ulysses_size
from longrun.trainer.cp.layout import LocalShard, ShardLayout
from longrun.trainer.cp.planner import CostModel, Group, Plan, plan_dynamic, plan_static
from longrun.trainer.packing import MicroBatch, build_micro_batch

if TYPE_CHECKING:
    from longrun.commgroup.init import ParallelGroups


@dataclass
class ContextParallelSetup:
    """Everything a trainer needs to run context parallelism on this rank."""

    span_group: dist.ProcessGroup | None  # the dp x cp ranks: gradients are summed over it
    span_rank: int
    span_size: int
    groups: dict[int, CPGroups]  # CP size -> this rank's groups of that size
    cost: CostModel
    dynamic: bool
    static_cp: int  # the group size when not dynamic

    @property
    def max_cp(self) -> int:
        return max(self.groups)

    def plan(self, lengths: np.ndarray, token_budget: int) -> Plan:
        if self.dynamic:
            return plan_dynamic(lengths, self.span_size, token_budget, self.cost, max_cp=self.max_cp)
        return plan_static(lengths, self.span_size, token_budget, self.cost, self.static_cp)


def aligned_blocks(span: list[int], size: int) -> list[list[int]]:
    """The span's ranks cut into consecutive blocks of `size`: the CP groups of that size (a
    block never straddles a data-parallel replica when size <= cp, as topology.py lays out)."""
    return [span[i:i + size] for i in range(0, len(span) - size + 1, size)]


def _ulysses_degree(impl: CPImpl, size: int, ulysses_size: int, n_heads: int | None) -> int:
    """How many ranks of a CP group of `size` split the heads (1: pure ring)."""
    if impl == "ring":
        return 1
    u = size if impl == "ulysses" else min(ulysses_size, size)
    if n_heads is not None:  # a group wider than the head count divides: Ulysses inside, ring across
        u = math.gcd(u, n_heads & -n_heads)  # the largest power of two dividing both
    return u


def build_setup(span: list[int], rank: int, *, cost: CostModel, dynamic: bool, static_cp: int,
                impl: CPImpl = "ring", ulysses_size: int = 1, n_heads: int | None = None,
                new_group: Callable[..., Any] = dist.new_group) -> ContextParallelSetup:
    """Create the CP groups a run may use: a dynamic run every power of two dividing the
    span (the sizes commgroup creates too, so every rank sees the same largest size and plans
    alike), a static run the one size. For a world that is one span (every rank of the default
    group calls this collectively with the same `span`, increasing); with tensor or pipeline
    parallelism use `setup_from_parallel_groups` over commgroup's groups."""
    if span != sorted(span) or rank not in span:
        raise ValueError(f"the span must list ranks in increasing order and hold rank {rank}: {span}")
    if dist.is_initialized() and len(span) != dist.get_world_size():
        raise ValueError(f"build_setup needs the span to be the whole world ({dist.get_world_size()} "
                         f"ranks), got {len(span)}; use setup_from_parallel_groups")
    n = len(span)
    sizes = [1 << i for i in range(n.bit_length()) if n % (1 << i) == 0] if dynamic else [static_cp]
    groups: dict[int, CPGroups] = {}
    for size in sizes:
        if size == 1:
            groups[1] = CPGroups("ring", 1, 0, 1, None, None)
            continue
        u = _ulysses_degree(impl, size, ulysses_size, n_heads)
        kind: CPImpl = "ring" if u == 1 else "ulysses" if u == size else "usp"
        mine = build_cp_groups(aligned_blocks(span, size), rank, kind, ulysses_size=u,
                               new_group=new_group)
        if mine is not None:
            groups[size] = mine
    span_group = new_group(span) if n > 1 else None
    return ContextParallelSetup(span_group, span.index(rank), n, groups, cost, dynamic, static_cp)


def setup_from_config(cfg: JobConfig, span: list[int], rank: int, *, cost: CostModel,
                      new_group: Callable[..., Any] = dist.new_group) -> ContextParallelSetup:
    """`build_setup` as the job's `parallelism` section asks: static CP of size `cp` or dynamic
    CP up to dp x cp, attention by `cp_impl` (USP splits each group as `usp_ulysses_size`)."""
    par = cfg.parallelism
    return build_setup(span, rank, cost=cost, dynamic=par.dynamic_cp, static_cp=par.cp,
                       impl=par.cp_impl, ulysses_size=usp_ulysses_size(par.cp, cfg.model.n_heads),
                       n_heads=cfg.model.n_heads, new_group=new_group)


def setup_from_parallel_groups(groups: ParallelGroups, *, cost: CostModel, dynamic: bool,
                               static_cp: int, impl: CPImpl = "ring") -> ContextParallelSetup:
    """The setup over the groups commgroup already brought up (no new communicators): the
    dp x cp group as the span, its power-of-two sub-groups (dynamic) or the cp group (static)
    for ring attention."""
    if impl != "ring":
        raise ValueError(f"cp_impl {impl!r} needs Ulysses sub-groups that commgroup does not "
                         "create yet; use cp_impl 'ring' with commgroup's groups, or build_setup")
    span_group = groups.dp_cp
    cp_groups = {1: CPGroups("ring", 1, 0, 1, None, None)}
    chosen = groups.dynamic_cp if dynamic else {static_cp: groups.cp}
    for size, pg in chosen.items():
        if size > 1:
            cp_groups[size] = CPGroups("ring", size, dist.get_rank(pg), 1, None, pg)
    if not dynamic:
        cp_groups = {static_cp: cp_groups[static_cp]} if static_cp > 1 else cp_groups
    size = dist.get_world_size(span_group)
    return ContextParallelSetup(span_group if size > 1 else None, dist.get_rank(span_group), size,
                                cp_groups, cost, dynamic, static_cp)


@dataclass
class RankMicroBatch:
    """This rank's part of one planned micro-batch."""

    group: Group  # its CP group in this micro-batch (cp, first rank, documents)
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
    """Plan one global batch of documents and keep this rank's micro-batches."""
    lengths = np.array([len(d) for d in docs], dtype=np.int64)
    plan = setup.plan(lengths, token_budget)
    mine = []
    for group in plan.for_rank(setup.span_rank):
        if not group.sequences:
            mine.append(RankMicroBatch(group, None, None))
            continue
        batch = build_micro_batch([docs[i] for i in group.sequences])
        shard = None
        if group.cp > 1:
            shard = ShardLayout.of(batch, group.cp).shard(batch, setup.span_rank - group.first_rank)
        mine.append(RankMicroBatch(group, batch, shard))
    return PlannedStep(mine, loss_tokens=int(lengths.sum() - len(docs)), tokens=int(lengths.sum()),
                       plan=plan, sampler_state=sampler_state)


def planned_steps(global_batches: Iterator[MicroBatch], setup: ContextParallelSetup,
                  token_budget: int) -> Iterator[PlannedStep]:
    """Global batches (as packed streams, from `packed_micro_batches` with the global token
    count as its budget) -> this rank's planned steps."""
    for batch in global_batches:
        yield plan_step(split_documents(batch), setup, token_budget, batch.sampler_state)


def cp_attention_for(rmb: RankMicroBatch, setup: ContextParallelSetup, device: torch.device):
    """The attention object the model uses for this micro-batch (None: plain packed)."""
    from longrun.trainer.cp.attention import ContextParallelAttention

    if rmb.shard is None:
        return None
    return ContextParallelAttention(rmb.shard.layout, setup.groups[rmb.group.cp], device)
