"""Prometheus service discovery for a job's processes: http_sd (served) and file_sd (written).

Workers come and go with attempts, on whichever nodes placement chose, on ports picked at
start; a static scrape config cannot know them. The controller knows, so it publishes them:

    groups = target_groups("my-run", attempt=2,
                           endpoints={0: ("10.0.0.5:40211", "node-a"), 1: ("10.0.0.6:40002", "node-b")},
                           controller_endpoint="10.0.0.5:9400")
    ObservabilityServer(registry, targets=lambda: groups)  # GET /sd, for http_sd_configs
    write_file_sd("/etc/prometheus/longrun/my-run.json", groups)  # for file_sd_configs

Target labels are job, attempt, rank, node, node_id (as on the series themselves) plus role
(controller or worker), so `up{job="my-run", role="worker"}` counts the live workers. See
vocab.py for why the target label is `job` and the scrape config sets honor_labels.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Mapping
from pathlib import Path

from longrun.observability.vocab import check_label_name

ROLE_CONTROLLER = "controller"
ROLE_WORKER = "worker"


def target_groups(job: str, attempt: int, endpoints: Mapping[int, tuple[str, str]],
                  controller_endpoint: str | None = None,
                  names: Mapping[str, str] | None = None) -> list[dict]:
    """http_sd / file_sd target groups: one per worker (rank -> ("host:port", node)), ranks in
    order, then the controller's. The controller's group has no attempt label: its series
    span attempts (see ControllerMetrics). With `names` (node id -> "host (address)"), the
    label `node` is the node's name and `node_id` its id, as on the workers' series."""
    groups = []
    for rank in sorted(endpoints):
        address, node = endpoints[rank]
        labels = {"job": job, "attempt": str(attempt), "rank": str(rank), "node": str(node)}
        if names is not None:
            labels |= {"node": names.get(node, str(node)), "node_id": str(node)}
        groups.append({"targets": [_address(address, f"rank {rank}")],
                       "labels": labels | {"role": ROLE_WORKER}})
    if controller_endpoint is not None:
        groups.append({"targets": [_address(controller_endpoint, "the controller")],
                       "labels": {"job": job, "role": ROLE_CONTROLLER}})
    return validate_groups(groups)


def validate_groups(groups: list[dict]) -> list[dict]:
    """The groups, if Prometheus would accept them: a list of {"targets": [str], "labels":
    {name: str}} with valid label names; ValueError naming the first problem otherwise."""
    if not isinstance(groups, list):
        raise ValueError(f"target groups must be a list, got {type(groups).__name__}")
    for i, group in enumerate(groups):
        if not isinstance(group, dict) or set(group) - {"targets", "labels"} or "targets" not in group:
            raise ValueError(f"target group {i} must be {{'targets': [...], 'labels': {{...}}}}, "
                             f"got {group!r}")
        targets = group["targets"]
        if not isinstance(targets, list) or not all(isinstance(t, str) and t for t in targets):
            raise ValueError(f"target group {i}: targets must be a list of 'host:port' strings")
        for name, value in group.get("labels", {}).items():
            check_label_name(name)
            if not isinstance(value, str):
                raise ValueError(f"target group {i}: label {name} must be a string, got {value!r}")
    return groups


def write_file_sd(path: str | Path, groups: list[dict]) -> None:
    """Write `groups` for file_sd_configs atomically: Prometheus watches the file and may read
    it at any moment, so it must never see half a file. Temp file in the same directory (same
    file system), fsync, then os.replace."""
    path = Path(path)
    data = json.dumps(validate_groups(groups), indent=1, sort_keys=True).encode()
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o644)  # mkstemp makes it 0600; Prometheus may run as another user
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _address(address: str, who: str) -> str:
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"the metrics endpoint of {who} must be 'host:port', got {address!r}")
    return address


WILDCARD_HOSTS = frozenset({"0.0.0.0", "::", ""})


def advertised_address(bind_host: str, port: int) -> str:
    """The host:port Prometheus should scrape for a server bound to `bind_host`: itself, unless
    it is a wildcard bind (0.0.0.0 on a real cluster), which is advertised as this node's IP."""
    host = bind_host
    if bind_host in WILDCARD_HOSTS:
        try:
            import ray  # on a Ray node, Ray knows the address its peers reach it by

            host = ray.util.get_node_ip_address()
        except Exception:  # not under Ray: the hostname's address
            import socket

            host = socket.gethostbyname(socket.gethostname())
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
