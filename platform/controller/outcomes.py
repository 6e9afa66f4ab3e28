"""How a rank ended, in the words of the health policy.

Translated here, once: finished (its summary); the kind its error declares (`fault_kind`:
`nan` for NonFiniteError, `fatal` for config, data and checkpoint mismatches); `fatal` for
import and syntax errors whatever they declare (user code, or an environment that lacks a
module: every node alike); `exception` for any other error; `dead` when its process is gone
(SIGKILL, OOM). The worker group turns a dead rank into `node_lost` when Ray reports its
node dead (`dead_nodes`).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import ray
from ray.exceptions import RayActorError, RayError, RayTaskError

from longrun.failures import RankFailure, fault_kind_of
from longrun.kinds import FaultKind

__all__ = ["RankEnded", "dead_nodes", "describe", "draining_nodes", "fault_kind_of", "last_line",
           "outcome", "unwrap"]

@dataclass(frozen=True)
class RankEnded:
    """A rank whose run() returned: `summary` when it finished, else the failure's kind."""

    rank: int
    summary: dict[str, Any] | None = None
    kind: str | None = None  # a FaultKind when it failed
    step: int | None = None
    detail: str = ""

    @property
    def finished(self) -> bool:
        return self.kind is None


def unwrap(exc: BaseException) -> BaseException:
    """The error a remote call raised, unwrapped from Ray's."""
    return exc.cause if isinstance(exc, RayTaskError) and exc.cause is not None else exc


# How the collective backends word a peer that went away mid-collective (gloo, NCCL).
_PEER_GONE = ("Connection closed by peer", "Connection reset by peer", "Broken pipe",
              "NCCL communicator was aborted", "remote process exited or there was a network error")


def last_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[-1] if text else type(exc).__name__


def describe(rank: int, error: BaseException) -> str:
    """A sentence for how `rank` failed. A collective that broke because a peer died reads as
    that (the peer's own death is the fault; this rank is a messenger), not as the backend's
    message with its source path."""
    text = str(error)
    name = error.short_name if isinstance(error, RankFailure) else type(error).__name__
    if any(sign in text for sign in _PEER_GONE):
        return (f"rank {rank} lost its connection to a peer in the middle of a collective "
                f"({name}): a peer's process likely died")
    return f"rank {rank} raised {name}: {last_line(error)}"


def dead_nodes(node_ids: Iterable[str]) -> set[str]:
    """Those of `node_ids` that Ray no longer lists as alive (removed, crashed, preempted)."""
    alive = {n["NodeID"] for n in ray.nodes() if n["Alive"]}
    return {n for n in node_ids if n not in alive}


def draining_nodes(node_ids: Iterable[str]) -> dict[str, float]:
    """Those of `node_ids` Ray is draining (a preemption notice, a scale-down), with the unix
    time each must be empty by (0: no deadline)."""
    from ray._private.state import state

    draining = state.get_draining_nodes()
    return {n: draining[n] / 1000 for n in node_ids if n in draining}


def outcome(ref: Any, rank: int) -> RankEnded:
    """How the run() behind `ref` (done) ended."""
    try:
        return RankEnded(rank, summary=ray.get(ref))
    except RayTaskError as exc:
        cause = unwrap(exc)
        return RankEnded(rank, kind=fault_kind_of(cause), step=getattr(cause, "step", None),
                         detail=describe(rank, cause))
    except RayActorError as exc:
        return RankEnded(rank, kind=FaultKind.DEAD,
                         detail=f"rank {rank}'s process died ({type(exc).__name__})")
    except RayError as exc:  # e.g. an exception Ray could not bring back: still a failure
        return RankEnded(rank, kind=FaultKind.EXCEPTION, detail=f"rank {rank} failed: {last_line(exc)[:300]}")
