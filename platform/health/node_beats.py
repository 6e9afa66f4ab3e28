"""Per-node heartbeat records: what a node's agent publishes and the controller reads.

At 16,384 ranks a poll of one JSON key per rank costs the controller 100-150 ms a second
(MGET of 16k values, then parsing them). MegaScale runs one daemon per node instead; here
one agent per node (health/node_agent.py) hears its ranks' beats over a local socket and
publishes ONE binary record per node per interval: a 20-byte header and 57 bytes per rank
that is alive and fresh. The controller reads 2,048 records with one MGET and turns them into
columns with numpy (`NodeBeatReader`), so a poll at 16k ranks is a few milliseconds.

What the record leaves out decides what the controller concludes:
- a rank whose process the agent saw exit, or whose beats stopped reaching it for the
  heartbeat timeout, is left out: the monitor reads it as missing, i.e. dead, at once;
- a node whose record expired (its agent stopped publishing) is lost as a whole: the reader
  names it once, and the controller declares the node, not each of its ranks.

What rarely changes (pid, host, metrics address) travels in a JSON roster per node, read only
while some rank's metrics endpoint is unknown.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from longrun import keys
from longrun.health.beat_columns import NONE, BeatColumns, phase_code
from longrun.health.heartbeat import Heartbeat, read_heartbeats

MAGIC = b"LRN1"
HEADER = np.dtype([("magic", "S4"), ("node", "<u4"), ("sent_at", "<f8"), ("count", "<u4")])
ROW = np.dtype([("rank", "<u4"), ("step", "<i8"), ("resumed_from", "<i8"), ("phase", "<i2"),
                ("pp_stage", "<i2"), ("loss_finite", "u1"), ("loss", "<f8"), ("step_time_s", "<f4"),
                ("work_cost", "<f4"), ("sent_at", "<f8"),
                ("stepped_at", "<f8")])
ROSTER_FIELDS = ("pid", "host", "metrics_addr")


def encode(node: int, sent_at: float, rows: np.ndarray) -> bytes:
    """One node's record: the header, then `rows` (a ROW array, one per live rank)."""
    header = np.array([(MAGIC, node, sent_at, len(rows))], dtype=HEADER)
    return header.tobytes() + np.ascontiguousarray(rows, dtype=ROW).tobytes()


def decode(raw: bytes) -> tuple[int, float, np.ndarray]:
    """(node, sent_at, rows) of one record; ValueError when it is not one."""
    if len(raw) < HEADER.itemsize or raw[:4] != MAGIC:
        raise ValueError("not a node heartbeat record (bad magic or too short)")
    header = np.frombuffer(raw, HEADER, count=1)[0]
    count = int(header["count"])
    if len(raw) != HEADER.itemsize + count * ROW.itemsize:
        raise ValueError(f"node record of {len(raw)} bytes does not hold the {count} rows it announces")
    return int(header["node"]), float(header["sent_at"]), np.frombuffer(raw, ROW, count, HEADER.itemsize)


def decode_many(records: Sequence[bytes]) -> np.ndarray:
    """Every row of many records at once (their headers checked, then skipped): the controller's
    poll at 16,384 ranks decodes 2,048 records, and one `decode` each costs 20 us of numpy set-up."""
    size, step = HEADER.itemsize, ROW.itemsize
    for raw in records:
        if raw[:4] != MAGIC or (len(raw) - size) % step:
            decode(raw)  # raises, saying what is wrong with it
    return np.frombuffer(b"".join(raw[size:] for raw in records), ROW)


def rows_of(beats: Sequence[Mapping[str, Any]]) -> np.ndarray:
    """ROW entries for heartbeats given as dicts (Heartbeat's fields, as a worker sends them)."""
    rows = np.zeros(len(beats), ROW)
    for i, b in enumerate(beats):
        loss, step_time, cost = b.get("loss"), b.get("step_time_s"), b.get("work_cost")
        stage, stepped = b.get("pp_stage"), b.get("stepped_at")
        phase = phase_code(b.get("phase", "starting"))
        rows[i] = (b["rank"], b.get("step", 0), b.get("resumed_from", 0), phase,
                   NONE if stage is None else stage, bool(b.get("loss_finite", True)),
                   np.nan if loss is None else loss, np.nan if step_time is None else step_time,
                   np.nan if cost is None else cost, b.get("sent_at", 0.0),
                   np.nan if stepped is None else stepped)
    return rows


def columns_of(rows: np.ndarray, world_size: int) -> BeatColumns:
    """Columns for `world_size` ranks from every node's rows together (ranks outside the world
    are ignored: a record from another layout of the job)."""
    cols = BeatColumns.empty(world_size)
    rows = rows[rows["rank"] < world_size]
    r = rows["rank"].astype(np.int64)
    cols.present[r] = True
    cols.step[r] = rows["step"]
    cols.resumed_from[r] = rows["resumed_from"]
    cols.phase[r] = rows["phase"]
    cols.pp_stage[r] = rows["pp_stage"]
    cols.loss_finite[r] = rows["loss_finite"].astype(bool)
    cols.loss[r] = rows["loss"]
    cols.step_time_s[r] = rows["step_time_s"]
    cols.work_cost[r] = rows["work_cost"]
    cols.sent_at[r] = rows["sent_at"]
    cols.stepped_at[r] = rows["stepped_at"]
    return cols


@dataclass
class Beats:
    """One poll's reading: the columns the monitor judges, the nodes newly lost as a whole, and
    the live ranks' heartbeats for the controller's listeners (built only when asked)."""

    columns: BeatColumns
    lost_nodes: list[int] = field(default_factory=list)
    heartbeats: list[Heartbeat] | None = None
    roster: dict[int, dict[str, Any]] = field(default_factory=dict)
    attempt: int = 0
    # Rank -> its metrics endpoint (host:port): the same object from poll to poll until one
    # changes, so the controller looks at 16,384 of them only when there is news.
    endpoints: dict[int, str] = field(default_factory=dict)

    def live(self) -> list[Heartbeat]:
        if self.heartbeats is None:
            c = self.columns
            self.heartbeats = []
            for rank in np.flatnonzero(c.present).tolist():
                beat = c.beat(rank, self.attempt)
                about = self.roster.get(rank, {})
                beat.pid, beat.host = about.get("pid", 0), about.get("host", "")
                beat.metrics_addr = about.get("metrics_addr")
                self.heartbeats.append(beat)
        return self.heartbeats


class RankBeatReader:
    """The controller's side for small jobs: one key per rank, one MGET a poll."""

    def __init__(self, client: Any, job: str, attempt: int, world_size: int):
        self.client, self.job, self.attempt, self.world_size = client, job, attempt, world_size

    def read(self) -> Beats:
        beats = read_heartbeats(self.client, self.job, self.attempt, range(self.world_size))
        live = [b for b in beats.values() if b is not None]
        return Beats(BeatColumns.from_beats(beats, self.world_size), heartbeats=live, attempt=self.attempt,
                     endpoints={b.rank: b.metrics_addr for b in live if b.metrics_addr})


class NodeBeatReader:
    """The controller's side: every node's record of one attempt, one MGET a poll."""

    def __init__(self, client: Any, job: str, attempt: int, world_size: int, workers_per_node: int):
        self.client, self.world_size, self.attempt = client, world_size, attempt
        self.nodes = -(-world_size // workers_per_node)
        self.workers_per_node = workers_per_node
        self._keys = [keys.node_beats_key(job, attempt, n) for n in range(self.nodes)]
        self._roster_keys = [keys.node_roster_key(job, attempt, n) for n in range(self.nodes)]
        self._seen = np.zeros(self.nodes, bool)  # nodes whose agent has published this attempt
        self._lost = np.zeros(self.nodes, bool)  # nodes already reported lost
        self.roster: dict[int, dict[str, Any]] = {}
        self._endpoints: dict[int, str] = {}

    def ranks_of(self, node: int) -> range:
        return range(node * self.workers_per_node, min((node + 1) * self.workers_per_node, self.world_size))

    def read(self) -> Beats:
        raw = self.client.mget(self._keys)
        present = np.fromiter((value is not None for value in raw), bool, self.nodes)
        lost = self._seen & ~present & ~self._lost
        self._lost |= lost
        self._lost &= ~present  # a node whose agent is back can be lost again
        self._seen |= present
        cols = columns_of(decode_many([value for value in raw if value is not None]), self.world_size)
        if len(self.roster) < int(cols.present.sum()):
            self._read_roster()
        return Beats(cols, np.flatnonzero(lost).tolist(), roster=self.roster, attempt=self.attempt,
                     endpoints=self._endpoints)

    def _read_roster(self) -> None:
        for value in self.client.mget(self._roster_keys):
            if value is not None:
                self.roster.update({int(rank): about for rank, about in json.loads(value).items()})
        self._endpoints = {rank: about["metrics_addr"] for rank, about in self.roster.items()
                           if about.get("metrics_addr")}
