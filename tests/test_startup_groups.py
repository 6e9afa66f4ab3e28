"""What a rank's start sets up for its groups and its GPU (issue 38): the job's collective
timeout on every process group, NCCL options of each group's own, and on GPUs every rank of a
node seeing every GPU of the node, each picking its own.

Run: python -m pytest -q tests/test_startup_groups.py
"""

from __future__ import annotations

from datetime import timedelta

import pytest
import startup_workers as w
import torch
import torch.distributed as dist

import longrun.commgroup.groups as groups_module
import longrun.commgroup.init as init_module
from longrun.commgroup import NodeSpec, ParallelDims, make_layout
from longrun.config import config_from_dict
from longrun.controller.workers import NOSET_CUDA_VISIBLE_DEVICES, actor_options
from longrun.testing.worlds import World
from longrun.worker.setup import gpu_index, worker_device


def _cfg(device: str = "cpu", **health):
    return config_from_dict({
        "job": {"name": "startgroups"},
        "cluster": {"device": device, "nodes": 1, "workers_per_node": 2},
        "parallelism": {"dp": 1, "fsdp": 2},
        "model": {"dim": 64, "n_heads": 4, "max_seq_len": 128},
        "data": {"source": "synthetic", "micro_batch_tokens": 128},
        "health": health,
    })


def test_the_collective_timeout_reaches_every_process_group(redis_server, redis_client):
    cfg = _cfg(collective_timeout_s=7.5)
    args = (redis_server.url, cfg.model_dump(mode="json"))
    with World(w.group_timeouts, 2, args=args, timeout=120) as world:
        world.start()
        out = sorted(world.collect(2))
        world.join()
    for rank, outcome, seen in out:
        assert outcome == "ok"
        assert {"world", "replicate", "fsdp", "dp_cp", "tp"} <= set(seen), seen
        assert set(seen.values()) == {7.5}, (rank, seen)


class FakeOptions:
    """ProcessGroupNCCL.Options as torch uses it: fields written per group, kept by the group."""

    def __init__(self):
        self.config = type("Config", (), {"blocking": 1})()


def test_every_nccl_group_gets_options_of_its_own(monkeypatch):
    """torch writes each group's timeout, name, ranks and split colour into the options object it
    is given and the group keeps the pointer: one object for every group would leave all of
    them with the last group's fields."""
    monkeypatch.setattr(dist, "ProcessGroupNCCL", type("ProcessGroupNCCL", (), {"Options": FakeOptions}),
                        raising=False)
    made: list[tuple[str, object]] = []

    def new_group(members, *, pg_options, group_desc, **kw):
        made.append((group_desc, pg_options))
        return object()

    monkeypatch.setattr(groups_module.dist, "new_group", new_group)
    monkeypatch.setattr(init_module.dist, "is_initialized", lambda: False)
    monkeypatch.setattr(init_module, "count_in", lambda *a: None)
    monkeypatch.setattr(init_module, "_await_everyone", lambda *a: None)
    monkeypatch.setattr(init_module, "_init_world", lambda *a, **kw: object())

    class Store:
        @classmethod
        def for_attempt(cls, *a, **kw):
            return cls()

        def reading_ahead(self, n):
            import contextlib
            return contextlib.nullcontext()

    monkeypatch.setattr(init_module, "RedisStore", Store)
    # 2 nodes x 4: dp 2 x cp 2 x tp 2 gives rank 0 several groups of its own besides the world.
    layout = make_layout([NodeSpec("a"), NodeSpec("b")], 4, ParallelDims(dp=2, cp=2, tp=2))
    init_module.init_parallel_groups("redis://x", job="j", attempt=0, rank=0, layout=layout, backend="nccl",
                                     device=torch.device("cuda", 0), timeout=timedelta(seconds=9))
    assert len(made) >= 3, made
    options = [o for _, o in made]
    assert len({id(o) for o in options}) == len(options), "two groups share one options object"
    assert all(isinstance(o, FakeOptions) and o.config.blocking == 0 for o in options)


@pytest.mark.parametrize("assigned, visible, local, want", [
    (["5"], None, 1, 5),  # Ray's masking off: the physical id is torch's index
    (["6"], "4,5,6,7", 1, 2),  # a container given GPUs 4-7: the id's place in the node's mask
    (["3"], "3", 1, 0),  # Ray's masking on (an older launch): the one GPU the actor sees
    (["GPU-b2"], "GPU-a1,GPU-b2", 0, 1),  # ids as UUIDs
    ([], None, 3, 3),  # outside Ray: the local rank
])
def test_a_rank_picks_its_gpu_by_the_id_ray_assigned_or_its_local_rank(assigned, visible, local, want):
    assert gpu_index(assigned, visible, local, count=8) == want


def test_a_gpu_index_the_node_does_not_have_is_refused_with_what_was_seen():
    with pytest.raises(RuntimeError, match=r"index 9 .* torch sees 8 GPU"):
        gpu_index(["9"], None, 1, count=8)


def test_gpu_actors_see_every_gpu_of_their_node():
    gpu, cpu = actor_options(_cfg("cuda")), actor_options(_cfg("cpu"))
    assert gpu["runtime_env"] == {"env_vars": {NOSET_CUDA_VISIBLE_DEVICES: "1"}}
    assert gpu["num_gpus"] == 0.5 and "runtime_env" not in cpu


def test_a_cpu_rank_stays_on_the_cpu():
    assert worker_device(_cfg("cpu"), rank=1) == torch.device("cpu")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no GPU here")
def test_outside_ray_a_gpu_rank_takes_its_local_rank():
    count = torch.cuda.device_count()
    cfg = config_from_dict({"job": {"name": "gpu"}, "cluster": {"device": "cuda", "workers_per_node": count},
                            "parallelism": {"dp": count}})
    last = torch.cuda.device_count() - 1
    assert worker_device(cfg, rank=last) == torch.device("cuda", last)
    assert torch.cuda.current_device() == last


def test_a_rank_keeps_only_its_own_gpus_rng_state(monkeypatch):
    """With every GPU of the node visible, a rank's RNG record holds its own device's state (a
    record of all of them would start a CUDA context on each) and puts it back there."""
    from longrun.trainer import runtime

    calls = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 5)
    monkeypatch.setattr(torch.cuda, "get_rng_state", lambda device: calls.append(("get", device)) or
                        torch.tensor([device], dtype=torch.uint8))
    monkeypatch.setattr(torch.cuda, "get_rng_state_all", lambda: pytest.fail("every device's state"))
    monkeypatch.setattr(torch.cuda, "set_rng_state",
                        lambda s, device: calls.append(("set", int(s[0]), device)))
    state = runtime.rng_state()
    assert [int(s[0]) for s in state["cuda"]] == [5]
    runtime.set_rng_state(state)
    assert calls == [("get", 5), ("set", 5, 5)]
