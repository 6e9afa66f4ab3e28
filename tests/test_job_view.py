"""`longrun status`'s two sources, without a cluster: the job record in a real Redis (read only
when it is this submission's) and the controller's log; and which Redis URL status may use."""

from __future__ import annotations

import time

import pytest

from longrun.controller.job_state import JobRecordStore
from longrun.controller.state import JobState, JobStateMachine
from longrun.job_view import PASSWORD_ENV, read_log, read_record, record_url
from longrun.redact import redact
from longrun.services.ports import free_port

LOG = """\
metrics: http://127.0.0.1:1234/metrics
state PLACING: placing 2 worker(s) on 1 node(s), 0 evicted
state RUNNING: training
step 3/10  loss 4.5000
fault: rank 1 dead (exit code -9)
decision: restart from the newest checkpoint
evicted: node abc123 failed diagnostics
state RECOVERING: restarting
\x1b[36mstep 7/10  loss 3.2500\x1b[0m
state SUCCEEDED: finished 10 steps in attempt 1
"""


def test_the_log_gives_state_attempt_step_evictions_and_events():
    view = read_log(LOG, last_events=3)
    assert (view.state, view.reason) == ("SUCCEEDED", "finished 10 steps in attempt 1")
    assert view.attempt == 1 and view.step == "7/10" and view.loss == 3.25
    assert view.evicted == ["abc123"]
    assert view.events == ["evicted: node abc123 failed diagnostics", "state RECOVERING: restarting",
                           "state SUCCEEDED: finished 10 steps in attempt 1"]
    assert view.source == "the controller's log"


def test_record_url_says_why_there_is_none():
    assert record_url("", None, {}) == (None, "the job's Redis is embedded in its controller on the "
                                        "cluster; name one in cluster.redis_url for status to read "
                                        "the job record")
    # The metadata's URL is the submitter's word: the operator's password never goes there.
    url, why = record_url("redis://:***@h:1/0", None, {PASSWORD_ENV: "p w"})
    assert url is None and "sends only to the Redis you configure: set LONGRUN_REDIS_URL" in why
    assert record_url("redis://h:1/0", None, {}) == ("redis://h:1/0", "")
    assert record_url("", "redis://:x@other:2/0", {}) == ("redis://:x@other:2/0", "")
    assert record_url("redis://:***@h:1/0", "redis://:${LONGRUN_REDIS_PASSWORD}@mine:2/0",
                      {PASSWORD_ENV: "p w"}) == ("redis://:p%20w@mine:2/0", "")
    assert record_url(None, None, {})[0] is None


@pytest.fixture
def record(redis_client):
    store = JobRecordStore(redis_client, "tiny")
    store.update(steps=10, world_size=2)
    store.record_transition(JobStateMachine().transition(JobState.PLACING, "placing"), 0)
    store.update(step=7, loss=3.25)
    store.evict("node-b", "failed diagnostics")
    return store


def test_the_record_of_this_submission_is_read(record, redis_server):
    now_ms = int(time.time() * 1000)
    view, why = read_record(redis_server.url, "tiny", started_ms=now_ms - 60_000, ended_ms=None)
    assert why == "" and view is not None
    assert (view.state, view.reason, view.step, view.loss) == ("PLACING", "placing", "7/10", 3.25)
    assert view.evicted == ["node-b"] and view.events[-1].endswith("state PLACING: placing")
    assert view.source == f"the job record in Redis at {redact(redis_server.url)}"
    assert redis_server.password not in view.source


def test_a_record_of_another_run_of_the_job_name_is_not_used(record, redis_server):
    now_ms = int(time.time() * 1000)
    view, why = read_record(redis_server.url, "tiny", started_ms=now_ms + 60_000, ended_ms=None)
    assert view is None and "older than this submission" in why
    view, why = read_record(redis_server.url, "tiny", started_ms=now_ms - 120_000,
                            ended_ms=now_ms - 60_000)
    assert view is None and "by a later run of the same job" in why
    view, why = read_record(redis_server.url, "other", started_ms=now_ms, ended_ms=None)
    assert view is None and "holds no record of job 'other' yet" in why


def test_an_unreachable_redis_is_a_reason_without_the_password():
    url = f"redis://:hunter2@127.0.0.1:{free_port()}/0"
    view, why = read_record(url, "tiny", started_ms=None, ended_ms=None)
    assert view is None and why.startswith("cannot read the job record from redis://:***@127.0.0.1:")
    assert "hunter2" not in why
