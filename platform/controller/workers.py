"""One attempt's worker group: the actors in their placement group, started, polled, stopped.

The controller only decides; this is where it touches Ray. Everything it needs from a group
is the small `WorkerGroup` surface below, so the controller's state machine can be stepped in
tests against a fake group (tests/test_controller_steps.py) with no Ray at all.

How a rank ended is translated into what the health policy understands in `outcomes.py`;
the group adds what only it knows: a dead rank whose node Ray reports dead is `node_lost`.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import replace
from typing import Any, Protocol

import ray
from ray.exceptions import RayActorError, RayError

from longrun.checkpoint.shared import unseen_probes
from longrun.config import JobConfig
from longrun.controller.agents import Agents
from longrun.controller.elastic import layout_key
from longrun.controller.keepers import (
    Keepers,
    keeper_orphan_s,
    keeper_tag,
    keeper_targets,
    newest_committed_step,
)
from longrun.controller.outcomes import (
    RankEnded,
    dead_nodes,
    draining_nodes,
    fault_kind_of,
    last_line,
    outcome,
    unwrap,
)
from longrun.controller.placement import (
    Placement,
    alive_nodes,
    place,
    place_again,
    spare_nodes,
    worker_bundle,
)
from longrun.kinds import FaultKind
from longrun.worker.actor import TrainWorker

log = logging.getLogger(__name__)


class WorkerGroup(Protocol):
    node_ids: tuple[str, ...]
    node_names: Mapping[str, str]  # node id -> "host (address)" (node_names.py), those known
    pids: Mapping[int, int]  # rank -> its process's id, those known

    def node_of(self, rank: int) -> str: ...
    def diagnose(self, timeout_s: float) -> list[dict[str, Any]]: ...
    def start(self) -> None: ...
    def poll(self, timeout_s: float) -> list[RankEnded]: ...
    def running(self) -> int: ...
    def draining(self) -> dict[str, float]: ...
    def stop(self) -> None: ...


class LaunchFailed(RuntimeError):
    """The attempt's workers could not be started (an actor died or did not answer); `kind`
    is `fatal` when the cause would recur on any node (a config the workers reject)."""

    def __init__(self, message: str, kind: str = FaultKind.EXCEPTION):
        super().__init__(message)
        self.kind = kind


class Launcher(Protocol):
    """Places and starts one attempt's group; raises PlacementImpossible / PlacementTimeout.
    Between attempts it may keep what helps the next one start fast (see RayLauncher).
    `spare_nodes`: nodes beyond the job's own whose free resources could take one of its
    nodes' place now (None: unknown)."""

    def __call__(self, cfg: JobConfig, *, attempt: int, redis_url: str, evicted: Iterable[str],
                 resume_before_step: int | None, timeout_s: float,
                 skip_steps: Sequence[tuple[int, int]] = (),
                 cancelled: Callable[[], bool] | None = None) -> WorkerGroup: ...
    def spare_nodes(self, cfg: JobConfig, evicted: Iterable[str]) -> int | None: ...
    def warm_spares(self) -> None: ...
    def release(self) -> None: ...


# Ray masks each GPU actor's CUDA_VISIBLE_DEVICES to its own GPU. NCCL then cannot see the
# node's other GPUs as peers, and on H100s its NVLink paths break (hangs, slow first
# collectives). With this set, Ray leaves the mask alone: every rank sees every GPU of its node
# and picks its own by the GPU id Ray assigned it (worker/setup.py `worker_device`).
NOSET_CUDA_VISIBLE_DEVICES = "RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES"
SPARE_PING_S = 5.0  # how long a warm spare has to answer before its rank starts a fresh worker


def actor_options(cfg: JobConfig) -> dict[str, Any]:
    """A worker's (and a spare's) resources: half of its bundle each. The spare waiting in a
    bundle must be able to take the worker's place without a new reservation, and on a GPU it
    must already hold a share of the bundle's device (so Ray assigns it that GPU's id); a
    fractional share of the same bundle gives both. On GPUs, Ray's per-actor masking of
    CUDA_VISIBLE_DEVICES is off (the job's other runtime environment is kept: Ray merges
    environment variables)."""
    bundle = worker_bundle(cfg)
    options: dict[str, Any] = {"num_cpus": bundle.get("CPU", 0.0) / 2, "num_gpus": bundle.get("GPU", 0.0) / 2}
    if options["num_gpus"]:
        options["runtime_env"] = {"env_vars": {NOSET_CUDA_VISIBLE_DEVICES: "1"}}
    return options


class RayWorkerGroup:
    """One attempt's actors, rank r in bundle r of `placement`. Stopping kills the actors;
    the placement belongs to the launcher, which keeps it for the next attempt if it can."""

    def __init__(self, placement: Placement, actors: list[Any], agents: Agents | None = None,
                 attempt: int = 0, pids: Sequence[int] = ()):
        self.placement, self.agents, self.attempt = placement, agents, attempt
        self.node_ids = placement.node_ids
        self.actors = actors
        self.pids = dict(enumerate(pids))
        self._runs: dict[Any, int] = {}  # pending run() ref -> rank
        self._lost: set[str] = set()  # nodes already reported lost

    def node_of(self, rank: int) -> str:
        return self.placement.node_of(rank)

    @property
    def node_names(self) -> Mapping[str, str]:
        return self.placement.names

    def diagnose(self, timeout_s: float) -> list[dict[str, Any]]:
        """Every rank's self-check report. A rank whose check raised, died or did not answer
        within `timeout_s` fails it: that is what the checks are for (a hung GPU, a bad host)."""
        refs = {a.diagnose.remote(): rank for rank, a in enumerate(self.actors)}
        done, _ = ray.wait(list(refs), num_returns=len(refs), timeout=timeout_s)
        reports: dict[int, dict[str, Any]] = {}
        for ref in done:
            try:
                reports[refs[ref]] = ray.get(ref)
            except RayError as exc:
                why = f"the self-check failed: {last_line(exc)[:200]}"
                reports[refs[ref]] = self._failed_check(refs[ref], why)
        for rank in set(refs.values()) - set(reports):
            reports[rank] = self._failed_check(rank, f"the self-check did not answer within {timeout_s:g} s")
        return [reports[rank] for rank in sorted(reports)]

    def _failed_check(self, rank: int, reason: str) -> dict[str, Any]:
        return {"node": self.node_of(rank), "rank": rank, "ok": False, "reason": reason, "checks": []}

    def start(self) -> None:
        self._runs = {a.run.remote(): rank for rank, a in enumerate(self.actors)}

    def running(self) -> int:
        return len(self._runs)

    def poll(self, timeout_s: float) -> list[RankEnded]:
        """Wait up to `timeout_s` for ranks to end; those that did (possibly none)."""
        if not self._runs:
            return []
        done, _ = ray.wait(list(self._runs), num_returns=len(self._runs), timeout=timeout_s)
        return self._blame_lost_nodes([outcome(ref, self._runs.pop(ref)) for ref in done])

    def draining(self) -> dict[str, float]:
        """The group's nodes Ray is draining -> the unix time they must be empty by (0: none);
        none while Ray's control store cannot say (restarting): asked again next interval."""
        try:
            return draining_nodes(set(self.node_ids))
        except Exception as exc:  # Ray's internal state API raises whatever its RPC raised
            log.warning("cannot ask Ray which nodes it is draining (%s)", last_line(exc))
            return {}

    def _blame_lost_nodes(self, ended: list[RankEnded]) -> list[RankEnded]:
        """Dead ranks whose node Ray reports dead: the node is the fault (`node_lost`, once per
        node: its other ranks stay `dead`, their processes went with it)."""
        dead = {self.node_of(e.rank) for e in ended if e.kind == FaultKind.DEAD}
        gone = dead_nodes(dead) if dead else set()
        blamed = []
        for e in ended:
            node = self.node_of(e.rank)
            if e.kind != FaultKind.DEAD or node not in gone:
                blamed.append(e)
            elif node in self._lost:
                blamed.append(replace(e, detail=f"rank {e.rank}'s process went with its node {node}"))
            else:
                self._lost.add(node)
                blamed.append(replace(e, kind=FaultKind.NODE_LOST, detail=(
                    f"Ray reports node {node} dead; rank {e.rank}'s process went with it")))
        return blamed

    def stop(self, confirm_timeout_s: float = 30.0) -> None:
        """Kill the actors and wait until Ray reports them dead: a spare taking a rank's place
        shares its bundle (and on a GPU its device), so the old process must have let go of
        that memory before the new one allocates."""
        for actor in self.actors:
            ray.kill(actor, no_restart=True)
        # The runs the group never polled are waited for too (they end with their actors): Ray
        # prints an error no one waited for or read as an 'Unhandled error', with the rank's
        # coloured traceback, on the user's console. A surviving rank whose collective broke
        # as its peer died has one; the fault is reported already, its traceback is in its log.
        runs, self._runs = list(self._runs), {}
        if self.agents is not None:  # before the controller deletes the attempt's keys
            self.agents.forget(self.attempt)
        pings = [a.node_id.remote() for a in self.actors]  # fail once the actor is gone
        done, _ = ray.wait(pings + runs, num_returns=len(pings) + len(runs), timeout=confirm_timeout_s)
        ended = set(done)
        if missing := sum(ping not in ended for ping in pings):
            log.warning("%d killed worker(s) not confirmed dead after %g s", missing, confirm_timeout_s)


class RayLauncher:
    """Places attempts on the Ray cluster, and keeps a warm spare per rank between them.

    Recovery time is mostly process start and imports (torch, the training stack): about
    10 s for four workers on two cores, against about 1 s for rendezvous, restore and a
    step. So while an attempt trains, one spare actor per bundle waits with everything
    imported. A restart on the same nodes keeps the placement and hands each rank to its
    bundle's spare. A restart that must change nodes (one evicted, or gone) places only those
    again (`place_again`): the spares on the other nodes serve their ranks, and the new nodes'
    ranks start fresh. A change of the job's size (an elastic resize) releases everything,
    spares included, and places from scratch.
    """

    def __init__(self, spares: bool = True):
        self.spares_enabled = spares
        self.placement: Placement | None = None
        self.keepers: Keepers | None = None  # peer memory snapshots' keepers, across attempts
        self.agents: Agents | None = None  # heartbeat agents (health.node_agents), across attempts
        self._spares: list[Any | None] = []  # per rank; None where its node was placed again
        self._warming: list[Any | None] = []  # warm() refs of the spares
        self._cfg: JobConfig | None = None
        self._generation = 0  # of spares: actor names must stay unique after a promotion
        self._shared_storage_seen: set[str] = set()  # nodes whose probe the controller read back

    def __call__(self, cfg: JobConfig, *, attempt: int, redis_url: str, evicted: Iterable[str],
                 resume_before_step: int | None, timeout_s: float,
                 skip_steps: Sequence[tuple[int, int]] = (),
                 cancelled: Callable[[], bool] | None = None) -> RayWorkerGroup:
        launch = (cfg, attempt, redis_url, evicted, resume_before_step, timeout_s, skip_steps, cancelled)
        try:
            return self._launch(*launch)
        except LaunchFailed as exc:
            if not isinstance(exc.__cause__, RayActorError):
                raise
            # A worker that died before it started: a spare on a node lost a moment ago (its
            # warm-up answered before), or a worker placed there while Ray still listed the node
            # alive. The next try places afresh, with the dead node noticed (place() looks
            # again); a restart spent on it would cost the budget and a backoff.
            log.warning("%s; placing the workers once more", exc)
            return self._launch(*launch)

    def _launch(self, cfg: JobConfig, attempt: int, redis_url: str, evicted: Iterable[str],
                resume_before_step: int | None, timeout_s: float, skip_steps: Sequence[tuple[int, int]],
                cancelled: Callable[[], bool] | None) -> RayWorkerGroup:
        held: tuple[str, ...] = ()  # the nodes this job just gave back: free to it, whatever Ray says yet
        if self.placement is not None:
            stale = self._stale_nodes(cfg, set(evicted))
            if stale is None:
                held = self.placement.node_ids
                self._release_placement()
            elif stale:
                self._place_again(cfg, stale, attempt, evicted, timeout_s, cancelled)
        if self.placement is None:
            self.placement = place(cfg, evicted=evicted, timeout_s=timeout_s,
                                   name=f"longrun-{cfg.job.name}-a{attempt}", held=held, cancelled=cancelled)
        self._cfg = cfg
        self._ensure_agents(cfg, redis_url, timeout_s)
        spares = self._take_spares() or [None] * cfg.world_size
        actors = [spare or self._new_actor(cfg, rank, f"a{attempt}-r{rank}")
                  for rank, spare in enumerate(spares)]
        config = cfg.model_dump(mode="json")
        snapshots = self._snapshot_plans(cfg, resume_before_step, timeout_s=max(timeout_s, 300.0))
        beat_to = self.agents.addresses if cfg.node_agents and self.agents is not None else {}
        try:
            pids = ray.get([a.assume.remote(config, rank, attempt, redis_url, list(self.placement.node_ids),
                                            resume_before_step, list(skip_steps), snapshots[rank],
                                            beat_to.get(self.placement.node_of(rank)), self.placement.names)
                            for rank, a in enumerate(actors)], timeout=timeout_s)
            if beat_to:  # each node's agent believes its ranks' processes only, from now on
                self.agents.expect(attempt, self._ranks_by_node(cfg, pids), timeout_s=timeout_s)
        except (RayError, ray.exceptions.GetTimeoutError) as exc:
            # A spare that died after warming, or a worker that never came up: start over clean
            # (the snapshot keepers stay: they hold what the next try restores from).
            self._abandon(actors)
            why = (f"not every one started within the placement deadline of {timeout_s:g} s "
                   "(health.startup.placement_s)" if isinstance(exc, ray.exceptions.GetTimeoutError)
                   else last_line(exc)[:300])
            raise LaunchFailed(f"attempt {attempt}'s workers did not start: {why}",
                               kind=fault_kind_of(unwrap(exc))) from exc
        try:
            self._check_shared_storage(cfg, actors, timeout_s)
        except LaunchFailed:
            self._abandon(actors)
            raise
        return RayWorkerGroup(self.placement, actors, self.agents if cfg.node_agents else None, attempt, pids)

    def _ensure_agents(self, cfg: JobConfig, redis_url: str, timeout_s: float) -> None:
        """Every node of the placement has a heartbeat agent listening before a rank beats."""
        if not cfg.node_agents:
            return
        if self.agents is None:
            self.agents = Agents(cfg, redis_url)
        try:
            self.agents.ensure(self.placement.node_ids, timeout_s=timeout_s)
        except (RayError, ray.exceptions.GetTimeoutError) as exc:
            self._release_placement()
            raise LaunchFailed(f"a heartbeat agent did not start: {last_line(exc)[:300]}") from exc

    def _ranks_by_node(self, cfg: JobConfig, pids: list[int]) -> dict[str, dict[int, tuple[int, int]]]:
        """node -> rank -> (its process's pid, its node index), for the heartbeat agents."""
        ranks: dict[str, dict[int, tuple[int, int]]] = {}
        per_node = cfg.cluster.workers_per_node
        for rank, pid in enumerate(pids):
            ranks.setdefault(self.placement.node_of(rank), {})[rank] = (pid, rank // per_node)
        return ranks

    def _abandon(self, actors: list[Any]) -> None:
        for actor in actors:
            ray.kill(actor, no_restart=True)
        self._release_placement()

    def _check_shared_storage(self, cfg: JobConfig, actors: list[Any], timeout_s: float) -> None:
        """Before a node first trains: is cfg.checkpoint_dir the directory the controller reads
        (checkpoint/shared.py)? One worker per node new to the job writes a probe; a node whose
        probe the controller cannot read is a fatal error (it would be on any restart)."""
        per_node, nodes = cfg.cluster.workers_per_node, self.placement.node_ids
        fresh = [i for i, node in enumerate(nodes) if node not in self._shared_storage_seen]
        if not fresh:
            return
        token = uuid.uuid4().hex[:12]
        try:
            ray.get([actors[i * per_node].write_probe.remote(token) for i in fresh], timeout=timeout_s)
        except (RayError, ray.exceptions.GetTimeoutError) as exc:
            raise LaunchFailed(f"a worker could not write to checkpoint.dir {cfg.checkpoint_dir}: "
                               f"{last_line(exc)[:300]}", kind=fault_kind_of(unwrap(exc))) from exc
        unseen = unseen_probes(cfg.checkpoint_dir, token, [nodes[i] for i in fresh])
        if unseen:
            named = ", ".join(self.placement.names.get(n, n) for n in unseen)
            raise LaunchFailed(
                f"checkpoint.dir {cfg.checkpoint_dir} is not one directory shared by every node: what "
                f"the workers on node(s) {named} wrote there, the controller cannot read. "
                "Every rank writes its pieces there and a restart on any node reads them: "
                "use storage every node mounts at the same path, or a URL (s3://..., gs://...)",
                kind=FaultKind.FATAL)
        self._shared_storage_seen.update(nodes[i] for i in fresh)

    def spare_nodes(self, cfg: JobConfig, evicted: Iterable[str]) -> int | None:
        """Live nodes beyond the job's own placement (never evicted) whose free resources could
        take one of its nodes' place now; None (unknown) while Ray's control store cannot list
        them. A busy node is no spare: growing onto it would wait on its resources."""
        own = self.placement.node_ids if self.placement is not None else ()
        try:
            return spare_nodes(cfg, alive_nodes(), evicted, own=own)
        except Exception as exc:  # a GCS restart must not end the controller
            log.warning("cannot list Ray's nodes (%s)", last_line(exc))
            return None

    def warm_spares(self) -> None:
        """Start and warm the next attempt's spares (called once the attempt trains, so their
        imports do not compete with its start-up). The attempt has restored by then: keepers on
        nodes it does not use are let go."""
        if self.keepers is not None and self.placement is not None:
            self.keepers.prune(self.placement.node_ids)
        if not self.spares_enabled or self.placement is None or self._spares or self._cfg is None:
            return
        self._generation += 1
        self._spares = [self._new_actor(self._cfg, rank, f"spare{self._generation}-r{rank}")
                        for rank in range(self._cfg.world_size)]
        self._warming = [s.warm.remote() for s in self._spares]

    def persist_snapshots(self, *, before_step: int | None, timeout_s: float) -> tuple[int | None, int]:
        """Before the job lets its keepers go (a stop between attempts): commit the newest
        snapshot every rank has, when newer than the newest committed checkpoint, as a
        checkpoint. (the step committed from memory or None, the newest committed step before);
        raises when the keepers held a newer step that could not be committed."""
        if self.keepers is None or self.keepers.layout_cfg is None:
            return None, 0
        stored = newest_committed_step(self.keepers.layout_cfg, before_step=before_step)
        return self.keepers.persist(newer_than=stored, before_step=before_step, timeout_s=timeout_s), stored

    def _persist(self, stored: int, before_step: int | None, *, timeout_s: float) -> int | None:
        try:
            return self.keepers.persist(newer_than=stored, before_step=before_step, timeout_s=timeout_s)
        except Exception as exc:  # a shortcut lost, not a reason to fail: storage has the rest
            log.warning("the memory snapshots of the old layout could not be committed (%s); the new "
                        "layout restores from the newest committed checkpoint (step %d)", last_line(exc),
                        stored)
            return None

    def _snapshot_plans(self, cfg: JobConfig, resume_before_step: int | None,
                        timeout_s: float = 300.0) -> list[dict | None]:
        """Per rank, what assume() needs for peer memory snapshots (None each when off): the
        keepers to send to, and the snapshot to restore from when one is newer than the newest
        committed checkpoint."""
        if cfg.checkpoint.memory_interval_steps == 0:
            return [None] * cfg.world_size
        nodes = self.placement.node_ids
        if self.keepers is None:
            # Keepers a dead controller of this job left, holding its newest snapshots, are taken
            # over (controller/keepers.py): every live node's, not only this placement's.
            self.keepers = Keepers(cfg.job.name, keeper_tag(cfg), keeper_orphan_s(cfg))
            try:
                self.keepers.adopt_survivors(n.node_id for n in alive_nodes())
            except Exception as exc:  # a shortcut: the restore falls back to storage
                log.warning("snapshot keepers left by an earlier controller not looked for (%s)",
                            last_line(exc))
        stored = newest_committed_step(cfg, before_step=resume_before_step)
        if self.keepers.layout not in (None, layout_key(cfg)):
            # A resize: the old layout's snapshots fit none of the new ranks, so the newest one
            # becomes a committed checkpoint, which the new layout restores by resharding.
            stored = max(stored, self._persist(stored, resume_before_step, timeout_s=timeout_s) or 0)
        try:
            # A resized attempt restores from storage: what the keepers held was the old layout's.
            resized = self.keepers.adopt(layout_key(cfg), cfg)
            restore = None if resized else self.keepers.plan(cfg.world_size, newer_than=stored,
                                                             before_step=resume_before_step)
            # What follows the step this attempt resumes from was trained on a path it leaves.
            self.keepers.drop_after(restore.step if restore else stored)
        except (RayError, ray.exceptions.GetTimeoutError) as exc:
            log.warning("memory snapshots off for this attempt: the keepers did not answer (%s)", exc)
            return [None] * cfg.world_size
        # After plan and drop_after, which forget the keepers that died (killed, or lost with
        # their node): a live keeper on every node of this attempt, a new one where the old went,
        # before any rank looks its keepers up. A shortcut, never a reason to fail: a keeper that
        # did not start leaves its ranks sending to their other one.
        try:
            self.keepers.ensure(nodes)
        except (RayError, ray.exceptions.GetTimeoutError) as exc:
            log.warning("a snapshot keeper did not start (%s); its ranks send to their other keeper", exc)
        return [{"targets": keeper_targets(nodes, rank, cfg.cluster.workers_per_node, cfg.job.name),
                 "restore": restore.to_dict() if restore else None} for rank in range(cfg.world_size)]

    def revive_keepers(self) -> None:
        """While the attempt runs (the controller asks every few seconds): a new snapshot keeper
        where one of its nodes' keepers died (`Keepers.revive`; never waits). A shortcut: what
        goes wrong here is logged, never raised."""
        cfg = self._cfg
        if self.keepers is None or self.placement is None or cfg is None:
            return
        if not cfg.checkpoint.memory_interval_steps:
            return
        try:
            self.keepers.revive(self.placement.node_ids, alive=lambda nodes: set(nodes) - dead_nodes(nodes))
        except Exception as exc:  # Ray's errors and a GCS that did not answer alike
            log.warning("snapshot keepers not checked (%s)", last_line(exc))

    def release(self) -> None:
        """Everything this launcher holds: the placement, the spares, the snapshot keepers."""
        self._release_placement()
        if self.keepers is not None:
            self.keepers.close()
            self.keepers = None
        if self.agents is not None:
            self.agents.close()
            self.agents = None

    def _release_placement(self) -> None:
        for spare in self._spares:
            if spare is not None:
                ray.kill(spare, no_restart=True)
        self._spares, self._warming = [], []
        if self.placement is not None:
            self.placement.remove()  # each group, even where another is gone with its node
            self.placement = None

    def _new_actor(self, cfg: JobConfig, rank: int, tag: str) -> Any:
        # max_concurrency 2: a query (node id, diagnostics) is served while run() trains.
        actor_cls = ray.remote(max_restarts=0, max_concurrency=2)(TrainWorker)
        return actor_cls.options(name=f"longrun-{cfg.job.name}-{tag}-{id(self):x}",
                                 scheduling_strategy=self.placement.strategy(rank),
                                 **actor_options(cfg)).remote()

    def _stale_nodes(self, cfg: JobConfig, evicted: set[str]) -> list[int] | None:
        """The node indices of the placement that the next attempt cannot use (dead or evicted);
        None when the job's size changed (everything is placed again)."""
        nodes = self.placement.node_ids
        if (len(nodes), self.placement.workers_per_node) != (cfg.cluster.nodes, cfg.cluster.workers_per_node):
            return None
        gone = dead_nodes(nodes) | evicted
        return [i for i, node in enumerate(nodes) if node in gone]

    def _place_again(self, cfg: JobConfig, stale: list[int], attempt: int, evicted: Iterable[str],
                     timeout_s: float, cancelled: Callable[[], bool] | None) -> None:
        """Replace the nodes at `stale`, keeping the others' bundles and warm spares. The spares
        of the replaced nodes go; if the re-placement fails, everything is let go (the next try
        places from scratch, with the old nodes counted as the job's own)."""
        old = self.placement
        for index in stale:
            for rank in old.ranks_on(index):
                if rank < len(self._spares) and self._spares[rank] is not None:
                    ray.kill(self._spares[rank], no_restart=True)
                    self._spares[rank] = None
        try:
            self.placement = place_again(old, cfg, stale, evicted=evicted, timeout_s=timeout_s,
                                         name=f"longrun-{cfg.job.name}-a{attempt}", cancelled=cancelled)
        except Exception:
            self._release_placement()
            raise
        log.info("placed node(s) %s again on %s; the other %d node(s) keep their workers' places and spares",
                 ", ".join(old.names.get(old.node_ids[i], old.node_ids[i]) for i in stale),
                 ", ".join(self.placement.names[self.placement.node_ids[i]] for i in stale),
                 len(old.node_ids) - len(stale))

    def _take_spares(self) -> list[Any | None]:
        """Per rank, its spare if it is alive and warm, else None (that rank starts fresh); []
        when there are no spares at all."""
        spares, warming = self._spares, self._warming
        self._spares, self._warming = [], []
        if not any(s is not None for s in spares):
            return []
        pending = [ref for ref in warming if ref is not None]
        ray.wait(pending, num_returns=len(pending), timeout=60)
        # A spare that warmed and died since (killed, its process lost) still has its warm-up's
        # answer: a call now finds it dead, and only its rank starts fresh, where assume() failing
        # would have cost every rank a new process.
        pings = {i: spare.node_id.remote() for i, spare in enumerate(spares) if spare is not None}
        ray.wait(list(pings.values()), num_returns=len(pings), timeout=SPARE_PING_S)
        taken: list[Any | None] = []
        for i, (spare, ref) in enumerate(zip(spares, warming, strict=True)):
            if spare is None:
                taken.append(None)
                continue
            try:
                ray.get([ref, pings[i]], timeout=0)
                taken.append(spare)
            except (RayError, ray.exceptions.GetTimeoutError) as exc:
                log.warning("a warm spare is unusable, its rank starts a fresh worker: %s", last_line(exc))
                ray.kill(spare, no_restart=True)
                taken.append(None)
        return taken
