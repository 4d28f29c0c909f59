"""Tests for specdec.common.validation: each checker rejects what it should, at the stated tolerances."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from specdec.common.codecs import CodecConfig, decode_distribution
from specdec.common.modes import Mode
from specdec.common.validation import (
    DENSE_PACKET_SUM_ATOL,
    HALF_PRECISION_SUM_ATOL,
    MAX_LATTICE,
    SOFTMAX_SUM_ATOL,
    VERIFY_SUM_ATOL,
    check_counts,
    check_drafts_sampleable,
    check_generator,
    check_int,
    check_lattice,
    check_logits,
    check_nonnegative,
    check_positive,
    check_prob_rows,
    check_prob_scalars,
    check_prob_vector,
    check_probs,
    check_real,
    check_sorted_ids,
    check_sparse_probs,
    check_tensor,
    check_token_ids,
    check_uint,
    check_unit_interval,
)


def f64(*values: float) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float64)


def i64(*values: int) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64)


# ----------------------------------------------------------------------------- tolerances


def test_tolerances_are_the_stated_values_loosest_for_the_coarsest_data() -> None:
    assert VERIFY_SUM_ATOL == 1e-6  # float64 rows normalised in float64
    assert SOFTMAX_SUM_ATOL == 1e-3  # a float32 softmax row
    assert HALF_PRECISION_SUM_ATOL == 1e-2  # a float16 / bfloat16 row
    assert DENSE_PACKET_SUM_ATOL == 0.05  # a dense packet decoded from the wire
    assert VERIFY_SUM_ATOL < SOFTMAX_SUM_ATOL < HALF_PRECISION_SUM_ATOL < DENSE_PACKET_SUM_ATOL


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_softmax_rows_are_held_to_1e3(dtype) -> None:
    check_probs(torch.tensor([0.5, 0.5 + 0.9e-3], dtype=dtype), "q")
    check_probs(torch.tensor([0.5, 0.5 - 0.9e-3], dtype=dtype), "q")
    with pytest.raises(ValueError, match="sums to"):
        check_probs(torch.tensor([0.5, 0.5 + 1.1e-3], dtype=dtype), "q")


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_rows_are_held_to_1e2(dtype) -> None:
    check_probs(torch.tensor([0.5, 0.5078125], dtype=dtype), "q")  # exact in both: sum 1 + 7.8e-3
    with pytest.raises(ValueError, match="sums to"):
        check_probs(torch.tensor([0.5, 0.515625], dtype=dtype), "q")  # 1 + 1.6e-2


def test_verification_rows_are_held_to_1e6() -> None:
    check_prob_rows(torch.stack([f64(0.5, 0.5), f64(0.5, 0.5 + 0.9e-6)]), "p")
    with pytest.raises(ValueError, match="p row 1 sums to"):
        check_prob_rows(torch.stack([f64(0.5, 0.5), f64(0.5, 0.5 + 1.1e-6)]), "p")
    # the same row passes the softmax tolerance: the two purposes differ 1000-fold
    check_probs(f64(0.5, 0.5 + 1.1e-6), "q")


def test_verification_scalars_allow_the_row_slack_above_1() -> None:
    check_prob_scalars(f64(0.0, 1.0 + 0.9e-6), "q_of_draft", 2)
    with pytest.raises(ValueError, match="probabilities in"):
        check_prob_scalars(f64(1.0 + 1.1e-6), "q_of_draft", 1)


def test_wire_scalars_are_exact_probabilities_of_sampled_tokens() -> None:
    check_prob_scalars(f64(1e-300, 1.0), "dssd scalars", wire=True)
    for bad in (0.0, math.nextafter(1.0, 2.0), math.nan, math.inf, -0.5):
        with pytest.raises(ValueError, match=r"\(0, 1\]"):
            check_prob_scalars(f64(bad), "dssd scalars", wire=True)


@pytest.mark.parametrize("total, ok", [(1.0 + 0.04, True), (1.0 - 0.04, True), (1.0 + 0.06, False),
                                       (1.0 - 0.06, False)])
def test_dense_packets_are_held_to_5_percent(total: float, ok: bool) -> None:
    cfg = CodecConfig(mode=Mode.DENSE, vocab_size=4, dense_dtype="fp32")
    payload = (np.array([0.25, 0.25, 0.25, total - 0.75], dtype="<f4")).tobytes()
    if ok:
        assert float(decode_distribution(payload, cfg).probs.sum()) == pytest.approx(1.0)
    else:
        with pytest.raises(ValueError, match="sum to"):
            decode_distribution(payload, cfg)


# ----------------------------------------------------------------------------- scalars


def test_check_int() -> None:
    assert check_int(3, "k", 1, 3) == 3
    assert check_int(10**30, "k", 0) == 10**30  # no upper bound by default
    for bad in (True, 2.0, "2", None, 0, 4):
        with pytest.raises(ValueError, match=r"k must be an int in \[1, 3\]"):
            check_int(bad, "k", 1, 3)
    with pytest.raises(ValueError, match="k must be an int >= 1"):
        check_int(0, "k", 1)


def test_check_uint_takes_numpy_ints_of_a_fixed_width() -> None:
    assert check_uint(np.uint64(2**64 - 1), "seed", 64) == 2**64 - 1
    assert type(check_uint(np.int32(5), "seed", 64)) is int
    for bad in (True, 1.5, "1"):
        with pytest.raises(ValueError, match="must be an int"):
            check_uint(bad, "seed", 64)
    for bad in (-1, 2**64):
        with pytest.raises(ValueError, match=r"\[0, 2\*\*64\)"):
            check_uint(bad, "seed", 64)


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf, True, "0.5", None])
def test_check_real_rejects_non_finite_and_non_numbers(bad) -> None:
    with pytest.raises(ValueError, match="beta must be a finite real, got"):
        check_real(bad, "beta")


def test_check_real_bounds_and_their_messages() -> None:
    assert check_real(-3, "beta") == -3.0 and type(check_real(1, "beta")) is float
    assert check_nonnegative(0, "t") == 0.0
    with pytest.raises(ValueError, match="t must be a finite real >= 0"):
        check_nonnegative(-1e-300, "t")
    assert check_positive(1e-300, "rate") == 1e-300
    with pytest.raises(ValueError, match="rate must be a finite real > 0"):
        check_positive(0.0, "rate")
    with pytest.raises(ValueError, match="x must be a finite real <= 2"):
        check_real(3, "x", high=2)


@pytest.mark.parametrize("low_open, high_open, inside, outside, text", [
    (False, False, [0.0, 1.0], [-1e-9, 1 + 1e-9], "[0, 1]"),
    (True, True, [1e-9, 1 - 1e-9], [0.0, 1.0], "(0, 1)"),
    (True, False, [1.0], [0.0], "(0, 1]"),
    (False, True, [0.0], [1.0], "[0, 1)"),
])
def test_check_unit_interval(low_open, high_open, inside, outside, text) -> None:
    for value in inside:
        assert check_unit_interval(value, "a", low_open=low_open, high_open=high_open) == value
    for value in outside:
        with pytest.raises(ValueError) as err:
            check_unit_interval(value, "a", low_open=low_open, high_open=high_open)
        assert f"a must be a finite real in {text}" in str(err.value)


def test_check_lattice() -> None:
    assert check_lattice(1) == 1 and check_lattice(MAX_LATTICE) == MAX_LATTICE
    for bad in (0, MAX_LATTICE + 1, 1000.0, True):
        with pytest.raises(ValueError, match="lattice resolution ell"):
            check_lattice(bad)


# ----------------------------------------------------------------------------- tensors


def test_check_tensor_and_generator() -> None:
    x = f64(1.0)
    assert check_tensor(x, "x") is x
    with pytest.raises(ValueError, match="x must be a torch.Tensor, got list"):
        check_tensor([1.0], "x")
    check_generator(torch.Generator())
    with pytest.raises(ValueError, match="generator must be a torch.Generator"):
        check_generator(np.random.default_rng(0))


@pytest.mark.parametrize("q, match", [
    ([0.5, 0.5], "torch.Tensor"),
    (torch.ones(2, 2) / 2, "1-D"),
    (torch.empty(0), "non-empty"),
    (torch.tensor([1, 0]), "floating-point"),
    (torch.tensor([0.5, math.nan]), "NaN or inf"),
    (torch.tensor([0.5, math.inf]), "NaN or inf"),
    (torch.tensor([1.5, -0.5]), "negative"),
    (torch.tensor([3.0, -1.0, -1.0]), "negative"),  # sums to 1, still not a distribution
    (torch.tensor([0.2, 0.2]), "sums to"),
])
def test_check_probs_rejects(q, match) -> None:
    with pytest.raises(ValueError, match=match):
        check_probs(q, "q")


@pytest.mark.parametrize("x, kw, match", [
    (f64(0.5, 0.5), {}, "2-D"),
    (torch.full((1, 2), 0.5), {}, "float64"),
    (f64(0.5, 0.5).repeat(2, 1), {"rows": 3}, "3 rows"),
    (f64(0.5, 0.5).repeat(2, 1), {"vocab": 3}, "vocab size 3"),
    (torch.empty(2, 0, dtype=torch.float64), {}, "empty vocabulary"),
    (f64(0.5, math.nan).unsqueeze(0), {}, "NaN"),
    (f64(1.5, -0.5).unsqueeze(0), {}, "negative"),
    (f64(0.5, 0.4).unsqueeze(0), {}, "row 0 sums to"),
])
def test_check_prob_rows_rejects(x, kw, match) -> None:
    with pytest.raises(ValueError, match=match):
        check_prob_rows(x, "p", **kw)


def test_check_prob_vector() -> None:
    check_prob_vector(f64(0.25, 0.75), "q", 2)
    with pytest.raises(ValueError, match=r"1-D tensor \[vocab\]"):
        check_prob_vector(f64(0.25, 0.75).unsqueeze(0), "q")
    with pytest.raises(ValueError, match="vocab size 3"):
        check_prob_vector(f64(0.25, 0.75), "q", 3)


def test_check_prob_scalars_layout() -> None:
    check_prob_scalars(torch.empty(0, dtype=torch.float64), "sample_probs", 0)
    with pytest.raises(ValueError, match="1-D tensor of 2 probabilities"):
        check_prob_scalars(f64(0.5), "q_of_draft", 2)
    with pytest.raises(ValueError, match="float64"):
        check_prob_scalars(torch.tensor([0.5]), "q_of_draft", 1)


@pytest.mark.parametrize("ids, kw, match", [
    ([1, 2], {}, "torch.Tensor"),
    (i64(1, 2).unsqueeze(0), {}, "1-D"),
    (torch.tensor([1, 2], dtype=torch.int32), {}, "int64"),
    (i64(), {}, "non-empty"),
    (i64(1, 2), {"length": 3}, "3 entries"),
    (i64(0, 5), {"vocab": 5}, "out of range"),
    (i64(-1, 2), {"vocab": 5}, "out of range"),
])
def test_check_token_ids_rejects(ids, kw, match) -> None:
    with pytest.raises(ValueError, match=match):
        check_token_ids(ids, "draft_ids", **kw)


def test_check_token_ids_takes_any_order_and_repeats() -> None:
    check_token_ids(i64(4, 0, 4), "draft_ids", 5, 3)
    check_token_ids(i64(-7, 99), "draft_ids")  # vocab=None: layout only


@pytest.mark.parametrize("ids, match", [
    (i64(2, 1), "strictly increasing"),
    (i64(1, 1), "strictly increasing"),
    (i64(0, 5), "out of range"),
    (i64(-1, 0), "out of range"),
    (i64(), "non-empty"),
])
def test_check_sorted_ids_rejects(ids, match) -> None:
    with pytest.raises(ValueError, match=match):
        check_sorted_ids(ids, "ids", 5)
    check_sorted_ids(i64(0, 2, 4), "ids", 5)


def test_check_sparse_probs() -> None:
    check_sparse_probs(f64(0.25, 0.75), i64(1, 3), "SparseDist.probs")
    with pytest.raises(ValueError, match="float64"):
        check_sparse_probs(torch.tensor([0.25, 0.75]), i64(1, 3), "SparseDist.probs")
    with pytest.raises(ValueError, match="same shape"):
        check_sparse_probs(f64(1.0), i64(1, 3), "SparseDist.probs")
    with pytest.raises(ValueError, match="sums to"):
        check_sparse_probs(f64(0.25, 0.7), i64(1, 3), "SparseDist.probs")


def test_check_drafts_sampleable_names_the_first_zero_in_the_callers_numbering() -> None:
    check_drafts_sampleable(i64(3, 1), f64(0.1, 1e-300), "draft_ids")
    with pytest.raises(ValueError, match=r"draft_ids\[1\] = 7 has draft probability 0"):
        check_drafts_sampleable(i64(3, 7, 8), f64(0.1, 0.0, 0.0), "draft_ids")
    with pytest.raises(ValueError, match=r"node_tokens\[2\] = 7 .* cannot have been sampled"):
        check_drafts_sampleable(i64(3, 7), f64(0.1, 0.0), "node_tokens", first_index=1)


@pytest.mark.parametrize("b, match", [
    (torch.tensor([2.0, 2.0]), "int64"),
    (i64(), "non-empty"),
    (i64(5, -1), "non-negative"),
    (i64(1, 2), "sum to ell = 4"),
])
def test_check_counts_rejects(b, match) -> None:
    with pytest.raises(ValueError, match=match):
        check_counts(b, 4)
    check_counts(i64(0, 4), 4)


@pytest.mark.parametrize("logits, temperature, match", [
    (torch.tensor([1, 2]), 1.0, "float tensor"),
    (torch.empty(2, 0), 1.0, "float tensor"),
    (torch.tensor([1.0, math.inf]), 1.0, "NaN or inf"),
    (torch.tensor([1.0, 2.0]), -0.1, "temperature must be a finite real >= 0"),
    (torch.tensor([1.0, 2.0]), math.nan, "temperature"),
])
def test_check_logits_rejects(logits, temperature, match) -> None:
    with pytest.raises(ValueError, match=match):
        check_logits(logits, temperature)


def test_check_logits_returns_the_temperature_as_a_float() -> None:
    assert check_logits(torch.zeros(2, 3), 0) == 0.0
    assert type(check_logits(torch.zeros(3), 1)) is float
