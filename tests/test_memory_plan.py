"""The per-rank memory planner: its counts against the real model, its activation estimate
against what autograd actually keeps, and the refusal that names the knob to turn."""

from __future__ import annotations

import pytest
from saved_tensors import kept_bytes

from longrun.config import config_from_dict
from longrun.config.memory import (
    GB,
    kept_values_per_token,
    memory_plan,
    parameter_counts,
    plan_for,
    plan_problem,
)
from longrun.parallel.dims import ParallelDims
from longrun.trainer import Trainer

SHAPES = [  # dim, heads, kv heads, ffn, layers, tokens, tied
    (64, 4, 4, 128, 2, 256, True),
    (64, 4, 4, 128, 4, 256, False),
    (128, 4, 2, 256, 2, 256, True),
    (64, 4, 1, 512, 3, 512, True),
]


def _config(dim, heads, kv, ffn, layers, tokens, tied, **training):
    return config_from_dict({
        "job": {"name": "mem"}, "cluster": {"device": "cpu"},
        "model": {"dim": dim, "n_heads": heads, "n_kv_heads": kv, "ffn_dim": ffn, "n_layers": layers,
                  "max_seq_len": tokens, "tie_embeddings": tied},
        "data": {"source": "synthetic", "micro_batch_tokens": tokens,
                 "synthetic": {"min_len": 8, "max_len": tokens, "mean": 64, "sigma": 0.5}},
        "training": training,
    })


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("ac", ["none", "full"])
def test_activation_estimate_matches_what_autograd_keeps(shape, ac):
    cfg = _config(*shape, activation_checkpointing=ac)
    with Trainer(cfg, progress=False) as trainer:
        measured = kept_bytes(trainer, shape[5])
        assert trainer.model.num_params() == parameter_counts(cfg.model)[0]
    estimated = kept_values_per_token(cfg.model, 1, ac) * shape[5] * 4  # fp32 on the CPU
    assert estimated == pytest.approx(measured, rel=0.05), (estimated, measured)


def test_sharding_divides_the_state_and_checkpointing_the_activations():
    cfg = _config(256, 8, 4, 512, 4, 1024, True, dtype="bfloat16")
    whole = plan_for(cfg)
    fsdp4 = memory_plan(cfg.model, ParallelDims(fsdp=4), cfg.training, cfg.data)
    tp4 = memory_plan(cfg.model, ParallelDims(tp=4), cfg.training, cfg.data)
    assert fsdp4.parameters == pytest.approx(whole.parameters / 4)
    assert fsdp4.optimizer == pytest.approx(whole.optimizer / 4) and fsdp4.gathered > 0
    assert tp4.activations < whole.activations / 2 and tp4.gathered == 0
    by_mode = {mode: memory_plan(cfg.model, cfg.dims,
                                 cfg.training.model_copy(update={"activation_checkpointing": mode}),
                                 cfg.data).activations
               for mode in ("none", "selective", "full")}
    assert by_mode["none"] > by_mode["selective"] > by_mode["full"]
    # The partitioner's budget runs from what full checkpointing keeps (0) to what none does (1).
    budgeted = [memory_plan(cfg.model, cfg.dims, cfg.training.model_copy(
        update={"activation_checkpointing": "budget", "activation_memory_budget": b}), cfg.data).activations
        for b in (0.01, 0.5, 0.99)]
    assert by_mode["full"] < budgeted[0] < budgeted[1] < budgeted[2] < by_mode["none"]
    assert budgeted[1] == pytest.approx((by_mode["full"] + by_mode["none"]) / 2, rel=0.05)


def test_a_layout_that_does_not_fit_is_refused_with_the_change_that_fits():
    cfg = _config(256, 8, 4, 512, 4, 1024, True)
    assert plan_problem(cfg) is None  # no device memory configured: nothing to check
    total = plan_for(cfg).total_bytes
    assert plan_problem(_with_memory(cfg, total / GB * 2)) is None
    problem = plan_problem(_with_memory(cfg, total / GB))
    assert "exceeds 90% of cluster.device_memory_gb" in problem
    assert "set training.activation_checkpointing: selective" in problem
    assert "no single change" in plan_problem(_with_memory(cfg, 1e-6))


def _with_memory(cfg, gb: float):
    return cfg.model_copy(update={"cluster": cfg.cluster.model_copy(update={"device_memory_gb": gb})})


def test_checkpointed_blocks_keep_only_their_inputs_outside_the_recompute():
    """Both checkpointing modes are applied: outside the checkpointed blocks autograd keeps
    far less than without (what selective keeps inside lives in the recompute's own cache)."""
    shape = SHAPES[0]
    kept = {}
    for mode in ("none", "full", "selective"):
        with Trainer(_config(*shape, activation_checkpointing=mode), progress=False) as trainer:
            kept[mode] = kept_bytes(trainer, shape[5])
    assert kept["full"] == kept["selective"] < kept["none"] / 3


@pytest.mark.parametrize(("pp", "virtual", "schedule"), [(2, 1, "1f1b"), (4, 2, "interleaved_1f1b"),
                                                         (2, 2, "zbv_zero_bubble")])
def test_each_pipeline_rank_is_planned_with_the_weights_it_holds(pp, virtual, schedule):
    """The planner's parameters per pipeline rank are those its real stages hold (the same
    split as the trainer's), and the activations follow the schedule's micro-batches in flight."""
    from longrun.config.memory import stage_plans
    from longrun.parallel.pipeline import PipelinedModel, PipelinePlan
    from longrun.trainer.model import Transformer

    cfg = config_from_dict({
        "job": {"name": "pp-plan"}, "cluster": {"workers_per_node": pp},
        "parallelism": {"pp": pp, "pp_virtual_stages": virtual},
        "model": {"dim": 64, "n_layers": 8, "n_heads": 4, "ffn_dim": 128, "tie_embeddings": False},
        "training": {"pp_schedule": schedule, "grad_accum": 8}})
    plans = stage_plans(cfg.model, cfg.dims, cfg.training, cfg.data, on_gpu=False,
                        parallelism=cfg.parallelism)
    model = Transformer(cfg.model)
    held = []
    for r in range(pp):
        plan = PipelinePlan(group=None, rank=r, schedule=schedule, virtual_stages=virtual)
        parts = PipelinedModel(model, pp=pp, plan=plan, span_group=None).module
        held.append(sum(p.numel() for p in parts.parameters()))
    assert [p.parameters / 4 for p in plans] == held
    assert sum(held) == model.num_params()
    # The first rank keeps the most micro-batches in flight; the last one the logits too.
    flights = [p.in_flight for p in plans]
    assert flights == sorted(flights, reverse=True) and flights[0] > 1
    assert plan_for(cfg).total_bytes == max(p.total_bytes for p in plans)
