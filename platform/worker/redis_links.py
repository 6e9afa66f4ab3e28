"""A training rank's Redis connections: two at most, whatever the rank does.

At 16,384 ranks every connection a rank opens is 16,384 on the server: five clients each
(heartbeats, the step ledger, the log shipper, commit reports, the rendezvous store, ...) were
80,000 connections against Redis's default `maxclients` of 10,000. So a rank opens two:

- `client`: ONE redis-py connection (a pool of one: callers take turns; every command is
  short), for everything but the store's hot path: heartbeats, the stop request, the step
  ledger, the log shipper, commit reports and restore votes (`patient`: the same connection,
  retried for `health.store_patience_s` and given back between tries), the store's pipelines
  and scans. It fails fast (`TIMEOUT_S`): the heartbeat and ledger retry on their own, a
  waiting caller gets the connection within a command's time.
- `fast`: the rendezvous store's hot path (commgroup/store.py), whose reads block server-side
  until a peer writes (up to 2 s a read, re-issued), and must not hold up the first.

Both carry a client name (`longrun:<job>:a<attempt>:r<rank>`, the store's with `:store`), so
`CLIENT LIST` says whose each connection is. Opening them imports no torch (the store's socket
is made when a store first asks for it): a rank's first heartbeat goes out before the imports,
which belong to its setup phase and its deadline.

    links = RankRedis(url, job, attempt, rank, patience_s=60.0)
    HeartbeatPublisher(links.client, ...); RedisCommitLedger(links.patient, ...)
    join_groups(..., links=links.store())
    links.close()
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from longrun.services.redis_client import PatientCalls

if TYPE_CHECKING:
    from longrun.commgroup.resp import SharedResp
    from longrun.commgroup.store import StoreLinks

TIMEOUT_S = 2.0  # connecting, each reply, and waiting for the connection another thread holds


def client_name(job: str, attempt: int, rank: int) -> str:
    return f"longrun:{job}:a{attempt}:r{rank}"


class RankRedis:
    def __init__(self, url: str, job: str, attempt: int, rank: int, *, patience_s: float,
                 timeout_s: float = TIMEOUT_S):
        self.name = client_name(job, attempt, rank)
        self.pool = redis.BlockingConnectionPool.from_url(
            url, max_connections=1, timeout=timeout_s, socket_connect_timeout=timeout_s,
            socket_timeout=timeout_s, retry=Retry(NoBackoff(), 0), client_name=self.name)
        self.client = redis.Redis(connection_pool=self.pool)
        self.patient = PatientCalls(self.client, patience_s)
        self.url = url
        self.fast: SharedResp | None = None  # the store's socket, from the first store on

    def store(self) -> StoreLinks:
        """What the rank's rendezvous stores borrow (they leave these open when they close)."""
        from longrun.commgroup.store import StoreLinks, store_socket  # torch: not before a store

        if self.fast is None:
            self.fast = store_socket(self.url, name=f"{self.name}:store")
        return StoreLinks(self.client, self.fast)

    def close(self) -> None:
        if self.fast is not None:
            self.fast.close()
        self.pool.disconnect()  # a client given a pool leaves it open when it closes
