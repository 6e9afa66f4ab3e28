"""What every command family of the command line shares: the two consoles, config arguments,
the cluster address, and the errors a user can hit that end a command with a sentence."""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

from rich.console import Console
from rich.markup import escape

from longrun.config import JobConfig, load_config

# Control characters (C0 but tab, DEL, C1) and the bidirectional overrides that reorder what a
# reader sees: shown as escapes, never sent to the terminal. Text from a job record, a manifest
# or a config file is written by whoever could write there, and an escape sequence in it could
# retitle the terminal, rewrite the screen or (OSC 52) set the clipboard.
_CONTROLS = {c: f"\\x{c:02x}" for c in (*range(0x20), 0x7F, *range(0x80, 0xA0)) if c != 0x09}
_CONTROLS.update({c: f"\\u{c:04x}" for c in (*range(0x202A, 0x202F), *range(0x2066, 0x206A))})
_KEEP_NEWLINES = {c: v for c, v in _CONTROLS.items() if c != 0x0A}

console = Console(stderr=True, soft_wrap=True)  # progress and errors
out = Console(soft_wrap=True)  # results
ADDRESS_HELP = "the Ray dashboard / Jobs API address, e.g. http://127.0.0.1:8265 (default: $RAY_ADDRESS)"


def printable(text: object, *, newlines: bool = False) -> str:
    """`text` with every control character shown as an escape (newlines kept when asked)."""
    return str(text).translate(_KEEP_NEWLINES if newlines else _CONTROLS)


def shown(text: object, *, newlines: bool = False) -> str:
    """`text` from outside longrun, safe in a Rich markup string: no controls, no markup."""
    return escape(printable(text, newlines=newlines))


def add_config_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("config", type=Path, help="job config file (YAML)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a value, e.g. --set training.steps=200 (repeatable; values are YAML)")


def load(args) -> JobConfig:
    return load_config(args.config, args.overrides)


def address(args) -> str:
    """The Jobs API address from --address or $RAY_ADDRESS; SubmitError saying how to give one."""
    found = args.address or os.environ.get("RAY_ADDRESS")
    if not found:
        from longrun.submit import SubmitError

        raise SubmitError("no cluster given: pass --address http://HOST:8265 or set RAY_ADDRESS")
    return found


def size(n: int | None) -> str:
    if n is None:
        return "?"
    if n < 1024:
        return f"{n} B"
    value = n / 1024
    for unit in ("KiB", "MiB", "GiB"):
        if value < 1024:
            return f"{value:.1f} {unit}"
        value /= 1024
    return f"{value:.1f} TiB"


def when(unix: float | None) -> str:
    return "?" if not unix else time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(unix))


def print_json(data) -> None:
    print(json.dumps(data, indent=1, default=str))


def job_errors(exc: Exception) -> int | None:
    """Exit 1 with the message for the errors of running and submitting jobs; None for others."""
    from longrun.config.runnable import UnsupportedJob
    from longrun.controller.driver import JobFailed
    from longrun.services import ServiceError
    from longrun.submit import SubmitError

    if isinstance(exc, ServiceError | JobFailed | UnsupportedJob | SubmitError):
        console.print(f"[red]error[/]: {shown(exc, newlines=True)}", highlight=False)
        return 1
    return None
