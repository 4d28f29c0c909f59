"""Prometheus metrics of the edge server (``specdec_edge_*``): the shared set of
:mod:`specdec.common.metrics` (its docstring gives the PromQL for rates), plus the loaded model, the
resumed sessions, admission, and the statuses only the edge gives (authentication, ownership, expiry).

- sessions resumed with their KV cache per second:
  ``rate(specdec_edge_sessions_resumed_total[$__rate_interval])``; resumes of a session this edge did
  not hold (another edge's, or expired), re-prefilled from the device's prefix:
  ``rate(specdec_edge_sessions_reprefilled_total[$__rate_interval])``
- fleet: sessions per edge ``sum by (instance) (specdec_edge_sessions_active)``; sessions a drain sent
  to another edge ``increase(specdec_edge_sessions_ended_total{status="moved"}[$__rate_interval])``;
  edges draining now ``sum(specdec_edge_draining)``
- new sessions refused by admission per second, by reason (``principal_cap``, ``queue_full``,
  ``queue_timeout``; each refusal also ends as status ``resource_exhausted``):
  ``sum by (reason) (rate(specdec_edge_admission_rejected_total[$__rate_interval]))``
- share of new sessions refused by admission:
  ``sum(rate(specdec_edge_admission_rejected_total[$__rate_interval]))
  / (sum(rate(specdec_edge_admission_rejected_total[$__rate_interval]))
  + rate(specdec_edge_admission_wait_seconds_count[$__rate_interval]))``
- sessions waiting for a slot now: ``specdec_edge_admission_queued_sessions``
- admission wait p95 (admitted sessions; 0 for those admitted at once):
  ``histogram_quantile(0.95, sum by (le) (rate(specdec_edge_admission_wait_seconds_bucket[$__rate_interval])))``
- target forwards per second, and sessions / tokens per forward (batching):
  ``rate(specdec_edge_batch_forward_seconds_count[$__rate_interval])``,
  ``rate(specdec_edge_batch_sessions_sum[$__rate_interval]) / rate(specdec_edge_batch_sessions_count[$__rate_interval])``,
  ``rate(specdec_edge_batch_tokens_sum[$__rate_interval]) / rate(specdec_edge_batch_tokens_count[$__rate_interval])``
- share of target forwards run in static shapes, and replayed from CUDA graphs (by ``graph``:
  ``captured`` = the first forward of its shape, which pays the capture; ``replayed``; ``failed`` =
  a capture that failed, its shape eager from then on, which an alert should catch):
  ``rate(specdec_edge_batch_static_forwards_total[$__rate_interval]) / rate(specdec_edge_batch_forward_seconds_count[$__rate_interval])``,
  ``sum by (graph) (rate(specdec_edge_batch_cuda_graph_forwards_total[$__rate_interval]))``
- running ahead through overdue rounds (an outage, a stalled device): tokens generated ahead per
  second, rounds superseded by them (each cost its device a draft), and rounds continued after them
  (their first drafts were those tokens: nothing lost):
  ``rate(specdec_edge_run_ahead_tokens_total[$__rate_interval])``,
  ``rate(specdec_edge_superseded_rounds_total[$__rate_interval])``,
  ``rate(specdec_edge_continued_rounds_total[$__rate_interval])``
- share of the edge's time in target forwards (1 = the target never idles):
  ``rate(specdec_edge_batch_forward_seconds_sum[$__rate_interval])``
- seconds spent verifying the rounds the forwards served (batch tensor work) per second of forwards:
  ``rate(specdec_edge_batch_verify_seconds_sum[$__rate_interval]) / rate(specdec_edge_batch_forward_seconds_sum[$__rate_interval])``
- a forward request's wait for its batch, p95:
  ``histogram_quantile(0.95, sum by (le) (rate(specdec_edge_batch_queue_seconds_bucket[$__rate_interval])))``
- load-aware speculation: the draft length the edge advises, p50, and the load it sees:
  ``histogram_quantile(0.5, sum by (le) (rate(specdec_edge_draft_len_hint_bucket[$__rate_interval])))``,
  ``specdec_edge_batch_active_sessions``
- DSSD fallbacks per second, by the reply (``head``: p_j's top-K and tail samples; ``whole``: all of
  p_j, asked for when a head's tail samples ran out or by a device without head fallbacks), and the
  bytes they sent down: ``sum by (reply) (rate(specdec_edge_dssd_fallbacks_total[$__rate_interval]))``,
  ``rate(specdec_edge_dssd_fallback_bytes_total[$__rate_interval])``
- share of admitted sessions that had to wait (longer than 1 ms):
  ``1 - rate(specdec_edge_admission_wait_seconds_bucket{le="0.001"}[$__rate_interval])
  / rate(specdec_edge_admission_wait_seconds_count[$__rate_interval])``
"""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Info

from specdec.common.metrics import PHASE_BUCKETS, STATUSES, SpecMetrics
from specdec.common.stats import EDGE_PHASES, RoundRecord
from specdec.edge.admission import REASONS
from specdec.edge.batching import BatchStats

# The edge also refuses callers and frees sessions nobody resumed in time.
EDGE_STATUSES = STATUSES + ("unauthenticated", "permission_denied", "expired", "moved")
# Ended, but not failed: a drain sent the session to another edge, where its device resumes it.
NOT_FAILED = ("ok", "moved")
# A queued session waits up to --admission-wait-ms (5 s by default); at once is ~0.
ADMISSION_WAIT_BUCKETS = (0.001, 0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
# Sessions per forward: 1 up to --max-sessions (64 by default).
BATCH_SESSIONS_BUCKETS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64)
# New tokens per forward: one edge-only token up to --max-batch-tokens (256 by default).
BATCH_TOKENS_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)
# A request waits ~0 (alone), the scheduler's 2 ms window, or a whole forward in progress (10-500 ms).
# Advised draft lengths: 0 (edge-only) up to the edge's --max-draft-len (32).
HINT_BUCKETS = (0, 1, 2, 3, 4, 5, 6, 8, 10, 12, 16, 24, 32)
FALLBACK_REPLIES = ("head", "whole")
GRAPH_OUTCOMES = ("captured", "replayed", "failed")  # BatchStats.graph
BATCH_QUEUE_BUCKETS = (0.0001, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0)


class EdgeMetrics(SpecMetrics):
    def __init__(self, registry: CollectorRegistry | None = None):
        super().__init__("edge", EDGE_PHASES, EDGE_STATUSES, registry=registry)
        self.model = Info("model", "The loaded target model", **self.kw)
        self.resumed = Counter("sessions_resumed", "Broken streams whose session was resumed (KV kept)", **self.kw)
        self.reprefilled = Counter("sessions_reprefilled", "Resumes of a session this edge did not hold "
                                   "(another edge's, or expired): re-prefilled from the device's prefix",
                                   **self.kw)
        self.draining = Gauge("draining", "1 while the edge drains (SIGTERM): it takes no new sessions", **self.kw)
        self.rejected = Counter("admission_rejected", "New sessions refused by admission (RESOURCE_EXHAUSTED), "
                                "by reason", ["reason"], **self.kw)
        self.queued = Gauge("admission_queued_sessions", "New sessions waiting for a slot", **self.kw)
        self.admission_wait = Histogram("admission_wait_seconds", "Time an admitted new session waited for "
                                        "a slot (0 when admitted at once)", buckets=ADMISSION_WAIT_BUCKETS,
                                        **self.kw)
        for reason in REASONS:
            self.rejected.labels(reason)
        self.batch_sessions = Histogram("batch_sessions", "Sessions whose tokens one target forward ran",
                                        buckets=BATCH_SESSIONS_BUCKETS, **self.kw)
        self.batch_tokens = Histogram("batch_tokens", "New tokens one target forward ran (all sessions)",
                                      buckets=BATCH_TOKENS_BUCKETS, **self.kw)
        self.batch_queue = Histogram("batch_queue_seconds", "Time a forward request waited for its batch "
                                     "to start", buckets=BATCH_QUEUE_BUCKETS, **self.kw)
        self.hint = Histogram("draft_len_hint", "Draft length advised in a verdict at the edge's load "
                              "(0: edge-only rounds)", buckets=HINT_BUCKETS, **self.kw)
        self.active_batch_sessions = Gauge("batch_active_sessions", "Sessions that ran a target forward "
                                           "within the last second (the load draft advice is for)", **self.kw)
        self.batch_forward = Histogram("batch_forward_seconds", "Duration of one (batched) target forward",
                                       buckets=PHASE_BUCKETS, **self.kw)
        self.batch_static = Counter("batch_static_forwards", "Target forwards run in static shapes (KV "
                                    "slots' chain forwards: what a CUDA graph replays)", **self.kw)
        self.batch_graphs = Counter("batch_cuda_graph_forwards", "Static target forwards by their CUDA graph: "
                                    "captured for it first (the first forward of a shape), already held "
                                    "and replayed, or failed to capture (it ran eagerly)", ["graph"], **self.kw)
        for graph in GRAPH_OUTCOMES:
            self.batch_graphs.labels(graph)
        self.batch_verify = Histogram("batch_verify_seconds", "Duration of verifying the rounds drafted in "
                                      "one (batched) target forward, all together", buckets=PHASE_BUCKETS,
                                      **self.kw)
        self.fallbacks = Counter("dssd_fallbacks", "DSSD fallback replies (every target sample failed), by "
                                 "reply: head (top-K of p_j and tail samples) or whole p_j", ["reply"], **self.kw)
        self.fallback_bytes = Counter("dssd_fallback_bytes", "Serialized DSSD fallback replies sent", **self.kw)
        for reply in FALLBACK_REPLIES:
            self.fallbacks.labels(reply)
        self.run_ahead_tokens = Counter("run_ahead_tokens", "Tokens generated ahead while a device's next round "
                                 "was overdue (Draft.run_ahead_ms)", **self.kw)
        self.superseded_rounds = Counter("superseded_rounds", "Rounds that started before tokens generated ahead "
                                  "(answered without verifying)", **self.kw)
        self.continued_rounds = Counter("continued_rounds", "Rounds that started before tokens generated ahead, "
                                        "served after them (drafted: their first drafts, Hello.continues_late; "
                                        "edge-only: the rest, Hello.continues_late_edge_only)", **self.kw)

    def set_model(self, name: str, vocab_size: int) -> None:
        self.model.info({"name": name, "vocab_size": str(vocab_size)})

    def session_resumed(self) -> None:
        self.resumed.inc()

    def session_reprefilled(self) -> None:
        self.reprefilled.inc()

    def set_draining(self, draining: bool) -> None:
        self.draining.set(1 if draining else 0)

    def session_ended(self, status: str, was_active: bool = True) -> None:
        if status not in NOT_FAILED:
            super().session_ended(status, was_active)
            return
        self.ended.labels(status).inc()
        if was_active:
            self.active.dec()

    def admission_rejected(self, reason: str) -> None:
        self.rejected.labels(reason).inc()

    def admission_queued(self, waiting: int) -> None:
        self.queued.set(waiting)

    def admission_waited(self, seconds: float) -> None:
        self.admission_wait.observe(seconds)

    def dssd_fallback(self, head: bool, size: int) -> None:
        self.fallbacks.labels(FALLBACK_REPLIES[0] if head else FALLBACK_REPLIES[1]).inc()
        self.fallback_bytes.inc(size)

    def ran_ahead(self) -> None:
        self.run_ahead_tokens.inc()

    def round_superseded(self) -> None:
        self.superseded_rounds.inc()

    def draft_len_hinted(self, hint: int, active_sessions: int) -> None:
        self.hint.observe(hint)
        self.active_batch_sessions.set(active_sessions)

    def observe_batch(self, b: BatchStats) -> None:
        """One forward of the scheduler (called on its thread; prometheus_client is thread-safe)."""
        self.batch_sessions.observe(b.sessions)
        self.batch_tokens.observe(b.tokens)
        self.batch_forward.observe(b.forward_seconds)
        if b.static:
            self.batch_static.inc()
        if b.graph:
            self.batch_graphs.labels(b.graph).inc()
        if b.rounds:
            self.batch_verify.observe(b.verify_seconds)
        for seconds in b.queue_seconds:
            self.batch_queue.observe(seconds)

    def observe_round(self, r: RoundRecord, continued: bool = False) -> None:
        """A served round; ``continued``: after tokens generated ahead past its start (verifier.continued)."""
        super().observe_round(r)
        self.generated_tokens.labels(r.mode).inc(r.generated)  # the device counts what it delivers
        if continued:
            self.continued_rounds.inc()
