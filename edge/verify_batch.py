"""Verification of a batched forward as batch tensor work: every chain round of one forward at once.

The per-session functions of :mod:`specdec.common.verification` (``chain_verify``,
``dssd_edge_verify``, ``gumbel_verify``) verify one round in Python, position by position; they stay
the reference. Here every round one target forward served is verified together, with a handful of
tensor operations per draft position, as vLLM's rejection sampler verifies a batch
(vllm/v1/sample/rejection_sampler.py): on a GPU a batch of 32 sessions costs a few kernels instead of
thousands, and on a CPU the target's law is computed only for the rows a decision reads.

The algorithms are verification.py's: chain speculative sampling (Leviathan et al. 2023 Alg. 1; TSLT
Alg. 3 with its erratum fixed: accept ``x`` with probability ``min(1, p(x)/q(x))``, at the first
rejection draw from ``norm(max(0, p - q))``, after L acceptances a bonus from ``p_{L+1}``), DSSD's
edge half (Ning et al. 2025: the accept tests on the scalars ``q_i(x_i)``, ``m`` samples of ``p_j`` at
a rejection) and Gumbel verification (Daliri et al. 2024, arXiv 2408.07978, §4: accept iff the draft
is the target's own race ``argmin E / p``; with no draft it is mode none's token). So are the numbers:

- uniforms: each round's are drawn beforehand from its own CPU stream, ``k`` at once being the
  ``k`` numbers ``k`` single draws give, and read in the per-session order: accept test ``i`` reads
  ``u_i``; the correction after a rejection at ``i`` reads ``u_{i+1}``, the bonus after ``L``
  acceptances ``u_L``; DSSD's ``m`` samples of ``p_j`` read ``u_{j+1} .. u_{j+m}``;
- the target's law: :meth:`TargetLaw.probs32` on a batch of rows, then each row's float64 sum; a
  probability a decision reads is its row's float64 value over that sum, the very operations
  :meth:`TargetLaw.probs` runs on one round's rows (softmax, sums and cumulative sums run row by row
  on a CPU, so a row gets the same bits in a batch as alone);
- residuals, inverse CDFs, races and the coupled bonus: the per-session formulas, row-wise.

A batch's verdicts are therefore the per-session functions' verdicts token for token
(tests/unit/test_verify_batch.py compares them on thousands of random rounds). On a GPU a reduction
may group its terms differently with the batch's shape; a verdict could then differ only where a
uniform falls within a rounding error of its threshold (of order 1e-16 per test), and the law is
exact either way.

On a CPU, positions in lockstep: step ``i`` takes row ``i`` of every round still running, so rows
past a round's first rejection are never computed, and each race (``argmin E / p``) runs on its own
row, where copying the noise and the law into a batch cost more than the batch saved. Elsewhere (:class:`_Upfront`) the whole batch at
once, since a GPU pays per operation and per transfer to the host rather than per row. A round's
outcome depends on its own inputs only, never on the batch around it. Trees and a DSSD fallback's
``p_j`` keep the per-session host path.
"""
from __future__ import annotations

import enum
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

import numpy as np
import torch

from specdec.common.distributions import SparseDist, first_argmax, first_argmin, inverse_cdf_rows
from specdec.common.adjust import History, chain_paths
from specdec.common.logprobs import NO_LOGPROBS, TokenLogprob
from specdec.common.sampling import TargetLaw
from specdec.common.validation import (VERIFY_SUM_ATOL, check_drafts_sampleable, check_int, check_logits,
                                       check_prob_scalars, check_token_ids)
from specdec.common.verification import BonusNoise

__all__ = ["ChainRound", "RoundKind", "RoundOutcome", "chain_round", "dssd_round", "gumbel_round",
           "verify_rounds"]


class RoundKind(enum.Enum):
    CHAIN = "chain"    # q sent (dense, tslt, ksqs, csqs): u < p/q, the residual at the first rejection
    DSSD = "dssd"      # q(x) sent: the accept tests, m samples of p_j at the first rejection
    GUMBEL = "gumbel"  # nothing of q sent: accept iff the draft is the target's race (no draft: mode none)


@dataclass(frozen=True)
class ChainRound:
    """One session's drafted chain, to verify against the target's rows of its forward (build it with
    :func:`chain_round`, :func:`dssd_round` or :func:`gumbel_round`, which check it)."""

    kind: RoundKind
    law: TargetLaw
    draft_ids: torch.Tensor                   # [L] int64 (host); L >= 1, or 0 for a gumbel race alone
    q_of_draft: torch.Tensor | None = None    # [L] float64 q_i(x_i) (chain, dssd)
    q_rows: tuple[SparseDist, ...] = ()       # chain: q_i, densified only at a rejection
    uniforms: torch.Tensor | None = None      # [U] float64 of the round's VERIFY stream (chain, dssd)
    bonus_noise: BonusNoise | None = None     # the coupled bonus's noise (chain, dssd), or None
    dssd_samples: int = 0                     # dssd: m samples of p_j at a rejection
    token_noise: Callable[[int], torch.Tensor] | None = None  # gumbel: noise(i) [V] of draft position i
    history: History | None = None           # what the law's penalties read of the verified prefix
    masks: torch.Tensor | None = None         # [L + 1, V] bool: the grammar's allowed tokens of each row
    logprobs: int = NO_LOGPROBS               # report the emitted tokens' log-probabilities (and top N)

    @property
    def length(self) -> int:
        return self.draft_ids.numel()


@dataclass(frozen=True)
class RoundOutcome:
    """A round's verdict: ``draft_ids[:num_accepted]`` accepted, then ``next_token`` (the correction or
    the bonus), or, after a DSSD rejection, the samples of ``p_j`` the device resolves."""

    num_accepted: int
    next_token: int | None                     # None: a DSSD rejection
    reject_samples: tuple[int, ...] = ()       # dssd: y_k ~ p_j
    reject_sample_probs: tuple[float, ...] = ()  # dssd: p_j(y_k)
    reject_p: torch.Tensor | None = None       # dssd: [V] float64 p_j on the host, for the fallback
    logprobs: tuple[TokenLogprob, ...] = ()    # one per emitted token, if the round asked


# ------------------------------------------------------------------------------------ building rounds
def chain_round(draft_ids: torch.Tensor,  # [L] int64
                q_rows: Sequence[SparseDist], law: TargetLaw, generator: torch.Generator,
                bonus_noise: BonusNoise | None = None, history: History | None = None,
                masks: torch.Tensor | None = None) -> ChainRound:
    """A chain round (dense, tslt, ksqs, csqs) whose drafts were sampled from ``q_rows`` (the decoded
    packets), with ``L + 1`` uniforms of ``generator``. ValueError on what ``chain_verify`` refuses."""
    ids = _draft_ids(draft_ids, minimum=1)
    if len(q_rows) != ids.numel():
        raise ValueError(f"{len(q_rows)} distributions for {ids.numel()} drafts")
    q_of_draft = _checked_q_of_draft(q_rows, ids)
    check_drafts_sampleable(ids, q_of_draft, "draft_ids")
    return ChainRound(RoundKind.CHAIN, law, ids, q_of_draft, tuple(q_rows),
                      _uniforms(generator, ids.numel() + 1), bonus_noise, history=_history(law, history), masks=masks)


def dssd_round(draft_ids: torch.Tensor,  # [L] int64
               q_of_draft: torch.Tensor,  # [L] float64, q_i(x_i) as the device sent them
               law: TargetLaw, generator: torch.Generator, num_samples: int,
               bonus_noise: BonusNoise | None = None, history: History | None = None,
               masks: torch.Tensor | None = None) -> ChainRound:
    """DSSD's edge half of a round, with ``L + max(m, 1)`` uniforms of ``generator``."""
    ids = _draft_ids(draft_ids, minimum=1)
    check_int(num_samples, "num_samples", 0)
    check_prob_scalars(q_of_draft, "q_of_draft", ids.numel())
    check_drafts_sampleable(ids, q_of_draft, "draft_ids")
    return ChainRound(RoundKind.DSSD, law, ids, q_of_draft.cpu(), (),
                      _uniforms(generator, ids.numel() + max(num_samples, 1)), bonus_noise, num_samples,
                      history=_history(law, history), masks=masks)


def gumbel_round(draft_ids: torch.Tensor,  # [L] int64, L >= 0
                 law: TargetLaw, token_noise: Callable[[int], torch.Tensor],
                 history: History | None = None, masks: torch.Tensor | None = None) -> ChainRound:
    """A gumbel round (``token_noise(i)``: [V] exponential noise of draft position i), or with no
    draft the target's own token at the position (mode none)."""
    return ChainRound(RoundKind.GUMBEL, law, _draft_ids(draft_ids, minimum=0), token_noise=token_noise,
                      history=_history(law, history), masks=masks)


def _history(law: TargetLaw, history: History | None) -> History | None:
    """``history``, which a law with penalties needs (ValueError without it)."""
    if law.adjust.needs_history and history is None:
        raise ValueError("the law's penalties need the verified prefix's history")
    return history


def _draft_ids(draft_ids: torch.Tensor, minimum: int) -> torch.Tensor:
    if isinstance(draft_ids, torch.Tensor) and draft_ids.numel() == 0 and minimum == 0:
        return torch.empty(0, dtype=torch.int64)
    check_token_ids(draft_ids, "draft_ids")
    if draft_ids.numel() < minimum:
        raise ValueError(f"a round needs at least {minimum} draft token(s)")
    return draft_ids.cpu()


def _checked_q_of_draft(rows: Sequence[SparseDist], draft: torch.Tensor) -> torch.Tensor:  # [L] float64
    """``q_i(x_i)`` (0 off the support), after what check_sparse_dist and chain_verify's check of q ask
    of each row (sorted distinct ids in the vocabulary, float64 probabilities, finite, non-negative,
    each row summing to 1 within VERIFY_SUM_ATOL) and a range check of the drafts: for all of a round's
    rows at once, in NumPy (a few microseconds an operation on a round's ~100-300 entries, where
    torch's dispatch costs ~10)."""
    vocab = rows[0].vocab_size if isinstance(rows[0], SparseDist) else 0
    if any(not isinstance(sd, SparseDist) or sd.vocab_size != vocab or sd.ids.ndim != 1
           or sd.ids.shape != sd.probs.shape or not sd.ids.numel() for sd in rows):
        raise ValueError("the draft distributions must be non-empty SparseDists over one vocabulary")
    ids, probs = torch.cat([sd.ids for sd in rows]), torch.cat([sd.probs for sd in rows])  # [sum K]
    if ids.dtype != torch.int64 or probs.dtype != torch.float64:
        raise ValueError("a draft distribution needs int64 ids and float64 probs")
    ids, probs, drafts = ids.cpu().numpy(), probs.cpu().numpy(), draft.numpy()
    sizes = [sd.ids.numel() for sd in rows]
    starts = np.cumsum([0, *sizes[:-1]])
    if min(ids.min(), drafts.min()) < 0 or max(ids.max(), drafts.max()) >= vocab:
        raise ValueError(f"draft or distribution ids out of range [0, {vocab})")
    rising = np.diff(ids) > 0
    rising[starts[1:] - 1] = True  # a row may start below where the last one ended
    if not rising.all():
        raise ValueError("draft distribution ids must be strictly increasing (sorted, no duplicates)")
    sums = np.add.reduceat(probs, starts)                                      # [L]
    if not np.isfinite(sums).all() or (probs < 0).any():
        raise ValueError("draft distributions must hold finite, non-negative probabilities")
    error = np.abs(sums - 1.0)
    if (error > VERIFY_SUM_ATOL).any():
        i = int(error.argmax())
        raise ValueError(f"q row {i} sums to {float(sums[i])!r}, not 1 (tolerance {VERIFY_SUM_ATOL})")
    hit = ids == np.repeat(drafts, sizes)  # at most one a row: the ids of a row are distinct
    q_x = np.zeros(len(rows))
    q_x[np.repeat(np.arange(len(rows)), sizes)[hit]] = probs[hit]
    return torch.from_numpy(q_x)


def _uniforms(generator: torch.Generator, n: int) -> torch.Tensor:  # [n] float64
    """The first ``n`` numbers of the round's stream: what ``n`` single draws would read."""
    if not isinstance(generator, torch.Generator):
        raise ValueError(f"generator must be a torch.Generator, got {type(generator).__name__}")
    return torch.rand(n, generator=generator, dtype=torch.float64)


# ------------------------------------------------------------------------------------ verifying
def verify_rounds(logits: Sequence[torch.Tensor],  # each [L_b + 1, V]: row i after prefix + draft_ids[:i]
                  rounds: Sequence[ChainRound], upfront: bool | None = None) -> list[RoundOutcome]:
    """The verdict of every round against its target logits (any device, the rounds' order). Rounds
    of one law share each step's tensor work; ValueError on malformed input (a batch's caller may
    then verify its rounds one by one, so that only the culprit fails). ``upfront``: the law of every
    row at once and the accept tests from one transfer (:class:`_Upfront`); None: where the logits are
    not on the CPU, whose position-by-position path computes no row past a rejection."""
    if len(logits) != len(rounds):
        raise ValueError(f"{len(logits)} logits for {len(rounds)} rounds")
    for rows, r in zip(logits, rounds):
        _check_pair(rows, r)
    # the law's bias and penalties, row by row with the drafts before each (before any decision)
    logits = [r.law.shaped(rows, r.history, chain_paths(r.draft_ids.tolist()), r.masks)
              if r.law.adjust.active or r.masks is not None else rows for rows, r in zip(logits, rounds)]
    if len({rows.shape[1] for rows in logits}) > 1:
        raise ValueError("the rounds of one forward share the target's vocabulary")
    outcomes: list[RoundOutcome | None] = [None] * len(rounds)
    groups: dict[TargetLaw, list[int]] = {}
    for b, r in enumerate(rounds):
        groups.setdefault(r.law, []).append(b)
    if upfront is None:
        upfront = bool(logits) and logits[0].device.type != "cpu"
    for law, members in groups.items():
        done = (_Upfront if upfront else _Lockstep)(law, [logits[b] for b in members],
                                                     [rounds[b] for b in members]).run()
        for b, outcome in zip(members, done):
            outcomes[b] = _with_logprobs(outcome, rounds[b], logits[b])
    return outcomes  # type: ignore[return-value]


def _with_logprobs(outcome: RoundOutcome, r: ChainRound, rows: torch.Tensor) -> RoundOutcome:
    """The emitted tokens' log-probabilities (common/logprobs.py), where the round asks for them."""
    if r.logprobs == NO_LOGPROBS:
        return outcome
    if outcome.next_token is None:
        raise ValueError("a DSSD rejection's correction is drawn on the device: no logprobs")
    n = outcome.num_accepted
    emitted = r.draft_ids[:n].tolist() + [outcome.next_token]
    return replace(outcome, logprobs=r.law.token_logprobs(rows[:n + 1], emitted, r.logprobs))


def _check_pair(rows: torch.Tensor, r: ChainRound) -> None:
    if not isinstance(rows, torch.Tensor) or rows.ndim != 2 or rows.shape[0] != r.length + 1:
        shape = tuple(rows.shape) if isinstance(rows, torch.Tensor) else type(rows).__name__
        raise ValueError(f"a round of {r.length} drafts needs logits [{r.length + 1}, V], got {shape}")
    vocab = rows.shape[1]
    if r.length:
        check_token_ids(r.draft_ids, "draft_ids", vocab)
    if r.masks is not None and (r.masks.shape != rows.shape or r.masks.dtype != torch.bool):
        raise ValueError(f"grammar masks {tuple(r.masks.shape)} {r.masks.dtype} for logits {tuple(rows.shape)}")
    if r.q_rows and r.q_rows[0].vocab_size != vocab:
        raise ValueError(f"draft distributions over {r.q_rows[0].vocab_size} tokens, target over {vocab}")


class _Rows:
    """The law on one step's rows (:meth:`TargetLaw.probs` row by row, computed where read)."""

    def __init__(self, law: TargetLaw, rows: torch.Tensor):  # rows: [k, V] logits
        self.mass = law.probs32(rows)                                          # [k, V] float32
        self.total = self.mass.sum(dim=-1, keepdim=True, dtype=torch.float64)  # [k, 1]
        self.vocab = rows.shape[1]

    def at(self, j: torch.Tensor, x: torch.Tensor) -> torch.Tensor:  # [t], [t] -> [t] float64: p_j(x)
        return self.mass[j, x].double() / self.total[j, 0]

    def rows(self, j: list[int]) -> torch.Tensor:  # [e, V] float64, a new tensor
        return self.mass[j].double().div_(self.total[j])

    def race(self, j: int, noise: torch.Tensor) -> int:  # noise: [V] float64
        """``argmin noise / p_j`` for row j alone: the same elementwise operations as on a batch of rows."""
        p = self.mass[j].double().div_(self.total[j])
        return int(first_argmin(torch.div(noise, p, out=p)))


class _GreedyRows:
    """Temperature 0: each row's law is one-hot at its argmax ``a`` (``probs_from_logits``), so p(x) is
    1.0 at ``a`` and 0.0 elsewhere, and every token a row ends with is ``a``: the residual
    ``max(0, p - q)`` is zero but at ``a`` (or zero everywhere, and then p itself), the bonus and
    DSSD's samples are draws of a one-hot p, and the race ``argmin E / p`` with positive noise E is
    ``a``. Only the argmax is computed, row by row on a CPU (no copy into a batch: NumPy's argmax is
    faster than the copy), in one batch elsewhere."""

    def __init__(self, rows: list[torch.Tensor] | torch.Tensor):  # k x [V] logits, or [k, V]
        self.vocab = rows[0].shape[0]
        if rows[0].device.type == "cpu" and rows[0].dtype in (torch.float32, torch.float64):
            self.top_host = [_finite_argmax(row.numpy()) for row in rows]
            self.top = torch.tensor(self.top_host)
        else:
            batch = rows if isinstance(rows, torch.Tensor) else torch.stack(rows)  # [k, V]
            check_logits(batch, 0.0)
            self.top = batch.argmax(dim=-1)  # [k] on the original dtype, as probs_from_logits
            self.top_host = self.top.tolist()

    def at(self, j: torch.Tensor, x: torch.Tensor) -> torch.Tensor:  # [t] float64: 1.0 at the argmax
        return (self.top[j.to(self.top.device)] == x.to(self.top.device)).double().to(x.device)

    def rows(self, j: list[int]) -> torch.Tensor:  # [e, V] float64 one-hot
        out = torch.zeros(len(j), self.vocab, dtype=torch.float64, device=self.top.device)
        return out.scatter_(1, self.top[j].unsqueeze(1), 1.0)


def _finite_argmax(row: np.ndarray) -> int:
    """The first argmax of a row of logits, after check_logits' test in two NumPy passes: the maximum
    is NaN if any value is (NumPy's argmax stops at the first NaN), +inf if any is, the minimum -inf."""
    top = int(row.argmax())
    if not (np.isfinite(row[top]) and np.isfinite(row.min())):
        raise ValueError("logits contain NaN or inf")
    return top


class _Lockstep:
    """The rounds of one law, verified a draft position at a time (module docstring)."""

    row_by_row = True  # a CPU's races row by row (one [V] pass each, no batch copies); _Upfront: batched

    def __init__(self, law: TargetLaw, logits: list[torch.Tensor], rounds: list[ChainRound]):
        self.law, self.logits, self.rounds = law, logits, rounds
        self.device = logits[0].device
        self.lengths = [r.length for r in rounds]
        width = max(self.lengths)
        self.ids = _padded([r.draft_ids for r in rounds], width, torch.int64)              # [B, Lmax] host
        self.q_x = _padded([_or_empty(r.q_of_draft) for r in rounds], width, torch.float64)  # [B, Lmax] host
        uniforms = [_or_empty(r.uniforms) for r in rounds]
        self.u_host = _padded(uniforms, max(u.numel() for u in uniforms), torch.float64)     # [B, Umax] host
        self.u = self.u_host.to(self.device)                                                 # [B, Umax]
        self.outcomes: list[RoundOutcome | None] = [None] * len(rounds)

    def run(self) -> list[RoundOutcome]:
        running = list(range(len(self.rounds)))
        for i in range(max(self.lengths) + 1):
            if not running:
                break
            running = self._step(i, running)
        return self._done(running)

    def _done(self, running: list[int]) -> list[RoundOutcome]:
        assert not running and all(o is not None for o in self.outcomes)
        return self.outcomes  # type: ignore[return-value]

    def _step(self, i: int, running: list[int]) -> list[int]:
        """Row i of every running round: the accept tests, the races, and the ends they reach; returns
        the rounds that go on to row i + 1."""
        rows = [self.logits[b][i] for b in running]  # k x [V]
        law = _GreedyRows(rows) if self.law.temperature == 0 else _Rows(self.law, torch.stack(rows))
        gumbel = [j for j, b in enumerate(running) if self.rounds[b].kind is RoundKind.GUMBEL]
        tested = [j for j, b in enumerate(running)
                  if self.rounds[b].kind is not RoundKind.GUMBEL and i < self.lengths[b]]
        going = set(self._accept_tests(i, running, tested, law))
        going |= set(self._races(i, [(running[j], j) for j in gumbel], law))
        raced = set(gumbel)
        self._ends([(running[j], i, j) for j in range(len(running)) if j not in going and j not in raced], law)
        return [b for j, b in enumerate(running) if j in going]

    def _accept_tests(self, i: int, running: list[int], tested: list[int], law) -> list[int]:
        """``u_i * q_i(x_i) < p_i(x_i)`` (verification._accepts) on the tested rows; the accepted ones."""
        if not tested:
            return []
        b = [running[j] for j in tested]
        x = self.ids[b, i].to(self.device)                                         # [t]
        p_x = law.at(torch.tensor(tested, device=self.device), x)                  # [t] float64
        accept = self.u[b, i] * self.q_x[b, i].to(self.device) < p_x
        return [j for j, ok in zip(tested, accept.tolist()) if ok]

    def _races(self, i: int, gumbel: list[tuple[int, int]], law) -> list[int]:
        """The target's race ``argmin E_i / p_i`` (verification.gumbel_verify) on the gumbel rounds
        (round b, its law row j): a draft equal to it goes on, any other round ends with the race's
        token; the law rows of the rounds that go on."""
        if not gumbel:
            return []
        if isinstance(law, _GreedyRows):
            won = [law.top_host[j] for _, j in gumbel]
        elif self.row_by_row and self.device.type == "cpu":  # no [g, V] float64 copies of noise and law
            won = [law.race(j, _checked_noise(self.rounds[b].token_noise, i, law.vocab)) for b, j in gumbel]
        else:
            noise = torch.stack([_checked_noise(self.rounds[b].token_noise, i, law.vocab)
                                 for b, _ in gumbel]).to(self.device)             # [g, V]
            won = first_argmin(noise / law.rows([j for _, j in gumbel])).tolist()  # [g]
        going = []
        for (b, j), y in zip(gumbel, won):
            if i < self.lengths[b] and int(self.ids[b, i]) == y:
                going.append(j)
            else:
                self.outcomes[b] = RoundOutcome(num_accepted=i, next_token=int(y))
        return going

    def _ends(self, ends: list[tuple[int, int, int]], law) -> None:
        """Chain and DSSD rounds that end, as (round b, position i, law row j): a rejection at
        ``i < L`` or the bonus at ``i == L``."""
        if not ends:
            return
        dssd = [e for e in ends if self.rounds[e[0]].kind is RoundKind.DSSD and e[1] < self.lengths[e[0]]]
        if isinstance(law, _GreedyRows):
            for b, i, j in ends:
                a, m = law.top_host[j], self.rounds[b].dssd_samples
                if (b, i, j) not in dssd:
                    self.outcomes[b] = RoundOutcome(num_accepted=i, next_token=a)
                else:  # m draws of a one-hot p_j, each its argmax with probability 1.0
                    self.outcomes[b] = RoundOutcome(num_accepted=i, next_token=None, reject_samples=(a,) * m,
                                                    reject_sample_probs=(1.0,) * m, reject_p=law.rows([j])[0].cpu())
            return
        chain = [e for e in ends if self.rounds[e[0]].kind is RoundKind.CHAIN and e[1] < self.lengths[e[0]]]
        bonus = [e for e in ends if e[1] == self.lengths[e[0]]]
        self._corrections(chain, law.rows([j for _, _, j in chain]))
        self._dssd_samples(dssd, law.rows([j for _, _, j in dssd]))
        self._bonuses(bonus, law.rows([j for _, _, j in bonus]))

    def _corrections(self, ends: list[tuple[int, int, int]], p: torch.Tensor) -> None:
        """The correction token from ``norm(max(0, p_i - q_i))`` with ``u_{i+1}`` (verification._residual)."""
        if not ends:
            return
        residual = _residual_rows(p, [self.rounds[b].q_rows[i] for b, i, _ in ends])  # [c, V]
        tokens = inverse_cdf_rows(residual, self.u[[b for b, _, _ in ends], [i + 1 for _, i, _ in ends]].unsqueeze(1))
        for (b, i, _), token in zip(ends, tokens[:, 0].tolist()):
            self.outcomes[b] = RoundOutcome(num_accepted=i, next_token=int(token))

    def _dssd_samples(self, ends: list[tuple[int, int, int]], p: torch.Tensor) -> None:
        """DSSD after a rejection at ``i``: ``m`` samples of ``p_i`` with ``u_{i+1..i+m}`` (dssd_edge_verify)."""
        if not ends:
            return
        width = max(self.rounds[b].dssd_samples for b, _, _ in ends)
        last = self.u.shape[1] - 1  # a round reads only its own m columns, which its uniforms hold
        columns = [[min(i + 1 + c, last) for c in range(width)] for _, i, _ in ends]
        samples = inverse_cdf_rows(p, self.u[[[b] for b, _, _ in ends], columns]) if width else None  # [d, m]
        for k, (b, i, _) in enumerate(ends):
            m = self.rounds[b].dssd_samples
            ys = samples[k, :m] if m else torch.empty(0, dtype=torch.int64, device=p.device)
            self.outcomes[b] = RoundOutcome(num_accepted=i, next_token=None,
                                            reject_samples=tuple(ys.tolist()),
                                            reject_sample_probs=tuple(p[k, ys].tolist()),
                                            reject_p=p[k].cpu().clone())

    def _bonuses(self, ends: list[tuple[int, int, int]], p: torch.Tensor) -> None:
        """After ``L = i`` acceptances: the coupled bonus (its own noise), else a draw of ``p_L`` with ``u_L``."""
        plain = [k for k, (b, _, _) in enumerate(ends) if self.rounds[b].bonus_noise is None]
        coupled = [k for k, (b, _, _) in enumerate(ends) if self.rounds[b].bonus_noise is not None]
        u = self.u[[ends[k][0] for k in plain], [ends[k][1] for k in plain]].unsqueeze(1) if plain else None
        tokens = inverse_cdf_rows(p[plain], u)[:, 0].tolist() if plain else []
        tokens += _coupled_bonuses(p[coupled], [self.rounds[ends[k][0]].bonus_noise for k in coupled])
        for k, token in zip(plain + coupled, tokens):
            b, i, _ = ends[k]
            self.outcomes[b] = RoundOutcome(num_accepted=i, next_token=int(token))


class _Upfront(_Lockstep):
    """The same verdicts with the tensor work of a whole batch at once, for a device where each
    operation and each transfer to the host costs more than its arithmetic (a GPU: a kernel launch,
    a synchronisation): the law of every row of every round in one pass, ``p_i(x_i)`` of every draft
    in one transfer, the accept tests on the host (``u_i * q_i(x_i) < p_i(x_i)`` in float64, as on the
    device), then the corrections, DSSD's samples and the bonuses of all rounds together. Gumbel's
    races still run a position at a time (a race's noise is drawn only for positions reached). Rows
    past a round's first rejection are computed too (on a CPU the lockstep path skips them)."""

    row_by_row = False

    def run(self) -> list[RoundOutcome]:
        starts = [0]
        for n in self.lengths:
            starts.append(starts[-1] + n + 1)
        rows = torch.cat(self.logits) if len(self.logits) > 1 else self.logits[0]   # [R, V]
        law = _GreedyRows(rows) if self.law.temperature == 0 else _Rows(self.law, rows)
        chains = [b for b, r in enumerate(self.rounds) if r.kind is not RoundKind.GUMBEL]
        accepted = self._accepted(chains, starts, law)
        self._ends([(b, n, starts[b] + n) for b, n in zip(chains, accepted)], law)
        running = [b for b, r in enumerate(self.rounds) if r.kind is RoundKind.GUMBEL]
        for i in range(max(self.lengths) + 1):
            if not running:
                break
            going = set(self._races(i, [(b, starts[b] + i) for b in running], law))
            running = [b for b in running if starts[b] + i in going]
        return self._done(running)

    def _accepted(self, chains: list[int], starts: list[int], law) -> list[int]:
        """Each chain or DSSD round's accepted drafts: the position of its first failed accept test."""
        where = [(b, i) for b in chains for i in range(self.lengths[b])]
        if not where:
            return []
        b, i = [w[0] for w in where], [w[1] for w in where]
        rows = torch.tensor([starts[c] + k for c, k in where], device=self.device)
        p_x = law.at(rows, self.ids[b, i].to(self.device)).cpu()                  # [D] float64, one transfer
        passed = (self.u_host[b, i] * self.q_x[b, i] < p_x).tolist()
        out, k = [], 0
        for c in chains:
            tests = passed[k:k + self.lengths[c]]
            out.append(tests.index(False) if False in tests else self.lengths[c])
            k += self.lengths[c]
        return out


def _or_empty(x: torch.Tensor | None) -> torch.Tensor:
    return x if x is not None else torch.empty(0)


def _padded(rows: list[torch.Tensor], width: int, dtype: torch.dtype) -> torch.Tensor:  # [B, width]
    out = torch.zeros(len(rows), width, dtype=dtype)
    for b, row in enumerate(rows):
        out[b, :row.numel()] = row
    return out


def _residual_rows(p: torch.Tensor,  # [c, V] float64, overwritten
                   q_rows: list[SparseDist]) -> torch.Tensor:  # [c, V] float64
    """``norm(max(0, p - q))`` row by row, as verification._residual on q densified, in p's memory: off
    q's support ``max(0, p - 0)`` is p itself, so only the support is subtracted. A row whose positive
    part is all zero (p == q up to rounding, so a rejection had probability 0) keeps p."""
    which = torch.cat([torch.full((sd.ids.numel(),), k, dtype=torch.int64) for k, sd in enumerate(q_rows)])
    which, ids = which.to(p.device), torch.cat([sd.ids for sd in q_rows]).to(p.device)
    kept = p[which, ids]                                                       # p on the supports
    p[which, ids] = torch.clamp(kept - torch.cat([sd.probs for sd in q_rows]).to(p.device), min=0.0)
    total = p.sum(dim=-1, keepdim=True)                                        # [c, 1]
    empty = (total <= 0).squeeze(1)
    if bool(empty.any()):  # those rows back to p, divided by 1.0 below: bit for bit p
        p[which, ids] = torch.where(empty[which], kept, p[which, ids])
        total[empty] = 1.0
    return p.div_(total)


def _coupled_bonuses(p: torch.Tensor,  # [c, V] float64
                     noise: list[BonusNoise]) -> list[int]:
    """Row by row what verification._coupled_bonus draws: ``argmax log p + noise`` (distributions.
    sample_token_gumbel), and no noise drawn for a one-hot row, whose only token wins whatever it is."""
    if not noise:
        return []
    tokens = first_argmax(p)                                                   # [c]
    drawn = [k for k, n in enumerate((p > 0).sum(dim=-1).tolist()) if n != 1]
    if drawn:
        rows = [noise[k]() if callable(noise[k]) else noise[k] for k in drawn]
        if any(not isinstance(g, torch.Tensor) or g.shape != (p.shape[1],) for g in rows):
            raise ValueError(f"bonus noise must be tensors of shape ({p.shape[1]},)")
        g = torch.stack(rows).to(p.device, torch.float64)                    # [d, V]
        if bool(torch.isnan(g.sum())):  # NaN propagates into the sum (Gumbel noise is never +inf)
            raise ValueError("bonus noise contains NaN")
        q = p[drawn]
        # log 0 = -inf stays -inf whatever the noise adds (finite, or -inf for a uniform of 0): the
        # masked_fill of sample_token_gumbel would change nothing
        best = first_argmax(torch.log(q) + g)
        ok = q.gather(1, best.unsqueeze(1)).squeeze(1) > 0  # else every kept token drew u = 0 (p ~ 2^-53)
        tokens[drawn] = torch.where(ok, best, first_argmax(q))
    return tokens.tolist()


def _checked_noise(noise: Callable[[int], torch.Tensor] | None, i: int, vocab: int) -> torch.Tensor:
    """noise(i), checked as gumbel_verify checks it: [V] positive float64."""
    assert noise is not None, "a gumbel round carries its noise"
    e = noise(i)
    if not isinstance(e, torch.Tensor) or e.shape != (vocab,) or e.dtype != torch.float64 or not _all_positive(e):
        raise ValueError(f"noise({i}) must be a positive float64 tensor of shape ({vocab},)")
    return e


def _all_positive(e: torch.Tensor) -> bool:
    """Every entry > 0, NaN not: on the CPU one NumPy pass for the minimum (a NaN propagates into it),
    a fifth of what torch's comparison and reduction cost, for every race row a batch verifies."""
    if e.device.type == "cpu" and not e.requires_grad:
        return bool(e.numpy().min() > 0)
    return bool((e > 0).all())
