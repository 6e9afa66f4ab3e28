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

console = Console(stderr=True, soft_wrap=True)  # progress and errors
out = Console(soft_wrap=True)  # results
ADDRESS_HELP = "the Ray dashboard / Jobs API address, e.g. http://127.0.0.1:8265 (default: $RAY_ADDRESS)"


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
        console.print(f"[red]error[/]: {escape(str(exc))}", highlight=False)
        return 1
    return None
