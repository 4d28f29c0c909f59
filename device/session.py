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

import threading
import time
from dataclasses import replace
from typing import Callable

from specdec.common import settings as S
from specdec.common.modeling import LoadedModel
from specdec.common.logprobs import NO_LOGPROBS, TokenLogprob
from specdec.common.protocol import DraftBlock, DraftSettings, Hello, ResidualReply, Verdict, Welcome
from specdec.common.modes import Mode, RACE_MODES
from specdec.common.stats import SpecStats
from specdec.device import chain, dssd, edge_only, tree_round
from specdec.device import run_ahead as RA
from specdec.device.drafting import Drafting
from specdec.device.parts import SessionParts
from specdec.device.rounds import AheadPlans, RoundDraft, RoundEvent, RoundIO, RoundPlan, round_record, round_settings_json

Listener = Callable[[RoundEvent], None]
# While the edge's advice stays 0, each edge-only round asks for twice the tokens of the one
# before, up to EDGE_ONLY_CHUNK x 2^this (64): a round boundary costs the device a round trip and, at a busy
# batching edge, the forward it misses (an eighth of its tokens at 8 tokens a round).
ADVICE_CHUNK_DOUBLINGS = 3


def measured_up_to_mismatch(q_stats: list, settings: DraftSettings, num_accepted: int) -> list:
    """What a committed round may teach the policy of its measurements per draft step. In a gumbel
    round, a draft past the first mismatch was raced with the noise of a position that the next round
    races with again: what was measured after it would let that round's plan see its random numbers."""
    if settings.mode is Mode.GUMBEL:
        return q_stats[:num_accepted + 1]
    return q_stats


def retry_within(plan: RoundPlan, welcome: Welcome, auto: bool) -> RoundPlan | None:
    """A round retried on an edge that cannot take it as planned (a shorter longest draft, a smaller K
    or fewer DSSD samples, or, for mode auto, not its mode): mode auto (``auto``) chooses again within
    the new edge's limits (None: its candidates now are), a fixed mode drafts it cut to them. Not a
    choice from the round's random numbers: only from what the new edge states."""
    s = plan.settings
    fitted = S.within_limits(s, welcome.max_draft_len, welcome.max_k, welcome.dssd_max_samples)
    if fitted == s and (s.mode is Mode.NONE or welcome.verifies(s.mode)):
        return plan
    return None if auto else replace(plan, settings=fitted)


class DraftSession:
    """Drafts rounds for one generation and applies the edge's verdicts. Blocking (torch).

    Built from parts (device/parts.py: how drafts are drawn, what a round runs with when no policy
    plans it, who watches), which tests and benchmarks swap instead of overriding methods."""

    def __init__(self, drafter: LoadedModel, hello: Hello, *, draft_ahead: bool = False, policy=None,
                 round_log: bool = False, reproducible: bool = False, parts: SessionParts = SessionParts(),
                 run_ahead: bool = False, overdue: RA.OverdueClock | None = None):
        self.hello, self.parts = hello, parts
        # Seeded and sampling (factory.DeviceConfig.reproducible): the edge's load advice must not cut a
        # round whose tokens depend on where rounds end (every mode but the race modes).
        self.fixed_cuts = reproducible and hello.temperature > 0
        self.vocab_size = drafter.vocab_size
        # mode auto (device/auto.py AutoPolicy): plans each round, learns from each RoundEvent; fixed
        # for the session's life (its drafting measures the encoded q's for it)
        self.policy = policy
        self.drafting = Drafting(drafter, hello, parts, policy)
        self.model, self.csqs = self.drafting.model, self.drafting.csqs
        self.edge_hint: int | None = None  # the edge's advised longest draft at its load (last committed verdict)
        self._advised_edge_only = 0       # edge-only rounds in a row committed under an advice of 0
        self.tokens: list[int] = []
        self.prompt_len = 0               # of self.tokens, the prompt's (start)
        self.logprobs: list[TokenLogprob] = []  # of the generated tokens, in order, if the Hello asked
        self.round_id = 0
        self.stats = SpecStats()          # the session's one account of its rounds
        self.listeners: list[Listener] = []  # further consumers of each RoundEvent (device metrics)
        self.pending_correction: int | None = None
        self.draft_ahead_requested = draft_ahead
        # whether rounds with the session's own settings are drafted ahead
        self.draft_ahead_enabled = draft_ahead and chain.can_draft_ahead(hello.draft)
        self.ahead: chain.Ahead | None = None  # the next round, drafted ahead with its plan
        self._next: RoundPlan | None = None    # the next round's plan, when fixed already
        self._in_flight: RoundDraft | None = None  # drafted and sent, its verdict not applied yet
        self._sent_ahead: RoundDraft | None = None  # an edge-only round sent while the one in flight streams
        self.edge_rtt_s: float | None = None  # the network wait of the last edge-only round not sent ahead
        # Rounds say where they start and when the edge may run ahead of them (device/run_ahead.py)
        self.runs_ahead = run_ahead and RA.runs_ahead(hello, self.fixed_cuts, policy is not None)
        # ``overdue``: the device's (its sessions share the link), so that a session's first round is
        # stamped from the rounds before it: unstamped, an outage at its end left the edge idle
        self.overdue = RA.OverdueClock() if overdue is None else RA.OverdueClock(overdue.trips, overdue.turnarounds)
        self.replied_at: float | None = None  # when the last round's last reply arrived (turnaround)
        self.round_log: list[dict] | None = [] if round_log else None  # per-round entries for the JSON
        self.ahead_plans = AheadPlans()  # what was planned ahead of each verdict
        self._t0 = self._round_began = time.perf_counter()

    def start(self, prompt_ids: list[int]) -> None:
        self.tokens = list(prompt_ids)
        self.prompt_len = self.drafting.model.shaping.prompt_len = len(prompt_ids)
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
        plan = self.choose(in_flight=rd.plan)
        return self.ahead_plans.made(rd, plan, chain.can_draft_ahead(plan.settings))

    def choose(self, in_flight: RoundPlan | None = None, remaining: int | None = None) -> RoundPlan:
        """The policy's plan (mode auto) or the planner's, drafting no longer than the edge advised at
        its load (0: an edge-only round, longer the longer the advice stays 0), except where that would
        change a reproducible session's tokens. ``in_flight``: the plan of the round not yet committed
        that this one follows (planned ahead), which mode auto counts among the rounds it has run.
        ``remaining``: the tokens still wanted after it (default: after the committed ones, less one
        for a round in flight)."""
        if remaining is None:
            remaining = self.hello.max_new_tokens - (len(self.tokens) - self.prompt_len) - (in_flight is not None)
        plan = (self.policy.choose(in_flight, max(0, remaining)) if self.policy is not None
                else self.parts.planner.plan(self.hello, self.vocab_size, self.round_id))
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

    def observe_welcome(self, welcome: Welcome) -> None:
        """The edge's limits: mode auto chooses within them (a round beyond one fails the session); its
        load-aware advice for the first round (an edge that gives one)."""
        if self.policy is not None:
            self.policy.observe_welcome(welcome)
        if self._next is not None:
            self._next = retry_within(self._next, welcome, auto=self.policy is not None)
        if welcome.draft_len_hint is not None and self.round_id == 0 and not self.stats.rounds:
            self.edge_hint = welcome.draft_len_hint
        self.overdue.continued = welcome.continues_late and RA.continues(self.hello, self.fixed_cuts, self.policy is not None)
        self.overdue.continued_edge_only = welcome.continues_late_edge_only

    # -- rounds ---------------------------------------------------------------------------------------
    def draft(self, plan: RoundPlan, max_tokens: int) -> RoundDraft:
        """Draft a round with ``plan``: up to ``max_tokens`` draft positions (at least one)."""
        s = plan.settings
        self.csqs.start_round(s)
        if self.policy is not None:
            self.policy.begin(plan)
        if s.tree:
            if self.ahead is not None:
                self.drop_drafted()  # a chain drafted ahead does not make a tree
            rd = tree_round.draft(self, plan, max_tokens)
        else:
            rd = chain.draft(self, plan, max_tokens)
        self._in_flight = rd
        self.parts.observer.sent(rd)
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
        off, ``rd`` ends where a drafted round is expected, nothing remains, or the plan drafts). Also
        after the session's first round: its times hold the prefill (kept out of mode auto's net and
        round-trip samples), a device that knows nothing of the link starts with a round that expects a
        drafted one, and what else it measures a plan made during it lacks as any plan made ahead
        lacks its round in flight's. ``remaining``: the tokens still wanted after ``rd``."""
        if (not self.draft_ahead_requested or remaining < 1 or self._sent_ahead is not None
                or (rd.plan.choice or {}).get("catch_up") or self._next is not None):
            return None
        plan = self.choose(in_flight=rd.plan, remaining=remaining)
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

    def draft_ahead(self, rd: RoundDraft, plan: RoundPlan, max_tokens: int, stop: threading.Event) -> None:
        """In a worker thread while the edge verifies ``rd``: the next round with ``plan`` until ``stop``
        is set (chain.draft_ahead)."""
        chain.draft_ahead(self, rd, plan, max_tokens,
                          stop if self.parts.ahead_stops_at_verdict else threading.Event())

    def block(self, ids: tuple[int, ...], s: DraftSettings, **payload) -> DraftBlock:
        """A round's message: numbered, carrying any pending DSSD correction, and its settings when
        they are not the session's."""
        self.round_id += 1
        block = DraftBlock(round_id=self.round_id, token_ids=ids, correction_token=self.pending_correction,
                           settings=None if s == self.hello.draft else s, **payload)
        self.pending_correction = None
        return block

    def superseded(self, rd: RoundDraft, verdicts: list[Verdict], downlink_bytes: int,
                   go_on: bool = False) -> RoundEvent:
        """``rd`` was superseded by ``verdicts``, tokens the edge generated ahead before it arrived (its
        predecessor's next message was overdue): they are committed as an edge-only round of their own
        that mode auto does not learn from (their time is the outage's), and ``rd`` is forgotten with
        anything drafted after it; or (``go_on``) edge-only ``rd``, its rest already (RA.rest_of_edge_round),
        stays in flight. ValueError for a verdict that is no such token."""
        tokens = [RA.ahead_token(v, rd.block.round_id - 1) for v in verdicts]  # all checked before any is taken
        if not go_on:  # rd starts at the verified end: the drafter keeps what precedes it
            self.drop_drafted()
            self.csqs.abort_round()
            self._next = None
        first = len(self.tokens)
        for token, v in zip(tokens, verdicts):
            _append_edge_token(self, token, v)
        part, totals = RA.ahead_round(rd.block.round_id - 1, first, verdicts)
        record = round_record(part, totals, len(verdicts), RoundIO(0, downlink_bytes), None)
        event = self._commit_event(part, record, self.tokens[first:], None, totals, learn=False)
        self._in_flight = rd if go_on else self._in_flight
        return event

    def take_edge_token(self, rd: RoundDraft, verdict: Verdict) -> int:
        """One streamed token of an edge-only round, committed as it arrives."""
        token = edge_only.take_token(rd, verdict, len(self.tokens))
        _append_edge_token(self, token, verdict)
        if verdict.draft_len_hint is not None:
            self.edge_hint = verdict.draft_len_hint
        return token

    def resolve(self, rd: RoundDraft, verdict: Verdict, reply: ResidualReply | None = None) -> int | None:
        """DSSD's device half: accept one of the edge's samples y ~ p_j (dssd.resolve_rejection), or,
        with a fallback's ``reply``, draw from it (dssd.resolve_fallback; ValueError on a malformed
        one). None: a fallback round trip is needed."""
        if reply is not None:
            return dssd.resolve_fallback(self.hello.seed, self.vocab_size, rd, verdict, reply)
        token = dssd.resolve_rejection(self.hello.seed, rd, verdict)
        if token is None:
            self.parts.observer.fallback(rd, verdict)
        return token

    # -- verdicts: one event per committed round -----------------------------------------------------------
    def apply_verdict(self, rd: RoundDraft, verdict: Verdict, next_token: int, io: RoundIO, *,
                      dssd_correction: bool = False, learn: bool = True) -> RoundEvent:
        """Commit a drafted round: keep the accepted prefix, roll the draft cache back, and publish the
        round's event (mode auto ``learn``s from it unless the edge ran ahead of it: its wait is an outage's)."""
        guess, discarded = None, 0
        if rd.tree is not None:
            t = tree_round.commit(rd, verdict, next_token, len(self.tokens))
            self.model.keep(t.cache)
            self.csqs.on_path(rd.settings, rd.dropped, t.csqs_nodes)
            new = t.new
        else:
            c = chain.commit(rd, verdict, next_token, self.ahead, len(self.tokens))
            if c.guess:  # the next round runs with the plan it was drafted with: its numbers are drawn
                self._next = self.ahead.plan
            else:
                self.ahead = None
                self.model.truncate(min(self.model.cache_len, c.cache_len))
            self.csqs.on_verdict(rd.settings, verdict.num_accepted)
            new, guess, discarded = c.new, c.guess, c.discarded
        self.tokens.extend(new)
        self.logprobs.extend(t.complete(x) for t, x in zip(verdict.logprobs, new))  # one a token, if asked
        rd.q_stats = measured_up_to_mismatch(rd.q_stats, rd.settings, verdict.num_accepted)
        if dssd_correction:
            self.pending_correction = int(next_token)
        record = round_record(rd, verdict, len(new), io, self.csqs.threshold(rd.settings), discarded)
        return self._commit_event(rd, record, new, guess, verdict, learn)

    def end_edge_round(self, rd: RoundDraft, totals: Verdict, io: RoundIO, *, broken: bool = False) -> RoundEvent:
        """An edge-only round whose last token arrived (its tokens are committed already), or whose
        stream ``broken`` after some of its tokens: those are committed and delivered, so they are
        published as a round of their own, and the round stays in flight so that
        :meth:`abort_round` retries it for the tokens it lacks."""
        part = rd
        if broken:
            part = replace(rd, plan=replace(rd.plan, settings=replace(rd.settings, edge_tokens=rd.received)))
            totals = replace(totals, more=False)
        record = round_record(part, totals, part.received, io, None)
        new = self.tokens[len(self.tokens) - part.received:]
        event = self._commit_event(part, record, new, None, totals, learn=not part.continued_after)  # (its wait: an outage)
        if broken:
            self._in_flight = rd
        return event

    def _commit_event(self, rd: RoundDraft, record, new: list[int], guess: bool | None,
                      verdict: Verdict, learn: bool = True) -> RoundEvent:
        """The round's one event, published to the session's account, the policy (if it ``learn``s from
        it), the round log and the listeners. Every verdict may carry the edge's draft-length advice:
        the newest committed counts."""
        self._in_flight = None
        if verdict.draft_len_hint is not None:
            self.edge_hint = verdict.draft_len_hint
        advised = self.edge_hint == 0 and rd.settings.mode is Mode.NONE
        self._advised_edge_only = self._advised_edge_only + 1 if advised else 0
        now = time.perf_counter()
        event = RoundEvent(record=record, plan=rd.plan, new_tokens=tuple(new), q_stats=tuple(rd.q_stats),
                           guess=guess, elapsed_s=now - self._round_began, edge_hint=verdict.draft_len_hint,
                           t=now - self._t0, ahead_steps=rd.ahead_steps, sent_ahead=rd.sent_ahead,
                           ran_ahead=not learn, **self.ahead_plans.commit(rd, record))
        self._round_began = now
        self.stats.observe(event.record)
        if self.policy is not None:
            (self.policy.observe if learn else self.policy.skip)(event)
        if self.round_log is not None:
            self.round_log.append(_log_entry(event, self.edge_hint))
        for listener in self.listeners:
            listener(event)
        return event

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
            plan = edge_only.retry_plan(rd) if rd.settings.mode is Mode.NONE else replace(rd.plan, retry=True)
            self._next = None if plan is None else self.parts.planner.retry(plan)
        self._round_began = time.perf_counter()

    def drop_drafted(self) -> None:
        """Forget what was drafted past the verified tokens (a round drafted ahead too, and what was
        planned ahead), keeping the cache strictly behind them: the next forward needs an input."""
        self.ahead, self.ahead_plans = None, AheadPlans()
        self.model.truncate(min(self.model.cache_len, len(self.tokens) - 1))


def _log_entry(event: RoundEvent, edge_hint: int | None) -> dict:
    """A committed round's entry in the session's round log (the JSON output's ``rounds``): with the
    plan made for the round after it while it was verified, if one was (whether it was drafted ahead)."""
    entry = {"t": event.t, **round_settings_json(event.settings), **event.record.to_json(),
             "edge_hint": edge_hint, "sent_ahead": event.sent_ahead, "ran_ahead": event.ran_ahead,
             "planned_ahead": event.planned_ahead, "declined_ahead": event.declined_ahead}
    if event.plan.choice is not None:
        entry["auto"] = dict(event.plan.choice)
    return entry


def _append_edge_token(session: DraftSession, token: int, verdict: Verdict) -> None:
    """A token the edge generated (an edge-only round's, or ahead) appended to ``session``, with its
    log-probabilities where the Hello asked, and shown to the session's parts."""
    if verdict.logprobs and session.hello.temperature > 0:
        # before the token: the shadow's thread reads a token's p once it sees the token
        session.drafting.edge_logp[len(session.tokens)] = verdict.logprobs[0].logprob
    session.tokens.append(token)
    if session.hello.logprobs != NO_LOGPROBS:  # (a round may ask for them for the shadow alone)
        session.logprobs.extend(t.complete(token) for t in verdict.logprobs)
    session.parts.observer.edge_token(token)
