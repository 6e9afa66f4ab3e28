"""A lean Redis connection for the store's hot path: one socket, hiredis parsing, nothing else.

Rendezvous is thousands of tiny round trips issued from gloo's C++ code through the Python
store, often with many processes per core. redis-py spends about 140 us of client CPU per
command (connection-pool checkout, retry and health-check machinery, response callbacks);
TCPStore's C++ client about 40. This client packs the command itself, writes it with one
`sendall` and feeds the reply to hiredis' C parser: a few tens of microseconds. It speaks
exactly what RedisStore needs (commands and replies, AUTH, SELECT, TLS) and is not a general
client: pipelines, scans and administration stay on redis-py.

One connection per thread (torch and gloo call a store from several threads; a shared socket
would need a lock, and a blocking read holding it would stall a writer in the same process),
or, where connections are counted (a training rank keeps to two: services/redis_client.py),
one connection shared by every thread (`SharedResp`): callers take turns in arrival order, a
blocked read holding it for at most one block (2 s; the store re-issues longer waits), and a
worker's store is used by one thread at a time in practice (gloo's rendezvous on the thread
that forms the groups; NCCL's monitor thread checks a key now and then).
"""

from __future__ import annotations

import socket
import ssl
import threading
from typing import Any

import hiredis
from redis.connection import parse_url

from longrun.redis_password import REDIS_SCHEMES


class RespError(Exception):
    """An error reply from the server (e.g. NOSCRIPT, WRONGPASS)."""


def pack(args: tuple[Any, ...]) -> bytes:
    parts = [b"*%d\r\n" % len(args)]
    for arg in args:
        if isinstance(arg, str):
            arg = arg.encode()
        elif isinstance(arg, int):
            arg = b"%d" % arg
        parts.append(b"$%d\r\n%s\r\n" % (len(arg), arg))
    return b"".join(parts)


class RespConnection:
    """One socket to one server; `call(*args)` sends a command and returns its reply."""

    def __init__(self, url: str, connect_timeout_s: float, read_timeout_s: float, name: str | None = None):
        if not url.startswith(REDIS_SCHEMES):
            # parse_url reads a unix:// URL as a socket path, and the TCP connect below would go
            # to localhost:6379 with the password: refuse what this client cannot reach.
            raise ValueError("the store connects over TCP only: give a redis:// or rediss:// URL, "
                             "not a unix socket")
        opts = parse_url(url)
        self._address = (opts.get("host", "localhost"), int(opts.get("port", 6379)))
        sock = socket.create_connection(self._address, timeout=connect_timeout_s)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if url.startswith("rediss://"):
            sock = _tls_context(opts).wrap_socket(sock, server_hostname=self._address[0])
        sock.settimeout(read_timeout_s)
        self._sock = sock
        self._reader = hiredis.Reader(replyError=RespError)
        if opts.get("password") is not None:
            auth = ("AUTH", opts["username"], opts["password"]) if opts.get("username") \
                else ("AUTH", opts["password"])
            self.call(*auth)
        if opts.get("db"):
            self.call("SELECT", int(opts["db"]))
        if name:  # what CLIENT LIST shows: whose connection this is
            self.call("CLIENT", "SETNAME", name)

    def call(self, *args: Any) -> Any:
        self._sock.sendall(pack(args))
        reader = self._reader
        reply = reader.gets()
        while reply is False:
            data = self._sock.recv(65536)
            if not data:
                raise ConnectionError(f"Redis at {self._address[0]}:{self._address[1]} closed the connection")
            reader.feed(data)
            reply = reader.gets()
        if isinstance(reply, RespError):
            raise reply
        return reply

    def close(self) -> None:
        self._sock.close()


def _tls_context(opts: dict) -> ssl.SSLContext:
    ctx = ssl.create_default_context(cafile=opts.get("ssl_ca_certs"))
    if opts.get("ssl_certfile"):
        ctx.load_cert_chain(opts["ssl_certfile"], opts.get("ssl_keyfile"))
    if str(opts.get("ssl_check_hostname", True)).lower() in ("false", "0", "no"):
        ctx.check_hostname = False
    if opts.get("ssl_cert_reqs") in ("none", ssl.CERT_NONE):
        ctx.check_hostname = False
        ctx.verify_mode = ssl.CERT_NONE
    return ctx


class PerThreadResp:
    """A RespConnection per calling thread, opened on first use, and closed together."""

    def __init__(self, url: str, connect_timeout_s: float, read_timeout_s: float,
                 error: type[Exception] = ConnectionError, where: str = "Redis", name: str | None = None):
        self._args = (url, connect_timeout_s, read_timeout_s, name)
        self._error, self._where = error, where
        self._local = threading.local()
        self._all: list[RespConnection] = []
        self._lock = threading.Lock()

    def conn(self) -> RespConnection:
        conn = getattr(self._local, "conn", None)
        if conn is None:
            conn = self._local.conn = RespConnection(*self._args)
            with self._lock:
                self._all.append(conn)
        return conn

    def call(self, *args: Any) -> Any:
        try:
            conn = self.conn()
        except OSError as exc:
            raise self._error(f"cannot connect to {self._where}: {exc}") from exc
        try:
            return conn.call(*args)
        except OSError as exc:  # ConnectionError and socket timeouts included
            # A broken socket (server restart, no reply in time): drop it so the next call
            # reconnects, and let the caller see the error.
            self._local.conn = None
            conn.close()
            raise self._error(f"lost the connection to {self._where} during {args[0]}: {exc}") from exc

    def close(self) -> None:
        with self._lock:
            conns, self._all = self._all, []
        for conn in conns:
            conn.close()


class SharedResp:
    """One RespConnection for every calling thread (opened on first use, again after a broken
    one), each call holding it from send to reply; waiting callers are served in arrival order
    (a ticket lock: a thread re-issuing a blocked read cannot starve a writer)."""

    def __init__(self, url: str, connect_timeout_s: float, read_timeout_s: float,
                 error: type[Exception] = ConnectionError, where: str = "Redis", name: str | None = None):
        self._args = (url, connect_timeout_s, read_timeout_s, name)
        self._error, self._where = error, where
        self._conn: RespConnection | None = None
        self._turns = threading.Condition()
        self._next_ticket = self._serving = 0

    def call(self, *args: Any) -> Any:
        with self._turns:
            ticket, self._next_ticket = self._next_ticket, self._next_ticket + 1
            self._turns.wait_for(lambda: self._serving == ticket)
        try:
            return self._call(args)
        finally:
            with self._turns:
                self._serving += 1
                self._turns.notify_all()

    def _call(self, args: tuple[Any, ...]) -> Any:
        if self._conn is None:
            try:
                self._conn = RespConnection(*self._args)
            except OSError as exc:
                raise self._error(f"cannot connect to {self._where}: {exc}") from exc
        try:
            return self._conn.call(*args)
        except OSError as exc:  # as PerThreadResp: drop the broken socket, the next call reconnects
            self._conn, conn = None, self._conn
            conn.close()
            raise self._error(f"lost the connection to {self._where} during {args[0]}: {exc}") from exc

    def close(self) -> None:
        with self._turns:
            conn, self._conn = self._conn, None
        if conn is not None:
            conn.close()
