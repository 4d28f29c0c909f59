"""Prometheus metrics both processes export, fed by :class:`~specdec.common.stats.RoundRecord`s.

Names follow ``specdec_<subsystem>_<thing>_<unit>`` in base units; counters end in ``_total``.
Labels are of low cardinality only (mode, status, position, phase); never a session or request id.
Derived rates are PromQL over counters (``$__rate_interval`` is Grafana's; use e.g. ``5m`` by hand),
with ``S`` the subsystem (``device`` or ``edge``):

- throughput: ``sum by (mode) (rate(specdec_S_generated_tokens_total[$__rate_interval]))``
- acceptance rate alpha (accepted tokens / drafted positions; for chains positions = draft tokens, for
  token trees one position per tree layer, so trees and chains compare):
  ``sum(rate(specdec_S_accepted_tokens_total[$__rate_interval]))
  / sum(rate(specdec_S_draft_positions_total[$__rate_interval]))``
- acceptance per draft position (tree depth for token trees):
  ``sum by (position) (rate(specdec_S_accepted_tokens_per_position_total[$__rate_interval]))
  / sum by (position) (rate(specdec_S_draft_tokens_per_position_total[$__rate_interval]))``
- mean accepted length per round:
  ``sum(rate(specdec_S_accepted_tokens_total[$__rate_interval]))
  / sum(rate(specdec_S_rounds_total[$__rate_interval]))``
- uplink (downlink) bytes per generated token:
  ``sum by (mode) (rate(specdec_S_uplink_bytes_total[$__rate_interval]))
  / sum by (mode) (rate(specdec_S_generated_tokens_total[$__rate_interval]))``
- phase latency p95:
  ``histogram_quantile(0.95, sum by (le, phase) (rate(specdec_S_phase_duration_seconds_bucket[$__rate_interval])))``
- share of round time per phase:
  ``sum by (phase) (rate(specdec_S_phase_duration_seconds_sum[$__rate_interval]))
  / ignoring(phase) group_left sum(rate(specdec_S_phase_duration_seconds_sum[$__rate_interval]))``
- failed sessions/s: ``sum by (status) (rate(specdec_S_sessions_failed_total[$__rate_interval]))``
- mean draft nodes per round (tree size):
  ``sum(rate(specdec_S_round_draft_nodes_sum[$__rate_interval]))
  / sum(rate(specdec_S_round_draft_nodes_count[$__rate_interval]))``
"""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from specdec.common.stats import RoundRecord

# Per-round phases run ~0.1 ms (encode, payload decode, queueing) to seconds (shaped links, big
# models); verification of a few tokens takes ~10-100 ms on a CPU, ~1-20 ms on a GPU.
PHASE_BUCKETS = (0.0001, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
# A request lasts from ~0.1 s (tiny models, few tokens) to minutes (long answers on a shaped link).
REQUEST_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 25.0, 60.0, 120.0, 300.0)
# Per output token: ~1 ms (GPU, long accepted runs) to ~1 s (CPU target behind a slow link).
TOKEN_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28)
# A round's uplink spans ~20 B (DSSD) to ~400 KB (dense fp32 over 49k tokens x L).
BYTES_BUCKETS = (32, 128, 512, 2048, 8192, 32768, 131072, 524288, 2097152)
# Draft nodes per round: a chain of L <= 32, or a token tree of up to the edge's 256 nodes.
NODES_BUCKETS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 64, 128, 256)
MAX_POSITION_LABELS = 32  # positions beyond this share one label to bound cardinality
# Final statuses (grpc.StatusCode names, lower case), pre-created at 0 so that "no failures" is a
# zero series, not a missing one (Prometheus instrumentation practice: avoid missing metrics).
STATUSES = ("ok", "cancelled", "invalid_argument", "failed_precondition", "resource_exhausted",
            "deadline_exceeded", "unavailable", "internal")


class SpecMetrics:
    """The sessions, rounds, bytes and phases of one subsystem (``device`` or ``edge``)."""

    def __init__(self, subsystem: str, phases: tuple[str, ...], statuses: tuple[str, ...] = STATUSES,
                 registry: CollectorRegistry | None = None):
        reg = registry if registry is not None else CollectorRegistry()
        self.registry = reg
        self.kw = kw = dict(namespace="specdec", subsystem=subsystem, registry=reg)
        self.active = Gauge("sessions_active", "Sessions currently open", **kw)
        self.started = Counter("sessions_started", "Sessions started", ["mode"], **kw)
        self.ended = Counter("sessions_ended", "Sessions ended, by final status", ["status"], **kw)
        self.failed = Counter("sessions_failed", "Sessions ended with a status other than ok", ["status"], **kw)
        self.rounds = Counter("rounds", "Draft/verify rounds", ["mode"], **kw)
        self.draft_tokens = Counter("draft_tokens", "Draft tokens (tree nodes) per round", ["mode"], **kw)
        self.draft_positions = Counter("draft_positions", "Draft positions (chain length, or tree depth)",
                                       ["mode"], **kw)
        self.accepted_tokens = Counter("accepted_tokens", "Draft tokens accepted", ["mode"], **kw)
        self.drafted_per_position = Counter(
            "draft_tokens_per_position", "Rounds that drafted a token at this position (0-based depth)",
            ["position"], **kw)
        self.accepted_per_position = Counter(
            "accepted_tokens_per_position", "Accepted draft tokens by draft position (0-based depth)",
            ["position"], **kw)
        self.generated_tokens = Counter("generated_tokens", "Verified tokens generated", ["mode"], **kw)
        self.uplink_bytes = Counter("uplink_bytes", "Serialized uplink bytes of rounds (Draft messages)",
                                    ["mode"], **kw)
        self.downlink_bytes = Counter("downlink_bytes", "Serialized downlink bytes of rounds (Verdicts)",
                                      ["mode"], **kw)
        self.phase_seconds = Histogram("phase_duration_seconds", "Time per round and phase", ["phase"],
                                       buckets=PHASE_BUCKETS, **kw)
        self.round_uplink = Histogram("round_uplink_size_bytes", "Uplink bytes per round", ["mode"],
                                      buckets=BYTES_BUCKETS, **kw)
        self.round_downlink = Histogram("round_downlink_size_bytes", "Downlink bytes per round", ["mode"],
                                        buckets=BYTES_BUCKETS, **kw)
        self.round_nodes = Histogram("round_draft_nodes", "Draft nodes per round (chain length or tree size)",
                                     ["mode"], buckets=NODES_BUCKETS, **kw)
        self.request_seconds = Histogram("request_duration_seconds", "End-to-end time per session",
                                         ["mode"], buckets=REQUEST_BUCKETS, **kw)
        self.token_seconds = Histogram("time_per_output_token_seconds", "Wall time per generated token",
                                       ["mode"], buckets=TOKEN_BUCKETS, **kw)
        self.phases = phases
        for status in statuses:
            self.ended.labels(status)
            if status != "ok":
                self.failed.labels(status)
        for phase in phases:
            self.phase_seconds.labels(phase)

    def session_started(self, mode: str) -> None:
        self.started.labels(mode).inc()
        self.active.inc()

    def session_ended(self, status: str, was_active: bool = True) -> None:
        self.ended.labels(status).inc()
        if status != "ok":
            self.failed.labels(status).inc()
        if was_active:
            self.active.dec()

    def observe_round(self, r: RoundRecord) -> None:
        mode = r.mode
        self.rounds.labels(mode).inc()
        self.draft_tokens.labels(mode).inc(r.drafted_tokens)
        self.accepted_tokens.labels(mode).inc(r.accepted)
        self.draft_positions.labels(mode).inc(r.positions)
        for i in range(r.positions):
            self.drafted_per_position.labels(_position(i)).inc()
        for i in range(r.accepted):
            self.accepted_per_position.labels(_position(i)).inc()
        self.uplink_bytes.labels(mode).inc(r.uplink_bytes)
        self.downlink_bytes.labels(mode).inc(r.downlink_bytes)
        self.round_uplink.labels(mode).observe(r.uplink_bytes)
        self.round_downlink.labels(mode).observe(r.downlink_bytes)
        self.round_nodes.labels(mode).observe(r.drafted_tokens)
        for phase in self.phases:
            if phase in r.phases:
                self.phase_seconds.labels(phase).observe(r.phases[phase])

    def request_done(self, mode: str, seconds: float, tokens: int) -> None:
        self.request_seconds.labels(mode).observe(seconds)
        if tokens:
            self.token_seconds.labels(mode).observe(seconds / tokens)


def _position(i: int) -> str:
    return str(min(i, MAX_POSITION_LABELS))
