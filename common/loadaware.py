"""Load-aware speculation: the longest draft that still pays when one target forward serves many.

Pure functions, no model, clock or socket. The edge measures its batched forward cost c(T), the
seconds of one forward over T new tokens (all sessions together), and keeps each session's
acceptance alpha; :func:`best_draft_len` then tells a device how long to draft.

Model (the uniform-load form of TSLT eq. 5/8 and of SLED's batched verification): n sessions each
send rounds of L drafts to the same forwards, so a forward holds T = n (L + 1) tokens and yields
each session E(L) = (1 - alpha^(L+1)) / (1 - alpha) tokens (L accepted drafts at most, plus the
correction/bonus token; Leviathan et al. 2023, eq. 1). Edge goodput is

    G(L) = n E(L) / c(n (L + 1)),

and L = 0 is the edge generating alone (one token per session per forward). On a flat cost curve
(a GPU, or one session) G grows with L up to the device's own limit; on a CPU under load
c(T) grows nearly linearly and the best L falls, down to 0 where speculation costs more forward
than it saves (vLLM's measurement: speculation made loaded serving 1.4-1.8x slower until the draft
length followed the batch size).
"""
from __future__ import annotations

from dataclasses import dataclass, field

# Tokens at which the cost curve is kept: powers of two cover 1 .. 1024 with 11 points, and
# forward time is smooth in T in between (linear interpolation).
CURVE_POINTS = tuple(2 ** i for i in range(11))
# A new measurement moves its point this far: a few forwards refresh it, one outlier does not.
CURVE_EWMA = 0.2
# Ties within this share of the best goodput go to the longer draft: a longer draft also hides more
# of the device's round trip, which the edge cannot see.
TIE_SHARE = 0.02


@dataclass
class CostCurve:
    """Seconds of one target forward over T new tokens, at CURVE_POINTS; linear in between and
    extrapolated linearly beyond the last point."""
    seconds: dict[int, float] = field(default_factory=dict)

    def observe(self, tokens: int, seconds: float) -> None:
        """One forward of ``tokens`` tokens took ``seconds``: refresh the nearest point."""
        if tokens < 1 or not seconds > 0:
            return
        point = min(CURVE_POINTS, key=lambda p: abs(p - tokens))
        # Rescale to the point along the current curve, so a 5-token forward informs the 4-point.
        scaled = seconds * self(point) / self(tokens) if self.seconds else seconds
        old = self.seconds.get(point)
        self.seconds[point] = scaled if old is None else (1 - CURVE_EWMA) * old + CURVE_EWMA * scaled

    @classmethod
    def affine(cls, fixed_s: float, per_token_s: float) -> "CostCurve":
        """The curve of a forward costing ``fixed_s + per_token_s * T`` (a published fit, e.g. vLLM's
        on an H100), at CURVE_POINTS."""
        return cls({t: fixed_s + per_token_s * t for t in CURVE_POINTS})

    def points(self) -> tuple[tuple[int, float], ...]:
        """(tokens, seconds) at each calibrated point, fewest tokens first."""
        return tuple(sorted(list(self.seconds.items())))  # list(): one step, while forwards refresh it

    def fit_affine(self, up_to: int | None = None) -> tuple[float, float]:
        """(fixed seconds, seconds per token): the least-squares line through the curve's points (those
        of at most ``up_to`` tokens)."""
        pts = [(t, s) for t, s in sorted(self.seconds.items()) if up_to is None or t <= up_to]
        if len(pts) < 2:
            raise ValueError("an affine fit needs two points")
        n = len(pts)
        mean_t = sum(t for t, _ in pts) / n
        mean_s = sum(s for _, s in pts) / n
        slope = sum((t - mean_t) * (s - mean_s) for t, s in pts) / sum((t - mean_t) ** 2 for t, _ in pts)
        return mean_s - slope * mean_t, slope

    def __call__(self, tokens: float) -> float:
        if not self.seconds:
            raise ValueError("empty cost curve")
        pts = sorted(self.seconds.items())
        if len(pts) == 1:
            return pts[0][1] * max(tokens, 1) / pts[0][0] if tokens > pts[0][0] else pts[0][1]
        if tokens <= pts[0][0]:
            return pts[0][1]
        for (t0, s0), (t1, s1) in zip(pts, pts[1:]):
            if tokens <= t1:
                return s0 + (s1 - s0) * (tokens - t0) / (t1 - t0)
        (t0, s0), (t1, s1) = pts[-2], pts[-1]
        return s1 + max(0.0, (s1 - s0) / (t1 - t0)) * (tokens - t1)


def expected_tokens(alpha: float, draft_len: int) -> float:
    """E(L): tokens a round yields with per-position acceptance ``alpha`` (1 for L = 0)."""
    if draft_len == 0:
        return 1.0
    if alpha >= 1.0:
        return draft_len + 1.0
    return (1.0 - alpha ** (draft_len + 1)) / (1.0 - alpha)


def goodput(sessions: int, alpha: float, draft_len: int, cost: CostCurve) -> float:
    """Tokens per second of the edge when ``sessions`` sessions all draft ``draft_len``."""
    return sessions * expected_tokens(alpha, draft_len) / cost(sessions * (draft_len + 1))


def best_draft_len(sessions: int, alpha: float, cost: CostCurve, max_len: int) -> int:
    """The longest L in 0..max_len whose goodput is within TIE_SHARE of the best."""
    assert sessions >= 1 and 0.0 <= alpha <= 1.0 and max_len >= 0, (sessions, alpha, max_len)
    values = [goodput(sessions, alpha, n, cost) for n in range(max_len + 1)]
    best = max(values)
    return max(n for n, g in enumerate(values) if g >= (1 - TIE_SHARE) * best)


@dataclass
class Acceptance:
    """Per-position acceptance of one session's drafts: the geometric MLE, accepted drafts over
    positions tested (a round of L that accepted k tested k + 1 positions if k < L, else k),
    shrunk toward a prior worth PRIOR_POSITIONS positions and decayed so it follows the text."""
    PRIOR = 0.7
    # A few positions: two rounds of a drafter that is never right (tested one position each) bring
    # it below what pays for a draft on a busy CPU edge, where eight positions took five rounds.
    PRIOR_POSITIONS = 4.0
    DECAY = 0.95  # per round: ~20 rounds of memory
    # Per edge-only token the estimate moves this much back toward PRIOR: a session the advice sent
    # edge-only teaches nothing of its drafts, and must not stay there on an old estimate for good
    # (~140 tokens halve what its drafted rounds taught).
    RELAX = 0.995

    accepted: float = PRIOR * PRIOR_POSITIONS
    tested: float = PRIOR_POSITIONS

    @classmethod
    def starting_at(cls, alpha: float) -> "Acceptance":
        """A new session's estimate starting from ``alpha`` (the edge's recent drafts': a device's
        first drafts are likeliest as good as those before it), at the prior's weight."""
        return cls(accepted=min(1.0, max(0.0, alpha)) * cls.PRIOR_POSITIONS, tested=cls.PRIOR_POSITIONS)

    def observe(self, drafted: int, accepted: int) -> None:
        if drafted < 1:
            return
        self.accepted = self.DECAY * self.accepted + accepted
        self.tested = self.DECAY * self.tested + accepted + (1 if accepted < drafted else 0)

    def relax(self, tokens: int) -> None:
        """``tokens`` came from edge-only rounds: back toward PRIOR by RELAX per token."""
        keep = self.RELAX ** max(0, tokens)
        self.accepted = keep * self.accepted + (1 - keep) * self.PRIOR * self.PRIOR_POSITIONS
        self.tested = keep * self.tested + (1 - keep) * self.PRIOR_POSITIONS

    @property
    def alpha(self) -> float:
        return min(1.0, self.accepted / self.tested)


@dataclass
class RecentAcceptance(Acceptance):
    """The acceptance of all the edge's recent drafts (every session's), where a new session's
    estimate starts: a busy edge whose devices draft badly advises the next one from its first round."""
    PRIOR_POSITIONS = 1.0  # many sessions' rounds soon outweigh it
    DECAY = 0.99           # per round of any session: ~100 rounds

    accepted: float = Acceptance.PRIOR * PRIOR_POSITIONS
    tested: float = PRIOR_POSITIONS
