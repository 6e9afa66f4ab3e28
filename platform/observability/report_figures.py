"""The report's four charts, each a pure function of a Journal (see report.py for the why).

Times are shown in UTC (a report is read on machines in other time zones than the job's), as
naive date strings: plotly.js would ignore an offset anyway. A series longer than
MAX_POINTS per attempt is thinned to every k-th step (its last kept): a week of one-second
steps would otherwise make a file of tens of MB that a browser draws slowly; the fault
markers keep the moments that matter visible whatever the thinning.
"""

from __future__ import annotations

import html
import math
import textwrap
from collections.abc import Iterable
from datetime import UTC, datetime
from typing import Any

import plotly.graph_objects as go

from longrun.goodput.accounting import BUCKETS
from longrun.goodput.summary import duration
from longrun.kinds import TERMINAL_STATES
from longrun.observability.journal import Journal

MAX_POINTS = 5000
FONT = dict(family="Helvetica, Arial, sans-serif", size=13)
# State rows: the label a person reads and a colour (startup blues, running green, trouble orange).
STATES = {"PENDING": ("pending", "#c6dbef"), "PLACING": ("placing", "#9ecae1"),
          "DIAGNOSING": ("self-checks", "#6baed6"), "RENDEZVOUS": ("rendezvous", "#3182bd"),
          "RUNNING": ("running", "#31a354"), "RECOVERING": ("recovering (backoff)", "#fd8d3c"),
          "PREEMPTING": ("preempting", "#9467bd")}
DOWN = ("no controller (ended)", "#d9d9d9")  # after a terminal state, until a later run resumed
FAULT_COLORS = {"node_lost": "#7f0000", "diagnostics_failed": "#b30000", "fatal": "#000000",
                "dead": "#d62728", "hang": "#e6550d", "nan": "#8c6d31", "loss_spike": "#bcbd22",
                "exception": "#e377c2", "straggler": "#17becf"}
SOURCE_COLORS = {"storage": "#1f77b4", "memory": "#2ca02c", "none": "#7f7f7f"}
# By name, so a bucket added to accounting.BUCKETS later is drawn (grey) rather than breaking this.
BUCKET_COLORS = {"productive": "#31a354", "redone": "#d62728", "startup": "#9ecae1",
                 "restore_memory": "#74c476", "restore_storage": "#3182bd", "checkpoint": "#6baed6",
                 "snapshot": "#a1d99b", "validation": "#c7e9c0", "data_wait": "#fdd0a2",
                 "detection": "#e6550d", "backoff": "#fd8d3c",
                 "controller_down": "#252525", "waiting_for_nodes": "#bdbdbd", "preemption_save": "#9467bd",
                 "shutdown": "#636363"}
SHOWN_ELSEWHERE = {"transition", "fault", "resumed", "recovered", "resized"}


def when(unix: float) -> str:
    return datetime.fromtimestamp(unix, UTC).strftime("%Y-%m-%d %H:%M:%S.%f")[:-3]


def wrap(text: Any, width: int = 72) -> str:
    """Hover text: escaped (plotly reads a few HTML tags) and broken into lines a hover box holds."""
    return "<br>".join(textwrap.wrap(html.escape(str(text), quote=False), width, break_long_words=False))


def finite(value: Any) -> bool:
    return isinstance(value, int | float) and math.isfinite(value)


def thin(rows: list[dict[str, Any]], limit: int = MAX_POINTS) -> list[dict[str, Any]]:
    if len(rows) <= limit:
        return rows
    k = math.ceil(len(rows) / limit)
    kept = rows[::k]
    return kept if kept[-1] is rows[-1] else [*kept, rows[-1]]


def by_attempt(steps: Iterable[dict[str, Any]], field: str) -> dict[int, list[dict[str, Any]]]:
    """The steps that have a finite `field`, per attempt, in written order."""
    out: dict[int, list[dict[str, Any]]] = {}
    for s in steps:
        if finite(s.get(field)):
            out.setdefault(int(s.get("attempt", 0)), []).append(s)
    return out


def _gaps(rows: list[dict[str, Any]]) -> list[dict[str, Any] | None]:
    """None between rows whose step goes back, so a line never joins two runs of one attempt
    number (several controllers appended to the journal)."""
    out: list[dict[str, Any] | None] = []
    for r in rows:
        if out and out[-1] is not None and r["step"] < out[-1]["step"]:
            out.append(None)
        out.append(r)
    return out


def _xy(rows: list[dict[str, Any] | None], x: Any, y: str) -> tuple[list, list, list]:
    xs = [None if r is None else x(r) for r in rows]
    ys = [None if r is None else r[y] for r in rows]
    steps = [None if r is None else r["step"] for r in rows]
    return xs, ys, steps


def _layout(fig: go.Figure, title: str, height: int, **extra: Any) -> go.Figure:
    settings = dict(template="plotly_white", font=FONT, height=height, title=dict(text=title, x=0.01),
                    margin=dict(l=70, r=30, t=60, b=50), hovermode="closest")
    fig.update_layout({**settings, **extra})
    return fig


def _empty(fig: go.Figure, text: str) -> go.Figure:
    fig.add_annotation(text=text, xref="paper", yref="paper", x=0.5, y=0.5, showarrow=False,
                       font=dict(size=15, color="#777"))
    fig.update_xaxes(visible=False)
    fig.update_yaxes(visible=False)
    return fig


def faults(journal: Journal) -> list[dict[str, Any]]:
    return [e for e in journal.events if e.get("type") == "fault"]


def fault_color(e: dict[str, Any]) -> str:
    return FAULT_COLORS.get(str(e.get("fault")), "#d62728")


def _fault_text(e: dict[str, Any]) -> str:
    shown = e | {"node": e.get("node_name") or e.get("node")}  # by name where the event has it
    where = ", ".join(f"{k} {shown[k]}" for k in ("rank", "node", "step") if shown.get(k) is not None)
    return (f"<b>fault: {html.escape(str(e.get('fault', '?')))}</b> (attempt {e.get('attempt')}"
            f"{', ' + html.escape(where) if where else ''})<br>{wrap(e.get('reason', ''))}")


def loss_figure(journal: Journal) -> go.Figure:
    fig = go.Figure()
    series = by_attempt(journal.steps, "loss")
    for attempt, rows in sorted(series.items()):
        xs, ys, _ = _xy(_gaps(thin(rows)), lambda r: r["step"], "loss")
        fig.add_trace(go.Scatter(x=xs, y=ys, mode="lines", name=f"attempt {attempt}", hovertemplate=(
            f"attempt {attempt}<br>step %{{x}}<br>loss %{{y:.4f}}<extra></extra>")))
    validated = validation_points(journal.steps)
    if validated:  # the second curve: the held-out loss after every validation.interval_steps steps
        fig.add_trace(go.Scatter(
            x=[step for step, _ in validated], y=[loss for _, loss in validated], mode="lines+markers",
            name="validation", line=dict(color="#111111", width=2, dash="dash"), marker=dict(size=7),
            hovertemplate="validation<br>step %{x}<br>val_loss %{y:.4f}<extra></extra>"))
    marks = [e for e in faults(journal) if isinstance(e.get("step"), int)]
    for e in marks:  # a line at each fault's step: the later attempt's overlap starts before it
        fig.add_vline(x=e["step"], line=dict(color=fault_color(e), width=1, dash="dot"))
    placed = [(e, _loss_near(series, e)) for e in marks]
    placed = [(e, y) for e, y in placed if y is not None]
    for kind in sorted({str(e.get("fault")) for e, _ in placed}):  # one legend entry per kind, in its colour
        here = [(e, y) for e, y in placed if str(e.get("fault")) == kind]
        fig.add_trace(go.Scatter(
            x=[e["step"] for e, _ in here], y=[y for _, y in here], mode="markers", name=f"fault: {kind}",
            marker=dict(symbol="x", size=12, color=FAULT_COLORS.get(kind, "#d62728"),
                        line=dict(width=1, color="white")),
            hovertext=[_fault_text(e) for e, _ in here], hoverinfo="text"))
    title = "Loss by step, one line per attempt" + (", validation dashed" if validated else "")
    _layout(fig, f"{title} (faults marked ×)", 430,
            xaxis_title="step", yaxis_title="loss")
    return fig if series else _empty(fig, "no step has trained yet")


def validation_points(steps: Iterable[dict[str, Any]]) -> list[tuple[int, float]]:
    """(step, validation loss) by step; a step validated again after a fault keeps its newest
    value (on the CPU the same: every pass evaluates the same held-out data)."""
    found = {int(s["step"]): float(s["val_loss"]) for s in steps if finite(s.get("val_loss"))}
    return sorted(found.items())


def _loss_near(series: dict[int, list[dict[str, Any]]], fault: dict[str, Any]) -> float | None:
    """The loss of the newest step at or before the fault's, in the fault's attempt if it has one."""
    rows = series.get(fault.get("attempt")) or [r for rs in series.values() for r in rs]
    before = [r for r in rows if r["step"] <= fault["step"]]
    return before[-1]["loss"] if before else None


def throughput_figure(journal: Journal) -> go.Figure:
    fig = go.Figure()
    series = by_attempt(journal.steps, "tokens_per_s")
    for attempt, rows in sorted(series.items()):
        xs, ys, steps = _xy(_gaps(thin(rows)), lambda r: when(r["end"]), "tokens_per_s")
        fig.add_trace(go.Scatter(x=xs, y=ys, customdata=steps, mode="lines", name=f"attempt {attempt}",
                                 hovertemplate=f"attempt {attempt}<br>step %{{customdata}}<br>%{{x}}"
                                 "<br>%{y:,.0f} tokens/s<extra></extra>"))
    _layout(fig, "Throughput (global tokens/s) over time, per attempt", 380,
            xaxis_title="time (UTC)", yaxis_title="tokens/s", yaxis_rangemode="tozero")
    return fig if series else _empty(fig, "no step has trained yet")


def last_seen(journal: Journal) -> float | None:
    """The newest time the journal knows of: how far a job that is still running has got."""
    times = [e["at"] for e in journal.events if finite(e.get("at"))]
    times += [s["end"] for s in journal.steps if finite(s.get("end"))]
    if journal.goodput and finite(journal.goodput.get("updated_at")):
        times.append(journal.goodput["updated_at"])
    return max(times) if times else None


def state_intervals(journal: Journal) -> list[tuple[str, float, float, dict[str, Any]]]:
    """(state, start, end, the transition into it) for every state held for a while; a
    terminal state followed by a later transition (a rerun resumed the job) becomes DOWN."""
    moves = sorted((e for e in journal.events if e.get("type") == "transition" and finite(e.get("at"))),
                   key=lambda e: e["at"])
    end = last_seen(journal)
    out = []
    for i, e in enumerate(moves):
        until = moves[i + 1]["at"] if i + 1 < len(moves) else end
        state = str(e.get("to"))
        if state in TERMINAL_STATES and i + 1 == len(moves):
            continue  # the end: a marker, not a bar
        out.append(("DOWN" if state in TERMINAL_STATES else state, e["at"], max(until, e["at"]), e))
    return out


def timeline_figure(journal: Journal) -> go.Figure:
    fig = go.Figure()
    rows: list[str] = []

    def row(name: str) -> str:
        if name not in rows:
            rows.append(name)
        return name

    by_state: dict[str, list] = {}
    for state, start, end, e in state_intervals(journal):
        by_state.setdefault(state, []).append((start, end, e))
    for state, spans in by_state.items():
        label, color = DOWN if state == "DOWN" else STATES.get(state, (state.lower(), "#bcbd22"))
        fig.add_trace(go.Bar(
            orientation="h", y=[row("job state")] * len(spans), base=[when(s) for s, _, _ in spans],
            x=[(e - s) * 1000 for s, e, _ in spans], name=label, marker=dict(color=color, line=dict(width=0)),
            hovertext=[f"<b>{html.escape(label)}</b> (attempt {e.get('attempt')}) for {duration(end - s)}"
                       f"<br>from {when(s)}<br>{wrap(e.get('reason', ''))}" for s, end, e in spans],
            hoverinfo="text"))
    moves = [e for e in journal.events if e.get("type") == "transition" and finite(e.get("at"))]
    final = max(moves, key=lambda e: e["at"]) if moves else None
    if final is not None and final.get("to") in TERMINAL_STATES:
        _points(fig, row("job state"), [final], str(final["to"]).lower(), "diamond", "#252525",
                lambda e: f"<b>{html.escape(str(e['to']))}</b><br>{wrap(e.get('reason', ''))}", size=13,
                legend=False)
    # Snapshots first, short and pale, so the (rarer) checkpoints drawn over them stay visible.
    for kind, field, color, size in (("memory snapshot", "snapshot_s", "#a1d99b", 10),
                                     ("checkpoint", "checkpoint_s", "#08519c", 18)):
        saves = [s for s in journal.steps if finite(s.get(field)) and s[field] > 0 and finite(s.get("end"))]
        if saves:  # a mark at the step's end: a few seconds are no visible bar on a week's axis
            _points(fig, row("checkpoints"), saves, kind, "line-ns", color,
                    lambda s, f=field, k=kind: f"{k} at step {s['step']} (attempt {s.get('attempt')}): "
                    f"{s[f]:.2f} s", size=size, at="end")
    for i, e in enumerate(_events(journal, "recovered")):
        took = e.get("seconds") if finite(e.get("seconds")) else 0.0
        text = (f"recovered in {duration(took)}: resumed from step {e.get('resumed_from')}, "
                f"{e.get('steps_lost')} step(s) lost<br>{wrap(e.get('reason', ''))}")
        fig.add_trace(go.Bar(orientation="h", y=[row("recovery / restore")], base=[when(e["at"] - took)],
                             x=[took * 1000], name="fault to first step", marker=dict(color="#fdae6b"),
                             hovertext=[text], hoverinfo="text", legendgroup="recovered", showlegend=i == 0))
    resumed = _events(journal, "resumed")
    for source in sorted({str(e.get("source")) for e in resumed}):
        _points(fig, row("recovery / restore"), [e for e in resumed if str(e.get("source")) == source],
                f"restore from {source}", "triangle-right", SOURCE_COLORS.get(source, "#7f7f7f"),
                lambda e: f"restored step {e.get('step')} from {e.get('source')} (attempt {e.get('attempt')})"
                f"<br>{wrap(e.get('reason', ''))}")
    found = faults(journal)
    for kind in sorted({str(e.get("fault")) for e in found}):
        _points(fig, row(f"fault: {kind}"), [e for e in found if str(e.get("fault")) == kind],
                f"fault: {kind}", "x", FAULT_COLORS.get(kind, "#d62728"), _fault_text, size=12, legend=False)
    resized = _events(journal, "resized")
    for direction, symbol in (("grow", "triangle-up"), ("shrink", "triangle-down")):
        picked = [e for e in resized if e.get("direction") == direction]
        if picked:
            _points(fig, row("resize"), picked, direction, symbol, "#6a51a3",
                    lambda e: f"<b>{e.get('direction')}</b> to {e.get('nodes')} node(s), "
                    f"{e.get('world_size')} rank(s)<br>{wrap(e.get('reason', ''))}", size=12, legend=False)
    # Any other kind (decision, evicted, store_outage, ... or one this report does not know) gets
    # a row named after it: a legend of a dozen colours would not fit beside the chart.
    others = [e for e in journal.events if e.get("type") not in SHOWN_ELSEWHERE and finite(e.get("at"))]
    for kind in sorted({str(e.get("type")) for e in others}):
        _points(fig, row(kind.replace("_", " ")), [e for e in others if str(e.get("type")) == kind], kind,
                "circle", "#636363", lambda e: f"<b>{html.escape(str(e.get('type')))}</b> (attempt "
                f"{e.get('attempt')})<br>{wrap(e.get('reason', ''))}", size=9, legend=False)
    _layout(fig, "Timeline: states, saves, restores, faults, resizes (hover for details; drag to zoom)",
            150 + 46 * max(len(rows), 1), barmode="overlay", xaxis=dict(type="date", title="time (UTC)"),
            yaxis=dict(categoryorder="array", categoryarray=rows[::-1], automargin=True),
            legend=dict(tracegroupgap=2))
    return fig if rows else _empty(fig, "the journal holds no timed state changes or steps")


def _events(journal: Journal, kind: str) -> list[dict[str, Any]]:
    return [e for e in journal.events if e.get("type") == kind and finite(e.get("at"))]


def _points(fig: go.Figure, y: str, items: list[dict[str, Any]], name: str, symbol: str, color: str | None,
            text, size: int = 14, at: str = "at", legend: bool = True) -> None:
    marker = dict(symbol=symbol, size=size, line=dict(width=2 if symbol.startswith("line") else 1,
                                                      color=color or "white"))
    if color:
        marker["color"] = color
    fig.add_trace(go.Scatter(x=[when(i[at]) for i in items], y=[y] * len(items), mode="markers", name=name,
                             marker=marker, hovertext=[text(i) for i in items], hoverinfo="text",
                             showlegend=legend))


def phase_figure(journal: Journal) -> go.Figure | None:
    """Where the wall time went, by goodput bucket; None when the journal has no goodput."""
    buckets = (journal.goodput or {}).get("buckets") or {}
    spent = [(b, float(buckets[b])) for b in (*BUCKETS, *sorted(set(buckets) - set(BUCKETS)))
             if finite(buckets.get(b)) and buckets[b] > 0]
    if not spent:
        return None
    wall = sum(s for _, s in spent)
    unit, scale = ("hours", 3600) if wall >= 7200 else ("minutes", 60) if wall >= 120 else ("seconds", 1)
    fig = go.Figure()
    for bucket, seconds in spent:
        fig.add_trace(go.Bar(orientation="h", y=["wall time"], x=[seconds / scale],
                             name=bucket.replace("_", " "),
                             marker=dict(color=BUCKET_COLORS.get(bucket, "#969696")),
                             hovertext=[f"<b>{bucket}</b>: {duration(seconds)} ({seconds / wall:.1%})"],
                             hoverinfo="text", text=[f"{bucket.replace('_', ' ')} {seconds / wall:.0%}"],
                             textposition="inside", insidetextanchor="middle", textangle=0))
    _layout(fig, f"Time by phase: {duration(wall)} of wall time", 300, barmode="stack",
            xaxis_title=unit, yaxis=dict(visible=False), margin=dict(l=70, r=30, t=60, b=110),
            uniformtext=dict(minsize=11, mode="hide"),  # a label that does not fit its segment is left out
            legend=dict(orientation="h", yanchor="top", y=-0.45, x=0, traceorder="normal"))
    return fig
