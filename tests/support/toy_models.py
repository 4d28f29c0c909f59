"""Tiny context-dependent toy models and the statistics for the losslessness harness.

A toy "language model" over a vocabulary of ``V`` tokens is a table of next-token distributions
indexed by the last ``ORDER`` tokens, so the exact law of any finite continuation is known by
enumeration. Target ``p`` and draft ``q`` are different seeded tables (the draft is deliberately
poor: acceptance around one half), so rejections, residuals and bonus tokens are all exercised.

Statistics: a Pearson chi-square goodness-of-fit test with small expected cells merged, its upper
tail from the Wilson-Hilferty normal approximation (no scipy here), and a total-variation bound.
"""
from __future__ import annotations

import itertools
import math
from collections import Counter
from dataclasses import dataclass
from typing import Callable

import torch

ORDER = 2  # the toy models condition on the last two tokens
MIN_EXPECTED = 5.0  # chi-square cells with a smaller expected count are merged (Cochran's rule)
P_VALUE_CUT = 1e-4  # null tests must stay above, negative controls must fall below
LOGIT_SCALE = 2.0  # spread of the random logits: peaked enough that p and q differ a lot


@dataclass(frozen=True)
class ToyPair:
    """A target and a draft toy model over the same vocabulary."""

    vocab: int
    p_table: torch.Tensor  # [V**ORDER, V] float64 target next-token distributions
    q_table: torch.Tensor  # [V**ORDER, V] float64 draft next-token distributions

    def context(self, seq: list[int]) -> int:
        a, b = seq[-ORDER:]
        return a * self.vocab + b

    def p(self, seq: list[int]) -> torch.Tensor:  # [V]
        return self.p_table[self.context(seq)]

    def q(self, seq: list[int]) -> torch.Tensor:  # [V]
        return self.q_table[self.context(seq)]


def make_pair(vocab: int = 4, seed: int = 0) -> ToyPair:
    g = torch.Generator().manual_seed(seed)
    shape = (vocab**ORDER, vocab)
    p = torch.softmax(LOGIT_SCALE * torch.randn(shape, generator=g, dtype=torch.float64), dim=-1)
    q = torch.softmax(LOGIT_SCALE * torch.randn(shape, generator=g, dtype=torch.float64), dim=-1)
    return ToyPair(vocab, p, q)


def greedy_pair(pair: ToyPair, disagree_every: int = 2) -> ToyPair:
    """Temperature 0: one-hot tables at the argmax. The draft's argmax is the target's except in
    every ``disagree_every``-th context, where it is deliberately a different token."""
    v = pair.vocab
    p_arg = pair.p_table.argmax(dim=-1)  # [C]
    wrong = (p_arg + 1) % v
    q_arg = torch.where(torch.arange(v**ORDER) % disagree_every == 0, wrong, p_arg)
    eye = torch.eye(v, dtype=torch.float64)
    return ToyPair(v, eye[p_arg], eye[q_arg])


def argmax_decode(pair: ToyPair, prompt: list[int], n: int) -> list[int]:
    """The target's own greedy decode of n tokens."""
    seq = list(prompt)
    for _ in range(n):
        seq.append(int(pair.p(seq).argmax()))
    return seq[len(prompt) :]


def temperature(probs: torch.Tensor, t: float) -> torch.Tensor:
    """probs ** (1/t), renormalised (a different draft 'temperature')."""
    x = probs ** (1.0 / t)
    return x / x.sum(dim=-1, keepdim=True)


def exact_distribution(pair: ToyPair, prompt: list[int], n: int) -> dict[tuple[int, ...], float]:
    """Exact law of the next ``n`` target tokens after ``prompt``, by enumeration."""
    out = {}
    for seq in itertools.product(range(pair.vocab), repeat=n):
        ctx, prob = list(prompt), 1.0
        for x in seq:
            prob *= float(pair.p(ctx)[x])
            ctx.append(x)
        out[seq] = prob
    return out


# A round takes the current sequence (prompt + generated) and returns the newly emitted tokens.
Round = Callable[[list[int]], list[int]]


def generate_counts(round_fn: Round, prompt: list[int], n: int, num_seqs: int) -> Counter:
    """Run rounds until ``n`` tokens are generated, ``num_seqs`` times; count the continuations."""
    counts: Counter = Counter()
    for _ in range(num_seqs):
        seq = list(prompt)
        while len(seq) - len(prompt) < n:
            seq += round_fn(seq)
        counts[tuple(seq[len(prompt) : len(prompt) + n])] += 1
    return counts


@dataclass(frozen=True)
class FitResult:
    chi2: float
    dof: int
    p_value: float
    tv: float  # total variation between empirical and exact
    tv_bound: float  # TV the null exceeds with probability < P_VALUE_CUT (approx.)

    def __str__(self) -> str:
        return f"chi2={self.chi2:.1f} dof={self.dof} p={self.p_value:.3g} tv={self.tv:.4f} (bound {self.tv_bound:.4f})"


def chi2_upper_tail(stat: float, dof: int) -> float:
    """P(X >= stat) for X ~ chi2(dof), Wilson-Hilferty cube-root normal approximation.

    Accurate to well under a factor 2 at p ~ 1e-4 for dof >= 10, which is all a fixed cut needs."""
    if dof <= 0:
        return 1.0
    s = 2.0 / (9.0 * dof)
    z = ((stat / dof) ** (1.0 / 3.0) - (1.0 - s)) / math.sqrt(s)
    return 0.5 * math.erfc(z / math.sqrt(2.0))


def merged_cells(counts: Counter, exact: dict, n: int | None = None) -> list[tuple[float, int]]:
    """(expected probability, observed count) per cell, the smallest cells merged until each has an
    expected count >= MIN_EXPECTED (for ``n`` sessions: by default those counted)."""
    n = sum(counts.values()) if n is None else n
    unknown = set(counts) - set(exact)
    assert not unknown, f"impossible sequences generated: {sorted(unknown)[:5]}"
    cells = sorted((prob, counts.get(seq, 0)) for seq, prob in exact.items())
    merged: list[tuple[float, int]] = []
    acc_p, acc_c = 0.0, 0
    for prob, c in cells:
        acc_p, acc_c = acc_p + prob, acc_c + c
        if acc_p * n >= MIN_EXPECTED:
            merged.append((acc_p, acc_c))
            acc_p, acc_c = 0.0, 0
    if acc_p > 0 or acc_c > 0:  # leftover goes into the last (largest) cell
        lp, lc = merged.pop()
        merged.append((lp + acc_p, lc + acc_c))
    return merged


def goodness_of_fit(counts: Counter, exact: dict) -> FitResult:
    n = sum(counts.values())
    cells = merged_cells(counts, exact)
    chi2 = sum((c - n * prob) ** 2 / (n * prob) for prob, c in cells)
    dof = len(cells) - 1
    tv = 0.5 * sum(abs(counts.get(seq, 0) / n - prob) for seq, prob in exact.items())
    # Null: E[TV] ~ sum sqrt(prob (1 - prob) / (2 pi n)); McDiarmid (each sample moves TV by <= 1/n)
    # adds sqrt(ln(1/cut) / (2n)) for a one-sided tail below P_VALUE_CUT.
    mean_tv = sum(math.sqrt(pr * (1 - pr) / (2 * math.pi * n)) for pr in exact.values())
    bound = mean_tv + math.sqrt(math.log(1 / P_VALUE_CUT) / (2 * n))
    return FitResult(chi2, dof, chi2_upper_tail(chi2, dof), tv, bound)


# -- power: the smallest total variation a law test sees ---------------------------------------------
POWER_DRAWS = 20_000  # simulated chi-square statistics per power estimate (its error: ~0.002 at 0.9)


def least_noncentrality(law: dict, n: int, tv: float) -> float:
    """The smallest chi-square noncentrality ``n * sum(delta_c^2 / p_c)`` of any alternative at total
    variation ``tv`` from ``law`` (cells as :func:`merged_cells` merges them for ``n`` sessions).

    An alternative moves mass ``tv`` from some cells to others; the noncentrality is least when the
    shift is spread over each side in proportion to the law (delta_c = +a p_c on a set of mass P,
    -b p_c on the rest, a P = b (1 - P) = tv), giving ``tv^2 (1/P + 1/(1 - P))``, least at P as near
    1/2 as the cells allow: no side can be split, so a cell above 1/2 sets P. Mass inside merged cells
    can move unseen: it is taken off the shift (0 if a shift of ``tv`` could hide there whole). A lower
    bound, so the power stated from it is too."""
    cells = [p for p, _ in merged_cells(Counter(), law, n)]
    hidden = sum(p for p in law.values() if p * n < MIN_EXPECTED)
    if hidden >= tv:
        return 0.0
    side = max(max(cells), 0.5)
    return n * (tv - hidden) ** 2 * (1 / side + 1 / (1 - side))


def chi2_power(noncentrality: float, dof: int, cut: float = P_VALUE_CUT, draws: int = POWER_DRAWS) -> float:
    """P(the test's p-value < ``cut``) for a statistic ~ noncentral chi-square(dof, noncentrality),
    simulated (seeded: the same answer every run) through the test's own p-value."""
    g = torch.Generator().manual_seed(0)
    z = torch.randn(draws, dof, generator=g, dtype=torch.float64)
    z[:, 0] += math.sqrt(noncentrality)
    stats = (z ** 2).sum(dim=1).tolist()
    return sum(chi2_upper_tail(s, dof) < cut for s in stats) / draws


def sessions_for(law: dict, tv: float, power: float, cut: float = P_VALUE_CUT) -> int:
    """The fewest sessions (to the next thousand) at which any alternative at total variation ``tv``
    is rejected with probability >= ``power`` (:func:`least_noncentrality`, :func:`chi2_power`)."""
    n = 1000
    while chi2_power(least_noncentrality(law, n, tv), len(merged_cells(Counter(), law, n)) - 1, cut) < power:
        n += 1000
    return n
