"""A worker's setup: the collective backend follows `cluster.device`, and the groups it asks
commgroup for are laid out from the job's parallel dims (no GPU needed to test the choice)."""

from __future__ import annotations

import pytest
import torch

import longrun.worker.setup as setup
from longrun.config import config_from_dict


def _cfg(device: str, **parallelism):
    return config_from_dict({
        "job": {"name": "setup"},
        "cluster": {"device": device, "nodes": 2, "workers_per_node": 2},
        "parallelism": {"dp": 2, "cp": 2, **parallelism},
        "model": {"dim": 64, "n_heads": 4, "max_seq_len": 128},
        "data": {"source": "synthetic", "micro_batch_tokens": 64},
    })


@pytest.mark.parametrize("device, backend, passed_device", [
    (torch.device("cuda", 0), "nccl", torch.device("cuda", 0)),
    (torch.device("cpu"), "gloo", None),
])
def test_the_backend_follows_the_device(monkeypatch, device, backend, passed_device):
    asked = {}
    monkeypatch.setattr(setup, "init_parallel_groups", lambda url, **kw: asked.update(kw, url=url))
    cfg = _cfg("cuda" if device.type == "cuda" else "cpu")
    setup.join_groups(cfg, rank=3, attempt=2, redis_url="redis://127.0.0.1:1", node_ids=["b", "a"],
                      device=device)
    assert asked["backend"] == backend and asked["device"] == passed_device
    assert (asked["rank"], asked["attempt"], asked["job"]) == (3, 2, "setup")


def test_groups_are_laid_out_from_the_jobs_dims_in_placement_order(monkeypatch):
    asked = {}
    monkeypatch.setattr(setup, "init_parallel_groups", lambda url, **kw: asked.update(kw))
    cfg = _cfg("cpu", cp_impl="usp", dp=1, cp=4)
    setup.join_groups(cfg, rank=0, attempt=0, redis_url="redis://127.0.0.1:1", node_ids=["zz", "aa"],
                      device=torch.device("cpu"))
    layout = asked["layout"]
    assert layout.dims == cfg.dims
    # Rank r stays on the node the controller placed it on, whatever the node names sort as.
    assert [layout.node_of(r).name.split("-", 1)[1] for r in range(4)] == ["zz", "zz", "aa", "aa"]
    # USP over 4 ranks with 4 heads: Ulysses pairs, rings across them, formed by commgroup.
    assert layout.attention_groups == {"uly4": [[0, 1], [2, 3]], "ring4": [[0, 2], [1, 3]]}
