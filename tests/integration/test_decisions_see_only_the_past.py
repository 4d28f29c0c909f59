"""A round's settings never depend on that round's own random numbers (issue 33).

Two ways the device once let them (each a stopping rule that peeks at the draws it then uses, which
bends the output law although every round with fixed settings is exact):
  * mode auto re-planned the next round after seeing the round drafted ahead for it, and redrafted
    it from the same stream when the codec changed;
  * a round retried after a broken DSSD fallback took a shorter length from the broken attempt's
    verdict (the edge's draft-length advice, computed after that round's own outcome).
Each is rebuilt here as a negative control and rejected by the exact-law test; the same scenarios
pass with the device as it is, driven by the real AutoPolicy made as sensitive as it can be (every
estimate its latest observation). The device's real round loop runs against a real edge session in
this process (inprocess.py), so each scenario affords hundreds of seeded sessions.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import replace

import pytest

from specdec.common import protocol as P
from specdec.common import settings as S
from specdec.common.modes import Mode
from specdec.common.modeling import encode_prompt, vocab_fingerprint
from specdec.device.auto import AutoConfig, AutoPolicy, LinkTracker
from specdec.device.parts import Observer, Planner, SessionParts
from specdec.device.session import DraftSession
from tests.support.parts import TO_THE_END, AheadToTheEnd
from specdec.testbed.tiny_models import make_close_drafter, make_model, make_sharpened_drafter
from tests.support.laws import LAW_SESSIONS, N_TOKENS, PROMPT, TEMPERATURE, exact_law
from tests.support.harness import device_config, load
from tests.support.inprocess import run_seeds
from tests.support.toy_models import P_VALUE_CUT, goodness_of_fit

NULL_SESSIONS = LAW_SESSIONS  # the default tier's size: TV >= 0.18 seen (laws.py)
CONTROL_SESSIONS = 600   # both controls fall below p = 1e-9 at 800 sessions, near 1e-4 at 400
# Every estimate the latest observation and no hysteresis: a policy that could see a round's own
# draws would follow them round by round. Each session has a tracker of its own, so each would start
# with a cold, edge-only round (decided before anything is drawn), which in these short sessions
# leaves nothing to decide: off here.
SENSITIVE = dict(memory=0.0, hysteresis=0.0, lattice=8, ksqs_ks=(3,), cold_start=False)


@pytest.fixture(scope="module")
def flat_target(tmp_path_factory):
    """Six tokens with mild logits: several likely continuations per position (a peaky target puts
    most sequences in one cell, where no bias shows)."""
    return make_model(tmp_path_factory.mktemp("past") / "target", 6, seed=1, logit_scale=1.5)


@pytest.fixture(scope="module")
def guessing_drafter(flat_target, tmp_path_factory):
    """So close to the target that most bonus guesses come true: rounds drafted ahead are kept."""
    return make_close_drafter(flat_target, tmp_path_factory.mktemp("past") / "close", noise=0.05)


@pytest.fixture(scope="module")
def sharp_drafter(flat_target, tmp_path_factory):
    """The target sharpened: rejections leave residuals on p's tail, far from p."""
    return make_sharpened_drafter(flat_target, tmp_path_factory.mktemp("past") / "sharp", scale=2.0)


def _sessions(target_dir, drafter_dir, factory, seeds, max_new: int, **kw):
    """[(tokens, session)] over seeds, each session to ``max_new`` tokens, and the exact law of the
    first N_TOKENS (sessions may run past them so that later rounds' decisions land inside)."""
    draft_kw = kw.pop("draft")
    drafter = load(str(drafter_dir))
    ids = encode_prompt(drafter.tokenizer, PROMPT, raw=True)
    hello = device_config(temperature=TEMPERATURE, max_new_tokens=max_new, **draft_kw).hello(
        vocab_fingerprint(drafter.tokenizer), drafter.vocab_size, seed=0)
    results = run_seeds(load(str(target_dir)), drafter, hello, ids, max_new, seeds, factory, **kw)
    return results, exact_law(str(target_dir), tuple(ids))


def _fit(results, law):
    return goodness_of_fit(Counter(tuple(tokens[:N_TOKENS]) for tokens, _ in results), law)


def _sensitive_auto(session_class, **config):
    def factory(drafter, hello):
        policy = AutoPolicy(LinkTracker(AutoConfig(**{**SENSITIVE, **config})), hello, drafter.vocab_size,
                            draft_ahead=True)
        session = session_class(drafter, hello, draft_ahead=True, policy=policy)
        session.kinds = Counter()  # the settings its committed rounds ran with
        session.listeners.append(lambda event: session.kinds.update([_kind(event.settings)]))
        return session
    return factory


def _kind(s: S.DraftSettings) -> str:
    return f"{s.mode.value}-K{s.top_k}-L{s.draft_len}" if s.mode is not Mode.NONE else "none"


# -- planned before drafted ahead --------------------------------------------------------------------------



class ReplansAfterPeeking(DraftSession):
    """Control, the old wiring: once the guess came true the next round is planned again having seen
    the round drafted ahead (here: its first token was the packet's likeliest), and a new codec
    redrafts it from the same stream. White-box (it reads the session's round drafted ahead); every
    round drafted ahead in full (tests.support.parts.AheadToTheEnd)."""
    replanned = 0

    def __init__(self, drafter, hello, **kw):
        super().__init__(drafter, hello, **{"draft_ahead": True, "parts": TO_THE_END, **kw})

    def plan(self):
        plan = super().plan()
        ahead = self.ahead
        if ahead is not None and ahead.plan is plan and ahead.round.steps:
            first = ahead.round.steps[0]
            if first.token == int(first.encoded.q_hat.argmax()):
                self.replanned += 1
                return replace(plan, settings=replace(plan.settings, top_k=1))
        return plan


# L = 1: the round drafted ahead starts at the third token, inside the law's window.
AHEAD = dict(mode="tslt", top_k=3, draft_len=1)


def test_control_replanning_after_seeing_the_round_drafted_ahead_is_rejected(flat_target, guessing_drafter) -> None:
    results, law = _sessions(flat_target, guessing_drafter, ReplansAfterPeeking, range(CONTROL_SESSIONS),
                             N_TOKENS, draft=AHEAD)
    fit = _fit(results, law)
    print(f"control, re-planned after peeking: {fit}")
    assert sum(s.replanned for _, s in results) > CONTROL_SESSIONS // 4
    assert fit.p_value < P_VALUE_CUT, f"negative control passed: {fit}"


def test_rounds_planned_before_they_are_drafted_ahead_keep_the_law(flat_target, guessing_drafter) -> None:
    """The real AutoPolicy, as sensitive as it gets, choosing mode and K every round while every
    round is drafted ahead in full: its plans come from committed rounds only."""
    factory = _sensitive_auto(AheadToTheEnd, top_ks=(1, 3, 6), draft_lens=(1,))
    results, law = _sessions(flat_target, guessing_drafter, factory, range(NULL_SESSIONS), N_TOKENS, draft=AHEAD)
    fit = _fit(results, law)
    kept = sum(s.stats.ahead_rounds_used for _, s in results)
    kinds = sum((s.kinds for _, s in results), Counter())
    print(f"sensitive auto, drafting ahead: {kept} rounds drafted ahead kept, rounds by kind {dict(kinds)}; {fit}")
    assert kept > NULL_SESSIONS // 4, "few rounds drafted ahead were kept: the test proves little"
    assert sum(n > NULL_SESSIONS // 10 for n in kinds.values()) >= 2, f"auto hardly changed its mind: {kinds}"
    assert fit.p_value > P_VALUE_CUT, str(fit)


# -- a retried round repeats its plan ------------------------------------------------------------------------
# DSSD with one sample per rejection: most rejections need the fallback trip, and the stream breaks
# before the first of each round's (the round is retried on a fresh edge). The edge's advice in a
# rejecting verdict is the number accepted: what a retry must not read.
RETRY = dict(mode="dssd", dssd_samples=1, draft_len=2)
RETRY_MAX_NEW = N_TOKENS + 2  # round 1 drafts two tokens; later rounds' retries land inside the window


def _advice(verdict: P.Verdict) -> int | None:
    return verdict.num_accepted if verdict.next_token is None else None


def _breaks_each_first_fallback():
    """A fault that breaks the stream before the first fallback request of every round (by where it
    starts), once: the retry then runs through. Returns (fault, the set of rounds broken)."""
    broken: set = set()

    def fault(direction, msg, device) -> bool:
        key = (id(device), len(device.tokens))
        if direction == "send" and isinstance(msg, P.ResidualRequest) and key not in broken:
            broken.add(key)
            return True
        return False
    return fault, broken


class TakesTheAdvice(Observer, Planner):
    """Control, the old wiring: the retried round drafts no longer than the advice in the broken
    attempt's verdict (0: an edge-only round), which the edge computed from that round's outcome.
    The faults here break a round before its fallback: the verdict that needed it is the one seen."""
    seen: int | None = None

    def fallback(self, rd, verdict):
        self.seen = verdict.draft_len_hint

    def retry(self, plan):
        return replace(plan, settings=S.within_draft_len(plan.settings, self.seen))


def retry_takes_the_advice(drafter, hello, **kw) -> DraftSession:
    control = TakesTheAdvice()
    return DraftSession(drafter, hello, parts=SessionParts(planner=control, observer=control), **kw)


def test_control_a_retry_shortened_by_its_own_verdict_is_rejected(flat_target, sharp_drafter) -> None:
    fault, broken = _breaks_each_first_fallback()
    results, law = _sessions(flat_target, sharp_drafter, retry_takes_the_advice, range(CONTROL_SESSIONS),
                             RETRY_MAX_NEW, draft=RETRY, fault=fault, hint=_advice)
    fit = _fit(results, law)
    print(f"control, retry took its own verdict's advice: {len(broken)} rounds broken; {fit}")
    assert fit.p_value < P_VALUE_CUT, f"negative control passed: {fit}"


def test_a_retried_round_repeats_its_plan_and_its_tokens(flat_target, sharp_drafter) -> None:
    """Broken before each first fallback and retried on a fresh edge: every session's tokens are those
    of the unbroken session with its seed, and the law holds."""
    fault, broken = _breaks_each_first_fallback()
    results, law = _sessions(flat_target, sharp_drafter, DraftSession, range(NULL_SESSIONS), RETRY_MAX_NEW,
                             draft=RETRY, fault=fault, hint=_advice)
    unbroken, _ = _sessions(flat_target, sharp_drafter, DraftSession, range(150), RETRY_MAX_NEW, draft=RETRY,
                            hint=_advice)
    assert len(broken) > NULL_SESSIONS // 5, f"only {len(broken)} rounds broken: the test proves little"
    assert [t for t, _ in results[:150]] == [t for t, _ in unbroken]
    fit = _fit(results, law)
    print(f"retries repeat their plan: {len(broken)} rounds broken; {fit}")
    assert fit.p_value > P_VALUE_CUT, str(fit)


def test_sensitive_auto_with_retries_keeps_the_law(flat_target, sharp_drafter) -> None:
    """The real AutoPolicy choosing DSSD's length and edge-only rounds round by round, under the
    edge's advice, with every first fallback broken and retried."""
    fault, broken = _breaks_each_first_fallback()
    factory = _sensitive_auto(DraftSession, top_ks=(), ksqs_ks=(), dense=False, draft_lens=(1, 2), dssd_samples=1)
    results, law = _sessions(flat_target, sharp_drafter, factory, range(NULL_SESSIONS), RETRY_MAX_NEW,
                             draft=RETRY, fault=fault, hint=_advice)
    fit = _fit(results, law)
    kinds = sum((s.kinds for _, s in results), Counter())
    print(f"sensitive auto with retries: {len(broken)} rounds broken, rounds by kind {dict(kinds)}; {fit}")
    assert len(broken) > NULL_SESSIONS // 5, f"only {len(broken)} rounds broken: the test proves little"
    assert sum(n > NULL_SESSIONS // 10 for n in kinds.values()) >= 2, f"auto hardly changed its mind: {kinds}"
    assert fit.p_value > P_VALUE_CUT, str(fit)


def test_an_edge_only_round_broken_midway_finishes_with_the_same_tokens(flat_target, sharp_drafter) -> None:
    """Its tokens are committed as they arrive; the retry asks for the rest, drawn by position."""
    seen: set = set()

    def fault(direction, msg, device) -> bool:
        key = (id(device), len(device.tokens))
        if direction == "recv" and isinstance(msg, P.Verdict) and msg.more and key not in seen:
            seen.add(key)
            return len(seen) % 2 == 0  # every other token's arrival breaks the stream once
        return False

    edge_only = dict(mode="none", edge_tokens=4)
    broken, _ = _sessions(flat_target, sharp_drafter, DraftSession, range(40), 6, draft=edge_only, fault=fault)
    plain, _ = _sessions(flat_target, sharp_drafter, DraftSession, range(40), 6, draft=edge_only)
    assert len(seen) > 40
    assert [t for t, _ in broken] == [t for t, _ in plain]
