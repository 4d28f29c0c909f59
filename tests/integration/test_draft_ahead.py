"""Drafting ahead (DraftSession.draft_ahead): the device drafts round r + 1 while the edge verifies
round r, on the guess that all of round r is accepted with the drafter's argmax as the bonus.

Its contract is exactness, not just losslessness: the same seed gives the same tokens with and
without it, because a round drafted ahead is the round that would have been drafted after the
verdict (same context, same per-round stream, same forward calls). Over real gRPC, tiny
checkpoints. On these models the edge answers faster than the drafter drafts, so a test session
drafts each ahead round to its end before the verdict is applied (``AheadToTheEnd``); the real
client stops at the verdict, which only cuts the work shorter.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import replace
from functools import partial
from pathlib import Path

import pytest
import torch

from specdec.testbed.tiny_models import make_close_drafter, make_model
from tests.support.harness import device_config, edge, load, run, run_sessions, split_sessions, target_greedy
from specdec.common import verification as V
from specdec.common.modes import Mode
from specdec.common.modeling import encode_prompt
from specdec.device.auto import AutoConfig, AutoDecision, AutoPolicy, LinkTracker
from specdec.device.autotune import Candidate
from specdec.device.parts import Sampler, SessionParts
from specdec.device.rounds import RoundPlan
from specdec.device.session import DraftSession
from tests.support.parts import AheadToTheEnd
from specdec.device.factory import edge_channel
from tests.support.laws import CONTROL_SESSIONS, HIGH_POWER_SESSIONS, LAW_SESSIONS, PROMPT, TEMPERATURE, law_counts
from tests.support.toy_models import P_VALUE_CUT, goodness_of_fit

SEEDS = range(20)  # ~30 rounds drafted ahead kept and ~500 tokens discarded per mode
MAX_NEW = 30  # long enough that rounds drafted ahead are usually full
MODES = {"tslt": dict(mode=Mode.TSLT, top_k=8), "dense": dict(mode=Mode.DENSE, dense_dtype="fp16"),
         "ksqs": dict(mode=Mode.KSQS, top_k=8, lattice=16), "dssd": dict(mode=Mode.DSSD)}


@pytest.fixture(scope="module")
def diverse_pair(tmp_path_factory) -> tuple[Path, Path]:
    """64 tokens, mild logits and a close drafter: varied outputs (the 8-token pair settles into
    repeating one token, where every generator draws the same drafts) and high acceptance."""
    root = tmp_path_factory.mktemp("ahead")
    target = make_model(root / "target", 64, seed=5, logit_scale=2.0)
    return target, make_close_drafter(target, root / "draft", noise=0.1)


class WhiteBox(DraftSession):
    """Base of the white-box controls below, which look into the session's round drafted ahead (its
    plan, its stream): drafts every round ahead in full (tests.support.parts.AheadToTheEnd)."""

    def __init__(self, drafter, hello, **parts):
        super().__init__(drafter, hello, draft_ahead=True, parts=SessionParts(ahead_stops_at_verdict=False, **parts))


class OwnStreamAhead(Sampler):
    """Draws a round's drafts ahead from a generator of their own while ``ahead`` is set."""
    ahead = False

    def sample(self, encoded, generator, position):
        if self.ahead:
            generator = torch.Generator().manual_seed(977 + position)
        return super().sample(encoded, generator, position)


class AheadOwnStream(WhiteBox):
    """Negative control: rounds drafted ahead draw from their own generator, not the one the round
    would use after the verdict (still lossless, but the seed no longer decides the tokens)."""

    def __init__(self, drafter, hello):
        super().__init__(drafter, hello, sampler=OwnStreamAhead())

    def draft_ahead(self, rd, plan, max_tokens, stop):
        self.parts.sampler.ahead = True  # the verdict waits for this worker: no other drafting meanwhile
        try:
            super().draft_ahead(rd, plan, max_tokens, stop)
        finally:
            self.parts.sampler.ahead = False


_RUNS: dict = {}  # several tests compare against the same run: each distinct run happens once


def _sessions(pair, factory, seeds, twin=None, **kw):
    """[(tokens, result, session)]; with ``twin``, half of the seeds run in the twin process
    (harness.Twin) and a session there comes back as its stats only."""
    target_dir, drafter_dir = pair
    cfg_kw = dict(temperature=TEMPERATURE, max_new_tokens=MAX_NEW, draft_len=3, **kw)
    key = (tuple(pair), factory, tuple(seeds), device_config(**cfg_kw), twin is None)
    if key not in _RUNS:
        if twin is None:
            async def main():
                async with edge(target_dir) as address:
                    return await run_sessions(address, drafter_dir, device_config(**cfg_kw), PROMPT, seeds, factory,
                                              concurrency=4)
            _RUNS[key] = run(main())
        else:
            _RUNS[key] = split_sessions(twin, seeds, target_dir, drafter_dir, cfg_kw, PROMPT, factory, concurrency=4)
    return _RUNS[key]


@pytest.mark.parametrize("name", list(MODES))
def test_same_tokens_with_and_without_drafting_ahead(twin, diverse_pair, name) -> None:
    plain = _sessions(diverse_pair, DraftSession, SEEDS, twin, **MODES[name])
    ahead = _sessions(diverse_pair, AheadToTheEnd, SEEDS, twin, **MODES[name])
    assert [t for t, _, _ in ahead] == [t for t, _, _ in plain]
    used = sum(s.stats.ahead_rounds_used for _, _, s in ahead)
    discarded = sum(s.stats.ahead_tokens_discarded for _, _, s in ahead)
    rounds = sum(s.stats.rounds for _, _, s in ahead)
    # a round is kept only if all of the last round was accepted and its bonus was the guess
    print(f"{name}: {used} of {rounds} rounds drafted ahead kept, {discarded} tokens discarded")
    assert used >= 10, f"only {used} of {rounds} rounds were drafted ahead: the test proves little"
    assert discarded > 0, "no wrong guess: the discard path was not exercised"
    assert all(s.stats.ahead_rounds_used == 0 for _, _, s in plain)


LENGTHS = (3, 1, 5, 2, 6, 4)  # a round's draft length, by the position it starts at


class AheadVarying(WhiteBox):
    """Each plan's draft length is a function of the verified length when it is made, as mode auto
    may change it between rounds; records each round drafted ahead with the plan it ran with."""

    def __init__(self, drafter, hello):
        super().__init__(drafter, hello)
        self.planned: list[tuple[int, int]] = []  # (draft length planned ahead, length the round ran with)

    def choose(self, in_flight=None, remaining=None):
        plan = super().choose(in_flight, remaining)
        return replace(plan, settings=replace(plan.settings, draft_len=LENGTHS[len(self.tokens) % len(LENGTHS)]))

    def draft(self, plan, max_tokens):
        ahead = self.ahead
        rd = super().draft(plan, max_tokens)
        if rd.drafted_ahead:
            self.planned.append((ahead.plan.settings.draft_len, rd.settings.draft_len))
        return rd


def test_a_round_drafted_ahead_runs_with_the_plan_it_was_drafted_with(diverse_pair) -> None:
    """Settings change between rounds while rounds are drafted ahead: the next round's plan is made
    before it is drafted ahead (from committed rounds only) and the kept round runs with exactly that
    plan; nothing drafted ahead reshapes it (a length chosen after seeing the round would be a
    stopping rule that peeks at its own draws)."""
    results = _sessions(diverse_pair, AheadVarying, SEEDS[:16], **MODES["tslt"])
    planned = [pair for _, _, s in results for pair in s.planned]
    assert len(planned) >= 10, f"only {len(planned)} rounds drafted ahead were kept"
    assert all(ahead == ran for ahead, ran in planned), planned
    assert len({ran for _, ran in planned}) >= 3, "the draft length hardly changed: the test proves little"


def counting_forwards(drafter, hello) -> DraftSession:
    """Keeps every round's record: its drafter forwards against its drafts."""
    session = AheadToTheEnd(drafter, hello)
    session.records = []
    session.listeners.append(lambda event: session.records.append(event.record))
    return session


def test_rounds_count_their_drafter_forwards(diverse_pair) -> None:
    """mode auto prices drafting per forward: a round of L drafts takes L forwards after a rejection
    (the correction is the one token to feed) and L + 1 after a full accept (the last draft and the
    bonus are fed one forward each), unless a round drafted ahead on a wrong guess already fed the
    last draft. Each of those forwards feeds one token and is timed (auto's samples of the drafter's
    cost)."""
    results = _sessions(diverse_pair, counting_forwards, SEEDS[:16], **MODES["tslt"])
    kinds = Counter()
    for _, _, session in results:
        records = session.records
        for before, r in zip(records, records[1:]):
            full = before.accepted == before.positions
            fed = full and before.ahead_discarded > 0
            assert r.draft_forwards == r.drafted_tokens + (full and not fed), (before, r)
            assert len(r.forward_s) == r.draft_forwards and min(r.forward_s) > 0  # each fed one token
            kinds[(full, fed, r.drafted_ahead)] += 1
    assert kinds[(True, False, True)] and kinds[(False, False, False)] and kinds[(True, True, False)], kinds


def test_coupled_bonus_is_guessed_at_temperature_one(twin, diverse_pair) -> None:
    """With the coupled bonus the device guesses the edge's T = 1 bonus token from the same noise, so
    far more rounds drafted ahead are kept than with the argmax guess of an uncoupled bonus."""
    kept = {}
    for coupled in (True, False):
        results = _sessions(diverse_pair, AheadToTheEnd, SEEDS, twin, coupled_bonus=coupled, **MODES["tslt"])
        kept[coupled] = sum(s.stats.ahead_rounds_used for _, _, s in results)
    print(f"rounds drafted ahead and kept, coupled / uncoupled bonus: {kept[True]} / {kept[False]}")
    assert kept[True] > 1.5 * kept[False], kept  # measured 66 / 26 over 40 seeds


def test_control_ahead_rounds_on_their_own_generator_change_tokens(twin, diverse_pair) -> None:
    plain = _sessions(diverse_pair, DraftSession, SEEDS, twin, **MODES["tslt"])
    buggy = _sessions(diverse_pair, AheadOwnStream, SEEDS, twin, **MODES["tslt"])
    differ = sum(a != b for (a, _, _), (b, _, _) in zip(plain, buggy))
    assert differ > 0, "the equality test above would not catch ahead rounds drawn from another stream"


@pytest.fixture(scope="module")
def guessing_pair(tiny_pair_v8, tmp_path_factory) -> tuple[Path, Path]:
    """The statistical tests' 8-token target with a drafter so close to it (noise 0.05) that the
    device's guesses mostly succeed: ~75 % of sessions keep a round drafted ahead, against ~2 % with
    tiny_pair_v8's own drafter, which gives the test below its power."""
    target, _ = tiny_pair_v8
    return target, make_close_drafter(target, tmp_path_factory.mktemp("guessing") / "draft", noise=0.05)


MIN_KEPT_SHARE = 0.6  # of sessions keeping a round drafted ahead: measured ~1140 of 1500


def _ahead_counts(twin, pair, num_sessions=LAW_SESSIONS, patches=(), over_grpc=False):
    """(sequence counts, exact law, rounds drafted ahead and kept) with every round drafted ahead;
    half of the sessions in the twin process (``patches`` apply in both)."""
    # L = 1: a round drafted ahead is still inside the first N_TOKENS tokens the law covers
    counts, law, results = law_counts(twin, *pair, num_sessions=num_sessions, over_grpc=over_grpc,
                                      session_factory=AheadToTheEnd, patches=patches, draft_len=1, mode=Mode.TSLT,
                                      top_k=3)
    return counts, law, sum(s.stats.ahead_rounds_used for _, s in results)


@pytest.mark.parametrize("num_sessions, over_grpc", [
    (LAW_SESSIONS, False), pytest.param(HIGH_POWER_SESSIONS, True, marks=pytest.mark.slow)], ids=["in-process", "grpc"])
def test_drafting_ahead_is_lossless(twin, guessing_pair, num_sessions, over_grpc) -> None:
    """The exact-law test with every round drafted ahead where possible, on a pair where most rounds
    drafted ahead (on the coupled bonus's guess) are kept."""
    counts, law, kept = _ahead_counts(twin, guessing_pair, num_sessions, over_grpc=over_grpc)
    fit = goodness_of_fit(counts, law)
    print(f"drafting ahead: {kept} of {num_sessions} sessions kept a round drafted ahead; {fit}")
    assert kept >= MIN_KEPT_SHARE * num_sessions, f"only {kept} rounds drafted ahead were kept: little power"
    assert fit.p_value > P_VALUE_CUT, f"drafting ahead: {fit}"


def _uniform_not_gumbel(generator, vocab_size):
    return torch.rand(vocab_size, dtype=torch.float64, generator=generator)


def test_control_coupled_bonus_with_uniform_noise_is_detected(twin, guessing_pair) -> None:
    """Negative control: the coupled bonus drawn as argmax(log p + u) with uniform u (the Gumbel
    transform forgotten) on both sides. The guesses still succeed, but the bonus is no draw from p."""
    counts, law, kept = _ahead_counts(twin, guessing_pair, num_sessions=CONTROL_SESSIONS, over_grpc=True,
                                      patches=[(V, "gumbel_noise", _uniform_not_gumbel)])
    fit = goodness_of_fit(counts, law)
    print(f"control, uniform bonus noise: {kept} kept; {fit}")
    assert kept > 0 and fit.p_value < P_VALUE_CUT, f"negative control passed: {fit}"


def test_greedy_with_drafting_ahead_equals_target(tiny_pair_v512) -> None:
    target_dir, drafter_dir = tiny_pair_v512
    cfg = device_config(mode=Mode.TSLT, top_k=16, temperature=0.0, max_new_tokens=16, draft_len=3)
    prompts = ["w1 w2 w3", "w40 w7", "w300 w301 w302 w303 w9"]

    async def main():
        async with edge(target_dir) as address:
            return [await run_sessions(address, drafter_dir, cfg, p, [0], AheadToTheEnd) for p in prompts]

    tok = load(str(drafter_dir)).tokenizer
    for prompt, [(tokens, _, session)] in zip(prompts, run(main())):
        assert tokens == target_greedy(target_dir, encode_prompt(tok, prompt, raw=True), 16), prompt


def test_client_drafts_ahead_by_default_for_chain_modes_only(twin, diverse_pair, tiny_pair_v8) -> None:
    """The real client path (the stop event set by the verdict), and which sessions may draft ahead."""
    results = _sessions(diverse_pair, partial(DraftSession, draft_ahead=True), range(20), twin, **MODES["tslt"])
    plain = _sessions(diverse_pair, DraftSession, range(20), twin, **MODES["tslt"])
    assert [t for t, _, _ in results] == [t for t, _, _ in plain]
    drafter = load(str(tiny_pair_v8[1]))
    for kw, eligible in ((dict(mode=Mode.TSLT), True), (dict(mode=Mode.CSQS), False),
                         (dict(mode=Mode.DSSD), True), (dict(mode=Mode.TSLT, tree=(2, 2)), False),
                         (dict(mode=Mode.TSLT, bit_budget=4000), False)):
        hello = device_config(**kw).hello("fp", drafter.vocab_size, seed=0)
        assert DraftSession(drafter, hello, draft_ahead=True).draft_ahead_enabled is eligible, kw


def _bench_driver():
    """The benchmarks' device process (specdec.bench.harness.driver)."""
    from specdec.bench.harness import driver
    return driver


def test_bench_driver_drafts_ahead_and_logs_only_what_was_sent(diverse_pair) -> None:
    """The benchmark must time what device-client runs: its session drafts ahead when the config
    says so (it once did not, and every chain in `make bench` ran without drafting ahead), and its
    per-position logs (sigma, support, top-K mass) hold exactly the distributions the edge received,
    not those of rounds drafted ahead on a wrong guess and thrown away."""
    driver = _bench_driver()
    grid = [1, 4]
    seeds = SEEDS[:16]  # enough for wrong guesses to occur (the first assertion checks it)

    ahead = _sessions(diverse_pair, partial(driver.recording_session, topk_grid=grid, draft_ahead=True,
                                            parts=SessionParts(ahead_stops_at_verdict=False)), seeds, **MODES["tslt"])
    plain = _sessions(diverse_pair, partial(driver.recording_session, topk_grid=grid), seeds, **MODES["tslt"])
    assert sum(s.stats.ahead_tokens_discarded for _, _, s in ahead) > 0, "no wrong guess: nothing to filter"
    assert sum(s.stats.ahead_rounds_used for _, _, s in ahead) >= 10
    for (tokens, _, session), (plain_tokens, _, plain_session) in zip(ahead, plain):
        assert tokens == plain_tokens
        s, p = session.parts.observer, plain_session.parts.observer
        sent = sum(positions for positions, _ in s.rounds_log)
        assert len(s.sigma) == len(s.support) == len(s.topk_mass) == sent
        assert (s.sigma, s.support, s.topk_mass) == (p.sigma, p.support, p.topk_mass)

    target_dir, drafter_dir = diverse_pair
    drafter = load(str(drafter_dir))
    cfg = device_config(temperature=TEMPERATURE, max_new_tokens=MAX_NEW, draft_len=3, **MODES["tslt"])
    assert cfg.draft_ahead, "device-client drafts ahead by default; the driver must follow its config"

    async def main():
        async with edge(target_dir) as address:
            bench_cfg = replace(cfg, edge=address)
            async with edge_channel(bench_cfg) as channel:
                return [await driver.run_session(channel, drafter, bench_cfg, PROMPT, seed, None)
                        for seed in range(4)]

    records = run(main())
    assert sum(record["stats"]["draft_ahead"]["rounds_used"] for record, _ in records) > 0


class WaveringAuto(AutoPolicy):
    """Mode auto's plumbing (its observations, its safety net) with a net that wavers at its threshold
    (``wavering``): a plan made ahead of a verdict is edge-only, the plan made after it drafts again
    (TSLT-L3); without, every plan drafts."""
    wavering = True

    def choose(self, in_flight=None, remaining=None):
        c = Candidate(Mode.NONE) if self.wavering and in_flight is not None else Candidate(Mode.TSLT, 3, 8)
        return RoundPlan(self.settings_for(c, 8), choice={}, decision=AutoDecision(c, None))


def _auto_session(drafter, hello, wavering: bool = True) -> DraftSession:
    policy = WaveringAuto(LinkTracker(AutoConfig(top_ks=(8,), ksqs_ks=(), draft_lens=(3,), dssd=False)), hello,
                          drafter.vocab_size, draft_ahead=True)
    policy.wavering = wavering
    session = DraftSession(drafter, hello, draft_ahead=True, policy=policy,
                           parts=SessionParts(ahead_stops_at_verdict=False))
    session.events = []
    session.listeners.append(session.events.append)
    return session


def test_a_round_drafted_after_a_plan_made_ahead_declined_is_a_switch_not_the_arms(diverse_pair) -> None:
    """A drafted round after one accepted whole whose plan made ahead was edge-only waits for drafts
    that drafting ahead would have made: it is marked (``declined_ahead``) and mode auto's net counts
    it with the switches' rounds, not as what drafted rounds deliver (a net near its threshold that
    counted them drafted every other round ahead and priced drafting by the slow half). Rounds after
    a rejection are drafted after the verdict anyway: they stay the arm's."""
    results = _sessions(diverse_pair, _auto_session, SEEDS[:8], **MODES["tslt"])
    kinds = Counter()
    for _, _, s in results:
        for before, e in zip(s.events, s.events[1:]):
            whole = before.record.accepted == before.record.positions
            assert e.declined_ahead == whole and not e.record.drafted_ahead, (before.record, e)
            kinds[whole] += 1
        declined = sum(e.declined_ahead for e in s.events)
        assert (s.policy.net.switch.rounds > 0) == (declined > 0), (declined, s.policy.net.switch)
    assert kinds[True] >= 10 and kinds[False] >= 10, kinds
    control = _sessions(diverse_pair, partial(_auto_session, wavering=False), SEEDS[:8], **MODES["tslt"])
    assert all(not e.declined_ahead for _, _, s in control for e in s.events)
    assert all(s.policy.net.switch.rounds == 0 for _, _, s in control)
    assert sum(e.record.drafted_ahead for _, _, s in control for e in s.events) >= 10
