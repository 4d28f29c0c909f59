"""Prometheus metrics of the device client (``specdec_device_*``): the shared set of
:mod:`specdec.common.metrics` (its docstring gives the PromQL for rates), plus what only the device
sees: the transmitted support sizes, the C-SQS threshold, tokens as delivered to the caller.

- transmitted support size K, p50:
  ``histogram_quantile(0.5, sum by (le, mode) (rate(specdec_device_support_size_tokens_bucket[$__rate_interval])))``
- fleet: this device's sessions per edge ``sum by (edge) (specdec_device_fleet_sessions)``; sessions
  that moved to another edge per second ``rate(specdec_device_fleet_moves_total[$__rate_interval])``;
  resumes by kind (``kv``: the edge still held the session; ``reprefill``: started over from the
  verified prefix) ``sum by (kind) (rate(specdec_device_fleet_resumes_total[$__rate_interval]))``
- mode auto, rounds per second per chosen mode:
  ``sum by (mode) (rate(specdec_device_auto_choices_total[$__rate_interval]))`` (divided by its sum over
  modes: the share of each); the controller's latest estimates are
  the ``specdec_device_auto_*`` gauges (round trip, uplink goodput, predicted tokens/s, chosen L and K).
"""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from specdec.common.modes import Mode
from specdec.common.metrics import SpecMetrics
from specdec.common.stats import PHASES, RoundRecord
from specdec.device.fleet import RESUME_KINDS

# K: 1 (a point mass) up to the vocabulary (dense: 49k for SmolLM2, 152k for Qwen-size vocabularies).
SUPPORT_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 4096, 16384, 65536, 262144)


# mode auto's latest choice and estimates (device/auto.py ``AutoPolicy.last``): key, metric, help.
AUTO_GAUGES = (
    ("rtt_s", "rtt_seconds", "Estimated round trip (min-filtered, without serialization and edge time)"),
    ("uplink_bps", "uplink_bits_per_second", "Estimated uplink goodput (0 = not measured yet)"),
    ("predicted_tokens_per_s", "predicted_tokens_per_second", "Tokens per second predicted for the choice"),
    ("alpha_base", "acceptance_ratio", "Estimated per-position acceptance with the exact draft distribution"),
    ("draft_len", "draft_len_tokens", "Chosen draft length L (0 = edge-only round)"),
    ("top_k", "top_k_tokens", "Chosen support size K (0 = the mode has none)"),
    ("net_edge_tokens_per_s", "net_edge_only_tokens_per_second",
     "Tokens per second edge-only rounds delivered (the safety net's estimate)"),
    ("net_spec_tokens_per_s", "net_drafted_tokens_per_second",
     "Tokens per second drafted rounds delivered (the safety net's estimate)"),
    ("draft_s", "drafter_forward_seconds", "Estimated seconds of one drafter forward feeding one token"),
)
# why mode auto overrode its model's pick (``AutoPolicy.last["why"]``): a fixed set, so a bounded label
AUTO_OVERRIDES = ("cold", "probe", "net", "explore")


class DeviceMetrics(SpecMetrics):
    def __init__(self, registry: CollectorRegistry | None = None):
        super().__init__("device", PHASES, registry=registry)
        self.support_size = Histogram("support_size_tokens", "Transmitted support size K per distribution",
                                      ["mode"], buckets=SUPPORT_BUCKETS, **self.kw)
        self.csqs_threshold = Gauge("csqs_threshold", "Current C-SQS threshold beta (0 outside C-SQS)", **self.kw)
        self.auto_choices = Counter("auto_choices", "Rounds whose settings mode auto chose, by mode", ["mode"],
                                    **self.kw)
        self.auto_gauges = {key: Gauge(f"auto_{name}", text, **self.kw) for key, name, text in AUTO_GAUGES}
        for mode in Mode:  # zero series, not missing ones, for modes not chosen yet
            self.auto_choices.labels(mode.value)
        self.auto_overrides = Counter("auto_overrides", "Rounds where mode auto ran another choice than its "
                                      "model's best: cold (first round on an unknown link), probe (a goodput "
                                      "probe), net (the safety net's arm), explore (the net exploring the other "
                                      "arm)", ["why"], **self.kw)
        for why in AUTO_OVERRIDES:
            self.auto_overrides.labels(why)
        self.auto_drafter_timings = Counter("auto_drafter_timings", "Edge-only rounds during which mode auto "
                                            "timed the drafter: in place of an exploration of drafting that "
                                            "could not pay (safety_net.NetCall.retime), or before one", **self.kw)
        # The edge label takes Welcome.edge_name: one value per edge of the fleet, never per session.
        self.fleet_sessions = Gauge("fleet_sessions", "Sessions running on each edge now", ["edge"], **self.kw)
        self.fleet_moves = Counter("fleet_moves", "Sessions that continued on another edge than the one "
                                   "they ran on", **self.kw)
        self.fleet_resumes = Counter("fleet_resumes", "Broken streams resumed, by kind: kv (the edge still "
                                     "held the session) or reprefill (started over from the verified prefix)",
                                     ["kind"], **self.kw)
        for kind in RESUME_KINDS:
            self.fleet_resumes.labels(kind)

    def observe_round(self, r: RoundRecord) -> None:
        super().observe_round(r)
        for k in r.support_sizes:
            self.support_size.labels(r.mode).observe(k)
        if r.threshold is not None:
            self.csqs_threshold.set(r.threshold)

    def observe_auto(self, last: dict) -> None:
        """mode auto chose a round's settings (``AutoPolicy.last``)."""
        if not last:
            return
        self.auto_choices.labels(last["mode"]).inc()
        if last.get("why") in AUTO_OVERRIDES:
            self.auto_overrides.labels(last["why"]).inc()
        if last.get("retime"):
            self.auto_drafter_timings.inc()
        for key, gauge in self.auto_gauges.items():
            gauge.set(last.get(key) or 0.0)

    def fleet_welcomed(self, edge: str, resume: str | None, moved: bool) -> None:
        """A stream of a session started on ``edge``: the first one (``resume`` None) or a resume."""
        self.fleet_sessions.labels(edge).inc()
        if resume is not None:
            self.fleet_resumes.labels(resume).inc()
        if moved:
            self.fleet_moves.inc()

    def fleet_left(self, edge: str) -> None:
        self.fleet_sessions.labels(edge).dec()

    def tokens_delivered(self, mode: str, n: int) -> None:
        """Verified tokens handed to the caller (after the cut at EOS / max_new_tokens)."""
        self.generated_tokens.labels(mode).inc(n)


class SessionMeter:
    """All that one session's client feeds the device's metrics, in one place: its start and end,
    each committed round (a listener of the session's round events), the fleet's welcomes, and the
    tokens handed to the caller. Every method is a no-op without metrics."""

    def __init__(self, metrics: DeviceMetrics | None, mode: str):
        self.metrics, self.mode = metrics, mode

    def started(self, listeners: list) -> None:
        if self.metrics:
            self.metrics.session_started(self.mode)
            listeners.append(self.round)

    def round(self, event) -> None:
        """A committed round (device/rounds.py RoundEvent), and mode auto's choice for it."""
        self.metrics.observe_round(event.record)
        if event.plan.choice is not None:
            self.metrics.observe_auto(event.plan.choice)

    def welcomed(self, edge: str, resume: str | None, moved: bool) -> None:
        if self.metrics:
            self.metrics.fleet_welcomed(edge, resume, moved)

    def left(self, edge: str | None) -> None:
        if self.metrics and edge is not None:
            self.metrics.fleet_left(edge)

    def delivered(self, n: int) -> None:
        """Counted after the cut at EOS / max_new_tokens: what the caller gets."""
        if self.metrics:
            self.metrics.tokens_delivered(self.mode, n)

    def done(self, seconds: float, tokens: int) -> None:
        if self.metrics:
            self.metrics.request_done(self.mode, seconds, tokens)

    def ended(self, status: str) -> None:
        if self.metrics:
            self.metrics.session_ended(status)
