"""`longrun dashboards push` against a fake Grafana on 127.0.0.1 that records every request."""

from __future__ import annotations

import base64
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from longrun.cli import main
from longrun.observability.grafana import GrafanaPushError, credential_from_env, folder_uid

UIDS = ["longrun-overview", "longrun-performance"]


class FakeGrafana:
    """Answers the handful of Grafana HTTP API calls `push` makes, like Grafana 10/11 does."""

    def __init__(self, *, folders=(), datasources=(), status: int | None = None):
        self.requests: list[dict] = []
        self.folders = list(folders)
        self.datasources = list(datasources)
        self.status = status  # answer everything with this status (401, 500, ...)
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):
                fake.handle(self, None)

            def do_POST(self):
                length = int(self.headers.get("Content-Length") or 0)
                fake.handle(self, json.loads(self.rfile.read(length)) if length else None)

            def log_message(self, *args):
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()

    def handle(self, h: BaseHTTPRequestHandler, body):
        path = h.path.split("?")[0]
        self.requests.append({"method": h.command, "path": path, "body": body,
                              "authorization": h.headers.get("Authorization")})
        if self.status is not None:
            return self.reply(h, self.status, {"message": "Unauthorized" if self.status == 401 else "boom"})
        if (h.command, path) == ("GET", "/api/folders"):
            return self.reply(h, 200, self.folders)
        if (h.command, path) == ("POST", "/api/folders"):
            folder = {"id": len(self.folders) + 1, "uid": body.get("uid") or "generated",
                      "title": body["title"]}
            self.folders.append(folder)
            return self.reply(h, 200, folder)
        if h.command == "GET" and path.startswith("/api/datasources/uid/"):
            uid = path.rsplit("/", 1)[1]
            match = [d for d in self.datasources if d["uid"] == uid]
            if not match:
                return self.reply(h, 404, {"message": "Data source not found"})
            return self.reply(h, 200, match[0])
        if (h.command, path) == ("POST", "/api/datasources"):
            self.datasources.append(body)
            return self.reply(h, 200, {"datasource": body, "id": 1, "message": "Datasource added"})
        if (h.command, path) == ("POST", "/api/dashboards/db"):
            uid = body["dashboard"]["uid"]
            return self.reply(h, 200, {"id": 7, "uid": uid, "status": "success", "version": 1,
                                       "url": f"/d/{uid}/{uid}"})
        return self.reply(h, 404, {"message": "Not found"})

    @staticmethod
    def reply(h, code: int, payload):
        data = json.dumps(payload).encode()
        h.send_response(code)
        h.send_header("Content-Type", "application/json")
        h.send_header("Content-Length", str(len(data)))
        h.end_headers()
        h.wfile.write(data)

    def calls(self) -> list[str]:
        return [f"{r['method']} {r['path']}" for r in self.requests]


@pytest.fixture
def grafana_env(monkeypatch):
    for var in ("GRAFANA_TOKEN", "GRAFANA_USER", "GRAFANA_PASSWORD", "GRAFANA_URL"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("NO_PROXY", "127.0.0.1,localhost")
    return monkeypatch


def test_push_creates_folder_and_datasource_then_saves_each_dashboard(grafana_env, capsys):
    grafana_env.setenv("GRAFANA_TOKEN", "glsa_secret")
    fake = FakeGrafana()
    try:
        code = main(["dashboards", "push", "--grafana-url", fake.url, "--folder", "Training Jobs",
                     "--prometheus-url", "http://prometheus:9090"])
    finally:
        fake.close()
    assert code == 0
    assert fake.calls() == ["GET /api/folders", "POST /api/folders",
                            "GET /api/datasources/uid/longrun-prometheus", "POST /api/datasources",
                            "POST /api/dashboards/db", "POST /api/dashboards/db"]
    assert all(r["authorization"] == "Bearer glsa_secret" for r in fake.requests)
    assert fake.requests[1]["body"] == {"title": "Training Jobs", "uid": "training-jobs"}
    datasource = fake.requests[3]["body"]
    assert (datasource["uid"], datasource["type"], datasource["url"], datasource["access"]) == \
        ("longrun-prometheus", "prometheus", "http://prometheus:9090", "proxy")
    saves = [r["body"] for r in fake.requests[4:]]
    assert [s["dashboard"]["uid"] for s in saves] == UIDS
    for s in saves:
        assert s["overwrite"] is True and s["folderUid"] == "training-jobs"
        assert s["dashboard"]["id"] is None  # Grafana matches on uid; a stale id would be refused
        assert s["dashboard"]["panels"] and s["dashboard"]["templating"]["list"][0]["name"] == "datasource"
    printed = capsys.readouterr().out
    assert "/d/longrun-overview/longrun-overview" in printed


def test_push_reuses_an_existing_folder_and_datasource_with_basic_auth(grafana_env):
    grafana_env.setenv("GRAFANA_USER", "admin")
    grafana_env.setenv("GRAFANA_PASSWORD", "pw")
    grafana_env.setenv("GRAFANA_URL", "unused-when-the-flag-is-given")
    fake = FakeGrafana(folders=[{"id": 3, "uid": "abc123", "title": "longrun"}],
                       datasources=[{"uid": "longrun-prometheus", "type": "prometheus"}])
    try:
        assert main(["dashboards", "push", "--grafana-url", fake.url + "/"]) == 0
    finally:
        fake.close()
    assert fake.calls() == ["GET /api/folders", "GET /api/datasources/uid/longrun-prometheus",
                            "POST /api/dashboards/db", "POST /api/dashboards/db"]
    expected = "Basic " + base64.b64encode(b"admin:pw").decode()
    assert all(r["authorization"] == expected for r in fake.requests)
    assert {r["body"]["folderUid"] for r in fake.requests[2:]} == {"abc123"}


def test_refused_credentials_give_a_clear_error_and_exit_1(grafana_env, capsys):
    grafana_env.setenv("GRAFANA_TOKEN", "wrong")
    fake = FakeGrafana(status=401)
    try:
        code = main(["dashboards", "push", "--grafana-url", fake.url])
    finally:
        fake.close()
    assert code == 1
    assert fake.calls() == ["GET /api/folders"]  # stops at the first refusal
    err = capsys.readouterr().err
    assert "refused the credentials (HTTP 401)" in err and "GRAFANA_TOKEN" in err


def test_missing_datasource_without_prometheus_url_is_explained(grafana_env, capsys):
    fake = FakeGrafana(folders=[{"id": 1, "uid": "longrun", "title": "longrun"}])
    try:
        assert main(["dashboards", "push", "--grafana-url", fake.url]) == 1
    finally:
        fake.close()
    assert "POST /api/dashboards/db" not in fake.calls()
    assert "--prometheus-url" in capsys.readouterr().err


def test_unreachable_grafana_and_missing_url(grafana_env, capsys):
    fake = FakeGrafana()
    url = fake.url
    fake.close()  # nothing listens there any more
    assert main(["dashboards", "push", "--grafana-url", url]) == 1
    assert f"cannot reach Grafana at {url}" in capsys.readouterr().err
    assert main(["dashboards", "push"]) == 1
    assert "--grafana-url" in capsys.readouterr().err


def test_server_errors_are_reported(grafana_env, capsys):
    fake = FakeGrafana(status=500)
    try:
        assert main(["dashboards", "push", "--grafana-url", fake.url]) == 1
    finally:
        fake.close()
    assert "answered an error" in capsys.readouterr().err


def test_credentials_from_the_environment():
    assert credential_from_env({}) is None
    assert credential_from_env({"GRAFANA_TOKEN": "t", "GRAFANA_USER": "u", "GRAFANA_PASSWORD": "p"}) == "t"
    assert credential_from_env({"GRAFANA_USER": "u", "GRAFANA_PASSWORD": "p"}) == ("u", "p")
    with pytest.raises(GrafanaPushError, match="both"):
        credential_from_env({"GRAFANA_USER": "u"})
    assert folder_uid("Training Jobs / prod") == "training-jobs-prod"
    assert folder_uid("!!!") == "longrun"


def test_push_finds_the_grafana_in_the_jobs_config(grafana_env, tmp_path, capsys):
    """`observability.grafana_url` is where a job's config names its Grafana: `--config` reads it
    (the flag and $GRAFANA_URL, when given, come first)."""
    fake = FakeGrafana(folders=[{"id": 1, "uid": "longrun", "title": "longrun"}],
                       datasources=[{"uid": "longrun-prometheus", "type": "prometheus"}])
    job = tmp_path / "job.yaml"
    job.write_text(f"job: {{name: j}}\nobservability: {{grafana_url: '{fake.url}'}}\n")
    try:
        assert main(["dashboards", "push", "--config", str(job)]) == 0
    finally:
        fake.close()
    assert fake.calls().count("POST /api/dashboards/db") == len(UIDS)
    job.write_text("job: {name: j}\n")
    assert main(["dashboards", "push", "--config", str(job)]) == 1
    assert "observability.grafana_url" in capsys.readouterr().err
