"""A real `longrun run` whose config carries the Redis password: afterwards the password is in
no file the run wrote, no key or value in Redis (the job record, its events, the ledger) and no
line of its console log. The resolved config holds a reference in its place, which loads back
when the password is in the environment."""

from __future__ import annotations

import os
import secrets
import subprocess
import sys
from urllib.parse import quote

import redis
import yaml

from longrun import keys
from longrun.config import load_config
from longrun.redis_password import PASSWORD_ENV, REFERENCE
from longrun.services import EmbeddedRedis


def _forms(password: str) -> list[bytes]:
    """The password as it could appear: raw, and URL-quoted either way."""
    return sorted({password.encode(), quote(password, safe="").encode(), quote(password).encode()})


def _redis_dump(client: redis.Redis) -> list[bytes]:
    """Every key of the database and every value under it, whatever its type."""
    out = []
    for key in client.scan_iter(count=1000):
        out.append(key)
        kind = client.type(key).decode()
        if kind == "string":
            out.append(client.get(key))
        elif kind == "hash":
            out += [b for kv in client.hgetall(key).items() for b in kv]
        elif kind == "list":
            out += client.lrange(key, 0, -1)
        elif kind == "set":
            out += list(client.smembers(key))
        elif kind == "zset":
            out += [m for m, _ in client.zrange(key, 0, -1, withscores=True)]
        elif kind == "stream":
            out += [b for _, fields in client.xrange(key) for kv in fields.items() for b in kv]
    return out


def test_a_password_bearing_config_leaves_the_password_nowhere(repo_root, tmp_path):
    # Characters a URL must quote, so both spellings are searched for.
    password = secrets.token_urlsafe(18) + "+/%"
    with EmbeddedRedis(password=password) as server:
        cfg = yaml.safe_load((repo_root / "examples" / "tiny.yaml").read_text())
        out_dir = tmp_path / "out"
        cfg["job"]["output_dir"] = str(out_dir)
        cfg["cluster"]["redis_url"] = server.url
        cfg["training"].update(steps=4, warmup_steps=1)
        cfg["checkpoint"].update(interval_steps=2)
        config = tmp_path / "job.yaml"  # the user's own file: the one place the password was put
        config.write_text(yaml.safe_dump(cfg))
        env = {k: v for k, v in os.environ.items() if not k.startswith("LONGRUN_REDIS")}
        run = subprocess.run([sys.executable, "-m", "longrun.cli", "run", str(config)], cwd=tmp_path,
                             env=env, capture_output=True, text=True, timeout=300)
        log = run.stdout + run.stderr
        assert run.returncode == 0, log
        assert "state SUCCEEDED" in log and "done: 4 steps" in log, log

        forms = _forms(password)
        written = [p for p in out_dir.rglob("*") if p.is_file()]
        assert out_dir / "tiny" / "config.yaml" in written
        assert any("checkpoints" in p.parts for p in written), written
        leaked = [str(p) for p in written if any(f in p.read_bytes() for f in forms)]
        assert leaked == [], f"the password is written in {leaked}"

        client = server.client()
        try:
            assert client.exists(keys.job_record_key("tiny")) and client.exists(keys.job_events_key("tiny"))
            stored = _redis_dump(client)
        finally:
            client.close()
        assert not [v for v in stored if any(f in v for f in forms)], "the password is stored in Redis"
        assert not any(f.decode() in log for f in forms), "the password is in the console log"

        # The resolved config names where the password comes from, and loads back with it.
        resolved = out_dir / "tiny" / "config.yaml"
        assert REFERENCE in yaml.safe_load(resolved.read_text())["cluster"]["redis_url"]
        os.environ[PASSWORD_ENV] = password
        try:
            assert load_config(resolved).cluster.redis_url == server.url
        finally:
            del os.environ[PASSWORD_ENV]

