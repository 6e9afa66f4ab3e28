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

import pydantic
import ray
from ray.exceptions import RayActorError, RayError, RayTaskError

from longrun.kinds import FaultKind

__all__ = ["RankEnded", "dead_nodes", "fault_kind_of", "last_line", "outcome", "unwrap"]

# Errors that recur on any node and in any attempt: user code that does not import or parse,
# and a config the workers reject.
_FATAL_TYPES = (ImportError, SyntaxError, pydantic.ValidationError)


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


def fault_kind_of(error: BaseException) -> str:
    """What kind of fault an error a rank raised is (see the module docstring)."""
    if isinstance(error, _FATAL_TYPES):
        return FaultKind.FATAL
    return str(getattr(error, "fault_kind", FaultKind.EXCEPTION))


def unwrap(exc: BaseException) -> BaseException:
    """The error a remote call raised, unwrapped from Ray's."""
    return exc.cause if isinstance(exc, RayTaskError) and exc.cause is not None else exc


def last_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[-1] if text else type(exc).__name__


def dead_nodes(node_ids: Iterable[str]) -> set[str]:
    """Those of `node_ids` that Ray no longer lists as alive (removed, crashed, preempted)."""
    alive = {n["NodeID"] for n in ray.nodes() if n["Alive"]}
    return {n for n in node_ids if n not in alive}


def outcome(ref: Any, rank: int) -> RankEnded:
    """How the run() behind `ref` (done) ended."""
    try:
        return RankEnded(rank, summary=ray.get(ref))
    except RayTaskError as exc:
        cause = unwrap(exc)
        return RankEnded(rank, kind=fault_kind_of(cause), step=getattr(cause, "step", None),
                         detail=f"rank {rank} raised {type(cause).__name__}: {last_line(cause)}")
    except RayActorError as exc:
        return RankEnded(rank, kind=FaultKind.DEAD,
                         detail=f"rank {rank}'s process died ({type(exc).__name__})")
    except RayError as exc:  # e.g. an exception Ray could not bring back: still a failure
        return RankEnded(rank, kind=FaultKind.EXCEPTION, detail=f"rank {rank} failed: {last_line(exc)[:300]}")
