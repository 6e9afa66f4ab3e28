"""A small Python model of Grafana dashboards, rendered to Grafana's dashboard JSON.

Dashboards are code so that their queries can be tested against a real Prometheus (see
queries.py), reviewed in diffs, and rendered to the same bytes every time. Panels flow left
to right in a 24-column grid and wrap; a Row starts a new line. Only what longrun's
dashboards use is modelled: timeseries, stat, bargauge and heatmap panels of PromQL targets.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

GRID_WIDTH = 24
SCHEMA_VERSION = 39  # Grafana 10.4 / 11; newer Grafana migrates older schemas on load
# Every panel asks the dashboard's `datasource` variable, so one dashboard serves any
# Prometheus the operator picks (and the provisioned one by default).
DATASOURCE_REF = {"type": "prometheus", "uid": "${datasource}"}
DEFAULT_DATASOURCE_UID = "longrun-prometheus"
KINDS = ("timeseries", "stat", "bargauge", "heatmap")
_UID = re.compile(r"^[a-zA-Z0-9_-]{1,40}$")


@dataclass(frozen=True)
class Target:
    expr: str  # PromQL; may use $job, $rank, $__rate_interval, $__range
    legend: str = ""
    instant: bool = False  # one value per series (stat, bargauge), not a range
    heatmap: bool = False  # histogram buckets for a heatmap panel


@dataclass(frozen=True)
class Panel:
    title: str
    targets: tuple[Target, ...]
    unit: str = "short"
    kind: str = "timeseries"
    width: int = 12
    height: int = 8
    description: str = ""  # shown as the panel's (i) tooltip; says what to look for
    stack: bool = False
    text_mode: str = "auto"  # stat panels: "name" shows the legend (e.g. a state) instead of the value
    thresholds: tuple[tuple[float | None, str], ...] = ()  # (from value, colour); None = base

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"panel {self.title!r}: kind must be one of {KINDS}, got {self.kind!r}")
        if not 1 <= self.width <= GRID_WIDTH or self.height < 1:
            raise ValueError(f"panel {self.title!r}: width must be 1..{GRID_WIDTH} and height >= 1")
        if not self.targets:
            raise ValueError(f"panel {self.title!r} has no targets")


@dataclass(frozen=True)
class Row:
    title: str


@dataclass(frozen=True)
class Variable:
    """A query variable over a label's values (`label_values(metric, label)` in Grafana)."""

    name: str
    label: str
    metric: str  # a series selector whose `name` label values are offered
    description: str = ""

    @property
    def definition(self) -> str:
        return f"label_values({self.metric}, {self.name})"


@dataclass(frozen=True)
class Annotation:
    name: str
    expr: str  # PromQL; every series point it returns marks the time
    colour: str
    title: str
    text: str  # legend-style template, e.g. "{{cause}}"
    tag_keys: str = ""


@dataclass(frozen=True)
class Dashboard:
    uid: str
    title: str
    description: str
    items: tuple[Panel | Row, ...]
    variables: tuple[Variable, ...] = ()
    annotations: tuple[Annotation, ...] = ()
    tags: tuple[str, ...] = ("longrun",)
    links_tag: str = "longrun"  # a link menu to every dashboard with this tag
    time_from: str = "now-3h"
    refresh: str = "30s"

    def __post_init__(self):
        if not _UID.match(self.uid):
            raise ValueError(f"dashboard uid {self.uid!r} must be 1-40 of [a-zA-Z0-9_-]")

    def panels(self) -> list[Panel]:
        return [item for item in self.items if isinstance(item, Panel)]

    def to_json(self, datasource_uid: str = DEFAULT_DATASOURCE_UID) -> dict:
        return {
            "uid": self.uid,
            "title": self.title,
            "description": self.description,
            "tags": list(self.tags),
            "editable": True,
            "graphTooltip": 1,  # shared crosshair: the same moment on every panel
            "schemaVersion": SCHEMA_VERSION,
            "version": 1,
            "timezone": "browser",
            "time": {"from": self.time_from, "to": "now"},
            "refresh": self.refresh,
            "links": [{"type": "dashboards", "tags": [self.links_tag], "asDropdown": False,
                       "title": "longrun", "includeVars": True, "keepTime": True, "icon": "external link",
                       "targetBlank": False}],
            "templating": {"list": [_datasource_variable(datasource_uid),
                                    *(_query_variable(v) for v in self.variables)]},
            "annotations": {"list": [_builtin_annotation(), *(_annotation(a) for a in self.annotations)]},
            "panels": _layout(self.items),
        }


def _layout(items: tuple[Panel | Row, ...]) -> list[dict]:
    """Place items on the grid: fill a line left to right, wrap when the next panel does not
    fit, start the next line below the tallest panel of this one; a row takes a line of its own."""
    out: list[dict] = []
    x = y = line_height = 0
    for pid, item in enumerate(items, start=1):
        if isinstance(item, Row):
            y += line_height
            out.append({"id": pid, "type": "row", "title": item.title, "collapsed": False, "panels": [],
                        "gridPos": {"x": 0, "y": y, "w": GRID_WIDTH, "h": 1}})
            x, y, line_height = 0, y + 1, 0
            continue
        if x + item.width > GRID_WIDTH:
            x, y, line_height = 0, y + line_height, 0
        out.append(_panel(pid, item, {"x": x, "y": y, "w": item.width, "h": item.height}))
        x += item.width
        line_height = max(line_height, item.height)
    return out


def _panel(pid: int, p: Panel, grid: dict) -> dict:
    steps = [{"color": c, "value": v} for v, c in (p.thresholds or ((None, "green"),))]
    defaults: dict = {"unit": p.unit, "thresholds": {"mode": "absolute", "steps": steps}}
    if p.kind == "timeseries":
        defaults["custom"] = {"drawStyle": "line", "lineWidth": 1, "fillOpacity": 10 if p.stack else 0,
                              "showPoints": "never", "spanNulls": False,
                              "stacking": {"mode": "normal" if p.stack else "none", "group": "A"}}
    reduce = {"calcs": ["lastNotNull"], "fields": "", "values": False}
    options = {
        "timeseries": {"legend": {"displayMode": "list", "placement": "bottom", "showLegend": True},
                       "tooltip": {"mode": "multi", "sort": "desc"}},
        "stat": {"reduceOptions": reduce, "textMode": p.text_mode, "colorMode": "value",
                 "graphMode": "none", "justifyMode": "auto", "orientation": "auto"},
        "bargauge": {"reduceOptions": reduce, "displayMode": "gradient", "orientation": "horizontal",
                     "showUnfilled": True},
        "heatmap": {"calculate": False, "yAxis": {"axisPlacement": "left", "unit": p.unit},
                    "cellGap": 1, "color": {"mode": "scheme", "scheme": "Oranges"},
                    "tooltip": {"show": True, "yHistogram": False}},
    }[p.kind]
    return {
        "id": pid, "type": p.kind, "title": p.title, "description": p.description,
        "datasource": DATASOURCE_REF, "gridPos": grid,
        "fieldConfig": {"defaults": defaults, "overrides": []}, "options": options,
        "targets": [_target(t, chr(ord("A") + i)) for i, t in enumerate(p.targets)],
    }


def _target(t: Target, ref_id: str) -> dict:
    return {"refId": ref_id, "datasource": DATASOURCE_REF, "expr": t.expr, "legendFormat": t.legend,
            "instant": t.instant, "range": not t.instant, "format": "heatmap" if t.heatmap else "time_series",
            "editorMode": "code"}


def _datasource_variable(default_uid: str) -> dict:
    return {"name": "datasource", "label": "Data source", "type": "datasource", "query": "prometheus",
            "current": {"selected": False, "text": default_uid, "value": default_uid},
            "hide": 0, "includeAll": False, "multi": False, "options": [], "refresh": 1, "regex": ""}


def _query_variable(v: Variable) -> dict:
    return {"name": v.name, "label": v.label, "description": v.description, "type": "query",
            "datasource": DATASOURCE_REF, "definition": v.definition,
            "query": {"query": v.definition, "refId": f"{v.name}-values", "qryType": 1},
            "refresh": 2,  # on time-range change: new jobs and ranks appear without a reload
            "includeAll": True, "multi": True, "allValue": ".+",  # queries use label=~"$var"
            "current": {"selected": True, "text": ["All"], "value": ["$__all"]},
            "hide": 0, "options": [], "regex": "", "sort": 3 if v.name == "rank" else 1}


def _builtin_annotation() -> dict:
    return {"builtIn": 1, "datasource": {"type": "grafana", "uid": "-- Grafana --"}, "enable": True,
            "hide": True, "iconColor": "rgba(0, 211, 255, 1)", "name": "Annotations & Alerts",
            "type": "dashboard"}


def _annotation(a: Annotation) -> dict:
    return {"name": a.name, "datasource": DATASOURCE_REF, "enable": True, "hide": False,
            "iconColor": a.colour, "expr": a.expr, "step": "30s", "titleFormat": a.title,
            "textFormat": a.text, "tagKeys": a.tag_keys, "useValueForTime": False}
