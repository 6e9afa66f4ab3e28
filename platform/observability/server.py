"""One small HTTP server for a process's observability endpoints.

    server = ObservabilityServer(registry, targets=lambda: groups, host="127.0.0.1", port=0)
    server.url            # http://127.0.0.1:PORT
    GET /metrics          # the registry, in the format the scraper asks for (text or OpenMetrics)
    GET /sd               # Prometheus http_sd target groups (only when `targets` is given)
    server.close()

A stdlib ThreadingHTTPServer in a daemon thread: one slow scrape never holds up the next,
and the process exits without waiting for it. It binds loopback unless told otherwise; the
deploy files bind 0.0.0.0, where anyone on the network can connect, so a connection gets
`REQUEST_TIMEOUT_S` to send its request (Prometheus' own scrape timeout) and at most
`MAX_CONNECTIONS` are served at once: more are closed at once instead of each holding a thread
(an idle connection per thread had let a port scan pile up threads without end).
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from prometheus_client import CollectorRegistry
from prometheus_client.exposition import choose_encoder

log = logging.getLogger(__name__)

# Prometheus' http_sd accepts exactly this (optionally with charset=utf-8) and nothing else.
SD_CONTENT_TYPE = "application/json"
REQUEST_TIMEOUT_S = 10.0
MAX_CONNECTIONS = 16  # scrapers are one or two Prometheus servers and a person with curl


class _BoundedServer(ThreadingHTTPServer):
    """A thread per connection, at most `max_connections` at once; the rest closed unserved."""

    daemon_threads = True

    def __init__(self, address, handler, max_connections: int):
        self._slots = threading.BoundedSemaphore(max_connections)
        self.refused = 0
        super().__init__(address, handler)

    def process_request(self, request, client_address) -> None:
        if not self._slots.acquire(blocking=False):
            self.refused += 1
            self.shutdown_request(request)
            return
        try:
            super().process_request(request, client_address)
        except BaseException:
            self._slots.release()
            raise

    def process_request_thread(self, request, client_address) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._slots.release()


class ObservabilityServer:
    def __init__(self, registry: CollectorRegistry, targets: Callable[[], list[dict]] | None = None,
                 host: str = "127.0.0.1", port: int = 0):
        # `timeout`: socketserver sets it on each connection, so a silent client is dropped.
        handler = type("_Handler", (_Handler,), {"registry": registry, "targets": staticmethod(targets),
                                                 "owner": self, "timeout": REQUEST_TIMEOUT_S})
        self.scrapes = 0  # /metrics requests served: has anything ever scraped us?
        self._httpd = _BoundedServer((host, port), handler, MAX_CONNECTIONS)
        self.host = host
        self.port: int = self._httpd.server_address[1]
        # A short poll interval: close() (shutdown) waits up to one interval, and workers and
        # tests close these often; ten idle wake-ups a second cost nothing measurable.
        self._thread = threading.Thread(target=self._httpd.serve_forever, kwargs={"poll_interval": 0.1},
                                        name=f"observability-{self.port}", daemon=True)
        self._thread.start()

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    @property
    def sd_url(self) -> str:
        return f"{self.url}/sd"

    @property
    def refused(self) -> int:
        """Connections closed unserved because MAX_CONNECTIONS were being served."""
        return self._httpd.refused

    def close(self) -> None:
        if self._thread.is_alive():
            self._httpd.shutdown()
        self._httpd.server_close()

    def __enter__(self) -> ObservabilityServer:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class _Handler(BaseHTTPRequestHandler):
    registry: CollectorRegistry
    targets: Callable[[], list[dict]] | None
    owner: ObservabilityServer

    def do_GET(self) -> None:
        path = self.path.split("?", 1)[0]
        if path == "/metrics":
            encoder, content_type = choose_encoder(self.headers.get("Accept", ""))
            self._reply(200, content_type, encoder(self.registry))
            self.owner.scrapes += 1
        elif path == "/sd" and self.targets is not None:
            try:
                body = json.dumps(self.targets(), sort_keys=True).encode()
            except Exception as exc:  # a bug in the caller's callback; say so to the scraper
                log.exception("http_sd: the target callback failed")
                self._reply(500, "text/plain; charset=utf-8", f"target callback failed: {exc}\n".encode())
                return
            self._reply(200, SD_CONTENT_TYPE, body)
        elif path == "/":
            links = "/metrics" + (" /sd" if self.targets is not None else "")
            self._reply(200, "text/plain; charset=utf-8", f"longrun observability: {links}\n".encode())
        else:
            self._reply(404, "text/plain; charset=utf-8", b"not found\n")

    def _reply(self, code: int, content_type: str, body: bytes) -> None:
        self.send_response(code)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args) -> None:  # scrapes every second would flood stderr
        log.debug("%s %s", self.address_string(), format % args)
