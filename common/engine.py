"""Helpers shared by both engines: target/draft probabilities from logits, codec settings.

Pure functions over tensors and settings; no model, socket or clock inside.
"""
from __future__ import annotations

import math

import torch

from specdec.common.codecs import CodecConfig, Mode
from specdec.common.distributions import check_logits, filter_target_logits, probs_from_logits
from specdec.common.protocol import DraftSettings, Hello


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


def codec_config(mode: Mode, settings: DraftSettings, vocab_size: int) -> CodecConfig:
    """The codec both sides build from the negotiated draft settings (ValueError if invalid)."""
    return CodecConfig(
        mode=mode, vocab_size=vocab_size, dense_dtype=settings.dense_dtype,
        top_k=min(settings.top_k, vocab_size) if settings.top_k else None,
        top_p=settings.top_p or None, lattice=settings.lattice, max_k=settings.max_k,
    )


def validate_hello(hello: Hello) -> None:
    """Checks on sampling settings that do not depend on the edge's limits."""
    if not math.isfinite(hello.temperature) or hello.temperature < 0:
        raise ValueError(f"temperature must be finite and >= 0, got {hello.temperature}")
    if not 0.0 <= hello.target_top_p <= 1.0:
        raise ValueError(f"target top_p must be in [0, 1], got {hello.target_top_p}")
    if hello.draft.draft_len < 1:
        raise ValueError("draft_len must be >= 1")
    if hello.mode is Mode.DSSD and hello.draft.dssd_samples < 1:
        raise ValueError("dssd_samples must be >= 1")
    if hello.draft.coupled_bonus and (hello.mode is Mode.DSSD or hello.draft.tree):
        raise ValueError("coupled_bonus applies to chain rounds outside DSSD only")
    if hello.mode is Mode.CSQS:
        d = hello.draft
        if not 0.0 < d.csqs_alpha < 1.0 or d.csqs_eta <= 0:
            raise ValueError("C-SQS needs alpha in (0, 1) and eta > 0")


FLOAT64_BYTES = 8


def encode_target_probs(p: torch.Tensor) -> bytes:
    """DSSD fallback downlink: p_j [V] float64 as little-endian bytes, bit-exact."""
    if p.dtype != torch.float64 or p.ndim != 1:
        raise ValueError("target probabilities must be a float64 vector [V]")
    return p.contiguous().numpy().astype("<f8").tobytes()


def decode_target_probs(payload: bytes, vocab_size: int) -> torch.Tensor:
    """Inverse of :func:`encode_target_probs`: [V] float64 (ValueError on a malformed payload)."""
    if len(payload) != vocab_size * FLOAT64_BYTES:
        raise ValueError(f"target payload of {len(payload)} bytes, expected {vocab_size * FLOAT64_BYTES}")
    p = torch.frombuffer(bytearray(payload), dtype=torch.float64).clone()
    if not torch.isfinite(p).all() or (p < 0).any() or abs(float(p.sum()) - 1.0) > 1e-6:
        raise ValueError("target payload is not a probability vector")
    return p
