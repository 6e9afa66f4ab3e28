"""RedisStore against a real redis-server: the whole torch Store contract."""

from __future__ import annotations

import subprocess
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta

import pytest
import redis
import torch.distributed as dist
from hypothesis import given, settings
from hypothesis import strategies as st

from longrun import keys
from longrun.commgroup import rendezvous
from longrun.commgroup.store import (
    RedisStore,
    StoreConnectionError,
    StoreTimeoutError,
    delete_attempt_keys,
    redact,
)
from longrun.services import EmbeddedRedis, TlsFiles
from longrun.services.ports import free_port

NS = "longrun:test:a0:store:"


@pytest.fixture
def store(redis_server, redis_client):
    s = RedisStore(redis_server.url, NS, timeout=timedelta(seconds=10))
    yield s
    s.close()


def _wait_for_blocked_reader(client: redis.Redis, deadline_s: float = 10.0) -> None:
    """Block until some connection sits in XREAD: proof that a reader is waiting server-side."""
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        if any(c.get("cmd") == "xread" and "b" in c.get("flags", "") for c in client.client_list()):
            return
        time.sleep(0.005)  # polling Redis for a state change of another thread
    raise AssertionError("no reader blocked in XREAD")


def test_set_get_binary_and_str(store):
    blob = bytes(range(256)) + b"\x00\xff\xfe"
    store.set("bin", blob)
    assert store.get("bin") == blob
    store.set("text", "héllo")
    assert store.get("text") == "héllo".encode()
    store.set("empty", b"")
    assert store.get("empty") == b""


def test_get_blocks_until_another_client_sets(store, redis_server, redis_client):
    other = RedisStore(redis_server.url, NS)
    with ThreadPoolExecutor(1) as pool:
        future = pool.submit(store.get, "late")
        _wait_for_blocked_reader(redis_client)
        assert not future.done()
        other.set("late", b"here")
        assert future.result(timeout=10) == b"here"


def test_get_times_out_naming_the_key(redis_server):
    s = RedisStore(redis_server.url, NS, timeout=timedelta(milliseconds=300))
    start = time.monotonic()
    with pytest.raises(StoreTimeoutError, match=r"waiting for key\(s\) 'never'") as info:
        s.get("never")
    assert 0.3 <= time.monotonic() - start < 10
    assert info.value.missing == ["never"]
    assert isinstance(info.value, dist.DistStoreError)


def test_wait_with_and_without_timeout(store, redis_server, redis_client):
    store.set("a", b"1")
    store.wait(["a"])
    store.wait(["a"], timedelta(milliseconds=1))
    with pytest.raises(StoreTimeoutError) as info:
        store.wait(["a", "b", "c"], timedelta(milliseconds=200))
    assert info.value.missing == ["b", "c"]
    other = RedisStore(redis_server.url, NS)
    with ThreadPoolExecutor(1) as pool:
        future = pool.submit(store.wait, ["b", "c"])
        _wait_for_blocked_reader(redis_client)
        other.set("b", b"")
        other.add("c", 1)
        assert future.result(timeout=10) is None


def test_add_counts_and_interoperates_with_get(store):
    assert store.add("n", 1) == 1
    assert store.add("n", 5) == 6
    assert store.add("n", -2) == 4
    assert store.get("n") == b"4"


def test_many_concurrent_clients_add_exactly(redis_server):
    clients = [RedisStore(redis_server.url, NS) for _ in range(16)]

    def work(s):
        return [s.add("counter", 1) for _ in range(50)]

    with ThreadPoolExecutor(16) as pool:
        results = [v for vs in pool.map(work, clients) for v in vs]
    assert sorted(results) == list(range(1, 16 * 50 + 1))  # every increment seen exactly once


def test_append_check_delete_num_keys(store):
    store.append("log", b"ab")
    store.append("log", b"cd")
    assert store.get("log") == b"abcd"
    assert store.check(["log"]) and not store.check(["log", "nope"]) and store.check([])
    store.set("x", b"1")
    assert store.num_keys() == 2
    assert store.delete_key("x") is True
    assert store.delete_key("x") is False
    assert not store.check(["x"])
    assert store.num_keys() == 1


def test_multi_get_and_multi_set(store, redis_server, redis_client):
    store.multi_set(["m1", "m2"], [b"one", "two"])
    assert store.multi_get(["m1", "m2"]) == [b"one", b"two"]
    assert store.multi_get([]) == []
    with pytest.raises(ValueError, match="2 keys but 1 values"):
        store.multi_set(["a", "b"], [b"1"])
    other = RedisStore(redis_server.url, NS)
    with ThreadPoolExecutor(1) as pool:
        future = pool.submit(store.multi_get, ["m1", "m3"])  # blocks for the missing one
        _wait_for_blocked_reader(redis_client)
        other.set("m3", b"three")
        assert future.result(timeout=10) == [b"one", b"three"]


def test_timeout_property_and_clone(store):
    store.set_timeout(timedelta(seconds=42))
    assert store.timeout == timedelta(seconds=42)
    twin = store.clone()
    assert twin.timeout == timedelta(seconds=42)
    store.set("shared", b"v")
    assert twin.get("shared") == b"v"
    twin.close()


def test_works_through_prefix_store(store):
    prefixed = dist.PrefixStore("pg0", store)
    prefixed.set("k", b"v")
    assert store.get("pg0/k") == b"v"
    assert prefixed.add("c", 3) == 3
    assert prefixed.delete_key("k")
    assert prefixed.num_keys() >= 1


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(
    st.sampled_from(["set", "compare_set", "append", "add", "delete", "check"]),
    st.sampled_from(["k1", "k2"]),
    st.sampled_from([b"", b"a", b"b", b"1", b"ab"]),
    st.sampled_from([b"", b"a", b"b", b"7"]),
), max_size=25))
def test_same_results_as_torch_hashstore(redis_server, ops):
    """Any sequence of operations gives the results torch's own in-memory store gives."""
    ours = RedisStore(redis_server.url, f"longrun:prop:a{time.monotonic_ns()}:store:")
    theirs = dist.HashStore()
    try:
        for op, key, v1, v2 in ops:
            if op == "set":
                ours.set(key, v1)
                theirs.set(key, v1)
            elif op == "compare_set":
                assert ours.compare_set(key, v1, v2) == theirs.compare_set(key, v1, v2)
            elif op == "append":
                ours.append(key, v1)
                theirs.append(key, v1)
            elif op == "add":
                if not theirs.check([key]) or theirs.get(key).lstrip(b"-").isdigit():
                    assert ours.add(key, 3) == theirs.add(key, 3)
            elif op == "delete":
                assert ours.delete_key(key) == theirs.delete_key(key)
            else:
                assert ours.check([key]) == theirs.check([key])
        for key in ("k1", "k2"):
            assert ours.check([key]) == theirs.check([key])
            if theirs.check([key]):
                assert ours.get(key) == theirs.get(key)
    finally:
        ours.delete_namespace()
        ours.close()


def test_attempts_are_isolated_and_cleaned_up(redis_server, redis_client):
    first = RedisStore.for_attempt(redis_server.url, "iso", 0)
    second = RedisStore.for_attempt(redis_server.url, "iso", 1)
    first.set("rank0_addr", b"old")
    assert not second.check(["rank0_addr"])
    second.set("rank0_addr", b"new")
    assert first.get("rank0_addr") == b"old" and second.get("rank0_addr") == b"new"
    redis_client.set(keys.heartbeat_key("iso", 0, 0), b"{}")
    removed = delete_attempt_keys(redis_client, "iso", 0)
    assert removed == 3  # value, its signal stream, the heartbeat
    assert not first.check(["rank0_addr"]) and second.get("rank0_addr") == b"new"
    assert second.delete_namespace() == 2
    assert redis_client.keys("longrun:iso:*") == []


def test_namespace_with_glob_characters_is_matched_literally(redis_server, redis_client):
    a = RedisStore(redis_server.url, "ns[1]*:")
    b = RedisStore(redis_server.url, "ns1x:")
    a.set("k", b"1")
    b.set("k", b"1")
    assert a.num_keys() == 1
    a.delete_namespace()
    assert b.check(["k"])


def test_unreachable_redis_is_a_clear_error():
    port = free_port()  # nothing listens here
    start = time.monotonic()
    with pytest.raises(StoreConnectionError, match=f"cannot reach Redis at redis://127.0.0.1:{port}"):
        RedisStore(f"redis://127.0.0.1:{port}/0", NS, connect_timeout_s=2)
    assert time.monotonic() - start < 10


def test_wrong_password_is_a_clear_error_that_hides_the_password(redis_server):
    url = f"redis://:secret-guess@127.0.0.1:{redis_server.port}/0"
    with pytest.raises(StoreConnectionError, match="refused the credentials") as info:
        RedisStore(url, NS)
    assert "secret-guess" not in str(info.value)
    assert redact(url) == f"redis://:***@127.0.0.1:{redis_server.port}/0"


def _make_tls_files(tmp_path) -> TlsFiles:
    def openssl(*args):
        subprocess.run(["openssl", *args], check=True, capture_output=True)

    ca_key, ca, key, csr, cert = (tmp_path / n for n in ("ca.key", "ca.crt", "srv.key", "srv.csr", "srv.crt"))
    openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", ca_key, "-out", ca, "-days", "1",
            "-subj", "/CN=longrun-test-ca")
    openssl("req", "-newkey", "rsa:2048", "-nodes", "-keyout", key, "-out", csr, "-subj", "/CN=127.0.0.1")
    ext = tmp_path / "ext.cnf"
    ext.write_text("subjectAltName=IP:127.0.0.1\n")
    openssl("x509", "-req", "-in", csr, "-CA", ca, "-CAkey", ca_key, "-CAcreateserial", "-out", cert,
            "-days", "1", "-extfile", ext)
    return TlsFiles(cert=cert, key=key, ca=ca)


def test_tls_url_with_password(tmp_path):
    with EmbeddedRedis(tls=_make_tls_files(tmp_path)) as server:
        assert server.url.startswith("rediss://")
        s = RedisStore(server.url, NS)
        s.set("secure", b"yes")
        assert s.get("secure") == b"yes"
        # The plain-text protocol is refused on the TLS port.
        with pytest.raises(StoreConnectionError):
            RedisStore(f"redis://:{server.password}@127.0.0.1:{server.port}/0", NS, connect_timeout_s=2)


def test_threads_share_one_store(store, redis_server):
    """torch calls a store from several threads at once (gloo's async connects)."""
    barrier = threading.Barrier(8)

    def work(i):
        barrier.wait()
        store.set(f"t{i}", str(i))
        return store.get(f"t{(i + 1) % 8}")

    with ThreadPoolExecutor(8) as pool:
        got = list(pool.map(work, range(8)))
    assert got == [str((i + 1) % 8).encode() for i in range(8)]


def test_a_restarted_server_is_a_clear_error_then_the_store_reconnects(tmp_path):
    port = free_port()
    with EmbeddedRedis(port=port, password="pw") as server:
        store = RedisStore(server.url, NS, timedelta(seconds=5))
        store.set("k", b"v1")
        assert store.get("k") == b"v1"
    # The server is gone: the hot path says which server and which command, with no password.
    with pytest.raises(StoreConnectionError, match=r"Redis at redis://:\*+@127.0.0.1") as info:
        store.get("k")
    assert ":pw@" not in str(info.value)
    with EmbeddedRedis(port=port, password="pw"):  # back, empty (no persistence)
        store.set("k", b"v2")  # a fresh connection, and the Lua script loaded again
        assert store.get("k") == b"v2" and store.add("n", 3) == 3
    store.close()


def test_the_lean_client_encodes_every_argument_type():
    from longrun.commgroup.resp import pack

    assert pack(("SET", b"k\r\n", 12, "é")) == (
        b"*4\r\n$3\r\nSET\r\n$3\r\nk\r\n\r\n$2\r\n12\r\n$2\r\n\xc3\xa9\r\n")


# -- counting in (commgroup.rendezvous) and reading ahead (gloo's rendezvous) -------------------


def _counting(store: RedisStore) -> list[tuple]:
    """Every command `store` sends on its fast connection, recorded as it goes."""
    sent: list[tuple] = []
    call = store._fast.call
    store._fast.call = lambda *args: (sent.append(args), call(*args))[1]
    return sent


def test_counting_in_is_one_round_trip_and_the_last_rank_completes_the_world(redis_server, redis_client):
    stores = [RedisStore(redis_server.url, NS, timeout=timedelta(seconds=10)) for _ in range(3)]
    rendezvous.count_in(stores[0], 0, 3, "dims-A")  # (the first call loads the script)
    rendezvous.count_in(stores[0], 0, 3, "dims-A")  # a retried count-in counts once
    sent = _counting(stores[1])
    rendezvous.count_in(stores[1], 2, 3, "dims-A")
    assert [args[0] for args in sent] == ["EVALSHA"]  # joining, the layout check: one script
    assert rendezvous.missing_ranks(stores[0], 3) == [1]
    with pytest.raises(StoreTimeoutError, match="world/complete"):
        rendezvous.await_world(stores[0], timedelta(seconds=0.2))
    rendezvous.count_in(stores[2], 1, 3, "dims-A")
    assert rendezvous.missing_ranks(stores[0], 3) == []
    del sent[:]
    rendezvous.await_world(stores[1], timedelta(seconds=10))
    assert [args[0] for args in sent] == ["XREAD"]
    assert stores[1].get(rendezvous.COMPLETE) == b"1"  # a plain store key: the Store API sees it
    for s in stores:
        s.close()


def test_a_rank_that_counts_in_early_waits_on_an_event_not_a_poll(store, redis_server, redis_client):
    rendezvous.count_in(store, 0, 2, "dims-A")
    waiter = RedisStore(redis_server.url, NS, timeout=timedelta(seconds=30))
    sent = _counting(waiter)
    with ThreadPoolExecutor(1) as pool:
        done = pool.submit(rendezvous.await_world, waiter, timedelta(seconds=30))
        _wait_for_blocked_reader(redis_client)  # parked in XREAD on the server, not sleeping
        assert not done.done()
        rendezvous.count_in(RedisStore(redis_server.url, NS), 1, 2, "dims-A")
        done.result(timeout=10)
    # One blocking read, woken by the last count-in: a poll would have sent more than one.
    assert [args[0] for args in sent] == ["XREAD"]
    waiter.close()


def test_a_rank_with_another_layout_is_refused_at_once_naming_both(store, redis_server):
    rendezvous.count_in(store, 0, 4, "ParallelDims(dp=2, cp=2)")
    other = RedisStore(redis_server.url, NS)
    with pytest.raises(rendezvous.LayoutMismatchError, match=r"rank 3 was started with parallel layout "
                       r"ParallelDims\(dp=4, cp=1\).*joined first with ParallelDims\(dp=2, cp=2\)"):
        rendezvous.count_in(other, 3, 4, "ParallelDims(dp=4, cp=1)")
    assert rendezvous.missing_ranks(store, 4) == [1, 2, 3]  # the refused rank was not counted
    other.close()


def test_a_new_attempt_reads_nothing_of_the_dead_attempts_keys(redis_server, redis_client):
    dead = RedisStore.for_attempt(redis_server.url, "reform", 0, timedelta(seconds=10))
    for rank in range(2):  # the dead attempt was complete, and had another layout
        rendezvous.count_in(dead, rank, 2, "dims-old")
    dead_keys = set(redis_client.keys(keys.attempt_prefix("reform", 0) + "*"))
    assert dead_keys
    new = RedisStore.for_attempt(redis_server.url, "reform", 1, timedelta(seconds=10))
    sent = _counting(new)
    rendezvous.count_in(new, 0, 2, "dims-new")  # no mismatch with the old attempt's layout
    with pytest.raises(StoreTimeoutError):  # not complete: the old attempt's record is not seen
        rendezvous.await_world(new, timedelta(seconds=0.2))
    assert rendezvous.missing_ranks(new, 2) == [1]
    rendezvous.count_in(RedisStore.for_attempt(redis_server.url, "reform", 1), 1, 2, "dims-new")
    rendezvous.await_world(new, timedelta(seconds=10))
    named = [a for args in sent for a in args if isinstance(a, str | bytes)]
    assert not [a for a in named if (a.decode() if isinstance(a, bytes) else a).startswith(
        keys.attempt_prefix("reform", 0))]
    assert set(redis_client.keys(keys.attempt_prefix("reform", 0) + "*")) == dead_keys  # untouched
    delete_attempt_keys(redis_client, "reform", 0)
    delete_attempt_keys(redis_client, "reform", 1)


def test_reading_ahead_serves_a_groups_rendezvous_in_one_round_trip(store, redis_server):
    peers = RedisStore(redis_server.url, NS)
    for i in range(4):
        peers.set(f"g/0/{i}", f"addr{i}")
    sent = _counting(store)
    with store.reading_ahead(4):
        got = []
        for i in range(4):  # gloo's pattern: wait for each peer's key, then get it
            store.wait([f"g/0/{i}"])
            got.append(store.get(f"g/0/{i}"))
    assert got == [f"addr{i}".encode() for i in range(4)]
    assert [args[0] for args in sent] == ["XREAD"]
    peers.set("g/0/1", b"later")  # outside the block, reads ask the server again
    assert store.get("g/0/1") == b"later"
    peers.close()


def test_reading_ahead_waits_only_for_the_key_asked_for(store, redis_server, redis_client):
    other = RedisStore(redis_server.url, NS)
    other.set("h/0/1", b"one")  # peers 0 and 2 have not written yet
    with store.reading_ahead(3):
        store.wait(["h/0/1"], timedelta(seconds=5))  # returns at once: only its own key counts
        assert store.get("h/0/1") == b"one"
        # This thread reads ahead while it waits for key 0; the peers write from another.
        with ThreadPoolExecutor(1) as pool:
            def peers_write() -> None:
                _wait_for_blocked_reader(redis_client)
                other.set("h/0/2", b"two")  # a later peer's key wakes the read: it waits on for 0
                _wait_for_blocked_reader(redis_client)
                other.set("h/0/0", b"zero")

            writing = pool.submit(peers_write)
            store.wait(["h/0/0"], timedelta(seconds=30))
            writing.result(timeout=30)
        sent = _counting(store)
        assert store.get("h/0/0") == b"zero" and store.get("h/0/2") == b"two"
        assert sent == []  # both were read while waiting
        with pytest.raises(StoreTimeoutError, match="h/0/5"):  # an absent key still times out
            store.wait(["h/0/5"], timedelta(seconds=0.2))
    other.close()


def test_reading_ahead_through_torchs_prefix_store(store, redis_server):
    """gloo calls the store through PrefixStores: the keys arrive prefixed, the family holds."""
    writer = RedisStore(redis_server.url, NS)  # held: the PrefixStore calls back into it
    peers = dist.PrefixStore("grp", writer)
    for i in range(3):
        peers.set(f"0/{i}", f"a{i}")
    sent = _counting(store)
    prefixed = dist.PrefixStore("grp", store)
    with store.reading_ahead(3):
        for i in range(3):
            prefixed.wait([f"0/{i}"])
            assert prefixed.get(f"0/{i}") == f"a{i}".encode()
    assert [args[0] for args in sent] == ["XREAD"]
    writer.close()


def test_reading_ahead_a_large_group_reads_in_bounded_windows(store, redis_server):
    writer = RedisStore(redis_server.url, NS)
    writer.multi_set([f"big/0/{i}" for i in range(1500)], [f"v{i}" for i in range(1500)])
    sent = _counting(store)
    with store.reading_ahead(1500):
        for i in range(1500):
            store.wait([f"big/0/{i}"])
            assert store.get(f"big/0/{i}") == f"v{i}".encode()
    assert [args[0] for args in sent] == ["XREAD"] * 3  # 513 keys per XREAD at most, not 1,500
    assert max(len(args) for args in sent) <= 6 + 2 * 513
    writer.close()
