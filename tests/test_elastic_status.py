"""What operators see of an elastic job: the size in `longrun status` (from the job record or the
controller's log) and the resize annotation and panel on the overview dashboard."""

from __future__ import annotations

from longrun.job_view import read_log, view_of_record
from longrun.observability import dashboards

LOG = """\
state RUNNING: training
fault: Ray reports node abc dead; rank 2's process went with it
state RECOVERING: node lost: node abc left the cluster (1 lost); evict it and restart.
resized: shrink: 3 -> 2 node(s), 6 -> 4 rank(s), dp x fsdp 3 x 2 -> 2 x 2, global batch 3072 tokens kept; ...
grow_requested: 3 node(s) can be placed again, enough for the configured 3; grow from 2 ...
"""


def test_status_shows_the_size_from_the_log_and_from_the_record():
    view = read_log(LOG, last_events=10)
    assert view.size == "2 node(s), 4 rank(s)"
    assert [line.split(":")[0] for line in view.events][-2:] == ["resized", "grow_requested"]
    record = {"state": "RUNNING", "attempt": 1, "step": 5, "evicted": {}, "events": [],
              "fields": {"steps": "10", "size": "2 of 3 node(s), 4 rank(s)"}}
    assert view_of_record(record, "redis").size == "2 of 3 node(s), 4 rank(s)"
    assert read_log("state RUNNING: training\n").size is None  # never resized: nothing to say


def test_the_overview_marks_every_resize_and_plots_the_size():
    overview = dashboards.overview().to_json()
    annotations = {a["name"]: a for a in overview["annotations"]["list"]}
    assert "longrun_elastic_resizes_total" in annotations["Resizes"]["expr"]
    assert "direction" in annotations["Resizes"]["expr"]
    panel = next(p for p in overview["panels"] if p["title"] == "Job size")
    exprs = " ".join(t["expr"] for t in panel["targets"])
    assert "longrun_job_nodes" in exprs and "longrun_job_world_size" in exprs


def test_longrun_status_prints_the_size(cli, monkeypatch):
    from longrun import submit
    from longrun.job_view import ControllerView

    view = ControllerView(state="RUNNING", attempt=1, step="5/10", size="2 of 3 node(s), 4 rank(s)")
    monkeypatch.setattr(submit, "status", lambda *a, **k: {
        "id": "j", "ray_status": "RUNNING", "message": "", "controller": view, "longrun": None})
    code, out, _ = cli("status", "j", "--address", "http://127.0.0.1:8265")
    assert code == 0 and "size: 2 of 3 node(s), 4 rank(s)" in out
    view.size = None  # never resized: no size line
    assert "size:" not in cli("status", "j", "--address", "http://127.0.0.1:8265")[1]
