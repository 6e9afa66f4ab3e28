"""`longrun run`'s entry into the controller."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from longrun.config import JobConfig
from longrun.config.runnable import UnsupportedJob, check_runnable
from longrun.controller.controller import Controller, JobFailed

__all__ = ["JobFailed", "UnsupportedJob", "run_job"]


def run_job(cfg: JobConfig, redis_url: str, *, on_event: Callable[[str], None] | None = None,
            poll_s: float | None = None) -> dict[str, Any]:
    """Run the job on the connected Ray cluster to its end; the summary of rank 0.
    Raises UnsupportedJob before anything is placed when this version cannot run the config,
    and JobFailed (with the reason) when the job ends FAILED."""
    check_runnable(cfg)
    return Controller(cfg, redis_url, on_event=on_event, poll_s=poll_s).run()
