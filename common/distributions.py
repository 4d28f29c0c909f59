"""Draft/target distributions: temperature, truncation (top-K, top-p, threshold), sparse <-> dense.

References:
- TSLT: Zheng et al., "Fast Collaborative Inference via Distributed Speculative Decoding", §3.1,
  eq. (12)-(14), with the erratum of eq. (12) fixed: the truncated distribution is
  ``q(x) / sum_{v in V'} q(v)`` for ``x`` in the kept set ``V'`` and 0 outside it (the paper swaps
  the two cases).
- SQS: Bhattacharjee et al., "Conformal Sparsification for Bandwidth-Efficient Edge-Cloud
  Speculative Decoding", §3, eq. (6) for the probability-threshold support ``{x : q(x) >= beta}``.

Conventions: ``p`` target, ``q`` draft. All functions are pure; inputs are validated (validation.py)
and bad input raises ``ValueError``. A ``*_unchecked`` function skips the checks, for callers that
validated the same input already.

Determinism: every selection of a support (top-K, top-p, threshold cap) orders tokens by
descending probability and breaks ties by ascending token id, so the device and the edge (or two
runs) always pick the same set. Tokens with probability exactly 0 are never kept.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

# check_logits stays importable from here too (sampling.py validates logits before filtering them).
from specdec.common.validation import (check_generator, check_int, check_logits, check_probs, check_real,
                                       check_sorted_ids, check_sparse_probs, check_tensor, check_unit_interval)


@dataclass(frozen=True)
class SparseDist:
    """A probability distribution over a vocabulary of ``vocab_size`` stored on its support.

    ``ids`` are strictly increasing token ids; ``probs`` are float64, non-negative, sum to 1
    (up to float64 rounding). Tokens not in ``ids`` have probability exactly 0.
    """

    ids: torch.Tensor  # [K] int64, strictly increasing, each in [0, vocab_size)
    probs: torch.Tensor  # [K] float64
    vocab_size: int


# First top-K size tried when growing a top-p prefix; most nucleus sets are smaller than this,
# so one partial selection usually suffices instead of sorting the whole vocabulary.
_TOP_P_FIRST_K = 256


def check_sparse_dist(sd: SparseDist) -> None:
    """Raise ValueError unless ``sd`` satisfies the SparseDist invariants."""
    if not isinstance(sd, SparseDist):
        raise ValueError(f"expected a SparseDist, got {type(sd).__name__}")
    check_int(sd.vocab_size, "vocab_size", 1)
    check_sorted_ids(sd.ids, "SparseDist.ids", sd.vocab_size)
    check_sparse_probs(sd.probs, sd.ids, "SparseDist.probs")


# ----------------------------------------------------------------------------- first extreme

# NumPy's argmax / argmin over float32 and float64 run vectorized and return the first extreme, as
# torch's do; torch's CPU argmax reads ~2 ns an element, NumPy's ~0.2 (a [32, 128256] batch: 9.5 ms
# against 0.8 ms here).
_NUMPY_EXTREMES = (torch.float32, torch.float64)


def first_argmax(x: torch.Tensor, dim: int = -1) -> torch.Tensor:  # [..., V] -> [...] int64
    """``x.argmax(dim)``: the index of the first maximum (NaN counting as the maximum), on x's device."""
    if x.device.type == "cpu" and x.dtype in _NUMPY_EXTREMES and x.numel():
        return torch.from_numpy(np.asarray(x.numpy().argmax(axis=dim), dtype=np.int64))
    return x.argmax(dim=dim)


def first_argmin(x: torch.Tensor, dim: int = -1) -> torch.Tensor:  # [..., V] -> [...] int64
    """``x.argmin(dim)``: the index of the first minimum (NaN counting as the minimum), on x's device."""
    if x.device.type == "cpu" and x.dtype in _NUMPY_EXTREMES and x.numel():
        return torch.from_numpy(np.asarray(x.numpy().argmin(axis=dim), dtype=np.int64))
    return x.argmin(dim=dim)


# ----------------------------------------------------------------------------- logits -> probs


def probs_from_logits(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """Temperature softmax; ``temperature == 0`` is greedy decoding (one-hot at the argmax).

    Args:
        logits: [..., V] float logits, all finite.
        temperature: 0 for greedy, > 0 for sampling from softmax(logits / T).

    Returns:
        [..., V] float32 probabilities. At T = 0 the one-hot sits at the first index of the
        maximum, exactly like ``torch.argmax`` (and hence like a transformers greedy decode).
    """
    temperature = check_logits(logits, temperature)
    if temperature == 0.0:
        # argmax on the original dtype: a cast could merge distinct maxima and move the argmax.
        top = first_argmax(logits).unsqueeze(-1)  # [..., 1]
        return torch.zeros(logits.shape, dtype=torch.float32, device=logits.device).scatter_(-1, top, 1.0)
    x = logits.to(torch.float32)
    # Subtracting the max first keeps exp() in range for any temperature.
    x = x - x.amax(dim=-1, keepdim=True)
    x /= temperature  # in place: the difference is a temporary of its own
    return torch.softmax(x, dim=-1)


# ----------------------------------------------------------------------------- truncation


def top_k_ids_unchecked(q: torch.Tensor, k: int) -> torch.Tensor:
    """top_k_ids without input checks: the k most probable ids of q, by descending q then ascending id.

    ``torch.topk`` does not define which of several tied values it returns. Its set is only
    trusted when the (k+1)-th value is strictly below the k-th (no tie across the cut);
    otherwise the tokens above the k-th value plus the lowest-id ties at it are taken.
    """
    values, ids = torch.topk(q, min(k + 1, q.numel()), sorted=True)
    if k < q.numel() and bool(values[k] == values[k - 1]):
        # A tie straddles the cut, and topk picks among ties arbitrarily: take every token above
        # the k-th value plus the lowest-id ties at it instead.
        kth = values[k - 1]
        above = (q > kth).nonzero().squeeze(1)
        ties = (q == kth).nonzero().squeeze(1)[: k - above.numel()]
        ids = torch.cat([above, ties])
    else:
        ids = ids[:k]
    ids = ids.sort().values  # ascending id, so the stable sort below breaks ties by id
    order = torch.sort(q[ids], descending=True, stable=True).indices
    return ids[order]


def top_k_ids(q: torch.Tensor, k: int) -> torch.Tensor:
    """The k most probable token ids, by descending q then ascending id (TSLT eq. 13).

    Unlike truncate_top_k this keeps zero-probability tokens when q has fewer than k non-zero
    entries (K-SQS sends a fixed-size support).

    Args:
        q: [V] float probabilities summing to 1.
        k: 1 <= k <= V.

    Returns:
        [k] int64 ids in selection order (not sorted by id).
    """
    check_probs(q, "q")
    return top_k_ids_unchecked(q, check_int(k, "k", 1, q.numel()))


def _renormalised(q: torch.Tensor, ids: torch.Tensor) -> SparseDist:
    """TSLT eq. (12), erratum fixed: q / q(kept) on the kept ids, 0 elsewhere."""
    ids = ids.sort().values
    probs = q[ids].to(torch.float64)
    total = probs.sum()
    if not float(total) > 0.0:
        raise ValueError("the kept tokens have zero total probability")
    return SparseDist(ids=ids, probs=probs / total, vocab_size=q.numel())


def _drop_zeros(q: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    return ids[q[ids] > 0]


def truncate_top_k(q: torch.Tensor, k: int) -> SparseDist:
    """Top-K truncation (TSLT eq. 13) renormalised over the kept set (eq. 12, erratum fixed).

    Args:
        q: [V] float probabilities summing to 1.
        k: 1 <= k <= V. Fewer than k tokens are kept when q has fewer than k non-zero entries
            (e.g. K = 1 for the one-hot of greedy decoding).
    """
    check_probs(q, "q")
    k = check_int(k, "k", 1, q.numel())
    return _renormalised(q, _drop_zeros(q, top_k_ids_unchecked(q, k)))


def truncate_top_p(q: torch.Tensor, top_p: float) -> SparseDist:
    """Top-p (nucleus) truncation, TSLT eq. (14): the smallest prefix of tokens sorted by
    descending probability whose cumulative mass is >= top_p (relative to the total of q).

    The paper's inequalities in eq. (14) are off by one (they describe the largest prefix below
    top_p); we follow its prose, "the smallest set whose cumulative probability exceeds p".

    Args:
        q: [V] float probabilities summing to 1.
        top_p: in (0, 1].
    """
    check_probs(q, "q")
    top_p = check_unit_interval(top_p, "top_p", low_open=True)
    return _renormalised(q, _top_p_ids(q, top_p))


def _top_p_ids(q: torch.Tensor, top_p: float) -> torch.Tensor:
    """Ids of the nucleus; grows a partial top-K selection instead of sorting all of V."""
    target = top_p * float(q.double().sum())
    nonzero = int((q > 0).sum())
    k = min(_TOP_P_FIRST_K, nonzero)
    while True:
        ids = top_k_ids_unchecked(q, k)
        cum = torch.cumsum(q[ids].to(torch.float64), dim=0)  # [k]
        n = int(torch.searchsorted(cum, torch.tensor([target], dtype=torch.float64))[0]) + 1
        if n <= k or k == nonzero:
            # Rounding can leave the full sum a hair below target: then keep every non-zero token.
            return ids[: min(n, k)]
        k = min(2 * k, nonzero)


def truncate_threshold(q: torch.Tensor, beta: float, max_k: int | None = None) -> SparseDist:
    """Probability-threshold support, SQS eq. (6): ``{x : q(x) >= beta}``, renormalised.

    The comparison is done in float64 against the exact values of q. The most probable token
    (lowest id among ties) is always kept, so the support is never empty even when
    ``beta > max q`` (C-SQS thresholds may leave [0, 1], SQS Lemma 4). When more than ``max_k``
    tokens pass, the ``max_k`` most probable are kept (a protocol cap, not part of the paper).

    Args:
        q: [V] float probabilities summing to 1.
        beta: any finite real threshold.
        max_k: optional cap, >= 1.
    """
    check_probs(q, "q")
    beta = check_real(beta, "beta")
    if max_k is not None:
        max_k = check_int(max_k, "max_k", 1)
    keep = (q.to(torch.float64) >= beta) & (q > 0)
    count = int(keep.sum())
    if count == 0:
        ids = top_k_ids_unchecked(q, 1)
    elif max_k is not None and count > max_k:
        ids = top_k_ids_unchecked(q, max_k)  # the passing tokens are exactly the most probable ones
    else:
        ids = keep.nonzero().squeeze(1)
    return _renormalised(q, ids)


# ----------------------------------------------------------------------------- sparse <-> dense


def support(q: torch.Tensor) -> torch.Tensor:
    """Ids where q > 0, ascending.  q: [V] float probabilities. Returns [K] int64."""
    check_probs(q, "q")
    return (q > 0).nonzero().squeeze(1)


def sparsify(q: torch.Tensor, ids: torch.Tensor) -> SparseDist:
    """Restrict q to ``ids`` and renormalise (TSLT eq. 12, erratum fixed).

    Args:
        q: [V] float probabilities summing to 1.
        ids: [K] int64, strictly increasing, in [0, V); must carry positive mass.
    """
    check_probs(q, "q")
    check_sorted_ids(ids, "ids", q.numel())
    return _renormalised(q, ids)


def densify(sd: SparseDist, device: torch.device | str | None = None) -> torch.Tensor:
    """Scatter a SparseDist into a dense [V] float64 vector (0 off the support), on ``device``
    (default: the CPU); only the support travels there."""
    check_sparse_dist(sd)
    dense = torch.zeros(sd.vocab_size, dtype=torch.float64, device=device)
    dense[sd.ids.to(dense.device)] = sd.probs.to(dense.device)
    return dense


def dropped_mass(q: torch.Tensor, ids: torch.Tensor) -> float:
    """sum_{x not in ids} q(x), with q normalised in float64.

    This is the C-SQS update input (SQS eq. 8) and equals TV(q, q truncated to ids), SQS Lemma 1
    (eq. 22).

    Args:
        q: [V] float probabilities summing to 1.
        ids: [K] int64, strictly increasing, in [0, V).
    """
    check_probs(q, "q")
    check_sorted_ids(ids, "ids", q.numel())
    return dropped_mass_unchecked(q, ids)


def dropped_mass_unchecked(q: torch.Tensor, ids: torch.Tensor) -> float:
    """dropped_mass without input checks (for callers that validated q and built ids)."""
    if ids.numel() == q.numel():
        return 0.0
    total = float(q.sum(dtype=torch.float64))
    # 1 - kept/total: the float64 rounding (~1e-16) is far below any alpha C-SQS targets.
    return max(0.0, (total - float(q[ids].sum(dtype=torch.float64))) / total)


def tv_distance(a: torch.Tensor | SparseDist, b: torch.Tensor | SparseDist) -> float:
    """Total variation distance 1/2 sum_x |a(x) - b(x)| (TSLT eq. 16), in float64.

    Args:
        a, b: [V] float probability vectors (or SparseDists) over the same vocabulary.
    """
    a, b = (densify(x) if isinstance(x, SparseDist) else x for x in (a, b))
    check_probs(a, "a")
    check_probs(b, "b")
    if a.shape != b.shape:
        raise ValueError(f"a and b must have the same shape, got {tuple(a.shape)} and {tuple(b.shape)}")
    return 0.5 * float((a.to(torch.float64) - b.to(torch.float64)).abs().sum())


# ----------------------------------------------------------------------------- sampling


def sample_token_from_uniform(probs: torch.Tensor | SparseDist, u: float) -> int:
    """Inverse-CDF sampling with a given uniform ``u`` in [0, 1): the pure core of sample_token.

    Returns the first token whose float64 cumulative probability exceeds ``u * total``, so a token
    with probability 0 is never returned. If rounding leaves ``u * total`` at or above the last
    cumulative sum, the last token with non-zero probability is returned.

    Args:
        probs: [V] float probabilities (float64 recommended), or a SparseDist (returns a vocab id).
        u: uniform draw in [0, 1).
    """
    u = check_unit_interval(u, "u", high_open=True)
    if isinstance(probs, SparseDist):
        check_sparse_dist(probs)
        return int(probs.ids[_inverse_cdf(probs.probs, u)])
    check_probs(probs, "probs")
    return _inverse_cdf(probs, u)


def _inverse_cdf(probs: torch.Tensor, u: float) -> int:
    return int(_inverse_cdf_many(probs, torch.tensor([u], dtype=torch.float64, device=probs.device))[0])


def _inverse_cdf_many(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:  # [V], [n] -> [n] int64
    """The first token whose float64 cumulative probability exceeds ``u * total``, for each uniform,
    over one cumulative sum (:func:`inverse_cdf_rows` of one row)."""
    return inverse_cdf_rows(probs.unsqueeze(0), u.unsqueeze(0))[0]


def inverse_cdf_rows(probs: torch.Tensor,  # [r, V] probabilities (need not sum to 1)
                     u: torch.Tensor) -> torch.Tensor:  # [r, m] float64 uniforms -> [r, m] int64
    """Row by row, the first token whose float64 cumulative probability exceeds ``u * total``, one
    cumulative sum a row; past the end by rounding: the row's last token with non-zero probability.
    The one inverse CDF of every sampler here, one session's or a batch's (verify_batch.py)."""
    cum = torch.cumsum(probs.to(torch.float64), dim=-1)                        # [r, V]
    idx = torch.searchsorted(cum, u * cum[:, -1:], right=True)                # [r, m]
    past_end = idx >= probs.shape[-1]
    if bool(past_end.any()):
        for row, col in past_end.nonzero().tolist():
            idx[row, col] = int((probs[row] > 0).nonzero()[-1])
    return idx


def sample_token(probs: torch.Tensor | SparseDist, generator: torch.Generator) -> int:
    """Sample one token by inverse CDF from ONE float64 uniform drawn from ``generator``.

    Exact (float64 cumulative sums) and reproducible: the same generator state gives the same
    token on any machine.

    Args:
        probs: [V] float probabilities, or a SparseDist (returns a vocab id).
        generator: the per-request torch.Generator (CPU).
    """
    check_generator(generator)
    u = float(torch.rand((), dtype=torch.float64, generator=generator))
    return sample_token_from_uniform(probs, u)


def sample_tokens(probs: torch.Tensor, generator: torch.Generator, n: int) -> torch.Tensor:  # [n] int64
    """``n`` i.i.d. tokens from ``probs`` [V], token for token what ``n`` calls of :func:`sample_token`
    return (the same ``n`` float64 uniforms in the same order, the same float64 inverse CDF and its
    rounding fallback), with one cumulative sum instead of ``n``: DSSD's m samples of p_j after a
    rejection took ~8 ms at m = 64 and V = 49152 one by one."""
    check_generator(generator)
    check_int(n, "n", 0)
    check_probs(probs, "probs")
    u = torch.rand(n, dtype=torch.float64, generator=generator)  # [n], the stream n scalar draws read
    return _inverse_cdf_many(probs, u.to(probs.device))


def gumbel_noise(generator: torch.Generator, vocab_size: int) -> torch.Tensor:  # [V] float64
    """``vocab_size`` i.i.d. standard Gumbel draws ``-log(-log u)`` from float64 uniforms of ``generator``
    (a uniform of exactly 0 gives -inf: that token cannot win a Gumbel-max draw)."""
    check_generator(generator)
    check_int(vocab_size, "vocab_size", 1)
    u = torch.rand(vocab_size, dtype=torch.float64, generator=generator)
    return -torch.log(-torch.log(u))


def sample_token_gumbel(probs: torch.Tensor, noise: torch.Tensor) -> int:
    """Gumbel-max sampling: ``argmax_x log probs(x) + noise(x)``.

    With ``noise`` i.i.d. standard Gumbel and independent of ``probs``, the token is distributed
    exactly as ``probs`` (Gumbel 1954; the Gumbel-max trick), and a token with probability 0 is never
    returned. Two laws sampled with the SAME noise give the same token with probability at least
    ``(1 - TV) / (1 + TV)`` (the Gumbel-max coupling): the device can guess the edge's bonus token
    from its own q (client.py's drafting ahead) without changing the bonus token's law.

    Args:
        probs: [V] float probabilities.
        noise: [V] float64 Gumbel noise (:func:`gumbel_noise`).
    """
    check_probs(probs, "probs")
    if not isinstance(noise, torch.Tensor) or noise.shape != probs.shape or torch.isnan(noise).any():
        raise ValueError(f"noise must be a tensor of shape {tuple(probs.shape)} without NaN")
    noise = noise.to(probs.device, torch.float64)  # drawn on the host (its stream), probs may be on a GPU
    scores = (torch.log(probs.to(torch.float64)) + noise).masked_fill(probs <= 0, -math.inf)
    best = int(first_argmax(scores))
    return best if probs[best] > 0 else int(first_argmax(probs))  # every kept token drew u = 0 (p ~ 2^-53)


def race_token(probs: torch.Tensor, noise: torch.Tensor) -> int:
    """The Gumbel-max draw with exponential noise: ``argmin_x noise(x) / probs(x)`` over ``probs > 0``,
    which is ``argmax_x log probs(x) + g(x)`` with Gumbel noise ``g = -log noise`` (the exponential
    race; Daliri, Musco and Suresh, "Coupling without Communication and Drafter-Invariant Speculative
    Decoding", arXiv 2408.07978, §2: Gumbel sampling).

    With ``noise`` i.i.d. standard exponential and independent of ``probs``, the token is distributed
    exactly as ``probs``; a token with probability 0 is never
    returned. Two laws raced with the same noise pick the same token with probability at least
    ``(1 - TV) / (1 + TV)`` (their Theorem 2). A one-hot ``probs`` (temperature 0) returns its token
    whatever the noise.

    Args:
        probs: [V] float probabilities.
        noise: [V] float64 positive exponential noise (streams.exponentials).
    """
    check_probs(probs, "probs")
    if not isinstance(noise, torch.Tensor) or noise.shape != probs.shape or not bool((noise > 0).all()):
        raise ValueError(f"noise must be a positive tensor of shape {tuple(probs.shape)}")
    return race_token_unchecked(probs, noise)


def race_token_unchecked(probs: torch.Tensor, noise: torch.Tensor) -> int:
    """:func:`race_token` without its checks ([V] each, validated by the caller)."""
    # the noise is drawn on the host (its stream); probs may be on a GPU, where the race then runs
    keys = noise.to(probs.device, torch.float64) / probs.to(torch.float64)  # [V]; probs 0 -> inf, never the minimum
    return int(first_argmin(keys))


# ----------------------------------------------------------------------------- target filtering


def filter_target_logits(scores: torch.Tensor, top_k: int | None, top_p: float | None) -> torch.Tensor:
    """Top-k then top-p on target scores, exactly as transformers' sampling does (``-inf`` = removed).

    The target distribution is "the target alone" as transformers samples it: ``generate`` divides
    the float32 logits by the temperature, then applies ``TopKLogitsWarper`` (keeps every token
    whose score is >= the k-th largest, so all ties at the k-th score stay) and ``TopPLogitsWarper``
    (sorts ascending, removes tokens whose cumulative softmax is <= 1 - top_p, always keeps the
    last), then samples ``softmax(scores)``. The same operations on the same float32 scores keep
    the same tokens, ties and rounding included (tested against transformers' own processors).

    Args:
        scores: [..., V] float32 logits already divided by the temperature.
        top_k: None (off) or >= 1; clamped to V.
        top_p: None (off) or in (0, 1]; 1 is off, as in transformers.

    Returns:
        [..., V] float32 scores with the removed tokens at ``-inf``.
    """
    check_tensor(scores, "scores")
    if scores.dtype != torch.float32 or scores.ndim < 1 or scores.shape[-1] == 0:
        raise ValueError(f"scores must be float32 [..., V] with V >= 1, got {scores.dtype} {tuple(scores.shape)}")
    if top_k is not None:
        top_k = min(check_int(top_k, "top_k", 1), scores.shape[-1])
        kth = torch.topk(scores, top_k)[0][..., -1, None]  # [..., 1]
        scores = scores.masked_fill(scores < kth, -math.inf)
    if top_p is not None:
        top_p = check_unit_interval(top_p, "top_p", low_open=True)
        if top_p < 1.0:
            scores = _top_p_filter(scores, top_p)
    return scores


def _top_p_filter(scores: torch.Tensor, top_p: float) -> torch.Tensor:
    """transformers' TopPLogitsWarper with min_tokens_to_keep = 1, on [..., V] float32 scores."""
    sorted_scores, sorted_ids = torch.sort(scores, descending=False)
    cumulative = sorted_scores.softmax(dim=-1).cumsum(dim=-1)
    remove_sorted = cumulative <= (1 - top_p)
    remove_sorted[..., -1] = False  # the most probable token always stays
    remove = remove_sorted.scatter(-1, sorted_ids, remove_sorted)
    return scores.masked_fill(remove, -math.inf)
