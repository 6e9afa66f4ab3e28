"""Before any worker is placed: can this job resume from the checkpoints it would restore?
What did a crashed save leave behind? And, when a rollback is decided, fence off the
checkpoints of the abandoned path.

Every worker refuses a checkpoint of another model, or of the earlier format (`restore.py`;
any parallel layout is fine: it reshards), and a restart would only meet the same refusal on
other nodes. So the controller reads the newest
committed checkpoint's manifest itself (JSON: no torch, no worker) and fails the job at once,
with the manifest's own reason, instead of spending a placement and an attempt to learn it.
Here too a checkpoint written by a job with other data, tokenizer or training settings is
refused, one sentence per difference, unless `checkpoint.accept_changes` names it
(`config/identity.py`): a reused job name or checkpoint directory must not resume another
job's weights, step and data position unsaid. `longrun run` asks before it starts anything.
"""

from __future__ import annotations

import logging

import fsspec

from longrun.checkpoint.layout import MANIFEST, committed_dirs, sweep_uncommitted
from longrun.checkpoint.lineage import FENCES, FenceError, abandoned_reason, add_fence, read_fences
from longrun.checkpoint.manifest import Manifest, ManifestError
from longrun.config import JobConfig
from longrun.config.identity import identity_changes, refusal, unused_accepts
from longrun.config.vocabulary import tokenizer_record

log = logging.getLogger(__name__)


def checkpoint_problem(cfg: JobConfig, *, quiet: bool = False) -> str | None:
    """Why the job cannot resume from the newest committed checkpoint under
    cfg.checkpoint_dir (saying what to do), or None when it can or there is none. `quiet`: no
    warnings (about an unchecked older checkpoint, accepted changes): the caller checks early
    and the controller checks again, and says them.

    Unreadable manifests are skipped, as the workers skip them (they fall back to an older
    step); the first readable one decides, as it does for them."""
    fs, root = fsspec.core.url_to_fs(cfg.checkpoint_dir)
    root = root.rstrip("/")
    try:
        dirs = committed_dirs(fs, root)
    except OSError as exc:  # the workers will meet the storage too, and say so in their own error
        log.warning("checkpoint precheck: cannot list %s (%s); leaving it to the workers", root, exc)
        return None
    try:
        fences = read_fences(fs, root)
    except FenceError as exc:
        return f"cannot resume from {cfg.checkpoint_dir}: {exc}"
    except OSError as exc:
        log.warning("checkpoint precheck: cannot read %s/%s (%s); leaving it to the workers",
                    root, FENCES, exc)
        return None
    for step in sorted(dirs, reverse=True):
        path = f"{root}/{dirs[step][0]}/{MANIFEST}"  # the newest revision is the step's checkpoint
        try:
            manifest = Manifest.from_json(fs.cat_file(path), where=path)
        except (ManifestError, OSError) as exc:
            log.warning("checkpoint precheck: %s is unreadable (%s); looking at an older one", path, exc)
            continue
        if abandoned_reason(manifest, fences) is not None:  # the workers pass it over too
            continue
        where = f"{cfg.checkpoint_dir}/{dirs[step][0]}"
        # Any layout restores any checkpoint; only the model (and the format) must fit...
        mismatch = manifest.incompatibility(cfg.model.model_dump(mode="json"))
        if mismatch is not None:
            return (f"cannot resume from {where}: {mismatch}. Point checkpoint.dir elsewhere to "
                    "start afresh, or run with the model the checkpoint was written with.")
        # ...and the data, tokenizer and training settings be the same, or accepted.
        changed = _changed_settings(cfg, manifest, where, quiet=quiet)
        return None if changed is None else f"cannot resume from {where}: {changed}."
    return None


def _changed_settings(cfg: JobConfig, manifest: Manifest, where: str, *, quiet: bool) -> str | None:
    """The refusal of the settings that differ between the checkpoint at `where` and the job,
    unaccepted; None when there are none (the accepted ones, and what could not be compared,
    logged unless `quiet`)."""
    try:
        tokenizer = tokenizer_record(cfg)
    except (OSError, ValueError) as exc:  # the workers will meet it too, and say so
        tokenizer = None
        if not quiet:
            log.warning("checkpoint precheck: this job's tokenizer cannot be read (%s); the "
                        "checkpoint's is not compared with it", exc)
    changes = identity_changes(manifest.identity, manifest.tokenizer, cfg, tokenizer)
    accept = cfg.checkpoint.accept_changes
    refused = refusal(changes, accept)
    if refused is not None or quiet:
        return refused
    if manifest.identity is None:
        log.warning("%s records no data or training settings (written by an earlier longrun): "
                    "resuming without comparing them with this job's", where)
    for change in changes:
        log.warning("resuming from %s with an accepted change: %s", where, change.sentence())
    if unused := unused_accepts(changes, accept):
        log.warning("checkpoint.accept_changes names %s, which the checkpoint at %s does not differ "
                    "in: remove it, so that a later change is refused", ", ".join(unused), where)
    return None


def sweep_partial_saves(cfg: JobConfig) -> list[str]:
    """Delete the step directories that saves of earlier attempts left without a manifest (a
    worker killed mid-save), before an attempt is placed. Only here is it safe: no worker of the
    job is alive (the last attempt's were stopped and confirmed dead), so none of them is a save
    in progress; and only here is it timely: a disk a crashed save filled is freed before the
    next attempt writes, not after its first commit (retention removes the earlier steps' too).
    A failure is logged, never fatal. Returns what was deleted."""
    fs, root = fsspec.core.url_to_fs(cfg.checkpoint_dir)
    try:
        removed = sweep_uncommitted(fs, root.rstrip("/"))
    except OSError as exc:
        log.warning("could not sweep the uncommitted saves under %s (%s); retention removes them "
                    "after the next commit", root, exc)
        return []
    if removed:
        log.info("removed %d uncommitted save(s) under %s: %s", len(removed), root,
                 ", ".join(p.rsplit("/", 1)[-1] for p in removed))
    return removed


def fence_rollback(cfg: JobConfig, before_step: int, reason: str) -> None:
    """A decision restores from before `before_step` (a loss spike): fence off every checkpoint
    at or after it, so that no later restart, of this job or a rerun, restores the spiked
    weights (`checkpoint/lineage.py`). Called after the attempt's workers were stopped and
    before the next attempt starts (it stamps its checkpoints with the new lineage). Without a
    checkpoint root there is nothing to fence: no save was ever started."""
    fs, root = fsspec.core.url_to_fs(cfg.checkpoint_dir)
    root = root.rstrip("/")
    try:
        if not fs.isdir(root):
            return
        lineage = add_fence(fs, root, before_step, reason)
    except (OSError, FenceError) as exc:  # the restore still goes before the step; a later one might not
        log.error("could not fence the checkpoints at or after step %d under %s (%s): a later "
                  "ordinary restart may restore the spiked weights; delete them by hand", before_step,
                  root, exc)
        return
    log.info("checkpoints at or after step %d under %s fenced off (lineage %d)", before_step, root, lineage)
