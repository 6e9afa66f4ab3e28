"""The `longrun` command line.

    longrun run examples/tiny.yaml --set training.steps=50
    longrun config validate examples/tiny.yaml
    longrun config show examples/tiny.yaml --set parallelism.dp=2
    longrun doctor
    longrun checkpoint list runs/tiny/checkpoints
    longrun checkpoint inspect runs/tiny/checkpoints --step 120 --verify
    longrun checkpoint export runs/tiny/checkpoints --out tiny.safetensors
    longrun dashboards render
    longrun dashboards push --grafana-url http://127.0.0.1:3000 --prometheus-url http://prometheus:9090
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import sys
import time
from contextlib import ExitStack
from pathlib import Path

from rich.console import Console
from rich.markup import escape
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

    address_help = "the Ray dashboard / Jobs API address, e.g. http://127.0.0.1:8265 (default: $RAY_ADDRESS)"
    submit = sub.add_parser("submit", formatter_class=RichHelpFormatter,
                            help="submit a job to a Ray cluster (its controller runs there)",
                            description="Validate the config here, then submit the longrun controller as a "
                            "Ray job. Waits and streams the job's log unless --no-wait.")
    _add_config_args(submit)
    submit.add_argument("--address", default=None, help=address_help)
    submit.add_argument("--no-wait", action="store_true", help="return once submitted")
    submit.set_defaults(func=cmd_submit)
    for name, summary, func in (
        ("status", "the job's state: Ray's view and the controller's (attempt, step, evictions, events)",
         "cmd_status"),
        ("logs", "the job's log", "cmd_logs"),
        ("stop", "stop a job", "cmd_stop"),
    ):
        p = sub.add_parser(name, formatter_class=RichHelpFormatter, help=summary, description=summary)
        p.add_argument("id", help="the submission id `longrun submit` printed")
        p.add_argument("--address", default=None, help=address_help)
        if name == "logs":
            p.add_argument("--follow", "-f", action="store_true", help="keep streaming until the job ends")
        p.set_defaults(func=globals()[func])
    jobs = sub.add_parser("list", formatter_class=RichHelpFormatter, help="longrun jobs on a Ray cluster")
    jobs.add_argument("--address", default=None, help=address_help)
    jobs.set_defaults(func=cmd_list)

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
    _add_checkpoint_parser(sub)
    _add_dashboards_parser(sub)
    return parser


def _add_dashboards_parser(sub) -> None:
    dash = sub.add_parser("dashboards", formatter_class=RichHelpFormatter,
                          help="render longrun's Grafana dashboards and alert rules, or push them to Grafana")
    dash_sub = dash.add_subparsers(dest="dashboards_command", metavar="ACTION", required=True)
    render = dash_sub.add_parser("render", formatter_class=RichHelpFormatter,
                                 help="write the dashboard JSON and the Prometheus alert rules",
                                 description="Write every dashboard as Grafana JSON (same bytes each time) "
                                 "and the alert rules as a Prometheus rule file.")
    render.add_argument("--out", type=Path, default=Path("deploy/grafana/dashboards"), metavar="DIR",
                        help="dashboard directory (default: deploy/grafana/dashboards)")
    render.add_argument("--rules", type=Path, default=Path("deploy/prometheus/rules.yml"), metavar="FILE",
                        help="alert rule file (default: deploy/prometheus/rules.yml)")
    render.set_defaults(func=cmd_dashboards_render)
    push = dash_sub.add_parser("push", formatter_class=RichHelpFormatter,
                               help="upload the dashboards to Grafana (folder and datasource created "
                               "if missing)",
                               description="Upload the dashboards with overwrite into a folder, creating the "
                               "folder and a Prometheus datasource when missing. Credentials from the "
                               "environment: GRAFANA_TOKEN, or GRAFANA_USER and GRAFANA_PASSWORD.")
    push.add_argument("--grafana-url", default=os.environ.get("GRAFANA_URL"),
                      help="e.g. http://127.0.0.1:3000 (default: $GRAFANA_URL)")
    push.add_argument("--folder", default="longrun", help="Grafana folder title (default: longrun)")
    push.add_argument("--prometheus-url", default=None,
                      help="Prometheus as Grafana's server reaches it; needed only to create the datasource")
    push.set_defaults(func=cmd_dashboards_push)


def _add_checkpoint_parser(sub) -> None:
    ckpt = sub.add_parser("checkpoint", formatter_class=RichHelpFormatter,
                          help="list, inspect, verify or export the checkpoints of a job",
                          description="Read a checkpoint root (any fsspec URL: a path, s3://..., "
                          "memory://...); nothing under it is changed.")
    ckpt_sub = ckpt.add_subparsers(dest="checkpoint_command", metavar="ACTION", required=True)

    def action(name: str, func, summary: str, description: str) -> argparse.ArgumentParser:
        p = ckpt_sub.add_parser(name, formatter_class=RichHelpFormatter, help=summary,
                                description=description)
        p.add_argument("dir", nargs="?", metavar="DIR",
                       help="the checkpoint root (step-NNNNNNNN/ directories and `latest`)")
        p.add_argument("--config", type=Path, metavar="JOB.yaml",
                       help="take the root from a job config (its checkpoint.dir) instead of DIR")
        p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                       help="override a value of --config, e.g. --set job.output_dir=/data/runs")
        p.set_defaults(func=func, parser=p)
        return p

    ls = action("list", cmd_checkpoint_list, "the committed steps, and saves in progress",
                "List the committed checkpoints (step, time, size, shards, layout; the one `latest` "
                "names is marked) and the step-N.tmp directories of saves in progress or abandoned. "
                "Exit 2 if there are none.")
    ls.add_argument("--json", action="store_true", help="print JSON instead of a table")

    inspect = action("inspect", cmd_checkpoint_inspect,
                     "one checkpoint: manifest, model config, parameter count; --verify its shards",
                     "Show a committed checkpoint: its manifest, the model config it was trained "
                     "with and the parameter count of its weights. --verify re-hashes every shard "
                     "against the manifest's SHA-256 (exit 1 if any is corrupt or missing).")
    inspect.add_argument("--step", type=int, help="the step (default: the newest committed)")
    inspect.add_argument("--verify", action="store_true", help="re-check every shard's checksum")
    inspect.add_argument("--json", action="store_true", help="print JSON instead of tables")

    export = action("export", cmd_checkpoint_export,
                    "write the model weights to one file (safetensors or torch)",
                    "Write the model state_dict of a committed checkpoint to one file that loads "
                    "without longrun: safetensors (model config and step in its metadata) or a "
                    "torch.save file. The shard's checksum is verified first.")
    export.add_argument("--out", required=True, metavar="FILE",
                        help="the file to write (a path or fsspec URL); .safetensors or .pt")
    export.add_argument("--step", type=int, help="the step (default: the newest committed)")
    export.add_argument("--format", choices=("safetensors", "torch"),
                        help="default: from the extension of --out")
    export.add_argument("--force", action="store_true", help="replace --out if it exists")


def cmd_dashboards_render(args) -> int:
    from longrun.observability import alerts, dashboards

    for path in dashboards.render(args.out):
        out.print(f"[green]wrote[/] {escape(str(path))}", highlight=False)
    out.print(f"[green]wrote[/] {escape(str(alerts.render_rules(args.rules)))}", highlight=False)
    return 0


def cmd_dashboards_push(args) -> int:
    from longrun.observability.grafana import GrafanaPushError, credential_from_env, push_dashboards

    if not args.grafana_url:
        raise GrafanaPushError("no Grafana given: pass --grafana-url http://HOST:3000 or set GRAFANA_URL")
    result = push_dashboards(args.grafana_url, folder=args.folder, prometheus_url=args.prometheus_url,
                             credential=credential_from_env())
    if result.folder_created:
        out.print(f"created folder [bold]{escape(args.folder)}[/] ({result.folder_uid})", highlight=False)
    if result.datasource_created:
        out.print(f"created Prometheus datasource for {escape(args.prometheus_url)}", highlight=False)
    base = args.grafana_url.rstrip("/")
    for uid, url in zip(result.dashboards, result.urls, strict=True):
        out.print(f"[green]pushed[/] {uid}: {escape(base + url if url else uid)}", highlight=False)
    return 0


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


def _checkpoint_root(args) -> str:
    if (args.dir is None) == (args.config is None):
        args.parser.error("give the checkpoint root as DIR, or a job config with --config (not both)")
    if args.config is None:
        if args.overrides:
            args.parser.error("--set applies to --config")
        return args.dir
    return load_config(args.config, args.overrides).checkpoint_dir


def _size(n: int | None) -> str:
    if n is None:
        return "?"
    if n < 1024:
        return f"{n} B"
    size = n / 1024
    for unit in ("KiB", "MiB", "GiB"):
        if size < 1024:
            return f"{size:.1f} {unit}"
        size /= 1024
    return f"{size:.1f} TiB"


def _when(unix: float | None) -> str:
    return "?" if not unix else time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(unix))


def _print_json(data) -> None:
    print(json.dumps(data, indent=1, default=str))


def cmd_checkpoint_list(args) -> int:
    from longrun.checkpoint.export import list_checkpoints

    listing = list_checkpoints(_checkpoint_root(args))
    if args.json:
        _print_json(listing.to_json())
    else:
        table = Table(title=f"checkpoints in {escape(listing.root)}")
        for col in ("step", "created", "size", "shards", "world/dp", "latest"):
            table.add_column(col, justify="right" if col in ("step", "size", "shards") else "left")
        for e in listing.steps:
            if e.error:
                table.add_row(str(e.step), f"[red]unreadable manifest[/]: {escape(e.error)}", "", "", "", "")
                continue
            table.add_row(str(e.step), _when(e.created_unix), _size(e.total_bytes), str(e.shards),
                          f"{e.world_size}/{e.dp_size}", "[green]<- latest[/]" if e.latest else "")
        if listing.steps:
            out.print(table)
        for p in listing.pending:
            out.print(f"[yellow]in progress or abandoned[/]: {escape(p.path)} ({p.files} files, "
                      f"{_size(p.total_bytes)}; not a checkpoint until committed)", highlight=False)
        if listing.latest_problem:
            out.print(f"[yellow]note[/]: {escape(listing.latest_problem)}", highlight=False)
    if not listing.steps:
        console.print(f"[red]error[/]: no committed checkpoint under {escape(listing.root)} "
                      f"(only {len(listing.pending)} save(s) in progress or abandoned)", highlight=False)
        return 2
    return 0


def _key_values(rows, title: str | None = None) -> Table:
    table = Table(title=title, show_header=False, box=None, title_justify="left", padding=(0, 2, 0, 2))
    table.add_column(style="bold")
    table.add_column(overflow="fold")
    for key, value in rows:
        table.add_row(key, value)
    return table


def cmd_checkpoint_inspect(args) -> int:
    from longrun.checkpoint.export import inspect_checkpoint

    result = inspect_checkpoint(_checkpoint_root(args), args.step, verify=args.verify)
    failed = bool(result.corrupt) or result.weights_error is not None
    if args.json:
        _print_json(result.to_json())
        return 1 if failed else 0
    m = result.manifest
    out.print(f"[bold]{escape(result.path)}[/]" + (" [green](latest)[/]" if result.latest else ""),
              highlight=False)
    out.print(_key_values([
        ("step", str(m.step)),
        ("created", _when(m.created_unix)),
        ("layout", f"{m.world_size} rank(s), data-parallel {m.dp_size}"),
        ("fingerprint", m.config_fingerprint),
        ("format", str(m.format)),
        ("files", f"{len(m.files)}, {_size(sum(f.bytes for f in m.files.values()))}: "
                  + ", ".join(sorted(m.files))),
    ]))
    out.print(_key_values([(k, json.dumps(v)) for k, v in m.model.items()], title="model"))
    w = result.weights
    if w is not None:
        dtypes = ", ".join(sorted(w.dtypes))
        tied = f"; tied: {' = '.join(w.tied)}" if w.tied else ""
        out.print(f"[bold]parameters[/]: {w.parameters:,} ({w.tensors} tensors, {dtypes}, "
                  f"{_size(w.bytes)}{tied})", highlight=False)
    else:
        out.print(f"[red]weights unreadable[/]: {escape(result.weights_error)}", highlight=False)
    if result.checks is not None:
        table = Table(title="verify")
        for col in ("file", "bytes", "status", "detail"):
            table.add_column(col, justify="right" if col == "bytes" else "left")
        for c in result.checks:
            status = f"[green]{c.status}[/]" if c.status == "OK" else f"[red]{c.status}[/]"
            table.add_row(c.name, f"{c.bytes:,}", status, c.detail)
        out.print(table)
        if result.corrupt:
            out.print(f"[red]CORRUPT[/]: {len(result.corrupt)} of {len(result.checks)} shards do not "
                      f"match the manifest: {', '.join(result.corrupt)}", highlight=False)
        else:
            out.print(f"[green]all {len(result.checks)} shards OK[/]")
    return 1 if failed else 0


def cmd_checkpoint_export(args) -> int:
    from longrun.checkpoint.export import export_weights

    root = _checkpoint_root(args)
    with console.status(f"exporting the model weights of {root} to {args.out}"):
        result = export_weights(root, args.out, step=args.step, fmt=args.format, overwrite=args.force)
    out.print(f"[green]wrote[/] {escape(result.out)} ({result.format}, {_size(result.bytes)}): "
              f"{result.parameters:,} parameters in {result.tensors} tensors from {escape(result.source)}",
              highlight=False)
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
                # One logical CPU per worker at least, so a multi-worker job fits on one machine.
                head = stack.enter_context(EmbeddedRay(num_cpus=max(os.cpu_count() or 1, cfg.world_size)))
            address = head.address
            console.print(f"ray: embedded head at {address}, dashboard {head.dashboard_url}")
        ray.init(address=address, logging_level="warning", configure_logging=True, log_to_driver=True)
        stack.callback(ray.shutdown)

        def on_event(line: str) -> None:
            console.print(f"[cyan]{escape(line)}[/]", highlight=False)

        summary = run_job(cfg, redis_url, on_event=on_event)
    done = f"[green]done[/]: {summary['step']} steps"
    if summary.get("resumed_from"):
        done += f" (resumed from step {summary['resumed_from']})"
    if summary.get("loss") is not None:
        done += f", final loss {summary['loss']:.4f}"
    console.print(done)
    return 0


def _address(args) -> str:
    address = args.address or os.environ.get("RAY_ADDRESS")
    if not address:
        from longrun.submit import SubmitError

        raise SubmitError("no cluster given: pass --address http://HOST:8265 or set RAY_ADDRESS")
    return address


def cmd_submit(args) -> int:
    from longrun import submit

    cfg = _load(args)  # a bad config is refused here, before anything reaches the cluster
    address = _address(args)
    job_id = submit.submit(cfg, address)
    console.print(f"submitted [bold]{job_id}[/] to {address}", highlight=False)
    if args.no_wait:
        print(job_id)
        return 0
    submit.logs(address, job_id, follow=True, write=lambda chunk: print(chunk, end="", flush=True))
    final = submit.wait(address, job_id, timeout_s=60)
    console.print(f"job {job_id}: {final}", highlight=False)
    return 0 if final == "SUCCEEDED" else 1


def cmd_status(args) -> int:
    from longrun import submit

    info = submit.status(_address(args), args.id)
    view = info["controller"]
    out.print(f"job {info['id']}: ray {info['ray_status']}"
                  + (f" ({escape(info['message'])})" if info["message"] else ""), highlight=False)
    out.print(f"controller: {view.state or 'not started'}"
                  + (f" ({escape(view.reason)})" if view.reason else ""), highlight=False)
    out.print(f"attempt {view.attempt}, step {view.step or '-'}"
                  + (f", loss {view.loss:.4f}" if view.loss is not None else ""), highlight=False)
    out.print(f"evicted nodes: {', '.join(view.evicted) or 'none'}", highlight=False)
    for line in view.events:
        out.print(f"  {escape(line)}", highlight=False)
    return 0


def cmd_logs(args) -> int:
    from longrun import submit

    submit.logs(_address(args), args.id, follow=args.follow,
                write=lambda chunk: print(chunk, end="", flush=True))
    return 0


def cmd_stop(args) -> int:
    from longrun import submit

    stopped = submit.stop(_address(args), args.id)
    out.print(f"{args.id}: {'stop requested' if stopped else 'already ended'}", highlight=False)
    return 0


def cmd_list(args) -> int:
    from longrun import submit

    jobs = submit.list_jobs(_address(args))
    if not jobs:
        out.print("no longrun jobs on this cluster")
    for job in jobs:
        out.print(f"{job['id']}  {job['status']:10s}  {job['job']}", highlight=False)
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
        if args.command == "checkpoint":
            return _checkpoint_error(exc)
        if args.command == "dashboards":
            return _dashboards_error(exc)
        from longrun.controller.driver import JobFailed, UnsupportedJob
        from longrun.services import ServiceError
        from longrun.submit import SubmitError

        if isinstance(exc, ServiceError | JobFailed | UnsupportedJob | SubmitError):
            console.print(f"[red]error[/]: {exc}", highlight=False)
            return 1
        raise


def _dashboards_error(exc: Exception) -> int:
    from longrun.observability.grafana import GrafanaPushError

    if isinstance(exc, GrafanaPushError | OSError):
        console.print(f"[red]error[/]: {escape(str(exc))}", highlight=False)
        return 1
    raise exc


def _checkpoint_error(exc: Exception) -> int:
    """Exit 2 for a wrong request (no such directory or step, bad --out), 1 for a checkpoint
    that cannot be read (corrupt shard, bad manifest)."""
    from longrun.checkpoint import CorruptShardError, ManifestError
    from longrun.checkpoint.export import CheckpointNotFound, ExportError

    if isinstance(exc, CheckpointNotFound | ExportError):
        console.print(f"[red]error[/]: {escape(str(exc))}", highlight=False)
        return 2
    if isinstance(exc, CorruptShardError | ManifestError):
        console.print(f"[red]error[/]: {escape(str(exc))}", highlight=False)
        return 1
    raise exc


if __name__ == "__main__":
    sys.exit(main())
