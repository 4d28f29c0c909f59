"""Statistical losslessness harness: every verification mode must sample exactly the target.

A tiny vocabulary (V = 4) with context-dependent toy target ``p`` and draft ``q`` tables (see
toy_models.py), so the exact law of the next N = 3 tokens is known by enumeration. Each test runs
draft-then-verify rounds through the REAL library functions until N tokens are generated, many
times, and compares the empirical law of the N-token continuation with the exact one by a
chi-square test (p-value cut 1e-4, fixed seeds) and a total-variation bound.

Negative controls run the same harness on deliberately broken verifiers (defined here, never in
the library) and assert that the test rejects them, so the harness demonstrably has power.

Sizes: NUM_SEQS sequences per mode in the default run (a few minutes for the file on a shared
2-core machine); ``-m slow`` (``make test-slow``) repeats every mode with HIGH_POWER_SEQS.
"""
from __future__ import annotations

from typing import Callable

import pytest
import torch

from specdec.common.codecs import (
    CodecConfig,
    decode_distribution,
    decode_dssd_scalars,
    encode_distribution,
    encode_dssd_scalars,
)
from specdec.device.conformal import ConformalController
from specdec.common.distributions import densify, gumbel_noise, race_token, sample_token_gumbel
from specdec.common.tree import TreeSpec, tree_verify
from specdec.common.verification import (
    ChainResult,
    bonus_noise,
    chain_verify,
    dssd_device_residual,
    dssd_device_resolve,
    dssd_device_resolve_head,
    dssd_edge_head,
    dssd_edge_verify,
    gumbel_verify,
    mc_verify,
    residual_distribution,
    sample_candidates,
    sample_token,
    token_noise,
)

from tests.support import toy_models as tm



VOCAB = 4
PROMPT = [0, 1]
N_TOKENS = 3  # 4**3 = 64 sequence cells
NUM_SEQS = 2_000  # ~5-15 s per mode on a shared 2-core machine; chi2 noncentrality grows linearly with it
HIGH_POWER_SEQS = 20_000  # the slow-marked run of every mode
CONTROL_SEQS = 1_000  # the gross breakages below are rejected at p < 1e-15 already at this size
PAIR_SEED = 1


@pytest.fixture(scope="module")
def pair() -> "tm.ToyPair":
    return tm.make_pair(VOCAB, PAIR_SEED)


@pytest.fixture(scope="module")
def exact(pair) -> dict:
    return tm.exact_distribution(pair, PROMPT, N_TOKENS)


def fit(round_fn, exact, num_seqs: int = NUM_SEQS) -> "tm.FitResult":
    return tm.goodness_of_fit(tm.generate_counts(round_fn, PROMPT, N_TOKENS, num_seqs), exact)


def assert_lossless(result: "tm.FitResult") -> None:
    print(f"lossless check: {result}")
    assert result.p_value > tm.P_VALUE_CUT, f"output law differs from the target: {result}"
    assert result.tv < result.tv_bound, f"output law differs from the target: {result}"


def assert_rejected(result: "tm.FitResult") -> None:
    print(f"negative control: {result}")
    assert result.p_value < tm.P_VALUE_CUT, f"negative control NOT rejected, harness too weak: {result}"


# --- round builders (the device + edge loop, inlined) --------------------------------------------

ChainVerifier = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Generator], ChainResult]


def draft_chain(pair, seq: list[int], L: int, g: torch.Generator, draft_law=None) -> tuple[list[int], list]:
    """The device's L drafts after ``seq``, each from q (or from ``draft_law(q)`` for a control), and
    the q rows [V] the verifier sees."""
    draft: list[int] = []
    q_rows = []
    for _ in range(L):
        q = pair.q(seq + draft)  # [V]
        q_rows.append(q)
        draft.append(sample_token(q if draft_law is None else draft_law(q), g))
    return draft, q_rows


def chain_round(pair, L: int, g: torch.Generator, verify: ChainVerifier = chain_verify, draft_law=None):
    """Draft L tokens from q (or from ``draft_law(q)`` for a control), verify against q and p."""

    def round_fn(seq: list[int]) -> list[int]:
        draft, q_rows = draft_chain(pair, seq, L, g, draft_law)
        p = torch.stack([pair.p(seq + draft[:i]) for i in range(L + 1)])  # [L+1, V]
        res = verify(torch.tensor(draft), torch.stack(q_rows), p, g)
        return draft[: res.num_accepted] + [res.next_token]

    return round_fn


# noise(session seed, position, V) -> [V] Gumbel noise of a coupled bonus token
BonusNoise = Callable[[int, int, int], torch.Tensor]


def coupled_chain_round(pair, L: int, g: torch.Generator, noise: BonusNoise = bonus_noise, bonus=None):
    """Chain rounds with the coupled bonus (edge: Gumbel-max with ``noise(seed, position)``), a new
    session seed per generated sequence as every session has its own. ``bonus(p, q, noise)`` (controls
    only) replaces the edge's bonus draw."""
    session = {"seed": 0}

    def round_fn(seq: list[int]) -> list[int]:
        if len(seq) == len(PROMPT):  # a new sequence: a new session
            session["seed"] = int(torch.randint(2**62, (1,), generator=g))
        draft, q_rows = draft_chain(pair, seq, L, g)
        p = torch.stack([pair.p(seq + draft[:i]) for i in range(L + 1)])
        g_bonus = noise(session["seed"], len(seq) + L, VOCAB)
        res = chain_verify(torch.tensor(draft), torch.stack(q_rows), p, g, bonus_noise=g_bonus)
        if bonus is not None and res.num_accepted == L:
            res = ChainResult(L, bonus(p[L], pair.q(seq + draft), g_bonus))
        return draft[: res.num_accepted] + [res.next_token]

    return round_fn


def mc_round(pair, k: int, g: torch.Generator, with_replacement: bool, verify=mc_verify):
    def round_fn(seq: list[int]) -> list[int]:
        q, p = pair.q(seq), pair.p(seq)
        cands = sample_candidates(q, k, g, with_replacement=with_replacement)
        _, token = verify(cands, q, p, g, with_replacement=with_replacement)
        return [token]

    return round_fn


def tree_round(pair, config, g: torch.Generator, with_replacement: bool = True):
    spec = TreeSpec.from_config(config)

    def round_fn(seq: list[int]) -> list[int]:
        paths: dict[int, list[int]] = {0: []}
        node_tokens = [0] * spec.num_nodes
        q_rows = []
        for node in spec.internal_nodes:  # layer order: a parent is drafted before its children (Alg. 7)
            q = pair.q(seq + paths[node])
            q_rows.append(q)
            kids = spec.children(node)
            for kid, tok in zip(kids, sample_candidates(q, len(kids), g, with_replacement).tolist()):
                node_tokens[kid] = tok
                paths[kid] = paths[node] + [tok]
        p = torch.stack([pair.p(seq + paths[n]) for n in range(spec.num_nodes)])  # [N, V]
        res = tree_verify(spec, torch.tensor(node_tokens), torch.stack(q_rows), p, g, with_replacement=with_replacement)
        return res.tokens

    return round_fn


def dssd_round(pair, L: int, m: int, g: torch.Generator, stats: dict, residual_fallback=dssd_device_residual,
               scalar_wire=None, coupled: bool = False):
    """Device drafts and sends ids + q_i(x_i) (through ``scalar_wire`` if given); edge verifies and
    samples m y ~ p_j; device resolves. ``coupled``: the bonus is the coupled Gumbel-max draw (a new
    session seed per sequence), as DSSD rounds that draft ahead use."""
    g_edge = torch.Generator().manual_seed(int(torch.randint(2**31, (1,), generator=g)))
    session = {"seed": 0}

    def round_fn(seq: list[int]) -> list[int]:
        if coupled and len(seq) == len(PROMPT):  # a new sequence: a new session
            session["seed"] = int(torch.randint(2**62, (1,), generator=g))
        draft, q_rows = draft_chain(pair, seq, L, g)
        ids = torch.tensor(draft)
        q_of_draft = torch.stack(q_rows).gather(1, ids.unsqueeze(1)).squeeze(1)  # [L], the uplink scalars
        if scalar_wire is not None:
            q_of_draft = scalar_wire(q_of_draft)
        p = torch.stack([pair.p(seq + draft[:i]) for i in range(L + 1)])
        noise = bonus_noise(session["seed"], len(seq) + L, VOCAB) if coupled else None
        edge = dssd_edge_verify(ids, q_of_draft, p, g_edge, num_samples=m, bonus_noise=noise)
        if edge.bonus_token is not None:
            return draft + [edge.bonus_token]
        j = edge.num_accepted
        y = dssd_device_resolve(edge.reject_samples, edge.reject_sample_probs, q_rows[j], g)
        if y is None:  # all m samples failed: the edge sends the full p_j
            stats["fallbacks"] = stats.get("fallbacks", 0) + 1
            y = residual_fallback(edge.reject_p, q_rows[j], g)
        else:
            stats["resolved"] = stats.get("resolved", 0) + 1
        return draft[:j] + [y]

    return round_fn


def head_fallback(top_k: int, tail: int, stats: dict, resolve=dssd_device_resolve_head):
    """A DSSD fallback as the client runs it: p_j's head and ``tail`` samples of its tail (the edge's
    draws from their own generator), and the whole p_j when those run out."""
    def fallback(p_j, q_j, g) -> int:
        g_edge = torch.Generator().manual_seed(int(torch.randint(2**31, (1,), generator=g)))
        y = resolve(dssd_edge_head(p_j, top_k, tail, g_edge), q_j, g)
        path = "head resolved" if y is not None else "ran out"
        stats[path] = stats.get(path, 0) + 1
        return y if y is not None else dssd_device_residual(p_j, q_j, g)
    return fallback


# --- null tests: every real mode is lossless -----------------------------------------------------


def test_harness_sanity(pair, exact) -> None:
    """Plain target sampling passes; the draft's own law (q != p) is rejected."""
    g = torch.Generator().manual_seed(10)
    assert_lossless(fit(lambda seq: [sample_token(pair.p(seq), g)], exact))
    assert_rejected(fit(lambda seq: [sample_token(pair.q(seq), g)], exact, num_seqs=CONTROL_SEQS))


# --- compressed draft modes: the device samples from the decoded packet, the edge verifies it ---

SMALL_LATTICE = 8  # coarse on purpose: q_hat differs visibly from q, some counts round to 0
CODEC_TOP_K = 2
CSQS_ALPHA = 0.1  # target average dropped mass: well inside what V = 4 can show
CSQS_ETA = 0.5  # fast learning rate so the threshold (and support) moves within a sequence
CSQS_BETA0 = 0.15


def codec_config(mode: str) -> "CodecConfig":
    return CodecConfig(mode=mode, vocab_size=VOCAB, dense_dtype="fp16", top_k=CODEC_TOP_K,
                       lattice=SMALL_LATTICE, max_k=VOCAB)


def codec_round(pair, cfg, L: int, g: torch.Generator, controller=None, draft_law=None, supports=None):
    """Chain rounds through the real codecs. ``draft_law(q, q_hat)`` (controls only) overrides
    the law the device samples from; the verifier always sees densify(q_hat). For C-SQS the
    ``ConformalController`` supplies the threshold per position and sees every verdict.

    Encoding and decoding are pure functions of (q, threshold), the toy q depends only on the
    context, and the threshold acts only through the set {x : q(x) >= beta} (SQS eq. 6), so packets
    are memoised per (context, that set) to keep the test fast."""
    packets: dict = {}

    def packet(seq: list[int], beta):
        q = pair.q(seq)
        key = (pair.context(seq), None if beta is None else tuple((q >= beta).tolist()))
        if key not in packets:
            enc = encode_distribution(q, cfg, threshold=beta)
            q_hat = decode_distribution(enc.payload, cfg)  # what the device samples from ...
            q_edge = densify(decode_distribution(enc.payload, cfg))  # ... and what the edge decodes
            packets[key] = (q_hat, q_edge, enc.dropped_mass)
        return packets[key]

    def round_fn(seq: list[int]) -> list[int]:
        draft: list[int] = []
        q_rows = []
        if controller is not None:
            controller.start_round()
        for _ in range(L):
            beta = controller.beta if controller is not None else None
            q_hat, q_edge, dropped = packet(seq + draft, beta)
            if controller is not None:
                controller.observe(dropped)
            if supports is not None:
                supports.add(q_hat.ids.numel())
            q_rows.append(q_edge)
            law = q_hat if draft_law is None else draft_law(pair.q(seq + draft), q_hat)
            draft.append(sample_token(law, g))
        p = torch.stack([pair.p(seq + draft[:i]) for i in range(L + 1)])
        res = chain_verify(torch.tensor(draft), torch.stack(q_rows), p, g)
        if controller is not None:
            controller.on_verdict(res.num_accepted)
        return draft[: res.num_accepted] + [res.next_token]

    return round_fn


# --- every mode, through one registry ----------------------------------------------------------


def wire_scalars(q_of_draft: torch.Tensor) -> torch.Tensor:
    """The DSSD uplink as the edge sees it: decode(encode(q_i(x_i)))."""
    return decode_dssd_scalars(encode_dssd_scalars(q_of_draft), q_of_draft.numel())


def build_mode(name: str, pair, g: torch.Generator):
    """(round function, post-run check) for one verification mode."""
    stats: dict = {}
    supports: set = set()

    def both_dssd_paths_used(num_seqs: int) -> None:
        # the device resolved from the samples and also fell back to the full p_j
        assert stats["fallbacks"] > num_seqs // 100 and stats["resolved"] > num_seqs // 100, stats

    def every_head_path_used(num_seqs: int) -> None:
        # the head fallback kept a token, and also ran out and fetched the whole p_j
        both_dssd_paths_used(num_seqs)
        assert stats["head resolved"] > num_seqs // 100 and stats["ran out"] > num_seqs // 100, stats

    def support_moved(num_seqs: int) -> None:
        assert len(supports) >= 3, supports  # the conformal threshold really changed the support

    builders = {
        "chain L=1": lambda: chain_round(pair, 1, g),
        "chain L=2": lambda: chain_round(pair, 2, g),
        "chain L=4": lambda: chain_round(pair, 4, g),
        "chain L=2 coupled bonus": lambda: coupled_chain_round(pair, 2, g),
        "mc k=2 iid": lambda: mc_round(pair, 2, g, True),
        "mc k=3 distinct": lambda: mc_round(pair, 3, g, False),
        "tree <2,2>": lambda: tree_round(pair, (2, 2), g),
        "tree <3,1>": lambda: tree_round(pair, (3, 1), g),
        "tree <2,2> distinct": lambda: tree_round(pair, (2, 2), g, with_replacement=False),
        "dssd L=3 m=4": lambda: dssd_round(pair, 3, 4, g, stats),
        "dssd wire scalars L=2 m=1": lambda: dssd_round(pair, 2, 1, g, stats, scalar_wire=wire_scalars),
        "dssd L=2 m=2 coupled bonus": lambda: dssd_round(pair, 2, 2, g, stats, coupled=True),
        "dssd L=2 m=1 head fallback K=1 n=1": lambda: dssd_round(pair, 2, 1, g, stats,
                                                                  residual_fallback=head_fallback(1, 1, stats)),
        "dense fp16": lambda: codec_round(pair, codec_config("dense"), 2, g),
        "tslt top-2": lambda: codec_round(pair, codec_config("tslt"), 2, g),
        "ksqs top-2": lambda: codec_round(pair, codec_config("ksqs"), 2, g),
        "csqs conformal": lambda: codec_round(
            pair, codec_config("csqs"), 2, g,
            ConformalController(alpha=CSQS_ALPHA, eta=CSQS_ETA, beta0=CSQS_BETA0), supports=supports),
    }
    checks = {"dssd L=3 m=4": both_dssd_paths_used, "dssd wire scalars L=2 m=1": both_dssd_paths_used,
              "dssd L=2 m=2 coupled bonus": both_dssd_paths_used,
              "dssd L=2 m=1 head fallback K=1 n=1": every_head_path_used, "csqs conformal": support_moved}
    return builders[name](), checks.get(name, lambda num_seqs: None)


MODES = [
    "chain L=1", "chain L=2", "chain L=4", "chain L=2 coupled bonus", "mc k=2 iid", "mc k=3 distinct",
    "tree <2,2>", "tree <3,1>", "tree <2,2> distinct", "dssd L=3 m=4", "dssd wire scalars L=2 m=1",
    "dssd L=2 m=2 coupled bonus", "dssd L=2 m=1 head fallback K=1 n=1", "dense fp16", "tslt top-2",
    "ksqs top-2", "csqs conformal",
]


@pytest.mark.parametrize("mode", MODES)
def test_mode_is_lossless(pair, exact, mode: str) -> None:
    round_fn, check = build_mode(mode, pair, torch.Generator().manual_seed(1000 + MODES.index(mode)))
    assert_lossless(fit(round_fn, exact))
    check(NUM_SEQS)


@pytest.mark.slow
@pytest.mark.parametrize("mode", MODES)
def test_mode_is_lossless_high_power(request, pair, exact, mode: str) -> None:
    """`make test-slow`: the same check with HIGH_POWER_SEQS sequences (~7x more sensitive).

    About 20 s per mode here, so it runs only when the slow marker is selected explicitly
    (``-m slow``), not when this file is run on its own."""
    if "slow" not in (request.config.option.markexpr or ""):
        pytest.skip("high-power run: select it with -m slow (make test-slow)")
    round_fn, check = build_mode(mode, pair, torch.Generator().manual_seed(2000 + MODES.index(mode)))
    assert_lossless(fit(round_fn, exact, num_seqs=HIGH_POWER_SEQS))
    check(HIGH_POWER_SEQS)


# --- greedy: temperature 0 reproduces the target's argmax decode token for token -----------------

GREEDY_TOKENS = 24


def greedy_rounds(pair, g):
    stats: dict = {}
    return {
        "chain L=1": chain_round(pair, 1, g),
        "chain L=3": chain_round(pair, 3, g),
        "chain L=3 coupled bonus": coupled_chain_round(pair, 3, g),
        "mc k=3": mc_round(pair, 3, g, True),
        "mc k=1 without replacement": mc_round(pair, 1, g, False),
        "tree <2,2>": tree_round(pair, (2, 2), g),
        "tree <3,1,2>": tree_round(pair, (3, 1, 2), g),
        "dssd L=3 m=1": dssd_round(pair, 3, 1, g, stats),
    }


GREEDY_SEEDS = [1, 2, 5, 6]  # toy pairs whose argmax path meets wrong drafts at drafted positions


def run_greedy(round_fn) -> list[int]:
    seq = list(PROMPT)
    while len(seq) < len(PROMPT) + GREEDY_TOKENS:
        seq += round_fn(seq)
    return seq[len(PROMPT) : len(PROMPT) + GREEDY_TOKENS]


@pytest.mark.parametrize("pair_seed", GREEDY_SEEDS)
def test_greedy_equals_target_argmax(pair_seed: int) -> None:
    greedy = tm.greedy_pair(tm.make_pair(VOCAB, pair_seed))
    want = tm.argmax_decode(greedy, PROMPT, GREEDY_TOKENS)
    assert len(set(want)) > 1  # a non-trivial path
    for name, round_fn in greedy_rounds(greedy, torch.Generator().manual_seed(pair_seed)).items():
        assert run_greedy(round_fn) == want, name


@pytest.mark.parametrize("pair_seed", GREEDY_SEEDS)
def test_control_greedy_check_catches_inverted_accept(pair_seed: int) -> None:
    """The greedy check has teeth: with min(1, q/p) a wrong one-hot draft is always accepted."""
    greedy = tm.greedy_pair(tm.make_pair(VOCAB, pair_seed))
    want = tm.argmax_decode(greedy, PROMPT, GREEDY_TOKENS)
    g = torch.Generator().manual_seed(pair_seed)
    for L in (1, 3):
        assert run_greedy(chain_round(greedy, L, g, verify=chain_inverted_accept)) != want


# --- negative controls ----------------------------------------------------------------------------


def chain_inverted_accept(draft_ids, q, p, g) -> ChainResult:
    """BROKEN (TSLT Alg. 3 as printed): accept with min(1, q/p)."""
    for i, x in enumerate(draft_ids.tolist()):
        if float(torch.rand(1, generator=g, dtype=torch.float64)) * float(p[i, x]) >= float(q[i, x]):
            return ChainResult(i, sample_token(residual_distribution(p[i], q[i]), g))
    return ChainResult(len(draft_ids), sample_token(p[-1], g))


def chain_unnormalised_residual(draft_ids, q, p, g) -> ChainResult:
    """BROKEN: inverse CDF on the unnormalised max(0, p - q); the missing mass falls to token 0."""
    for i, x in enumerate(draft_ids.tolist()):
        if float(torch.rand(1, generator=g, dtype=torch.float64)) * float(q[i, x]) < float(p[i, x]):
            continue
        cdf = torch.cumsum(torch.clamp(p[i] - q[i], min=0), 0)
        idx = int(torch.searchsorted(cdf, float(torch.rand(1, generator=g, dtype=torch.float64)), right=True))
        return ChainResult(i, idx if idx < cdf.numel() else 0)
    return ChainResult(len(draft_ids), sample_token(p[-1], g))


def chain_residual_falls_back_to_p(draft_ids, q, p, g) -> ChainResult:
    """BROKEN: on rejection resample from p itself instead of the residual."""
    for i, x in enumerate(draft_ids.tolist()):
        if float(torch.rand(1, generator=g, dtype=torch.float64)) * float(q[i, x]) >= float(p[i, x]):
            return ChainResult(i, sample_token(p[i], g))
    return ChainResult(len(draft_ids), sample_token(p[-1], g))


def mc_without_p_update(candidates, q, p, g, *, with_replacement: bool = True):
    """BROKEN: every candidate is tested against the original p; only the final sample uses the residual."""
    for i, x in enumerate(candidates.tolist()):
        if float(torch.rand(1, generator=g, dtype=torch.float64)) * float(q[x]) < float(p[x]):
            return i, x
    return -1, sample_token(residual_distribution(p, q), g)


def residual_fallback_to_p(p_j, q_j, g) -> int:
    """BROKEN DSSD device fallback: samples p_j instead of norm(max(0, p_j - q_j))."""
    return sample_token(p_j, g)


@pytest.mark.parametrize(
    "name, verify",
    [
        ("inverted accept test min(1, q/p)", chain_inverted_accept),
        ("residual not renormalised", chain_unnormalised_residual),
        ("residual replaced by p", chain_residual_falls_back_to_p),
    ],
)
def test_control_broken_chain_is_rejected(pair, exact, name: str, verify) -> None:
    round_fn = chain_round(pair, 2, torch.Generator().manual_seed(500), verify=verify)
    assert_rejected(fit(round_fn, exact, num_seqs=CONTROL_SEQS))


def _one_noise_for_every_session(seed: int, position: int, vocab: int) -> torch.Tensor:
    """BROKEN: the bonus noise ignores the session (a constant seed): bonus tokens are then a fixed
    function of p at each position instead of fresh draws."""
    return bonus_noise(0, position, vocab)


def _uniform_noise(seed: int, position: int, vocab: int) -> torch.Tensor:
    """BROKEN: uniform instead of Gumbel noise; argmax log p + u is not a draw from p."""
    return torch.rand(vocab, dtype=torch.float64, generator=torch.Generator().manual_seed(seed + position))


def _bonus_is_the_device_guess(p_next, q_next, noise) -> int:
    """BROKEN: the edge emits the device's guess (the Gumbel-max draw on q) as the bonus."""
    return sample_token_gumbel(q_next, noise)


@pytest.mark.parametrize(
    "name, kwargs",
    [
        ("one bonus noise for every session", dict(noise=_one_noise_for_every_session)),
        ("uniform instead of Gumbel noise", dict(noise=_uniform_noise)),
        ("bonus taken from the device's guess", dict(bonus=_bonus_is_the_device_guess)),
    ],
)
def test_control_broken_coupled_bonus_is_rejected(pair, exact, name: str, kwargs) -> None:
    round_fn = coupled_chain_round(pair, 1, torch.Generator().manual_seed(550), **kwargs)
    assert_rejected(fit(round_fn, exact, num_seqs=CONTROL_SEQS))


@pytest.mark.parametrize("t", [0.5, 2.0])
def test_control_draft_sampled_from_other_q_is_rejected(pair, exact, t: float) -> None:
    """BROKEN pipeline: tokens drawn from q at another temperature, verifier sees q."""
    g = torch.Generator().manual_seed(600)
    round_fn = chain_round(pair, 2, g, draft_law=lambda q: tm.temperature(q, t))
    assert_rejected(fit(round_fn, exact, num_seqs=CONTROL_SEQS))


def test_control_mc_without_p_update_is_rejected(pair, exact) -> None:
    g = torch.Generator().manual_seed(700)
    assert_rejected(fit(mc_round(pair, 3, g, True, verify=mc_without_p_update), exact, num_seqs=CONTROL_SEQS))


def test_control_without_replacement_draft_verified_as_iid_is_rejected(pair, exact) -> None:
    """BROKEN pipeline: candidates drawn without replacement, verifier keeps q fixed (i.i.d. rule)."""
    g = torch.Generator().manual_seed(750)

    def round_fn(seq: list[int]) -> list[int]:
        q, p = pair.q(seq), pair.p(seq)
        cands = sample_candidates(q, 3, g, with_replacement=False)
        return [mc_verify(cands, q, p, g, with_replacement=True)[1]]

    assert_rejected(fit(round_fn, exact, num_seqs=CONTROL_SEQS))


def test_control_sampled_before_quantization_is_rejected(pair, exact) -> None:
    """BROKEN pipeline (K-SQS): the device samples from its truncated q before lattice quantization
    (restricted to the transmitted support), the edge verifies against the quantized q_hat."""

    def unquantized(q, q_hat):
        kept = torch.zeros_like(q)
        kept[q_hat.ids] = q[q_hat.ids]
        return kept / kept.sum()

    # ell = 3 over K = 3 tokens: quantization moves q by up to 1/3, which the harness must see
    cfg = CodecConfig(mode="ksqs", vocab_size=VOCAB, top_k=3, lattice=3)
    g = torch.Generator().manual_seed(760)
    assert_rejected(fit(codec_round(pair, cfg, 2, g, draft_law=unquantized), exact, num_seqs=3_000))


def test_control_sampled_from_uncompressed_q_is_refused(pair) -> None:
    """BROKEN pipeline (TSLT): the device samples from the full q, the edge verifies q_hat on the
    top-2 support. A draft outside the packet's support cannot have been sampled from it: the
    verifier refuses it with ValueError instead of silently biasing the output."""
    g = torch.Generator().manual_seed(770)
    round_fn = codec_round(pair, codec_config("tslt"), 2, g, draft_law=lambda q, q_hat: q)
    with pytest.raises(ValueError, match="cannot have been sampled"):
        tm.generate_counts(round_fn, PROMPT, N_TOKENS, CONTROL_SEQS)


def resolve_head_tail_untested(head, q_j, g):
    """BROKEN head fallback: keeps a tail sample without its accept test (as if p_j were q_j's residual
    off the head)."""
    excess = torch.clamp(head.head_probs - q_j[head.head_ids], min=0.0)
    r_head = float(excess.sum())
    if float(torch.rand((), dtype=torch.float64, generator=g)) * (r_head + head.tail_mass) < r_head:
        return int(head.head_ids[sample_token(excess / r_head, g)])
    return int(head.tail_samples[0]) if head.tail_samples.numel() else None


def test_control_dssd_head_fallback_keeping_tail_samples_untested_is_rejected(pair, exact) -> None:
    """(Running out one trial late biases far less: test_verification's exact-law check catches it.)"""
    stats: dict = {}
    g = torch.Generator().manual_seed(810)
    round_fn = dssd_round(pair, 2, 1, g, stats, residual_fallback=head_fallback(1, 1, stats, resolve_head_tail_untested))
    assert_rejected(fit(round_fn, exact, num_seqs=2_000))  # only the fallback path is broken


def test_control_dssd_fallback_to_p_is_rejected(pair, exact) -> None:
    stats: dict = {}
    g = torch.Generator().manual_seed(800)
    round_fn = dssd_round(pair, 2, 1, g, stats, residual_fallback=residual_fallback_to_p)
    assert_rejected(fit(round_fn, exact, num_seqs=2_000))  # only the rarer fallback path is broken


# --- gumbel: ids only, accept iff the draft is the target's own race (Daliri et al. 2024) ------------

# noise(session seed, round start, offset) -> [V] exponential noise of position start + offset
RaceNoise = Callable[[int, int, int], torch.Tensor]


def by_position(seed: int, start: int, offset: int) -> torch.Tensor:
    return token_noise(seed, start + offset, VOCAB)


def by_round(seed: int, start: int, offset: int) -> torch.Tensor:
    """BROKEN: keyed by the round's start, so every position of a round races with the same noise."""
    return token_noise(seed, start, VOCAB)


def gumbel_round(pair, L: int, g: torch.Generator, noise: RaceNoise = by_position, verify=None):
    """The device races q with each position's noise, the edge verifies accept-iff-equal
    (``verify(draft, q_rows, p, noise_at)`` replaces it in controls); a new session seed per sequence."""
    session = {"seed": 0}

    def round_fn(seq: list[int]) -> list[int]:
        if len(seq) == len(PROMPT):  # a new sequence: a new session
            session["seed"] = int(torch.randint(2**62, (1,), generator=g))
        seed, start = session["seed"], len(seq)

        def noise_at(i: int) -> torch.Tensor:
            return noise(seed, start, i)

        draft: list[int] = []
        for i in range(L):
            draft.append(race_token(pair.q(seq + draft), noise_at(i)))
        p = torch.stack([pair.p(seq + draft[:i]) for i in range(L + 1)])  # [L+1, V]
        if verify is None:
            res = gumbel_verify(torch.tensor(draft), p, noise_at)
        else:
            res = verify(draft, [pair.q(seq + draft[:i]) for i in range(L)], p, noise_at)
        return draft[: res.num_accepted] + [res.next_token]

    return round_fn


def verify_by_ratio_with_the_shared_noise(draft, q_rows, p, noise_at) -> ChainResult:
    """BROKEN, the known trap: race-drafted tokens verified by speculative sampling whose accept
    uniform is the one behind the draft's own noise (u = exp(-E(x))) and whose residual races with the
    same noise. Having won q's race, x's noise is small, its uniform large: x is accepted too rarely."""
    for i, x in enumerate(draft):
        e = noise_at(i)
        if not float(torch.exp(-e[x])) * float(q_rows[i][x]) < float(p[i][x]):
            return ChainResult(i, race_token(residual_distribution(p[i], q_rows[i]), e))
    return ChainResult(len(draft), race_token(p[len(draft)], noise_at(len(draft))))


@pytest.mark.parametrize("L", [1, 3])
def test_gumbel_is_lossless(pair, exact, L: int) -> None:
    g = torch.Generator().manual_seed(900 + L)
    assert_lossless(fit(gumbel_round(pair, L, g), exact))


@pytest.mark.slow
@pytest.mark.parametrize("L", [1, 3])
def test_gumbel_is_lossless_high_power(pair, exact, L: int) -> None:
    g = torch.Generator().manual_seed(910 + L)
    assert_lossless(fit(gumbel_round(pair, L, g), exact, num_seqs=HIGH_POWER_SEQS))


def test_gumbel_greedy_is_the_target_argmax(pair) -> None:
    """At T = 0 both laws are one-hot: every token is the target's argmax, whatever the noise."""
    greedy = tm.greedy_pair(pair)
    g = torch.Generator().manual_seed(920)
    round_fn = gumbel_round(greedy, 3, g)
    seq = list(PROMPT)
    while len(seq) < len(PROMPT) + 8:
        seq += round_fn(seq)
    assert seq[len(PROMPT):len(PROMPT) + 8] == tm.argmax_decode(greedy, PROMPT, 8)


def test_control_gumbel_verified_by_ratio_with_shared_noise_is_rejected(pair, exact) -> None:
    g = torch.Generator().manual_seed(930)
    assert_rejected(fit(gumbel_round(pair, 2, g, verify=verify_by_ratio_with_the_shared_noise), exact,
                        num_seqs=CONTROL_SEQS))


def test_control_gumbel_noise_keyed_by_round_is_rejected(pair, exact) -> None:
    g = torch.Generator().manual_seed(940)
    assert_rejected(fit(gumbel_round(pair, 3, g, noise=by_round), exact, num_seqs=CONTROL_SEQS))
