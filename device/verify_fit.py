"""Mode auto's fit of the edge's verify time: seconds of a forward by the tokens it verifies.

Part of what the device learns about its edge (device/auto.py's ``LinkTracker`` holds one): the
forwards its rounds reported (``Verdict.verify_seconds`` with the round's tokens), fitted as a line
(:func:`~specdec.device.autotune.fit_verify`) shrunk toward a prior: the edge's stated cost curve when
its Welcome gives one (``Welcome.forward_cost``), else a CPU-shaped guess. Not thread-safe by itself:
the tracker calls it under its lock.
"""
from __future__ import annotations

import collections

from specdec.common.loadaware import CostCurve
from specdec.device import autotune as A

VERIFY_WINDOW = 24            # (tokens, seconds) points in the verify-time fit
PRIOR_VERIFY_SLOPE = 0.15     # a forward's extra cost per token, relative to one token (a CPU's, the steeper kind)
VERIFY_PRIOR_WEIGHT = 4.0     # forwards' worth of spread behind that prior slope
PRIOR_VERIFY_BASE_S = 0.05    # a one-token forward before any verdict reported one
# ... unless the edge's Welcome states its calibrated cost curve: its line over forwards of at most
# this many tokens (a round's forward is at most the longest draft plus one) replaces both, so that a
# GPU edge, whose forwards hardly grow with their tokens, is priced as one from the first round.
EDGE_CURVE_UP_TO = 64
MIN_FORWARD_S = 1e-4          # a stated one-token cost below this is the curve's rounding, not a forward


class VerifyFit:
    """The edge's recent forwards and the prior they are shrunk toward."""

    def __init__(self) -> None:
        self.points: collections.deque[tuple[int, float]] = collections.deque(maxlen=VERIFY_WINDOW)
        self.prior = (PRIOR_VERIFY_BASE_S, PRIOR_VERIFY_SLOPE)  # (one-token s, relative slope)

    def add(self, tokens: int, seconds: float) -> None:
        self.points.append((max(1, tokens), seconds))

    def fit(self) -> tuple[float, float]:
        """(seconds of a one-token forward, seconds per further token), shrunk toward the prior."""
        base, slope = self.prior
        return A.fit_verify(list(self.points), slope, VERIFY_PRIOR_WEIGHT, base)

    def observe_edge_cost(self, points: tuple[tuple[int, float], ...]) -> None:
        """The edge's calibrated cost curve becomes the prior: its one-token cost and its slope
        relative to it, over the forwards a round makes."""
        usable = [(t, s) for t, s in points if t <= EDGE_CURVE_UP_TO and s > 0]
        if len(usable) < 2:
            return
        fixed, per_token = CostCurve(dict(usable)).fit_affine()
        one = max(MIN_FORWARD_S, fixed + per_token)
        self.prior = (one, max(0.0, per_token) / one)
