"""Grafana dashboard JSON, alert rules and the query inventory, checked without a Grafana.

The queries themselves are evaluated by a real Prometheus in test_observability_prometheus.py.
"""

from __future__ import annotations

import itertools
import re
from types import SimpleNamespace

import pytest
import yaml
from prometheus_client.openmetrics.exposition import generate_latest
from prometheus_client.openmetrics.parser import text_string_to_metric_families

from longrun.observability import alerts, dashboards
from longrun.observability.grafana_model import GRID_WIDTH, Dashboard, Panel, Row, Target
from longrun.observability.metrics import ControllerMetrics, WorkerMetrics
from longrun.observability.queries import DEFAULT_VALUES, UnknownVariable, all_queries, substitute

UIDS = ["longrun-overview", "longrun-performance"]


@pytest.fixture(scope="module")
def models() -> dict[str, dict]:
    return {d.uid: d.to_json() for d in dashboards.all_dashboards()}


def test_dashboards_have_stable_uids_and_grafana_essentials(models):
    assert list(models) == UIDS  # the uids are the dashboards' identity in Grafana: never change them
    for uid, m in models.items():
        assert m["uid"] == uid and m["title"].startswith("longrun / ") and m["schemaVersion"] >= 36
        assert m["time"]["to"] == "now" and "longrun" in m["tags"]
        variables = {v["name"]: v for v in m["templating"]["list"]}
        assert list(variables) == ["datasource", "job", "rank"]
        source = variables["datasource"]
        assert source["type"] == "datasource" and source["query"] == "prometheus"
        for name in ("job", "rank"):
            v = variables[name]
            assert v["type"] == "query" and v["datasource"]["uid"] == "${datasource}"
            assert re.fullmatch(rf"label_values\(longrun_\w+(\{{.*\}})?, {name}\)", v["definition"])
            assert v["query"]["query"] == v["definition"]
            assert v["includeAll"] and v["allValue"] == ".+"  # the regex the queries' =~ expects
        annotations = {a["name"]: a for a in m["annotations"]["list"]}
        assert "longrun_job_restarts_total" in annotations["Restarts"]["expr"]
        assert "longrun_job_faults_total" in annotations["Faults"]["expr"]
        assert annotations["Restarts"]["datasource"]["uid"] == "${datasource}"


def test_every_panel_has_a_position_and_targets(models):
    for m in models.values():
        ids = [p["id"] for p in m["panels"]]
        assert len(ids) == len(set(ids))
        for p in m["panels"]:
            pos = p["gridPos"]
            assert set(pos) == {"x", "y", "w", "h"} and all(isinstance(v, int) for v in pos.values())
            assert pos["x"] >= 0 and pos["y"] >= 0 and pos["w"] >= 1 and pos["h"] >= 1
            assert pos["x"] + pos["w"] <= GRID_WIDTH, p["title"]
            if p["type"] == "row":
                assert pos == {"x": 0, "y": pos["y"], "w": GRID_WIDTH, "h": 1}
                continue
            assert p["title"] and p["datasource"] == {"type": "prometheus", "uid": "${datasource}"}
            assert "unit" in p["fieldConfig"]["defaults"]
            refs = [t["refId"] for t in p["targets"]]
            assert refs and len(refs) == len(set(refs))
            for t in p["targets"]:
                assert t["expr"].strip() and t["datasource"]["uid"] == "${datasource}"
                assert 'job=~"$job"' in t["expr"] or "up{" in t["expr"], (p["title"], t["expr"])


def _cells(pos: dict) -> set[tuple[int, int]]:
    xs, ys = range(pos["x"], pos["x"] + pos["w"]), range(pos["y"], pos["y"] + pos["h"])
    return {(x, y) for x in xs for y in ys}


def test_panels_do_not_overlap(models):
    for m in models.values():
        for a, b in itertools.combinations(m["panels"], 2):
            assert not _cells(a["gridPos"]) & _cells(b["gridPos"]), (a["title"], b["title"])


def test_layout_wraps_and_rows_start_new_lines():
    target = (Target('x{job=~"$job"}'),)
    items = (Row("r1"), Panel("a", target, width=16, height=3), Panel("b", target, width=16, height=5),
             Panel("c", target, width=8, height=2), Row("r2"), Panel("d", target, width=24))
    d = Dashboard("t", "t", "", items)
    pos = {p["title"]: p["gridPos"] for p in d.to_json()["panels"]}
    assert pos["r1"] == {"x": 0, "y": 0, "w": 24, "h": 1}
    assert pos["a"] == {"x": 0, "y": 1, "w": 16, "h": 3}
    assert pos["b"] == {"x": 0, "y": 4, "w": 16, "h": 5}  # did not fit beside a
    assert pos["c"] == {"x": 16, "y": 4, "w": 8, "h": 2}  # fits beside b
    assert pos["r2"]["y"] == 9  # below the tallest panel of the line
    assert pos["d"]["y"] == 10
    with pytest.raises(ValueError, match="width"):
        Panel("wide", target, width=25)
    with pytest.raises(ValueError, match="uid"):
        Dashboard("not a uid!", "t", "", ())


def test_render_is_deterministic(tmp_path):
    first = {p.name: p.read_bytes() for p in dashboards.render(tmp_path / "a")}
    second = {p.name: p.read_bytes() for p in dashboards.render(tmp_path / "b")}
    assert first == second and sorted(first) == [f"{uid}.json" for uid in UIDS]
    assert all(b.endswith(b"}\n") for b in first.values())
    assert alerts.rules_text() == alerts.rules_text()


def test_checked_in_files_are_a_fresh_render(repo_root, tmp_path):
    """deploy/ holds the rendered dashboards and rules: run `longrun dashboards render` after
    changing platform/observability/dashboards.py or alerts.py."""
    fresh = {p.name: p.read_bytes() for p in dashboards.render(tmp_path)}
    checked_in = {p.name: p.read_bytes() for p in (repo_root / "deploy/grafana/dashboards").glob("*.json")}
    assert checked_in == fresh, "deploy/grafana/dashboards is stale: run `longrun dashboards render`"
    rules = (repo_root / "deploy/prometheus/rules.yml").read_text()
    assert rules == alerts.rules_text(), \
        "deploy/prometheus/rules.yml is stale: run `longrun dashboards render`"


def test_cli_render_writes_dashboards_and_rules(tmp_path):
    from longrun.cli import main

    argv = ["dashboards", "render", "--out", str(tmp_path / "d"), "--rules", str(tmp_path / "r.yml")]
    assert main(argv) == 0
    assert sorted(p.name for p in (tmp_path / "d").iterdir()) == [f"{uid}.json" for uid in UIDS]
    assert yaml.safe_load((tmp_path / "r.yml").read_text()) == alerts.rules_document()


def test_alert_rules_document():
    doc = alerts.rules_document()
    rules = doc["groups"][0]["rules"]
    assert [r["alert"] for r in rules] == ["LongrunJobFailed", "LongrunHeartbeatStale", "LongrunRestartStorm",
                                           "LongrunMFUDrop", "LongrunCheckpointStale"]
    for r in rules:
        assert r["labels"]["severity"] in ("critical", "warning")
        assert r["annotations"]["runbook"].startswith("docs/operations.md#")
        assert "$job" not in r["expr"]  # rules are not dashboards: no template variables


def test_every_runbook_anchor_exists_in_the_operations_guide(repo_root):
    guide = (repo_root / "docs/operations.md").read_text()
    # GitHub's anchor of a heading: lowercase, punctuation dropped, spaces to dashes.
    anchors = {re.sub(r"[^a-z0-9 _-]", "", h.strip().lower()).replace(" ", "-")
               for h in re.findall(r"^#+ (.+)$", guide, re.M)}
    for rule in alerts.RULES:
        assert rule.runbook.split("#")[1] in anchors, rule.name


def test_all_queries_covers_every_panel_variable_annotation_and_alert():
    queries = all_queries()
    sources = [q.source for q in queries]
    exprs = {q.expr for q in queries}
    for d in dashboards.all_dashboards():
        for p in d.panels():
            for t in p.targets:
                assert t.expr in exprs, (d.uid, p.title)
        for a in d.annotations:
            assert a.expr in exprs
    for rule in alerts.RULES:
        assert rule.expr in exprs and rule.signal in exprs
    assert "variable $job" in sources and "variable $rank" in sources
    assert sum(q.expects_data for q in queries) > 30
    for q in queries:
        resolved = q.resolved()
        assert "$" not in resolved, resolved
    assert substitute('a{job=~"$job"}[$__rate_interval]') == 'a{job=~".+"}[1m]'
    assert substitute("${rank}", {**DEFAULT_VALUES, "rank": "(0|1)"}) == "(0|1)"
    with pytest.raises(UnknownVariable, match=r"\$nope"):
        substitute("x[$nope]")


def _exported_names() -> set[str]:
    worker = WorkerMetrics("j", 0)
    worker.observe_step(SimpleNamespace(step=1, loss=1.0, grad_norm=1.0, lr=1.0, tokens=1, tokens_per_s=1.0,
                                        step_time_s=1.0, data_wait_s=0.0, mfu=0.5, memory_bytes=1,
                                        val_loss=1.0))
    worker.observe_phase("forward", 0.1)
    worker.observe_checkpoint(0.1, 0.2)
    worker.checkpoint_committed(1, 1.0)
    worker.observe_cp_plan([2], 1.0, 1.0)
    worker.observe_group_init("total", 1.0)
    worker.observe_state("single", {"parameters": 1})
    worker.observe_restore("storage", 1.0)
    controller = ControllerMetrics("j")
    controller.heartbeat_age(0, "n", 1.0, sent_at=1.0)
    controller.diagnostics("n", "compute", True, 1.0)
    controller.group_init("total", 1.0)
    names = set()
    for registry in (worker.registry, controller.registry):
        for family in text_string_to_metric_families(generate_latest(registry).decode()):
            names |= {s.name for s in family.samples}
    return names


def test_every_metric_a_query_names_is_exported():
    """A typo in a metric name would make a panel silently empty; catch it without Prometheus."""
    exported = _exported_names()
    # (longrun_job_state is also the enum's label name; as a metric it is exported too.)
    used = {name for q in all_queries() for name in re.findall(r"\blongrun_[a-z_]+\b", q.expr)}
    assert len(used) > 20
    missing = sorted(used - exported)
    assert not missing, f"queries name metrics no exporter has: {missing}"


def test_the_overview_shows_goodput_and_where_the_time_went(models):
    panels = {p["title"]: p for p in models["longrun-overview"]["panels"]}
    goodput, spent = panels["Goodput"], panels["Time by bucket"]
    assert goodput["type"] == "stat" and goodput["fieldConfig"]["defaults"]["unit"] == "percentunit"
    assert "longrun_goodput_ratio" in goodput["targets"][0]["expr"]
    assert spent["type"] == "timeseries" and spent["fieldConfig"]["defaults"]["unit"] == "s"
    assert spent["fieldConfig"]["defaults"]["custom"]["stacking"]["mode"] == "normal"
    assert spent["targets"][0]["expr"].startswith("sum by (bucket) (longrun_job_seconds_total{")

