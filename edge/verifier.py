"""The edge's per-session verifier: target KV cache, verification of each draft, rollback.

No grpc here: the servicer converts messages to :mod:`specdec.common.protocol` dataclasses and calls
:class:`VerifierSession` off the event loop. The accept/reject math is in
:mod:`specdec.common.verification`; this module only runs the target and keeps state.

State invariant: ``tokens`` is the verified sequence (prompt + generated); the KV cache holds
``tokens[:cache_len]`` with ``cache_len < len(tokens)`` between rounds, so every verification
forward feeds ``tokens[cache_len:] + draft`` and reads the last ``L + 1`` logits: row i is
``p_{i+1}``, the target distribution after ``prefix + draft[:i]``.
"""
from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace

import torch

from specdec.common import verification as V
from specdec.common import settings as S
from specdec.edge.batched import ForwardRequest, forward_batch
from specdec.common.codecs import CodecConfig, decode_distribution, decode_dssd_scalars, encode_target_probs
from specdec.common.modes import Mode, TOP_K_MODES
from specdec.common.distributions import SparseDist, densify
from specdec.common.loadaware import Acceptance
from specdec.common.modeling import CachedLM, LoadedModel
from specdec.common.adjust import MAX_LOGIT_BIAS_ENTRIES, chain_paths
from specdec.common.logprobs import NO_LOGPROBS
from specdec.common.sampling import TargetLaw, validate_hello
from specdec.edge.prefix_law import PrefixLaw
from specdec.edge.verify_batch import ChainRound, RoundOutcome, chain_round, dssd_round, gumbel_round, verify_rounds
from specdec.common.streams import Purpose, stream
from specdec.common.tree import TreeSpec, tree_verify
from specdec.common.treeplan import edge_tree_inputs, path_cache_indices
from specdec.common.protocol import (CONTEXT_FULL, DEFAULT_DSSD_MAX_SAMPLES, DEFAULT_MAX_DRAFT_LEN, DEFAULT_MAX_K,
                                     MAX_STOP_IDS, PROTOCOL_VERSION, TARGET_MISMATCH, DraftBlock,
                                     DraftSettings, Hello, Prompt, ResidualReply, ResidualRequest, Verdict, Welcome)


@dataclass(frozen=True)
class _PendingReject:
    """A DSSD rejection whose correction token the device has not sent yet."""
    round_id: int
    p_j: torch.Tensor   # [V] float64, the target distribution at the rejected position
    start: int          # the round's start: keys the streams of its fallback
    top_k: int          # the round's dssd_fallback_top_k (0: the whole p_j)


class RefusedError(ValueError):
    """A Hello the edge will not serve (version, vocabulary, target or limits); maps to
    FAILED_PRECONDITION, with ``reason`` sent to the device as protocol.REASON_KEY when set."""

    def __init__(self, message: str, reason: str = ""):
        super().__init__(message)
        self.reason = reason


class LimitError(ValueError):
    """A request beyond a configured limit; maps to RESOURCE_EXHAUSTED, with ``reason`` sent to the
    device as protocol.REASON_KEY (CONTEXT_FULL: the sequence reached the context limit)."""

    def __init__(self, message: str, reason: str = "limit"):
        super().__init__(message)
        self.reason = reason


@dataclass(frozen=True)
class EdgeLimits:
    max_sessions: int = 64          # sessions held at once (detached ones too); more wait in admission's queue
    max_context: int = 0            # tokens per session; 0 = the model's max_position_embeddings
    max_draft_len: int = DEFAULT_MAX_DRAFT_LEN  # draft tokens per round
    max_k: int = DEFAULT_MAX_K      # transmitted support size per distribution
    max_prompt_tokens: int = 0      # 0 = max_context
    idle_timeout_s: float = 120.0   # a session silent this long is closed and freed
    resume_window_s: float = 60.0   # a session whose stream broke waits this long for a resume
    dssd_max_samples: int = DEFAULT_DSSD_MAX_SAMPLES  # downlink samples per DSSD rejection
    max_tree_nodes: int = 256       # drafted nodes per round (one target forward covers them all)
    max_logit_bias: int = MAX_LOGIT_BIAS_ENTRIES  # entries of a session's logit bias map


@dataclass(frozen=True)
class TargetInfo:
    """What the servicer needs to know about the loaded target without touching the model."""
    name: str
    vocab_size: int
    fingerprint: str
    max_context: int
    target_fingerprint: str = ""  # weights and vocabulary (modeling.target_fingerprint); "" = not known


Forward = Callable[[ForwardRequest], torch.Tensor]  # runs one target forward, returns its logits
# Runs one target forward and verifies the round drafted in it against the logits (the scheduler
# verifies all the rounds of a batched forward together: edge/verify_batch.py).
VerifyForward = Callable[[ForwardRequest, ChainRound], RoundOutcome]


def forward_alone(request: ForwardRequest) -> torch.Tensor:
    """A forward of one session only, on the calling thread (no scheduler: ``--no-batching``)."""
    return forward_batch([request])[0]


def verify_alone(request: ForwardRequest, round_: ChainRound) -> RoundOutcome:
    """A forward of one session and its round's verification, on the calling thread (``--no-batching``)."""
    return verify_rounds([forward_alone(request)], [round_])[0]


def complete(session: "VerifierSession") -> bool:
    """Whether no round of ``session`` can follow: it holds all the tokens its Hello asked for
    (``max_new_tokens``), or a generated token is among the device's end-of-sequence ids
    (``Hello.stop_ids``), where the device stops. Never while a DSSD rejection waits for its
    correction: the device may still ask for the residual it draws it from (a fallback), even where
    an accepted draft already ended the text (a draft that went on past end-of-sequence)."""
    if session._pending_reject is not None:  # the device holds the correction (its next draft carries it)
        return False
    if len(session.tokens) - session.prefix.prompt_len >= session.hello.max_new_tokens:
        return True
    return session.stops.reached(session.tokens, session.prefix.prompt_len)


class StopScan:
    """Whether a session's generated tokens hold one of the device's end-of-sequence ids (Hello.stop_ids),
    each token looked at once: :func:`complete` asks after every token an edge-only round or running
    ahead generates, and a scan of the whole sequence each time grows with it."""

    def __init__(self, stop_ids):
        self.stop = frozenset(stop_ids)
        self._tokens: list[int] | None = None  # the sequence scanned: a prefill or resync replaces the list
        self._clean = 0                        # its tokens before this index hold no stop id

    def reached(self, tokens: list[int], start: int) -> bool:
        """Whether ``tokens[start:]`` (the session's, which only grow between replacements) holds a stop id."""
        if not self.stop:
            return False
        if tokens is not self._tokens:
            self._tokens, self._clean = tokens, start
        for i in range(self._clean, len(tokens)):
            if tokens[i] in self.stop:
                return True
            self._clean = i + 1
        return False


def continued(session: "VerifierSession", draft: DraftBlock) -> DraftBlock | None:
    """The rest of a late ``draft`` to verify (Hello.continues_late): its drafts after the k tokens the
    edge generated ahead past its start, where those are its first k drafts and it drafted more; None
    for any other round.

    Verified from the edge's end, the rest gets the verdict the whole round would have had on time. A
    gumbel round accepts a draft iff it is its position's race, which is the token generated ahead
    there (:meth:`VerifierSession.ahead_token`); a chain round at temperature 0 iff it is the target's
    argmax, also that token, whatever its q; after the k, a gumbel round's noise is keyed by position
    and a greedy round draws nothing. Not DSSD (a rejection's token may be the device's) nor trees
    (their drafts are no single path), nor chain rounds at T > 0 (their accept tests draw numbers
    keyed by the round's start)."""
    k = len(session.tokens) - draft.start
    if not (session.hello.continues_late and draft.start and 0 < k < len(draft.token_ids)):
        return None
    settings = session.round_settings(draft)
    if not continues_like(session.hello, settings) or tuple(session.tokens[draft.start:]) != tuple(draft.token_ids[:k]):
        return None
    return replace(draft, token_ids=draft.token_ids[k:], distributions=draft.distributions[k:],
                   start=len(session.tokens))


def continues_like(hello: Hello, settings: DraftSettings) -> bool:
    """Whether a late round with these settings is served from the tokens generated ahead instead of
    superseded (where it drafted them, :func:`continued`, or asks for more of them,
    :func:`continued_edge_only`): edge-only rounds, gumbel rounds, and chain rounds at temperature 0,
    never DSSD rounds nor trees, in a session that asked for it (Hello.continues_late, ...late_edge_only)."""
    if settings.mode is Mode.NONE:
        return hello.continues_late_edge_only
    race = settings.mode is Mode.GUMBEL or (hello.temperature == 0 and settings.mode is not Mode.DSSD)
    return hello.continues_late and race and not settings.tree


def continued_edge_only(session: "VerifierSession", draft: DraftBlock) -> int:
    """How many tokens the edge generated ahead past the start of a late edge-only ``draft`` that it
    continues after them (Hello.continues_late_edge_only): a round that asks for more than those k,
    whose rest the edge streams after them; 0 for any other round (served, superseded or void as
    before). The rest is the same race at the same positions as the whole round on time (each token's
    noise is keyed by its position): which request asks for a token changes nothing of it. Not after an
    end-of-sequence token or at ``max_new_tokens`` (the edge stopped there: the round is superseded)."""
    k = len(session.tokens) - draft.start
    if not (session.hello.continues_late_edge_only and draft.start and k > 0):
        return 0
    settings = session.round_settings(draft)
    if settings.mode is not Mode.NONE or k >= (settings.edge_tokens or 1):
        return 0
    if session.tokens[-1] in session.eos_token_ids or complete(session):
        return 0
    return k


def served_late(session: "VerifierSession", draft: DraftBlock) -> bool:
    """Whether a late ``draft`` (it starts before tokens generated ahead) is served, not superseded: a
    round :func:`continued`, or an edge-only one :func:`continued_edge_only` (its generate() streams the
    rest)."""
    return continued(session, draft) is not None or continued_edge_only(session, draft) > 0


def verify_round(session: "VerifierSession", draft: DraftBlock) -> Verdict:
    """``session.verify(draft)``, a late round :func:`continued`: its Verdict counts from the round's
    start, the drafts matched by tokens generated ahead among the accepted ones."""
    rest = continued(session, draft)
    if rest is None:
        return session.verify(draft)
    verdict = session.verify(rest)
    return replace(verdict, num_accepted=verdict.num_accepted + len(draft.token_ids) - len(rest.token_ids))


class VerifierSession:
    """One generation session on the edge. Methods are blocking (torch); call them off the loop.

    Every target forward goes through ``forward``, and a chain round's forward with its verification
    through ``verify``: the edge's scheduler, which batches them with other sessions'
    (:mod:`specdec.edge.batching`), or :func:`forward_alone` and :func:`verify_alone`."""

    def __init__(self, target: LoadedModel, info: TargetInfo, hello: Hello, limits: EdgeLimits,
                 session_id: str, forward: Forward = forward_alone, lm: CachedLM | None = None,
                 verify: VerifyForward = verify_alone):
        check_hello(info, hello, limits)
        self._forward, self._verify = forward, verify
        self.hello = hello
        self.stops = StopScan(hello.stop_ids)  # where the device's own end-of-sequence ids end it
        self.law = TargetLaw(hello.temperature, hello.target_top_k, hello.target_top_p, hello.target_min_p,
                             hello.adjust)
        # what the law reads of the verified prefix, and the logprobs the session asks for
        self.prefix = PrefixLaw(hello, self.law, target.tokenizer, info.vocab_size, target.eos_token_ids)
        self.info = info
        self.limits = limits
        self.session_id = session_id
        self.max_context = min(limits.max_context or info.max_context, info.max_context)
        # the target's KV cache of this session: its own, or a slot of the edge's (edge/slots.py)
        self.lm = lm if lm is not None else CachedLM(target.model, target.device)
        self.eos_token_ids = eos_ids(hello, target)  # an edge-only round ends at one, running ahead stops there
        self.tokens: list[int] = []
        self.round_id = 0
        self._pending_reject: _PendingReject | None = None  # DSSD: a rejection the device still resolves
        # Per-round settings already checked, with their codec: a device that changes settings
        # between rounds usually alternates among a few.
        self._codecs: dict[DraftSettings, CodecConfig | None] = {hello.draft: hello.draft.codec(info.vocab_size)}
        self._specs: dict[tuple[int, ...], TreeSpec] = {}  # tree configuration (prefix) -> spec
        self.acceptance = Acceptance()  # of this device's drafts, for load-aware speculation

    def welcome(self) -> Welcome:
        return Welcome(session_id=self.session_id, model_name=self.info.name, vocab_size=self.info.vocab_size,
                       max_context=self.max_context, max_draft_len=self.limits.max_draft_len, max_k=self.limits.max_k,
                       dssd_max_samples=self.limits.dssd_max_samples, target_fingerprint=self.info.target_fingerprint,
                       modes=tuple(Mode), adjusts_law=True, continues_late=True, continues_late_edge_only=True,
                       ignores_eos=True, token_probs=True)

    # -- prompt ----------------------------------------------------------------------------------
    def prefill(self, prompt: Prompt) -> None:
        ids = list(prompt.token_ids)
        if not ids:
            raise ValueError("empty prompt")
        max_prompt = self.limits.max_prompt_tokens or self.max_context
        if len(ids) >= min(max_prompt, self.max_context):
            raise LimitError(f"prompt of {len(ids)} tokens exceeds the limit {min(max_prompt, self.max_context) - 1}")
        check_ids(ids, self.info.vocab_size, "prompt")
        if self.tokens:
            raise ValueError("prompt sent twice")
        self.prefix.take_prompt(prompt)
        self.tokens = ids
        if len(ids) > 1:
            self._forward(ForwardRequest(self.lm, ids[:-1], num_logits=0))

    def resync(self, prompt: Prompt) -> int:
        """A resumed stream: adopt the device's verified prefix, keep the KV of the common prefix.

        The edge may be ahead (a verdict lost with the broken stream) or behind (a DSSD correction
        not yet sent); both agree on their longest common prefix. Returns the cached tokens kept.
        """
        ids = list(prompt.token_ids)
        if not ids:
            raise ValueError("empty prefix on resume")
        if len(ids) + 1 > self.max_context:
            raise LimitError(f"prefix of {len(ids)} tokens exceeds the context limit {self.max_context}",
                             CONTEXT_FULL)
        check_ids(ids, self.info.vocab_size, "prefix")
        self.prefix.take_prompt(prompt)
        common = 0
        for a, b in zip(ids, self.tokens):
            if a != b:
                break
            common += 1
        keep = min(self.lm.cache_len, common, len(ids) - 1)  # cache stays strictly behind tokens
        self.lm.truncate(keep)
        self.tokens = ids
        self.round_id = 0  # round numbering restarts on every stream
        self._pending_reject = None
        return keep

    # -- rounds ----------------------------------------------------------------------------------
    def verify(self, draft: DraftBlock) -> Verdict:
        start = time.perf_counter()
        settings = self.round_settings(draft)
        spec = tree_spec(draft, settings, self._specs) if settings.tree else None
        self._check_order(draft)
        check_round(draft, settings, spec, self.info.vocab_size, len(self.tokens), self.max_context)
        self._apply_correction(draft)
        t_decode = time.perf_counter()
        q = decode_q(draft, settings, spec, self._codecs[settings])
        decode_seconds = time.perf_counter() - t_decode
        generator = self._round_generator()
        if spec is not None:
            verdict = self._verify_tree(draft, spec, q, generator)
        else:
            verdict = self._verify_chain(draft, settings, q, generator)
        self.acceptance.observe(spec.depth if spec is not None else len(draft.token_ids), verdict.num_accepted)
        self.round_id = draft.round_id
        return replace(verdict, verify_seconds=time.perf_counter() - start, decode_seconds=decode_seconds)

    def round_settings(self, draft: DraftBlock) -> DraftSettings:
        """How ``draft`` was drafted: its own settings, checked once, or the session's."""
        settings = draft.settings or self.hello.draft
        if settings not in self._codecs:
            S.validate(settings)
            _check_limits(settings, self.info, self.limits)
            self._codecs[settings] = settings.codec(self.info.vocab_size)
        return settings

    # -- edge-only rounds (mode none): the target generates alone ------------------------------------
    def generate(self, draft: DraftBlock) -> Iterator[Verdict]:
        """An edge-only round: up to ``edge_tokens`` tokens sampled from the target alone, one Verdict
        each as soon as it exists (``more`` on all but the last), so the device can stream them.

        Each token at sequence index t is the race of p_t with the position's noise
        (verification.token_noise): exactly the target's law, the very token a gumbel round emits
        there, and a resumed round redraws the same token. The round ends early at an end-of-sequence
        token or when the context is full.

        A round sent ahead (``draft.sent_ahead``: the device asked for it before the previous round's
        last token arrived) that follows an end-of-sequence token is void: one Verdict with no token,
        and no forward, since the device that sent it has most likely finished."""
        settings = self.round_settings(draft)
        if settings.mode is not Mode.NONE:
            raise ValueError(f"generate() takes edge-only rounds, got mode {settings.mode.value}")
        self._check_order(draft)
        if draft.token_ids or draft.distributions or draft.dssd_scalars or draft.tree_depth:
            raise ValueError("an edge-only round carries no draft")
        self._apply_correction(draft)
        self.round_id = draft.round_id
        if draft.sent_ahead and (self.tokens[-1] in self.eos_token_ids or draft.start > len(self.tokens)):
            yield Verdict(round_id=draft.round_id, num_accepted=0, next_token=None)
            return
        want = (settings.edge_tokens or 1) - continued_edge_only(self, draft)
        round_start = len(self.tokens)
        for i in range(want):
            start = time.perf_counter()
            if len(self.tokens) + 1 > self.max_context:
                raise LimitError(f"context limit {self.max_context} tokens reached", CONTEXT_FULL)
            outcome = self._edge_token(round_start, draft.token_probs)
            token = outcome.next_token
            last = i + 1 == want or token in self.eos_token_ids or len(self.tokens) + 1 > self.max_context or complete(self)
            yield Verdict(round_id=draft.round_id, num_accepted=0, next_token=token, more=not last,
                          verify_seconds=time.perf_counter() - start, logprobs=outcome.logprobs)
            if last:
                return

    # -- running ahead (Draft.run_ahead_ms): the device's next round is overdue ---------------------------
    def superseded(self, draft: DraftBlock) -> Verdict | None:
        """The answer to a round that starts before tokens generated ahead (which the device gets first):
        unverified, no token; None: a round to serve (one :func:`served_late` included). A start beyond the
        edge's is an error (void in a round sent ahead: :meth:`generate`)."""
        end = len(self.tokens) + (self._pending_reject is not None)  # the device holds its DSSD correction
        if not draft.start or draft.start == end or (draft.start > end and draft.sent_ahead) or served_late(self, draft):
            return None
        if draft.start > end:
            raise ValueError(f"round {draft.round_id} starts at token {draft.start}, beyond the {end} tokens verified")
        self._check_order(draft)
        self.round_id = draft.round_id
        return Verdict(round_id=draft.round_id, num_accepted=0, next_token=None, superseded=True)

    def ahead_token(self) -> Verdict | None:
        """A token generated ahead (the next message is overdue): the race an edge-only or gumbel round
        runs at the position. None after an end-of-sequence token, at ``max_new_tokens``, with the context
        full or a DSSD correction still with the device."""
        n = len(self.tokens)
        if (self._pending_reject is not None or self.tokens[-1] in self.eos_token_ids or n + 1 > self.max_context
                or complete(self)):
            return None
        start, outcome = time.perf_counter(), self._edge_token(n)
        return Verdict(round_id=self.round_id, num_accepted=0, next_token=outcome.next_token, ahead=True,
                       verify_seconds=time.perf_counter() - start, logprobs=outcome.logprobs)

    def _edge_token(self, round_start: int, token_probs: bool = False) -> RoundOutcome:
        """The target's next token alone (a gumbel race with no draft), appended (the cache stays one behind)."""
        offset = len(self.tokens) - round_start
        race = self.prefix.asking(gumbel_round(torch.empty(0, dtype=torch.long), self.law,
                                               lambda i: self.token_noise(round_start, offset + i),
                                               **self.prefix.shape(self.tokens, [[]])), token_probs)
        outcome = self._verify(ForwardRequest(self.lm, self.tokens[self.lm.cache_len:], 1), race)
        self.tokens.append(outcome.next_token)
        return outcome

    def token_noise(self, start: int, offset: int) -> torch.Tensor:  # [V] float64
        """The exponential noise of sequence index ``start + offset`` in a round starting at ``start``:
        keyed by the position alone (verification.token_noise), whatever the round. At T = 0 the
        target is one-hot and any noise gives its argmax: none is drawn."""
        if self.hello.temperature == 0:
            return torch.ones(self.info.vocab_size, dtype=torch.float64)
        return V.token_noise(self.hello.seed, start + offset, self.info.vocab_size)

    def _round_generator(self) -> torch.Generator:
        """The numbers of the round that starts at ``len(self.tokens)``, from its own stream: a retry
        of this round (resume, re-prefill on a fresh edge, a broken DSSD fallback) draws them again
        exactly, and no two rounds share them."""
        return stream(self.hello.seed, Purpose.VERIFY, len(self.tokens))

    def _verify_chain(self, draft: DraftBlock, settings: DraftSettings, q, generator: torch.Generator) -> Verdict:
        """One target forward over the unverified tail + the drafts, verified with every round of the
        same forward (:mod:`specdec.edge.verify_batch`); only the verdict comes back from the
        target's device."""
        draft_ids = list(draft.token_ids)
        request = ForwardRequest(self.lm, self.tokens[self.lm.cache_len:] + draft_ids, len(draft_ids) + 1)
        outcome = self._verify(request, self._chain_round(draft_ids, settings, q, generator))
        n = outcome.num_accepted
        self._commit(draft_ids[:n], n, outcome.next_token)
        if outcome.next_token is not None:
            return Verdict(round_id=draft.round_id, num_accepted=n, next_token=outcome.next_token,
                           logprobs=outcome.logprobs)
        # DSSD: the device resolves the rejection; p_j waits on the host for its fallback (rare)
        self._pending_reject = _PendingReject(draft.round_id, outcome.reject_p, len(self.tokens) - n,
                                              settings.dssd_fallback_top_k)
        return Verdict(round_id=draft.round_id, num_accepted=n, next_token=None,
                       reject_samples=outcome.reject_samples, reject_sample_probs=outcome.reject_sample_probs)

    def _chain_round(self, draft_ids: list[int], settings: DraftSettings, q,
                     generator: torch.Generator) -> ChainRound:
        """The round to verify, checked before any model work: gumbel (no q: accept iff each draft is the
        target's own race), DSSD (the scalars q_i(x_i)) or a chain (the decoded packets)."""
        ids = torch.tensor(draft_ids, dtype=torch.long)
        shape = self.prefix.shape(self.tokens, chain_paths(draft_ids))
        if settings.mode is Mode.GUMBEL:
            start = len(self.tokens)
            return self.prefix.asking(gumbel_round(ids, self.law, lambda i: self.token_noise(start, i), **shape))
        bonus = self._bonus_noise(len(draft_ids), settings)
        if settings.mode is Mode.DSSD:
            if self.hello.logprobs != NO_LOGPROBS:
                raise ValueError("a session that asks for logprobs sends no DSSD round (its corrections are "
                                 "drawn on the device)")
            return dssd_round(ids, q, self.law, generator, settings.dssd_samples, bonus, **shape)
        return self.prefix.asking(chain_round(ids, q, self.law, generator, bonus, **shape))

    def _bonus_noise(self, num_drafts: int, settings: DraftSettings):
        """What draws the coupled bonus's Gumbel noise for the position after this round's drafts (a
        function: only a round whose drafts are all accepted needs it), or None without the coupling."""
        if not settings.coupled_bonus:
            return None
        position = len(self.tokens) + num_drafts
        return lambda: V.bonus_noise(self.hello.seed, position, self.info.vocab_size)

    def _verify_tree(self, draft: DraftBlock, spec: TreeSpec, q: torch.Tensor,
                     generator: torch.Generator) -> Verdict:
        """One target forward over prefix + whole tree (tree attention), then TSLT Alg. 8."""
        tail = self.tokens[self.lm.cache_len:]
        attend, positions = edge_tree_inputs(spec, self.lm.cache_len, len(tail))
        logits = self._forward(ForwardRequest(self.lm, tail + list(draft.token_ids), spec.num_nodes,
                                              attend=attend, positions=positions))
        node_tokens = torch.tensor([0, *draft.token_ids], dtype=torch.long)  # root entry unused
        paths = spec.paths(node_tokens.tolist())
        rows = self.law.shaped(logits.cpu(), paths=paths, **self.prefix.shape(self.tokens, paths))
        p = self.law.probs(rows)  # row 0: after the prefix; row n: after node n (host math)
        result = tree_verify(spec, node_tokens, q, p, generator)
        prefix_len = len(self.tokens)
        # Keep KV only for the prefix and the accepted path; the final token is not in the cache.
        self.lm.keep(path_cache_indices(prefix_len, result.accepted_nodes, fed_until=spec.num_nodes))
        self.tokens.extend(result.tokens)
        return Verdict(round_id=draft.round_id, num_accepted=len(result.accepted_nodes),
                       next_token=result.tokens[-1], accepted_nodes=tuple(result.accepted_nodes),
                       logprobs=self.prefix.tree_logprobs(rows, result.accepted_nodes, result.tokens))

    def residual(self, request: ResidualRequest) -> ResidualReply:
        """DSSD fallback: p_j of the pending rejection (float64, exactly what was verified), as its head
        and tail samples when the round set ``dssd_fallback_top_k`` (unless the device asks for the
        whole of it), else whole."""
        pending = self._pending_reject
        if pending is None or request.round_id != pending.round_id:
            raise ValueError(f"no pending DSSD rejection for round {request.round_id}")
        if request.whole or not pending.top_k:
            return ResidualReply(round_id=request.round_id, target_probs=encode_target_probs(pending.p_j))
        generator = stream(self.hello.seed, Purpose.DSSD_TAIL, pending.start)
        head = V.dssd_edge_head(pending.p_j, pending.top_k, V.DSSD_TAIL_SAMPLES, generator)
        return ResidualReply(round_id=request.round_id, **head.to_values())

    # -- internals -------------------------------------------------------------------------------
    def _check_order(self, draft: DraftBlock) -> None:
        """Every round, edge-only or not: after the prompt, numbered in order."""
        if not self.tokens:
            raise ValueError("draft before prompt")
        if draft.round_id != self.round_id + 1:
            raise ValueError(f"round id {draft.round_id} out of order (expected {self.round_id + 1})")

    def _apply_correction(self, draft: DraftBlock) -> None:
        if self._pending_reject is not None:
            if draft.correction_token is None:
                raise ValueError("DSSD: this draft must carry the correction token of the last rejection")
            check_ids([draft.correction_token], self.info.vocab_size, "correction")
            self.tokens.append(int(draft.correction_token))
            self._pending_reject = None
        elif draft.correction_token is not None:
            raise ValueError("unexpected correction token: no rejection is pending")

    def _commit(self, accepted: list[int], num_accepted: int, next_token: int | None) -> None:
        """Keep KV only for the verified prefix; append the accepted tokens (and the next one)."""
        self.lm.truncate(len(self.tokens) + num_accepted)
        self.tokens.extend(accepted)
        if next_token is not None:
            self.tokens.append(int(next_token))


def decode_q(draft: DraftBlock, settings: DraftSettings, spec: TreeSpec | None, codec: CodecConfig | None):
    """The round's q: DSSD's scalars [L] float64, None (gumbel), a chain's packets decoded (each
    densified only if the round rejects there), or a tree's rows [internal nodes, V] on the host."""
    n = len(draft.token_ids)
    if settings.mode is Mode.DSSD:
        return decode_dssd_scalars(draft.dssd_scalars, n)
    if settings.mode is Mode.GUMBEL:
        if draft.distributions or draft.dssd_scalars:
            raise ValueError("a gumbel round carries token ids only")
        return None
    expected = spec.num_internal if spec is not None else n  # trees: one q per internal node
    if len(draft.distributions) != expected:
        raise ValueError(f"{len(draft.distributions)} distributions, expected {expected}")
    rows: list[SparseDist] = [decode_distribution(payload, codec) for payload in draft.distributions]
    if spec is None:
        return tuple(rows)
    return torch.stack([densify(sd) for sd in rows])


def check_hello(info: TargetInfo, hello: Hello, limits: EdgeLimits) -> None:
    """A Hello this edge can serve: its protocol, vocabulary and target, valid settings within the
    edge's limits (RefusedError, ValueError or LimitError, before any model work)."""
    if hello.protocol_version != PROTOCOL_VERSION:
        raise RefusedError(f"protocol version {hello.protocol_version} not supported "
                           f"(edge speaks {PROTOCOL_VERSION})")
    if hello.vocab_fingerprint != info.fingerprint or hello.vocab_size != info.vocab_size:
        raise RefusedError(
            f"vocabulary mismatch: device {hello.vocab_fingerprint[:12]}/{hello.vocab_size}, "
            f"edge {info.fingerprint[:12]}/{info.vocab_size} ({info.name})")
    if hello.target_fingerprint and hello.target_fingerprint != info.target_fingerprint:
        raise RefusedError(
            f"target mismatch: the session ran on target {hello.target_fingerprint[:12]}, this edge "
            f"serves {info.target_fingerprint[:12] or 'an unfingerprinted target'} ({info.name}); "
            "continuing here would change the output distribution", TARGET_MISMATCH)
    validate_hello(hello)
    if len(hello.adjust.logit_bias) > limits.max_logit_bias:
        raise LimitError(f"logit bias of {len(hello.adjust.logit_bias)} entries exceeds the edge limit "
                         f"{limits.max_logit_bias}")
    if len(hello.stop_ids) > MAX_STOP_IDS:
        raise LimitError(f"{len(hello.stop_ids)} stop ids; at most {MAX_STOP_IDS}")
    check_ids(hello.stop_ids, info.vocab_size, "stop")
    _check_limits(hello.draft, info, limits)


def eos_ids(hello: Hello, target: LoadedModel) -> frozenset[int]:
    """Where the session's tokens end: the target's end-of-sequence ids, none where it ignores them
    (Hello.ignore_eos: on to max_new_tokens)."""
    return frozenset() if hello.ignore_eos else frozenset(target.eos_token_ids)


def check_ids(ids, vocab_size: int, what: str) -> None:
    bad = [i for i in ids if not 0 <= i < vocab_size]
    if bad:
        raise ValueError(f"{what} token id {bad[0]} out of range [0, {vocab_size})")


def check_round(draft: DraftBlock, settings: DraftSettings, spec: TreeSpec | None, vocab_size: int,
                verified: int, max_context: int) -> None:
    """A drafted round's shape: its tokens (a chain's within the draft length, a tree's its node
    count), their ids, and the context they need after the ``verified`` tokens."""
    if draft.sent_ahead:
        raise ValueError("only an edge-only round is sent ahead")
    n = len(draft.token_ids)
    if spec is None and draft.tree_depth:
        raise ValueError("tree_depth set in a chain session")
    if spec is not None:
        if n != spec.num_nodes - 1:
            raise ValueError(f"tree of depth {spec.depth} has {spec.num_nodes - 1} nodes, got {n} tokens")
    elif not 1 <= n <= settings.draft_len:
        raise LimitError(f"draft of {n} tokens; allowed 1..{settings.draft_len}")
    check_ids(draft.token_ids, vocab_size, "draft")
    extra = 1 if draft.correction_token is not None else 0
    if verified + extra + n + 1 > max_context:
        raise LimitError(f"context limit {max_context} tokens reached", CONTEXT_FULL)


def tree_spec(draft: DraftBlock, settings: DraftSettings, specs: dict[tuple[int, ...], TreeSpec]) -> TreeSpec:
    """The round's tree: the configured one cut to its depth (cached in ``specs`` by configuration)."""
    depth = draft.tree_depth
    if not 1 <= depth <= len(settings.tree):
        raise ValueError(f"tree_depth {depth} outside 1..{len(settings.tree)}")
    config = settings.tree[:depth]
    if config not in specs:
        specs[config] = TreeSpec.from_config(config)
    return specs[config]


def _check_limits(settings: DraftSettings, info: TargetInfo, limits: EdgeLimits) -> None:
    """The edge's own limits on how a round may be drafted (LimitError). An edge-only round's length
    is bounded by the context only."""
    if settings.mode is Mode.NONE:
        return
    if settings.draft_len > limits.max_draft_len:
        raise LimitError(f"draft_len {settings.draft_len} exceeds the edge limit {limits.max_draft_len}")
    if settings.mode in TOP_K_MODES and settings.top_k > min(limits.max_k, info.vocab_size):
        raise LimitError(f"top_k {settings.top_k} exceeds the edge limit {min(limits.max_k, info.vocab_size)}")
    if settings.mode is Mode.CSQS and settings.max_k > limits.max_k:
        raise LimitError(f"C-SQS max_k {settings.max_k} exceeds the edge limit {limits.max_k}")
    if settings.mode is Mode.DSSD and settings.dssd_samples > limits.dssd_max_samples:
        raise LimitError(f"dssd_samples exceeds the edge limit {limits.dssd_max_samples}")
    if settings.tree:
        _check_tree(settings.tree, limits)


def _check_tree(config: tuple[int, ...], limits: EdgeLimits) -> None:
    """Token trees: any expansion configuration within the edge's node and depth limits.

    The size is counted arithmetically, stopping at the limit, before any tree is built: a 95-byte
    Hello with <4096, 4096> must not make the edge allocate a 16M-node tree to refuse it.
    """
    if len(config) > limits.max_draft_len:
        raise LimitError(f"tree depth {len(config)} exceeds the edge limit {limits.max_draft_len}")
    width = nodes = 1
    for k in config:
        width *= k
        nodes += width
        if nodes - 1 > limits.max_tree_nodes:
            raise LimitError(f"tree {list(config)} has more than the edge limit of {limits.max_tree_nodes} nodes")
