"""Sparse lattice quantization (SQS appendix Alg. 2) and exact enumerative coding.

References: SQS (Bhattacharjee et al., "Conformal Sparsification for Bandwidth-Efficient
Edge-Cloud Speculative Decoding"): appendix A.1, Alg. 2 (lattice quantization of a K-vector to
integer counts ``b`` with ``sum b == ell``); §2, eq. (2) (``log2 C(ell+K-1, K-1)`` bits for the
counts) and eq. (5) (``log2 C(V, K)`` bits for the support); appendix A.2, eq. (20)
(``TV <= K / (4 ell)``).

Enumerative coding. A composition of ``ell`` into K non-negative parts is coded through stars
and bars as a subset of ``range(ell + K - 1)`` (the K - 1 bar positions, or the ``ell`` star
positions when those are fewer; both views have ``C(ell+K-1, K-1)`` elements) ranked in the
combinatorial number system (colexicographic order): ``rank = sum_i C(c_i, i + 1)`` for sorted
``c_0 < ... < c_{m-1}``. A K-subset of the vocabulary uses a range-split order (see
``encode_subset``): lexicographic over (count in range 0, colex rank in range 0, count in range
1, ...), exact onto ``[0, C(V, K))`` by Vandermonde's identity, and the plain colex rank when K
is small. Everything is exact Python integers; indices travel in ``ceil(bits / 8)`` bytes.

Speed (bench/bench_lattice.py). A binomial from scratch costs k multiplications of Python ints
(~15 us for k = 256), too slow for hundreds of them per packet, so:
  * colex terms are falling factorials ``perm(c, k) = k! C(c, k)``; the ``1 / k!`` is folded
    into a Horner scheme (encode) or a scaled remainder (decode), never a big division;
  * long ranges of consecutive factors come from cached products of aligned blocks of
    ``_BLOCK`` integers (and prefix/suffix products of super-blocks of ``_GROUP`` blocks);
  * a term whose position is close to its neighbour's is updated from it in place;
  * the range split keeps colex ranks small (k <= ~_ELEMENTS_PER_RANGE) and needs one big
    binomial per range; its Vandermonde offsets are a Horner evaluation in small integers;
  * decoding guesses each position (or range count) in floating point and corrects it exactly,
    or walks down one step at a time where positions are dense (compositions).
"""
from __future__ import annotations

import functools
import math

import numpy as np
import torch

from .validation import check_counts, check_int, check_lattice, check_probs, check_sorted_ids, check_uint

# Integers per cached block product. 32 factors of <= 18 bits make ~580-bit blocks: a perm of
# k = 256 factors is 8 block multiplications plus two short C-level ``math.perm`` ends.
_BLOCK = 32
# Ranges up to this many factors are multiplied directly by ``math.perm`` (C loop, no table).
_DIRECT_RANGE = 2 * _BLOCK
# Largest position gap for which a term is derived from its neighbour (multiply by the new
# factors, divide by the dropped ones) instead of being recomputed from the block table.
_MAX_INCREMENTAL_GAP = 24
# Unranking walks down from the previous position, instead of estimating, when the remaining
# positions are this dense (range / count below it): compositions, where most gaps are 1-3.
_WALK_DENSITY = 8
# Steps walked before falling back to the estimate (a head token's count can be in the hundreds).
_MAX_WALK = 24
# Newton iterations for the float position estimate when unranking; it converges in 2-3, and
# the exact correction that follows fixes any residual error, so this only bounds the work.
_NEWTON_ITERATIONS = 8
_NEWTON_TOLERANCE = 0.25
# Beyond c > _SPARSE_RATIO * k the second-order start of the estimate is used without Newton.
_SPARSE_RATIO = 4
# Target number of subset elements per range of the range-split subset code (encode_subset):
# small enough that colex ranks within a range stay cheap, large enough that the per-range
# Vandermonde bookkeeping (one big binomial each) stays a small share.
_ELEMENTS_PER_RANGE = 32


# ----------------------------------------------------------------------------- quantization


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
    ell = check_lattice(ell)
    q = probs.detach().cpu().numpy().astype(np.float64)  # numpy: K is small, torch op overhead is not
    x = ell * (q / q.sum())  # [K]
    b = np.floor(x + 0.5).astype(np.int64)
    excess = int(b.sum()) - ell
    if excess != 0:
        zeta = b - x
        if excess > 0:
            # Never decrement a zero count (only reachable through float rounding).
            order = np.argsort(-np.where(b > 0, zeta, -np.inf), kind="stable")  # largest zeta first
            b[order[:excess]] -= 1
        else:
            # A token with q = 0 only gets mass if nothing else can take it (float rounding).
            order = np.argsort(np.where(x > 0, zeta, np.inf), kind="stable")  # smallest zeta first
            b[order[:-excess]] += 1
    assert int(b.sum()) == ell and bool((b >= 0).all())
    return torch.from_numpy(b)


def dequantize(b: torch.Tensor, ell: int) -> torch.Tensor:
    """Lattice point to probabilities: ``b / ell`` as float64.  b: [K] int64, sum == ell."""
    ell = check_lattice(ell)
    check_counts(b, ell)
    return b.to(torch.float64) / ell


# ----------------------------------------------------------------------------- bit counts


@functools.lru_cache(maxsize=1024)
def _binom(n: int, k: int) -> int:
    """Exact C(n, k), memoised: the same (V, K) and (ell, K) recur for every packet."""
    return math.comb(n, k)


def _subset_args(K: object, V: object) -> tuple[int, int]:
    """(K, V) with 1 <= K <= V."""
    V = check_int(V, "V", 1)
    return check_int(K, "K", 1, V), V


def subset_bits(K: int, V: int) -> int:
    """ceil(log2 C(V, K)) bits for a K-subset of a V-token vocabulary (SQS eq. 5), exact."""
    K, V = _subset_args(K, V)
    return (_binom(V, K) - 1).bit_length()


def composition_bits(K: int, ell: int) -> int:
    """ceil(log2 C(ell + K - 1, K - 1)) bits for K lattice counts summing to ell (SQS eq. 2)."""
    K, ell = check_int(K, "K", 1), check_lattice(ell)
    return (_binom(ell + K - 1, K - 1) - 1).bit_length()


def int_to_bytes(value: int, bits: int) -> bytes:
    """Pack ``0 <= value < 2**bits`` into exactly ceil(bits / 8) big-endian bytes."""
    value = check_uint(value, "value", check_int(bits, "bits", 0))
    return value.to_bytes((bits + 7) // 8, "big")


def int_from_bytes(data: bytes, bits: int) -> int:
    """Inverse of int_to_bytes: exactly ceil(bits / 8) bytes, value < 2**bits, else ValueError."""
    check_int(bits, "bits", 0)
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
# Blocks are grouped in super-blocks of _GROUP; per super-block u, _PREFIXES[u][r] is the product
# of its first r blocks and _SUFFIXES[u][r] that of its blocks r.._GROUP-1 (both memos, like the
# block table). A long range is then head * suffix * (whole super-blocks) * prefix * tail, where
# the two big factors meet in one balanced multiplication instead of _GROUP growing ones.
_GROUP = 8
_PREFIXES: list[tuple[int, ...]] = []
_SUFFIXES: list[tuple[int, ...]] = []


def _block_products(num_blocks: int) -> list[int]:
    """The memoised block table, extended to at least ``num_blocks`` entries."""
    have = len(_BLOCK_PRODUCTS)
    if have < num_blocks:
        # Grow geometrically so that a growing vocabulary costs O(log) extensions.
        want = max(num_blocks, 2 * have)
        _BLOCK_PRODUCTS.extend(math.perm((j + 1) * _BLOCK - 1, _BLOCK) for j in range(have, want))
    return _BLOCK_PRODUCTS


def _super_tables(num_supers: int) -> tuple[list[tuple[int, ...]], list[tuple[int, ...]]]:
    """The memoised prefix/suffix tables, extended to at least ``num_supers`` super-blocks."""
    have = len(_PREFIXES)
    if have < num_supers:
        want = max(num_supers, 2 * have)
        blocks = _block_products(want * _GROUP)
        for u in range(have, want):
            group = blocks[u * _GROUP:(u + 1) * _GROUP]
            prefix, suffix = [1], [1]
            for x, y in zip(group, reversed(group)):
                prefix.append(prefix[-1] * x)
                suffix.append(suffix[-1] * y)
            _PREFIXES.append(tuple(prefix))
            _SUFFIXES.append(tuple(reversed(suffix)))
    return _PREFIXES, _SUFFIXES


def _range_product(a: int, b: int) -> int:
    """Product of the integers in [a, b] (1 when empty). Requires a >= 1 or a > b."""
    if a > b:
        return 1
    assert a >= 1
    if b - a < _DIRECT_RANGE:
        return math.perm(b, b - a + 1)
    j0 = -(-a // _BLOCK)  # first block fully inside [a, b]
    j1 = (b + 1) // _BLOCK  # one past the last block fully inside
    head = math.perm(j0 * _BLOCK - 1, j0 * _BLOCK - a)
    tail = math.perm(b, b + 1 - j1 * _BLOCK)
    u0, r0 = divmod(j0, _GROUP)
    u1, r1 = divmod(j1, _GROUP)
    if u0 == u1:
        return math.prod(_block_products(j1)[j0:j1], start=head * tail)
    prefixes, suffixes = _super_tables(u1 + 1)
    left = head * suffixes[u0][r0]
    right = tail * prefixes[u1][r1]
    if u1 == u0 + 1:
        return left * right
    return left * right * math.prod(suffixes[u][0] for u in range(u0 + 1, u1))


def _perm(c: int, k: int) -> int:
    """Falling factorial c (c-1) ... (c-k+1) = k! C(c, k); 0 when c < k."""
    return 0 if c < k else _range_product(c - k + 1, c)


# ----------------------------------------------------------------------------- colex ranking


def _rank_positions(pos: list[int]) -> int:
    """Colex rank sum_i C(c_i, i+1) of strictly increasing non-negative positions."""
    perms = []  # perms[i] = perm(c_i, i + 1)
    prev, prev_c = 0, -1
    for i, c in enumerate(pos):
        gap = c - prev_c
        if prev and gap <= _MAX_INCREMENTAL_GAP and gap - 1 < i:
            # perm(c_{i-1}, i) covers [c_{i-1}-i+1, c_{i-1}]; perm(c_i, i+1) covers [c_i-i, c_i]:
            # multiply in the gap's new factors (c_{i-1}, c_i], divide out the gap-1 lowest old ones.
            prev *= math.perm(c, gap)
            if gap > 1:
                prev //= math.perm(prev_c - i + gap - 1, gap - 1)
        else:
            prev = math.perm(c, i + 1) if i < _DIRECT_RANGE else _perm(c, i + 1)
        perms.append(prev)
        prev_c = c
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
    if x > _SPARSE_RATIO * k:
        return min(max(int(x), lo), hi)  # the expansion is accurate to well under a unit here
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
        found = False
        if above_perm and hi - 1 < _WALK_DENSITY * k:
            # Dense positions (compositions): the next one is usually a step or two below.
            c, p, found = _walk_down(above_c, above_perm, k, scaled)
            hi = c
        if not found:
            c, p = _locate(above_c, above_perm, k, scaled, hi)
        scaled = (scaled - p) // k
        pos[i], hi, above_c, above_perm = c, c, c, p
    return pos


def _walk_down(above_c: int, above_perm: int, k: int, scaled: int) -> tuple[int, int, bool]:
    """Step c down from c_{i+1} - 1 while perm(c, k) > scaled, at most _MAX_WALK steps.

    Returns (c, perm(c, k), True) at the answer, or (c, perm(c, k), False) with perm still too
    large, in which case the answer lies below c.
    """
    c = above_c - 1
    p = above_perm // above_c  # perm(c_{i+1}, k+1) = c_{i+1} perm(c_{i+1} - 1, k)
    for _ in range(_MAX_WALK):
        if p <= scaled:
            return c, p, True
        p = p * (c - k) // c  # perm(c-1, k)
        c -= 1
    return c, p, p <= scaled


def _locate(above_c: int, above_perm: int, k: int, scaled: int, hi: int) -> tuple[int, int]:
    """The largest c < hi with perm(c, k) <= scaled, and that perm: float guess, exact fix."""
    c = _estimate_position(math.log(scaled), k, k, hi - 1)
    gap = above_c - c
    if above_perm and 1 <= gap <= _MAX_INCREMENTAL_GAP and gap <= k:
        # Reverse of the update in _rank_positions: drop [c+1, c_{i+1}], add [c-k+1, c-k+gap-1].
        p = above_perm * _range_product(c - k + 1, c - k + gap - 1) // _range_product(c + 1, above_c)
    elif k <= _DIRECT_RANGE:
        p = math.perm(c, k)  # the common case inside a subset range: one C call
    else:
        p = _perm(c, k)
    return _correct_position(c, k, p, scaled, hi)


def _correct_position(c: int, k: int, p: int, scaled: int, hi: int) -> tuple[int, int]:
    """Move c (with p = perm(c, k)) to the largest c < hi with perm(c, k) <= scaled."""
    while p > scaled:
        p = p * (c - k) // c  # perm(c-1, k)
        c -= 1
    # perm(c+1, k) = p (c+1) / (c+1-k) <= scaled, tested without the division.
    while c + 1 < hi and p * (c + 1) <= scaled * (c + 1 - k):
        p = p * (c + 1) // (c + 1 - k)
        c += 1
    return c, p


# ----------------------------------------------------------------------------- range-split code


def _binomial(n: int, k: int) -> int:
    """Exact C(n, k) (0 outside 0 <= k <= n) from the block products: faster than math.comb."""
    k = min(k, n - k)
    if k < 0:
        return 0
    return _perm(n, k) // math.factorial(k)


def _ranges(n: int, m: int) -> list[tuple[int, int]]:
    """(start, size) of the equal-width ranges that split range(n) for an m-subset."""
    num = max(1, min(m // _ELEMENTS_PER_RANGE, n))
    width = -(-n // num)
    return [(start, min(width, n - start)) for start in range(0, n, width)]


def _offset_and_tail(size: int, r: int, rest: int, j: int, j_min: int, t_min: int) -> tuple[int, int]:
    """Vandermonde partial sum and next block weight for one range of the split code.

    offset = sum_{j'=j_min}^{j-1} C(size, j') C(rest, r - j'): the number of (r)-subsets of the
    remaining universe that put fewer than j elements in this range. tail = C(rest, r - j).
    Given t_min = C(rest, r - j_min), consecutive terms differ by small rational factors
    ``C(rest, r-j'-1) / C(rest, r-j') = (r - j') / (rest - r + j' + 1)``, so the whole sum is one
    Horner evaluation in small integers followed by one big multiplication and one exact division.
    """
    if j == j_min:
        return 0, t_min
    a = math.comb(size, j - 1)  # a_{j'} = C(size, j'), walked down from j' = j - 1
    y, z = a, 1  # X_{j'} = y / z with X_{j-1} = a_{j-1}, X_{j'} = a_{j'} + (num/den) X_{j'+1}
    for jp in range(j - 2, j_min - 1, -1):
        a = a * (jp + 1) // (size - jp)
        den = rest - r + jp + 1
        y = a * den * z + (r - jp) * y
        z *= den
    offset = t_min * y // z
    tail = t_min * _range_product(r - j + 1, r - j_min) // _range_product(rest - r + j_min + 1, rest - r + j)
    return offset, tail


def _split_rank(pos: list[int], n: int) -> int:
    """Rank of an m-subset of range(n) in the range-split order (see encode_subset)."""
    m = len(pos)
    ranges = _ranges(n, m)
    if len(ranges) == 1:
        return _rank_positions(pos)
    parts: list[list[int]] = [[] for _ in ranges]
    width = ranges[0][1]
    for c in pos:
        parts[c // width].append(c - (c // width) * width)
    # I_b = offset_b(j_b) + rho_b C(N_{b+1}, r_{b+1}) + I_{b+1}, accumulated from the last range.
    index, r, rest = 0, 0, 0  # I_{b+1}, r_{b+1} = elements at or after range b+1, N_{b+1}
    for (start, size), part in zip(reversed(ranges), reversed(parts)):
        j = len(part)
        r += j
        j_min = max(0, r - rest)
        offset, tail = _offset_and_tail(size, r, rest, j, j_min, _binomial(rest, r - j_min))
        index += offset + _rank_positions(part) * tail
        rest += size
    return index


def _split_unrank(index: int, m: int, n: int) -> list[int]:
    """Inverse of _split_rank; requires 0 <= index < C(n, m)."""
    ranges = _ranges(n, m)
    if len(ranges) == 1:
        return _unrank_positions(index, m, n)
    pos: list[int] = []
    r, rest = m, n
    for start, size in ranges:
        rest -= size
        j_min, j_max = max(0, r - rest), min(size, r)
        if rest == 0:
            j, rho = r, index  # the last range holds all remaining elements
        else:
            t_min = _binomial(rest, r - j_min)
            j = _estimate_count(index, size, r, rest, j_min, j_max, t_min)
            j, offset, tail = _exact_count(index, size, r, rest, j, j_min, j_max, t_min)
            rho, index = divmod(index - offset, tail)
        if j:
            pos.extend(start + c for c in _unrank_positions(rho, j, size))
        r -= j
    return pos


def _estimate_count(index: int, size: int, r: int, rest: int, j_min: int, j_max: int, t_min: int) -> int:
    """Float guess of how many elements the range holds: accumulate block weights up to index."""
    if index == 0:
        return j_min
    log_gap = math.log(math.comb(size, j_min)) + math.log(t_min) - math.log(index)  # log(block / index)
    total = 0.0
    for j in range(j_min, j_max):
        if log_gap > 0:
            return j  # this block alone exceeds the index
        total += math.exp(log_gap)
        if total > 1.0:
            return j
        log_gap += math.log((size - j) * (r - j) / ((j + 1) * (rest - r + j + 1)))
    return j_max


def _exact_count(index: int, size: int, r: int, rest: int, j: int, j_min: int, j_max: int,
                 t_min: int) -> tuple[int, int, int]:
    """Correct the guessed count exactly: returns (j, offset(j), C(rest, r - j))."""
    offset, tail = _offset_and_tail(size, r, rest, j, j_min, t_min)
    while offset > index:
        j -= 1
        offset, tail = _offset_and_tail(size, r, rest, j, j_min, t_min)
    while j < j_max:
        block = math.comb(size, j) * tail
        if offset + block > index:
            break
        offset += block
        tail = tail * (r - j) // (rest - r + j + 1)
        j += 1
    return j, offset, tail


# ----------------------------------------------------------------------------- subsets


def encode_subset(ids: torch.Tensor, V: int) -> int:
    """Enumerative index of a K-subset of range(V), in [0, C(V, K)) (SQS eq. 5 bits).

    Order: range(V) is cut into R = max(1, K // _ELEMENTS_PER_RANGE) equal-width ranges;
    subsets are ordered lexicographically by (j_0, rho_0, j_1, rho_1, ...), where j_b is the
    number of ids in range b and rho_b the colex rank (combinatorial number system) of those
    ids within the range. The block of subsets sharing j_0 .. j_b has a closed-form size
    (Vandermonde), so this is an exact bijection onto [0, C(V, K)). With R = 1 (K below
    2 * _ELEMENTS_PER_RANGE) it is the plain colex rank ``sum_i C(c_i, i + 1)``. The split keeps
    every colex rank small; only one big binomial per range is needed.

    Args:
        ids: [K] int64, strictly increasing, each in [0, V).
        V: vocabulary size.
    """
    check_sorted_ids(ids, "ids", check_int(V, "V", 1))
    return _split_rank(ids.tolist(), V)


def decode_subset(index: int, K: int, V: int) -> torch.Tensor:
    """Inverse of encode_subset: the K-subset of range(V) with the given index.

    Returns:
        [K] int64 ids, strictly increasing. ValueError unless 0 <= index < C(V, K).
    """
    K, V = _subset_args(K, V)
    check_int(index, "index", 0, _binom(V, K) - 1)
    return torch.tensor(_split_unrank(index, K, V), dtype=torch.int64)


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
    ell = check_lattice(ell)
    check_counts(b, ell)
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
    K, ell = check_int(K, "K", 1), check_lattice(ell)
    slots = ell + K - 1
    check_int(index, "index", 0, _binom(slots, K - 1) - 1)
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
