"""The bounded label vocabularies of longrun's metrics, and the one label-name decision.

Every label value that is not a job, attempt, rank or node comes from a closed set here:
a Prometheus series per distinct value lives forever in the TSDB, so an error string or a
group name that slipped into a label would grow it without bound. Unknown values are
mapped to "other" (and logged once) rather than raising, because metrics must never take a
training job down.

The `job` label
---------------
Prometheus reserves `job` for the scrape job's name. longrun keeps `job` = the longrun job
name anyway, consistently everywhere, because the house rule names the labels job, attempt,
rank, node and because operators type `{job="my-run"}`:

- the exporters (WorkerMetrics, ControllerMetrics) put `job` on every series;
- the http_sd target groups (discovery.py) carry `job` as a target label, which overrides
  the scrape config's job_name for those targets, so even Prometheus' own `up` and
  `scrape_duration_seconds` series of a worker say `job="my-run"`;
- the scrape config sets `honor_labels: true`, so the exposed `job` is kept instead of
  being renamed `exported_job` (the deploy config and EmbeddedPrometheus both do this);
- dashboards and alert rules select `{job=~"$job"}`.
The targets are our own processes, so honouring their labels trusts nothing foreign.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterable

import prometheus_client

from longrun.health.stragglers import BLAMES
from longrun.kinds import PLACEMENT_CAUSE, STEP_PHASES, FaultKind, Phase

log = logging.getLogger(__name__)

# prometheus-client adds a `<name>_created` timestamp series beside every counter and histogram
# child by default: unit-less names that double the series count, which Prometheus 2.x stores
# as plain gauges. rate()/increase() handle counter resets without them. Process-wide switch;
# the processes that import longrun's metrics are longrun's own.
prometheus_client.disable_created_metrics()

OTHER = "other"

# Worker series: the four bounded identity labels of the house rules; the node by the name a
# person reads ("host (address)") and, as a second label, by its Ray id (node_names.py).
WORKER_LABELS = ("job", "attempt", "rank", "node", "node_id")
# Controller series span attempts (the attempt is the value of longrun_job_attempt): an attempt
# label would split a counter like longrun_job_restarts_total into one series per attempt.
CONTROLLER_LABELS = ("job",)

# Where a step's time goes: the trainer's on_phase names (data, forward, backward, sync,
# optimizer) plus what surrounds steps, the start-up phases timed on the worker among them.
PHASES = (*STEP_PHASES, Phase.CHECKPOINT, Phase.VALIDATION, Phase.RESTORE, Phase.BUILD, Phase.INIT,
          Phase.CALIBRATION, OTHER)

# commgroup.init.InitTimings fields (the per-group times are summed into "groups": group
# names like tp_3 are not bounded by anything but the world size).
INIT_PHASES = ("store_connect", "arrival", "world_init", "groups", "total", OTHER)
# Where a restore read the training state from (longrun_checkpoint_restore_seconds{source}).
RESTORE_SOURCES = ("storage", "memory", OTHER)
# What the training state a rank holds is made of (longrun_train_state_bytes{kind}).
STATE_KINDS = ("parameters", "gradients", "optimizer", OTHER)

# Fault kinds and restart causes: health.policy.PRECEDENCE, plus placement failures.
# tests/test_observability_metrics.py fails if the policy or monitor learns a kind this lacks.
FAULT_KINDS = (*FaultKind.precedence(), PLACEMENT_CAUSE, OTHER)
_FAULT_ALIASES = {"diagnostics": "diagnostics_failed"}

# What a slow rank is blamed on (health/stragglers.py): longrun_slow_ranks{blame}.
STRAGGLER_BLAMES = BLAMES

# health.diagnostics check names.
DIAGNOSTIC_CHECKS = ("compute", "memory", "collective", "store", "nvml", OTHER)

_LABEL_NAME = re.compile(r"^[a-zA-Z_][a-zA-Z0-9_]*$")
_warned: set[tuple[str, str]] = set()


def bounded(value: str, allowed: Iterable[str], what: str, aliases: dict[str, str] | None = None) -> str:
    """`value` if it is in `allowed` (after `aliases`), else "other", logged once per value."""
    value = str(value)
    value = (aliases or {}).get(value, value)
    if value in allowed:
        return value
    if (what, value) not in _warned:
        _warned.add((what, value))
        log.warning("metrics: unknown %s %r is recorded as %r (known: %s)", what, value, OTHER,
                    ", ".join(allowed))
    return OTHER


def fault_kind(kind: str) -> str:
    return bounded(kind, FAULT_KINDS, "fault kind", _FAULT_ALIASES)


def check_label_name(name: str) -> str:
    """A valid Prometheus label name, not one of the reserved `__` ones, or ValueError."""
    if not _LABEL_NAME.match(name) or name.startswith("__"):
        raise ValueError(f"{name!r} is not a valid Prometheus label name ([a-zA-Z_][a-zA-Z0-9_]*, "
                         "not starting with __)")
    return name
