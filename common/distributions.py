"""Draft/target distributions: temperature, truncation (top-K, top-p, threshold), sparse <-> dense.

References: TSLT paper (``tslt-mc-dsd.txt``) eq. (12)-(14), with the erratum of eq. (12) fixed:
the truncated distribution is ``q(x) / sum_{v in V'} q(v)`` for ``x`` in the kept set ``V'`` and 0
outside it (the paper swaps the two cases). SQS paper (``sqs-conformal.txt``) eq. (6) for the
probability-threshold support ``{x : q(x) >= beta}``.

Conventions: ``p`` target, ``q`` draft. All functions are pure; inputs are validated and bad input
raises ``ValueError``.

Determinism: every selection of a support (top-K, top-p, threshold cap) orders tokens by
descending probability and breaks ties by ascending token id, so the device and the edge (or two
runs) always pick the same set. Tokens with probability exactly 0 are never kept.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SparseDist:
    """A probability distribution over a vocabulary of ``vocab_size`` stored on its support.

    ``ids`` are strictly increasing token ids; ``probs`` are float64, non-negative, sum to 1
    (up to float64 rounding). Tokens not in ``ids`` have probability exactly 0.
    """

    ids: torch.Tensor  # [K] int64, strictly increasing, each in [0, vocab_size)
    probs: torch.Tensor  # [K] float64
    vocab_size: int


# Probabilities must sum to 1 within this tolerance. Inputs come from a float32 softmax whose sum
# is off by ~1e-6 even over 150k tokens; 1e-3 still rejects unnormalised or wrong inputs
# (logits passed as probabilities, a mask instead of a distribution).
PROB_SUM_ATOL = 1e-3
# 16-bit floats carry ~3 decimal digits, so their sum over a large vocabulary drifts further.
PROB_SUM_ATOL_16BIT = 1e-2
_SIXTEEN_BIT = (torch.float16, torch.bfloat16)
# First top-K size tried when growing a top-p prefix; most nucleus sets are smaller than this,
# so one partial selection usually suffices instead of sorting the whole vocabulary.
_TOP_P_FIRST_K = 256


# ----------------------------------------------------------------------------- validation


def _check_tensor(x: object, name: str) -> torch.Tensor:
    if not isinstance(x, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    return x


def check_probs(q: torch.Tensor, name: str = "q") -> None:
    """Raise ValueError unless ``q`` is a 1-D finite non-negative float tensor summing to ~1."""
    _check_tensor(q, name)
    if q.ndim != 1 or q.numel() == 0:
        raise ValueError(f"{name} must be a non-empty 1-D tensor, got shape {tuple(q.shape)}")
    _check_prob_values(q, name)


def _check_prob_values(q: torch.Tensor, name: str) -> None:
    """Checks dtype, finiteness, sign and per-row sum (last dim) of a probability tensor.

    Two passes over the data: a float64 sum (NaN and inf propagate into it; a sum overflowing
    to inf is rejected too, rightly) and a minimum.
    """
    if not q.is_floating_point():
        raise ValueError(f"{name} must be a floating-point tensor, got {q.dtype}")
    sums = q.sum(dim=-1, dtype=torch.float64)
    if not bool(torch.isfinite(sums).all()):
        raise ValueError(f"{name} contains NaN or inf")
    if bool(q.min() < 0):
        raise ValueError(f"{name} contains negative probabilities")
    atol = PROB_SUM_ATOL_16BIT if q.dtype in _SIXTEEN_BIT else PROB_SUM_ATOL
    if bool(((sums - 1.0).abs() > atol).any()):
        worst = float(sums.flatten()[(sums.flatten() - 1.0).abs().argmax()])
        raise ValueError(f"{name} must sum to 1 (tolerance {atol}), got a sum of {worst:.6g}")


def check_ids(ids: torch.Tensor, vocab_size: int, name: str = "ids") -> None:
    """Raise ValueError unless ``ids`` is a non-empty 1-D int64 tensor, strictly increasing, in range."""
    _check_tensor(ids, name)
    if ids.dtype != torch.int64:
        raise ValueError(f"{name} must be int64, got {ids.dtype}")
    if ids.ndim != 1 or ids.numel() == 0:
        raise ValueError(f"{name} must be a non-empty 1-D tensor, got shape {tuple(ids.shape)}")
    if int(ids[0]) < 0 or int(ids[-1]) >= vocab_size:
        raise ValueError(f"{name} out of range [0, {vocab_size})")
    if ids.numel() > 1 and not bool((ids[1:] > ids[:-1]).all()):
        raise ValueError(f"{name} must be strictly increasing (sorted, no duplicates)")


def check_sparse_dist(sd: SparseDist) -> None:
    """Raise ValueError unless ``sd`` satisfies the SparseDist invariants."""
    if not isinstance(sd, SparseDist):
        raise ValueError(f"expected a SparseDist, got {type(sd).__name__}")
    _check_vocab_size(sd.vocab_size)
    check_ids(sd.ids, sd.vocab_size, "SparseDist.ids")
    _check_tensor(sd.probs, "SparseDist.probs")
    if sd.probs.dtype != torch.float64 or sd.probs.shape != sd.ids.shape:
        raise ValueError("SparseDist.probs must be float64 with the same shape as ids")
    _check_prob_values(sd.probs, "SparseDist.probs")


def _check_vocab_size(vocab_size: object) -> None:
    if not isinstance(vocab_size, int) or isinstance(vocab_size, bool) or vocab_size < 1:
        raise ValueError(f"vocab_size must be a positive int, got {vocab_size!r}")


def _check_int(value: object, name: str, low: int, high: int) -> int:
    if not isinstance(value, int) or isinstance(value, bool):
        raise ValueError(f"{name} must be an int, got {value!r}")
    if not low <= value <= high:
        raise ValueError(f"{name} must be in [{low}, {high}], got {value}")
    return value


def _check_real(value: object, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"{name} must be a finite real number, got {value!r}")
    return float(value)


# ----------------------------------------------------------------------------- logits -> probs


def check_logits(logits: torch.Tensor, temperature: float) -> float:
    """Raise ValueError unless ``logits`` is a finite float tensor [..., V] and ``temperature`` >= 0;
    returns the temperature as a float."""
    _check_tensor(logits, "logits")
    if not logits.is_floating_point() or logits.ndim < 1 or logits.shape[-1] == 0:
        raise ValueError(f"logits must be a float tensor [..., V] with V >= 1, got {logits.dtype} "
                         f"{tuple(logits.shape)}")
    temperature = _check_real(temperature, "temperature")
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    if not bool(torch.isfinite(logits).all()):
        raise ValueError("logits contain NaN or inf")
    return temperature


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
        top = logits.argmax(dim=-1, keepdim=True)  # [..., 1]
        return torch.zeros(logits.shape, dtype=torch.float32).scatter_(-1, top, 1.0)
    x = logits.to(torch.float32)
    # Subtracting the max first keeps exp() in range for any temperature.
    x = (x - x.amax(dim=-1, keepdim=True)) / temperature
    return torch.softmax(x, dim=-1)


# ----------------------------------------------------------------------------- truncation


def _top_ids_ordered(q: torch.Tensor, k: int) -> torch.Tensor:
    """The k most probable ids of q, ordered by descending q then ascending id.  # [k] int64

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
    check_probs(q)
    return _top_ids_ordered(q, _check_int(k, "k", 1, q.numel()))


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
    check_probs(q)
    k = _check_int(k, "k", 1, q.numel())
    return _renormalised(q, _drop_zeros(q, _top_ids_ordered(q, k)))


def truncate_top_p(q: torch.Tensor, top_p: float) -> SparseDist:
    """Top-p (nucleus) truncation, TSLT eq. (14): the smallest prefix of tokens sorted by
    descending probability whose cumulative mass is >= top_p (relative to the total of q).

    The paper's inequalities in eq. (14) are off by one (they describe the largest prefix below
    top_p); we follow its prose, "the smallest set whose cumulative probability exceeds p".

    Args:
        q: [V] float probabilities summing to 1.
        top_p: in (0, 1].
    """
    check_probs(q)
    top_p = _check_real(top_p, "top_p")
    if not 0.0 < top_p <= 1.0:
        raise ValueError(f"top_p must be in (0, 1], got {top_p}")
    return _renormalised(q, _top_p_ids(q, top_p))


def _top_p_ids(q: torch.Tensor, top_p: float) -> torch.Tensor:
    """Ids of the nucleus; grows a partial top-K selection instead of sorting all of V."""
    target = top_p * float(q.double().sum())
    nonzero = int((q > 0).sum())
    k = min(_TOP_P_FIRST_K, nonzero)
    while True:
        ids = _top_ids_ordered(q, k)
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
    check_probs(q)
    beta = _check_real(beta, "beta")
    if max_k is not None:
        max_k = _check_int(max_k, "max_k", 1, 2**62)
    keep = (q.to(torch.float64) >= beta) & (q > 0)
    count = int(keep.sum())
    if count == 0:
        ids = _top_ids_ordered(q, 1)
    elif max_k is not None and count > max_k:
        ids = _top_ids_ordered(q, max_k)  # the passing tokens are exactly the most probable ones
    else:
        ids = keep.nonzero().squeeze(1)
    return _renormalised(q, ids)


# ----------------------------------------------------------------------------- sparse <-> dense


def support(q: torch.Tensor) -> torch.Tensor:
    """Ids where q > 0, ascending.  q: [V] float probabilities. Returns [K] int64."""
    check_probs(q)
    return (q > 0).nonzero().squeeze(1)


def sparsify(q: torch.Tensor, ids: torch.Tensor) -> SparseDist:
    """Restrict q to ``ids`` and renormalise (TSLT eq. 12, erratum fixed).

    Args:
        q: [V] float probabilities summing to 1.
        ids: [K] int64, strictly increasing, in [0, V); must carry positive mass.
    """
    check_probs(q)
    check_ids(ids, q.numel())
    return _renormalised(q, ids)


def densify(sd: SparseDist) -> torch.Tensor:
    """Scatter a SparseDist into a dense [V] float64 vector (0 off the support)."""
    check_sparse_dist(sd)
    dense = torch.zeros(sd.vocab_size, dtype=torch.float64)
    dense[sd.ids] = sd.probs
    return dense


def dropped_mass(q: torch.Tensor, ids: torch.Tensor) -> float:
    """sum_{x not in ids} q(x), with q normalised in float64.

    This is the C-SQS update input (SQS eq. 8) and equals TV(q, q truncated to ids), SQS Lemma 1
    (eq. 22).

    Args:
        q: [V] float probabilities summing to 1.
        ids: [K] int64, strictly increasing, in [0, V).
    """
    check_probs(q)
    check_ids(ids, q.numel())
    return _dropped_mass(q, ids)


def _dropped_mass(q: torch.Tensor, ids: torch.Tensor) -> float:
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
    u = _check_real(u, "u")
    if not 0.0 <= u < 1.0:
        raise ValueError(f"u must be in [0, 1), got {u}")
    if isinstance(probs, SparseDist):
        check_sparse_dist(probs)
        return int(probs.ids[_inverse_cdf(probs.probs, u)])
    check_probs(probs, "probs")
    return _inverse_cdf(probs, u)


def _inverse_cdf(probs: torch.Tensor, u: float) -> int:
    cum = torch.cumsum(probs.to(torch.float64), dim=0)  # [V]
    x = torch.tensor([u * float(cum[-1])], dtype=torch.float64)
    idx = int(torch.searchsorted(cum, x, right=True)[0])
    if idx >= probs.numel():
        idx = int((probs > 0).nonzero()[-1])
    return idx


def sample_token(probs: torch.Tensor | SparseDist, generator: torch.Generator) -> int:
    """Sample one token by inverse CDF from ONE float64 uniform drawn from ``generator``.

    Exact (float64 cumulative sums) and reproducible: the same generator state gives the same
    token on any machine.

    Args:
        probs: [V] float probabilities, or a SparseDist (returns a vocab id).
        generator: the per-request torch.Generator (CPU).
    """
    if not isinstance(generator, torch.Generator):
        raise ValueError(f"generator must be a torch.Generator, got {type(generator).__name__}")
    u = float(torch.rand((), dtype=torch.float64, generator=generator))
    return sample_token_from_uniform(probs, u)


def gumbel_noise(generator: torch.Generator, vocab_size: int) -> torch.Tensor:  # [V] float64
    """``vocab_size`` i.i.d. standard Gumbel draws ``-log(-log u)`` from float64 uniforms of ``generator``
    (a uniform of exactly 0 gives -inf: that token cannot win a Gumbel-max draw)."""
    if not isinstance(generator, torch.Generator):
        raise ValueError(f"generator must be a torch.Generator, got {type(generator).__name__}")
    _check_vocab_size(vocab_size)
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
    scores = torch.where(probs > 0, torch.log(probs.to(torch.float64)) + noise.to(torch.float64),
                         torch.tensor(-math.inf, dtype=torch.float64))
    best = int(scores.argmax())
    return best if probs[best] > 0 else int(probs.argmax())  # every kept token drew u = 0 (p ~ 2^-53)


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
    _check_tensor(scores, "scores")
    if scores.dtype != torch.float32 or scores.ndim < 1 or scores.shape[-1] == 0:
        raise ValueError(f"scores must be float32 [..., V] with V >= 1, got {scores.dtype} {tuple(scores.shape)}")
    if top_k is not None:
        top_k = min(_check_int(top_k, "top_k", 1, 2**62), scores.shape[-1])
        kth = torch.topk(scores, top_k)[0][..., -1, None]  # [..., 1]
        scores = scores.masked_fill(scores < kth, -math.inf)
    if top_p is not None:
        top_p = _check_real(top_p, "top_p")
        if not 0.0 < top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {top_p}")
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
