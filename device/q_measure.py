"""Mode auto's measurement of encoded draft distributions: what each candidate codec would lose and
send, from the q's the rounds actually encode.

A regular subsample of the encoded q's (one in OBSERVE_Q_EVERY) gives each candidate top-K's dropped
mass and the used K-SQS packet's lattice error; now and then (one in BYTES_REFRESH_EVERY) every
candidate codec encodes the q, for its packet size and K-SQS's TV, so that codecs never sent still get
estimates. Nothing is learned here: a :class:`QStats` travels with its round and reaches the tracker's
estimates only in the round's event. Pure: no clock, no I/O; the caller counts the encoded q's.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Mapping, Sequence

import torch

from specdec.common.modes import Mode
from specdec.common.protocol import DraftSettings

BYTES_REFRESH_EVERY = 256     # encoded q between two re-measurements of every candidate's packet size
OBSERVE_Q_EVERY = 4           # encoded q per one whose dropped masses are measured: a top-K over the
                              # vocabulary per drafted token is a few % of a drafter forward, inline
Key = tuple[Mode, int]


@dataclass(frozen=True)
class QStats:
    """What one encoded q says about the codecs: TV(q_hat, q) per codec key (a top-K's dropped mass,
    K-SQS's lattice error) and, now and then, every candidate's packet size."""
    temperature: float
    sigma: Mapping[Key, float]
    packet_bytes: Mapping[Key, float]


@dataclass(frozen=True)
class Codecs:
    """The candidate codecs whose losses and sizes are measured (mode auto's AutoConfig's)."""
    top_ks: Sequence[int]
    ksqs_ks: Sequence[int]
    lattice: int
    dense: bool


def due(encoded: int) -> tuple[bool, bool]:
    """(measure, refresh the packet sizes) for the ``encoded``-th encoded q of a temperature (from 1)."""
    return (encoded - 1) % OBSERVE_Q_EVERY == 0, encoded % BYTES_REFRESH_EVERY == 1


def measure(q: torch.Tensor, q_hat: torch.Tensor, settings: DraftSettings, codecs: Codecs, temperature: float,
            refresh: bool) -> QStats:
    """q [V] (the drafter's), q_hat [V] (what the round's packet carries) -> their QStats."""
    assert q.ndim == 1 and q_hat.shape == q.shape, (tuple(q.shape), tuple(q_hat.shape))
    ks = sorted({min(k, q.numel()) for k in (*codecs.top_ks, *codecs.ksqs_ks)})  # as the candidates clamp them
    top = q.topk(max(ks, default=1)).values.cumsum(0)  # [max K]
    sigma = {(Mode.TSLT, k): max(0.0, 1.0 - float(top[k - 1])) for k in ks}
    if settings.mode is Mode.KSQS:
        sigma[(Mode.KSQS, settings.top_k)] = 0.5 * float((q_hat.double() - q.double()).abs().sum())
    sizes: dict[Key, float] = {}
    if refresh:
        sizes, tvs = _measure_packets(q, settings, codecs)
        sigma.update(tvs)
    return QStats(temperature, sigma, sizes)


def _measure_packets(q: torch.Tensor, settings: DraftSettings, codecs: Codecs) -> tuple[dict, dict]:
    """Encode one q with every candidate codec: their payload bytes, and K-SQS's TV(q_hat, q) (its
    lattice error on top of the dropped mass)."""
    from specdec.device.draft_model import encode_q  # the same encoder the rounds use
    sizes, tvs = {}, {}
    for key in codec_keys(codecs, q.numel()):
        mode, k = key
        s = replace(settings, mode=mode, top_k=k or settings.top_k, top_p=0.0, lattice=codecs.lattice,
                    dense_dtype="fp16")
        enc = encode_q(q, s.codec(q.numel()))
        sizes[key] = float(len(enc.payload))
        if mode is Mode.KSQS:
            tvs[key] = 0.5 * float((enc.q_hat.double() - q.double()).abs().sum())
    return sizes, tvs


def codec_keys(codecs: Codecs, vocab_size: int) -> list[Key]:
    keys = [(Mode.TSLT, min(k, vocab_size)) for k in codecs.top_ks]
    keys += [(Mode.KSQS, min(k, vocab_size)) for k in codecs.ksqs_ks]
    return keys + ([(Mode.DENSE, 0)] if codecs.dense else [])
