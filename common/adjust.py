"""The part of the target law read from the prefix and the request's token map: logit bias and the
repetition, presence and frequency penalties (:class:`LogitAdjust`), and what they read of a prefix
(:class:`History`). Pure functions over tensors; :class:`specdec.common.sampling.TargetLaw` holds one.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Mapping, Sequence

import torch


# OpenAI's ranges for what a request may ask (the daemon refuses beyond them, and so does the edge:
# a Hello is a request too).
MAX_LOGIT_BIAS = 100.0      # |logit_bias[token]|
MAX_OPENAI_PENALTY = 2.0    # |presence_penalty|, |frequency_penalty|
# vLLM and transformers take any penalty > 0; at 10 a seen token is already all but excluded.
MAX_REPETITION_PENALTY = 10.0
# A logit bias map's entries (the edge's default limit, the daemon's): OpenAI's API takes up to 300;
# more would make a Hello, and each verified row's bias, grow with what a client sends.
MAX_LOGIT_BIAS_ENTRIES = 300


@dataclass(frozen=True)
class History:
    """What the penalties read of a verified prefix: how often each token occurs in the generated
    output, and which tokens occur in the prompt. Recomputed from the prefix whenever needed, so it
    advances through drafts and rolls back at a rejection with nothing kept (a resumed or moved session
    recomputes it from the verified prefix and its prompt length)."""

    output_counts: torch.Tensor  # [V] float32
    in_prompt: torch.Tensor      # [V] bool

    @classmethod
    def of(cls, tokens: Sequence[int], prompt_len: int, vocab_size: int) -> "History":
        """``tokens``: the prompt's ``prompt_len`` ids, then the generated ones."""
        ids = torch.tensor(list(tokens), dtype=torch.long)
        counts = torch.bincount(ids[prompt_len:], minlength=vocab_size).to(torch.float32)
        in_prompt = torch.zeros(vocab_size, dtype=torch.bool)
        in_prompt[ids[:prompt_len]] = True
        return cls(counts, in_prompt)


@dataclass(frozen=True)
class LogitAdjust:
    """The part of the target law that depends on the prefix or on the request's token map: OpenAI's
    ``logit_bias``, the repetition penalty (CTRL, Keskar et al. 2019, eq. in sec. 4.1, as transformers
    and vLLM define it) and OpenAI's presence / frequency penalties.

    Applied to the float32 logits in transformers' ``generate`` order, before the temperature and the
    warpers (:class:`TargetLaw`): the bias as ``SequenceBiasLogitsProcessor`` adds it (one-token
    sequences), then the repetition penalty as ``RepetitionPenaltyLogitsProcessor`` (every token of
    prompt and output: a negative logit times the penalty, a non-negative one divided by it), then the
    frequency and presence penalties, which transformers lacks, where vLLM applies them (after the
    repetition penalty), by OpenAI's formula over the generated tokens only:
    ``logit[j] -= frequency * count[j] + presence * (count[j] > 0)``.
    """

    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias), ids ascending and distinct
    repetition_penalty: float = 1.0                 # 1 = off
    presence_penalty: float = 0.0                   # 0 = off
    frequency_penalty: float = 0.0                  # 0 = off

    @classmethod
    def of(cls, logit_bias: Mapping[int, float] | None = None, **penalties) -> "LogitAdjust":
        """From a token -> bias map (any order) and the penalties; ValueError on what :meth:`check` refuses."""
        adjust = cls(tuple(sorted((int(k), float(v)) for k, v in (logit_bias or {}).items())), **penalties)
        adjust.check()
        return adjust

    @property
    def active(self) -> bool:
        return bool(self.logit_bias) or self.needs_history

    @property
    def needs_history(self) -> bool:
        """Whether the adjustment depends on the prefix (a penalty is on)."""
        return self.repetition_penalty != 1.0 or bool(self.presence_penalty) or bool(self.frequency_penalty)

    def check(self, vocab_size: int | None = None) -> None:
        """ValueError on values outside the ranges above, or bias ids outside the vocabulary."""
        ids = [i for i, _ in self.logit_bias]
        if ids != sorted(set(ids)):
            raise ValueError("logit_bias token ids must be distinct")
        for i, b in self.logit_bias:
            if i < 0 or (vocab_size is not None and i >= vocab_size):
                raise ValueError(f"logit_bias token id {i} outside the vocabulary [0, {vocab_size})")
            if not (math.isfinite(b) and abs(b) <= MAX_LOGIT_BIAS):
                raise ValueError(f"logit_bias value {b} for token {i} outside "
                                 f"[-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}]")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not (math.isfinite(value) and abs(value) <= MAX_OPENAI_PENALTY):
                raise ValueError(f"{name} {value} outside [-{MAX_OPENAI_PENALTY:g}, {MAX_OPENAI_PENALTY:g}]")
        r = self.repetition_penalty
        if not (math.isfinite(r) and 0 < r <= MAX_REPETITION_PENALTY):
            raise ValueError(f"repetition_penalty {r} outside (0, {MAX_REPETITION_PENALTY:g}]")

    def apply(self, logits: torch.Tensor,  # [n, V]
              history: History | None, paths: Sequence[Sequence[int]]) -> torch.Tensor:  # [n, V] float32
        """The adjusted float32 logits of ``n`` positions: row r follows the verified prefix that
        ``history`` describes, then the tokens ``paths[r]`` (a chain round's drafts before it, a tree
        node's path). The input is not modified."""
        assert logits.ndim == 2 and len(paths) == logits.shape[0], (tuple(logits.shape), len(paths))
        scores = logits.to(torch.float32, copy=True)
        if self.logit_bias:
            ids = torch.tensor([i for i, _ in self.logit_bias], device=scores.device)
            bias = torch.tensor([b for _, b in self.logit_bias], dtype=torch.float32, device=scores.device)
            scores[:, ids] += bias
        if not self.needs_history:
            return scores
        assert history is not None, "a penalty reads the prefix's history"
        counts = self._counts(history, paths, scores)
        if self.repetition_penalty != 1.0:
            seen = (counts > 0) | history.in_prompt.to(scores.device)
            r = self.repetition_penalty
            scores = torch.where(seen, torch.where(scores < 0, scores * r, scores / r), scores)
        if self.frequency_penalty:
            scores = scores - self.frequency_penalty * counts
        if self.presence_penalty:
            scores = scores - self.presence_penalty * (counts > 0).to(torch.float32)
        return scores

    @staticmethod
    def _counts(history: History, paths: Sequence[Sequence[int]], like: torch.Tensor) -> torch.Tensor:  # [n, V]
        counts = history.output_counts.to(like.device).expand(like.shape[0], -1).clone()
        rows = [r for r, path in enumerate(paths) for _ in path]
        if rows:
            ids = torch.tensor([t for path in paths for t in path], device=like.device)
            counts.index_put_((torch.tensor(rows, device=like.device), ids),
                              torch.ones(len(rows), device=like.device), accumulate=True)
        return counts


NO_ADJUST = LogitAdjust()


def chain_paths(draft_ids: Sequence[int]) -> list[list[int]]:
    """The paths of a chain's rows: row i follows the drafts before it (``L + 1`` rows)."""
    ids = [int(t) for t in draft_ids]
    return [ids[:i] for i in range(len(ids) + 1)]
