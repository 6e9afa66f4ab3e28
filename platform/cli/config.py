"""`longrun config validate|show|plan`: a job config checked (valid, and runnable by this longrun),
printed with its defaults filled in, or its per-rank memory estimated for its layout."""

from __future__ import annotations

from rich_argparse import RichHelpFormatter

from longrun.cli.common import add_config_args, load, out
from longrun.config import ConfigError
from longrun.config.memory import GB, plan_for
from longrun.config.runnable import runnable_problems


def add_parsers(sub) -> None:
    cfg = sub.add_parser("config", formatter_class=RichHelpFormatter, help="validate or show a job config")
    cfg_sub = cfg.add_subparsers(dest="config_command", metavar="ACTION", required=True)
    validate = cfg_sub.add_parser("validate", formatter_class=RichHelpFormatter,
                                  help="check a config; exit 2 with every problem listed if invalid")
    add_config_args(validate)
    validate.set_defaults(func=cmd_config_validate)
    show = cfg_sub.add_parser("show", formatter_class=RichHelpFormatter,
                              help="print the resolved config (defaults filled in) as YAML")
    add_config_args(show)
    show.set_defaults(func=cmd_config_show)
    plan = cfg_sub.add_parser("plan", formatter_class=RichHelpFormatter,
                              help="estimate the memory one rank needs at the config's layout; exit 2 "
                              "if it does not fit cluster.device_memory_gb, naming the knob to turn")
    add_config_args(plan)
    plan.set_defaults(func=cmd_config_plan)


def cmd_config_validate(args) -> int:
    cfg = load(args)
    problems = runnable_problems(cfg)
    if problems:  # valid, but `run` and `submit` would refuse it: say so here too
        raise ConfigError(str(args.config), problems)
    workers = f"{cfg.world_size} worker{'s' if cfg.world_size != 1 else ''}"
    out.print(f"[green]ok[/]: {args.config} is a valid config for job [bold]{cfg.job.name}[/] "
              f"({workers}, fingerprint {cfg.fingerprint()})")
    return 0


def cmd_config_show(args) -> int:
    out.print(load(args).to_yaml(), end="", markup=False, highlight=False)
    return 0


def cmd_config_plan(args) -> int:
    cfg = load(args)
    from rich.table import Table

    plan, dims = plan_for(cfg), cfg.dims
    table = Table(title=f"memory per rank: {cfg.job.name}, layout {dims.layout_name} ({cfg.world_size} "
                  f"ranks: dp {dims.dp} x fsdp {dims.fsdp} x cp {dims.cp} x tp {dims.tp}), activation "
                  f"checkpointing {cfg.training.activation_checkpointing}")
    table.add_column("part")
    table.add_column("GB", justify="right")
    for name, nbytes in plan.rows():
        table.add_row(name, f"{nbytes / GB:.2f}", style="bold" if name == "total" else None)
    out.print(table)
    limit = cfg.cluster.device_memory_gb
    problems = runnable_problems(cfg)
    if problems:
        raise ConfigError(str(args.config), problems)
    if limit is None:
        out.print("cluster.device_memory_gb is not set: nothing to check the estimate against")
    else:
        out.print(f"[green]fits[/]: {plan.total_bytes / GB:.1f} GB of {limit:g} GB per rank "
                  f"({plan.total_bytes / (limit * GB):.0%})")
    return 0
