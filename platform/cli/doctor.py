"""`longrun doctor`: what this machine has and lacks, with how to fix each."""

from __future__ import annotations

from rich.table import Table
from rich_argparse import RichHelpFormatter

from longrun.cli.common import out


def add_parsers(sub) -> None:
    doctor = sub.add_parser("doctor", formatter_class=RichHelpFormatter,
                            help="check this machine: torch, ray, redis-server, prometheus, ports, GPUs")
    doctor.set_defaults(func=cmd_doctor)


def cmd_doctor(args) -> int:
    from longrun.doctor import FAIL, OK, run_checks

    checks = run_checks()
    table = Table(title="longrun doctor", show_lines=False)
    for col in ("check", "status", "detail", "how to fix"):
        table.add_column(col, overflow="fold")
    style = {OK: "green", "warn": "yellow", FAIL: "red"}
    for c in checks:
        table.add_row(c.name, f"[{style[c.status]}]{c.status}[/]", c.detail, c.fix)
    out.print(table)
    failed = [c.name for c in checks if c.status == FAIL]
    if failed:
        out.print(f"[red]missing or broken:[/] {', '.join(failed)}")
        return 1
    out.print("[green]ready[/]")
    return 0
