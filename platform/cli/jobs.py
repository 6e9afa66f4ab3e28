"""`longrun submit|status|logs|stop|list`: jobs on a Ray cluster, through its Jobs API."""

from __future__ import annotations

import os

from rich_argparse import RichHelpFormatter

from longrun.cli.common import ADDRESS_HELP, add_config_args, address, console, load, out, shown


def add_parsers(sub) -> None:
    submit = sub.add_parser("submit", formatter_class=RichHelpFormatter,
                            help="submit a job to a Ray cluster (its controller runs there)",
                            description="Validate the config here, then submit the longrun controller as a "
                            "Ray job, with this longrun shipped along (the cluster's python needs longrun's "
                            "dependencies, not longrun). Waits and streams the job's log unless --no-wait.")
    add_config_args(submit)
    submit.add_argument("--address", default=None, help=ADDRESS_HELP)
    submit.add_argument("--no-wait", action="store_true", help="return once submitted")
    submit.add_argument("--python", default=None, metavar="PYTHON",
                        help="the interpreter that runs the controller on the cluster's head, on its PATH "
                        "or a path there: one with torch, ray and longrun's other dependencies "
                        "(default: python3)")
    submit.set_defaults(func=cmd_submit)
    for name, summary, func in (
        ("status", "the job's state: Ray's view and the controller's (attempt, step, evictions, events)",
         cmd_status),
        ("logs", "the job's log", cmd_logs),
        ("stop", "stop a job", cmd_stop),
    ):
        p = sub.add_parser(name, formatter_class=RichHelpFormatter, help=summary, description=summary)
        p.add_argument("id", help="the submission id `longrun submit` printed"
                       + (", or a job's directory with --rank" if name == "logs" else ""))
        p.add_argument("--address", default=None, help=ADDRESS_HELP)
        p.set_defaults(func=func)
    sub.choices["logs"].add_argument("--follow", "-f", action="store_true",
                                     help="keep streaming until the job ends")
    sub.choices["logs"].add_argument(
        "--rank", type=int, default=None, metavar="R",
        help="one rank's own log instead of the job's; ID may then also be the job's directory "
        "(<output_dir>/<job>). A submitted job's files are on the cluster's head: readable here only "
        "where this machine sees that path")
    sub.choices["logs"].add_argument("--attempt", type=int, default=None, metavar="A",
                                     help="with --rank: that attempt's log (default: the newest)")
    sub.choices["stop"].add_argument(
        "--force", action="store_true",
        help="stop at once without saving (default: every worker saves at the next step boundary "
        "and the job ends PREEMPTED); needs the job's Redis, found as for status")
    sub.choices["stop"].add_argument("--redis-url", default=None, metavar="URL",
                                     help="the job's Redis, for --force (as for status)")
    sub.choices["status"].add_argument(
        "--redis-url", default=None, metavar="URL",
        help="read the job record from this Redis (default: $LONGRUN_REDIS_URL; its password may be "
        "written ${LONGRUN_REDIS_PASSWORD}, taken from that variable). Without it, the Redis the job's "
        "config named, only if that needs no password: a password goes only to the Redis you name. "
        "Failing both, the controller's log")
    jobs = sub.add_parser("list", formatter_class=RichHelpFormatter, help="longrun jobs on a Ray cluster")
    jobs.add_argument("--address", default=None, help=ADDRESS_HELP)
    jobs.set_defaults(func=cmd_list)


def _print_chunk(chunk: str) -> None:
    print(chunk, end="", flush=True)


def cmd_submit(args) -> int:
    from longrun import submit
    from longrun.config.runnable import check_runnable
    from longrun.config.vocabulary import paths_elsewhere

    with paths_elsewhere():  # a tokenizer on the cluster only is checked there
        cfg = load(args)  # a bad config is refused here, before anything reaches the cluster
    # ... and one this longrun cannot run (a layout that does not fit, ...); the cluster, not
    # this machine, supplies a Redis password the config only refers to.
    check_runnable(cfg, runs_here=False)
    cluster = address(args)
    with console.status(f"shipping longrun and submitting job {cfg.job.name} to {cluster}"):
        job = submit.submit(cfg, cluster, python=args.python)
    console.print(f"submitted [bold]{job.id}[/] to {cluster}, with {job.shipment.describe()}",
                  highlight=False)
    if args.no_wait:
        print(job.id)
        return 0
    submit.logs(cluster, job.id, follow=True, write=_print_chunk)
    final = submit.wait(cluster, job.id, timeout_s=60)
    console.print(f"job {shown(job.id)}: {shown(final)}", highlight=False)
    return 0 if final == "SUCCEEDED" else 1


def cmd_status(args) -> int:
    from longrun import submit

    info = submit.status(address(args), args.id, redis_url=args.redis_url)
    view = info["controller"]
    # Every field below is the cluster's or the job record's: shown as text, controls escaped.
    out.print(f"job {shown(info['id'])}: ray {shown(info['ray_status'])}"
              + (f" ({shown(info['message'])})" if info["message"] else ""), highlight=False)
    out.print(f"source: {shown(view.source)}", highlight=False)
    out.print(f"controller: {shown(view.state or 'not started')}"
              + (f" ({shown(view.reason)})" if view.reason else ""), highlight=False)
    out.print(f"attempt {shown(view.attempt)}, step {shown(view.step or '-')}"
              + (f", loss {view.loss:.4f}" if view.loss is not None else "")
              + (f", val_loss {view.val_loss:.4f} (after step {view.val_step})"
                 if view.val_loss is not None else ""), highlight=False)
    if view.size:
        out.print(f"size: {shown(view.size)}", highlight=False)
    if view.goodput:
        out.print(shown(view.goodput), highlight=False)
    if view.stragglers:
        out.print(f"stragglers: {shown(view.stragglers)}", highlight=False)
    out.print(f"evicted nodes: {shown(', '.join(view.evicted) or 'none')}", highlight=False)
    for line in view.events:
        out.print(f"  {shown(line)}", highlight=False)
    if info["longrun"]:
        out.print(f"longrun {shown(info['longrun'])}, shipped with the job", highlight=False)
    return 0


def cmd_logs(args) -> int:
    from longrun import submit

    if args.rank is None:
        if os.path.isdir(args.id):
            console.print(f"{shown(args.id)} is a job's directory: pass --rank R for one rank's log, or "
                          f"run `longrun report {shown(args.id)}`", highlight=False)
            return 2
        submit.logs(address(args), args.id, follow=args.follow, write=_print_chunk)
        return 0
    return _rank_log(args)


def _rank_log(args) -> int:
    from longrun import submit
    from longrun.controller.rank_logs import find_rank_log

    run_dir = args.id if os.path.isdir(args.id) else submit.run_dir_of(address(args), args.id)
    try:
        path = find_rank_log(run_dir, args.rank, args.attempt)
    except FileNotFoundError as exc:
        console.print(f"[red]{shown(str(exc))}[/]"
                      + ("" if os.path.isdir(args.id) else " (the files are on the cluster's head)"),
                      highlight=False)
        return 1
    console.print(f"rank {args.rank}: {path}", highlight=False)
    with open(path, encoding="utf-8", errors="replace") as f:
        for chunk in iter(lambda: f.read(1 << 16), ""):
            _print_chunk(chunk)
    return 0


def cmd_stop(args) -> int:
    from longrun import submit

    stopped = submit.stop(address(args), args.id, force=args.force, redis_url=args.redis_url)
    out.print(f"{shown(args.id)}: {'stop requested' if stopped else 'already ended'}", highlight=False)
    return 0


def cmd_list(args) -> int:
    from longrun import submit

    jobs = submit.list_jobs(address(args))
    if not jobs:
        out.print("no longrun jobs on this cluster")
    for job in jobs:
        out.print(f"{shown(job['id'])}  {shown(job['status']):10s}  {shown(job['job'])}", highlight=False)
    return 0
