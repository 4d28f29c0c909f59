"""Prometheus metrics of the edge server (``specdec_edge_*``).

Names follow ``specdec_<subsystem>_<thing>_<unit>`` in base units; counters end in ``_total``.
Labels are of low cardinality only (mode, status, position, phase); never a session or request id.
Derived rates are PromQL over counters (``$__rate_interval`` is Grafana's; use e.g. ``5m`` by hand):

- throughput (generated tokens/s):
  ``sum by (mode) (rate(specdec_edge_generated_tokens_total[$__rate_interval]))``
- acceptance rate alpha (accepted tokens / drafted positions; for chains positions = draft tokens, for
  token trees one position per tree layer, so trees and chains compare):
  ``sum(rate(specdec_edge_accepted_tokens_total[$__rate_interval]))
  / sum(rate(specdec_edge_draft_positions_total[$__rate_interval]))``
- acceptance per draft position (tree depth for token trees):
  ``sum by (position) (rate(specdec_edge_accepted_tokens_per_position_total[$__rate_interval]))
  / sum by (position) (rate(specdec_edge_draft_tokens_per_position_total[$__rate_interval]))``
- mean accepted length per round:
  ``sum(rate(specdec_edge_accepted_tokens_total[$__rate_interval]))
  / sum(rate(specdec_edge_rounds_total[$__rate_interval]))``
- uplink (downlink) bytes per generated token:
  ``sum by (mode) (rate(specdec_edge_uplink_bytes_total[$__rate_interval]))
  / sum by (mode) (rate(specdec_edge_generated_tokens_total[$__rate_interval]))``
- phase latency p95:
  ``histogram_quantile(0.95, sum by (le, phase) (rate(specdec_edge_phase_duration_seconds_bucket[$__rate_interval])))``
- failed sessions/s: ``sum by (status) (rate(specdec_edge_sessions_failed_total[$__rate_interval]))``
- mean draft nodes per round (tree size):
  ``sum(rate(specdec_edge_round_draft_nodes_sum[$__rate_interval]))
  / sum(rate(specdec_edge_round_draft_nodes_count[$__rate_interval]))``
"""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Info

from specdec.common import protocol as P

# Verification of a few tokens on a CPU takes ~10-100 ms, on a GPU ~1-20 ms; payload decode and
# queueing can be ~0.1 ms.
LATENCY_BUCKETS = (0.0001, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
# A session lasts from ~0.1 s (tiny models, few tokens) to minutes (long answers on a shaped link).
REQUEST_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 25.0, 60.0, 120.0, 300.0)
# Per output token: ~1 ms (GPU, long accepted runs) to ~1 s (CPU target behind a slow link).
TOKEN_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28)
# A round's uplink spans ~20 B (DSSD) to ~400 KB (dense fp32 over 49k tokens x L).
BYTES_BUCKETS = (32, 128, 512, 2048, 8192, 32768, 131072, 524288, 2097152)
# Draft nodes per round: a chain of L <= 32, or a token tree of up to max_tree_nodes (256).
NODES_BUCKETS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 64, 128, 256)
MAX_POSITION_LABELS = 32  # positions beyond this share one label to bound cardinality
# Final statuses, pre-created at 0 so that "no failures" is a zero series, not a missing one
# (Prometheus instrumentation practice: avoid missing metrics). grpc.StatusCode names, lower case.
STATUSES = ("ok", "cancelled", "invalid_argument", "failed_precondition", "resource_exhausted",
            "deadline_exceeded", "unavailable", "internal", "unauthenticated", "permission_denied", "expired")
# Edge phases of one round; together with the device's draft/encode/network they cover the round.
PHASES = ("queue", "decode", "verify")  # verify = target forward + accept/reject, decode excluded


class EdgeMetrics:
    def __init__(self, registry: CollectorRegistry | None = None):
        reg = registry if registry is not None else CollectorRegistry()
        self.registry = reg
        kw = dict(namespace="specdec", subsystem="edge", registry=reg)
        self.model = Info("model", "The loaded target model", **kw)
        self.active = Gauge("sessions_active", "Sessions currently open", **kw)
        self.started = Counter("sessions_started", "Sessions started", ["mode"], **kw)
        self.ended = Counter("sessions_ended", "Sessions ended, by final status", ["status"], **kw)
        self.failed = Counter("sessions_failed", "Sessions ended with a status other than ok", ["status"], **kw)
        self.resumed = Counter("sessions_resumed", "Broken streams whose session was resumed (KV kept)", **kw)
        self.rounds = Counter("rounds", "Verification rounds", ["mode"], **kw)
        self.draft_tokens = Counter("draft_tokens", "Draft tokens (tree nodes) received", ["mode"], **kw)
        self.draft_positions = Counter("draft_positions", "Draft positions (chain length, or tree depth)",
                                       ["mode"], **kw)
        self.accepted_tokens = Counter("accepted_tokens", "Draft tokens accepted", ["mode"], **kw)
        self.drafted_per_position = Counter(
            "draft_tokens_per_position", "Rounds that drafted a token at this position (0-based depth)",
            ["position"], **kw)
        self.accepted_per_position = Counter(
            "accepted_tokens_per_position", "Accepted draft tokens by draft position (0-based depth)",
            ["position"], **kw)
        self.generated_tokens = Counter("generated_tokens", "Tokens added to outputs (accepted + next)",
                                        ["mode"], **kw)
        self.uplink_bytes = Counter("uplink_bytes", "Serialized Draft bytes received", ["mode"], **kw)
        self.downlink_bytes = Counter("downlink_bytes", "Serialized Verdict bytes sent", ["mode"], **kw)
        self.phase_seconds = Histogram("phase_duration_seconds", "Edge time per round and phase", ["phase"],
                                       buckets=LATENCY_BUCKETS, **kw)
        self.uplink_round_bytes = Histogram("round_uplink_size_bytes", "Uplink bytes per round", ["mode"],
                                            buckets=BYTES_BUCKETS, **kw)
        self.downlink_round_bytes = Histogram("round_downlink_size_bytes", "Downlink bytes per round", ["mode"],
                                              buckets=BYTES_BUCKETS, **kw)
        self.round_nodes = Histogram("round_draft_nodes", "Draft nodes per round (chain length or tree size)",
                                     ["mode"], buckets=NODES_BUCKETS, **kw)
        self.request_seconds = Histogram("request_duration_seconds", "Session time from Prompt to Close",
                                         ["mode"], buckets=REQUEST_BUCKETS, **kw)
        self.token_seconds = Histogram("time_per_output_token_seconds", "Session time per generated token",
                                       ["mode"], buckets=TOKEN_BUCKETS, **kw)
        self._precreate()

    def _precreate(self) -> None:
        for status in STATUSES:
            self.ended.labels(status)
            if status != "ok":
                self.failed.labels(status)
        for phase in PHASES:
            self.phase_seconds.labels(phase)

    def set_model(self, name: str, vocab_size: int) -> None:
        self.model.info({"name": name, "vocab_size": str(vocab_size)})

    def session_started(self, mode: str) -> None:
        self.started.labels(mode).inc()
        self.active.inc()

    def session_resumed(self) -> None:
        self.resumed.inc()

    def session_ended(self, status: str, was_active: bool) -> None:
        self.ended.labels(status).inc()
        if status != "ok":
            self.failed.labels(status).inc()
        if was_active:
            self.active.dec()

    def round_done(self, mode: str, draft: P.DraftBlock, verdict: P.Verdict, downlink_bytes: int,
                   uplink_bytes: int) -> None:
        n = verdict.num_accepted
        self.rounds.labels(mode).inc()
        self.draft_tokens.labels(mode).inc(len(draft.token_ids))
        self.accepted_tokens.labels(mode).inc(n)
        positions = _draft_depth(draft)
        self.draft_positions.labels(mode).inc(positions)
        for i in range(positions):
            self.drafted_per_position.labels(_position(i)).inc()
        for i in range(n):
            self.accepted_per_position.labels(_position(i)).inc()
        extra = 1 if verdict.next_token is not None else 0
        self.generated_tokens.labels(mode).inc(n + extra)
        self.uplink_bytes.labels(mode).inc(uplink_bytes)
        self.uplink_round_bytes.labels(mode).observe(uplink_bytes)
        self.downlink_bytes.labels(mode).inc(downlink_bytes)
        self.downlink_round_bytes.labels(mode).observe(downlink_bytes)
        self.round_nodes.labels(mode).observe(len(draft.token_ids))
        self.phase_seconds.labels("queue").observe(verdict.queue_seconds)
        self.phase_seconds.labels("decode").observe(verdict.decode_seconds)
        self.phase_seconds.labels("verify").observe(max(0.0, verdict.verify_seconds - verdict.decode_seconds))

    def request_done(self, mode: str, seconds: float, tokens: int) -> None:
        self.request_seconds.labels(mode).observe(seconds)
        if tokens:
            self.token_seconds.labels(mode).observe(seconds / tokens)


def _position(i: int) -> str:
    return str(min(i, MAX_POSITION_LABELS))


def _draft_depth(draft: P.DraftBlock) -> int:
    """Positions drafted this round: the chain length, or the tree depth for token trees."""
    return draft.tree_depth or len(draft.token_ids)  # tree_depth is 0 for chains
