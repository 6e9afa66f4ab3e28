"""Run a function in `world` spawned processes joined into one gloo world (tests only).

Targets are `(rank, world, init_file, results)` functions in an importable test-helper module;
they put tuples on `results`, `(rank, "error", traceback)` on failure."""

from __future__ import annotations

import multiprocessing as mp

ctx = mp.get_context("spawn")


def run_world(target, world: int, tmp_path, per_rank: int = 1, timeout: float = 240,
              args: tuple = ()) -> list[tuple]:
    results = ctx.Queue()
    init_file = str(tmp_path / "init")
    procs = [ctx.Process(target=target, args=(r, world, init_file, results, *args))
             for r in range(world)]
    for p in procs:
        p.start()
    out = []
    try:
        while len(out) < world * per_rank:
            out.append(results.get(timeout=timeout))
            assert out[-1][1] != "error", out[-1][2]
        for p in procs:
            p.join(60)
            assert p.exitcode == 0, f"rank exited with {p.exitcode}"
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
    return sorted(out, key=lambda r: r[:2])
