"""The device's half of split verification (DSSD): the uplink scalars q_i(x_i), and finishing a
rejection from the edge's samples of p_j (or, when all of them fail, from p_j's head and samples of
its tail, and when those run out too, from the whole p_j).

After a rejection at position j the edge sends m samples y_k ~ p_j with p_j(y_k); accepting y_k with
probability max(0, p_j(y_k) - q_j(y_k)) / p_j(y_k) (first success wins) draws exactly from the
residual norm(max(0, p_j - q_j)), which only the device can form since only it holds q_j.
"""
from __future__ import annotations

import torch

from specdec.common import verification as V
from specdec.common.codecs import decode_target_probs, encode_dssd_scalars
from specdec.common.protocol import ResidualReply, Verdict
from specdec.common.streams import Purpose, stream
from specdec.device.rounds import RoundDraft


def draft_scalars(q_rows: list[torch.Tensor], ids: list[int]) -> bytes:
    """q_i(x_i) of each draft token, float64: bit for bit the law each token was sampled from."""
    return encode_dssd_scalars(torch.stack([row[t] for row, t in zip(q_rows, ids)]))


def resolve(q_j: torch.Tensor, verdict: Verdict, generator: torch.Generator) -> int | None:
    """Accept one of the edge's samples y ~ p_j, or None (then the full p_j is needed)."""
    samples = torch.tensor(verdict.reject_samples, dtype=torch.long)
    probs = torch.tensor(verdict.reject_sample_probs, dtype=torch.float64)
    return V.dssd_device_resolve(samples, probs, q_j, generator)


def resolve_head(q_j: torch.Tensor, reply: ResidualReply, generator: torch.Generator) -> int | None:
    """Rejection-sample the residual from p_j's head and tail samples, or None (then the whole p_j).
    ValueError on a malformed reply."""
    return V.dssd_device_resolve_head(V.DssdHead.from_values(reply), q_j, generator)


def residual(p_j: torch.Tensor, q_j: torch.Tensor, generator: torch.Generator) -> int:
    """The fallback: sample norm(max(0, p_j - q_j)) from the full p_j."""
    return V.dssd_device_residual(p_j, q_j, generator)


def resolve_rejection(seed: int, rd: RoundDraft, verdict: Verdict) -> int | None:
    """A DSSD round rejected at j: accept one of the edge's samples of p_j, or None (a fallback trip)."""
    return resolve(rd.q_rows[verdict.num_accepted], verdict, stream(seed, Purpose.DSSD_RESOLVE, rd.start))


def resolve_fallback(seed: int, vocab_size: int, rd: RoundDraft, verdict: Verdict, reply: ResidualReply) -> int | None:
    """A fallback's reply: from p_j's head and tail samples (None when those run out: ask for the whole
    p_j), or from the whole p_j. ValueError on a malformed reply. Each has its own stream, keyed by
    the round's start, so a retried round draws what its first attempt drew."""
    q_j = rd.q_rows[verdict.num_accepted]
    if reply.is_head:
        return resolve_head(q_j, reply, stream(seed, Purpose.DSSD_HEAD, rd.start))
    p_j = decode_target_probs(reply.target_probs, vocab_size)
    return residual(p_j, q_j, stream(seed, Purpose.DSSD_RESIDUAL, rd.start))
