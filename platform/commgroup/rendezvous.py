"""Counting in: each rank joins an attempt in one round trip, and learns that every rank (so
every group) is there in one more.

    count_in(store, rank, world_size, layout)   # 1 round trip
    ... init_process_group ...                   # torch's own world rendezvous
    await_world(store, timeout)                  # 1 round trip once everyone came

Nothing here is per group. A rank counts in once for the whole attempt, so the moment the
world is complete every group is complete too: a group can only wait for ranks that have not
counted in, and those are missing from the world. A per-group record or counter would add a
round trip or a script step per rank and group (at 16,384 ranks x 18 groups, the most of a
million keys and operations torch's per-group pattern costs) and tell nothing the world's
member set does not: who is missing, and so which groups lack them.

The count-in is one Lua script: SADD the rank into the world's member set (a retried call
counts once), and when the set is full write the world's completion record (a store key with
its signal stream, so `RedisStore.wait` works on it too). Waiting is one XREAD on that stream:
it returns at once when the record exists and otherwise blocks server-side until the last
rank writes it - an event, never a poll. The same script checks that every rank forms the
same groups: the first rank to count in stores its parallel layout, and a rank whose layout
differs is refused at once, naming both, instead of waiting in torch for groups its peers
never form. Everything lives in the attempt's namespace: a new attempt reads nothing of a dead
one (whose keys the controller deletes when it ends).
"""

from __future__ import annotations

from datetime import timedelta

from longrun.commgroup.store import RedisStore, lua

__all__ = ["COMPLETE", "LayoutMismatchError", "RendezvousError", "await_world", "count_in", "missing_ranks"]

COMPLETE = "world/complete"  # the store key written when the last rank counts in

# KEYS: the layout key, the world's member set, the completion record's key and its signal
# stream. ARGV: rank, layout, world size. Returns the layout stored first: ARGV[2] unless the
# ranks disagree (and then nothing was recorded).
_COUNT_IN = lua("""
local layout = redis.call('GET', KEYS[1])
if not layout then
  redis.call('SET', KEYS[1], ARGV[2])
elseif layout ~= ARGV[2] then
  return layout
end
if redis.call('SADD', KEYS[2], ARGV[1]) == 1 and redis.call('SCARD', KEYS[2]) == tonumber(ARGV[3]) then
  redis.call('SET', KEYS[3], '1')
  redis.call('XADD', KEYS[4], 'MAXLEN', '1', '*', 'v', '1')
end
return ARGV[2]
""")


class RendezvousError(RuntimeError):
    """The world could not be formed; the message names the ranks that are missing."""

    def __init__(self, message: str, missing_ranks: list[int] | None = None):
        super().__init__(message)
        self.missing_ranks = missing_ranks or []


class LayoutMismatchError(RendezvousError):
    """Ranks of one attempt were started with different parallel layouts."""


def _members(store: RedisStore) -> str:
    return f"{store.namespace}m:world"


def count_in(store: RedisStore, rank: int, world_size: int, layout: str) -> None:
    """Join the attempt: one round trip. `layout` is what every rank must agree on (the
    parallel dims); raises LayoutMismatchError when the attempt's first rank came with
    another."""
    stored = store.run_script(
        _COUNT_IN, [f"{store.namespace}layout", _members(store), store._k(COMPLETE), store._s(COMPLETE)],
        [rank, layout, world_size])
    if stored != layout.encode():
        raise LayoutMismatchError(
            f"rank {rank} was started with parallel layout {layout}, but this attempt "
            f"(store {store.namespace!r}) was joined first with {stored.decode()}: every rank "
            "of an attempt must get the same parallelism config and world size")


def await_world(store: RedisStore, timeout: timedelta) -> None:
    """Block until every rank has counted in: one XREAD once they have. Raises the store's
    StoreTimeoutError after `timeout` (see `missing_ranks` for who is missing)."""
    store.read_values([COMPLETE], timeout)


def missing_ranks(store: RedisStore, world_size: int) -> list[int]:
    """The ranks that have not counted in (one SMEMBERS)."""
    came = {int(r) for r in store._client.smembers(_members(store))}
    return [r for r in range(world_size) if r not in came]
