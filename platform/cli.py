"""The `longrun` command line.

    longrun run examples/tiny.yaml --set training.steps=50
    longrun config validate examples/tiny.yaml
    longrun config show examples/tiny.yaml --set parallelism.dp=2
    longrun doctor
"""

from __future__ import annotations

import argparse
import importlib.metadata
import os
import sys
from contextlib import ExitStack
from pathlib import Path

from rich.console import Console
from rich.table import Table
from rich_argparse import RichHelpFormatter

from longrun.config import ConfigError, JobConfig, load_config

console = Console(stderr=True, soft_wrap=True)
out = Console(soft_wrap=True)


def _add_config_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("config", type=Path, help="job config file (YAML)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a value, e.g. --set training.steps=200 (repeatable; values are YAML)")


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

    run = sub.add_parser("run", formatter_class=RichHelpFormatter,
                         help="run a job here, starting Redis and Ray locally when none is configured",
                         description="Run a job on this machine. Starts an embedded Redis and a Ray head "
                         "on 127.0.0.1 unless cluster.redis_url / cluster.address name existing ones.")
    _add_config_args(run)
    run.set_defaults(func=cmd_run)

    cfg = sub.add_parser("config", formatter_class=RichHelpFormatter, help="validate or show a job config")
    cfg_sub = cfg.add_subparsers(dest="config_command", metavar="ACTION", required=True)
    validate = cfg_sub.add_parser("validate", formatter_class=RichHelpFormatter,
                                  help="check a config; exit 2 with every problem listed if invalid")
    _add_config_args(validate)
    validate.set_defaults(func=cmd_config_validate)
    show = cfg_sub.add_parser("show", formatter_class=RichHelpFormatter,
                              help="print the resolved config (defaults filled in) as YAML")
    _add_config_args(show)
    show.set_defaults(func=cmd_config_show)

    doctor = sub.add_parser("doctor", formatter_class=RichHelpFormatter,
                            help="check this machine: torch, ray, redis-server, prometheus, ports, GPUs")
    doctor.set_defaults(func=cmd_doctor)
    return parser


def _load(args) -> JobConfig:
    return load_config(args.config, args.overrides)


def cmd_config_validate(args) -> int:
    cfg = _load(args)
    workers = f"{cfg.world_size} worker{'s' if cfg.world_size != 1 else ''}"
    out.print(f"[green]ok[/]: {args.config} is a valid config for job [bold]{cfg.job.name}[/] "
              f"({workers}, fingerprint {cfg.fingerprint()})")
    return 0


def cmd_config_show(args) -> int:
    out.print(_load(args).to_yaml(), end="", markup=False, highlight=False)
    return 0


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


def cmd_run(args) -> int:
    cfg = _load(args)
    from longrun.services.ray_head import LOOPBACK_ENV

    if cfg.cluster.address is None:
        # Ray reads these when it is first imported, so before anything imports it.
        os.environ.update(LOOPBACK_ENV)
    from longrun.controller.driver import check_supported

    check_supported(cfg)
    run_dir = Path(cfg.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.yaml").write_text(cfg.to_yaml())
    console.print(f"[bold]longrun[/] job [bold]{cfg.job.name}[/]: {cfg.world_size} worker(s), "
                  f"{cfg.training.steps} steps; resolved config in {run_dir / 'config.yaml'}")

    import ray

    from longrun.controller.driver import run_job
    from longrun.services import EmbeddedRay, EmbeddedRedis

    with ExitStack() as stack:
        redis_url = cfg.cluster.redis_url
        if redis_url is None:
            with console.status("starting an embedded Redis on 127.0.0.1"):
                server = stack.enter_context(EmbeddedRedis())
            redis_url = server.url
            console.print(f"redis: embedded on 127.0.0.1:{server.port} (password protected)")
        address = cfg.cluster.address
        if address is None:
            with console.status("starting an embedded Ray head on 127.0.0.1 (takes ~10 s)"):
                head = stack.enter_context(EmbeddedRay())
            address = head.address
            console.print(f"ray: embedded head at {address}, dashboard {head.dashboard_url}")
        ray.init(address=address, logging_level="warning", configure_logging=True, log_to_driver=True)
        stack.callback(ray.shutdown)

        def on_state(state, reason):
            console.print(f"[cyan]state[/] {state}: {reason}")

        summary = run_job(cfg, redis_url, on_state=on_state)
    console.print(f"[green]done[/]: {summary['step']} steps, final loss {summary['loss']:.4f}")
    return 0


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except ConfigError as exc:
        console.print(f"[red]error[/]: {exc}", markup=True, highlight=False)
        return 2
    except KeyboardInterrupt:
        console.print("[yellow]interrupted[/]")
        return 130
    except Exception as exc:
        from longrun.controller.driver import JobFailed, UnsupportedJob
        from longrun.services import ServiceError

        if isinstance(exc, ServiceError | JobFailed | UnsupportedJob):
            console.print(f"[red]error[/]: {exc}", highlight=False)
            return 1
        raise


if __name__ == "__main__":
    sys.exit(main())
