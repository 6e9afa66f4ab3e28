"""`longrun dashboards render|push`: the Grafana dashboards and alert rules, as files or uploaded."""

from __future__ import annotations

import os
from pathlib import Path

from rich_argparse import RichHelpFormatter

from longrun.cli.common import console, out, shown


def add_parsers(sub) -> None:
    dash = sub.add_parser("dashboards", formatter_class=RichHelpFormatter,
                          help="render longrun's Grafana dashboards and alert rules, or push them to Grafana")
    dash.set_defaults(errors=dashboards_errors)
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
                      help="e.g. http://127.0.0.1:3000 (default: $GRAFANA_URL, else the job's "
                      "observability.grafana_url with --config)")
    push.add_argument("--config", type=Path, default=None, metavar="JOB.yaml",
                      help="a job config whose observability.grafana_url names the Grafana")
    push.add_argument("--folder", default="longrun", help="Grafana folder title (default: longrun)")
    push.add_argument("--prometheus-url", default=None,
                      help="Prometheus as Grafana's server reaches it; needed only to create the datasource")
    push.set_defaults(func=cmd_dashboards_push)


def cmd_dashboards_render(args) -> int:
    from longrun.observability import alerts, dashboards

    for path in dashboards.render(args.out):
        out.print(f"[green]wrote[/] {shown(str(path))}", highlight=False)
    out.print(f"[green]wrote[/] {shown(str(alerts.render_rules(args.rules)))}", highlight=False)
    return 0


def cmd_dashboards_push(args) -> int:
    from longrun.observability.grafana import GrafanaPushError, credential_from_env, push_dashboards

    if not args.grafana_url and args.config is not None:
        from longrun.config import load_config

        args.grafana_url = load_config(args.config).observability.grafana_url
    if not args.grafana_url:
        raise GrafanaPushError("no Grafana given: pass --grafana-url http://HOST:3000, set GRAFANA_URL, "
                               "or name a job config whose observability.grafana_url is set (--config)")
    result = push_dashboards(args.grafana_url, folder=args.folder, prometheus_url=args.prometheus_url,
                             credential=credential_from_env())
    if result.folder_created:
        out.print(f"created folder [bold]{shown(args.folder)}[/] ({result.folder_uid})", highlight=False)
    if result.datasource_created:
        out.print(f"created Prometheus datasource for {shown(args.prometheus_url)}", highlight=False)
    base = args.grafana_url.rstrip("/")
    for uid, url in zip(result.dashboards, result.urls, strict=True):
        out.print(f"[green]pushed[/] {uid}: {shown(base + url if url else uid)}", highlight=False)
    return 0


def dashboards_errors(exc: Exception) -> int | None:
    from longrun.observability.grafana import GrafanaPushError

    if isinstance(exc, GrafanaPushError | OSError):
        console.print(f"[red]error[/]: {shown(exc, newlines=True)}", highlight=False)
        return 1
    return None
