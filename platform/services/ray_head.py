"""An embedded single-node Ray head on loopback, for `longrun run` without a cluster address.

It is `ray start --head --block` in its own process group: `--block` makes the command the
parent of every Ray daemon it starts and kills them when it is terminated, so stopping the
group stops the cluster. Ray's worker processes can outlive that briefly; they all carry the
cluster's private temp dir in their command line, which is how `stop()` sweeps them.

Every embedded head runs with Ray's token authentication and a token of its own, made when it
starts and handed to the head's processes and to the drivers `longrun run` starts, through
their environment (readable by the same user only, never on a command line). Loopback is not a
boundary on a shared login or GPU box: without a token, any other user there could find the
GCS or dashboard port and run code as this job's owner, beside its checkpoints and its Redis
password. The dashboard (and the Jobs API it serves) starts only when asked for, and then
demands the token too.
"""

from __future__ import annotations

import os
import secrets
import shutil
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

from longrun.safe_files import create
from longrun.services.ports import free_ports
from longrun.services.process import ManagedProcess, ServiceError, kill_until_gone, pids_mentioning

LOOPBACK = "127.0.0.1"
# Ray turns 127.0.0.1 into the machine's routable address so other nodes can join; an
# embedded head is single-node, so keep every Ray server (GCS, raylet, client server,
# dashboard) on loopback. Drivers connecting to it need the same environment.
LOOPBACK_ENV = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_USAGE_STATS_ENABLED": "0"}
# Ray reads the token from RAY_AUTH_TOKEN before RAY_AUTH_TOKEN_PATH and ~/.ray/auth_token, so
# a token file a local `ray.init()` left (which had turned auth on with a token the embedded
# head's drivers lacked: the head never read as ready) no longer matters. The mode is read once,
# when Ray is first imported: a driver's environment is set before that (`cli/run.py`).
AUTH_MODE_ENV, AUTH_TOKEN_ENV = "RAY_AUTH_MODE", "RAY_AUTH_TOKEN"


def new_token() -> str:
    """A token for one embedded head (Ray's own are 32 hex digits; this is 256 bits)."""
    return secrets.token_hex(32)


def embedded_env(environ: dict[str, str], token: str) -> dict[str, str]:
    """The environment of an embedded head with `token`, and of the drivers that talk to it."""
    env = {k: v for k, v in environ.items() if k != "RAY_AUTH_TOKEN_PATH"}
    return {**env, AUTH_MODE_ENV: "token", AUTH_TOKEN_ENV: token, **LOOPBACK_ENV}


class EmbeddedRay:
    """`with EmbeddedRay() as head: ray.init(address=head.address)`."""

    def __init__(
        self,
        *,
        num_cpus: int | None = None,
        include_dashboard: bool = False,
        start_timeout_s: float = 90.0,
        auth_token: str | None = None,
    ):
        self.num_cpus = num_cpus
        self.include_dashboard = include_dashboard
        self.start_timeout_s = start_timeout_s
        self.auth_token = auth_token or new_token()
        self.gcs_port: int | None = None
        self.dashboard_port: int | None = None
        self.temp_dir: Path | None = None
        self.process: ManagedProcess | None = None

    @property
    def address(self) -> str:
        """The GCS address, for `ray.init(address=...)`."""
        self._require_running()
        return f"{LOOPBACK}:{self.gcs_port}"

    @property
    def client_env(self) -> dict[str, str]:
        """What a driver's environment needs to reach this head (set before Ray is imported)."""
        return {AUTH_MODE_ENV: "token", AUTH_TOKEN_ENV: self.auth_token, **LOOPBACK_ENV}

    @property
    def token_file(self) -> Path:
        """A file (mode 0600, in the head's private temp dir) holding the token, to sign in to
        the dashboard with; written on first use."""
        self._require_running()
        path = self.temp_dir / "auth_token"
        if not path.exists():
            with create(path, text=True, mode=0o600) as f:
                f.write(self.auth_token + "\n")
        return path

    @property
    def dashboard_url(self) -> str:
        """The HTTP address of the dashboard, where the Ray Jobs API lives."""
        self._require_running()
        if not self.include_dashboard:
            raise ServiceError("this embedded Ray was started without its dashboard (no Jobs API)")
        return f"http://{LOOPBACK}:{self.dashboard_port}"

    def start(self) -> EmbeddedRay:
        # Ray puts Unix sockets under the temp dir; their paths must stay under 107 bytes.
        self.temp_dir = Path(tempfile.mkdtemp(prefix="lr-ray-", dir="/tmp"))
        self.gcs_port, self.dashboard_port, client_port, agent_port = free_ports(4)
        argv = [
            sys.executable, "-m", "ray.scripts.scripts", "start", "--head", "--block",
            f"--node-ip-address={LOOPBACK}",
            f"--port={self.gcs_port}",
            f"--temp-dir={self.temp_dir}",
            f"--include-dashboard={'true' if self.include_dashboard else 'false'}",
            f"--dashboard-host={LOOPBACK}",
            f"--dashboard-port={self.dashboard_port}",
            # Ray's fixed defaults (10001, 52365) would clash between two embedded heads.
            f"--ray-client-server-port={client_port}",
            f"--dashboard-agent-listen-port={agent_port}",
            "--disable-usage-stats",
        ]
        if self.num_cpus is not None:
            argv.append(f"--num-cpus={self.num_cpus}")
        env = embedded_env(dict(os.environ), self.auth_token)
        # Jobs submitted to this head run `python ...` in its environment: make that this
        # interpreter (the one with longrun installed), whether or not a venv is activated.
        env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
        self.process = ManagedProcess("ray-head", argv, self.temp_dir / "head.log", env=env, tree=True)
        try:
            self._wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        if self.process is not None:
            # `ray start --block` lingers for many seconds on SIGTERM although its daemons exit at
            # once; nothing of an embedded head needs a graceful end, so keep the grace short.
            self.process.stop(grace_s=3.0)
            self.process = None
        if self.temp_dir is not None:
            # Ray renames its workers (ray::IDLE) but they keep the session of the head.
            temp_dir = str(self.temp_dir)
            kill_until_gone(lambda: pids_mentioning(temp_dir))
            shutil.rmtree(self.temp_dir, ignore_errors=True)
            self.temp_dir = None

    def __enter__(self) -> EmbeddedRay:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def _require_running(self) -> None:
        if self.process is None or not self.process.alive():
            raise ServiceError("the embedded Ray head is not running; call start() first")

    def _wait_ready(self) -> None:
        assert self.process is not None and self.temp_dir is not None
        address_file = self.temp_dir / "ray_current_cluster"
        deadline = time.monotonic() + self.start_timeout_s
        delay = 0.05
        while True:
            if not self.process.alive():
                raise ServiceError(
                    f"the Ray head exited with code {self.process.proc.returncode} during "
                    f"start-up:\n{self.process.log_tail()}"
                )
            if address_file.exists() and (not self.include_dashboard or self._dashboard_up()):
                return
            if time.monotonic() > deadline:
                raise ServiceError(
                    f"the Ray head was not ready within {self.start_timeout_s:.0f} s:\n"
                    f"{self.process.log_tail()}"
                )
            time.sleep(delay)  # polling a starting server; there is no event to wait on
            delay = min(delay * 2, 0.5)

    def _dashboard_up(self) -> bool:
        request = urllib.request.Request(f"http://{LOOPBACK}:{self.dashboard_port}/api/version",
                                         headers={"Authorization": f"Bearer {self.auth_token}"})
        try:
            with urllib.request.urlopen(request, timeout=2) as response:
                return response.status == 200
        except (urllib.error.URLError, OSError):  # HTTPError included: not (yet) serving us
            return False
