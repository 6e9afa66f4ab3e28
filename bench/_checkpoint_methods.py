"""The save methods bench/checkpoint.py compares, each timed the same way (run that script;
this file is not a bench). Its docstring says what each method does and measures."""

from __future__ import annotations

import gc
import os
import shutil
import statistics
import sys
import time

import torch
from _common import evict

from longrun.checkpoint.writer import fsync_dir  # a durable save also syncs its directory

METHODS = ("longrun", "sync", "dcp", "dcp_cached", "memcpy", "disk")
DISK_CHUNK = 64 << 20  # the floor's unit of write and read: large, sequential, like a checkpoint's


def sync_device() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _bytes(t) -> memoryview:
    """A host tensor's bytes, writable, without a copy."""
    return memoryview(t.reshape(-1).view(torch.uint8).numpy()) if t.numel() else memoryview(bytearray())


def same_weights(a, b) -> bool:
    sa, sb = a.model.state_dict(), b.model.state_dict()
    return all(torch.equal(sa[k], sb[k]) for k in sa)


# --- the methods ------------------------------------------------------------------------------


class Bench:
    def __init__(self, trainer, restore_target, ckpt, root: str):
        import torch.distributed.checkpoint as dcp

        from longrun.checkpoint.snapshot import tensors_of

        self.trainer, self.restore_target, self.ckpt, self.root = trainer, restore_target, ckpt, root
        self.dcp_save = dcp.async_save
        self.on_gpu = trainer.device.type == "cuda"
        self.stager, self.stager_closed = self._new_stager(), 0
        self.sources = [t.detach() for _, t in tensors_of(trainer.state_dict())]
        self.buffers = [torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=self.on_gpu)
                        for t in self.sources]
        self.rows: dict[str, list[dict[str, float]]] = {m: [] for m in METHODS}
        self.first: dict[str, float] = {}

    def _new_stager(self):
        """async_save's own default when no stager is given (synchronous staging, no shared
        memory), but kept, so its storages are cached; pinned on a GPU like longrun's buffers."""
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

        return DefaultStager(StagingOptions(use_pinned_memory=self.on_gpu, use_shared_memory=False,
                                            use_async_staging=False, use_non_blocking_copy=False))

    def clean(self, path: str) -> None:
        shutil.rmtree(path, ignore_errors=True)
        gc.collect()

    def longrun(self) -> dict[str, float]:
        ckpt = self.ckpt
        ckpt.flush()  # the previous save is committed: steady state, not waiting on it
        sync_device()
        start = time.perf_counter()
        returned = ckpt.save(self.trainer)
        ckpt.before_update()  # a GPU copy still in flight must finish before the optimizer
        blocking = time.perf_counter() - start
        result = ckpt.flush()
        e2e = time.perf_counter() - start
        if result is None or not result.committed:
            raise RuntimeError(f"the longrun save did not commit: {result}")
        target = self.restore_target()
        evict(ckpt.root)
        start = time.perf_counter()
        restored = ckpt.restore(target)
        sync_device()
        restore = time.perf_counter() - start
        if restored is None or not same_weights(self.trainer, target):
            raise RuntimeError("the longrun restore did not reproduce the saved weights")
        start = time.perf_counter()
        ckpt.restore(target)
        sync_device()
        restore_warm = time.perf_counter() - start
        del target
        self.clean(ckpt.root)
        return {"blocking_s": blocking, "save_return_s": returned, "e2e_s": e2e,
                "write_s": result.write_s, "restore_s": restore, "restore_warm_s": restore_warm}

    def sync(self) -> dict[str, float]:
        folder = os.path.join(self.root, "sync")
        os.makedirs(folder, exist_ok=True)
        path = os.path.join(folder, "state.pt")
        sync_device()
        start = time.perf_counter()
        with open(path, "wb") as f:
            torch.save(self.trainer.state_dict(), f)
            f.flush()
            os.fsync(f.fileno())
        fsync_dir(folder)
        blocking = time.perf_counter() - start
        target = self.restore_target()
        evict(folder)
        start = time.perf_counter()
        target.load_state_dict(torch.load(path, map_location="cpu", weights_only=True))
        sync_device()
        restore = time.perf_counter() - start
        if not same_weights(self.trainer, target):
            raise RuntimeError("torch.load did not reproduce the saved weights")
        del target
        self.clean(folder)
        return {"blocking_s": blocking, "e2e_s": blocking, "restore_s": restore}

    def _dcp(self, name: str, stager) -> dict[str, float]:
        folder = os.path.join(self.root, name)
        sync_device()
        start = time.perf_counter()
        kwargs = {} if stager is None else {"async_stager": stager}
        future = self.dcp_save(self.trainer.state_dict(), checkpoint_id=folder, **kwargs)
        blocking = time.perf_counter() - start
        future.result()
        e2e = time.perf_counter() - start
        row = {"blocking_s": blocking, "e2e_s": e2e}
        if stager is not None:  # the restore of the same files, cold: DCP's own reader
            row["restore_s"] = self._dcp_load(folder)
        self.clean(folder)
        return row

    def _dcp_load(self, folder: str) -> float:
        """`dcp.load` into a worker's new trainer's state dict (its tensors filled in place) and
        `load_state_dict`, the files evicted from the page cache first: DCP's cold restore."""
        import torch.distributed.checkpoint as dcp

        target = self.restore_target()
        evict(folder)
        sync_device()
        start = time.perf_counter()
        state = target.state_dict()  # as longrun's restore builds its template (optimizer state too)
        dcp.load(state, checkpoint_id=folder)
        target.load_state_dict(state)
        sync_device()
        took = time.perf_counter() - start
        if not same_weights(self.trainer, target):
            raise RuntimeError("dcp.load did not reproduce the saved weights")
        return took

    def dcp_default(self) -> dict[str, float]:
        return self._dcp("dcp", None)

    def dcp_cached(self) -> dict[str, float]:
        # On torch 2.11 the second save with the reused stager failed with `KeyError: <class
        # 'type'>` in StateDictStager.deepcopy_with_tensor_offload: the lookup of its dispatch
        # table's `type` entry, which fails only once `close()` emptied that table, i.e. the
        # stager was closed after the first save. Then it cannot be reused: make a new one,
        # and say so (the row then measures a fresh stager per save, like `dcp`).
        inner = getattr(self.stager, "_state_dict_stager", None)
        if inner is not None and not getattr(inner, "_deepcopy_dispatch", True):
            self.stager_closed += 1
            if self.stager_closed == 1:
                print("[checkpoint] DCP closed the reused stager after a save: a new one per save",
                      file=sys.stderr, flush=True)
            self.stager = self._new_stager()
        return self._dcp("dcp_cached", self.stager)

    def memcpy(self) -> dict[str, float]:
        """The blocking floor: the same tensors (gathered once, no tree walk in the timed region)
        copied with the same intra-op threads into buffers touched before; the summary takes
        the fastest rep, since a floor is what the copy can do, not what it did on average."""
        sync_device()
        start = time.perf_counter()
        for dst, src in zip(self.buffers, self.sources, strict=True):
            dst.copy_(src, non_blocking=self.on_gpu)
        sync_device()
        return {"blocking_s": time.perf_counter() - start}

    def disk(self) -> dict[str, float]:
        """The floor (`dd`-style): the state's bytes, already in host memory (the memcpy
        method's buffers: no extra copy of the state), written sequentially in large chunks
        with no serialisation or checksum, fsynced with the directory; then read back into the
        same buffers cold. What the disk allows through the page cache, as every method goes."""
        folder = os.path.join(self.root, "disk")
        os.makedirs(folder, exist_ok=True)
        path = os.path.join(folder, "floor.bin")
        views = [_bytes(b) for b in self.buffers]
        start = time.perf_counter()
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            for view in views:
                for at in range(0, len(view), DISK_CHUNK):
                    part = view[at:at + DISK_CHUNK]
                    while part:  # a write may take less than asked
                        part = part[os.write(fd, part):]
            os.fsync(fd)
        finally:
            os.close(fd)
        fsync_dir(folder)
        write = time.perf_counter() - start
        evict(folder)
        start = time.perf_counter()
        with open(path, "rb", buffering=0) as f:
            for view in views:
                for at in range(0, len(view), DISK_CHUNK):
                    part = view[at:at + DISK_CHUNK]
                    while part:
                        got = f.readinto(part)
                        if not got:
                            raise RuntimeError(f"{path} is shorter than what was written")
                        part = part[got:]
        read = time.perf_counter() - start
        self.clean(folder)
        return {"blocking_s": write, "e2e_s": write, "restore_s": read}

    def run(self, method: str) -> dict[str, float]:
        # Every method starts on a quiet machine: the page cache's dirty gigabytes of the method
        # before written back now, not by the kernel's flusher threads during this one's timed
        # copy (a memory-bound copy on 2 cores halves when one of them is taken: the memcpy
        # floor once measured 0.268 s at 1.22 GB, a one-thread copy's time, against 0.14 s).
        os.sync()
        gc.collect()
        row = getattr(self, "dcp_default" if method == "dcp" else method)()
        gc.collect()
        return row

    def breakdown(self, reps: int) -> dict[str, float]:
        """Where longrun's blocking time goes, with the writer idle: building the state dict,
        and the stage copy (HostStager.stage of the same shards save() stages, until ready)."""
        self.ckpt.flush()
        times: dict[str, list[float]] = {"state_dict_s": [], "stage_s": []}
        for _ in range(reps):
            start = time.perf_counter()
            state = self.trainer.state_dict()
            times["state_dict_s"].append(time.perf_counter() - start)
            start = time.perf_counter()
            snap = self.ckpt.stager.stage(self.ckpt.files_of(state))
            snap.wait()
            times["stage_s"].append(time.perf_counter() - start)
        return {k: statistics.median(v) for k, v in times.items()}
