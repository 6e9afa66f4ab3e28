"""Processes for the validation tests: gloo-world ranks (imported by spawned children) and a
training script killed and resumed (`python validation_workers.py ROOT [KILL_AFTER_STEP]`)."""

from __future__ import annotations

import os
import signal
import sys
import traceback

from pipeline_workers import pipeline_config, pipelined_trainer
from sharded_workers import _trainer, layout_config
from trainer_workers import _join

VALIDATION = {"interval_steps": 5, "held_out": 0.1, "steps": 2}
# One global batch for every layout (by default it would follow the span), so every layout
# trains the same batches and validates the same weights.
TRAINING = {"steps": 10, "global_batch_tokens": 512}


def validated_config(parallelism: dict, world: int, **sections):
    return layout_config(parallelism, world, validation=VALIDATION | sections.pop("validation", {}),
                         training=TRAINING | sections.pop("training", {}), **sections)


def source_documents(corpus, ids) -> set[int]:
    return {corpus.document_of(int(i)) for i in ids or ()}  # a CP slice may not name its documents


def train_and_validate(trainer) -> tuple[dict, dict, set, set]:
    """Train `trainer` to its last step: ({step: training loss}, {step: validation loss}, the
    source documents it trained on, the source documents a validation pass evaluates)."""
    losses, val_losses, trained = {}, {}, set()
    done = trainer.feed.done

    def record_done(work):
        for mb in work.micro_batches:
            if not mb.idle:
                trained.update(source_documents(trainer.corpus, mb.documents.doc_ids))
        done(work)

    def record(m):
        losses[m.step] = m.loss
        if m.val_loss is not None:
            val_losses[m.step] = m.val_loss

    trainer.feed.done = record_done
    trainer.train(on_step=record)
    validator = trainer.validator
    validated = set()
    for work in validator.works():
        for mb in work.micro_batches:
            if not mb.idle:
                validated.update(source_documents(validator.corpus, mb.documents.doc_ids))
    return losses, val_losses, trained, validated


def layout_validates(rank: int, world: int, init_file: str, results, parallelism: dict) -> None:
    """Ten steps at `parallelism` with validation every five: reports (rank, training losses,
    validation losses, source documents trained, source documents validated)."""
    try:
        dist = _join(rank, world, init_file)
        from longrun.commgroup import form_groups, single_node_layout

        cfg = validated_config(parallelism, world)
        groups = form_groups(single_node_layout(cfg.dims), rank)
        with _trainer(cfg, groups) as trainer:
            results.put((rank, *train_and_validate(trainer)))
        dist.destroy_process_group()
    except Exception:
        results.put((rank, "error", traceback.format_exc()))


def pipeline_validates(rank: int, world: int, init_file: str, results) -> None:
    """Pipeline stages: a pass at the initial weights against one process's loss of the same
    micro-batches at the same weights (the initial weights do not depend on the layout); then
    four steps validated every two and every four: the training losses must not depend on how
    often validation ran, and the step-4 validation loss neither. Reports (rank, loss, reference
    loss, training losses with each interval, step-4 validation losses with each interval)."""
    try:
        dist = _join(rank, world, init_file)
        import torch

        from longrun.commgroup import form_groups, single_node_layout
        from longrun.trainer import Trainer
        from longrun.trainer.step import plain_step

        def config(parallelism, world, interval):
            return pipeline_config(parallelism, world, grad_accum=2, n_layers=2,
                                   sections={"validation": VALIDATION | {"interval_steps": interval}})

        cfg = config({"pp": 2}, world, 2)
        groups = form_groups(single_node_layout(cfg.dims), rank)
        with pipelined_trainer(cfg, groups) as trainer, \
                Trainer(config({}, 1, 2), "cpu", progress=False) as alone:
            loss, _ = trainer.validator.run(trainer)
            micro_batches = [mb.inputs for work in trainer.validator.works() for mb in work.micro_batches]
            alone.model.eval()
            with torch.no_grad():
                summed = float(alone.forward_loss(plain_step(micro_batches)))
            reference = summed / sum(mb.n_tokens for mb in micro_batches)
        runs = []
        for interval in (2, 4):
            with pipelined_trainer(config({"pp": 2}, world, interval), groups) as trainer:
                losses, val_losses, _, _ = train_and_validate(trainer)
                runs.append((losses, val_losses[4]))
        results.put((rank, loss, reference, runs[0][0], runs[1][0], runs[0][1], runs[1][1]))
        dist.destroy_process_group()
    except Exception:
        results.put((rank, "error", traceback.format_exc()))


def resumable_config(root: str):
    from checkpoint_workers import config

    return config(root, training={"steps": 12}, checkpoint={"interval_steps": 4, "async_save": False},
                  validation=VALIDATION)


def main(root: str, kill_after: int | None) -> None:
    """Train to step 12 from the newest checkpoint under `root` (one every 4 steps, each committed
    before training goes on), printing each validation loss in hex; SIGKILL itself after step
    `kill_after`'s hooks."""
    import torch

    from longrun.checkpoint import Checkpointer
    from longrun.trainer import Trainer

    torch.set_num_threads(1)
    cfg = resumable_config(root)
    with Trainer(cfg, progress=False) as trainer:
        ckpt = Checkpointer(cfg)
        restored = ckpt.restore(trainer)
        print(f"resumed {restored.step if restored else 0}", flush=True)
        trainer.before_update.append(ckpt.before_update)
        save = ckpt.on_step(trainer)

        def on_step(m):
            save(m)
            if m.val_loss is not None:
                print(f"val {m.step} {m.val_loss.hex()}", flush=True)
            if m.step == kill_after:
                os.kill(os.getpid(), signal.SIGKILL)

        trainer.train(on_step=on_step)
        ckpt.close()


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else None)
