"""`data prepare` throughput: tokens/s with worker processes vs a plain `encode_batch` loop.

    .venv/bin/python bench/data.py            # ~12 MB of the standard library's .py files, 3 reps
    .venv/bin/python bench/data.py --quick    # ~6 MB, 1 rep

The corpus is the running interpreter's standard library (.py files in sorted order, up to
--mb megabytes, tests excluded), and the tokenizer a byte-level BPE of --vocab ids trained on its first 2 MB
(`train_bpe`, not timed). Side by side in one run, alternating the order across reps (medians):
  prepare   - `longrun.data.prepare.prepare(files, tok, out, workers=--workers)` end to end:
              reading, worker start-up, tokenising, writing .bin/.idx with sha256 and fsync,
              manifest after every shard. tokens/s = tokens written / wall time.
  baseline  - the plain way in one process: the same documents read by the same readers,
              batched like prepare batches them, `Tokenizer.encode_batch(texts)` (the library's
              default Rayon threads), tokens counted from `.ids`; nothing written.
  baseline_1thread - the same loop with RAYON_NUM_THREADS=1, in a child process (one core).
Target (issue 19): prepare >= 1.5x the baseline with 2 worker processes. The machine's load
average is printed: other processes on these 2 cores skew everything.
  data wait - the tiny model (dim 128, 2 layers, 2,048-token micro-batches) trained from the
              prepared shards: time blocked on data over step time (target: below 1%).
Progress goes to stderr; the last line on stdout is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

from _common import logger, parser

from longrun.data.prepare import BATCH_CHARS, prepare
from longrun.data.sources import iter_documents, resolve_inputs
from longrun.data.tokenizers import train_bpe

log = logger("data")


def corpus(mb: float) -> list[str]:
    files, total = [], 0
    for path in sorted(Path(sysconfig.get_paths()["stdlib"]).rglob("*.py")):
        if "site-packages" in path.parts or "test" in path.parts:
            continue
        files.append(str(path))
        total += path.stat().st_size
        if total >= mb * 1e6:
            break
    return files


def baseline(files: list[str], tok_dir: str) -> tuple[int, float]:
    """(tokens, seconds) of the plain loop: read, batch, encode_batch, count."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(Path(tok_dir) / "tokenizer.json"))
    tok.encode_special_tokens = True  # as prepare: a "<s>" in the text is text (the stdlib has some)
    start = time.perf_counter()
    tokens, texts, chars = 0, [], 0
    for doc in iter_documents(resolve_inputs(files)):
        texts.append(doc.text)
        chars += len(doc.text)
        if chars >= BATCH_CHARS:
            tokens += sum(len(e.ids) for e in tok.encode_batch(texts, add_special_tokens=False))
            texts, chars = [], 0
    if texts:
        tokens += sum(len(e.ids) for e in tok.encode_batch(texts, add_special_tokens=False))
    return tokens, time.perf_counter() - start


def baseline_one_thread(files: list[str], tok_dir: str) -> tuple[int, float]:
    args = json.dumps({"files": files, "tok": tok_dir})
    out = subprocess.run([sys.executable, __file__, "--baseline-child", args], capture_output=True,
                         text=True, check=True, env={**os.environ, "RAYON_NUM_THREADS": "1"})
    tokens, seconds = json.loads(out.stdout.strip().splitlines()[-1])
    return tokens, seconds


def ours(files: list[str], tok_dir: str, workers: int) -> tuple[int, float]:
    out = tempfile.mkdtemp(prefix="bench-data-")
    try:
        start = time.perf_counter()
        manifest = prepare(files, tok_dir, out, workers=workers, progress=False)
        return manifest["tokens"], time.perf_counter() - start
    finally:
        shutil.rmtree(out, ignore_errors=True)


def data_wait(files: list[str], tok_dir: str, steps: int) -> dict[str, float]:
    """Train the tiny model from shards prepared from `files` (data.source: tokens) and return
    the share of step time spent waiting for data (the prefetch thread reads the memory-mapped
    shards, packs and plans while the step before computes). The first steps are warm-up."""
    from longrun.config import config_from_dict
    from longrun.trainer import Trainer

    out = tempfile.mkdtemp(prefix="bench-data-shards-")
    try:
        prepare(files, tok_dir, out, workers=2, progress=False)
        cfg = config_from_dict({
            "job": {"name": "bench-data-wait", "seed": 0},
            "cluster": {"device": "cpu"},
            "model": {"dim": 128, "n_layers": 2, "n_heads": 4, "max_seq_len": 256},
            "data": {"source": "tokens", "path": out, "tokenizer": tok_dir, "micro_batch_tokens": 2048,
                     "prefetch": 4},
            "training": {"steps": steps, "warmup_steps": 2, "log_every": 1000},
            "checkpoint": {"dir": os.path.join(out, "ckpt")},
        })
        waits, times = [], []
        with Trainer(cfg, progress=False) as trainer:
            trainer.train(on_step=lambda m: (waits.append(m.data_wait_s), times.append(m.step_time_s)))
        warm = max(1, steps // 5)
        return {"data_wait_fraction": sum(waits[warm:]) / sum(times[warm:]),
                "step_s": statistics.median(times[warm:]), "steps": steps}
    finally:
        shutil.rmtree(out, ignore_errors=True)


def main() -> None:
    p = parser(__doc__)
    p.add_argument("--quick", action="store_true", help="~6 MB, 1 rep")
    p.add_argument("--mb", type=float, help="corpus size in MB (default 12, quick 6)")
    p.add_argument("--reps", type=int, help="default 3, quick 1")
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--baseline-child", help=argparse.SUPPRESS)  # the one-thread baseline's process
    args = p.parse_args()
    if args.baseline_child:
        spec = json.loads(args.baseline_child)
        print(json.dumps(baseline(spec["files"], spec["tok"])))
        return
    mb = args.mb or (6 if args.quick else 12)
    reps = args.reps or (1 if args.quick else 3)
    files = corpus(mb)
    size = sum(os.path.getsize(f) for f in files)
    log(f"corpus: {len(files)} files, {size / 1e6:.1f} MB; training a BPE of {args.vocab} ids on 2 MB")
    with tempfile.TemporaryDirectory(prefix="bench-data-tok-") as tok_dir:
        train_bpe(corpus(2), args.vocab, tok_dir, progress=False)
        methods = {"prepare": lambda: ours(files, tok_dir, args.workers),
                   "baseline": lambda: baseline(files, tok_dir),
                   "baseline_1thread": lambda: baseline_one_thread(files, tok_dir)}
        results: dict[str, list[float]] = {name: [] for name in methods}
        tokens: dict[str, int] = {}
        for rep in range(reps):
            order = list(methods) if rep % 2 == 0 else list(reversed(methods))
            for name in order:
                n, seconds = methods[name]()
                tokens[name] = n
                results[name].append(n / seconds)
                log(f"rep {rep + 1}/{reps} {name}: {n:,} tokens in {seconds:.2f} s "
                    f"= {n / seconds:,.0f} tok/s")
        log("training the tiny model from the prepared shards (data wait)")
        wait = data_wait(files, tok_dir, 30 if args.quick else 60)
        log(f"data wait {100 * wait['data_wait_fraction']:.2f}% of step time (step {wait['step_s']:.3f} s)")
    if len(set(tokens.values())) != 1:
        raise SystemExit(f"the methods disagree on the token count: {tokens}")
    median = {name: statistics.median(v) for name, v in results.items()}
    summary = {
        "corpus_mb": round(size / 1e6, 2), "files": len(files), "tokens": tokens["prepare"],
        "vocab": args.vocab, "workers": args.workers, "reps": reps, "cpus": os.cpu_count(),
        "load_average_1m": round(os.getloadavg()[0], 2),
        "prepare_tokens_per_s": round(median["prepare"]),
        "baseline_tokens_per_s": round(median["baseline"]),
        "baseline_1thread_tokens_per_s": round(median["baseline_1thread"]),
        "ratio_vs_baseline": round(median["prepare"] / median["baseline"], 3),
        "ratio_vs_1thread": round(median["prepare"] / median["baseline_1thread"], 3),
        "target_ratio": 1.5,
        **wait,
    }
    log(f"prepare {summary['prepare_tokens_per_s']:,} tok/s, baseline {summary['baseline_tokens_per_s']:,} "
        f"tok/s ({summary['ratio_vs_baseline']}x), one thread {summary['baseline_1thread_tokens_per_s']:,} "
        f"tok/s ({summary['ratio_vs_1thread']}x); load average {summary['load_average_1m']}")
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
