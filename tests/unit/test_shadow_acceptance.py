"""Mode auto's shadow acceptance (device/auto.py ``shadow_rounds``, ``_observe_shadow``): at T = 0 an
edge-only round's tokens, read by the drafter as they stream, say what acceptance the text would give
drafts; the session's estimate follows them (the drafted rounds it is not running cannot), and only at
T = 0, where agreeing with the argmax is acceptance."""
from __future__ import annotations

import math
from dataclasses import replace

import pytest

from specdec.common.modes import Mode
from specdec.common.protocol import Hello
from specdec.common.settings import DraftSettings, resolve
from specdec.common.stats import RoundRecord
from specdec.device import safety_net as N
from specdec.device.auto import AutoPolicy, LinkTracker, shadow_rounds
from specdec.device.rounds import RoundEvent, RoundPlan


def test_the_shadow_is_cut_where_a_chain_of_drafts_would_have_been() -> None:
    # to each first miss (the target's token replaces it); a full round of 3 skips the bonus position
    assert shadow_rounds((1, 1, 0, 1, 1, 1, 1, 0), 3) == [[1.0, 1.0, 0.0], [1.0, 1.0, 1.0], [0.0]]
    assert shadow_rounds((0, 0), 3) == [[0.0], [0.0]] and shadow_rounds((), 3) == []
    assert shadow_rounds((1, 1), 3) == [[1.0, 1.0]]  # a stretch that ended before the round would have


def hello(temperature: float) -> Hello:
    return Hello(vocab_fingerprint="x", vocab_size=49152, temperature=temperature,
                 draft=resolve({}, vocab_size=49152), seed=0, max_new_tokens=512)


def edge_round(shadow: tuple[int, ...], t: float, shadow_s: float = 0.0) -> RoundEvent:
    s = replace(DraftSettings(), mode=Mode.NONE, edge_tokens=32)
    r = RoundRecord(mode="none", drafted_tokens=0, positions=0, accepted=0, generated=32, uplink_bytes=30,
                    downlink_bytes=1000, shadow=shadow, shadow_s=shadow_s, shadow_fed=len(shadow),
                    phases={"network": 0.05, "queue": 0.0, "decode": 0.0, "verify": 1.6})
    return RoundEvent(record=r, plan=RoundPlan(s), new_tokens=(), q_stats=(), guess=None, elapsed_s=1.7,
                      edge_hint=None, t=t)


def session_alpha(temperature: float, shadow: tuple[int, ...]) -> tuple[float, float]:
    """(the session's acceptance estimate, its gumbel one) after three edge-only rounds with ``shadow``."""
    policy = AutoPolicy(LinkTracker(), hello(temperature), 49152)
    for i in range(3):
        policy.observe(edge_round(shadow, 1.7 * (i + 1)))
    e = policy.tracker.estimates(temperature, 49152, policy.acceptance, gumbel=policy.gumbel)
    return e.alpha_base, e.gumbel_alpha


def test_an_easy_text_streamed_edge_only_raises_the_sessions_acceptance_at_t0_only() -> None:
    easy = (1,) * 31 + (0,)
    hard = (1, 0) * 16
    plain, _ = session_alpha(0.0, ())
    high, high_gumbel = session_alpha(0.0, easy)
    low, _ = session_alpha(0.0, hard)
    assert high > 0.9 > plain > low, (high, plain, low)  # the prior (0.8) moved each way by the text
    assert high_gumbel == pytest.approx(high, abs=0.02)   # at T = 0 the race's acceptance is the same event
    assert session_alpha(1.0, easy)[0] == pytest.approx(session_alpha(1.0, ())[0])  # T = 1: no such evidence


def test_an_edge_only_round_at_t0_shadows_only_where_drafting_could_pay() -> None:
    cold = AutoPolicy(LinkTracker(), hello(0.0), 49152).choose()
    assert cold.settings.mode is Mode.NONE and cold.choice.get("shadow")  # a new device's first round reads the text
    assert not AutoPolicy(LinkTracker(), hello(1.0), 49152).choose().choice.get("shadow")


def test_the_shadow_runs_only_where_drafting_could_gain_more_than_it_costs() -> None:
    """Drafting's best case 8 % above edge-only (18 tok/s): a shadow costing 5 ms a token (9 % of
    edge-only's time) is not worth it, one costing 1 ms (2 %) is; a best case within the net's margin
    never is. A rule that ignored the cost, or added it the wrong way, fails a case."""
    cfg = N.NetConfig()
    assert not N.shadow_pays(cfg, 1.08 * 18, 18.0, 0.005 * 18)
    assert N.shadow_pays(cfg, 1.08 * 18, 18.0, 0.001 * 18)
    assert N.shadow_pays(cfg, 1.2 * 18, 18.0, 0.005 * 18)
    assert not N.shadow_pays(cfg, 1.02 * 18, 18.0, 0.0)


def test_the_shadows_measured_cost_decides_whether_an_edge_only_round_shadows() -> None:
    """The cost the shadow's forwards measured (seconds per token read) reaches the policy's choice:
    unmeasured, a round where drafting could pay shadows (so that it is measured); at 5 ms a token
    against a best case 8 % up, it does not; where drafting cannot pay at all, never."""
    policy = AutoPolicy(LinkTracker(), hello(0.0), 49152)
    call = N.NetCall(N.EDGE, None, edge_rate=18.0, spec_rate=17.0, probe_due_s=math.inf, spec_pays=True,
                     spec_ceiling=1.08 * 18)
    assert policy._shadow_pays(call)
    policy.observe(edge_round((1, 0) * 16, 1.7, shadow_s=32 * 0.005))
    assert policy.tracker.shadow_token_s.value == pytest.approx(0.005)
    assert not policy._shadow_pays(call)
    assert policy._shadow_pays(replace(call, spec_ceiling=1.2 * 18))
    assert not policy._shadow_pays(replace(call, spec_ceiling=1.2 * 18, spec_pays=False))


def known_link_drafting_measured_slow(shadow_s: float) -> LinkTracker:
    """A device that streamed three edge-only rounds of a hard text at T = 0 (each shadow read costing
    ``shadow_s`` a round) and measured two drafted rounds at 4 tok/s: its next session starts edge-only."""
    tracker = LinkTracker()
    first = AutoPolicy(tracker, hello(0.0), 49152)
    for i in range(3):
        first.observe(edge_round((0,) * 32, 1.7 * (i + 1), shadow_s=shadow_s))
    d = N.NetConfig().discount
    slow = N.Sums().plus(4, 1.0, d)
    tracker.nets[0.0] = replace(tracker.nets[0.0], spec=slow.plus(4, 1.0, d), spec_steady=slow)
    return tracker


def test_a_sessions_first_rounds_read_the_text_in_short_chunks() -> None:
    """The plan of a round is made while the round before streams, and the shadow reads a round's last
    tokens in the next: where they read the text, a session's rounds ask for ``edge_chunk_min`` tokens
    until its committed rounds measured as many of its positions as the acceptance prior weighs (one
    shadowed position is not enough), the rounds after for the usual chunk. Where the shadow does not
    run (its measured cost exceeds what drafting could gain), the first rounds are of the usual chunk."""
    cfg = LinkTracker().config
    policy = AutoPolicy(known_link_drafting_measured_slow(shadow_s=0.0), hello(0.0), 49152)
    first = policy.choose()
    ahead = policy.choose(in_flight=first)
    usual = first.choice["edge_chunk"]
    assert usual > cfg.edge_chunk_min, "the usual chunk is the short one: nothing to tell apart"
    for plan in (first, ahead):
        assert plan.settings.mode is Mode.NONE and plan.choice.get("shadow"), plan.choice
        assert plan.settings.edge_tokens == cfg.edge_chunk_min
    policy.observe(edge_round((0,), 1.7))   # the first round's shadow: the prompt, then one position
    third = policy.choose()
    assert third.settings.mode is Mode.NONE and third.settings.edge_tokens == cfg.edge_chunk_min
    policy.observe(edge_round((0,) * 8, 3.4))
    later = policy.choose()
    assert later.settings.mode is Mode.NONE and later.choice.get("shadow")
    assert later.settings.edge_tokens == usual
    unshadowed = AutoPolicy(known_link_drafting_measured_slow(shadow_s=32 * 0.5), hello(0.0), 49152).choose()
    assert unshadowed.settings.mode is Mode.NONE and not unshadowed.choice.get("shadow")
    assert unshadowed.settings.edge_tokens == usual
