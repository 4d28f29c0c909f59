"""A session's target law applied to the rows after its prefix, the same on both sides: the edge
shapes every row it verifies with it, the device every q it drafts from (common/sampling.TargetLaw).

What it reads of the prefix is recomputed from the tokens it is given (the penalties' counts:
common/adjust.History) or follows them (the grammar's matcher: common/grammar.GrammarState), so the
drafts before a row advance it, a rejection rolls it back, and a resumed or moved session rebuilds it
from the verified prefix and the prompt's length alone.
"""
from __future__ import annotations

from typing import Sequence

import torch

from specdec.common.adjust import History
from specdec.common.grammar import Grammar, GrammarState
from specdec.common.sampling import TargetLaw


class Shaping:
    """One session's: its law, its grammar's matcher (compiled once per grammar in this process, copied
    per session), and how many of its tokens are the prompt (the penalties count the rest)."""

    def __init__(self, law: TargetLaw, grammar: Grammar | None, tokenizer, vocab_size: int,
                 eos_ids: Sequence[int]):
        self.law = law
        self.vocab_size = vocab_size
        self.grammar = None if grammar is None else GrammarState(grammar, tokenizer, vocab_size, eos_ids)
        self.prompt_len = 0

    @property
    def active(self) -> bool:
        """Whether any row depends on the prefix or the request (bias, a penalty, a grammar)."""
        return self.law.adjust.active or self.grammar is not None

    def shape(self, tokens: list[int], paths: Sequence[Sequence[int]]) -> dict:
        """What :meth:`TargetLaw.shaped` reads for rows after ``tokens`` (prompt, then generated) and
        each row's path: its ``history`` and ``masks`` keywords (verify_batch's round builders' too)."""
        history = History.of(tokens, self.prompt_len, self.vocab_size) if self.law.adjust.needs_history else None
        masks = None if self.grammar is None else self.grammar.masks(tokens[self.prompt_len:], paths)
        return {"history": history, "masks": masks}

    def shaped(self, logits: torch.Tensor,  # [n, V]
               tokens: list[int], paths: Sequence[Sequence[int]]) -> torch.Tensor:  # [n, V]
        """The rows after ``tokens`` + ``paths[r]``, shaped (the logits themselves when nothing shapes them)."""
        if not self.active:
            return logits
        return self.law.shaped(logits, paths=paths, **self.shape(tokens, paths))
