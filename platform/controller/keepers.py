"""Where memory snapshots live: one keeper actor per node, outliving the attempts.

Each rank sends every snapshot (its part of its shard's: checkpoint/memory.py) to two keepers:
its own node's and the next node's in ring order over the job's nodes, so a node that is lost
(with its keeper) leaves a copy of each of its ranks' part behind. A keeper (snapshot_keeper.py,
a threaded actor taking chunks from many ranks at once) holds the last two snapshots it was sent
of every rank (the last to arrive, not the highest steps: after a rollback the new path's steps
are lower); two, so the newest complete one survives while the next is being sent. Before each
attempt, snapshots past the step it resumes from are dropped: they belong to a path the job
abandoned.

Snapshots are per rank of one layout: after a resize (an elastic job shrinking or growing,
controller/elastic.py), rank r of the new world holds another piece of the state than rank r of
the old one. So the keepers remember the layout they hold snapshots of (`Keepers.adopt`), and no
restore from memory is ever planned across a layout change. Instead, before the layout changes,
the old layout's newest complete snapshot, when newer than the newest committed checkpoint, is
committed as a checkpoint (`Keepers.persist`: a short-lived actor per node reads its node's
ranks' snapshots from the keepers and writes them through the checkpoint writer, every node at
once, one commit: controller/snapshot_commit.py), which the new layout restores by resharding
like any checkpoint; then the keepers forget the old layout.
A stop request between attempts does the same before the keepers go with the job.

After a fault, `Keepers.plan` picks the newest step every rank has a snapshot of on a live
keeper (only a step every rank finished counts; the ranks take and skip snapshots at the same
steps, so they hold the same ones) and lists, per rank, every keeper holding it; each worker
fetches its own blob, its node's keeper first, then the others in turn, verifying (xxh3 per
chunk); the replicas of a shard swap their parts over their group; and all fall back to storage
together only if some rank finds no good copy (checkpoint/memory.py, worker/snapshots.py).
A keeper on a node the job no longer uses goes once the attempt that might restore from it
trains (`Keepers.prune`), and all go when the job ends (`close`). A controller that dies (killed,
its host lost) leaves them: they are detached actors, so the next controller of the job (a
rerun, or a resubmission) finds them by name (`adopt_survivors`) and restores from memory what
the dead one would have, instead of from the last committed checkpoint (the hour's soak lost 10
and 5 steps to its two `controller_kill`s so). It takes only keepers whose tag (`keeper_tag`: the
job's identity, checkpoint directory and layout) is its own; others hold another job's state, or
another layout's, and are let go. While a controller holds them it calls each every
`orphan_after_s / 5` (`touch`, from a thread: the controller may wait for nodes for long); a
keeper no controller has called for `orphan_after_s` (the lease's expiry and five minutes: time
for the next controller to take over) ends itself (snapshot_keeper.py).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import threading
from collections.abc import Callable, Hashable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import fsspec
import ray
from ray.exceptions import RayError
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from longrun.checkpoint.layout import committed_steps
from longrun.checkpoint.lineage import FenceError, fenced_steps
from longrun.config import JobConfig
from longrun.config.identity import job_identity
from longrun.controller.elastic import layout_key
from longrun.controller.lease import lease_ttl_s
from longrun.controller.outcomes import last_line
from longrun.controller.snapshot_commit import commit_in_parallel
from longrun.controller.snapshot_keeper import (
    KEEP_STEPS,
    KEEPER_NAMESPACE,
    THREADS,
    SnapshotKeeper,
    keeper_name,
)

log = logging.getLogger(__name__)

__all__ = ["KEEPER_NAMESPACE", "KEEP_STEPS", "Keepers", "MemoryRestore", "SnapshotKeeper", "keeper_name",
           "keeper_tag", "keeper_targets", "newest_committed_step"]

ORPHAN_MARGIN_S = 300.0  # beyond the lease's expiry: how long keepers wait for a dead controller's successor


def keeper_tag(cfg: JobConfig) -> str:
    """What a keeper's snapshots are of: the job (name, checkpoint directory, identity) and the
    layout its ranks' pieces belong to. A controller restores only from keepers of its own tag."""
    what = [cfg.job.name, cfg.checkpoint_dir, job_identity(cfg), repr(layout_key(cfg))]
    return hashlib.sha256(json.dumps(what, sort_keys=True).encode()).hexdigest()[:16]


def keeper_orphan_s(cfg: JobConfig) -> float:
    """How long a keeper waits without a controller's call before it ends itself."""
    return lease_ttl_s(cfg.health.store_patience_s) + ORPHAN_MARGIN_S


@dataclass(frozen=True)
class MemoryRestore:
    step: int
    keepers: dict[int, list[str]]  # rank -> the names of the keepers holding its snapshot of `step`

    def to_dict(self) -> dict[str, Any]:
        return {"step": self.step, "keepers": {str(r): names for r, names in self.keepers.items()}}


def newest_committed_step(cfg: JobConfig, before_step: int | None = None) -> int:
    """The newest committed checkpoint's step under cfg.checkpoint_dir (0: none), below
    `before_step` if given and not fenced off by a rollback (what a storage restore would take):
    a memory snapshot is used only when it is newer."""
    fs, root = fsspec.core.url_to_fs(cfg.checkpoint_dir)
    root = root.rstrip("/")
    try:
        steps = committed_steps(fs, root)
        fenced = fenced_steps(fs, root)  # a rollback's abandoned path is never resumed from
    except (OSError, FenceError):
        return 0
    steps = [s for s in steps if s not in fenced and (before_step is None or s < before_step)]
    return steps[-1] if steps else 0


def keeper_targets(node_ids: Sequence[str], rank: int, per_node: int, job: str) -> list[str]:
    """The keepers rank `rank` sends its snapshots to: its node's and the next node's."""
    index = rank // per_node
    nodes = [node_ids[index], node_ids[(index + 1) % len(node_ids)]]
    return list(dict.fromkeys(keeper_name(job, n) for n in nodes))  # one node: one keeper


class Keepers:
    """The controller's side: one keeper per node the job has used, created on demand. `tag`
    (`keeper_tag`) marks what they hold; with `orphan_after_s` they are detached and kept
    alive by this object's calls (see the module docstring), without it they go with the driver."""

    def __init__(self, job: str, tag: str = "", orphan_after_s: float | None = None):
        self.job, self.tag, self.orphan_after_s = job, tag, orphan_after_s
        self._actors: dict[str, Any] = {}  # node id -> keeper
        self._pings: dict[str, Any] = {}  # node id -> a holdings() call sent by the last revive()
        self.layout: Hashable | None = None  # the layout the held snapshots were taken at
        self.layout_cfg: JobConfig | None = None  # its config (what `persist` writes them as)
        self._closed = threading.Event()
        self._toucher: threading.Thread | None = None

    def adopt(self, layout: Hashable, cfg: JobConfig | None = None) -> bool:
        """Hold snapshots of `layout` (whose config is `cfg`) from now on; True when the layout
        changed, in which case every snapshot held (of the old one) was dropped and none may be
        restored from (`persist` them first)."""
        if layout == self.layout:
            self.layout_cfg = cfg or self.layout_cfg
            return False
        changed = self.layout is not None
        if changed:
            self.drop_after(-1)  # before the layout is noted: a failed drop is tried again
            if cfg is not None:  # what they hold from now on is the new layout's
                self._retag(keeper_tag(cfg))
        self.layout, self.layout_cfg = layout, cfg
        return changed

    def _retag(self, tag: str) -> None:
        self.tag = tag
        self._call_all("retag", tag)

    def _call_all(self, method: str, *args: Any, timeout_s: float = 30.0) -> None:
        """`method(*args)` on every keeper; one that does not answer (gone with its node) is
        forgotten itself."""
        refs = {node: getattr(actor, method).remote(*args) for node, actor in self._actors.items()}
        for node, ref in refs.items():
            try:
                ray.get(ref, timeout=timeout_s)
            except (RayError, ray.exceptions.GetTimeoutError) as exc:
                self._forget(node, exc)

    def adopt_survivors(self, node_ids: Iterable[str], timeout_s: float = 10.0) -> list[str]:
        """The keepers of this job on `node_ids` that a controller before this one left (it died):
        kept when their tag is this one's, let go otherwise; the nodes kept."""
        kept = []
        for node in node_ids:
            if node in self._actors:
                continue
            try:
                actor = ray.get_actor(keeper_name(self.job, node), namespace=KEEPER_NAMESPACE)
            except ValueError:  # none there
                continue
            try:
                tag = ray.get(actor.touch.remote(), timeout=timeout_s)
            except (RayError, ray.exceptions.GetTimeoutError) as exc:
                log.warning("a snapshot keeper left on node %s did not answer (%s): let go", node[:12],
                            last_line(exc))
                ray.kill(actor, no_restart=True)
                continue
            if tag != self.tag:
                log.warning("a snapshot keeper left on node %s holds another job's or layout's snapshots "
                            "(tag %s, this job's %s): let go", node[:12], tag, self.tag)
                ray.kill(actor, no_restart=True)
                continue
            self._actors[node] = actor
            kept.append(node)
        if kept:
            log.warning("found %d snapshot keeper(s) the job's previous controller left (node(s) %s): "
                        "what they hold is restored from if it is newer than storage", len(kept),
                        ", ".join(n[:12] for n in kept))
            self._keep_touching()
        return kept

    def _keep_touching(self) -> None:
        """Call every keeper every orphan_after_s / 5 from a thread of this object's, so that none
        ends itself while the controller holds it, whatever state the job is in."""
        if self.orphan_after_s is None or self._toucher is not None:
            return

        def touch() -> None:
            pending: list[Any] = []
            while not self._closed.wait(self.orphan_after_s / 5):
                try:
                    done: list[Any] = []
                    if pending:
                        done, pending = ray.wait(pending, num_returns=len(pending), timeout=0)
                    for ref in done:  # read, so Ray does not print a dead keeper's error as unhandled
                        with contextlib.suppress(RayError):
                            ray.get(ref)
                    pending += [actor.touch.remote() for actor in list(self._actors.values())]
                except Exception as exc:  # a GCS restarting: called again at the next round
                    if not ray.is_initialized():  # Ray shut down under it (the driver's end)
                        return
                    log.warning("snapshot keepers not called this round (%s)", last_line(exc))

        self._toucher = threading.Thread(target=touch, name=f"longrun-keepers-{self.job}", daemon=True)
        self._toucher.start()

    def persist(self, *, newer_than: int, before_step: int | None, timeout_s: float = 300.0) -> int | None:
        """Commit the newest step every rank of the held layout has a snapshot of, when newer
        than `newer_than` (the newest committed checkpoint) and below `before_step`, as a
        checkpoint under the job's checkpoint dir; its step, or None when there is none to
        commit. Raises (RayError, GetTimeoutError, or the committer's error) when it could not."""
        cfg = self.layout_cfg
        if cfg is None or not self._actors:
            return None
        restore = self.plan(cfg.world_size, newer_than=newer_than, before_step=before_step)
        if restore is None:
            return None
        names = {keeper_name(self.job, node): node for node in self._actors}
        return commit_in_parallel(cfg, restore.to_dict(), names, timeout_s=timeout_s)

    def prune(self, nodes: Iterable[str]) -> None:
        """Let the keepers on nodes the job no longer uses go (evicted, or left by a resize):
        once the attempt trains, no restore reads them, and each holds snapshots as big as a
        rank's state."""
        keep = set(nodes)
        for node in [n for n in self._actors if n not in keep]:
            log.info("snapshot keeper on node %s let go: the job no longer uses the node", node[:12])
            self._pings.pop(node, None)
            ray.kill(self._actors.pop(node), no_restart=True)

    def ensure(self, node_ids: Iterable[str], timeout_s: float | None = 60.0) -> None:
        """A live keeper on each of `node_ids`, ready (its name resolvable) before any worker
        looks it up; `timeout_s` None: started, not waited for."""
        # Threaded: chunks from every rank sending to it are taken at once (snapshot_keeper.py).
        cls = ray.remote(num_cpus=0, max_restarts=0, max_concurrency=THREADS)(SnapshotKeeper)
        detached = {"lifetime": "detached"} if self.orphan_after_s is not None else {}
        started = []
        for node in node_ids:
            if node not in self._actors:
                # Recorded at once, so close() finds it even if it never answers; get_if_exists:
                # a keeper an earlier call started but could not confirm is taken, not clashed with.
                self._actors[node] = cls.options(
                    name=keeper_name(self.job, node), namespace=KEEPER_NAMESPACE, get_if_exists=True,
                    scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False),
                    **detached).remote(self.tag, self.orphan_after_s)
                started.append(self._actors[node])
        self._keep_touching()
        if timeout_s is not None:
            ray.get([actor.holdings.remote() for actor in started], timeout=timeout_s)

    def revive(self, node_ids: Sequence[str], alive: Callable[[Sequence[str]], set[str]]) -> list[str]:
        """During an attempt: a new keeper on each of `node_ids` (the attempt's nodes that
        `alive` says Ray still lists) whose keeper died since the last call (killed, or its
        process lost); the nodes revived. Never waits: each call collects the answers to the
        pings the call before sent, and sends new ones. Without this a keeper killed mid-attempt
        stayed dead until the next attempt, and with both of a rank's keepers gone no snapshot
        landed in between (the hour soak at 512 MB lost 9 steps to the next SIGKILL so). The
        ranks look a lost keeper up again by name at each send (worker/snapshot_transfer.py)."""
        for node, ping in list(self._pings.items()):
            ready, _ = ray.wait([ping], timeout=0)
            if not ready:
                continue  # a busy keeper (taking a snapshot's chunks) answers by the next call
            del self._pings[node]
            try:
                ray.get(ping)
            except RayError as exc:
                if node in self._actors:
                    self._forget(node, exc)
        missing = [n for n in node_ids if n not in self._actors]
        revived = sorted(alive(missing)) if missing else []
        if revived:
            log.warning("snapshot keeper(s) on node(s) %s gone mid-attempt: starting new ones",
                        ", ".join(n[:12] for n in revived))
            self.ensure(revived, timeout_s=None)
        for node in node_ids:
            if node in self._actors and node not in self._pings:
                self._pings[node] = self._actors[node].holdings.remote()
        return revived

    def plan(self, world_size: int, *, newer_than: int, before_step: int | None,
             timeout_s: float = 10.0) -> MemoryRestore | None:
        """The newest step every rank has a snapshot of on a live keeper, if newer than
        `newer_than` (the newest committed checkpoint) and below `before_step` (a restore the
        policy wants from before a bad step); None otherwise. Keepers that died (with their
        node) are dropped."""
        held: dict[int, dict[int, list[str]]] = {}  # step -> rank -> keeper names
        for node, actor in list(self._actors.items()):
            try:
                holdings = ray.get(actor.holdings.remote(), timeout=timeout_s)
            except (RayError, ray.exceptions.GetTimeoutError) as exc:
                self._forget(node, exc)
                continue
            for rank, steps in holdings.items():
                for step in steps:
                    held.setdefault(step, {}).setdefault(rank, []).append(keeper_name(self.job, node))
        usable = [s for s, ranks in held.items() if len(ranks) == world_size and s > newer_than
                  and (before_step is None or s < before_step)]
        if not usable:
            return None
        step = max(usable)
        return MemoryRestore(step, dict(sorted(held[step].items())))

    def drop_after(self, step: int, timeout_s: float = 30.0) -> None:
        """Every keeper forgets the snapshots of steps after `step` (see SnapshotKeeper); one
        that does not answer (gone with its node) is forgotten itself."""
        self._call_all("drop_after", step, timeout_s=timeout_s)

    def _forget(self, node: str, why: Exception) -> None:
        log.warning("snapshot keeper on node %s is gone (%s)", node[:12], why)
        self._pings.pop(node, None)
        ray.kill(self._actors.pop(node), no_restart=True)  # a slow one too: its name is free for a new one

    def close(self) -> None:
        self._closed.set()
        for actor in self._actors.values():
            ray.kill(actor, no_restart=True)
        self._actors.clear()
        self._pings.clear()
