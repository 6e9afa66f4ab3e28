"""`longrun config dryrun CONFIG [--rank R]`: one rank of the job's real layout, built here.

    longrun config dryrun examples/llama-70b-pp.yaml              # the fullest rank of 128
    longrun config dryrun examples/llama-8b-64gpu.yaml --rank 9 --set parallelism.tp=4

The rest of the world is simulated by torch's fake process-group backend; see
`longrun.worker.dryrun`. Prints a table, then one JSON object as the last line.
"""

from __future__ import annotations

import json

from rich.table import Table
from rich_argparse import RichHelpFormatter

from longrun.cli.common import add_config_args, console, load, out, size

PLANNER_TOLERANCE = 0.10  # the planner should be within this of what a rank really holds


def add_parser(cfg_sub) -> None:
    dry = cfg_sub.add_parser(
        "dryrun", formatter_class=RichHelpFormatter,
        help="build one rank's real model shards and optimizer state on this machine's CPU (the rest "
        "of the world simulated) and compare them with `config plan`; the last line is JSON")
    add_config_args(dry)
    dry.add_argument("--rank", type=int, default=None,
                     help="the rank to build (default: the first rank of the stage `config plan` "
                     "calls fullest)")
    dry.set_defaults(func=cmd_config_dryrun)


def cmd_config_dryrun(args) -> int:
    from longrun.worker.dryrun import dry_run, fullest_rank

    cfg = load(args)
    rank = fullest_rank(cfg) if args.rank is None else args.rank
    if not 0 <= rank < cfg.world_size:
        console.print(f"[red]error[/]: --rank {rank} is outside the job's world of {cfg.world_size} ranks "
                      f"(0 to {cfg.world_size - 1})")
        return 2
    with console.status(f"building rank {rank} of {cfg.world_size} ({cfg.dims.layout_name}) on the CPU: "
                        "meta model, groups, every parallelism, its shards initialised, optimizer state"):
        report = dry_run(cfg, rank)
    table = Table(title=f"dry run of {cfg.job.name}: rank {rank} of {report.world} "
                  f"({', '.join(f'{k} {v}' for k, v in report.coords.items())})")
    table.add_column("")
    table.add_column("measured", justify="right")
    table.add_column("planned", justify="right")
    table.add_row("parameters + optimizer state", size(report.state_bytes), size(int(report.planned_bytes)))
    table.add_row("  parameters", size(report.param_bytes), "")
    table.add_row("  optimizer state", size(report.optimizer_bytes), "")
    table.add_row("peak host memory (RSS)", size(report.peak_rss_bytes), "")
    table.add_row("build (meta model, groups, parallelisms)", f"{report.build_s:.1f} s", "")
    table.add_row("initial weights of this rank's pieces", f"{report.init_s:.1f} s", "")
    table.add_row("optimizer state", f"{report.optimizer_s:.1f} s", "")
    out.print(table)
    error = report.planner_error
    if abs(error) > PLANNER_TOLERANCE:
        console.print(f"[yellow]warning[/]: `config plan` is off by {error:+.1%} for this rank's parameters "
                      "and optimizer state; please report it")
    else:
        out.print(f"the planner is within {abs(error):.1%} of what this rank holds")
    print(json.dumps(report.as_json()))
    return 0
