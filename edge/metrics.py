"""Prometheus metrics of the edge server (``specdec_edge_*``): the shared set of
:mod:`specdec.common.metrics` (its docstring gives the PromQL for rates), plus the loaded model, the
resumed sessions and the statuses only the edge gives (authentication, ownership, expiry).

- sessions resumed with their KV cache per second:
  ``rate(specdec_edge_sessions_resumed_total[$__rate_interval])``
"""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Info

from specdec.common.metrics import STATUSES, SpecMetrics
from specdec.common.stats import EDGE_PHASES, RoundRecord

# The edge also refuses callers and frees sessions nobody resumed in time.
EDGE_STATUSES = STATUSES + ("unauthenticated", "permission_denied", "expired")


class EdgeMetrics(SpecMetrics):
    def __init__(self, registry: CollectorRegistry | None = None):
        super().__init__("edge", EDGE_PHASES, EDGE_STATUSES, registry=registry)
        self.model = Info("model", "The loaded target model", **self.kw)
        self.resumed = Counter("sessions_resumed", "Broken streams whose session was resumed (KV kept)", **self.kw)

    def set_model(self, name: str, vocab_size: int) -> None:
        self.model.info({"name": name, "vocab_size": str(vocab_size)})

    def session_resumed(self) -> None:
        self.resumed.inc()

    def observe_round(self, r: RoundRecord) -> None:
        super().observe_round(r)
        self.generated_tokens.labels(r.mode).inc(r.generated)  # the device counts what it delivers
