"""The entrypoint of a submitted job on the cluster: check the python, then run the shipped longrun.

    python3 -m longrun.preflight run config.yaml --set cluster.address=auto

`longrun submit` ships the submitter's longrun with the job (Ray's `py_modules`, see
shipping.py) and writes `longrun-shipped.json` next to the config: its version, a digest of its
source and the packages it needs. This module runs first on the cluster, before anything
imports them, and refuses with a sentence naming what to install where when the cluster's
python lacks one (a bare ImportError deep in the controller says neither). It then checks
that the longrun this python imports is the shipped one, prints the versions that run, and
hands over to `longrun.cli`.

Standard library only, and syntax old pythons parse: it must speak on any interpreter the
cluster's `python3` happens to be.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.util
import json
import re
import socket
import sys
from pathlib import Path

MANIFEST = "longrun-shipped.json"
_SKIPPED = ("__pycache__",)
_NAME = re.compile(r"^\s*([A-Za-z0-9][A-Za-z0-9._-]*)")
_MIN_PYTHON = re.compile(r">=\s*(\d+)\.(\d+)")


class PreflightError(RuntimeError):
    """The cluster's python cannot run the shipped longrun; the message says what to install where."""


def source_digest(root: Path) -> str:
    """SHA-256 over every source file under `root` (relative path and bytes), bytecode caches
    excluded: the same on the submitter's staged copy and on the copy Ray unpacked."""
    digest = hashlib.sha256()
    files = sorted(p for p in root.rglob("*") if p.is_file() and not _skipped(p.relative_to(root)))
    for path in files:
        digest.update(path.relative_to(root).as_posix().encode() + b"\0")
        digest.update(hashlib.sha256(path.read_bytes()).digest())
    return digest.hexdigest()


def _skipped(rel: Path) -> bool:
    return any(part in _SKIPPED or part.startswith(".") for part in rel.parts) or rel.suffix == ".pyc"


def installed(requirements: list[str]) -> tuple[dict[str, str], list[str]]:
    """({name: version} of what this python has, [requirement lines it does not satisfy]).
    Versions are checked when `packaging` is importable (it comes with ray), presence otherwise."""
    try:
        from packaging.requirements import Requirement
    except ImportError:
        Requirement = None
    found, unmet = {}, []
    for line in requirements:
        spec = None
        if Requirement is not None:
            req = Requirement(line)
            if req.marker is not None and not req.marker.evaluate():
                continue
            name, spec = req.name, req.specifier
        else:
            name = _NAME.match(line).group(1)
        try:
            version = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            unmet.append(line)
            continue
        found[name] = version
        if spec is not None and not spec.contains(version, prereleases=True):
            unmet.append(f"{line} (has {version})")
    return found, unmet


def check_python(requires_python: str) -> None:
    """Refuse an interpreter older than the shipped longrun's Requires-Python."""
    match = _MIN_PYTHON.search(requires_python or "")
    if match and sys.version_info[:2] < (int(match.group(1)), int(match.group(2))):
        raise PreflightError(
            f"longrun needs Python {requires_python}; the job's python on {socket.gethostname()} is "
            f"{sys.executable} (Python {sys.version.split()[0]}). Submit with --python naming an "
            "interpreter that runs Ray on the cluster and is new enough.")


def check_requirements(manifest: dict) -> dict[str, str]:
    """The versions of what longrun needs here; PreflightError naming what is missing."""
    found, unmet = installed(manifest.get("requires", []))
    if unmet:
        quoted = " ".join(f"'{line.split(' (has')[0]}'" for line in unmet)
        raise PreflightError(
            f"the job's python on {socket.gethostname()} ({sys.executable}) lacks what longrun "
            f"{manifest.get('version', '?')} needs: {', '.join(unmet)}. Install them into the python "
            f"that runs Ray on every node of the cluster (e.g. `{sys.executable} -m pip install "
            f"{quoted}`; torch first, from the index that matches your accelerators), or submit "
            "with --python naming an interpreter that has them.")
    return found


def check_shipped(manifest: dict) -> Path:
    """The folder of the longrun this python imports; PreflightError unless it is the shipped one."""
    root = Path(__file__).resolve().parent
    spec = importlib.util.find_spec("longrun.cli")
    if spec is None or spec.origin is None or root not in Path(spec.origin).resolve().parents:
        raise PreflightError(
            f"this python imports longrun.cli from {spec.origin if spec else 'nowhere'}, not from the "
            f"copy shipped with the job ({root}): an installed longrun shadows it. Remove that "
            "installation from the cluster's python, or submit from the same version.")
    digest = source_digest(root)
    if manifest.get("digest") and digest != manifest["digest"]:
        raise PreflightError(
            f"the longrun under {root} (source {digest[:12]}) is not the one submitted "
            f"(source {manifest['digest'][:12]}); submit the job again.")
    return root


def read_manifest(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise PreflightError(
            f"no {MANIFEST} in {Path.cwd()}: this entrypoint runs jobs that `longrun submit` made; "
            "run a job here with `longrun run CONFIG` instead.") from None


def preflight(manifest_path: Path = Path(MANIFEST)) -> list[str]:
    """Every check, in the order a missing piece would show itself; the lines to print."""
    manifest = read_manifest(manifest_path)
    check_python(manifest.get("requires_python", ""))
    found = check_requirements(manifest)
    root = check_shipped(manifest)
    try:
        also = f"; this python also has longrun {importlib.metadata.version('longrun')} installed, unused"
    except importlib.metadata.PackageNotFoundError:
        also = ""
    return [
        f"longrun {manifest.get('version', '?')} (source {manifest.get('digest', '?')[:12]}) shipped "
        f"with the job, running from {root}{also}",
        f"python: {sys.executable} (Python {sys.version.split()[0]}) on {socket.gethostname()}; "
        + ", ".join(f"{name} {version}" for name, version in sorted(found.items())),
    ]


def main(argv: list[str] | None = None) -> int:
    try:
        lines = preflight()
    except PreflightError as exc:
        print(f"error: {exc}", file=sys.stderr, flush=True)
        return 1
    for line in lines:
        print(line, flush=True)
    # Imported only now: longrun.cli needs the packages checked above.
    from longrun.cli import main as cli_main

    return cli_main(sys.argv[1:] if argv is None else argv)


if __name__ == "__main__":
    sys.exit(main())
