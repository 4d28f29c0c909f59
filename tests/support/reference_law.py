"""The target law with bias and penalties as the target alone applies it, written independently of
common/adjust.py: transformers' own logits processors (``SequenceBiasLogitsProcessor``,
``RepetitionPenaltyLogitsProcessor``, ``MinPLogitsWarper``) and OpenAI's presence / frequency formula
from its documentation, in transformers' ``generate`` order. Tests compare the product's decode with
``generate`` under these processors (greedy identity) and its samples with the law they define.
"""
from __future__ import annotations

from collections import Counter

import torch
from transformers import LogitsProcessor, LogitsProcessorList
from transformers.generation.logits_process import (MinPLogitsWarper, RepetitionPenaltyLogitsProcessor,
                                                    SequenceBiasLogitsProcessor, TemperatureLogitsWarper)

from specdec.common.adjust import LogitAdjust
from specdec.common.grammar import Grammar


class OpenAIPenalties(LogitsProcessor):
    """OpenAI's "frequency and presence penalties" (API reference, text generation guide):
    ``mu[j] -> mu[j] - c[j] * alpha_frequency - float(c[j] > 0) * alpha_presence``, with ``c[j]`` how
    often token j was sampled before this position (the prompt's tokens are not sampled)."""

    def __init__(self, prompt_len: int, presence: float, frequency: float):
        self.prompt_len, self.presence, self.frequency = prompt_len, presence, frequency

    def __call__(self, input_ids: torch.LongTensor, scores: torch.Tensor) -> torch.Tensor:
        out = scores.clone()
        for b in range(input_ids.shape[0]):
            for j, c in Counter(input_ids[b, self.prompt_len:].tolist()).items():
                out[b, j] = out[b, j] - self.frequency * c
                out[b, j] = out[b, j] - self.presence
        return out


class GrammarMask(LogitsProcessor):
    """A grammar as llguidance's own numpy helpers apply it (``fill_next_token_bitmask``, then
    ``apply_token_bitmask_inplace``: ``-inf`` off the mask), its matcher fed each generated token:
    independent of common/grammar.py's state and masks."""

    def __init__(self, grammar: Grammar, model, prompt_len: int):
        import llguidance
        import llguidance.hf
        tok = llguidance.hf.from_tokenizer(model.tokenizer, n_vocab=model.vocab_size,
                                           eos_token=list(model.eos_token_ids))
        self.matcher = llguidance.LLMatcher(tok, grammar.llguidance_grammar(), log_level=0)
        self.vocab, self.prompt_len, self.fed = model.vocab_size, prompt_len, 0

    def __call__(self, input_ids: torch.LongTensor, scores: torch.Tensor) -> torch.Tensor:
        from llguidance.numpy import allocate_token_bitmask, apply_token_bitmask_inplace, fill_next_token_bitmask
        out = input_ids[0, self.prompt_len:].tolist()
        for token in out[self.fed:]:
            assert self.matcher.consume_token(token), f"the decode left the grammar at {token}"
        self.fed = len(out)
        bitmask = allocate_token_bitmask(1, self.vocab)
        fill_next_token_bitmask(self.matcher, bitmask, 0)
        logits = scores.numpy().copy()
        apply_token_bitmask_inplace(logits, bitmask)
        return torch.from_numpy(logits)


def processors(adjust: LogitAdjust, prompt_len: int, temperature: float = 0.0,
               min_p: float = 0.0, grammar: Grammar | None = None, model=None) -> LogitsProcessorList:
    """What ``generate`` would apply for this law: the processors (the grammar after the bias and
    penalties), then (T > 0) the warpers."""
    out = LogitsProcessorList()
    if adjust.logit_bias:
        out.append(SequenceBiasLogitsProcessor({(i,): b for i, b in adjust.logit_bias}))
    if adjust.repetition_penalty != 1.0:
        out.append(RepetitionPenaltyLogitsProcessor(adjust.repetition_penalty))
    if adjust.presence_penalty or adjust.frequency_penalty:
        out.append(OpenAIPenalties(prompt_len, adjust.presence_penalty, adjust.frequency_penalty))
    if grammar is not None:
        out.append(GrammarMask(grammar, model, prompt_len))
    if temperature > 0:
        out.append(TemperatureLogitsWarper(temperature))
        if min_p:
            out.append(MinPLogitsWarper(min_p))
    return out


def greedy(model, prompt_ids: list[int], max_new: int, adjust: LogitAdjust, grammar: Grammar | None = None) -> list[int]:
    """transformers' own greedy ``generate`` with the law's processors."""
    ids = torch.tensor([prompt_ids])
    out = model.model.generate(ids, max_new_tokens=max_new, do_sample=False, pad_token_id=0,
                               eos_token_id=list(model.eos_token_ids),
                               logits_processor=processors(adjust, len(prompt_ids), grammar=grammar, model=model))
    return out[0, len(prompt_ids):].tolist()


def next_probs(model, prompt_ids: tuple[int, ...], seq: tuple[int, ...], adjust: LogitAdjust,
               temperature: float, min_p: float = 0.0, grammar: Grammar | None = None) -> torch.Tensor:  # [V] float64
    """The target's law of the token after ``prompt_ids + seq``, as ``generate`` samples it."""
    ids = torch.tensor([list(prompt_ids) + list(seq)])
    with torch.inference_mode():
        logits = model.model(ids).logits[:, -1].float()
    scores = processors(adjust, len(prompt_ids), temperature, min_p, grammar, model)(ids, logits)
    return torch.softmax(scores[0], dim=-1).double()
