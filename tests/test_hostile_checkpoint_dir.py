"""A hostile or damaged checkpoint directory (issue 42, door 7), on a real checkpoint and a real
file tree: names in the manifest never lead out of their step directory, a symbolic link or a
FIFO where a shard, a manifest or `latest` belongs is refused instead of followed or waited on,
a tokenizer path the manifest records is read only if it is a regular file, shapes the manifest's
own sizes cannot hold are refused before anything is allocated, and a Hugging Face index's
weight_map names files of its own directory only. Every refusal is one sentence (no traceback)
and leaves nothing behind."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
from safetensors.torch import load_file

from longrun.checkpoint import Checkpointer
from longrun.config import config_from_dict
from longrun.interop.hf import HFError
from longrun.interop.hf_export import export_hf
from longrun.interop.hf_import import load_hf_weights
from longrun.trainer import Trainer

STEP = "step-00000004"
DATA_FILE = "__0_0.distcp"  # the model's and optimizer's tensors
NOT_REGULAR = "is a symbolic link, FIFO or device, not a regular file; put the file itself there"
DAMAGED = "the manifest was damaged or tampered with: restore it from a good copy, or use another step"

# Restores the newest usable checkpoint of the job config given as JSON, as a resuming job does.
RESTORE = """
import json, sys
import fsspec
from longrun.checkpoint import restore_latest
from longrun.config import config_from_dict
from longrun.trainer import Trainer
cfg = config_from_dict(json.loads(sys.argv[1]))
fs, root = fsspec.core.url_to_fs(cfg.checkpoint_dir)
with Trainer(cfg, progress=False) as trainer:
    restored = restore_latest(fs, root, model=cfg.model.model_dump(mode="json"), template=trainer.state_dict)
print(json.dumps({"step": restored.step, "skipped": restored.skipped}))
"""


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    """A tiny model trained 4 steps, checkpointed at steps 2 and 4."""
    out = tmp_path_factory.mktemp("ckpt")
    spec = {"job": {"name": "c", "seed": 1, "output_dir": str(out)},
            "model": {"dim": 64, "n_layers": 2, "n_heads": 4, "max_seq_len": 128},
            "data": {"micro_batch_tokens": 512, "prefetch": 2},
            "training": {"steps": 4, "warmup_steps": 1},
            "checkpoint": {"interval_steps": 2}}
    cfg = config_from_dict(spec)
    with Trainer(cfg, progress=False) as trainer:
        checkpointer = Checkpointer(cfg)
        trainer.before_update.append(checkpointer.before_update)
        trainer.train(on_step=checkpointer.on_step(trainer))
        checkpointer.close()
    return SimpleNamespace(cfg=cfg, spec=spec, root=cfg.checkpoint_dir)


def _copy(ckpt, tmp_path: Path) -> Path:
    """A copy of the checkpoint root the test may damage."""
    return Path(shutil.copytree(ckpt.root, tmp_path / "checkpoints"))


def _edit_manifest(step_dir: Path, edit) -> None:
    path = step_dir / "manifest.json"
    manifest = json.loads(path.read_text())
    edit(manifest)
    path.write_text(json.dumps(manifest))


def _longrun(*args, cwd: Path) -> subprocess.CompletedProcess:
    # A FIFO or /dev/zero read by the code before door 7 blocks or never ends: the timeout
    # turns that into a failure. COLUMNS: rich would wrap a long sentence at 80 columns.
    return subprocess.run([sys.executable, "-m", "longrun.cli", *map(str, args)], capture_output=True,
                          text=True, cwd=cwd, timeout=120, env={**os.environ, "COLUMNS": "1000"})


def _refused(done: subprocess.CompletedProcess, code: int, sentence: str) -> None:
    assert done.returncode == code, (done.stdout, done.stderr)
    assert sentence in done.stderr, done.stderr
    assert "Traceback" not in done.stderr


def _restore(ckpt, root: Path, cwd: Path) -> dict:
    spec = {**ckpt.spec, "checkpoint": {**ckpt.spec["checkpoint"], "dir": str(root)}}
    done = subprocess.run([sys.executable, "-c", RESTORE, json.dumps(spec)], capture_output=True,
                          text=True, cwd=cwd, timeout=120)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.splitlines()[-1])


def test_manifest_names_never_lead_out_of_the_step_directory(ckpt, tmp_path):
    root = _copy(ckpt, tmp_path)
    outside = tmp_path / "outside.distcp"  # the step's real tensors, moved out of the checkpoint
    (root / STEP / DATA_FILE).rename(outside)
    for name in ("../../outside.distcp", str(outside), "sub/__0_0.distcp"):
        _edit_manifest(root / STEP, lambda m, name=name: m["files"].update(
            {name: m["files"].pop(next(k for k in m["files"] if k.endswith(".distcp")))}))
        sentence = (f"{root / STEP / 'manifest.json'} names the file {name!r}, which is not a plain "
                    f"file name in {root / STEP}")
        out = tmp_path / "m.safetensors"
        _refused(_longrun("checkpoint", "export", root, "--out", out, cwd=tmp_path), 1, sentence)
        assert not list(tmp_path.glob("*m.safetensors*"))  # nothing written, not even a partial file
        _refused(_longrun("checkpoint", "inspect", root, "--verify", cwd=tmp_path), 1, sentence)
    assert _longrun("checkpoint", "export", root, "--out", out, "--step", "2", cwd=tmp_path).returncode == 0


def test_links_and_fifos_in_a_checkpoint_are_refused_not_followed(ckpt, tmp_path):
    root = _copy(ckpt, tmp_path)
    step = root / STEP
    (step / "rank-00000.pt").unlink()
    (step / "rank-00000.pt").symlink_to("/dev/zero")  # followed, its hash never ends
    (step / "train-state.pt").unlink()
    os.mkfifo(step / "train-state.pt")  # opened, it waits for a writer that never comes
    shutil.move(step / DATA_FILE, tmp_path / "elsewhere.distcp")
    (step / DATA_FILE).symlink_to(tmp_path / "elsewhere.distcp")  # the right bytes, behind a link

    verify = _longrun("checkpoint", "inspect", root, "--verify", "--json", cwd=tmp_path)
    assert verify.returncode == 1, verify.stderr
    checks = {c["name"]: c for c in json.loads(verify.stdout)["checks"]}
    assert {name: c["status"] for name, c in checks.items()} == {
        ".metadata": "OK", DATA_FILE: "CORRUPT", "rank-00000.pt": "CORRUPT", "train-state.pt": "CORRUPT"}
    assert checks["train-state.pt"]["detail"] == ("a symbolic link, FIFO or device, not a regular file: "
                                                  "put the shard itself there")
    assert NOT_REGULAR in json.loads(verify.stdout)["weights_error"]

    _refused(_longrun("checkpoint", "export", root, "--out", tmp_path / "m.pt", cwd=tmp_path), 1,
             f"{step / DATA_FILE} {NOT_REGULAR}")
    assert not list(tmp_path.glob("*m.pt*"))

    restored = _restore(ckpt, root, tmp_path)  # a resuming job falls back instead of hanging
    assert restored["step"] == 2
    assert restored["skipped"] == [[4, f"{step / 'train-state.pt'} {NOT_REGULAR} (longrun reads only "
                                        "regular files, never through a link)"]]

    (root / "latest").unlink()
    os.mkfifo(root / "latest")
    _refused(_longrun("checkpoint", "list", root, cwd=tmp_path), 1, f"{root / 'latest'} {NOT_REGULAR}")
    (root / STEP / "manifest.json").rename(tmp_path / "manifest.json")
    (root / STEP / "manifest.json").symlink_to(tmp_path / "manifest.json")
    (root / "latest").unlink()
    listing = _longrun("checkpoint", "list", root, "--json", cwd=tmp_path)
    assert listing.returncode == 0, listing.stderr
    error = json.loads(listing.stdout)["steps"][1]["error"]
    assert error.startswith(f"{step / 'manifest.json'} {NOT_REGULAR}")


def test_a_recorded_tokenizer_is_read_only_if_it_is_a_regular_file(ckpt, tmp_path):
    root = _copy(ckpt, tmp_path)
    fifo = tmp_path / "tokenizer.json"
    os.mkfifo(fifo)
    link = tmp_path / "tokenizer-link.json"
    link.symlink_to("/dev/zero")
    # The FIFO first: the code before door 7 blocks on it (a timeout) instead of reading /dev/zero
    # into memory until the host runs out.
    for spec in (fifo, "/dev/zero", link):
        record = {"spec": str(spec), "sha256": "0" * 64}
        _edit_manifest(root / STEP, lambda m, record=record: m.update(tokenizer=record))
        export = _longrun("checkpoint", "export", root, "--format", "hf", "--out", tmp_path / "hf",
                          cwd=tmp_path)
        _refused(export, 2, f"the checkpoint names the tokenizer {spec}, which is a symbolic link, FIFO "
                            "or device, not a regular file; pass --tokenizer PATH")
        assert sorted(os.listdir(tmp_path)) == ["checkpoints", "tokenizer-link.json", "tokenizer.json"]


def test_shapes_the_manifests_own_sizes_cannot_hold_are_refused_before_allocating(ckpt, tmp_path):
    root = _copy(ckpt, tmp_path)
    huge = [1 << 40, 64]  # 256 TiB of float32: allocating it fails or takes the host's memory

    def grow(manifest, claim_file: bool) -> None:
        info = manifest["files"][DATA_FILE]
        item = next(i for i in info["items"] if i["fqn"] == "model.tok_embeddings.weight")
        item["sizes"] = item["global_shape"] = huge
        if claim_file:  # the record moved to a file end as far out as the shape needs: consistent
            item["data"][1] = huge[0] * huge[1] * 4
            item["offset"], item["length"] = info["bytes"], item["data"][0] + item["data"][1]
            info["bytes"] = item["offset"] + item["length"]

    _edit_manifest(root / STEP, lambda m: grow(m, claim_file=False))
    sentence = (f"{root / STEP}: the record of model.tok_embeddings.weight in {DATA_FILE} is a "
                f"({huge[0]}, {huge[1]}) tensor of {huge[0] * huge[1] * 4} bytes, but says its data holds ")
    for command in (("export", "--out", tmp_path / "m.pt"), ("inspect",)):
        done = _longrun("checkpoint", command[0], root, *command[1:], cwd=tmp_path)
        assert done.returncode == 1, done.stderr
        assert sentence in done.stdout + done.stderr and DAMAGED in done.stdout + done.stderr
        assert "Traceback" not in done.stderr
    assert not list(tmp_path.glob("*m.pt*"))

    shutil.copy(Path(ckpt.root) / STEP / "manifest.json", root / STEP / "manifest.json")
    _edit_manifest(root / STEP, lambda m: grow(m, claim_file=True))
    _refused(_longrun("checkpoint", "export", root, "--out", tmp_path / "m.pt", cwd=tmp_path), 1,
             f"{root / STEP / DATA_FILE} is truncated (it ends at byte")
    assert not list(tmp_path.glob("*m.pt*"))


def test_an_hf_weight_map_names_files_of_its_own_directory_only(ckpt, tmp_path):
    hf_dir = tmp_path / "hf"
    export_hf(ckpt.root, str(hf_dir))
    model = ckpt.cfg.model
    names = list(load_file(hf_dir / "model.safetensors"))
    (hf_dir / "model.safetensors").rename(tmp_path / "outside.safetensors")
    index = hf_dir / "model.safetensors.index.json"
    for file in ("../outside.safetensors", str(tmp_path / "outside.safetensors")):
        index.write_text(json.dumps({"weight_map": dict.fromkeys(names, file)}))
        with pytest.raises(HFError) as refused:
            load_hf_weights(str(hf_dir), model)
        assert str(refused.value).startswith(f"{index} names the file {file!r}, which is not a plain file "
                                             f"name in {hf_dir}")

    os.mkfifo(hf_dir / "model-00001.safetensors")  # safetensors' open would wait for a writer
    index.write_text(json.dumps({"weight_map": dict.fromkeys(names, "model-00001.safetensors")}))
    with pytest.raises(HFError, match="is a FIFO, socket or device, not a regular file"):
        load_hf_weights(str(hf_dir), model)
    (hf_dir / "model-00001.safetensors").unlink()
    (hf_dir / "model-00001.safetensors").symlink_to(tmp_path / "outside.safetensors")  # a hub cache's way
    assert set(load_hf_weights(str(hf_dir), model)) >= {"tok_embeddings.weight", "norm.weight"}
