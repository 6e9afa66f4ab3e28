"""A data mixture: documents drawn from several prepared datasets by weight, deterministically
and resumably.

Which dataset the n-th draw comes from is decided without randomness: the one furthest behind
its share, i.e. the argmax over datasets of `weight_i * (n + 1) - drawn_i` (ties to the first
listed). After any number of draws each dataset's count is within one document of
`weight_i * n`, so the proportions hold over short windows too, not only on average. (The
same rule Megatron-LM's blended datasets use.)

Within a dataset the order is that dataset's own `DocumentSampler`: a permutation per epoch,
seeded by (job seed, dataset index). A small dataset simply starts its next epoch sooner. The
position is the per-dataset counts plus each dataset's (epoch, index): integers, which
`state_dict()` holds and a restored sampler continues from exactly. There is one mixture order
for the whole job: every rank draws the same sequence (each step's global batch, which
`step.py` splits among the ranks), so the position fits any world size.

    sampler = build_sampler(cfg.data, corpus, seed=cfg.job.seed)
"""

from __future__ import annotations

from typing import Any

import numpy as np

from longrun.config.sections import DataSection
from longrun.data.corpus import Corpus
from longrun.data.documents import DocumentSampler, refuse_per_rank_position
from longrun.data.errors import DataError
from longrun.data.orders import SharedOrders


def _dataset_seed(seed: int, dataset: int) -> int:
    # Derived, not seed + dataset: job seed 1's dataset 0 must not repeat seed 0's dataset 1.
    return int(np.random.SeedSequence([seed, dataset, 0x313]).generate_state(1)[0])


class MixtureSampler:
    """An endless stream of corpus item indices, the same on every rank, from the datasets
    whose items are the consecutive ranges of `sizes`, each drawn with its share of `weights`."""

    def __init__(self, sizes: list[int], weights: list[float], *, seed: int,
                 names: list[str] | None = None, shuffle: bool = True, orders: SharedOrders | None = None):
        if len(sizes) != len(weights) or not sizes:
            raise ValueError(f"one weight per dataset: {len(sizes)} datasets, {len(weights)} weights")
        if not all(w > 0 for w in weights):
            raise ValueError(f"mixture weights must be positive, got {list(weights)}")
        names = names or [f"dataset {i}" for i in range(len(sizes))]
        self.seed = seed
        self.weights = np.asarray(weights, dtype=np.float64) / float(np.sum(weights))
        self._offsets = np.concatenate(([0], np.cumsum(sizes)[:-1])).astype(np.int64)
        self.parts: list[DocumentSampler] = []
        for i, (size, name) in enumerate(zip(sizes, names, strict=True)):
            if size < 1:
                raise DataError(f"{name} holds no documents; every dataset of a mixture needs some")
            self.parts.append(DocumentSampler(int(size), seed=_dataset_seed(seed, i), shuffle=shuffle,
                                              orders=orders))
        self.drawn = np.zeros(len(sizes), dtype=np.int64)

    def next_dataset(self) -> int:
        """The dataset the next draw comes from: the one furthest behind its share."""
        return int(np.argmax(self.weights * float(self.drawn.sum() + 1) - self.drawn))

    def __iter__(self) -> MixtureSampler:
        return self

    def __next__(self) -> int:
        part = self.next_dataset()
        self.drawn[part] += 1
        return int(self._offsets[part]) + next(self.parts[part])

    def state_dict(self) -> dict[str, Any]:
        return {"seed": self.seed, "weights": self.weights.tolist(), "drawn": self.drawn.tolist(),
                "parts": [p.state_dict() for p in self.parts]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if "parts" not in state:
            raise DataError(
                f"cannot resume the data order: the saved position is of a single dataset, this job "
                f"mixes {len(self.parts)} (data.path became data.mix)")
        refuse_per_rank_position(state)
        if state["seed"] != self.seed:
            raise DataError(
                f"cannot resume the data order: the saved mixture has seed = {state['seed']}, this "
                f"one {self.seed} (the seed changed)")
        if len(state["parts"]) != len(self.parts) or not np.array_equal(state["weights"], self.weights):
            raise DataError(
                f"cannot resume the data order: the saved mixture has weights {state['weights']}, "
                f"data.mix gives {self.weights.tolist()} (normalised); a mixture resumes with the "
                "datasets and weights it was saved with")
        for part, saved in zip(self.parts, state["parts"], strict=True):
            part.load_state_dict(saved)  # checks each dataset's size
        self.drawn = np.asarray(state["drawn"], dtype=np.int64).copy()


def build_sampler(data: DataSection, corpus: Corpus, *, seed: int) -> DocumentSampler | MixtureSampler:
    """The one global document order of `corpus`: a mixture sampler for `data.mix`, else one
    permutation per epoch over all its documents. A corpus with an index cache keeps each
    epoch's permutation there, computed by one process and mapped by the others."""
    orders = SharedOrders(corpus.index_cache) if corpus.index_cache is not None else None
    if data.mix is None:
        return DocumentSampler(len(corpus), seed=seed, orders=orders)
    sizes = getattr(corpus, "part_sizes", None)
    if sizes is None or len(sizes) != len(data.mix):
        raise ValueError("data.mix needs the corpus of its prepared directories (open_token_corpus)")
    return MixtureSampler([int(n) for n in sizes], [item.weight for item in data.mix], seed=seed,
                          names=[item.path for item in data.mix], orders=orders)
