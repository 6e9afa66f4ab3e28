"""The structure of a checkpoint's model and optimizer state when pipeline stages wrote it.

Rank 0 writes the structure (`skeleton`: every tensor a placeholder, every plain value kept,
such as the optimizer's learning rate) of what it holds into `train-state.pt`. Without
pipeline parallelism every rank holds every name, so that is the whole structure. With it,
rank 0 holds the first stage only: the first rank of every later stage writes its stage's
structure too (`stage_state_name`), and a restore merges them and keeps what the restoring
rank holds at its own layout, whatever pp degree wrote them:

    files.update(structure_files(state, rank=r, stage=s, leads_stage=True))   # on save
    structure = merged_structure(train_state, [stage files' contents])          # on restore
    structure = held_structure(structure, live)                                 # this rank's

The optimizer's state is keyed by parameter name (torch's `get_state_dict`), and it has the
same parameter groups on every stage (AdamW with and without weight decay, `optim.py`): the
groups merge by position, their names concatenated in stage order.
"""

from __future__ import annotations

from typing import Any

from longrun.checkpoint.dcp_format import DCP_KEYS, skeleton
from longrun.checkpoint.manifest import GLOBAL_KEYS, STAGE_STATE_PREFIX, TRAIN_STATE, stage_state_name


def structure_files(state: dict[str, Any], *, rank: int, stage: int, leads_stage: bool) -> dict[str, Any]:
    """{file name: content} of the structure this rank writes: rank 0 the global state and its
    structure; the first rank of each later pipeline stage its stage's structure."""
    structure = {k: skeleton(state[k]) for k in DCP_KEYS}
    if rank == 0:
        return {TRAIN_STATE: {k: state[k] for k in GLOBAL_KEYS} | structure}
    if leads_stage and stage > 0:
        return {stage_state_name(stage): structure}
    return {}


def stage_files(names: list[str]) -> list[str]:
    """The stage structure files among a checkpoint's files, in stage order."""
    return sorted(n for n in names if n.startswith(STAGE_STATE_PREFIX))


def merged_structure(train_state: dict[str, Any], stages: list[dict[str, Any]]) -> dict[str, Any]:
    """`train_state` with its model and optimizer structure extended by the later stages'."""
    if not stages:
        return train_state
    merged = dict(train_state)
    merged["model"] = {**train_state["model"]}
    optimizer = train_state["optimizer"]
    merged["optimizer"] = {**optimizer, "state": dict(optimizer.get("state", {})),
                           "param_groups": [dict(g, params=list(g["params"]))
                                            for g in optimizer.get("param_groups", [])]}
    for stage in stages:
        merged["model"].update(stage["model"])
        merged["optimizer"]["state"].update(stage["optimizer"].get("state", {}))
        groups = stage["optimizer"].get("param_groups", [])
        if len(groups) != len(merged["optimizer"]["param_groups"]):
            raise ValueError(f"a stage's optimizer has {len(groups)} parameter groups, the first stage's "
                             f"{len(merged['optimizer']['param_groups'])}")
        for into, group in zip(merged["optimizer"]["param_groups"], groups, strict=True):
            into["params"].extend(group["params"])
    return merged


def held_structure(structure: dict[str, Any], live: dict[str, Any]) -> dict[str, Any]:
    """`structure` kept to the parameters this rank holds (the names of its live model state):
    under pipeline parallelism a rank restores its own stages' part of the whole."""
    held = set(live["model"])
    if set(structure["model"]) <= held:
        return structure
    out = dict(structure)
    out["model"] = {k: v for k, v in structure["model"].items() if k in held}
    optimizer = structure["optimizer"]
    out["optimizer"] = {**optimizer,
                        "state": {k: v for k, v in optimizer.get("state", {}).items() if k in held},
                        "param_groups": [dict(g, params=[p for p in g["params"] if p in held])
                                         for g in optimizer.get("param_groups", [])]}
    return out
