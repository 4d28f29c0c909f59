"""Tests for specdec.device.latency against hand-computed values (TSLT eq. 1-10, 26-28)."""
import pytest

from specdec.device.latency import (
    comm_time,
    dense_uplink_bits,
    dsd_throughput,
    expected_tokens_by_depth,
    expected_tokens_per_call,
    oracle_time,
    oracle_time_drafting_ahead,
    predicted_speedup,
    speedup,
    tree_num_distributions,
    tree_oracle_time,
    tree_speedup,
)


def test_oracle_time_drafting_ahead():
    # hit rate 0: eq. (5); drafting (5 x 10 ms) hidden inside the 90 ms window when every guess holds
    assert oracle_time_drafting_ahead(4, 0.01, 0.01, 0.08, 0.0) == pytest.approx(oracle_time(4, 0.01, 0.01, 0.08))
    assert oracle_time_drafting_ahead(4, 0.01, 0.01, 0.08, 1.0) == pytest.approx(0.09)
    # drafting longer than the window: the excess shows; half the guesses hold: the mean of both
    assert oracle_time_drafting_ahead(4, 0.03, 0.01, 0.08, 1.0) == pytest.approx(0.15)
    assert oracle_time_drafting_ahead(4, 0.03, 0.01, 0.08, 0.5) == pytest.approx(0.5 * 0.15 + 0.5 * 0.21)
    with pytest.raises(ValueError):
        oracle_time_drafting_ahead(4, 0.03, 0.01, 0.08, 1.5)


def test_comm_and_uplink():
    assert comm_time(1_000_000, 2_000_000) == 0.5  # eq. (1)
    assert dense_uplink_bits(4, 32_000, 16) == 4 * 32_000 * (16 + 15)  # eq. (2)-(3), ceil(log2 32000) = 15
    assert dense_uplink_bits(1, 1024, 32) == 1024 * (32 + 10)
    assert dense_uplink_bits(2, 100, 16, b_idx=0) == 3200


def test_oracle_time_and_tokens():
    assert oracle_time(4, 0.01, 0.2, 0.1) == pytest.approx(0.34)  # eq. (5)
    assert expected_tokens_per_call(0.5, 3) == pytest.approx(1.875)  # (1 - 0.5^4) / 0.5
    assert expected_tokens_per_call(0.0, 5) == 1.0
    assert expected_tokens_per_call(1.0, 5) == 6.0
    assert expected_tokens_per_call(1.0 - 1e-12, 5) == pytest.approx(6.0, rel=1e-6)  # continuous at 1


def test_tokens_by_depth_is_eq8_for_constant_acceptance_and_counts_survivors_otherwise():
    assert expected_tokens_by_depth([0.5] * 3) == pytest.approx(expected_tokens_per_call(0.5, 3))
    assert expected_tokens_by_depth([0.9] * 8) == pytest.approx(expected_tokens_per_call(0.9, 8))
    assert expected_tokens_by_depth([]) == 1.0
    # rejected at depth 1 or accepted to the end (mean per-position acceptance ~0.9 as above): more tokens
    assert expected_tokens_by_depth([0.7] + [1.0] * 7) == pytest.approx(1 + 8 * 0.7)
    with pytest.raises(ValueError):
        expected_tokens_by_depth([0.5, 1.2])


def test_throughput_and_speedup():
    # alpha 0.5, L 3, V 1024, fp16 + 10-bit ids, 1 Mbit/s: D = 3 * 1024 * 26 = 79872 bits.
    t_oracle = 3 * 0.01 + 79_872 / 1e6 + 0.1
    theta = dsd_throughput(0.5, 3, 0.01, 0.1, 1024, 16, 1e6)
    assert theta == pytest.approx(1.875 / t_oracle)
    assert speedup(theta, 0.1) == pytest.approx(0.1875 / t_oracle)  # eq. (10)
    assert predicted_speedup(0.5, 3, 0.01, 0.1, 0.05, 0.02) == pytest.approx(1.875 * 0.1 / 0.2)


def test_tree_model():
    assert tree_num_distributions([2, 2, 2]) == 1 + 2 + 4  # eq. (27)
    assert tree_num_distributions([3]) == 1
    assert tree_num_distributions([1, 1, 1, 1]) == 4  # a chain: one distribution per layer
    assert tree_oracle_time([2, 3], 0.01, 0.005, 0.1) == pytest.approx(2 * 0.01 + 3 * 0.005 + 0.1)  # eq. (26)
    # (L alpha + 1) T_LLM / T_oracle = 2 * 0.1 / 0.135.
    assert tree_speedup([2, 3], 0.5, 0.01, 0.005, 0.1) == pytest.approx(0.2 / 0.135)


@pytest.mark.parametrize("call", [
    lambda: comm_time(10, 0), lambda: comm_time(-1, 10), lambda: dense_uplink_bits(1, 0, 16),
    lambda: oracle_time(-1, 0.1, 0.1, 0.1), lambda: oracle_time(1, float("nan"), 0.1, 0.1),
    lambda: expected_tokens_per_call(1.5, 3), lambda: expected_tokens_per_call(-0.1, 3),
    lambda: speedup(1.0, 0.0), lambda: tree_num_distributions([]), lambda: tree_num_distributions([2, 0]),
    lambda: tree_speedup([2], 2.0, 0.1, 0.1, 0.1), lambda: predicted_speedup(0.5, 2, 0.1, 0.1, -1.0),
])
def test_rejects_bad_input(call):
    with pytest.raises(ValueError):
        call()
