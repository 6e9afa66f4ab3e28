"""Shipping the submitter's longrun with a job, so the cluster runs the code that was submitted.

A Ray cluster's python often lacks longrun, or has another version of it. `stage()` copies the
longrun this process runs (an editable checkout's platform/ folder, or an installed
site-packages/longrun) into a temporary folder named `longrun`, for the job's runtime
environment: Ray's `py_modules` puts a folder on the path under its own name, and the source
folder `platform` must never be on a path under that name (it would shadow the standard
library's `platform`). The job's working directory gets `longrun-shipped.json`, which
preflight.py checks on the cluster: version, source digest, the packages longrun needs there.

A copied folder, not a wheel: the copy takes about 20 ms and Ray uploads it zipped (about
200 KB, and not again while the source is unchanged: Ray names uploads by content); building a
wheel takes about 2 s, and Ray installs a wheel with `pip install --target`, which would try to
resolve torch, ray and the rest from an index on the cluster's nodes.
"""

from __future__ import annotations

import importlib.metadata
import json
import shutil
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

from packaging.requirements import Requirement

from longrun.preflight import MANIFEST, source_digest

# Declared dependencies the job does not need on the cluster; the preflight does not ask for them.
NOT_NEEDED_ON_CLUSTER = {
    "grafana-client": "only `longrun dashboards push` uses it, on an operator's machine",
}


@dataclass(frozen=True)
class Shipment:
    """A staged copy of longrun and what the cluster's preflight checks against."""

    path: str  # the staged `longrun` folder, for runtime_env py_modules
    version: str
    digest: str
    bytes: int
    requires: list[str]
    requires_python: str
    submitter_python: str

    def manifest(self) -> dict:
        return {k: v for k, v in asdict(self).items() if k != "path"}

    def describe(self) -> str:
        return f"longrun {self.version} (source {self.digest[:12]}, {self.bytes / 1024:.0f} KiB)"


def longrun_root() -> Path:
    """The folder this process imports longrun from (this module lives at its top)."""
    return Path(__file__).resolve().parent


def _metadata() -> tuple[str, list[str], str]:
    """(version, requirements the cluster needs, Requires-Python) of the installed longrun."""
    try:
        dist = importlib.metadata.distribution("longrun")
    except importlib.metadata.PackageNotFoundError:  # run from a checkout that was never installed
        return "unknown", [], ""
    needed = [line for line in dist.requires or [] if "extra ==" not in line
              and Requirement(line).name not in NOT_NEEDED_ON_CLUSTER]
    return dist.version, needed, dist.metadata.get("Requires-Python") or ""


def stage(parent: Path) -> Shipment:
    """Copy longrun into `parent`/longrun (bytecode caches and dotfiles left out)."""
    dest = Path(parent) / "longrun"
    shutil.copytree(longrun_root(), dest, ignore=shutil.ignore_patterns("__pycache__", "*.pyc", ".*"))
    version, requires, requires_python = _metadata()
    size = sum(p.stat().st_size for p in dest.rglob("*") if p.is_file())
    return Shipment(path=str(dest), version=version, digest=source_digest(dest), bytes=size,
                    requires=requires, requires_python=requires_python,
                    submitter_python=sys.version.split()[0])


def write_manifest(shipment: Shipment, working_dir: Path) -> Path:
    path = Path(working_dir) / MANIFEST
    path.write_text(json.dumps(shipment.manifest(), indent=1))
    return path
