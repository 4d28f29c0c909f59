"""Prometheus metrics of the device client (``specdec_device_*``): the shared set of
:mod:`specdec.common.metrics` (its docstring gives the PromQL for rates), plus what only the device
sees: the transmitted support sizes, the C-SQS threshold, tokens as delivered to the caller.

- transmitted support size K, p50:
  ``histogram_quantile(0.5, sum by (le, mode) (rate(specdec_device_support_size_tokens_bucket[$__rate_interval])))``
"""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Gauge, Histogram

from specdec.common.metrics import SpecMetrics
from specdec.common.stats import PHASES, RoundRecord

# K: 1 (a point mass) up to the vocabulary (dense: 49k for SmolLM2, 152k for Qwen-size vocabularies).
SUPPORT_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 4096, 16384, 65536, 262144)


class DeviceMetrics(SpecMetrics):
    def __init__(self, registry: CollectorRegistry | None = None):
        super().__init__("device", PHASES, registry=registry)
        self.support_size = Histogram("support_size_tokens", "Transmitted support size K per distribution",
                                      ["mode"], buckets=SUPPORT_BUCKETS, **self.kw)
        self.csqs_threshold = Gauge("csqs_threshold", "Current C-SQS threshold beta (0 outside C-SQS)", **self.kw)

    def observe_round(self, r: RoundRecord) -> None:
        super().observe_round(r)
        for k in r.support_sizes:
            self.support_size.labels(r.mode).observe(k)
        if r.threshold is not None:
            self.csqs_threshold.set(r.threshold)

    def tokens_delivered(self, mode: str, n: int) -> None:
        """Verified tokens handed to the caller (after the cut at EOS / max_new_tokens)."""
        self.generated_tokens.labels(mode).inc(n)
