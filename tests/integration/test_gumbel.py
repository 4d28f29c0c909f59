"""Mode gumbel end to end in process (the device's real round loop against a real edge session,
inprocess.py): drafter invariance token for token, the exact law, and its controls.

Every token a gumbel or none round emits is the target's own race with the noise of its position
(keyed by seed and position only), so a session's tokens are a function of (target, prompt, seed,
temperature, filters): two drafters, any draft length, rounds drafted ahead, a controller switching
between gumbel and edge-only rounds, and a resume on a fresh edge all give the edge-only session's
tokens. The law itself: test_lossless_in_process.py and, over gRPC, test_lossless_e2e.py (laws.MODES);
here, on a six-token target whose first three tokens' law is enumerated, its controls (the known trap
of verifying race-drafted tokens by u < p/q with the shared noise, and noise keyed by the round instead
of the position) are rejected by the same test, and the real mode auto switching between gumbel and
TSLT keeps it. Greedy identity: test_end_to_end.py.
"""
from __future__ import annotations

import itertools
from collections import Counter

import pytest
import torch

from specdec.common import protocol as P
from specdec.common.modes import Mode
from specdec.common import verification as V
from specdec.edge.batched import ForwardRequest
from specdec.common.distributions import densify, race_token
from specdec.common.modeling import encode_prompt, vocab_fingerprint
from specdec.common.streams import Purpose, exponentials
from specdec.device.auto import AutoConfig, AutoPolicy, LinkTracker
from specdec.device.draft_model import DraftModel
from specdec.device.factory import new_session
from specdec.device.parts import Sampler, SessionParts
from specdec.device.session import DraftSession
from specdec.device.safety_net import NetConfig
from specdec.edge.verifier import VerifierSession
from specdec.testbed.tiny_models import make_close_drafter, make_model, make_sharpened_drafter
from tests.support.parts import AheadToTheEnd, AlternatesGumbelAndNone, EdgeOnlyAhead, with_parts
from tests.support.laws import N_TOKENS, PROMPT, exact_law
from tests.support.harness import device_config, load
from tests.support.inprocess import run_seeds
from tests.support.toy_models import P_VALUE_CUT, goodness_of_fit
from tests.unit.test_lossless import verify_by_ratio_with_the_shared_noise

# -- drafter invariance ---------------------------------------------------------------------------------
INVARIANCE_PROMPTS = ("w1 w2", "w7 w3 w30", "w12")
INVARIANCE_SEEDS = (0, 1, 2**40 + 3)
INVARIANCE_TOKENS = 24


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """A 64-token target with mild logits (many likely continuations at T = 1), a close drafter (most
    drafts accepted, rounds drafted ahead kept) and the target sharpened (a different drafter that
    misses more)."""
    root = tmp_path_factory.mktemp("gumbel")
    target = make_model(root / "target", 64, seed=5, logit_scale=1.5)
    return {"target": target, "close": make_close_drafter(target, root / "close", noise=0.05),
            "sharp": make_sharpened_drafter(target, root / "sharp", scale=2.0)}


def _tokens(models, drafter: str, factory=DraftSession, temperature: float = 1.0, max_new: int = INVARIANCE_TOKENS,
            prompts=INVARIANCE_PROMPTS, seeds=INVARIANCE_SEEDS, settings: dict | None = None, **kw):
    """{(prompt, seed): tokens} of one configuration, and its sessions."""
    target, model = load(str(models["target"])), load(str(models[drafter]))
    filters = {k: kw.pop(k) for k in ("target_top_k", "target_top_p") if k in kw}
    out, sessions = {}, []
    for prompt in prompts:
        ids = encode_prompt(model.tokenizer, prompt, raw=True)
        hello = device_config(temperature=temperature, max_new_tokens=max_new, **filters, **(settings or {})).hello(
            vocab_fingerprint(model.tokenizer), model.vocab_size, seed=0)
        for seed, (tokens, session) in zip(seeds, run_seeds(target, model, hello, ids, max_new, seeds, factory, **kw)):
            out[(prompt, seed)] = tokens
            sessions.append(session)
    return out, sessions


@pytest.fixture(scope="module")
def edge_only(models):
    return _tokens(models, "close", settings=dict(mode="none"))[0]


def _breaks_every_third_round():
    """The stream breaks before every third Draft (and inside edge-only rounds, after their first
    token), once per position: the device resumes on a fresh edge, which re-prefills its prefix."""
    seen: set = set()

    def fault(direction, msg, device) -> bool:
        key = (id(device), len(device.tokens), direction)
        if key in seen:
            return False
        seen.add(key)
        if direction == "send" and isinstance(msg, P.DraftBlock):
            return len(seen) % 3 == 0
        return direction == "recv" and isinstance(msg, P.Verdict) and msg.more
    return fault, seen


@pytest.mark.parametrize("drafter, draft_len", list(itertools.product(("close", "sharp"), (1, 4, 8))))
def test_gumbel_tokens_are_the_edge_only_tokens(models, edge_only, drafter, draft_len) -> None:
    tokens, sessions = _tokens(models, drafter, AheadToTheEnd, settings=dict(mode="gumbel", draft_len=draft_len))
    assert tokens == edge_only
    accepted = sum(s.stats.accepted_tokens for s in sessions)
    print(f"{drafter} L={draft_len}: {accepted} drafts accepted of {sum(s.stats.draft_tokens for s in sessions)}; "
          f"{sum(s.stats.ahead_rounds_used for s in sessions)} rounds drafted ahead kept")
    assert accepted > 0
    assert drafter == "sharp" or sum(s.stats.ahead_rounds_used for s in sessions) > 0


def test_rounds_switching_between_gumbel_and_none_give_the_same_tokens(models, edge_only) -> None:
    tokens, sessions = _tokens(models, "sharp", AlternatesGumbelAndNone)
    assert tokens == edge_only
    assert all(s.stats.rounds > 2 for s in sessions)  # both kinds of round in every session


def test_mode_auto_choosing_gumbel_or_none_gives_the_same_tokens(models, edge_only) -> None:
    """The real controller, every estimate its latest observation, among gumbel rounds of any length
    and edge-only rounds (in process edge-only rounds cost next to nothing: it explores drafted rounds
    at every chance here). No cold start: the first round is drafted whatever the clock says (a cold
    start's edge-only first round left the only gumbel round to the exploration's timing, and a loaded
    machine could leave a session without one)."""
    def factory(drafter, hello):
        config = AutoConfig(top_ks=(), ksqs_ks=(), dense=False, dssd=False, memory=0.0, hysteresis=0.0,
                            net=NetConfig(explore_cost=1.0), cold_start=False)
        policy = AutoPolicy(LinkTracker(config), hello, drafter.vocab_size, draft_ahead=True)
        session = DraftSession(drafter, hello, draft_ahead=True, policy=policy)
        session.modes = Counter()
        session.listeners.append(lambda event: session.modes.update([event.settings.mode.value]))
        return session

    tokens, sessions = _tokens(models, "close", factory, settings=dict(mode="auto"))
    assert tokens == edge_only
    print(f"auto's rounds by mode: {dict(sum((s.modes for s in sessions), Counter()))}")
    per_session = [dict(s.modes) for s in sessions]
    assert all(s.modes["gumbel"] and s.modes["none"] for s in sessions), per_session  # every session switched


def _runner_auto(reproducible: bool, modes: Counter):
    """Sessions as the device makes them (factory.new_session, mode auto, every candidate of the
    default AutoConfig: TSLT, K-SQS, dense, DSSD, gumbel, edge-only), the controller as sensitive as it
    gets and drafting whenever it can pay (in process edge-only rounds cost next to nothing)."""
    def factory(drafter, hello):
        cfg = device_config(mode="auto", temperature=hello.temperature, reproducible=reproducible)
        tracker = LinkTracker(AutoConfig(memory=0.0, hysteresis=0.0, net=NetConfig(explore_cost=1.0), cold_start=False))
        session = new_session(cfg, drafter, hello, tracker)
        session.listeners.append(lambda event: modes.update([event.settings.mode.value]))
        return session
    return factory


@pytest.mark.parametrize("drafter", ("close", "sharp"))
def test_seeded_auto_gives_the_same_tokens_whatever_the_drafter(models, edge_only, drafter) -> None:
    """Same seed, same tokens (factory.DeviceConfig.reproducible, on by default): a seeded mode auto
    session at T = 1 keeps to gumbel and edge-only rounds, so every drafter gives the edge-only tokens
    whatever auto chooses from its timing."""
    modes = Counter()
    tokens, _ = _tokens(models, drafter, _runner_auto(True, modes), settings=dict(mode="auto"))
    print(f"{drafter}: seeded auto's rounds by mode {dict(modes)}")
    assert set(modes) <= {"gumbel", "none"} and modes["gumbel"] > 0, modes
    assert tokens == edge_only


def test_control_auto_free_to_choose_gives_other_tokens(models, edge_only) -> None:
    """Control for the test above: the same sessions with reproducibility off choose exact-q chain
    rounds too, whose tokens depend on the drafter and on where rounds end."""
    modes = Counter()
    tokens, _ = _tokens(models, "sharp", _runner_auto(False, modes), settings=dict(mode="auto"))
    print(f"auto free to choose: rounds by mode {dict(modes)}")
    assert set(modes) - {"gumbel", "none"}, modes
    assert tokens != edge_only


def test_a_resume_on_a_fresh_edge_gives_the_same_tokens(models, edge_only) -> None:
    """Also: an edge-only round broken after some of its tokens counts them (a round of their own in the
    session's stats), so the stats add up to every token the session generated."""
    fault, seen = _breaks_every_third_round()
    tokens, sessions = _tokens(models, "sharp", AlternatesGumbelAndNone, fault=fault)
    assert len(seen) > 20
    assert tokens == edge_only
    assert [s.stats.generated_tokens for s in sessions] == [len(s.tokens) - s.prompt_len for s in sessions]
    fault, seen = _breaks_every_third_round()
    tokens, _ = _tokens(models, "close", AheadToTheEnd, settings=dict(mode="gumbel", draft_len=4), fault=fault)
    assert tokens == edge_only


def _ahead_counted(sent: Counter):
    def make(drafter, hello):
        session = EdgeOnlyAhead(drafter, hello)
        session.listeners.append(lambda event: sent.update([event.sent_ahead]))
        return session
    return make


def test_edge_only_rounds_sent_ahead_give_the_same_tokens(models, edge_only) -> None:
    """Requests sent ahead change where rounds are cut and when they start, never a token: the
    sessions equal the one-round edge-only ones (whose law test_lossless_e2e.py checks), also when the
    stream breaks inside a round, before a Draft, or before a request sent ahead (the device retries
    the round in flight and plans the next again); the stats add up to every token generated."""
    sent = Counter()
    tokens, sessions = _tokens(models, "sharp", _ahead_counted(sent))
    print(f"edge-only rounds sent ahead (True) or not: {dict(sent)}")
    assert sent[True] > 3 * sent[False] and tokens == edge_only  # all but each session's first
    fault, broke = _breaks_now_and_then()
    sent.clear()
    tokens, sessions = _tokens(models, "sharp", _ahead_counted(sent), fault=fault)
    print(f"with breaks: sent ahead (True) or not: {dict(sent)}; breaks {dict(broke)}")
    assert tokens == edge_only
    assert sent[True] >= 10 and len(broke) == 3 and min(broke.values()) >= 3, broke
    assert [s.stats.generated_tokens for s in sessions] == [len(s.tokens) - s.prompt_len for s in sessions]


def _breaks_now_and_then():
    """The stream breaks before every fifth Draft and every seventh streamed token, once per position
    (so rounds also get far enough to send the next ahead); counted by where: before a Draft sent
    ahead, before one that is not, inside a round."""
    seen, broke = set(), Counter()

    def fault(direction, msg, device) -> bool:
        key = (id(device), len(device.tokens), direction)
        if key in seen:
            return False
        seen.add(key)
        if direction == "send" and len(seen) % 5 == 0:
            broke["before a Draft sent ahead" if msg.sent_ahead else "before a Draft"] += 1
            return True
        if direction == "recv" and len(seen) % 7 == 0:
            broke["inside a round"] += 1
            return True
        return False
    return fault, broke


def test_with_the_targets_top_k_and_top_p_the_drafter_still_changes_no_token(models) -> None:
    filters = dict(target_top_k=20, target_top_p=0.9)
    reference, _ = _tokens(models, "close", settings=dict(mode="none"), **filters)
    for drafter in ("close", "sharp"):
        tokens, _ = _tokens(models, drafter, settings=dict(mode="gumbel", draft_len=4), **filters)
        assert tokens == reference, drafter
    unfiltered, _ = _tokens(models, "close", settings=dict(mode="none"))
    assert unfiltered != reference  # the filters mattered


class KeyedByRound(Sampler):
    """Control for invariance: noise keyed by the round's start, a fresh vector per offset (lossless:
    no emitted token shares noise with another) but a function of where rounds start, so of the
    drafter and the draft length."""

    def token_noise(self, seed, start, offset, vocab_size):
        return _round_keyed(seed, start, offset, vocab_size)


KeyedByRoundDevice = with_parts(sampler=KeyedByRound())


class KeyedByRoundEdge(VerifierSession):
    def token_noise(self, start, offset):
        return _round_keyed(self.hello.seed, start, offset, self.info.vocab_size)


def _round_keyed(seed: int, start: int, offset: int, vocab: int) -> torch.Tensor:
    return exponentials(seed, Purpose.TOKEN_NOISE, start, (offset + 1) * vocab)[offset * vocab:]


def test_control_noise_keyed_by_round_breaks_invariance(models, edge_only) -> None:
    tokens, _ = _tokens(models, "close", KeyedByRoundDevice, settings=dict(mode="gumbel", draft_len=4),
                        edge_cls=KeyedByRoundEdge)
    differ = sum(tokens[key] != edge_only[key] for key in edge_only)
    print(f"control, noise keyed by round: {differ} of {len(edge_only)} sessions differ from edge-only")
    assert differ >= len(edge_only) // 2


class OneAhead(Sampler):
    """Control for the coupling: the device races with the next position's noise (the two sides off by
    one position). Its tokens are still the edge's, so the law and invariance tests cannot see it; only
    its acceptance falls."""

    def token_noise(self, seed, start, offset, vocab_size):
        return super().token_noise(seed, start, offset + 1, vocab_size)


NoiseOneAhead = with_parts(draft_ahead=True, ahead_stops_at_verdict=False, sampler=OneAhead())


def _drafts_off_the_race(models, factory, prompts=INVARIANCE_PROMPTS) -> tuple[int, int]:
    """(tested drafts, those that are not the drafter's race with their position's noise on the verified
    prefix) over gumbel sessions of L = 4, every round drafted ahead."""
    drafter = load(str(models["close"]))
    rounds = []
    _tokens(models, "close", factory, settings=dict(mode="gumbel", draft_len=4), prompts=prompts,
            on_round=lambda prefix, msg, verdict, edge: rounds.append(
                (edge.hello.seed, list(prefix), msg.token_ids, verdict.num_accepted)))
    tested = off = 0
    for seed, seq, drafts, accepted in rounds:
        offline = DraftModel(drafter, 1.0)  # fed this round's verified prefix from scratch
        for x in drafts[:accepted + 1]:    # the accepted drafts and the first rejected one
            q = offline.probs(offline.feed(seq))
            off += x != race_token(q, V.token_noise(seed, len(seq), drafter.vocab_size))
            tested += 1
            seq.append(x)
    return tested, off


def test_every_draft_is_the_drafters_race_with_its_positions_noise(models) -> None:
    """The coupling that makes gumbel fast: each tested draft, drafted ahead or not, is argmin E_t / q_t
    with the noise of its own position, the edge's, so a draft is rejected only where the two races
    disagree (an off-by-one between the sides keeps every token and loses most drafts: the control)."""
    tested, off = _drafts_off_the_race(models, AheadToTheEnd)
    assert tested > 50 and off == 0
    tested, off = _drafts_off_the_race(models, NoiseOneAhead, prompts=INVARIANCE_PROMPTS[:1])
    print(f"control, noise one position ahead: {off} of {tested} tested drafts off the race")
    assert off > tested // 4


# -- the exact law --------------------------------------------------------------------------------------
LAW_SESSIONS = 400
CONTROL_SESSIONS = 400   # each control below falls under p = 1e-6 at this size
CUT_CONTROL_SESSIONS = 40  # the count it checks is exact: a handful of mismatching gumbel rounds show it


@pytest.fixture(scope="module")
def law_models(tmp_path_factory):
    """Six tokens with mild logits (several likely continuations per position) and a close drafter."""
    root = tmp_path_factory.mktemp("gumbel_law")
    target = make_model(root / "target", 6, seed=1, logit_scale=1.5)
    return target, make_close_drafter(target, root / "close", noise=0.3)


@pytest.fixture(scope="module")
def law_models_closer(law_models, tmp_path_factory):
    """The same target with a drafter so close that most rounds cover the whole window: a mistake that
    couples a round's positions shows in most sequences."""
    target, _ = law_models
    return target, make_close_drafter(target, tmp_path_factory.mktemp("gumbel_law") / "closer", noise=0.05)


def _law_fit(law_models, factory, sessions: int, draft: dict, max_new: int = N_TOKENS, **kw):
    """The fit of the first N_TOKENS of ``sessions`` seeded sessions to the exact law (sessions may run
    to ``max_new`` so that later rounds' choices land inside), and the sessions."""
    target_dir, drafter_dir = law_models
    drafter = load(str(drafter_dir))
    ids = encode_prompt(drafter.tokenizer, PROMPT, raw=True)
    hello = device_config(temperature=1.0, max_new_tokens=max_new, **draft).hello(
        vocab_fingerprint(drafter.tokenizer), drafter.vocab_size, seed=0)
    results = run_seeds(load(str(target_dir)), drafter, hello, ids, max_new, range(sessions), factory, **kw)
    fit = goodness_of_fit(Counter(tuple(t[:N_TOKENS]) for t, _ in results), exact_law(str(target_dir), tuple(ids)))
    return fit, [s for _, s in results]


GUMBEL_L2 = dict(mode="gumbel", draft_len=2)


def test_control_noise_keyed_by_round_start_is_rejected(law_models_closer) -> None:
    """Both sides key the noise by the round's start: every position of a round races with the same."""
    class KeyedByStart(Sampler):
        def token_noise(self, seed, start, offset, vocab_size):
            return super().token_noise(seed, start, 0, vocab_size)

    class Edge(VerifierSession):
        def token_noise(self, start, offset):
            return super().token_noise(start, 0)

    fit, _ = _law_fit(law_models_closer, with_parts(sampler=KeyedByStart()), CONTROL_SESSIONS, GUMBEL_L2,
                      edge_cls=Edge)
    print(f"control, noise keyed by round start: {fit}")
    assert fit.p_value < P_VALUE_CUT, f"negative control passed: {fit}"


class RacesTheSharedNoise(Sampler):
    """The trap's sampler: a dense round's draft (q sent) is q's race with the position's shared noise."""

    def __init__(self, seed: int, vocab_size: int):
        self.seed, self.vocab_size = seed, vocab_size

    def sample(self, encoded, generator, position):
        return self.race(encoded, V.token_noise(self.seed, position, self.vocab_size))


def drafts_dense_by_the_shared_noise(drafter, hello, **kw) -> DraftSession:
    """The trap's device: its sampler knows the session's seed."""
    return DraftSession(drafter, hello, parts=SessionParts(sampler=RacesTheSharedNoise(hello.seed, drafter.vocab_size)),
                        **kw)


class VerifiesByRatioWithTheSharedNoise(VerifierSession):
    """The trap's edge: u < p/q with u the uniform behind the draft's own noise, the residual raced with
    the same noise (test_lossless.verify_by_ratio_with_the_shared_noise)."""

    def _verify_chain(self, draft, settings, q, generator):
        ids = list(draft.token_ids)
        p = self.law.probs(self._forward(ForwardRequest(self.lm, self.tokens[self.lm.cache_len:] + ids,
                                                            len(ids) + 1)))
        start = len(self.tokens)
        q_rows = [densify(sd) for sd in q]
        result = verify_by_ratio_with_the_shared_noise(ids, q_rows, p, lambda i: self.token_noise(start, i))
        self._commit(ids[:result.num_accepted], result.num_accepted, result.next_token)
        return P.Verdict(round_id=draft.round_id, num_accepted=result.num_accepted, next_token=result.next_token)


def test_control_accept_by_ratio_with_the_shared_noise_is_rejected(law_models) -> None:
    fit, _ = _law_fit(law_models, drafts_dense_by_the_shared_noise, CONTROL_SESSIONS,
                      dict(mode="dense", dense_dtype="fp32", draft_len=2), edge_cls=VerifiesByRatioWithTheSharedNoise)
    print(f"control, u < p/q with the shared noise: {fit}")
    assert fit.p_value < P_VALUE_CUT, f"negative control passed: {fit}"


def _sensitive_auto_with_gumbel(drafter, hello):
    """The real controller, as sensitive as it gets, choosing every round between gumbel and TSLT-1
    rounds of length 3 (in process edge-only rounds cost nothing and would win every round), every
    round drafted ahead in full. It counts the gumbel rounds that mismatched before their last draft
    (where the cut of device/session.py ``measured_up_to_mismatch`` has something to cut) and the
    events that still carry a measurement past the first mismatch."""
    config = AutoConfig(top_ks=(1,), ksqs_ks=(), dense=False, dssd=False, edge_only=False,
                        draft_lens=(GUMBEL_AUTO_LEN,), memory=0.0, hysteresis=0.0, lattice=8)
    policy = AutoPolicy(LinkTracker(config), hello, drafter.vocab_size, draft_ahead=True)
    session = AheadToTheEnd(drafter, hello, policy=policy)
    session.modes, session.measured_past_mismatch, session.cut_rounds = Counter(), 0, 0

    def on_round(event):
        session.modes.update([event.settings.mode.value])
        if event.settings.mode is not Mode.GUMBEL:
            return
        session.cut_rounds += event.record.accepted + 1 < event.record.drafted_tokens
        session.measured_past_mismatch += len(event.q_stats) > event.record.accepted + 1
    session.listeners.append(on_round)
    return session


# L >= 3: a round of length 1 has no draft past its first mismatch, so nothing to cut
GUMBEL_AUTO_LEN = 3


def test_auto_with_gumbel_among_its_candidates_keeps_the_law(law_models) -> None:
    """Mode auto switching between gumbel and TSLT keeps the law, and no gumbel round teaches it
    anything measured past its first mismatch (test_control_measurements_past_the_mismatch_are_seen
    shows that this count sees them when the cut is removed)."""
    fit, sessions = _law_fit(law_models, _sensitive_auto_with_gumbel, LAW_SESSIONS, dict(mode="auto"),
                             max_new=2 * N_TOKENS)
    modes = sum((s.modes for s in sessions), Counter())
    cut = sum(s.cut_rounds for s in sessions)
    print(f"sensitive auto with gumbel: rounds by mode {dict(modes)}, {cut} gumbel rounds mismatched before "
          f"their last draft; {fit}")
    assert sum(n > LAW_SESSIONS // 10 for n in modes.values()) >= 2, f"auto hardly changed its mind: {modes}"
    assert cut > LAW_SESSIONS // 10, f"too few gumbel rounds for the cut to act on: {cut}"
    assert sum(s.measured_past_mismatch for s in sessions) == 0
    assert fit.p_value > P_VALUE_CUT, str(fit)


def test_control_measurements_past_the_mismatch_are_seen(law_models, monkeypatch) -> None:
    """Control for the count above: with the cut removed, the events carry measurements past the
    first mismatch (the leak the cut prevents: the next round's plan would see its own noise)."""
    from specdec.device import session as device_session
    monkeypatch.setattr(device_session, "measured_up_to_mismatch", lambda q_stats, settings, accepted: q_stats)
    _, sessions = _law_fit(law_models, _sensitive_auto_with_gumbel, CUT_CONTROL_SESSIONS, dict(mode="auto"),
                           max_new=2 * N_TOKENS)
    past = sum(s.measured_past_mismatch for s in sessions)
    print(f"cut removed: {past} events measured past the first mismatch")
    assert past > 0
