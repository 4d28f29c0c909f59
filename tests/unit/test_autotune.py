"""mode auto: the pure choice (device/autotune.py) and the estimates behind it (device/auto.py)."""
from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch

from specdec.device import autotune as A
from specdec.device import tracker_state as TS
from specdec.device import edge_only
from specdec.common.modes import Mode
from specdec.common.protocol import Hello, Welcome
from specdec.common.settings import DraftSettings, resolve, validate
from specdec.common.stats import RoundRecord
from specdec.common.verification import dssd_fallback_bytes
from specdec.device.link_fit import LinkConfig, LinkFit
from specdec.device.auto import (AutoConfig, AutoDecision, GumbelAcceptance,
                                 AutoPolicy, EstimateConfig, LinkTracker, SessionAcceptance, _Stepped)
from specdec.device.q_measure import OBSERVE_Q_EVERY
from specdec.device.rounds import RoundEvent, RoundPlan

TSLT_256 = (Mode.TSLT, 256)
BYTES = {(Mode.TSLT, 16): 80.0, (Mode.TSLT, 64): 320.0, TSLT_256: 1280.0, (Mode.TSLT, 1024): 5120.0,
         (Mode.KSQS, 64): 90.0, (Mode.DENSE, 0): 98304.0}
SIGMA = {(Mode.TSLT, 16): 0.12, (Mode.TSLT, 64): 0.05, TSLT_256: 0.02, (Mode.TSLT, 1024): 0.005,
         (Mode.KSQS, 64): 0.07}


def estimates(**kw) -> A.Estimates:
    base = dict(rtt_s=0.0, uplink_bps=100e6, downlink_bps=100e6, draft_s=0.01, verify_base_s=0.05,
                verify_per_token_s=0.008, alpha_base=0.9, sigma=SIGMA, packet_bytes=BYTES, guess_rate=0.7,
                dssd_fallback_rate=0.05, dssd_fallback_bytes=8 * 49152, edge_chunk=16)
    return A.Estimates(**{**base, **kw})


CLOCK = [0.0]  # session seconds: each round moves it on by its elapsed time (the safety net reads it)


def event(r: RoundRecord, s: DraftSettings, elapsed_s: float = 0.0) -> RoundEvent:
    """A committed round as the session hands it to the policy."""
    CLOCK[0] += elapsed_s
    return RoundEvent(record=r, plan=RoundPlan(s), new_tokens=(), q_stats=(), guess=None, elapsed_s=elapsed_s,
                      edge_hint=None, t=CLOCK[0])


def observe_q(t: LinkTracker, q, q_hat, s: DraftSettings, temperature: float) -> None:
    """One encoded q measured while drafting, and learned when its round commits."""
    stats = t.measure_q(q, q_hat, s, temperature)
    if stats is not None:
        t.add_q_stats(stats)


CANDIDATES = A.candidate_grid((16, 64, 256, 1024), (1, 2, 3, 4, 6, 8, 12, 16), (64,))
# the codecs that send q (DSSD sends 12 bytes a token whatever the link, and drafts ahead like them)
SENDING_Q = A.candidate_grid((16, 64, 256, 1024), (1, 2, 3, 4, 6, 8, 12, 16), (64,), dssd=False, gumbel=False)


def test_edge_only_round_is_its_tokens_over_one_round_trip_and_their_forwards() -> None:
    e = estimates(rtt_s=0.1, edge_chunk=10, downlink_bps=math.inf)
    p = A.predict(A.Candidate(Mode.NONE), e, draft_ahead=False)
    assert p.tokens == 10 and p.seconds == pytest.approx(0.1 + 8 * A.PROTO_BYTES_PER_ROUND / 100e6 + 10 * 0.05)
    # sent ahead of the last one's end, a round in steady state waits no round trip
    ahead = A.predict(A.Candidate(Mode.NONE), e)
    assert ahead.tokens == 10 and ahead.seconds == pytest.approx(10 * 0.05)
    assert A.first_round(A.Candidate(Mode.NONE), e) == pytest.approx(p.seconds)
    assert A.first_round(A.Candidate(Mode.NONE), e, sent_ahead=True) == pytest.approx(ahead.seconds)


def test_edge_only_is_priced_at_how_its_rounds_streamed_once_measured() -> None:
    """The fit of the edge's forwards says a one-token forward takes 0.14 s (extrapolated from drafted
    rounds' forwards); edge-only rounds streamed a token every 0.07 s: they price edge-only."""
    fit = estimates(verify_base_s=0.14, downlink_bps=math.inf, edge_chunk=10)
    assert A.predict(A.Candidate(Mode.NONE), fit).seconds == pytest.approx(10 * 0.14)
    measured = replace(fit, edge_token_s=0.07)
    assert A.predict(A.Candidate(Mode.NONE), measured).seconds == pytest.approx(10 * 0.07)
    assert A.first_round(A.Candidate(Mode.NONE), measured) == pytest.approx(10 * 0.07 + 8 * A.PROTO_BYTES_PER_ROUND / 100e6)


def test_a_streamed_rounds_token_interval_is_its_arrivals_mean_spacing() -> None:
    assert edge_only.Arrivals([1.0, 1.1, 1.3, 1.6]).interval() == pytest.approx(0.2)
    assert edge_only.Arrivals([1.0]).interval() == 0.0 and edge_only.Arrivals([]).interval() == 0.0
    assert edge_only.Arrivals([1.0, 1.1, 1.3, 1.6]).stall() == 0.0


def test_an_outage_in_a_stream_is_left_out_of_its_interval() -> None:
    """Eight tokens 60 ms apart, but for a 2 s outage after the fourth (the tokens the edge generated
    meanwhile arrive in a burst): the interval is the stream's pace, and the stall the outage less the
    pace and less what the burst made up. Control: the burst counted as streamed (the stall the whole
    outage beyond one gap) puts the interval a third below the pace. Gaps a cellular link scatters
    (0.1-0.3 s among 60 ms ones) are no stall."""
    steady = [0.06 * i for i in range(4)]
    arrived = steady + [2.18 + 0.001 * i for i in range(4)]
    made_up = 3 * (0.06 - 0.001)
    assert edge_only.Arrivals(arrived).stall() == pytest.approx(2.0 - 0.06 - made_up)
    assert edge_only.Arrivals(arrived).interval() == pytest.approx(0.06)
    assert (arrived[-1] - arrived[0] - (2.0 - 0.06)) / 7 < 0.7 * 0.06  # the control
    scattered = [0.0, 0.06, 0.3, 0.36, 0.42, 0.6, 0.66]
    assert edge_only.Arrivals(scattered).stall() == 0.0


def test_an_outage_whose_burst_is_most_of_the_round_leaves_the_pace() -> None:
    """A 42-token round: 6 tokens 55 ms apart, a 2 s outage, then the 35 the edge made meanwhile at
    once and one more at the pace (the held-out ucc trace at 80 ms): the edge lost ~nothing (it went on
    generating), so the interval is within 5 % of the pace, where counting the burst as streamed made
    it ~8x faster; the median gap, a burst gap here, does not set the pace."""
    arrived = [0.055 * i for i in range(7)]
    arrived += [arrived[-1] + 2.0 + 0.0005 * i for i in range(35)]
    arrived.append(arrived[-1] + 0.055)
    a = edge_only.Arrivals(arrived)
    assert a.gaps[len(a.gaps) // 2] < 0.01  # the median is a burst gap
    assert a.interval() == pytest.approx(0.055, rel=0.05)
    assert a.stall() < 0.1


def test_an_outage_at_a_rounds_end_costs_it_all_beyond_the_pace() -> None:
    """The round's tokens all made before the link went down but the last (no burst to make up for
    it), and one met at a stream's first gap (no pace before it: the rest's set it)."""
    arrived = [0.05 * i for i in range(20)] + [0.95 + 2.0]
    assert edge_only.Arrivals(arrived).stall() == pytest.approx(2.0 - 0.05)
    first = [0.0, 1.5] + [1.5 + 0.0005 * i for i in range(1, 4)] + [1.5015 + 0.05 * i for i in range(1, 12)]
    a = edge_only.Arrivals(first)
    assert a.stall() == pytest.approx(1.5 - 0.05 - 3 * (0.05 - 0.0005), abs=1e-6)
    assert a.interval() == pytest.approx(0.05)


def test_an_edge_only_round_an_outage_held_up_prices_edge_only_as_it_streams() -> None:
    """Such a round (8 tokens in 2.5 s, 2 s of them the outage) leaves the model's price of edge-only
    and the net's rate of it where a round without the outage leaves them; the stall is what it
    reports. Control: counted in, it pulls both down by over 10 %."""
    def after(seconds_s: float, stall_s: float, interval_s: float) -> tuple[float, float]:
        t = LinkTracker()
        policy = AutoPolicy(t, HELLO, 49152)
        s = DraftSettings(mode=Mode.NONE, edge_tokens=32)
        for i, (n, seconds, interval, stall) in enumerate([(32, 2.0, 0.06, 0.0)] * 4 + [(8, seconds_s, interval_s, stall_s)]):
            r = RoundRecord(mode="none", drafted_tokens=0, positions=0, accepted=0, generated=n, uplink_bytes=30,
                            downlink_bytes=40 * n, phases={"network": 0.08, "queue": 0.0, "decode": 0.0,
                                                           "verify": 0.05 * n},
                            first_reply_s=0.08, token_interval_s=interval, stream_stall_s=stall)
            policy.observe(replace(event(r, s, seconds), sent_ahead=i > 0))
        return t.edge_token_s.value, policy.net.edge.tokens / policy.net.edge.seconds
    clean, stalled, counted = after(0.5, 0.0, 0.06), after(2.5, 2.0, 0.06), after(2.5, 0.0, 2.5 / 7)
    assert stalled[0] == pytest.approx(clean[0])
    assert stalled[1] == pytest.approx(clean[1], rel=0.02)
    assert counted[0] > 1.1 * clean[0] and counted[1] < 0.9 * clean[1]


def test_edge_only_is_not_priced_faster_than_the_edge_made_its_tokens() -> None:
    """A round whose tokens the edge made ahead (through an outage) arrives at once (10 ms apart) where
    the edge took 50 ms on each: the edge's time per token is what its pace is learned from. Control:
    a round as fast as it streams (60 ms apart) is learned as it streamed."""
    def learned(interval_s: float) -> float:
        t = LinkTracker()
        r = RoundRecord(mode="none", drafted_tokens=0, positions=0, accepted=0, generated=32, uplink_bytes=30,
                        downlink_bytes=40 * 32, phases={"network": 0.08, "queue": 0.0, "decode": 0.0,
                                                        "verify": 0.05 * 32},
                        first_reply_s=0.08, token_interval_s=interval_s)
        t.observe_round(r, DraftSettings(mode=Mode.NONE, edge_tokens=32), 0.0, 49152, sent_ahead=True)
        return t.edge_token_s.value
    assert learned(0.01) == pytest.approx(0.05)
    assert learned(0.06) == pytest.approx(0.06)


def test_the_next_edge_only_request_leads_by_a_round_trip_of_tokens() -> None:
    assert edge_only.send_ahead_lead(0.08, 0.09) == 1 + edge_only.SEND_AHEAD_SLACK
    assert edge_only.send_ahead_lead(0.30, 0.09) == 4 + edge_only.SEND_AHEAD_SLACK  # a slow link: earlier
    assert edge_only.send_ahead_lead(0.0, 0.09) == edge_only.SEND_AHEAD_SLACK
    assert edge_only.send_ahead_lead(0.1, 0.0) == edge_only.SEND_AHEAD_SLACK  # no interval measured


def test_acceptance_of_a_support_is_the_exact_q_acceptance_minus_its_dropped_mass() -> None:
    """TSLT eq. (22) used as the estimate: alpha_K = alpha - sigma_K; dense and DSSD send q exactly."""
    e = estimates()
    assert e.alpha(A.Candidate(Mode.TSLT, 4, 16)) == pytest.approx(0.78)
    assert e.alpha(A.Candidate(Mode.TSLT, 4, 1024)) == pytest.approx(0.895)
    assert e.alpha(A.Candidate(Mode.DSSD, 4)) == e.alpha(A.Candidate(Mode.DENSE, 4)) == pytest.approx(0.9)


def test_chain_round_without_drafting_ahead_is_eq5_with_the_link() -> None:
    e = estimates(rtt_s=0.02, uplink_bps=1e6, downlink_bps=math.inf)
    c = A.Candidate(Mode.TSLT, 4, 256)
    p = A.predict(c, e, draft_ahead=False)
    up = 8 * (A.PROTO_BYTES_PER_ROUND + 4 * (1280 + A.PROTO_BYTES_PER_TOKEN)) / 1e6
    assert p.seconds == pytest.approx(4 * 0.01 + 0.02 + up + 0.05 + 4 * 0.008)
    assert p.tokens == pytest.approx((1 - 0.88 ** 5) / (1 - 0.88))


def test_drafting_ahead_at_its_best_case_keeps_every_round_at_temperature_0_only() -> None:
    """Every draft accepted: at T = 0 each round drafted ahead is kept (the bonus is one more argmax
    agreement), so the round takes its window or its L + 1 forwards, whichever is longer; at T > 0 the
    bonus is sampled from p and the guess stays as measured. Control: the measured guess (0.7) at
    T = 0 prices the round ~15 % longer."""
    greedy, sampled = estimates(greedy=True, draft_s=0.05, rtt_s=0.1), estimates(draft_s=0.05, rtt_s=0.1)
    c = A.Candidate(Mode.TSLT, 4, 16)
    window = A.predict(c, replace(A.accepting_all(greedy), draft_s=0.0)).seconds
    assert A.predict(c, A.accepting_all(greedy)).seconds == pytest.approx(max(window, 5 * 0.05))
    measured = replace(A.accepting_all(greedy), guess_rate=0.7)
    assert A.predict(c, measured).seconds > 1.1 * A.predict(c, A.accepting_all(greedy)).seconds
    assert A.accepting_all(sampled).guess_rate == 0.7
    assert A.predict(c, A.accepting_all(sampled)).seconds == pytest.approx(A.predict(c, measured).seconds)


def test_longer_round_trips_choose_longer_drafts() -> None:
    """A round trip is paid once per round: the slower it is, the more tokens a round should carry."""
    lens = []
    for rtt in (0.0, 0.02, 0.06, 0.15):
        pick, _ = A.best(CANDIDATES, estimates(rtt_s=rtt, alpha_base=0.95))
        assert pick.candidate.mode is not Mode.NONE
        lens.append(pick.candidate.draft_len)
    assert lens == sorted(lens) and lens[-1] > lens[0], lens


def test_slow_uplinks_choose_smaller_packets() -> None:
    fast, _ = A.best(SENDING_Q, estimates(uplink_bps=100e6))
    slow, _ = A.best(SENDING_Q, estimates(uplink_bps=0.5e6))
    assert A.uplink_bytes(slow.candidate, estimates()) < A.uplink_bytes(fast.candidate, estimates()) / 4


def test_dssd_wins_where_its_fallback_is_rare_and_loses_where_it_is_not() -> None:
    """DSSD drafts ahead like the other chains and keeps the exact q's acceptance in a few bytes; what
    it pays is the whole p_j down the link when the m samples all fail."""
    rare = estimates(uplink_bps=2e6, downlink_bps=8e6, dssd_fallback_rate=0.02)
    assert A.best(CANDIDATES, rare)[0].candidate.mode is Mode.DSSD
    common = replace(rare, dssd_fallback_rate=0.9)
    assert A.best(CANDIDATES, common)[0].candidate.mode is not Mode.DSSD


def test_speculation_stops_when_it_loses() -> None:
    """A drafter slower than the target's forward with poor acceptance: the edge alone is faster."""
    pick, ranking = A.best(CANDIDATES, estimates(draft_s=0.08, alpha_base=0.3, rtt_s=0.05))
    assert pick.candidate.mode is Mode.NONE, [p.candidate.key for p in ranking[:3]]


def test_hysteresis_keeps_the_current_choice_unless_another_is_clearly_better() -> None:
    e = estimates()
    ranking = A.rank(CANDIDATES, e)
    second = ranking[1]
    assert second.rate > ranking[0].rate / 1.05  # close enough to be kept
    kept, _ = A.best(CANDIDATES, e, current=second.candidate, hysteresis=0.05)
    assert kept.candidate == second.candidate
    switched, _ = A.best(CANDIDATES, e, current=ranking[-1].candidate, hysteresis=0.05)
    assert switched.candidate == ranking[0].candidate


def test_drafting_ahead_hides_drafting_behind_the_round_trip() -> None:
    e = estimates(rtt_s=0.1, alpha_base=1.0, sigma={}, guess_rate=1.0)
    c = A.Candidate(Mode.TSLT, 4, 256)
    ahead, after = A.predict(c, e, draft_ahead=True), A.predict(c, e, draft_ahead=False)
    assert ahead.seconds == pytest.approx(after.seconds - 4 * 0.01)  # every step fits in the window
    dssd = A.Candidate(Mode.DSSD, 4)
    assert A.predict(dssd, e, True).seconds == pytest.approx(A.predict(dssd, e, False).seconds - 4 * 0.01)


def test_a_round_takes_the_drafting_not_done_ahead() -> None:
    """The time a round should take from the last verdict to its own (what teaches the time scale):
    its steps drafted while the last round was verified are not drafted again."""
    e = estimates(rtt_s=0.06)
    c = A.Candidate(Mode.TSLT, 6, 256)
    fresh = A.first_round(c, e, 0)
    assert A.first_round(c, e, 4) == pytest.approx(fresh - 4 * 0.01)
    assert A.first_round(c, e, 9) == pytest.approx(fresh - 6 * 0.01)  # at most its L
    assert A.first_round(c, e, 4, draft_ahead=False) == fresh
    edge = A.Candidate(Mode.NONE)  # no draft: what counts is whether its request was sent ahead
    assert A.first_round(edge, e, 4) == A.model_round(edge, e, draft_ahead=False).seconds
    assert A.first_round(edge, e, 4, sent_ahead=True) == A.model_round(edge, e).seconds


def test_the_uplink_is_probed_only_where_a_fast_link_would_change_the_rate() -> None:
    """T = 1 packets differ 64x between K = 16 and K = 1024: on a link believed slow a probe may pay.
    At T = 0 every packet is a few bytes: no goodput changes the choice by more than noise."""
    slow = estimates(uplink_bps=0.3e6)
    pick, _ = A.best(SENDING_Q, slow)
    assert A.probe_pays(SENDING_Q, slow, pick.candidate, 1e9, 0.1)
    greedy = estimates(uplink_bps=0.3e6, sigma={}, packet_bytes={**{key: 3.0 for key in BYTES}, (Mode.DENSE, 0): 98304.0})
    pick, _ = A.best(SENDING_Q, greedy)
    assert not A.probe_pays(SENDING_Q, greedy, pick.candidate, 1e9, 0.1)
    assert not A.probe_pays(SENDING_Q, slow, A.best(SENDING_Q, replace(slow, uplink_bps=1e9))[0].candidate, 1e9, 0.1)


def test_edge_chunk_bounds_the_share_of_a_round_boundary() -> None:
    """A boundary is a round trip and the forward missed meanwhile."""
    assert A.edge_chunk(0.15, 0.05, 0.1, 8, 64) == 36  # 36 x 50 ms >= 9 x (150 + 50) ms
    assert A.edge_chunk(0.0, 0.05, 0.05, 8, 64) == 19  # loopback: 19 tokens for 1 missed forward
    assert A.edge_chunk(0.0, 0.05, 0.5, 8, 64) == 8
    assert A.edge_chunk(5.0, 0.05, 0.1, 8, 64) == 64


# -- the estimates ---------------------------------------------------------------------------------------

def record(mode=Mode.TSLT, drafted=4, accepted=4, up=2000, down=40, network=0.0, verify=0.05,
           draft=0.04, ahead=False) -> RoundRecord:
    return RoundRecord(mode=mode.value, drafted_tokens=drafted, positions=drafted, accepted=accepted,
                       generated=accepted + 1, uplink_bytes=up, downlink_bytes=down,
                       phases={"draft": draft, "encode": 0.0, "network": network, "queue": 0.0, "decode": 0.0,
                               "verify": verify}, drafted_ahead=ahead)


def link_network(rtt: float, rate: float, up: int, down: int = 40) -> float:
    return rtt + 8 * (up + down) / rate


SETTINGS = DraftSettings(mode=Mode.TSLT, top_k=256, draft_len=4)
HELLO = Hello(vocab_fingerprint="x", vocab_size=49152, temperature=1.0, draft=resolve({}, vocab_size=49152),
              seed=0, max_new_tokens=64)


def test_round_trip_and_goodput_are_recovered_from_round_records() -> None:
    t = LinkTracker()
    rtt, rate = 0.06, 2e6
    for up in (300, 5000, 300, 9000, 2500, 300, 7000):  # small rounds floor the RTT, large ones the rate
        t.observe_round(record(up=up, network=link_network(rtt, rate, up)), SETTINGS, 1.0, 49152)
    e = t.estimates(1.0, 49152)
    assert e.rtt_s == pytest.approx(rtt, rel=0.05)
    assert e.uplink_bps == pytest.approx(rate, rel=0.15)


def test_a_changed_link_shows_within_three_rounds() -> None:
    """100 Mbit/s 5 ms -> 1 Mbit/s 100 ms, with the rounds a controller would send (sizes vary)."""
    t = LinkTracker()
    sizes = (300, 5000, 2500, 300, 9000, 4000)
    for up in sizes * 2:
        t.observe_round(record(up=up, network=link_network(0.005, 100e6, up)), SETTINGS, 1.0, 49152)
    assert t.link.rtt_s() == pytest.approx(0.005, abs=0.002) and t.link.uplink_bps() > 30e6
    assert t.link.uplink_bps() <= 10e6 * 4 ** 12  # it grew from the prior at most 4x per round
    for up in sizes[:3]:
        t.observe_round(record(up=up, network=link_network(0.1, 1e6, up)), SETTINGS, 1.0, 49152)
    assert t.link.rtt_s() > 0.05 and t.link.uplink_bps() < 3e6, (t.link.rtt_s(), t.link.uplink_bps())
    for up in sizes:
        t.observe_round(record(up=up, network=link_network(0.1, 1e6, up)), SETTINGS, 1.0, 49152)
    assert t.link.rtt_s() == pytest.approx(0.1, rel=0.05) and t.link.uplink_bps() == pytest.approx(1e6, rel=0.05)


def test_one_round_faster_than_the_round_trip_estimate_resets_it_and_one_slow_round_does_not() -> None:
    """No round beats the round trip, while loss and queues make single rounds slow: 150 ms -> 0 ms
    shows after one round (it took three, each of L = 16 chosen for 150 ms), a lost segment is not
    taken for a change, and the downlink goodput measured before the change is dropped with it."""
    t = LinkTracker()
    for up in (600, 5000, 600, 9000, 2500, 600):
        t.observe_round(record(up=up, network=link_network(0.15, 10e6, up)), SETTINGS, 1.0, 49152)
    t.link.down.append((8 * 393216, 0.3))
    t.observe_round(record(up=600, network=0.15 + 0.2), SETTINGS, 1.0, 49152)  # one lost segment
    assert t.link.rtt_s() >= 0.15 and t.link.down and len(t.link.samples) == LinkConfig().window  # in the fit, not a change
    t.observe_round(record(up=600, network=link_network(0.002, 10e6, 600)), SETTINGS, 1.0, 49152)
    assert t.link.rtt_s() < 0.005 and not t.link.down, t.link.rtt_s()


def test_auto_dssd_rounds_send_enough_samples_to_spare_the_full_p() -> None:
    """A rejection ships the whole p_j when all m samples fail, each with probability ~alpha: auto's
    DSSD rounds ask for AutoConfig.dssd_samples (within the edge's default cap), and the fallback
    share the model charges shrinks with it."""
    from specdec.edge.verifier import EdgeLimits
    policy = AutoPolicy(LinkTracker(), HELLO, 49152)
    s = policy.settings_for(A.Candidate(Mode.DSSD, 8), 16)
    assert s.dssd_samples == AutoConfig().dssd_samples > DraftSettings().dssd_samples
    assert s.dssd_samples <= EdgeLimits().dssd_max_samples
    validate(s)
    assert policy.tracker.estimates(1.0, 49152).dssd_fallback_rate < 0.8 ** 8


def test_a_changed_link_is_probed_soon_when_only_small_rounds_are_sent() -> None:
    """Rounds below a segment cannot tell a longer round trip from a slower uplink: after the round
    trip changes the tracker asks for a goodput probe within LinkConfig.probe_after_change rounds, not
    probe_every."""
    t = LinkTracker()
    for _ in range(6):
        t.observe_round(record(up=600, network=link_network(0.02, 100e6, 600)), SETTINGS, 1.0, 49152)
    c = LinkConfig()
    assert t.link.rounds_since_rate == 6 < c.probe_every and not t.link.probe_due()
    for n in range(2 + c.probe_after_change):  # two rounds to see the change, then the wait
        t.observe_round(record(up=600, network=link_network(0.06, 100e6, 600)), SETTINGS, 1.0, 49152)
    assert t.link.probe_due()


def test_goodput_estimate_rises_gradually_and_falls_at_once() -> None:
    t = LinkTracker()
    for up in (300, 5000, 2500):
        t.observe_round(record(up=up, network=link_network(0.01, 1e9, up)), SETTINGS, 1.0, 49152)
    assert t.link.uplink_bps() <= 10e6 * 4 ** 3
    for up in (5000, 300, 9000):
        t.observe_round(record(up=up, network=link_network(0.01, 0.5e6, up)), SETTINGS, 1.0, 49152)
    assert t.link.uplink_bps() < 1e6


def test_link_fit_separates_round_trip_from_serialization() -> None:
    rounds = [(b, 0.06 + b / 2e6) for b in (2e3, 4e4, 8e4, 1e4)]
    rtt, rate = A.fit_link(rounds, [1.0] * 4, 0.0, 1e9, 9600.0)
    assert rtt == pytest.approx(0.06) and rate == pytest.approx(2e6)
    # one size only: the previous round trip gives the rate, and small rounds give the round trip
    assert A.fit_link([(4e4, 0.08)] * 3, [1.0] * 3, 0.06, 1e9, 9600.0) == pytest.approx((0.06, 2e6))
    assert A.fit_link([(2e3, 0.061)] * 3, [1.0] * 3, 0.0, 2e6, 9600.0) == pytest.approx((0.06, 2e6))
    # bigger rounds not slower: nothing learned about the rate (never "infinitely fast")
    assert A.fit_link([(2e4, 0.01), (8e4, 0.009)], [1.0, 1.0], 0.0, 1e6, 9600.0)[1] == 1e6


def _spell_fit() -> LinkFit:
    """A 40 ms link, then a bad spell: two rounds in a row at 0.4 s (a changed link, by the fit's rule)."""
    fit = LinkFit(LinkConfig())
    for network in [0.04] * 12 + [0.4, 0.41]:
        fit.add(network, 300, 40)
    return fit


def test_a_round_trip_a_bad_spell_inflated_relaxes_to_the_usual_one_while_unmeasured() -> None:
    """After the spell the fit says ~0.4 s; unmeasured, the round trip expected relaxes toward the
    usual 40 ms (half-way by ln 2 time constants) and a fresh 40 ms round is believed at once.
    Control: without time passing nothing relaxes, and a link that stays slow becomes the usual one."""
    fit = _spell_fit()
    spell, usual = fit.rtt_s(), fit.usual_rtt_s()
    assert spell > 0.35 and usual == pytest.approx(0.04, abs=1e-3)
    fit.elapse(fit.config.rtt_relax_s * math.log(2))
    assert fit.rtt_s() == pytest.approx(usual + (spell - usual) / 2, rel=1e-6)
    fit.elapse(10 * fit.config.rtt_relax_s)
    assert fit.rtt_s() == pytest.approx(usual, abs=1e-4)
    fit.add(0.04, 300, 40)
    assert fit.rtt_s() == pytest.approx(0.04, abs=1e-3)
    slow = _spell_fit()
    for _ in range(fit.config.usual_window):
        slow.add(0.4, 300, 40)
    slow.elapse(10 * fit.config.rtt_relax_s)
    assert slow.rtt_s() == pytest.approx(0.4, rel=0.05)


def test_a_round_trip_below_the_usual_one_is_not_pulled_up() -> None:
    fit = LinkFit(LinkConfig())
    for network in [0.2] * 12 + [0.04]:  # one far faster round: a faster link at once
        fit.add(network, 300, 40)
    fit.elapse(10.0)
    assert fit.rtt_s() == pytest.approx(0.04, abs=1e-3) and fit.usual_rtt_s() > 0.15


def test_edge_only_rounds_sent_ahead_relax_the_round_trip_and_one_not_sent_ahead_measures_it() -> None:
    """Rounds sent ahead take no sample: their seconds relax the spell's round trip (what a session
    started after them prices drafting at); one not sent ahead samples its first token's wait and
    relaxes only for the seconds it streamed after it."""
    t = LinkTracker()
    t.link = _spell_fit()
    spell, usual = t.estimates(0.0, 49152).rtt_s, t.link.usual_rtt_s()
    s = DraftSettings(mode=Mode.NONE, edge_tokens=32)
    r = RoundRecord(mode="none", drafted_tokens=0, positions=0, accepted=0, generated=32, uplink_bytes=30,
                    downlink_bytes=40 * 32, phases={"network": 0.4, "queue": 0.0, "decode": 0.0, "verify": 1.6},
                    first_reply_s=0.4, token_interval_s=0.05)
    t.observe_round(r, s, 0.0, 49152, sent_ahead=True, seconds=2.0)
    relaxed = t.estimates(0.0, 49152).rtt_s
    assert relaxed == pytest.approx(usual + (spell - usual) * math.exp(-2.0 / t.link.config.rtt_relax_s), rel=1e-6)
    t.observe_round(r, s, 0.0, 49152, sent_ahead=False, seconds=2.0)  # a 0.4 s wait, as the spell's
    assert t.link.rtt_s() == pytest.approx(usual + (t.link.fit[0] - usual) * math.exp(-1.6 / t.link.config.rtt_relax_s))
    assert t.link.fit[0] > 0.35


def test_verify_time_fit_recovers_base_and_slope() -> None:
    t = LinkTracker()
    for n in (2, 5, 9, 3, 13, 5):
        t.verify.add(n, 0.05 + 0.01 * (n - 1))
    base, slope = t.verify.fit()
    assert base == pytest.approx(0.05, rel=0.1) and slope == pytest.approx(0.01, rel=0.15)


def test_acceptance_estimate_adds_back_the_dropped_mass_of_the_packets_sent() -> None:
    """Rounds sent with a TSLT K whose dropped mass is 0.1 accept 7 of the 8 positions tested (the
    eighth rejected): the exact q would accept ~0.975, and a K dropping 0.02 is estimated at ~0.955."""
    t = LinkTracker()
    side = t.model(1.0)
    for _ in range(50):
        side.add_sigma(TSLT_256, 0.1)
        side.add_sigma((Mode.TSLT, 1024), 0.02)
    acc = t.session_acceptance(1.0)
    for _ in range(300):
        t.observe_round(record(drafted=10, accepted=7, up=300, network=0.01), SETTINGS, 1.0, 49152, acc)
    e = t.estimates(1.0, 49152, acc)
    assert e.alpha_base == pytest.approx(7 / 8 + 0.1, abs=0.005)
    assert e.alpha(A.Candidate(Mode.TSLT, 4, 1024)) == pytest.approx(7 / 8 + 0.1 - 0.02, abs=0.005)


def test_acceptance_is_estimated_per_depth() -> None:
    """Rounds of L = 8 accepted whole three times in four and rejected at the first draft otherwise:
    per tested position that is 24 of 25 (0.96), but depth 1 accepts 0.75 and every later depth 1.0.
    A round yields 1 + 0.75 x 8 = 7 tokens, and a round of L = 1 1.75; eq. (8) at 0.96 would say 7.6
    and 1.96."""
    t = LinkTracker()
    acc = t.session_acceptance(1.0)
    for i in range(200):
        accepted = 0 if i % 4 == 3 else 8
        t.observe_round(record(drafted=8, accepted=accepted, up=300, network=0.01), SETTINGS, 1.0, 49152, acc)
    e = replace(t.estimates(1.0, 49152, acc), sigma={})
    assert e.alpha_base == pytest.approx(24 / 25, abs=0.01)
    assert e.alpha_depth[0] == pytest.approx(0.75, abs=0.05)
    assert min(e.alpha_depth[1:8]) > 0.98 and e.alpha_depth[8] == pytest.approx(e.alpha_base)  # 9: never reached
    for L, tokens in ((8, 7.0), (1, 1.75)):
        c = A.Candidate(Mode.TSLT, L, 256)
        assert A.predict(c, e).tokens == pytest.approx(tokens, abs=0.3)
        assert A.predict(c, replace(e, alpha_depth=())).tokens > tokens + 0.15  # i.i.d. at the pooled rate
    # i.i.d. rounds give one rate at every depth
    t = LinkTracker()
    acc = t.session_acceptance(1.0)
    gen = torch.Generator().manual_seed(0)
    for _ in range(400):
        accepted = next((d for d in range(8) if torch.rand((), generator=gen) > 0.8), 8)
        t.observe_round(record(drafted=8, accepted=accepted, up=300, network=0.01), SETTINGS, 1.0, 49152, acc)
    assert all(abs(a - 0.8) < 0.1 for a in acc.alpha_depth()[:6])


def test_drafter_time_is_per_forward() -> None:
    """A round of 5 drafts that fed the last draft and the bonus one forward each took 6 forwards:
    0.09 s of drafting is 15 ms a forward (18 ms 'per token' would count the extra forward twice,
    once in the rate and once in the model's L + 1 steps of drafting ahead)."""
    t = LinkTracker()
    for _ in range(40):
        t.observe_round(replace(record(drafted=5, accepted=5, draft=0.09), draft_forwards=6), SETTINGS, 1.0, 49152)
    assert t.estimates(1.0, 49152).draft_s == pytest.approx(0.015)
    t = LinkTracker()
    for _ in range(40):  # rounds without a count (trees) fall back to one forward per draft
        t.observe_round(record(drafted=5, accepted=5, draft=0.09), SETTINGS, 1.0, 49152)
    assert t.estimates(1.0, 49152).draft_s == pytest.approx(0.018)


def test_the_drafters_time_follows_a_step_within_three_rounds_not_its_scatter() -> None:
    """A drafter that turns 2.7x slower (throttled, its cores taken): the estimate is the new level
    after three rounds (an EWMA alone: ~14 rounds); forwards scattering +-20 % around a level, or one
    or two slow ones among them, leave it an average."""
    def tracker(forward_s: list[float]) -> LinkTracker:
        t = LinkTracker()
        for x in forward_s:
            t.observe_round(replace(record(drafted=2, accepted=2, draft=2 * x), draft_forwards=2), SETTINGS, 1.0, 49152)
        return t
    warm = [0.03] * 20
    assert tracker(warm + [0.08] * 3).estimates(1.0, 49152).draft_s == pytest.approx(0.08)
    assert tracker(warm + [0.08] * 2).estimates(1.0, 49152).draft_s < 0.045
    assert tracker(warm + [0.01] * 3).estimates(1.0, 49152).draft_s == pytest.approx(0.01)  # faster too
    scatter = [0.03 * (1 + 0.2 * ((-1) ** i)) for i in range(30)] + [0.08, 0.08, 0.03, 0.08]
    assert tracker(warm + scatter).estimates(1.0, 49152).draft_s < 0.05  # an average (a jump: 0.08)


def test_each_timed_forward_samples_the_drafters_time() -> None:
    """Rounds that time their forwards step the estimate within one round of three forwards, even a
    round that catches the drafter up (the forward that reads the tokens it missed is not among them).
    A step of 1.4x or more counts as a changed drafter."""
    t = LinkTracker()
    for _ in range(20):
        t.observe_round(replace(record(drafted=3, accepted=3, draft=0.09), draft_forwards=3, forward_s=(0.03,) * 3),
                        SETTINGS, 1.0, 49152)
    assert t.estimates(1.0, 49152).draft_s == pytest.approx(0.03)
    slow = replace(record(drafted=3, accepted=3, draft=0.5), draft_forwards=4, forward_s=(0.08,) * 3)
    t.observe_round(slow, SETTINGS, 1.0, 49152, catching_up=True)
    assert t.estimates(1.0, 49152).draft_s == pytest.approx(0.08) and t.drafter_changes == 1


def test_an_edge_only_round_that_timed_the_drafter_samples_its_time() -> None:
    """The safety net times the drafter during an edge-only round where it does not explore drafting
    (safety_net.NetCall.retime): those forwards step the estimate as drafted rounds' do, so a drafter
    that got faster is found without drafting; an edge-only round without them leaves it."""
    t = LinkTracker()
    for _ in range(20):
        t.observe_round(replace(record(drafted=3, accepted=3, draft=0.3), draft_forwards=3, forward_s=(0.1,) * 3),
                        SETTINGS, 1.0, 49152)
    edge = DraftSettings(mode=Mode.NONE, edge_tokens=32)
    streamed = replace(record(mode=Mode.NONE, drafted=0, accepted=0, draft=0.0), generated=32)
    t.observe_round(streamed, edge, 1.0, 49152)
    assert t.estimates(1.0, 49152).draft_s == pytest.approx(0.1) and t.drafter_changes == 0
    t.observe_round(replace(streamed, forward_s=(0.04,) * 3), edge, 1.0, 49152)
    assert t.estimates(1.0, 49152).draft_s == pytest.approx(0.04) and t.drafter_changes == 1


def test_a_step_is_measured_from_the_level_its_run_left() -> None:
    """The step a run of samples makes is its mean over the level before its first sample, from the
    first level measured on (an estimate that starts empty, or is restored, included)."""
    fresh = _Stepped(None, 0.9)
    assert [fresh.add(x) for x in (0.01, 0.03, 0.03, 0.03)] == [None, None, None, pytest.approx(3.0)]
    warm = _Stepped(0.02, 0.9)
    steps = [warm.add(x) for x in (0.02, 0.021, 0.01, 0.01, 0.01)]
    assert steps[:4] == [None] * 4 and steps[4] == pytest.approx(0.01 / (0.9 * 0.02 + 0.1 * 0.021))


def test_a_session_follows_its_text_and_the_next_starts_from_the_long_run_rate() -> None:
    """Links run: one T = 1 text the drafter could not follow (rejected at the first draft round after
    round) took ~50 rounds to show in the estimate, and its tail then kept the next six sessions
    edge-only. Now ten such rounds show, and a new session starts near the device's long-run rate."""
    t = LinkTracker()
    for _ in range(3):  # three sessions of a text the drafter follows
        policy = AutoPolicy(t, HELLO, 49152)
        for _ in range(10):
            policy.observe(event(record(drafted=6, accepted=6, up=300, network=0.01), SETTINGS))
    assert t.estimates(1.0, 49152, policy.acceptance).alpha_base > 0.97
    policy = AutoPolicy(t, HELLO, 49152)
    for _ in range(10):  # then one it cannot
        policy.observe(event(record(drafted=4, accepted=0, up=300, network=0.01), SETTINGS))
    assert t.estimates(1.0, 49152, policy.acceptance).alpha_base < 0.5
    assert AutoPolicy(t, HELLO, 49152).acceptance.alpha_base > 0.85  # the next session


def test_a_new_temperature_starts_from_the_nearest_measured_ones_acceptance() -> None:
    """A device that measured its pair at T = 0 (all drafts accepted) and T = 0.7 (half) starts T = 1
    from T = 0.7's long-run rate, T = 0.2 from T = 0's; one that measured nothing from the configured
    prior, and one that tested a round's positions from that prior moved by them, even where a session
    at T = 1 that drafted nothing (the bench's warm-up) came first."""
    t = LinkTracker()
    greedy = replace(SETTINGS, draft_len=4)
    for temperature, accepted in ((0.0, 4), (0.7, 2)):
        for _ in range(30):
            t.observe_round(record(drafted=4, accepted=accepted), greedy, temperature, 49152)
    assert t.session_acceptance(1.0).alpha_base == pytest.approx(t.model(0.7).long.rate)
    assert t.model(0.7).long.rate < 0.7 and t.model(0.0).long.rate > 0.95
    assert t.session_acceptance(0.2).alpha_base == pytest.approx(t.model(0.0).long.rate)
    prior = EstimateConfig().prior_alpha
    assert LinkTracker().session_acceptance(1.0).alpha_base == pytest.approx(prior)
    few = LinkTracker()
    assert few.session_acceptance(1.0).alpha_base == pytest.approx(prior)  # a T = 1 session that drafted nothing
    few.observe_round(record(drafted=4, accepted=4), greedy, 0.0, 49152)
    assert few.session_acceptance(1.0).alpha_base == pytest.approx(few.model(0.0).long.rate)
    assert prior < few.model(0.0).long.rate < 0.9


def test_sessions_at_once_keep_their_own_acceptance() -> None:
    """A daemon serves sessions at once over one link: each drafts its own text, so one the drafter
    cannot follow must not pull another's estimate down (nor a new session reset theirs)."""
    t = LinkTracker()
    easy, hard = AutoPolicy(t, HELLO, 49152), AutoPolicy(t, HELLO, 49152)
    for _ in range(20):
        easy.observe(event(record(drafted=6, accepted=6, up=300, network=0.01), SETTINGS))
        hard.observe(event(record(drafted=4, accepted=0, up=300, network=0.01), SETTINGS))
        AutoPolicy(t, HELLO, 49152)  # sessions starting meanwhile
    assert t.estimates(1.0, 49152, easy.acceptance).alpha_base > 0.95
    assert t.estimates(1.0, 49152, hard.acceptance).alpha_base < 0.2
    assert t.estimates(1.0, 49152, easy.acceptance).alpha_depth[3] > 0.95  # per depth as well
    newcomer = t.estimates(1.0, 49152).alpha_base  # the long-run mean of what was tested
    assert t.estimates(1.0, 49152, hard.acceptance).alpha_base + 0.3 < newcomer \
        < t.estimates(1.0, 49152, easy.acceptance).alpha_base - 0.05


def test_one_encoded_q_in_every_few_is_measured() -> None:
    """A top-1024 over the vocabulary per drafted token was 3-4 % of a drafter forward: the dropped
    masses come from one q in OBSERVE_Q_EVERY (the first, then every OBSERVE_Q_EVERY-th)."""
    t = LinkTracker(AutoConfig(top_ks=(2,), ksqs_ks=(2,)))
    two = torch.tensor([0.5, 0.5, 0.0, 0.0], dtype=torch.float64)      # top-2 drops nothing
    spread = torch.full((4,), 0.25, dtype=torch.float64)               # top-2 drops half
    for i in range(4 * OBSERVE_Q_EVERY):
        q = two if i % OBSERVE_Q_EVERY == 0 else spread
        observe_q(t, q, q, DraftSettings(mode=Mode.TSLT, top_k=2), 1.0)
    assert t.model(1.0).tv((Mode.TSLT, 2)) == 0.0


def test_dropped_mass_and_packet_sizes_come_from_the_encoded_distributions() -> None:
    t = LinkTracker(AutoConfig(top_ks=(2, 4), ksqs_ks=(4,), lattice=16))
    q = torch.tensor([0.5, 0.2, 0.1, 0.1, 0.05, 0.05], dtype=torch.float64)
    observe_q(t, q, q, DraftSettings(mode=Mode.DENSE, dense_dtype="fp16"), 1.0)
    side = t.model(1.0)
    assert side.tv((Mode.TSLT, 2)) == pytest.approx(0.3) and side.tv((Mode.TSLT, 4)) == pytest.approx(0.1)
    assert 0.1 <= side.tv((Mode.KSQS, 4)) < 0.2  # top-4 dropped mass plus the lattice's rounding
    sizes = t.estimates(1.0, 6).packet_bytes
    assert sizes[(Mode.TSLT, 4)] > sizes[(Mode.TSLT, 2)] > 0
    assert sizes[(Mode.DENSE, 0)] >= 2 * 6  # fp16 per entry
    # a greedy q is one token whatever K: its sizes are kept apart from T = 1's
    observe_q(t, torch.nn.functional.one_hot(torch.tensor(0), 6).double(), q, DraftSettings(), 0.0)
    greedy = t.estimates(0.0, 6).packet_bytes
    assert greedy[(Mode.TSLT, 4)] == greedy[(Mode.TSLT, 2)] < sizes[(Mode.TSLT, 4)]


def test_every_choice_is_a_valid_round() -> None:
    """Whatever the controller picks passes the edge's own checks (settings.validate)."""
    policy = AutoPolicy(LinkTracker(), HELLO, 49152)
    for c in policy.candidates:
        s = policy.settings_for(c, 16)
        validate(s)
        assert s.mode is c.mode
        if c.mode is Mode.NONE:
            assert s.edge_tokens == 16
        else:
            assert s.draft_len == c.draft_len and (not c.top_k or s.top_k == c.top_k)


def test_an_exploration_does_not_become_the_model_s_pick_by_hysteresis() -> None:
    """The model keeps its last pick unless another beats it by ``hysteresis``; a round the net ran to
    measure the other arm (or a link probe) is not the model's pick: kept, the net would then need rounds
    to prove the model's own choice wrong."""
    policy = AutoPolicy(LinkTracker(), HELLO, 49152)
    e = policy.tracker.estimates(HELLO.temperature, 49152, policy.acceptance, gumbel=policy.gumbel)
    top, ranking = A.best(policy.candidates, e)
    near = next(p.candidate for p in ranking[1:] if p.candidate != top.candidate
                and top.rate <= p.rate * (1 + policy.tracker.config.hysteresis))  # within the hysteresis
    for why in ("explore", "probe"):
        policy.begin(RoundPlan(policy.settings_for(near, 16), choice={"why": why}, decision=AutoDecision(near, e)))
        assert A.best(policy.candidates, e, policy.current, policy.tracker.config.hysteresis)[0].candidate == top.candidate
    policy.begin(RoundPlan(policy.settings_for(near, 16), choice={"why": None}, decision=AutoDecision(near, e)))
    assert A.best(policy.candidates, e, policy.current, policy.tracker.config.hysteresis)[0].candidate == near  # control


def _drafts_nothing_accepted(draft_s: float, rounds: int = 30, then: float | None = None,
                             after: int = 0) -> tuple[list, list, list]:
    """A policy's (modes, edge tokens, choices) over ``rounds`` rounds where no draft is ever accepted and
    the drafter takes ``draft_s`` a token (the target 0.05 s a token, the link 0.05 s a trip); ``then``
    a token from round ``after`` on (None: the same)."""
    hello = Hello(vocab_fingerprint="x", vocab_size=49152, temperature=1.0, draft=resolve({}, vocab_size=49152),
                  seed=0, max_new_tokens=512)
    policy = AutoPolicy(LinkTracker(), hello, 49152)
    modes, edge_tokens, choices = [], [], []
    for i in range(rounds):
        if then is not None and i == after:
            draft_s = then
        plan = policy.choose()
        s = plan.settings
        modes.append(s.mode)
        choices.append(plan.choice)
        edge_tokens.append(s.edge_tokens if s.mode is Mode.NONE else 0)
        if s.mode is Mode.NONE:
            timed = (draft_s,) * int(plan.choice.get("retime") or 0)   # the drafter timed as it streamed
            r = RoundRecord(mode="none", drafted_tokens=0, positions=0, accepted=0, generated=s.edge_tokens,
                            uplink_bytes=30, downlink_bytes=40 * s.edge_tokens, forward_s=timed,
                            phases={"network": 0.05, "queue": 0.0, "decode": 0.0, "verify": 0.05 * s.edge_tokens})
        else:
            r = replace(record(drafted=s.draft_len, accepted=0, up=300, network=0.05, verify=0.05,
                               draft=draft_s * s.draft_len), draft_forwards=s.draft_len, forward_s=(draft_s,) * s.draft_len)
        policy.observe(replace(event(r, s, sum(r.phases.values())), plan=plan))
        choices[-1] = {**plan.choice, "run_s_after": policy.net.run_s}
    return modes, edge_tokens, choices


def test_policy_leaves_speculation_that_does_not_pay_and_comes_back_to_check() -> None:
    """A drafter at a fifth of the target's cost per token whose drafts are all rejected: edge-only runs,
    and drafting, which would pay were its drafts accepted, is explored again now and then."""
    modes, edge_tokens, _ = _drafts_nothing_accepted(0.01)
    # edge-only rounds are as long as their boundary allows: it is their tokens that outnumber the drafted rounds'
    drafted = sum(m is not Mode.NONE for m in modes[-10:])
    assert sum(edge_tokens[-10:]) >= 10 * drafted and modes[-10:].count(Mode.NONE) > drafted, modes
    # drafting that could pay is explored: no edge-only round runs past the longest chunk its boundary allows
    assert max(edge_tokens) <= AutoConfig().edge_chunk_max, edge_tokens
    assert Mode.NONE in modes and any(m is not Mode.NONE for m in modes[10:]), "never re-checked drafting"


def test_a_drafter_slower_than_the_target_is_left_and_timed_not_drafted_again() -> None:
    """At 1.6x the target's cost per token no acceptance makes drafting pay: the drafter timed while the
    first round streams (a new device's first round is edge-only and catches the drafter up), drafting
    never runs, and the drafter is timed again where an exploration falls due (safety_net.NetCall.retime)."""
    modes, edge_tokens, choices = _drafts_nothing_accepted(0.08, rounds=60)
    assert choices[0]["retime"] and all(m is Mode.NONE for m in modes), modes
    assert sum(1 for c in choices[1:] if c.get("retime")) >= 2, choices
    # no exploration cuts its rounds: each asks for edge_round_unpaid_s of tokens at the rate edge-only
    # streams (20 tok/s here), not a chunk sized by its boundary (16-64 tokens): every boundary is a
    # request an uplink outage can hold while the edge idles
    unpaid = AutoConfig().edge_round_unpaid_s
    assert all(n >= unpaid * c["net_edge_tokens_per_s"] > 2 * AutoConfig().edge_chunk_max
               for n, c in zip(edge_tokens[1:], choices[1:])), edge_tokens
    # the drafter gets 8x faster: the first timing that sees it steps its cost, and the next round
    # drafts (its best case pays now), not one a whole exploration interval later
    modes, _, choices = _drafts_nothing_accepted(0.08, rounds=90, then=0.01, after=60)
    timed = next(i for i in range(60, 90) if choices[i].get("retime"))
    assert modes[timed + 1] is not Mode.NONE, modes[timed:]
    # each choice says the best case the net judged drafting by: below edge-only's rate, then above it
    slow, fast = choices[timed - 1], choices[timed + 1]
    assert 0 < slow["spec_ceiling_tokens_per_s"] < slow["net_edge_tokens_per_s"] < fast["spec_ceiling_tokens_per_s"]
    # a timing in place of an exploration restarts its clock, unless it found the drafter changed (one
    # before an exploration, as the drafter catches up for it, leaves it running)
    assert choices[timed]["run_s_after"] > 0
    assert all(c["run_s_after"] == 0 for c in choices[:60] if c.get("retime") and not c["catch_up"])


def test_a_kind_of_round_slower_than_modelled_is_predicted_slower() -> None:
    """What the model misses is learned per kind of round: rounds of one codec that took twice the
    modelled time make every length of it predicted twice as long, and others unchanged; from the
    model as is (a scale of 1): one round moves it a tenth of the way (a bench's warm-up round, or
    rounds timed before a drafter's step was seen, set a kind's scale to 1.3-2.2 for the whole run, and
    with it drafting's best case below edge-only's)."""
    e = estimates()
    c, other = A.Candidate(Mode.TSLT, 4, 1024), A.Candidate(Mode.TSLT, 4, 64)
    t = LinkTracker()
    t.add_round_time(c.codec_key, 2 * A.model_round(c, e).seconds, A.model_round(c, e).seconds)
    assert t.time_scale[c.codec_key].value == pytest.approx(1.1)
    for _ in range(80):
        t.add_round_time(c.codec_key, 2 * A.model_round(c, e).seconds, A.model_round(c, e).seconds)
    scaled = A.Estimates(**{**e.__dict__, "time_scale": {c.codec_key: t.time_scale[c.codec_key].value}})
    assert A.predict(c, scaled).seconds == pytest.approx(2 * A.predict(c, e).seconds, rel=1e-3)
    assert A.predict(A.Candidate(Mode.TSLT, 8, 1024), scaled).seconds == pytest.approx(
        2 * A.predict(A.Candidate(Mode.TSLT, 8, 1024), e).seconds, rel=1e-3)
    assert A.predict(other, scaled).seconds == A.predict(other, e).seconds


def test_an_edge_that_speeds_up_is_predicted_as_it_streams_not_faster() -> None:
    """Edge-only rounds are priced by how they streamed (``edge_token_s``); a time scale learned on
    top of it counts an edge that sped up twice (the streamed interval's estimate lags, and the scale
    learns the same lag: a bench session's first sample set it to 0.89 and edge-only was predicted
    13.5 tok/s where it streamed 12.2). An edge that sped up from 0.085 to 0.075 s a token: no scale
    is learned for edge-only rounds, the prediction stays between the two speeds, and a scale an older
    memory holds for them is ignored."""
    t = LinkTracker()
    policy = AutoPolicy(t, HELLO, HELLO.vocab_size)
    none = A.Candidate(Mode.NONE)
    s = replace(DraftSettings(), mode=Mode.NONE, edge_tokens=16)
    for i, interval in enumerate([0.085] * 4 + [0.075] * 2):
        r = RoundRecord(mode="none", drafted_tokens=0, positions=0, accepted=0, generated=16, uplink_bytes=30,
                        downlink_bytes=640, phases={"network": interval, "queue": 0.0, "decode": 0.0,
                                                    "verify": 15 * interval}, token_interval_s=interval)
        plan = RoundPlan(s, decision=AutoDecision(none, t.estimates(1.0, HELLO.vocab_size)))
        CLOCK[0] += 16 * interval
        policy.observe(RoundEvent(record=r, plan=plan, new_tokens=(), q_stats=(), guess=None, elapsed_s=16 * interval,
                                  edge_hint=None, t=CLOCK[0], sent_ahead=i > 0))
    e = t.estimates(1.0, HELLO.vocab_size)
    assert (Mode.NONE, 0) not in t.time_scale
    assert 1 / 0.085 < A.predict(none, e).rate <= 1 / 0.075
    older = replace(e, time_scale={(Mode.NONE, 0): 0.88})
    assert A.predict(none, older).rate == pytest.approx(A.predict(none, e).rate)


def test_rounds_far_larger_than_any_measured_are_not_trusted_to_the_estimate() -> None:
    """Small rounds pass a token bucket at line rate: a goodput they measured is trusted up to 4x
    their size; beyond, the rest is predicted at 1 Mbit/s at best (dense at 100 KB/token on a
    0.5 Mbit/s link 'measured' at 100 Mbit/s by 1 KB rounds took 13 s a round)."""
    e = estimates(uplink_bps=100e6, measured_up_bits=8 * 10_000)
    assert A.uplink_s(40_000, e) == pytest.approx(8 * 40_000 / 100e6)
    assert A.uplink_s(400_000, e) == pytest.approx(8 * 40_000 / 100e6 + 8 * 360_000 / 1e6)
    pick, _ = A.best(CANDIDATES, e)
    assert A.uplink_bytes(pick.candidate, e) <= 40_000


def test_dssd_fallbacks_are_charged_what_their_replies_measured_and_sample_the_downlink() -> None:
    """Before any fallback the model charges the head reply's size for the session's
    dssd_fallback_top_k (the whole p_j at 0); after fallbacks, what their replies measured. A
    fallback round's extra trips come off its time before it samples the downlink goodput."""
    t = LinkTracker()
    assert t.estimates(1.0, 49152).dssd_fallback_bytes == dssd_fallback_bytes(64, 49152) < 2000
    assert t.estimates(1.0, 49152, fallback_top_k=0).dssd_fallback_bytes == 8 * 49152
    rtt, rate = 0.05, 2e6
    for up in (300, 5000, 300, 9000, 2500, 300, 7000):
        t.observe_round(record(up=up, network=link_network(rtt, rate, up)), SETTINGS, 1.0, 49152)
    dssd = DraftSettings(mode=Mode.DSSD, draft_len=4)
    reply = 1400  # one head reply, and one that ran out: head and whole p_j in two trips
    for trips, down in ((1, reply), (2, reply + 8 * 49152 + 10)):
        fallback = replace(record(mode=Mode.DSSD, accepted=2, up=200, down=down,
                                  network=(1 + trips) * rtt + 8 * (200 + down) / 1e6),
                           residual_trips=trips, residual_bytes=down)
        t.observe_round(fallback, dssd, 1.0, 49152)
    e = t.estimates(1.0, 49152)
    assert reply < e.dssd_fallback_bytes < reply + 8 * 49152  # the run-out's whole p_j counts too
    assert len(t.link.down) == 2 and e.downlink_bps == pytest.approx(1e6, rel=0.1)
    assert t.model(1.0).fallback.hits > 0


def test_auto_chooses_within_the_edge_limits_its_welcome_states() -> None:
    """An edge refuses rounds past its longest draft, largest K or most DSSD samples (the session
    fails): after the Welcome, auto's candidates and DSSD rounds stay within them; an edge that does
    not state its sample cap had 64."""
    policy = AutoPolicy(LinkTracker(), HELLO, 49152)
    assert max(c.draft_len for c in policy.candidates) > 8 and max(c.top_k for c in policy.candidates) > 64
    policy.observe_welcome(Welcome(session_id="s", model_name="m", vocab_size=49152, max_context=2048,
                                   max_draft_len=8, max_k=64, dssd_max_samples=16))
    assert max(c.draft_len for c in policy.candidates) == 8 and max(c.top_k for c in policy.candidates) == 64
    for _ in range(3):
        s = policy.choose().settings
        assert s.mode is Mode.NONE or (s.draft_len <= 8 and (s.mode not in (Mode.TSLT, Mode.KSQS) or s.top_k <= 64))
    assert policy.settings_for(A.Candidate(Mode.DSSD, 8), 16).dssd_samples == 16
    policy.observe_welcome(Welcome(session_id="s", model_name="m", vocab_size=49152, max_context=2048,
                                   max_draft_len=32, max_k=8192))
    assert policy.settings_for(A.Candidate(Mode.DSSD, 8), 16).dssd_samples == AutoConfig().dssd_samples == 64


def test_auto_drops_dssd_at_temperature_0_beside_gumbel_and_keeps_it_elsewhere() -> None:
    """At T = 0 a DSSD round is accepted exactly as a gumbel round of its length, sends more and is
    neither run ahead of nor served late by the edge: auto does not choose it there while gumbel
    rounds are among its candidates. At T = 1 (another law) and where the edge verifies no gumbel
    round, DSSD stays."""
    def modes(hello, config=AutoConfig(), welcome_modes=None):
        policy = AutoPolicy(LinkTracker(config), hello, 49152)
        if welcome_modes is not None:
            policy.observe_welcome(Welcome(session_id="s", model_name="m", vocab_size=49152, max_context=2048,
                                           max_draft_len=32, max_k=8192, modes=welcome_modes))
        return {c.mode for c in policy.candidates}
    greedy = replace(HELLO, temperature=0.0)
    assert Mode.GUMBEL in modes(greedy) and Mode.DSSD not in modes(greedy)
    assert {Mode.GUMBEL, Mode.DSSD} <= modes(HELLO)
    assert Mode.DSSD in modes(greedy, AutoConfig(gumbel=False))
    no_gumbel = tuple(m for m in Mode if m is not Mode.GUMBEL)
    without = modes(greedy, welcome_modes=no_gumbel)
    assert Mode.DSSD in without and Mode.GUMBEL not in without
    assert Mode.DSSD not in modes(greedy, welcome_modes=tuple(Mode))


def test_the_verify_fit_recovers_an_affine_cost_and_keeps_its_prior_slope_for_one_size() -> None:
    """The edge's forward time against its tokens: an affine cost is recovered from forwards of
    several sizes; forwards all of one size give the prior slope's share of their time."""
    exact = [(t, 0.02 + 0.003 * (t - 1)) for t in (1, 2, 5, 9, 17) for _ in range(4)]
    base, slope = A.fit_verify(exact, 0.15, 0.0, 0.05)
    assert base == pytest.approx(0.02) and slope == pytest.approx(0.003)
    one_size = [(5, 0.04)] * 8
    base, slope = A.fit_verify(one_size, 0.15, 4.0, 0.05)
    assert base + 4 * slope == pytest.approx(0.04) and slope == pytest.approx(0.15 * base)
    assert A.fit_verify([], 0.15, 4.0, 0.05) == (0.05, 0.05 * 0.15)


H100_8B = [(t, 5.886e-3 + 1.21e-3 + 21.0e-6 * t) for t in (1, 2, 4, 8, 16, 32, 64, 128, 256)]  # vLLM's fit
CPU_135M = [(t, 0.03 * (1 + 0.18 * (t - 1))) for t in (1, 2, 4, 8, 16, 32, 64, 128, 256)]


def _welcomed(points, rtt_s: float) -> AutoPolicy:
    """A drafting-only policy (edge-only rounds aside: a GPU target alone streams fast too) that has
    seen a Welcome with ``points`` and nothing else but a link and a fast drafter."""
    policy = AutoPolicy(LinkTracker(AutoConfig(edge_only=False)), HELLO, 49152)
    policy.observe_welcome(Welcome(session_id="s", model_name="m", vocab_size=49152, max_context=2048,
                                   max_draft_len=32, max_k=8192, forward_cost=tuple(points)))
    policy.tracker.draft_s.add(0.002)
    policy.tracker.link.fit = (rtt_s, 100e6)
    policy.acceptance = SessionAcceptance(0.9)
    return policy


def test_the_edge_s_stated_cost_curve_makes_auto_draft_long_on_a_gpu() -> None:
    """Before any verdict, the edge's calibrated curve (Welcome.forward_cost) is the verify fit's
    prior: a GPU's flat curve prices a long draft at almost one token's forward, a CPU's does not, so
    over a link the GPU's rounds are longer (each round trip amortized over more tokens)."""
    gpu, cpu = _welcomed(H100_8B, 0.06), _welcomed(CPU_135M, 0.06)
    e_gpu, e_cpu = (p.tracker.estimates(1.0, 49152, p.acceptance) for p in (gpu, cpu))
    assert e_gpu.verify_s(17) < 1.1 * e_gpu.verify_s(1) and e_cpu.verify_s(17) > 3 * e_cpu.verify_s(1)
    assert gpu.choose().settings.draft_len == 16 > cpu.choose().settings.draft_len
    assert _welcomed(H100_8B, 0.02).choose().settings.draft_len >= _welcomed(CPU_135M, 0.02).choose().settings.draft_len
    # forwards the device measures still move the fit (the curve is its prior only)
    for _ in range(24):
        gpu.tracker.verify.add(9, 0.05)
        gpu.tracker.verify.add(2, 0.01)
    _, slope = gpu.tracker.verify.fit()
    assert slope > 0.004  # (0.05 - 0.01) / 7 s per token measured, far above the curve's 21 us


def test_a_round_stalled_by_an_outage_leaves_the_link_estimates_alone() -> None:
    """Issue 35, item 3: a round in flight when a cellular link stops for 0.8 s is held out of the
    round-trip / goodput fit (and of its kind's time scale); two in a row mean the link itself got
    slower, and the estimates follow; when it is fast again they come back at once."""
    rtt, rate = 0.08, 2e6
    t = LinkTracker()
    policy = AutoPolicy(t, HELLO, 49152)
    s = SETTINGS
    def commit(up: int, network: float) -> None:
        r = record(up=up, network=network)
        policy.observe(RoundEvent(record=r, plan=RoundPlan(s, decision=policy.choose().decision), new_tokens=(),
                                  q_stats=(), guess=None, elapsed_s=sum(r.phases.values()), edge_hint=None, t=0.0))
    for up in (600, 3000, 600, 5000, 1200, 3000, 600, 5000):
        commit(up, link_network(rtt, rate, up))
    before = (t.link.rtt_s(), t.link.uplink_bps(), dict((k, e.value) for k, e in t.time_scale.items()))
    commit(3000, link_network(rtt, rate, 3000) + 0.8)  # an outage while it was in flight
    assert t.link.stalls == 1
    assert (t.link.rtt_s(), t.link.uplink_bps()) == pytest.approx(before[:2], rel=1e-6)
    assert {k: e.value for k, e in t.time_scale.items()} == before[2]
    commit(3000, link_network(rtt, rate, 3000))  # back to normal: the stall is forgotten
    assert t.link.rtt_s() == pytest.approx(rtt, rel=0.05) and t.link.uplink_bps() == pytest.approx(rate, rel=0.1)
    predicted = lambda up: t.link.rtt_s() + 8 * up / t.link.uplink_bps()  # noqa: E731
    for _ in range(3):  # the link itself slows down: 0.6 s more a round, round after round
        commit(3000, link_network(rtt, rate, 3000) + 0.6)
    assert predicted(3000) == pytest.approx(link_network(rtt, rate, 3000) + 0.6, rel=0.1)
    for up in (600, 5000, 600, 5000):  # fast again
        commit(up, link_network(rtt, rate, up))
    assert predicted(600) == pytest.approx(link_network(rtt, rate, 600), rel=0.25)


# -- gumbel rounds -----------------------------------------------------------------------------------------

GUMBEL = DraftSettings(mode=Mode.GUMBEL, draft_len=8)


def test_gumbel_starts_from_the_prior_of_the_exact_qs_acceptance() -> None:
    """Before any round: (1 - TV)/(1 + TV) <= gumbel_prior <= 1 - TV; at T = 0 the two events are one."""
    for alpha in (0.5, 0.8, 0.95, 0.99):
        tv = 1 - alpha
        assert (1 - tv) / (1 + tv) - 1e-12 <= A.gumbel_prior(alpha) <= alpha
        assert A.gumbel_prior(alpha, greedy=True) == alpha
        assert A.exact_from_race(A.race_from_exact(alpha)) == pytest.approx(alpha)
    e = LinkTracker().estimates(1.0, 49152)
    assert e.alpha(A.Candidate(Mode.GUMBEL, 4)) == pytest.approx(A.gumbel_prior(e.alpha_base))


def test_gumbel_rounds_give_gumbel_its_own_rate_and_keep_the_exact_estimate_fresh() -> None:
    """A session on gumbel rounds that accept 31 of 32 tested positions: gumbel is estimated at its own
    rate, and the exact q's estimate follows through the measured relation, instead of staying where
    the session started (a DSSD candidate would otherwise be priced at a stale rate forever)."""
    t = LinkTracker()
    acc, gum = t.session_acceptance(1.0), GumbelAcceptance()
    for i in range(300):
        accepted = 7 if i % 4 == 3 else 8
        t.observe_round(record(mode=Mode.GUMBEL, drafted=8, accepted=accepted, up=40, network=0.01), GUMBEL,
                        1.0, 49152, acc, gumbel=gum)
    e = t.estimates(1.0, 49152, acc, gumbel=gum)
    rate = 31 / 32
    assert e.alpha(A.Candidate(Mode.GUMBEL, 8)) == pytest.approx(rate, abs=0.01)
    assert e.alpha_base == pytest.approx(A.exact_from_race(rate), abs=0.01)  # not the start's 0.8


def test_exact_rounds_keep_the_gumbel_estimate_fresh() -> None:
    t = LinkTracker()
    acc, gum = t.session_acceptance(1.0), GumbelAcceptance()
    for _ in range(100):
        t.observe_round(record(mode=Mode.GUMBEL, drafted=4, accepted=0, up=40, network=0.01), GUMBEL, 1.0, 49152,
                        acc, gumbel=gum)  # a text gumbel rounds did badly on ...
    for _ in range(300):  # ... then one the exact q accepts whole
        t.observe_round(record(drafted=8, accepted=8, up=300, network=0.01), SETTINGS, 1.0, 49152, acc, gumbel=gum)
    e = t.estimates(1.0, 49152, acc, gumbel=gum)
    assert e.alpha_base > 0.99 and e.alpha(A.Candidate(Mode.GUMBEL, 8)) > 0.95


def test_the_long_run_gumbel_rate_is_remembered_with_the_rest() -> None:
    t = LinkTracker()
    for _ in range(20):
        t.observe_round(record(mode=Mode.GUMBEL, drafted=8, accepted=6, up=40, network=0.01), GUMBEL, 1.0, 49152)
    state = TS.to_json(t.snapshot())
    other = LinkTracker()
    other.restore(TS.from_json({"models": state["models"]}))
    assert other.model(1.0).long_gumbel.rate == pytest.approx(t.model(1.0).long_gumbel.rate)
    assert other.estimates(1.0, 49152).alpha(A.Candidate(Mode.GUMBEL, 8)) == pytest.approx(
        t.estimates(1.0, 49152).alpha(A.Candidate(Mode.GUMBEL, 8)), abs=0.01)  # remembered at a capped weight
    old = {**state["models"], "temperatures": {k: {n: v for n, v in m.items() if n != "long_gumbel"}
                                               for k, m in state["models"]["temperatures"].items()}}
    LinkTracker().restore(TS.from_json({"models": old}))  # a memory from before gumbel reads as none of it


def test_rounds_modelled_before_the_link_was_measured_teach_no_time_scale_nor_does_the_first_rounds_encode() -> None:
    """A device's first drafted rounds are modelled with the link's round trip at its prior, 0: their
    wall time (a round trip more than modelled) teaches their kind no scale, which would otherwise
    price that kind 1.3x slow for as long as it did not run again (0.07-0.09 s modelled, 0.20 s
    measured: a bench's warm-up). Once a round measured the link, a round's time teaches its scale
    again. And the session's first round, which catches the drafter up, teaches no encode cost (the
    first calls' setup: 15 ms a token against 1 ms after); a round after it does."""
    t = LinkTracker()
    policy = AutoPolicy(t, HELLO, HELLO.vocab_size)
    c = A.Candidate(Mode.GUMBEL, 1)
    s = resolve(dict(mode="gumbel", draft_len=1), vocab_size=HELLO.vocab_size)

    def drafted(encode_s: float, elapsed_s: float) -> None:
        e = t.estimates(1.0, HELLO.vocab_size)
        r = RoundRecord(mode="gumbel", drafted_tokens=1, positions=1, accepted=1, generated=2, uplink_bytes=40,
                        downlink_bytes=20, draft_forwards=2, phases={"draft": 0.06, "encode": encode_s, "network": 0.09,
                                                                     "queue": 0.0, "decode": 0.0, "verify": 0.1})
        CLOCK[0] += elapsed_s
        policy.observe(RoundEvent(record=r, plan=RoundPlan(s, decision=AutoDecision(c, e)), new_tokens=(),
                                  q_stats=(), guess=None, elapsed_s=elapsed_s, edge_hint=None, t=CLOCK[0]))

    assert not t.estimates(1.0, HELLO.vocab_size).link_measured
    drafted(0.015, 0.2)   # the session's first: catches up
    assert Mode.GUMBEL not in t.encode_s
    drafted(0.001, 0.2)   # modelled before any round measured the link (this one measures it)
    assert c.codec_key not in t.time_scale
    assert t.encode_s[Mode.GUMBEL].value == pytest.approx(0.001)
    assert t.estimates(1.0, HELLO.vocab_size).link_measured
    drafted(0.001, 0.6)   # three times what it was modelled at, now with a round trip in the model
    assert t.time_scale[c.codec_key].value > 1.0
