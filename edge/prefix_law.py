"""What a session's target law reads of its verified prefix on the edge (common/adjust.py,
common/grammar.py), and the log-probabilities its verdicts carry (common/logprobs.py).

Nothing here is kept from one round to the next but the prompt's length and the grammar's matcher,
which follows whichever prefix it is asked about: a round's rows are shaped from the verified tokens
and the drafts before each row, so a rejection, a resume or a re-prefill on another edge changes
nothing but the prefix it is given.
"""
from __future__ import annotations

from dataclasses import replace
from typing import Sequence

import torch

from specdec.common.adjust import History
from specdec.common.grammar import GrammarState
from specdec.common.logprobs import NO_LOGPROBS, TokenLogprob, token_logprobs
from specdec.common.protocol import Hello, Prompt
from specdec.common.sampling import TargetLaw
from specdec.edge.verify_batch import ChainRound


class PrefixLaw:
    """One session's: its prompt's length, its grammar's matcher, the logprobs it asks for."""

    def __init__(self, hello: Hello, law: TargetLaw, tokenizer, vocab_size: int, eos_ids: Sequence[int]):
        self.law = law
        self.vocab_size = vocab_size
        self.logprobs = hello.logprobs
        self.prompt_len = 0  # of the session's tokens, the prompt: the penalties count the rest as generated
        # compiled once per grammar on this edge (common/grammar.py), copied per session
        self.grammar = None if hello.grammar is None else GrammarState(hello.grammar, tokenizer, vocab_size, eos_ids)

    def take_prompt(self, prompt: Prompt) -> None:
        """A Prompt message's prompt length (a re-sent prefix holds output after it); ValueError beyond it."""
        if prompt.prompt_len > len(prompt.token_ids):
            raise ValueError(f"prompt_len {prompt.prompt_len} beyond the {len(prompt.token_ids)} tokens sent")
        self.prompt_len = prompt.prompt_len or len(prompt.token_ids)

    def shape(self, tokens: list[int], paths: list[list[int]]) -> dict:
        """A round's ``history`` and ``masks`` (verify_batch's round builders' keywords) after the
        verified ``tokens``, for rows that follow ``paths``."""
        history = History.of(tokens, self.prompt_len, self.vocab_size) if self.law.adjust.needs_history else None
        masks = None if self.grammar is None else self.grammar.masks(tokens[self.prompt_len:], paths)
        return {"history": history, "masks": masks}

    def asking(self, round_: ChainRound) -> ChainRound:
        """The round with the session's logprobs request on it."""
        return round_ if self.logprobs == NO_LOGPROBS else replace(round_, logprobs=self.logprobs)

    def tree_logprobs(self, rows: torch.Tensor,  # [nodes, V] shaped logits, row n after node n
                      accepted: list[int], emitted: list[int]) -> tuple[TokenLogprob, ...]:
        """A tree round's emitted tokens' log-probabilities: each under the row of the node before it."""
        if self.logprobs == NO_LOGPROBS:
            return ()
        before = torch.tensor([0, *accepted], dtype=torch.long)
        return token_logprobs(self.law.reported().probs(rows[before]), list(emitted), self.logprobs, compact=True)
