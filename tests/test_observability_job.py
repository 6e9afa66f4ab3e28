"""End to end: a real Prometheus scrapes a real longrun job, found through the controller's
http_sd endpoint, and every PromQL expression of every dashboard and alert rule returns data.

The job is `longrun run` (embedded Ray and Redis) with 4 workers doing dynamic context
parallelism (dp 2 x cp 2), so the CP panels have plans to show; a worker is SIGKILLed once,
so restarts, faults, detection and recovery have data too. A dashboard that references a
metric nobody exports fails here.

The test waits on events, not on the job being slow enough: after the restart every rank is
held at one step (a `hold` fault) until every query has data, then released by a file. So
the job cannot end, and its targets cannot leave /sd, before Prometheus has scraped them.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time

import pytest
import yaml

from longrun.observability.queries import check_queries
from longrun.services.ports import free_port
from longrun.services.prometheus import EmbeddedPrometheus

pytestmark = pytest.mark.skipif(shutil.which("prometheus") is None,
                                reason="prometheus not installed (Debian package prometheus)")

JOB = {
    "job": {"name": "observed", "seed": 5},
    "cluster": {"device": "cpu", "nodes": 1, "workers_per_node": 4,
                "peak_tflops": 0.05},  # a nominal CPU figure, so MFU is reported
    "parallelism": {"dp": 2, "cp": 2, "dynamic_cp": True, "cp_impl": "ring"},
    "model": {"dim": 64, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "max_seq_len": 256},
    "data": {"source": "synthetic", "micro_batch_tokens": 64, "prefetch": 1,
             "synthetic": {"min_len": 8, "max_len": 256, "mean": 64, "sigma": 1.0}},
    "training": {"steps": 40, "lr": 3e-3, "warmup_steps": 2, "log_every": 10},
    "checkpoint": {"interval_steps": 2},
    "validation": {"interval_steps": 5, "steps": 1, "held_out": 0.05},  # the loss panel's second query
    "health": {"heartbeat_interval_s": 0.5, "heartbeat_timeout_s": 3.0, "hang_min_s": 10,
               # A held rank is judged by the hard ceiling: far beyond how long the queries take.
               "hang_timeout_s": 600,
               "faults": [{"rank": 1, "step": 6, "kind": "kill"}]},
    "recovery": {"restart_backoff_s": 0.0},
}
HOLD_STEP = 12  # attempt 1 (after the kill) holds every rank here: past a checkpoint and a recovery


def job_config(tmp_path) -> dict:
    release = str(tmp_path / "release")
    holds = [{"rank": r, "step": HOLD_STEP, "attempt": 1, "kind": "hold", "release_file": release}
             for r in range(4)]
    health = JOB["health"] | {"faults": JOB["health"]["faults"] + holds}
    return JOB | {"job": JOB["job"] | {"output_dir": str(tmp_path / "out")}, "health": health}


def restarts(prom) -> float:
    result = prom.query('sum(longrun_job_restarts_total{job="observed",cause="dead"})')["result"]
    return float(result[0]["value"][1]) if result else 0.0


def test_every_dashboard_and_alert_query_has_data_from_a_real_job(tmp_path):
    port = free_port()
    config = tmp_path / "job.yaml"
    config.write_text(yaml.safe_dump(job_config(tmp_path)))
    log = (tmp_path / "run.log").open("w")
    with EmbeddedPrometheus(sd_urls=[f"http://127.0.0.1:{port}/sd"]) as prom:
        job = subprocess.Popen([sys.executable, "-m", "longrun.cli", "run", str(config),
                                "--set", f"observability.controller_port={port}"],
                               stdout=log, stderr=subprocess.STDOUT,
                               env=os.environ | {"OMP_NUM_THREADS": "1"})
        report, deadline = None, time.monotonic() + 420
        try:
            # Evaluate while the job runs: it is held at HOLD_STEP until released below, so
            # its workers stay in /sd however long discovery and scraping take.
            while job.poll() is None and time.monotonic() < deadline:
                report = check_queries(prom.query)
                if report.ok and restarts(prom) >= 1:  # and the kill was seen and counted
                    break
                time.sleep(2)  # one scrape interval and a bit: new samples to look at
            assert job.poll() is None, ("the job ended before it was released from its hold",
                                        (tmp_path / "run.log").read_text()[-3000:])
            assert report is not None and report.ok, (report.describe() if report else "never evaluated",
                                                      (tmp_path / "run.log").read_text()[-3000:])
            assert report.checked > 40 and restarts(prom) >= 1
        finally:
            (tmp_path / "release").touch()
            code = job.wait(timeout=420)
    log.close()
    assert code == 0, (tmp_path / "run.log").read_text()[-3000:]
