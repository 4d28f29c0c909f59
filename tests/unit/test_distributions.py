"""Tests for specdec.common.distributions: temperature, truncation, sparse <-> dense, sampling."""
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from specdec.common.sampling import model_probs
from specdec.common.distributions import (
    SparseDist,
    check_sparse_dist,
    densify,
    dropped_mass,
    filter_target_logits,
    gumbel_noise,
    probs_from_logits,
    sample_token,
    sample_token_from_uniform,
    sample_token_gumbel,
    sample_tokens,
    sparsify,
    support,
    top_k_ids,
    truncate_threshold,
    truncate_top_k,
    truncate_top_p,
    tv_distance,
)

HYPOTHESIS = settings(max_examples=60, deadline=None)


def dist(values, dtype=torch.float64):
    t = torch.tensor(values, dtype=torch.float64)
    return (t / t.sum()).to(dtype)


@st.composite
def distributions(draw, min_size=1, max_size=60, zeros=True):
    """Random probability vectors with ties and exact zeros (float32 or float64)."""
    size = draw(st.integers(min_size, max_size))
    levels = [0.0, 1.0, 2.0, 0.5, 1e-6, 3.0] if zeros else [1.0, 2.0, 0.5, 1e-6, 3.0]
    raw = draw(st.lists(st.one_of(st.sampled_from(levels), st.floats(1e-9, 10.0)), min_size=size, max_size=size))
    if sum(raw) == 0:
        raw[draw(st.integers(0, size - 1))] = 1.0
    return dist(raw, draw(st.sampled_from([torch.float32, torch.float64])))


def brute_force_order(q):
    """Ids by descending q, ties by ascending id (the documented tie-break)."""
    return sorted(range(q.numel()), key=lambda i: (-float(q[i]), i))


# ----------------------------------------------------------------------------- probs_from_logits


def test_greedy_is_one_hot_at_first_maximum():
    logits = torch.tensor([[1.0, 3.0, 3.0, -2.0], [0.0, 0.0, 0.0, 0.0]])
    probs = probs_from_logits(logits, 0.0)
    assert probs.dtype == torch.float32
    assert torch.equal(probs, torch.tensor([[0.0, 1.0, 0.0, 0.0], [1.0, 0.0, 0.0, 0.0]]))
    assert torch.equal(probs.argmax(-1), logits.argmax(-1))


def test_greedy_uses_original_precision():
    # Two float64 logits that collapse to the same float32 value: the argmax must stay at 1.
    logits = torch.tensor([1.0, 1.0 + 1e-12, 0.0], dtype=torch.float64)
    assert int(probs_from_logits(logits, 0.0).argmax()) == 1


@pytest.mark.parametrize("temperature", [0.3, 1.0, 2.5])
def test_softmax_matches_reference(temperature):
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(1), dtype=torch.float64) * 5
    probs = probs_from_logits(logits, temperature)
    assert probs.dtype == torch.float32
    expected = torch.softmax(logits / temperature, dim=-1)
    assert torch.allclose(probs.double(), expected, atol=1e-6)


def test_tiny_temperature_and_huge_logits_stay_finite():
    logits = torch.tensor([1e30, -1e30, 0.0], dtype=torch.float32)
    probs = probs_from_logits(logits, 1e-30)
    assert torch.isfinite(probs).all() and float(probs[0]) == 1.0


@pytest.mark.parametrize("bad", [
    (torch.tensor([1.0, float("nan")]), 1.0),
    (torch.tensor([1.0, float("inf")]), 1.0),
    (torch.tensor([1.0, float("-inf")]), 0.0),
    (torch.tensor([1.0, 2.0]), -0.1),
    (torch.tensor([1.0, 2.0]), float("nan")),
    (torch.tensor([1, 2]), 1.0),
    (torch.zeros(0), 1.0),
    ([1.0, 2.0], 1.0),
])
def test_probs_from_logits_rejects_bad_input(bad):
    with pytest.raises(ValueError):
        probs_from_logits(*bad)


# ----------------------------------------------------------------------------- truncation


def test_top_k_hand_built_with_ties_and_zeros():
    q = dist([0.1, 0.3, 0.0, 0.3, 0.2, 0.1])
    sd = truncate_top_k(q, 3)
    assert sd.ids.tolist() == [1, 3, 4]
    assert torch.allclose(sd.probs, torch.tensor([0.375, 0.375, 0.25], dtype=torch.float64))
    # Tie at the boundary: the lower id wins.
    assert truncate_top_k(q, 4).ids.tolist() == [0, 1, 3, 4]
    # Zero-probability tokens are never kept: only 5 non-zero tokens exist.
    assert truncate_top_k(q, 6).ids.tolist() == [0, 1, 3, 4, 5]


def test_top_k_of_greedy_one_hot_keeps_one_token():
    q = probs_from_logits(torch.randn(1000, generator=torch.Generator().manual_seed(0)), 0.0)
    sd = truncate_top_k(q, 64)
    assert sd.ids.tolist() == [int(q.argmax())] and sd.probs.tolist() == [1.0]


def test_top_k_ids_keeps_zero_tokens_in_order():
    q = dist([0.0, 0.5, 0.0, 0.5])
    assert top_k_ids(q, 4).tolist() == [1, 3, 0, 2]


@HYPOTHESIS
@given(q=distributions(), data=st.data())
def test_top_k_matches_brute_force(q, data):
    k = data.draw(st.integers(1, q.numel()))
    sd = truncate_top_k(q, k)
    check_sparse_dist(sd)
    expected = sorted(i for i in brute_force_order(q)[:k] if float(q[i]) > 0)
    assert sd.ids.tolist() == expected
    assert sd.probs.dtype == torch.float64 and abs(float(sd.probs.sum()) - 1.0) < 1e-12


def test_top_p_hand_built():
    q = dist([0.15, 0.5, 0.05, 0.3])
    assert truncate_top_p(q, 0.75).ids.tolist() == [1, 3]
    assert truncate_top_p(q, 0.81).ids.tolist() == [0, 1, 3]
    assert truncate_top_p(q, 0.5).ids.tolist() == [1]
    assert truncate_top_p(q, 1e-9).ids.tolist() == [1]
    assert truncate_top_p(q, 1.0).ids.tolist() == [0, 1, 2, 3]


@HYPOTHESIS
@given(q=distributions(), top_p=st.floats(1e-6, 1.0))
def test_top_p_is_smallest_prefix_reaching_mass(q, top_p):
    sd = truncate_top_p(q, top_p)
    check_sparse_dist(sd)
    order = [i for i in brute_force_order(q) if float(q[i]) > 0]
    q64 = q.double() / q.double().sum()
    cum = torch.cumsum(q64[order], 0)
    n = int((cum < top_p * float(cum[-1])).sum()) + 1
    assert sd.ids.tolist() == sorted(order[: min(n, len(order))])


def test_top_p_beyond_first_partial_selection():
    # A flat distribution whose nucleus is far larger than the first top-K guess.
    q = dist([1.0] * 5000)
    assert truncate_top_p(q, 0.89995).ids.numel() == 4500  # off the float rounding boundary


def test_threshold_support():
    q = dist([0.1, 0.4, 0.0, 0.25, 0.25])
    assert truncate_threshold(q, 0.25).ids.tolist() == [1, 3, 4]
    assert truncate_threshold(q, 0.3).ids.tolist() == [1]
    assert truncate_threshold(q, 2.0).ids.tolist() == [1]  # above every q: the argmax survives
    assert truncate_threshold(q, -0.5).ids.tolist() == [0, 1, 3, 4]  # never the zero token
    assert truncate_threshold(q, 0.0, max_k=2).ids.tolist() == [1, 3]  # cap keeps the largest


def test_threshold_compares_exact_float32_values():
    q = torch.tensor([0.1, 0.9], dtype=torch.float32)
    beta = float(q[0])  # the float32 value of 0.1, not the float64 literal 0.1
    assert truncate_threshold(q, beta).ids.tolist() == [0, 1]
    assert truncate_threshold(q, math.nextafter(beta, 1.0)).ids.tolist() == [1]


@pytest.mark.parametrize("call", [
    lambda q: truncate_top_k(q, 0),
    lambda q: truncate_top_k(q, 5),
    lambda q: truncate_top_k(q, 1.5),
    lambda q: truncate_top_p(q, 0.0),
    lambda q: truncate_top_p(q, 1.5),
    lambda q: truncate_top_p(q, float("nan")),
    lambda q: truncate_threshold(q, float("nan")),
    lambda q: truncate_threshold(q, 0.1, max_k=0),
])
def test_truncation_rejects_bad_parameters(call):
    with pytest.raises(ValueError):
        call(dist([0.25] * 4))


@pytest.mark.parametrize("q", [
    torch.tensor([0.5, float("nan"), 0.5]),
    torch.tensor([0.5, float("inf"), 0.5]),
    torch.tensor([1.5, -0.5]),
    torch.tensor([0.5, 0.4]),  # sums to 0.9
    torch.tensor([0.5, 0.5001, 0.0]) * 2,
    torch.tensor([[0.5, 0.5]]),
    torch.tensor([], dtype=torch.float32),
    torch.tensor([1, 0]),
])
def test_truncation_rejects_bad_distributions(q):
    with pytest.raises(ValueError):
        truncate_top_k(q, 1)


def test_float32_sum_tolerance():
    q = torch.full((4,), 0.25, dtype=torch.float32)
    q[0] += 5e-4  # within 1e-3
    assert truncate_top_k(q, 1).ids.tolist() == [0]
    q[0] += 1e-3  # now 1.5e-3 off
    with pytest.raises(ValueError):
        truncate_top_k(q, 1)


# ----------------------------------------------------------------------------- sparse <-> dense


@HYPOTHESIS
@given(q=distributions())
def test_sparsify_densify_round_trip(q):
    dense = densify(sparsify(q, support(q)))
    expected = q.double() / q.double().sum()
    assert dense.dtype == torch.float64
    assert float((dense - expected).abs().max()) <= 1e-12


@HYPOTHESIS
@given(q=distributions(), data=st.data())
def test_dropped_mass_is_tv_to_truncation(q, data):
    # SQS Lemma 1: the dropped mass equals TV(q, q restricted and renormalised).
    k = data.draw(st.integers(1, q.numel()))
    sd = truncate_top_k(q, k)
    q64 = q.double() / q.double().sum()
    assert abs(dropped_mass(q, sd.ids) - tv_distance(q64, densify(sd))) <= 1e-12
    assert abs(dropped_mass(q, sd.ids) - (1.0 - float(q64[sd.ids].sum()))) <= 1e-12


def test_dropped_mass_hand_built():
    q = dist([0.1, 0.2, 0.3, 0.4])
    assert dropped_mass(q, torch.tensor([1, 3])) == pytest.approx(0.4, abs=1e-15)
    assert dropped_mass(q, torch.arange(4)) == 0.0


@pytest.mark.parametrize("ids", [
    torch.tensor([2, 1]),
    torch.tensor([1, 1]),
    torch.tensor([0, 4]),
    torch.tensor([-1, 2]),
    torch.tensor([0.0, 1.0]),
    torch.tensor([], dtype=torch.int64),
    torch.tensor([[0, 1]]),
    torch.tensor([0], dtype=torch.int32),
])
def test_sparsify_rejects_bad_ids(ids):
    with pytest.raises(ValueError):
        sparsify(dist([0.25] * 4), ids)


def test_sparsify_rejects_zero_mass_support():
    with pytest.raises(ValueError):
        sparsify(dist([0.0, 1.0]), torch.tensor([0]))


def test_densify_rejects_broken_sparse_dist():
    with pytest.raises(ValueError):
        densify(SparseDist(ids=torch.tensor([1, 0]), probs=torch.tensor([0.5, 0.5], dtype=torch.float64), vocab_size=2))
    with pytest.raises(ValueError):
        densify(SparseDist(ids=torch.tensor([0, 1]), probs=torch.tensor([0.5, 0.5]), vocab_size=2))  # float32


def test_tv_distance():
    a, b = dist([0.5, 0.5, 0.0]), dist([0.0, 0.5, 0.5])
    assert tv_distance(a, b) == 0.5 and tv_distance(b, a) == 0.5 and tv_distance(a, a) == 0.0
    assert tv_distance(a, SparseDist(torch.tensor([0]), torch.tensor([1.0], dtype=torch.float64), 3)) == 0.5
    with pytest.raises(ValueError):
        tv_distance(a, dist([0.5, 0.5]))


# ----------------------------------------------------------------------------- sampling


def test_inverse_cdf_boundaries():
    probs = torch.tensor([0.25, 0.0, 0.75], dtype=torch.float64)
    assert sample_token_from_uniform(probs, 0.0) == 0
    assert sample_token_from_uniform(probs, 0.2499) == 0
    assert sample_token_from_uniform(probs, 0.25) == 2  # never the zero-probability token 1
    assert sample_token_from_uniform(probs, math.nextafter(1.0, 0.0)) == 2


def test_inverse_cdf_falls_back_to_last_nonzero():
    probs = torch.tensor([0.3, 0.7, 0.0, 0.0], dtype=torch.float64)
    assert sample_token_from_uniform(probs, math.nextafter(1.0, 0.0)) == 1
    sd = SparseDist(ids=torch.tensor([5, 9]), probs=torch.tensor([0.5, 0.5], dtype=torch.float64), vocab_size=10)
    assert sample_token_from_uniform(sd, 0.7) == 9 and sample_token_from_uniform(sd, 0.1) == 5


@pytest.mark.parametrize("u", [1.0, -0.1, float("nan"), 2])
def test_inverse_cdf_rejects_bad_uniform(u):
    with pytest.raises(ValueError):
        sample_token_from_uniform(torch.tensor([1.0], dtype=torch.float64), u)


def test_sample_token_uses_exactly_one_float64_uniform():
    probs = dist([0.1, 0.2, 0.3, 0.4])
    g1, g2 = torch.Generator().manual_seed(7), torch.Generator().manual_seed(7)
    token = sample_token(probs, g1)
    u = float(torch.rand((), dtype=torch.float64, generator=g2))
    assert token == sample_token_from_uniform(probs, u)
    assert torch.equal(g1.get_state(), g2.get_state())


def test_sample_token_frequencies():
    probs = dist([0.1, 0.0, 0.2, 0.3, 0.4])
    g = torch.Generator().manual_seed(123)
    n = 20_000
    counts = torch.bincount(torch.tensor([sample_token(probs, g) for _ in range(n)]), minlength=5).double()
    assert counts[1] == 0
    # 5 sigma of a binomial count around n p.
    sigma = torch.sqrt(n * probs * (1 - probs))
    assert bool(((counts - n * probs).abs() <= 5 * sigma + 1e-9).all())


def test_sample_token_rejects_non_generator():
    with pytest.raises(ValueError):
        sample_token(dist([1.0]), 0)


# ----------------------------------------------------------------------------- target filtering


# Target top-k / top-p: "the target alone" is transformers' own sampling with the same settings.
TIED_LOGIT_STEP = 0.5  # integer multiples of it: many exact ties, also across the k-th cut
FILTER_GRID = [(t, k, p) for t in (0.7, 1.0, 1.3) for k in (0, 1, 3, 10, 60) for p in (0.0, 0.3, 0.9, 1.0)
               if k or p]


@pytest.fixture(scope="module")
def hf_model():
    """A tiny in-memory transformers model: only to ask transformers which processors it samples with."""
    from transformers import LlamaConfig, LlamaForCausalLM
    config = LlamaConfig(vocab_size=40, hidden_size=8, intermediate_size=16, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1)
    return LlamaForCausalLM(config)


def _transformers_probs(model, logits: torch.Tensor, temperature: float, top_k: int, top_p: float):
    """softmax of the scores after the processors transformers' generate(do_sample=True) applies."""
    from transformers import GenerationConfig, LogitsProcessorList
    config = GenerationConfig(do_sample=True, temperature=temperature, top_k=top_k, top_p=top_p or 1.0)
    processors = model._get_logits_processor(generation_config=config, input_ids_seq_length=1,
                                             logits_processor=LogitsProcessorList(), device="cpu",
                                             model_kwargs={})
    ids = torch.zeros(1, 1, dtype=torch.long)
    rows = [torch.softmax(processors(ids, row[None].float()), dim=-1)[0] for row in logits]
    return torch.stack(rows).double()


@pytest.mark.parametrize("tied", [False, True])
def test_target_filter_equals_transformers_sampling(hf_model, tied):
    g = torch.Generator().manual_seed(11)
    logits = torch.randn(6, 40, generator=g) * 3
    if tied:
        logits = torch.round(logits / TIED_LOGIT_STEP) * TIED_LOGIT_STEP
    ties_across_cut = 0
    for temperature, top_k, top_p in FILTER_GRID:
        ours = model_probs(logits, temperature, top_k, top_p)
        theirs = _transformers_probs(hf_model, logits, temperature, top_k, top_p)
        case = (temperature, top_k, top_p)
        assert torch.equal(ours > 0, theirs > 0), f"kept tokens differ for {case}"
        assert torch.allclose(ours, theirs, atol=1e-6), case
        if top_k and not top_p:
            ties_across_cut += int(((ours > 0).sum(-1) > top_k).sum())
    if tied:
        assert ties_across_cut > 0, "no tie straddled the k-th score: the tie rule was not exercised"


def test_target_top_k_keeps_every_tie_at_the_kth_score():
    logits = torch.tensor([[2.0, 1.0, 1.0, 1.0, 0.0]])
    assert (model_probs(logits, 1.0, top_k=2) > 0).tolist() == [[True, True, True, True, False]]


def test_target_filter_off_and_greedy():
    logits = torch.randn(3, 40, generator=torch.Generator().manual_seed(3))
    assert torch.equal(filter_target_logits(logits, None, None), logits)
    assert torch.equal(filter_target_logits(logits, None, 1.0), logits)  # top_p = 1 is off
    assert torch.equal(model_probs(logits, 0.0, 3, 0.5), model_probs(logits, 0.0))  # greedy ignores them


@pytest.mark.parametrize("args", [(0, None), (None, 0.0), (None, 1.2), (2.5, None)])
def test_target_filter_rejects_bad_parameters(args):
    with pytest.raises(ValueError):
        filter_target_logits(torch.zeros(1, 2), *args)


# --- Gumbel-max sampling (the coupled bonus token) ------------------------------------------------
GUMBEL_DRAWS = 20_000


def _gumbel_counts(probs: torch.Tensor, noise_fn) -> torch.Tensor:
    g = torch.Generator().manual_seed(7)
    counts = torch.zeros(probs.numel())
    for _ in range(GUMBEL_DRAWS):
        counts[sample_token_gumbel(probs, noise_fn(g, probs.numel()))] += 1
    return counts


def _chi2(counts: torch.Tensor, probs: torch.Tensor) -> float:
    keep = probs > 0
    expected = probs[keep] * counts.sum()
    return float(((counts[keep] - expected) ** 2 / expected).sum())


CHI2_DOF4_CUT = 23.5  # upper 1e-4 tail of chi-square with 4 degrees of freedom


def test_gumbel_max_draws_exactly_the_law():
    probs = dist([0.05, 0.0, 0.4, 0.25, 0.2, 0.1])                    # 5 cells with mass: 4 dof
    counts = _gumbel_counts(probs, gumbel_noise)
    assert counts[1] == 0                                              # probability 0: never drawn
    assert _chi2(counts, probs) < CHI2_DOF4_CUT


def test_control_gumbel_max_with_uniform_noise_is_rejected():
    probs = dist([0.05, 0.0, 0.4, 0.25, 0.2, 0.1])
    uniform = lambda g, v: torch.rand(v, dtype=torch.float64, generator=g)  # noqa: E731
    assert _chi2(_gumbel_counts(probs, uniform), probs) > 100 * CHI2_DOF4_CUT


def test_gumbel_coupling_matches_close_laws_often():
    """Two laws drawn with the same noise agree with probability >= (1 - TV) / (1 + TV): the bound
    that lets the device guess the edge's bonus token from its own q."""
    gen = torch.Generator().manual_seed(3)
    p = torch.softmax(torch.randn(64, generator=gen, dtype=torch.float64), 0)
    q = torch.softmax(torch.log(p) + 0.3 * torch.randn(64, generator=gen, dtype=torch.float64), 0)
    tv = tv_distance(p, q)
    g = torch.Generator().manual_seed(4)
    n = 4000
    same = sum(sample_token_gumbel(p, noise) == sample_token_gumbel(q, noise)
               for noise in (gumbel_noise(g, 64) for _ in range(n)))
    floor = (1 - tv) / (1 + tv)
    assert same / n > floor - 4 * math.sqrt(floor * (1 - floor) / n), (same / n, floor)
    assert same / n > float((p * q).sum()) + 0.5  # independent draws would agree this often


def test_gumbel_max_rejects_bad_input():
    probs = dist([0.5, 0.5])
    with pytest.raises(ValueError, match="noise"):
        sample_token_gumbel(probs, torch.zeros(3, dtype=torch.float64))
    with pytest.raises(ValueError, match="noise"):
        sample_token_gumbel(probs, torch.tensor([0.0, float("nan")], dtype=torch.float64))
    with pytest.raises(ValueError):
        sample_token_gumbel(torch.tensor([0.5, 0.6], dtype=torch.float64), torch.zeros(2, dtype=torch.float64))
    with pytest.raises(ValueError, match="generator"):
        gumbel_noise(None, 4)


@pytest.mark.parametrize("probs", [
    torch.softmax(torch.randn(4096, generator=torch.Generator().manual_seed(3), dtype=torch.float64) * 3, 0),
    torch.tensor([0.0, 0.25, 0.0, 0.75, 0.0], dtype=torch.float64),          # zeros are never drawn
    torch.tensor([0.1, 0.2, 0.3, 0.4 + 1e-9], dtype=torch.float64),           # total a hair above 1
])
def test_sample_tokens_is_n_calls_of_sample_token(probs) -> None:
    """Token for token and uniform for uniform: a vectorised draw must not change what a seed gives
    (DSSD's samples after a rejection are redrawn bit for bit on a retry)."""
    for n in (0, 1, 7, 64):
        one, many = torch.Generator().manual_seed(11), torch.Generator().manual_seed(11)
        expected = [sample_token(probs, one) for _ in range(n)]
        assert sample_tokens(probs, many, n).tolist() == expected
        assert torch.equal(one.get_state(), many.get_state())
    assert int(probs[sample_tokens(probs, torch.Generator().manual_seed(0), 500)].min() > 0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_first_argmax_and_argmin_are_torchs_ties_included(dtype) -> None:
    """NumPy's extremes (the fast path on a CPU) against torch's, on rows full of ties (few values)
    and on plain random rows, 1-D and 2-D, -inf included."""
    from specdec.common.distributions import first_argmax, first_argmin

    g = torch.Generator().manual_seed(5)
    for rows in (torch.randint(0, 4, (64, 37), generator=g).to(dtype), torch.randn(8, 5000, generator=g).to(dtype)):
        rows[0, :3] = -math.inf
        assert torch.equal(first_argmax(rows), rows.argmax(-1))
        assert torch.equal(first_argmin(rows), rows.argmin(-1))
        assert int(first_argmax(rows[1])) == int(rows[1].argmax())
