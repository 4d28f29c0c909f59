"""A grammar in the target law (common/grammar.py, llguidance): greedy identity in every mode with
``generate`` under the engine's own masks (tests/support/reference_law.GrammarMask), the exact law at
T = 1 with a grammar, bias and penalties together, a resumed session's tokens, and the control the law
test must reject: an edge that verifies without the grammar while the device drafts within it."""
from __future__ import annotations

import json

import jsonschema
import pytest

from specdec.common.adjust import NO_ADJUST, LogitAdjust
from specdec.common.grammar import Grammar, GrammarKind
from specdec.common.modeling import encode_prompt, vocab_fingerprint
from specdec.device.session import DraftSession
from specdec.edge.verifier import VerifierSession
from tests.support import reference_law
from tests.support.harness import device_config, load
from tests.support.inprocess import cut_the_second_verdict, run_seeds
from tests.support.laws import (COMPRESSING_MODES, GROSS_CONTROL_SESSIONS, MODES, TREE_LAW, TREE_MODES,
                                assert_lossless, assert_rejected, law_counts)

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 6},
                                           "n": {"type": "integer", "minimum": 0, "maximum": 99}},
          "required": ["name", "n"], "additionalProperties": False}
JSON_GRAMMAR = Grammar(GrammarKind.JSON_SCHEMA, json.dumps(SCHEMA))
PROMPTS = ["Answer in JSON: ", "{", "name and n? "]
MAX_NEW = 40


class DraftsOutsideTheGrammar(DraftSession):
    """A device whose q is not masked by the grammar (lossless still), for the acceptance comparison."""

    def __init__(self, drafter, hello, **kw):
        super().__init__(drafter, hello, **kw)
        self.drafting.model.shaping.grammar = None


def _in_process(pair, mode_kw: dict, prompt_ids: list[int], session_factory=DraftSession, **law):
    target, drafter = load(str(pair[0])), load(str(pair[1]))
    cfg = device_config(temperature=0.0, max_new_tokens=MAX_NEW, draft_len=4, **law, **mode_kw)
    hello = cfg.hello(vocab_fingerprint(drafter.tokenizer), drafter.vocab_size, seed=0)
    [(tokens, session)] = run_seeds(target, drafter, hello, prompt_ids, MAX_NEW, [0], session_factory)
    return tokens, session


@pytest.mark.parametrize("name", list(COMPRESSING_MODES))
def test_greedy_under_a_json_schema_equals_generate_with_the_engines_masks(byte_pair, name) -> None:
    target, tok = load(str(byte_pair[0])), load(str(byte_pair[1])).tokenizer
    accepted = {"masked": 0, "unmasked": 0}
    for prompt in PROMPTS:
        ids = encode_prompt(tok, prompt, raw=True)
        expected = reference_law.greedy(target, ids, MAX_NEW, NO_ADJUST, JSON_GRAMMAR)
        tokens, session = _in_process(byte_pair, COMPRESSING_MODES[name], ids, grammar=JSON_GRAMMAR)
        assert tokens == expected, f"{name}, prompt {prompt!r}: {tok.decode(tokens)!r}"
        accepted["masked"] += session.stats.accepted_tokens
        tokens, session = _in_process(byte_pair, COMPRESSING_MODES[name], ids, DraftsOutsideTheGrammar,
                                      grammar=JSON_GRAMMAR)
        assert tokens == expected, f"{name}, unmasked q, prompt {prompt!r}"
        accepted["unmasked"] += session.stats.accepted_tokens
        if tokens[-1] in target.eos_token_ids:  # finished: the text is the schema's
            jsonschema.validate(json.loads(tok.decode(tokens, skip_special_tokens=True)), SCHEMA)
    if name != "none":
        assert accepted["masked"] > 0 and accepted["masked"] >= accepted["unmasked"], accepted


def test_the_greedy_decodes_finish_as_valid_json(byte_pair) -> None:
    """Not vacuous: at least one prompt's decode ends within MAX_NEW tokens, with its schema's JSON."""
    target, tok = load(str(byte_pair[0])), load(str(byte_pair[1])).tokenizer
    done = [reference_law.greedy(target, encode_prompt(tok, p, raw=True), MAX_NEW, NO_ADJUST, JSON_GRAMMAR)
            for p in PROMPTS]
    finished = [d for d in done if d[-1] in target.eos_token_ids]
    assert finished, [tok.decode(d) for d in done]
    for d in finished:
        jsonschema.validate(json.loads(tok.decode(d, skip_special_tokens=True)), SCHEMA)


# -- the exact law at T = 1 ------------------------------------------------------------------------
# Three letters of which the grammar allows few at each place; with bias and penalties on top.
REGEX = Grammar(GrammarKind.REGEX, "[ab][abc][bcd]")
LAW = dict(grammar=REGEX, adjust=LogitAdjust.of({ord("c") + 2: 1.0}, presence_penalty=0.5))
DEFAULT_LAW_MODES = ("tslt", "dssd", "gumbel", "none")


@pytest.mark.parametrize("name", [n if n in DEFAULT_LAW_MODES else pytest.param(n, marks=pytest.mark.slow)
                                  for n in MODES])
def test_every_mode_samples_the_grammars_law(twin, byte_pair, name) -> None:
    patches = [(__import__("specdec.common.verification", fromlist=["x"]), "DSSD_TAIL_SAMPLES", 1)] \
        if name == "dssd" else ()
    counts, law, _ = law_counts(twin, *byte_pair, patches=patches, **LAW, **MODES[name])
    assert len(law) >= 6, law
    assert_lossless(counts, law, f"{name}, regex + bias + presence")


def test_a_tree_samples_the_grammars_law(twin, byte_pair) -> None:
    counts, law, _ = law_counts(twin, *byte_pair, **LAW, **TREE_LAW, **TREE_MODES["dense"])
    assert_lossless(counts, law, "tree <2,2>, regex + bias + presence")


@pytest.mark.slow  # by default: test_a_resumed_session_under_a_grammar_draws_the_uninterrupted_tokens
def test_a_resumed_session_samples_the_grammars_law(twin, byte_pair) -> None:
    counts, law, _ = law_counts(twin, *byte_pair, run_kw=dict(fault=cut_the_second_verdict), **LAW, **MODES["tslt"])
    assert_lossless(counts, law, "resumed on a fresh edge, regex + bias + presence")


class VerifiesWithoutTheGrammar(VerifierSession):
    """The classic bug: the edge verifies against the law without the grammar (vLLM #9423's kind)."""

    def __init__(self, *args, **kw):
        super().__init__(*args, **kw)
        self.prefix.grammar = None


def test_control_edge_verifying_without_the_grammar_is_rejected(twin, byte_pair) -> None:
    counts, law, _ = law_counts(twin, *byte_pair, num_sessions=GROSS_CONTROL_SESSIONS,
                                run_kw=dict(edge_cls=VerifiesWithoutTheGrammar), **LAW, **MODES["tslt"])
    assert_rejected(counts, law, "edge verifying without the grammar")


def test_a_resumed_session_under_a_grammar_draws_the_uninterrupted_tokens(byte_pair) -> None:
    """The matcher's state comes back from the verified prefix: cut after the first round and resumed
    on a fresh edge, each session gives the uninterrupted one's tokens, inside the schema."""
    target, drafter = load(str(byte_pair[0])), load(str(byte_pair[1]))
    cfg = device_config(temperature=1.0, max_new_tokens=MAX_NEW, draft_len=3, grammar=JSON_GRAMMAR, **MODES["tslt"])
    hello = cfg.hello(vocab_fingerprint(drafter.tokenizer), drafter.vocab_size, seed=0)
    ids = encode_prompt(drafter.tokenizer, PROMPTS[0], raw=True)
    seeds = range(12)
    whole = run_seeds(target, drafter, hello, ids, MAX_NEW, seeds)
    cut = run_seeds(target, drafter, hello, ids, MAX_NEW, seeds, fault=cut_the_second_verdict)
    assert all(getattr(session, "verdicts_seen", 0) >= 2 for _, session in cut)
    assert [t for t, _ in whole] == [t for t, _ in cut]
    for tokens, _ in whole:
        if tokens[-1] in target.eos_token_ids:
            jsonschema.validate(json.loads(drafter.tokenizer.decode(tokens, skip_special_tokens=True)), SCHEMA)


VALIDITY_SESSIONS = 200


@pytest.mark.slow
def test_json_schema_answers_sampled_through_the_system_are_valid(byte_pair) -> None:
    """200 sessions at T = 1 through the device's round loop and the edge (in process): every answer
    that finishes is valid for the schema, and most finish within MAX_NEW."""
    target, drafter = load(str(byte_pair[0])), load(str(byte_pair[1]))
    cfg = device_config(temperature=1.0, max_new_tokens=2 * MAX_NEW, draft_len=4, grammar=JSON_GRAMMAR,
                        **MODES["tslt"])
    hello = cfg.hello(vocab_fingerprint(drafter.tokenizer), drafter.vocab_size, seed=0)
    ids = encode_prompt(drafter.tokenizer, PROMPTS[0], raw=True)
    finished = 0
    for tokens, _ in run_seeds(target, drafter, hello, ids, 2 * MAX_NEW, range(VALIDITY_SESSIONS)):
        if tokens[-1] in target.eos_token_ids:
            finished += 1
            jsonschema.validate(json.loads(drafter.tokenizer.decode(tokens, skip_special_tokens=True)), SCHEMA)
    assert finished >= 0.9 * VALIDITY_SESSIONS, finished
