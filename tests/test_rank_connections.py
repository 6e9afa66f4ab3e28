"""A training rank holds at most two Redis connections (issue 38): at 16,384 ranks every
connection a rank opens is 16,384 on the server, and five per rank were 80,000 against Redis's
default maxclients of 10,000. Two real ranks train (gloo, a real Redis, outside Ray), are held at
a step, and Redis's own CLIENT LIST is read while they hold.

Run: python -m pytest -q tests/test_rank_connections.py
"""

from __future__ import annotations

import resource
import threading
import time

import pytest
import redis
import startup_workers as w

from longrun.commgroup.store import RedisStore
from longrun.config import config_from_dict
from longrun.health.heartbeat import read_heartbeats
from longrun.services.redis_client import PatientCalls
from longrun.services.redis_server import maxclients
from longrun.testing.worlds import World
from longrun.worker.redis_links import RankRedis, client_name

JOB = "conn"


def test_each_rank_holds_at_most_two_redis_connections_while_it_trains(redis_server, redis_client, tmp_path):
    release = tmp_path / "release"
    cfg = config_from_dict({
        "job": {"name": JOB, "output_dir": str(tmp_path)},
        "cluster": {"device": "cpu", "nodes": 1, "workers_per_node": 2},
        "parallelism": {"dp": 2},
        "model": {"dim": 64, "n_heads": 4, "max_seq_len": 64},
        "data": {"source": "synthetic", "micro_batch_tokens": 64},
        "training": {"steps": 4, "warmup_steps": 1},
        "checkpoint": {"interval_steps": 2},  # a commit (reports, the coordinator's wait) before the hold
        "health": {"heartbeat_interval_s": 0.2, "heartbeat_timeout_s": 5.0,
                   "faults": [{"rank": r, "step": 2, "kind": "hold", "release_file": str(release)}
                              for r in (0, 1)]},
    })
    own = redis_client.client_id()
    with World(w.train_rank, 2, args=(redis_server.url, cfg.model_dump(mode="json")), timeout=240) as world:
        world.start()
        deadline = time.monotonic() + 180
        while True:  # both ranks held after step 2 (their heartbeats say so)
            beats = read_heartbeats(redis_client, JOB, 0, range(2))
            if all(b is not None and b.phase == "held" for b in beats.values()):
                break
            assert time.monotonic() < deadline, f"the ranks never reached their hold: {beats}"
            time.sleep(0.1)  # polling Redis for the condition; nothing to block on
        clients = [c for c in redis_client.client_list() if int(c["id"]) != own]
        release.touch()
        done = sorted(world.collect(2))
        world.join()
    assert [d[1:] for d in done] == [("done", 4), ("done", 4)]
    names = [c["name"] for c in clients]
    for rank in range(2):
        mine = [n for n in names if n.startswith(client_name(JOB, 0, rank))]
        assert 1 <= len(mine) <= 2, (rank, names)
    # Every connection Redis sees is one of the ranks' (named), none opened unaccounted for.
    assert all(n.startswith(f"longrun:{JOB}:a0:r") for n in names), names


def test_the_embedded_redis_takes_the_clients_of_16384_ranks_or_what_its_file_limit_allows(redis_client):
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    want = 40_000 if hard == resource.RLIM_INFINITY else min(40_000, hard - 32)
    assert maxclients() == want
    assert int(redis_client.config_get("maxclients")["maxclients"]) == want  # not Redis's 10,000


class Flaky:
    """A client whose server is away for the first `fails` commands (a pipeline's execute counts
    one); a failed pipeline is emptied, as redis-py's is."""

    def __init__(self, fails: int):
        self.fails, self.applied = fails, []

    def _send(self, commands):
        if self.fails:
            self.fails -= 1
            raise redis.ConnectionError("Connection refused")
        self.applied.append(commands)
        return [True] * len(commands)

    def hgetall(self, key):
        return self._send([("hgetall", key)])

    def pipeline(self, transaction=True):
        client = self

        class Pipe:
            def __init__(self):
                self.stack = []

            def __enter__(self):
                return self

            def __exit__(self, *exc):
                self.stack = []

            def hset(self, *args):
                self.stack.append(("hset", *args))
                return self

            def execute(self):
                try:
                    return client._send(self.stack)
                finally:
                    self.stack = []
        return Pipe()


def test_patient_calls_retry_through_an_outage_and_replay_a_pipeline_whole():
    slept: list[float] = []
    flaky = Flaky(fails=2)
    patient = PatientCalls(flaky, patience_s=5.0, sleep=slept.append)
    assert patient.hgetall("k") == [True]
    assert slept == [0.05, 0.1]  # backing off between tries, the connection given back meanwhile
    flaky.fails = 1
    with patient.pipeline() as pipe:
        pipe.hset("h", "0", "report")
        pipe.hset("h", "1", "report")
        pipe.execute()
    assert flaky.applied[-1] == [("hset", "h", "0", "report"), ("hset", "h", "1", "report")]
    flaky.fails = 1000
    with pytest.raises(redis.ConnectionError):  # patience spent: the error reaches the caller
        PatientCalls(flaky, patience_s=0.2, sleep=slept.append).hgetall("k")


def test_a_store_on_a_ranks_links_is_one_connection_for_every_thread_and_its_clones(redis_server,
                                                                                   redis_client):
    links = RankRedis(redis_server.url, "links", 0, 3, patience_s=5.0)
    store = RedisStore(redis_server.url, "longrun:links:a0:store:", links=links.store())
    clone = store.clone()
    threads = [threading.Thread(target=(store if i % 2 else clone).set, args=(f"k{i}", str(i)))
               for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert [store.get(f"k{i}") for i in range(8)] == [str(i).encode() for i in range(8)]
    store.close()  # borrowed connections stay open: the rank closes them
    clone.close()
    assert links.client.ping()
    names = [c["name"] for c in redis_client.client_list()]
    assert names.count("longrun:links:a0:r3") == 1 and names.count("longrun:links:a0:r3:store") == 1
    links.close()


def test_the_deploy_files_size_redis_for_16384_ranks_and_say_why(repo_root):
    import yaml

    compose = yaml.safe_load((repo_root / "deploy" / "docker-compose.yml").read_text())["services"]["redis"]
    script = " ".join(compose["command"])
    assert "maxclients 40000" in script
    assert compose["ulimits"]["nofile"]["soft"] >= 40_000 + 32  # Redis needs maxclients + 32 files
    text = (repo_root / "deploy" / "docker-compose.yml").read_text()
    assert "16,384 ranks are 32,768" in text  # the sizing is explained where it is set
    kuberay = (repo_root / "deploy" / "kuberay" / "raycluster.yaml").read_text()
    assert "maxclients 40000" in kuberay and "at most two connections" in kuberay
