"""Tests for specdec.common.lattice: SQS Alg. 2 quantization and exact enumerative coding."""
import itertools
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from specdec.common import lattice
from specdec.common.lattice import (
    composition_bits,
    decode_composition,
    decode_subset,
    dequantize,
    encode_composition,
    encode_subset,
    int_from_bytes,
    int_to_bytes,
    quantize,
    subset_bits,
)

HYPOTHESIS = settings(max_examples=60, deadline=None)


def reference_alg2(q, ell):
    """SQS appendix Alg. 2 written out literally on Python floats (ties by lower index).

    ``ell * q`` is formed exactly as quantize does (same float64 sum and operation order), so
    that rounding ties cannot differ between the two; the algorithm itself is independent.
    """
    total = float(q.numpy().sum())
    x = [ell * (v / total) for v in q.tolist()]
    b = [math.floor(v + 0.5) for v in x]
    excess = sum(b) - ell
    zeta = [bi - xi for bi, xi in zip(b, x)]
    if excess > 0:
        for i in sorted(range(len(x)), key=lambda i: (-zeta[i], i))[:excess]:
            b[i] -= 1
    elif excess < 0:
        for i in sorted(range(len(x)), key=lambda i: (zeta[i], i))[:-excess]:
            b[i] += 1
    return b


@st.composite
def prob_vectors(draw, max_size=80):
    size = draw(st.integers(1, max_size))
    raw = draw(st.lists(st.one_of(st.just(0.0), st.floats(1e-9, 1.0), st.sampled_from([0.5, 0.25])),
                        min_size=size, max_size=size))
    if sum(raw) == 0:
        raw[0] = 1.0
    t = torch.tensor(raw, dtype=torch.float64)
    return t / t.sum()


# ----------------------------------------------------------------------------- quantization


def test_quantize_hand_built():
    # 1.5, 1.5 round up to 2, 2 (sum 4 > 3): equal zeta, the lower index is decremented.
    assert quantize(torch.tensor([0.5, 0.5]), 3).tolist() == [1, 2]
    # 1/3 each rounds to 0 (sum 0 < 1): equal zeta, the lower index is incremented.
    assert quantize(torch.tensor([1 / 3, 1 / 3, 1 / 3], dtype=torch.float64), 1).tolist() == [1, 0, 0]
    assert quantize(torch.tensor([0.7, 0.2, 0.1]), 10).tolist() == [7, 2, 1]
    assert quantize(torch.tensor([1.0]), 1).tolist() == [1]


@HYPOTHESIS
@given(q=prob_vectors(), ell=st.integers(1, 3000))
def test_quantize_matches_alg2_and_bounds(q, ell):
    b = quantize(q, ell)
    assert b.dtype == torch.int64 and int(b.sum()) == ell and bool((b >= 0).all())
    assert b.tolist() == reference_alg2(q, ell)
    err = (q - dequantize(b, ell)).abs()
    assert float(err.max()) < 1.0 / ell  # per-entry error
    # SQS eq. (20): TV(q, b / ell) <= K / (4 ell).
    assert 0.5 * float(err.sum()) <= q.numel() / (4 * ell) + 1e-12
    assert bool((b[q == 0] == 0).all())  # no mass on zero-probability slots


def test_quantize_float32_input_is_renormalised():
    q = torch.tensor([0.5004, 0.5], dtype=torch.float32)  # sums to 1.0004, within tolerance
    assert int(quantize(q, 1000).sum()) == 1000


@pytest.mark.parametrize("args", [
    (torch.tensor([0.5, 0.5]), 0),
    (torch.tensor([0.5, 0.5]), 2.0),
    (torch.tensor([0.5, 0.6]), 10),
    (torch.tensor([1.5, -0.5]), 10),
    (torch.tensor([0.5, float("nan")]), 10),
    (torch.tensor([], dtype=torch.float32), 10),
])
def test_quantize_rejects_bad_input(args):
    with pytest.raises(ValueError):
        quantize(*args)


@pytest.mark.parametrize("b, ell", [
    (torch.tensor([1, 2]), 4), (torch.tensor([-1, 5]), 4), (torch.tensor([2.0, 2.0]), 4),
    (torch.tensor([], dtype=torch.int64), 0), (torch.tensor([4]), 0),
])
def test_dequantize_rejects_bad_counts(b, ell):
    with pytest.raises(ValueError):
        dequantize(b, ell)


# ----------------------------------------------------------------------------- enumerative coding


@pytest.mark.parametrize("n", range(1, 8))
def test_subset_ranks_are_colex_bijection(n):
    for k in range(1, n + 1):
        subsets = sorted(itertools.combinations(range(n), k), key=lambda s: s[::-1])  # colex
        for rank, subset in enumerate(subsets):
            ids = torch.tensor(subset, dtype=torch.int64)
            assert encode_subset(ids, n) == rank
            assert decode_subset(rank, k, n).tolist() == list(subset)
        assert len(subsets) == math.comb(n, k)


def compositions(total, parts):
    if parts == 1:
        yield (total,)
        return
    for first in range(total + 1):
        for rest in compositions(total - first, parts - 1):
            yield (first,) + rest


@pytest.mark.parametrize("K, ell", [(1, 1), (1, 5), (2, 1), (3, 4), (5, 2), (4, 6), (6, 3)])
def test_composition_ranks_are_bijection(K, ell):
    ranks = set()
    for comp in compositions(ell, K):
        b = torch.tensor(comp, dtype=torch.int64)
        rank = encode_composition(b, ell)
        assert 0 <= rank < math.comb(ell + K - 1, K - 1)
        assert decode_composition(rank, K, ell).tolist() == list(comp)
        ranks.add(rank)
    assert len(ranks) == math.comb(ell + K - 1, K - 1)


@HYPOTHESIS
@given(data=st.data())
def test_subset_round_trip_property(data):
    V = data.draw(st.one_of(st.integers(1, 40), st.integers(1, 200_000)))
    K = data.draw(st.one_of(st.just(1), st.just(min(V, 3)), st.integers(1, min(V, 300))))
    mode = data.draw(st.sampled_from(["random", "prefix", "suffix", "dense"]))
    if mode == "prefix":
        ids = list(range(K))
    elif mode == "suffix":
        ids = list(range(V - K, V))
    elif mode == "dense":
        start = data.draw(st.integers(0, V - K))
        ids = list(range(start, start + K))
    else:
        ids = sorted(data.draw(st.sets(st.integers(0, V - 1), min_size=K, max_size=K)))
    index = encode_subset(torch.tensor(ids, dtype=torch.int64), V)
    if K < 2 * lattice._ELEMENTS_PER_RANGE:  # a single range: the combinatorial number system
        assert index == sum(math.comb(c, i + 1) for i, c in enumerate(ids))
    assert 0 <= index < math.comb(V, K) and index.bit_length() <= subset_bits(K, V)
    assert decode_subset(index, K, V).tolist() == ids


@HYPOTHESIS
@given(data=st.data())
def test_composition_round_trip_property(data):
    K = data.draw(st.integers(1, 300))
    ell = data.draw(st.one_of(st.just(1), st.integers(1, 2000)))
    cuts = sorted(data.draw(st.lists(st.integers(0, ell), min_size=K - 1, max_size=K - 1)))
    b = torch.tensor([hi - lo for lo, hi in zip([0] + cuts, cuts + [ell])], dtype=torch.int64)
    index = encode_composition(b, ell)
    assert 0 <= index < math.comb(ell + K - 1, K - 1) and index.bit_length() <= composition_bits(K, ell)
    assert torch.equal(decode_composition(index, K, ell), b)


def test_large_case_round_trip():
    g = torch.Generator().manual_seed(0)
    V, K, ell = 152_064, 256, 1000
    ids = torch.randperm(V, generator=g)[:K].sort().values
    assert torch.equal(decode_subset(encode_subset(ids, V), K, V), ids)
    q = torch.rand(K, generator=g, dtype=torch.float64) ** 6
    b = quantize(q / q.sum(), ell)
    assert torch.equal(decode_composition(encode_composition(b, ell), K, ell), b)
    # The extreme indices decode too, to subsets that encode back to them.
    for index in (0, 1, math.comb(V, K) - 2, math.comb(V, K) - 1):
        ids = decode_subset(index, K, V)
        assert ids.numel() == K and bool((ids[1:] > ids[:-1]).all()) and encode_subset(ids, V) == index


@pytest.mark.parametrize("per_range", [1, 2, 3])
def test_range_split_code_is_bijection(monkeypatch, per_range):
    # Force many ranges on small universes so that every branch of the split code is exercised.
    monkeypatch.setattr(lattice, "_ELEMENTS_PER_RANGE", per_range)
    for n in range(1, 10):
        for k in range(1, n + 1):
            ranks = []
            for subset in itertools.combinations(range(n), k):
                ids = torch.tensor(subset, dtype=torch.int64)
                ranks.append(encode_subset(ids, n))
                assert decode_subset(ranks[-1], k, n).tolist() == list(subset)
            assert sorted(ranks) == list(range(math.comb(n, k)))


def test_range_split_code_on_skewed_and_edge_subsets():
    for V, K in [(152_064, 256), (1000, 999), (300, 300), (129, 128), (5000, 64)]:
        for ids in (list(range(K)), list(range(V - K, V)), list(range(0, V, V // K))[:K],
                    sorted(set(range(0, min(V, 3 * K), 3)))[:K]):
            if len(ids) != K:
                continue
            t = torch.tensor(ids, dtype=torch.int64)
            index = encode_subset(t, V)
            assert 0 <= index < math.comb(V, K) and decode_subset(index, K, V).tolist() == ids


def test_bit_counts_exact():
    assert subset_bits(1, 1) == 0 and subset_bits(1, 4) == 2 and subset_bits(1, 5) == 3
    assert subset_bits(2, 4) == 3  # C(4, 2) = 6
    assert subset_bits(7, 7) == 0
    assert composition_bits(1, 1000) == 0
    assert composition_bits(2, 3) == 2  # 4 compositions
    assert composition_bits(3, 2) == 3  # C(4, 2) = 6
    assert subset_bits(256, 152_064) == (math.comb(152_064, 256) - 1).bit_length()
    for K, V in [(3, 50), (17, 1000), (64, 32_000)]:
        assert subset_bits(K, V) == math.ceil(math.log2(math.comb(V, K)))


@pytest.mark.parametrize("value, bits, size", [(0, 0, 0), (1, 1, 1), (255, 8, 1), (256, 9, 2), (5, 17, 3)])
def test_int_bytes_round_trip(value, bits, size):
    data = int_to_bytes(value, bits)
    assert len(data) == size and int_from_bytes(data, bits) == value


@pytest.mark.parametrize("call", [
    lambda: int_to_bytes(256, 8),
    lambda: int_to_bytes(-1, 8),
    lambda: int_to_bytes(1, 0),
    lambda: int_from_bytes(b"\x01", 0),
    lambda: int_from_bytes(b"\x02", 1),  # a value above 2**bits in the padding
    lambda: int_from_bytes(b"\x00\x01", 8),
    lambda: int_from_bytes(b"", 3),
])
def test_int_bytes_rejects_bad_input(call):
    with pytest.raises(ValueError):
        call()


@pytest.mark.parametrize("call", [
    lambda: encode_subset(torch.tensor([3, 1]), 5),
    lambda: encode_subset(torch.tensor([1, 1]), 5),
    lambda: encode_subset(torch.tensor([1, 5]), 5),
    lambda: encode_subset(torch.tensor([-1, 2]), 5),
    lambda: encode_subset(torch.tensor([1.0, 2.0]), 5),
    lambda: encode_subset(torch.tensor([], dtype=torch.int64), 5),
    lambda: decode_subset(math.comb(10, 3), 3, 10),
    lambda: decode_subset(-1, 3, 10),
    lambda: decode_subset(0, 0, 10),
    lambda: decode_subset(0, 11, 10),
    lambda: decode_subset(1.0, 3, 10),
    lambda: encode_composition(torch.tensor([1, 2]), 4),
    lambda: encode_composition(torch.tensor([-1, 5]), 4),
    lambda: encode_composition(torch.tensor([2, 2]), 0),
    lambda: decode_composition(math.comb(12, 2), 3, 10),
    lambda: decode_composition(0, 0, 10),
    lambda: decode_composition(0, 3, 0),
])
def test_enumerative_coding_rejects_bad_input(call):
    with pytest.raises(ValueError):
        call()
