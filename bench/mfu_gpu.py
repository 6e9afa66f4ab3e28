"""MFU of a ~1B-parameter Llama-style model on one GPU, trained through the longrun Trainer.

    .venv/bin/python bench/mfu_gpu.py                        # on a GPU machine
    .venv/bin/python bench/mfu_gpu.py --quick                # fewer steps
    .venv/bin/python bench/mfu_gpu.py --peak-tflops 989.4    # a GPU not in the table below
    .venv/bin/python bench/mfu_gpu.py --device cpu --tiny    # CPU dry run of the code path (hidden flags)

Target: >= 50% MFU on an H100 SXM (bf16, dense peak 989.4 TFLOP/s).

The model: dim 2048, 16 layers, 16 heads of 128, 8 KV heads (GQA), SwiGLU hidden 8192, max_seq_len
4096, vocab 260 (the byte tokenizer, so the embedding is negligible): 1.007e9 parameters without
the embedding (the Llama 3.2 1B shape, with 128-wide heads). bf16 autocast (training.dtype
'bfloat16'), fp32 master weights, fused AdamW, cluster.device 'cuda'. Data is synthetic
(data.source 'synthetic': lognormal document lengths, mean 1024, chunked to 4096) so no
corpus read matters. By default a step is 4 micro-batches of 8192 packed tokens.

`Trainer(cfg, peak_flops=...)` measures each step itself (data wait, forward/backward,
clipping, optimizer, a device synchronise at the end) and reports MFU with the PaLM FLOPs
count (6 N per token for the matmuls + the attention term, exact for packed documents via
sum(l^2) / sum(l)). After W warm-up steps, N timed steps; the medians of the Trainer's own
MFU and tokens/s are reported. The peak comes from a small table matched on
torch.cuda.get_device_name() (H100 SXM / H200 989.4, H100 PCIe 756, A100 312 TFLOP/s bf16
dense), or --peak-tflops; with neither, MFU is null and achieved TFLOP/s is still reported.

The attention kernel: model.py uses torch's varlen flash attention
(torch.nn.attention.varlen.varlen_attn) for CUDA tensors in half precision when torch has it,
and falls back for good to bucketed SDPA if a call fails. Reported: the path model.py took
(read from its module state after the run) and the attention operators seen in one extra,
profiled, untimed step.

Without a CUDA device the script prints why to stderr and {"skipped": "no CUDA device"} as
its last line, and exits 0. `--device cpu --tiny` (hidden flags) runs the same code path on
the CPU with a tiny model (dim 64, 2 layers) for 1 warm-up + 1 timed step + the profiled
step, with a placeholder peak of 1 TFLOP/s: a check that the script works, not a measurement.
Progress goes to stderr; the last line on stdout is one JSON object.

Issue 40's switches (each works with `--device cpu --tiny` too):

    --compile auto|none|blocks|model training.compile (default auto: blocks on CUDA; none: eager)
    --ac none|full|selective|budget  training.activation_checkpointing
    --ac-budget B                    training.activation_memory_budget (with --ac budget; 0.5)
    --profile                        device time of one profiled step by kind (matmul,
                                     elementwise, attention, communication, other), the
                                     share of the step the device was busy, and the 12
                                     heaviest kernels

Steps run through `Trainer.train` (numbers read one step late, no host synchronisation inside a
step), so the step time is the device's, between CUDA events.
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import sys

import torch
from _common import logger, parser

from longrun.config import config_from_dict
from longrun.trainer import Trainer
from longrun.trainer import model as model_module
from longrun.trainer.flops import peak_for

MODEL_1B = {"dim": 2048, "n_layers": 16, "n_heads": 16, "n_kv_heads": 8, "ffn_dim": 8192,
            "max_seq_len": 4096, "vocab_size": 260}
MODEL_TINY = {"dim": 64, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "max_seq_len": 256,
              "vocab_size": 260}
TINY_PEAK = 1e12  # placeholder for the CPU dry run
ATTENTION_OPS = ("attention", "attn", "flash", "varlen", "scaled_dot_product")
log = logger("mfu_gpu")


def make_config(model: dict, device: str, tokens: int, grad_accum: int, steps: int, *,
                compile_mode: str = "none", ac: str = "none", ac_budget: float = 0.5):
    return config_from_dict({
        "job": {"name": "bench-mfu-gpu", "seed": 0},
        "cluster": {"device": device},
        "model": model,
        "data": {"source": "synthetic", "micro_batch_tokens": tokens, "prefetch": 4},
        "training": {"steps": steps, "warmup_steps": min(10, steps), "grad_accum": grad_accum,
                     "dtype": "bfloat16", "compile": compile_mode, "activation_checkpointing": ac,
                     "activation_memory_budget": ac_budget},
    })


def attention_path(device: torch.device) -> str:
    """Which branch of model.packed_causal_attention the run took (bf16 autocast: half q/k/v)."""
    return model_module.attention_backend(device)


def profiled_attention_ops(trainer: Trainer) -> dict[str, int | str]:
    """Attention-related operator (and, on CUDA, kernel) names in one profiled step, with counts."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU]
    if trainer.device.type == "cuda":
        activities.append(ProfilerActivity.CUDA)
    with profile(activities=activities) as prof:
        trainer.train_step()
    return {e.key: e.count for e in prof.key_averages()
            if any(word in e.key.lower() for word in ATTENTION_OPS)}


def parse_args():
    cli = parser(__doc__)
    cli.add_argument("--quick", action="store_true", help="2 warm-up + 4 timed steps")
    cli.add_argument("--warmup", type=int, default=None, help="warm-up steps; default 3 (--quick 2)")
    cli.add_argument("--steps", type=int, default=None, help="timed steps; default 10 (--quick 4)")
    cli.add_argument("--tokens", type=int, default=8192, help="data.micro_batch_tokens (default 8192)")
    cli.add_argument("--grad-accum", type=int, default=4, help="micro-batches per step (default 4)")
    cli.add_argument("--layers", type=int, default=MODEL_1B["n_layers"], help="model.n_layers")
    cli.add_argument("--peak-tflops", type=float, default=None,
                     help="the GPU's bf16 dense peak in TFLOP/s (overrides the table)")
    cli.add_argument("--compile", choices=("auto", "none", "blocks", "model"), default="auto",
                     help="training.compile (default auto: blocks on CUDA)")
    cli.add_argument("--ac", choices=("none", "full", "selective", "budget"), default="none",
                     help="training.activation_checkpointing (default none)")
    cli.add_argument("--ac-budget", type=float, default=0.5,
                     help="training.activation_memory_budget, with --ac budget (default 0.5)")
    cli.add_argument("--profile", action="store_true",
                     help="device time of one profiled step by kind, and the busy share")
    cli.add_argument("--device", choices=("cuda", "cpu"), default="cuda", help=argparse.SUPPRESS)
    cli.add_argument("--tiny", action="store_true", help=argparse.SUPPRESS)
    return cli.parse_args()


def main() -> None:
    args = parse_args()
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)

    if args.device == "cuda" and not torch.cuda.is_available():
        log("no CUDA device: this benchmark measures GPU MFU and needs one; skipped "
            "(`--device cpu --tiny` dry-runs the code path on the CPU)")
        print(json.dumps({"skipped": "no CUDA device"}))
        return

    if args.tiny:
        model, tokens, grad_accum, warmup, steps = MODEL_TINY, 512, 1, 1, 1
    else:
        model, tokens, grad_accum = {**MODEL_1B, "n_layers": args.layers}, args.tokens, args.grad_accum
        warmup = args.warmup if args.warmup is not None else (2 if args.quick else 3)
        steps = args.steps or (4 if args.quick else 10)
    gpu, peak, source = peak_of(args)

    cfg = make_config(model, args.device, tokens, grad_accum, warmup + steps + 2,
                      compile_mode=args.compile, ac=args.ac, ac_budget=args.ac_budget)
    trainer = Trainer(cfg, peak_flops=peak, progress=False)
    bf16_parameters = bool(getattr(trainer.parallel, "casts_parameters", False))
    n_params = trainer.model.num_params()
    n_body = trainer.model.num_params(exclude_embedding=True)
    log(f"{gpu}: peak {peak / 1e12 if peak else float('nan'):.1f} TFLOP/s ({source}); model {model}: "
        f"{n_params:,} parameters, {n_body:,} without the embedding; {tokens} tokens x {grad_accum} "
        f"micro-batches per step, bf16 ({'bf16 parameters' if bf16_parameters else 'autocast'}), "
        f"compile {args.compile}, AC {args.ac}; {warmup} warm-up + {steps} timed steps")
    try:
        timed, ops = train(trainer, warmup, steps)
        breakdown = device_time_by_kind(trainer) if args.profile else None
    finally:
        trainer.close()

    path = attention_path(trainer.device)
    tok_s = statistics.median(m.tokens_per_s for m in timed)
    mfu = statistics.median(m.mfu for m in timed) if peak else None
    # Achieved model TFLOP/s, from the same FLOPs count the Trainer's MFU uses.
    tflops = mfu * peak / 1e12 if peak else None
    log(f"attention: {path}; profiled ops: {ops}")
    log(f"median over {steps} steps: {tok_s:,.0f} tok/s"
        + (f", {tflops:.2f} TFLOP/s, MFU {100 * mfu:.1f}%" if peak else "")
        + (" (dry run: not a measurement)" if args.device == "cpu" else " (target >= 50% on an H100)"))
    print(json.dumps({
        "mfu": round(mfu, 4) if mfu is not None else None, "tokens_per_s": round(tok_s, 1),
        "model_tflops": round(tflops, 2) if tflops is not None else None,
        "step_time_s": round(statistics.median(m.step_time_s for m in timed), 4),
        "memory_gib": round(max(m.memory_bytes for m in timed) / 2**30, 2),
        "attention": path, "attention_ops": ops, "profile": breakdown,
        "recompiles": timed[-1].recompiles if timed else None,
        "device": gpu, "peak_tflops": peak / 1e12 if peak else None, "peak_source": source,
        "params": n_params, "params_non_embedding": n_body,
        "config": {**model, "micro_batch_tokens": tokens, "grad_accum": grad_accum, "dtype": "bfloat16",
                   "compile": args.compile, "activation_checkpointing": args.ac,
                   "activation_memory_budget": args.ac_budget if args.ac == "budget" else None,
                   "bf16_parameters": bf16_parameters,
                   "data": "synthetic", "warmup": warmup, "steps": steps, "torch": torch.__version__},
        "dry_run": args.device == "cpu",
    }))


def peak_of(args) -> tuple[str, float | None, str]:
    """(device name, bf16 dense peak FLOP/s or None, where the peak came from)."""
    gpu = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    if args.peak_tflops:
        peak, source = args.peak_tflops * 1e12, "--peak-tflops"
    elif args.device == "cuda":
        peak, source = peak_for(gpu), "table"
    else:
        peak, source = TINY_PEAK, "dry-run placeholder"
    if peak is None:
        log(f"{gpu!r} is not in the peak-FLOPs table; MFU will be null (give --peak-tflops)")
    return gpu, peak, source


def train(trainer: Trainer, warmup: int, steps: int) -> tuple[list, dict]:
    """The warm-up and timed steps through `Trainer.train` (read one step late: the timed steps'
    metrics), then one profiled step's attention ops."""
    timed = []

    def record(m) -> None:
        phase = "warm-up" if m.step <= warmup else "timed"
        mfu = f"{100 * m.mfu:.1f}%" if m.mfu is not None else "n/a"
        log(f"step {m.step} ({phase}): {m.step_time_s * 1e3:.0f} ms, {m.tokens_per_s:,.0f} tok/s, "
            f"mfu {mfu}, loss {m.loss:.3f}, data wait {m.data_wait_s * 1e3:.1f} ms, "
            f"mem {m.memory_bytes / 2**30:.1f} GiB, recompiles {m.recompiles}")
        if m.step > warmup:
            timed.append(m)

    trainer.train(steps=warmup + steps, on_step=record)
    try:  # the profiler is a diagnostic: the measurement stands without it
        ops = profiled_attention_ops(trainer)
    except Exception as exc:
        ops = {"profiler failed": f"{type(exc).__name__}: {exc}"}
    return timed, ops


KINDS = (  # first match wins; names are lower-cased kernel (CUDA) or operator (CPU) names
    ("communication", ("nccl", "all_gather", "reduce_scatter", "all_reduce", "allreduce", "gloo")),
    ("attention", ("flash", "fmha", "attention", "attn", "varlen")),
    ("matmul", ("gemm", "matmul", "aten::mm", "aten::addmm", "aten::bmm", "cutlass", "xmma",
                "nvjet", "sm90", "sm80")),
    ("elementwise", ("elementwise", "vectorized", "triton", "reduce", "copy", "cast", "fill",
                     "aten::mul", "aten::add", "aten::to", "aten::copy_", "foreach", "fused_adam",
                     "aten::")),
)


def kind_of(name: str) -> str:
    lowered = name.lower()
    for kind, words in KINDS:
        if any(word in lowered for word in words):
            return kind
    return "other"


def device_time_by_kind(trainer: Trainer) -> dict:
    """One more step, profiled: device time by kind of kernel (on the CPU: operators' own time),
    the step's wall time, and the share of it the device was busy (kernel time over step time;
    overlapping streams can push it past 1)."""
    import time

    from torch.profiler import ProfilerActivity, profile

    cuda = trainer.device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        started = time.perf_counter()
        trainer.train_step()
        if cuda:
            torch.cuda.synchronize()
        wall = time.perf_counter() - started
    by_kind: dict[str, float] = {}
    by_name: dict[str, float] = {}
    launches = 0
    for event in prof.key_averages():
        if cuda:
            seconds = getattr(event, "self_device_time_total", 0.0) / 1e6
            if seconds <= 0 or event.device_type != torch.autograd.DeviceType.CUDA:
                continue
            launches += event.count
        else:
            seconds = event.self_cpu_time_total / 1e6
        by_kind[kind_of(event.key)] = by_kind.get(kind_of(event.key), 0.0) + seconds
        by_name[event.key] = by_name.get(event.key, 0.0) + seconds
    busy = sum(by_kind.values())
    return {"seconds_by_kind": {k: round(v, 5) for k, v in sorted(by_kind.items())},
            "share_by_kind": {k: round(v / busy, 4) for k, v in sorted(by_kind.items())} if busy else {},
            "step_wall_s": round(wall, 5), "device_busy_share": round(busy / wall, 4) if cuda else None,
            "kernel_launches": launches if cuda else None,
            # where the time goes, for the next change: the 12 heaviest kernels (operators on
            # the CPU), names cut to 90 characters
            "top": [[name[:90], round(seconds, 5), kind_of(name)] for name, seconds in
                    sorted(by_name.items(), key=lambda item: -item[1])[:12]]}


if __name__ == "__main__":
    main()
