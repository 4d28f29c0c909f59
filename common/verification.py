"""Lossless verification of drafted tokens: chain, multi-candidate and split (DSSD) rejection sampling.

Convention for the whole repository: ``p`` is the TARGET distribution (edge, LLM, ``M_p``) and ``q``
the DRAFT distribution (device, SLM, ``M_q``). Every ``q`` passed here must be exactly the
distribution the draft token was sampled from (after compression: the decoded packet, densified), or
the output is no longer distributed as the target alone.

References
- Chain speculative sampling: Leviathan et al. 2023 (arXiv 2211.17192) Alg. 1; Chen et al. 2023
  (arXiv 2302.01318) Alg. 2. TSLT (Zheng et al., "Fast Collaborative Inference via Distributed
  Speculative Decoding") §2.1, Alg. 3, with its erratum fixed: accept
  draft ``x`` with probability ``min(1, p(x)/q(x))`` (the paper writes ``q/p``), the target ``M_p`` is
  run (the paper writes ``M_q``), on rejection sample from ``norm(max(0, p - q))``, and if all ``L``
  drafts are accepted sample a bonus token from ``p_{L+1}``.
- Multi-candidate recursive rejection sampling: TSLT §4.2, Alg. 4-5 (eq. 25), after Yang et al. 2024
  (MCSD, arXiv 2401.06706): candidates drawn i.i.d. from one ``q``; after each rejected candidate
  ``p <- norm(max(0, p - q))``. The without-replacement variant (SpecTr, Sun et al. 2023; MCSD;
  Recursive Speculative Decoding, Jeon et al. 2024) also updates ``q <- norm(q with x zeroed)``.
- Split verification: Ning, Zheng and Yang, "DSSD: Efficient Edge-Device LLM Deployment and
  Collaborative Inference via Distributed Split Speculative Decoding" (ICML 2025, arXiv 2507.12000),
  Method, "Key Designs: Splitting the Verification Stage": the edge runs the accept tests, the
  device resamples at the first rejection j, where only it holds ``q_j``. The paper sends the whole
  ``p_j`` downlink; here (a smaller form, equally lossless) the edge sends ``m`` samples
  ``y ~ p_j`` with ``p_j(y)``, and the device accepts ``y`` with probability
  ``max(0, p_j(y) - q_j(y)) / p_j(y)`` (first success wins), which is exactly a sample of
  ``norm(max(0, p_j - q_j))``; only if all ``m`` fail does it fall back, and even then not to the
  whole ``p_j``: the edge sends its K largest entries, the mass of the rest and a few samples of the
  rest, and the device rejection-samples the residual from those (``dssd_edge_head`` /
  ``dssd_device_resolve_head``); the whole ``p_j`` only if that runs out of tail samples too.
- Gumbel verification (mode gumbel): Daliri, Musco and Suresh, "Coupling without Communication and
  Drafter-Invariant Speculative Decoding" (arXiv 2408.07978), §2 (Gumbel sampling, Theorem 2) and
  §4 (drafter-invariant speculative decoding). Both sides share the exponential noise ``E_t`` of
  each position ``t`` (keyed by seed and position only); the device drafts ``x_t = argmin E_t / q_t``,
  the edge computes the target's own draw ``y_t = argmin E_t / p_t`` and accepts while ``x_t == y_t``;
  every emitted token is a ``y_t``, so the output is the target's own Gumbel-max sample whatever the
  drafter: lossless, and identical token for token for every drafter and draft length. Nothing of
  ``q`` is sent. Verifying such drafts with ``u < p/q`` and the shared noise instead biases the output
  (the uniform behind ``E_t(x_t)`` is not independent of ``x_t`` having won the race).

Randomness: every function takes a CPU ``torch.Generator`` and draws float64 uniforms in ``[0, 1)``
with ``torch.rand(..., generator=g, dtype=torch.float64)``: one per accept test, and one per
sampled token (``distributions.sample_token``: inverse CDF, first token whose cumulative mass
exceeds ``u * total``; ``torch.rand(k)`` consumes the generator exactly like k single draws). Each
docstring lists the exact order of the draws, so results are reproducible draw for draw. All
arithmetic is float64. ``p`` and ``q`` may live on a GPU (where the edge's target ran): the uniforms
still come from the CPU generator, so a round draws the same numbers on any device, and only the
verdict (a few ints) comes back to the host.
Bad input raises ``ValueError`` (checks in validation.py); ``assert`` is used only for internal
invariants.
"""
from __future__ import annotations

import itertools
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

# Inverse-CDF sampling with one float64 uniform, shared with the device's drafting code so both
# sides sample identically (re-exported here for callers of the verification API).
from specdec.common.distributions import (gumbel_noise, race_token_unchecked, sample_token, sample_token_from_uniform,
                                          sample_token_gumbel, sample_tokens)
from specdec.common.streams import Purpose, exponentials, stream
from specdec.common.validation import (VERIFY_SUM_ATOL, check_drafts_sampleable, check_generator, check_int,
                                       check_prob_rows, check_prob_scalars, check_prob_vector, check_token_ids)

__all__ = [
    "ChainResult",
    "DssdEdgeResult",
    "DssdHead",
    "bonus_noise",
    "chain_verify",
    "gumbel_verify",
    "draw_uniform",
    "dssd_device_residual",
    "dssd_device_resolve",
    "dssd_device_resolve_head",
    "dssd_edge_head",
    "dssd_edge_verify",
    "dssd_fallback_bytes",
    "mc_verify",
    "mc_verify_unchecked",
    "residual_distribution",
    "sample_candidates",
    "sample_token",
    "sample_token_from_uniform",
    "sample_token_gumbel",
    "token_noise",
]

# ---------------------------------------------------------------------------------------------
# Sampling primitives
# ---------------------------------------------------------------------------------------------


def draw_uniform(generator: torch.Generator) -> float:
    """One float64 uniform in [0, 1) for an accept test; samples use ``sample_token``, which
    draws exactly one such uniform from the same generator (distributions.py)."""
    return float(torch.rand((), generator=generator, dtype=torch.float64))


def bonus_noise(seed: int, position: int, vocab_size: int) -> torch.Tensor:  # [V] float64
    """The Gumbel noise of a coupled bonus token at sequence index ``position`` (prompt included).

    Both sides compute it from the session seed: the edge draws the bonus token with it
    (:func:`chain_verify`), the device guesses that token with the same noise on its own q while the
    edge verifies (drafting ahead). The bonus stays distributed exactly as ``p_{L+1}``: the noise of
    a position is used for at most one emitted token and depends on nothing that decides ``p_{L+1}``
    or whether the round ends there (its own stream, ``Purpose.BONUS_NOISE`` in streams.py).
    """
    return gumbel_noise(stream(seed, Purpose.BONUS_NOISE, position), vocab_size)


BonusNoise = torch.Tensor | Callable[[], torch.Tensor]  # [V] float64 Gumbel noise, or what makes it


def _coupled_bonus(p_row: torch.Tensor, noise: BonusNoise) -> int:
    """The coupled bonus token ``argmax log p + noise`` (:func:`sample_token_gumbel`). ``noise`` may be
    a function that draws it: V Gumbels are a draw over the whole vocabulary, and a one-hot ``p``
    (greedy) needs none, its only token wins whatever the noise."""
    if callable(noise):
        if int((p_row > 0).sum()) == 1:
            return int(p_row.argmax())
        noise = noise()
    return sample_token_gumbel(p_row, noise)


def token_noise(seed: int, position: int, vocab_size: int) -> torch.Tensor:  # [V] float64
    """The exponential noise ``E_t`` of sequence index ``position`` (prompt included): the token a gumbel
    or none round emits there is ``argmin E_t / p`` (:func:`gumbel_verify`), the one a gumbel round
    drafts there ``argmin E_t / q``. Keyed by the seed and the position only (``Purpose.TOKEN_NOISE``),
    so every round, mode, drafter and retry that reaches a position races with the same noise."""
    return exponentials(seed, Purpose.TOKEN_NOISE, position, vocab_size)


def _accepts(u: float, p_x: float, q_x: float) -> bool:
    """Rejection-sampling test ``u < min(1, p(x)/q(x))`` written as ``u * q(x) < p(x)``: equal for
    ``u`` in [0, 1) and ``q(x) > 0``, and it needs no division."""
    return u * q_x < p_x


def residual_distribution(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """``norm(max(0, p - q))``, the distribution to resample from after a rejection (TSLT eq. 25).

    Args:
        p: [V] float64 target distribution.
        q: [V] float64 draft distribution.

    Returns:
        [V] float64. If the positive part is all zero (then p == q up to rounding and a rejection
        had probability 0), returns a copy of ``p``.
    """
    check_prob_vector(p, "p")
    check_prob_vector(q, "q", p.shape[0])
    return _residual(p, q.to(p.device))  # a device's q (its drafter on a GPU) against the edge's p_j


def _residual(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    diff = torch.clamp(p - q, min=0.0)  # [V]
    total = diff.sum()
    if total <= 0:
        return p.clone()
    return diff / total


# ---------------------------------------------------------------------------------------------
# Chain verification (Leviathan et al. 2023 Alg. 1; TSLT Alg. 3, erratum fixed)
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ChainResult:
    """Outcome of one chain verification round."""

    num_accepted: int  # n in [0, L]: draft_ids[:n] are accepted
    next_token: int  # correction token from norm(max(0, p_{n+1} - q_{n+1})) if n < L, else bonus from p_{L+1}


def chain_verify(
    draft_ids: torch.Tensor,  # [L] int64, L >= 1
    q: torch.Tensor,  # [L, V] float64, row i: the exact distribution draft_ids[i] was sampled from
    p: torch.Tensor,  # [L+1, V] float64, row i: target after prefix + draft_ids[:i]
    generator: torch.Generator,
    bonus_noise: BonusNoise | None = None,  # [V] float64 Gumbel noise for the bonus token (or its maker), or None
) -> ChainResult:
    """Speculative sampling of a drafted chain (Leviathan et al. 2023 Alg. 1; TSLT Alg. 3 fixed).

    For i = 1..L: accept ``x_i`` with probability ``min(1, p_i(x_i)/q_i(x_i))``; at the first
    rejection emit a token from ``norm(max(0, p_i - q_i))`` and stop; if all are accepted emit a
    bonus token from ``p_{L+1}``. The emitted sequence is distributed exactly as sampling the target.

    Random draws, in order: one uniform per accept test for positions 1..n+1 (n+1 tests if a
    rejection happens at position n+1, L tests if all are accepted), then exactly one uniform for
    the inverse-CDF sample of the correction (or bonus) token. Total: n + 2 draws, or L + 1. With
    ``bonus_noise`` (the coupled bonus, :func:`bonus_noise`), the bonus token is the Gumbel-max
    draw ``argmax log p_{L+1} + bonus_noise`` instead, and takes no uniform from ``generator``.

    Raises:
        ValueError: on malformed input (shapes, dtypes, NaN, negative or unnormalised rows, ids out
            of range, empty draft, a draft token with q(x) == 0).
    """
    check_generator(generator)
    check_token_ids(draft_ids, "draft_ids")  # [L]; the range once V is known
    L = draft_ids.numel()
    check_prob_rows(q, "q", rows=L)
    V = q.shape[1]
    check_prob_rows(p, "p", rows=L + 1, vocab=V)
    check_token_ids(draft_ids, "draft_ids", V)
    q_of_draft = q.gather(1, draft_ids.unsqueeze(1)).squeeze(1)  # [L]
    check_drafts_sampleable(draft_ids, q_of_draft, "draft_ids")
    p_of_draft = p.gather(1, draft_ids.unsqueeze(1)).squeeze(1).tolist()  # [L]
    q_of_draft = q_of_draft.tolist()

    for i in range(L):
        if not _accepts(draw_uniform(generator), p_of_draft[i], q_of_draft[i]):
            return ChainResult(num_accepted=i, next_token=sample_token(_residual(p[i], q[i]), generator))
    if bonus_noise is not None:
        return ChainResult(num_accepted=L, next_token=_coupled_bonus(p[L], bonus_noise))
    return ChainResult(num_accepted=L, next_token=sample_token(p[L], generator))


# ---------------------------------------------------------------------------------------------
# Gumbel verification (Daliri, Musco and Suresh 2024, arXiv 2408.07978, §4)
# ---------------------------------------------------------------------------------------------


def gumbel_verify(
    draft_ids: torch.Tensor,  # [L] int64, L >= 1: x_i = argmin noise(i) / q_i, drafted on the device
    p: torch.Tensor,  # [L+1, V] float64, row i: target (after temperature, top-k, top-p) after prefix + draft_ids[:i]
    noise: Callable[[int], torch.Tensor],  # noise(i): [V] float64 exponential noise of row i's position
) -> ChainResult:
    """Accept-iff-equal verification of a chain drafted by Gumbel sampling (Daliri et al. §4).

    For i = 0..L: the target's own draw ``y_i = argmin_v noise(i)(v) / p_i(v)`` (the exponential race,
    a Gumbel-max draw: exactly a sample of ``p_i``); accept ``x_i`` iff ``x_i == y_i``; at the first
    mismatch emit ``y_i`` and stop; if all ``L`` are accepted emit the bonus ``y_L``. Every emitted
    token is a ``y``, so the output is the target's Gumbel-max chain, whatever drafted it: distributed
    exactly as the target alone as long as each position's noise is independent of the prefix that
    reaches it (keyed by position: :func:`token_noise`), and identical for every drafter. A draft is
    accepted with probability >= (1 - TV(p_i, q_i)) / (1 + TV(p_i, q_i)) (their Theorem 2).

    ``noise`` is called for i = 0..n in order, once each (n accepted): rows past the first mismatch
    are never drawn. No accept uniform, no residual: nothing of q is needed.

    Raises:
        ValueError: on malformed input (shapes, dtypes, NaN, negative or unnormalised rows, ids out
            of range, empty draft, noise of the wrong shape or not positive).
    """
    check_token_ids(draft_ids, "draft_ids")  # [L]; the range once V is known
    L = draft_ids.numel()
    check_prob_rows(p, "p", rows=L + 1)
    V = p.shape[1]
    check_token_ids(draft_ids, "draft_ids", V)
    for i, x in enumerate(draft_ids.tolist()):
        y = _race(p[i], noise, i)
        if x != y:
            return ChainResult(num_accepted=i, next_token=y)
    return ChainResult(num_accepted=L, next_token=_race(p[L], noise, L))


def _race(p_i: torch.Tensor, noise: Callable[[int], torch.Tensor], i: int) -> int:
    """The target's draw at row i: p_i [V] raced with noise(i), checked."""
    e = noise(i)  # [V]
    if not isinstance(e, torch.Tensor) or e.shape != p_i.shape or e.dtype != torch.float64 or not bool((e > 0).all()):
        raise ValueError(f"noise({i}) must be a positive float64 tensor of shape {tuple(p_i.shape)}")
    return race_token_unchecked(p_i, e)


# ---------------------------------------------------------------------------------------------
# Multi-candidate verification (TSLT Alg. 4-5, eq. 25)
# ---------------------------------------------------------------------------------------------


def sample_candidates(
    q: torch.Tensor,  # [V] float64 draft distribution
    k: int,
    generator: torch.Generator,
    with_replacement: bool = True,
) -> torch.Tensor:  # [k] int64
    """Draw ``k`` draft candidates from ``q`` (TSLT Alg. 4 MCSample).

    ``with_replacement=True``: i.i.d. draws from ``q``. ``with_replacement=False``: candidate i is
    drawn from ``q`` with candidates 1..i-1 zeroed and renormalised (needs ``k`` <= the size of
    q's support). Random draws: exactly ``k`` uniforms, one per candidate, in candidate order.
    """
    check_generator(generator)
    check_prob_vector(q, "q")
    check_int(k, "k", 1)
    support = int((q > 0).sum())
    if not with_replacement and k > support:
        raise ValueError(f"cannot draw {k} distinct candidates from a q with support size {support}")
    if with_replacement:
        return _iid_inverse_cdf(q, k, generator)
    current = q  # [V], the law of the next draw
    out: list[int] = []
    for _ in range(k):
        x = int(_iid_inverse_cdf(current, 1, generator)[0])  # one uniform, as sample_token
        out.append(x)
        if len(out) < k:
            current = _remove_and_renormalise(current, x)
    return torch.tensor(out, dtype=torch.int64)


def _iid_inverse_cdf(q: torch.Tensor, k: int, generator: torch.Generator) -> torch.Tensor:
    """k i.i.d. draws from a validated q [V], vectorised. Identical, draw for draw, to k calls of
    ``sample_token(q, generator)``: ``torch.rand(k)`` consumes the generator exactly like k scalar
    draws, and the inverse CDF (first cumulative sum exceeding ``u * total``, a zero-probability
    token never chosen) is the one of distributions.sample_token_from_uniform (tested)."""
    u = torch.rand(k, generator=generator, dtype=torch.float64)  # [k]
    cdf = torch.cumsum(q, dim=0)  # [V]
    idx = torch.searchsorted(cdf, u * cdf[-1], right=True)  # [k]
    # rounding can put u * total at the last cumulative sum: take the last positive token
    return torch.where(idx >= q.shape[0], q.nonzero()[-1, 0], idx)


def _remove_and_renormalise(q: torch.Tensor, x: int) -> torch.Tensor:
    """q with token x zeroed, renormalised: the law of the next without-replacement draw."""
    out = q.clone()
    out[x] = 0.0
    total = out.sum()
    assert total > 0, "without-replacement draft exhausted q's support"
    return out / total


def mc_verify(
    candidates: torch.Tensor,  # [k] int64, drawn by sample_candidates(q, k, ..., with_replacement)
    q: torch.Tensor,  # [V] float64, the exact draft distribution the candidates were drawn from
    p: torch.Tensor,  # [V] float64 target distribution
    generator: torch.Generator,
    *,
    with_replacement: bool = True,
) -> tuple[int, int]:
    """Recursive rejection sampling over ``k`` candidates (TSLT Alg. 5, eq. 25; MCSD).

    For i = 1..k: accept candidate ``x_i`` with probability ``min(1, p^(i)(x_i) / q^(i)(x_i))``;
    on rejection ``p^(i+1) = norm(max(0, p^(i) - q^(i)))``. With replacement ``q^(i) = q``; without,
    ``q^(i+1) = norm(q^(i) with x_i zeroed)``. If all are rejected sample from ``p^(k+1)``. The
    output is distributed exactly as ``p`` (induction on the standard rejection-sampling identity
    ``min(q, p) + max(0, p - q) = p``).

    Random draws, in order: one uniform per accept test (i+1 tests if candidate i+1 is accepted,
    k if all are rejected), then, only if all are rejected, one uniform for sampling ``p^(k+1)``.

    Returns:
        (index of the accepted candidate or -1, output token).
    """
    check_generator(generator)
    check_prob_vector(q, "q")
    V = q.shape[0]
    check_prob_vector(p, "p", V)
    check_token_ids(candidates, "candidates", V)
    check_drafts_sampleable(candidates, q[candidates], "candidates")
    if not with_replacement and torch.unique(candidates).numel() != candidates.numel():
        raise ValueError(f"without-replacement candidates must be distinct, got {candidates.tolist()}")

    return mc_verify_unchecked(candidates.tolist(), q, p, generator, with_replacement)


def mc_verify_unchecked(
    candidates: list[int], q: torch.Tensor, p: torch.Tensor, generator: torch.Generator, with_replacement: bool
) -> tuple[int, int]:
    """mc_verify without input checks, for callers that validated them (tree_verify validates a
    whole tree once). candidates: k token ids; q, p: [V] float64."""
    p_i, q_i = p, q  # [V], [V]: p^(i) and q^(i)
    for i, x in enumerate(candidates):
        if _accepts(draw_uniform(generator), float(p_i[x]), float(q_i[x])):
            return i, x
        p_i = _residual(p_i, q_i)
        if not with_replacement and i + 1 < len(candidates):
            q_i = _remove_and_renormalise(q_i, x)
    return -1, sample_token(p_i, generator)


# ---------------------------------------------------------------------------------------------
# Split verification (DSSD, sampled downlink; see the module docstring)
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class DssdEdgeResult:
    """What the edge learns and sends back after its half of DSSD verification."""

    num_accepted: int  # n in [0, L]
    bonus_token: int | None  # sampled from p_{L+1}; set iff all L drafts were accepted
    reject_samples: torch.Tensor  # [m] int64, y_k ~ p_j i.i.d. at the first rejected position j (empty if all accepted)
    reject_sample_probs: torch.Tensor  # [m] float64, p_j(y_k)
    reject_p: torch.Tensor | None  # [V] float64, the full p_j, kept by the edge for the device's fallback


def dssd_edge_verify(
    draft_ids: torch.Tensor,  # [L] int64
    q_of_draft: torch.Tensor,  # [L] float64, q_i(x_i) as sent uplink by the device
    p: torch.Tensor,  # [L+1, V] float64, row i: target after prefix + draft_ids[:i]
    generator: torch.Generator,
    num_samples: int,
    bonus_noise: BonusNoise | None = None,  # [V] float64 Gumbel noise for the bonus token (or its maker), or None
) -> DssdEdgeResult:
    """Edge half of DSSD: the accept tests of chain verification, using only the scalars q_i(x_i).

    At the first rejected position j the edge cannot form ``norm(max(0, p_j - q_j))`` (only the
    device holds ``q_j``), so it draws ``m = num_samples`` i.i.d. samples ``y_k ~ p_j`` and returns
    them with ``p_j(y_k)``; the device finishes with ``dssd_device_resolve`` (or, if all fail,
    ``dssd_device_residual`` on the full ``p_j``).

    Random draws, in order: one uniform per accept test exactly as ``chain_verify`` (so for the same
    generator state ``num_accepted`` agrees with it), then either one uniform for the bonus token
    (all accepted) or ``m`` uniforms for ``y_1..y_m`` (a rejection). With ``bonus_noise`` (the
    coupled bonus, :func:`bonus_noise`) the bonus is the Gumbel-max draw instead, as in
    ``chain_verify``, so that the device can guess it and draft the next round ahead.
    """
    check_generator(generator)
    check_int(num_samples, "num_samples", 0)
    check_token_ids(draft_ids, "draft_ids")  # [L]; the range once V is known
    L = draft_ids.numel()
    check_prob_rows(p, "p", rows=L + 1)
    check_token_ids(draft_ids, "draft_ids", p.shape[1])
    check_prob_scalars(q_of_draft, "q_of_draft", L)
    check_drafts_sampleable(draft_ids, q_of_draft, "draft_ids")
    p_of_draft = p.gather(1, draft_ids.unsqueeze(1)).squeeze(1).tolist()  # [L]
    q_list = q_of_draft.tolist()

    for j in range(L):
        if not _accepts(draw_uniform(generator), p_of_draft[j], q_list[j]):
            samples = sample_tokens(p[j], generator, num_samples)  # [m], as m calls of sample_token
            return DssdEdgeResult(
                num_accepted=j,
                bonus_token=None,
                reject_samples=samples,
                reject_sample_probs=p[j][samples].clone(),
                reject_p=p[j].clone(),
            )
    bonus = _coupled_bonus(p[L], bonus_noise) if bonus_noise is not None else sample_token(p[L], generator)
    return DssdEdgeResult(
        num_accepted=L,
        bonus_token=bonus,
        reject_samples=torch.empty(0, dtype=torch.int64),
        reject_sample_probs=torch.empty(0, dtype=torch.float64),
        reject_p=None,
    )


def dssd_device_resolve(
    samples: torch.Tensor,  # [m] int64, y_k ~ p_j from the edge
    sample_probs: torch.Tensor,  # [m] float64, p_j(y_k) from the edge
    q_j: torch.Tensor,  # [V] float64, the device's draft distribution at the rejected position
    generator: torch.Generator,
) -> int | None:
    """Device half of DSSD: turn samples of ``p_j`` into one sample of ``norm(max(0, p_j - q_j))``.

    Accepts ``y_k`` with probability ``max(0, p_j(y_k) - q_j(y_k)) / p_j(y_k)``; the first success
    wins. Each trial succeeds on ``y`` with probability ``max(0, p_j(y) - q_j(y))``, so a success
    is distributed as the residual, independently of how many trials failed. Returns None if all
    ``m`` trials fail (then call ``dssd_device_residual``; that fallback is also lossless).

    Random draws: one uniform per trial, in sample order, stopping at the first success.
    """
    check_generator(generator)
    check_prob_vector(q_j, "q_j")
    V = q_j.shape[0]
    if not isinstance(samples, torch.Tensor) or samples.ndim != 1:
        raise ValueError("samples must be a 1-D int64 tensor [m]")
    m = samples.numel()
    if m > 0:
        check_token_ids(samples, "samples", V)
    check_prob_scalars(sample_probs, "sample_probs", m)
    if (sample_probs <= 0).any():
        raise ValueError("sample_probs must be > 0: a sample of p_j has p_j(y) > 0")
    for y, p_y in zip(samples.tolist(), sample_probs.tolist()):
        # u < (p - q) / p  <=>  u * p < p - q, false whenever p <= q
        if draw_uniform(generator) * p_y < p_y - float(q_j[y]):
            return y
    return None


def dssd_device_residual(
    p_j: torch.Tensor,  # [V] float64, the full target distribution at the rejected position
    q_j: torch.Tensor,  # [V] float64, the device's draft distribution there
    generator: torch.Generator,
) -> int:
    """DSSD fallback: sample ``norm(max(0, p_j - q_j))`` on the device. Draws exactly one uniform."""
    check_generator(generator)
    return sample_token(residual_distribution(p_j, q_j), generator)


# ---------------------------------------------------------------------------------------------
# DSSD fallback without the whole p_j: its head, its tail mass and samples of its tail
# ---------------------------------------------------------------------------------------------


# Samples of p_j's tail in a DSSD head fallback (11 bytes each on the wire). With the default K = 64,
# bench/bench_dssd_fallback.py (T = 1, the SmolLM2 pair, m = 64): n = 8 runs out of tail samples on 17%
# of fallbacks (each then costs the whole p_j, 393 KB, and a trip), n = 32 on 1%, n = 64 on 0.05%, for
# a 1.3 KB reply (1.5 KB per fallback counting run-outs; n = 128: 2.0 KB).
DSSD_TAIL_SAMPLES = 64
# A head entry or tail sample on the wire: its id as a varint (2-3 bytes) and its float64 p_j.
DSSD_HEAD_ENTRY_BYTES = 11


def dssd_fallback_bytes(top_k: int, vocab_size: int) -> int:
    """About what a DSSD fallback's reply carries down: p_j's head and tail samples (``top_k`` > 0, the
    round's dssd_fallback_top_k), or the whole p_j (0)."""
    if not top_k:
        return 8 * vocab_size
    return DSSD_HEAD_ENTRY_BYTES * (min(top_k, vocab_size) + DSSD_TAIL_SAMPLES)


@dataclass(frozen=True)
class DssdHead:
    """What the edge sends after a DSSD rejection whose ``m`` samples all failed: ``p_j`` on the head
    H (its ``K`` largest entries, bit for bit), the mass ``T`` of the rest, and ``n`` i.i.d. samples
    of ``p_j`` restricted to the rest with their ``p_j(y)``."""

    head_ids: torch.Tensor  # [K] int64, distinct
    head_probs: torch.Tensor  # [K] float64, p_j on head_ids (each > 0)
    tail_mass: float  # T = sum of p_j off the head (float64)
    tail_samples: torch.Tensor  # [n] int64, y ~ p_j restricted to the tail, none in the head
    tail_sample_probs: torch.Tensor  # [n] float64, p_j(y)

    def __post_init__(self):  # a reply off the wire may pair lists of different lengths
        k, n = self.head_ids.numel(), self.tail_samples.numel()
        if not self.head_ids.shape == self.head_probs.shape == (k,):
            raise ValueError("head_ids and head_probs must be vectors of one length")
        if not self.tail_samples.shape == self.tail_sample_probs.shape == (n,):
            raise ValueError("tail_samples and tail_sample_probs must be vectors of one length")

    def to_values(self) -> dict:
        """The fields as plain ints and floats (protocol.ResidualReply's head fields, same names)."""
        return {"head_ids": tuple(self.head_ids.tolist()), "head_probs": tuple(self.head_probs.tolist()),
                "tail_mass": float(self.tail_mass), "tail_samples": tuple(self.tail_samples.tolist()),
                "tail_sample_probs": tuple(self.tail_sample_probs.tolist())}

    @classmethod
    def from_values(cls, source) -> "DssdHead":
        """Inverse of :meth:`to_values`, from anything with those attributes (a ResidualReply);
        float64 values come back bit for bit. ValueError if the lengths do not pair up."""
        return cls(head_ids=torch.tensor(source.head_ids, dtype=torch.int64),
                   head_probs=torch.tensor(source.head_probs, dtype=torch.float64),
                   tail_mass=float(source.tail_mass),
                   tail_samples=torch.tensor(source.tail_samples, dtype=torch.int64),
                   tail_sample_probs=torch.tensor(source.tail_sample_probs, dtype=torch.float64))


def dssd_edge_head(
    p_j: torch.Tensor,  # [V] float64, the target distribution at the rejected position
    top_k: int,
    num_tail: int,
    generator: torch.Generator,
) -> DssdHead:
    """Edge side of the small DSSD fallback: p_j's ``top_k`` largest non-zero entries, the mass of
    the rest, and ``num_tail`` samples of the rest (see :func:`dssd_device_resolve_head`).

    Random draws: ``num_tail`` uniforms (inverse CDF of p_j off the head), none if the tail is empty.
    """
    check_prob_vector(p_j, "p_j")
    check_int(top_k, "top_k", 1)
    check_int(num_tail, "num_tail", 0)
    check_generator(generator)
    k = min(top_k, int((p_j > 0).sum()))
    head_probs, head_ids = torch.topk(p_j, k)  # [K], [K]
    tail = p_j.clone()  # [V]
    tail[head_ids] = 0.0
    tail_mass = float(tail.sum())
    if tail_mass > 0 and num_tail > 0:
        samples = sample_tokens(tail / tail_mass, generator, num_tail)  # [n]
    else:
        samples = torch.empty(0, dtype=torch.int64)
    return DssdHead(head_ids=head_ids, head_probs=head_probs, tail_mass=tail_mass,
                    tail_samples=samples, tail_sample_probs=p_j[samples].clone())


def dssd_device_resolve_head(
    head: DssdHead,
    q_j: torch.Tensor,  # [V] float64, the device's draft distribution at the rejected position
    generator: torch.Generator,
) -> int | None:
    """One sample of ``r = norm(max(0, p_j - q_j))`` from p_j's head and tail samples, or None when
    the tail samples run out (then the whole p_j: :func:`dssd_device_residual`, also lossless).

    Rejection sampling (von Neumann) under the envelope ``g = max(0, p_j - q_j)`` on the head H and
    ``g = p_j`` off it, of mass ``G = R_H + T`` with ``R_H = sum_H max(0, p_j - q_j)``; ``g >= r`` up to
    normalisation everywhere, and the device knows ``g`` on H exactly and can sample it off H from the
    edge's tail samples. Each trial: with probability ``R_H / G`` a head token ``y ~ max(0, p_j - q_j)``
    on H, always kept; else the next tail sample ``y ~ p_j / T`` off H, kept with probability
    ``max(0, p_j(y) - q_j(y)) / p_j(y)``. A trial keeps ``y`` with probability
    ``max(0, p_j(y) - q_j(y)) / G`` for every ``y``, so the first kept token is distributed as ``r``,
    whatever trials failed before it. A rejection on a position where ``r`` is 0 (rounding: p_j <= q_j
    everywhere) has ``G = T``, and with no tail ``G = 0``: then ``r`` is taken as ``p_j`` as in
    :func:`residual_distribution`, a head token ``y ~ p_j``.

    Running out must not depend on the token a trial would keep: it comes right after the last tail
    sample fails (so every trial that ran could keep any token), never at a later trial, which could
    still keep a head token but no tail one and would bias the kept token toward the head. Then the
    tail samples all failed, with probability ((T - R_T) / G)^n (``R_T`` the residual's mass off H).

    Random draws, per trial: one uniform (head or tail), then one uniform (the head token by inverse
    CDF, or the tail sample's accept test); stops at the first kept token or after the last tail
    sample's failed test (none at all when the tail has mass but no samples).
    """
    check_generator(generator)
    check_prob_vector(q_j, "q_j")
    _check_head(head, q_j.shape[0])
    q_head = q_j[head.head_ids.to(q_j.device)].to(head.head_probs.device)  # q_j may be on the drafter's GPU
    excess = torch.clamp(head.head_probs - q_head, min=0.0)  # [K]
    r_head = float(excess.sum())
    if r_head + head.tail_mass <= 0:
        probs = head.head_probs / head.head_probs.sum()
        return int(head.head_ids[sample_token_from_uniform(probs, draw_uniform(generator))])
    envelope = r_head + head.tail_mass
    tail = list(zip(head.tail_samples.tolist(), head.tail_sample_probs.tolist()))
    if head.tail_mass > 0 and not tail:
        return None
    for trial in itertools.count():
        if draw_uniform(generator) * envelope < r_head:
            return int(head.head_ids[sample_token_from_uniform(excess / r_head, draw_uniform(generator))])
        y, p_y = tail[trial]  # a tail trial: the tail has mass (else every trial is a head's) and samples
        if draw_uniform(generator) * p_y < p_y - float(q_j[y]):
            return y
        if trial + 1 == len(tail):
            return None


def _check_head(head: DssdHead, vocab_size: int) -> None:
    """Raise unless ``head`` is a well-formed fallback for a vocabulary of ``vocab_size`` (it comes
    from the wire: a wrong one would bias the token drawn, never only fail)."""
    check_token_ids(head.head_ids, "head_ids", vocab_size)
    if head.tail_samples.numel():
        check_token_ids(head.tail_samples, "tail_samples", vocab_size)
    check_prob_scalars(head.head_probs, "head_probs", head.head_ids.numel(), wire=True)
    check_prob_scalars(head.tail_sample_probs, "tail_sample_probs", head.tail_samples.numel(), wire=True)
    if head.head_ids.numel() == 0 or torch.unique(head.head_ids).numel() != head.head_ids.numel():
        raise ValueError("head_ids must be non-empty and distinct")
    if bool(torch.isin(head.tail_samples, head.head_ids).any()):
        raise ValueError("a tail sample lies in the head")
    total = float(head.head_probs.sum()) + head.tail_mass
    if not math.isfinite(head.tail_mass) or head.tail_mass < 0 or abs(total - 1.0) > VERIFY_SUM_ATOL:
        raise ValueError(f"head mass + tail mass is {total}, not 1")
    if head.tail_samples.numel() and head.tail_mass <= 0:
        raise ValueError("tail samples of an empty tail")
