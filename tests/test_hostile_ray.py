"""The embedded Ray head refuses whoever lacks its token (issue 42, door 1).

On a shared login or GPU box, loopback is no boundary: another user who finds the head's ports
must not be able to submit a job (code running as the job's owner) or talk to its GCS. The head
`longrun run` starts demands a token made for it, which only its own drivers get (through their
environment, never a command line); a token file a local `ray.init()` left in ~/.ray opens
nothing. Its drivers joining with that token: tests/test_services.py. Without --ray-dashboard
there is no Jobs API at all: tests/test_services.py too (its heads start without one).
"""

from __future__ import annotations

import contextlib
import json
import os
import stat
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from ray._raylet import GcsClient
from ray.exceptions import AuthenticationError

from longrun.services import EmbeddedRay


def _jobs_api(url: str, token: str | None, *, submit: bool) -> int:
    """The HTTP status of a job submission (or a listing) to the Jobs API, as anyone on the
    host could send it."""
    headers = {"Content-Type": "application/json"}
    if token is not None:
        headers["Authorization"] = f"Bearer {token}"
    data = json.dumps({"entrypoint": "id"}).encode() if submit else None
    request = urllib.request.Request(f"{url}/api/jobs/", data=data, headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status
    except urllib.error.HTTPError as exc:
        return exc.code


def _command_lines() -> list[bytes]:
    """Every process's command line: what any user on the host can read."""
    lines = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        with contextlib.suppress(OSError):  # gone meanwhile
            lines.append(Path(f"/proc/{pid}/cmdline").read_bytes())
    return lines


def test_the_embedded_head_refuses_submissions_and_clients_without_its_token(tmp_path, monkeypatch):
    # A token Ray itself would use: one a local `ray.init()` left in the home directory.
    (tmp_path / ".ray").mkdir()
    (tmp_path / ".ray" / "auth_token").write_text("b" * 32)
    monkeypatch.setenv("HOME", str(tmp_path))
    assert os.environ["RAY_AUTH_MODE"] == "disabled"  # this process: an outsider (conftest)
    with EmbeddedRay(num_cpus=1, include_dashboard=True) as head:
        url = head.dashboard_url
        assert _jobs_api(url, None, submit=True) == 401  # anyone on the host
        assert _jobs_api(url, "b" * 32, submit=True) == 403  # ~/.ray/auth_token's is not this head's
        assert _jobs_api(url, head.auth_token, submit=False) == 200  # the head's own: let in
        # The GCS (what a driver joins through) refuses a client without the token.
        with pytest.raises(AuthenticationError, match="InvalidAuthToken"):
            GcsClient(address=head.address).internal_kv_keys(b"", None, timeout=20)

        assert not [c for c in _command_lines() if head.auth_token.encode() in c]
        assert stat.S_IMODE(head.token_file.stat().st_mode) == 0o600
        assert head.token_file.read_text().strip() == head.auth_token
