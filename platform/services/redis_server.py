"""An embedded `redis-server` on loopback, for `longrun run` and for tests.

Password-protected (generated per start), bound to 127.0.0.1 on a free port, with no
persistence unless asked for: the rendezvous and heartbeat data it holds are per-attempt and
the job record is rebuilt from the checkpoint directory when a server is lost.
"""

from __future__ import annotations

import contextlib
import resource
import secrets
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import quote, urlencode

import redis

from longrun.services.process import EmbeddedServer, ManagedProcess, ServiceError

INSTALL_HINT = "install it with: apt-get update && apt-get install -y redis-server (or run scripts/bootstrap)"

# Connections to size for: a training rank keeps to two (worker/redis_links.py), so 16,384 ranks
# are 32,768, plus a heartbeat agent per node (2,048 at 8 ranks a node), the controller's few
# and operators' `status`: 40,000, as deploy/ sizes its Redis (Redis's default is 10,000).
MAXCLIENTS = 40_000
RESERVED_FDS = 32  # descriptors Redis keeps beside its clients (maxclients + 32 in all)


def maxclients() -> int:
    """MAXCLIENTS, or fewer where this process's hard limit of open files (which redis-server
    inherits) cannot hold them: Redis raises its own soft limit up to the hard one for
    maxclients + 32 descriptors, and past it would lower maxclients itself with a warning; this
    asks for what it can have."""
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    if hard == resource.RLIM_INFINITY:
        return MAXCLIENTS
    return max(1, min(MAXCLIENTS, hard - RESERVED_FDS))


def find_redis_server() -> str:
    path = shutil.which("redis-server")
    if path is None:
        raise ServiceError(f"redis-server was not found on PATH; {INSTALL_HINT}")
    return path


@dataclass(frozen=True)
class TlsFiles:
    """PEM files for a TLS-only server: its certificate and key, and the CA clients trust."""

    cert: Path
    key: Path
    ca: Path


class EmbeddedRedis(EmbeddedServer):
    """`with EmbeddedRedis() as server: redis.Redis.from_url(server.url)`."""

    name = "redis"

    def __init__(
        self,
        *,
        host: str = "127.0.0.1",
        port: int | None = None,
        password: str | None = None,
        persist_dir: str | Path | None = None,
        tls: TlsFiles | None = None,
        start_timeout_s: float = 15.0,
    ):
        super().__init__(host=host, port=port, start_timeout_s=start_timeout_s)
        self.password = password or secrets.token_urlsafe(24)
        self.persist_dir = Path(persist_dir) if persist_dir else None
        self.tls = tls

    @property
    def url(self) -> str:
        if self.port is None:
            raise ServiceError("the embedded Redis is not running; call start() first")
        auth = f":{quote(self.password, safe='')}@{self.host}:{self.port}/0"
        if self.tls is None:
            return f"redis://{auth}"
        query = urlencode({"ssl_ca_certs": str(self.tls.ca), "ssl_cert_reqs": "required"})
        return f"rediss://{auth}?{query}"

    def client(self, **kwargs) -> redis.Redis:
        return redis.Redis.from_url(self.url, **kwargs)

    def _prepare(self, workdir: Path) -> None:
        self._binary = find_redis_server()

    def _launch(self, workdir: Path) -> ManagedProcess:
        conf = workdir / "redis.conf"
        conf.write_text(self._config_text(workdir))
        conf.chmod(0o600)  # the password lives here, not on a command line ps can read
        return ManagedProcess("redis-server", [self._binary, str(conf)], workdir / "redis.log")

    def _shutdown(self) -> None:
        # Already going away is fine: stop() makes sure.
        with contextlib.suppress(redis.RedisError, OSError):
            self.client(socket_timeout=2).shutdown(nosave=self.persist_dir is None)

    def _config_text(self, workdir: Path) -> str:
        data_dir = self.persist_dir or workdir
        data_dir.mkdir(parents=True, exist_ok=True)
        # With persistence, every write is on disk before it is acknowledged: the job record,
        # the restart history and checkpoint commit reports must survive a crash of Redis
        # itself, and their write rate (a heartbeat per worker per interval) is low.
        persistence = (
            'appendonly yes\nappendfsync always\nsave ""\n'
            if self.persist_dir
            else 'appendonly no\nsave ""\n'
        )
        if self.tls is None:
            listen = f"port {self.port}\n"
        else:  # TLS only: the plain port is closed
            listen = (f"port 0\ntls-port {self.port}\ntls-cert-file {self.tls.cert}\n"
                      f"tls-key-file {self.tls.key}\ntls-ca-cert-file {self.tls.ca}\ntls-auth-clients no\n")
        return (
            f"bind {self.host}\n"
            f"{listen}"
            "protected-mode yes\n"
            f"requirepass {self.password}\n"
            "daemonize no\n"
            f"maxclients {maxclients()}\n"
            "loglevel notice\n"
            f"dir {data_dir}\n"
            f"{persistence}"
            # Keyspace notifications let rendezvous waiters block on a key's creation.
            "notify-keyspace-events KA\n"
        )

    def _wait_ready(self) -> None:
        assert self.process is not None
        deadline = time.monotonic() + self.start_timeout_s
        delay = 0.005
        client = redis.Redis.from_url(self.url, socket_timeout=1)
        try:
            while True:
                if not self.process.alive():
                    raise ServiceError(
                        f"redis-server exited with code {self.process.proc.returncode} during "
                        f"start-up:\n{self.process.log_tail()}"
                    )
                try:
                    if client.ping():
                        return
                except (redis.ConnectionError, redis.TimeoutError, redis.BusyLoadingError):
                    pass
                if time.monotonic() > deadline:
                    raise ServiceError(
                        f"redis-server did not answer on {self.host}:{self.port} within "
                        f"{self.start_timeout_s:.0f} s:\n{self.process.log_tail()}"
                    )
                time.sleep(delay)  # polling a server that is starting; no event to wait on
                delay = min(delay * 2, 0.2)
        finally:
            client.close()
