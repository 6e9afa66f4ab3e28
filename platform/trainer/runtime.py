"""The process-wide pieces a trainer sets up: its device, its seeds, the RNG state a
checkpoint carries, and the memory figure a step reports."""

from __future__ import annotations

import random
import resource
from typing import Any

import numpy as np
import torch


def resolve_device(setting: str, device: torch.device | str | None = None) -> torch.device:
    if device is not None:
        return torch.device(device)
    if setting == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if setting == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("cluster.device is 'cuda' but torch sees no GPU; use 'auto' or 'cpu'")
    return torch.device(setting)


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)  # CUDA generators too


def rng_state() -> dict[str, Any]:
    """Every generator's state as tensors and plain Python values only, so a checkpoint of
    it loads with `torch.load(weights_only=True)` (which refuses numpy arrays)."""
    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    state = {"python": random.getstate(),
             "numpy": (kind, torch.from_numpy(keys.astype(np.int64)), int(pos), int(has_gauss),
                       float(gauss)),
             "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        # This rank's device only: every GPU of the node is visible to every rank (Ray's masking
        # is off), and asking for all of them would start a CUDA context on each.
        state["cuda"] = [torch.cuda.get_rng_state(torch.cuda.current_device())]
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    kind, keys, pos, has_gauss, gauss = state["numpy"]
    np.random.set_state((kind, np.asarray(keys, dtype=np.int64).astype(np.uint32), pos, has_gauss,
                         gauss))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        # One state, this rank's device's (a rank saw only its own GPU before the masking went
        # off, so older checkpoints hold one too).
        torch.cuda.set_rng_state(state["cuda"][0], torch.cuda.current_device())


def peak_memory_bytes(device: torch.device) -> int:
    """Peak CUDA memory allocated (since the last reset), or the process's peak RSS on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB
