"""Which settings the next round should use: expected tokens per second of each candidate, as pure math.

The device's ``mode auto`` controller (device/auto.py) measures the link and the two models and asks
:func:`best` which candidate (mode, K, draft length, or an edge-only round) maximises expected tokens
per second. Pure: the estimates come in, a ranking comes out; no clock, no model, no socket.

The model is the oracle-call latency model of TSLT (Zheng et al., "Fast Collaborative Inference via
Distributed Speculative Decoding", §2.3: eq. (5) round time, eq. (8) tokens per round, here with the
acceptance measured per depth: :func:`~specdec.device.latency.expected_tokens_by_depth`), extended with
what a real link adds: a round trip (propagation, paid once per round), uplink and downlink goodput
(serialization), the edge's verify time as a function of the tokens in its forward, drafting ahead
(:func:`~specdec.device.latency.oracle_time_drafting_ahead`), DSSD's fallback round trip, and
edge-only rounds (the target alone, streamed). Acceptance for a support size not tried yet comes from
the top-K relation of TSLT Theorem 1, eq. (20)-(22): truncating q to its top K moves the acceptance
rate by at most the dropped mass sigma_K; we use that bound as a first-order estimate,
alpha_K = alpha_base - sigma_K (Lemma 2, eq. (19): the same holds for any packet with TV(q_hat, q) in
place of sigma_K, which covers K-SQS's lattice error). Gumbel rounds keep a draft iff it is the
target's own draw with the shared noise, which happens with probability between (1 - TV) / (1 + TV)
(Daliri et al., arXiv 2408.07978, Theorem 2) and 1 - TV = alpha_base: their acceptance is measured on
their own rounds, with a prior from alpha_base (:func:`gumbel_prior`) until they have run.
"""
from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Mapping

from specdec.common.modes import Mode
from specdec.device.latency import expected_tokens_by_depth, oracle_time_drafting_ahead

# Modes whose rounds the device can draft ahead (device/chain.py DRAFT_AHEAD_MODES, stated here as
# data so that this module stays free of device code).
AHEAD_MODES = frozenset({Mode.DENSE, Mode.TSLT, Mode.KSQS, Mode.DSSD, Mode.GUMBEL})
TRUST_FACTOR = 4.0             # rounds up to this x the largest measured one are predicted at the estimate
UNTRUSTED_BPS = 1e6            # ... and the bits beyond it at most this fast
PROTO_BYTES_PER_TOKEN = 6      # a draft token's id and its packet's length prefix on the wire
PROTO_BYTES_PER_ROUND = 24     # round id, settings and framing of a Draft message
VERDICT_BYTES = 40             # a Verdict (ids, counts, timings): the downlink of a verified round
EDGE_TOKEN_BYTES = 40          # one streamed Verdict per token of an edge-only round


@dataclass(frozen=True)
class Candidate:
    """One way to run the next round: a mode with its support size and draft length, or edge-only."""
    mode: Mode
    draft_len: int = 0          # L; 0 for edge-only rounds
    top_k: int = 0              # TSLT / K-SQS support; 0 where the mode has none

    @property
    def key(self) -> str:
        if self.mode is Mode.NONE:
            return "none"
        k = f"-{self.top_k}" if self.top_k else ""
        return f"{self.mode.value}{k}/L{self.draft_len}"

    @property
    def codec_key(self) -> tuple[Mode, int]:
        """What its packets depend on (bytes and acceptance per position do not depend on L)."""
        return self.mode, self.top_k


@dataclass(frozen=True)
class Estimates:
    """What the device currently believes about the link and the two models (seconds, bits/s)."""
    rtt_s: float                            # round trip without serialization or edge time
    uplink_bps: float                       # goodput device -> edge
    downlink_bps: float                     # goodput edge -> device
    draft_s: float                          # drafter time per forward (one per drafted token, + 1 feed)
    verify_base_s: float                    # edge time of a forward with one token ...
    verify_per_token_s: float               # ... plus this per further token in the forward
    alpha_base: float                       # per-position acceptance with the exact q
    # ... and per depth d + 1 given every earlier draft of the round was accepted (exact q as well);
    # depths past its end take its last entry; empty: alpha_base at every depth (eq. 8's i.i.d. rounds)
    alpha_depth: tuple[float, ...] = ()
    sigma: Mapping[tuple[Mode, int], float] = field(default_factory=dict)   # TV(q_hat, q) per codec
    packet_bytes: Mapping[tuple[Mode, int], float] = field(default_factory=dict)  # per draft token
    encode_s: Mapping[Mode, float] = field(default_factory=dict)   # device: encode + decode per draft token
    decode_s: Mapping[Mode, float] = field(default_factory=dict)   # edge: payload decode per draft token
    queue_s: float = 0.0                    # edge: wait for its worker per forward
    link_measured: bool = True              # rtt_s and uplink_bps rest on a round (not the prior: rtt 0)
    guess_rate: float = 0.7                 # P(bonus guessed right | all accepted): drafting ahead
    dssd_fallback_rate: float = 0.05        # P(a DSSD rejection needs the full p_j) ...
    dssd_fallback_bytes: float = 0.0        # ... and what that p_j costs downlink
    edge_chunk: int = 16                    # tokens an edge-only round asks for
    edge_token_s: float | None = None       # edge-only's seconds per streamed token, measured (None: not
                                            # yet: the edge's one-token forward, queue and message)
    # measured / predicted round time per codec key: what the model misses (runtime overheads,
    # contention) is learned per kind of round and scales its predictions (1 = the model as is)
    time_scale: Mapping[tuple[Mode, int], float] = field(default_factory=dict)
    # The goodput was measured with rounds of up to this many bits; a larger round may meet a slower
    # link (a token bucket lets small rounds through at line rate), so bits beyond TRUST_FACTOR x
    # this are predicted at UNTRUSTED_BPS at best: the controller grows its rounds step by step, as
    # TCP's slow start grows its window. inf = no limit.
    measured_up_bits: float = math.inf
    # The edge's measured cost curve, seconds of one forward by its new tokens (all sessions'; the
    # edge's common.loadaware.CostCurve), and the other sessions' tokens in the forwards this
    # device's rounds join. Set, it replaces the affine fit: on a GPU a forward of 64 tokens costs
    # ~1.2x one of a single token, which an affine fit of a few short rounds cannot tell.
    verify_curve: Callable[[float], float] | None = None
    edge_batch_tokens: float = 0.0
    # Gumbel rounds' acceptance per tested position and per depth, as their own rounds measured it
    # (None / empty: the prior :func:`gumbel_prior` of alpha_base and of each alpha_depth)
    gumbel_alpha: float | None = None
    gumbel_depth: tuple[float, ...] = ()
    greedy: bool = False                    # temperature 0: the race agrees exactly when the argmaxes do

    def verify_s(self, tokens: int) -> float:
        """The edge's time for a forward over ``tokens`` tokens of this device: its cost curve at
        those plus the other sessions' tokens, else the affine fit of its reports."""
        if self.verify_curve is not None:
            return self.verify_curve(tokens + self.edge_batch_tokens)
        return self.verify_base_s + self.verify_per_token_s * max(0, tokens - 1)

    def alpha(self, c: Candidate) -> float:
        """Per-position acceptance with c's packets: alpha_base - TV(q_hat, q) (TSLT eq. 22); gumbel
        rounds': their own (module docstring)."""
        if c.mode is Mode.GUMBEL:
            return self.gumbel_alpha if self.gumbel_alpha is not None else gumbel_prior(self.alpha_base, self.greedy)
        return min(1.0, max(0.0, self.alpha_base - self.sigma.get(c.codec_key, 0.0)))

    def depth_alphas(self, c: Candidate) -> list[float]:
        """Acceptance at each depth of c's round with c's packets: alpha_depth - TV(q_hat, q) (eq. 22
        per position); gumbel rounds': their own per depth, else the prior of alpha_depth's."""
        if c.mode is Mode.GUMBEL:
            depths = self.gumbel_depth or tuple(gumbel_prior(a, self.greedy)
                                                for a in (self.alpha_depth or (self.alpha_base,)))
            return [depths[min(d, len(depths) - 1)] for d in range(c.draft_len)]
        if not self.alpha_depth:
            return [self.alpha(c)] * c.draft_len
        sigma, last = self.sigma.get(c.codec_key, 0.0), len(self.alpha_depth) - 1
        return [min(1.0, max(0.0, self.alpha_depth[min(d, last)] - sigma)) for d in range(c.draft_len)]


# Gumbel rounds' acceptance before they have run: 1 - GUMBEL_TV_FACTOR x TV with TV = 1 - alpha, the
# exact q's acceptance. Daliri et al.'s Theorem 2 puts it between (1 - TV) / (1 + TV) ~ 1 - 2 TV and
# 1 - TV; the factor is where the default pair's race sits at T = 1 (`make bench-coupling`;
# docs/benchmarks.md, "Acceptance against uplink bits").
GUMBEL_TV_FACTOR = 1.30


def race_from_exact(alpha: float, greedy: bool = False) -> float:
    """The relation GUMBEL_TV_FACTOR measures, 1 - alpha_gumbel = GUMBEL_TV_FACTOR (1 - alpha), applied to
    one position's (expected) exact-q acceptance; linear, so that its average over positions is the
    relation's (a rejected position maps below 0). At temperature 0 the two events are one."""
    return alpha if greedy else 1.0 - GUMBEL_TV_FACTOR * (1.0 - alpha)


def exact_from_race(alpha_gumbel: float, greedy: bool = False) -> float:
    """Inverse of :func:`race_from_exact`."""
    return alpha_gumbel if greedy else 1.0 - (1.0 - alpha_gumbel) / GUMBEL_TV_FACTOR


def gumbel_prior(alpha: float, greedy: bool = False) -> float:
    """Expected gumbel acceptance per position from the exact q's acceptance ``alpha`` = 1 - TV, within
    Theorem 2's bounds; at temperature 0 both are one-hot and the race agrees iff the argmaxes do."""
    if greedy:
        return alpha
    tv = 1.0 - alpha
    return max((1.0 - tv) / (1.0 + tv), race_from_exact(alpha))


def accepting_all(e: Estimates) -> Estimates:
    """``e`` with every draft accepted, whatever its packets (no rejection, so no DSSD fallback): what
    drafted rounds deliver at best, at the costs measured. The bonus's guess: at temperature 0 right
    as well (every draft accepted is the drafter's argmax agreeing with the target's at each position,
    and the bonus is one more position's argmax); else as measured (the bonus is sampled from p, which
    no drafter's guess fixes). At 0 the measured guess (0.8-0.9 behind 0.99 acceptance) put the best
    case under what drafted rounds delivered (20 tok/s against a best case of 18), and drafting that
    paid by 10 % was never explored."""
    return replace(e, alpha_base=1.0, alpha_depth=(), sigma={}, gumbel_alpha=1.0, gumbel_depth=(),
                   dssd_fallback_rate=0.0, guess_rate=1.0 if e.greedy else e.guess_rate)


@dataclass(frozen=True)
class Prediction:
    candidate: Candidate
    tokens: float           # expected tokens per round
    seconds: float          # expected seconds per round
    alpha: float

    @property
    def rate(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0


def _serialize_s(nbytes: float, bps: float) -> float:
    return 8.0 * nbytes / bps if bps > 0 and math.isfinite(bps) else 0.0


def uplink_s(nbytes: float, e: Estimates) -> float:
    """Serialization of an uplink message: at the goodput estimate up to the size it was measured
    with (times TRUST_FACTOR), beyond that at no more than UNTRUSTED_BPS."""
    trusted = TRUST_FACTOR * e.measured_up_bits / 8.0
    if nbytes <= trusted:
        return _serialize_s(nbytes, e.uplink_bps)
    return _serialize_s(trusted, e.uplink_bps) + _serialize_s(nbytes - trusted, min(e.uplink_bps, UNTRUSTED_BPS))


def uplink_bytes(c: Candidate, e: Estimates) -> float:
    """Bytes of one round's Draft message run as ``c``."""
    if c.mode is Mode.NONE:
        return float(PROTO_BYTES_PER_ROUND)
    return PROTO_BYTES_PER_ROUND + c.draft_len * (e.packet_bytes.get(c.codec_key, 0.0) + PROTO_BYTES_PER_TOKEN)


def predict(c: Candidate, e: Estimates, draft_ahead: bool = True) -> Prediction:
    """Expected tokens and seconds per round run as ``c`` in steady state (module docstring: the
    model), scaled by what rounds of its kind measured against it (:func:`time_scale`). A round's
    plan is fixed before it is drafted, ahead or not, so no choice inherits work in progress."""
    p = model_round(c, e, draft_ahead)
    scale = time_scale(c, e)
    return Prediction(c, p.tokens, p.seconds * scale, p.alpha) if scale != 1.0 else p


def time_scale(c: Candidate, e: Estimates) -> float:
    """Measured over modelled time of ``c``'s kind of round (``Estimates.time_scale``); 1 for edge-only
    rounds, whose time per token is itself measured (``Estimates.edge_token_s``, how they streamed): a
    scale learned on top of it corrects the same error twice, and an edge that sped up by 10 % was then
    predicted 10 % faster than it streamed (a scale older memory files may still hold is ignored)."""
    return 1.0 if c.mode is Mode.NONE else e.time_scale.get(c.codec_key, 1.0)


def _round_parts(c: Candidate, e: Estimates) -> tuple[float, float, float]:
    """(seconds per draft token: one drafter forward and its codec; network seconds; edge seconds)
    of a chain round."""
    L = c.draft_len
    comm = (e.rtt_s + uplink_s(uplink_bytes(c, e), e)
            + _serialize_s(VERDICT_BYTES, e.downlink_bps))
    t_slm = e.draft_s + e.encode_s.get(c.mode, 0.0)
    verify = e.queue_s + L * e.decode_s.get(c.mode, 0.0) + e.verify_s(L + 1)
    return t_slm, comm, verify


def model_round(c: Candidate, e: Estimates, draft_ahead: bool = True) -> Prediction:
    """:func:`predict` in steady state, before the learned scale."""
    if c.mode is Mode.NONE:
        # Drafting ahead's edge-only kin: the device sends the next edge-only round's request while
        # this one streams (engine._send_ahead), so in steady state no boundary waits a round trip.
        n = max(1, e.edge_chunk)
        boundary = 0.0 if draft_ahead else e.rtt_s + uplink_s(PROTO_BYTES_PER_ROUND, e)
        return Prediction(c, float(n), boundary + n * edge_token_s(e), 0.0)
    L = c.draft_len
    alphas = e.depth_alphas(c)
    tokens = expected_tokens_by_depth(alphas)
    t_slm, comm, verify = _round_parts(c, e)
    if draft_ahead and c.mode in AHEAD_MODES:
        # The round drafted ahead is kept when all L are accepted and the bonus was guessed.
        hit = math.prod(alphas) * e.guess_rate
        seconds = oracle_time_drafting_ahead(L, t_slm, comm, verify, hit)
    else:
        seconds = L * t_slm + comm + verify
    return Prediction(c, tokens, seconds + _dssd_fallback_s(c, e), e.alpha(c))


def edge_token_s(e: Estimates) -> float:
    """Seconds per token an edge-only round streams at: as its rounds measured it, else the edge's
    one-token forward, its queue and the token's message."""
    if e.edge_token_s is not None:
        return e.edge_token_s
    return e.queue_s + e.verify_s(1) + _serialize_s(EDGE_TOKEN_BYTES, e.downlink_bps)


def _dssd_fallback_s(c: Candidate, e: Estimates) -> float:
    if c.mode is not Mode.DSSD:
        return 0.0
    rejected = 1.0 - math.prod(e.depth_alphas(c))  # a rejection needs the device's resample; rarely the full p_j
    return rejected * e.dssd_fallback_rate * (e.rtt_s + _serialize_s(e.dssd_fallback_bytes, e.downlink_bps))


def first_round(c: Candidate, e: Estimates, steps_ahead: int = 0, draft_ahead: bool = True,
                sent_ahead: bool = False) -> float:
    """Seconds one round run as ``c`` takes from the last verdict to its own (before the learned
    scale), given the ``steps_ahead`` of its tokens drafted while the last round was verified: it
    drafts only the L - steps_ahead others after the verdict (eq. 5); an edge-only round waits a
    round trip for its first token unless it was ``sent_ahead``. The measured time of each round
    against this teaches :attr:`Estimates.time_scale`."""
    if c.mode is Mode.NONE:
        return model_round(c, e, draft_ahead=sent_ahead).seconds
    t_slm, comm, verify = _round_parts(c, e)
    usable = draft_ahead and c.mode in AHEAD_MODES
    to_draft = max(0, c.draft_len - steps_ahead) if usable else c.draft_len
    return to_draft * t_slm + comm + verify + _dssd_fallback_s(c, e)


def rank(candidates: list[Candidate], e: Estimates, draft_ahead: bool = True) -> list[Prediction]:
    """Every candidate's prediction, best expected tokens per second first."""
    return sorted((predict(c, e, draft_ahead) for c in candidates), key=lambda p: -p.rate)


def best(candidates: list[Candidate], e: Estimates, current: Candidate | None = None,
         hysteresis: float = 0.0, draft_ahead: bool = True) -> tuple[Prediction, list[Prediction]]:
    """The candidate to run next and the full ranking. Keeps ``current`` unless the best beats it by
    more than ``hysteresis`` (relative)."""
    ranking = rank(candidates, e, draft_ahead)
    top = ranking[0]
    if current is not None and hysteresis > 0:
        kept = next((p for p in ranking if p.candidate == current), None)
        if kept is not None and top.rate <= kept.rate * (1.0 + hysteresis):
            return kept, ranking
    return top, ranking


def probe_pays(candidates: list[Candidate], e: Estimates, pick: Candidate, fast_bps: float, min_gain: float,
               draft_ahead: bool = True) -> bool:
    """Whether measuring the uplink could pay: on a link of ``fast_bps`` the best candidate would beat
    ``pick`` by more than ``min_gain`` (relative). A probe round costs a round drafted ahead and a
    larger packet; where all candidates send a few bytes (T = 0: a greedy q is one token) no
    goodput changes the choice by more than noise."""
    fast = replace(e, uplink_bps=fast_bps)
    top = rank(candidates, fast, draft_ahead)[0]
    return top.candidate != pick and top.rate > (1.0 + min_gain) * predict(pick, fast, draft_ahead).rate


def candidate_grid(top_ks: tuple[int, ...], draft_lens: tuple[int, ...], ksqs_ks: tuple[int, ...],
                   dense: bool = True, dssd: bool = True, edge_only: bool = True,
                   gumbel: bool = True) -> list[Candidate]:
    """The candidates a controller chooses among: each mode at each draft length, plus edge-only."""
    out: list[Candidate] = [Candidate(Mode.NONE)] if edge_only else []
    for L in draft_lens:
        out += [Candidate(Mode.TSLT, L, k) for k in top_ks]
        out += [Candidate(Mode.KSQS, L, k) for k in ksqs_ks]
        if dense:
            out.append(Candidate(Mode.DENSE, L))
        if dssd:
            out.append(Candidate(Mode.DSSD, L))
        if gumbel:
            out.append(Candidate(Mode.GUMBEL, L))
    return out


def edge_chunk(rtt_s: float, token_s: float, overhead: float, lo: int, hi: int) -> int:
    """Tokens an edge-only round should ask for so that its boundary costs at most ``overhead`` of
    the round: n t >= b (1 - overhead) / overhead, within [lo, hi], where the boundary b is the round
    trip plus one token's forward (while the next round's request travels the edge computes nothing
    for it; at a busy batching edge the session misses that forward)."""
    if token_s <= 0:
        return hi
    n = math.ceil((rtt_s + token_s) * (1.0 - overhead) / (overhead * token_s))
    return max(lo, min(hi, n))


def fit_link(samples: list[tuple[float, float]], weights: list[float], prior_rtt_s: float,
             prior_bps: float, small_bits: float, min_spread: float = 2.0) -> tuple[float, float]:
    """(round trip s, uplink bits/s) from recent rounds' (uplink bits, network seconds), newest
    weighted most: the weighted least-squares line network = rtt + bits / rate.

    Where the rounds cannot separate the two, the previous estimate of one gives the other: rounds
    all smaller than ``small_bits`` measure the round trip (their serialization at ``prior_bps``
    taken off), rounds all of one larger size measure the rate above ``prior_rtt_s``. A fit whose
    larger rounds are not slower says nothing about the rate (noise, or a round trip that changed
    inside the window): the rate stays ``prior_bps``. Never infinite: one window of noisy rounds must
    not make the device send megabytes down a slow link."""
    if not samples:
        return prior_rtt_s, prior_bps
    w = sum(weights)
    mean_b = sum(wi * b for wi, (b, _) in zip(weights, samples)) / w
    mean_t = sum(wi * t for wi, (_, t) in zip(weights, samples)) / w
    bits = [b for b, _ in samples]
    if max(bits) < small_bits:
        return max(0.0, mean_t - mean_b / prior_bps), prior_bps
    if min(bits) * min_spread <= max(bits):
        var = sum(wi * (b - mean_b) ** 2 for wi, (b, _) in zip(weights, samples))
        cov = sum(wi * (b - mean_b) * (t - mean_t) for wi, (b, t) in zip(weights, samples))
        if cov <= 0:
            return max(0.0, mean_t - mean_b / prior_bps), prior_bps
        slope = cov / var
        rtt = mean_t - slope * mean_b
        if rtt >= 0:
            return rtt, 1.0 / slope
        return 0.0, mean_b / mean_t  # all of the time is serialization
    rtt = max(0.0, min(prior_rtt_s, mean_t))
    excess = mean_t - rtt
    return rtt, (mean_b / excess if excess > 0 else prior_bps)


def fit_verify(samples: list[tuple[int, float]], prior_slope: float, prior_weight: float,
               prior_base_s: float) -> tuple[float, float]:
    """(seconds of a one-token forward, seconds per further token) from the edge's recent forwards'
    (tokens, seconds): least squares of seconds on tokens - 1, with ``prior_weight`` pseudo-forwards'
    worth of spread behind ``prior_slope`` (relative to a one-token forward), so forwards all of one
    size still give a slope. Without samples: ``prior_base_s`` and its prior slope."""
    if not samples:
        return prior_base_s, prior_base_s * prior_slope
    n = [float(t) - 1.0 for t, _ in samples]
    s = [x for _, x in samples]
    mean_n, mean_s = sum(n) / len(n), sum(s) / len(s)
    var = sum((x - mean_n) ** 2 for x in n)
    base_guess = mean_s / (1 + prior_slope * mean_n)
    cov = sum((a - mean_n) * (b - mean_s) for a, b in zip(n, s))
    slope = max(0.0, (cov + prior_weight * prior_slope * base_guess) / (var + prior_weight))
    return max(1e-4, mean_s - slope * mean_n), slope
