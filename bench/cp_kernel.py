"""The CP block kernel: flash (trainer/cp/flash.py, the default) against the float32 math kernel
(trainer/cp/kernel.py, the kernel before issue 40) on the same block, forward + backward.

    .venv/bin/python bench/cp_kernel.py                                        # on a GPU machine
    .venv/bin/python bench/cp_kernel.py --tokens 8192 32768 --ring 2 4 8 --reps 5
    .venv/bin/python bench/cp_kernel.py --device cpu --tokens 256 --ring 2 --reps 1   # dry run

One document of T tokens on a ring of n members, each holding T/n consecutive tokens (one
block). Two blocks per (T, n): a diagonal block (a member's queries against its own keys:
causal) and an off-diagonal block (the queries against the previous member's keys: all
visible). Each block runs through the kernel interface the ring drives (`one_block`: forward,
then backward with the merged output and log-sum-exp), 16 query heads, 8 K/V heads (GQA) of
128, bf16 inputs on CUDA (float32 on the CPU); the block's plan (masks for the math kernel,
segments for flash) is made once, as the ring does per micro-batch, and timed on its own.
Both kernels run in the same process, alternating, one warm-up each, then the median of --reps.
Peak memory is the most allocated above the inputs during the timed runs (CUDA only); an
out-of-memory is recorded as the row's result. Each row also says how far flash's output and
dq are from the math kernel's (relative to the largest), so the two did the same work.
Progress goes to stderr; the last line on stdout is one JSON object.
"""

from __future__ import annotations

import datetime
import json
import statistics
import time

import numpy as np
import torch
from _common import logger, parser

from longrun.trainer.cp.flash import MATH, block_kernel, one_block
from longrun.trainer.cp.layout import TokenStream

HEADS, KV_HEADS, HEAD_DIM = 16, 8, 128
log = logger("cp_kernel")


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _streams(tokens: int, ring: int, diagonal: bool) -> tuple[TokenStream, TokenStream]:
    """The second member's queries and, diagonal, its own keys or, off-diagonal, the first's."""
    c = tokens // ring
    lengths = np.array([tokens])
    q = TokenStream(np.zeros(c, np.int64), np.arange(c, 2 * c), lengths)
    k = TokenStream(np.zeros(c, np.int64), np.arange(c, 2 * c) if diagonal else np.arange(c), lengths)
    return q, k


def measure(kernel, q_stream, k_stream, inputs, device, reps: int) -> dict:
    start = time.perf_counter()
    plan = kernel.plan(q_stream, k_stream, device)
    _sync(device)
    plan_s = time.perf_counter() - start
    result = one_block(kernel, plan, *inputs)  # warm-up; kept to compare the kernels
    _sync(device)
    base = 0
    if device.type == "cuda":
        base = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        one_block(kernel, plan, *inputs)
        _sync(device)
        times.append(time.perf_counter() - start)
    row = {"s": round(statistics.median(times), 6), "plan_s": round(plan_s, 6)}
    if device.type == "cuda":
        row["peak_gib"] = round((torch.cuda.max_memory_allocated(device) - base) / 2**30, 3)
    return row | {"_result": result}


def _rel(a, b) -> float:
    return float(f"{float((a.float() - b.float()).abs().max() / b.float().abs().max()):.3g}")


def run_case(tokens: int, ring: int, diagonal: bool, device, dtype, reps: int) -> dict:
    c = tokens // ring
    g = torch.Generator(device=device).manual_seed(0)
    inputs = tuple(torch.randn(c, n, HEAD_DIM, generator=g, device=device).to(dtype)
                   for n in (HEADS, KV_HEADS, KV_HEADS, HEADS))  # q, k, v, dout
    q_stream, k_stream = _streams(tokens, ring, diagonal)
    row: dict = {"tokens": tokens, "ring": ring, "block": c, "diagonal": diagonal}
    kernels = {}
    try:
        kernels["flash"] = block_kernel("flash", inputs[0])
    except ValueError as exc:
        row["flash"] = {"error": str(exc)}
    kernels["math"] = MATH
    results = {}
    for name, kernel in kernels.items():
        try:
            measured = measure(kernel, q_stream, k_stream, inputs, device, reps)
            results[name] = measured.pop("_result")
            row[name] = measured
        except torch.OutOfMemoryError as exc:  # an out-of-memory is a result too
            row[name] = {"error": f"OutOfMemoryError: {str(exc)[:160]}"}
        if device.type == "cuda":
            torch.cuda.empty_cache()
    if "s" in row.get("flash", {}) and "s" in row["math"]:
        row["speedup"] = round(row["math"]["s"] / row["flash"]["s"], 2)
        row["flash_vs_math"] = {"out": _rel(results["flash"][0], results["math"][0]),
                                "dq": _rel(results["flash"][1], results["math"][1])}
    return row


def main() -> None:
    cli = parser(__doc__)
    cli.add_argument("--device", default="cuda")
    cli.add_argument("--tokens", type=int, nargs="+", default=[8192, 32768])
    cli.add_argument("--ring", type=int, nargs="+", default=[2, 4, 8])
    cli.add_argument("--reps", type=int, default=5)
    args = cli.parse_args()
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        log("no CUDA device: nothing measured (use --device cpu for a dry run)")
        print(json.dumps({"skipped": "no CUDA device"}))
        return
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    if device.type == "cpu":
        log("CPU dry run: the code path, not a measurement")
    rows = []
    for tokens in args.tokens:
        for ring in args.ring:
            for diagonal in (True, False):
                row = run_case(tokens, ring, diagonal, device, dtype, args.reps)
                log(json.dumps(row))
                rows.append(row)
    print(json.dumps({
        "bench": "cp_kernel", "device": torch.cuda.get_device_name(device) if device.type == "cuda"
        else "cpu", "dry_run": device.type != "cuda", "torch": torch.__version__,
        "date": datetime.date.today().isoformat(), "dtype": str(dtype).removeprefix("torch."),
        "heads": HEADS, "kv_heads": KV_HEADS, "head_dim": HEAD_DIM, "reps": args.reps,
        "rows": rows}))


if __name__ == "__main__":
    main()
