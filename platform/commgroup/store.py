"""`RedisStore`: a `torch.distributed.Store` over Redis.

torch's process groups exchange their bootstrap data (gloo addresses, NCCL unique ids,
barrier counters) through a key-value store. TCPStore puts that store inside rank 0, which
must be up first and dies with it; Redis is an independent, replicated service that every
rank of every attempt can reach, which is what lets a recovering job re-form its world
without a rank 0 that survived.

Layout: under the attempt's namespace (`keys.store_prefix(job, attempt)`), key K is stored
at `<ns>k:K`, and every write to it also replaces the single entry of a stream `<ns>s:K` with
the new value, atomically (one Lua script). `get` is one `XREAD BLOCK ... 0-0` on that
stream: it returns the current value at once when K exists and otherwise blocks server-side
until K is written - one round trip either way, like TCPStore's get, with no race, no
polling storm and no keyspace-notification config, on any Redis >= 5. Every other operation
is one round trip too (a script, a pipeline, or MGET/MSET).

A store opens two kinds of connection of its own (redis-py's for pipelines and scans, one lean
socket per calling thread for the hot path), or borrows a training rank's (`StoreLinks`: its
client and one shared socket), so that a rank holds at most two Redis connections whatever
it does (services/redis_client.py `RankRedis`).

Two additions serve bring-up at scale (see `commgroup.rendezvous`): `read_values` waits for
many keys with one XREAD and returns their values, and `reading_ahead(count)` lets gloo's
rendezvous (each member `set`s `<prefix><rank>` and then `wait`s and `get`s every peer's key,
2n round trips per group) read all the peers' keys present at its first `wait` in that one
XREAD and answer the rest from what it read.
"""

from __future__ import annotations

import hashlib
import re
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from typing import NamedTuple

import redis
import torch.distributed as dist

from longrun import keys
from longrun.commgroup.resp import PerThreadResp, RespError, SharedResp
from longrun.keys import delete_attempt_keys as delete_attempt_keys  # the cleanup lives in keys.py
from longrun.keys import delete_matching, glob_escape
from longrun.redact import redact  # the one redaction: user-info and ?password= alike

DEFAULT_TIMEOUT = timedelta(minutes=5)
# A blocked read is re-issued at least this often, so the socket timeout can stay finite and
# a vanished server is noticed rather than waited on forever.
_BLOCK_CHUNK_S = 2.0

# compare_set with exactly the semantics of torch's HashStore/TCPStore: set when the key is
# missing and `expected` is empty, or when the current value equals `expected`; return the
# value now stored, or `expected` when the key is missing and nothing was set.
_COMPARE_SET = """
local cur = redis.call('GET', KEYS[1])
if (not cur and ARGV[1] == '') or (cur and cur == ARGV[1]) then
  redis.call('SET', KEYS[1], ARGV[2])
  redis.call('XADD', KEYS[2], 'MAXLEN', '1', '*', 'v', ARGV[2])
  return ARGV[2]
elseif not cur then
  return ARGV[1]
end
return cur
"""


# Writes as single scripts: the value and its signal change atomically in one command on the
# wire (a MULTI/EXEC pipeline would be four).
_SET = """
redis.call('SET', KEYS[1], ARGV[1])
redis.call('XADD', KEYS[2], 'MAXLEN', '1', '*', 'v', ARGV[1])
"""
_ADD = """
local n = redis.call('INCRBY', KEYS[1], ARGV[1])
redis.call('XADD', KEYS[2], 'MAXLEN', '1', '*', 'v', tostring(n))
return n
"""
_APPEND = """
redis.call('APPEND', KEYS[1], ARGV[1])
redis.call('XADD', KEYS[2], 'MAXLEN', '1', '*', 'v', redis.call('GET', KEYS[1]))
"""


class LuaScript(NamedTuple):
    """A Lua script and its SHA1, for `RedisStore.run_script`."""

    script: str
    sha: str


def lua(script: str) -> LuaScript:
    return LuaScript(script, hashlib.sha1(script.encode()).hexdigest())


# A key of the form "<prefix><index>": what gloo's full-mesh rendezvous sets and reads per peer.
_INDEXED = re.compile(r"^(.*?)(\d+)$", re.DOTALL)
# At most this many keys are read ahead by one XREAD (from the awaited index on, the order in
# which gloo waits), so a world-sized group never sends one enormous command.
_AHEAD_WINDOW = 512


class StoreTimeoutError(dist.DistStoreError):
    """Waited `timeout` for keys that never appeared; `missing` names them."""

    def __init__(self, namespace: str, missing: Sequence[str], timeout: timedelta):
        self.missing = list(missing)
        shown = ", ".join(repr(k) for k in self.missing[:8]) + (" ..." if len(self.missing) > 8 else "")
        super().__init__(
            f"timed out after {timeout.total_seconds():g} s waiting for key(s) {shown} in store {namespace!r}"
        )


class StoreConnectionError(dist.DistStoreError):
    pass


def _as_bytes(value) -> bytes:
    return value.encode() if isinstance(value, str) else bytes(value)


@dataclass(frozen=True)
class StoreLinks:
    """Connections a store borrows instead of opening its own (and leaves open when it closes):
    `client` for pipelines, scans and the connection check, `fast` for the hot path (one socket
    shared by the calling threads: `store_socket`)."""

    client: redis.Redis
    fast: SharedResp


def store_socket(url: str, name: str | None = None, connect_timeout_s: float = 10.0) -> SharedResp:
    """The one socket a store's hot path shares between threads (for `StoreLinks`); its reads
    block for at most one chunk at a time, so its timeout covers one chunk."""
    return SharedResp(url, connect_timeout_s, _BLOCK_CHUNK_S + connect_timeout_s, error=StoreConnectionError,
                      where=f"Redis at {redact(url)}", name=name)


class RedisStore(dist.Store):
    def __init__(self, url: str, namespace: str, timeout: timedelta = DEFAULT_TIMEOUT,
                 connect_timeout_s: float = 10.0, *, links: StoreLinks | None = None):
        super().__init__()
        self.url = url
        self.namespace = namespace
        self._connect_timeout_s = connect_timeout_s
        self.set_timeout(timeout)
        self._links = links
        if links is not None:
            self._client, self._fast = links.client, links.fast
        else:
            self._client = redis.Redis.from_url(
                url, socket_connect_timeout=connect_timeout_s,
                socket_timeout=_BLOCK_CHUNK_S + connect_timeout_s, socket_keepalive=True,
                health_check_interval=30)
            # The hot path (get, set, wait, add, ...) goes through a lean per-thread connection;
            # redis-py serves the rest (pipelines, scans) and the connection check below.
            self._fast = PerThreadResp(url, connect_timeout_s, _BLOCK_CHUNK_S + connect_timeout_s,
                                       error=StoreConnectionError, where=f"Redis at {redact(url)}")
        self._compare_set = self._client.register_script(_COMPARE_SET)
        self._set = self._client.register_script(_SET)
        self._add = self._client.register_script(_ADD)
        self._append = self._client.register_script(_APPEND)
        self._ahead = threading.local()  # reading_ahead's state, per calling thread
        try:
            self._client.ping()
        except redis.AuthenticationError as exc:
            raise StoreConnectionError(redact(
                f"Redis at {url} refused the credentials: {exc}. Check the password "
                "(cluster.redis_url, or $LONGRUN_REDIS_PASSWORD it refers to).")) from None
        except (redis.ConnectionError, redis.TimeoutError) as exc:
            raise StoreConnectionError(redact(
                f"cannot reach Redis at {url} within {connect_timeout_s:g} s: {exc}. "
                "Is the server running and the address right?")) from None

    @classmethod
    def for_attempt(cls, url: str, job: str, attempt: int, timeout: timedelta = DEFAULT_TIMEOUT, *,
                    links: StoreLinks | None = None) -> RedisStore:
        return cls(url, keys.store_prefix(job, attempt), timeout, links=links)

    # -- key mapping ---------------------------------------------------------------------------
    def _k(self, key: str) -> str:
        return f"{self.namespace}k:{key}"

    def _s(self, key: str) -> str:
        return f"{self.namespace}s:{key}"

    def _signal(self, pipe, key: str, value: bytes) -> None:
        pipe.xadd(self._s(key), {"v": value}, maxlen=1, approximate=False)

    def _script(self, script, key: str, *args):
        """EVALSHA on the fast connection; the first call on a fresh server loads the script."""
        try:
            return self._fast.call("EVALSHA", script.sha, 2, self._k(key), self._s(key), *args)
        except RespError as exc:
            if not str(exc).startswith("NOSCRIPT"):
                raise
            self._fast.call("SCRIPT", "LOAD", script.script)
            return self._fast.call("EVALSHA", script.sha, 2, self._k(key), self._s(key), *args)

    def run_script(self, script, keys_: Sequence[str], args: Sequence) -> object:
        """EVALSHA of a script (`lua(...)`, or one registered with redis-py) with raw Redis
        keys, on the fast connection; one round trip (two on a server that lost its scripts)."""
        try:
            return self._fast.call("EVALSHA", script.sha, len(keys_), *keys_, *args)
        except RespError as exc:
            if not str(exc).startswith("NOSCRIPT"):
                raise
            self._fast.call("SCRIPT", "LOAD", script.script)
            return self._fast.call("EVALSHA", script.sha, len(keys_), *keys_, *args)

    def _xread(self, streams: list[str], block_ms: int):
        """XREAD COUNT 1 BLOCK from 0-0: [(stream name, value)] for the streams with an entry."""
        reply = self._fast.call("XREAD", "COUNT", 1, "BLOCK", block_ms, "STREAMS", *streams,
                                *(["0-0"] * len(streams)))
        # RESP2 reply: [[stream, [[entry id, [b"v", value]]]], ...] or nil after the block.
        return [(name.decode(), entries[0][1][1]) for name, entries in reply or ()]

    # -- the Store contract --------------------------------------------------------------------
    def set(self, key: str, value) -> None:
        self._script(self._set, key, _as_bytes(value))

    def get(self, key: str) -> bytes:
        read = getattr(self._ahead, "read", None)
        if read is not None and key in read:
            return read.pop(key)  # read ahead by the `wait` before it (see `reading_ahead`)
        timeout = self.timeout
        deadline = time.monotonic() + timeout.total_seconds()
        stream = self._s(key)
        while True:
            remaining = deadline - time.monotonic()
            block_ms = max(1, int(min(remaining, _BLOCK_CHUNK_S) * 1000))
            # The stream's one entry is the current value; from 0-0 it is returned at once
            # when the key exists, else this blocks until the key is written.
            reply = self._xread([stream], block_ms)
            if reply:
                return reply[0][1]
            if remaining <= 0:
                raise StoreTimeoutError(self.namespace, [key], timeout)

    def add(self, key: str, amount: int) -> int:
        return int(self._script(self._add, key, int(amount)))

    def compare_set(self, key: str, expected_value, desired_value) -> bytes:
        return self._script(self._compare_set, key, _as_bytes(expected_value), _as_bytes(desired_value))

    def append(self, key: str, value) -> None:
        self._script(self._append, key, _as_bytes(value))

    def check(self, keys_: list[str]) -> bool:
        if not keys_:
            return True
        unique = list(dict.fromkeys(keys_))
        return self._fast.call("EXISTS", *[self._k(k) for k in unique]) == len(unique)

    def wait(self, keys_: list[str], timeout: timedelta | None = None) -> None:
        timeout = self.timeout if timeout is None else timeout
        deadline = time.monotonic() + timeout.total_seconds()
        missing = list(dict.fromkeys(keys_))
        read = getattr(self._ahead, "read", None)
        if read is not None:
            missing = [k for k in missing if k not in read]
            if len(missing) == 1 and _INDEXED.match(missing[0]):
                self._read_ahead(missing[0], read, timeout, deadline)
                return
        while missing:
            remaining = deadline - time.monotonic()
            block_ms = max(1, int(min(max(remaining, 0.001), _BLOCK_CHUNK_S) * 1000))
            # From 0-0, XREAD returns every stream that has an entry (a key that exists) at
            # once, and otherwise blocks until one is written: one round trip when all exist.
            written = {name for name, _ in self._xread([self._s(k) for k in missing], block_ms)}
            missing = [k for k in missing if self._s(k) not in written]
            if missing and remaining <= 0:
                raise StoreTimeoutError(self.namespace, missing, timeout)

    def read_values(self, keys_: Sequence[str], timeout: timedelta | None = None) -> dict[str, bytes]:
        """Wait until every key exists and return {key: value}: one XREAD when they all exist
        already (a blocking multi-get; each XREAD returns every key then present)."""
        timeout = self.timeout if timeout is None else timeout
        deadline = time.monotonic() + timeout.total_seconds()
        values: dict[str, bytes] = {}
        missing = list(dict.fromkeys(keys_))
        by_stream = {self._s(k): k for k in missing}
        while missing:
            remaining = deadline - time.monotonic()
            block_ms = max(1, int(min(max(remaining, 0.001), _BLOCK_CHUNK_S) * 1000))
            for name, value in self._xread([self._s(k) for k in missing], block_ms):
                values[by_stream[name]] = value
            missing = [k for k in missing if k not in values]
            if missing and remaining <= 0:
                raise StoreTimeoutError(self.namespace, missing, timeout)
        return values

    @contextmanager
    def reading_ahead(self, count: int) -> Iterator[None]:
        """Within this block (on this thread), a `wait` for one key `<prefix><i>` also reads
        every present key of `<prefix><i+1>` .. `<prefix><count-1>` (the next 512 at most:
        gloo waits for its peers in rank order) in the same XREAD, and later
        `wait`s and `get`s of those keys are answered from what was read. This is the shape of
        gloo's rendezvous for a group of `count` members; a wait returns as soon as its own
        key is there (it never waits for the others), so any other caller is served as before.
        Values are taken once (a key's second `get` asks the server), and forgotten on exit."""
        outer = getattr(self._ahead, "read", None), getattr(self._ahead, "count", 0)
        self._ahead.read, self._ahead.count = {}, int(count)
        try:
            yield
        finally:
            self._ahead.read, self._ahead.count = outer

    def _read_ahead(self, key: str, read: dict[str, bytes], timeout: timedelta, deadline: float) -> None:
        prefix, index = _INDEXED.match(key).groups()
        first = int(index)
        ahead = range(first + 1, min(self._ahead.count, first + 1 + _AHEAD_WINDOW))
        family = [key] + [f"{prefix}{i}" for i in ahead if f"{prefix}{i}" not in read]
        by_stream = {self._s(k): k for k in family}
        while key not in read:
            remaining = deadline - time.monotonic()
            block_ms = max(1, int(min(max(remaining, 0.001), _BLOCK_CHUNK_S) * 1000))
            # From 0-0: every family key present now comes back at once; when the awaited one
            # is missing this blocks until some family key is written (each pass takes at
            # least one new key, so this never spins).
            wanted = [self._s(k) for k in family if k not in read]
            for name, value in self._xread(wanted, block_ms):
                read[by_stream[name]] = value
            if key not in read and remaining <= 0:
                raise StoreTimeoutError(self.namespace, [key], timeout)

    def delete_key(self, key: str) -> bool:
        with self._client.pipeline(transaction=True) as pipe:
            pipe.delete(self._k(key))
            pipe.delete(self._s(key))
            return pipe.execute()[0] > 0

    def num_keys(self) -> int:
        return sum(1 for _ in self._client.scan_iter(match=self._pattern("k:"), count=1000))

    def multi_get(self, keys_: list[str]) -> list[bytes]:
        values = self._client.mget([self._k(k) for k in keys_]) if keys_ else []
        if any(v is None for v in values):
            self.wait(keys_)
            values = self._client.mget([self._k(k) for k in keys_])
            if any(v is None for v in values):
                raise StoreTimeoutError(self.namespace, [k for k, v in zip(keys_, values, strict=True)
                                                         if v is None], self.timeout)
        return values

    def multi_set(self, keys_: list[str], values: list) -> None:
        if len(keys_) != len(values):
            raise ValueError(f"multi_set got {len(keys_)} keys but {len(values)} values")
        if not keys_:
            return
        with self._client.pipeline(transaction=True) as pipe:
            encoded = [_as_bytes(v) for v in values]
            pipe.mset({self._k(k): v for k, v in zip(keys_, encoded, strict=True)})
            for k, v in zip(keys_, encoded, strict=True):
                self._signal(pipe, k, v)
            pipe.execute()

    def has_extended_api(self) -> bool:
        return True

    def clone(self) -> RedisStore:
        """A store over the same namespace (torch clones a store for use from another thread):
        with its own connections, or the same borrowed ones (they serve any thread)."""
        return RedisStore(self.url, self.namespace, self.timeout, self._connect_timeout_s, links=self._links)

    # torch's C++ trampoline calls these two under their C++ names.
    deleteKey = delete_key
    getNumKeys = num_keys

    # -- lifecycle -----------------------------------------------------------------------------
    def _pattern(self, sub: str = "") -> str:
        return f"{glob_escape(self.namespace)}{sub}*"

    def delete_namespace(self) -> int:
        """Delete every key of this namespace (an attempt's store when the attempt ends)."""
        return delete_matching(self._client, self._pattern())

    def close(self) -> None:
        if self._links is not None:
            return  # borrowed: their owner closes them
        self._fast.close()
        self._client.close()
