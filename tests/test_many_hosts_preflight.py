"""What cannot work on a cluster of many hosts is refused before anything is placed, naming
the setting to change: checkpoints on a relative path for a submitted job (each node would
resolve it inside its own copy of the working directory); a Redis on loopback or /metrics bound
to loopback when a node that may run workers is another host than the driver's. Paths that
exist only on the cluster follow one rule at submit: checked there, not refused here. And gloo
listens on the address Ray knows the node by, not the loopback a host name may resolve to."""

from __future__ import annotations

import os

import pytest
import yaml

from longrun.config import ConfigError, config_from_dict
from longrun.config.runnable import UnsupportedJob, check_runnable, runnable_problems
from longrun.config.vocabulary import paths_elsewhere
from longrun.controller.placement import NodeInfo
from longrun.controller.reachability import cluster_problems, is_loopback


def tiny(**job_and_checkpoint) -> object:
    job = {"name": "hosts"} | job_and_checkpoint.get("job", {})
    return config_from_dict({"job": job, "checkpoint": job_and_checkpoint.get("checkpoint", {})})


@pytest.mark.parametrize(("job", "checkpoint", "knob"), [
    ({"output_dir": "runs"}, {}, "job.output_dir"),          # the default: <output_dir>/<job>/checkpoints
    ({"output_dir": "/shared/runs"}, {"dir": "ckpt"}, "checkpoint.dir"),
    ({"output_dir": "/shared/runs"}, {"dir": "file://ckpt"}, "checkpoint.dir"),
])
def test_a_submitted_job_with_checkpoints_on_a_relative_path_is_refused(job, checkpoint, knob):
    cfg = tiny(job=job, checkpoint=checkpoint)
    problems = dict(runnable_problems(cfg, runs_here=False))
    assert knob in problems and "relative path" in problems[knob] and "every node mounts" in problems[knob]
    with pytest.raises(UnsupportedJob, match=f"{knob}: the checkpoints would go to"):
        check_runnable(cfg, runs_here=False)
    # Run here (`longrun run`), a relative path is this machine's and fine.
    assert knob not in dict(runnable_problems(cfg))


@pytest.mark.parametrize("checkpoint_dir", [None, "/mnt/ckpt", "s3://bucket/run", "file:///mnt/ckpt"])
def test_a_submitted_job_with_shared_checkpoint_paths_is_not_refused(checkpoint_dir):
    cfg = tiny(job={"output_dir": "/shared/runs"}, checkpoint={"dir": checkpoint_dir})
    assert not {"job.output_dir", "checkpoint.dir"} & set(dict(runnable_problems(cfg, runs_here=False)))


def node(address: str, cpus: float = 2.0) -> NodeInfo:
    return NodeInfo(f"id-{address}-{cpus}", address, {"CPU": cpus}, {"CPU": cpus})


def two_node_job(**observability):
    return config_from_dict({"job": {"name": "hosts"}, "cluster": {"nodes": 2, "workers_per_node": 2},
                             "parallelism": {"dp": 4}, "observability": observability})


def test_loopback_redis_and_metrics_are_refused_when_workers_may_run_on_other_hosts():
    nodes = [node("10.0.0.1", cpus=0), node("10.0.0.2"), node("10.0.0.3")]  # a head without CPUs
    problems = dict(cluster_problems(two_node_job(), "redis://127.0.0.1:6379/0", "10.0.0.1", nodes))
    assert set(problems) == {"cluster.redis_url", "observability.metrics_host"}
    assert "nodes at 10.0.0.2, 10.0.0.3 may run its workers" in problems["cluster.redis_url"]
    assert "Set it to 0.0.0.0" in problems["observability.metrics_host"]
    # What the operator does: a shared Redis and a wildcard bind.
    assert cluster_problems(two_node_job(metrics_host="0.0.0.0"), "redis://:pw@10.0.0.1:6379/0",
                            "10.0.0.1", nodes) == []


def test_one_host_with_many_ray_nodes_is_fine_on_loopback():
    # The simulated clusters of the tests: every node at the driver's address.
    nodes = [node("127.0.0.1", cpus=0), node("127.0.0.1", 2.0), node("127.0.0.1", 3.0)]
    assert cluster_problems(two_node_job(), "redis://127.0.0.1:6379/0", "127.0.0.1", nodes) == []


def test_a_node_too_small_for_workers_is_not_counted_as_a_host_they_may_run_on():
    nodes = [node("10.0.0.1"), node("10.0.0.1", 3.0), node("10.0.0.9", cpus=1)]  # needs 2 CPUs per node
    assert cluster_problems(two_node_job(), "redis://localhost:6379/0", "10.0.0.1", nodes) == []


@pytest.mark.parametrize(("host", "loopback"), [
    ("127.0.0.1", True), ("127.3.4.5", True), ("localhost", True), ("::1", True), ("[::1]", True),
    ("10.0.0.1", False), ("0.0.0.0", False), ("redis.internal", False), (None, False),
])
def test_what_counts_as_loopback(host, loopback):
    assert is_loopback(host) is loopback


def test_a_tokenizer_on_the_cluster_only_is_left_to_the_cluster_at_submit():
    raw = {"job": {"name": "hosts"}, "data": {"source": "tokens", "path": "/cluster/shards",
                                               "tokenizer": "/cluster/tokenizers/bpe"}}
    with pytest.raises(ConfigError, match=r"data\.tokenizer: no tokenizer at /cluster/tokenizers/bpe"):
        config_from_dict(raw)  # where the job runs, a missing tokenizer is an error
    with paths_elsewhere():
        cfg = config_from_dict(raw)
    shipped = yaml.safe_load(cfg.to_yaml(pin_vocabulary=False))
    assert "vocab_size" not in shipped["model"]  # resolved on the cluster, from its tokenizer
    assert shipped["data"]["tokenizer"] == "/cluster/tokenizers/bpe"
    assert yaml.safe_load(cfg.to_yaml())["model"]["vocab_size"] == 260  # what `config show` prints


def test_a_given_or_resolved_vocabulary_stays_pinned_and_a_local_bad_tokenizer_is_still_refused(tmp_path):
    given = config_from_dict({"job": {"name": "hosts"}, "model": {"vocab_size": 4096}})
    assert yaml.safe_load(given.to_yaml(pin_vocabulary=False))["model"]["vocab_size"] == 4096
    (tmp_path / "tok").mkdir()  # here, but no tokenizer.json in it: this machine's mistake
    with paths_elsewhere(), pytest.raises(ConfigError, match="no tokenizer at"):
        config_from_dict({"job": {"name": "hosts"}, "data": {"source": "tokens", "path": "/x",
                                                            "tokenizer": str(tmp_path / "tok")}})


def test_gloo_is_pinned_to_the_interface_of_the_address_ray_knows_the_node_by(monkeypatch):
    import ray

    from longrun.worker.setup import interface_of, pin_gloo_to_node_address

    assert interface_of("127.0.0.1") == "lo" and interface_of("192.0.2.1") is None  # TEST-NET: nowhere
    monkeypatch.delenv("GLOO_SOCKET_IFNAME", raising=False)
    assert pin_gloo_to_node_address() is None  # outside Ray: left to gloo
    monkeypatch.setattr(ray, "is_initialized", lambda: True)
    monkeypatch.setattr(ray.util, "get_node_ip_address", lambda: "127.0.0.1")
    assert pin_gloo_to_node_address() == "lo" and os.environ["GLOO_SOCKET_IFNAME"] == "lo"
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "eth7")  # the operator's choice is kept
    assert pin_gloo_to_node_address() == "eth7"
