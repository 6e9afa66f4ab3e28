"""The pipeline schedules a job may name, and what each implies, torch-free (the config checks
and the memory planner read it; `pipeline.py` runs them).

    stage_layers(32, 8)                        # the transformer blocks of each of 8 stages
    stages_of_rank(1, pp=4, virtual=2, schedule="interleaved_1f1b")   # [1, 5]
    bubble_fraction("1f1b", pp=4, micro_batches=8)                    # 0.27: idle share of a step
    micro_batches_to_run("interleaved_1f1b", pp=4, stages=8, n=17)   # 20: 17 is refused at config time

Single-stage schedules give each pipeline rank one stage; the multi-stage ones give it
`parallelism.pp_virtual_stages` of them, looped (rank r holds r, r + pp, ...) or V-shaped
(rank r holds r and 2 pp - 1 - r, so the first and the last stage share a rank).
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import accumulate
from typing import Literal, get_args

PipelineSchedule = Literal["gpipe", "1f1b", "interleaved_1f1b", "looped_bfs", "interleaved_zero_bubble",
                           "zbv_zero_bubble"]
SCHEDULE_NAMES: tuple[str, ...] = get_args(PipelineSchedule)
MULTI_STAGE = frozenset({"interleaved_1f1b", "looped_bfs", "interleaved_zero_bubble", "zbv_zero_bubble"})
V_SHAPED = frozenset({"zbv_zero_bubble"})
# Zero-bubble schedules split each backward into its input and its weight gradients and run
# them apart; activation checkpointing's recompute cannot be split so (torch refuses it).
ZERO_BUBBLE = frozenset({"interleaved_zero_bubble", "zbv_zero_bubble"})


def stages_per_rank(schedule: str, virtual_stages: int) -> int:
    return 2 if schedule in V_SHAPED else virtual_stages if schedule in MULTI_STAGE else 1


def total_stages(schedule: str, pp: int, virtual_stages: int) -> int:
    return pp * stages_per_rank(schedule, virtual_stages)


def micro_batches_to_run(schedule: str, pp: int, stages: int, n: int) -> int:
    """The fewest micro-batches, at least `n`, that `schedule` runs on `pp` ranks holding
    `stages` stages in all: one per stage at least, and for the multi-stage schedules a
    multiple of pp (torch's interleaved rounds). A step runs exactly its job's count
    (`config.memory.pipeline_micro_batches`), which the config check holds to this."""
    n = max(n, stages)
    return -(-n // pp) * pp if schedule in MULTI_STAGE else n


def stage_layers(n_layers: int, stages: int, layers: Sequence[int] | None = None) -> list[range]:
    """The transformer blocks of each stage: `layers` (blocks per stage, summing to n_layers),
    or an even split with the remainder to the first stages. Every stage gets at least one."""
    if stages < 1:
        raise ValueError(f"a pipeline needs at least one stage, got {stages}")
    if layers is None:
        base, extra = divmod(n_layers, stages)
        layers = [base + (i < extra) for i in range(stages)]
    if len(layers) != stages or sum(layers) != n_layers or min(layers) < 1:
        raise ValueError(f"blocks per stage {list(layers)} must be {stages} counts of at least 1 "
                         f"summing to model.n_layers ({n_layers})")
    bounds = [0, *accumulate(layers)]
    return [range(bounds[i], bounds[i + 1]) for i in range(stages)]


def stages_of_rank(pp_rank: int, pp: int, virtual_stages: int, schedule: str) -> list[int]:
    """The stage indices pipeline rank `pp_rank` holds, in order."""
    if schedule in V_SHAPED:
        return [pp_rank, 2 * pp - 1 - pp_rank]
    return [pp_rank + i * pp for i in range(stages_per_rank(schedule, virtual_stages))]


def bubble_fraction(schedule: str, pp: int, micro_batches: int, virtual_stages: int = 1) -> float:
    """The idle share of a step the schedule implies with equal stages: a bubble of (p - 1) / m
    of the useful time for GPipe and 1F1B (Narayanan et al., 2021), divided by v when
    interleaved; returned as a share of the whole step, bubble / (1 + bubble). Zero-bubble
    schedules fill most of theirs; the interleaved figure is given as their upper bound."""
    if pp <= 1:
        return 0.0
    bubble = (pp - 1) / micro_batches
    if schedule in MULTI_STAGE and schedule != "looped_bfs":
        bubble /= stages_per_rank(schedule, virtual_stages)
    return bubble / (1 + bubble)


def micro_batches_in_flight(schedule: str, pp: int, micro_batches: int, pp_rank: int,
                            virtual_stages: int = 1) -> float:
    """How many micro-batches' activations of all its layers pipeline rank `pp_rank` keeps at
    its peak (what backward still needs): all of them for GPipe and looped BFS (every forward
    runs before any backward); for 1F1B the stages after it, itself included (p - r), as its
    warm-up; interleaved schedules warm up (p - r - 1) x 2 + (v - 1) x p + 1 chunks of 1/v of
    the rank's layers each (torch's interleaved warm-up, the figure Megatron gives too). The
    zero-bubble schedules are counted as their interleaved or V-shaped warm-up."""
    if pp <= 1:
        return 1.0
    if schedule in ("gpipe", "looped_bfs"):
        return float(micro_batches)
    v = stages_per_rank(schedule, virtual_stages)
    if v == 1:
        return float(min(micro_batches, pp - pp_rank))
    chunks = (pp - pp_rank - 1) * 2 + (v - 1) * pp + 1
    return min(float(micro_batches), chunks / v)
