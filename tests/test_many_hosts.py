"""A job submitted to a Ray cluster of separate hosts (testing/hosts.py: network namespaces on a
bridge, each with its own loopback, private /tmp and node-local directory, one shared
directory), on a python that has no longrun (`longrun submit` ships it). The head (no CPUs) is
host 1 with the job's Redis and a Prometheus that finds the workers through the controller's
/sd; hosts 2-4 have one CPU each: a 2-node job and a spare. Prometheus scrapes both workers on
their hosts; then a worker SIGKILLed on its host (default run) or a whole host lost (slow) at a
random moment after the first checkpoint: the job finishes with the weights of an
uninterrupted run on the same cluster, every piece in the shared directory. Nothing here can
reach beyond the namespaces the test made."""

from __future__ import annotations

import json
import random
import re
import subprocess
import sys
import time
from pathlib import Path

import fsspec
import psutil
import pytest
import torch
import yaml
from clusters import committed_weights

from longrun.checkpoint.layout import committed_steps
from longrun.services.prometheus import find_prometheus, scrape_config
from longrun.testing.hosts import SHARED_DIR, HostCluster, python_without_longrun

STEPS = 60  # 18 s of paced steps: room for the scrape check and a fault before the end
CONTROLLER_PORT = 9400  # the controller's /metrics and /sd on the head
PROMETHEUS_PORT = 9090


def config(name: str, redis_address: str) -> dict:
    return {
        "job": {"name": name, "seed": 7, "output_dir": f"{SHARED_DIR}/runs"},
        "cluster": {"nodes": 2, "workers_per_node": 1, "device": "cpu",
                    "redis_url": f"redis://{redis_address}:6379/0"},
        "parallelism": {"dp": 2},
        "model": {"dim": 64, "n_layers": 2, "n_heads": 4, "max_seq_len": 64},
        "data": {"source": "synthetic", "micro_batch_tokens": 128, "prefetch": 1,
                 "synthetic": {"min_len": 8, "max_len": 64, "mean": 24, "sigma": 0.8}},
        "training": {"steps": STEPS, "lr": 3e-3, "warmup_steps": 2, "log_every": 100},
        "checkpoint": {"interval_steps": 4, "keep_last": 3},
        # Steps slow enough that a fault lands inside the run, not after it.
        "health": {"heartbeat_interval_s": 0.5, "heartbeat_timeout_s": 3.0, "hang_timeout_s": 60,
                   "hang_min_s": 5, "faults": [{"rank": 0, "step": 1, "kind": "slow", "seconds": 0.3}]},
        "recovery": {"restart_backoff_s": 1.0},
        # Scraped from another host: bound to every address, advertised at the node's.
        "observability": {"metrics_host": "0.0.0.0", "controller_port": CONTROLLER_PORT},
    }


@pytest.fixture(scope="module")
def hosts(tmp_path_factory):
    work = tmp_path_factory.mktemp("hosts")
    # In the shared directory: the hosts' own /tmp hides the test's.
    python_without_longrun(work / "shared" / "cluster-venv")
    with HostCluster(4, work) as cluster:
        head = cluster.head
        head.popen(["redis-server", "--bind", head.address, "--port", "6379", "--save", "",
                    "--appendonly", "no", "--protected-mode", "no"], stdout=subprocess.DEVNULL)
        deadline = time.monotonic() + 30
        while head.run(["redis-cli", "-h", head.address, "ping"], check=False).stdout.strip() != "PONG":
            assert time.monotonic() < deadline, "redis-server did not come up on the head"
            time.sleep(0.1)  # a process starting in another namespace: nothing to wait on but it
        cluster.api = cluster.start_ray(Path(SHARED_DIR) / "cluster-venv" / "bin" / "python")
        (cluster.shared / "prometheus.yml").write_text(
            scrape_config(sd_urls=[f"http://{head.address}:{CONTROLLER_PORT}/sd"]))
        head.popen([find_prometheus(), f"--config.file={SHARED_DIR}/prometheus.yml",
                    "--storage.tsdb.path=/tmp/prometheus", "--log.level=warn",
                    f"--web.listen-address={head.address}:{PROMETHEUS_PORT}"],
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        yield cluster


def submit(hosts, name: str) -> subprocess.Popen:
    path = hosts.shared / f"{name}.yaml"
    path.write_text(yaml.safe_dump(config(name, hosts.head.address)))
    return hosts.head.popen([sys.executable, "-m", "longrun.cli", "submit", f"{SHARED_DIR}/{name}.yaml",
                             "--address", hosts.api], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)


def finish(run: subprocess.Popen) -> str:
    out, _ = run.communicate(timeout=420)
    assert run.returncode == 0, out[-6000:]
    return out


def checkpoints(hosts, name: str) -> str:
    return str(hosts.shared / "runs" / name / "checkpoints")


_SCRAPED = """
import json, sys, urllib.parse, urllib.request
query = urllib.parse.urlencode({"query": sys.argv[2]})
print(json.dumps(json.load(urllib.request.urlopen(f"http://{sys.argv[1]}/api/v1/query?{query}", timeout=5))))
"""


def workers_scraped(hosts, name: str) -> list[str]:
    """The worker instances Prometheus on the head scrapes with success for job `name`."""
    query = f'up{{job="{name}", role="worker"}} == 1'
    done = hosts.head.run([sys.executable, "-c", _SCRAPED, f"{hosts.head.address}:{PROMETHEUS_PORT}", query],
                          check=False)
    if done.returncode != 0:
        return []
    return sorted(r["metric"]["instance"] for r in json.loads(done.stdout)["data"]["result"])


def training_host(hosts):
    """A worker host with a training worker on it, and that worker's pid."""
    for host in hosts.hosts[1:]:
        for pid in host.pids():
            try:
                if psutil.Process(pid).cmdline()[:1] == ["ray::TrainWorker.run"]:
                    return host, pid
            except psutil.NoSuchProcess:
                continue
    raise AssertionError("no training worker on any host")


@pytest.fixture(scope="module")
def reference(hosts):
    finish(submit(hosts, "hosts-reference"))
    return committed_weights(checkpoints(hosts, "hosts-reference"), STEPS)


@pytest.mark.timeout(900)
@pytest.mark.parametrize("fault", ["worker_sigkill", pytest.param("host_lost", marks=pytest.mark.slow)])
def test_a_job_across_hosts_survives_a_fault_and_ends_bitwise_equal(hosts, reference, fault):
    name = f"hosts-{fault.replace('_', '-')}"
    run = submit(hosts, name)
    fs, root = fsspec.filesystem("file"), checkpoints(hosts, name)
    deadline = time.monotonic() + 300
    while not (fs.exists(root) and committed_steps(fs, root)):
        assert time.monotonic() < deadline and run.poll() is None, "no checkpoint committed"
        time.sleep(0.1)  # the shared directory is the only thing the test shares with the job
    # Prometheus on the head scrapes each worker on its own host, found through the controller's /sd.
    deadline = time.monotonic() + 120
    while len(scraped := workers_scraped(hosts, name)) < 2:
        assert time.monotonic() < deadline and run.poll() is None, f"workers scraped: {scraped}"
        time.sleep(0.5)  # Prometheus scrapes on its own clock
    worker_hosts = {h.address for h in hosts.hosts[1:]}
    assert {i.rsplit(":", 1)[0] for i in scraped} <= worker_hosts, scraped
    time.sleep(random.uniform(0, 2.0))  # a random moment of the next steps, not a favourable one
    host, pid = training_host(hosts)
    if fault == "worker_sigkill":
        psutil.Process(pid).kill()
    else:
        host.kill_all()  # raylet, workers, keeper: the host is gone
    out = finish(run)
    job_id = re.search(r"submitted (longrun-\S+)", out).group(1)
    status = hosts.head.run([sys.executable, "-m", "longrun.cli", "status", job_id, "--address", hosts.api,
                             "--redis-url", f"redis://{hosts.head.address}:6379/0"]).stdout
    assert "controller: SUCCEEDED" in status and re.search(r"attempt [1-9]", status), status
    got = committed_weights(root, STEPS)
    for key, want in reference.items():
        assert torch.equal(got[key], want), f"{key} differs from the uninterrupted run"
