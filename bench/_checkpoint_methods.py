"""The save methods bench/checkpoint.py compares, each timed the same way (run that script;
this file is not a bench). Its docstring says what each method does and measures."""

from __future__ import annotations

import ctypes
import gc
import mmap
import os
import queue
import shutil
import statistics
import sys
import time
from concurrent.futures import Future

import torch
import xxhash
from _common import evict

from longrun.checkpoint.writer import fsync_dir  # a durable save also syncs its directory

# The methods run in phases, each phase's methods alternating across its reps; what a phase's
# methods keep between saves (longrun's staging buffers, DCP's reused stagers, the floors'
# buffers) is freed before the next phase, so host memory holds at most two of them at once,
# beside the trainer and one restore's target. (longrun beside DCP's asynchronous staging, the
# two running threads that allocate, peaked at about 1.2x the state more than this grouping.)
PHASES = (("longrun", "sync", "dcp"), ("dcp_cached", "dcp_async_staging"), ("memcpy", "disk"))
METHODS = tuple(m for phase in PHASES for m in phase)
DISK_CHUNK = 64 << 20  # the floor's unit of write and read: large, sequential, like a checkpoint's


def sync_device() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _bytes(t) -> memoryview:
    """A host tensor's bytes, writable, without a copy."""
    return memoryview(t.reshape(-1).view(torch.uint8).numpy()) if t.numel() else memoryview(bytearray())


def fingerprint(trainer) -> list[int]:
    """The model's weights as one xxHash3 per tensor: what a restore must reproduce, taken just
    before a save (the step after it changes the weights) without holding a copy of them."""
    return [xxhash.xxh3_64_intdigest(_bytes(t.detach().cpu().contiguous()))
            for t in trainer.model.state_dict().values()]


def check_restored(saved: list[int], target, what: str) -> None:
    if fingerprint(target) != saved:
        raise RuntimeError(f"{what} did not reproduce the saved weights")


def read_into(path: str, views) -> None:
    """Read `path` from its start into `views`, in order, in the floor's large sequential reads."""
    with open(path, "rb", buffering=0) as f:
        for view in views:
            for at in range(0, len(view), DISK_CHUNK):
                part = view[at:at + DISK_CHUNK]
                while part:
                    got = f.readinto(part)
                    if not got:
                        raise RuntimeError(f"{path} is shorter than what was written")
                    part = part[got:]


# --- the methods ------------------------------------------------------------------------------


class Bench:
    def __init__(self, trainer, restore_target, cfg, root: str):
        import torch.distributed.checkpoint as dcp

        from longrun.checkpoint import Checkpointer

        self.trainer, self.restore_target, self.root = trainer, restore_target, root
        # When each longrun save was done (its writer's on_saved hook, on the writer's thread):
        # the end of its end-to-end time, whatever the training thread did meanwhile.
        self.saved_at: queue.Queue[float] = queue.Queue()
        self.ckpt = Checkpointer(cfg, on_saved=lambda _: self.saved_at.put(time.perf_counter()))
        self.dcp_save = dcp.async_save
        self.on_gpu = trainer.device.type == "cuda"
        self.stager, self.stager_closed = self._new_stager(async_staging=False), 0
        self.async_stager = self._new_stager(async_staging=True)
        self.sources: list[torch.Tensor] = []  # the floors' (made in their phase: see floor_buffers)
        self.buffers: list[torch.Tensor] = []
        self.rows: dict[str, list[dict[str, float]]] = {m: [] for m in METHODS}
        self.first: dict[str, float] = {}

    def _new_stager(self, *, async_staging: bool):
        """async_save's own default when no stager is given (synchronous staging, no shared
        memory), but kept, so its storages are cached; pinned on a GPU like longrun's buffers.
        With `async_staging` its copy runs in its own thread, overlapping the training step
        (its caller must wait for it before the next update); non-blocking copies need a GPU."""
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

        return DefaultStager(StagingOptions(use_pinned_memory=self.on_gpu, use_shared_memory=False,
                                            use_async_staging=async_staging,
                                            use_non_blocking_copy=self.on_gpu and async_staging))

    def clean(self, path: str) -> None:
        shutil.rmtree(path, ignore_errors=True)
        gc.collect()

    def step(self) -> float:
        """One real training step (the data, forward and backward, the trainer's before_update
        hooks, the optimizer update), in seconds. The data thread is stopped after it (nothing
        runs beside the measurements) and the gradients freed (no memory held between them)."""
        sync_device()
        start = time.perf_counter()
        self.trainer.train_step()
        sync_device()
        took = time.perf_counter() - start
        self.trainer.close()
        self.trainer.optimizer.zero_grad(set_to_none=True)
        return took

    def longrun(self) -> dict[str, float]:
        ckpt = self.ckpt
        ckpt.flush()  # the previous save is committed: steady state, not waiting on it
        saved = fingerprint(self.trainer)
        sync_device()
        start = time.perf_counter()
        returned = ckpt.save(self.trainer)
        # The next step's forward and backward run while the copy does (the writer's thread on
        # the CPU, a side stream on a GPU); its update waits for the rest in ckpt.before_update
        # (registered by save()), which adds that wait to last_blocking_s.
        step = self.step()
        blocking = ckpt.last_blocking_s
        result = ckpt.flush()
        e2e = self.saved_at.get() - start
        if result is None or not result.committed:
            raise RuntimeError(f"the longrun save did not commit: {result}")
        target = self.restore_target()
        evict(ckpt.root)
        start = time.perf_counter()
        restored = ckpt.restore(target)
        sync_device()
        restore = time.perf_counter() - start
        if restored is None:
            raise RuntimeError("the longrun restore found no checkpoint")
        check_restored(saved, target, "the longrun restore")
        start = time.perf_counter()
        ckpt.restore(target)
        sync_device()
        restore_warm = time.perf_counter() - start
        del target
        self.clean(ckpt.root)
        return {"blocking_s": blocking, "save_return_s": returned, "update_wait_s": blocking - returned,
                "step_s": step, "e2e_s": e2e, "write_s": result.write_s, "restore_s": restore,
                "restore_warm_s": restore_warm}

    def sync(self) -> dict[str, float]:
        folder = os.path.join(self.root, "sync")
        os.makedirs(folder, exist_ok=True)
        path = os.path.join(folder, "state.pt")
        saved = fingerprint(self.trainer)
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
        check_restored(saved, target, "torch.load")
        del target
        self.clean(folder)
        return {"blocking_s": blocking, "e2e_s": blocking, "restore_s": restore}

    def _dcp(self, name: str, stager) -> dict[str, float]:
        folder = os.path.join(self.root, name)
        saved = fingerprint(self.trainer)
        sync_device()
        start = time.perf_counter()
        kwargs = {} if stager is None else {"async_stager": stager}
        future = self.dcp_save(self.trainer.state_dict(), checkpoint_id=folder, **kwargs)
        blocking = time.perf_counter() - start
        future.result()
        e2e = time.perf_counter() - start
        row = {"blocking_s": blocking, "e2e_s": e2e}
        if stager is not None:  # the restore of the same files, cold: DCP's own reader
            row["restore_s"] = self._dcp_load(folder, saved)
        self.clean(folder)
        return row

    def _dcp_load(self, folder: str, saved: list[int]) -> float:
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
        check_restored(saved, target, "dcp.load")
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
            self.stager = self._new_stager(async_staging=False)
        return self._dcp("dcp_cached", self.stager)

    def dcp_async_staging(self) -> dict[str, float]:
        """DCP on longrun's terms: its reused stager copies in its own thread while the next
        step's forward and backward run, and that step's update waits for the copy (the wait
        DCP's AsyncSaveResponse.staging_completion stands for). Restored with dcp.load, cold."""
        folder = os.path.join(self.root, "dcp_async_staging")
        saved = fingerprint(self.trainer)
        sync_device()
        start = time.perf_counter()
        response = self.dcp_save(self.trainer.state_dict(), checkpoint_id=folder,
                                 async_stager=self.async_stager)
        returned = time.perf_counter() - start
        # The time the upload finished, set by its own thread (result() may return before the
        # future's callbacks have run, so the time is handed over in a future of its own).
        uploaded: Future[float] = Future()
        response.upload_completion.add_done_callback(lambda _: uploaded.set_result(time.perf_counter()))
        waits: list[float] = []

        def wait_for_staging() -> None:  # the weights must not change while DCP copies them
            begun = time.perf_counter()
            response.staging_completion.result()
            waits.append(time.perf_counter() - begun)

        self.trainer.before_update.append(wait_for_staging)
        try:
            step = self.step()
        finally:
            self.trainer.before_update.remove(wait_for_staging)
        response.upload_completion.result()
        e2e = uploaded.result() - start
        restore = self._dcp_load(folder, saved)
        self.clean(folder)
        return {"blocking_s": returned + waits[0], "save_return_s": returned, "update_wait_s": waits[0],
                "step_s": step, "e2e_s": e2e, "restore_s": restore}

    def floor_buffers(self) -> list[torch.Tensor]:
        """The floors' host buffers, one per tensor of the state (pinned on a GPU), made when
        their phase first asks (no earlier phase holds them) and touched by that first copy."""
        if not self.buffers:
            from longrun.checkpoint.snapshot import tensors_of

            self.sources = [t.detach() for _, t in tensors_of(self.trainer.state_dict())]
            self.buffers = [torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=self.on_gpu)
                            for t in self.sources]
        return self.buffers

    def memcpy(self) -> dict[str, float]:
        """The blocking floor: the same tensors (gathered once, no tree walk in the timed region)
        copied with the same intra-op threads into buffers touched before; the summary takes
        the fastest rep, since a floor is what the copy can do, not what it did on average."""
        buffers = self.floor_buffers()
        sync_device()
        start = time.perf_counter()
        for dst, src in zip(buffers, self.sources, strict=True):
            dst.copy_(src, non_blocking=self.on_gpu)
        sync_device()
        return {"blocking_s": time.perf_counter() - start}

    def disk(self) -> dict[str, float]:
        """The floor (`dd`-style): the state's bytes, already in host memory (the memcpy
        method's buffers: no extra copy of the state), written sequentially in large chunks
        with no serialisation or checksum, fsynced with the directory; then read back cold
        twice: into the same buffers (pages touched before: the disk alone), and into one
        fresh anonymous mapping never touched (the disk plus the first touch of every page,
        what a restarted process's restore reads into)."""
        folder = os.path.join(self.root, "disk")
        os.makedirs(folder, exist_ok=True)
        path = os.path.join(folder, "floor.bin")
        views = [_bytes(b) for b in self.floor_buffers()]
        nbytes = sum(len(v) for v in views)
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
        read_into(path, views)
        read = time.perf_counter() - start
        evict(folder)
        fresh = mmap.mmap(-1, max(nbytes, 1))  # unmapped again at close: held only for this read
        try:
            start = time.perf_counter()
            with memoryview(fresh) as view:
                read_into(path, [view[:nbytes]])
            read_fresh = time.perf_counter() - start
        finally:
            fresh.close()
        self.clean(folder)
        return {"blocking_s": write, "e2e_s": write, "restore_s": read, "restore_fresh_s": read_fresh}

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

    def release(self, phase: tuple[str, ...]) -> None:
        """Free what `phase`'s methods kept between saves, before the next phase allocates its own."""
        if "longrun" in phase:
            # save() registered its hook on the trainer, which would keep the buffers alive.
            self.trainer.before_update.remove(self.ckpt.before_update)
            self.ckpt.close()
            self.ckpt = None  # and with it its staging buffers
        if "dcp_cached" in phase:
            self.stager.close()
        if "dcp_async_staging" in phase:
            self.async_stager.close()
        if "memcpy" in phase:
            self.sources, self.buffers = [], []
        gc.collect()
        # Hand what the allocator's heaps keep free back to the system (smaller tensors live
        # there, not in mappings of their own), so the next phase's peak is not this one's.
        trim = getattr(ctypes.CDLL(None), "malloc_trim", None)  # glibc's
        if trim is not None:
            trim(0)

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
