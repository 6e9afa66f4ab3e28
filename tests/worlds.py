"""Run a function in `world` spawned processes joined into one gloo world (tests only).

Targets are `(rank, world, init_file, results, *args)` functions in an importable test-helper
module; they put tuples on `results`, `(rank, "error", traceback)` on failure. The spawning is
`longrun.testing.worlds.World`: a rank that dies is reported at once, with its exit code."""

from __future__ import annotations

from longrun.testing.worlds import World


def run_world(target, world: int, tmp_path, per_rank: int = 1, timeout: float = 240,
              args: tuple = ()) -> list[tuple]:
    out = []
    with World(target, world, tmp_path, args=args) as group:
        group.start()
        for _ in range(world * per_rank):
            out.append(group.get(timeout=timeout))  # `timeout` per result, as the callers expect
            assert out[-1][1] != "error", out[-1][2]
        group.join(60)
    return sorted(out, key=lambda r: r[:2])
