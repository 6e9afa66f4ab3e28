"""Every PromQL expression longrun ships, and a check that runs them against a Prometheus.

    for q in all_queries(): print(q.source, q.resolved())
    report = check_queries(prometheus.query)     # any callable: expr -> the API's `data`
    report.errors    # queries Prometheus refused: always a bug
    report.empty     # queries that must show data for a running job but returned none

Dashboards use Grafana's template variables; `resolved()` substitutes values that match
everything ($job -> .+) and fixed windows for Grafana's interval variables, so a plain
Prometheus can evaluate them. Alert expressions and annotations are empty while all is well,
so they are only required to evaluate (`expects_data` False); each alert's `signal` (the
quantity it thresholds) is required to have data like a panel.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field

from longrun.observability import alerts, dashboards

# $__rate_interval is at least four scrape intervals in Grafana; one minute covers the 1-15 s
# intervals longrun's configs use.
DEFAULT_VALUES: Mapping[str, str] = {
    "job": ".+", "rank": ".+", "datasource": "longrun-prometheus",
    "__rate_interval": "1m", "__interval": "1m", "__range": "5m",
}
_VARIABLE = re.compile(r"\$\{(\w+)\}|\$(\w+)")
_LABEL_VALUES = re.compile(r"^label_values\((.+),\s*(\w+)\)$")


class UnknownVariable(ValueError):
    pass


def substitute(expr: str, values: Mapping[str, str] = DEFAULT_VALUES) -> str:
    def one(m: re.Match) -> str:
        name = m.group(1) or m.group(2)
        if name not in values:
            raise UnknownVariable(f"no value for ${name} in {expr!r}")
        return values[name]

    return _VARIABLE.sub(one, expr)


@dataclass(frozen=True)
class Query:
    source: str  # "dashboard longrun-overview: Throughput", "alert LongrunJobFailed", ...
    expr: str  # as shipped, template variables included
    expects_data: bool

    def resolved(self, values: Mapping[str, str] = DEFAULT_VALUES) -> str:
        return substitute(self.expr, values)


def all_queries() -> list[Query]:
    """Every panel target, template variable and annotation of every dashboard, and every alert
    rule with its signal; duplicates (the variables both dashboards share) once."""
    found: list[Query] = []
    for d in dashboards.all_dashboards():
        for v in d.variables:
            # Grafana's label_values(metric, label) is the label's values among the metric's series.
            metric, label = _LABEL_VALUES.match(v.definition).groups()
            found.append(Query(f"variable ${v.name}", f"count by ({label}) ({metric})", True))
        for a in d.annotations:
            found.append(Query(f"annotation {a.name}", a.expr, False))
        for p in d.panels():
            for t in p.targets:
                found.append(Query(f"dashboard {d.uid}: {p.title}", t.expr, True))
    for rule in alerts.RULES:
        found.append(Query(f"alert {rule.name}", rule.expr, False))
        found.append(Query(f"alert {rule.name} (signal)", rule.signal, True))
    return list(dict.fromkeys(found))


def has_data(data: Mapping) -> bool:
    """Whether an /api/v1/query `data` object holds any sample (a scalar or string always does)."""
    if data.get("resultType") in ("scalar", "string"):
        return True
    return bool(data.get("result"))


@dataclass
class QueryReport:
    checked: int = 0
    empty: list[Query] = field(default_factory=list)
    errors: list[tuple[Query, str]] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.empty and not self.errors

    def describe(self) -> str:
        lines = [f"{len(self.errors)} error(s), {len(self.empty)} without data, of {self.checked} queries"]
        lines += [f"  error: {q.source}: {q.resolved()}: {why}" for q, why in self.errors]
        lines += [f"  empty: {q.source}: {q.resolved()}" for q in self.empty]
        return "\n".join(lines)


def check_queries(query: Callable[[str], Mapping], queries: Iterable[Query] | None = None,
                  values: Mapping[str, str] = DEFAULT_VALUES) -> QueryReport:
    """Evaluate `queries` (default: all_queries()) with `query` (expr -> API data; raises on a
    refused query). Errors are collected, not raised, so one report names every problem."""
    report = QueryReport()
    for q in all_queries() if queries is None else queries:
        report.checked += 1
        try:
            data = query(q.resolved(values))
        except Exception as exc:
            report.errors.append((q, str(exc)))
            continue
        if q.expects_data and not has_data(data):
            report.empty.append(q)
    return report


def queries_without_data(query: Callable[[str], Mapping],
                         values: Mapping[str, str] = DEFAULT_VALUES) -> list[Query]:
    """The queries that must show data but return none; raises if any query is refused."""
    report = check_queries(query, values=values)
    if report.errors:
        raise ValueError(report.describe())
    return report.empty
