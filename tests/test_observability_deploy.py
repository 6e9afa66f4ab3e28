"""deploy/: the Prometheus config and rules pass promtool (and the alerts fire when they
should), the compose file and the KubeRay manifests hang together."""

from __future__ import annotations

import re
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from longrun.observability import alerts
from longrun.observability.grafana_model import DEFAULT_DATASOURCE_UID

PROMTOOL = shutil.which("promtool")
needs_promtool = pytest.mark.skipif(PROMTOOL is None,
                                    reason="promtool not installed (Debian package prometheus)")


def series(selector: str, values: str) -> dict:
    return {"series": selector, "values": values}


def promtool(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([PROMTOOL, *args], capture_output=True, text=True, timeout=60, cwd=cwd)


@needs_promtool
def test_promtool_accepts_the_prometheus_config(repo_root):
    # Also loads and checks rules.yml, which the config references.
    out = promtool("check", "config", str(repo_root / "deploy/prometheus/prometheus.yml"))
    assert out.returncode == 0, out.stdout + out.stderr
    assert "SUCCESS" in out.stdout + out.stderr


@needs_promtool
def test_promtool_accepts_the_rules(repo_root):
    out = promtool("check", "rules", str(repo_root / "deploy/prometheus/rules.yml"))
    assert out.returncode == 0, out.stdout + out.stderr
    assert f"{len(alerts.RULES)} rules found" in out.stdout


def _annotations(name: str, **values: str) -> dict:
    """A rule's annotations with its templates expanded for `values` (job, rank, node, value)."""
    rule = next(r for r in alerts.RULES if r.name == name)
    out = {}
    for key, text in rule.to_yaml_dict()["annotations"].items():
        for var, value in values.items():
            text = re.sub(r"\{\{ \$(labels\.)?" + var + r"( \| \w+)? \}\}", value, text)
        assert "{{" not in text, text
        out[key] = text
    return out


@needs_promtool
def test_alerts_fire_when_they_should_and_only_then(repo_root, tmp_path):
    """promtool's rule unit tests: synthetic series in, expected alerts out."""
    running = series('longrun_job_state{job="a",longrun_job_state="RUNNING"}', "1x200")
    tests = [
        {  # a failed job alerts at once; a running one does not
            "interval": "1m",
            "input_series": [series('longrun_job_state{job="a",longrun_job_state="FAILED"}', "0 0 1"),
                             series('longrun_job_state{job="b",longrun_job_state="FAILED"}', "0 0 0")],
            "alert_rule_test": [
                {"eval_time": "1m", "alertname": "LongrunJobFailed", "exp_alerts": []},
                {"eval_time": "2m", "alertname": "LongrunJobFailed", "exp_alerts": [
                    {"exp_labels": {"severity": "critical", "job": "a"},
                     "exp_annotations": _annotations("LongrunJobFailed", job="a")}]},
            ],
        },
        {  # a stale heartbeat alerts while RUNNING, after its `for`; not while RECOVERING
            "interval": "1m",
            "input_series": [
                running,
                # rank 3 of a beat at 0 s and 60 s, then never again (the series stays)
                series('longrun_heartbeat_timestamp_seconds{job="a",rank="3",node="n1"}', "0 60x10"),
                series('longrun_heartbeat_timestamp_seconds{job="b",rank="0",node="n2"}', "0x10"),
                series('longrun_job_state{job="b",longrun_job_state="RUNNING"}', "0x10"),
            ],
            "alert_rule_test": [
                {"eval_time": "2m", "alertname": "LongrunHeartbeatStale", "exp_alerts": []},  # pending
                {"eval_time": "4m", "alertname": "LongrunHeartbeatStale", "exp_alerts": [
                    {"exp_labels": {"severity": "critical", "job": "a", "rank": "3", "node": "n1"},
                     "exp_annotations": _annotations("LongrunHeartbeatStale", job="a", rank="3",
                                                     value="3m 0s")}]},
            ],
        },
        {  # one restart a minute is a storm: 30 in the last 30 minutes; one restart is not
            "interval": "1m",
            "input_series": [series('longrun_job_restarts_total{job="a",cause="dead"}', "0+1x60"),
                             series('longrun_job_restarts_total{job="b",cause="dead"}', "0 1x60")],
            "alert_rule_test": [{"eval_time": "40m", "alertname": "LongrunRestartStorm", "exp_alerts": [
                {"exp_labels": {"severity": "warning", "job": "a"},
                 "exp_annotations": _annotations("LongrunRestartStorm", job="a", value="30")}]}],
        },
        {  # MFU from 0.5 to 0.3 for 30 minutes alerts; a steady job does not
            "interval": "1m",
            "input_series": [running,
                             series('longrun_train_mfu_ratio{job="a",rank="0"}', "0.5x150 0.3x30"),
                             series('longrun_job_state{job="b",longrun_job_state="RUNNING"}', "1x200"),
                             series('longrun_train_mfu_ratio{job="b",rank="0"}', "0.5x180")],
            "alert_rule_test": [{"eval_time": "180m", "alertname": "LongrunMFUDrop", "exp_alerts": [
                {"exp_labels": {"severity": "warning", "job": "a"},
                 "exp_annotations": _annotations("LongrunMFUDrop", job="a", value="30%")}]}],
        },
        {  # last commit at t=0 (unix 0), job running: stale after an hour (+ 5 m `for`)
            "interval": "1m",
            "input_series": [running,
                             series('longrun_checkpoint_last_commit_timestamp_seconds{job="a",rank="0"}',
                                    "0x100")],
            "alert_rule_test": [
                {"eval_time": "62m", "alertname": "LongrunCheckpointStale", "exp_alerts": []},
                {"eval_time": "70m", "alertname": "LongrunCheckpointStale", "exp_alerts": [
                    {"exp_labels": {"severity": "warning", "job": "a"},
                     "exp_annotations": _annotations("LongrunCheckpointStale", job="a", value="1h 10m 0s")}]},
            ],
        },
    ]
    spec = tmp_path / "alerts_test.yml"
    spec.write_text(yaml.safe_dump({"rule_files": [str(repo_root / "deploy/prometheus/rules.yml")],
                                    "evaluation_interval": "1m", "tests": tests}, sort_keys=False))
    out = promtool("test", "rules", str(spec))
    assert out.returncode == 0, out.stdout + out.stderr


def test_prometheus_config_discovers_through_the_controller(repo_root):
    config = yaml.safe_load((repo_root / "deploy/prometheus/prometheus.yml").read_text())
    assert config["rule_files"] == ["rules.yml"]
    longrun = next(s for s in config["scrape_configs"] if s["job_name"] == "longrun")
    assert longrun["honor_labels"] is True  # keeps the exposed `job` (see vocab.py)
    (sd,) = longrun["http_sd_configs"]
    assert sd["url"].endswith(":9400/sd")


def _compose(repo_root) -> dict:
    return yaml.safe_load((repo_root / "deploy/docker-compose.yml").read_text())


def test_compose_file_wires_the_services(repo_root):
    compose = _compose(repo_root)
    services = compose["services"]
    assert set(services) == {"redis", "ray-head", "ray-worker", "prometheus", "grafana"}
    assert "${REDIS_PASSWORD:?" in services["redis"]["environment"]["REDIS_PASSWORD"]
    assert "requirepass" in " ".join(services["redis"]["command"])
    for name in ("ray-head", "ray-worker"):
        s = services[name]
        assert s["build"]["dockerfile"] == "deploy/Dockerfile" and s["image"] == "longrun:0.1.0"
        assert s["environment"]["RAY_USAGE_STATS_ENABLED"] == "0"
        assert "checkpoints:/checkpoints" in s["volumes"]
    assert "--head" in services["ray-head"]["command"]
    assert "--address=ray-head:6379" in services["ray-worker"]["command"]
    sd_host = yaml.safe_load((repo_root / "deploy/prometheus/prometheus.yml").read_text())
    assert "ray-head" in sd_host["scrape_configs"][0]["http_sd_configs"][0]["url"]
    # Every bind mount names something that exists in deploy/, and published ports stay on loopback.
    deploy = repo_root / "deploy"
    for name, s in services.items():
        for volume in s.get("volumes", []):
            source = volume.split(":")[0]
            if source.startswith("."):
                assert (deploy / source).exists(), (name, volume)
        for port in s.get("ports", []):
            assert port.startswith("127.0.0.1:"), (name, port)
    grafana_mounts = dict(v.split(":")[:2] for v in services["grafana"]["volumes"])
    provider = yaml.safe_load((deploy / "grafana/provisioning/dashboards/longrun.yml").read_text())
    assert grafana_mounts["./grafana/dashboards"] == provider["providers"][0]["options"]["path"]
    home = services["grafana"]["environment"]["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"]
    assert (deploy / "grafana/dashboards" / Path(home).name).exists()


def test_grafana_datasource_is_the_one_the_dashboards_default_to(repo_root):
    provisioned = yaml.safe_load(
        (repo_root / "deploy/grafana/provisioning/datasources/longrun.yml").read_text())["datasources"]
    (ds,) = provisioned
    assert ds["uid"] == DEFAULT_DATASOURCE_UID and ds["type"] == "prometheus"
    assert ds["url"] == "http://prometheus:9090"


def test_docker_compose_config_parses_if_docker_is_here(repo_root, tmp_path):
    docker = shutil.which("docker")
    if docker is None:
        pytest.skip("no docker client")
    probe = subprocess.run([docker, "compose", "version"], capture_output=True, text=True, timeout=30)
    if probe.returncode != 0:
        pytest.skip(f"docker compose unavailable: {probe.stderr.strip() or probe.stdout.strip()}")
    env = {"REDIS_PASSWORD": "test", "GRAFANA_ADMIN_PASSWORD": "test", "PATH": "/usr/bin:/bin:/usr/local/bin",
           "HOME": str(tmp_path)}
    argv = [docker, "compose", "-f", str(repo_root / "deploy/docker-compose.yml"), "config", "-q"]
    out = subprocess.run(argv, capture_output=True, text=True, timeout=60, env=env)
    assert out.returncode == 0, out.stderr


def test_dockerfile_installs_cpu_torch_before_longrun(repo_root):
    lines = [ln.strip() for ln in (repo_root / "deploy/Dockerfile").read_text().splitlines()]
    assert next(ln for ln in lines if ln.startswith("FROM")) == "FROM python:3.11-slim"
    torch_at = next(i for i, ln in enumerate(lines) if 'pip install "torch==${TORCH_VERSION}"' in ln)
    project_at = next(i for i, ln in enumerate(lines) if ln.startswith("RUN pip install ."))
    assert torch_at < project_at
    assert "ARG TORCH_VERSION=2.13.0" in lines
    assert "ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu" in lines
    # What the image copies must exist (the build context is the repository root).
    for ln in lines:
        if ln.startswith("COPY"):
            for source in ln.split()[1:-1]:
                assert (repo_root / source).exists(), ln


def test_kuberay_manifests(repo_root):
    cluster = yaml.safe_load((repo_root / "deploy/kuberay/raycluster.yaml").read_text())
    job, configmap = yaml.safe_load_all((repo_root / "deploy/kuberay/rayjob.yaml").read_text())
    assert (cluster["apiVersion"], cluster["kind"]) == ("ray.io/v1", "RayCluster")
    assert (job["apiVersion"], job["kind"]) == ("ray.io/v1", "RayJob")
    assert job["spec"]["clusterSelector"]["ray.io/cluster"] == cluster["metadata"]["name"]
    import ray

    assert cluster["spec"]["rayVersion"] == ray.__version__  # the ray the image installs
    head = cluster["spec"]["headGroupSpec"]["template"]["spec"]
    mounts = {m["name"]: m["mountPath"] for m in head["containers"][0]["volumeMounts"]}
    volumes = {v["name"]: v for v in head["volumes"]}
    assert volumes["job-config"]["configMap"]["name"] == configmap["metadata"]["name"]
    ports = {p["containerPort"] for p in head["containers"][0]["ports"]}
    assert 9400 in ports  # the controller's /sd, published through the head service

    argv = shlex.split(job["spec"]["entrypoint"])
    assert argv[:2] == ["longrun", "run"]
    config_path = argv[2]
    assert config_path.startswith(mounts["job-config"] + "/")
    assert Path(config_path).name in configmap["data"]
    overrides = [argv[i + 1] for i, a in enumerate(argv) if a == "--set"]
    assert "cluster.address=auto" in overrides


def test_kuberay_job_config_is_valid_with_the_entrypoint_overrides(repo_root, tmp_path):
    from longrun.config import load_config

    job, configmap = yaml.safe_load_all((repo_root / "deploy/kuberay/rayjob.yaml").read_text())
    argv = shlex.split(job["spec"]["entrypoint"])
    path = tmp_path / "job.yaml"
    path.write_text(configmap["data"][Path(argv[2]).name])
    overrides = [argv[i + 1] for i, a in enumerate(argv) if a == "--set"]
    cfg = load_config(path, overrides)
    assert cfg.cluster.address == "auto" and cfg.checkpoint_dir.startswith("/checkpoints/")
    # The Redis password comes from the pods' environment (the Secret), not the ConfigMap.
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("LONGRUN_REDIS_PASSWORD", "from-the-secret-1")
        assert load_config(path, overrides).cluster.redis_url.startswith("redis://:from-the-secret-1@")


# -- secrets -----------------------------------------------------------------------------------


def test_compose_redis_runs_as_its_own_user_with_the_password_off_command_lines(repo_root):
    redis_service = _compose(repo_root)["services"]["redis"]
    # The image's entrypoint drops root only for a command that starts with redis-server.
    assert redis_service.get("user") == "redis" or redis_service["command"][0] == "redis-server"
    assert "--requirepass" not in " ".join(redis_service["command"])
    health = " ".join(redis_service["healthcheck"]["test"])
    assert "REDISCLI_AUTH=" in health and " -a " not in health


def _run_compose_redis_command(repo_root, tmp_path, password: str):
    """The compose Redis service's command, run by sh with a stand-in redis-server that records
    its arguments and the config it reads on stdin."""
    command = _compose(repo_root)["services"]["redis"]["command"]
    assert command[:2] == ["sh", "-c"]
    script = command[2].replace("$$", "$")  # compose's escape for a literal $
    bin_dir, seen = tmp_path / "bin", tmp_path / "seen"
    bin_dir.mkdir(exist_ok=True)
    stub = bin_dir / "redis-server"
    stub.write_text(f'#!/bin/sh\necho "$@" > {seen}.args\ncat > {seen}.conf\n')
    stub.chmod(0o755)
    env = {"PATH": f"{bin_dir}:/usr/bin:/bin", "REDIS_PASSWORD": password}
    return subprocess.run(["sh", "-c", script], env=env, capture_output=True, text=True, timeout=30), seen


def test_compose_redis_refuses_the_placeholder_and_reads_the_password_on_stdin(repo_root, tmp_path):
    from longrun.redis_password import RedisPasswordError, read_password

    example = dict(line.split("=", 1) for line in (repo_root / "deploy/.env.example").read_text().splitlines()
                   if "=" in line and not line.startswith("#"))
    placeholder = example["REDIS_PASSWORD"]
    out, seen = _run_compose_redis_command(repo_root, tmp_path, placeholder)
    assert out.returncode != 0 and "placeholder" in out.stderr, out
    assert not Path(f"{seen}.args").exists()  # redis-server never started
    with pytest.raises(RedisPasswordError, match="placeholder"):  # longrun refuses it too
        read_password({"LONGRUN_REDIS_PASSWORD": placeholder})

    out, seen = _run_compose_redis_command(repo_root, tmp_path, "a-real-one-7f3c9")
    assert out.returncode == 0, out
    assert "requirepass a-real-one-7f3c9" in Path(f"{seen}.conf").read_text()
    args = Path(f"{seen}.args").read_text()
    assert "a-real-one-7f3c9" not in args and "--appendfsync always" in args


def test_the_local_secrets_file_is_git_ignored(repo_root):
    if shutil.which("git") is None or not (repo_root / ".git").exists():
        pytest.skip("not a git checkout")
    ignored = subprocess.run(["git", "check-ignore", "-q", "deploy/.env"], cwd=repo_root, timeout=30)
    assert ignored.returncode == 0, "deploy/.env (the compose secrets) must be git-ignored"
    kept = subprocess.run(["git", "check-ignore", "-q", "deploy/.env.example"], cwd=repo_root, timeout=30)
    assert kept.returncode == 1


def test_kuberay_keeps_the_password_in_the_secret_and_off_command_lines(repo_root):
    cluster = yaml.safe_load((repo_root / "deploy/kuberay/raycluster.yaml").read_text())
    job, configmap = yaml.safe_load_all((repo_root / "deploy/kuberay/rayjob.yaml").read_text())
    assert "REDIS" not in job["spec"]["entrypoint"] and "redis" not in job["spec"]["entrypoint"]
    head = cluster["spec"]["headGroupSpec"]["template"]["spec"]["containers"][0]
    worker = cluster["spec"]["workerGroupSpecs"][0]["template"]["spec"]["containers"][0]
    for container in (head, worker):
        env = {e["name"]: e for e in container["env"]}
        assert env["LONGRUN_REDIS_PASSWORD"]["valueFrom"]["secretKeyRef"]["name"] == "longrun-redis"
        assert all("value" not in e or "redis://" not in e["value"] for e in container["env"])
    config = yaml.safe_load(configmap["data"]["job.yaml"])
    assert "${LONGRUN_REDIS_PASSWORD}" in config["cluster"]["redis_url"]


def test_kuberay_network_policy_restricts_who_reaches_the_jobs_api(repo_root):
    policies = list(yaml.safe_load_all((repo_root / "deploy/kuberay/networkpolicy.yaml").read_text()))
    cluster = yaml.safe_load((repo_root / "deploy/kuberay/raycluster.yaml").read_text())
    job, _ = yaml.safe_load_all((repo_root / "deploy/kuberay/rayjob.yaml").read_text())
    name = cluster["metadata"]["name"]
    head = next(p for p in policies if p["spec"]["podSelector"]["matchLabels"]
                == {"ray.io/cluster": name, "ray.io/node-type": "head"})
    assert all(p["kind"] == "NetworkPolicy" and p["spec"]["policyTypes"] == ["Ingress"] for p in policies)
    assert any(p["spec"]["podSelector"]["matchLabels"].get("ray.io/node-type") == "worker" for p in policies)
    for policy in policies:
        for rule in policy["spec"]["ingress"]:
            assert rule.get("from"), f"{policy['metadata']['name']}: a rule without `from` admits every pod"
    jobs_api = [rule for rule in head["spec"]["ingress"]
                if any(port["port"] == 8265 for port in rule.get("ports", []))]
    allowed = [peer["podSelector"]["matchLabels"] for rule in jobs_api for peer in rule["from"]]
    # The RayJob's submitter pod carries a label the policy lets through to the Jobs API.
    submitter_labels = job["spec"]["submitterPodTemplate"]["metadata"]["labels"]
    assert any(labels.items() <= submitter_labels.items() for labels in allowed)
    docs = (repo_root / "docs/operations.md").read_text()
    assert "networkpolicy.yaml" in docs and "NetworkPolicy" in docs
