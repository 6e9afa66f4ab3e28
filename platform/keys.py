"""Redis key names, in one place.

Everything a job writes lives under `longrun:{job}:`. What belongs to one attempt lives under
`longrun:{job}:a{attempt}:` so a restarted attempt never reads a stale key, and the controller
deletes it all when the attempt ends (`delete_attempt_keys`): a week-long job restarts hundreds
of times, and nothing there is read again. Under an attempt's prefix:

    store:   the torch.distributed rendezvous store (keys and their signal streams)
    hb:      heartbeats (they also expire on their own): one key per rank, or at scale one
             binary record per node from the node's agent (hb:node:N) and its roster
    diag:    the per-node stores of the collective self-check
    ckpt:    the checkpoint commit ledger (one hash per step)
    preempt: a stop request ("now"), then the step at which every rank saves and stops
    ledger:  the step ledger (goodput/ledger.py): the last step each rank finished, one record
             per step of the lowest rank, and each rank's restore; read by the controller before
             the attempt's keys go
    logs:    the ranks' log lines (worker/rank_log.py), consumed by the controller into
             <output_dir>/<job>/logs/attempt-A/rank-R.log

The job record (state, events, restarts, evictions, skips), the attempt counter, the goodput
summary (and beside it the detail a controller taking over after a death needs) and the
measured storage rate are job-wide: they must survive every attempt, and they
are what `longrun status` reads.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

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


def job_stop_key(job: str) -> str:
    """"force" when an operator asked to stop without saving (`longrun stop --force`)."""
    return f"{job_prefix(job)}stop"


def job_goodput_key(job: str) -> str:
    """The goodput summary (a hash: seconds per bucket, goodput, wall time, recent faults)."""
    return f"{job_prefix(job)}goodput"


def job_goodput_detail_key(job: str) -> str:
    """Beside the summary: the per-step detail and running span a controller after a death needs."""
    return f"{job_prefix(job)}goodput:detail"


def job_storage_rate_key(job: str) -> str:
    """The storage rate per rank (bytes/s) the job's last restore from storage measured (its
    slowest rank's): what the restore's start-up deadline is sized by (health/startup.py)."""
    return f"{job_prefix(job)}storage_rate"


def job_attempts_key(job: str) -> str:
    """How many attempt numbers were handed out under the job name (`allocate_attempt`)."""
    return f"{job_prefix(job)}attempts"


# INCR, raised to at least ARGV[1] + 1 first: numbers follow the job record's after an upgrade
# (a record older than the counter), and are never handed out twice.
_ALLOCATE = """
local n = redis.call('incr', KEYS[1])
local floor = tonumber(ARGV[1]) + 1
if n < floor then
    redis.call('set', KEYS[1], floor)
    n = floor
end
return n - 1
"""


def allocate_attempt(client: Any, job: str, at_least: int = 0) -> int:
    """The next attempt number under `job` (0 first), never below `at_least`, from a counter in
    Redis: two controllers that somehow ran at once (a lease lost with the store) would still
    never share an attempt's keys."""
    return int(client.eval(_ALLOCATE, 1, job_attempts_key(job), at_least))


def job_controller_key(job: str) -> str:
    """The controller's lease (controller/lease.py): one live controller per job name."""
    return f"{job_prefix(job)}controller"


def heartbeat_key(job: str, attempt: int, rank: int) -> str:
    return f"{attempt_prefix(job, attempt)}hb:{rank}"


def node_beats_key(job: str, attempt: int, node: int) -> str:
    """Node `node`'s record of its ranks' beats, from its agent (health/node_agent.py)."""
    return f"{attempt_prefix(job, attempt)}hb:node:{node}"


def node_roster_key(job: str, attempt: int, node: int) -> str:
    """What rarely changes about node `node`'s ranks (pid, host, metrics address), as JSON."""
    return f"{attempt_prefix(job, attempt)}hb:roster:{node}"


def preempt_key(job: str, attempt: int) -> str:
    return f"{attempt_prefix(job, attempt)}preempt"


def ledger_done_key(job: str, attempt: int) -> str:
    """Rank -> the last step that rank finished in the attempt (a hash)."""
    return f"{attempt_prefix(job, attempt)}ledger:done"


def ledger_steps_key(job: str, attempt: int) -> str:
    """One JSON record per step of the attempt's lowest rank (a list, consumed by the controller)."""
    return f"{attempt_prefix(job, attempt)}ledger:steps"


def ledger_restored_key(job: str, attempt: int) -> str:
    """Rank -> JSON of what the rank restored at the attempt's start, and when training began."""
    return f"{attempt_prefix(job, attempt)}ledger:restored"


def rank_logs_key(job: str, attempt: int) -> str:
    """The attempt's ranks' log lines, JSON each (a list, consumed by the controller)."""
    return f"{attempt_prefix(job, attempt)}logs"


def store_prefix(job: str, attempt: int) -> str:
    """Prefix of the torch.distributed store of one attempt."""
    return f"{attempt_prefix(job, attempt)}store:"


# -- deleting what ended attempts left behind ----------------------------------------------------
_ATTEMPT = re.compile(r"^a(\d+):")


def glob_escape(text: str) -> str:
    """`text` as a literal in a Redis SCAN/KEYS glob pattern."""
    return "".join("\\" + c if c in "*?[]\\" else c for c in text)


def delete_matching(client: Any, pattern: str, batch: int = 1000) -> int:
    """UNLINK every key matching `pattern` (a redis-py client), in batches; how many went."""
    return _unlink(client, client.scan_iter(match=pattern, count=batch), batch)


def delete_attempt_keys(client: Any, job: str, attempt: int) -> int:
    """Everything one attempt owned (see the module docstring): called when the attempt ends,
    once its workers are gone."""
    return delete_matching(client, glob_escape(attempt_prefix(job, attempt)) + "*")


def delete_attempts_before(client: Any, job: str, attempt: int, batch: int = 1000) -> int:
    """Every key of the job's attempts numbered below `attempt`, in one scan: what a controller
    that died mid-run left behind, deleted by the one that continues the job."""
    prefix = job_prefix(job)

    def older() -> Iterator[bytes | str]:
        for key in client.scan_iter(match=glob_escape(prefix) + "a[0-9]*", count=batch):
            name = key.decode() if isinstance(key, bytes) else key
            found = _ATTEMPT.match(name[len(prefix):])
            if found and int(found.group(1)) < attempt:
                yield key
    return _unlink(client, older(), batch)


def _unlink(client: Any, found: Iterator[bytes | str], batch: int) -> int:
    removed, chunk = 0, []
    for key in found:
        chunk.append(key)
        if len(chunk) >= batch:
            removed += client.unlink(*chunk)
            chunk = []
    if chunk:
        removed += client.unlink(*chunk)
    return removed
