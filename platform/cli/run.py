"""`longrun run`: a job on this machine, with an embedded Redis and Ray head unless the config
names existing ones."""

from __future__ import annotations

import os
import sys
import time
from contextlib import ExitStack
from pathlib import Path

from rich_argparse import RichHelpFormatter

from longrun.cli.common import add_config_args, console, load, shown
from longrun.cli.job_console import JobConsole
from longrun.safe_files import replace_file


def add_parsers(sub) -> None:
    run = sub.add_parser("run", formatter_class=RichHelpFormatter,
                         help="run a job here, starting Redis and Ray locally when none is configured",
                         description="Run a job on this machine. Starts an embedded Redis and a Ray head "
                         "on 127.0.0.1 unless cluster.redis_url / cluster.address name existing ones.")
    add_config_args(run)
    run.add_argument("--ray-dashboard", action="store_true",
                     help="also start the embedded Ray head's dashboard (on 127.0.0.1, signed in to "
                     "with the head's token, whose file is printed)")
    run.set_defaults(func=cmd_run)


def cmd_run(args) -> int:
    # The job's goodput clock starts at the launch: Redis and Ray start-up count as start-up.
    launched_at = getattr(args, "launched_at", None) or time.time()
    cfg = load(args)
    from longrun.services.ray_head import embedded_env, new_token

    token = None
    if cfg.cluster.address is None:
        # The embedded head's token, made here: Ray reads the auth mode when it is first imported,
        # so the driver's environment holds both before anything imports it.
        token = new_token()
        os.environ.update(embedded_env(dict(os.environ), token))
    if not console.is_terminal:  # piped or in a file: what Ray itself prints, without colour codes
        os.environ.setdefault("RAY_COLOR_PREFIX", "0")
    from longrun.config.runnable import check_runnable

    check_runnable(cfg)  # before any service starts
    from longrun.checkpoint.owner import in_use_refusal
    from longrun.controller.precheck import checkpoint_problem

    # The controller asks both again (and takes the directory); asked here, a second writer of
    # the checkpoint directory (another `longrun run` of this config, with a Redis of its own)
    # or a refused resume starts nothing and leaves the run directory's config.yaml describing
    # the checkpoints it has.
    problem = in_use_refusal(cfg.checkpoint_dir) or checkpoint_problem(cfg, quiet=True)
    if problem is not None:
        console.print(f"[red]error[/]: {shown(problem, newlines=True)}", highlight=False)
        return 1
    run_dir = Path(cfg.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    replace_file(run_dir / "config.yaml", cfg.to_yaml(), sync=False)  # never through a planted link
    console.print(f"[bold]longrun[/] job [bold]{cfg.job.name}[/]: {cfg.world_size} worker(s), layout "
                  f"{cfg.dims.layout_name}, {cfg.training.steps} steps; resolved config in "
                  f"{run_dir / 'config.yaml'}")
    summary = _run_with_services(cfg, token, dashboard=args.ray_dashboard, launched_at=launched_at)
    goodput = f"; {shown(summary['goodput_line'])}" if summary.get("goodput_line") else ""
    if summary.get("stopped"):
        console.print(f"[yellow]stopped[/]: {shown(summary['reason'])}{goodput}", highlight=False)
        return 130
    if summary.get("preempted"):
        from longrun.controller.driver import EXIT_PREEMPTED

        console.print(f"[yellow]preempted[/]: {shown(summary['reason'])}; run the same command to resume"
                      f"{goodput}", highlight=False)
        return EXIT_PREEMPTED
    done = f"[green]done[/]: {summary['step']} steps"
    if summary.get("resumed_from"):
        done += f" (resumed from step {summary['resumed_from']})"
    if summary.get("loss") is not None:
        done += f", final loss {summary['loss']:.4f}"
    console.print(done + goodput, highlight=False)
    return 0


def _run_with_services(cfg, token: str | None, *, dashboard: bool = False,
                       launched_at: float | None = None) -> dict:
    """Run the job against the configured Redis and Ray, or embedded ones stopped at the end
    (the head with `token`, its dashboard only when asked); `launched_at` starts its goodput clock."""
    import ray

    from longrun.controller.driver import run_job
    from longrun.controller.ray_deaths import WorkerDeaths
    from longrun.services import EmbeddedRay, EmbeddedRedis

    with ExitStack() as stack:
        # Last out: what Ray printed to stdout (buffered when piped) comes before the job's last
        # line, which `cmd_run` prints to stderr after this.
        stack.callback(sys.stdout.flush)
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
                head = stack.enter_context(EmbeddedRay(num_cpus=max(os.cpu_count() or 1, cfg.world_size),
                                                       include_dashboard=dashboard, auth_token=token))
            address = head.address
            shown_dashboard = (f"dashboard {head.dashboard_url}, sign in with the token in {head.token_file}"
                               if dashboard else "no dashboard (--ray-dashboard starts one)")
            console.print(f"ray: embedded head at {address} (token authentication), {shown_dashboard}",
                          highlight=False)
        # Ranks' output goes to their log files (<output_dir>/<job>/logs/), not through Ray to
        # this console, which shows the job as one: its progress lines and state changes. Ray's
        # paragraph on a worker that died comes to the controller instead, which folds it into its
        # own account (controller/ray_deaths.py); held until Ray's error thread has stopped.
        deaths = stack.enter_context(WorkerDeaths())
        ray.init(address=address, logging_level="warning", configure_logging=True, log_to_driver=False)
        stack.callback(ray.shutdown)

        with JobConsole(console, cfg.training.steps) as shown:
            return run_job(cfg, redis_url, on_event=shown.line, worker_deaths=deaths.take,
                           launched_at=launched_at)
