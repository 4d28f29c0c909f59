"""A grammar in the target law: which tokens may follow a prefix (structured outputs), with llguidance.

llguidance (MIT, a wheel with no dependencies; the engine behind OpenAI's own structured outputs and
one of vLLM's and SGLang's backends) compiles a JSON schema, a regex or a Lark (EBNF) grammar against
the tokenizer's bytes and answers, for a prefix, the bitmask of the tokens that keep it in the grammar.
It was picked over xgrammar because it pulls nothing in (xgrammar needs triton, tvm-ffi, pydantic and
transformers at fixed versions) and because its matcher rolls back consumed tokens, which is what a
rejected draft needs.

Both sides hold a :class:`GrammarState` for a session and ask it for the masks of the rows they
shape: the edge for every row it verifies, the device for every q it drafts from. The state follows
the prefix it is asked about (longest common prefix with what it has consumed, then rollback and
consume), so drafts advance it, a rejection rolls it back, and a resumed or moved session rebuilds it
from the verified prefix alone.
"""
from __future__ import annotations

import enum
import json
import time
from dataclasses import dataclass
from functools import lru_cache
from typing import Sequence

import numpy as np
import torch

# A grammar's source in a Hello: large enough for a JSON schema of a few dozen tools; larger ones
# would make every Hello (and each side's compile) grow with what a client sends.
MAX_GRAMMAR_BYTES = 64 * 1024
# Above this a grammar's compile is refused (a session must not hold an edge's worker for seconds).
MAX_COMPILE_SECONDS = 2.0
# Compiled grammars kept per side (templates: each session copies one, which costs microseconds).
COMPILED_CACHE = 64
# The logit of a token the grammar excludes: its softmax weight is exactly 0 in float32 at any
# temperature, and it is finite (the law's checks ask finite logits), unlike transformers' -inf.
MASKED_LOGIT = -1e30
JSON_DEFAULTS = {"whitespace_flexible": False}


class GrammarError(ValueError):
    """A grammar the engine refuses, or one the vocabulary cannot satisfy (the engine's message)."""


class GrammarKind(enum.Enum):
    JSON_SCHEMA = "json_schema"   # a JSON schema (OpenAI's response_format json_schema, tools)
    JSON_OBJECT = "json_object"   # any JSON object (response_format json_object)
    REGEX = "regex"
    LARK = "lark"                 # llguidance's Lark dialect (EBNF)


@dataclass(frozen=True)
class Grammar:
    """What a session's output must match. ``source``: the schema (JSON text), regex or Lark text."""

    kind: GrammarKind
    source: str = ""

    def check(self) -> None:
        """GrammarError on a source over MAX_GRAMMAR_BYTES or a schema that is not JSON."""
        if len(self.source.encode()) > MAX_GRAMMAR_BYTES:
            raise GrammarError(f"grammar of {len(self.source.encode())} bytes exceeds {MAX_GRAMMAR_BYTES}")
        if self.kind is GrammarKind.JSON_SCHEMA:
            try:
                json.loads(self.source)
            except ValueError as exc:
                raise GrammarError(f"JSON schema is not JSON: {exc}") from None

    def llguidance_grammar(self) -> str:
        import llguidance
        # compact JSON unless the schema's "x-guidance" says otherwise: a model is not made to choose
        # among runs of whitespace (a small one can spend its whole budget on them)
        if self.kind is GrammarKind.JSON_SCHEMA:
            return llguidance.LLMatcher.grammar_from_json_schema(self.source, defaults=JSON_DEFAULTS)
        if self.kind is GrammarKind.JSON_OBJECT:
            return llguidance.LLMatcher.grammar_from_json_schema('{"type": "object"}', defaults=JSON_DEFAULTS)
        if self.kind is GrammarKind.REGEX:
            return llguidance.LLMatcher.grammar_from_regex(self.source)
        return llguidance.LLMatcher.grammar_from_lark(self.source)


# ------------------------------------------------------------------------------------ tokenizers
_TOKENIZERS: dict[tuple[int, int], object] = {}


def ll_tokenizer(tokenizer, vocab_size: int, eos_ids: Sequence[int]):
    """llguidance's view of ``tokenizer`` (cached per tokenizer object), from its Rust tokenizer;
    GrammarError for one whose decoder does not say how its tokens become bytes (word-level
    vocabularies): no grammar can be matched against it."""
    key = (id(tokenizer), vocab_size)
    if key not in _TOKENIZERS:
        import llguidance.hf
        try:
            made = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size, eos_token=list(eos_ids))
        except ValueError as exc:
            raise GrammarError(f"grammars need a tokenizer whose tokens are bytes: {exc}") from None
        _TOKENIZERS[key] = (tokenizer, made)  # the tokenizer kept alive, so that its id is not reused
    return _TOKENIZERS[key][1]


# ------------------------------------------------------------------------------------ matching
@lru_cache(maxsize=COMPILED_CACHE)
def _compiled(ll_tok, grammar: Grammar):
    """A matcher at the grammar's start (the template each session copies); GrammarError if refused."""
    import llguidance
    grammar.check()
    try:
        source = grammar.llguidance_grammar()
    except Exception as exc:  # the engine's own message: a schema or regex it cannot read
        raise GrammarError(str(exc)) from None
    start = time.perf_counter()
    matcher = llguidance.LLMatcher(ll_tok, source, log_level=0)
    seconds = time.perf_counter() - start
    if matcher.is_error():
        raise GrammarError(matcher.get_error())
    if seconds > MAX_COMPILE_SECONDS:
        raise GrammarError(f"grammar took {seconds:.1f} s to compile (limit {MAX_COMPILE_SECONDS:g} s)")
    if not _unpack(matcher.compute_bitmask(), ll_tok.vocab_size).any():
        raise GrammarError("no token of the vocabulary can start this grammar")
    return matcher


def _unpack(bitmask: bytes, vocab_size: int) -> torch.Tensor:  # [V] bool
    bits = np.unpackbits(np.frombuffer(bitmask, dtype=np.uint8), bitorder="little")[:vocab_size]
    return torch.from_numpy(bits.astype(bool))


class GrammarState:
    """One session's matcher, following whichever prefix it is asked about (module docstring)."""

    def __init__(self, grammar: Grammar, tokenizer, vocab_size: int, eos_ids: Sequence[int]):
        ll_tok = ll_tokenizer(tokenizer, vocab_size, eos_ids)
        self.vocab_size = vocab_size
        self._matcher = _compiled(ll_tok, grammar).deep_copy()
        self._consumed: list[int] = []   # the generated tokens the matcher has taken

    def masks(self, output: Sequence[int], paths: Sequence[Sequence[int]]) -> torch.Tensor:  # [n, V] bool
        """The allowed tokens after ``output`` (the generated tokens of the verified prefix) followed by
        each path (a chain round's drafts before each row, a tree node's path). A row after a token the
        grammar refuses allows everything: no decision reads it (that token is rejected, as p = 0 there)."""
        out = torch.ones(len(paths), self.vocab_size, dtype=torch.bool)
        for r, path in enumerate(paths):
            if self._follow(list(output) + list(path)):
                out[r] = _unpack(self._matcher.compute_bitmask(), self.vocab_size)
        return out

    def _follow(self, seq: list[int]) -> bool:
        """Move the matcher to ``seq`` (rollback to the longest common prefix with what it has taken,
        then consume the rest); False if the grammar refuses part of it (the matcher then stays at the
        longest prefix of ``seq`` it accepts, and never enters the engine's error state)."""
        common, taken = 0, len(self._consumed)
        if seq[:taken] == self._consumed:  # the usual case, at C speed: seq extends what was taken
            common = taken
        else:
            while common < min(len(seq), taken) and seq[common] == self._consumed[common]:
                common += 1
        if len(self._consumed) > common:
            self._matcher.rollback(len(self._consumed) - common)
        rest = seq[common:]
        ok = self._matcher.validate_tokens(rest) if rest else 0
        if ok:
            self._matcher.consume_tokens(rest[:ok])
        self._consumed = seq[:common + ok]
        return ok == len(rest)
