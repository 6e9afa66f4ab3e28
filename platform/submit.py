"""Jobs on a Ray cluster through Ray's Jobs API: submit, status, logs, stop, list.

`longrun submit CONFIG --address URL` validates the config here, first, so a typo costs
nothing on the cluster. It then ships this machine's longrun with the job (shipping.py: the
cluster's python need not have longrun, or the same version), uploads the resolved config as
the job's working directory and submits the controller as the job's entrypoint: preflight.py,
which checks the cluster's python has what longrun needs, then `longrun run` against the
cluster it runs on. Ray keeps the job running whether or not this client stays.

Nothing submitted carries the Redis password: anyone who reaches the Jobs API can read the
metadata, the runtime environment and the working directory. The shipped config holds the
reference ${LONGRUN_REDIS_PASSWORD} (redis_password.py) and the cluster's nodes supply the
password from their own environment; the metadata holds the URL with its password masked.

`status` reports Ray's view of the job (its status) next to the controller's: the job record
in Redis when this machine can read it, the controller's log otherwise (job_view.py).
"""

from __future__ import annotations

import asyncio
import os
import re
import secrets
import shlex
import tempfile
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from longrun import job_view, shipping
from longrun.config import JobConfig
from longrun.redact import redact
from longrun.redis_password import password_of

METADATA_KEY = "longrun.job"
REDIS_KEY = "longrun.redis"  # the job's Redis URL, password masked ("" when embedded)
VERSION_KEY = "longrun.version"  # what was shipped: version and source digest
DEFAULT_PYTHON = "python3"


class SubmitError(RuntimeError):
    """The cluster cannot be reached or refused the request; the message says which."""


@dataclass(frozen=True)
class Submitted:
    id: str
    shipment: shipping.Shipment


def client(address: str):
    """A Jobs API client for `address` (the dashboard's http://host:8265), or SubmitError."""
    from ray.job_submission import JobSubmissionClient

    try:
        return JobSubmissionClient(address)
    except (ConnectionError, RuntimeError, ValueError) as exc:
        raise SubmitError(redact(f"cannot reach the Ray Jobs API at {address}: {exc}")) from exc


def job_env(cfg: JobConfig) -> dict[str, str]:
    """The submitted job's environment. `longrun stop` is Ray's `stop_job`: SIGTERM to the
    controller, then SIGKILL after RAY_JOB_STOP_WAIT_TIME_S (Ray's default: 3 s). The
    controller answers SIGTERM by saving at the next step boundary, so Ray must wait the
    preemption grace, and a little for the controller to stop what it started."""
    return {"RAY_USAGE_STATS_ENABLED": "0", "PYTHONUNBUFFERED": "1",
            "RAY_JOB_STOP_WAIT_TIME_S": str(int(cfg.recovery.preemption_grace_s) + 30)}


def submission_id_for(job: str) -> str:
    """`longrun-<job>-<UTC time>-<6 hex digits>`: sortable by time, and two submissions of one
    job within a second (a script, a retry) do not collide."""
    return f"longrun-{job}-{time.strftime('%Y%m%d-%H%M%S', time.gmtime())}-{secrets.token_hex(3)}"


def submit(cfg: JobConfig, address: str, *, python: str | None = None) -> Submitted:
    """Submit the controller for `cfg`, with this longrun shipped; `python` is the interpreter
    the entrypoint runs with on the cluster (on its PATH, or a path there; default python3)."""
    python = python or DEFAULT_PYTHON
    jobs = client(address)
    submission_id = submission_id_for(cfg.job.name)
    # The preflight runs the command line after it; the cluster's address is where it runs.
    entrypoint = f"{shlex.quote(python)} -m longrun.preflight run config.yaml --set cluster.address=auto"
    with tempfile.TemporaryDirectory(prefix="longrun-submit-") as tmp:
        working_dir, modules = Path(tmp, "job"), Path(tmp, "modules")
        working_dir.mkdir()
        # The password as a reference; a vocabulary this machine could not resolve (the
        # tokenizer or shards are on the cluster only) is resolved there.
        (working_dir / "config.yaml").write_text(cfg.to_yaml(pin_vocabulary=False))
        shipment = shipping.stage(modules)
        shipping.write_manifest(shipment, working_dir)
        redis_url = cfg.cluster.redis_url
        try:
            jobs.submit_job(
                entrypoint=entrypoint, submission_id=submission_id,
                runtime_env={"working_dir": str(working_dir), "py_modules": [shipment.path],
                             "env_vars": job_env(cfg)},
                metadata={METADATA_KEY: cfg.job.name,
                          REDIS_KEY: redact(redis_url) if redis_url else "",
                          VERSION_KEY: f"{shipment.version} (source {shipment.digest[:12]})"},
            )
        except RuntimeError as exc:
            raise SubmitError(redact(f"the cluster at {address} refused the job: {exc}")) from exc
    return Submitted(submission_id, shipment)


def status(address: str, submission_id: str, *, redis_url: str | None = None,
           env: Mapping[str, str] = os.environ) -> dict[str, Any]:
    """Ray's view of the job and the controller's (from its record, or else its log)."""
    jobs = client(address)
    try:
        info = jobs.get_job_info(submission_id)
    except RuntimeError as exc:
        raise SubmitError(f"no job {submission_id!r} on {address}: {exc}") from exc
    meta = info.metadata or {}
    url, why = job_view.record_url(meta.get(REDIS_KEY), redis_url or env.get(job_view.URL_ENV), env)
    view = None
    if url and METADATA_KEY in meta:
        view, why = job_view.read_record(url, meta[METADATA_KEY], started_ms=info.start_time,
                                         ended_ms=info.end_time)
    if view is None:
        view = job_view.read_log(jobs.get_job_logs(submission_id))
        view.source = f"the controller's log ({why})"
    return {"id": submission_id, "ray_status": str(info.status), "message": info.message or "",
            "controller": view, "longrun": meta.get(VERSION_KEY)}


def logs(address: str, submission_id: str, *, follow: bool, write: Callable[[str], None]) -> None:
    jobs = client(address)
    if not follow:
        write(jobs.get_job_logs(submission_id))
        return

    async def tail():
        async for chunk in jobs.tail_job_logs(submission_id):
            write(chunk)

    asyncio.run(tail())


_FILES = re.compile(r"files: ranks' logs in (\S+)/logs\b")


def run_dir_of(address: str, submission_id: str) -> str:
    """The job's directory on the cluster's head, as its controller printed it."""
    try:
        text = client(address).get_job_logs(submission_id)
    except RuntimeError as exc:
        raise SubmitError(f"no job {submission_id!r} on {address}: {exc}") from exc
    found = _FILES.findall(text)
    if not found:
        raise SubmitError(f"job {submission_id}'s controller has not said where its files are (yet); "
                          "its log holds no line starting with 'files: '")
    return found[-1]


def stop(address: str, submission_id: str, *, force: bool = False, redis_url: str | None = None,
         env: Mapping[str, str] = os.environ) -> bool:
    """Ask the job's controller to stop (Ray sends it SIGTERM): it saves at the next step
    boundary and ends PREEMPTED. `force`: stop at once without saving, told through the job's
    Redis record (its URL as for `status`), which the controller reads once asked to stop."""
    jobs = client(address)
    if force:
        try:
            meta = jobs.get_job_info(submission_id).metadata or {}
        except RuntimeError as exc:
            raise SubmitError(f"no job {submission_id!r} on {address}: {exc}") from exc
        url, why = job_view.record_url(meta.get(REDIS_KEY), redis_url or env.get(job_view.URL_ENV), env)
        if url is None or METADATA_KEY not in meta:
            raise SubmitError(f"--force needs the job's Redis: {why}")
        request_force_stop(url, meta[METADATA_KEY])
    return jobs.stop_job(submission_id)


def request_force_stop(redis_url: str, job: str) -> None:
    """Mark `job` to stop without saving; its controller reads the mark once asked to stop."""
    from longrun import keys
    from longrun.services.redis_client import quick_client

    redis = quick_client(redis_url)
    try:
        redis.set(keys.job_stop_key(job), "force", ex=24 * 3600)
    except Exception as exc:
        raise SubmitError(redact(f"could not reach the job's Redis to force the stop: {exc}",
                                 password_of(redis_url))) from None
    finally:
        redis.close()


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
