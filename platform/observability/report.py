"""`longrun report`: one HTML file that tells a job's history, read from its journal.

    html = render(load("runs/tiny"))             # ReportError when runs/tiny has no journal
    write_report("runs/tiny", "report.html")      # the same, written; returns the path

What it shows: a header (job, final or current state, attempts, steps, goodput and its top
losses, faults), the loss by step with one line per attempt (a step redone after a fault is
the later attempt's line overlapping the earlier's), throughput over time per attempt, a
timeline of the job (states, checkpoints, restores by source, faults by kind and rank,
resizes, other events) and where the wall time went by goodput bucket.

Plotly rather than matplotlib: a week-long timeline is unreadable as a still picture; it needs
zoom and hover (a fault's reason, a state's duration), and plotly gives both in a single file
with plotly.js inlined, so the report opens anywhere, offline, with nothing beside it. The
charts are pure functions of a Journal (report_figures.py), torch-free and Ray-free.
"""

from __future__ import annotations

import html
import os
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import plotly.io as pio
import yaml

from longrun.goodput.summary import GoodputSummary
from longrun.kinds import TERMINAL_STATES
from longrun.observability import report_figures as figs
from longrun.observability.journal import Journal, journal_dir, read_journal
from longrun.safe_files import replace_file

CHARTS = ("loss-curve", "throughput", "timeline", "time-by-phase")  # the containers' ids, in page order
PLOT_CONFIG = {"displaylogo": False, "responsive": True}


class ReportError(Exception):
    """A report that cannot be made from what was given; the message says what to pass."""


@dataclass
class Header:
    name: str
    state: str  # "SUCCEEDED at ...", or "running (as of ...)"
    reason: str
    attempts: int
    steps: int | None
    goodput: str | None  # GoodputSummary.describe(): goodput % and the top losses
    faults: str


def load(run_dir: str | os.PathLike) -> Journal:
    """The journal of the job whose run directory is `run_dir`; ReportError when it has none."""
    path = Path(run_dir)
    hint = ("pass the job's run directory, <output_dir>/<job name> (e.g. runs/tiny), the one that "
            "holds journal/ beside config.yaml and checkpoints/")
    if not path.is_dir():
        raise ReportError(f"{path} is not a directory: {hint}")
    journal = read_journal(path)
    if journal.empty:
        # Given the output directory instead of a job's: name the jobs in it.
        jobs = sorted(str(p) for p in path.iterdir() if journal_dir(p).is_dir())
        if jobs:
            hint = f"pass one of the job directories in it: {', '.join(jobs[:5])}"
        raise ReportError(f"{path} has no journal ({journal_dir(path)} is missing or holds no steps "
                          f"and no events): {hint}")
    return journal


def job_name(run_dir: Path) -> str:
    """job.name from the resolved config the run wrote there, else the directory's name."""
    try:
        name = (yaml.safe_load((run_dir / "config.yaml").read_text()) or {}).get("job", {}).get("name")
    except (OSError, yaml.YAMLError, AttributeError):
        name = None  # no config or an unreadable one: the directory is named after the job anyway
    return str(name) if name else run_dir.resolve().name


def header(journal: Journal) -> Header:
    moves = sorted((e for e in journal.events if e.get("type") == "transition" and figs.finite(e.get("at"))),
                   key=lambda e: e["at"])
    as_of = figs.last_seen(journal)
    seen = f"as of {figs.when(as_of)[:19]} UTC" if as_of is not None else "no time known"
    last = moves[-1] if moves else None
    if last is not None and last.get("to") in TERMINAL_STATES:
        state, reason = f"{last['to']} at {figs.when(last['at'])[:19]} UTC", str(last.get("reason", ""))
    elif last is not None:
        state, reason = f"running ({seen})", f"now {last.get('to')}: {last.get('reason', '')}"
    else:
        state, reason = f"running ({seen})", "the journal holds no state change yet"
    attempts = {x["attempt"] for x in (*journal.steps, *journal.events) if isinstance(x.get("attempt"), int)}
    steps = [s["step"] for s in journal.steps if isinstance(s.get("step"), int)]
    kinds = Counter(str(e.get("fault")) for e in figs.faults(journal))
    by_kind = ", ".join(f"{k} {n}" for k, n in kinds.most_common())
    faults = f"{sum(kinds.values())} reported" + (f" ({by_kind})" if kinds else "")
    goodput = None
    if journal.goodput and isinstance(journal.goodput.get("buckets"), dict):
        g = journal.goodput
        buckets = {b: float(s) for b, s in g["buckets"].items() if figs.finite(s)}
        summary = GoodputSummary.from_dict(g | {"buckets": buckets, "faults": g.get("faults") or []})
        goodput = summary.describe()
    return Header(job_name(journal.run_dir), state, reason, len(attempts), max(steps) if steps else None,
                  goodput, faults)


def figures(journal: Journal) -> dict[str, Any]:
    """Each chart's container id and its figure (None for a chart the journal cannot give)."""
    return dict(zip(CHARTS, (figs.loss_figure(journal), figs.throughput_figure(journal),
                             figs.timeline_figure(journal), figs.phase_figure(journal)), strict=True))


def render(journal: Journal) -> str:
    """The whole report as one HTML document, plotly.js inlined once (before the first chart)."""
    h = header(journal)
    rows = [("state", h.state), ("detail", h.reason), ("attempts", str(h.attempts)),
            ("steps reached", "none" if h.steps is None else str(h.steps)),
            ("goodput", h.goodput or "not known (the journal has no goodput summary yet)"),
            ("faults", h.faults)]
    facts = "\n".join(f"<dt>{html.escape(k)}</dt><dd>{html.escape(v)}</dd>" for k, v in rows if v)
    body, first = [], True
    for chart, fig in figures(journal).items():
        if fig is None:
            body.append('<p class="note">Time by phase: not known, the journal has no goodput summary.</p>')
            continue
        div = pio.to_html(fig, full_html=False, include_plotlyjs=first, div_id=chart, config=PLOT_CONFIG)
        body.append(f"<section>{div}</section>")
        first = False
    title = html.escape(f"longrun report: {h.name}")
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>{title}</title>
<style>{STYLE}</style></head>
<body><header><h1>{title}</h1><dl>{facts}</dl></header>
{chr(10).join(body)}
<footer>Made by <code>longrun report</code> from {html.escape(str(journal_dir(journal.run_dir)))}.
Times are UTC. Drag to zoom, double-click to reset, click a legend entry to hide it.</footer>
</body></html>
"""


def write_report(run_dir: str | os.PathLike, out: str | os.PathLike | None = None) -> Path:
    """Render the report of the job in `run_dir` to `out` (default: report.html there)."""
    journal = load(run_dir)
    path = Path(out) if out is not None else Path(run_dir) / "report.html"
    path.parent.mkdir(parents=True, exist_ok=True)
    # A browser reloading the report never reads half of it; a link planted there is replaced.
    replace_file(path, render(journal), sync=False)
    return path


STYLE = """
body { font-family: Helvetica, Arial, sans-serif; margin: 24px 32px; color: #222; }
h1 { font-size: 24px; margin: 0 0 12px; }
dl { display: grid; grid-template-columns: max-content auto; gap: 4px 18px; margin: 0 0 16px;
     font-size: 15px; }
dt { font-weight: bold; color: #555; } dd { margin: 0; }
section { border-top: 1px solid #e5e5e5; padding-top: 8px; margin-top: 8px; }
.note, footer { color: #777; font-size: 14px; } footer { margin-top: 24px; }
"""
