"""The one error of data preparation and reading: bad input a user can fix.

It lives here, not in `longrun.data.documents`, because importing anything under
`longrun.trainer` imports torch (the package's `__init__`), and preparing data needs none.
"""

from __future__ import annotations

from longrun.kinds import FaultKind


class DataError(ValueError):
    """The data cannot be used as given; the message names the input and what to change."""

    fault_kind = FaultKind.FATAL  # recurs on any node: a training job ends instead of restarting
