"""One generation on the device: plans its rounds, drafts each by its kind, applies the verdicts.

No grpc here: the round loop is :mod:`specdec.device.engine` and the stream
:mod:`specdec.device.client`. Round kinds, each in its own module that reads top to bottom: chain
rounds and drafting ahead (:mod:`.chain`, with DSSD's device half in :mod:`.dssd`), token trees
(:mod:`.tree_round`), edge-only rounds (:mod:`.edge_only`). The model and its cache:
:mod:`.draft_model`; the types a round goes through: :mod:`.rounds`.

Lossless rules, kept here:
  * each draft token is sampled from exactly the distribution the edge verifies against (the
    decoded packet: :func:`~specdec.device.draft_model.encode_q`);
  * every round of every mode draws from its own streams keyed by where it starts (common/streams.py);
  * a round's settings (its :class:`~specdec.device.rounds.RoundPlan`) are fixed before any random
    number of its positions is drawn or looked at: a plan comes from committed rounds only, before
    the round is drafted (also before it is drafted ahead), and a round retried after a broken
    stream repeats its plan. A policy learns only from :class:`~specdec.device.rounds.RoundEvent`s,
    produced once per round when its verdict is applied: never from work drafted ahead on a guess,
    never from a verdict of a round it is about to retry.
"""
from __future__ import annotations

import time
from dataclasses import replace
from typing import Any, Callable

import torch

from specdec.common import settings as S
from specdec.common import verification as V
from specdec.common.codecs import CodecConfig
from specdec.device.conformal import SessionThreshold
from specdec.common.distributions import race_token_unchecked
from specdec.common.modeling import LoadedModel
from specdec.common.protocol import DraftBlock, DraftSettings, Hello, ResidualReply, Verdict, Welcome
from specdec.common.modes import Mode, RACE_MODES
from specdec.common.stats import SpecStats
from specdec.common.tree import TreeSpec
from specdec.device import chain, dssd, edge_only, tree_round
from specdec.device.draft_model import DraftModel, DraftStep, EncodedQ, encode_q, gumbel_q, sample_step
from specdec.device.rounds import RoundDraft, RoundEvent, RoundIO, RoundPlan, round_record, round_settings_json

Listener = Callable[[RoundEvent], None]
# While the edge's advice stays 0, each edge-only round asks for twice the tokens of the one
# before, up to EDGE_ONLY_CHUNK x 2^this (64): a round boundary costs the device a round trip and, at a busy
# batching edge, the forward it misses (an eighth of its tokens at 8 tokens a round).
ADVICE_CHUNK_DOUBLINGS = 3
# Tokens fed to the drafter at once while an edge-only round streams: a forward over a few tokens costs
# about one over a single token, and the tokens arrive one at a time.
CATCH_UP_MIN = 8


def measured_up_to_mismatch(q_stats: list, settings: DraftSettings, num_accepted: int) -> list:
    """What a committed round may teach the policy of its measurements per draft step. In a gumbel
    round, a draft past the first mismatch was raced with the noise of a position that the next round
    races with again: what was measured after it would let that round's plan see its random numbers."""
    if settings.mode is Mode.GUMBEL:
        return q_stats[:num_accepted + 1]
    return q_stats


class DraftSession:
    """Drafts rounds for one generation and applies the edge's verdicts. Blocking (torch)."""

    def __init__(self, drafter: LoadedModel, hello: Hello, *, draft_ahead: bool = False, policy=None,
                 round_log: bool = False, reproducible: bool = False):
        self.hello = hello
        # Seeded and sampling (factory.DeviceConfig.reproducible): the edge's load advice must not cut a
        # round whose tokens depend on where rounds end (every mode but the race modes).
        self.fixed_cuts = reproducible and hello.temperature > 0
        self.vocab_size = drafter.vocab_size
        self.model = DraftModel(drafter, hello.temperature)
        self.edge_hint: int | None = None  # the edge's advised longest draft at its load (last committed verdict)
        self._advised_edge_only = 0       # edge-only rounds in a row committed under an advice of 0
        self.csqs = SessionThreshold()  # C-SQS's threshold across rounds (SQS Alg. 1)
        self.tokens: list[int] = []
        self.round_id = 0
        self.stats = SpecStats()          # the session's one account of its rounds
        self.listeners: list[Listener] = []  # further consumers of each RoundEvent (device metrics)
        self.pending_correction: int | None = None
        self.draft_ahead_requested = draft_ahead
        self.ahead: chain.Ahead | None = None  # the next round, drafted ahead with its plan
        self._next: RoundPlan | None = None    # the next round's plan, when fixed already
        self._in_flight: RoundDraft | None = None  # drafted and sent, its verdict not applied yet
        self._sent_ahead: RoundDraft | None = None  # an edge-only round sent while the one in flight streams
        self.edge_rtt_s: float | None = None  # the network wait of the last edge-only round not sent ahead
        self._codecs: dict[DraftSettings, CodecConfig | None] = {}
        self._specs: dict[tuple[int, ...], TreeSpec] = {}
        # mode auto (device/auto.py AutoPolicy): plans each round, learns from each RoundEvent
        self.policy = policy
        self.round_log: list[dict] | None = [] if round_log else None  # per-round entries for the JSON
        self._t0 = self._round_began = time.perf_counter()

    @property
    def draft_ahead_enabled(self) -> bool:
        """Whether rounds with the session's own settings are drafted ahead."""
        return self.draft_ahead_requested and chain.can_draft_ahead(self.hello.draft)

    def start(self, prompt_ids: list[int]) -> None:
        self.tokens = list(prompt_ids)
        self._t0 = self._round_began = time.perf_counter()

    # -- plans --------------------------------------------------------------------------------------------
    def plan(self) -> RoundPlan:
        """The next round's plan: the one fixed already (a round to retry, or drafted ahead on a guess
        that came true), else a new one from the rounds committed so far."""
        plan, self._next = self._next, None
        return plan if plan is not None else self.choose()

    def plan_ahead(self, rd: RoundDraft) -> RoundPlan | None:
        """The plan of the round after ``rd``, chosen now (from the rounds committed before ``rd``) so
        that the round can be drafted while the edge verifies ``rd``; None where it cannot be drafted
        ahead (then it is planned after the verdict)."""
        if not self.draft_ahead_requested or self._next is not None or not chain.can_draft_ahead(rd.settings):
            return None
        plan = self.choose()
        return plan if chain.can_draft_ahead(plan.settings) else None

    def choose(self) -> RoundPlan:
        """The policy's plan (mode auto) or the session's settings, drafting no longer than the edge
        advised at its load (0: an edge-only round, longer the longer the advice stays 0), except where
        that would change a reproducible session's tokens."""
        plan = self.policy.choose() if self.policy is not None else RoundPlan(self.hello.draft)
        if self.fixed_cuts and plan.settings.mode not in RACE_MODES:
            return plan
        chunk = S.EDGE_ONLY_CHUNK << min(self._advised_edge_only, ADVICE_CHUNK_DOUBLINGS)
        if self.policy is not None and self.edge_hint == 0:
            # mode auto prices a round's boundary, so its edge-only rounds under the advice are no
            # shorter than its model's (nor its own short ones: the advice rules drafting out anyway)
            chunk = max(chunk, plan.edge_chunk)
            if plan.settings.mode is Mode.NONE:
                plan = replace(plan, settings=replace(plan.settings, edge_tokens=max(plan.settings.edge_tokens, chunk)))
        return replace(plan, settings=S.within_draft_len(plan.settings, self.edge_hint, chunk))

    def fix_next(self, plan: RoundPlan) -> None:
        """The next round runs with ``plan``: its random numbers may already have been drawn."""
        self._next = plan

    def observe_welcome(self, welcome: Welcome) -> None:
        """The edge's limits: mode auto chooses within them (a round beyond one fails the session); its
        load-aware advice for the first round (an edge that gives one)."""
        if self.policy is not None:
            self.policy.observe_welcome(welcome)
        if self._next is not None:
            self._next = self._retry_within(self._next, welcome)
        if welcome.draft_len_hint is not None and self.round_id == 0 and not self.stats.rounds:
            self.edge_hint = welcome.draft_len_hint

    def _retry_within(self, plan: RoundPlan, welcome: Welcome) -> RoundPlan | None:
        """A round retried on an edge that cannot take it as planned (a shorter longest draft, a
        smaller K or fewer DSSD samples, or, for mode auto, not its mode): mode auto chooses again
        within the new edge's limits (its candidates now are), a fixed mode drafts it cut to them.
        Not a choice from the round's random numbers: only from what the new edge states."""
        s = plan.settings
        fitted = S.within_limits(s, welcome.max_draft_len, welcome.max_k, welcome.dssd_max_samples)
        if fitted == s and (s.mode is Mode.NONE or welcome.verifies(s.mode)):
            return plan
        if self.policy is not None:
            return None
        return replace(plan, settings=fitted)

    # -- per-position hooks (tests and benchmarks override them to log or to break things) ----------
    def encode(self, q: torch.Tensor, settings: DraftSettings) -> EncodedQ:
        if settings.mode is Mode.GUMBEL:
            return gumbel_q(q, self.hello, self.vocab_size)
        return encode_q(q, self._codec(settings), self.csqs.threshold(settings))

    def sample(self, encoded: EncodedQ, generator: torch.Generator) -> DraftStep:
        return sample_step(encoded, generator)

    def sample_gumbel(self, encoded: EncodedQ, start: int, offset: int) -> DraftStep:
        """A gumbel round's draft at sequence index ``start + offset``: q raced with the position's noise,
        the draw the edge makes on p with the same noise."""
        return DraftStep(race_token_unchecked(encoded.q_hat, self.token_noise(start, offset)), encoded)

    def token_noise(self, start: int, offset: int) -> torch.Tensor:  # [V] float64
        """The noise of sequence index ``start + offset`` (a round starting at ``start``): keyed by the
        position alone, as the edge's (VerifierSession.token_noise). At T = 0 q is one-hot: none drawn."""
        if self.hello.temperature == 0:
            return torch.ones(self.vocab_size, dtype=torch.float64)
        return V.token_noise(self.hello.seed, start + offset, self.vocab_size)

    def guess_bonus(self, logits: torch.Tensor, rd: RoundDraft, position: int) -> int:
        """The edge's likely bonus token after ``rd`` (at sequence index ``position``): in gumbel
        rounds the race of the drafter's q with the position's noise, as every gumbel draft; in the
        other chains the coupled bonus's guess (chain.guess_bonus)."""
        if rd.settings.mode is Mode.GUMBEL:
            encoded = gumbel_q(self.model.probs(logits), self.hello, self.vocab_size)
            return self.sample_gumbel(encoded, rd.start, position - rd.start).token
        return chain.guess_bonus(logits, position, self.hello.temperature, self.hello.seed, rd.settings.coupled,
                                 self.vocab_size)

    def draft_step(self, part: chain.ChainRound, base: list[int]) -> bool:
        """One more position of a chain round after ``base + part.ids`` (chain.draft_step)."""
        return chain.draft_step(self, part, base)

    def measure(self, q: torch.Tensor, encoded: EncodedQ, settings: DraftSettings) -> Any:
        """The policy's measurement of one encoded q, kept with its round and handed to the policy in
        the round's event (never before its verdict)."""
        return self.policy.measure_q(q, encoded.q_hat, settings) if self.policy is not None else None

    # -- rounds ---------------------------------------------------------------------------------------
    def draft(self, plan: RoundPlan, max_tokens: int) -> RoundDraft:
        """Draft a round with ``plan``: up to ``max_tokens`` draft positions (at least one)."""
        s = plan.settings
        self.csqs.start_round(s)
        if self.policy is not None:
            self.policy.begin(plan)
        if s.tree:
            self.drop_ahead()  # a chain drafted ahead does not make a tree
            rd = tree_round.draft(self, plan, max_tokens)
        else:
            rd = chain.draft(self, plan, max_tokens)
        self._in_flight = rd
        return rd

    def edge_round(self, plan: RoundPlan, remaining: int) -> RoundDraft:
        """An edge-only round (mode none) asking for up to ``remaining`` tokens."""
        if self.policy is not None:
            self.policy.begin(plan)
        rd = edge_only.draft(self, plan, remaining)
        self._in_flight = rd
        return rd

    def send_ahead(self, rd: RoundDraft, remaining: int) -> RoundDraft | None:
        """While edge-only round ``rd`` streams: the round after it if that is edge-only too (planned
        now, from the rounds committed before ``rd``), to be sent at once so that the edge goes on
        without waiting a round trip; None where the next round is not sent ahead (drafting ahead is
        off, ``rd`` ends where a drafted round is expected, nothing remains, the plan drafts, or ``rd``
        is the session's first round: the plan after it should see what it measured, the edge's time
        per token and the link). ``remaining``: the tokens still wanted after ``rd``."""
        if (not self.draft_ahead_requested or remaining < 1 or self._sent_ahead is not None
                or (rd.plan.choice or {}).get("catch_up") or self._next is not None or not self.stats.rounds):
            return None
        plan = self.choose()
        if plan.settings.mode is not Mode.NONE:
            return None  # planned again after rd's last token, from what rd taught
        self._sent_ahead = edge_only.draft_after(self, rd, plan, remaining)
        return self._sent_ahead

    def take_sent_ahead(self) -> RoundDraft | None:
        """The round sent ahead, as the round in flight now (its plan begins)."""
        rd, self._sent_ahead = self._sent_ahead, None
        if rd is not None:
            if self.policy is not None:
                self.policy.begin(rd.plan)
            self._in_flight = rd
        return rd

    def draft_ahead(self, rd: RoundDraft, plan: RoundPlan, max_tokens: int, stop) -> None:
        """In a worker thread while the edge verifies ``rd``: the next round with ``plan`` (chain.draft_ahead)."""
        chain.draft_ahead(self, rd, plan, max_tokens, stop)

    def block(self, ids: tuple[int, ...], s: DraftSettings, **payload) -> DraftBlock:
        """A round's message: numbered, carrying any pending DSSD correction, and its settings when
        they are not the session's."""
        self.round_id += 1
        block = DraftBlock(round_id=self.round_id, token_ids=ids, correction_token=self.pending_correction,
                           settings=None if s == self.hello.draft else s, **payload)
        self.pending_correction = None
        return block

    def catch_up(self, stop, arrived) -> None:
        """In a worker thread during an edge-only round: feed the drafter the verified tokens it has not
        seen, CATCH_UP_MIN or more at a time (all but the last: the next forward needs an input), so the
        next drafted round need not. Deterministic: no random number is drawn."""
        while not stop.is_set():
            target = len(self.tokens) - 1
            if target - self.model.cache_len >= CATCH_UP_MIN:
                self.model.feed(self.tokens[:target])
                continue
            arrived.wait()
            arrived.clear()

    def take_edge_token(self, rd: RoundDraft, verdict: Verdict) -> int:
        """One streamed token of an edge-only round, committed as it arrives."""
        token = edge_only.take_token(self, rd, verdict)
        self._observe_hint(verdict)
        return token

    # -- DSSD's device half ------------------------------------------------------------------------------
    def resolve_dssd(self, rd: RoundDraft, verdict: Verdict) -> int | None:
        """Accept one of the edge's samples y ~ p_j, or None (a fallback trip is needed)."""
        return dssd.resolve_rejection(self.hello.seed, rd, verdict)

    def resolve_residual(self, rd: RoundDraft, verdict: Verdict, reply: ResidualReply) -> int | None:
        """A fallback's reply (dssd.resolve_fallback); ValueError on a malformed one."""
        return dssd.resolve_fallback(self.hello.seed, self.vocab_size, rd, verdict, reply)

    # -- verdicts: one event per committed round -----------------------------------------------------------
    def apply_verdict(self, rd: RoundDraft, verdict: Verdict, next_token: int, io: RoundIO, *,
                      dssd_correction: bool = False) -> RoundEvent:
        """Commit a drafted round: keep the accepted prefix, roll the draft cache back, and publish the
        round's event."""
        guess, discarded = None, 0
        if rd.tree is not None:
            new = tree_round.commit(self, rd, verdict, next_token)
        else:
            new, guess, discarded = chain.commit(self, rd, verdict, next_token)
        rd.q_stats = measured_up_to_mismatch(rd.q_stats, rd.settings, verdict.num_accepted)
        if dssd_correction:
            self.pending_correction = int(next_token)
        record = round_record(rd, verdict, len(new), io, self.csqs.threshold(rd.settings), discarded)
        return self._commit_event(rd, record, new, guess, verdict)

    def finish_edge_round(self, rd: RoundDraft, totals: Verdict, io: RoundIO) -> RoundEvent:
        """An edge-only round whose last token arrived (its tokens are committed already)."""
        record = round_record(rd, totals, rd.received, io, None)
        return self._commit_event(rd, record, self.tokens[len(self.tokens) - rd.received:], None, totals)

    def break_edge_round(self, rd: RoundDraft, totals: Verdict, io: RoundIO) -> RoundEvent:
        """An edge-only round whose stream broke after some of its tokens: those are committed and
        delivered, so they are published as a round of their own; the round stays in flight so that
        :meth:`abort_round` retries it for the tokens it lacks."""
        s = replace(rd.settings, edge_tokens=rd.received)
        part = replace(rd, plan=replace(rd.plan, settings=s))
        event = self.finish_edge_round(part, replace(totals, more=False), io)
        self._in_flight = rd
        return event

    def _commit_event(self, rd: RoundDraft, record, new: list[int], guess: bool | None,
                      verdict: Verdict) -> RoundEvent:
        self._in_flight = None
        self._observe_hint(verdict)
        advised = self.edge_hint == 0 and rd.settings.mode is Mode.NONE
        self._advised_edge_only = self._advised_edge_only + 1 if advised else 0
        now = time.perf_counter()
        event = RoundEvent(record=record, plan=rd.plan, new_tokens=tuple(new), q_stats=tuple(rd.q_stats),
                           guess=guess, elapsed_s=now - self._round_began, edge_hint=verdict.draft_len_hint,
                           t=now - self._t0, ahead_steps=rd.ahead_steps, sent_ahead=rd.sent_ahead)
        self._round_began = now
        self._publish(event)
        return event

    def _publish(self, event: RoundEvent) -> None:
        self.stats.observe(event.record)
        if self.policy is not None:
            self.policy.observe(event)
        if self.round_log is not None:
            entry = {"t": event.t, **round_settings_json(event.settings), **event.record.to_json(),
                     "edge_hint": self.edge_hint, "sent_ahead": event.sent_ahead}
            if event.plan.choice is not None:
                entry["auto"] = dict(event.plan.choice)
            self.round_log.append(entry)
        for listener in self.listeners:
            listener(event)

    def _observe_hint(self, verdict: Verdict) -> None:
        """Every verdict may carry the edge's draft-length advice; the newest committed counts."""
        if verdict.draft_len_hint is not None:
            self.edge_hint = verdict.draft_len_hint

    # -- faults ----------------------------------------------------------------------------------------------
    def abort_round(self) -> None:
        """The stream broke before the verdict was applied: drop drafted state, keep the verified prefix,
        and retry the round in flight with its plan (an edge-only round: for the tokens it lacks).

        The next stream re-sends the whole verified prefix (which already holds any DSSD correction)
        and numbers its rounds from 1 again."""
        self.drop_drafted()
        self.csqs.abort_round()
        self.pending_correction = None
        self.round_id = 0
        self._sent_ahead = None  # a retry of the round in flight comes first; the next is planned after it
        rd, self._in_flight = self._in_flight, None
        if rd is not None:
            self._next = (edge_only.retry_plan(rd) if rd.settings.mode is Mode.NONE
                          else replace(rd.plan, retry=True))
        self._round_began = time.perf_counter()

    def drop_ahead(self) -> None:
        """Forget a round drafted ahead (its cache entries too)."""
        if self.ahead is not None:
            self.drop_drafted()

    def drop_drafted(self) -> None:
        """Keep the cache strictly behind the verified tokens: the next forward needs an input."""
        self.ahead = None
        self.model.truncate(min(self.model.cache_len, len(self.tokens) - 1))

    # -- per-settings state ------------------------------------------------------------------------------
    def tree_spec(self, config: tuple[int, ...]) -> TreeSpec:
        if config not in self._specs:
            self._specs[config] = TreeSpec.from_config(config)
        return self._specs[config]

    def _codec(self, s: DraftSettings) -> CodecConfig | None:
        if s not in self._codecs:
            self._codecs[s] = s.codec(self.vocab_size)
        return self._codecs[s]
