"""`longrun config validate|show|plan|dryrun`: a job config checked (valid, and runnable by this
longrun), printed with its defaults filled in, its per-rank memory estimated for its layout, or
one of its ranks built for real on this machine (`dryrun.py`)."""

from __future__ import annotations

from rich_argparse import RichHelpFormatter

from longrun.cli import dryrun
from longrun.cli.common import add_config_args, load, out
from longrun.config import ConfigError
from longrun.config.memory import GB, pipeline_micro_batches, plan_for, stage_plans
from longrun.config.runnable import runnable_problems
from longrun.parallel.schedules import stages_per_rank


def add_parsers(sub) -> None:
    cfg = sub.add_parser("config", formatter_class=RichHelpFormatter,
                         help="validate, show or plan a job config (memory per rank)")
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
    dryrun.add_parser(cfg_sub)


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
    from longrun.trainer.schedule import describe

    cfg = load(args)
    out.print(cfg.to_yaml(), end="", markup=False, highlight=False)
    # A YAML comment, so the output still loads as the config it shows.
    out.print(f"# learning rate: {describe(cfg.training)}", markup=False, highlight=False,
              soft_wrap=True)
    return 0


def _print_stages(cfg) -> None:
    """Each pipeline rank's blocks and memory, and the idle share its schedule implies."""
    from rich.table import Table

    from longrun.parallel.schedules import bubble_fraction

    tr, par, dims = cfg.training, cfg.parallelism, cfg.dims
    micro_batches = pipeline_micro_batches(tr, cfg.data, dims)
    table = Table(title=f"pipeline: {tr.pp_schedule}, {dims.pp} ranks x "
                  f"{stages_per_rank(tr.pp_schedule, par.pp_virtual_stages)} stage(s), {micro_batches} "
                  "micro-batches per step")
    for column in ("pp rank", "blocks", "weights + grads + optimizer GB", "activations GB",
                   "in flight", "total GB"):
        table.add_column(column, justify="right")
    for p in stage_plans(cfg.model, dims, tr, cfg.data, on_gpu=cfg.cluster.device != "cpu",
                         parallelism=par):
        table.add_row(str(p.pp_rank), str(p.layers), f"{(p.parameters + p.gradients + p.optimizer) / GB:.2f}",
                      f"{p.activations / GB:.2f}", f"{p.in_flight:g}", f"{p.total_bytes / GB:.2f}")
    out.print(table)
    bubble = bubble_fraction(tr.pp_schedule, dims.pp, micro_batches, par.pp_virtual_stages)
    out.print(f"bubble: {bubble:.1%} of each step idle per rank (equal stages; more micro-batches "
              "or virtual stages shrink it)")


def _print_deadlines(cfg) -> None:
    """How an attempt of this job starts: each phase in order with its deadline and why."""
    from rich.table import Table

    from longrun.health.startup import collective_note, startup_deadlines

    deadlines = startup_deadlines(cfg)
    table = Table(title="start-up: each phase in order and how long it may take before the rank is "
                  "declared hung (health.startup; steps after the first: health.hang_timeout_s)")
    for column, justify in (("phase", "left"), ("deadline s", "right"), ("from", "left")):
        table.add_column(column, justify=justify)
    for row in deadlines:
        table.add_row(str(row.phase), f"{row.seconds:.0f}", row.why)
    out.print(table)
    out.print(f"every process group: health.collective_timeout_s {cfg.health.collective_timeout_s:g} s; "
              "the restore's storage rate is re-measured by each restore from storage")
    note = collective_note(cfg, deadlines)
    if note:
        out.print(f"[yellow]note[/]: {note}")


def cmd_config_plan(args) -> int:
    cfg = load(args)
    from rich.table import Table

    plan, dims = plan_for(cfg), cfg.dims
    fullest = f" (the fullest pipeline rank: {plan.pp_rank})" if plan.pp_rank is not None else ""
    ranks = f"{cfg.world_size} rank{'s' if cfg.world_size != 1 else ''}"
    table = Table(title=f"memory per rank{fullest}: {cfg.job.name}, layout {dims.layout_name} "
                  f"({ranks}: dp {dims.dp} x fsdp {dims.fsdp} x pp {dims.pp} x cp {dims.cp} "
                  f"x tp {dims.tp}), activation checkpointing {cfg.training.activation_checkpointing}")
    # A small job's parts are megabytes: in GB with two decimals they all read 0.00.
    unit, scale = ("GB", GB) if plan.total_bytes >= GB else ("MB", GB / 1000)
    table.add_column("part")
    table.add_column(unit, justify="right")
    for name, nbytes in plan.rows():
        table.add_row(name, f"{nbytes / scale:.2f}", style="bold" if name == "total" else None)
    out.print(table)
    if dims.pp > 1:
        _print_stages(cfg)
    _print_deadlines(cfg)
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
