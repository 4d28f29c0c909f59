"""Prometheus metrics of the edge server (``specdec_edge_*``).

Labels are of low cardinality only (mode, status, position); never a session id.
Derived rates are PromQL over counters:
- acceptance rate:
  ``sum(rate(specdec_edge_accepted_tokens_total[5m])) / sum(rate(specdec_edge_draft_tokens_total[5m]))``
- mean accepted length per round:
  ``sum(rate(specdec_edge_accepted_tokens_total[5m])) / sum(rate(specdec_edge_rounds_total[5m]))``
- uplink bytes per generated token:
  ``sum(rate(specdec_edge_uplink_bytes_total[5m])) / sum(rate(specdec_edge_generated_tokens_total[5m]))``
"""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from specdec.common import protocol as P

# Verification of a few tokens on a CPU takes ~10-100 ms, on a GPU ~1-20 ms.
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
# A round's uplink spans ~20 B (DSSD) to ~400 KB (dense fp32 over 49k tokens x L).
BYTES_BUCKETS = (32, 128, 512, 2048, 8192, 32768, 131072, 524288, 2097152)
MAX_POSITION_LABELS = 32  # positions beyond this share one label to bound cardinality


class EdgeMetrics:
    def __init__(self, registry: CollectorRegistry | None = None):
        reg = registry if registry is not None else CollectorRegistry()
        self.registry = reg
        ns, sub = "specdec", "edge"
        self.active = Gauge("sessions_active", "Sessions currently open", namespace=ns, subsystem=sub, registry=reg)
        self.started = Counter("sessions_started", "Sessions started", ["mode"], namespace=ns, subsystem=sub, registry=reg)
        self.ended = Counter("sessions_ended", "Sessions ended, by final status", ["status"],
                             namespace=ns, subsystem=sub, registry=reg)
        self.rounds = Counter("rounds", "Verification rounds", ["mode"], namespace=ns, subsystem=sub, registry=reg)
        self.draft_tokens = Counter("draft_tokens", "Draft tokens received", ["mode"],
                                    namespace=ns, subsystem=sub, registry=reg)
        self.accepted_tokens = Counter("accepted_tokens", "Draft tokens accepted", ["mode"],
                                       namespace=ns, subsystem=sub, registry=reg)
        self.accepted_per_position = Counter(
            "accepted_tokens_per_position", "Accepted draft tokens by draft position (0-based)",
            ["position"], namespace=ns, subsystem=sub, registry=reg)
        self.generated_tokens = Counter("generated_tokens", "Tokens added to outputs (accepted + next)",
                                        ["mode"], namespace=ns, subsystem=sub, registry=reg)
        self.uplink_bytes = Counter("uplink_bytes", "Serialized Draft bytes received", ["mode"],
                                    namespace=ns, subsystem=sub, registry=reg)
        self.downlink_bytes = Counter("downlink_bytes", "Serialized Verdict bytes sent", ["mode"],
                                      namespace=ns, subsystem=sub, registry=reg)
        self.verify_seconds = Histogram("verify_duration_seconds", "Target forward + verification per round",
                                        ["mode"], buckets=LATENCY_BUCKETS, namespace=ns, subsystem=sub, registry=reg)
        self.uplink_round_bytes = Histogram("round_uplink_size_bytes", "Uplink bytes per round", ["mode"],
                                            buckets=BYTES_BUCKETS, namespace=ns, subsystem=sub, registry=reg)

    def session_started(self, mode: str) -> None:
        self.started.labels(mode).inc()
        self.active.inc()

    def session_ended(self, status: str, was_active: bool) -> None:
        self.ended.labels(status).inc()
        if was_active:
            self.active.dec()

    def round_done(self, mode: str, draft: P.DraftBlock, verdict: P.Verdict, downlink_bytes: int,
                   uplink_bytes: int) -> None:
        n = verdict.num_accepted
        self.rounds.labels(mode).inc()
        self.draft_tokens.labels(mode).inc(len(draft.token_ids))
        self.accepted_tokens.labels(mode).inc(n)
        for i in range(n):
            self.accepted_per_position.labels(str(min(i, MAX_POSITION_LABELS))).inc()
        extra = 1 if verdict.next_token is not None else 0
        self.generated_tokens.labels(mode).inc(n + extra)
        self.uplink_bytes.labels(mode).inc(uplink_bytes)
        self.uplink_round_bytes.labels(mode).observe(uplink_bytes)
        self.downlink_bytes.labels(mode).inc(downlink_bytes)
        self.verify_seconds.labels(mode).observe(verdict.verify_seconds)
