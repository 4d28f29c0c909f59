"""The edge's forward scheduler: the target forwards of all sessions ready at once run as one.

Sessions do their work on the worker pool (decode the draft, verify, commit); every target forward
they need (a verification round, an edge-only token, a prefill chunk) is handed to this scheduler
and the session's thread waits for its logits. One scheduler thread gathers what is pending and
runs it through :func:`specdec.edge.batched.forward_batch`:

- it starts a forward as soon as every session that is working has handed in its forward and no
  other session is worth waiting for (below), or the pending tokens reach ``max_batch_tokens``, or
  the oldest request has waited ``wait_s`` for a session still decoding its draft. A session not
  pending is due back when the gap it usually leaves between its forwards (round trip and the
  drafting not hidden by drafting ahead; ~1 ms for an edge-only session's next token) ends; it is
  worth waiting for if it is due sooner than what one shared forward saves over two,
  c(pending) + c(its tokens) - c(both), from the edge's cost curve. Without that wait, sessions
  whose gaps are shorter than a forward split into groups that take turns: each forward serves
  one group while the others wait for it, and batches stay small;
- requests are taken oldest first up to ``max_batch_tokens`` (at least one): no session starves;
- a prompt longer than ``max_batch_tokens`` is fed in chunks, each its own request, so a long
  prefill shares forwards with the rounds of other sessions instead of stalling them;
- if a batched forward fails, its requests are rerun one by one, so only the culprit's session
  sees the error;
- the rounds drafted in a forward are verified together right after it, as batch tensor work
  (:func:`specdec.edge.verify_batch.verify_rounds`): each session gets its verdict, not its logits,
  and only the verdicts (a few integers a round) leave the target's device. If that fails, each round
  is verified alone, so again only the culprit's session sees the error;
- with ``verify_overlap`` on (CUDA's default), a forward's rounds are verified on a thread of their
  own (:class:`_Behind`) while this thread starts the next forward for the sessions not waiting on
  it: verification is mostly host work (the packets' rows, each round's checks, the transfers of its
  decisions), and run between forwards it leaves the GPU idle (the ~8B edge's forwards took 55-65 % of
  an N = 32 cell on an H200, docs/gpu.md). The device runs the forwards in the order they were
  started and the verification on a stream of its own; every verdict is the one it would be without
  overlap (the rounds draw from their own streams, whichever thread verifies them).

No grpc and no clock inside the math: timing here is only for the scheduling decision and the
metrics the observer receives.
"""
from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from contextlib import contextmanager
from dataclasses import dataclass, replace

import torch

from specdec.edge.batched import BatchWorkspace, ForwardRequest, batch_key, batchable, forward_batch
from specdec.common.loadaware import CURVE_POINTS, CostCurve, best_draft_len
from specdec.common.modeling import CachedLM
from specdec.edge.noise_ahead import NOISE_AHEAD, draw_ahead, kept
from specdec.edge.slots import SlotPool, slots_supported
from specdec.edge.verify_batch import ChainRound, RoundOutcome, verify_rounds

log = logging.getLogger("specdec.edge")


@dataclass(frozen=True)
class DeviceDefaults:
    """The scheduler's defaults on one kind of device (the CLI's help and docs/gpu.md list them)."""
    max_batch_tokens: int
    wait_s: float
    kv_cache: str      # "slots" or "per-session" (edge/slots.py, edge/batched.py)
    cuda_graphs: str   # "on" or "off": chain forwards of KV slots replayed from CUDA graphs (edge/slots.py)
    noise_ahead: str   # "on" or "off": a round's noise drawn by its session while the forward runs (edge/noise_ahead.py)
    verify_overlap: str  # "on" or "off": a forward's rounds verified while the next forward runs (_Behind)


DEVICE_DEFAULTS = {
    # On a CPU core a forward's cost grows with its new tokens well before 256 of them, so a batch
    # that full has long stopped being cheap per token. A wait of a draft packet's decode time or so;
    # a session that needs longer is not waited for. Per-session caches: memory
    # follows each session's length, and copying them costs little next to a CPU forward.
    # Noise ahead and verification overlap: off, since the cores they would run on run the forward.
    "cpu": DeviceDefaults(max_batch_tokens=256, wait_s=0.002, kv_cache="per-session", cuda_graphs="off",
                          noise_ahead="off", verify_overlap="off"),
    # A GPU reads its weights once per forward whatever the batch: an 8B model's forward of 256
    # tokens costs ~1.9x one of a single token (vLLM on an H100), so 64 sessions x 8 tokens fit in
    # one forward; a prefill chunk of 512 tokens holds the others' rounds for ~2-3 forwards. KV
    # slots: no per-session copy in a forward, which a GPU would pay in thousands of small kernels.
    # CUDA graphs: a forward of a few tokens a session is launch-bound (an ~8B one 21-24 ms eager,
    # 8-11 ms replayed on an H200: docs/gpu.md). Noise ahead: the host's cores idle while the GPU
    # runs the forward, and the race noise of 32 sessions' rounds is more host work than the forward.
    # Verification overlap: the same idle host, and a GPU idle while the host verifies.
    "cuda": DeviceDefaults(max_batch_tokens=512, wait_s=0.002, kv_cache="slots", cuda_graphs="on",
                           noise_ahead="on", verify_overlap="on"),
}
KV_CACHES = ("auto", "slots", "per-session")
CUDA_GRAPHS = ("auto", "on", "off")
VERIFY_OVERLAP = ("auto", "on", "off")
# A session that ran a forward this recently is load: a round trip plus drafting is ~0.05-0.5 s.
ACTIVE_WINDOW_S = 1.0
# A session due back is waited for up to this share of its usual gap after it was due (jitter of
# its round trip and drafting), and no longer: one that does not come is not held for.
DUE_TOLERANCE = 0.25
# How fast a session's usual gap between forwards follows a change (a new link, a new draft length).
GAP_EWMA = 0.3
# Below this share of time in forwards the edge has room to spare: a longer draft costs the other
# sessions little, and the device (which sees its round trip, the edge does not) decides alone.
SATURATED_UTILIZATION = 0.7
# Start-up calibration: cached context of each timed forward, and timings per short point (the least
# is kept: a short forward is quick enough that one scheduler hiccup would double it); forwards of
# CALIBRATION_STABLE_TOKENS or more take long enough to be timed once (a shorter start-up).
CALIBRATION_CONTEXT = 64
CALIBRATION_REPEATS = 2
CALIBRATION_STABLE_TOKENS = 32


@dataclass(frozen=True)
class BatchSettings:
    enabled: bool = True                            # False: no scheduler, each session runs its own
                                                    # forwards on its worker thread (--no-batching)
    max_batch_tokens: int | None = None             # new tokens per target forward; None: the device's default
    wait_s: float | None = None                     # longest wait of a ready forward for others; None: default
    kv_cache: str = "auto"                          # slots | per-session | auto: the device's default
    cuda_graphs: str = "auto"                       # on | off | auto: on with slots on CUDA
    noise_ahead: str = "auto"                       # on | off | auto: the device's default
    verify_overlap: str = "auto"                    # on | off | auto: the device's default

    def resolved(self, device: torch.device | str) -> "BatchSettings":
        """These settings with every default filled in for ``device`` (DEVICE_DEFAULTS)."""
        if self.kv_cache not in KV_CACHES:
            raise ValueError(f"kv_cache must be one of {list(KV_CACHES)}, got {self.kv_cache!r}")
        if self.cuda_graphs not in CUDA_GRAPHS:
            raise ValueError(f"cuda_graphs must be one of {list(CUDA_GRAPHS)}, got {self.cuda_graphs!r}")
        if self.noise_ahead not in NOISE_AHEAD:
            raise ValueError(f"noise_ahead must be one of {list(NOISE_AHEAD)}, got {self.noise_ahead!r}")
        if self.verify_overlap not in VERIFY_OVERLAP:
            raise ValueError(f"verify_overlap must be one of {list(VERIFY_OVERLAP)}, got {self.verify_overlap!r}")
        kind = torch.device(device).type
        d = DEVICE_DEFAULTS.get(kind, DEVICE_DEFAULTS["cpu"])
        out = replace(self, max_batch_tokens=self.max_batch_tokens or d.max_batch_tokens,
                      wait_s=d.wait_s if self.wait_s is None else self.wait_s,
                      kv_cache=d.kv_cache if self.kv_cache == "auto" else self.kv_cache,
                      noise_ahead=d.noise_ahead if self.noise_ahead == "auto" else self.noise_ahead,
                      verify_overlap=self.verify_overlap if self.verify_overlap != "auto"
                      else d.verify_overlap if self.enabled else "off")
        if self.noise_ahead == "on" and not out.enabled:
            raise ValueError("noise ahead is drawn while a batched forward runs: it needs batching")
        if self.verify_overlap == "on" and not out.enabled:
            raise ValueError("verification overlaps the next batched forward: it needs batching")
        if self.cuda_graphs == "auto":
            return replace(out, cuda_graphs=d.cuda_graphs if out.kv_cache == "slots" and out.enabled else "off")
        if self.cuda_graphs == "on" and (kind != "cuda" or out.kv_cache != "slots" or not out.enabled):
            raise ValueError("CUDA graphs need a CUDA device and batching with KV slots (--kv-cache slots)")
        return out


def wait_for_device(result: torch.Tensor) -> None:
    """Wait until the device has computed ``result`` (a no-op on the CPU, where it already has)."""
    if result.is_cuda:
        torch.cuda.synchronize(result.device)


def kv_slots(settings: BatchSettings, model: torch.nn.Module, device: torch.device) -> SlotPool | None:
    """The KV slot pool resolved ``settings`` ask for, or None (per-session caches). A model slots
    cannot hold (sliding-window layers) keeps per-session caches, with a warning if slots were asked."""
    if settings.kv_cache != "slots":
        return None
    if not slots_supported(model):
        log.warning("this model's cache has sliding-window layers: per-session KV caches instead of slots")
        return None
    return SlotPool(model, device, static="graphs" if settings.cuda_graphs == "on" else "off")


@dataclass(frozen=True)
class BatchStats:
    """One target forward, for metrics."""
    sessions: int
    tokens: int
    queue_seconds: tuple[float, ...]   # per request: from hand-in to the forward's start
    forward_seconds: float
    verify_seconds: float = 0.0        # verifying the rounds drafted in it, all together (0: none)
    rounds: int = 0                    # rounds verified
    static: bool = False               # run in static shapes (KV slots: edge/slots.py)
    graph: str = ""                    # "replayed", "captured" (then replayed), "failed" (capture failed:
                                       # eager), or "" (no CUDA graph)


class Arrivals:
    """When each session is due back with its next forward: the gap it usually leaves between its
    forwards, from when its last one ended (module docstring). Keyed by the session's cache runner;
    the scheduler holds its lock around every call. Pure: the times are passed in."""

    def __init__(self):
        self.done: dict[int, float] = {}  # when its last forward ended: the load, and who is due back
        self.gap: dict[int, float] = {}   # its usual gap until the next hand-in
        self.size: dict[int, int] = {}    # tokens of its last request

    def handed_in(self, key: int, tokens: int, now: float) -> None:
        if key in self.done:
            gap = now - self.done[key]
            old = self.gap.get(key)
            self.gap[key] = gap if old is None else (1 - GAP_EWMA) * old + GAP_EWMA * gap
        self.size[key] = tokens

    def forward_ended(self, key: int, end: float) -> None:
        self.done[key] = end

    def forget(self, key: int) -> None:
        for table in (self.done, self.gap, self.size):
            table.pop(key, None)

    def active(self, now: float) -> int:
        """Sessions that ran a forward within ACTIVE_WINDOW_S."""
        return sum(now - done <= ACTIVE_WINDOW_S for done in self.done.values())

    def worth_waiting_for(self, now: float, pending: set[int], saving: Callable[[int], float]) -> float | None:
        """Until when to wait for the sessions not ``pending`` that are due back before what a shared
        forward saves (``saving(their tokens)``), or None; forgets those away far longer than a round."""
        until = None
        for key, done in list(self.done.items()):
            if now - done > ACTIVE_WINDOW_S:  # left, or away far longer than a round
                self.forget(key)
                continue
            if key in pending or key not in self.gap:
                continue
            due, gap = done + self.gap[key], self.gap[key]
            latest = due + DUE_TOLERANCE * gap
            if now <= latest and due - now <= saving(self.size.get(key, 1)):
                until = latest if until is None else max(until, latest)
        return until


@dataclass
class _Pending:
    request: ForwardRequest
    future: Future
    since: float
    round: ChainRound | None = None  # the round drafted in this forward, verified right after it


class _Stopwatch:
    """A forward's time on its device: on CUDA between two events on the forward's stream (the next
    forward may be started before this one has run, so the host's clock would time the queue), on a
    CPU the host's clock (the forward has run when its call returns)."""

    def __init__(self, device: torch.device):
        self._cuda = device.type == "cuda"
        self.start = time.perf_counter()
        self._events = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) if self._cuda else None
        if self._events is not None:
            self._events[0].record()
        self._seconds = 0.0

    def stop(self) -> None:
        """Right after the forward's work is started (its logits included)."""
        if self._events is not None:
            self._events[1].record()
        else:
            self._seconds = time.perf_counter() - self.start

    @property
    def ended(self) -> "torch.cuda.Event | None":
        """The event the device passes once the forward has run (None on a CPU)."""
        return None if self._events is None else self._events[1]

    def wait(self) -> float:
        """Wait until the device has run the forward; its seconds there."""
        if self._events is None:
            return self._seconds
        self._events[1].synchronize()
        return self._events[0].elapsed_time(self._events[1]) / 1e3


@dataclass
class _Job:
    """One forward started: its requests, their results (logits, on the device), what it ran as."""
    batch: list[_Pending]
    results: list[torch.Tensor]
    clock: _Stopwatch
    static: bool      # run in static shapes (KV slots)
    graph: str        # BatchStats.graph


class _Behind:
    """Verification behind the next forward (``verify_overlap``, module docstring): a thread that
    finishes the started forwards in order (``finish(job)``: wait for its device, verify its rounds,
    answer), while the scheduler's thread starts the next. On CUDA it verifies on a stream of its own,
    which waits for the job's forward only: on the forward's stream its work would queue behind the
    next forward."""

    def __init__(self, finish: Callable[[_Job], None], device: torch.device):
        self._finish = finish
        self._stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self._jobs: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._loop, name="verify-behind", daemon=True)
        self._thread.start()

    def put(self, job: _Job) -> None:
        self._jobs.put(job)

    def close(self) -> None:
        """Finish the jobs put so far, then stop (from the scheduler's thread, as it ends)."""
        self._jobs.put(None)
        self._thread.join(timeout=5)

    def _loop(self) -> None:
        while (job := self._jobs.get()) is not None:
            if self._stream is None:
                self._finish(job)
                continue
            with torch.cuda.stream(self._stream):
                self._stream.wait_event(job.clock.ended)
                self._finish(job)
                # the results' memory was the forward stream's: nothing may still read it once freed
                self._stream.synchronize()


class ForwardScheduler:
    """Runs the target forwards of many sessions, batched; thread-safe, blocking :meth:`forward`."""

    def __init__(self, settings: BatchSettings = BatchSettings(),
                 observer: Callable[[BatchStats], None] | None = None, pool: SlotPool | None = None,
                 device: torch.device | str = "cpu"):
        settings = settings.resolved(device)
        if settings.max_batch_tokens < 1:
            raise ValueError("max_batch_tokens must be >= 1")
        self.settings = settings
        self.pool = pool  # the sessions' KV slots (None: each session keeps its own cache)
        self._observer = observer
        self._cond = threading.Condition()
        self._pending: deque[_Pending] = deque()
        self._working = 0       # threads now inside working(): each may still hand in a forward
        self._stopped = False
        self._workspace = BatchWorkspace()  # the padded caches' memory, reused by every forward
        self.cost = CostCurve()  # seconds per forward by tokens: calibrated, then refreshed by every forward
        self._busy: deque[tuple[float, float]] = deque()  # (end, seconds) of forwards in the window
        self.arrivals = Arrivals()  # by id(CachedLM), under _cond: who is due back, and when
        self._flight: set[int] = set()  # under _cond: sessions (id(CachedLM)) in a forward not yet answered
        self._load_lock = threading.Lock()
        self._device = torch.device(device)
        self._behind = _Behind(self._finish, self._device) if settings.verify_overlap == "on" else None
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
        return self._through(request)

    def verify(self, request: ForwardRequest, round_: ChainRound) -> RoundOutcome:
        """The verdict of ``round_`` against the logits ``request`` asks for, verified with the other
        rounds of the same forward; with ``noise_ahead`` on, the round's noise is drawn here while the
        forward runs (edge/noise_ahead.py)."""
        return self._through(request, round_)

    def _through(self, request: ForwardRequest, round_: ChainRound | None = None):
        """``request``'s chunks through forwards in order; the last one's answer (logits, or with
        ``round_`` its outcome)."""
        *head, last = chunks(request, self.settings.max_batch_tokens)
        for chunk in head:
            self._submit(chunk).result()
        ahead = round_ is not None and self.settings.noise_ahead == "on"
        round_ = kept(round_) if ahead else round_  # only then: kept draws hold V floats a position
        answer = self._submit(last, round_)
        if ahead:
            draw_ahead(round_, answer.done)
        return answer.result()

    def _submit(self, request: ForwardRequest, round_: ChainRound | None = None) -> Future:
        future: Future = Future()
        now = time.perf_counter()
        with self._cond:
            if self._stopped:
                raise RuntimeError("the edge is shutting down")
            self.arrivals.handed_in(id(request.lm), request.num_tokens, now)
            self._pending.append(_Pending(request, future, now, round_))
            self._cond.notify_all()
        return future

    def new_lm(self, model: torch.nn.Module, device: torch.device):
        """A new session's model runner: a KV slot of the pool, or a cache of its own."""
        return self.pool.new_lm() if self.pool is not None else CachedLM(model, device)

    def forget(self, lm) -> None:
        """A session ended: it is not due back, and its KV slot is free."""
        with self._cond:
            self.arrivals.forget(id(lm))
        release = getattr(lm, "release", None)
        if release is not None:
            release()

    # -- load-aware speculation -------------------------------------------------------------------------
    def calibrate(self, lm: CachedLM, vocab_size: int, max_context: int) -> None:
        """Time forwards of 1, 2, 4 .. max_batch_tokens tokens on the edge's own hardware (start-up)."""
        context = [i % vocab_size for i in range(CALIBRATION_CONTEXT)]
        wait_for_device(lm.forward(context, 1))  # also warms the kernels up
        longest = min(self.settings.max_batch_tokens, max_context - CALIBRATION_CONTEXT)
        for tokens in (p for p in CURVE_POINTS if p <= longest):
            ids = [(7 * i + 3) % vocab_size for i in range(tokens)]
            best = float("inf")
            for _ in range(CALIBRATION_REPEATS if tokens < CALIBRATION_STABLE_TOKENS else 1):
                start = time.perf_counter()
                wait_for_device(lm.forward(ids, 1))
                best = min(best, time.perf_counter() - start)
                lm.truncate(CALIBRATION_CONTEXT)
            with self._load_lock:
                self.cost.seconds[tokens] = best

    def active_sessions(self) -> int:
        """Open sessions that ran a forward within ACTIVE_WINDOW_S: the load the edge shares."""
        now = time.perf_counter()
        with self._cond:
            return self.arrivals.active(now)

    def utilization(self) -> float:
        """Share of the last ACTIVE_WINDOW_S the target spent in forwards."""
        now = time.perf_counter()
        with self._load_lock:
            while self._busy and now - self._busy[0][0] > ACTIVE_WINDOW_S:
                self._busy.popleft()
            return min(1.0, sum(seconds for _, seconds in self._busy) / ACTIVE_WINDOW_S)

    def draft_len_hint(self, alpha: float, max_len: int, sessions: int | None = None) -> int | None:
        """The longest draft that still pays at the current load: ``max_len`` while the edge has time
        to spare, else the draft length that maximizes the edge's goodput (common/loadaware.py)
        for the ``sessions`` it serves now (default: :meth:`active_sessions`). None before calibration."""
        sessions = max(1, self.active_sessions() if sessions is None else sessions)
        if self.utilization() < SATURATED_UTILIZATION:
            return max_len if self.cost.seconds else None
        with self._load_lock:
            if not self.cost.seconds:
                return None
            return best_draft_len(sessions, alpha, self.cost, max_len)

    def stop(self) -> None:
        with self._cond:
            self._stopped = True
            self._cond.notify_all()
        self._thread.join(timeout=5)

    # -- the scheduler thread ------------------------------------------------------------------------
    def _loop(self) -> None:
        while (batch := self._next_batch()) is not None:
            for job in self._launch(batch):
                if self._behind is not None:
                    self._behind.put(job)
                else:
                    self._finish(job)
        if self._behind is not None:
            self._behind.close()

    def _next_batch(self) -> list[_Pending] | None:
        with self._cond:
            while True:
                if self._stopped:
                    while self._pending:
                        self._pending.popleft().future.set_exception(RuntimeError("the edge is shutting down"))
                    return None
                if self._pending:
                    now = time.perf_counter()
                    deadline, ready = self._deadline(now)
                    if ready or now >= deadline:
                        return self._take()
                    self._cond.wait(timeout=deadline - now)
                else:
                    self._cond.wait()

    def _deadline(self, now: float) -> tuple[float, bool]:
        """(latest start of the next forward, whether it may start now): now if the batch is full, or
        if every working session has handed in and none is worth waiting for."""
        tokens = sum(p.request.num_tokens for p in self._pending)
        if tokens >= self.settings.max_batch_tokens:
            return now, True
        # a session in a forward not yet answered (verify_overlap) cannot hand in before its answer
        away = {id(p.request.lm) for p in self._pending} | self._flight
        with self._load_lock:  # a copy: the verifying thread may refresh the curve meanwhile
            cost = CostCurve(dict(self.cost.seconds)) if self.cost.seconds else None
        wait_for = self.arrivals.worth_waiting_for(now, away, lambda joining: _saving(cost, tokens, joining))
        deadline = max(self._pending[0].since + self.settings.wait_s, wait_for or 0.0)
        return deadline, len(self._pending) >= self._working - len(self._flight) and wait_for is None

    def _take(self) -> list[_Pending]:
        """Oldest first, up to max_batch_tokens (at least one request); a cache that cannot be
        padded (sliding-window layers) goes alone."""
        batch = [self._pending.popleft()]
        if not batchable(batch[0].request.lm):
            return batch
        tokens, key = batch[0].request.num_tokens, batch_key(batch[0].request.lm)
        while self._pending:
            nxt = self._pending[0].request
            if (tokens + nxt.num_tokens > self.settings.max_batch_tokens or not batchable(nxt.lm)
                    or batch_key(nxt.lm) is not key):
                break
            batch.append(self._pending.popleft())
            tokens += nxt.num_tokens
        self._flight.update(id(p.request.lm) for p in batch)
        return batch

    def _launch(self, batch: list[_Pending]) -> list[_Job]:
        """Start ``batch``'s forward (on a GPU its work is queued, not yet run); if it fails, its
        requests one by one, so that only the culprit's session gets the error."""
        clock, counts = _Stopwatch(self._device), _pool_counts(self.pool)
        try:
            results = forward_batch([p.request for p in batch], self._workspace)
            clock.stop()
        except Exception as exc:  # noqa: BLE001 - one session's bad request must not fail the others
            if len(batch) == 1:
                self._answer(batch, [exc])
                return []
            log.warning("batched forward of %d sessions failed; running them one by one", len(batch))
            return [job for p in batch for job in self._launch([p])]
        static, replays, captures, failures = (b - a for a, b in zip(counts, _pool_counts(self.pool)))
        return [_Job(batch, results, clock, static > 0,
                     "captured" if captures else "replayed" if replays else "failed" if failures else "")]

    def _finish(self, job: _Job) -> None:
        """Once ``job``'s forward has run: verify its rounds, answer its sessions, note the load."""
        try:
            seconds = job.clock.wait()
            answers, verified = _answers(job.batch, job.results)
        except Exception as exc:  # noqa: BLE001 - the device failed: its sessions get the error, not a hang
            log.exception("a forward of %d sessions failed on its device", len(job.batch))
            self._answer(job.batch, [exc] * len(job.batch))
            return
        self._answer(job.batch, answers)
        tokens = sum(p.request.num_tokens for p in job.batch)
        with self._load_lock:
            self.cost.observe(tokens, seconds)
            self._busy.append((time.perf_counter(), seconds))
        if self._observer is not None:
            self._observer(BatchStats(sessions=len(job.batch), tokens=tokens,
                                      queue_seconds=tuple(job.clock.start - p.since for p in job.batch),
                                      forward_seconds=seconds, verify_seconds=verified,
                                      rounds=sum(p.round is not None for p in job.batch), static=job.static,
                                      graph=job.graph))

    def _answer(self, batch: list[_Pending], answers: list) -> None:
        """Each request's answer (a result, or the exception its session gets)."""
        with self._cond:  # before the answers: a session may hand in its next forward at once
            end = time.perf_counter()
            for p in batch:
                self.arrivals.forward_ended(id(p.request.lm), end)
                self._flight.discard(id(p.request.lm))
            self._cond.notify_all()
        for p, answer in zip(batch, answers):
            if isinstance(answer, BaseException):
                p.future.set_exception(answer)
            else:
                p.future.set_result(answer)


def _saving(c: CostCurve | None, pending_tokens: int, joining_tokens: int) -> float:
    """Seconds one forward over both saves over two: c(a) + c(b) - c(a + b) (0 before calibration)."""
    if c is None:
        return 0.0
    return c(pending_tokens) + c(joining_tokens) - c(pending_tokens + joining_tokens)


def _pool_counts(pool: SlotPool | None) -> tuple[int, int, int, int]:
    """A slot pool's static forwards, graph replays, captures and failed captures so far (zeros
    without one)."""
    return (0, 0, 0, 0) if pool is None else (pool.static_forwards, pool.graph_replays, pool.graph_captures,
                                              pool.graph_failures)


def chunks(r: ForwardRequest, size: int) -> list[ForwardRequest]:
    """A causal request longer than a batch of ``size`` tokens, split in order; only the last chunk,
    which holds every position whose logits are asked for, returns logits. Trees are never split."""
    n = r.num_tokens
    if r.attend is not None or n <= size:
        return [r]
    last = max(r.num_logits, n % size or size)
    head = r.new_ids[:n - last]
    out = [ForwardRequest(r.lm, head[c:c + size], 0) for c in range(0, len(head), size)]
    return [*out, ForwardRequest(r.lm, r.new_ids[n - last:], r.num_logits)]


def _answers(batch: list[_Pending], results: list[torch.Tensor]) -> tuple[list, float]:
    """What each request waits for (its logits, or its round's outcome, or the error verifying it
    raised) and the seconds verification took: the batch's rounds together, or if that fails,
    one by one."""
    answers: list = list(results)
    mine = [k for k, p in enumerate(batch) if p.round is not None]
    if not mine:
        return answers, 0.0
    start = time.perf_counter()
    try:
        outcomes: list = verify_rounds([results[k] for k in mine], [batch[k].round for k in mine])
    except Exception:  # noqa: BLE001 - one session's bad round must not fail the others
        outcomes = [_verify_one(results[k], batch[k].round) for k in mine]
    for k, outcome in zip(mine, outcomes):
        answers[k] = outcome
    return answers, time.perf_counter() - start


def _verify_one(logits: torch.Tensor, round_: ChainRound) -> RoundOutcome | Exception:
    try:
        return verify_rounds([logits], [round_])[0]
    except Exception as exc:  # noqa: BLE001 - handed to the round's own session
        return exc
