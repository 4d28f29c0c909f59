"""Chain rounds on the device (every mode but trees and edge-only rounds): drafting position by
position, drafting the next round ahead, and applying the verdict.

Drafting ahead: while the edge verifies round r, the device drafts round r + 1 on the guess that all
of r is accepted and what the bonus token is (drafting.Drafting.guess_bonus). Round r + 1's plan is fixed
before that (from committed rounds only, :meth:`DraftSession.plan_ahead`), and the round drafted
ahead is bit for bit the round that would be drafted after the verdict with that plan (same context,
same per-round stream, same forward calls). A right guess keeps the round and its plan; a wrong one
drops both unsent and unseen: nothing drafted ahead reaches the policy, so no choice is a function
of the numbers it then uses.
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from specdec.device.budget import MIN_DRAFT_LEN, fits_budget
from specdec.common.codecs import dssd_theoretical_bits
from specdec.common.idpack import id_bits
from specdec.common.protocol import DraftSettings, Verdict
from specdec.common.modes import Mode
from specdec.common.streams import Purpose, stream
from specdec.device import dssd
from specdec.device.draft_model import DraftStep
from specdec.device.drafting import RoundHost
from specdec.device.rounds import RoundDraft, RoundPlan

# Modes whose chain rounds carry no state but the cache and the tokens: their rounds can be drafted
# ahead (C-SQS updates its threshold while drafting, trees and bit budgets shape the round: those
# draft after each verdict). DSSD too: a round drafted ahead guesses a full accept, where DSSD needs
# nothing of the device but the bonus, drawn coupled as in the other chains; and gumbel, whose bonus
# is the race of its position like every token it emits.
DRAFT_AHEAD_MODES = (Mode.DENSE, Mode.TSLT, Mode.KSQS, Mode.DSSD, Mode.GUMBEL)


def can_draft_ahead(s: DraftSettings) -> bool:
    """Whether rounds with these settings may be drafted ahead. Such rounds also feed the last draft
    and the bonus one token per forward, as drafting ahead must, whether drafted ahead or not."""
    return not s.tree and s.mode in DRAFT_AHEAD_MODES and not s.bit_budget


def chain_limit(s: DraftSettings, max_tokens: int) -> int:
    """Positions a chain round may draft: L, fewer near the end, at least one."""
    return max(MIN_DRAFT_LEN, min(s.draft_len, max_tokens))


@dataclass
class ChainRound:
    """A chain round being drafted: its steps so far and the stream it draws from."""
    start: int                          # sequence position of the round's first draft token
    settings: DraftSettings
    generator: torch.Generator          # the round's own stream (streams.py: DRAFT, start)
    steps: list[DraftStep] = field(default_factory=list)
    q_stats: list[Any] = field(default_factory=list)  # the policy's measurement per step (None: not measured)
    bits: int = 0                       # theoretical uplink bits so far
    t_draft: float = 0.0                # drafter forwards + sampling
    t_encode: float = 0.0               # codec encode + decode
    forwards: int = 0                   # drafter forwards in t_draft (one per token, plus feeding the
                                        # last draft and the bonus one at a time after a full accept)
    forward_s: list[float] = field(default_factory=list)  # seconds of each forward that fed one token
    drafted_ahead: bool = False         # its drafting began while the edge verified the last round

    @property
    def ids(self) -> list[int]:
        return [s.token for s in self.steps]

    def fits(self, bits: int) -> bool:
        """Whether one more position of ``bits`` stays within the bit budget B (SQS section 4)."""
        budget = self.settings.bit_budget
        return not budget or len(self.steps) < MIN_DRAFT_LEN or fits_budget(self.bits, bits, budget)


@dataclass
class Ahead:
    """The next round, drafted while the edge verifies the current one, on the guess that every draft
    is accepted and that the bonus token is ``guess``."""
    plan: RoundPlan
    guess: int
    round: ChainRound


# -- drafting -------------------------------------------------------------------------------------------
def draft(session: RoundHost, plan: RoundPlan, max_tokens: int) -> RoundDraft:
    """Draft up to ``min(L, max_tokens)`` tokens (at least one) with ``plan``, continuing the round
    drafted ahead with this very plan if the guess came true."""
    s = plan.settings
    limit = chain_limit(s, max_tokens)
    part = _take_ahead(session, plan, limit) or new_round(session, len(session.tokens), s)
    ahead_steps = len(part.steps) if part.drafted_ahead else 0
    while len(part.steps) < limit and draft_step(session, part, session.tokens):
        pass
    return _round_draft(session, plan, part, ahead_steps)


def new_round(session: RoundHost, start: int, s: DraftSettings) -> ChainRound:
    return ChainRound(start, s, stream(session.drafting.hello.seed, Purpose.DRAFT, start))


def draft_step(session: RoundHost, part: ChainRound, base: list[int]) -> bool:
    """Sample and encode one more draft token after ``base + part.ids``; False if the bit budget
    says the round ends before it."""
    d = session.drafting
    t0, n0, c0 = time.perf_counter(), d.model.forwards, d.model.cache_len
    q = d.model.q_after(base + part.ids, one_token_per_forward=can_draft_ahead(part.settings))
    t1 = time.perf_counter()
    _count_forwards(part, d.model, t1 - t0, n0, c0)
    encoded = d.encode(q, part.settings)
    step = d.sample(encoded, part.settings, part.generator, part.start, len(part.steps))
    measured = d.measure(q, step.encoded, part.settings)
    t2 = time.perf_counter()
    part.t_draft += t1 - t0
    part.t_encode += t2 - t1
    if not part.fits(step.encoded.theoretical_bits):
        return False  # this position would overflow the round's bit budget B (SQS sec. 4)
    d.parts.observer.step(t2 - t0)
    d.csqs.observe(part.settings, step.encoded.dropped_mass)
    part.steps.append(step)
    part.q_stats.append(measured)
    part.bits += step.encoded.theoretical_bits
    return True


def _count_forwards(part: ChainRound, model, seconds: float, forwards_before: int, cache_before: int) -> None:
    """The forwards a step took, and their seconds where each fed one token: those are the drafter's
    cost per draft, sampled a forward at a time (a forward that catches the drafter up on many tokens
    costs more, and says nothing of it), so that a drafter that turned slower shows within a round."""
    n = model.forwards - forwards_before
    part.forwards += n
    if n and model.cache_len - cache_before == n:
        part.forward_s.extend([seconds / n] * n)


def _round_draft(session: RoundHost, plan: RoundPlan, part: ChainRound, ahead_steps: int) -> RoundDraft:
    s, ids = plan.settings, part.ids
    q_rows = [st.encoded.q_hat for st in part.steps]
    packed = 0
    if s.mode is Mode.DSSD:
        payloads, scalars = (), dssd.draft_scalars(q_rows, ids)
        bits = dssd_theoretical_bits(len(ids), session.drafting.vocab_size)
    elif s.mode is Mode.GUMBEL:  # the ids alone, each at ceil(log2 V) bits
        payloads, scalars, bits, packed = (), b"", part.bits, id_bits(session.drafting.vocab_size)
    else:
        payloads, scalars, bits = tuple(st.encoded.payload for st in part.steps), b"", part.bits
    block = session.block(tuple(ids), s, distributions=payloads, dssd_scalars=scalars, id_bits=packed)
    return RoundDraft(block=block, plan=plan, q_rows=q_rows, theoretical_bits=bits,
                      support_sizes=[st.encoded.support_size for st in part.steps],
                      draft_seconds=part.t_draft, encode_seconds=part.t_encode, start=part.start,
                      drafted_ahead=part.drafted_ahead, ahead_steps=ahead_steps, draft_forwards=part.forwards,
                      forward_s=tuple(part.forward_s), q_stats=list(part.q_stats))


# -- drafting ahead: the next round while the edge verifies this one ----------------------------------
def draft_ahead(session: RoundHost, rd: RoundDraft, plan: RoundPlan, max_tokens: int,
                stop: threading.Event) -> None:
    """Called (in a worker thread) once ``rd`` is sent: guess that all of it is accepted and what the
    bonus token is, and draft the round after it with ``plan`` from there until ``stop`` is set (when
    the verdict arrives) or the round is full. ``max_tokens``: what :func:`draft` will be given if the
    guess is right."""
    if stop.is_set():
        return
    s = plan.settings
    seq = session.tokens + list(rd.block.token_ids)
    part = new_round(session, len(seq) + 1, s)
    part.drafted_ahead = True
    model = session.drafting.model
    t0, n0, c0 = time.perf_counter(), model.forwards, model.cache_len
    logits = model.feed(seq)   # feeds the last draft token
    dt = time.perf_counter() - t0
    part.t_draft += dt
    _count_forwards(part, model, dt, n0, c0)
    guess = session.drafting.guess_bonus(logits, rd, len(seq))
    session.ahead = Ahead(plan=plan, guess=guess, round=part)
    base = seq + [guess]
    limit = chain_limit(s, max_tokens)
    while len(part.steps) < limit and not stop.is_set() and draft_step(session, part, base):
        pass


def _take_ahead(session: RoundHost, plan: RoundPlan, limit: int) -> ChainRound | None:
    """The round drafted ahead with ``plan``, if :func:`commit` kept it, cut to ``limit`` steps (the
    tokens the session still wants: a function of the verified sequence only)."""
    ahead, session.ahead = session.ahead, None
    if ahead is None:
        return None
    part = ahead.round
    if ahead.plan is not plan or part.start != len(session.tokens):
        session.drop_drafted()
        return None
    if len(part.steps) > limit:
        # the cache as a round of `limit` steps leaves it: every draft but the last fed
        kept = limit / len(part.steps)
        part.t_draft, part.t_encode = part.t_draft * kept, part.t_encode * kept
        dropped = len(part.steps) - limit  # one forward per dropped step
        part.forwards -= dropped
        part.forward_s = part.forward_s[:max(0, len(part.forward_s) - dropped)]
        part.steps, part.q_stats = part.steps[:limit], part.q_stats[:limit]
        part.bits = sum(step.encoded.theoretical_bits for step in part.steps)
        model = session.drafting.model
        model.truncate(min(model.cache_len, part.start + limit - 1))
    return part


# -- the verdict ------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ChainCommit:
    """What a chain round's verdict decides; the session applies it."""
    new: list[int]              # the accepted drafts and the next token
    # the round drafted ahead guessed right (None: none drafted, or not all accepted); if so it runs
    # next, with its plan (the cache holds its context)
    guess: bool | None
    discarded: int              # draft tokens drafted ahead and dropped
    cache_len: int              # else the draft cache keeps at most this many entries (the verified prefix)


def commit(rd: RoundDraft, verdict: Verdict, next_token: int, ahead: Ahead | None, verified: int) -> ChainCommit:
    """Keep the accepted prefix of ``rd`` after ``verified`` tokens; ``ahead``: the round drafted
    ahead of the verdict, kept if its guess (all accepted, and the bonus token) came true."""
    n = verdict.num_accepted
    ids = list(rd.block.token_ids)
    if not 0 <= n <= len(ids) or verdict.round_id != rd.block.round_id:
        raise ValueError(f"verdict does not match round {rd.block.round_id}")
    guess = None if ahead is None or n < len(ids) else int(next_token) == ahead.guess
    discarded = len(ahead.round.steps) if ahead is not None and not guess else 0
    return ChainCommit(ids[:n] + [int(next_token)], guess, discarded, verified + n)
