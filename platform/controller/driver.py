"""`longrun run`'s entry into the controller, and what this version of it supports."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from longrun.config import JobConfig
from longrun.controller.controller import Controller, JobFailed

__all__ = ["JobFailed", "UnsupportedJob", "check_supported", "run_job"]


class UnsupportedJob(ValueError):
    pass


def check_supported(cfg: JobConfig) -> None:
    """What the controller's workers can run today: data and context parallelism (static or
    dynamic; ring, Ulysses or USP attention). The trainer has no tensor or pipeline
    parallelism yet."""
    par = cfg.parallelism
    if par.tp * par.pp > 1:
        raise UnsupportedJob(
            f"the trainer has no tensor or pipeline parallelism yet; the config asks for tp {par.tp}, "
            f"pp {par.pp}. Set both to 1 (data and context parallelism are supported).")
    if par.dynamic_cp and cfg.world_size < 2:
        raise UnsupportedJob(
            "dynamic context parallelism splits sequences across workers; a one-worker job has "
            "nothing to split. Set parallelism.dynamic_cp to false or add workers.")


def run_job(cfg: JobConfig, redis_url: str, *, on_event: Callable[[str], None] | None = None,
            poll_s: float | None = None) -> dict[str, Any]:
    """Run the job on the connected Ray cluster to its end; the summary of rank 0.
    Raises JobFailed (with the reason) when the job ends FAILED."""
    check_supported(cfg)
    return Controller(cfg, redis_url, on_event=on_event, poll_s=poll_s).run()
