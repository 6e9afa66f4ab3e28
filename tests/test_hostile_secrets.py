"""The Redis password where a URL would leak it (issue 42, doors 4 and 5).

A password written into the URL without percent-encoding (as `openssl rand -base64` makes one,
'/' included about 4 times in 10) was not found by the parser, so redaction left the URL whole
everywhere; a unix:// URL made the store's client send the password to TCP localhost:6379.
"""

from __future__ import annotations

import contextlib
import socket
import subprocess
import sys
import threading

import pytest

from longrun.commgroup.resp import RespConnection
from longrun.commgroup.store import RedisStore
from longrun.config import load_config
from longrun.redact import redact
from longrun.redis_password import REFERENCE, RedisPasswordError, refuse_placeholder
from longrun.services import EmbeddedRedis

RAW = "Zk3/Qp9+xY7wLm2?a#b@c"  # '/', '?', '#' and '@', none of them encoded


def _longrun(*args, cwd) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "longrun.cli", *map(str, args)], capture_output=True,
                          text=True, cwd=cwd, timeout=120)


def test_a_password_written_raw_in_the_url_is_parsed_and_never_shown(repo_root, tmp_path):
    with EmbeddedRedis(password=RAW) as server:
        url = f"redis://:{RAW}@127.0.0.1:{server.port}/0"
        shown = _longrun("config", "show", repo_root / "examples" / "tiny.yaml", "--set",
                         f"cluster.redis_url={url}", cwd=tmp_path)
        assert shown.returncode == 0, shown.stderr
        assert f"redis_url: redis://:{REFERENCE}@127.0.0.1:{server.port}/0" in shown.stdout
        for piece in ("Zk3", "Qp9", "xY7wLm2", "a#b"):
            assert piece not in shown.stdout + shown.stderr
        assert redact(f"cannot reach {url} now") == f"cannot reach redis://:***@127.0.0.1:{server.port}/0 now"

        # ... and the URL works: the config's copy reaches the server, the store's client too.
        cfg = load_config(repo_root / "examples" / "tiny.yaml", [f"cluster.redis_url={url}"])
        store = RedisStore(cfg.cluster.redis_url, "ns:", connect_timeout_s=10)
        try:
            store.set("k", b"v")
            assert store.get("k") == b"v"
        finally:
            store.close()
    with pytest.raises(RedisPasswordError, match=r"openssl rand -hex 24"):
        refuse_placeholder("change-me", "cluster.redis_url")


@contextlib.contextmanager
def _listening_on_6379():
    """What a TCP server on localhost:6379 receives (this test runs in its own network namespace)."""
    received = bytearray()
    server = socket.socket()
    try:
        server.bind(("127.0.0.1", 6379))
    except OSError:
        server.close()
        pytest.skip("127.0.0.1:6379 is taken here (run the tests in a private network namespace)")
    server.listen()
    server.settimeout(0.5)
    done = threading.Event()

    def serve() -> None:
        while not done.is_set():
            try:
                conn, _ = server.accept()
            except TimeoutError:
                continue
            with conn:
                conn.settimeout(2)
                with contextlib.suppress(OSError):
                    received.extend(conn.recv(65536))
                    conn.sendall(b"+OK\r\n")

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield received
    finally:
        done.set()
        thread.join()
        server.close()


def test_a_unix_socket_url_is_refused_and_the_password_goes_nowhere(repo_root, tmp_path):
    url = "unix://:S3cret-unix-pw@/tmp/redis.sock?db=0"
    out = _longrun("config", "validate", repo_root / "examples" / "tiny.yaml", "--set",
                   f"cluster.redis_url={url}", cwd=tmp_path)
    assert out.returncode == 2, out.stderr
    assert "cluster.redis_url: must be a redis:// or rediss:// URL" in out.stderr
    assert "Traceback" not in out.stderr and "S3cret-unix-pw" not in out.stdout + out.stderr
    with _listening_on_6379() as received, pytest.raises(ValueError, match="redis:// or rediss://"):
        RespConnection(url, connect_timeout_s=2, read_timeout_s=2)
    assert b"S3cret-unix-pw" not in received and not received
