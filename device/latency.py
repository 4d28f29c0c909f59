"""Oracle-call latency model of distributed speculative decoding, as plain functions.

Reference: TSLT, Zheng et al., "Fast Collaborative Inference via Distributed Speculative Decoding":
§2.2-2.3, eq. (1)-(10) for a single-candidate chain, and §4.2, eq. (26)-(28) for token trees.
Times are in seconds, rates in bits per second.

Errata handled here (checked against the definitions they come from):
  * eq. (9) prints ``(1 - alpha^{L+1}) / ((1 - alpha) L (T_SLM + ...) + T_LLM)``; with
    ``Theta = N_oracle / T_oracle`` (its own first line) the ``(1 - alpha)`` multiplies the whole
    denominator. We compute ``N_oracle / T_oracle``.
  * eq. (28) prints ``1 / ((L T_SLM + |Q| T_V) / ((L alpha + 1) T_LLM) + 1)``; from eq. (10) and
    (26), ``S = N T_LLM / T_oracle`` with ``N = L alpha + 1`` gives ``+ 1 / (L alpha + 1)`` in
    place of the final ``+ 1``. We compute ``N T_LLM / T_oracle``.
"""
from __future__ import annotations

from collections.abc import Sequence

from specdec.common.validation import check_int, check_nonnegative, check_positive, check_unit_interval



def comm_time(bits: float, rate_bps: float) -> float:
    """Eq. (1): T_comm = D_up / R_up."""
    return check_nonnegative(bits, "bits") / check_positive(rate_bps, "rate_bps")


def dense_uplink_bits(L: int, V: int, b_prob: int, b_idx: int | None = None) -> int:
    """Eq. (2)-(3): D_up = L |V| (b_prob + b_idx), with b_idx = ceil(log2 |V|) by default."""
    check_int(L, "L", 0)
    check_int(V, "V", 1)
    check_int(b_prob, "b_prob", 0)
    b_idx = (V - 1).bit_length() if b_idx is None else check_int(b_idx, "b_idx", 0)
    return L * V * (b_prob + b_idx)


def oracle_time(L: int, t_slm: float, t_comm: float, t_llm: float) -> float:
    """Eq. (5): T_oracle = L T_SLM + T_comm + T_LLM (one draft-send-verify round)."""
    return (check_int(L, "L", 0) * check_nonnegative(t_slm, "t_slm") + check_nonnegative(t_comm, "t_comm")
            + check_nonnegative(t_llm, "t_llm"))


def oracle_time_drafting_ahead(L: int, t_slm: float, t_comm: float, t_llm: float, hit_rate: float) -> float:
    """Eq. (5) when the device drafts round r + 1 while round r is verified (our extension, not in
    the papers; device/session.py ``draft_ahead``).

    Drafting ahead starts when round r is sent, on a guess of its verdict (all accepted, a guessed
    bonus token); it needs L + 1 drafter steps (it first feeds the last draft token). With
    probability ``hit_rate`` the guess holds and the steps that fit into the verify window
    W = T_comm + T_LLM are kept: T = W + max(0, (L + 1) T_SLM - W). Otherwise the round is drafted
    after the verdict, as in eq. (5): T = W + L T_SLM. ``hit_rate`` = 0 gives eq. (5) exactly.
    """
    L, h = check_int(L, "L", 0), check_unit_interval(hit_rate, "hit_rate")
    window = check_nonnegative(t_comm, "t_comm") + check_nonnegative(t_llm, "t_llm")
    drafting = check_nonnegative(t_slm, "t_slm")
    kept = window + max(0.0, (L + 1) * drafting - window)
    return h * kept + (1.0 - h) * (window + L * drafting)


def expected_tokens_per_call(alpha: float, L: int) -> float:
    """Eq. (8): N_oracle = (1 - alpha^{L+1}) / (1 - alpha); L + 1 at alpha = 1 (the limit)."""
    alpha, L = check_unit_interval(alpha, "alpha"), check_int(L, "L", 0)
    if alpha == 1.0:
        return float(L + 1)
    return (1.0 - alpha ** (L + 1)) / (1.0 - alpha)


def expected_tokens_by_depth(alphas: Sequence[float]) -> float:
    """Eq. (8) without its i.i.d. assumption: a round of L = len(alphas) drafts, where alphas[d] is the
    acceptance at depth d + 1 given every earlier draft was accepted, yields
    N = 1 + sum_{l=1}^{L} prod_{d<=l} alpha_d tokens (accepted drafts plus the correction or bonus).
    Constant alphas give eq. (8). Real acceptance is correlated along a round (easy text is easy at
    every depth), so the conditional acceptance grows with depth and eq. (8) undercounts long rounds."""
    total, survive = 1.0, 1.0
    for i, a in enumerate(alphas):
        survive *= check_unit_interval(a, f"alphas[{i}]")
        total += survive
    return total


def dsd_throughput(alpha: float, L: int, t_slm: float, t_llm: float, V: int, b_prob: int,
                   rate_bps: float, b_idx: int | None = None) -> float:
    """Eq. (9), erratum fixed: tokens per second = N_oracle / T_oracle with dense uplink."""
    t_comm = comm_time(dense_uplink_bits(L, V, b_prob, b_idx), rate_bps)
    return expected_tokens_per_call(alpha, L) / oracle_time(L, t_slm, t_comm, t_llm)


def speedup(throughput: float, t_llm: float) -> float:
    """Eq. (10): S = Theta_DSD / Theta_LLM with Theta_LLM = 1 / T_LLM."""
    return check_nonnegative(throughput, "throughput") * check_positive(t_llm, "t_llm")


def predicted_speedup(alpha: float, L: int, t_slm: float, t_llm: float, uplink_seconds: float,
                      downlink_seconds: float = 0.0) -> float:
    """N_oracle T_LLM / T_oracle (eq. 5, 8, 10) with measured uplink and downlink times."""
    t_comm = (check_nonnegative(uplink_seconds, "uplink_seconds")
              + check_nonnegative(downlink_seconds, "downlink_seconds"))
    return expected_tokens_per_call(alpha, L) * check_positive(t_llm, "t_llm") / oracle_time(L, t_slm, t_comm, t_llm)


def _check_config(config: Sequence[int]) -> list[int]:
    ks = [check_int(k, f"config[{i}]", 1) for i, k in enumerate(config)]
    if not ks:
        raise ValueError("expansion configuration must be non-empty")
    return ks


def tree_num_distributions(config: Sequence[int]) -> int:
    """Eq. (27): |Q| = 1 + sum_{i=1}^{L-1} prod_{j<=i} k_j for config <k_1, ..., k_L>.

    One distribution per node that has children: the root plus every node of layers 1..L-1.
    """
    ks = _check_config(config)
    total, width = 1, 1
    for k in ks[:-1]:
        width *= k
        total += width
    return total


def tree_oracle_time(config: Sequence[int], t_slm: float, t_v: float, t_llm: float) -> float:
    """Eq. (26): T_oracle = L T_SLM + |Q| T_V + T_LLM, T_V = time to send one distribution."""
    ks = _check_config(config)
    return oracle_time(len(ks), t_slm, tree_num_distributions(ks) * check_nonnegative(t_v, "t_v"), t_llm)


def tree_speedup(config: Sequence[int], alpha: float, t_slm: float, t_v: float, t_llm: float) -> float:
    """Eq. (28), erratum fixed (module docstring): (L alpha + 1) T_LLM / T_oracle(tree)."""
    ks = _check_config(config)
    tokens = len(ks) * check_unit_interval(alpha, "alpha") + 1.0
    return tokens * check_positive(t_llm, "t_llm") / tree_oracle_time(ks, t_slm, t_v, t_llm)
