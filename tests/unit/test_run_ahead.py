"""When rounds let the edge run ahead, and how late a round must be (device/run_ahead.py)."""
from __future__ import annotations

import pytest

from specdec.common.modes import Mode
from specdec.common.logprobs import TokenLogprob
from specdec.common.protocol import DraftBlock, DraftSettings, Hello, Verdict
from specdec.device import run_ahead as RA
from specdec.device.auto import LinkTracker
from specdec.device.factory import new_session
from specdec.testbed.tiny_models import make_model
from tests.support.harness import device_config, load


def test_the_clock_says_never_before_a_round_trip_and_never_for_dssd() -> None:
    clock = RA.OverdueClock()
    assert clock.after_ms(Mode.TSLT) == 0
    clock.trip(0.1)
    assert clock.after_ms(Mode.DSSD) == 0
    assert clock.after_ms(Mode.TSLT) == pytest.approx(1000 * (RA.OVERDUE_FACTOR * 0.1 + RA.OVERDUE_MARGIN_S), abs=1)


def test_the_clock_adds_the_longest_turnaround_and_one_outage_does_not_switch_it_off() -> None:
    clock = RA.OverdueClock()
    for i in range(RA.WINDOW - 1):
        clock.trip(0.08)
        clock.turnaround(0.12 if i == 3 else 0.0)  # a round drafted ahead on a guess that failed, once
    usual = clock.after_ms(Mode.GUMBEL)
    assert usual == pytest.approx(1000 * (RA.OVERDUE_FACTOR * 0.2 + RA.OVERDUE_MARGIN_S), abs=1)
    # a round whose drafting took longer: its successor may take as long where its guess fails
    assert clock.after_ms(Mode.GUMBEL, draft_s=0.32) == pytest.approx(
        1000 * (RA.OVERDUE_FACTOR * 0.4 + RA.OVERDUE_MARGIN_S), abs=1)
    clock.trip(3.0)  # the round an outage held up
    assert clock.after_ms(Mode.GUMBEL) == usual
    for _ in range(RA.WINDOW):  # the link is slower now: the clock follows it
        clock.trip(0.5)
    assert clock.after_ms(Mode.GUMBEL) > 2 * usual


def test_an_edge_only_round_another_follows_is_overdue_a_link_s_wait_after_it() -> None:
    """An edge-only round whose successor goes out while it streams (and which the edge continues if it
    comes late) counts no turnaround of the device: a drafted round's drafting does not delay that
    request. Another edge-only round, and any drafted one, still does."""
    clock = RA.OverdueClock()
    clock.trip(0.1)
    clock.turnaround(0.6)   # drafting a round at 1.5x the target's cost
    link_only = 1000 * (RA.OVERDUE_FACTOR * 0.1 + RA.OVERDUE_MARGIN_S)
    assert clock.after_ms(Mode.NONE, streams_on=True) == pytest.approx(link_only, abs=1)
    assert clock.after_ms(Mode.NONE) == pytest.approx(link_only + 1000 * RA.OVERDUE_FACTOR * 0.6, abs=1)


def test_an_edge_only_round_is_continued_only_past_fewer_tokens_than_it_asked_for() -> None:
    """The rest of a late edge-only round the edge continued after k tokens generated ahead: it starts
    after them and asks for the rest; a round that asked for k or fewer, one of another mode or one
    that streamed already is no such round."""
    from specdec.device.rounds import RoundDraft, RoundPlan

    def edge_round(n: int, mode: Mode = Mode.NONE) -> RoundDraft:
        return RoundDraft(block=DraftBlock(round_id=5, token_ids=()), plan=RoundPlan(DraftSettings(mode=mode, edge_tokens=n)),
                          q_rows=[], theoretical_bits=0, support_sizes=[], draft_seconds=0.0, encode_seconds=0.0, start=40)
    rest = RA.rest_of_edge_round(edge_round(8), 3)
    assert (rest.start, rest.settings.edge_tokens, rest.continued_after) == (43, 5, 3)
    for rd, k in ((edge_round(3), 3), (edge_round(8, Mode.TSLT), 3), (edge_round(8), 0)):
        with pytest.raises(ValueError):
            RA.rest_of_edge_round(rd, k)
    streamed = edge_round(8)
    streamed.received = 1
    with pytest.raises(ValueError):
        RA.rest_of_edge_round(streamed, 3)


@pytest.fixture(scope="module")
def drafter(tmp_path_factory):
    return load(str(make_model(tmp_path_factory.mktemp("drafter") / "m", 64, seed=3)))


@pytest.mark.parametrize("mode", ["auto", "tslt"])
def test_a_sessions_first_round_is_stamped_from_the_devices_earlier_rounds(drafter, mode) -> None:
    """A session's clock shares the device's round trips and turnarounds: its first round, sent before
    it measured any, may still be run ahead of (the edge sat idle through an outage at that round's
    end, 0.77x edge-only's session); a session made without the device's tracker measures its own."""
    cfg = device_config(mode=mode, temperature=0.0)
    hello = cfg.hello("fp", drafter.vocab_size, seed=7)

    def first_round_ms(tracker) -> tuple:
        session = new_session(cfg, drafter, hello, tracker)
        session.start([1, 2, 3])
        return RA.stamp(session, session.draft(session.plan(), 8)).run_ahead_ms, session

    tracker = LinkTracker()
    ms, earlier = first_round_ms(tracker)
    assert ms == 0                                       # nothing measured on this device yet
    earlier.overdue.trip(0.1)
    earlier.overdue.turnaround(0.05)
    ms, _ = first_round_ms(tracker)
    assert ms >= 1000 * (RA.OVERDUE_FACTOR * 0.1 + 0.05)
    assert first_round_ms(None)[0] == 0                  # no device's tracker: its own clock


def test_a_clock_whose_rounds_the_edge_continues_counts_the_turnaround_once() -> None:
    clock = RA.OverdueClock()
    clock.trip(0.1)
    clock.turnaround(0.5)
    assert clock.after_ms(Mode.KSQS) == pytest.approx(1000 * (RA.OVERDUE_FACTOR * 0.6 + RA.OVERDUE_MARGIN_S), abs=1)
    clock.continued = True  # a false alarm costs nothing: only the link's jitter gets the factor
    assert clock.after_ms(Mode.KSQS) == pytest.approx(
        1000 * (RA.OVERDUE_FACTOR * 0.1 + 0.5 + RA.OVERDUE_MARGIN_S), abs=1)
    assert clock.after_ms(Mode.KSQS, draft_s=0.8) == pytest.approx(
        1000 * (RA.OVERDUE_FACTOR * 0.1 + 0.8 + RA.OVERDUE_MARGIN_S), abs=1)


def test_sessions_whose_late_rounds_are_continued() -> None:
    def hello(mode, t, **kw):
        return Hello(vocab_fingerprint="", vocab_size=8, temperature=t, draft=DraftSettings(mode=mode, **kw))
    assert RA.continues(hello(Mode.TSLT, 0.0), fixed_cuts=False, auto=False)  # greedy: the argmax either way
    assert RA.continues(hello(Mode.GUMBEL, 1.0), fixed_cuts=True, auto=False)  # the position's race
    assert RA.continues(hello(Mode.TSLT, 1.0), fixed_cuts=True, auto=True)  # reproducible auto: race rounds only
    assert not RA.continues(hello(Mode.TSLT, 1.0), fixed_cuts=False, auto=True)  # may send chain rounds at T > 0
    assert not RA.continues(hello(Mode.TSLT, 1.0), fixed_cuts=False, auto=False)
    assert not RA.continues(hello(Mode.DSSD, 0.0), fixed_cuts=False, auto=False)
    assert not RA.continues(hello(Mode.TSLT, 0.0, tree=(2, 2)), fixed_cuts=False, auto=False)


def test_only_sessions_whose_tokens_cannot_change_run_ahead_by_default() -> None:
    def hello(mode, t):
        return Hello(vocab_fingerprint="", vocab_size=8, temperature=t, draft=DraftSettings(mode=mode))
    # a reproducible fixed chain mode at T > 0: tokens would move with where rounds end
    assert not RA.runs_ahead(hello(Mode.TSLT, 1.0), fixed_cuts=True, auto=False)
    assert RA.runs_ahead(hello(Mode.TSLT, 1.0), fixed_cuts=False, auto=False)  # --no-reproducible: the law only
    assert RA.runs_ahead(hello(Mode.TSLT, 0.0), fixed_cuts=False, auto=False)  # greedy
    for mode in (Mode.GUMBEL, Mode.NONE):
        assert RA.runs_ahead(hello(mode, 1.0), fixed_cuts=True, auto=False)
    assert RA.runs_ahead(hello(Mode.TSLT, 1.0), fixed_cuts=True, auto=True)  # reproducible auto: race rounds only


def test_quantile_is_nearest_rank_from_below() -> None:
    assert RA.quantile([5, 1, 3, 2, 4], 0.75) == 4 and RA.quantile([7], 0.75) == 7


def _ahead(token: int, lp: float) -> Verdict:
    return Verdict(round_id=4, num_accepted=0, next_token=token, ahead=True, logprobs=(TokenLogprob(lp),))


def test_a_continued_verdict_must_accept_the_tokens_generated_ahead_and_carries_their_logprobs_first() -> None:
    block = DraftBlock(round_id=5, token_ids=(11, 12, 13, 14))
    early = [_ahead(11, -0.1), _ahead(12, -0.2)]
    on_time = Verdict(round_id=5, num_accepted=3, next_token=40, logprobs=(TokenLogprob(-0.3), TokenLogprob(-0.4)))
    got = RA.continued(block, early, on_time)
    assert (got.num_accepted, got.next_token) == (3, 40)
    assert [t.logprob for t in got.logprobs] == [-0.1, -0.2, -0.3, -0.4]  # one per token of the round, in order
    bad = {"not the round's drafts": ([_ahead(11, 0.0), _ahead(99, 0.0)], on_time),
           "accepting fewer than them": (early, Verdict(round_id=5, num_accepted=1, next_token=40)),
           "accepting more than the round drafted": (early, Verdict(round_id=5, num_accepted=5, next_token=40)),
           "without a token (DSSD's)": (early, Verdict(round_id=5, num_accepted=3, next_token=None)),
           "after another round": ([Verdict(round_id=3, num_accepted=0, next_token=11, ahead=True)], on_time)}
    for why, (ahead, verdict) in bad.items():
        with pytest.raises(ValueError):
            RA.continued(block, ahead, verdict)
            pytest.fail(why)
