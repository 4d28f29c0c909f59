"""Mode auto's shadow acceptance (device/auto.py ``shadow_rounds``, ``_observe_shadow``): an edge-only
round's tokens, read by the drafter as they stream, say what acceptance the text would give drafts; the
session's estimate follows them (the drafted rounds it is not running cannot). At T = 0 agreeing with the
argmax is acceptance; at T > 0 each token x ~ p gives min(1, q(x)/p(x)) (edge_only.shadow_acceptance),
with p from the edge (Draft.token_probs), an unbiased estimate of the position's acceptance."""
from __future__ import annotations

import math
from dataclasses import replace

import pytest

from specdec.common.modes import Mode
from specdec.common.protocol import Hello, Welcome
from specdec.common.settings import DraftSettings, resolve
from specdec.common.stats import RoundRecord
from specdec.device import safety_net as N
from specdec.device.auto import AutoPolicy, LinkTracker, shadow_rounds
from specdec.device.autotune import race_from_exact
from specdec.device.edge_only import shadow_acceptance, shadow_values
from specdec.device.rounds import RoundEvent, RoundPlan


def test_the_shadow_is_cut_where_a_chain_of_drafts_would_have_been() -> None:
    # to each first miss (the target's token replaces it); a full round of 3 skips the bonus position
    assert shadow_rounds((1, 1, 0, 1, 1, 1, 1, 0), 3) == [[1.0, 1.0, 0.0], [1.0, 1.0, 1.0], [0.0]]
    assert shadow_rounds((0, 0), 3) == [[0.0], [0.0]] and shadow_rounds((), 3) == []
    assert shadow_rounds((1, 1), 3) == [[1.0, 1.0]]  # a stretch that ended before the round would have


def test_the_t1_shadow_value_is_an_unbiased_estimate_of_the_acceptance() -> None:
    """Over x ~ p, min(1, q(x)/p(x)) averages to sum_x min(p, q), the expected acceptance of a draft
    from q (Leviathan et al. 2023, Cor. 3.6), exactly: here 0.6, where the swapped ratio min(1, p/q)
    would give 1.0."""
    p = [0.5, 0.3, 0.2, 0.0]
    q = [0.2, 0.3, 0.1, 0.4]
    expected = sum(pi * shadow_acceptance(qi, math.log(pi)) for pi, qi in zip(p, q) if pi > 0)
    assert expected == pytest.approx(sum(map(min, p, q))) and expected == pytest.approx(0.6)
    assert sum(pi * min(1.0, pi / qi) for pi, qi in zip(p, q) if pi > 0) == pytest.approx(1.0)
    # a token read once: its p is dropped after, one without a p (generated ahead) is left out
    logp = {7: math.log(0.5), 9: math.log(0.25)}
    assert shadow_values([(7, 0.25), (8, 0.9), (9, 0.5)], logp) == [0.5, 1.0] and logp == {}


def hello(temperature: float) -> Hello:
    return Hello(vocab_fingerprint="x", vocab_size=49152, temperature=temperature,
                 draft=resolve({}, vocab_size=49152), seed=0, max_new_tokens=512)


def edge_round(shadow: tuple[float, ...], t: float, shadow_s: float = 0.0) -> RoundEvent:
    s = replace(DraftSettings(), mode=Mode.NONE, edge_tokens=32)
    r = RoundRecord(mode="none", drafted_tokens=0, positions=0, accepted=0, generated=32, uplink_bytes=30,
                    downlink_bytes=1000, shadow=shadow, shadow_s=shadow_s, shadow_fed=len(shadow),
                    phases={"network": 0.05, "queue": 0.0, "decode": 0.0, "verify": 1.6})
    return RoundEvent(record=r, plan=RoundPlan(s), new_tokens=(), q_stats=(), guess=None, elapsed_s=1.7,
                      edge_hint=None, t=t)


def session_alpha(temperature: float, shadow: tuple[float, ...]) -> tuple[float, float]:
    """(the session's acceptance estimate, its gumbel one) after three edge-only rounds with ``shadow``."""
    policy = AutoPolicy(LinkTracker(), hello(temperature), 49152)
    for i in range(3):
        policy.observe(edge_round(shadow, 1.7 * (i + 1)))
    e = policy.tracker.estimates(temperature, 49152, policy.acceptance, gumbel=policy.gumbel)
    return e.alpha_base, e.gumbel_alpha


def test_an_easy_text_streamed_edge_only_raises_the_sessions_acceptance_at_t0() -> None:
    easy = (1,) * 31 + (0,)
    hard = (1, 0) * 16
    plain, _ = session_alpha(0.0, ())
    high, high_gumbel = session_alpha(0.0, easy)
    low, _ = session_alpha(0.0, hard)
    assert high > 0.9 > plain > low, (high, plain, low)  # the prior (0.8) moved each way by the text
    assert high_gumbel == pytest.approx(high, abs=0.02)   # at T = 0 the race's acceptance is the same event


def test_at_t1_the_shadows_expected_acceptances_move_the_session_and_gumbel_follows_the_relation() -> None:
    """At T = 1 each position's value is its expected exact-q acceptance (not a hit): 0.97 everywhere
    moves the session up from the prior (0.8), 0.5 down; gumbel's estimate moves the same way, toward
    the relation's value 1 - 1.3 (1 - a) and not past it (a shadow taught to gumbel as a hit would
    pass it). A shadow ignored at T > 0 (as before Draft.token_probs) leaves both at their priors."""
    plain, plain_gumbel = session_alpha(1.0, ())
    high, high_gumbel = session_alpha(1.0, (0.97,) * 32)
    low, low_gumbel = session_alpha(1.0, (0.5,) * 32)
    assert high > 0.9 > plain > 0.7 > low, (high, plain, low)
    assert plain_gumbel + 0.1 < high_gumbel <= race_from_exact(0.97) + 1e-9, (plain_gumbel, high_gumbel)
    assert race_from_exact(0.5) - 1e-9 <= low_gumbel < plain_gumbel - 0.1, (plain_gumbel, low_gumbel)


def test_an_edge_only_round_shadows_only_where_drafting_could_pay_and_at_t1_where_the_edge_sends_p() -> None:
    cold = AutoPolicy(LinkTracker(), hello(0.0), 49152).choose()
    assert cold.settings.mode is Mode.NONE and cold.choice.get("shadow")  # a new device's first round reads the text
    assert not AutoPolicy(LinkTracker(), hello(1.0), 49152).choose().choice.get("shadow")  # an edge with no p
    policy = AutoPolicy(LinkTracker(), hello(1.0), 49152)
    policy.observe_welcome(Welcome(session_id="s", model_name="m", vocab_size=49152, max_context=2048,
                                   max_draft_len=16, max_k=4096,
                                   modes=tuple(Mode), token_probs=True))
    first = policy.choose()
    assert first.settings.mode is Mode.NONE and first.choice.get("shadow"), first.choice


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
