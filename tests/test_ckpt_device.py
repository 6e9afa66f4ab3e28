"""The device rule of a restore, checked without a GPU: every buffer the replica broadcast
concatenates sits on the live pieces' device. A checkpoint holding tensors the live state
lacks (an optimizer before its first step) gets new buffers for them; made on the host
beside CUDA pieces, `torch.cat` in the broadcast failed on every GPU job. The `meta` device
stands in for CUDA: a host buffer beside it is caught the same way."""

from __future__ import annotations

import checkpoint_workers as w
import fsspec
import pytest
import torch

from longrun.checkpoint import Checkpointer
from longrun.checkpoint.restore import _read_candidate, flat_on
from longrun.checkpoint.snapshot import map_tree
from longrun.trainer import Trainer

META = torch.device("meta")


def test_buffers_for_state_the_live_template_lacks_are_on_the_live_pieces_device(tmp_path):
    cfg = w.config(str(tmp_path / "ckpt"), training={"steps": 3})
    with Trainer(cfg, progress=False) as trainer:
        ckpt = Checkpointer(cfg)
        trainer.before_update.append(ckpt.before_update)
        trainer.train(on_step=ckpt.on_step(trainer))
        ckpt.close()
        state = trainer.state_dict()
    # The live state on the "accelerator", its optimizer without state yet.
    template = {k: map_tree(state[k], lambda _p, t: t.to(META)) if k in ("model", "optimizer") else v
                for k, v in state.items()}
    template["optimizer"]["state"] = {}
    fs, root = fsspec.core.url_to_fs(cfg.checkpoint_dir)
    found = _read_candidate(fs, root, 3, model=cfg.model.model_dump(mode="json"), template=template,
                            rank=0, world_size=1, reads_tensors=False)
    assert found.extra, "the checkpoint's optimizer state is what the template lacks"
    assert {w.buffer.device for w in found.wanted} == {META}
    # And so the broadcast's flat buffer builds (it is what fails on a mix).
    assert flat_on([w.buffer for w in found.wanted], META).device == META


def test_the_broadcast_buffer_takes_pieces_of_any_device():
    with pytest.raises(RuntimeError):  # what the broadcast did: one cat over two devices
        torch.cat([torch.zeros(2, device=META), torch.zeros(3)])
    flat = flat_on([torch.zeros(2, device=META), torch.zeros(3)], META)
    assert flat.device == META and flat.shape == (5,)
    assert torch.equal(flat_on([torch.ones(2, 2), torch.zeros(1)], torch.device("cpu")),
                       torch.tensor([1.0, 1, 1, 1, 0]))
