"""The distributions both sides sample from, and the checks on a session's sampling settings.

Pure functions over tensors and settings; no model, socket or clock inside.
"""
from __future__ import annotations

import math

import torch

from specdec.common.settings import validate as validate_settings
from specdec.common.distributions import check_logits, filter_target_logits, probs_from_logits
from specdec.common.protocol import Hello


def model_probs(logits: torch.Tensor, temperature: float, top_k: int = 0, top_p: float = 0.0) -> torch.Tensor:
    """Probabilities as both sides use them: [..., V] float64, each row summing to 1.

    ``probs_from_logits`` computes in float32 (one-hot argmax at temperature 0, i.e. greedy);
    the result is renormalised in float64 so that verification's sum checks hold exactly.
    Optional top-k / top-p (0 = off) define the target distribution itself, as transformers'
    sampling defines it: the float32 logits divided by the temperature, filtered by its top-k and
    top-p warpers (:func:`filter_target_logits`), then softmax. Greedy ignores them, as there.
    """
    if temperature == 0 or not (top_k or top_p):
        probs = probs_from_logits(logits, temperature).double()
    else:
        check_logits(logits, temperature)
        scores = filter_target_logits(logits.float() / temperature, top_k or None, top_p or None)
        probs = torch.softmax(scores, dim=-1).double()
    return probs / probs.sum(dim=-1, keepdim=True)


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
