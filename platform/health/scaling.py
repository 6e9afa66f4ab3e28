"""Elastic continuation as a pure policy: how many nodes the job runs on, and why.

As Ray Train v2's scaling policy: the inputs are numbers (the nodes that can be placed, the
job's configured count, `recovery.min_nodes`, how long the job has been short of nodes), the
output is one `SizeDecision` with a sentence that names them, and the controller only carries
it out (controller/elastic.py derives the smaller config; controller.py places it, or asks the
workers to save at a step boundary before a grow). No I/O, no clock.

Which sizes exist is arithmetic (`shrunk_degrees`): only the data-parallel degrees shrink,
parallelism.dp first, then parallelism.fsdp. cp, tp and pp cut one model replica, and a
replica cannot lose a piece, so they stay; a world of n nodes x workers_per_node ranks must
be dp' x fsdp' x cp x tp x pp with dp' <= dp and fsdp' <= fsdp (neither grows: a larger
fsdp or dp than configured was never asked for, and a smaller fsdp than needed is the price
of fewer nodes, not a choice).

Busy is not gone: a node that is alive but whose resources another job holds cannot be
placed now (it is not `available`) yet still exists (`existing`). The job continues on what
can be placed, and when not even `recovery.min_nodes` can, it waits for the busy nodes to free
up rather than giving up: only nodes that do not exist at all end the job.

    policy = ScalingPolicy(configured=4, min_nodes=2, shrink_after_s=60, sizes=frozenset({2, 3}))
    policy.short(available=3, waited_s=75)     # SHRINK to 3
    policy.short(available=1, waited_s=75, existing=4)  # WAIT: three nodes are busy, not gone
    policy.running(current=3, available=4)     # GROW to 4
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

__all__ = ["Resize", "ScalingPolicy", "SizeDecision", "shrunk_degrees"]


def shrunk_degrees(dp: int, fsdp: int, fixed: int, workers: int) -> tuple[int, int] | None:
    """(dp', fsdp') with dp' x fsdp' x `fixed` (cp x tp x pp) = `workers`, dp' <= dp and
    fsdp' <= fsdp, keeping fsdp' as large as it can be (dp shrinks first: fewer replicas
    change no rank's share of the weights); None when no such pair exists."""
    if workers < 1 or workers % fixed:
        return None
    span = workers // fixed
    for f in range(min(fsdp, span), 0, -1):
        if span % f == 0 and span // f <= dp:
            return span // f, f
    return None


class Resize(enum.StrEnum):
    KEEP = "keep"  # run at the size the job has
    WAIT = "wait"  # too few nodes, still within shrink_after_s: try the full size again
    SHRINK = "shrink"  # continue on fewer nodes
    GROW = "grow"  # capacity is back: save at a step boundary, restart at the configured size
    GIVE_UP = "give_up"  # too few nodes for any size the job may run at


@dataclass(frozen=True)
class SizeDecision:
    action: Resize
    nodes: int  # the node count to run at (KEEP, WAIT, GIVE_UP: the one the job has or wants)
    reason: str  # one sentence, for the event log and `longrun status`


@dataclass(frozen=True)
class ScalingPolicy:
    configured: int  # cluster.nodes
    min_nodes: int | None  # recovery.min_nodes; None: not elastic
    shrink_after_s: float  # recovery.shrink_after_s
    sizes: frozenset[int] = frozenset()  # node counts below `configured` the layout can shrink to

    @property
    def elastic(self) -> bool:
        return self.min_nodes is not None

    def short(self, available: int | None, waited_s: float, existing: int | None = None) -> SizeDecision:
        """The configured node count cannot be placed: `available` nodes can be now (None:
        unknown), `existing` eligible nodes exist at all, busy ones included (None: as many as
        are available), and the job has been short for `waited_s`. WAIT, SHRINK or GIVE_UP."""
        want = self.configured
        have = "an unknown number" if available is None else f"{available} of {want}"
        busy = 0 if available is None or existing is None else max(0, existing - available)
        if self.min_nodes is None:
            return SizeDecision(Resize.GIVE_UP, want, (
                f"only {have} node(s) can be placed and the job is not elastic (recovery.min_nodes "
                "is unset), so it cannot continue on fewer."))
        if available is None or waited_s < self.shrink_after_s:
            return SizeDecision(Resize.WAIT, want, (
                f"{have} node(s) can be placed; waiting for the rest ({waited_s:.0f} s of "
                f"recovery.shrink_after_s = {self.shrink_after_s:g} s) before continuing on fewer."))
        fits = [n for n in self.sizes if self.min_nodes <= n <= available and n < want]
        if fits:
            n = max(fits)
            return SizeDecision(Resize.SHRINK, n, (
                f"{have} node(s) can be placed after {waited_s:.0f} s (recovery.shrink_after_s = "
                f"{self.shrink_after_s:g} s); continue on {n} (recovery.min_nodes = {self.min_nodes}) "
                f"with the same global batch, and grow back to {want} when they can be placed."))
        if busy and any(self.min_nodes <= n <= existing for n in self.sizes | {want}):
            return SizeDecision(Resize.WAIT, want, (
                f"only {have} node(s) can be placed now and {busy} more are busy (another job holds "
                f"their resources), too few for any size from recovery.min_nodes ({self.min_nodes}); "
                "busy is not gone: waiting for them to free up."))
        if available < self.min_nodes:
            why = f"fewer than recovery.min_nodes ({self.min_nodes})"
        else:
            why = (f"and the layout cannot shrink to any size from recovery.min_nodes ({self.min_nodes}) "
                   f"to {available} (only parallelism.dp and parallelism.fsdp shrink)")
        return SizeDecision(Resize.GIVE_UP, want, (
            f"only {have} node(s) can be placed after {waited_s:.0f} s, {why}; add nodes or lower "
            "recovery.min_nodes."))

    def running(self, current: int, available: int | None) -> SizeDecision:
        """An attempt runs on `current` nodes while `available` could be placed (the job's own
        included; None: unknown). GROW back to the configured size once it fits, else KEEP.
        Only to the configured size: every resize costs a save and a restart."""
        want = self.configured
        if current >= want:
            return SizeDecision(Resize.KEEP, current, f"running on its configured {want} node(s).")
        if available is None or available < want:
            have = "an unknown number of" if available is None else f"{available} of"
            return SizeDecision(Resize.KEEP, current, (
                f"{have} {want} node(s) can be placed; keep running on {current}."))
        return SizeDecision(Resize.GROW, want, (
            f"{available} node(s) can be placed again, enough for the configured {want}; grow from "
            f"{current} after a checkpoint at the next step boundary."))
