"""The dynamic-CP cost model: predicted seconds of one micro-batch on one rank of a CP group.

Affine in the tokens a rank holds and in the sum of squared sequence pieces (the causal
attention core), plus fixed costs per micro-batch, per ring step and per step, plus the ring's
communication where it is not hidden behind the block compute it overlaps with. The planner
(`cp/planner.py`) calls it a great many times, so it works on running sums and vectorises;
the coefficients come from measuring the machine (`cp/calibration.py`).
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, fields
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from longrun.config.sections import ModelSection
    from longrun.trainer.cp.plan import Plan

COST_MODEL_FORMAT = "longrun.dynamic_cp.CostModel/2"


def padded_shares(lengths: np.ndarray, cp: int) -> np.ndarray:
    """`padded_tokens_per_rank` (`longrun.parallel.dims`) over an int64 array."""
    if cp == 1:
        return lengths
    return -(-lengths // (2 * cp)) * 2


def positive_part(x: float) -> float:
    return x if x > 0.0 else 0.0


def positive_part_array(x: np.ndarray) -> np.ndarray:
    return np.maximum(x, 0.0)


@dataclass(frozen=True)
class CostModel:
    """Predicted seconds of forward+backward of one micro-batch on one rank of a CP group.

    Every coefficient covers the whole model (all layers, forward and backward); measuring
    them is the calibration module's job. The model is affine in tokens and in the sum of
    squared sequence lengths (the causal attention core), plus the ring's communication where
    it is not hidden behind the attention compute it overlaps with.
    """

    linear_s_per_token: float  # everything but the attention core, per token a rank holds
    attn_s_per_token2: float  # attention core of a size-1 group, per unit of sum(L^2)
    ring_block_s_per_token2: float  # one ring step of a group of size > 1, per unit of sum(s^2)
    p2p_latency_s: float  # fixed cost of one ring transfer (one layer, one step)
    p2p_s_per_byte: float
    kv_bytes_per_token: float  # K and V of one token in one layer
    n_layers: int
    micro_batch_overhead_s: float
    # Fixed cost of one ring step (whole model, forward and backward) beyond its block compute:
    # the kernel launches / op dispatch of the step, and waiting for the slower peer.
    ring_step_overhead_s: float = 0.0
    # Once per global batch whatever the plan: the gradient synchronisation and loss reduction.
    step_overhead_s: float = 0.0

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
                raise ValueError(f"CostModel.{f.name} must be a finite number, got {value!r}")
            if value < 0:
                raise ValueError(f"CostModel.{f.name} must be >= 0, got {value!r}")
        if not isinstance(self.n_layers, int) or self.n_layers < 1:
            raise ValueError(f"CostModel.n_layers must be a positive integer, got {self.n_layers!r}")

    def time_from_sums(self, cp: int, n: Any, q: Any, relu: Callable[[Any], Any] = positive_part) -> Any:
        """Group time from n = tokens a rank holds and q = sum of squared per-rank sequence
        pieces (sum L^2 when cp == 1). The solver keeps (n, q) per group, so adding a
        sequence costs O(1). Works on scalars, or on arrays with `relu=positive_part_array`."""
        base = self.micro_batch_overhead_s + self.linear_s_per_token * n
        if cp == 1:
            return base + self.attn_s_per_token2 * q
        # One ring step: this rank's local queries against one peer's local keys, whole model.
        block = self.ring_block_s_per_token2 * q + self.ring_step_overhead_s
        # Per layer and step, the compute a transfer can hide behind. Backward does about twice
        # the forward's attention work (dQ, dK, dV), hence the 1/3 : 2/3 split.
        fwd_hide = block / (3.0 * self.n_layers)
        bwd_hide = 2.0 * block / (3.0 * self.n_layers)
        kv_bytes = n * self.kv_bytes_per_token
        fwd_transfer = self.p2p_latency_s + kv_bytes * self.p2p_s_per_byte
        # Backward passes K/V on together with the dK/dV accumulated so far: twice the bytes.
        bwd_transfer = self.p2p_latency_s + 2.0 * kv_bytes * self.p2p_s_per_byte
        # Forward: c compute steps, c-1 transfers (the last step needs none). Backward: c steps,
        # c transfers (dK/dV must travel home after the last step).
        exposed = (cp - 1) * relu(fwd_transfer - fwd_hide) + cp * relu(bwd_transfer - bwd_hide)
        return base + cp * block + self.n_layers * exposed

    def step_time(self, plan: Plan) -> float:
        """Predicted seconds of a whole step (forward and backward) under `plan`."""
        return plan.predicted_s + self.step_overhead_s

    def group_time(self, lengths: Sequence[int] | np.ndarray, cp: int) -> float:
        """Seconds for one rank of a size-`cp` group to train `lengths` in one micro-batch."""
        if len(lengths) == 0:
            return 0.0
        s = padded_shares(np.asarray(lengths, dtype=np.int64), cp)
        return float(self.time_from_sums(cp, int(s.sum()), int((s * s).sum())))

    def sequence_times(self, lengths: np.ndarray, cp: int) -> np.ndarray:
        """Time of each sequence alone in a size-`cp` group, vectorised."""
        s = padded_shares(np.asarray(lengths, dtype=np.int64), cp).astype(np.float64)
        return self.time_from_sums(cp, s, s * s, relu=positive_part_array)

    @classmethod
    def for_model(
        cls,
        model_cfg: ModelSection,
        *,
        linear_s_per_token: float,
        attn_s_per_token2: float,
        ring_block_s_per_token2: float,
        p2p_latency_s: float,
        p2p_s_per_byte: float,
        micro_batch_overhead_s: float,
        ring_step_overhead_s: float = 0.0,
        step_overhead_s: float = 0.0,
        element_size: int = 4,
    ) -> CostModel:
        """Fill the model constants (K/V bytes per token and layer, layer count) from the config."""
        return cls(
            linear_s_per_token=linear_s_per_token,
            attn_s_per_token2=attn_s_per_token2,
            ring_block_s_per_token2=ring_block_s_per_token2,
            p2p_latency_s=p2p_latency_s,
            p2p_s_per_byte=p2p_s_per_byte,
            kv_bytes_per_token=float(2 * model_cfg.kv_heads * model_cfg.head_dim * element_size),
            n_layers=model_cfg.n_layers,
            micro_batch_overhead_s=micro_batch_overhead_s,
            ring_step_overhead_s=ring_step_overhead_s,
            step_overhead_s=step_overhead_s,
        )

    def to_json(self) -> str:
        return json.dumps({"format": COST_MODEL_FORMAT, **asdict(self)}, indent=2, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> CostModel:
        data = json.loads(text)
        if not isinstance(data, dict) or data.get("format") != COST_MODEL_FORMAT:
            raise ValueError(f"not a cost model: expected format {COST_MODEL_FORMAT!r}")
        data = {k: v for k, v in data.items() if k != "format"}
        expected = {f.name for f in fields(cls)}
        if set(data) != expected:
            missing, unknown = sorted(expected - set(data)), sorted(set(data) - expected)
            raise ValueError(f"cost model fields do not match: missing {missing}, unknown {unknown}")
        return cls(**data)

    def save(self, path: str | os.PathLike[str]) -> None:
        # Write then rename, so a reader never sees half a file.
        tmp = f"{os.fspath(path)}.tmp"
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(self.to_json() + "\n")
        os.replace(tmp, path)

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> CostModel:
        with open(path, "rb") as f:
            raw = f.read()
        try:
            return cls.from_json(raw.decode("utf-8"))
        except (ValueError, TypeError) as exc:  # UnicodeDecodeError and JSONDecodeError included
            raise ValueError(
                f"{os.fspath(path)} is not a valid cost model file ({exc}); delete it and calibrate again"
            ) from exc
