"""The law's bias and penalties (common/adjust.py) and min-p (common/sampling.py) against transformers'
own processors and OpenAI's formula (tests/support/reference_law.py), row by row as verification
shapes them, and their trip over the wire."""
from __future__ import annotations

import pytest
import torch
from transformers.generation.logits_process import (MinPLogitsWarper, RepetitionPenaltyLogitsProcessor,
                                                    SequenceBiasLogitsProcessor, TemperatureLogitsWarper,
                                                    TopKLogitsWarper, TopPLogitsWarper)

from specdec.common import protocol as P
from specdec.common import wire
from specdec.common.adjust import History, LogitAdjust, chain_paths
from specdec.common.grammar import Grammar, GrammarKind
from specdec.common.logprobs import TokenLogprob, token_logprobs
from specdec.common.sampling import TargetLaw, min_p_filter
from specdec.common.settings import DraftSettings
from specdec.common.tree import TreeSpec
from tests.support.reference_law import OpenAIPenalties, processors

V = 64
PROMPT = [3, 5, 5, 9, 17]
OUTPUT = [5, 21, 21, 40, 3]
PENALTIES = LogitAdjust.of({5: -7.5, 40: 2.25, 63: 100.0}, repetition_penalty=1.7, presence_penalty=0.6,
                           frequency_penalty=0.45)


def _logits(n: int = 1, seed: int = 0) -> torch.Tensor:  # [n, V], both signs, as a model's
    return torch.randn(n, V, generator=torch.Generator().manual_seed(seed)) * 3


def _one(adjust: LogitAdjust, logits: torch.Tensor, tokens: list[int]) -> torch.Tensor:
    return adjust.apply(logits, History.of(tokens, len(PROMPT), V), [[]] * logits.shape[0])


def test_bias_is_transformers_sequence_bias_bit_for_bit() -> None:
    adjust = LogitAdjust.of({5: -7.5, 40: 2.25, 63: 100.0})
    logits, ids = _logits(), torch.tensor([PROMPT + OUTPUT])
    expected = SequenceBiasLogitsProcessor({(i,): b for i, b in adjust.logit_bias})(ids, logits)
    assert torch.equal(_one(adjust, logits, PROMPT + OUTPUT), expected)


def test_repetition_penalty_is_transformers_bit_for_bit_over_prompt_and_output() -> None:
    adjust = LogitAdjust.of(repetition_penalty=1.7)
    logits, ids = _logits(), torch.tensor([PROMPT + OUTPUT])
    expected = RepetitionPenaltyLogitsProcessor(1.7)(ids, logits.clone())
    got = _one(adjust, logits, PROMPT + OUTPUT)
    assert torch.equal(got, expected)
    assert not torch.equal(got[0, PROMPT], logits[0, PROMPT]), "the prompt's tokens were not penalised"


def test_presence_and_frequency_follow_openai_over_the_output_only() -> None:
    adjust = LogitAdjust.of(presence_penalty=0.6, frequency_penalty=0.45)
    logits, ids = _logits(), torch.tensor([PROMPT + OUTPUT])
    got = _one(adjust, logits, PROMPT + OUTPUT)
    torch.testing.assert_close(got, OpenAIPenalties(len(PROMPT), 0.6, 0.45)(ids, logits), rtol=0, atol=1e-6)
    assert got[0, 9] == logits[0, 9], "a token of the prompt alone was penalised"
    assert torch.isclose(got[0, 21], logits[0, 21] - 2 * 0.45 - 0.6)


def test_all_together_in_generate_order() -> None:
    logits, ids = _logits(seed=1), torch.tensor([PROMPT + OUTPUT])
    expected = processors(PENALTIES, len(PROMPT))(ids, logits.clone())
    torch.testing.assert_close(_one(PENALTIES, logits, PROMPT + OUTPUT), expected, rtol=0, atol=1e-6)


def test_a_chain_rounds_rows_see_the_drafts_before_them() -> None:
    """Row i of a round after the verified prefix is the law after prefix + drafts[:i]: the state
    advances through the drafts and nothing is kept (a rejection rolls back by construction)."""
    drafts = [21, 9, 9, 5]
    logits = _logits(len(drafts) + 1, seed=2)
    rows = PENALTIES.apply(logits, History.of(PROMPT + OUTPUT, len(PROMPT), V), chain_paths(drafts))
    for i in range(len(drafts) + 1):
        alone = _one(PENALTIES, logits[i:i + 1], PROMPT + OUTPUT + drafts[:i])
        assert torch.equal(rows[i:i + 1], alone), i


def test_tree_paths_walk_from_the_root() -> None:
    spec = TreeSpec.from_config((2, 2))
    nodes = [0, 11, 12, 13, 14, 15, 16]
    paths = spec.paths(nodes)
    assert paths[0] == [] and paths[1] == [11] and paths[2] == [12]
    assert paths[3] == [11, 13] and paths[5] == [12, 15] and paths[6] == [12, 16]
    with pytest.raises(ValueError):
        spec.paths(nodes[:-1])


def test_the_input_is_left_as_it_was() -> None:
    logits = _logits()
    before = logits.clone()
    _one(PENALTIES, logits, PROMPT + OUTPUT)
    assert torch.equal(logits, before)


def test_min_p_is_transformers_warper_bit_for_bit() -> None:
    scores = _logits(3) / 0.7
    assert torch.equal(min_p_filter(scores, 0.1), MinPLogitsWarper(0.1)(None, scores.clone()))


def test_target_law_with_min_p_is_generates_warpers_in_order() -> None:
    """Temperature, top-k, top-p, then min-p: transformers' order (generation/utils.py)."""
    logits = _logits(2, seed=3)
    law = TargetLaw(0.8, top_k=20, top_p=0.9, min_p=0.2)
    scores = logits.clone()
    for warper in (TemperatureLogitsWarper(0.8), TopKLogitsWarper(20), TopPLogitsWarper(0.9), MinPLogitsWarper(0.2)):
        scores = warper(None, scores)
    assert torch.equal(law.probs32(logits), torch.softmax(scores, dim=-1))
    assert (law.probs32(logits) == 0).sum() > (TargetLaw(0.8, 20, 0.9).probs32(logits) == 0).sum(), \
        "min-p removed nothing beyond top-k / top-p: the test would not see it ignored"


def test_greedy_takes_the_argmax_of_the_adjusted_logits() -> None:
    logits = torch.zeros(1, V)
    logits[0, 7] = 1.0
    law = TargetLaw(0.0, adjust=LogitAdjust.of({7: -5.0, 8: 0.5}))
    assert int(law.probs(law.shaped(logits, None, [[]])).argmax()) == 8


def test_no_adjustment_leaves_the_logits_object_itself() -> None:
    logits = _logits()
    assert TargetLaw(1.0).shaped(logits, None, [[]]) is logits


@pytest.mark.parametrize("kw, message", [
    (dict(logit_bias={3: 101.0}), "outside"), (dict(logit_bias={3: float("nan")}), "outside"),
    (dict(logit_bias={-1: 1.0}), "outside the vocabulary"), (dict(presence_penalty=2.5), "presence_penalty"),
    (dict(frequency_penalty=-3.0), "frequency_penalty"), (dict(repetition_penalty=0.0), "repetition_penalty"),
    (dict(repetition_penalty=float("inf")), "repetition_penalty")])
def test_out_of_range_values_are_refused(kw, message) -> None:
    with pytest.raises(ValueError, match=message):
        LogitAdjust.of(**kw)


def test_bias_ids_beyond_the_vocabulary_are_refused() -> None:
    with pytest.raises(ValueError, match="outside the vocabulary"):
        LogitAdjust.of({V: 1.0}).check(V)


def test_hello_with_the_law_round_trips_the_wire() -> None:
    hello = P.Hello(vocab_fingerprint="f", vocab_size=V, temperature=0.75, draft=DraftSettings(),
                    target_min_p=0.0625, adjust=PENALTIES)
    back = wire.hello_from_pb(wire.hello_to_pb(hello).hello)
    assert (back.adjust, back.target_min_p) == (PENALTIES, 0.0625) and back.adjusts_law
    plain = wire.hello_from_pb(wire.hello_to_pb(P.Hello(vocab_fingerprint="f", vocab_size=V, temperature=0.75,
                                                        draft=DraftSettings())).hello)
    assert plain.adjust == LogitAdjust() and plain.target_min_p == 0 and not plain.adjusts_law


def test_prompt_len_and_welcome_flag_round_trip_the_wire() -> None:
    prompt = P.Prompt((1, 2, 3, 4), prompt_len=2)
    assert wire.prompt_from_pb(wire.prompt_to_pb(prompt).prompt) == prompt
    welcome = P.Welcome("s", "m", V, 128, 8, 64, adjusts_law=True)
    assert wire.welcome_from_pb(wire.welcome_to_pb(welcome).welcome).adjusts_law


def test_a_malformed_bias_on_the_wire_is_refused() -> None:
    msg = wire.hello_to_pb(P.Hello(vocab_fingerprint="f", vocab_size=V, temperature=0.7, draft=DraftSettings(),
                                   adjust=LogitAdjust.of({3: 1.0}))).hello
    msg.adjust.bias_values.append(2.0)
    with pytest.raises(ValueError, match="2 values"):
        wire.hello_from_pb(msg)
    msg.adjust.bias_ids.append(3)
    with pytest.raises(ValueError, match="distinct"):
        wire.hello_from_pb(msg)


@pytest.mark.parametrize("grammar", [Grammar(GrammarKind.JSON_OBJECT), Grammar(GrammarKind.REGEX, "[ab]+"),
                                     Grammar(GrammarKind.LARK, 'start: "x"'), Grammar(GrammarKind.JSON_SCHEMA, "{}")])
def test_a_grammar_round_trips_the_wire(grammar) -> None:
    hello = P.Hello(vocab_fingerprint="f", vocab_size=V, temperature=1.0, draft=DraftSettings(), grammar=grammar)
    back = wire.hello_from_pb(wire.hello_to_pb(hello).hello)
    assert back.grammar == grammar and back.adjusts_law


LOGPROB_VOCAB = 49152  # the embedded target's


def _verdict_bytes(n_tokens: int, top_n: int, sampled: bool, seed: int = 0) -> int:
    """A verdict's bytes with ``n_tokens`` emitted tokens (drawn from peaked rows over the embedded
    target's vocabulary, or their argmax) and their logprobs as the edge sends them (-1: none)."""
    g = torch.Generator().manual_seed(seed)
    probs = torch.softmax(torch.randn(n_tokens, LOGPROB_VOCAB, generator=g, dtype=torch.float64) * 3, dim=-1)
    tokens = (torch.multinomial(probs, 1, generator=g)[:, 0] if sampled else probs.argmax(-1)).tolist()
    logprobs = token_logprobs(probs, tokens, top_n, compact=True) if top_n >= 0 else ()
    return wire.verdict_to_pb(P.Verdict(3, n_tokens - 1, tokens[-1], logprobs=logprobs)).ByteSize()


def test_logprobs_round_trip_the_wire_in_descending_order() -> None:
    logprobs = (TokenLogprob(-0.5, ((40000, -0.125), (7, -0.5), (300, -2.0))), TokenLogprob(-1.0, ((9, -1.0),)))
    back = wire.verdict_from_pb(wire.verdict_to_pb(P.Verdict(1, 1, 5, logprobs=logprobs)).verdict).logprobs
    assert [t.top for t in back] == [t.top for t in logprobs]
    assert [t.logprob for t in back] == [t.logprob for t in logprobs]  # exact in float32


@pytest.mark.parametrize("top_n", [0, 5, 20])
@pytest.mark.parametrize("sampled", [False, True], ids=["argmax", "sampled"])
def test_logprobs_cost_on_the_downlink(top_n, sampled) -> None:
    """Nothing without them; 4 bytes a token for its own; each top entry a 4-byte float and the varint
    of its id's gap, the token itself left out when among them (always when it is the argmax). The
    issue's budget, 6 bytes a token per top entry, holds where the token is among its top."""
    assert _verdict_bytes(8, -1, sampled) < 16
    assert _verdict_bytes(8, 0, sampled) - _verdict_bytes(8, -1, sampled) <= 8 * 4 + 2
    if top_n:
        per_entry = (_verdict_bytes(8, top_n, sampled) - _verdict_bytes(8, 0, sampled)) / (8 * top_n)
        print(f"top {top_n}, {'sampled' if sampled else 'argmax'}: {per_entry:.2f} bytes an entry")
        assert per_entry <= (6.0 if not sampled else 6.6), per_entry


def test_the_device_puts_the_token_back_into_its_top() -> None:
    probs = torch.softmax(torch.randn(4, 50, generator=torch.Generator().manual_seed(1), dtype=torch.float64), -1)
    tokens = [int(probs[0].argmax()), 7, 9, int(probs[3].argsort()[-2])]
    full = token_logprobs(probs, tokens, 5)
    sent = wire.verdict_from_pb(wire.verdict_to_pb(P.Verdict(1, 3, tokens[-1], logprobs=token_logprobs(
        probs, tokens, 5, compact=True))).verdict).logprobs
    assert sent[0].in_top and len(sent[0].top) == 4
    back = [t.complete(x) for t, x in zip(sent, tokens)]
    assert [[i for i, _ in t.top] for t in back] == [[i for i, _ in t.top] for t in full]
    assert all(abs(a - b) < 1e-6 for t, f in zip(back, full) for (_, a), (_, b) in zip(t.top, f.top))
