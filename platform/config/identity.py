"""What makes a job the same job to its checkpoints (issue 42, door 8).

A checkpoint holds weights, a step and a position in the data's order. Resumed by a job with
other data, another tokenizer or other optimizer settings (a reused job name, a shared
checkpoint directory), they would carry on under that job's settings, silently. So every
manifest records the job's identity (`job_identity`; the tokenizer has its own record,
`vocabulary.tokenizer_record`), and before any worker is placed the controller compares the
newest checkpoint's with the job's (`controller/precheck.py`): each difference is refused in
one sentence, unless `checkpoint.accept_changes` names its key or its group.

The groups, each key a config path:
- data: `job.seed` (it orders the documents), `data.source` and what that source reads
  (`data.path`, `data.mix`; `data.include` for text, `data.synthetic` for synthetic), and
  `validation.held_out` when set (the documents it holds out are never trained on);
- tokenizer: `data.tokenizer`, compared by the tokenizer file's sha256 (or the one the shards
  record), so a tokenizer retrained in place is caught too;
- training: the global batch (`training.global_batch_tokens` as the job would draw it, set or
  following the layout) and the optimizer's settings: lr, min_lr_ratio, warmup_steps,
  lr_schedule, decay_steps, decay_fraction, weight_decay, betas, grad_clip, dtype. The schedule
  is part of it: the checkpoint's moments and step were reached under it, and lowering the
  learning rate after an instability is a deliberate act, one `accept_changes` entry away.

Left out, because resuming legitimately changes them: `training.steps` (extending or shortening
a run: the schedule's horizon follows it), the layout (cluster, parallelism, grad_accum,
micro-batch budget: a checkpoint reshards to any; what the layout changes of the batch is
compared as the global batch), the rest of `validation` (when and how much it evaluates, or its
own data: none of it changes what trains), and checkpoint, health, recovery, observability, compile,
activation checkpointing, prefetch and logging settings. The model's shape is compared on its
own (`Manifest.incompatibility`) and cannot be accepted: the weights would not fit.

An accepted change takes effect: after a restore the optimizer's learning rate, betas and weight
decay are the config's (`trainer/optim.py`), and accepted data, seed or tokenizer changes start
the new data's order from its beginning (`checkpoint/checkpointer.py`); the weights, the
optimizer's moments and the step go on.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from longrun.config.job import JobConfig

TOKENIZER_KEY = "data.tokenizer"
GROUPS: dict[str, tuple[str, ...]] = {
    "data": ("job.seed", "data.source", "data.path", "data.mix", "data.include", "data.synthetic",
             "validation.held_out"),
    "tokenizer": (TOKENIZER_KEY,),
    "training": ("training.global_batch_tokens", "training.lr", "training.min_lr_ratio",
                 "training.warmup_steps", "training.lr_schedule", "training.decay_steps",
                 "training.decay_fraction", "training.weight_decay", "training.betas",
                 "training.grad_clip", "training.dtype"),
}
GROUP_OF = {key: group for group, keys in GROUPS.items() for key in keys}
# What checkpoint.accept_changes may name: a group, or one key of one.
ACCEPTABLE = (*GROUPS, *GROUP_OF)
# The data keys each source reads (the rest of data.* is not used by it).
_SOURCE_READS = {"text": ("data.path", "data.include"), "synthetic": ("data.synthetic",),
                 "tokens": ("data.path", "data.mix")}
_NOT_RECORDED = object()


def job_identity(cfg: JobConfig) -> dict[str, Any]:
    """The job's data and training settings as a manifest records them: {dotted key: JSON value}
    (the tokenizer is recorded on its own, `vocabulary.tokenizer_record`)."""
    dumped = cfg.model_dump(mode="json")
    reads = _SOURCE_READS[cfg.data.source]
    keys = [k for k in (*GROUPS["data"], *GROUPS["training"])
            if not k.startswith("data.") or k == "data.source" or k in reads]
    if cfg.data.source == "tokens":  # one prepared directory or a mixture: the one in use
        keys.remove("data.mix" if cfg.data.mix is None else "data.path")
    found = {k: dumped[k.split(".", 1)[0]][k.split(".", 1)[1]] for k in keys}
    found["training.global_batch_tokens"] = cfg.global_batch_tokens  # set, or what the layout gives
    if found["validation.held_out"] is None:
        # Recorded only when set: checkpoints from before validation existed hold no such key,
        # and a job without a held-out share trains on the same documents they did.
        del found["validation.held_out"]
    return json.loads(json.dumps(found))  # as it reads back from the manifest (tuples as lists)


@dataclass(frozen=True)
class Change:
    """One setting that differs between a checkpoint and the job resuming it."""

    key: str
    before: str  # as shown: a JSON value, or a tokenizer's description
    after: str
    hint: str = ""

    @property
    def group(self) -> str:
        return GROUP_OF[self.key]

    def accepted_by(self, accept: list[str]) -> bool:
        return self.key in accept or self.group in accept

    def sentence(self) -> str:
        return f"{self.key} changed from {self.before} to {self.after}{self.hint}."


def _shown(value: Any) -> str:
    return "(not used)" if value is _NOT_RECORDED else json.dumps(value)


def _tokenizer_shown(record: dict[str, Any]) -> str:
    spec = record.get("spec")
    name = ("the byte tokenizer" if spec == "byte" else
            "the shards' tokenizer" if spec is None else str(spec))
    return f"{name} (sha256 {str(record.get('sha256'))[:12]}...)"


def identity_changes(recorded: dict[str, Any] | None, recorded_tokenizer: dict[str, Any] | None,
                     cfg: JobConfig, tokenizer: dict[str, Any] | None) -> list[Change]:
    """What differs between a checkpoint's identity (`recorded`, None in checkpoints from before
    it was recorded: nothing to compare) and tokenizer record and the job `cfg` with its
    tokenizer record `tokenizer` (None when unknown: not compared)."""
    found: list[Change] = []
    if recorded is not None:
        ours = job_identity(cfg)
        for key in (k for k in GROUP_OF if k in recorded or k in ours):
            before, after = recorded.get(key, _NOT_RECORDED), ours.get(key, _NOT_RECORDED)
            if before == after:
                continue
            hint = ""
            if key == "training.global_batch_tokens" and cfg.training.global_batch_tokens is None:
                hint = (f" (it follows the layout while unset: set training.global_batch_tokens to "
                        f"{before} to keep the checkpoint's batch at this layout)")
            found.append(Change(key, _shown(before), _shown(after), hint))
    if recorded_tokenizer and tokenizer and recorded_tokenizer.get("sha256") != tokenizer.get("sha256"):
        found.append(Change(TOKENIZER_KEY, _tokenizer_shown(recorded_tokenizer), _tokenizer_shown(tokenizer)))
    return found


def refusal(changes: list[Change], accept: list[str]) -> str | None:
    """The sentences that refuse the changes `accept` does not name, ending with how to start
    afresh or accept them; None when every change is accepted."""
    refused = [c for c in changes if not c.accepted_by(accept)]
    if not refused:
        return None
    lines = "\n".join(f"  {c.sentence()}" for c in refused)
    names = ", ".join(dict.fromkeys([*accept, *(c.key for c in refused)]))
    return (f"it was written by a job with other settings; resuming would carry its weights, step "
            f"and data position into this one:\n{lines}\nPoint checkpoint.dir elsewhere to "
            f"start afresh, or accept the changes deliberately with checkpoint.accept_changes: "
            f"[{names}] (on the command line: --set 'checkpoint.accept_changes=[{names}]')")


def starts_new_data(changes: list[Change], accept: list[str]) -> bool:
    """Whether an accepted change makes the checkpoint's data position meaningless: one of the
    data (the seed orders it) or of the tokenizer (the shards are other tokens)."""
    return any(c.group in ("data", "tokenizer") and c.accepted_by(accept) for c in changes)


def unused_accepts(changes: list[Change], accept: list[str]) -> list[str]:
    """The names in `accept` that accept none of `changes`: left over from an earlier resume,
    they would let a later change of theirs through unsaid."""
    return [name for name in accept if not any(c.key == name or c.group == name for c in changes)]
