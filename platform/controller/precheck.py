"""Before any worker is placed: can this job resume from the checkpoints it would restore?

Every worker refuses a checkpoint of another model, or of the earlier format (`restore.py`;
any parallel layout is fine: it reshards), and a restart would only meet the same refusal on
other nodes. So the controller reads the newest
committed checkpoint's manifest itself (JSON: no torch, no worker) and fails the job at once,
with the manifest's own reason, instead of spending a placement and an attempt to learn it.
"""

from __future__ import annotations

import logging

import fsspec

from longrun.checkpoint.layout import MANIFEST, committed_steps, step_dir_name
from longrun.checkpoint.manifest import Manifest, ManifestError
from longrun.config import JobConfig

log = logging.getLogger(__name__)


def checkpoint_problem(cfg: JobConfig) -> str | None:
    """Why the job cannot resume from the newest committed checkpoint under
    cfg.checkpoint_dir (one sentence saying what to do), or None when it can or there is none.

    Unreadable manifests are skipped, as the workers skip them (they fall back to an older
    step); the first readable one decides, as it does for them."""
    fs, root = fsspec.core.url_to_fs(cfg.checkpoint_dir)
    root = root.rstrip("/")
    try:
        steps = committed_steps(fs, root)
    except OSError as exc:  # the workers will meet the storage too, and say so in their own error
        log.warning("checkpoint precheck: cannot list %s (%s); leaving it to the workers", root, exc)
        return None
    for step in reversed(steps):
        path = f"{root}/{step_dir_name(step)}/{MANIFEST}"
        try:
            manifest = Manifest.from_json(fs.cat_file(path), where=path)
        except (ManifestError, OSError) as exc:
            log.warning("checkpoint precheck: %s is unreadable (%s); looking at an older one", path, exc)
            continue
        # Any layout restores any checkpoint; only the model (and the format) must fit.
        mismatch = manifest.incompatibility(cfg.model.model_dump(mode="json"))
        if mismatch is None:
            return None
        return (f"cannot resume from {cfg.checkpoint_dir}/{step_dir_name(step)}: {mismatch}. "
                "Point checkpoint.dir elsewhere to start afresh, or run with the model the "
                "checkpoint was written with.")
    return None
