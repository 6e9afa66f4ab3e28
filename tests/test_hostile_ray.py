"""The embedded Ray head refuses whoever lacks its token (issue 42, door 1).

On a shared login or GPU box, loopback is no boundary: another user who finds the head's ports
must not be able to submit a job (code running as the job's owner) or join as a driver. The head
`longrun run` starts demands a token made for it, which only its own drivers get; a token file
a local `ray.init()` left in ~/.ray opens nothing.
"""

from __future__ import annotations

import contextlib
import json
import os
import stat
import subprocess
import sys
import textwrap
import urllib.error
import urllib.request
from pathlib import Path

from longrun.services import EmbeddedRay


def _submit(url: str, token: str | None) -> int:
    """The HTTP status of a job submission to the Jobs API, as anyone on the host could send it."""
    headers = {"Content-Type": "application/json"}
    if token is not None:
        headers["Authorization"] = f"Bearer {token}"
    request = urllib.request.Request(f"{url}/api/jobs/", data=json.dumps({"entrypoint": "id"}).encode(),
                                     headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status
    except urllib.error.HTTPError as exc:
        return exc.code
    except urllib.error.URLError:
        return 0  # nothing listens


def _driver(address: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    code = textwrap.dedent(f"""
        import ray
        ray.init(address={address!r}, logging_level="error")
        print("joined", ray.get(ray.remote(lambda: 7).remote()))
    """)
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)


def _command_lines() -> list[bytes]:
    """Every process's command line: what any user on the host can read."""
    lines = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        with contextlib.suppress(OSError):  # gone meanwhile
            lines.append(Path(f"/proc/{pid}/cmdline").read_bytes())
    return lines


def test_the_embedded_head_refuses_submissions_and_drivers_without_its_token(tmp_path, monkeypatch):
    # A token Ray itself would use: one a local `ray.init()` left in the home directory.
    (tmp_path / ".ray").mkdir()
    (tmp_path / ".ray" / "auth_token").write_text("b" * 32)
    monkeypatch.setenv("HOME", str(tmp_path))
    outsider = {k: v for k, v in os.environ.items() if not k.startswith("RAY_AUTH")}
    with EmbeddedRay(num_cpus=1, include_dashboard=True) as head:
        url = head.dashboard_url
        assert _submit(url, None) == 401  # anyone on the host
        assert _submit(url, "b" * 32) == 403  # ~/.ray/auth_token's token is not this head's
        refused = _driver(head.address, {**outsider, "RAY_AUTH_MODE": "disabled"})  # ~20 s of retries
        assert refused.returncode != 0 and "InvalidAuthToken" in refused.stderr, refused.stderr[-2000:]
        joined = _driver(head.address, {**outsider, **head.client_env})  # what `longrun run` sets
        assert joined.returncode == 0 and "joined 7" in joined.stdout, joined.stderr

        assert not [c for c in _command_lines() if head.auth_token.encode() in c]
        assert stat.S_IMODE(head.token_file.stat().st_mode) == 0o600
        assert head.token_file.read_text().strip() == head.auth_token


def test_without_asking_there_is_no_jobs_api():
    # Ray still runs its dashboard process (usage stats only, no frontend): no job is accepted
    # on its port, not even with the head's own token.
    with EmbeddedRay(num_cpus=1) as head:
        assert not head.include_dashboard
        assert _submit(f"http://127.0.0.1:{head.dashboard_port}", head.auth_token) in (0, 404)
