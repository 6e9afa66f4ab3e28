"""Watching a RUNNING attempt, one heartbeat interval at a time.

Each poll asks the worker group which ranks ended (and how), reads every rank's heartbeat
with one MGET (of a key per rank, or at scale of a record per node: health/node_beats.py;
a node whose agent went silent is declared lost as a whole), and lets the attempt's monitor
judge them (dead, hung, slow, NaN, spikes). What it learns goes to the attempt (summaries,
last signs of life, metrics endpoints) and to the listeners (heartbeats, the first trained
step, a Redis outage ridden out); what needs a decision comes back as incidents.

Heartbeat reads go through a client that fails fast: a Redis that is away pauses the judging
(the monitor's clock stands still) instead of stalling the watch or blaming the ranks.

Where a recovered attempt resumed and how many steps the fault cost come from the step ledger
(`ledger`: the goodput tracker), not from heartbeats: those are sent on a timer and can miss a
dying attempt's last steps, which made a lost step read "0 step(s) of work lost".
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import redis

from longrun.config import JobConfig
from longrun.config.job import uses_node_agents
from longrun.controller.attempt import Attempt
from longrun.controller.listeners import Listener
from longrun.controller.outcomes import RankEnded
from longrun.goodput.tracker import GoodputTracker
from longrun.health.node_beats import Beats, NodeBeatReader, RankBeatReader
from longrun.health.policy import Incident
from longrun.health.stragglers import StragglerReport
from longrun.kinds import FaultKind

log = logging.getLogger(__name__)


class Watcher:
    def __init__(self, cfg: JobConfig, client: redis.Redis, listeners: Listener, *, poll_s: float,
                 clock: Callable[[], float], wall: Callable[[], float], ledger: GoodputTracker | None = None):
        self.cfg, self.client, self.listeners, self.ledger = cfg, client, listeners, ledger
        self.poll_s, self.clock, self.wall = poll_s, clock, wall
        self._store_lost_at: float | None = None  # wall time the heartbeat reads started failing
        self._readers: dict[int, RankBeatReader | NodeBeatReader] = {}  # the watched attempt's
        self._explained: StragglerReport | None = None  # the straggler report last handed on
        self._endpoints_seen: dict[int, str] | None = None  # the metrics endpoints last looked at

    def poll(self, attempt: Attempt) -> list[Incident] | None:
        """One heartbeat interval of watching. [] when every rank finished, the incidents when
        something needs a decision, None to keep watching."""
        group, monitor = attempt.group, attempt.monitor
        ended = group.poll(self.poll_s)
        now, wall = self.clock(), self.wall()  # the monitor's clock; the policy's (persisted)
        incidents = [self._ended(attempt, e, wall) for e in ended if not e.finished]
        for e in ended:
            if e.finished:
                attempt.summaries[e.rank] = e.summary
                monitor.finished(e.rank)
        beats = self._read(attempt, now, wall)
        if beats is not None:
            incidents += self._lost_nodes(attempt, beats, wall)
            incidents += [Incident(kind=str(f.kind), rank=f.rank,
                                   node=group.node_of(f.rank) if f.rank is not None else None,
                                   step=f.step, at=wall, detail=f.detail, blame=f.blame)
                          for f in monitor.observe(beats.columns, now, wall)]
            if monitor.stragglers is not None and monitor.stragglers is not self._explained:
                self._explained = monitor.stragglers  # what slow ranks cost the job, and why
                self.listeners.stragglers(attempt, monitor.stragglers, wall)
            self._progress(attempt, beats, wall)
        decided = attempt.settle(incidents, now, self.cfg.health.heartbeat_timeout_s)
        if decided is None or decided:
            return decided
        if group.running():
            return None
        self._recovered_at_end(attempt)
        return []

    def _ended(self, attempt: Attempt, ended: RankEnded, wall: float) -> Incident:
        return Incident(kind=ended.kind, rank=ended.rank, node=attempt.group.node_of(ended.rank),
                        step=ended.step, at=wall, detail=ended.detail)

    def _read(self, attempt: Attempt, now: float, wall: float) -> Beats | None:
        """Every rank's heartbeat, or None while Redis is unreachable (judging paused)."""
        try:
            beats = self._reader(attempt).read()
        except (redis.RedisError, OSError) as exc:
            attempt.monitor.store_unreachable(now)
            if self._store_lost_at is None:
                self._store_lost_at = wall
                log.warning("Redis unreachable (%s); judging paused until it is back", exc)
            return None
        if self._store_lost_at is not None:
            away, self._store_lost_at = wall - self._store_lost_at, None
            self.listeners.event("store_outage", attempt, (
                f"Redis was unreachable for about {away:.1f} s; heartbeat judging was paused and "
                f"missing heartbeats get {self.cfg.health.store_outage_grace_s:g} s to return"),
                {"seconds": round(away, 3)})
        return beats

    def _reader(self, attempt: Attempt) -> RankBeatReader | NodeBeatReader:
        """Per-rank keys, or per-node records at scale (health.node_agents), for this attempt."""
        if self._readers.get(attempt.number) is None:
            job = self.cfg.job.name
            self._readers = {attempt.number: NodeBeatReader(
                self.client, job, attempt.number, attempt.world_size, self.cfg.cluster.workers_per_node)
                if uses_node_agents(self.cfg.health.node_agents, attempt.world_size)
                else RankBeatReader(self.client, job, attempt.number, attempt.world_size)}
        return self._readers[attempt.number]

    def _lost_nodes(self, attempt: Attempt, beats: Beats, wall: float) -> list[Incident]:
        """A node whose agent stopped publishing: one incident for the node, its ranks marked dead."""
        reader, incidents = self._readers[attempt.number], []
        for index in beats.lost_nodes:
            ranks = reader.ranks_of(index)
            attempt.monitor.node_lost(ranks)
            node = attempt.group.node_of(ranks[0])
            incidents.append(Incident(
                kind=FaultKind.NODE_LOST, rank=None, node=node, at=wall, detail=(
                    f"the heartbeat agent of node {node} (ranks {ranks[0]}-{ranks[-1]}) stopped publishing "
                    f"for {self.cfg.health.heartbeat_timeout_s:g} s: its node is taken for lost")))
        return incidents

    def _progress(self, attempt: Attempt, beats: Beats, wall: float) -> None:
        cols = beats.columns
        if not cols.present.any():
            return
        # Columns, not a loop over heartbeats: at 16,384 ranks this runs every second.
        attempt.reached = max(attempt.reached, int(cols.step[cols.present].max()))
        attempt.last_beat_at.update(cols)
        if beats.endpoints is not self._endpoints_seen:  # per-node records: only when the roster changed
            self._endpoints_seen = beats.endpoints
            for rank, address in beats.endpoints.items():
                if attempt.endpoints.get(rank, ("",))[0] != address:
                    attempt.endpoints[rank] = (address, attempt.group.node_of(rank))
                    attempt.endpoints_changed += 1
        self.listeners.heartbeats(attempt, beats, wall)
        if attempt.trained or not attempt.first_step_done(cols):
            return
        attempt.trained = True
        self.listeners.trained(attempt)
        if attempt.recovery is not None:
            self._report_recovery(attempt, int(cols.resumed_from[cols.present].max()), "heartbeats")

    def _recovered_at_end(self, attempt: Attempt) -> None:
        """An attempt after a fault whose every rank finished before a poll saw them all past
        their restore (a short remainder; with node agents a finished rank leaves its node's
        record at once): its recovery is still reported, from the ranks' own summaries, dated
        by the end since the first step's moment was not seen. No warm spares: nothing follows."""
        if attempt.trained or attempt.recovery is None:
            return
        summaries = [attempt.summaries.get(r) for r in range(attempt.world_size)]
        if not all(s and s.get("step", 0) > (s.get("resumed_from") or 0) for s in summaries):
            return
        attempt.trained = True
        resumed = max(int(s.get("resumed_from") or 0) for s in summaries)
        self._report_recovery(attempt, resumed, "summaries", at_end=True)

    def _report_recovery(self, attempt: Attempt, resumed: int, fallback: str, at_end: bool = False) -> None:
        """The "recovered" event: the step resumed from and the steps lost are the step ledger's
        once it has every rank's restore, else `resumed` as `fallback` saw it (Redis was away
        when the ledger was read)."""
        took = self.wall() - attempt.recovery.at
        known = self.ledger.recovery(attempt.number) if self.ledger is not None else None
        if known is not None:
            (resumed, lost), source = known, "ledger"
        else:
            lost, source = max(0, (attempt.lost_from or 0) - resumed), fallback
        if at_end:
            message = (f"attempt {attempt.number} trained past its restore and finished within {took:.1f} s "
                       f"of the fault's declaration, before a heartbeat showed its first step")
        else:
            message = (f"attempt {attempt.number} completed its first step {took:.1f} s after the fault "
                       f"was declared")
        extra = {"seconds": round(took, 3), "resumed_from": resumed, "steps_lost": lost, "source": source}
        self.listeners.event("recovered", attempt, (
            f"{message}; it resumed from step {resumed}, {lost} step(s) of work lost"
            + ("" if source == "ledger" else f" (from {fallback}: the step ledger could not be read)")),
            extra | ({"at_end": True} if at_end else {}))
