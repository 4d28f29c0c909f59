"""Tests for specdec.device.budget: draft length from a per-round bit budget (SQS section 4)."""
import pytest

from specdec.device.budget import MIN_DRAFT_LEN, fits_budget, max_draft_len_for_budget


@pytest.mark.parametrize("bits, budget, expected", [
    ([100, 200, 300], 600, 3),
    ([100, 200, 300], 599, 2),
    ([100, 200, 300], 300, 2),
    ([100, 200, 300], 99, 0),
    ([100, 10, 10], 105, 1),  # sequential: stop at the first overflow even if later ones are small
    ([0, 0, 0], 0, 3),
    ([], 10, 0),
])
def test_max_draft_len(bits, budget, expected):
    assert max_draft_len_for_budget(bits, budget) == expected


def test_fits_budget_matches_sequential_loop():
    bits = [120, 80, 300, 5]
    for budget in (0, 100, 200, 500, 1000):
        used, n = 0, 0
        while n < len(bits) and fits_budget(used, bits[n], budget):
            used += bits[n]
            n += 1
        assert n == max_draft_len_for_budget(bits, budget)


def test_min_draft_len_is_one():
    # The device drafts max(MIN_DRAFT_LEN, L) positions so every round makes progress.
    assert MIN_DRAFT_LEN == 1
    assert max(MIN_DRAFT_LEN, max_draft_len_for_budget([5000], 100)) == 1


@pytest.mark.parametrize("call", [
    lambda: fits_budget(-1, 1, 10), lambda: fits_budget(0, -1, 10), lambda: fits_budget(0, 1, -10),
    lambda: fits_budget(0, 1.5, 10), lambda: max_draft_len_for_budget([1, -2], 10),
    lambda: max_draft_len_for_budget([1, 2], -1), lambda: max_draft_len_for_budget([1, 2.0], 10),
    lambda: max_draft_len_for_budget([1, 2], True),
])
def test_rejects_bad_input(call):
    with pytest.raises(ValueError):
        call()
