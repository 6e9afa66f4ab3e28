"""Hugging Face interop: `checkpoint export --format hf` loads in transformers with longrun's
logits, `model.init_from` starts a job from a local HF Llama with HF's logits. Every HF model
here is built locally (tiny, random); nothing is downloaded."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import yaml
from safetensors import safe_open
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

from longrun.checkpoint import Checkpointer
from longrun.config import config_from_dict
from longrun.config.sections import ModelSection
from longrun.interop.export import ExportError
from longrun.interop.hf import HFError, model_section_from_hf
from longrun.interop.hf_export import export_hf
from longrun.interop.hf_import import load_hf_weights
from longrun.trainer import Trainer, Transformer

TINY = {"vocab_size": 300, "dim": 64, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2,
        "ffn_dim": 128, "max_seq_len": 64, "rope_theta": 500000.0}
DOC_LENGTHS = (37, 64, 5, 20)  # several documents, one of the longest length


def _job(out: Path, model: dict, steps: int = 1) -> dict:
    return {
        "job": {"name": "hf", "seed": 3, "output_dir": str(out)},
        "model": model,
        "data": {"source": "synthetic", "micro_batch_tokens": 256, "prefetch": 1},
        "training": {"steps": steps, "warmup_steps": 0, "lr": 1e-2},
        "checkpoint": {"interval_steps": 1},
    }


def _documents(seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, TINY["vocab_size"], (n,), generator=g) for n in DOC_LENGTHS]


@torch.no_grad()
def _longrun_logits(model: Transformer, docs: list[torch.Tensor]) -> list[torch.Tensor]:
    """One packed forward over all documents, split back per document."""
    lengths = torch.tensor([len(d) for d in docs])
    cu = torch.cat([torch.zeros(1, dtype=torch.int32), lengths.cumsum(0).int()])
    positions = torch.cat([torch.arange(n) for n in lengths.tolist()])
    logits = model.eval()(torch.cat(docs), positions, cu)
    return list(logits.split(lengths.tolist()))


@torch.no_grad()
def _hf_logits(model, docs: list[torch.Tensor]) -> list[torch.Tensor]:
    """One HF forward per document (positions 0..n-1)."""
    return [model.eval()(d[None]).logits[0] for d in docs]


def _max_diff(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return max((x.float() - y.float()).abs().max().item() for x, y in zip(a, b, strict=True))


def _randomize_norms(model: torch.nn.Module) -> None:
    """Norm weights start at 1: give them values, so a swapped norm would show in the logits."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(1.0, 0.3)


@pytest.fixture(scope="module", params=[True, False], ids=["tied", "untied"])
def ckpt(request, tmp_path_factory):
    """A GQA model trained one step and checkpointed: (config, root, its weights)."""
    out = tmp_path_factory.mktemp("ckpt")
    cfg = config_from_dict(_job(out, TINY | {"tie_embeddings": request.param}))
    with Trainer(cfg, progress=False) as t:
        _randomize_norms(t.model)
        ck = Checkpointer(cfg)
        t.before_update.append(ck.before_update)
        t.train(on_step=[ck.on_step(t)])
        ck.close()
        weights = {k: v.detach().clone() for k, v in t.model.state_dict().items()}
    model = Transformer(cfg.model)
    model.load_state_dict(weights)
    return SimpleNamespace(cfg=cfg, root=cfg.checkpoint_dir, model=model, out=out)


def _hf_model(tmp_path: Path, *, tie: bool, sharded: bool = False,
              **overrides) -> tuple[Path, LlamaForCausalLM]:
    """A tiny randomly initialised HF Llama saved with save_pretrained."""
    torch.manual_seed(7)
    config = LlamaConfig(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                         rms_norm_eps=1e-5, rope_theta=500000.0, tie_word_embeddings=tie,
                         bos_token_id=0, eos_token_id=1, pad_token_id=2, **overrides)
    model = LlamaForCausalLM(config)
    _randomize_norms(model)
    path = tmp_path / ("hf-sharded" if sharded else "hf")
    model.save_pretrained(path, **({"max_shard_size": "100KB"} if sharded else {}))
    return path, model


# -- export ----------------------------------------------------------------------------------


def test_export_loads_in_transformers_with_longruns_logits(ckpt, cli, tmp_path):
    out_dir = tmp_path / "export"
    code, out, err = cli("checkpoint", "export", ckpt.root, "--format", "hf", "--out", out_dir)
    assert code == 0, err
    assert f"wrote {out_dir} (hf, " in out and "step-00000001" in out

    config = json.loads((out_dir / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and config["model_type"] == "llama"
    assert (config["num_key_value_heads"], config["head_dim"]) == (2, 16)
    assert config["tie_word_embeddings"] is ckpt.cfg.model.tie_embeddings
    with safe_open(out_dir / "model.safetensors", "pt") as f:
        assert f.metadata()["format"] == "pt"
        # HF leaves a tied lm_head out of the file and ties it on loading.
        assert ("lm_head.weight" in set(f.keys())) is not ckpt.cfg.model.tie_embeddings
    assert (out_dir / "generation_config.json").is_file()
    assert not [p for p in tmp_path.iterdir() if "partial" in p.name]

    hf = AutoModelForCausalLM.from_pretrained(out_dir)
    assert isinstance(hf, LlamaForCausalLM)
    docs = _documents()
    ours, theirs = _longrun_logits(ckpt.model, docs), _hf_logits(hf, docs)
    assert _max_diff(ours, theirs) < 1e-4
    assert ours[0].abs().max() > 1e-2  # the comparison is not between two near-zero outputs


def test_export_round_trips_through_init_from(ckpt, tmp_path):
    out_dir = tmp_path / "export"
    result = export_hf(ckpt.root, str(out_dir))
    assert result.format == "hf" and result.step == 1
    assert result.parameters == ckpt.model.num_params()
    state = load_hf_weights(str(out_dir), ckpt.cfg.model)
    for name, value in ckpt.model.state_dict().items():
        assert torch.equal(state[name], value), name
    # A job starting from the export computes what the checkpoint computed.
    cfg = config_from_dict(_job(tmp_path / "runs", model_section_from_hf(str(out_dir))))
    with Trainer(cfg, progress=False) as t:
        assert _max_diff(_longrun_logits(t.model, _documents(1)),
                         _longrun_logits(ckpt.model, _documents(1))) == 0.0


def test_export_refuses_a_nonempty_directory_and_replaces_an_export_with_force(ckpt, cli, tmp_path):
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("keep me")
    code, _, err = cli("checkpoint", "export", ckpt.root, "--format", "hf", "--out", mine)
    assert code == 2 and "not empty" in err and "Traceback" not in err
    code, _, err = cli("checkpoint", "export", ckpt.root, "--format", "hf", "--out", mine, "--force")
    assert code == 2 and "not an earlier export" in err
    assert (mine / "notes.txt").read_text() == "keep me"

    again = tmp_path / "again"
    assert cli("checkpoint", "export", ckpt.root, "--format", "hf", "--out", again)[0] == 0
    (again / "stale.txt").write_text("from before")
    assert cli("checkpoint", "export", ckpt.root, "--format", "hf", "--out", again, "--force")[0] == 0
    assert sorted(p.name for p in again.iterdir()) == [
        "config.json", "generation_config.json", "model.safetensors"]


def test_export_takes_the_tokenizer_the_checkpoint_records(ckpt, cli, tmp_path):
    # The job trained with the byte tokenizer; its manifest says so, and the export needs no flag.
    out_dir = tmp_path / "export"
    code, _, err = cli("checkpoint", "export", ckpt.root, "--format", "hf", "--out", out_dir)
    assert code == 0, err
    config = json.loads((out_dir / "config.json").read_text())
    from longrun.data.byte_tokenizer import ByteTokenizer

    assert (config["bos_token_id"], config["eos_token_id"], config["pad_token_id"]) == (
        ByteTokenizer.BOS, ByteTokenizer.EOS, ByteTokenizer.PAD)
    assert json.loads((out_dir / "generation_config.json").read_text())["eos_token_id"] == ByteTokenizer.EOS


def test_export_writes_a_bpe_tokenizer_that_autotokenizer_reads(ckpt, tmp_path):
    from longrun.data import tokenizers
    text = tmp_path / "corpus.txt"
    text.write_text("the quick brown fox jumps over the lazy dog\n" * 50 + "pack my box with jugs\n" * 30)
    tok = tokenizers.train_bpe([str(text)], 280, str(tmp_path / "tok"), progress=False)
    out_dir = tmp_path / "export"
    export_hf(ckpt.root, str(out_dir), tokenizer=str(tmp_path / "tok"))
    config = json.loads((out_dir / "config.json").read_text())
    assert (config["bos_token_id"], config["eos_token_id"]) == (tok.BOS, tok.EOS)
    hf_tok = AutoTokenizer.from_pretrained(out_dir)
    sample = "the lazy fox packs a box"
    assert hf_tok(sample, add_special_tokens=False)["input_ids"] == tok.encode(sample)
    assert hf_tok(sample)["input_ids"] == tok.encode(sample, bos=True)  # as training saw documents


def test_export_ships_the_recorded_bpe_tokenizer_and_refuses_a_changed_one(ckpt, tmp_path):
    import shutil

    from longrun.data import tokenizers

    text = tmp_path / "corpus.txt"
    text.write_text("the quick brown fox jumps over the lazy dog\n" * 50)
    tok = tokenizers.train_bpe([str(text)], 280, str(tmp_path / "tok"), progress=False)
    # The checkpoint of a job trained with this tokenizer (its manifest records path and hash).
    root = tmp_path / "ckpt"
    shutil.copytree(ckpt.root, root)
    for manifest in root.glob("step-*/manifest.json"):
        record = json.loads(manifest.read_text())
        record["tokenizer"] = {"spec": tok.path, "sha256": tok.sha256}
        manifest.write_text(json.dumps(record))
    out_dir = tmp_path / "export"
    export_hf(str(root), str(out_dir))  # no --tokenizer: the recorded one
    assert (out_dir / "tokenizer.json").read_bytes() == Path(tok.path).read_bytes()
    assert json.loads((out_dir / "config.json").read_text())["bos_token_id"] == tok.BOS
    # Retrained in place since: not the tokenizer the model learned, so not shipped silently.
    tokenizers.train_bpe([str(text)], 300, str(tmp_path / "tok"), progress=False, overwrite=True)
    with pytest.raises(ExportError, match="changed since the checkpoint was trained with it"):
        export_hf(str(root), str(tmp_path / "again"))


# -- import ----------------------------------------------------------------------------------


@pytest.mark.parametrize("tie", [True, False], ids=["tied", "untied"])
def test_init_from_starts_a_trainer_with_hfs_logits(tie, tmp_path):
    hf_dir, hf = _hf_model(tmp_path, tie=tie)
    section = model_section_from_hf(str(hf_dir))
    assert section["init_from"] == str(hf_dir) and section["tie_embeddings"] is tie
    cfg = config_from_dict(_job(tmp_path / "runs", section))
    with Trainer(cfg, progress=False) as t:
        docs = _documents(2)
        assert _max_diff(_longrun_logits(t.model, docs), _hf_logits(hf, docs)) < 1e-4
        if tie:
            assert t.model.output.weight is t.model.tok_embeddings.weight


def test_sharded_safetensors_load_like_a_single_file(tmp_path):
    single, _ = _hf_model(tmp_path, tie=False)
    sharded, _ = _hf_model(tmp_path, tie=False, sharded=True)
    assert (sharded / "model.safetensors.index.json").is_file()
    assert len(list(sharded.glob("*.safetensors"))) > 1
    model = ModelSection(**model_section_from_hf(str(single)))
    a, b = load_hf_weights(str(single), model), load_hf_weights(str(sharded), model)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_a_config_mismatch_names_both_sides(tmp_path):
    hf_dir, _ = _hf_model(tmp_path, tie=False)
    job = ModelSection(**(model_section_from_hf(str(hf_dir)) | {"dim": 128, "n_layers": 3}))
    with pytest.raises(HFError) as exc:
        load_hf_weights(str(hf_dir), job)
    message = str(exc.value)
    assert f"hidden_size 64 in {hf_dir}/config.json, model.dim 128 in the job" in message
    assert "num_hidden_layers 2 in" in message and "model.n_layers 3 in the job" in message


def test_a_tensor_shape_or_name_mismatch_is_named(tmp_path):
    hf_dir, _ = _hf_model(tmp_path, tie=False)
    config_path = hf_dir / "config.json"
    config = json.loads(config_path.read_text())
    # The config claims a wider MLP than the tensors hold.
    config_path.write_text(json.dumps(config | {"intermediate_size": 192}))
    job = ModelSection(**model_section_from_hf(str(hf_dir)))
    with pytest.raises(HFError, match=r"model\.layers\.0\.mlp\.gate_proj\.weight is \[128, 64\], "
                                      r"the job's model needs \[192, 64\]"):
        load_hf_weights(str(hf_dir), job)
    # An untied config over a checkpoint saved tied: the output matrix is missing.
    tied_dir, _ = _hf_model(tmp_path / "tied", tie=True)
    config_path = tied_dir / "config.json"
    config_path.write_text(json.dumps(json.loads(config_path.read_text()) | {"tie_word_embeddings": False}))
    with pytest.raises(HFError, match=r"missing lm_head\.weight"):
        load_hf_weights(str(tied_dir), ModelSection(**model_section_from_hf(str(tied_dir))))


def test_what_longruns_decoder_cannot_compute_is_refused(tmp_path):
    hf_dir, _ = _hf_model(tmp_path, tie=False, attention_bias=True)
    with pytest.raises(HFError, match="attention_bias true"):
        model_section_from_hf(str(hf_dir))
    with pytest.raises(HFError, match=r"has no config\.json"):
        model_section_from_hf(str(tmp_path))


def test_config_validate_names_an_init_from_mismatch_without_a_traceback(cli, tmp_path):
    hf_dir, _ = _hf_model(tmp_path, tie=False)
    job = tmp_path / "job.yaml"
    section = model_section_from_hf(str(hf_dir)) | {"vocab_size": 512}
    job.write_text(yaml.safe_dump(_job(tmp_path / "runs", section)))
    code, _, err = cli("config", "validate", job)
    assert code == 2 and "Traceback" not in err
    assert "model.init_from" in err and "vocab_size 300 in" in err and "model.vocab_size 512" in err
    job.write_text(yaml.safe_dump(_job(tmp_path / "runs", model_section_from_hf(str(hf_dir)))))
    code, _, err = cli("config", "validate", job)
    assert code == 0, err


def test_a_resumed_job_keeps_its_checkpoint_not_init_from(tmp_path):
    """A restore replaces the init_from weights: resuming never goes back to the HF model."""
    hf_dir, _ = _hf_model(tmp_path, tie=False)
    cfg = config_from_dict(_job(tmp_path / "runs", model_section_from_hf(str(hf_dir)), steps=2))
    with Trainer(cfg, progress=False) as t:
        ck = Checkpointer(cfg)
        t.before_update.append(ck.before_update)
        t.train(on_step=[ck.on_step(t)])
        ck.close()
        trained = {k: v.detach().clone() for k, v in t.model.state_dict().items()}
    with Trainer(cfg, progress=False) as t:
        assert not torch.equal(t.model.norm.weight, trained["norm.weight"])  # fresh from HF
        ck = Checkpointer(cfg)
        assert ck.restore(t).step == 2
        ck.close()
        for name, value in t.model.state_dict().items():
            assert torch.equal(value, trained[name]), name


def test_a_worker_that_restores_does_not_read_init_from(tmp_path, monkeypatch):
    """A restarted worker restores before it sets any weights, and a restore leaves nothing to
    set: a moved or deleted HF directory cannot fail a restart, no restart pays for reading it,
    and the initialiser never runs. A fresh start reads it (and would fail without it)."""
    import shutil

    from longrun.interop import hf_import
    from longrun.worker.setup import InitFromSkipped, build_trainer, has_committed_checkpoint, start_weights

    hf_dir, _ = _hf_model(tmp_path, tie=False)
    cfg = config_from_dict(_job(tmp_path / "runs", model_section_from_hf(str(hf_dir)), steps=2))
    assert not has_committed_checkpoint(cfg)
    with Trainer(cfg, progress=False) as t:
        ck = Checkpointer(cfg)
        t.before_update.append(ck.before_update)
        t.train(on_step=[ck.on_step(t)])
        ck.close()
    assert has_committed_checkpoint(cfg)
    shutil.rmtree(hf_dir)
    reads = []
    monkeypatch.setattr(hf_import, "load_hf_pieces", lambda *a, **k: reads.append(a) or 0)
    trainer, _ = build_trainer(cfg, None, torch.device("cpu"))
    with trainer:
        assert not trainer.initialised
        step = Checkpointer(cfg).restore(trainer).step
        start_weights(trainer, step, checkpoints_expected=True)
        assert step == 2 and not trainer.initialised and reads == []
    # Committed checkpoints that none could restore: going on from init_from is refused.
    trainer, _ = build_trainer(cfg, None, torch.device("cpu"))
    with trainer, pytest.raises(InitFromSkipped, match="none of them could be restored"):
        start_weights(trainer, 0, checkpoints_expected=True)
    monkeypatch.undo()
    trainer, _ = build_trainer(cfg, None, torch.device("cpu"))
    with trainer, pytest.raises(HFError):  # what a fresh start would have hit reading it
        start_weights(trainer, 0, checkpoints_expected=False)


def test_init_from_is_not_part_of_the_shape_a_checkpoint_must_match():
    from longrun.checkpoint.manifest import Manifest

    model = ModelSection(**TINY).model_dump(mode="json")
    older = {k: v for k, v in model.items() if k != "init_from"}  # before the field existed
    manifest = Manifest(step=1, world_size=1, dp_size=1, model=older, config_fingerprint="x")
    assert manifest.incompatibility(model | {"init_from": "/models/llama"}) is None
    assert "dim: checkpoint 64 vs job 128" in manifest.incompatibility(model | {"dim": 128})
