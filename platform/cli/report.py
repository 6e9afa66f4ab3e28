"""`longrun report`: a job's history as one self-contained HTML file, from its journal."""

from __future__ import annotations

import os
from pathlib import Path

from rich_argparse import RichHelpFormatter

from longrun.cli.common import ADDRESS_HELP, address, console, out, shown


def add_parsers(sub) -> None:
    report = sub.add_parser("report", formatter_class=RichHelpFormatter,
                            help="write a job's history (loss, throughput, timeline, goodput) as one HTML "
                            "file",
                            description="Read the journal in a job's run directory and write one HTML file "
                            "that opens offline: the job's state, loss by step per attempt, throughput, a "
                            "timeline of states, checkpoints, restores and faults, and time by phase. Works "
                            "while the job still runs (the report is as of the newest line written).")
    report.add_argument("job_dir", metavar="JOB_DIR_OR_ID",
                        help="the job's run directory, <output_dir>/<job name> (e.g. runs/tiny), or a "
                        "submission id: its directory on the cluster's head, where this machine sees it")
    report.add_argument("--address", default=None, help=ADDRESS_HELP + "; for a submission id")
    report.add_argument("--out", type=Path, default=None, metavar="FILE",
                        help="where to write the report (default: JOB_DIR/report.html)")
    report.set_defaults(func=cmd_report, errors=report_errors)


def cmd_report(args) -> int:
    from longrun.observability.report import write_report

    job_dir = Path(args.job_dir)
    if not job_dir.is_dir() and (args.address or os.environ.get("RAY_ADDRESS")):
        from longrun import submit

        job_dir = Path(submit.run_dir_of(address(args), args.job_dir))  # where its controller wrote
    with console.status(f"reading the journal of {shown(str(job_dir))}"):
        path = write_report(job_dir, args.out)
    out.print(f"[green]wrote[/] {shown(str(path))}", highlight=False)
    return 0


def report_errors(exc: Exception) -> int | None:
    """Exit 2 for a directory that holds no journal (a wrong request), 1 when writing failed."""
    from longrun.observability.report import ReportError

    if isinstance(exc, ReportError | OSError):
        console.print(f"[red]error[/]: {shown(exc, newlines=True)}", highlight=False)
        return 2 if isinstance(exc, ReportError) else 1
    return None
