"""The job's parallel layout in one object, built once from its config (torch-free).

    dims = parallel_dims(cfg)
    dims.world_size          # dp x fsdp x cp x tp x pp ranks
    dims.span                # dp x fsdp x cp: the ranks that hold replicas or shards of one model
                             # and reduce gradients together (under CP: one global batch)
    dims.replicas            # dp x cp: the ranks holding the same shard of the weights
    dims.shards              # fsdp x tp: the pieces one copy of the weights is cut into
    dims.cp_sizes            # the CP group sizes a run uses: (cp,) static; dynamic: every power
                             # of two dividing the span
    dims.widest_cp           # the largest of them
    dims.ulysses_degree(4)   # how many ranks of a CP group of 4 split the heads (1: pure ring)
    dims.padded_share(L)     # tokens one rank holds of a length-L sequence in the widest group

torchtitan's `ParallelDims` is the model: the config checks, commgroup's rank layout, the CP
setup and the worker all read this object instead of each recomputing world sizes and the
power-of-two rules. Sizes are checked here (each >= 1); what a job may combine (tp inside a
node, a budget that holds the widest share, ...) is checked by `longrun.config`, which
reports every problem with the field to change.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal, get_args

if TYPE_CHECKING:
    from longrun.config import JobConfig

CPImpl = Literal["ring", "ulysses", "usp"]
_SIZES = ("dp", "fsdp", "cp", "tp", "pp")
# How ranks are numbered, outermost axis first (commgroup/topology.py says why this order):
#     rank = (((dp_i * fsdp + fsdp_i) * pp + pp_i) * cp + cp_i) * tp + tp_i
AXES = ("dp", "fsdp", "pp", "cp", "tp")


def is_power_of_two(n: int) -> bool:
    return n >= 1 and n & (n - 1) == 0


def power_of_two_divisors(n: int) -> tuple[int, ...]:
    """1, 2, 4, ... up to the largest power of two dividing n: the group sizes that cut n
    ranks into aligned blocks (what dynamic CP chooses from)."""
    if n < 1:
        raise ValueError(f"a rank count must be >= 1, got {n}")
    return tuple(1 << k for k in range((n & -n).bit_length()))


def padded_tokens_per_rank(length: int, cp: int) -> int:
    """Tokens one rank of a size-`cp` group holds for one sequence: the sequence is padded to a
    multiple of 2*cp and cut into 2*cp zigzag chunks, two per rank."""
    if cp == 1:
        return length
    return -(-length // (2 * cp)) * 2


def usp_ulysses_size(cp: int, n_heads: int) -> int:
    """Default Ulysses degree for USP: the largest power of two u with u*u <= cp dividing
    n_heads, so both dimensions are used (CP 4 -> 2 x 2, CP 8 -> 2 x 4)."""
    u = 1
    while (2 * u) * (2 * u) <= cp and cp % (2 * u) == 0 and n_heads % (2 * u) == 0:
        u *= 2
    return u


@dataclass(frozen=True)
class ParallelDims:
    dp: int = 1  # data-parallel replicas (outermost)
    fsdp: int = 1  # ranks sharding one replica's weights, gradients and optimizer state (FSDP2)
    cp: int = 1  # context parallelism: the static group size, dynamic CP's per-replica share
    tp: int = 1  # tensor parallelism (inside a node)
    pp: int = 1  # pipeline stages
    dynamic_cp: bool = False
    cp_impl: CPImpl = "ring"
    heads: int | None = None  # attention heads a CP group may split (Ulysses); None: no limit

    def __post_init__(self):
        for name in _SIZES:
            if getattr(self, name) < 1:
                raise ValueError(f"parallel size {name} must be >= 1, got {getattr(self, name)}")
        if self.cp_impl not in get_args(CPImpl):
            raise ValueError(f"cp_impl must be one of {get_args(CPImpl)}, got {self.cp_impl!r}")

    @property
    def world_size(self) -> int:
        return self.dp * self.fsdp * self.cp * self.tp * self.pp

    @property
    def span(self) -> int:
        return self.dp * self.fsdp * self.cp

    @property
    def replicas(self) -> int:
        """Ranks holding the same shard of the weights (data-parallel replicas and CP ranks):
        a checkpoint is written once for them and read once for them."""
        return self.dp * self.cp

    @property
    def shards(self) -> int:
        """The pieces one copy of the weights is cut into (FSDP shards x TP shards)."""
        return self.fsdp * self.tp

    @property
    def sharded(self) -> bool:
        """Whether parameters are DTensors (FSDP2 and/or tensor parallel) rather than whole
        tensors on every rank (plain data parallelism)."""
        return self.shards > 1

    @property
    def degrees(self) -> dict[str, int]:
        """{"dp", "fsdp", "cp", "tp", "pp"}: what a checkpoint records of the layout it was
        written at (for information: any layout restores it)."""
        return {name: getattr(self, name) for name in _SIZES}

    @property
    def layout_name(self) -> str:
        """A short, stable name of the layout for logs and metric labels: the degrees above 1
        (e.g. "fsdp2.tp2", "dp2.cp2", "single")."""
        parts = [f"{n}{getattr(self, n)}" for n in ("dp", "fsdp", "cp", "tp", "pp") if getattr(self, n) > 1]
        if self.dynamic_cp:
            parts.append("dcp")
        return ".".join(parts) or "single"

    @property
    def cp_enabled(self) -> bool:
        return self.cp > 1 or self.dynamic_cp

    @property
    def dynamic_cp_sizes(self) -> tuple[int, ...]:
        return power_of_two_divisors(self.span)

    @property
    def cp_sizes(self) -> tuple[int, ...]:
        return self.dynamic_cp_sizes if self.dynamic_cp else (self.cp,)

    @property
    def widest_cp(self) -> int:
        return max(self.cp_sizes)

    @property
    def usp_ulysses(self) -> int:
        """USP's Ulysses degree, chosen for the configured cp (and kept for dynamic groups)."""
        return usp_ulysses_size(self.cp, self.heads) if self.heads else usp_ulysses_size(self.cp, self.cp)

    def ulysses_degree(self, size: int) -> int:
        """How many ranks of a CP group of `size` split the heads: 1 is pure ring, `size` pure
        Ulysses, anything between USP (Ulysses inside groups of that many ranks, ring across).
        A group wider than the head count allows splits what divides and rings the rest."""
        if self.cp_impl == "ring" or size == 1:
            return 1
        u = size if self.cp_impl == "ulysses" else min(self.usp_ulysses, size)
        if self.heads:
            u = math.gcd(u, self.heads)  # each rank of a Ulysses group takes whole heads
        return u

    def attention_impl(self, size: int) -> CPImpl:
        u = self.ulysses_degree(size)
        return "ring" if u == 1 else "ulysses" if u == size else "usp"

    def padded_share(self, length: int) -> int:
        """Tokens one rank holds of a `length`-token sequence split over the widest CP group."""
        return padded_tokens_per_rank(length, self.widest_cp)


def parallel_dims(cfg: JobConfig) -> ParallelDims:
    """The job's dims, from its `parallelism` section and the heads each TP rank holds (what
    Ulysses splits; a head count tp does not divide is reported by the config checks)."""
    par, heads = cfg.parallelism, cfg.model.n_heads
    return ParallelDims(dp=par.dp, fsdp=par.fsdp, cp=par.cp, tp=par.tp, pp=par.pp, dynamic_cp=par.dynamic_cp,
                        cp_impl=par.cp_impl, heads=heads // par.tp if heads % par.tp == 0 else heads)


@dataclass(frozen=True)
class RankCoords:
    dp: int
    pp: int
    cp: int
    tp: int
    fsdp: int = 0


def coords_of(dims: ParallelDims, rank: int) -> RankCoords:
    """Where `rank` sits on each axis (`AXES`' numbering; nodes play no part in it)."""
    position = {}
    for axis in reversed(AXES):
        rank, position[axis] = divmod(rank, getattr(dims, axis))
    return RankCoords(**position)


def leads_its_stage(dims: ParallelDims, rank: int) -> bool:
    """Whether `rank` is the first rank of its pipeline stage (every other coordinate 0): the
    one that writes what all of the stage's ranks hold alike (the whole model without pp)."""
    c = coords_of(dims, rank)
    return c.dp == c.fsdp == c.cp == c.tp == 0
