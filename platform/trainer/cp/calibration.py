"""Calibrating the dynamic-CP cost model by measuring this machine, once, then reusing it.

The planner is only as good as its predictions, and the coefficients depend on the model, the
kernels, the framework's overheads and the links, so they are measured where the job runs,
through the trainer's own micro-batch path (DDP wrapper, loss, context-parallel attention):

- **without CP**: typical packed micro-batches plus the extremes (only short documents, one
  long document), fitted by non-negative least squares to overhead + per-token x tokens +
  per-token^2 x sum(L^2);
- **the ring** (the largest CP group): typical mixes and one long sequence, the linear part
  subtracted, fitted per ring step to overhead + per-s^2 x sum(s^2). The fixed part is what a
  ring step costs whatever its size (dispatching its ops, waiting for the slower peer) and
  dominates for short sequences: it is what dynamic CP saves by not splitting them;
- **once per step**: the gradient synchronisation (a synchronised pass minus an unsynchronised one);
- **ring transfers**: a ping-pong between the span's first two ranks, small (latency) and
  large (bandwidth) messages.

Every rank measures at once (contention on a shared host is part of the cost) and all take the
mean, so every rank holds the same model: plans must be identical everywhere.
`load_or_calibrate` keeps the result in a JSON file keyed by model shape, device, world and
budget, so restarts reuse it.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import os
import time
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch
import torch.distributed as dist

from longrun.data.packing import MicroBatch, build_micro_batch
from longrun.parallel.dims import padded_tokens_per_rank
from longrun.trainer.cp.batches import RankMicroBatch
from longrun.trainer.cp.cost import CostModel
from longrun.trainer.cp.layout import ShardLayout
from longrun.trainer.cp.plan import PlannedGroup

if TYPE_CHECKING:
    from longrun.trainer.trainer import Trainer

log = logging.getLogger(__name__)


def _fit_nonnegative(rows: list[list[float]], times: list[float]) -> list[float]:
    """Least squares with every coefficient >= 0: columns whose estimate goes negative are
    fixed at 0 and the rest refitted (a tiny system; this simple active set does)."""
    x, y = np.array(rows, dtype=np.float64), np.array(times, dtype=np.float64)
    active = list(range(x.shape[1]))
    coef = np.zeros(x.shape[1])
    while active:
        sol = np.linalg.lstsq(x[:, active], y, rcond=None)[0]
        if (sol >= 0).all():
            coef[active] = sol
            break
        active = [a for a, c in zip(active, sol, strict=True) if c >= 0]
    return coef.tolist()


def sample_micro_batch(lengths: np.ndarray, budget: int, rng: np.random.Generator) -> list[int]:
    """Lengths drawn from `lengths` (clipped to the budget) until the budget is full: what a
    packed micro-batch of this data looks like."""
    out: list[int] = []
    while True:
        n = int(min(rng.choice(lengths), budget))
        if sum(out) + n > budget:
            return out or [n]
        out.append(n)


def _p2p_one_way(group: dist.ProcessGroup, nbytes: int, device: torch.device, repeats: int) -> float:
    """One-way time of an `nbytes` message between the group's ranks 0 and 1 (half a round
    trip); other ranks return 0. All ranks of the group must call it."""
    me = dist.get_rank(group)
    buf = torch.zeros(max(nbytes // 4, 1), dtype=torch.float32, device=device)
    if me > 1:
        return 0.0
    peer = dist.get_global_rank(group, 1 - me)

    def trip():
        if me == 0:
            dist.send(buf, peer, group=group)
            dist.recv(buf, peer, group=group)
        else:
            dist.recv(buf, peer, group=group)
            dist.send(buf, peer, group=group)
        if device.type == "cuda":  # NCCL returns once the transfer is queued
            torch.cuda.synchronize(device)

    trip()  # warm-up
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        trip()
        best = min(best, time.perf_counter() - start)
    return best / 2  # the fastest round trip: the link itself, not scheduling noise


def _link(trainer: Trainer, budget: int, element_size: int, repeats: int) -> tuple[float, float]:
    """(latency s, s per byte) of one ring transfer, timed between span ranks 0 and 1 and
    known to every rank of the span afterwards."""
    setup = trainer.cp
    if setup is None or setup.span_group is None:
        return 0.0, 0.0
    nbytes = budget * 2 * trainer.cfg.model.kv_heads * trainer.cfg.model.head_dim * element_size
    small = _p2p_one_way(setup.span_group, 1024, trainer.device, repeats)
    big = _p2p_one_way(setup.span_group, nbytes, trainer.device, repeats)
    link = torch.tensor([small, max(big - small, 0.0) / nbytes] if setup.span_rank == 0 else [0.0, 0.0],
                        dtype=torch.float64, device=trainer.device)
    dist.all_reduce(link, group=setup.span_group)  # rank 0's numbers, everywhere
    return float(link[0]), float(link[1])


def _pass_time(trainer: Trainer, rmb: RankMicroBatch, repeats: int, *, last: bool = False) -> float:
    """Median seconds of one micro-batch's forward and backward through the trainer's own
    path (DDP wrapper, loss, CP attention); gradients not synchronised unless `last`."""

    def run():
        trainer.micro_batch_pass(rmb, last=last, loss_tokens=1)
        if trainer.device.type == "cuda":
            torch.cuda.synchronize(trainer.device)

    run()  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    trainer.optimizer.zero_grad(set_to_none=True)
    return float(np.median(times))


@dataclasses.dataclass
class _Sampler:
    """The shapes calibration measures: drawn from the same seed on every rank, with this
    rank's place in the span, for a budget of tokens per rank."""

    trainer: Trainer
    lengths: np.ndarray
    budget: int
    rng: np.random.Generator

    def batch(self, lengths: list[int]) -> MicroBatch:
        vocab = self.trainer.cfg.model.vocab_size
        return build_micro_batch([self.rng.integers(0, vocab, size=n) for n in lengths])

    def alone(self, lengths: list[int]) -> RankMicroBatch:
        me = self.trainer.cp.span_rank
        return RankMicroBatch(PlannedGroup(1, me, tuple(range(len(lengths))), 0.0), self.batch(lengths), None)

    def in_group(self, lengths: list[int], cp: int) -> RankMicroBatch:
        me = self.trainer.cp.span_rank
        batch, first = self.batch(lengths), me - me % cp
        shard = ShardLayout.of(batch, cp).shard(batch, me - first)
        return RankMicroBatch(PlannedGroup(cp, first, tuple(range(len(lengths))), 0.0), batch, shard)


def _fit_without_cp(sampler: _Sampler, shapes: int, repeats: int) -> tuple[float, float, float, float]:
    """(overhead, per token, per token^2, gradient sync) of micro-batches without CP: typical
    packed ones plus the extremes (short documents only, one long document), fitted to
    overhead + per-token x tokens + per-token^2 x sum(L^2); the sync is a synchronised pass
    minus an unsynchronised one."""
    trainer, budget = sampler.trainer, sampler.budget
    cp1 = [sample_micro_batch(sampler.lengths, budget, sampler.rng) for _ in range(shapes)]
    cp1 += [[8] * max(budget // 64, 1), [8] * max(budget // 8, 2), [budget]]
    times = [_pass_time(trainer, sampler.alone(lens), repeats) for lens in cp1]
    overhead, per_token, attn = _fit_nonnegative(
        [[1.0, sum(lens), float(sum(n * n for n in lens))] for lens in cp1], times)
    sync = max(_pass_time(trainer, sampler.alone(cp1[0]), repeats, last=True) - times[0], 0.0)
    return overhead, per_token, attn, sync


def _fit_ring(sampler: _Sampler, cost: CostModel, cp: int, shapes: int, repeats: int) -> CostModel:
    """The ring, on the largest CP group: what is left after the linear part and the modelled
    exposed communication, fitted per ring step to overhead + per-s^2 x sum(s^2) (s: a
    sequence's tokens on one rank). The exposure depends on the fit (a bigger block hides
    more), so fit, subtract, and fit once more."""
    budget, longest = sampler.budget, sampler.trainer.cfg.model.max_seq_len
    shapes_ring = [sample_micro_batch(sampler.lengths, budget * cp, sampler.rng) for _ in range(shapes // 2)]
    shapes_ring.append([min(budget * cp - 2 * cp, longest)])
    rows, rest = [], []
    for lens in shapes_ring:
        rmb = sampler.in_group(lens, cp)
        s = np.array([padded_tokens_per_rank(n, cp) for n in lens], dtype=np.float64)
        rows.append([float(cp), cp * float((s * s).sum())])
        linear = cost.micro_batch_overhead_s + cost.linear_s_per_token * s.sum()
        rest.append(_pass_time(sampler.trainer, rmb, repeats) - linear)
    for _ in range(2):
        step_overhead, ring_block = _fit_nonnegative(
            rows, [r - _exposed(cost, lens, cp) for r, lens in zip(rest, shapes_ring, strict=True)])
        cost = dataclasses.replace(cost, ring_block_s_per_token2=ring_block,
                                   ring_step_overhead_s=step_overhead)
    return cost


def _mean_over_span(trainer: Trainer, cost: CostModel) -> CostModel:
    """Every rank measured at the same time, as they will train (contention on a shared host
    is part of the cost): all take the mean of the compute terms, so all plan alike."""
    setup = trainer.cp
    if setup.span_group is None:
        return cost
    names = ("linear_s_per_token", "attn_s_per_token2", "ring_block_s_per_token2",
             "micro_batch_overhead_s", "ring_step_overhead_s", "step_overhead_s")
    mean = torch.tensor([getattr(cost, n) for n in names], dtype=torch.float64, device=trainer.device)
    dist.all_reduce(mean, group=setup.span_group)
    mean /= setup.span_size
    return dataclasses.replace(cost, **dict(zip(names, mean.tolist(), strict=True)))


def calibrate(trainer: Trainer, sample_lengths: np.ndarray | None = None, *,
              shapes: int = 6, repeats: int = 3) -> CostModel:
    """Measure the cost model on this machine through `trainer` (which has a
    context-parallel setup; every rank of its span must call this at once). `sample_lengths`:
    sequence lengths typical of the data (default: lognormal around half the budget)."""
    setup = trainer.cp
    if setup is None:
        raise ValueError("calibration needs a trainer with a context-parallel setup")
    model = trainer.cfg.model
    budget = min(trainer.cfg.data.micro_batch_tokens, model.max_seq_len)
    rng = np.random.default_rng(0)  # the same shapes on every rank
    if sample_lengths is None:
        sample_lengths = np.clip(rng.lognormal(np.log(budget / 2), 1.0, 4096), 8, budget).astype(int)
    sampler = _Sampler(trainer, sample_lengths, budget, rng)
    overhead, per_token, attn, sync = _fit_without_cp(sampler, shapes, repeats)
    element_size = 2 if trainer.cfg.training.dtype == "bfloat16" else 4  # K/V on the wire
    latency, per_byte = _link(trainer, budget, element_size, repeats)
    cost = CostModel.for_model(
        model, linear_s_per_token=per_token, attn_s_per_token2=attn, ring_block_s_per_token2=0.0,
        micro_batch_overhead_s=overhead, step_overhead_s=sync, p2p_latency_s=latency,
        p2p_s_per_byte=per_byte, element_size=element_size)
    if setup.max_cp > 1:
        cost = _fit_ring(sampler, cost, setup.max_cp, shapes, repeats)
    return _mean_over_span(trainer, cost)


def _exposed(cost: CostModel, lengths: list[int], cp: int) -> float:
    """The communication the cost model says a ring micro-batch leaves unhidden."""
    silent = dataclasses.replace(cost, p2p_latency_s=0.0, p2p_s_per_byte=0.0)
    return cost.group_time(lengths, cp) - silent.group_time(lengths, cp)


def calibration_path(directory: str | os.PathLike[str], trainer: Trainer) -> Path:
    """Where the calibration for this trainer's shape is kept: model, precision, CP
    implementation, span, budget, device (and its name) and torch version all change it."""
    setup = trainer.cp
    assert setup is not None
    device = trainer.device
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else device.type
    key = "|".join([trainer.cfg.model.model_dump_json(), trainer.cfg.training.dtype,
                    trainer.cfg.parallelism.cp_impl, str(setup.span_size), str(setup.max_cp),
                    str(trainer.cfg.data.micro_batch_tokens), name, torch.__version__])
    digest = hashlib.sha256(key.encode()).hexdigest()[:12]
    return Path(directory) / f"cp_cost_model-{digest}.json"


def load_or_calibrate(directory: str | os.PathLike[str], trainer: Trainer,
                      sample_lengths: np.ndarray | None = None) -> CostModel:
    """The saved calibration for this trainer's model, device, span and budget if there is
    one, else measure (collectively: every rank of the span calls this) and save it. Span
    rank 0 alone reads and writes the file and sends what it read to the others, so the
    directory need not be shared between nodes. Installs the result as the trainer's
    planning cost model."""
    setup = trainer.cp
    if setup is None:
        raise ValueError("calibration needs a trainer with a context-parallel setup")
    path = calibration_path(directory, trainer)
    saved = [path.read_text() if setup.span_rank == 0 and path.exists() else None]
    if setup.span_group is not None:
        dist.broadcast_object_list(saved, group_src=0, group=setup.span_group)
    if saved[0] is not None:
        try:
            cost = CostModel.from_json(saved[0])
        except ValueError as exc:  # every rank parses the same text, so all stop here alike
            raise ValueError(f"{path} is not a valid cost model file ({exc}); delete it to "
                             "calibrate again") from exc
    else:
        log.info("calibrating the dynamic-CP cost model (a few seconds) -> %s", path)
        cost = calibrate(trainer, sample_lengths)
    if setup.tp_group is not None:
        # Each TP lane's span measured for itself; TP peers train the same micro-batches in
        # lock-step, so all take the first lane's model (and only that lane writes the file).
        text = [cost.to_json()]
        dist.broadcast_object_list(text, group_src=0, group=setup.tp_group)
        cost = CostModel.from_json(text[0])
    first_lane = setup.tp_group is None or dist.get_rank(setup.tp_group) == 0
    if saved[0] is None and setup.span_rank == 0 and first_lane:
        path.parent.mkdir(parents=True, exist_ok=True)
        cost.save(path)
    trainer.close()  # batches already planned ahead used the old model: plan them again
    setup.cost = cost
    return cost
