"""The target law with logit bias, repetition / presence / frequency penalties and min-p, in every mode:
greedy identity with transformers' ``generate`` under its own processors (tests/support/reference_law.py),
the exact law at T = 1 on the 8-token pair (in process, a resumed session too, and over gRPC), and the
control the law test must reject: an edge that verifies against the plain law while the device drafts
from the adjusted one."""
from __future__ import annotations

import math
from dataclasses import replace

import grpc
import pytest
import torch

from specdec.common import protocol as P
from specdec.common.adjust import NO_ADJUST, LogitAdjust
from specdec.common.modeling import encode_prompt, vocab_fingerprint
from specdec.common.modes import Mode
from specdec.device.client import EdgeError
from specdec.device.session import DraftSession
from specdec.edge.verifier import VerifierSession
from tests.support import reference_law
from tests.support.harness import device_config, edge, load, run, run_sessions, target_greedy
from tests.support.inprocess import cut_the_second_verdict, run_seeds
from tests.support.laws import (COMPRESSING_MODES, GROSS_CONTROL_SESSIONS, MODES, TREE_LAW, TREE_MODES,
                                assert_lossless, assert_rejected, exact_law, law_counts, prompt_ids)

PROMPTS = ["w1 w2 w3", "w40 w7", "w300 w301 w302 w303 w9"]
MAX_NEW = 24
PENALTIES = dict(repetition_penalty=1.3, presence_penalty=0.4, frequency_penalty=0.3)


def _greedy_adjust(target, prompt: list[int]) -> LogitAdjust:
    """Penalties, a ban on the plain greedy decode's first token and a push to its fourth: a law whose
    greedy decode differs from the plain one (checked), so a path that ignores it is seen."""
    plain = reference_law.greedy(target, prompt, MAX_NEW, NO_ADJUST)
    return LogitAdjust.of({plain[0]: -100.0, plain[3]: 4.0}, **PENALTIES)


class DraftsFromThePlainLaw(DraftSession):
    """A device that does not shape its q with the law's bias and penalties (lossless still: the edge
    verifies against its own law), for the acceptance comparison."""

    def __init__(self, drafter, hello, **kw):
        super().__init__(drafter, hello, **kw)
        shaping = self.drafting.model.shaping
        shaping.law = replace(shaping.law, adjust=NO_ADJUST)


def _in_process(pair, mode_kw: dict, prompt: str, adjust: LogitAdjust, session_factory=DraftSession):
    target, drafter = load(str(pair[0])), load(str(pair[1]))
    ids = encode_prompt(drafter.tokenizer, prompt, raw=True)
    cfg = device_config(temperature=0.0, max_new_tokens=MAX_NEW, draft_len=4, adjust=adjust, **mode_kw)
    hello = cfg.hello(vocab_fingerprint(drafter.tokenizer), drafter.vocab_size, seed=0)
    [(tokens, session)] = run_seeds(target, drafter, hello, ids, MAX_NEW, [0], session_factory)
    return tokens, session


@pytest.mark.parametrize("name", list(COMPRESSING_MODES))
def test_greedy_equals_generate_with_the_same_processors(accepting_pair_v512, name) -> None:
    target = load(str(accepting_pair_v512[0]))
    tok = load(str(accepting_pair_v512[1])).tokenizer
    accepted = {"shaped": 0, "plain": 0}
    for prompt in PROMPTS:
        ids = encode_prompt(tok, prompt, raw=True)
        adjust = _greedy_adjust(target, ids)
        expected = reference_law.greedy(target, ids, MAX_NEW, adjust)
        assert expected != target_greedy(accepting_pair_v512[0], ids, MAX_NEW), "the law changed nothing"
        tokens, session = _in_process(accepting_pair_v512, COMPRESSING_MODES[name], prompt, adjust)
        assert tokens == expected, f"{name}, prompt {prompt!r}"
        accepted["shaped"] += session.stats.accepted_tokens
        tokens, session = _in_process(accepting_pair_v512, COMPRESSING_MODES[name], prompt, adjust,
                                      DraftsFromThePlainLaw)
        assert tokens == expected, f"{name}, plain q, prompt {prompt!r}"
        accepted["plain"] += session.stats.accepted_tokens
    if name != "none":
        # at T = 0 acceptance is a function of the drafts alone: a q shaped like the target's law keeps
        # drafts off banned and penalised tokens
        assert accepted["shaped"] > 0 and accepted["shaped"] >= accepted["plain"], accepted


ALONE = {"bias": lambda plain: LogitAdjust.of({plain[0]: -100.0, plain[3]: 4.0}),
         "repetition": lambda plain: LogitAdjust.of(repetition_penalty=1.3),
         "presence and frequency": lambda plain: LogitAdjust.of(presence_penalty=0.4, frequency_penalty=0.3)}


@pytest.mark.parametrize("transform", list(ALONE))
@pytest.mark.parametrize("name", ["tslt", "dssd", "gumbel", "none", "tree"])
def test_each_transform_alone_in_greedy(accepting_pair_v512, name, transform) -> None:
    target = load(str(accepting_pair_v512[0]))
    ids = encode_prompt(load(str(accepting_pair_v512[1])).tokenizer, PROMPTS[0], raw=True)
    adjust = ALONE[transform](reference_law.greedy(target, ids, MAX_NEW, NO_ADJUST))
    tokens, _ = _in_process(accepting_pair_v512, COMPRESSING_MODES[name], PROMPTS[0], adjust)
    assert tokens == reference_law.greedy(target, ids, MAX_NEW, adjust), (name, transform)


@pytest.mark.parametrize("name", ["tslt", "none", "dssd"])
def test_greedy_over_grpc_equals_generate(accepting_pair_v512, name) -> None:
    """The law on the wire (Hello.adjust, Prompt.prompt_len) and through the edge server's batching."""
    target_dir, drafter_dir = accepting_pair_v512
    target, tok = load(str(target_dir)), load(str(drafter_dir)).tokenizer
    adjusts = [_greedy_adjust(target, encode_prompt(tok, p, raw=True)) for p in PROMPTS]

    async def main():
        async with edge(target_dir) as address:
            return [await run_sessions(address, drafter_dir, device_config(
                temperature=0.0, max_new_tokens=MAX_NEW, adjust=a, **COMPRESSING_MODES[name]), prompt, [0])
                for prompt, a in zip(PROMPTS, adjusts)]

    for prompt, a, [(tokens, result, _)] in zip(PROMPTS, adjusts, run(main())):
        assert result.welcome.adjusts_law
        assert tokens == reference_law.greedy(target, encode_prompt(tok, prompt, raw=True), MAX_NEW, a), prompt


# -- the exact law at T = 1 ------------------------------------------------------------------------
LAW_ADJUST = LogitAdjust.of({3: 1.5, 5: -2.0}, repetition_penalty=1.6, presence_penalty=0.8, frequency_penalty=0.5)
LAW = dict(adjust=LAW_ADJUST, target_min_p=0.08)
# The default tier runs a chain, DSSD (its fallback rows come from the shaped logits), the race modes
# (gumbel, edge-only) and a tree; the other chain codecs share the chain's path and run in the slow tier.
DEFAULT_LAW_MODES = ("tslt", "dssd", "gumbel", "none")


def _shaped_law_differs(pair) -> None:
    plain = exact_law(str(pair[0]), prompt_ids(pair[1]))
    shaped = exact_law(str(pair[0]), prompt_ids(pair[1]), adjust=LAW_ADJUST, min_p=LAW["target_min_p"])
    tv = 0.5 * sum(abs(plain.get(s, 0.0) - shaped.get(s, 0.0)) for s in set(plain) | set(shaped))
    assert tv > 0.2, f"the law moved only TV {tv:.3f}: a path that ignores it would pass"


@pytest.mark.parametrize("name", [n if n in DEFAULT_LAW_MODES else pytest.param(n, marks=pytest.mark.slow)
                                  for n in MODES])
def test_every_mode_samples_the_adjusted_law(twin, tiny_pair_v8, name) -> None:
    _shaped_law_differs(tiny_pair_v8)
    patches = [(__import__("specdec.common.verification", fromlist=["x"]), "DSSD_TAIL_SAMPLES", 1)] \
        if name == "dssd" else ()
    counts, law, _ = law_counts(twin, *tiny_pair_v8, patches=patches, **LAW, **MODES[name])
    assert_lossless(counts, law, f"{name}, bias + penalties + min-p")


def test_a_tree_samples_the_adjusted_law(twin, tiny_pair_v8) -> None:
    counts, law, _ = law_counts(twin, *tiny_pair_v8, **LAW, **TREE_LAW, **TREE_MODES["dense"])
    assert_lossless(counts, law, "tree <2,2>, bias + penalties + min-p")


@pytest.mark.slow  # by default: test_a_resumed_session_draws_the_uninterrupted_tokens, token for token
def test_a_resumed_session_samples_the_adjusted_law(twin, tiny_pair_v8) -> None:
    counts, law, results = law_counts(twin, *tiny_pair_v8, run_kw=dict(fault=cut_the_second_verdict),
                                      **LAW, **MODES["tslt"])
    assert_lossless(counts, law, "resumed on a fresh edge, bias + penalties + min-p")


REPLAY_SEEDS = range(24)
REPLAY_TOKENS = 12


class ForgetsThePromptLength(VerifierSession):
    """A fresh edge that takes a resumed session's whole prefix as its prompt: its penalties then
    count no generated token before the cut (the bug Prompt.prompt_len prevents)."""

    def prefill(self, prompt: P.Prompt) -> None:
        super().prefill(replace(prompt, prompt_len=0))


def _replayed(pair, edge_cls) -> tuple[int, int]:
    """(sessions cut and resumed, of those the ones whose tokens are the uninterrupted session's)."""
    target, drafter = load(str(pair[0])), load(str(pair[1]))
    cfg = device_config(temperature=1.0, max_new_tokens=REPLAY_TOKENS, draft_len=2, **LAW, **MODES["tslt"])
    hello = cfg.hello(vocab_fingerprint(drafter.tokenizer), drafter.vocab_size, seed=0)
    ids = list(prompt_ids(pair[1]))
    whole = run_seeds(target, drafter, hello, ids, REPLAY_TOKENS, REPLAY_SEEDS)
    cut = run_seeds(target, drafter, hello, ids, REPLAY_TOKENS, REPLAY_SEEDS, fault=cut_the_second_verdict,
                    edge_cls=edge_cls)
    resumed = [(a, b) for (a, _), (b, session) in zip(whole, cut) if getattr(session, "verdicts_seen", 0) >= 2]
    return len(resumed), sum(a == b for a, b in resumed)


def test_a_resumed_session_draws_the_uninterrupted_tokens(tiny_pair_v8) -> None:
    """The penalties' state comes back from the verified prefix and its prompt length alone: cut and
    resumed on a fresh edge, every session gives the uninterrupted one's tokens."""
    resumed, same = _replayed(tiny_pair_v8, VerifierSession)
    assert resumed >= len(REPLAY_SEEDS) // 2, "too few sessions were cut after their first round"
    assert same == resumed, f"{resumed - same} of {resumed} resumed sessions drew other tokens"


def test_control_edge_forgetting_the_prompt_length_diverges(tiny_pair_v8) -> None:
    resumed, same = _replayed(tiny_pair_v8, ForgetsThePromptLength)
    assert same < resumed, "the replay check would not see the penalties' history lost on a resume"


class VerifiesThePlainLaw(VerifierSession):
    """The classic bug the law test must see: the edge verifies against the law without bias, penalties
    and min-p, while the device drafts from the adjusted one."""

    def __init__(self, *args, **kw):
        super().__init__(*args, **kw)
        self.law = type(self.law)(self.law.temperature, self.law.top_k, self.law.top_p)


def test_control_edge_verifying_the_plain_law_is_rejected(twin, tiny_pair_v8) -> None:
    counts, law, _ = law_counts(twin, *tiny_pair_v8, num_sessions=GROSS_CONTROL_SESSIONS,
                                run_kw=dict(edge_cls=VerifiesThePlainLaw), **LAW, **MODES["tslt"])
    assert_rejected(counts, law, "edge verifying the plain law")


def test_law_over_grpc(twin, tiny_pair_v8) -> None:
    counts, law, _ = law_counts(twin, *tiny_pair_v8, over_grpc=True, **LAW, **MODES["tslt"])
    assert_lossless(counts, law, "over gRPC, bias + penalties + min-p")


def test_a_device_stops_on_an_edge_that_does_not_apply_the_law(accepting_pair_v512, monkeypatch) -> None:
    """An edge from before Hello.adjust ignores it (and says nothing of it in its Welcome): the session
    ends with FAILED_PRECONDITION before any round, instead of sampling the plain law; a plain session
    on the same edge runs."""
    target_dir, drafter_dir = accepting_pair_v512
    older = VerifierSession.welcome
    monkeypatch.setattr(VerifierSession, "welcome", lambda self: replace(older(self), adjusts_law=False))
    adjusted = device_config(temperature=0.0, max_new_tokens=8, adjust=LogitAdjust.of({5: -100.0}), **MODES["tslt"])
    plain = device_config(temperature=0.0, max_new_tokens=8, **MODES["tslt"])

    async def main():
        async with edge(target_dir) as address:
            with pytest.raises(EdgeError) as refused:
                await run_sessions(address, drafter_dir, adjusted, PROMPTS[0], [0])
            [(tokens, _, session)] = await run_sessions(address, drafter_dir, plain, PROMPTS[0], [0])
            return refused.value, tokens, session

    refused, tokens, session = run(main())
    assert refused.code == grpc.StatusCode.FAILED_PRECONDITION and "does not apply" in refused.details
    assert len(tokens) == 8 and session.stats.rounds >= 1


# -- logprobs ----------------------------------------------------------------------------------------
LOGPROB_MODES = {"tslt": dict(mode=Mode.TSLT, top_k=16), "dense": dict(mode=Mode.DENSE, dense_dtype="fp16"),
                 "gumbel": dict(mode=Mode.GUMBEL), "none": dict(mode=Mode.NONE),
                 "tree": dict(mode=Mode.TSLT, top_k=16, tree=(2, 2))}
LOGPROB_TOL = 1e-4  # float32 on the wire; the law itself is computed as the reference computes it
TOP_N = 5


@pytest.mark.parametrize("temperature", [0.0, 0.8])
@pytest.mark.parametrize("name", list(LOGPROB_MODES))
def test_logprobs_are_the_laws_at_every_emitted_position(accepting_pair_v512, name, temperature) -> None:
    """Each emitted token's log-probability and the top N, against transformers' own processors and
    warpers at that position (at T = 0: the shaped logits' log-softmax at temperature 1)."""
    target, drafter = load(str(accepting_pair_v512[0])), load(str(accepting_pair_v512[1]))
    ids = encode_prompt(drafter.tokenizer, PROMPTS[1], raw=True)
    adjust = LogitAdjust.of({7: -3.0, 9: 2.0}, **PENALTIES)
    cfg = device_config(temperature=temperature, max_new_tokens=MAX_NEW, draft_len=4, adjust=adjust, target_min_p=0.02,
                        logprobs=TOP_N, **LOGPROB_MODES[name])
    hello = cfg.hello(vocab_fingerprint(drafter.tokenizer), drafter.vocab_size, seed=5)
    [(tokens, session)] = run_seeds(target, drafter, hello, ids, MAX_NEW, [5])
    assert len(session.logprobs) >= len(tokens) > 0  # committed tokens past the delivered ones have theirs too
    for i, (token, got) in enumerate(zip(tokens, session.logprobs)):
        law = reference_law.next_probs(target, tuple(ids), tuple(tokens[:i]), adjust, temperature or 1.0,
                                       0.02 if temperature else 0.0)
        assert abs(got.logprob - math.log(law[token])) < LOGPROB_TOL, (i, got.logprob, math.log(law[token]))
        top = torch.topk(law, TOP_N)
        assert [t for t, _ in got.top] == top.indices.tolist()[:len(got.top)], i
        assert all(abs(lp - math.log(p)) < LOGPROB_TOL for (_, lp), p in zip(got.top, top.values.tolist())), i


def test_a_logprobs_session_refuses_dssd_rounds(accepting_pair_v512) -> None:
    target, drafter = load(str(accepting_pair_v512[0])), load(str(accepting_pair_v512[1]))
    cfg = device_config(temperature=1.0, max_new_tokens=8, logprobs=0, **MODES["dssd"])
    hello = cfg.hello(vocab_fingerprint(drafter.tokenizer), drafter.vocab_size, seed=0)
    with pytest.raises(ValueError, match="no DSSD round"):
        run_seeds(target, drafter, hello, encode_prompt(drafter.tokenizer, PROMPTS[0], raw=True), 8, [0])
