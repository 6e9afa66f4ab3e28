"""Redis key names, in one place.

Everything a job writes lives under `longrun:{job}:`. What belongs to one attempt (the
rendezvous store, heartbeats) lives under `longrun:{job}:a{attempt}:` so a restarted attempt
never reads a stale key and an ended attempt is deleted with one prefix scan. The job record
(attempt counter, state, events) is job-wide: it must survive every attempt.
"""

from __future__ import annotations

import re

_SAFE = re.compile(r"^[A-Za-z0-9._-]+$")


def _check(part: str, what: str) -> str:
    if not _SAFE.match(part):
        raise ValueError(f"{what} {part!r} may only contain letters, digits, '.', '_' and '-'")
    return part


def job_prefix(job: str) -> str:
    return f"longrun:{_check(job, 'job name')}:"


def attempt_prefix(job: str, attempt: int) -> str:
    if attempt < 0:
        raise ValueError(f"attempt must be >= 0, got {attempt}")
    return f"{job_prefix(job)}a{attempt}:"


def job_record_key(job: str) -> str:
    return f"{job_prefix(job)}record"


def job_events_key(job: str) -> str:
    return f"{job_prefix(job)}events"


def job_restarts_key(job: str) -> str:
    """The restart history (a list of JSON records): the restart budget's memory."""
    return f"{job_prefix(job)}restarts"


def job_skips_key(job: str) -> str:
    """Step windows whose data the policy decided to skip (a set of "first-last"): every later
    attempt skips all of them, whichever checkpoint it resumes from."""
    return f"{job_prefix(job)}skips"


def job_evicted_key(job: str) -> str:
    """Evicted Ray node ids -> why (a hash): never placed on again by this job."""
    return f"{job_prefix(job)}evicted"


def heartbeat_key(job: str, attempt: int, rank: int) -> str:
    return f"{attempt_prefix(job, attempt)}hb:{rank}"


def store_prefix(job: str, attempt: int) -> str:
    """Prefix of the torch.distributed store of one attempt."""
    return f"{attempt_prefix(job, attempt)}store:"
