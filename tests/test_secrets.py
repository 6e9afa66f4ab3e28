"""The Redis password stays secret: one redaction for every message, the password written down
only as a reference put back from the environment or a 0600 file, placeholders refused, and
`status` / `stop --force` sending it only to the Redis the operator configured."""

from __future__ import annotations

import contextlib
import socket
import threading
from types import SimpleNamespace

import pytest
import yaml

from longrun import submit
from longrun.commgroup import store
from longrun.commgroup.store import RedisStore, StoreConnectionError
from longrun.config import ConfigError, config_from_dict
from longrun.config.runnable import runnable_problems
from longrun.redact import MASK, PASSWORD_ENV, redact
from longrun.redis_password import (
    PASSWORD_FILE_ENV,
    REFERENCE,
    RedisPasswordError,
    as_reference,
    read_password,
    resolve,
)
from longrun.services.ports import free_port

PW = "Tr0ub4dor-and-3"


@pytest.fixture(autouse=True)
def _no_password_in_the_environment(monkeypatch):
    monkeypatch.delenv(PASSWORD_ENV, raising=False)
    monkeypatch.delenv(PASSWORD_FILE_ENV, raising=False)


# -- one redaction ---------------------------------------------------------------------------------


@pytest.mark.parametrize(("text", "shown"), [
    (f"redis://:{PW}@10.0.0.5:6379/0", "redis://:***@10.0.0.5:6379/0"),
    (f"redis://ops:{PW}@10.0.0.5:6379/0", "redis://ops:***@10.0.0.5:6379/0"),
    (f"rediss://ops:{PW}@h:6380/0?ssl_cert_reqs=required", "rediss://ops:***@h:6380/0?ssl_cert_reqs=required"),
    (f"redis://h:6379/0?password={PW}", "redis://h:6379/0?password=***"),
    (f"rediss://h:6380/0?ssl_ca_certs=/etc/ca.pem&password={PW}&db=1",
     "rediss://h:6380/0?ssl_ca_certs=/etc/ca.pem&password=***&db=1"),
    # A query password runs to the next space, '&' or '#': a ':' may be part of it.
    (f"cannot reach Redis at redis://:{PW}@a:1/0 or redis://b:2/0?password={PW}:x refused",
     "cannot reach Redis at redis://:***@a:1/0 or redis://b:2/0?password=*** refused"),
    ("redis://:p%40ss%2Fw@h:1/0", "redis://:***@h:1/0"),  # a quoted password
    ("redis://:p@ss@h:1/0", "redis://:***@h:1/0"),  # an unquoted '@' in it
])
def test_redact_masks_every_form_of_url_password(text, shown):
    assert redact(text) == shown


@pytest.mark.parametrize("text", [
    "redis://10.0.0.5:6379/0", "http://127.0.0.1:8265", "rediss://h:6380/0?ssl_cert_reqs=required",
    "step 3/10 loss 4.5: ok", "redis://ops@h:1/0",
])
def test_redact_leaves_text_without_a_password_alone(text):
    assert redact(text) == text


def test_redact_masks_known_passwords_and_the_environments_anywhere(monkeypatch):
    assert redact(f"AUTH {PW} failed", PW) == f"AUTH {MASK} failed"
    assert redact("AUTH p/w+x failed (p%2Fw%2Bx)", "p/w+x") == f"AUTH {MASK} failed ({MASK})"
    monkeypatch.setenv(PASSWORD_ENV, "from-the-env-123")
    assert redact("server said from-the-env-123") == f"server said {MASK}"


def test_the_store_uses_the_one_redaction_and_hides_a_query_password():
    url = f"redis://127.0.0.1:{free_port()}/0?password={PW}"  # nothing listens there
    with pytest.raises(StoreConnectionError, match="cannot reach Redis") as info:
        RedisStore(url, "ns:", connect_timeout_s=2)
    assert PW not in str(info.value) and "password=***" in str(info.value)
    assert store.redact is redact


# -- the password as a reference -------------------------------------------------------------------


def test_reference_and_resolve_round_trip_both_forms():
    for url, ref in [(f"redis://:{PW}@h:1/0", f"redis://:{REFERENCE}@h:1/0"),
                     (f"redis://ops:{PW}@h:1/0", f"redis://ops:{REFERENCE}@h:1/0"),
                     (f"rediss://h:1/0?password={PW}&db=2", f"rediss://h:1/0?password={REFERENCE}&db=2")]:
        assert as_reference(url) == ref
        assert resolve(ref, {PASSWORD_ENV: PW}) == url
    assert as_reference("redis://h:1/0") == "redis://h:1/0" and as_reference(None) is None
    assert resolve(f"redis://:{REFERENCE}@h:1/0", {PASSWORD_ENV: "a b/c"}) == "redis://:a%20b%2Fc@h:1/0"
    with pytest.raises(RedisPasswordError, match=f"neither \\${PASSWORD_ENV} nor \\${PASSWORD_FILE_ENV}"):
        resolve(f"redis://:{REFERENCE}@h:1/0", {})
    assert resolve(f"redis://:{REFERENCE}@h:1/0", {}, strict=False) == f"redis://:{REFERENCE}@h:1/0"


def test_the_password_file_must_be_the_owners_alone(tmp_path):
    secret = tmp_path / "redis-password"
    secret.write_text(PW + "\n")
    secret.chmod(0o600)
    assert read_password({PASSWORD_FILE_ENV: str(secret)}) == PW
    secret.chmod(0o644)
    with pytest.raises(RedisPasswordError, match=f"others can read it .*chmod 600 {secret}"):
        read_password({PASSWORD_FILE_ENV: str(secret)})
    with pytest.raises(RedisPasswordError, match="cannot read the Redis password"):
        read_password({PASSWORD_FILE_ENV: str(tmp_path / "missing")})


@pytest.mark.parametrize("placeholder", ["change-me", "CHANGEME", "password", "***"])
def test_a_placeholder_password_is_refused(tmp_path, placeholder, repo_root):
    with pytest.raises(RedisPasswordError, match="placeholder"):
        read_password({PASSWORD_ENV: placeholder})
    secret = tmp_path / "pw"
    secret.write_text(placeholder)
    secret.chmod(0o600)
    with pytest.raises(RedisPasswordError, match="placeholder"):
        read_password({PASSWORD_FILE_ENV: str(secret)})
    with pytest.raises(ConfigError, match=r"cluster.redis_url: the Redis password .* is the placeholder"):
        _tiny(repo_root, f"redis://:{placeholder}@h:1/0")


def _tiny(repo_root, redis_url: str | None):
    data = yaml.safe_load((repo_root / "examples" / "tiny.yaml").read_text())
    data["cluster"]["redis_url"] = redis_url
    return config_from_dict(data)


def test_written_configs_hold_the_reference_and_load_back(repo_root, monkeypatch):
    cfg = _tiny(repo_root, f"redis://:{PW}@h:1/0")
    assert cfg.cluster.redis_url == f"redis://:{PW}@h:1/0"  # in memory, for this process to use
    text = cfg.to_yaml()
    assert PW not in text and PW not in repr(cfg) and f"redis_url: redis://:{REFERENCE}@h:1/0" in text
    assert cfg.fingerprint() == _tiny(repo_root, "redis://:another-one-9@h:1/0").fingerprint()
    written = yaml.safe_load(text)
    monkeypatch.setenv(PASSWORD_ENV, PW)
    assert config_from_dict(written).cluster.redis_url == f"redis://:{PW}@h:1/0"


def test_an_unresolved_reference_is_refused_where_the_job_runs_not_where_it_is_submitted(repo_root):
    cfg = _tiny(repo_root, f"redis://:{REFERENCE}@h:1/0")
    problems = dict(runnable_problems(cfg))
    assert f"neither ${PASSWORD_ENV}" in problems["cluster.redis_url"]
    assert "cluster.redis_url" not in dict(runnable_problems(cfg, runs_here=False))


# -- status and stop --force: the password goes only to the operator's Redis ----------------------


class _Listener:
    """A TCP server that records every byte sent to it and closes each connection."""

    def __init__(self):
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.received = b""
        self.connected = threading.Event()
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self):
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.connected.set()
            with conn:
                conn.settimeout(2)
                with contextlib.suppress(OSError):  # a client's first write: AUTH comes first
                    self.received += conn.recv(65536)

    def close(self):
        self.sock.close()


@pytest.fixture
def listeners():
    made = []

    def make():
        made.append(_Listener())
        return made[-1]

    yield make
    for listener in made:
        listener.close()


def _fake_jobs(monkeypatch, metadata: dict[str, str]) -> None:
    info = SimpleNamespace(metadata=metadata, status="RUNNING", message="", start_time=None, end_time=None)
    jobs = SimpleNamespace(get_job_info=lambda _id: info, stop_job=lambda _id: True,
                           get_job_logs=lambda _id: "state RUNNING: training\n")
    monkeypatch.setattr(submit, "client", lambda _address: jobs)


def test_status_never_sends_the_password_to_the_host_a_jobs_metadata_names(monkeypatch, listeners):
    attacker, operator = listeners(), listeners()
    _fake_jobs(monkeypatch, {submit.METADATA_KEY: "tiny",
                             submit.REDIS_KEY: f"redis://:***@127.0.0.1:{attacker.port}/0"})
    env = {PASSWORD_ENV: PW}
    info = submit.status("http://ray:8265", "job-1", env=env)
    view = info["controller"]
    assert "sends only to the Redis you configure" in view.source and view.state == "RUNNING"
    with pytest.raises(submit.SubmitError, match="--force needs the job's Redis"):
        submit.stop("http://ray:8265", "job-1", force=True, env=env)
    assert not attacker.connected.is_set() and PW.encode() not in attacker.received

    # The operator's own Redis (its URL refers to the password) gets it, for status and stop.
    env[submit.job_view.URL_ENV] = f"redis://:{REFERENCE}@127.0.0.1:{operator.port}/0"
    info = submit.status("http://ray:8265", "job-1", env=env)
    assert PW not in info["controller"].source
    with pytest.raises(submit.SubmitError) as stopped:
        submit.stop("http://ray:8265", "job-1", force=True, env=env)
    assert PW not in str(stopped.value)
    assert operator.connected.wait(5) and PW.encode() in operator.received
    assert not attacker.connected.is_set()


def test_status_uses_a_metadata_url_that_needs_no_password_without_sending_one(monkeypatch, listeners):
    open_redis = listeners()
    _fake_jobs(monkeypatch, {submit.METADATA_KEY: "tiny",
                             submit.REDIS_KEY: f"redis://127.0.0.1:{open_redis.port}/0"})
    info = submit.status("http://ray:8265", "job-1", env={PASSWORD_ENV: PW})
    assert "cannot read the job record from redis://127.0.0.1" in info["controller"].source
    assert open_redis.connected.is_set() and PW.encode() not in open_redis.received
