"""Config loading: every bad input fails with the dotted path of the field and the reason."""

from __future__ import annotations

import pytest
import yaml

from longrun.config import ConfigError, JobConfig, config_from_dict, load_config

BASE = {"job": {"name": "t"}}


def _with(**sections):
    raw = {"job": {"name": "t"}}
    for dotted, value in sections.items():
        node = raw
        *parents, leaf = dotted.split("__")
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = value
    return raw


def _problems(raw, overrides=()):
    with pytest.raises(ConfigError) as info:
        config_from_dict(raw, overrides)
    return info.value.problems, str(info.value)


def test_minimal_config_gets_defaults():
    cfg = config_from_dict(BASE)
    assert cfg.world_size == 1
    assert cfg.model.kv_heads == cfg.model.n_heads
    assert cfg.checkpoint_dir == "runs/t/checkpoints"


@pytest.mark.parametrize("raw, path, needle", [
    # wrong types
    (_with(training__steps="many"), "training.steps", "valid integer"),
    (_with(model__tie_embeddings="perhaps"), "model.tie_embeddings", "valid boolean"),
    (_with(training__betas=[0.9]), "training.betas[1]", "required but missing"),
    # unknown keys, at every depth
    (_with(trainin={"steps": 1}), "trainin", "unknown key"),
    (_with(model__layers=4), "model.layers", "unknown key"),
    (_with(health__faults=[{"rank": 0, "step": 1, "kind": "kill", "when": 3}]), "health.faults[0].when",
     "unknown key"),
    # negative and zero sizes
    (_with(parallelism__dp=0), "parallelism.dp", "greater than 0"),
    (_with(cluster__nodes=-2), "cluster.nodes", "greater than 0"),
    (_with(model__dim=-8), "model.dim", "greater than 0"),
    # bad enum values and names
    (_with(parallelism__cp_impl="spiral"), "parallelism.cp_impl", "'ring', 'ulysses' or 'usp'"),
    (_with(job__name="My Job"), "job.name", "not a valid job name"),
    (_with(health__faults=[{"rank": 0, "step": 1, "kind": "explode"}]), "health.faults[0].kind", "kill"),
    # a section's own consistency
    (_with(model__dim=130), "model", "divisible by n_heads"),
    (_with(model__n_heads=8, model__n_kv_heads=3, model__dim=128), "model", "must divide n_heads"),
    (_with(health__heartbeat_timeout_s=1.0), "health", "must exceed heartbeat_interval_s"),
    (_with(data__synthetic={"min_len": 500, "max_len": 100}), "data.synthetic", "must not exceed"),
    # required
    ({"model": {"dim": 64}}, "job", "required"),
])
def test_bad_values_name_the_field(raw, path, needle):
    problems, message = _problems(raw)
    assert any(p == path and needle in why for p, why in problems), problems
    assert path in message


@pytest.mark.parametrize("raw, path, needle", [
    (_with(parallelism__dp=2), "parallelism", "change parallelism.dp to 1"),
    (_with(cluster__workers_per_node=4, parallelism__dp=1, parallelism__tp=4, cluster__nodes=1,
           model__n_heads=6, model__dim=192), "parallelism.tp", "n_heads (6) must be divisible by tp (4)"),
    (_with(cluster__workers_per_node=2, cluster__nodes=2, parallelism__tp=4), "parallelism.tp",
     "must divide cluster.workers_per_node"),
    (_with(cluster__workers_per_node=3, parallelism__cp=3, parallelism__dynamic_cp=True), "parallelism.cp",
     "power-of-two"),
    (_with(training__steps=5, training__warmup_steps=10), "training.warmup_steps", "longer than the run"),
    (_with(health__faults=[{"rank": 3, "step": 1, "kind": "kill"}]), "health.faults[0].rank",
     "does not exist"),
    (_with(model__max_seq_len=4096, data__micro_batch_tokens=1024), "data.micro_batch_tokens", "cannot hold"),
    # dynamic CP over dp 3 x cp 2: the widest group is 2 ranks (the largest power of two
    # dividing 6), which must hold 1000 tokens as two zigzag halves of 2 x 250 = 500 each
    (_with(cluster__workers_per_node=6, parallelism__dp=3, parallelism__cp=2, parallelism__dynamic_cp=True,
           model__max_seq_len=1000, data__micro_batch_tokens=499), "data.micro_batch_tokens",
     "raise micro_batch_tokens to 500"),
])
def test_cross_section_checks_say_what_to_change(raw, path, needle):
    problems, _ = _problems(raw)
    assert any(p == path and needle in why for p, why in problems), problems


def test_dynamic_cp_budget_that_fits_the_widest_group_is_accepted():
    cfg = config_from_dict(_with(cluster__workers_per_node=6, parallelism__dp=3, parallelism__cp=2,
                                 parallelism__dynamic_cp=True, model__max_seq_len=1000,
                                 data__micro_batch_tokens=500))
    assert cfg.parallelism.dynamic_cp and cfg.data.micro_batch_tokens == 500


def test_several_problems_are_reported_together():
    problems, message = _problems(_with(training__steps=0, model__dim="wide", bogus=1))
    assert {p for p, _ in problems} == {"training.steps", "model.dim", "bogus"}
    assert "3 problems" in message


def test_missing_file(tmp_path):
    with pytest.raises(ConfigError, match="no such file"):
        load_config(tmp_path / "absent.yaml")
    with pytest.raises(ConfigError, match="it is a directory"):
        load_config(tmp_path)


def test_invalid_yaml_reports_line_and_column(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("job:\n  name: t\nmodel: [dim: 1\n")
    with pytest.raises(ConfigError, match=r"invalid YAML at line \d+, column \d+"):
        load_config(path)


def test_top_level_must_be_a_mapping(tmp_path):
    path = tmp_path / "list.yaml"
    path.write_text("- job\n- model\n")
    with pytest.raises(ConfigError, match="mapping of sections, not list"):
        load_config(path)


def test_overrides_are_typed_and_validated(tmp_path):
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(BASE))
    cfg = load_config(path, ["training.steps=7", "training.warmup_steps=2", "training.lr=1e-3",
                             "model.tie_embeddings=false", "data.include=['*.py', '*.txt']",
                             "cluster.address=ray://h:10001"])
    assert cfg.training.steps == 7 and isinstance(cfg.training.steps, int)
    assert cfg.training.lr == pytest.approx(1e-3)
    assert cfg.model.tie_embeddings is False
    assert cfg.data.include == ["*.py", "*.txt"]
    assert cfg.cluster.address == "ray://h:10001"


@pytest.mark.parametrize("override, path, needle", [
    ("training.steps", "--set training.steps", "KEY=VALUE"),
    ("training..steps=3", "--set training..steps=3", "empty segment"),
    ("job.name.first=x", "--set job.name.first=x", "job.name is a value"),
    ("training.stepz=3", "training.stepz", "unknown key"),
    ("training.steps=-1", "training.steps", "greater than 0"),
])
def test_bad_overrides(override, path, needle):
    problems, _ = _problems(BASE, [override])
    assert any(p == path and needle in why for p, why in problems), problems


def test_resolved_yaml_round_trips(tmp_path):
    cfg = config_from_dict(_with(training__steps=11, parallelism__cp_impl="usp"))
    path = tmp_path / "resolved.yaml"
    path.write_text(cfg.to_yaml())
    again = load_config(path)
    assert again == cfg
    assert again.fingerprint() == cfg.fingerprint()
    assert again.fingerprint("model") == config_from_dict(BASE).fingerprint("model")
    assert again.fingerprint("training") != config_from_dict(BASE).fingerprint("training")


@pytest.mark.parametrize("name", ["tiny.yaml", "llama-8b-64gpu.yaml"])
def test_examples_are_valid(repo_root, name):
    cfg = load_config(repo_root / "examples" / name)
    assert isinstance(cfg, JobConfig)


def test_realistic_example_is_multi_node(repo_root):
    cfg = load_config(repo_root / "examples" / "llama-8b-64gpu.yaml")
    assert cfg.cluster.nodes > 1 and cfg.world_size == 64
    assert cfg.parallelism.tp == cfg.cluster.workers_per_node


def test_a_fixed_metrics_port_with_several_workers_per_node_is_refused():
    with pytest.raises(ConfigError, match=r"observability\.metrics_port"):
        config_from_dict({"job": {"name": "m"}, "cluster": {"workers_per_node": 2},
                          "parallelism": {"dp": 2}, "observability": {"metrics_port": 9100}})
