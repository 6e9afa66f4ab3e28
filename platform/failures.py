"""An error a rank raised, as it crosses from the worker to the controller: torch-free.

Ray brings a remote call's exception back by pickle, and unpickling an instance imports the
module that defines its class. A worker's errors are often torch's (`DistNetworkError` when the
store goes away, `DistBackendError`, an `OutOfMemoryError`) or longrun's trainer's, so the first
such failure made the controller import torch: 150 MiB of controller grew to 330 in one fault
(the hour's soak saw 152 -> 379 MiB), and the controller never imports torch by design. So
every error leaves the worker as a `RankFailure`, which carries what the controller reads of it
(its class name, its message, the kind of fault it is, the step, the traceback as text) and
nothing that needs torch to read.

    raise RankFailure.of(exc) from None     # in the worker, at the edge of a remote method
    fault_kind_of(error)                    # in the controller: what the policy calls it
"""

from __future__ import annotations

import functools
import traceback
from collections.abc import Callable
from typing import Any, TypeVar

import pydantic

from longrun.kinds import FaultKind

T = TypeVar("T")

# Errors that recur on any node and in any attempt: user code that does not import or parse,
# and a config the workers reject.
_FATAL_TYPES = (ImportError, SyntaxError, pydantic.ValidationError)


def fault_kind_of(error: BaseException) -> str:
    """What kind of fault an error a rank raised is: the kind it declares (`fault_kind`: `nan`
    for NonFiniteError, `fatal` for config, data and checkpoint mismatches), `fatal` for import
    and syntax errors and rejected configs whatever they declare, else `exception`."""
    if isinstance(error, _FATAL_TYPES):
        return FaultKind.FATAL
    return str(getattr(error, "fault_kind", FaultKind.EXCEPTION))


class RankFailure(Exception):
    """A worker's error with its class left behind (see the module docstring)."""

    def __init__(self, type_name: str, message: str, fault_kind: str, step: int | None = None,
                 trace: str = ""):
        super().__init__(message)
        self.type_name, self.fault_kind, self.step, self.trace = type_name, fault_kind, step, trace

    @classmethod
    def of(cls, error: BaseException) -> RankFailure:
        if isinstance(error, RankFailure):
            return error
        kind = type(error)
        name = (kind.__qualname__ if kind.__module__ == "builtins"
                else f"{kind.__module__}.{kind.__qualname__}")
        step = getattr(error, "step", None)
        return cls(name, str(error), fault_kind_of(error), step if isinstance(step, int) else None,
                   "".join(traceback.format_exception(error)))

    @property
    def short_name(self) -> str:
        """The class's own name, as `describe` words it ("DistNetworkError")."""
        return self.type_name.rsplit(".", 1)[-1]

    def __reduce__(self):  # pickled by value: the controller needs this module, nothing else
        return (RankFailure, (self.type_name, str(self), self.fault_kind, self.step, self.trace))


def carried(method: Callable[..., T]) -> Callable[..., T]:
    """A remote method whose errors reach the controller as RankFailures (torch-free)."""

    @functools.wraps(method)
    def call(*args: Any, **kwargs: Any) -> T:
        try:
            return method(*args, **kwargs)
        except Exception as exc:  # SystemExit and KeyboardInterrupt stay what they are
            raise RankFailure.of(exc) from None
    return call
