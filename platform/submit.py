"""Jobs on a Ray cluster through Ray's Jobs API: submit, status, logs, stop, list.

`longrun submit CONFIG --address URL` validates the config here, first, so a typo costs
nothing on the cluster. It then uploads the resolved config as the job's working directory and
submits the controller as the job's entrypoint (`longrun run` against the cluster it runs on).
Ray keeps the job running whether or not this client stays.

The controller prints its state changes, faults and decisions to its log, so `status` can
report the controller's view from the job's log (state, attempt, step, evicted nodes, last
events) next to Ray's view (the job's status). It needs no other service.
"""

from __future__ import annotations

import asyncio
import re
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from longrun.config import JobConfig

METADATA_KEY = "longrun.job"
_STATE = re.compile(r"state (PENDING|PLACING|DIAGNOSING|RENDEZVOUS|RUNNING|RECOVERING|SUCCEEDED|"
                    r"FAILED|STOPPED): (.*)")
_STEP = re.compile(r"step (\d+)/(\d+)\s+loss ([0-9.]+)")
_EVENT = re.compile(r"^(fault|decision|evicted|diagnostics_failed|resume): (.*)$")
_ANSI = re.compile(r"\x1b\[[0-9;]*m")


class SubmitError(RuntimeError):
    """The cluster cannot be reached or refused the request; the message says which."""


def client(address: str):
    """A Jobs API client for `address` (the dashboard's http://host:8265), or SubmitError."""
    from ray.job_submission import JobSubmissionClient

    try:
        return JobSubmissionClient(address)
    except (ConnectionError, RuntimeError, ValueError) as exc:
        raise SubmitError(f"cannot reach the Ray Jobs API at {address}: {exc}") from exc


def submit(cfg: JobConfig, address: str) -> str:
    """Submit the controller for `cfg`; returns the submission id."""
    jobs = client(address)
    staging = Path(tempfile.mkdtemp(prefix="longrun-submit-"))
    (staging / "config.yaml").write_text(cfg.to_yaml())
    submission_id = f"longrun-{cfg.job.name}-{time.strftime('%Y%m%d-%H%M%S')}"
    # `python` of the cluster's environment (a cluster image, or the interpreter of an embedded
    # head), not this client's path, which need not exist there.
    entrypoint = "python -m longrun.cli run config.yaml --set cluster.address=auto"
    try:
        return jobs.submit_job(
            entrypoint=entrypoint, submission_id=submission_id,
            runtime_env={"working_dir": str(staging),
                         "env_vars": {"RAY_USAGE_STATS_ENABLED": "0", "PYTHONUNBUFFERED": "1"}},
            metadata={METADATA_KEY: cfg.job.name},
        )
    except RuntimeError as exc:
        raise SubmitError(f"the cluster at {address} refused the job: {exc}") from exc


@dataclass
class ControllerView:
    """What the controller's log says about the job."""

    state: str | None = None
    reason: str = ""
    attempt: int = 0
    step: str | None = None
    loss: float | None = None
    evicted: list[str] = field(default_factory=list)
    events: list[str] = field(default_factory=list)


def read_log(text: str, last_events: int = 5) -> ControllerView:
    view = ControllerView()
    for raw in text.splitlines():
        line = _ANSI.sub("", raw).strip()
        if m := _STATE.search(line):
            view.state, view.reason = m.group(1), m.group(2)
            if m.group(1) == "RECOVERING":
                view.attempt += 1
            view.events.append(line)
        elif m := _STEP.search(line):
            view.step, view.loss = f"{m.group(1)}/{m.group(2)}", float(m.group(3))
        elif m := _EVENT.match(line):
            view.events.append(line)
            if m.group(1) == "evicted":
                view.evicted.append(m.group(2).split()[1])
    view.events = view.events[-last_events:]
    return view


def status(address: str, submission_id: str) -> dict[str, Any]:
    jobs = client(address)
    try:
        info = jobs.get_job_info(submission_id)
    except RuntimeError as exc:
        raise SubmitError(f"no job {submission_id!r} on {address}: {exc}") from exc
    view = read_log(jobs.get_job_logs(submission_id))
    return {"id": submission_id, "ray_status": str(info.status), "message": info.message or "",
            "controller": view}


def logs(address: str, submission_id: str, *, follow: bool, write: Callable[[str], None]) -> None:
    jobs = client(address)
    if not follow:
        write(jobs.get_job_logs(submission_id))
        return

    async def tail():
        async for chunk in jobs.tail_job_logs(submission_id):
            write(chunk)

    asyncio.run(tail())


def stop(address: str, submission_id: str) -> bool:
    return client(address).stop_job(submission_id)


def list_jobs(address: str) -> list[dict[str, Any]]:
    out = []
    for job in client(address).list_jobs():
        meta = job.metadata or {}
        if METADATA_KEY in meta:
            out.append({"id": job.submission_id, "job": meta[METADATA_KEY], "status": str(job.status),
                        "start": job.start_time})
    return sorted(out, key=lambda j: j["start"] or 0)


def wait(address: str, submission_id: str, *, timeout_s: float | None = None,
         poll_s: float = 1.0) -> str:
    """Block until the job is terminal; its final Ray status."""
    jobs = client(address)
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    while True:
        state = jobs.get_job_status(submission_id)
        if state.is_terminal():
            return str(state)
        if deadline is not None and time.monotonic() > deadline:
            raise SubmitError(f"job {submission_id} still {state} after {timeout_s:g} s")
        time.sleep(poll_s)  # the Jobs API has no blocking wait; poll it
