"""Dynamic context parallelism vs static CP: simulated at scale, measured for real on CPU.

    .venv/bin/python bench/dynamic_cp.py            # ~6 min: simulation + 4 and 2 real ranks
    .venv/bin/python bench/dynamic_cp.py --quick    # ~2 min: smaller simulation, 4 ranks
    .venv/bin/python bench/dynamic_cp.py --calibration h100-paper   # on paper: H100s, Llama 3 8B

Both strategies train the *same* global batches; static CP sizes every CP group for the
longest sequence (Megatron's baseline: static CP4 for 8192 tokens at 2048 per rank) and packs
sequences by token count; dynamic CP lets the solver pick a CP size per micro-batch.

Simulated: the cost model calibrated on this machine (2 gloo ranks) predicts one global batch
at 8, 64 and 512 ranks, on Megatron's length distribution (lognormal, min 128 / max 8192 /
mean 1024 / sigma 1.5, budget 2048 tokens per rank) and on the Python standard library's files
chunked to 8192 tokens (a real code corpus). A global batch holds 4 x ranks x budget tokens.

Measured: W gloo processes on CPU, a tiny model, the same distribution scaled down by 8 (so
that static CP = W), a few global batches, both strategies alternating; the time of a step's
forward+backward (gradient sync included) on the slowest rank, and the plans' predictions.

`--calibration h100-paper`: no measurement; the simulation's cost model comes from published
H100 figures (`longrun.trainer.cp.published`: FlashAttention-3's attention throughput, NVIDIA's
GEMM peak, NVLink and 400 Gb/s InfiniBand) for the 64-GPU example's model (Llama 3 8B's
shape), with the CP groups' transfers over NVLink and, separately, over InfiniBand.

Progress goes to stderr; the last line on stdout is one JSON object:
{"simulated": {"speedup_8", "speedup_64", "speedup_512", ...},
 "measured": {"static_s", "dynamic_s", "speedup", "predicted_speedup", ...}}
"""

from __future__ import annotations

import json
import statistics
import tempfile
import time

import numpy as np
from _common import logger, parser

from longrun.testing.worlds import World

log = logger("dynamic_cp")


# --- global batches ----------------------------------------------------------------------------


def megatron_batch(rng, tokens: int, *, min_len=128, max_len=8192, mean=1024) -> np.ndarray:
    """Lognormal lengths (Megatron's Dynamic-CP benchmark) until `tokens` would be exceeded."""
    from longrun.trainer.cp.planner import megatron_lengths

    pool = megatron_lengths(max(tokens // mean * 4, 16), rng, min_len=min_len, max_len=max_len,
                            mean=mean)
    total = np.cumsum(pool)
    return pool[:max(int(np.searchsorted(total, tokens, side="right")), 1)]


def corpus_batch(chunk_lengths: np.ndarray, rng, tokens: int) -> np.ndarray:
    pool = rng.permutation(chunk_lengths)
    total = np.cumsum(pool)
    return pool[:max(int(np.searchsorted(total, tokens, side="right")), 1)]


def stdlib_chunk_lengths(max_len: int) -> np.ndarray:
    from longrun.config import config_from_dict
    from longrun.data.byte_tokenizer import ByteTokenizer
    from longrun.data.documents import build_corpus

    cfg = config_from_dict({"job": {"name": "lengths"}, "model": {"max_seq_len": max_len},
                            "data": {"source": "text", "path": "stdlib",
                                     "micro_batch_tokens": max_len}})
    return build_corpus(cfg.data, cfg.model, ByteTokenizer(cfg.model.vocab_size), 0).chunk_lengths


# --- measured ----------------------------------------------------------------------------------


def config(args, world: int):
    from longrun.config import config_from_dict

    return config_from_dict({
        "job": {"name": "dynamic-cp-bench", "seed": 0},
        "cluster": {"device": "cpu", "workers_per_node": world},
        "parallelism": {"dp": 1, "cp": world, "dynamic_cp": True},
        "model": {"dim": args.dim, "n_layers": args.layers, "n_heads": args.heads,
                  "n_kv_heads": args.kv_heads, "max_seq_len": args.budget * world},
        "data": {"source": "synthetic", "micro_batch_tokens": args.budget, "prefetch": 0},
    })


def build_trainers(rank: int, world: int, args, calib_dir: str):
    """A static-CP and a dynamic-CP trainer of the same model, over the same groups (formed
    on the world this rank joined); the cost model both plan with."""
    from dataclasses import replace

    from longrun.commgroup import form_groups, single_node_layout
    from longrun.trainer import Trainer
    from longrun.trainer.cp.batches import setup_from_parallel_groups
    from longrun.trainer.cp.calibration import load_or_calibrate
    from longrun.trainer.cp.planner import CostModel

    cfg = config(args, world)
    b = args.budget
    placeholder = CostModel.for_model(cfg.model, linear_s_per_token=1.0, attn_s_per_token2=0.0,
                                      ring_block_s_per_token2=0.0, p2p_latency_s=0.0,
                                      p2p_s_per_byte=0.0, micro_batch_overhead_s=0.0)
    groups = form_groups(single_node_layout(cfg.dims), rank)  # every dynamic-CP size of the span
    static = replace(cfg.dims, dynamic_cp=False)  # static CP over the whole span: cp = world
    setups = {"static": setup_from_parallel_groups(groups, cost=placeholder, dims=static),
              "dynamic": setup_from_parallel_groups(groups, cost=placeholder)}
    trainers = {k: Trainer(cfg, "cpu", context_parallel=s, progress=False) for k, s in setups.items()}
    # Calibrated once, through the static trainer (it has the full-width CP group), on lengths
    # typical of the data; both strategies plan with the same model.
    typical = megatron_batch(np.random.default_rng(7), 64 * b, min_len=b // 16, max_len=b * world,
                             mean=b // 2)
    cost = load_or_calibrate(calib_dir, trainers["static"], typical)
    setups["dynamic"].cost = cost
    return setups, trainers, cost, groups


def rank_main(rank: int, world: int, init_file: str, results, args, calib_dir: str) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    from longrun.trainer.cp.batches import plan_step

    setups, trainers, cost, groups = build_trainers(rank, world, args, calib_dir)
    b = args.budget
    rng = np.random.default_rng(42)  # the same batches on every rank
    batches = [megatron_batch(rng, world * b * args.accum, min_len=b // 16, max_len=b * world,
                              mean=b // 2) for _ in range(args.steps + 1)]
    times = {k: [] for k in setups}
    predicted = {k: [] for k in setups}
    plan_s = []
    for i, lengths in enumerate(batches):
        docs = [rng.integers(0, 256, size=int(n)) for n in lengths]
        order = list(setups) if i % 2 == 0 else list(reversed(setups))
        for name in order:
            start = time.perf_counter()
            step = plan_step(docs, setups[name], b)
            if name == "dynamic":
                plan_s.append(time.perf_counter() - start)
            trainer = trainers[name]
            dist.barrier()
            start = time.perf_counter()
            trainer.optimizer.zero_grad(set_to_none=True)
            trainer.forward_backward_planned(step)
            dist.barrier()  # the step is as long as its slowest rank
            if i > 0:  # the first batch warms up (allocator, DDP buckets)
                times[name].append(time.perf_counter() - start)
                predicted[name].append(cost.step_time(step.plan))
        if rank == 0 and i > 0:
            log(f"world {world} batch {i}/{args.steps} ({len(lengths)} sequences): "
                + "  ".join(f"{k} {times[k][-1]:.2f} s (predicted {predicted[k][-1]:.2f})"
                            for k in setups))
    if rank == 0:
        results.put({"times": times, "predicted": predicted, "plan_s": plan_s,
                     "cost": json.loads(cost.to_json()),
                     "sizes": step.plan.summary()["sequences_per_cp"] if name == "dynamic" else None})
    dist.barrier()
    for t in trainers.values():
        t.close()
    groups.teardown()
    dist.destroy_process_group()


def measure(args, world: int, calib_dir: str) -> dict:
    with World(rank_main, world, args=(args, calib_dir)) as ranks:
        [out] = ranks.run(1, timeout=3600)  # rank 0 reports for all
    static_s, dynamic_s = (statistics.mean(out["times"][k]) for k in ("static", "dynamic"))
    pred_static, pred_dynamic = (statistics.mean(out["predicted"][k]) for k in ("static", "dynamic"))
    errors = {k: statistics.mean(abs(p - m) / m for p, m in
                                 zip(out["predicted"][k], out["times"][k], strict=True))
              for k in ("static", "dynamic")}
    result = {
        "world": world, "static_s": round(static_s, 3), "dynamic_s": round(dynamic_s, 3),
        "speedup": round(static_s / dynamic_s, 3),
        "predicted_speedup": round(pred_static / pred_dynamic, 3),
        "prediction_error": {k: round(v, 3) for k, v in errors.items()},
        "plan_ms": round(1e3 * statistics.mean(out["plan_s"]), 1),
        "cost": out["cost"],
    }
    log(f"world {world}: static {static_s:.2f} s, dynamic {dynamic_s:.2f} s per step -> "
        f"{result['speedup']:.2f}x measured, {result['predicted_speedup']:.2f}x predicted; "
        f"prediction error static {errors['static']:.0%}, dynamic {errors['dynamic']:.0%}")
    return result


# --- simulated ---------------------------------------------------------------------------------


def simulate(cost, ranks: list[int], batches: int, corpus: np.ndarray | None) -> dict:
    """Predicted static vs dynamic time per global batch (4 x ranks x budget tokens).
    megatron: the distribution as specified (budget 2048); megatron/8: lengths and budget
    scaled down by 8, the regime the measured runs use; stdlib: the corpus's chunk lengths."""
    from longrun.trainer.cp.planner import plan_dynamic, plan_static

    cases = {"megatron": 2048, "megatron/8": 256} | ({"stdlib": 2048} if corpus is not None else {})
    out = {}
    for name, budget in cases.items():
        for n in ranks:
            rng = np.random.default_rng(n)
            static_t = dynamic_t = plan_t = 0.0
            for _ in range(batches):
                tokens = 4 * n * budget
                if name == "stdlib":
                    lengths = corpus_batch(corpus, rng, tokens)
                else:
                    k = 2048 // budget
                    lengths = megatron_batch(rng, tokens, min_len=128 // k, max_len=8192 // k,
                                             mean=1024 // k)
                cp = max(1, 1 << int(np.ceil(np.log2(-(-int(lengths.max()) // budget)))))
                static_t += cost.step_time(plan_static(lengths, n, budget, cost, cp))
                start = time.perf_counter()
                dynamic_t += cost.step_time(plan_dynamic(lengths, n, budget, cost))
                plan_t = max(plan_t, time.perf_counter() - start)
            key = {"megatron": "", "megatron/8": "scaled_", "stdlib": "stdlib_"}[name] + str(n)
            out[f"speedup_{key}"] = round(static_t / dynamic_t, 3)
            log(f"simulated {name:10s} {n:4d} ranks: static {static_t / batches:.3f} s, "
                f"dynamic {dynamic_t / batches:.3f} s per global batch -> "
                f"{static_t / dynamic_t:.2f}x (slowest plan {plan_t * 1e3:.0f} ms)")
    return out


def on_paper(args) -> None:
    """The simulation with the H100 cost model from published figures, NVLink and InfiniBand."""
    import os

    from longrun.config import load_config
    from longrun.trainer.cp.published import h100_cost_model

    example = load_config(os.path.join(os.path.dirname(__file__), "..", "examples", "llama-8b-64gpu.yaml"))
    out = {"calibration": "h100-paper", "model": "llama-8b-64gpu.yaml's (Llama 3 8B shape)"}
    for link in ("nvlink", "ib"):
        cost = h100_cost_model(example.model, link=link)
        log(f"{link}: {cost}")
        sims = simulate(cost, [8, 64, 512], 1 if args.quick else 3, None)
        out[link] = {k: v for k, v in sims.items() if not k.startswith("speedup_scaled")}
    print(json.dumps(out))


def planning_time(cost) -> float:
    """Seconds to plan 8,192 Megatron-distributed sequences for 256 ranks (one core)."""
    from longrun.trainer.cp.planner import megatron_lengths, plan_dynamic

    lengths = megatron_lengths(8192, np.random.default_rng(0))
    start = time.perf_counter()
    plan_dynamic(lengths, 256, 2048, cost)
    return time.perf_counter() - start


def main() -> None:
    cli = parser(__doc__.split("\n")[0])
    cli.add_argument("--budget", type=int, default=256, help="tokens per rank (measured part)")
    cli.add_argument("--dim", type=int, default=128)
    cli.add_argument("--layers", type=int, default=4)
    cli.add_argument("--heads", type=int, default=4)
    cli.add_argument("--kv-heads", type=int, default=2)
    cli.add_argument("--accum", type=int, default=4, help="global batch = world x budget x accum")
    cli.add_argument("--steps", type=int, default=4, help="timed global batches per world")
    cli.add_argument("--worlds", type=int, nargs="+", default=[4, 2], help="real ranks to measure")
    cli.add_argument("--quick", action="store_true", help="4 ranks only, 2 steps, 1 batch simulated")
    cli.add_argument("--calibration", choices=("measured", "h100-paper"), default="measured",
                     help="the simulation's cost model: measured here, or from published H100 figures")
    args = cli.parse_args()
    if args.calibration == "h100-paper":
        on_paper(args)
        return
    worlds = [4] if args.quick else args.worlds
    if args.quick:
        args.steps = 2
    from longrun.trainer.cp.planner import CostModel

    with tempfile.TemporaryDirectory() as calib_dir:
        measured = {w: measure(args, w, calib_dir) for w in worlds}
    # The simulation uses the calibration of the least oversubscribed world.
    cost = CostModel.from_json(json.dumps(measured[min(worlds)].pop("cost")))
    log(f"cost model: {cost}")
    corpus = None if args.quick else stdlib_chunk_lengths(8192)
    simulated = simulate(cost, [8, 64, 512], 1 if args.quick else 3, corpus)
    simulated["plan_8192_seqs_256_ranks_s"] = round(planning_time(cost), 3)
    log(f"planning 8,192 sequences for 256 ranks: {simulated['plan_8192_seqs_256_ranks_s']:.3f} s")
    for m in measured.values():
        m.pop("cost", None)
    head = measured[worlds[0]]
    print(json.dumps({
        "simulated": simulated,
        "measured": {k: head[k] for k in ("static_s", "dynamic_s", "speedup", "predicted_speedup")}
        | {"prediction_error": head["prediction_error"], "plan_ms": head["plan_ms"],
           "by_world": {str(w): m for w, m in measured.items()}},
    }))


if __name__ == "__main__":
    main()
