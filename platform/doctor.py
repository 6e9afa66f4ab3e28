"""`longrun doctor`: is this machine ready to run longrun, and if not, what to do."""

from __future__ import annotations

import importlib
import importlib.metadata
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass

from longrun.services.ports import port_is_free

OK, WARN, FAIL = "ok", "warn", "fail"

# Ports the usual deployment expects on a head node: free is good, taken is worth knowing.
WELL_KNOWN_PORTS = {6379: "Redis", 6380: "Redis (alt)", 8265: "Ray dashboard / Jobs API",
                    9090: "Prometheus", 3000: "Grafana", 10001: "Ray client"}


@dataclass(frozen=True)
class Check:
    name: str
    status: str
    detail: str
    fix: str = ""


def _version_of(binary: str, *args: str) -> str | None:
    path = shutil.which(binary)
    if path is None:
        return None
    try:
        out = subprocess.run([path, *args], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return "unknown version"
    text = (out.stdout or out.stderr).strip()
    match = re.search(r"\d+\.\d+(\.\d+)?", text)
    return match.group(0) if match else (text.splitlines()[0] if text else "unknown version")


def check_python() -> Check:
    v = sys.version_info
    ok = v >= (3, 11)
    return Check("python", OK if ok else FAIL, f"{v.major}.{v.minor}.{v.micro} ({sys.executable})",
                 "" if ok else "longrun needs Python >= 3.11")


def check_package(name: str, module: str, fix: str) -> Check:
    try:
        importlib.import_module(module)
        return Check(name, OK, importlib.metadata.version(name))
    except Exception as exc:  # an import can fail in many ways (ABI, missing libs)
        return Check(name, FAIL, f"cannot import {module}: {exc}", fix)


def check_torch() -> Check:
    try:
        import torch
    except Exception as exc:
        return Check("torch", FAIL, f"cannot import torch: {exc}", "run scripts/bootstrap")
    build = f"CUDA {torch.version.cuda}" if torch.version.cuda else "CPU build"
    return Check("torch", OK, f"{torch.__version__} ({build})")


def check_gpu() -> Check:
    try:
        import torch
        if torch.cuda.is_available():
            names = sorted({torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())})
            return Check("gpu", OK, f"{torch.cuda.device_count()} x {', '.join(names)}; NCCL "
                         f"{'available' if torch.distributed.is_nccl_available() else 'missing'}")
    except Exception as exc:
        return Check("gpu", WARN, f"could not query CUDA: {exc}")
    return Check("gpu", WARN, "no GPU visible: jobs run on CPU with gloo (fine for tests and demos)",
                 "on a GPU machine, install a CUDA build of torch and the NVIDIA driver")


def check_binary(name: str, args: tuple[str, ...], fix: str) -> Check:
    version = _version_of(name, *args)
    if version is None:
        return Check(name, FAIL, "not found on PATH", fix)
    return Check(name, OK, f"{version} ({shutil.which(name)})")


def check_ports() -> Check:
    if not port_is_free(0):
        return Check("ports", FAIL, "cannot bind a port on 127.0.0.1",
                     "check the loopback interface (ip link set lo up)")
    taken = [f"{port} ({what})" for port, what in WELL_KNOWN_PORTS.items() if not port_is_free(port)]
    if taken:
        return Check("ports", WARN, "in use on 127.0.0.1: " + ", ".join(taken),
                     "embedded services pick free ports; a deployment expecting these must move them")
    return Check("ports", OK, "loopback works; " + ", ".join(map(str, WELL_KNOWN_PORTS)) + " are free")


def run_checks() -> list[Check]:
    apt = "apt-get update && apt-get install -y {} (or run scripts/bootstrap)"
    return [
        check_python(),
        check_torch(),
        check_package("ray", "ray", "pip install 'ray[default]' (or run scripts/bootstrap)"),
        check_package("redis", "redis", "pip install redis hiredis"),
        check_package("prometheus-client", "prometheus_client", "pip install prometheus-client"),
        check_binary("redis-server", ("--version",), apt.format("redis-server")),
        check_binary("prometheus", ("--version",), apt.format("prometheus")),
        check_ports(),
        check_gpu(),
    ]
