"""The distributions both sides sample from, and the checks on a session's sampling settings.

Pure functions over tensors and settings; no model, socket or clock inside.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Sequence

import torch

from specdec.common.settings import validate as validate_settings
from specdec.common.distributions import check_logits, filter_target_logits, probs_from_logits
from specdec.common.adjust import NO_ADJUST, History, LogitAdjust
from specdec.common.grammar import MASKED_LOGIT
from specdec.common.logprobs import MAX_TOP_LOGPROBS, NO_LOGPROBS, TokenLogprob, token_logprobs
from specdec.common.protocol import Hello


@dataclass(frozen=True)
class TargetLaw:
    """The target distribution of a session: the temperature, then transformers' top-k / top-p.

    Both stages of :meth:`probs` are public because batched verification (verify_batch.py) runs the
    float32 stage on a batch of rows and the float64 renormalisation only where a decision reads it:
    the same operations on the same rows, so the same bits as :meth:`probs` gives row by row. The
    float64 sum of the float32 stage is the sum of its float64 copy, bit for bit (the same cascade
    sum, the cast on load; tests/unit/test_verify_batch.py checks it), without the copy.
    """

    temperature: float   # 0: greedy (one-hot at the argmax)
    top_k: int = 0       # 0: off
    top_p: float = 0.0   # 0: off
    min_p: float = 0.0   # 0: off
    adjust: LogitAdjust = field(default=NO_ADJUST)  # bias and penalties, before all of the above

    def shaped(self, logits: torch.Tensor,  # [n, V]
               history: History | None, paths: Sequence[Sequence[int]],
               masks: torch.Tensor | None = None) -> torch.Tensor:  # masks: [n, V] bool -> [n, V]
        """The logits with the law's prefix-dependent part applied: the bias and penalties
        (:class:`LogitAdjust`), then the grammar's ``masks`` (the tokens each row's prefix may continue
        with, common/grammar.py; the others get MASKED_LOGIT), or the logits themselves when there is
        none; :meth:`probs32` and :meth:`probs` take the result."""
        if self.adjust.active:
            logits = self.adjust.apply(logits, history, paths)
        if masks is not None:
            assert masks.shape == logits.shape and masks.dtype == torch.bool, (tuple(masks.shape), masks.dtype)
            logits = logits.to(torch.float32).masked_fill(~masks.to(logits.device), MASKED_LOGIT)
        return logits

    def reported(self) -> "TargetLaw":
        """The law whose log-probabilities a verdict reports for the shaped logits
        (common/logprobs.py): this one, or at T = 0 their softmax at temperature 1 without filters."""
        return self if self.temperature > 0 else TargetLaw(1.0)

    def token_logprobs(self, rows: torch.Tensor,  # [n, V] shaped logits, row i the law of emitted[i]
                       emitted: list[int], top_n: int) -> tuple[TokenLogprob, ...]:
        """The emitted tokens' log-probabilities under :meth:`reported` and their rows' top ``top_n``,
        as a verdict carries them (each token left out of its own top: TokenLogprob.complete)."""
        return token_logprobs(self.reported().probs(rows), emitted, top_n, compact=True)

    def probs32(self, logits: torch.Tensor) -> torch.Tensor:  # [..., V] -> [..., V] float32
        """The law before its float64 renormalisation: ``probs_from_logits`` (float32, one-hot at
        temperature 0), or with top-k / top-p / min-p as transformers' sampling defines it: the float32
        logits divided by the temperature, filtered by its warpers in its order
        (:func:`warp`), then softmax. Greedy ignores the
        filters, as there."""
        if self.temperature == 0 or not (self.top_k or self.top_p or self.min_p):
            return probs_from_logits(logits, self.temperature)
        check_logits(logits, self.temperature)
        return torch.softmax(warp(logits.float() / self.temperature, self.top_k, self.top_p, self.min_p), dim=-1)

    def probs(self, logits: torch.Tensor) -> torch.Tensor:  # [..., V] -> [..., V] float64
        """Probabilities as both sides use them, each row renormalised in float64 so that
        verification's sum checks hold exactly."""
        probs = self.probs32(logits)
        return probs.double() / probs.sum(dim=-1, keepdim=True, dtype=torch.float64)


def warp(scores: torch.Tensor, top_k: int = 0, top_p: float = 0.0, min_p: float = 0.0) -> torch.Tensor:
    """Tempered float32 scores [..., V] through transformers' warpers in its order (0 = off): top-k and
    top-p (:func:`filter_target_logits`), then min-p (:func:`min_p_filter`); removed tokens at -inf."""
    if top_k or top_p:
        scores = filter_target_logits(scores, top_k or None, top_p or None)
    if min_p:
        scores = min_p_filter(scores, min_p)
    return scores


def min_p_filter(scores: torch.Tensor, min_p: float) -> torch.Tensor:  # [..., V] float32 -> [..., V]
    """Min-p (Nguyen et al. 2024, "Turning Up the Heat: Min-p Sampling", sec. 3) exactly as transformers'
    ``MinPLogitsWarper`` (one token kept at least): tokens whose probability is below ``min_p`` times
    the top token's are set to ``-inf``."""
    probs = torch.softmax(scores, dim=-1)
    remove = probs < min_p * probs.amax(dim=-1, keepdim=True)
    remove.scatter_(-1, torch.topk(probs, 1, dim=-1).indices, False)
    return scores.masked_fill(remove, -math.inf)


def model_probs(logits: torch.Tensor, temperature: float, top_k: int = 0, top_p: float = 0.0) -> torch.Tensor:
    """Probabilities as both sides use them: [..., V] float64, each row summing to 1
    (:class:`TargetLaw`; 0 = off for ``top_k`` and ``top_p``)."""
    return TargetLaw(temperature, top_k, top_p).probs(logits)


def filter_probs(q: torch.Tensor, top_k: int = 0, top_p: float = 0.0, min_p: float = 0.0) -> torch.Tensor:
    """``q`` [V] float64 with transformers' top-k / top-p / min-p warpers applied (0 = off) and
    renormalised: the warpers are invariant to a shift of the scores, so filtering ``log q`` keeps what
    filtering the tempered logits that made ``q`` keeps."""
    if not (top_k or top_p or min_p):
        return q
    return torch.softmax(warp(torch.log(q.float()), top_k, top_p, min_p), dim=-1).double()


def validate_hello(hello: Hello) -> None:
    """Checks on a session's sampling settings and its first rounds' draft settings that do not
    depend on the edge's limits (ValueError)."""
    if not math.isfinite(hello.temperature) or hello.temperature < 0:
        raise ValueError(f"temperature must be finite and >= 0, got {hello.temperature}")
    if not 0.0 <= hello.target_top_p <= 1.0:
        raise ValueError(f"target top_p must be in [0, 1], got {hello.target_top_p}")
    if not 0.0 <= hello.target_min_p <= 1.0:
        raise ValueError(f"target min_p must be in [0, 1], got {hello.target_min_p}")
    hello.adjust.check(hello.vocab_size)
    if hello.grammar is not None:
        hello.grammar.check()
        if hello.ignore_eos:
            raise ValueError("ignore_eos with a grammar: the grammar's output ends where its language does")
    if not (hello.logprobs == NO_LOGPROBS or 0 <= hello.logprobs <= MAX_TOP_LOGPROBS):
        raise ValueError(f"logprobs asks for the top {hello.logprobs}; at most {MAX_TOP_LOGPROBS}")
    validate_settings(hello.draft)
