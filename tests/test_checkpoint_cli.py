"""`longrun checkpoint list|inspect|export` on a real checkpoint written by the Checkpointer."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from types import SimpleNamespace

import fsspec
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load, load_file, save_file

from longrun.checkpoint import Checkpointer
from longrun.checkpoint.catalog import summarize_weights
from longrun.cli import main
from longrun.config import config_from_dict
from longrun.interop.weights_file import unshare
from longrun.trainer import Trainer, Transformer


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    """A tiny model trained 4 steps, checkpointed at steps 2 and 4; the weights after each."""
    out = tmp_path_factory.mktemp("ckpt")
    cfg = config_from_dict({
        "job": {"name": "c", "seed": 1, "output_dir": str(out)},
        "model": {"dim": 64, "n_layers": 2, "n_heads": 4, "max_seq_len": 128},
        "data": {"micro_batch_tokens": 512, "prefetch": 2},
        "training": {"steps": 4, "warmup_steps": 1},
        "checkpoint": {"interval_steps": 2},
    })
    weights = {}
    with Trainer(cfg, progress=False) as t:
        ck = Checkpointer(cfg)
        t.before_update.append(ck.before_update)

        def record(metrics):
            weights[metrics.step] = {k: v.detach().clone() for k, v in t.model.state_dict().items()}

        t.train(on_step=[ck.on_step(t), record])
        ck.close()
    return SimpleNamespace(cfg=cfg, root=cfg.checkpoint_dir, weights=weights, out=out)


def _copy(ckpt, tmp_path) -> Path:
    """A copy of the checkpoint root the test may damage."""
    return Path(shutil.copytree(ckpt.root, tmp_path / "checkpoints"))


def test_help_lists_the_checkpoint_actions(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["checkpoint", "--help"])
    assert exit_.value.code == 0
    help_text = capsys.readouterr().out
    for action in ("list", "inspect", "export"):
        assert action in help_text


def test_list_shows_both_steps_and_marks_latest(ckpt, cli):
    code, out, err = cli("checkpoint", "list", ckpt.root)
    assert code == 0, err
    rows = {line.split("│")[1].strip(): line for line in out.splitlines() if line.count("│") > 2}
    assert set(rows) == {"2", "4"}
    assert "<- latest" in rows["4"] and "<- latest" not in rows["2"]
    assert "1/1" in rows["4"] and "MiB" in rows["4"]

    code, out, _ = cli("checkpoint", "list", ckpt.root, "--json")
    assert code == 0
    listing = json.loads(out)
    assert [s["step"] for s in listing["steps"]] == [2, 4]
    assert [s["latest"] for s in listing["steps"]] == [False, True]
    assert listing["latest"] == 4 and listing["pending"] == []
    step4 = listing["steps"][1]
    assert step4["shards"] == 4 and (step4["world_size"], step4["dp_size"]) == (1, 1)
    files = [p for p in Path(step4["path"]).iterdir() if p.name != "manifest.json"]
    assert step4["total_bytes"] == sum(p.stat().st_size for p in files)


def test_list_reports_a_save_in_progress(ckpt, cli, tmp_path):
    root = _copy(ckpt, tmp_path)
    (root / "step-00000006.tmp").mkdir()
    (root / "step-00000006.tmp" / "rank-00000.pt").write_bytes(b"x" * 100)
    code, out, _ = cli("checkpoint", "list", root)
    assert code == 0
    assert "in progress or abandoned" in out and "step-00000006.tmp (1 files, 100 B" in out
    listing = json.loads(cli("checkpoint", "list", root, "--json")[1])
    assert listing["pending"] == [{"step": 6, "path": str(root / "step-00000006.tmp"),
                                   "files": 1, "total_bytes": 100}]


def test_list_on_an_empty_or_missing_dir_exits_2(cli, tmp_path):
    (tmp_path / "empty").mkdir()
    code, out, err = cli("checkpoint", "list", tmp_path / "empty")
    assert code == 2 and out == ""
    assert f"no checkpoints under {tmp_path / 'empty'}" in err and "step-NNNNNNNN/" in err
    code, _, err = cli("checkpoint", "list", tmp_path / "nope")
    assert code == 2 and f"no such checkpoint directory: {tmp_path / 'nope'}" in err


def test_list_points_from_the_run_dir_to_its_checkpoints(ckpt, cli):
    code, _, err = cli("checkpoint", "list", ckpt.cfg.run_dir)
    assert code == 2 and f"the checkpoints seem to be in {ckpt.root}" in err


def test_config_gives_the_checkpoint_root(ckpt, cli, tmp_path):
    job = tmp_path / "job.yaml"
    job.write_text(ckpt.cfg.to_yaml())
    code, out, _ = cli("checkpoint", "list", "--config", job, "--json")
    assert code == 0 and [s["step"] for s in json.loads(out)["steps"]] == [2, 4]
    with pytest.raises(SystemExit) as exit_:  # not both
        cli("checkpoint", "list", ckpt.root, "--config", job)
    assert exit_.value.code == 2


def test_inspect_shows_manifest_model_and_parameter_count(ckpt, cli):
    expected = f"{Transformer(ckpt.cfg.model).num_params():,}"
    code, out, err = cli("checkpoint", "inspect", ckpt.root)
    assert code == 0, err
    assert "step-00000004 (latest)" in out and ckpt.cfg.fingerprint() in out
    assert f"parameters: {expected} (" in out
    assert "tied: tok_embeddings.weight = output.weight" in out
    assert "n_layers" in out and "verify" not in out

    code, out, _ = cli("checkpoint", "inspect", ckpt.root, "--step", "2", "--json")
    assert code == 0
    shown = json.loads(out)
    assert shown["step"] == 2 and not shown["latest"]
    assert shown["manifest"]["model"] == ckpt.cfg.model.model_dump(mode="json")
    assert shown["weights"]["parameters"] == Transformer(ckpt.cfg.model).num_params()

    code, _, err = cli("checkpoint", "inspect", ckpt.root, "--step", "3")
    assert code == 2 and "committed steps: 2, 4" in err


def test_inspect_verify_passes_on_a_whole_checkpoint(ckpt, cli):
    code, out, _ = cli("checkpoint", "inspect", ckpt.root, "--verify")
    assert code == 0
    assert "all 4 shards OK" in out and "CORRUPT" not in out


def test_inspect_verify_reports_a_flipped_byte(ckpt, cli, tmp_path):
    root = _copy(ckpt, tmp_path)
    shard = root / "step-00000004" / "__0_0.distcp"  # the model's and optimizer's tensors
    data = bytearray(shard.read_bytes())
    data[100] ^= 0x01  # in the first record: a weight
    shard.write_bytes(bytes(data))
    code, out, _ = cli("checkpoint", "inspect", root, "--verify")
    assert code == 1
    rows = {line.split("│")[1].strip(): line for line in out.splitlines() if line.count("│") > 2}
    assert "CORRUPT" in rows["__0_0.distcp"] and "checksum differs" in rows["__0_0.distcp"]
    assert "OK" in rows["rank-00000.pt"]
    assert "weights unreadable" in out  # the parameter count needs a verified shard

    checks = json.loads(cli("checkpoint", "inspect", root, "--verify", "--json")[1])["checks"]
    assert {c["name"]: c["status"] for c in checks} == {"__0_0.distcp": "CORRUPT", ".metadata": "OK",
                                                         "train-state.pt": "OK", "rank-00000.pt": "OK"}
    # The export refuses it too (the shard is verified on the way), and writes nothing.
    code, _, err = cli("checkpoint", "export", root, "--out", tmp_path / "m.safetensors")
    assert code == 1 and "does not match its checksum" in err
    assert not list(tmp_path.glob("m.safetensors*"))
    # An older step is still fine.
    assert cli("checkpoint", "inspect", root, "--step", "2", "--verify")[0] == 0


def test_export_safetensors_loads_into_a_fresh_model(ckpt, cli, tmp_path):
    out_file = tmp_path / "out" / "model.safetensors"
    code, out, err = cli("checkpoint", "export", ckpt.root, "--out", out_file)
    assert code == 0, err
    assert f"wrote {out_file} (safetensors, " in out and "step-00000004" in out
    model = Transformer(ckpt.cfg.model)
    model.load_state_dict(load_file(out_file), strict=True)
    assert model.output.weight is model.tok_embeddings.weight  # still tied after loading
    for name, value in model.state_dict().items():
        assert torch.equal(value, ckpt.weights[4][name]), name
    with safe_open(out_file, "pt") as f:
        meta = f.metadata()
    assert meta["step"] == "4" and meta["format"] == "pt"
    assert json.loads(meta["model_config"]) == ckpt.cfg.model.model_dump(mode="json")
    assert meta["config_fingerprint"] == ckpt.cfg.fingerprint()
    assert not list(out_file.parent.glob("*.partial"))


def test_export_torch_loads_with_weights_only(ckpt, cli, tmp_path):
    out_file = tmp_path / "model.pt"
    code, out, err = cli("checkpoint", "export", ckpt.root, "--out", out_file, "--step", "2")
    assert code == 0, err
    assert "(torch, " in out and "step-00000002" in out
    state = torch.load(out_file, weights_only=True)
    assert set(state) == set(ckpt.weights[2])
    for name, value in state.items():
        assert torch.equal(value, ckpt.weights[2][name]), name
    assert not all(torch.equal(state[k], ckpt.weights[4][k]) for k in state)  # step 2, not 4
    Transformer(ckpt.cfg.model).load_state_dict(state, strict=True)

    # --format overrides the extension.
    odd = tmp_path / "weights.bin"
    assert cli("checkpoint", "export", ckpt.root, "--out", odd, "--format", "safetensors")[0] == 0
    assert set(load_file(odd)) == set(state)


def test_export_refuses_to_replace_a_file_or_guess_a_format(ckpt, cli, tmp_path):
    existing = tmp_path / "model.pt"
    existing.write_bytes(b"keep me")
    code, _, err = cli("checkpoint", "export", ckpt.root, "--out", existing)
    assert code == 2 and "exists; pass --force" in err
    assert existing.read_bytes() == b"keep me"
    assert cli("checkpoint", "export", ckpt.root, "--out", existing, "--force")[0] == 0
    assert set(torch.load(existing, weights_only=True)) == set(ckpt.weights[4])
    code, _, err = cli("checkpoint", "export", ckpt.root, "--out", tmp_path / "model.npz")
    assert code == 2 and "--format safetensors|torch" in err


def test_list_and_export_on_an_fsspec_url(ckpt, cli):
    mem = fsspec.filesystem("memory")
    root = f"/ckpt-{id(ckpt)}"
    try:
        mem.put(ckpt.root, root, recursive=True)
        url = f"memory://{root}"
        code, out, _ = cli("checkpoint", "list", url, "--json")
        assert code == 0 and [s["step"] for s in json.loads(out)["steps"]] == [2, 4]
        assert cli("checkpoint", "inspect", url, "--verify")[0] == 0
        code, _, err = cli("checkpoint", "export", url, "--out", f"memory://{root}-out/m.safetensors")
        assert code == 0, err
        state = load(mem.cat_file(f"{root}-out/m.safetensors"))
        Transformer(ckpt.cfg.model).load_state_dict(state, strict=True)
        assert torch.equal(state["norm.weight"], ckpt.weights[4]["norm.weight"])
    finally:
        for path in (root, f"{root}-out"):
            if mem.exists(path):
                mem.rm(path, recursive=True)


def test_tied_weights_that_share_memory_export_and_count_once(ckpt, tmp_path):
    """A state_dict straight from a tied model (no staging copy) shares the matrix."""
    model = Transformer(ckpt.cfg.model)
    state = model.state_dict()
    assert state["output.weight"].data_ptr() == state["tok_embeddings.weight"].data_ptr()
    with pytest.raises(RuntimeError):
        save_file(state, tmp_path / "plain.safetensors")  # what unshare() is for
    save_file(unshare(state), tmp_path / "m.safetensors")
    fresh = Transformer(ckpt.cfg.model)
    fresh.load_state_dict(load_file(tmp_path / "m.safetensors"), strict=True)
    assert torch.equal(fresh.output.weight, model.output.weight)
    summary = summarize_weights(state, ckpt.cfg.model.model_dump(mode="json"))
    assert summary.parameters == model.num_params()
    assert summary.tensors == len(state)
