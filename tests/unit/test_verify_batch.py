"""Batched verification (edge/verify_batch.py) against the per-session functions it replaces on the
edge (chain_verify, dssd_edge_verify, gumbel_verify on TargetLaw.probs): the same verdicts, token for
token, on thousands of random rounds in batches of mixed modes, laws, lengths and vocabularies.

What the comparison can see: any verdict that differs in one round out of the ~3,000 fails it, so a
batched path that read a wrong uniform, a wrong row, an unrenormalised residual or another round's
numbers would fail (the control below shows that one shifted uniform already changes hundreds)."""
from __future__ import annotations

import random
import threading
from dataclasses import dataclass
from itertools import islice

import pytest
import torch

from specdec.common import verification as V
from specdec.common.distributions import SparseDist, densify, race_token_unchecked
from specdec.common.sampling import TargetLaw
from specdec.edge.noise_ahead import Memo, draw_ahead, kept as noise_kept
from specdec.edge.verify_batch import (ChainRound, RoundKind, chain_round, dssd_round, gumbel_round,
                                         verify_rounds)

LAWS = (TargetLaw(1.0), TargetLaw(0.0), TargetLaw(0.7), TargetLaw(1.3, top_k=20), TargetLaw(1.0, top_p=0.9),
        TargetLaw(0.0, top_k=5))
BATCHES = 400          # x ~7.5 rounds: ~3,000 rounds
MAX_BATCH = 14
MAX_DRAFTS = 6
# both paths (verify_rounds' upfront: the one a GPU takes, checked here on the CPU)
UPFRONT = pytest.mark.parametrize("upfront", [False, True], ids=["lockstep", "upfront"])


@dataclass
class Case:
    """One random round: its logits, its inputs, and what the per-session function says."""
    logits: torch.Tensor   # [L + 1, V] float32
    batched: ChainRound
    expected: tuple


def _q_rows(logits: torch.Tensor, rng: random.Random, gen: torch.Generator, temperature: float,
            sparse: bool) -> list[SparseDist]:
    """Draft distributions near the target's (so that acceptance ranges from none to all): the target's
    logits plus noise, tempered, optionally cut to a top-K support."""
    rows = []
    vocab = logits.shape[1]
    for row in logits:
        noisy = row + torch.randn(vocab, generator=gen) * rng.choice([0.0, 0.3, 1.0, 3.0])
        if temperature == 0 or rng.random() < 0.1:
            q = torch.zeros(vocab, dtype=torch.float64)
            q[int(noisy.argmax()) if rng.random() < 0.7 else rng.randrange(vocab)] = 1.0
        else:
            q = torch.softmax(noisy.double() / max(temperature, 0.3), dim=-1)
        ids = torch.arange(vocab)
        if sparse:
            ids = torch.sort(torch.topk(q, rng.randint(1, vocab)).indices).values
            ids = ids[q[ids] > 0]
        probs = q[ids] / q[ids].sum()
        rows.append(SparseDist(ids=ids, probs=probs, vocab_size=vocab))
    return rows


def _draws(rows: list[SparseDist], gen: torch.Generator) -> torch.Tensor:
    return torch.tensor([int(sd.ids[torch.multinomial(sd.probs, 1, generator=gen)]) for sd in rows])


def _case(rng: random.Random, gen: torch.Generator, law: TargetLaw, vocab: int) -> Case:
    kind = rng.choice(list(RoundKind))
    length = rng.randint(0 if kind is RoundKind.GUMBEL else 1, MAX_DRAFTS)
    logits = (torch.randn(length + 1, vocab, generator=gen) * rng.choice([0.5, 2.0, 6.0])).float()
    seed, position = rng.getrandbits(63), rng.randrange(1 << 20)
    p = law.probs(logits)
    coupled = rng.random() < 0.5
    noise = (lambda: V.bonus_noise(seed, position, vocab)) if coupled else None
    if kind is RoundKind.GUMBEL:
        def token_noise(i, seed=seed, position=position):
            return V.token_noise(seed, position + i, vocab)
        drafts = torch.tensor([int(race_token_unchecked(p[i], token_noise(i))) if rng.random() < 0.8
                               else rng.randrange(vocab) for i in range(length)], dtype=torch.int64)
        if length:
            res = V.gumbel_verify(drafts, p, token_noise)
            expected = (res.num_accepted, res.next_token)
        else:
            expected = (0, race_token_unchecked(p[0], token_noise(0)))
        return Case(logits, gumbel_round(drafts, law, token_noise), expected)
    rows = _q_rows(logits[:length], rng, gen, law.temperature, sparse=rng.random() < 0.5)
    drafts = _draws(rows, gen)
    if kind is RoundKind.CHAIN:
        q = torch.stack([densify(sd) for sd in rows])
        res = V.chain_verify(drafts, q, p, torch.Generator().manual_seed(seed), noise)
        return Case(logits, chain_round(drafts, rows, law, torch.Generator().manual_seed(seed), noise),
                    (res.num_accepted, res.next_token))
    q_x = torch.tensor([float(densify(sd)[x]) for sd, x in zip(rows, drafts.tolist())], dtype=torch.float64)
    m = rng.choice([0, 1, 4, 16])
    res = V.dssd_edge_verify(drafts, q_x, p, torch.Generator().manual_seed(seed), m, noise)
    expected = (res.num_accepted, res.bonus_token, tuple(res.reject_samples.tolist()),
                tuple(res.reject_sample_probs.tolist()),
                None if res.reject_p is None else tuple(res.reject_p.tolist()))
    return Case(logits, dssd_round(drafts, q_x, law, torch.Generator().manual_seed(seed), m, noise), expected)


def _observed(case: Case, outcome) -> tuple:
    if case.batched.kind is not RoundKind.DSSD:
        return outcome.num_accepted, outcome.next_token
    return (outcome.num_accepted, outcome.next_token, outcome.reject_samples, outcome.reject_sample_probs,
            None if outcome.reject_p is None else tuple(outcome.reject_p.tolist()))


def _batches(seed: int, vocab: int | None = None):
    rng, gen = random.Random(seed), torch.Generator().manual_seed(seed)
    for _ in range(BATCHES):
        size, vocab_b = rng.randint(1, MAX_BATCH), vocab or rng.choice([7, 50, 300])
        yield [_case(rng, gen, rng.choice(LAWS), vocab_b) for _ in range(size)]


def test_batched_verdicts_equal_the_per_session_functions_on_thousands_of_rounds() -> None:
    """Both paths (lockstep, upfront) on the same rounds: the cases and their per-session verdicts cost
    most of the test's time, so they are made once."""
    rounds = 0
    differ = {False: 0, True: 0}
    ends: dict[str, int] = {}
    for cases in _batches(2026):
        for upfront in (False, True):
            outcomes = verify_rounds([c.logits for c in cases], [c.batched for c in cases], upfront=upfront)
            differ[upfront] += sum(_observed(c, o) != c.expected for c, o in zip(cases, outcomes))
        for c, o in zip(cases, outcomes):
            rounds += 1
            where = "all accepted" if o.num_accepted == c.batched.length else "rejected"
            ends[f"{c.batched.kind.value} {where}"] = ends.get(f"{c.batched.kind.value} {where}", 0) + 1
    print(f"{rounds} rounds, ends: {ends}")
    assert rounds >= 2500
    assert min(ends.values()) >= 100, f"every kind should both reject and accept all often: {ends}"
    assert differ == {False: 0, True: 0}, f"of {rounds} verdicts, differing by path (upfront?): {differ}"


@UPFRONT
def test_a_verdict_does_not_depend_on_the_batch_around_it(upfront: bool) -> None:
    cases = next(_batches(7, vocab=50)) + next(_batches(8, vocab=50))
    alone = [verify_rounds([c.logits], [c.batched], upfront=upfront)[0] for c in cases]
    together = verify_rounds([c.logits for c in cases], [c.batched for c in cases], upfront=upfront)
    reversed_ = verify_rounds([c.logits for c in cases[::-1]], [c.batched for c in cases[::-1]], upfront=upfront)[::-1]
    for a, b, r, c in zip(alone, together, reversed_, cases):
        assert _observed(c, a) == _observed(c, b) == _observed(c, r) == c.expected


@UPFRONT
def test_control_one_shifted_uniform_changes_verdicts(upfront: bool) -> None:
    """The comparison's power: the same rounds verified with their uniforms shifted by one draw (a
    correction reading the accept test's uniform, say) give other verdicts in many rounds."""
    differ = total = 0
    for cases in islice(_batches(11), 60):
        shifted = [c for c in cases if c.batched.kind is RoundKind.CHAIN and c.batched.law.temperature > 0]
        for c in shifted:
            u = c.batched.uniforms
            wrong = ChainRound(**{**c.batched.__dict__, "uniforms": torch.cat([u[1:], u[:1]])})
            total += 1
            differ += _observed(c, verify_rounds([c.logits], [wrong], upfront=upfront)[0]) != c.expected
    assert total >= 50 and differ >= total // 10, f"{differ} of {total} differ"


@UPFRONT
def test_greedy_rounds_end_at_the_targets_argmax(upfront: bool) -> None:
    logits = torch.tensor([[0.0, 3.0, 1.0], [2.0, 0.0, 1.0], [0.0, 1.0, 5.0]])
    law = TargetLaw(0.0)
    rows = [SparseDist(torch.tensor([1]), torch.tensor([1.0], dtype=torch.float64), 3),
            SparseDist(torch.tensor([1, 2]), torch.tensor([0.5, 0.5], dtype=torch.float64), 3)]
    accepted_all = chain_round(torch.tensor([1, 0]), [rows[0], SparseDist(torch.tensor([0]), torch.tensor(
        [1.0], dtype=torch.float64), 3)], law, torch.Generator().manual_seed(0))
    rejected = chain_round(torch.tensor([1, 2]), rows, law, torch.Generator().manual_seed(0))
    a, r = verify_rounds([logits, logits], [accepted_all, rejected], upfront=upfront)
    assert (a.num_accepted, a.next_token) == (2, 2)  # bonus: argmax of row 2
    assert (r.num_accepted, r.next_token) == (1, 0)  # token 2 is not row 1's argmax: the correction is


def test_bad_input_is_refused() -> None:
    law, gen = TargetLaw(1.0), torch.Generator().manual_seed(0)
    sd = SparseDist(torch.tensor([0, 2]), torch.tensor([0.5, 0.5], dtype=torch.float64), 4)
    with pytest.raises(ValueError, match="draft probability 0"):
        chain_round(torch.tensor([1]), [sd], law, gen)
    with pytest.raises(ValueError, match="sums to"):
        chain_round(torch.tensor([0]), [SparseDist(torch.tensor([0, 2]), torch.tensor([0.5, 0.6],
                                                   dtype=torch.float64), 4)], law, gen)
    with pytest.raises(ValueError, match="distributions for"):
        chain_round(torch.tensor([0, 2]), [sd], law, gen)
    good = chain_round(torch.tensor([0]), [sd], law, gen)
    with pytest.raises(ValueError, match=r"needs logits \[2, V\]"):
        verify_rounds([torch.zeros(3, 4)], [good])
    with pytest.raises(ValueError, match="target over 5"):
        verify_rounds([torch.zeros(2, 5)], [good])
    with pytest.raises(ValueError, match="NaN"):
        verify_rounds([torch.full((2, 4), float("nan"))], [good])
    greedy = chain_round(torch.tensor([0]), [sd], TargetLaw(0.0), gen)
    for bad in (float("nan"), float("inf"), -float("inf")):
        logits = torch.zeros(2, 4)
        logits[0, 3] = bad
        with pytest.raises(ValueError, match="NaN or inf"):
            verify_rounds([logits], [greedy])
    with pytest.raises(ValueError, match="q_of_draft"):
        dssd_round(torch.tensor([0]), torch.tensor([1.5], dtype=torch.float64), law, gen, 4)
    bad_noise = gumbel_round(torch.tensor([1]), law, lambda i: -torch.ones(4, dtype=torch.float64))
    with pytest.raises(ValueError, match="positive float64"):
        verify_rounds([torch.zeros(2, 4)], [bad_noise])


@pytest.mark.parametrize("vocab", [7, 4096, 49152])
def test_the_float64_sum_of_float32_rows_is_the_sum_of_their_float64_copy(vocab: int) -> None:
    """TargetLaw.probs and the batched path renormalise with ``sum(dtype=float64)`` of the float32 law,
    which must be, bit for bit, the sum of its float64 copy (what the law was renormalised with
    before): a torch whose cast-on-load sum ran in another order would change tokens at the last bit."""
    gen = torch.Generator().manual_seed(vocab)
    rows = torch.softmax(torch.randn(40, vocab, generator=gen) * 3, dim=-1)
    for k in (1, 6, 40):
        assert torch.equal(rows[:k].sum(-1, dtype=torch.float64), rows[:k].double().sum(-1))
        assert torch.equal(rows[:k].sum(-1, dtype=torch.float64), torch.stack([r.double().sum() for r in rows[:k]]))


@pytest.mark.parametrize("how", ["before", "while verifying"])
def test_noise_drawn_ahead_gives_the_same_verdicts(how: str) -> None:
    """edge/noise_ahead.py: the race and bonus noise drawn beforehand by the session (all of it), or by
    other threads while the batch is verified (each draw by whichever thread asks first), and read
    from what they kept: every verdict as drawn where read."""
    rounds = drawn = 0
    for cases in islice(_batches(2027), 120):
        kept = [noise_kept(c.batched) for c in cases]
        threads = [threading.Thread(target=lambda r=r: draw_ahead(r, lambda: False)) for r in kept]
        if how == "before":
            assert all(draw_ahead(r, lambda: False) == r.length + 1 for r in kept if isinstance(r.token_noise, Memo))
        for t in threads if how != "before" else ():
            t.start()
        outcomes = verify_rounds([c.logits for c in cases], kept)
        for t in threads if how != "before" else ():
            t.join()
        rounds += len(cases)
        drawn += sum(r.token_noise.drawn(r.length) for r in kept if isinstance(r.token_noise, Memo))
        assert [_observed(c, o) for c, o in zip(cases, outcomes)] == [c.expected for c in cases]
    assert rounds >= 500 and drawn >= 100, (rounds, drawn)
