"""Draft length from a per-round uplink bit budget B (SQS, Bhattacharjee et al., "Conformal
Sparsification for Bandwidth-Efficient Edge-Cloud Speculative Decoding", §4).

``L^t = max{L : sum_{n <= L} b_n^t <= B}``, enforced sequentially: the device stops drafting at the
first position whose bits would overflow B. The device always drafts at least ``MIN_DRAFT_LEN``
tokens per round, even if that one position alone exceeds B: a round with no draft would make no
progress (the edge would only add its bonus token while the link sits idle), and a budget smaller
than one packet must not stall generation.
"""
from __future__ import annotations

from collections.abc import Sequence

from specdec.common.validation import check_int

# Positions drafted per round regardless of the budget, so that every round makes progress.
MIN_DRAFT_LEN = 1


def fits_budget(used_bits: int, next_bits: int, budget_bits: int) -> bool:
    """Whether one more position of ``next_bits`` keeps the round within ``budget_bits``."""
    check_int(used_bits, "used_bits", 0)
    check_int(next_bits, "next_bits", 0)
    check_int(budget_bits, "budget_bits", 0)
    return used_bits + next_bits <= budget_bits


def max_draft_len_for_budget(bits_per_position: Sequence[int], budget_bits: int) -> int:
    """Largest L with sum of the first L entries <= budget_bits, stopping at the first overflow.

    Pure count: it can be 0 (the first position alone overflows); the device applies
    ``max(MIN_DRAFT_LEN, ...)`` on top.
    """
    check_int(budget_bits, "budget_bits", 0)
    bits = [check_int(b, f"bits_per_position[{n}]", 0) for n, b in enumerate(bits_per_position)]
    used = 0
    for n, b in enumerate(bits):
        used += b
        if used > budget_bits:
            return n
    return len(bits)
