"""Batches of texts tokenised in worker processes, results back in submission order.

Each worker is a spawned process with its own pipe (no shared queue: a SIGKILLed process could
leave one locked, and a worker notices its parent is gone when its pipe reaches EOF, so a
killed `data prepare` leaves no orphans). Batch i goes to worker i % n and results are read
back in order i, so the output does not depend on how many workers there are or which is
faster; a bounded number of batches in flight keeps memory flat however large the input.
"""

from __future__ import annotations

import contextlib
import itertools
import multiprocessing
import os
import queue
import threading
import traceback
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import numpy as np
from tokenizers import Tokenizer

from longrun.data.errors import DataError

Encoded = tuple[np.ndarray, np.ndarray]  # (token ids back to back, each text's token count)
IN_FLIGHT_PER_WORKER = 2  # one being encoded, one waiting: a worker never idles on the parent


def make_encoder(kind: str, tokenizer_json: str | None, dtype: str) -> Callable[[list[str]], Encoded]:
    """A function encoding a batch of texts (no BOS/EOS) to (ids, lengths), ids in `dtype`."""
    out_dtype = np.dtype(dtype)
    if kind == "byte":
        def encode_bytes(texts: list[str]) -> Encoded:
            data = [t.encode("utf-8") for t in texts]
            lengths = np.fromiter(map(len, data), dtype=np.int64, count=len(data))
            return np.frombuffer(b"".join(data), dtype=np.uint8).astype(out_dtype), lengths

        return encode_bytes
    tok = Tokenizer.from_str(tokenizer_json)
    tok.encode_special_tokens = True  # as BPETokenizer: "<s>" in a document is text, not BOS

    def encode_bpe(texts: list[str]) -> Encoded:
        # encode_batch_fast: no offsets computed, which a token stream never needs.
        ids = [e.ids for e in tok.encode_batch_fast(texts, add_special_tokens=False)]
        lengths = np.fromiter(map(len, ids), dtype=np.int64, count=len(ids))
        flat = np.fromiter(itertools.chain.from_iterable(ids), dtype=out_dtype, count=int(lengths.sum()))
        return flat, lengths

    return encode_bpe


def _worker_main(conn, kind: str, tokenizer_json: str | None, dtype: str) -> None:
    # One thread per worker: the processes are the parallelism; a Rayon pool of every core in
    # each of them would only oversubscribe the machine. Read when Rayon first starts, below.
    os.environ.setdefault("RAYON_NUM_THREADS", "1")
    encode = make_encoder(kind, tokenizer_json, dtype)
    inbox: queue.SimpleQueue = queue.SimpleQueue()

    def receive() -> None:
        # Always draining the pipe means the parent's send never waits on this worker's own
        # (blocking) send of a result: no deadlock with large batches both ways.
        try:
            while (texts := conn.recv()) is not None:
                inbox.put(texts)
        except (EOFError, OSError):  # the parent is gone
            pass
        inbox.put(None)

    threading.Thread(target=receive, daemon=True).start()
    while (texts := inbox.get()) is not None:
        try:
            result: tuple = ("ok", *encode(texts))
        except Exception:
            result = ("error", traceback.format_exc())
        try:
            conn.send(result)
        except OSError:
            return


class EncoderPool:
    """`workers` processes encoding batches; workers=0 encodes in this process (same results)."""

    def __init__(self, workers: int, kind: str, tokenizer_json: str | None, dtype: str):
        self._conns: list[Any] = []
        self._procs: list[Any] = []
        self._inline = make_encoder(kind, tokenizer_json, dtype) if workers == 0 else None
        ctx = multiprocessing.get_context("spawn")  # no inherited threads or locks (fork is unsafe here)
        for i in range(workers):
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=_worker_main, args=(child, kind, tokenizer_json, dtype),
                               name=f"longrun-encode-{i}", daemon=True)
            proc.start()
            child.close()  # only the worker holds its end: EOF reaches it when we die
            self._conns.append(parent)
            self._procs.append(proc)

    def map(self, batches: Iterable[tuple[list[str], Any]]) -> Iterator[tuple[Encoded, Any]]:
        """Encode each (texts, tag) in order; yields ((ids, lengths), tag)."""
        if self._inline is not None:
            for texts, tag in batches:
                yield self._inline(texts), tag
            return
        n = len(self._conns)
        source = iter(batches)
        pending: deque[tuple[int, Any]] = deque()
        submitted = 0

        def submit() -> None:
            nonlocal submitted
            item = next(source, None)
            if item is not None:
                worker = submitted % n
                try:
                    self._conns[worker].send(item[0])
                except OSError:
                    self._died(worker)
                pending.append((worker, item[1]))
                submitted += 1

        for _ in range(n * IN_FLIGHT_PER_WORKER):
            submit()
        while pending:
            worker, tag = pending.popleft()
            result = self._receive(worker)
            submit()  # refill before the caller writes, so the workers keep busy meanwhile
            yield result, tag

    def _receive(self, worker: int) -> Encoded:
        try:
            msg = self._conns[worker].recv()
        except (EOFError, OSError):
            self._died(worker)
        if msg[0] == "error":
            raise DataError(f"encoding worker {worker} failed:\n{msg[1]}")
        return msg[1], msg[2]

    def _died(self, worker: int) -> None:
        self._procs[worker].join(timeout=5)
        code = self._procs[worker].exitcode
        raise DataError(f"encoding worker {worker} died (exit code {code}); rerun the same command "
                        "to resume from the last finished shard") from None

    def close(self, *, wait: bool = True) -> None:
        for conn in self._conns:
            if wait:
                with contextlib.suppress(OSError):  # a worker that died already
                    conn.send(None)
            conn.close()
        for proc in self._procs:
            proc.join(timeout=10 if wait else 0)
            if proc.is_alive():
                proc.kill()
                proc.join()

    def __enter__(self) -> EncoderPool:
        return self

    def __exit__(self, exc_type, *_) -> None:
        self.close(wait=exc_type is None)
