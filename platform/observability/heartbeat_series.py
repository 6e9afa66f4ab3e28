"""Each rank's heartbeat age and send time as Prometheus series, rendered when scraped.

A labelled Gauge keeps an object per series and costs a few microseconds per `set`: at 16,384
ranks, 32,768 sets every poll were 50-75 ms of the controller's second. Here a poll stores two
columns (numpy, no loop over the ranks) and the series are built only when Prometheus scrapes,
every 15 s or so. A rank keeps its last values until the attempt ends (`clear`), as a Gauge's
series did: a rank whose beats stopped keeps showing how old its last one is.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence

import numpy as np
from prometheus_client import CollectorRegistry
from prometheus_client.core import GaugeMetricFamily

AGE = "longrun_heartbeat_age_seconds"
SENT_AT = "longrun_heartbeat_timestamp_seconds"


class HeartbeatSeries:
    """A Prometheus collector of `AGE` and `SENT_AT`, labelled (job, rank, node, node_id): the
    node by the name a person reads ("host (address)") and by its Ray id."""

    def __init__(self, job: str, labels: Sequence[str], registry: CollectorRegistry):
        self.job, self.labels = job, (*labels, "rank", "node", "node_id")
        self._lock = threading.Lock()
        self._empty()
        registry.register(self)

    def set(self, rank: int, node: str, age: float, sent_at: float | None = None,
            node_id: str | None = None) -> None:
        with self._lock:
            self._fit(rank + 1)
            self._age[rank], self._node[rank] = age, node
            self._node_id[rank] = node if node_id is None else node_id
            if sent_at is not None:
                self._at[rank] = sent_at

    def set_many(self, ranks: np.ndarray, nodes: Sequence[str], ages: np.ndarray,
                 sent_at: np.ndarray, node_ids: Sequence[str] | None = None) -> None:
        """`ranks`' ages and send times; `nodes[r]` is rank r's node (every rank's, in rank order),
        `node_ids[r]` its id (None: the same as `nodes`)."""
        if not len(ranks):
            return
        node_ids = nodes if node_ids is None else node_ids
        with self._lock:
            self._fit(int(ranks.max()) + 1)
            self._age[ranks], self._at[ranks] = ages, sent_at
            for column, values in ((self._node, nodes), (self._node_id, node_ids)):
                if len(values) >= len(column):
                    column[:] = values[:len(column)]
                else:
                    column[ranks] = [values[r] for r in ranks.tolist()]

    def clear(self) -> None:
        with self._lock:
            self._empty()

    def _empty(self) -> None:
        self._age, self._at = np.zeros(0), np.zeros(0)
        self._node, self._node_id = np.zeros(0, dtype=object), np.zeros(0, dtype=object)

    def _fit(self, n: int) -> None:
        if n > len(self._age):
            grow = n - len(self._age)
            self._age = np.concatenate([self._age, np.full(grow, np.nan)])
            self._at = np.concatenate([self._at, np.full(grow, np.nan)])
            self._node = np.concatenate([self._node, np.full(grow, "", dtype=object)])
            self._node_id = np.concatenate([self._node_id, np.full(grow, "", dtype=object)])

    def describe(self) -> list:
        return [GaugeMetricFamily(name, "", labels=self.labels) for name in (AGE, SENT_AT)]

    def collect(self) -> Iterator[GaugeMetricFamily]:
        age = GaugeMetricFamily(AGE, "Age of each rank's newest heartbeat.", labels=self.labels)
        # The send time itself: `time() - ...` keeps growing at query time even when nothing
        # updates the series any more (a dead rank's key expired, a wedged controller), which
        # an age computed here cannot do.
        at = GaugeMetricFamily(SENT_AT, "Send time (Unix seconds) of each rank's newest heartbeat.",
                               labels=self.labels)
        with self._lock:
            ages, sent = self._age.copy(), self._at.copy()
            nodes, ids = self._node.copy(), self._node_id.copy()
        for rank in np.flatnonzero(~np.isnan(ages)).tolist():
            age.add_metric([self.job, str(rank), nodes[rank], ids[rank]], float(ages[rank]))
        for rank in np.flatnonzero(~np.isnan(sent)).tolist():
            at.add_metric([self.job, str(rank), nodes[rank], ids[rank]], float(sent[rank]))
        yield age
        yield at
