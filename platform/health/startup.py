"""How long each part of an attempt's start may take: one deadline per start-up phase.

    deadlines = startup_deadlines(cfg, storage_bytes_per_s=None)   # torch-free
    deadlines[StartupPhase.RESTORE].seconds, deadlines[StartupPhase.RESTORE].why
    deadlines.summary()     # "placement 123 s, setup 300 s, rendezvous 121 s, ..."

A start is not a step: a 70B rank reads gigabytes before its first step, and one clock for all
of it (the hang timeout) called every such start a hang. So each phase has its own deadline
(`kinds.StartupPhase`, in order: placement, setup, rendezvous, build, restore, init,
calibration, first step), `health.startup.<phase>_s` or, by default ('auto'), a sum of a
fixed part and SAFETY times an estimate of the phase's work at a conservative rate:

- the work: this rank's state from the memory planner (`config/memory.py`, the fullest
  pipeline rank's under pipeline parallelism): parameters plus optimizer state, what a restore
  reads and a build allocates; the parameters alone for the initial weights; and for the
  first step its training FLOPs per rank (6 per parameter and token of the global batch);
- the rates: the storage rate per rank measured by this job's last restore from storage (the
  controller keeps it, goodput/tracker.py), else `health.startup.storage_mb_per_s` (100 MB/s);
  1 GB/s for a build; 100 MB/s for seeded initial weights (measured at about 350 MB/s per
  core); 10% of `cluster.peak_tflops` for compute, or 40 TFLOP/s on a GPU and 0.02 TFLOP/s on
  a CPU when it is unset;
- a floor: no 'auto' deadline is shorter than `health.startup.floor_s` (120 s) or
  `health.hang_timeout_s`, what every start-up phase got before, so small jobs lose nothing.

Placement is the controller's (the reservation and the processes' start are bounded by it); the
others are judged by the health monitor from each rank's heartbeat phase, the clock of a phase
starting when every rank has reached it (a rank waiting for a peer still in an earlier phase is
not charged for the wait: the peer is judged by its own phase's deadline).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from longrun.config.memory import GB, parameter_counts, plan_for
from longrun.kinds import StartupPhase

SAFETY = 3.0  # a phase may take this many times its estimate before it is called stuck
PLACEMENT_BASE_S, PLACEMENT_PER_RANK_S = 120.0, 0.02  # Ray starts a few hundred actors a second at best
SETUP_S = 300.0  # imports of the training stack on a fresh process: minutes on a busy shared file system
RENDEZVOUS_BASE_S, RENDEZVOUS_PER_RANK_S = 120.0, 0.01  # 10x the store's measured 1 ms per rank (NCCL's own)
BUILD_BASE_S, BUILD_BYTES_PER_S = 60.0, 1e9
RESTORE_BASE_S = 60.0  # listing, the manifest, the votes
INIT_BYTES_PER_S = 100e6
CALIBRATION_PASSES = 60  # micro-batch passes dynamic CP's calibration times (6 shapes x 3 repeats, rings)
FIRST_STEP_BASE_S = 180.0  # the first collectives (communicators connect on first use), allocator warm-up
ASSUMED_MFU = 0.1  # of cluster.peak_tflops: a first step runs cold
DEFAULT_FLOPS = {"cuda": 40e12, "cpu": 0.02e12}  # sustained, when cluster.peak_tflops is unset
MB = 1e6


@dataclass(frozen=True)
class Deadline:
    phase: StartupPhase
    seconds: float
    why: str  # how it was reached, for the operator
    configured: bool = False  # set in health.startup instead of 'auto'

    def sentence(self) -> str:
        return f"{self.seconds:.0f} s: {self.why}"


@dataclass(frozen=True)
class StartupDeadlines:
    rows: tuple[Deadline, ...]

    def __getitem__(self, phase: StartupPhase | str) -> Deadline:
        for row in self.rows:
            if row.phase == phase:
                return row
        raise KeyError(phase)

    def __iter__(self) -> Iterator[Deadline]:
        return iter(self.rows)

    def seconds(self, phase: StartupPhase | str) -> float:
        return self[phase].seconds

    @property
    def longest(self) -> Deadline:
        return max(self.rows, key=lambda row: row.seconds)

    def summary(self) -> str:
        return ", ".join(f"{row.phase} {row.seconds:.0f} s" for row in self.rows)

    @classmethod
    def uniform(cls, seconds: float, why: str) -> StartupDeadlines:
        """Every phase the same (a monitor given no deadlines: the hang ceiling, as before)."""
        return cls(tuple(Deadline(phase, seconds, why) for phase in StartupPhase))


def state_bytes(cfg) -> tuple[float, float]:
    """(parameters, parameters + optimizer state) one rank holds, in bytes (the fullest pipeline
    rank's): what an initialisation writes, and what a restore reads and a build allocates."""
    plan = plan_for(cfg)
    return plan.parameters, plan.parameters + plan.optimizer


def sustained_flops(cfg) -> tuple[float, str]:
    """The compute rate a first step is assumed to reach, and where it comes from."""
    peak = cfg.cluster.peak_tflops
    if peak is not None:
        return ASSUMED_MFU * peak * 1e12, f"{ASSUMED_MFU:.0%} of cluster.peak_tflops ({peak:g})"
    device = "cuda" if cfg.cluster.device == "cuda" else "cpu"  # 'auto' may be either: the slower
    return DEFAULT_FLOPS[device], f"{DEFAULT_FLOPS[device] / 1e12:g} TFLOP/s assumed on {device}"


def step_flops_per_rank(cfg) -> float:
    """Training FLOPs of one step per rank: 6 per parameter and token of the global batch, the
    work spread over every rank (tokens over the span, the model over tp and pp)."""
    total, _, _ = parameter_counts(cfg.model)
    return 6.0 * total * cfg.global_batch_tokens / cfg.world_size


def startup_deadlines(cfg, storage_bytes_per_s: float | None = None) -> StartupDeadlines:
    """Every start-up phase's deadline for `cfg` (torch-free). `storage_bytes_per_s`: the
    storage rate per rank this job's last restore measured (None: nothing measured yet)."""
    s, health = cfg.health.startup, cfg.health
    floor = max(s.floor_s, health.hang_timeout_s)
    params, state = state_bytes(cfg)
    if storage_bytes_per_s:
        rate, rate_why = storage_bytes_per_s, "measured by this job's last restore"
    else:
        rate, rate_why = s.storage_mb_per_s * MB, "health.startup.storage_mb_per_s: nothing measured yet"
    flops, flops_why = sustained_flops(cfg)
    world = cfg.world_size

    def auto(phase: StartupPhase, estimate: float, why: str) -> Deadline:
        configured = getattr(s, f"{phase}_s")
        if configured != "auto":
            return Deadline(phase, float(configured), f"health.startup.{phase}_s", configured=True)
        if estimate < floor:
            return Deadline(phase, floor, f"the floor (estimate {estimate:.0f} s: {why})")
        return Deadline(phase, estimate, why)

    step_s = step_flops_per_rank(cfg) / flops
    rows = [
        auto(StartupPhase.PLACEMENT, PLACEMENT_BASE_S + PLACEMENT_PER_RANK_S * world,
             f"{PLACEMENT_BASE_S:.0f} s + {PLACEMENT_PER_RANK_S * 1e3:.0f} ms x {world} ranks"),
        auto(StartupPhase.SETUP, SETUP_S, "imports and the device on a fresh process"),
        auto(StartupPhase.RENDEZVOUS, RENDEZVOUS_BASE_S + RENDEZVOUS_PER_RANK_S * world,
             f"{RENDEZVOUS_BASE_S:.0f} s + {RENDEZVOUS_PER_RANK_S * 1e3:.0f} ms x {world} ranks"),
        auto(StartupPhase.BUILD, BUILD_BASE_S + SAFETY * state / BUILD_BYTES_PER_S,
             f"{BUILD_BASE_S:.0f} s + {SAFETY:g} x {_gb(state)} of state at {_rate(BUILD_BYTES_PER_S)}"),
        auto(StartupPhase.RESTORE, RESTORE_BASE_S + SAFETY * state / rate,
             f"{RESTORE_BASE_S:.0f} s + {SAFETY:g} x {_gb(state)} of parameters and optimizer state at "
             f"{_rate(rate)} ({rate_why})"),
        _init(cfg, auto, params, rate, rate_why),
        _calibration(cfg, auto, flops, flops_why, floor),
        auto(StartupPhase.FIRST_STEP, FIRST_STEP_BASE_S + SAFETY * step_s,
             f"{FIRST_STEP_BASE_S:.0f} s + {SAFETY:g} x {step_flops_per_rank(cfg) / 1e12:.3g} TFLOP per rank "
             f"at {flops_why}"),
    ]
    return StartupDeadlines(tuple(rows))


def _init(cfg, auto, params: float, rate: float, rate_why: str) -> Deadline:
    if cfg.model.init_from:
        return auto(StartupPhase.INIT, SAFETY * params / rate,
                    f"{SAFETY:g} x {_gb(params)} of parameters read from model.init_from at {_rate(rate)} "
                    f"({rate_why}); only when nothing was restored")
    return auto(StartupPhase.INIT, SAFETY * params / INIT_BYTES_PER_S,
                f"{SAFETY:g} x {_gb(params)} of parameters drawn at {_rate(INIT_BYTES_PER_S)}; only when "
                "nothing was restored")


def _calibration(cfg, auto, flops: float, flops_why: str, floor: float) -> Deadline:
    dims = cfg.dims
    if not dims.cp_enabled:
        return Deadline(StartupPhase.CALIBRATION, floor, "not run: the job has no context parallelism")
    total, _, _ = parameter_counts(cfg.model)
    per_pass = 6.0 * total * cfg.data.micro_batch_tokens / (dims.tp * dims.pp) / flops
    return auto(StartupPhase.CALIBRATION, SAFETY * CALIBRATION_PASSES * per_pass,
                f"{SAFETY:g} x {CALIBRATION_PASSES} micro-batch passes at {flops_why}; measured once per "
                "model, device and span, then read")


def collective_note(cfg, deadlines: StartupDeadlines) -> str | None:
    """A warning when health.collective_timeout_s is shorter than a start-up phase: a rank's
    first collectives may wait for a peer still in that phase, and would time out first."""
    longest, timeout = deadlines.longest, cfg.health.collective_timeout_s
    if timeout >= longest.seconds:
        return None
    return (f"health.collective_timeout_s ({timeout:g} s) is shorter than the {longest.phase} deadline "
            f"({longest.seconds:.0f} s): a rank waiting in a collective for a peer still in that phase "
            "would time out first; raise it")


def _gb(nbytes: float) -> str:
    return f"{nbytes / GB:.3g} GB" if nbytes >= GB else f"{nbytes / MB:.3g} MB"


def _rate(bytes_per_s: float) -> str:
    return f"{bytes_per_s / GB:.3g} GB/s" if bytes_per_s >= GB else f"{bytes_per_s / MB:.3g} MB/s"
