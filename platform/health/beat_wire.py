"""A heartbeat datagram as a node's agent takes it: parsed and checked whole, or refused.

The agent (node_agent.py) hears datagrams from its ranks; what it keeps of one goes into the
node's binary record (node_beats.ROW: fixed-width integers and floats) and its roster (pid,
host, metrics address). A field of the wrong type or size used to surface only there: a beat
without `rank` ended the agent's receiving thread, a `pid` that was not an integer its
publishing thread. So every field is checked here, before anything is kept, and a datagram with
any wrong field is refused whole (`BeatRefused`).

What the agent knows better than the datagram it takes from itself: the sender's pid (from the
kernel) and host; the attempt (from the controller). Those fields of the datagram are ignored.
The wire format is unchanged (the worker's JSON), so checking costs a few microseconds a beat.
"""

from __future__ import annotations

import json
import math
import re
from typing import Any

MAX_PHASE = 64  # characters: phases are short names (kinds.Phase)
_INT64 = 2**63
_INT16 = 2**15
_MAX_SECONDS_FLOAT = 1e30  # any time or cost; float32 columns hold up to 3.4e38
# host:port, the host a name, an IPv4 address or a bracketed IPv6 one (discovery.advertised_address)
_ENDPOINT = re.compile(r"^(?:[A-Za-z0-9][A-Za-z0-9.-]{0,252}|\[[0-9A-Fa-f:.]{2,45}\]):(\d{1,5})$")


class BeatRefused(ValueError):
    """A datagram that is not a heartbeat this agent can keep; the message says which field."""


def _int(beat: dict, name: str, low: int, high: int, default: int | None = None) -> int | None:
    value = beat.get(name, default)
    if value is None and default is None:
        return None
    if type(value) is not int or not low <= value < high:
        raise BeatRefused(f"{name} must be an integer in [{low}, {high})")
    return value


def _float(beat: dict, name: str, default: float | None = None, *, none: bool = True) -> float | None:
    value = beat.get(name, default)
    if value is None and none:
        return None
    if type(value) not in (int, float) or (math.isfinite(value) and abs(value) > _MAX_SECONDS_FLOAT):
        raise BeatRefused(f"{name} must be a number")
    return float(value)


def _endpoint(value: Any) -> str | None:
    if value is None:
        return None
    match = _ENDPOINT.match(value) if isinstance(value, str) else None
    if match is None or not 0 < int(match.group(1)) < 65536:
        raise BeatRefused("metrics_addr must be host:port")
    return value


def parse_beat(data: bytes) -> dict[str, Any]:
    """The beat a datagram carries, every field the agent keeps checked; BeatRefused otherwise."""
    try:
        message = json.loads(data)
    except (ValueError, RecursionError):
        raise BeatRefused("not JSON") from None
    beat = message.get("beat") if isinstance(message, dict) else None
    if not isinstance(beat, dict):
        raise BeatRefused("no beat in the datagram")
    phase = beat.get("phase", "starting")
    if not isinstance(phase, str) or not 0 < len(phase) <= MAX_PHASE:
        raise BeatRefused(f"phase must be a name of at most {MAX_PHASE} characters")
    if type(beat.get("loss_finite", True)) is not bool:
        raise BeatRefused("loss_finite must be true or false")
    return {
        "rank": _int(beat, "rank", 0, 2**32, default=-1),
        "step": _int(beat, "step", -_INT64, _INT64, default=0),
        "resumed_from": _int(beat, "resumed_from", -_INT64, _INT64, default=0),
        "phase": phase,
        "pp_stage": _int(beat, "pp_stage", 0, _INT16),
        "loss_finite": beat.get("loss_finite", True),
        "loss": _float(beat, "loss"),
        "step_time_s": _float(beat, "step_time_s"),
        "work_cost": _float(beat, "work_cost"),
        "sent_at": _float(beat, "sent_at", 0.0, none=False),
        "stepped_at": _float(beat, "stepped_at"),
        "metrics_addr": _endpoint(beat.get("metrics_addr")),
    }
