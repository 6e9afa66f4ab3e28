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
    par = cfg.parallelism
    if par.tp * par.cp * par.pp > 1:
        raise UnsupportedJob(
            f"the controller runs data-parallel jobs for now; the config asks for tp {par.tp}, "
            f"cp {par.cp}, pp {par.pp}. Set them to 1 (context parallelism runs through the "
            "trainer API: see docs/architecture.md)."
        )


def run_job(cfg: JobConfig, redis_url: str, *, on_event: Callable[[str], None] | None = None,
            poll_s: float | None = None) -> dict[str, Any]:
    """Run the job on the connected Ray cluster to its end; the summary of rank 0.
    Raises JobFailed (with the reason) when the job ends FAILED."""
    check_supported(cfg)
    return Controller(cfg, redis_url, on_event=on_event, poll_s=poll_s).run()
