"""An embedded `prometheus` server on loopback, for tests and local checks of the dashboards.

    with EmbeddedPrometheus(sd_urls=[controller_server.sd_url], rules=alerts.rules_text()) as prom:
        prom.wait_for('up{job="my-run"} == 1')
        prom.query('sum(rate(longrun_train_tokens_total[1m]))')   # the API's `data` object

Started from the Debian `prometheus` binary with a private temporary TSDB, bound to
127.0.0.1 on a free port, scraping every second by default. The scrape config honours the
targets' labels (see longrun.observability.vocab for why the label is `job`). Give either a
full `config_text` or scrape targets / http_sd URLs to build one from.
"""

from __future__ import annotations

import json
import shutil
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import yaml

from longrun.services.process import EmbeddedServer, ManagedProcess, ServiceError

INSTALL_HINT = "install it with: apt-get update && apt-get install -y prometheus (or run scripts/bootstrap)"
# Loopback only: a ProxyHandler without proxies, so an http_proxy in the environment never
# carries a query off the machine.
_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))


class PromQLError(RuntimeError):
    """Prometheus refused a query (bad syntax, wrong types); the message is Prometheus' own."""


def find_prometheus() -> str:
    path = shutil.which("prometheus")
    if path is None:
        raise ServiceError(f"prometheus was not found on PATH; {INSTALL_HINT}")
    return path


def scrape_config(*, targets: Sequence[str] = (), sd_urls: Sequence[str] = (), interval: str = "1s",
                  job_name: str = "longrun", rule_files: Sequence[str] = ()) -> str:
    """A prometheus.yml scraping static `targets` and the http_sd endpoints `sd_urls`."""
    scrape: dict = {"job_name": job_name, "honor_labels": True, "scrape_interval": interval,
                    "scrape_timeout": interval}
    if targets:
        scrape["static_configs"] = [{"targets": list(targets)}]
    if sd_urls:
        scrape["http_sd_configs"] = [{"url": url, "refresh_interval": interval} for url in sd_urls]
    config = {"global": {"scrape_interval": interval, "evaluation_interval": interval},
              "scrape_configs": [scrape]}
    if rule_files:
        config["rule_files"] = list(rule_files)
    return yaml.safe_dump(config, sort_keys=False)


class EmbeddedPrometheus(EmbeddedServer):
    name = "prometheus"
    retry_grace_s = 2.0

    def __init__(self, config_text: str | None = None, *, targets: Sequence[str] = (),
                 sd_urls: Sequence[str] = (), scrape_interval: str = "1s", rules: str | None = None,
                 host: str = "127.0.0.1", port: int | None = None, start_timeout_s: float = 30.0):
        if config_text is not None and (targets or sd_urls):
            raise ValueError("give either config_text or targets/sd_urls, not both")
        super().__init__(host=host, port=port, start_timeout_s=start_timeout_s)
        self.config_text = config_text
        self.targets, self.sd_urls, self.scrape_interval = list(targets), list(sd_urls), scrape_interval
        self.rules = rules

    @property
    def url(self) -> str:
        if self.port is None:
            raise ServiceError("the embedded Prometheus is not running; call start() first")
        return f"http://{self.host}:{self.port}"

    def _prepare(self, workdir: Path) -> None:
        self._binary = find_prometheus()
        rule_files = []
        if self.rules is not None:
            (workdir / "rules.yml").write_text(self.rules)
            rule_files.append(str(workdir / "rules.yml"))
        config = self.config_text or scrape_config(targets=self.targets, sd_urls=self.sd_urls,
                                                   interval=self.scrape_interval, rule_files=rule_files)
        (workdir / "prometheus.yml").write_text(config)

    def _launch(self, workdir: Path) -> ManagedProcess:
        argv = [self._binary, f"--config.file={workdir / 'prometheus.yml'}",
                f"--storage.tsdb.path={workdir / 'data'}",
                f"--web.listen-address={self.host}:{self.port}",
                "--storage.tsdb.retention.time=1d", "--log.level=warn"]
        return ManagedProcess("prometheus", argv, workdir / "prometheus.log")

    # --- the HTTP API -------------------------------------------------------------------------

    def api(self, path: str, params: Mapping[str, str] | None = None, *, post: bool = False) -> dict:
        """GET (or POST, form-encoded: long queries) `path` of the HTTP API; returns its `data`,
        or raises PromQLError."""
        encoded = urllib.parse.urlencode(params or {})
        if post:
            request = urllib.request.Request(self.url + path, data=encoded.encode())
        else:
            request = urllib.request.Request(self.url + path + (f"?{encoded}" if encoded else ""))
        try:
            with _OPENER.open(request, timeout=30) as response:
                payload = json.load(response)
        except urllib.error.HTTPError as exc:  # 400/422: a query Prometheus refused, with a reason
            try:
                payload = json.load(exc)
            except ValueError:
                raise PromQLError(f"{path}: HTTP {exc.code}") from exc
        if payload.get("status") != "success":
            raise PromQLError(f"{payload.get('errorType', 'error')}: {payload.get('error', payload)}")
        return payload["data"]

    def query(self, expr: str, at: float | None = None) -> dict:
        """An instant query, now or at unix time `at` (e.g. while a job that has since ended was
        running): the API's data, {"resultType": ..., "result": ...}."""
        params = {"query": expr} if at is None else {"query": expr, "time": f"{at:.3f}"}
        return self.api("/api/v1/query", params, post=True)

    def active_targets(self) -> list[dict]:
        return self.api("/api/v1/targets", {"state": "active"})["activeTargets"]

    def rule_groups(self) -> list[dict]:
        return self.api("/api/v1/rules")["groups"]

    def wait_for(self, expr: str, *, timeout_s: float = 30.0,
                 predicate: Callable[[dict], bool] | None = None) -> dict:
        """Poll `expr` until it returns data (or `predicate(data)` holds); returns the data.
        Prometheus offers no way to be told when a scrape landed, so polling the API is the
        synchronisation."""
        predicate = predicate or (lambda data: bool(data.get("result")))
        deadline = time.monotonic() + timeout_s
        delay = 0.05
        while True:
            data = self.query(expr)
            if predicate(data):
                return data
            if time.monotonic() > deadline:
                raise TimeoutError(f"{expr!r} did not return the expected data within {timeout_s:g} s; "
                                   f"last: {data}; targets: {self._target_summary()}")
            self._check_alive()
            time.sleep(delay)
            delay = min(delay * 2, 0.5)

    def _target_summary(self) -> str:
        try:
            return "; ".join(f"{t['scrapeUrl']} {t['health']} {t.get('lastError', '')}".strip()
                             for t in self.active_targets()) or "none"
        except (PromQLError, OSError) as exc:
            return f"unavailable ({exc})"

    def _check_alive(self) -> None:
        if self.process is not None and not self.process.alive():
            raise ServiceError(f"prometheus exited with code {self.process.proc.returncode}:\n"
                               f"{self.process.log_tail()}")

    def _wait_ready(self) -> None:
        assert self.process is not None
        deadline = time.monotonic() + self.start_timeout_s
        delay = 0.02
        while True:
            if not self.process.alive():
                raise ServiceError(f"prometheus exited with code {self.process.proc.returncode} during "
                                   f"start-up (a bad config or rule file, or the port is taken):\n"
                                   f"{self.process.log_tail()}")
            try:
                with _OPENER.open(f"{self.url}/-/ready", timeout=2) as response:
                    if response.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                pass
            if time.monotonic() > deadline:
                raise ServiceError(f"prometheus did not become ready on {self.host}:{self.port} within "
                                   f"{self.start_timeout_s:.0f} s:\n{self.process.log_tail()}")
            time.sleep(delay)  # polling a server that is starting; no event to wait on
            delay = min(delay * 2, 0.25)
