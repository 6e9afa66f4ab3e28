"""Each epoch's order of a corpus's items: one permutation per (seed, epoch, number of items),
computed once and memory-mapped by every other process.

The order is `np.random.default_rng([seed, epoch]).permutation(n)`, as it has always been, so
positions saved in checkpoints name the same documents. Every rank needs the whole order (each
draws every global batch), which at N items is N x 8 bytes per rank and a shuffle of N per rank
per epoch; `SharedOrders` keeps it in the corpus's index cache instead (`index_cache.py`): the
first rank to reach an epoch writes it, the others map it. Orders of fewer than
`SHARED_MIN_ITEMS` items are computed in memory: a file would cost more than it saves, and a
small corpus runs through many epochs, each of which would leave a file.
"""

from __future__ import annotations

import numpy as np

from longrun.data.index_cache import IndexCache

SHARED_MIN_ITEMS = 1 << 16  # 512 KiB per private copy: below it, computing is cheaper than a file


def epoch_permutation(seed: int, epoch: int, n: int) -> np.ndarray:
    # A (seed, epoch) pair rather than seed + epoch: seed 1 epoch 0 != seed 0 epoch 1.
    return np.random.default_rng([seed, epoch]).permutation(n)


class SharedOrders:
    """Per-epoch permutations kept in `cache` (read-only arrays), identical in value to
    `epoch_permutation`; computed in memory below `min_items` items."""

    def __init__(self, cache: IndexCache, min_items: int = SHARED_MIN_ITEMS):
        self.cache, self.min_items = cache, min_items

    def permutation(self, seed: int, epoch: int, n: int) -> np.ndarray:
        if n < self.min_items:
            return epoch_permutation(seed, epoch, n)
        # numpy's version is part of the key: a file holds what this numpy would compute.
        key = {"kind": "order", "seed": int(seed), "epoch": int(epoch), "items": int(n),
               "numpy": np.__version__}
        return self.cache.arrays("order", key, lambda: {"order": epoch_permutation(seed, epoch, n)})["order"]
