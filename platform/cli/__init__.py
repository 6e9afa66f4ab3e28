"""The `longrun` command line: one module per command family, `main` here.

    longrun run examples/tiny.yaml --set training.steps=50
    longrun submit examples/tiny.yaml --address http://HEAD:8265
    longrun status|logs|stop JOB_ID --address http://HEAD:8265; longrun list --address ...
    longrun config validate examples/tiny.yaml
    longrun config show examples/tiny.yaml --set parallelism.dp=2
    longrun doctor
    longrun checkpoint list runs/tiny/checkpoints
    longrun checkpoint inspect runs/tiny/checkpoints --step 120 --verify
    longrun checkpoint export runs/tiny/checkpoints --out tiny.safetensors
    longrun tokenizer train corpus/ --vocab-size 8192 --out runs/tok
    longrun data prepare corpus/ web.jsonl --tokenizer runs/tok --out data/web
    longrun dashboards render
    longrun dashboards push --grafana-url http://127.0.0.1:3000 --prometheus-url http://prometheus:9090

A command ends with exit 0, 1 (it failed: the reason is printed), 2 (a wrong request: a bad
config, no such checkpoint) or 130 (interrupted). Each family maps the errors users can hit
to a sentence (`errors` in its parser's defaults); anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import os
import time

# A command line imports this module first: its import is (within a fraction of a second) when
# the process was launched, which is where a job's goodput clock starts. Taken before the
# imports below, which take a second or more.
IMPORTED_AT = time.time()

from rich_argparse import RichHelpFormatter  # noqa: E402

from longrun.cli import checkpoint, config, dashboards, data, doctor, jobs, report, run  # noqa: E402
from longrun.cli.common import console, job_errors, shown  # noqa: E402
from longrun.config import ConfigError  # noqa: E402

FAMILIES = (run, jobs, config, doctor, checkpoint, data, dashboards, report)  # in the order --help lists them

__all__ = ["build_parser", "main"]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="longrun", formatter_class=RichHelpFormatter,
        description="Fault-tolerant training jobs on Ray: run, watch, recover.")
    try:
        version = importlib.metadata.version("longrun")
    except importlib.metadata.PackageNotFoundError:
        version = "unknown"
    parser.add_argument("--version", action="version", version=f"longrun {version}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for family in FAMILIES:
        family.add_parsers(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    args = build_parser().parse_args(argv)
    # Launched: this process's start on a real command line (argv None), the call otherwise.
    args.launched_at = IMPORTED_AT if argv is None else time.time()
    try:
        return args.func(args)
    except ConfigError as exc:
        # The message quotes the config (keys, values): markup and control characters in it are
        # the file's, shown as text ("[/x]" as a key had crashed Rich's markup parser).
        console.print(f"[red]error[/]: {shown(exc, newlines=True)}", highlight=False)
        return 2
    except KeyboardInterrupt:
        console.print("[yellow]interrupted[/]")
        return 130
    except Exception as exc:
        code = getattr(args, "errors", job_errors)(exc)
        if code is None:
            raise
        return code
