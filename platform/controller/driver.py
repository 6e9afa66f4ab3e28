"""`longrun run`'s entry into the controller, and how it answers signals.

The first SIGTERM or SIGINT (Kubernetes and Slurm preempt with SIGTERM, then kill after a grace
period; Ray's `stop_job` sends SIGTERM; an operator presses Ctrl-C) asks the controller to stop
with its work saved: the workers checkpoint at the next step boundary and the job ends
PREEMPTED (`EXIT_PREEMPTED`). A second signal while that is under way stops everything at once.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Callable, Iterator
from typing import Any

from longrun.config import JobConfig
from longrun.config.runnable import UnsupportedJob, check_runnable
from longrun.controller.controller import Controller, JobFailed
from longrun.controller.ray_deaths import WorkerDeath

__all__ = ["EXIT_PREEMPTED", "JobFailed", "UnsupportedJob", "run_job"]

# sysexits' EX_TEMPFAIL: "a temporary failure; the user is invited to retry". Running the
# same command again resumes from the checkpoint the preemption committed.
EXIT_PREEMPTED = 75


def run_job(cfg: JobConfig, redis_url: str, *, on_event: Callable[[str], None] | None = None,
            poll_s: float | None = None,
            worker_deaths: Callable[[], list[WorkerDeath]] | None = None,
            launched_at: float | None = None) -> dict[str, Any]:
    """Run the job on the connected Ray cluster to its end; the summary of rank 0 (with
    "preempted": True when it stopped on request, its checkpoint saved), with the job's
    goodput ("goodput": the ratio; "goodput_line": it and its top three losses, as `longrun
    status` shows them). Raises UnsupportedJob before anything is placed when this version
    cannot run the config, and JobFailed (with the reason) when the job ends FAILED (the
    controller's goodput line comes just before). `worker_deaths`: Ray's reports of worker
    processes that died (controller/ray_deaths.py), folded into the controller's lines.
    `launched_at`: when the run began (the goodput clock's start: its service start-up counts)."""
    check_runnable(cfg)
    check_reachable(cfg, redis_url)
    controller = Controller(cfg, redis_url, on_event=on_event, poll_s=poll_s, worker_deaths=worker_deaths,
                            launched_at=launched_at)
    with _stop_on_signals(controller, on_event or (lambda line: None)):
        summary = controller.run()
    goodput = controller.goodput.summary()
    return summary | {"goodput": round(goodput.goodput, 4), "goodput_line": goodput.describe()}


def check_reachable(cfg: JobConfig, redis_url: str) -> None:
    """Raise UnsupportedJob when the connected cluster has hosts the job's workers could not
    reach its Redis from, or be scraped on (controller/reachability.py)."""
    import ray

    from longrun.controller.placement import alive_nodes
    from longrun.controller.reachability import cluster_problems

    nodes = alive_nodes()
    here = ray.get_runtime_context().get_node_id()
    driver = next((n.address for n in nodes if n.node_id == here), None)
    if driver is None:  # a driver outside the cluster (Ray Client): every node is elsewhere
        driver = ray.util.get_node_ip_address()
    problems = cluster_problems(cfg, redis_url, driver, nodes)
    if problems:
        raise UnsupportedJob("\n".join(f"{path}: {why}" for path, why in problems))


@contextlib.contextmanager
def _stop_on_signals(controller: Controller, say: Callable[[str], None]) -> Iterator[None]:
    """SIGTERM/SIGINT: the first asks the controller to stop with its work saved, the second
    interrupts at once. Only where signal handlers can be set (the main thread)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    received: list[str] = []

    def on_signal(signum: int, frame: Any) -> None:
        name = signal.Signals(signum).name
        received.append(name)
        if len(received) > 1:
            raise KeyboardInterrupt(f"{name} again while stopping")
        say(f"{name} received: saving a checkpoint at the next step boundary, then stopping "
            f"(within {controller.cfg.recovery.preemption_grace_s:g} s); send it again to stop at once")
        controller.request_preemption(f"{name} received")

    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
