"""A rank's log, shipped to the controller: its lines go to the job's Redis, never to the console.

Ray forwards every worker's stdout to the driver, which folds identical lines ("[repeated 28x
across cluster]") and, at 64 ranks, prints 64 of each. Instead every rank's log records and
its stdout/stderr lines are sent to one list of the attempt (keys.rank_logs_key); the
controller consumes it into `<output_dir>/<job>/logs/attempt-A/rank-R.log` on its own machine
(the head, for a submitted job: a node that died is the one whose disk cannot be read), keeps
each rank's last lines for the fault that names it, and prints a warning every rank shares once.
What goes to the original stdout/stderr still goes there (Ray's own worker log files keep it).
A record logged with `extra={"console": False}` stays in the file (and the fault's last lines).

Lines go only into a list the controller opened for the attempt (RPUSHX; controller/rank_logs.py
opens it before the ranks run, and again if a Redis restart lost it), so a rank that outlives its
attempt cannot recreate the attempt's keys after the controller deleted them.

Shipping must never slow or stop training: lines wait in a bounded queue (the oldest dropped,
and counted, while Redis is away) and a daemon thread sends them every `interval_s` in one
pipeline. A rank SIGKILLed loses at most the last interval's lines; one that fails in Python
flushes on its way out (`close`).
"""

from __future__ import annotations

import io
import json
import logging
import sys
import threading
import time
from collections import deque
from typing import Any, TextIO

import redis

from longrun import keys

MAX_QUEUED = 10_000  # lines kept while Redis is away
MAX_LIST = 200_000  # the list's bound when no controller consumes it (lines of all ranks)
INTERVAL_S = 0.5
FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


class RankLogShipper:
    def __init__(self, client: redis.Redis, job: str, attempt: int, rank: int, *,
                 interval_s: float = INTERVAL_S, max_queued: int = MAX_QUEUED):
        self.client, self.rank, self.interval_s = client, rank, interval_s
        self.key = keys.rank_logs_key(job, attempt)
        self._queue: deque[str] = deque(maxlen=max_queued)
        self._lock = threading.Lock()  # the queue
        self._sending = threading.Lock()  # one flush at a time
        self._sent_from = 0
        self.dropped = 0  # lines lost to a full queue
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="rank-log", daemon=True)
        self._handler = _ShippingHandler(self)
        self._streams: list[tuple[str, TextIO]] = []

    def put(self, level: str, line: str, at: float | None = None, text: str | None = None,
            console: bool = True) -> None:
        """One line; `text`: the message without its time, by which the controller tells that
        several ranks logged the same warning; `console`: False keeps a warning or error in
        the file only (one the controller reports in its own words)."""
        entry = {"rank": self.rank, "at": time.time() if at is None else at, "level": level, "line": line}
        if text is not None:
            entry["text"] = text
        if not console:
            entry["console"] = False
        record = json.dumps(entry)
        with self._lock:
            if len(self._queue) == self._queue.maxlen:
                self.dropped += 1
            self._queue.append(record)

    def start(self) -> RankLogShipper:
        """Ship the root logger's records (INFO and up) and every line of stdout and stderr."""
        root = logging.getLogger()
        root.addHandler(self._handler)
        if root.level > logging.INFO or root.level == logging.NOTSET:
            root.setLevel(logging.INFO)
        logging.captureWarnings(True)  # warnings.warn as WARNING records, not bare stderr lines
        for name, level in (("stdout", "INFO"), ("stderr", "STDERR")):
            original = getattr(sys, name)
            self._streams.append((name, original))
            setattr(sys, name, _TeeStream(original, self, level))
        self._thread.start()
        return self

    def flush(self) -> bool:
        """Send what is queued, in one pipeline; False when Redis did not take it (kept). One
        sender at a time (the thread, a logging flush), so nothing is sent twice or dropped."""
        with self._sending:
            with self._lock:
                batch = list(self._queue)
                self._sent_from = self.dropped
            if not batch:
                return True
            try:
                with self.client.pipeline(transaction=False) as pipe:
                    # Only into the list the controller opened: a rank outliving its attempt
                    # (killed, not yet gone) must not bring the attempt's keys back.
                    pipe.rpushx(self.key, *batch)
                    pipe.ltrim(self.key, -MAX_LIST, -1)
                    pipe.execute()
            except (redis.RedisError, OSError):
                return False
            with self._lock:
                # Lines dropped from the front while sending were among those just sent.
                for _ in range(max(0, len(batch) - (self.dropped - self._sent_from))):
                    self._queue.popleft()
            return True

    def close(self) -> None:
        """Stop shipping (the streams and handler are given back) after a last flush."""
        for name, original in self._streams:
            stream = getattr(sys, name)
            if isinstance(stream, _TeeStream):
                stream.flush_partial()
            setattr(sys, name, original)
        self._streams.clear()
        logging.getLogger().removeHandler(self._handler)
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=2 * self.interval_s + 1)
        self.flush()

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.flush()


class _ShippingHandler(logging.Handler):
    def __init__(self, shipper: RankLogShipper):
        super().__init__(logging.INFO)
        self.shipper = shipper
        self.setFormatter(logging.Formatter(FORMAT))

    def flush(self) -> None:
        """Send now: the fault injector flushes before it SIGKILLs its own process."""
        self.shipper.flush()

    def emit(self, record: logging.LogRecord) -> None:
        try:
            self.shipper.put(record.levelname, self.format(record), record.created,
                             text=record.getMessage(), console=getattr(record, "console", True))
        except Exception:  # logging must never raise into the training loop
            self.handleError(record)


class _TeeStream(io.TextIOBase):
    """Writes through to the original stream and ships each complete line."""

    def __init__(self, original: TextIO, shipper: RankLogShipper, level: str):
        self.original, self.shipper, self.level = original, shipper, level
        self._partial = ""

    def write(self, text: str) -> int:
        self.original.write(text)
        lines = (self._partial + text).split("\n")
        self._partial = lines.pop()
        for line in lines:
            if line.strip():
                self.shipper.put(self.level, line)
        return len(text)

    def flush(self) -> None:
        self.original.flush()

    def flush_partial(self) -> None:
        if self._partial.strip():
            self.shipper.put(self.level, self._partial)
        self._partial = ""

    def fileno(self) -> int:  # faulthandler and subprocesses write to the real descriptor
        return self.original.fileno()

    def isatty(self) -> bool:
        return False

    @property
    def encoding(self) -> str:  # type: ignore[override]
        return getattr(self.original, "encoding", "utf-8")

    def __getattr__(self, name: str) -> Any:
        return getattr(self.original, name)
