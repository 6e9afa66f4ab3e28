"""The controller's view of a submitted job, for `longrun status`: its record in Redis when this
machine can read it, its log otherwise.

The record (controller/job_state.py) is the controller's own account: state, attempt, step,
evicted nodes, events. It lives in the job's Redis, which this machine can find only when the
job's config named one (`cluster.redis_url`; without it the controller embeds a Redis on the
cluster's loopback). `longrun submit` records that URL in the job's metadata with its
password masked, since anyone who reaches the Jobs API can read metadata. Anyone who can
submit can also write any host there, so `status` sends a password only to the Redis the
operator configured (--redis-url or $LONGRUN_REDIS_URL, whose password may be the reference
${LONGRUN_REDIS_PASSWORD}); it uses the metadata's URL only when that needs no password. When
there is no URL, no password, no reachable server, or a record left by another run of the same
job name, the view comes from the controller's log (its state changes, steps and events), and
`source` says which was used and why.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import redis

from longrun.controller.job_state import job_status
from longrun.goodput.summary import read_summary
from longrun.kinds import JobState
from longrun.node_names import NodeNames
from longrun.redact import PASSWORD_ENV, redact
from longrun.redis_password import REFERENCE, RedisPasswordError, password_of, resolve
from longrun.services.redis_client import quick_client

URL_ENV = "LONGRUN_REDIS_URL"
# The record's times and Ray's job times both come from the head node's clock; this covers
# the gap between the controller's first write and Ray noting the job's start (and its end).
CLOCK_SLACK_S = 5.0
LAST_EVENTS = 5

_STATE = re.compile(r"state (" + "|".join(JobState) + r"): (.*)")
_STEP = re.compile(r"step (\d+)/(\d+)\s+loss ([0-9.]+)(?:\s+val_loss ([0-9.]+))?")
_EVENT = re.compile(r"^(fault|decision|evicted|diagnostics_failed|resume|waiting_for_nodes|grow_requested|"
                    r"resized|stragglers): (.*)$")
_EVICTED = re.compile(r"^node (.+?)(?: will not be used again.*| failed.*)?$")  # "evicted" event: the node
_RESIZED = re.compile(r"-> (\d+) node\(s\), \d+ -> (\d+) rank\(s\)")  # the controller's "resized" event
_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_GOODPUT = re.compile(r"^goodput \d+(\.\d+)?% of ")  # the controller's goodput line (goodput/summary.py)


@dataclass
class ControllerView:
    """What the controller says about the job, and where that was read."""

    state: str | None = None
    reason: str = ""
    attempt: int = 0
    step: str | None = None
    loss: float | None = None
    # The newest validation pass's loss and the step it followed (validation.interval_steps).
    val_loss: float | None = None
    val_step: int | None = None
    evicted: list[str] = field(default_factory=list)
    events: list[str] = field(default_factory=list)
    source: str = "the controller's log"
    # Nodes and ranks the job runs with, e.g. "2 of 3 node(s), 4 rank(s)": fewer than configured
    # while an elastic job is shrunk (recovery.min_nodes). None: not known (an older controller).
    size: str | None = None
    # "goodput 93.4% of 6m 52s; lost to redone 12.0 s, ...": the goodput summary's line. None:
    # not known (an older controller, or a log from before the first attempt ended).
    goodput: str | None = None
    # "runs 23% slower than with every rank at the median (1.23 s vs 1.00 s): node n3 (ranks
    # 24-31) slow together 1.60x": the newest straggler report (health/stragglers.py). None: not
    # known (no report yet, between attempts, or an older controller). From the log: the last
    # one that named a change.
    stragglers: str | None = None


def read_log(text: str, last_events: int = LAST_EVENTS) -> ControllerView:
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
            if m.group(4) is not None:
                view.val_loss, view.val_step = float(m.group(4)), int(m.group(1))
        elif m := _EVENT.match(line):
            view.events.append(line)
            if m.group(1) == "evicted" and (node := _EVICTED.match(m.group(2))):
                view.evicted.append(node.group(1))
            elif m.group(1) == "resized" and (size := _RESIZED.search(m.group(2))):
                view.size = f"{size.group(1)} node(s), {size.group(2)} rank(s)"
            elif m.group(1) == "stragglers":
                view.stragglers = m.group(2)
        elif _GOODPUT.match(line):
            view.goodput = line
    view.events = view.events[-last_events:]
    return view


# -- the Redis URL, and where its secret may go ------------------------------------------------


def record_url(recorded: str | None, override: str | None,
               env: Mapping[str, str]) -> tuple[str | None, str]:
    """(the URL to read the job record from, or None and why not). `recorded` is the job's
    metadata (its submitter's word), `override` the operator's --redis-url or $LONGRUN_REDIS_URL."""
    if override:
        try:
            return resolve(override, env), ""
        except RedisPasswordError as exc:
            return None, f"--redis-url / {URL_ENV}: {exc}"
    if recorded is None:
        return None, "the job was submitted without a record of its Redis"
    if not recorded:
        return None, ("the job's Redis is embedded in its controller on the cluster; name one in "
                      "cluster.redis_url for status to read the job record")
    if password_of(recorded) is not None:
        # Never put the operator's password into a URL the job's metadata names.
        return None, (f"the job's Redis {redact(recorded)} needs its password, which status sends only "
                      f"to the Redis you configure: set {URL_ENV} (e.g. redis://:{REFERENCE}@HOST:6379/0 "
                      f"with the password in ${PASSWORD_ENV}) or pass --redis-url")
    return recorded, ""


# -- the record ----------------------------------------------------------------------------------


def read_record(url: str, job: str, *, started_ms: int | None, ended_ms: int | None,
                last_events: int = LAST_EVENTS) -> tuple[ControllerView | None, str]:
    """(the view from the job record of this submission, or None and why not)."""
    shown = redact(url)
    client = quick_client(url)
    try:
        status = job_status(client, job, events=last_events)
        goodput = read_summary(client, job)
    except (redis.RedisError, OSError) as exc:
        return None, redact(f"cannot read the job record from {shown}: {exc}", password_of(url))
    finally:
        client.close()
    if status["state"] is None:
        return None, f"{shown} holds no record of job {job!r} yet"
    updated = float(status["fields"].get("updated_at", 0))
    if started_ms and updated < started_ms / 1000 - CLOCK_SLACK_S:
        return None, f"the record of job {job!r} in {shown} is older than this submission"
    if ended_ms and updated > ended_ms / 1000 + CLOCK_SLACK_S:
        return None, (f"the record of job {job!r} in {shown} was written after this submission "
                      "ended, by a later run of the same job")
    view = view_of_record(status, f"the job record in Redis at {shown}")
    view.goodput = goodput.describe() if goodput is not None else None
    return view, ""


def view_of_record(status: dict[str, Any], source: str) -> ControllerView:
    """A ControllerView of what controller.job_status returns: evicted nodes by name ("host
    (address)") where the record knows it, by id otherwise."""
    fields = status["fields"]
    steps = fields.get("steps")
    loss = json.loads(fields["loss"]) if fields.get("loss") else None
    val_loss = _json_number(fields.get("val_loss"))
    val_step = _json_number(fields.get("val_step"))
    names = NodeNames(_json_dict(fields.get("node_names")))
    return ControllerView(
        state=status["state"], reason=fields.get("reason", ""), attempt=status["attempt"],
        step=f"{status['step']}/{steps}" if steps else str(status["step"]),
        loss=float(loss) if loss is not None else None, val_loss=val_loss,
        val_step=int(val_step) if val_step is not None else None,
        evicted=sorted(map(names.name, status["evicted"])),
        events=[event_line(e) for e in status["events"]], source=source, size=fields.get("size"),
        stragglers=fields.get("stragglers") or None)


def _json_number(text: str | None) -> float | None:
    """A number of the record, or None when it is absent or not one (the record is anyone's who
    can write to its Redis)."""
    try:
        value = json.loads(text) if text else None
    except ValueError:
        return None
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else None


def _json_dict(text: str | None) -> dict[str, str]:
    """A JSON object of the record, or {} when it is absent or not one (a record is anyone's
    who can write to its Redis)."""
    try:
        found = json.loads(text) if text else {}
    except ValueError:
        return {}
    return {str(k): str(v) for k, v in found.items()} if isinstance(found, dict) else {}


def event_line(event: dict[str, Any]) -> str:
    """An event of the record as the controller logged it, after its time."""
    at = time.strftime("%H:%M:%S", time.localtime(event.get("at", 0)))
    if event.get("type") == "transition":
        return f"{at} state {event.get('to')}: {event.get('reason', '')}"
    line = f"{at} {event.get('type')}: {event.get('reason', '')}"
    if event.get("log_file"):  # a fault of one rank: where its log is, its node, and how it ended
        line += f"\n    log: {event['log_file']}"
        if event.get("node_name") or event.get("node"):
            line += f"\n    node: {event.get('node_name') or event['node']}"
        parts = [part for last in event.get("last_lines", ()) for part in last.split("\n")]
        line += "".join(f"\n    | {part}" for part in parts)
    return line
