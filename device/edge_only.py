"""Edge-only rounds (mode none): no draft; the edge generates the round's tokens from the target alone
and streams each in its own Verdict, which the device commits as it arrives.

Each token at sequence index t is the target's race with the noise of position t
(verification.token_noise), the token a gumbel round emits there too, so the tokens do not depend on
how rounds are cut (nor on which of the two modes cut them): a round broken after k tokens is retried
as a round asking for the rest.
"""
from __future__ import annotations

import bisect
import math
import threading
import time
from collections.abc import Iterable
from dataclasses import replace

from specdec.common.protocol import Verdict
from specdec.device.drafting import RoundHost
from specdec.device.link_fit import LinkConfig
from specdec.device.rounds import RoundDraft, RoundPlan


# Tokens of slack when the next round's request goes out ahead: the round trip and the token interval
# it is sized from are estimates, and a request a token early costs nothing while one late leaves
# the edge idle until it arrives.
SEND_AHEAD_SLACK = 2
# Tokens fed to the drafter at once while an edge-only round streams: a forward over a few tokens costs
# about one over a single token, and the tokens arrive one at a time.
CATCH_UP_MIN = 8
# A gap under this share of a stream's pace, right after an outage, is a token the edge made while the
# link was down (it arrives in the burst when the link is back): a share, whatever the edge's pace.
BURST_SHARE = 0.5


def draft(session: RoundHost, plan: RoundPlan, remaining: int) -> RoundDraft:
    """An empty round asking the edge for up to ``edge_tokens`` tokens (0 = all ``remaining``)."""
    if session.ahead is not None:
        session.drop_drafted()  # a chain drafted ahead does not follow an edge-only round
    return _round(session, plan, remaining, len(session.tokens), sent_ahead=False)


def draft_after(session: RoundHost, rd: RoundDraft, plan: RoundPlan, remaining: int) -> RoundDraft:
    """The edge-only round after ``rd``, sent while ``rd`` still streams: it starts where ``rd`` ends
    if ``rd`` streams all its tokens (else it is void at the edge, or dropped by a retry of ``rd``)."""
    return _round(session, plan, remaining, rd.start + rd.settings.edge_tokens, sent_ahead=True)


def _round(session: RoundHost, plan: RoundPlan, remaining: int, start: int, sent_ahead: bool) -> RoundDraft:
    s = plan.settings
    s = replace(s, edge_tokens=asked(s.edge_tokens, remaining, plan.edge_tail))  # the edge must know when to stop
    plan = replace(plan, settings=s)
    # the shadow at T > 0 reads each token's p (catch_up); at T = 0 greedy agreement needs none
    token_probs = bool((plan.choice or {}).get("shadow")) and session.drafting.model.temperature > 0
    block = replace(session.block((), s), sent_ahead=sent_ahead, token_probs=token_probs)
    return RoundDraft(block=block, plan=plan, q_rows=[], theoretical_bits=0, support_sizes=[],
                      draft_seconds=0.0, encode_seconds=0.0, start=start, sent_ahead=sent_ahead)


def asked(edge_tokens: int, remaining: int, tail: int) -> int:
    """Tokens an edge-only round asks for: ``edge_tokens`` (0: all), within the ``remaining`` ones, and
    all of them where it would leave fewer than ``tail``."""
    n = min(edge_tokens or remaining, remaining)
    return remaining if remaining - n < tail else n


class Arrivals:
    """A round's streamed tokens' arrival times, their gaps kept sorted: the engine asks for the interval
    after every token (edge_only.send_ahead_lead), and sorting the round's gaps each time grew with a
    long round (a mode-none round of all the session's tokens) on the event loop."""

    def __init__(self, times: Iterable[float] = ()):
        self.first: float | None = None
        self.last: float | None = None
        self.count = 0
        self.gaps: list[float] = []  # ascending
        self.order: list[float] = []  # as they came (a burst follows its outage)
        self._stall: tuple[int, float] | None = None  # (count, stall) of the last outage's reckoning
        for t in times:
            self.add(t)

    def add(self, t: float) -> None:
        if self.last is None:
            self.first = t
        else:
            bisect.insort(self.gaps, t - self.last)
            self.order.append(t - self.last)
        self.last, self.count = t, self.count + 1

    def stall(self, cfg: LinkConfig = LinkConfig()) -> float:
        """Seconds the link held the stream up: what its outages cost the round beyond the stream's pace.
        An outage is a gap beyond the round's median gap by link_fit's rule for a round met by one
        (``stall_rel`` times it and ``stall_abs_s``); the edge goes on generating through it, and the
        tokens it made meanwhile arrive in a burst when the link is back, which makes up part of it
        (:func:`outage_cost`). An outage says nothing about edge-only (the link is down for either arm),
        and one met by an 8-token round (2.5 s) once priced edge-only at 12 tok/s where it streamed at
        17, and the next session drafted at 0.64x its speed (held-out ucc LTE, 80 ms). Its burst
        counted as streamed, a 2 s outage followed by 35 tokens arriving at once priced the round at
        120 tok/s, and edge-only's rate at 20.7 tok/s where it streamed at 18."""
        if not self.gaps:
            return 0.0
        usual = _median(self.gaps)
        beyond = max(cfg.stall_rel * usual, cfg.stall_abs_s)
        if self.gaps[-1] - usual <= beyond:  # no outage (the common case: O(1) per token)
            return 0.0
        if self._stall is None or self._stall[0] != self.count:
            self._stall = (self.count, outage_cost(self.order, [g - usual > beyond for g in self.order]))
        return self._stall[1]

    def interval(self) -> float:
        """Mean seconds between arrivals (0: fewer than two): how edge-only streams, the edge's forward,
        its sampling, the messages and the downlink all in; the link's stalls (:meth:`stall`) left out."""
        return (self.last - self.first - self.stall()) / (self.count - 1) if self.count >= 2 else 0.0


def outage_cost(gaps: list[float], outage: list[bool]) -> float:
    """Seconds a stream's outages cost beyond its pace, given its ``gaps`` in arrival order and which
    are outages. The pace is the median of the other gaps less each outage's burst: the gaps right
    after it under ``BURST_SHARE`` of the pace before the first outage (tokens the edge made while
    the link was down, arriving at once). Each outage costs its gap less the pace; each burst gap
    makes up the pace less itself (those tokens were made in the outage's time); at least 0 in all."""
    first = outage.index(True)
    if first:
        paced_then = _median(sorted(gaps[:first]))
    else:  # an outage at the stream's start leaves no pace before it: the upper quartile of the rest
        # (a burst shorter than three quarters of them leaves it at the pace)
        rest = sorted(g for g, o in zip(gaps, outage) if not o)
        paced_then = rest[3 * len(rest) // 4] if rest else 0.0
    paced, burst, in_burst = [], [], False
    for g, o in zip(gaps, outage):
        if o:
            in_burst = True
        elif in_burst and g < BURST_SHARE * paced_then:
            burst.append(g)
        else:
            in_burst = False
            paced.append(g)
    pace = _median(sorted(paced)) if paced else paced_then
    lost = sum(g - pace for g, o in zip(gaps, outage) if o) - sum(pace - g for g in burst)
    return max(0.0, lost)


def _median(ascending: list[float]) -> float:
    return ascending[len(ascending) // 2] if ascending else 0.0


def send_ahead_lead(rtt_s: float, interval_s: float) -> int:
    """How many tokens before a round's last one the next round's request goes out: its trip to the
    edge must end before the edge sends that last token, and tokens leave the edge ``interval_s``
    apart (the device sees them at that interval, a one-way trip later): ceil(rtt / interval)
    tokens, plus SEND_AHEAD_SLACK."""
    if interval_s <= 0:
        return SEND_AHEAD_SLACK
    return math.ceil(max(0.0, rtt_s) / interval_s) + SEND_AHEAD_SLACK


def is_void(rd: RoundDraft, verdict: Verdict) -> bool:
    """The edge's answer to a round sent ahead after the previous round ended at an end-of-sequence
    token: no token at all."""
    return (rd.sent_ahead and not rd.received and verdict.round_id == rd.block.round_id
            and verdict.next_token is None and not verdict.num_accepted and not verdict.more)


def take_token(rd: RoundDraft, verdict: Verdict, verified: int) -> int:
    """One streamed token of ``rd``, after ``verified`` tokens: the session appends it (the draft cache
    catches up in the next drafted round, or meanwhile: :func:`catch_up`)."""
    if verdict.round_id != rd.block.round_id or verdict.next_token is None or verdict.num_accepted:
        raise ValueError(f"verdict does not belong to edge-only round {rd.block.round_id}")
    if verified != rd.start + rd.received:
        raise ValueError(f"edge-only round {rd.block.round_id} was sent ahead of a round that ended early")
    if rd.settings.edge_tokens and rd.received >= rd.settings.edge_tokens:
        raise ValueError(f"edge-only round {rd.block.round_id} streamed more than its {rd.settings.edge_tokens} tokens")
    rd.received += 1
    return int(verdict.next_token)


def catch_up(session: RoundHost, stop: threading.Event, arrived: threading.Event,
             shadow: RoundDraft | None = None) -> None:
    """In a worker thread during an edge-only round: feed the drafter the verified tokens it has not
    seen, CATCH_UP_MIN or more at a time (all but the last: the next forward needs an input), so the
    next drafted round need not. With ``shadow`` (the round), record in its ``shadow`` for each token fed
    whether the drafter's greedy choice after it was the token that followed: at T = 0, whether a draft
    there would have been accepted (mode auto's shadow acceptance: the text's acceptance measured while
    the edge streams it, at the cost of the catch-up's forwards, which its ``shadow_s`` and
    ``shadow_fed`` count: auto weighs that cost). Deterministic: no random number is drawn."""
    model = session.drafting.model
    while not stop.is_set():
        tokens = list(session.tokens)  # (the event loop appends as tokens arrive)
        target = len(tokens) - 1
        if target - model.cache_len < CATCH_UP_MIN:
            arrived.wait()
            arrived.clear()
        elif shadow is None:
            model.feed(tokens[:target])
        else:
            fed, t0 = target - model.cache_len, time.perf_counter()
            values = (model.feed_agreement(tokens, target) if model.temperature == 0
                      else shadow_values(model.feed_token_probs(tokens, target), session.drafting.edge_logp))
            shadow.shadow_s += time.perf_counter() - t0
            shadow.shadow_fed += fed
            shadow.shadow.extend(values)


def shadow_values(qs: list[tuple[int, float]], logp: dict[int, float]) -> list[float]:
    """At T > 0, each streamed token's :func:`shadow_acceptance` from the drafter's q of it (``qs``:
    (sequence index, q(x))) and the edge's log p of it (``logp``, by sequence index: the tokens that
    came with one; each read once, then dropped); a token without one (the edge generated it ahead,
    or an older edge) is left out."""
    out = []
    for index, q in qs:
        lp = logp.pop(index, None)
        if lp is not None:
            out.append(shadow_acceptance(q, lp))
    return out


def shadow_acceptance(q: float, logp: float) -> float:
    """min(1, q(x) / p(x)) for a token x the target drew from p (its log-probability ``logp``): an
    unbiased estimate of the acceptance a draft from q would have had at that position, since
    E_{x~p} min(1, q(x)/p(x)) = sum_x min(p(x), q(x)) = 1 - TV(p, q) (Leviathan et al. 2023,
    Corollary 3.6: the expected acceptance of speculative sampling). At T = 0 the shadow counts
    greedy agreement instead."""
    return min(1.0, q / math.exp(logp)) if logp > -math.inf else 1.0


def time_drafter(session: RoundHost, stop: threading.Event, arrived: threading.Event,
                 forwards: int) -> tuple[float, ...]:
    """In a worker thread during an edge-only round: the seconds of ``forwards`` forwards of the drafter
    that each feed it one verified token it has not seen, as a drafted round's forwards do, from where
    its cache stands (the prompt's first tokens in a session it never drafted in). Not after reading the
    whole context first: that is a prefill whose CPU, on a host the edge shares, slows the very tokens
    the round streams; a drafted round reads it when one runs. The price: forwards at a shorter context
    than a drafted round's read a little fast (the default drafter: 13.9 ms after 3 tokens, 15.2 after
    150, 16.7 after 300; docs/benchmarks.md), well inside the 1.4x a drafter step needs. Where the safety
    net does not explore drafting, this is how it learns the drafter's cost still. Deterministic: no
    random number is drawn."""
    model = session.drafting.model
    times: list[float] = []
    while len(times) < forwards and not stop.is_set():
        if len(session.tokens) - 1 > model.cache_len:
            t0 = time.perf_counter()
            model.feed(session.tokens[:model.cache_len + 1])
            times.append(time.perf_counter() - t0)
        else:
            arrived.wait()
            arrived.clear()
    return tuple(times)


def retry_plan(rd: RoundDraft) -> RoundPlan | None:
    """The plan that finishes ``rd`` after a broken stream: the same settings for the tokens it has
    not received yet (None if it had them all)."""
    rest = rd.settings.edge_tokens - rd.received
    if rest <= 0:
        return None
    return replace(rd.plan, settings=replace(rd.settings, edge_tokens=rest), retry=True)
