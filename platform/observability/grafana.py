"""Upload longrun's dashboards to a running Grafana (`longrun dashboards push`).

Idempotent: the folder and the Prometheus datasource are created only when missing, and the
dashboards are saved with overwrite, under their fixed uids, so pushing twice replaces
rather than duplicates. The requests, in order:

    GET  /api/folders                          find the folder by title
    POST /api/folders                          create it when missing
    GET  /api/datasources/uid/longrun-prometheus
    POST /api/datasources                      create it when missing (needs --prometheus-url)
    POST /api/dashboards/db                    once per dashboard

Credentials come from the environment, never the command line (where `ps` shows them):
GRAFANA_TOKEN (a service account token), or GRAFANA_USER and GRAFANA_PASSWORD.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass

from longrun.observability.dashboards import all_dashboards
from longrun.observability.grafana_model import DEFAULT_DATASOURCE_UID

TIMEOUT_S = 10.0


class GrafanaPushError(RuntimeError):
    """Grafana could not be reached or refused a request; the message says what to do."""


@dataclass(frozen=True)
class PushResult:
    folder_uid: str
    folder_created: bool
    datasource_created: bool
    dashboards: list[str]  # uids
    urls: list[str]  # Grafana's URL path of each dashboard


def credential_from_env(env: Mapping[str, str] | None = None) -> str | tuple[str, str] | None:
    env = os.environ if env is None else env
    if env.get("GRAFANA_TOKEN"):
        return env["GRAFANA_TOKEN"]
    if env.get("GRAFANA_USER") or env.get("GRAFANA_PASSWORD"):
        if not (env.get("GRAFANA_USER") and env.get("GRAFANA_PASSWORD")):
            raise GrafanaPushError("set both GRAFANA_USER and GRAFANA_PASSWORD (or GRAFANA_TOKEN)")
        return env["GRAFANA_USER"], env["GRAFANA_PASSWORD"]
    return None


def folder_uid(title: str) -> str:
    """A stable uid for a folder title (Grafana uids: at most 40 of [a-zA-Z0-9_-])."""
    slug = re.sub(r"[^a-zA-Z0-9_-]+", "-", title).strip("-").lower()[:40]
    return slug or "longrun"


def push_dashboards(grafana_url: str, *, folder: str = "longrun", prometheus_url: str | None = None,
                    credential: str | tuple[str, str] | None = None,
                    datasource_uid: str = DEFAULT_DATASOURCE_UID) -> PushResult:
    from grafana_client import GrafanaApi

    api = GrafanaApi.from_url(grafana_url.rstrip("/"), credential=credential, timeout=TIMEOUT_S)
    # The session must not pick up an http_proxy from the environment for, say, a Grafana on
    # localhost; longrun talks to the URL it was given and nothing else.
    api.client.s.trust_env = False
    with _explained(grafana_url):
        folder_created = False
        existing = [f for f in api.folder.get_all_folders() if f.get("title") == folder]
        if existing:
            uid = existing[0]["uid"]
        else:
            uid = api.folder.create_folder(folder, uid=folder_uid(folder))["uid"]
            folder_created = True
        datasource_created = _ensure_datasource(api, datasource_uid, prometheus_url, grafana_url)
        uids, urls = [], []
        for dashboard in all_dashboards():
            model = dashboard.to_json(datasource_uid)
            reply = api.dashboard.update_dashboard({
                "dashboard": {**model, "id": None}, "folderUid": uid, "overwrite": True,
                "message": "longrun dashboards push"})
            uids.append(dashboard.uid)
            urls.append(reply.get("url", "") if isinstance(reply, dict) else "")
    return PushResult(uid, folder_created, datasource_created, uids, urls)


def _ensure_datasource(api, uid: str, prometheus_url: str | None, grafana_url: str) -> bool:
    from grafana_client.client import GrafanaClientError

    try:
        api.datasource.get_datasource_by_uid(uid)
        return False
    except GrafanaClientError as exc:
        if exc.status_code != 404:
            raise
    if not prometheus_url:
        raise GrafanaPushError(f"Grafana at {grafana_url} has no datasource with uid {uid!r}; pass "
                               "--prometheus-url URL (as Grafana's server reaches Prometheus) to create it")
    api.datasource.create_datasource({"name": uid, "uid": uid, "type": "prometheus", "access": "proxy",
                                      "url": prometheus_url, "isDefault": False,
                                      "jsonData": {"httpMethod": "POST", "timeInterval": "10s"}})
    return True


class _explained:
    """Turn grafana-client's and niquests' exceptions into one GrafanaPushError sentence."""

    def __init__(self, url: str):
        self.url = url

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb) -> bool:
        if exc is None or isinstance(exc, GrafanaPushError):
            return False
        from grafana_client.client import GrafanaException

        if isinstance(exc, GrafanaException) and exc.status_code:  # 0: no answer (timeout, transport)
            if exc.status_code == 401:
                raise GrafanaPushError(
                    f"Grafana at {self.url} refused the credentials (HTTP 401): set GRAFANA_TOKEN to a "
                    "service account token, or GRAFANA_USER and GRAFANA_PASSWORD") from exc
            if exc.status_code == 403:
                raise GrafanaPushError(
                    f"Grafana at {self.url} denied the request (HTTP 403): the account needs the Editor "
                    "role (Admin to create the datasource)") from exc
            raise GrafanaPushError(f"Grafana at {self.url} answered an error: {exc.message}") from exc
        # The HTTP library's transport errors (refused, DNS, TLS) are OSErrors.
        if isinstance(exc, GrafanaException | OSError):
            raise GrafanaPushError(f"cannot reach Grafana at {self.url}: {exc}; check --grafana-url "
                                   "and that Grafana is running") from exc
        return False
