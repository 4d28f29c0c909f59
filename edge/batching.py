"""The edge's forward scheduler: the target forwards of all sessions ready at once run as one.

Sessions do their work on the worker pool (decode the draft, verify, commit); every target forward
they need (a verification round, an edge-only token, a prefill chunk) is handed to this scheduler
and the session's thread waits for its logits. One scheduler thread gathers what is pending and
runs it through :func:`specdec.common.batched.forward_batch`:

- it starts a forward as soon as every session that is working has handed in its forward (no one
  else can join), or the pending tokens reach ``max_batch_tokens``, or the oldest request has
  waited ``wait_s`` (a session still decoding its draft does not hold the others for longer);
- requests are taken oldest first up to ``max_batch_tokens`` (at least one): no session starves;
- a prompt longer than ``max_batch_tokens`` is fed in chunks, each its own request, so a long
  prefill shares forwards with the rounds of other sessions instead of stalling them;
- if a batched forward fails, its requests are rerun one by one, so only the culprit's session
  sees the error.

No grpc and no clock inside the math: timing here is only for the scheduling decision and the
metrics the observer receives.
"""
from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from specdec.common.batched import ForwardRequest, batchable, forward_batch

log = logging.getLogger("specdec.edge")

# A forward of 256 new tokens costs the embedded target ~5x one of a single token on a CPU core,
# so a batch that full has long stopped being cheap per token; on a GPU raise it.
DEFAULT_MAX_BATCH_TOKENS = 256
# Decoding a draft packet takes ~0.1-2 ms here; a session that needs longer is not waited for.
DEFAULT_WAIT_S = 0.002


@dataclass(frozen=True)
class BatchSettings:
    enabled: bool = True                            # False: no scheduler, each session runs its own
                                                    # forwards on its worker thread (--no-batching)
    max_batch_tokens: int = DEFAULT_MAX_BATCH_TOKENS  # new tokens per target forward
    wait_s: float = DEFAULT_WAIT_S                  # longest wait of a ready forward for others


@dataclass(frozen=True)
class BatchStats:
    """One target forward, for metrics."""
    sessions: int
    tokens: int
    queue_seconds: tuple[float, ...]   # per request: from hand-in to the forward's start
    forward_seconds: float


@dataclass
class _Pending:
    request: ForwardRequest
    future: Future
    since: float


class ForwardScheduler:
    """Runs the target forwards of many sessions, batched; thread-safe, blocking :meth:`forward`."""

    def __init__(self, settings: BatchSettings = BatchSettings(),
                 observer: Callable[[BatchStats], None] | None = None):
        if settings.max_batch_tokens < 1:
            raise ValueError("max_batch_tokens must be >= 1")
        self.settings = settings
        self._observer = observer
        self._cond = threading.Condition()
        self._pending: deque[_Pending] = deque()
        self._working = 0       # threads now inside working(): each may still hand in a forward
        self._stopped = False
        self._thread = threading.Thread(target=self._loop, name="forward-scheduler", daemon=True)
        self._thread.start()

    # -- callers (session threads) -------------------------------------------------------------------
    @contextmanager
    def working(self) -> Iterator[None]:
        """Around a session's work: while inside, a forward may wait (briefly) for this thread."""
        with self._cond:
            self._working += 1
        try:
            yield
        finally:
            with self._cond:
                self._working -= 1
                self._cond.notify_all()

    def forward(self, request: ForwardRequest) -> torch.Tensor:
        """The logits ``request`` asks for, once a forward has run it (chunked if long)."""
        *chunks, last = self._chunks(request)
        for chunk in chunks:
            self._submit(chunk).result()
        return self._submit(last).result()

    def _chunks(self, r: ForwardRequest) -> list[ForwardRequest]:
        """A causal request longer than a batch, split in order; only the last chunk, which holds
        every position whose logits are asked for, returns logits. Trees are never split."""
        n, size = r.num_tokens, self.settings.max_batch_tokens
        if r.attend is not None or n <= size:
            return [r]
        last = max(r.num_logits, n % size or size)
        head = r.new_ids[:n - last]
        chunks = [ForwardRequest(r.lm, head[c:c + size], 0) for c in range(0, len(head), size)]
        return [*chunks, ForwardRequest(r.lm, r.new_ids[n - last:], r.num_logits)]

    def _submit(self, request: ForwardRequest) -> Future:
        future: Future = Future()
        with self._cond:
            if self._stopped:
                raise RuntimeError("the edge is shutting down")
            self._pending.append(_Pending(request, future, time.perf_counter()))
            self._cond.notify_all()
        return future

    def stop(self) -> None:
        with self._cond:
            self._stopped = True
            self._cond.notify_all()
        self._thread.join(timeout=5)

    # -- the scheduler thread ------------------------------------------------------------------------
    def _loop(self) -> None:
        while True:
            batch = self._next_batch()
            if batch is None:
                return
            self._run(batch)

    def _next_batch(self) -> list[_Pending] | None:
        with self._cond:
            while True:
                if self._stopped:
                    self._fail_pending()
                    return None
                if self._pending:
                    wait = self._pending[0].since + self.settings.wait_s - time.perf_counter()
                    if self._ready() or wait <= 0:
                        return self._take()
                    self._cond.wait(timeout=wait)
                else:
                    self._cond.wait()

    def _ready(self) -> bool:
        """No one else can join (everyone working has handed in), or the batch is full."""
        tokens = sum(p.request.num_tokens for p in self._pending)
        return len(self._pending) >= self._working or tokens >= self.settings.max_batch_tokens

    def _take(self) -> list[_Pending]:
        """Oldest first, up to max_batch_tokens (at least one request); a cache that cannot be
        padded (sliding-window layers) goes alone."""
        batch = [self._pending.popleft()]
        if not batchable(batch[0].request.lm):
            return batch
        tokens = batch[0].request.num_tokens
        while self._pending:
            nxt = self._pending[0].request
            if tokens + nxt.num_tokens > self.settings.max_batch_tokens or not batchable(nxt.lm):
                break
            batch.append(self._pending.popleft())
            tokens += nxt.num_tokens
        return batch

    def _fail_pending(self) -> None:
        while self._pending:
            self._pending.popleft().future.set_exception(RuntimeError("the edge is shutting down"))

    def _run(self, batch: list[_Pending]) -> None:
        start = time.perf_counter()
        try:
            results = forward_batch([p.request for p in batch])
        except Exception as exc:  # noqa: BLE001 - one session's bad request must not fail the others
            if len(batch) == 1:
                batch[0].future.set_exception(exc)
                return
            log.warning("batched forward of %d sessions failed; running them one by one", len(batch))
            for p in batch:
                self._run([p])
            return
        seconds = time.perf_counter() - start
        for p, logits in zip(batch, results):
            p.future.set_result(logits)
        if self._observer is not None:
            self._observer(BatchStats(sessions=len(batch), tokens=sum(p.request.num_tokens for p in batch),
                                      queue_seconds=tuple(start - p.since for p in batch),
                                      forward_seconds=seconds))

