"""Sparse lattice quantization (SQS appendix Alg. 2) and exact enumerative coding.

References: SQS paper (``sqs-conformal.txt``): Alg. 2 (lattice quantization of a K-vector to
integer counts ``b`` with ``sum b == ell``), eq. (2) (``log2 C(ell+K-1, K-1)`` bits for the
counts), eq. (5) (``log2 C(V, K)`` bits for the support), eq. (20) (``TV <= K / (4 ell)``).

Enumerative coding maps a K-subset of ``range(n)`` to its rank in the combinatorial number
system (colexicographic order): ``rank = sum_i C(c_i, i + 1)`` for sorted ``c_0 < ... < c_{K-1}``.
A composition of ``ell`` into K non-negative parts is coded through stars and bars as a subset of
``range(ell + K - 1)`` (the K - 1 bar positions, or the ``ell`` star positions when that is
smaller; both views have ``C(ell+K-1, K-1)`` elements). Everything is exact Python integers.

Speed: a binomial from scratch costs k multiplications of Python ints (~15 us for k = 256), too
slow for 256 of them per packet. We therefore work with falling factorials
``perm(c, k) = c (c-1) ... (c-k+1) = k! C(c, k)``:
  * ranges of consecutive factors are multiplied from cached products of aligned blocks of
    ``_BLOCK`` integers, so one ``perm`` costs about k / _BLOCK big multiplications;
  * consecutive terms whose positions are close share most factors and are updated in place;
  * the ``1 / k!`` is folded into a Horner scheme (encode) or a scaled remainder (decode), so no
    big divisions by factorials are needed;
  * decoding guesses each position from a float ``lgamma`` estimate and corrects it exactly.
"""
from __future__ import annotations

import functools
import math

import torch

from .distributions import check_probs

# Integers per cached block product. 32 factors of <= 18 bits make ~580-bit blocks: a perm of
# k = 256 factors is 8 block multiplications plus two short C-level ``math.perm`` ends.
_BLOCK = 32
# Ranges up to this many factors are multiplied directly by ``math.perm`` (C loop, no table).
_DIRECT_RANGE = 2 * _BLOCK
# Largest position gap for which a term is derived from its neighbour (multiply by the new
# factors, divide by the dropped ones) instead of being recomputed from the block table.
_MAX_INCREMENTAL_GAP = 24
# Newton iterations for the float position estimate when unranking; it converges in 2-3, and
# the exact correction that follows fixes any residual error, so this only bounds the work.
_NEWTON_ITERATIONS = 8
_NEWTON_TOLERANCE = 0.25
# Lattice resolutions above this would lose exactness in the float64 product ell * q.
MAX_LATTICE = 2**40


# ----------------------------------------------------------------------------- quantization


def _check_lattice(ell: object) -> int:
    if not isinstance(ell, int) or isinstance(ell, bool) or not 1 <= ell <= MAX_LATTICE:
        raise ValueError(f"lattice resolution ell must be an int in [1, {MAX_LATTICE}], got {ell!r}")
    return ell


def quantize(probs: torch.Tensor, ell: int) -> torch.Tensor:
    """Lattice-quantize a K-vector of probabilities to counts ``b`` with ``sum b == ell``.

    SQS appendix Alg. 2: ``b' = floor(ell q + 1/2)``; if ``sum b' != ell``, with
    ``zeta = b' - ell q``, decrease the ``sum b' - ell`` entries with the largest zeta by 1 (or
    increase the ``ell - sum b'`` entries with the smallest zeta by 1). Ties are broken by the
    lower index. ``q`` is first renormalised in float64 so that float32 rounding of its sum
    cannot shift the lattice point.

    Error bounds (exact arithmetic), with ``e = b - ell q``: every ``|e_i| < 1`` so
    ``|q_i - b_i / ell| < 1 / ell``; and ``TV(q, b / ell) <= K / (4 ell)`` (SQS eq. 20). Proof of
    the latter: after rounding, ``e`` lies in (-1/2, 1/2]; say ``d`` entries with the largest
    ``e`` (all ``>= z`` for some ``0 < z <= 1/2``) are decremented. The positive part of ``e`` is
    then at most ``(n_pos - d) z`` and the negative part at most ``n_neg / 2 + d (1 - z)``; they
    are equal (``sum e = 0``), so TV ``* ell`` is at most the ``(1 - z, z)``-weighted mean of the
    two, ``z (1 - z) n_pos + z n_neg / 2 <= K / 4``. The increment case is symmetric.

    Args:
        probs: [K] float probabilities summing to 1.
        ell: lattice resolution, >= 1.

    Returns:
        [K] int64 counts, non-negative, summing to ell exactly.
    """
    check_probs(probs, "probs")
    ell = _check_lattice(ell)
    q = probs.to(torch.float64)
    x = ell * (q / q.sum())  # [K]
    b = torch.floor(x + 0.5).to(torch.int64)
    excess = int(b.sum()) - ell
    if excess != 0:
        zeta = b.to(torch.float64) - x
        if excess > 0:
            # Never decrement a zero count (only reachable through float rounding).
            zeta = torch.where(b > 0, zeta, torch.tensor(-math.inf, dtype=torch.float64))
            order = torch.sort(zeta, descending=True, stable=True).indices
            b[order[:excess]] -= 1
        else:
            # A token with q = 0 only gets mass if nothing else can take it (float rounding).
            zeta = torch.where(x > 0, zeta, torch.tensor(math.inf, dtype=torch.float64))
            order = torch.sort(zeta, stable=True).indices
            b[order[:-excess]] += 1
    assert int(b.sum()) == ell and bool((b >= 0).all())
    return b


def _check_counts(b: torch.Tensor, ell: int) -> None:
    if not isinstance(b, torch.Tensor) or b.dtype != torch.int64 or b.ndim != 1 or b.numel() == 0:
        raise ValueError("counts b must be a non-empty 1-D int64 tensor")
    if bool((b < 0).any()):
        raise ValueError("counts b must be non-negative")
    if int(b.sum()) != ell:
        raise ValueError(f"counts b must sum to ell = {ell}, got {int(b.sum())}")


def dequantize(b: torch.Tensor, ell: int) -> torch.Tensor:
    """Lattice point to probabilities: ``b / ell`` as float64.  b: [K] int64, sum == ell."""
    ell = _check_lattice(ell)
    _check_counts(b, ell)
    return b.to(torch.float64) / ell


# ----------------------------------------------------------------------------- bit counts


@functools.lru_cache(maxsize=1024)
def _binom(n: int, k: int) -> int:
    """Exact C(n, k), memoised: the same (V, K) and (ell, K) recur for every packet."""
    return math.comb(n, k)


def _check_subset_args(k: object, n: object) -> tuple[int, int]:
    for value, name in ((k, "K"), (n, "V")):
        if not isinstance(value, int) or isinstance(value, bool):
            raise ValueError(f"{name} must be an int, got {value!r}")
    if n < 1 or not 1 <= k <= n:
        raise ValueError(f"need 1 <= K <= V, got K = {k}, V = {n}")
    return k, n


def subset_bits(K: int, V: int) -> int:
    """ceil(log2 C(V, K)) bits for a K-subset of a V-token vocabulary (SQS eq. 5), exact."""
    K, V = _check_subset_args(K, V)
    return (_binom(V, K) - 1).bit_length()


def composition_bits(K: int, ell: int) -> int:
    """ceil(log2 C(ell + K - 1, K - 1)) bits for K lattice counts summing to ell (SQS eq. 2)."""
    if not isinstance(K, int) or isinstance(K, bool) or K < 1:
        raise ValueError(f"K must be an int >= 1, got {K!r}")
    ell = _check_lattice(ell)
    return (_binom(ell + K - 1, K - 1) - 1).bit_length()


def int_to_bytes(value: int, bits: int) -> bytes:
    """Pack ``0 <= value < 2**bits`` into exactly ceil(bits / 8) big-endian bytes."""
    if not isinstance(bits, int) or bits < 0:
        raise ValueError(f"bits must be a non-negative int, got {bits!r}")
    if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value < (1 << bits):
        raise ValueError(f"value must be an int in [0, 2**{bits}), got {value!r}")
    return value.to_bytes((bits + 7) // 8, "big")


def int_from_bytes(data: bytes, bits: int) -> int:
    """Inverse of int_to_bytes: exactly ceil(bits / 8) bytes, value < 2**bits, else ValueError."""
    if not isinstance(bits, int) or bits < 0:
        raise ValueError(f"bits must be a non-negative int, got {bits!r}")
    if len(data) != (bits + 7) // 8:
        raise ValueError(f"expected {(bits + 7) // 8} bytes, got {len(data)}")
    value = int.from_bytes(data, "big")
    if value >> bits:
        raise ValueError(f"value does not fit in {bits} bits")
    return value


# ----------------------------------------------------------------------------- exact products


# _BLOCK_PRODUCTS[j] is the product of the integers in [j * _BLOCK, (j + 1) * _BLOCK). A grow-only
# memo (its content depends on nothing but j), extended on demand up to the largest range seen.
_BLOCK_PRODUCTS: list[int] = []


def _block_products(num_blocks: int) -> list[int]:
    """The memoised block table, extended to at least ``num_blocks`` entries."""
    have = len(_BLOCK_PRODUCTS)
    if have < num_blocks:
        # Grow geometrically so that a growing vocabulary costs O(log) extensions.
        want = max(num_blocks, 2 * have)
        _BLOCK_PRODUCTS.extend(math.perm((j + 1) * _BLOCK - 1, _BLOCK) for j in range(have, want))
    return _BLOCK_PRODUCTS


def _range_product(a: int, b: int) -> int:
    """Product of the integers in [a, b] (1 when empty). Requires a >= 1 or a > b."""
    if a > b:
        return 1
    assert a >= 1
    if b - a < _DIRECT_RANGE:
        return math.perm(b, b - a + 1)
    j0 = -(-a // _BLOCK)  # first block fully inside [a, b]
    j1 = (b + 1) // _BLOCK  # one past the last block fully inside
    table = _block_products(j1)
    head = math.perm(j0 * _BLOCK - 1, j0 * _BLOCK - a)
    tail = math.perm(b, b + 1 - j1 * _BLOCK)
    return math.prod(table[j0:j1], start=head * tail)


def _perm(c: int, k: int) -> int:
    """Falling factorial c (c-1) ... (c-k+1) = k! C(c, k); 0 when c < k."""
    return 0 if c < k else _range_product(c - k + 1, c)


# ----------------------------------------------------------------------------- colex ranking


def _rank_positions(pos: list[int]) -> int:
    """Colex rank sum_i C(c_i, i+1) of strictly increasing non-negative positions."""
    perms = []  # perms[i] = perm(c_i, i + 1)
    for i, c in enumerate(pos):
        prev = perms[-1] if perms else 0
        gap = c - pos[i - 1] if i else 0
        if prev and 1 <= gap <= _MAX_INCREMENTAL_GAP and gap - 1 < i:
            # perm(c_{i-1}, i) covers [c_{i-1}-i+1, c_{i-1}]; perm(c_i, i+1) covers [c_i-i, c_i]:
            # add the gap's new factors on top, drop the gap-1 lowest old factors.
            start = pos[i - 1] - i + 1
            perms.append(prev * _range_product(pos[i - 1] + 1, c) // _range_product(start, start + gap - 2))
        else:
            perms.append(_perm(c, i + 1))
    # Horner on sum_i perm_i / (i+1)!: G_i = (perm_i + G_{i+1}) / (i+1) = i! sum_{j>=i} C(c_j, j+1).
    acc = 0
    for i in range(len(pos) - 1, -1, -1):
        acc = (perms[i] + acc) // (i + 1)
    return acc


def _estimate_position(log_target: float, k: int, lo: int, hi: int) -> int:
    """Float estimate of the c in [lo, hi] with log perm(c, k) = log_target (Newton on lgamma).

    Stops once a step is below _NEWTON_TOLERANCE of a position: the exact correction that
    follows removes the last unit of error more cheaply than another lgamma iteration.
    """
    # log perm(c, k) = sum_j log(m - (j - (k-1)/2)) ~ k log m - (k^3 - k) / (24 m^2) with
    # m = c - (k-1)/2 (second-order expansion around the mean factor); one fixed-point step on m
    # lands within a fraction of a unit unless k is comparable to c.
    m = math.exp(log_target / k)
    m = math.exp(log_target / k + (k * k - 1) / (24 * m * m))
    x = m + (k - 1) / 2
    for _ in range(_NEWTON_ITERATIONS):
        if x <= lo or x >= hi:
            # The root is at or beyond a bound (common: adjacent positions); the exact
            # correction walks from the bound.
            return lo if x <= lo else hi
        f = math.lgamma(x + 1) - math.lgamma(x - k + 1) - log_target
        step = f / math.log((x + 0.5) / (x - k + 0.5))  # slope ~ digamma(x+1) - digamma(x-k+1)
        x -= step
        if -_NEWTON_TOLERANCE < step < _NEWTON_TOLERANCE:
            break
    return min(max(int(x), lo), hi)


def _unrank_positions(rank: int, m: int, n: int) -> list[int]:
    """Inverse of _rank_positions for m positions in range(n); requires 0 <= rank < C(n, m)."""
    pos = [0] * m
    scaled = rank * math.factorial(m)  # remainder R_i scaled by (i+1)!, compared with perm(c, i+1)
    hi = n  # exclusive bound: positions strictly decrease as i goes down
    above_c, above_perm = -1, 0  # c_{i+1} and perm(c_{i+1}, i+2)
    for i in range(m - 1, -1, -1):
        k = i + 1
        if scaled == 0:
            pos[: i + 1] = range(i + 1)  # the remaining rank is that of {0, ..., i}
            break
        c = _estimate_position(math.log(scaled), k, k, hi - 1)
        gap = above_c - c
        if above_perm and 1 <= gap <= _MAX_INCREMENTAL_GAP and gap <= k:
            # Reverse of the update in _rank_positions: drop [c+1, c_{i+1}], add [c-k+1, c-k+gap-1].
            p = above_perm * _range_product(c - k + 1, c - k + gap - 1) // _range_product(c + 1, above_c)
        else:
            p = _perm(c, k)
        c, p = _correct_position(c, k, p, scaled, hi)
        scaled = (scaled - p) // k
        pos[i], hi, above_c, above_perm = c, c, c, p
    return pos


def _correct_position(c: int, k: int, p: int, scaled: int, hi: int) -> tuple[int, int]:
    """Move c (with p = perm(c, k)) to the largest c < hi with perm(c, k) <= scaled."""
    while p > scaled:
        p = p * (c - k) // c  # perm(c-1, k)
        c -= 1
    while c + 1 < hi:
        nxt = p * (c + 1) // (c + 1 - k)  # perm(c+1, k)
        if nxt > scaled:
            break
        c, p = c + 1, nxt
    return c, p


# ----------------------------------------------------------------------------- subsets


def encode_subset(ids: torch.Tensor, V: int) -> int:
    """Colex rank of a K-subset of range(V) (combinatorial number system), in [0, C(V, K)).

    Args:
        ids: [K] int64, strictly increasing, each in [0, V).
        V: vocabulary size.
    """
    _check_sorted_ids(ids, V)
    return _rank_positions(ids.tolist())


def decode_subset(index: int, K: int, V: int) -> torch.Tensor:
    """Inverse of encode_subset: the K-subset of range(V) with colex rank ``index``.

    Returns:
        [K] int64 ids, strictly increasing. ValueError unless 0 <= index < C(V, K).
    """
    K, V = _check_subset_args(K, V)
    _check_index(index, _binom(V, K))
    return torch.tensor(_unrank_positions(index, K, V), dtype=torch.int64)


def _check_sorted_ids(ids: torch.Tensor, V: int) -> None:
    if not isinstance(V, int) or isinstance(V, bool) or V < 1:
        raise ValueError(f"V must be a positive int, got {V!r}")
    if not isinstance(ids, torch.Tensor) or ids.dtype != torch.int64 or ids.ndim != 1 or ids.numel() == 0:
        raise ValueError("ids must be a non-empty 1-D int64 tensor")
    if int(ids[0]) < 0 or int(ids[-1]) >= V or (ids.numel() > 1 and not bool((ids[1:] > ids[:-1]).all())):
        raise ValueError(f"ids must be strictly increasing and in [0, {V})")


def _check_index(index: object, count: int) -> None:
    if not isinstance(index, int) or isinstance(index, bool) or not 0 <= index < count:
        raise ValueError(f"index must be an int in [0, {count}), got {index!r}")


# ----------------------------------------------------------------------------- compositions


def _uses_bars(K: int, ell: int) -> bool:
    """Code the K-1 bar positions, or the ell star positions when those are fewer."""
    return K - 1 <= ell


def encode_composition(b: torch.Tensor, ell: int) -> int:
    """Rank of a composition of ell into K = len(b) non-negative parts, in [0, C(ell+K-1, K-1)).

    Args:
        b: [K] int64 counts, non-negative, summing to ell.
        ell: lattice resolution, >= 1.
    """
    ell = _check_lattice(ell)
    _check_counts(b, ell)
    K = b.numel()
    if K == 1:
        return 0
    # Stars and bars: part t occupies slots [start_t, start_t + b_t), then one bar (except last).
    ends = torch.cumsum(b, 0) + torch.arange(K)  # [K]; ends[t] = slot of the bar after part t
    if _uses_bars(K, ell):
        return _rank_positions(ends[:-1].tolist())
    stars = torch.ones(ell + K - 1, dtype=torch.bool)
    stars[ends[:-1]] = False
    return _rank_positions(stars.nonzero().squeeze(1).tolist())


def decode_composition(index: int, K: int, ell: int) -> torch.Tensor:
    """Inverse of encode_composition.

    Returns:
        [K] int64 counts, non-negative, summing to ell. ValueError unless
        0 <= index < C(ell + K - 1, K - 1).
    """
    if not isinstance(K, int) or isinstance(K, bool) or K < 1:
        raise ValueError(f"K must be an int >= 1, got {K!r}")
    ell = _check_lattice(ell)
    slots = ell + K - 1
    _check_index(index, _binom(slots, K - 1))
    if K == 1:
        return torch.tensor([ell], dtype=torch.int64)
    if _uses_bars(K, ell):
        bars = torch.tensor(_unrank_positions(index, K - 1, slots), dtype=torch.int64)
    else:
        is_bar = torch.ones(slots, dtype=torch.bool)
        is_bar[torch.tensor(_unrank_positions(index, ell, slots), dtype=torch.int64)] = False
        bars = is_bar.nonzero().squeeze(1)
    edges = torch.cat([torch.tensor([-1]), bars, torch.tensor([slots])])  # [K+1]
    return edges[1:] - edges[:-1] - 1
