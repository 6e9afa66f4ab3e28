"""Before anything is placed: can the job's workers reach what it hands them, and be reached?

On one host every address works. On a cluster of many, two defaults made for one host cannot:
a Redis on loopback (what `longrun run` starts when the config names none) is handed to workers
on other hosts that cannot reach it, and workers whose /metrics bind loopback are advertised to
Prometheus at an address that is the scraper's own. Both fail late and obscurely (a rendezvous
timeout, empty dashboards), so the job is refused at once with the setting to change whenever a
node that may run its workers is another host than the driver's.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable
from urllib.parse import urlsplit

from longrun.config import JobConfig
from longrun.controller.placement import NodeInfo, eligible_nodes


def is_loopback(host: str | None) -> bool:
    if not host:
        return False
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:  # a name: resolved by each node for itself, so not judged here
        return False


def cluster_problems(cfg: JobConfig, redis_url: str, driver_address: str,
                     nodes: Iterable[NodeInfo]) -> list[tuple[str, str]]:
    """(dotted path, reason) for what cannot work with the job's workers on `nodes` (Ray's live
    nodes) and its driver on `driver_address`; [] when every node that could run a worker is
    the driver's host."""
    others = sorted({n.address for n in eligible_nodes(cfg, nodes) if n.address != driver_address})
    if not others:
        return []
    hosts = f"{', '.join(others[:5])}{' and more' if len(others) > 5 else ''}"
    problems = []
    redis_host = urlsplit(redis_url).hostname
    if is_loopback(redis_host):
        problems.append(("cluster.redis_url", f"the job's Redis is at {redis_host}, which only the driver's "
                         f"host ({driver_address}) reaches, but nodes at {hosts} may run its workers. Set "
                         "cluster.redis_url to a Redis every node reaches (without one, `longrun run` "
                         "starts one on loopback, for one host)"))
    if is_loopback(cfg.observability.metrics_host):
        problems.append(("observability.metrics_host", f"workers would serve /metrics on "
                         f"{cfg.observability.metrics_host}, which Prometheus cannot reach on the nodes at "
                         f"{hosts}. Set it to 0.0.0.0 (each worker is then advertised at its node's "
                         "address) or to an address of the nodes' network"))
    return problems
