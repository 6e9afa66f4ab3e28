"""`longrun config validate|show`: a job config checked, or printed with its defaults filled in."""

from __future__ import annotations

from rich_argparse import RichHelpFormatter

from longrun.cli.common import add_config_args, load, out


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


def cmd_config_validate(args) -> int:
    cfg = load(args)
    workers = f"{cfg.world_size} worker{'s' if cfg.world_size != 1 else ''}"
    out.print(f"[green]ok[/]: {args.config} is a valid config for job [bold]{cfg.job.name}[/] "
              f"({workers}, fingerprint {cfg.fingerprint()})")
    return 0


def cmd_config_show(args) -> int:
    out.print(load(args).to_yaml(), end="", markup=False, highlight=False)
    return 0
