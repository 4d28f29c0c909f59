"""Prometheus metrics of the device client (``specdec_device_*``).

Labels are of low cardinality only (mode, status, position, phase); never a session id.
Derived rates are PromQL over counters:
- acceptance rate:
  ``sum(rate(specdec_device_accepted_tokens_total[5m])) / sum(rate(specdec_device_draft_tokens_total[5m]))``
- mean accepted length per round:
  ``sum(rate(specdec_device_accepted_tokens_total[5m])) / sum(rate(specdec_device_rounds_total[5m]))``
- uplink / downlink bytes per generated token:
  ``sum(rate(specdec_device_uplink_bytes_total[5m])) / sum(rate(specdec_device_generated_tokens_total[5m]))``
- throughput: ``sum(rate(specdec_device_generated_tokens_total[1m]))``
- phase latency p95: ``histogram_quantile(0.95, sum by (le, phase) (rate(specdec_device_phase_duration_seconds_bucket[5m])))``
"""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

# Per-round phases run ~0.1 ms (encode, tiny models) to seconds (shaped links, big models).
PHASE_BUCKETS = (0.0001, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
REQUEST_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 25.0, 60.0, 120.0)
TOKEN_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28)
BYTES_BUCKETS = (32, 128, 512, 2048, 8192, 32768, 131072, 524288, 2097152)
SUPPORT_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 4096, 16384, 65536, 262144)
TREE_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
MAX_POSITION_LABELS = 32  # positions beyond this share one label to bound cardinality
PHASES = ("draft", "encode", "network", "verify")


class DeviceMetrics:
    def __init__(self, registry: CollectorRegistry | None = None):
        reg = registry if registry is not None else CollectorRegistry()
        self.registry = reg
        kw = dict(namespace="specdec", subsystem="device", registry=reg)
        self.active = Gauge("sessions_active", "Sessions currently open", **kw)
        self.started = Counter("sessions_started", "Sessions started", ["mode"], **kw)
        self.ended = Counter("sessions_ended", "Sessions ended, by final status", ["status"], **kw)
        self.rounds = Counter("rounds", "Draft/verify rounds", ["mode"], **kw)
        self.draft_tokens = Counter("draft_tokens", "Draft tokens sent", ["mode"], **kw)
        self.accepted_tokens = Counter("accepted_tokens", "Draft tokens accepted by the edge", ["mode"], **kw)
        self.accepted_per_position = Counter(
            "accepted_tokens_per_position", "Accepted draft tokens by draft position (0-based)", ["position"], **kw)
        self.generated_tokens = Counter("generated_tokens", "Verified tokens delivered", ["mode"], **kw)
        self.uplink_bytes = Counter("uplink_bytes", "Serialized bytes sent during rounds", ["mode"], **kw)
        self.downlink_bytes = Counter("downlink_bytes", "Serialized bytes received during rounds", ["mode"], **kw)
        self.phase_seconds = Histogram("phase_duration_seconds", "Time per round and phase", ["phase"],
                                       buckets=PHASE_BUCKETS, **kw)
        self.request_seconds = Histogram("request_duration_seconds", "End-to-end time per request",
                                         ["mode"], buckets=REQUEST_BUCKETS, **kw)
        self.token_seconds = Histogram("time_per_output_token_seconds", "Wall time per generated token",
                                       ["mode"], buckets=TOKEN_BUCKETS, **kw)
        self.round_uplink = Histogram("round_uplink_size_bytes", "Uplink bytes per round", ["mode"],
                                      buckets=BYTES_BUCKETS, **kw)
        self.support_size = Histogram("support_size_tokens", "Transmitted support size K per distribution",
                                      ["mode"], buckets=SUPPORT_BUCKETS, **kw)
        self.csqs_threshold = Gauge("csqs_threshold", "Current C-SQS threshold beta", **kw)
        self.tree_nodes = Histogram("tree_nodes", "Draft nodes sent per round", ["mode"],
                                    buckets=TREE_BUCKETS, **kw)

    def session_started(self, mode: str) -> None:
        self.started.labels(mode).inc()
        self.active.inc()

    def session_ended(self, status: str) -> None:
        self.ended.labels(status).inc()
        self.active.dec()

    def round_done(self, mode: str, *, drafted: int, accepted: int, generated: int, uplink: int,
                   downlink: int, phases: dict[str, float], support_sizes: list[int],
                   threshold: float | None) -> None:
        self.rounds.labels(mode).inc()
        self.draft_tokens.labels(mode).inc(drafted)
        self.accepted_tokens.labels(mode).inc(accepted)
        for i in range(accepted):
            self.accepted_per_position.labels(str(min(i, MAX_POSITION_LABELS))).inc()
        self.generated_tokens.labels(mode).inc(generated)
        self.uplink_bytes.labels(mode).inc(uplink)
        self.downlink_bytes.labels(mode).inc(downlink)
        self.round_uplink.labels(mode).observe(uplink)
        self.tree_nodes.labels(mode).observe(drafted)
        for phase, seconds in phases.items():
            self.phase_seconds.labels(phase).observe(seconds)
        for k in support_sizes:
            self.support_size.labels(mode).observe(k)
        if threshold is not None:
            self.csqs_threshold.set(threshold)

    def request_done(self, mode: str, seconds: float, tokens: int) -> None:
        self.request_seconds.labels(mode).observe(seconds)
        if tokens:
            self.token_seconds.labels(mode).observe(seconds / tokens)
