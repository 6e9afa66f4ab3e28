"""Self-check diagnostics run on every worker before each (re)start, as MegaScale does.

A node that fails is evicted (by policy) before it can take a new attempt down with it. Each
check is short (well under a second on a healthy machine) and answers one question:

- compute     does a matrix product on this device agree with a float64 CPU reference?
              (a bad GPU, a broken kernel, a flipped bit)
- memory      can this device allocate and touch the working memory it will need?
- collective  do this node's workers complete an all-reduce among themselves with the right
              sum? (the intra-node links, NVLink/PCIe or shared memory)
- store       is the Redis store reachable, and how long does a round trip take?
- nvml        on NVIDIA GPUs where pynvml is installed: no pending retired pages, no XID
              errors reported as critical (skipped elsewhere).

`run_diagnostics` runs the configured checks and returns a `NodeReport`; a failed check's
detail is one sentence naming what was wrong.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import timedelta

import torch

_LATENCY_LIMIT_S = 0.25  # a store this slow would stall rendezvous and heartbeats


@dataclass(frozen=True)
class CheckResult:
    name: str
    ok: bool
    seconds: float
    detail: str  # one sentence; what was measured, or what failed


@dataclass(frozen=True)
class NodeReport:
    node: str
    rank: int
    checks: tuple[CheckResult, ...] = field(default_factory=tuple)

    @property
    def ok(self) -> bool:
        return all(c.ok for c in self.checks)

    @property
    def reason(self) -> str:
        failed = [c for c in self.checks if not c.ok]
        return "; ".join(f"{c.name}: {c.detail}" for c in failed) if failed else "all checks passed"


def _timed(name: str, fn: Callable[[], tuple[bool, str]]) -> CheckResult:
    start = time.perf_counter()
    try:
        ok, detail = fn()
    except Exception as exc:  # a check that crashes has failed, with the reason
        ok, detail = False, f"{type(exc).__name__}: {exc}"
    return CheckResult(name, ok, time.perf_counter() - start, detail)


def compute_check(device: torch.device, *, size: int = 256,
                  matmul: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = torch.matmul) -> CheckResult:
    """`matmul` is the device's product under test (replaceable, so a broken one can be
    injected in tests)."""

    def run():
        gen = torch.Generator().manual_seed(1234)
        a = torch.randn(size, size, generator=gen, dtype=torch.float64)
        b = torch.randn(size, size, generator=gen, dtype=torch.float64)
        want = a @ b
        got = matmul(a.float().to(device), b.float().to(device)).double().cpu()
        # float32 accumulation over `size` terms: relative error ~1e-6; a broken unit is far off
        err = float((got - want).abs().max() / want.abs().max())
        return err < 1e-4, f"{size}x{size} product off by {err:.1e} (relative) against float64 on the CPU"

    return _timed("compute", run)


def memory_check(device: torch.device, nbytes: int) -> CheckResult:
    def run():
        buf = torch.empty(nbytes, dtype=torch.uint8, device=device)
        buf.fill_(0xA5)  # touch every page: an allocation alone may be lazy
        ok = bool((buf[:: max(nbytes // 4096, 1)] == 0xA5).all())
        del buf
        if device.type == "cuda":
            torch.cuda.empty_cache()
        return ok, f"allocated and wrote {nbytes / 2**20:.0f} MiB"

    return _timed("memory", run)


def collective_check(store: torch.distributed.Store, rank: int, size: int, device: torch.device,
                     timeout: timedelta = timedelta(seconds=30)) -> CheckResult:
    """An all-reduce among `size` workers (this node's) over a group made just for it from
    `store` (every participant passes a store with the same prefix); gloo on CPU, NCCL on GPU."""

    def run():
        import torch.distributed as dist

        if size == 1:
            return True, "one worker on the node: nothing to exchange"
        if device.type == "cuda":
            opts = dist.ProcessGroupNCCL.Options()
            opts._timeout = timeout
            group = dist.ProcessGroupNCCL(store, rank, size, opts)
        else:
            group = dist.ProcessGroupGloo(store, rank, size, timeout)
        t = torch.full((1024,), float(rank + 1), device=device)
        group.allreduce([t]).wait(timeout)
        want = size * (size + 1) / 2
        ok = bool((t == want).all())
        return ok, f"all-reduce over {size} workers gave {float(t[0])} (expected {want})"

    return _timed("collective", run)


def store_check(redis_url: str, *, pings: int = 10, client=None) -> CheckResult:
    """Round trips to Redis: on `client` (a worker's own connection) or a client opened for it."""
    def run():
        import redis

        own = client is None
        pinged = client
        if own:
            pinged = redis.Redis.from_url(redis_url, socket_connect_timeout=5, socket_timeout=5)
        try:
            times = []
            for _ in range(pings):
                start = time.perf_counter()
                pinged.ping()
                times.append(time.perf_counter() - start)
        finally:
            if own:
                pinged.close()
        median = statistics.median(times)
        return median < _LATENCY_LIMIT_S, f"median round trip {median * 1e3:.2f} ms over {pings} pings"

    return _timed("store", run)


def nvml_check(device: torch.device) -> CheckResult | None:
    """None where it does not apply (not CUDA, or pynvml not installed)."""
    if device.type != "cuda":
        return None
    try:
        import pynvml
    except ImportError:
        return None

    def run():
        pynvml.nvmlInit()
        try:
            handle = pynvml.nvmlDeviceGetHandleByIndex(device.index or 0)
            pending = pynvml.nvmlDeviceGetRetiredPagesPendingStatus(handle)
            return not pending, "retired pages pending a reset" if pending else "no pending retired pages"
        finally:
            pynvml.nvmlShutdown()

    return _timed("nvml", run)


def run_diagnostics(checks: Sequence[str], *, node: str, rank: int, device: torch.device,
                    redis_url: str | None = None, memory_bytes: int = 256 * 2**20,
                    node_group: tuple[torch.distributed.Store, int, int] | None = None,
                    store_client=None, collective_timeout: timedelta = timedelta(seconds=30)) -> NodeReport:
    """Run `checks` (names from `recovery.diagnostics`) on this worker. `node_group` is
    (store, local rank, local size) for the collective check, whose group and all-reduce wait
    `collective_timeout` at most; without it, it is skipped. `store_client`: the connection the
    store check pings on (None: one opened for it)."""
    results: list[CheckResult] = []
    for name in checks:
        if name == "compute":
            results.append(compute_check(device))
        elif name == "memory":
            results.append(memory_check(device, memory_bytes))
        elif name == "collective" and node_group is not None:
            results.append(collective_check(*node_group, device, timeout=collective_timeout))
        elif name == "store" and redis_url is not None:
            results.append(store_check(redis_url, client=store_client))
        elif name not in ("collective", "store"):
            raise ValueError(f"unknown diagnostic {name!r}; known: compute, memory, collective, store")
    extra = nvml_check(device)
    if extra is not None:
        results.append(extra)
    return NodeReport(node, rank, tuple(results))
