"""The trainer's view of checkpointing: save every N steps without waiting, restore on start.

    ckpt = Checkpointer(cfg, rank=r, world_size=w, dp_rank=d, dp_size=n, ledger=...)
    ckpt.restore(trainer, world_group, dp_group)   # resume if a checkpoint exists
    trainer.before_update.append(ckpt.before_update)
    trainer.train(on_step=ckpt.on_step(trainer))
    ckpt.close()                                    # the last save committed

A save costs the training loop only the copy of its state into host memory (`snapshot.py`);
writing, checksumming and committing happen on the writer thread (`writer.py`). If the
previous save is still being written when the next is due, `checkpoint.when_busy` decides:
"wait" for it (default: no checkpoint is ever skipped) or "skip" this one.

`dp_rank`/`dp_size` place this rank in its replica group (the ranks holding the same pieces of
the weights): its rank 0 writes the group's pieces (in torch's distributed-checkpoint format,
`dcp_format.py`) and reads them back once for the group. A checkpoint restores at any layout
(`resharding.py`): the pieces this rank holds now are read from whichever saved pieces overlap.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Callable

import fsspec
import torch.distributed as dist

from longrun.checkpoint.commit import CommitLedger, LocalCommitLedger
from longrun.checkpoint.dcp_format import data_file_name, pieces_of
from longrun.checkpoint.lineage import current_lineage
from longrun.checkpoint.manifest import Manifest, rank_shard_name
from longrun.checkpoint.restore import Restored, restore_latest
from longrun.checkpoint.snapshot import HostStager, Snapshot
from longrun.checkpoint.stage_structure import structure_files
from longrun.checkpoint.writer import CheckpointWriter, SaveJob, SaveResult
from longrun.config import JobConfig
from longrun.config.identity import identity_changes, job_identity, starts_new_data
from longrun.config.vocabulary import tokenizer_record
from longrun.parallel.dims import coords_of, leads_its_stage
from longrun.trainer.optim import lay_out_state

log = logging.getLogger(__name__)

# Restores in this process, in order: each votes under its own key. Every rank makes the same
# sequence of restores, so the n-th restore of every rank shares one key, whichever
# Checkpointer makes it.
_RESTORES = itertools.count(1)


class Checkpointer:
    def __init__(self, cfg: JobConfig, *, rank: int = 0, world_size: int = 1, dp_rank: int = 0,
                 dp_size: int = 1, ledger: CommitLedger | None = None,
                 on_saved: Callable[[SaveResult], None] | None = None):
        if ledger is None:
            if world_size > 1:
                raise ValueError("a checkpoint of several ranks needs a shared commit ledger "
                                 "(RedisCommitLedger)")
            ledger = LocalCommitLedger()
        self.cfg = cfg
        self.rank, self.world_size, self.dp_rank, self.dp_size = rank, world_size, dp_rank, dp_size
        # Under pipeline parallelism each stage's first rank writes what its stage holds whole.
        self.stage = coords_of(cfg.dims, rank).pp if world_size == cfg.world_size else 0
        self.leads_stage = leads_its_stage(cfg.dims, rank) if world_size == cfg.world_size else rank == 0
        self.fs, self.root = fsspec.core.url_to_fs(cfg.checkpoint_dir)
        self.root = self.root.rstrip("/")
        self.stager = HostStager()
        self.writer = CheckpointWriter(
            self.fs, self.root, rank=rank, world_size=world_size, ledger=ledger,
            keep_last=cfg.checkpoint.keep_last, commit_timeout_s=cfg.checkpoint.commit_timeout_s,
            on_done=on_saved)
        self._pending: Snapshot | None = None
        self.last_saved_step: int | None = None  # the step of the newest save handed to the writer
        self.last_blocking_s: float | None = None
        self.saves = self.skipped = 0
        # Recorded in every manifest (rank 0 writes it): read once, the file does not change.
        self._tokenizer = tokenizer_record(cfg) if rank == 0 else None
        self._identity = job_identity(cfg)
        # Fixed when the attempt starts, not read at each commit: a rollback's fence (written
        # by the controller between attempts) must also catch this attempt's late commits.
        self.lineage = current_lineage(self.fs, self.root) if rank == 0 else 0

    # -- saving ------------------------------------------------------------------------------
    def save(self, trainer) -> float | None:
        """Snapshot `trainer` and hand it to the writer; returns the seconds training was
        blocked, or None if skipped because the previous save is still being written."""
        start = time.perf_counter()
        self.writer.raise_if_failed()
        if self.writer.busy:
            if self.cfg.checkpoint.when_busy == "skip":
                self.skipped += 1
                log.warning("step %d: previous checkpoint still being written; skipping this one",
                            trainer.step)
                return None
            self.writer.wait_idle()
            self.writer.raise_if_failed()
        # Asynchronous saves leave a CPU state's copy to the writer's thread (the GPU's runs on
        # a side stream): training goes on and waits for it in before_update(), which is made
        # sure to run before this trainer's next optimizer update.
        hooks = getattr(trainer, "before_update", None)
        if hooks is not None and self.before_update not in hooks:
            hooks.append(self.before_update)
        snapshot = self.stager.stage(self.files_of(trainer.state_dict()),
                                     defer=self.cfg.checkpoint.async_save)
        manifest = None
        if self.rank == 0:
            manifest = Manifest(step=trainer.step, world_size=self.world_size, dp_size=self.dp_size,
                                model=self.cfg.model.model_dump(mode="json"),
                                config_fingerprint=self.cfg.fingerprint(), layout=self.cfg.dims.degrees,
                                tokenizer=self._tokenizer, identity=self._identity, lineage=self.lineage)
        self.writer.submit(SaveJob(trainer.step, snapshot, manifest))
        self.last_saved_step = trainer.step
        self._pending = snapshot
        if not self.cfg.checkpoint.async_save:
            self.writer.wait_idle()
            self.writer.raise_if_failed()
        self.saves += 1
        self.last_blocking_s = time.perf_counter() - start
        return self.last_blocking_s

    def files_of(self, state: dict) -> dict[str, dict]:
        """{file name: what this rank writes into it} for a trainer state (see manifest.py)."""
        files = {rank_shard_name(self.rank): {"rng": state["rng"]}}
        # Each piece of the model and optimizer once: by the first rank that holds it.
        mine = {p.fqn: {"tensor": p.local, "offsets": p.offsets, "global_shape": p.global_shape,
                        "path": p.path}
                for p in pieces_of(state, rank=self.rank, replica_leader=self.dp_rank == 0,
                                   writes_whole=self.leads_stage) if p.writer}
        if mine:
            files[data_file_name(self.rank)] = mine
        files.update(structure_files(state, rank=self.rank, stage=self.stage, leads_stage=self.leads_stage))
        return files

    @property
    def copying(self) -> bool:
        """A save's copy of the weights may still be running (before_update waits for it)."""
        return self._pending is not None

    def before_update(self) -> None:
        """Call right before the optimizer changes the weights: a snapshot still copying (on a
        GPU's side stream, or in the writer's thread on the CPU) must finish first."""
        if self._pending is not None:
            start = time.perf_counter()
            self._pending.wait()
            self._pending = None
            if self.last_blocking_s is not None:  # the rest of the save's cost to training
                self.last_blocking_s += time.perf_counter() - start

    def due(self, step: int) -> bool:
        """Whether a save is due after `step`: every checkpoint.interval_steps and at the last."""
        return step % self.cfg.checkpoint.interval_steps == 0 or step == self.cfg.training.steps

    def on_step(self, trainer) -> Callable[[object], None]:
        """A `Trainer.train` hook: save whenever `due`."""

        def hook(metrics) -> None:
            if self.due(metrics.step):
                self.save(trainer)
        return hook

    def save_now(self, trainer) -> SaveResult | None:
        """Save `trainer`'s current step unless that was done already, and wait until it is
        written (committed, on the coordinator): what a stop request needs. Never skipped."""
        self.flush()  # a save still in flight would otherwise make this one skip or wait
        if self.last_saved_step != trainer.step:
            self.save(trainer)
        return self.flush()

    def flush(self) -> SaveResult | None:
        """Wait for the save in flight; raise if it failed. Returns its result."""
        self.writer.wait_idle()
        self.writer.raise_if_failed()
        return self.writer.last_result

    def close(self) -> None:
        self.writer.close()
        self.writer.raise_if_failed()

    # -- restoring ---------------------------------------------------------------------------
    def restore(self, trainer, world_group: dist.ProcessGroup | None = None,
                dp_group: dist.ProcessGroup | None = None, *,
                before_step: int | None = None) -> Restored | None:
        """Load the newest usable checkpoint (below `before_step` if given) into `trainer`,
        whatever layout wrote it; None (and no change) if there is none. Collective over the
        groups when given (`dp_group`: this rank's replica group)."""
        self.before_update()  # a copy still reading the weights finishes before they are overwritten
        ledger, restore = self.writer.ledger, next(_RESTORES)
        agree = None
        if ledger.shared and self.world_size > 1:
            # A vote outside the process group: a reader that never answers is named.
            def agree(key: str, ok: bool) -> bool:
                return ledger.agree(f"{key}-{restore}", self.rank, ok, self.world_size,
                                    self.cfg.checkpoint.restore_timeout_s)
        # Building the live state to load into gives an optimizer without state yet its state
        # (torch's get_state_dict would take a step at lr 0; lay_out_state makes the same
        # tensors unfilled); if nothing is restored after all, that must not change the fresh
        # run's trajectory (AdamW's step count), so the state is cleared again.
        fresh = not trainer.optimizer.state
        if fresh:
            lay_out_state(trainer.optimizer)  # instead of that step: the same tensors, not filled
        restored = restore_latest(
            self.fs, self.root, model=self.cfg.model.model_dump(mode="json"),
            template=trainer.state_dict, rank=self.rank, world_size=self.world_size,
            replica_rank=self.dp_rank, layout=self.cfg.dims.degrees, world_group=world_group,
            replica_group=dp_group, before_step=before_step, agree=agree,
            # A worker restores before it sets any weights (`Trainer(init_weights=False)`,
            # initialised only if nothing is restored): its state can take the reads directly.
            into_live=not trainer.initialised and fresh)
        if restored is not None:
            state = restored.state
            if self._starts_new_data(restored.manifest):
                state = {**state, "data": None}  # the new data from its beginning
            trainer.load_state_dict(state)
            log.info("resumed from step %d of %s", restored.step, self.root)
        elif fresh:
            trainer.optimizer.state.clear()
        return restored

    def _starts_new_data(self, manifest: Manifest | None) -> bool:
        """Whether the restored checkpoint's data position is left behind: the job changed its
        data, seed or tokenizer and accepted it (checkpoint.accept_changes; the controller
        refused it otherwise). The same answer on every rank: the same manifest and files."""
        if manifest is None or not self.cfg.checkpoint.accept_changes:
            return False
        tokenizer = self._tokenizer if self.rank == 0 else tokenizer_record(self.cfg)
        changes = identity_changes(manifest.identity, manifest.tokenizer, self.cfg, tokenizer)
        if not starts_new_data(changes, self.cfg.checkpoint.accept_changes):
            return False
        if self.rank == 0:
            log.warning("step %d was trained on other data (%s, accepted): the new data is read "
                        "from its beginning", manifest.step,
                        "; ".join(c.sentence() for c in changes if c.group in ("data", "tokenizer")))
        return True
