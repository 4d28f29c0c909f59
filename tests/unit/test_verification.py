"""Hand-built and edge-case tests for specdec.common.verification (chain, MC, DSSD halves).

The statistical losslessness tests live in test_lossless.py.
"""
from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from specdec.common.verification import (
    ChainResult,
    bonus_noise,
    chain_verify,
    dssd_device_residual,
    dssd_device_resolve,
    dssd_device_resolve_head,
    dssd_edge_head,
    dssd_edge_verify,
    dssd_fallback_bytes,
    gumbel_verify,
    mc_verify,
    residual_distribution,
    sample_candidates,
    sample_token,
    sample_tokens,
    token_noise,
)
from specdec.common.distributions import race_token

V = 5


def gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def dist(*values: float) -> torch.Tensor:
    t = torch.tensor(values, dtype=torch.float64)
    return t / t.sum()


def one_hot(i: int, vocab: int = V) -> torch.Tensor:
    t = torch.zeros(vocab, dtype=torch.float64)
    t[i] = 1.0
    return t


def ids(*xs: int) -> torch.Tensor:
    return torch.tensor(xs, dtype=torch.int64)


Q_ROW = dist(1, 2, 3, 4, 5)
P_ROW = dist(5, 1, 1, 2, 1)


# --- chain_verify ------------------------------------------------------------------------------


@pytest.mark.parametrize("L", [1, 2, 4])
@pytest.mark.parametrize("seed", range(5))
def test_perfect_match_accepts_all_and_samples_bonus(L: int, seed: int) -> None:
    q = Q_ROW.repeat(L, 1)
    p = torch.cat([q, one_hot(3).unsqueeze(0)])  # bonus row is one-hot: bonus must be 3
    draft = ids(*[(seed + i) % V for i in range(L)])
    res = chain_verify(draft, q, p, gen(seed))
    assert res == ChainResult(num_accepted=L, next_token=3)


@pytest.mark.parametrize("reject_at", [0, 1, 2])
def test_target_zero_at_draft_rejects_there(reject_at: int) -> None:
    L = 3
    draft = ids(1, 2, 3)
    q = Q_ROW.repeat(L, 1)
    p = Q_ROW.repeat(L + 1, 1)
    # p_j(x_j) = 0: rejection is certain; the rest of the row goes to token 0 only, so the residual
    # norm(max(0, p - q)) is one-hot at 0.
    p[reject_at] = one_hot(0)
    for seed in range(20):
        res = chain_verify(draft, q, p, gen(seed))
        assert res == ChainResult(num_accepted=reject_at, next_token=0)


def test_q_equal_p_always_accepts() -> None:
    torch.manual_seed(0)
    for seed in range(200):
        rows = torch.softmax(torch.randn(4, V, dtype=torch.float64, generator=gen(seed)), dim=-1)
        draft = torch.multinomial(rows[:3], 1, generator=gen(seed)).squeeze(1)
        assert chain_verify(draft, rows[:3], rows, gen(seed)).num_accepted == 3


def test_draw_order_is_documented_order() -> None:
    """n + 1 accept uniforms, then one inverse-CDF uniform for the correction token."""
    draft = ids(0, 1)
    q = torch.stack([dist(1, 1, 1, 1, 1), dist(1, 1, 1, 1, 1)])
    p = torch.stack([dist(2, 1, 1, 1, 1), dist(1, 1, 1, 1, 2), dist(1, 1, 1, 1, 1)])
    for seed in range(50):
        g = gen(seed)
        u = torch.rand(4, generator=gen(seed), dtype=torch.float64).tolist()
        res = chain_verify(draft, q, p, g)
        # position 0: p/q = 2/6 / (1/5) > 1 -> always accepted; position 1: p/q = (1/6)/(1/5) = 5/6
        if u[1] < 5 / 6:
            expected_next = int(torch.searchsorted(torch.cumsum(p[2], 0), u[2], right=True))
            assert res == ChainResult(2, expected_next)
        else:
            residual = residual_distribution(p[1], q[1])
            expected_next = int(torch.searchsorted(torch.cumsum(residual, 0), u[2], right=True))
            assert res == ChainResult(1, expected_next)
            assert expected_next == 4  # the only token with p > q at position 1


def test_residual_is_renormalised_positive_part() -> None:
    p, q = dist(4, 3, 2, 1, 0), dist(1, 1, 1, 1, 1)
    r = residual_distribution(p, q)
    expected = torch.clamp(p - q, min=0)
    torch.testing.assert_close(r, expected / expected.sum(), rtol=0, atol=1e-15)
    assert math.isclose(float(r.sum()), 1.0, abs_tol=1e-15)
    assert r[3] == 0 and r[4] == 0


def test_residual_of_identical_distributions_is_p() -> None:
    torch.testing.assert_close(residual_distribution(P_ROW, P_ROW), P_ROW)


def argmax_path(table: dict[tuple[int, ...], int], prefix: tuple[int, ...], n: int) -> list[int]:
    out = list(prefix)
    for _ in range(n):
        out.append(table[tuple(out[-2:])])
    return out[len(prefix):]


@pytest.mark.parametrize("seed", range(10))
def test_greedy_one_hot_equals_target_argmax(seed: int) -> None:
    """Temperature 0: one-hot p and q; the output is the target's argmax decode token for token."""
    rng = torch.Generator().manual_seed(seed)
    contexts = [(a, b) for a in range(V) for b in range(V)]
    tgt = {c: int(torch.randint(V, (1,), generator=rng)) for c in contexts}
    # the draft agrees with the target's argmax in ~60% of contexts, else proposes a random token
    dft = {c: tgt[c] if torch.rand(1, generator=rng) < 0.6 else int(torch.randint(V, (1,), generator=rng))
           for c in contexts}
    want = argmax_path(tgt, (0, 1), 12)
    seq = [0, 1]
    L = 3
    while len(seq) < 14:
        draft = []
        for _ in range(L):
            draft.append(dft[tuple((seq + draft)[-2:])])
        q = torch.stack([one_hot(dft[tuple((seq + draft[:i])[-2:])]) for i in range(L)])
        p = torch.stack([one_hot(tgt[tuple((seq + draft[:i])[-2:])]) for i in range(L + 1)])
        res = chain_verify(ids(*draft), q, p, gen(seed))
        seq += draft[: res.num_accepted] + [res.next_token]
    assert seq[2:14] == want


# --- bad input -----------------------------------------------------------------------------------


def _good() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return ids(1, 2), Q_ROW.repeat(2, 1), P_ROW.repeat(3, 1)


def _nan_p(d, q, p):
    p = p.clone()
    p[1, 0] = float("nan")
    return d, q, p


def _neg_q(d, q, p):
    q = q.clone()
    q[0, 0] = -0.1
    q[0, 1] += 0.1
    return d, q, p


def _unnorm_p(d, q, p):
    return d, q, p * 1.01


def _q_zero_at_draft(d, q, p):
    q = q.clone()
    q[1] = dist(1, 1, 0, 1, 1)  # draft_ids[1] == 2
    return d, q, p


@pytest.mark.parametrize(
    "mutate, match",
    [
        (lambda d, q, p: (d, q.float(), p), "float64"),
        (lambda d, q, p: (d.int(), q, p), "int64"),
        (lambda d, q, p: (ids(), q[:0], p[:1]), "non-empty"),
        (lambda d, q, p: (ids(1, V), q, p), "out of range"),
        (lambda d, q, p: (ids(-1, 2), q, p), "out of range"),
        (lambda d, q, p: (d, q, p[:2]), "rows"),
        (lambda d, q, p: (d, q, p[:, :4] / p[:, :4].sum(-1, keepdim=True)), "vocab"),
        (lambda d, q, p: (d, q[0], p), "2-D"),
        (_nan_p, "NaN"),
        (_neg_q, "negative"),
        (_unnorm_p, "sums to"),
        (_q_zero_at_draft, "cannot have been sampled"),
    ],
)
def test_chain_verify_rejects_bad_input(mutate, match) -> None:
    d, q, p = mutate(*_good())
    with pytest.raises(ValueError, match=match):
        chain_verify(d, q, p, gen())


def test_rejects_non_generator() -> None:
    with pytest.raises(ValueError, match="Generator"):
        chain_verify(*_good(), 0)


def test_tolerance_is_1e6_in_float64() -> None:
    d, q, p = _good()
    p = p.clone()
    p[0, 0] += 5e-7  # within tolerance
    chain_verify(d, q, p, gen())
    p[0, 0] += 1e-6
    with pytest.raises(ValueError, match="sums to"):
        chain_verify(d, q, p, gen())


# --- mc_verify / sample_candidates ---------------------------------------------------------------


def test_mc_single_candidate_matches_chain_of_length_one() -> None:
    for seed in range(100):
        x = sample_candidates(Q_ROW, 1, gen(seed + 1000))
        mc = mc_verify(x, Q_ROW, P_ROW, gen(seed))
        ch = chain_verify(x, Q_ROW.unsqueeze(0), torch.stack([P_ROW, one_hot(0)]), gen(seed))
        if ch.num_accepted == 1:
            assert mc == (0, int(x[0]))
        else:
            assert mc == (-1, ch.next_token)


@pytest.mark.parametrize("with_replacement", [True, False])
def test_mc_all_rejected_samples_updated_target(with_replacement: bool) -> None:
    # p puts no mass on the candidates: every test rejects; the final residual is p restricted off
    # the candidates' excess, here exactly one-hot at 4.
    q = dist(1, 1, 1, 1, 0)
    p = one_hot(4)
    for seed in range(20):
        cands = sample_candidates(q, 3, gen(seed), with_replacement=with_replacement)
        assert mc_verify(cands, q, p, gen(seed), with_replacement=with_replacement) == (-1, 4)


def test_mc_accepts_first_when_p_dominates() -> None:
    q = dist(1, 1, 1, 1, 1)
    p = dist(10, 10, 10, 10, 10)
    assert mc_verify(ids(2, 3), q, p, gen()) == (0, 2)


def test_sample_candidates_without_replacement_distinct_and_limited() -> None:
    q = dist(1, 2, 0, 3, 4)
    for seed in range(50):
        c = sample_candidates(q, 4, gen(seed), with_replacement=False)
        assert sorted(c.tolist()) == [0, 1, 3, 4]
    with pytest.raises(ValueError, match="distinct candidates"):
        sample_candidates(q, 5, gen(), with_replacement=False)
    with pytest.raises(ValueError, match="k must be"):
        sample_candidates(q, 0, gen())


def test_sample_candidates_draws_k_uniforms_in_order() -> None:
    g = gen(7)
    c = sample_candidates(Q_ROW, 3, g)
    u = torch.rand(4, generator=gen(7), dtype=torch.float64)
    cdf = torch.cumsum(Q_ROW, 0)
    assert c.tolist() == [int(torch.searchsorted(cdf, u[i], right=True)) for i in range(3)]
    assert float(torch.rand(1, generator=g, dtype=torch.float64)) == float(u[3])


@pytest.mark.parametrize("seed", range(20))
def test_sample_candidates_equals_repeated_sample_token(seed: int) -> None:
    """The vectorised i.i.d. path is draw-for-draw distributions.sample_token."""
    q = torch.softmax(3 * torch.randn(7, generator=gen(seed), dtype=torch.float64), 0)
    q[seed % 7] = 0.0  # a zero-probability token must never be drawn
    q = q / q.sum()
    fast = sample_candidates(q, 6, gen(seed + 1)).tolist()
    g = gen(seed + 1)
    assert fast == [sample_token(q, g) for _ in range(6)]
    assert seed % 7 not in fast
    # without replacement: draw i is sample_token on q with earlier draws removed, renormalised
    distinct = sample_candidates(q, 4, gen(seed + 2), with_replacement=False).tolist()
    g, rest, want = gen(seed + 2), q.clone(), []
    for _ in range(4):
        want.append(sample_token(rest, g))
        rest[want[-1]] = 0.0
        rest = rest / rest.sum()
    assert distinct == want


def test_mc_rejects_bad_input() -> None:
    with pytest.raises(ValueError, match="distinct"):
        mc_verify(ids(1, 1), Q_ROW, P_ROW, gen(), with_replacement=False)
    with pytest.raises(ValueError, match="cannot have been sampled"):
        mc_verify(ids(2), dist(1, 1, 0, 1, 1), P_ROW, gen())
    with pytest.raises(ValueError, match="empty"):
        mc_verify(ids(), Q_ROW, P_ROW, gen())
    with pytest.raises(ValueError, match="vocab"):
        mc_verify(ids(1), Q_ROW, dist(1, 1, 1, 1), gen())


# --- DSSD ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("seed", range(30))
def test_dssd_edge_accept_tests_match_chain(seed: int) -> None:
    L = 3
    q = torch.stack([Q_ROW, P_ROW, dist(1, 1, 1, 1, 1)])
    p = torch.stack([P_ROW, Q_ROW, dist(3, 1, 1, 1, 1), dist(1, 2, 1, 1, 1)])
    draft = sample_candidates(Q_ROW, L, gen(seed + 500))
    q_of_draft = q.gather(1, draft.unsqueeze(1)).squeeze(1)
    edge = dssd_edge_verify(draft, q_of_draft, p, gen(seed), num_samples=4)
    chain = chain_verify(draft, q, p, gen(seed))
    assert edge.num_accepted == chain.num_accepted
    if edge.num_accepted == L:
        assert edge.bonus_token == chain.next_token  # same draws: bonus uses the next uniform
        assert edge.reject_samples.numel() == 0 and edge.reject_p is None
    else:
        j = edge.num_accepted
        assert edge.bonus_token is None
        assert edge.reject_samples.dtype == torch.int64 and edge.reject_samples.shape == (4,)
        torch.testing.assert_close(edge.reject_sample_probs, p[j][edge.reject_samples])
        torch.testing.assert_close(edge.reject_p, p[j])


def test_dssd_device_never_accepts_where_q_covers_p() -> None:
    p_j, q_j = dist(1, 1, 1, 1, 6), dist(2, 2, 2, 2, 2)  # residual is one-hot at 4
    samples = ids(0, 1, 2, 3, 0, 1)
    for seed in range(20):
        assert dssd_device_resolve(samples, p_j[samples], q_j, gen(seed)) is None
        assert dssd_device_residual(p_j, q_j, gen(seed)) == 4
    always = ids(0, 4)
    hits = [dssd_device_resolve(always, p_j[always], q_j, gen(s)) for s in range(200)]
    # p(4) = 0.6, q(4) = 0.2: accepted with probability 2/3 each time it is tried
    assert set(hits) <= {4, None} and hits.count(4) > 100


def test_dssd_device_resolve_empty_samples_is_none() -> None:
    empty = torch.empty(0, dtype=torch.int64)
    assert dssd_device_resolve(empty, torch.empty(0, dtype=torch.float64), Q_ROW, gen()) is None


def test_dssd_bad_input() -> None:
    with pytest.raises(ValueError, match="cannot have been sampled"):
        dssd_edge_verify(ids(1), torch.tensor([0.0], dtype=torch.float64), P_ROW.repeat(2, 1), gen(), 2)
    with pytest.raises(ValueError, match="probabilities in"):
        dssd_edge_verify(ids(1), torch.tensor([1.5], dtype=torch.float64), P_ROW.repeat(2, 1), gen(), 2)
    with pytest.raises(ValueError, match="num_samples"):
        dssd_edge_verify(ids(1), torch.tensor([0.5], dtype=torch.float64), P_ROW.repeat(2, 1), gen(), -1)
    with pytest.raises(ValueError, match="> 0"):
        dssd_device_resolve(ids(1), torch.tensor([0.0], dtype=torch.float64), Q_ROW, gen())
    with pytest.raises(ValueError, match="out of range"):
        dssd_device_resolve(ids(9), torch.tensor([0.5], dtype=torch.float64), Q_ROW, gen())


def test_bonus_noise_is_a_function_of_seed_and_position() -> None:
    """Both sides derive the coupled bonus's noise from (session seed, sequence index) alone."""
    a = bonus_noise(7, 40, 16)
    assert a.shape == (16,) and a.dtype == torch.float64 and torch.isfinite(a).all()
    assert torch.equal(a, bonus_noise(7, 40, 16))
    assert not torch.equal(a, bonus_noise(7, 41, 16)) and not torch.equal(a, bonus_noise(8, 40, 16))
    with pytest.raises(ValueError):
        bonus_noise(7, -1, 16)


def test_coupled_bonus_uses_the_noise_and_no_uniform() -> None:
    """All accepted: the bonus is argmax log p_{L+1} + noise and the generator gives one uniform per
    accept test only; a rejection still samples the residual by inverse CDF."""
    p = torch.tensor([[0.5, 0.5, 0.0], [0.2, 0.3, 0.5]], dtype=torch.float64)
    q = torch.tensor([[0.5, 0.5, 0.0]], dtype=torch.float64)
    noise = torch.tensor([3.0, 0.0, 0.0], dtype=torch.float64)  # log 0.2 + 3 wins
    g = torch.Generator().manual_seed(1)
    res = chain_verify(torch.tensor([0]), q, p, g, bonus_noise=noise)
    assert (res.num_accepted, res.next_token) == (1, 0)
    reference = torch.Generator().manual_seed(1)
    torch.rand((), generator=reference, dtype=torch.float64)           # the one accept test
    assert torch.equal(g.get_state(), reference.get_state())


# --- gumbel: accept iff the draft is the target's own race -----------------------------------------


def noise_rows(*rows) -> list[torch.Tensor]:
    return [torch.tensor(r, dtype=torch.float64) for r in rows]


def test_race_is_argmin_noise_over_p() -> None:
    p = dist(4, 2, 1, 1, 0)
    e = torch.tensor([2.0, 0.5, 0.4, 9.0, 1e-9], dtype=torch.float64)  # ratios 2.5, 1.25, 1.6, 36, inf
    assert race_token(p, e) == 1
    assert race_token(one_hot(3), e) == 3  # T = 0: the one token, whatever the noise


@pytest.mark.parametrize("seed", range(3))
def test_race_samples_p_exactly(seed: int) -> None:
    """Exponential race over many noise draws: the empirical law is p (chi-square, 20k draws)."""
    from tests.support.toy_models import P_VALUE_CUT, goodness_of_fit
    from collections import Counter
    p = dist(5, 1, 1, 2, 1)
    e = -torch.log(torch.rand(20_000, V, dtype=torch.float64, generator=gen(seed)))  # [n, V] Exp(1)
    tokens = (e / p).argmin(dim=1).tolist()
    assert all(race_token(p, e[i]) == tokens[i] for i in range(50))
    fit = goodness_of_fit(Counter((t,) for t in tokens), {(i,): float(p[i]) for i in range(V)})
    assert fit.p_value > P_VALUE_CUT, str(fit)


def test_gumbel_verify_accepts_while_equal_and_emits_the_target_draw() -> None:
    p = torch.stack([one_hot(1), one_hot(2), one_hot(4)])  # [3, V]: the target's draws are 1, 2, then 4
    ones = lambda i: torch.ones(V, dtype=torch.float64)
    assert gumbel_verify(ids(1, 2), p, ones) == ChainResult(2, 4)  # all accepted, bonus y_2
    assert gumbel_verify(ids(1, 3), p, ones) == ChainResult(1, 2)  # mismatch at 1: y_1 emitted
    assert gumbel_verify(ids(0, 2), p, ones) == ChainResult(0, 1)


def test_gumbel_verify_races_with_each_rows_noise_and_stops_drawing_at_the_mismatch() -> None:
    p = torch.stack([dist(1, 1, 1, 1, 1)] * 4)  # [4, V] uniform: the noise alone decides
    rows = noise_rows([1, 2, 3, 0.5, 4], [3, 0.1, 2, 2, 2], [1, 1, 0.2, 1, 1], [1, 1, 1, 1, 0.3])
    asked: list[int] = []

    def noise(i: int) -> torch.Tensor:
        asked.append(i)
        return rows[i]

    assert gumbel_verify(ids(3, 1, 0), p, noise) == ChainResult(2, 2)  # y = 3, 1, 2: mismatch at 2
    assert asked == [0, 1, 2]                                          # row 3 never drawn
    asked.clear()
    assert gumbel_verify(ids(3, 1, 2), p, noise) == ChainResult(3, 4)  # all accepted: bonus y_3 = 4
    assert asked == [0, 1, 2, 3]


@pytest.mark.parametrize("bad, match", [
    (lambda i: torch.ones(V + 1, dtype=torch.float64), "noise"),
    (lambda i: torch.zeros(V, dtype=torch.float64), "noise"),
    (lambda i: torch.ones(V, dtype=torch.float32), "noise"),
])
def test_gumbel_verify_refuses_bad_noise(bad, match) -> None:
    with pytest.raises(ValueError, match=match):
        gumbel_verify(ids(1), torch.stack([P_ROW, P_ROW]), bad)


def test_gumbel_verify_refuses_bad_drafts() -> None:
    ones = lambda i: torch.ones(V, dtype=torch.float64)
    with pytest.raises(ValueError):
        gumbel_verify(ids(V), torch.stack([P_ROW, P_ROW]), ones)   # id out of range
    with pytest.raises(ValueError):
        gumbel_verify(ids(1, 2), torch.stack([P_ROW, P_ROW]), ones)  # L + 1 rows needed
    with pytest.raises(ValueError):
        gumbel_verify(ids(), P_ROW.unsqueeze(0), ones)               # empty draft


def test_token_noise_is_a_function_of_seed_and_position_only() -> None:
    a = token_noise(7, 40, 16)
    assert a.shape == (16,) and a.dtype == torch.float64 and bool((a > 0).all()) and torch.isfinite(a).all()
    assert torch.equal(a, token_noise(7, 40, 16))
    assert not torch.equal(a, token_noise(7, 41, 16)) and not torch.equal(a, token_noise(8, 40, 16))
    assert not torch.equal(a, token_noise(7 + 2**32, 40, 16))
    assert not torch.equal(-torch.log(a), bonus_noise(7, 40, 16))  # another stream than the coupled bonus's
    with pytest.raises(ValueError):
        token_noise(7, -1, 16)


def test_the_race_agrees_at_least_as_often_as_the_coupling_bound() -> None:
    """Daliri et al. Theorem 2: the same noise makes the races of p and q agree with probability
    >= (1 - TV) / (1 + TV), and at most 1 - TV (no coupling does better). 20k noise draws."""
    p, q = dist(5, 1, 1, 2, 1), Q_ROW
    tv = 0.5 * float((p - q).abs().sum())
    e = -torch.log(torch.rand(20_000, V, dtype=torch.float64, generator=gen(5)))
    agree = float(((e / p).argmin(1) == (e / q).argmin(1)).double().mean())
    sd = math.sqrt(agree * (1 - agree) / 20_000)
    assert (1 - tv) / (1 + tv) - 4 * sd < agree < 1 - tv + 4 * sd
    assert agree > (1 - tv) / (1 + tv) + 4 * sd  # strictly better than the worst case here


# --- DSSD head fallback --------------------------------------------------------------------------


def test_dssd_edge_head_is_the_top_k_and_samples_only_the_tail() -> None:
    p_j = dist(5, 0, 3, 1, 1)
    head = dssd_edge_head(p_j, 2, 200, gen(3))
    assert head.head_ids.tolist() == [0, 2]
    torch.testing.assert_close(head.head_probs, p_j[[0, 2]], rtol=0, atol=0)  # bit for bit
    assert head.tail_mass == pytest.approx(0.2)
    assert set(head.tail_samples.tolist()) == {3, 4}  # never the head, never p = 0
    torch.testing.assert_close(head.tail_sample_probs, p_j[head.tail_samples], rtol=0, atol=0)
    whole = dssd_edge_head(p_j, 10, 200, gen(3))  # K past p's support: the head is all of it
    assert sorted(whole.head_ids.tolist()) == [0, 2, 3, 4] and whole.tail_mass == 0 and whole.tail_samples.numel() == 0
    # draws: exactly the tail samples' uniforms, as sample_tokens of the renormalised tail
    g = gen(9)
    dssd_edge_head(p_j, 2, 7, g)
    g2 = gen(9)
    sample_tokens(dist(0, 0, 0, 1, 1), g2, 7)
    assert torch.equal(g.get_state(), g2.get_state())


HEAD_P, HEAD_Q = dist(4, 1, 2, 2, 1), dist(1, 3, 1, 3, 2)


def _head_fallback_tv(top_k: int, tail: int, resolve=dssd_device_resolve_head) -> tuple[float, int]:
    """(TV from norm(max(0, p_j - q_j)) of 10000 head fallbacks' tokens, how many ran out)."""
    p_j, q_j = HEAD_P, HEAD_Q
    r = residual_distribution(p_j, q_j)
    g, n, counts, ran_out = gen(11), 10_000, torch.zeros(V, dtype=torch.float64), 0
    for _ in range(n):
        y = resolve(dssd_edge_head(p_j, top_k, tail, g), q_j, g)
        if y is None:
            ran_out += 1
            y = dssd_device_residual(p_j, q_j, g)
        counts[y] += 1
    return 0.5 * float((counts / n - r).abs().sum()), ran_out


# sampling noise ~0.004 at 10000 draws; running out one trial late (below) is 0.046 off at K = 1, n = 1
HEAD_TV_BOUND = 0.015


@pytest.mark.parametrize("top_k, tail", [(1, 1), (2, 2), (5, 0)])
def test_dssd_head_fallback_samples_the_residual_exactly(top_k: int, tail: int) -> None:
    """Edge head + device rejection sampling, with the whole-p_j fallback when the tail samples run
    out: the token's law is norm(max(0, p_j - q_j))."""
    tv, ran_out = _head_fallback_tv(top_k, tail)
    assert tv < HEAD_TV_BOUND
    assert (ran_out > 0) == (top_k < V)  # K = V covers p_j's support: nothing left to run out of


def resolve_head_late_run_out(head, q_j, g):
    """BROKEN head fallback: runs out only when a trial picks the tail and finds no sample left, so
    that last trial could still keep a head token but never a tail one."""
    excess = torch.clamp(head.head_probs - q_j[head.head_ids], min=0.0)
    r_head = float(excess.sum())
    tail = iter(zip(head.tail_samples.tolist(), head.tail_sample_probs.tolist()))
    while True:
        if float(torch.rand((), dtype=torch.float64, generator=g)) * (r_head + head.tail_mass) < r_head:
            return int(head.head_ids[sample_token(excess / r_head, g)])
        y, p_y = next(tail, (None, 0.0))
        if y is None:
            return None
        if float(torch.rand((), dtype=torch.float64, generator=g)) * p_y < p_y - float(q_j[y]):
            return y


def test_control_dssd_head_fallback_running_out_late_is_rejected() -> None:
    tv, _ = _head_fallback_tv(1, 1, resolve_head_late_run_out)
    assert tv > HEAD_TV_BOUND


def test_dssd_head_fallback_where_the_residual_is_zero_samples_p() -> None:
    """Rounding can reject where p_j <= q_j everywhere: then r is p_j, as residual_distribution says."""
    p_j = dist(1, 1, 1, 1, 1)
    head = dssd_edge_head(p_j, 5, 4, gen())
    hits = {dssd_device_resolve_head(head, p_j, gen(s)) for s in range(100)}
    assert hits == set(range(V))


def test_dssd_device_resolve_head_refuses_a_malformed_head() -> None:
    p_j, q_j = dist(4, 1, 2, 2, 1), dist(1, 3, 1, 3, 2)
    good = dssd_edge_head(p_j, 2, 3, gen())
    bad = {
        "in the head": dataclasses.replace(good, tail_samples=good.head_ids[:1].clone(),
                                           tail_sample_probs=good.head_probs[:1].clone()),
        "distinct": dataclasses.replace(good, head_ids=torch.tensor([0, 0]), head_probs=p_j[[0, 0]]),
        "not 1": dataclasses.replace(good, tail_mass=0.5),
        r"\(0, 1\]": dataclasses.replace(good, head_probs=torch.tensor([0.4, -0.2], dtype=torch.float64)),
        "out of range": dataclasses.replace(good, head_ids=torch.tensor([0, 9])),
    }
    for message, head in bad.items():
        with pytest.raises(ValueError, match=message):
            dssd_device_resolve_head(head, q_j, gen())
    with pytest.raises(ValueError, match="one length"):
        dataclasses.replace(good, head_probs=good.head_probs[:1])


def test_dssd_fallback_bytes_prior() -> None:
    assert dssd_fallback_bytes(0, 49152) == 8 * 49152
    assert dssd_fallback_bytes(64, 49152) < dssd_fallback_bytes(0, 49152) / 100
