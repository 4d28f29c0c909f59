"""What a session's target law reads of its verified prefix on the edge (common/shaping.py), and the
log-probabilities its verdicts carry (common/logprobs.py)."""
from __future__ import annotations

from dataclasses import replace

import torch

from specdec.common.logprobs import NO_LOGPROBS, TokenLogprob
from specdec.common.protocol import Hello, Prompt
from specdec.common.shaping import Shaping
from specdec.edge.verify_batch import ChainRound


class PrefixLaw(Shaping):
    """One session's shaping (its prompt's length, its grammar's matcher) and the logprobs it asks for."""

    def __init__(self, hello: Hello, law, tokenizer, vocab_size: int, eos_ids):
        super().__init__(law, hello.grammar, tokenizer, vocab_size, eos_ids)
        self.logprobs = hello.logprobs

    def take_prompt(self, prompt: Prompt) -> None:
        """A Prompt message's prompt length (a re-sent prefix holds output after it); ValueError beyond it."""
        if prompt.prompt_len > len(prompt.token_ids):
            raise ValueError(f"prompt_len {prompt.prompt_len} beyond the {len(prompt.token_ids)} tokens sent")
        self.prompt_len = prompt.prompt_len or len(prompt.token_ids)

    def asking(self, round_: ChainRound, token_probs: bool = False) -> ChainRound:
        """The round with the session's logprobs request on it (``token_probs``: at least the emitted
        tokens' own, as an edge-only round may ask: Draft.token_probs)."""
        if self.logprobs == NO_LOGPROBS:
            return replace(round_, logprobs=0) if token_probs else round_
        return replace(round_, logprobs=self.logprobs)

    def tree_logprobs(self, rows: torch.Tensor,  # [nodes, V] shaped logits, row n after node n
                      accepted: list[int], emitted: list[int]) -> tuple[TokenLogprob, ...]:
        """A tree round's emitted tokens' log-probabilities: each under the row of the node before it."""
        if self.logprobs == NO_LOGPROBS:
            return ()
        before = torch.tensor([0, *accepted], dtype=torch.long)
        return self.law.token_logprobs(rows[before], list(emitted), self.logprobs)
