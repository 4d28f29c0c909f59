"""The distributions both sides sample from, and the checks on a session's sampling settings.

Pure functions over tensors and settings; no model, socket or clock inside.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from specdec.common.settings import validate as validate_settings
from specdec.common.distributions import check_logits, filter_target_logits, probs_from_logits
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

    def probs32(self, logits: torch.Tensor) -> torch.Tensor:  # [..., V] -> [..., V] float32
        """The law before its float64 renormalisation: ``probs_from_logits`` (float32, one-hot at
        temperature 0), or with top-k / top-p as transformers' sampling defines it: the float32
        logits divided by the temperature, filtered by its warpers (:func:`filter_target_logits`),
        then softmax. Greedy ignores the filters, as there."""
        if self.temperature == 0 or not (self.top_k or self.top_p):
            return probs_from_logits(logits, self.temperature)
        check_logits(logits, self.temperature)
        scores = filter_target_logits(logits.float() / self.temperature, self.top_k or None, self.top_p or None)
        return torch.softmax(scores, dim=-1)

    def probs(self, logits: torch.Tensor) -> torch.Tensor:  # [..., V] -> [..., V] float64
        """Probabilities as both sides use them, each row renormalised in float64 so that
        verification's sum checks hold exactly."""
        probs = self.probs32(logits)
        return probs.double() / probs.sum(dim=-1, keepdim=True, dtype=torch.float64)


def model_probs(logits: torch.Tensor, temperature: float, top_k: int = 0, top_p: float = 0.0) -> torch.Tensor:
    """Probabilities as both sides use them: [..., V] float64, each row summing to 1
    (:class:`TargetLaw`; 0 = off for ``top_k`` and ``top_p``)."""
    return TargetLaw(temperature, top_k, top_p).probs(logits)


def filter_probs(q: torch.Tensor, top_k: int = 0, top_p: float = 0.0) -> torch.Tensor:
    """``q`` [V] float64 with transformers' top-k / top-p warpers applied (0 = off) and renormalised:
    the warpers are invariant to a shift of the scores, so filtering ``log q`` keeps what filtering the
    tempered logits that made ``q`` keeps."""
    if not (top_k or top_p):
        return q
    scores = filter_target_logits(torch.log(q.float()), top_k or None, top_p or None)
    return torch.softmax(scores, dim=-1).double()


def validate_hello(hello: Hello) -> None:
    """Checks on a session's sampling settings and its first rounds' draft settings that do not
    depend on the edge's limits (ValueError)."""
    if not math.isfinite(hello.temperature) or hello.temperature < 0:
        raise ValueError(f"temperature must be finite and >= 0, got {hello.temperature}")
    if not 0.0 <= hello.target_top_p <= 1.0:
        raise ValueError(f"target top_p must be in [0, 1], got {hello.target_top_p}")
    validate_settings(hello.draft)
