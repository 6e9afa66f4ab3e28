"""Pipeline parallelism on gloo: every schedule and every composition (PP x DP, PP x FSDP,
PP x TP, PP 4 interleaved) gives the loss and gradients of one process; each layout resumes
bitwise from its own checkpoint, and a checkpoint restores at another pp degree (and without
pp, and back) with every tensor bitwise the saved one. Configs that cannot run are refused by
`config validate` with the knob to turn."""

from __future__ import annotations

import pytest
from pipeline_workers import (
    VARIED,
    gradients_match_one_process,
    packed_steps_match_one_process,
    restore_at_layout,
    resumes_from_own_checkpoint,
    save_at_layout,
)
from worlds import run_world

from longrun.config import ConfigError, config_from_dict
from longrun.parallel.schedules import bubble_fraction, stage_layers, stages_of_rank

# name: (parallelism, schedule, world, training)
LAYOUTS = {
    "pp2-1f1b": ({"pp": 2}, "1f1b", 2, {}),
    "pp2-gpipe": ({"pp": 2}, "gpipe", 2, {}),
    "pp2xdp2": ({"pp": 2, "dp": 2}, "1f1b", 4, {}),
    "pp2xfsdp2": ({"pp": 2, "fsdp": 2}, "1f1b", 4, {}),
    "pp2xtp2": ({"pp": 2, "tp": 2}, "1f1b", 4, {}),
    "pp4-interleaved": ({"pp": 4, "pp_virtual_stages": 2}, "interleaved_1f1b", 4, {"grad_accum": 8}),
    "pp2-looped-bfs": ({"pp": 2, "pp_virtual_stages": 2}, "looped_bfs", 2, {}),
    "pp2-interleaved-zero-bubble": ({"pp": 2, "pp_virtual_stages": 2}, "interleaved_zero_bubble", 2, {}),
    "pp2-zbv": ({"pp": 2, "pp_virtual_stages": 2}, "zbv_zero_bubble", 2, {}),
    "pp2xfsdp2-interleaved": ({"pp": 2, "fsdp": 2, "pp_virtual_stages": 2}, "interleaved_1f1b", 4, {}),
    "pp2xtp2-full-ac": ({"pp": 2, "tp": 2}, "1f1b", 4, {"activation_checkpointing": "full"}),
    # Varied document lengths: packed per rank, some steps' global batches needed 5 micro-batches
    # on a rank (6 with the interleaved rounding) before issue 38.
    "pp2xdp2-interleaved": ({"pp": 2, "dp": 2, "pp_virtual_stages": 2}, "interleaved_1f1b", 4,
                            {"data": VARIED}),
}
N_LAYERS = 8  # pipeline_config's model


# By default every composition and one schedule of each kind (single-stage, interleaved, V);
# the schedules the others cover are `slow`.
FAST_GRADIENTS = ("pp2xdp2", "pp2xfsdp2", "pp2xtp2", "pp4-interleaved", "pp2-zbv")


@pytest.mark.parametrize("name", [pytest.param(n, marks=[] if n in FAST_GRADIENTS else pytest.mark.slow)
                                  for n in LAYOUTS])
def test_gradients_equal_one_process(name, tmp_path):
    parallelism, schedule, world, training = LAYOUTS[name]
    out = run_world(gradients_match_one_process, world, tmp_path, args=(parallelism, schedule, training))
    held: dict[str, int] = {}
    for rank, loss, ref_loss, worst_rel_err, names, norm, ref_norm in out:
        assert worst_rel_err < 1e-5, (rank, worst_rel_err)
        assert loss == pytest.approx(ref_loss, rel=1e-5), rank
        # The norm clipping sees is over every stage, not this rank's alone.
        assert norm == pytest.approx(ref_norm, rel=1e-5), rank
        for n in names:
            held[n] = held.get(n, 0) + 1
    # The stages partition the model: every parameter is held by one stage's ranks (all of
    # them: dp, fsdp and tp ranks hold a copy or a piece of each of their stage's).
    per_stage = world // parallelism["pp"]
    layers = {n.split(".")[1] for n in held if n.startswith("layers.")}
    assert layers == {str(i) for i in range(N_LAYERS)}
    assert set(held.values()) == {per_stage}, held
    assert {"tok_embeddings.weight", "norm.weight", "output.weight"} <= set(held)


# By default DTensor pieces per stage (PP x FSDP) and several stages per rank (PP 4
# interleaved); the other layouts resume in the slow set.
RESUMES = ["pp2xfsdp2", "pp4-interleaved", "pp2xdp2-interleaved"]


@pytest.mark.parametrize("name", [pytest.param(n, marks=[] if n in RESUMES else pytest.mark.slow)
                                  for n in [*RESUMES, "pp2xdp2", "pp2xtp2", "pp2-1f1b", "pp2-zbv"]])
def test_each_layout_resumes_bitwise_from_its_own_checkpoint(name, tmp_path, redis_server):
    parallelism, schedule, world, training = LAYOUTS[name]
    out = run_world(resumes_from_own_checkpoint, world, tmp_path,
                    args=(parallelism, schedule, training, redis_server.url, str(tmp_path / "ckpt"),
                          f"pp-resume-{name}"))
    assert [(rank, step, bitwise) for rank, step, bitwise, *_ in out] == [(r, 2, True) for r in range(world)]
    # Every step of the three runs packed exactly the job's micro-batches: none was empty.
    assert [empty for *_, empty in out] == [[0, 0, 0]] * world


# Steps whose global batches, packed per rank, needed one micro-batch more than grad_accum and
# were padded up to the schedule's count before issue 38 (pp 2 x dp 2: 5 -> 6; pp 4: 9 -> 12).
PACKED = {"pp2xdp2-interleaved": 3, "pp4-interleaved": 2}


@pytest.mark.parametrize("name", [pytest.param(n, marks=[] if n == "pp2xdp2-interleaved"
                                               else pytest.mark.slow) for n in PACKED])
def test_a_step_that_was_padded_runs_no_empty_micro_batch_and_equals_one_process(name, tmp_path):
    parallelism, schedule, world, training = LAYOUTS[name]
    training = {"data": VARIED} | training
    steps, accum = PACKED[name], training.get("grad_accum", 4)
    out = run_world(packed_steps_match_one_process, world, tmp_path,
                    args=(parallelism, schedule, training, steps))
    for rank, counts, empty, builds, worst, losses, ref_losses in out:
        # The job's count every step, none empty, and the schedule built once for it.
        assert (counts, empty, builds) == ([accum] * steps, [0] * steps, [accum]), rank
        assert worst < 1e-5, (rank, worst)
        assert losses == pytest.approx(ref_losses, rel=1e-5), rank


def _world_dir(tmp_path, name):
    path = tmp_path / name
    path.mkdir(exist_ok=True)
    return path


# (source, target): pp 2 -> none, pp 2 -> pp 4 interleaved, none -> pp 2 x tp 2, pp2 x fsdp2 -> pp 2
RESHARDS = {
    "pp2-to-none": ("pp2-1f1b", ({}, "1f1b", 1, {})),
    "pp2-to-pp4": ("pp2-1f1b", LAYOUTS["pp4-interleaved"]),
    "none-to-pp2xtp2": (({}, "1f1b", 1, {}), LAYOUTS["pp2xtp2"]),
    "pp2xfsdp2-to-pp2": ("pp2xfsdp2", LAYOUTS["pp2-1f1b"]),
}


@pytest.mark.parametrize("name", [pytest.param(n, marks=[] if n in ("pp2-to-none", "pp2-to-pp4")
                                               else pytest.mark.slow) for n in RESHARDS])
def test_a_checkpoint_restores_at_another_pipeline_degree_bitwise(name, tmp_path, redis_server):
    source, target = RESHARDS[name]
    source = LAYOUTS[source] if isinstance(source, str) else source
    s_par, s_sched, s_world, s_train = source
    t_par, t_sched, t_world, t_train = target
    root, job = str(tmp_path / "ckpt"), f"pp-reshard-{name}"
    saved = run_world(save_at_layout, s_world, _world_dir(tmp_path, "save"),
                      args=(s_par, s_sched, s_train, redis_server.url, root, job))
    assert saved == [(r, "saved") for r in range(s_world)]
    out = run_world(restore_at_layout, t_world, _world_dir(tmp_path, "restore"),
                    args=(t_par, t_sched, t_train, redis_server.url, root, job, s_world))
    assert [(rank, step, same) for rank, step, same, _ in out] == [(r, 3, True) for r in range(t_world)]
    # Between them the restoring ranks hold every tensor of the model and its optimizer state.
    held = {n for *_, names in out for n in names}
    assert {f"model.layers.{i}.attention.wq.weight" for i in range(N_LAYERS)} <= held
    assert "optimizer.state.output.weight.exp_avg" in held


# -- the schedules' arithmetic ------------------------------------------------------------------


def test_stages_split_the_blocks_evenly_or_as_told():
    assert stage_layers(8, 4) == [range(0, 2), range(2, 4), range(4, 6), range(6, 8)]
    assert stage_layers(7, 3) == [range(0, 3), range(3, 5), range(5, 7)]  # the first stages get more
    assert stage_layers(8, 2, [3, 5]) == [range(0, 3), range(3, 8)]
    with pytest.raises(ValueError, match=r"summing to model\.n_layers"):
        stage_layers(8, 2, [3, 4])
    with pytest.raises(ValueError, match="at least 1"):
        stage_layers(8, 2, [0, 8])


def test_each_rank_holds_its_stages_looped_or_v_shaped():
    assert stages_of_rank(1, pp=4, virtual_stages=2, schedule="interleaved_1f1b") == [1, 5]
    assert stages_of_rank(0, pp=2, virtual_stages=2, schedule="zbv_zero_bubble") == [0, 3]
    assert stages_of_rank(1, pp=2, virtual_stages=2, schedule="zbv_zero_bubble") == [1, 2]
    assert stages_of_rank(3, pp=4, virtual_stages=3, schedule="1f1b") == [3]  # one stage per rank


def test_the_bubble_shrinks_with_micro_batches_and_interleaving():
    one = bubble_fraction("1f1b", pp=4, micro_batches=8)
    assert one == pytest.approx((3 / 8) / (1 + 3 / 8))
    assert bubble_fraction("1f1b", pp=4, micro_batches=32) < one
    assert bubble_fraction("interleaved_1f1b", pp=4, micro_batches=8, virtual_stages=2) == \
        pytest.approx((3 / 16) / (1 + 3 / 16))
    assert bubble_fraction("gpipe", pp=1, micro_batches=1) == 0.0


# -- what validate refuses ------------------------------------------------------------------------

PP2 = {"cluster": {"workers_per_node": 2}, "parallelism": {"pp": 2},
       "model": {"n_layers": 4, "tie_embeddings": False}, "training": {"grad_accum": 2}}


def _with(base: dict, **changes) -> dict:
    raw = {"job": {"name": "pp"}, **{k: dict(v) for k, v in base.items()}}
    for dotted, value in changes.items():
        section, key = dotted.split("__")
        raw.setdefault(section, {})[key] = value
    return raw


@pytest.mark.parametrize("changes, path, needle", [
    ({"model__tie_embeddings": True}, "model.tie_embeddings", "set model.tie_embeddings to false"),
    ({"training__grad_accum": 1}, "training.grad_accum", "raise training.grad_accum to 2"),
    ({"training__global_batch_tokens": 2048}, "training.global_batch_tokens",
     "raise training.global_batch_tokens to 4096"),
    ({"parallelism__cp": 2, "cluster__workers_per_node": 4}, "parallelism.cp", "Set parallelism.cp to 1"),
    ({"parallelism__pp_virtual_stages": 2}, "parallelism.pp_virtual_stages", "one stage per rank"),
    ({"training__pp_schedule": "zbv_zero_bubble"}, "parallelism.pp_virtual_stages", "set it to 2"),
    ({"training__pp_schedule": "interleaved_zero_bubble", "parallelism__pp_virtual_stages": 2,
      "training__grad_accum": 4, "training__activation_checkpointing": "full"},
     "training.activation_checkpointing", "set it to none"),
    ({"parallelism__pp_layers": [1, 2]}, "parallelism.pp_layers", "summing to model.n_layers (4)"),
    ({"parallelism__pp": 8, "cluster__workers_per_node": 8, "training__grad_accum": 8}, "parallelism.pp",
     "8 pipeline stages need at least as many transformer blocks"),
    # Every step runs exactly the job's count: the interleaved rounds need a multiple of pp.
    ({"training__pp_schedule": "interleaved_1f1b", "parallelism__pp_virtual_stages": 2,
      "training__grad_accum": 5}, "training.grad_accum", "raise training.grad_accum to 6"),
    ({"training__pp_schedule": "interleaved_1f1b", "parallelism__pp_virtual_stages": 2,
      "training__global_batch_tokens": 5 * 2048 + 100}, "training.global_batch_tokens",
     f"raise training.global_batch_tokens to {6 * 2048}"),
])
def test_validate_refuses_what_the_pipeline_cannot_run_with_the_knob(changes, path, needle):
    with pytest.raises(ConfigError) as info:
        config_from_dict(_with(PP2, **changes))
    assert any(p == path and needle in why for p, why in info.value.problems), info.value.problems


def test_a_pipeline_config_validates_and_names_its_layout():
    cfg = config_from_dict(_with(PP2))
    assert cfg.dims.layout_name == "pp2"
    assert cfg.world_size == 2
