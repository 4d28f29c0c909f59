"""The device's per-session drafter: drafts each round with its settings and applies the verdicts.

No grpc here: :mod:`specdec.device.client` moves :class:`DraftBlock` / :class:`Verdict` over the
stream. Lossless rule: each draft token is sampled from exactly the distribution the edge will
verify against, the DECODED packet, so the device encodes, decodes, then samples
(:func:`~specdec.device.draft_model.encode_q`). The pieces: the model and its cache
(:mod:`.draft_model`), chain rounds and drafting ahead (:mod:`.chain`), token trees
(:mod:`.tree_draft`), the device half of DSSD (:mod:`.dssd`).

Settings are per round: :attr:`DraftSession.settings` drafts the next round and may be changed
between rounds; a round whose settings differ from the session's says so on the wire. Every round
of every mode draws from its own random stream keyed by where it starts (common/streams.py).
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field, replace

import torch

from specdec.common import settings as S
from specdec.common.codecs import CodecConfig, decode_target_probs, dssd_theoretical_bits
from specdec.common.settings import Mode
from specdec.common.conformal import ConformalController
from specdec.common.modeling import LoadedModel
from specdec.common.protocol import DraftBlock, DraftSettings, Hello, ResidualReply, Verdict, Welcome
from specdec.common.stats import RoundRecord, SpecStats, edge_phases
from specdec.common.streams import Purpose, stream
from specdec.common.tree import TreeSpec
from specdec.common.treeplan import path_cache_indices
from specdec.device import dssd
from specdec.device.chain import Ahead, ChainRound, can_draft_ahead, chain_limit, guess_bonus
from specdec.device.draft_model import DraftModel, DraftStep, EncodedQ, encode_q, sample_step
from specdec.device.tree_draft import draft_tree, is_root_path


@dataclass
class RoundDraft:
    """One round's draft and what the device keeps to finish it."""
    block: DraftBlock
    settings: DraftSettings         # how it was drafted
    q_rows: list[torch.Tensor]      # [V] float64 per position (tree: per internal node): sampled-from q
    theoretical_bits: int
    support_sizes: list[int]
    draft_seconds: float            # drafter forwards + sampling
    encode_seconds: float           # codec encode + decode
    start: int = 0                  # sequence position of the round's first draft token (its streams' key)
    tree: TreeSpec | None = None    # the round's tree (a prefix of the configured one)
    dropped: list[float] = field(default_factory=list)  # C-SQS: dropped mass per encoded q
    drafted_ahead: bool = False     # its drafting began while the edge verified the last round
    ahead_discarded: int = 0        # set at its verdict: tokens drafted ahead for the next round, dropped
    draft_forwards: int = 0         # drafter forwards in draft_seconds (chains; 0 for trees)

    @property
    def positions(self) -> int:
        """Draft positions (tree depth for trees): the denominator of the acceptance rate."""
        return self.tree.depth if self.tree is not None else len(self.block.token_ids)

    def record(self, verdict: Verdict, generated: int, uplink: int, downlink: int, network: float,
               threshold: float | None, residual_trips: int = 0, residual_bytes: int = 0) -> RoundRecord:
        """The round's :class:`RoundRecord` once its verdict (and any DSSD fallback) is in."""
        phases = {"draft": self.draft_seconds, "encode": self.encode_seconds, "network": network,
                  **edge_phases(verdict)}
        return RoundRecord(
            mode=self.settings.mode.value, drafted_tokens=len(self.block.token_ids), positions=self.positions,
            accepted=verdict.num_accepted, generated=generated, uplink_bytes=uplink, downlink_bytes=downlink,
            theoretical_bits=self.theoretical_bits, support_sizes=tuple(self.support_sizes), phases=phases,
            drafted_ahead=self.drafted_ahead, ahead_tokens=len(self.block.token_ids) if self.drafted_ahead else 0,
            ahead_discarded=self.ahead_discarded, threshold=threshold, draft_forwards=self.draft_forwards,
            residual_trips=residual_trips, residual_bytes=residual_bytes)


def round_settings_json(s: DraftSettings) -> dict:
    """What a round log says about how a round was drafted."""
    out = {"mode": s.mode.value}
    if s.mode is Mode.NONE:
        return {**out, "edge_tokens": s.edge_tokens}
    out["draft_len"] = len(s.tree) if s.tree else s.draft_len
    if s.mode in (Mode.TSLT, Mode.KSQS):
        out["top_k"] = s.top_k
    if s.tree:
        out["tree"] = list(s.tree)
    return out


class DraftSession:
    """Drafts rounds for one generation and applies the edge's verdicts. Blocking (torch)."""

    def __init__(self, drafter: LoadedModel, hello: Hello, *, draft_ahead: bool = False, policy=None,
                 round_log: bool = False):
        self.hello = hello
        self.vocab_size = drafter.vocab_size
        self.model = DraftModel(drafter, hello.temperature)
        self.settings = hello.draft       # the next round's; change between rounds to re-plan
        self.edge_hint: int | None = None  # the edge's advised longest draft at its load (last verdict)
        self.controller: ConformalController | None = None  # C-SQS threshold (SQS Alg. 1)
        self._controller_key: tuple | None = None
        self.tokens: list[int] = []
        self.round_id = 0
        self.stats = SpecStats()          # filled by whoever sees the whole round (the client)
        self.pending_correction: int | None = None
        self.draft_ahead_requested = draft_ahead
        self._ahead: Ahead | None = None
        self._codecs: dict[DraftSettings, CodecConfig | None] = {}
        self._specs: dict[tuple[int, ...], TreeSpec] = {}
        # mode auto (device/auto.py AutoPolicy): picks each round's settings, fed every round's record
        self.policy = policy
        self.round_log: list[dict] | None = [] if round_log else None  # per-round entries for the JSON
        self._t0 = time.perf_counter()

    @property
    def draft_ahead_enabled(self) -> bool:
        return self.draft_ahead_requested and can_draft_ahead(self.settings)

    def start(self, prompt_ids: list[int]) -> None:
        self.tokens = list(prompt_ids)
        self._t0 = time.perf_counter()

    def abort_round(self) -> None:
        """The stream broke before the verdict: drop drafted state, keep the verified prefix.

        The next stream re-sends the whole verified prefix (which already holds any DSSD correction)
        and numbers its rounds from 1 again.
        """
        # Keep the cache strictly behind the verified tokens: the next forward needs an input.
        self.model.truncate(min(self.model.cache_len, len(self.tokens) - 1))
        if self.controller is not None:
            self.controller.abort_round()
        self.pending_correction = None
        self.round_id = 0
        self._ahead = None

    def choose_settings(self) -> None:
        """Called before each round: the policy (mode auto) or the session's own settings, drafting
        no longer than the edge advised at its load (0: an edge-only round)."""
        chosen = self.policy.choose(self.head_start()) if self.policy is not None else self.hello.draft
        self.settings = S.within_draft_len(chosen, self.edge_hint)

    def observe_welcome(self, welcome: Welcome) -> None:
        """The edge's limits: mode auto chooses within them (a round beyond one fails the session)."""
        if self.policy is not None:
            self.policy.observe_welcome(welcome)

    def observe_verdict(self, verdict: Verdict) -> None:
        """Every verdict may carry the edge's draft-length advice; the newest counts."""
        if verdict.draft_len_hint is not None:
            self.edge_hint = verdict.draft_len_hint

    def observe(self, record: RoundRecord, settings: DraftSettings) -> None:
        """A finished round (its verdict and any DSSD fallback in): statistics, policy, round log."""
        self.stats.observe(record)
        if self.policy is not None:
            self.policy.observe(record, settings)
        if self.round_log is not None:
            entry = {"t": time.perf_counter() - self._t0, **round_settings_json(settings), **record.to_json(),
                     "edge_hint": self.edge_hint}
            if self.policy is not None:
                entry["auto"] = self.policy.last
            self.round_log.append(entry)

    # -- per-position hooks (tests and benchmarks override them to log or to break things) ----------
    def encode(self, q: torch.Tensor, settings: DraftSettings) -> EncodedQ:
        threshold = self.controller.beta if settings.mode is Mode.CSQS else None
        encoded = encode_q(q, self._codec(settings), threshold)
        if self.policy is not None:
            self.policy.observe_q(q, encoded.q_hat, settings)
        return encoded

    def sample(self, encoded: EncodedQ, generator: torch.Generator) -> DraftStep:
        return sample_step(encoded, generator)

    # -- rounds ---------------------------------------------------------------------------------------
    def draft(self, max_tokens: int) -> RoundDraft:
        """Draft up to ``min(draft_len, max_tokens)`` tokens (at least one) with :attr:`settings`."""
        s = self.settings
        self._ensure_controller(s)
        if self.controller is not None and s.mode is Mode.CSQS:
            self.controller.start_round()  # one threshold per round (trees: updated along the path later)
        if s.tree:
            self._drop_ahead()  # a chain drafted ahead does not make a tree
            return self._draft_tree(s, max(1, min(len(s.tree), max_tokens)))
        limit = chain_limit(s, max_tokens)
        part = self._take_ahead(limit, s) or self._new_round(len(self.tokens), s)
        while len(part.steps) < limit and self._draft_step(part, self.tokens):
            pass
        return self._chain_round(part)

    def _new_round(self, start: int, s: DraftSettings) -> ChainRound:
        return ChainRound(start, s, stream(self.hello.seed, Purpose.DRAFT, start))

    def _draft_step(self, part: ChainRound, base: list[int]) -> bool:
        """Sample and encode one more draft token after ``base + part.ids``; False if the bit budget
        says the round ends before it."""
        t0, n0 = time.perf_counter(), self.model.forwards
        q = self.model.q_after(base + part.ids, one_token_per_forward=can_draft_ahead(part.settings))
        t1 = time.perf_counter()
        part.forwards += self.model.forwards - n0
        step = self.sample(self.encode(q, part.settings), part.generator)
        t2 = time.perf_counter()
        part.t_draft += t1 - t0
        part.t_encode += t2 - t1
        if not part.fits(step.encoded.theoretical_bits):
            return False  # this position would overflow the round's bit budget B (SQS sec. 4)
        if self.controller is not None and part.settings.mode is Mode.CSQS:
            self.controller.observe(step.encoded.dropped_mass)
        part.add(step)
        return True

    def _chain_round(self, part: ChainRound) -> RoundDraft:
        s, ids = part.settings, part.ids
        q_rows = [st.encoded.q_hat for st in part.steps]
        if s.mode is Mode.DSSD:
            payloads, scalars, bits = (), dssd.draft_scalars(q_rows, ids), dssd_theoretical_bits(len(ids), self.vocab_size)
        else:
            payloads, scalars, bits = tuple(st.encoded.payload for st in part.steps), b"", part.bits
        block = self._block(tuple(ids), s, distributions=payloads, dssd_scalars=scalars)
        return RoundDraft(block=block, settings=s, q_rows=q_rows, theoretical_bits=bits,
                          support_sizes=[st.encoded.support_size for st in part.steps],
                          draft_seconds=part.t_draft, encode_seconds=part.t_encode, start=part.start,
                          drafted_ahead=part.drafted_ahead, draft_forwards=part.forwards)

    def _block(self, ids: tuple[int, ...], s: DraftSettings, **payload) -> DraftBlock:
        """The round's message: numbered, carrying any pending DSSD correction, and its settings
        when they are not the session's."""
        self.round_id += 1
        block = DraftBlock(round_id=self.round_id, token_ids=ids, correction_token=self.pending_correction,
                           settings=None if s == self.hello.draft else s, **payload)
        self.pending_correction = None
        return block

    # -- edge-only rounds (mode none): no draft, the edge generates and streams -------------------------
    def edge_round(self, remaining: int) -> RoundDraft:
        """An empty round asking the edge for up to ``edge_tokens`` tokens (0 = all ``remaining``)."""
        self._drop_ahead()
        s = self.settings
        s = replace(s, edge_tokens=min(s.edge_tokens or remaining, remaining))  # the edge must know when to stop
        block = self._block((), s)
        return RoundDraft(block=block, settings=s, q_rows=[], theoretical_bits=0, support_sizes=[],
                          draft_seconds=0.0, encode_seconds=0.0, start=len(self.tokens))

    def take_edge_token(self, rd: RoundDraft, verdict: Verdict) -> int:
        """One streamed token of an edge-only round: append it (the draft cache catches up later)."""
        if verdict.round_id != rd.block.round_id or verdict.next_token is None or verdict.num_accepted:
            raise ValueError(f"verdict does not belong to edge-only round {rd.block.round_id}")
        self.tokens.append(int(verdict.next_token))
        return int(verdict.next_token)

    def _drop_ahead(self) -> None:
        if self._ahead is not None:
            self._ahead = None
            self.model.truncate(min(self.model.cache_len, len(self.tokens) - 1))

    # -- drafting ahead: the next round while the edge verifies this one ------------------------------
    def draft_ahead(self, rd: RoundDraft, max_tokens: int, stop: threading.Event) -> None:
        """Called (in a worker thread) once ``rd`` is sent: guess that all of it is accepted and what
        the bonus token is, and draft the next round from there until ``stop`` is set (when the
        verdict arrives) or the round is full. :meth:`commit` keeps the work if the guess was right
        and drops it otherwise. ``max_tokens``: what the next :meth:`draft` call will be given if the
        guess is right. Lossless: see :mod:`specdec.device.chain`."""
        s = self.settings
        if not self.draft_ahead_enabled or rd.tree is not None or stop.is_set():
            return
        seq = self.tokens + list(rd.block.token_ids)
        part = self._new_round(len(seq) + 1, s)
        part.drafted_ahead = True
        t0 = time.perf_counter()
        logits = self.model.feed(seq)   # feeds the last draft token
        part.t_draft += time.perf_counter() - t0
        part.forwards += 1
        guess = guess_bonus(logits, len(seq), self.hello.temperature, self.hello.seed,
                            rd.settings.coupled, self.vocab_size)
        self._ahead = Ahead(guess=guess, round=part)
        base = seq + [guess]
        limit = chain_limit(s, max_tokens)
        while len(part.steps) < limit and not stop.is_set() and self._draft_step(part, base):
            pass

    def _take_ahead(self, limit: int, s: DraftSettings) -> ChainRound | None:
        """The round drafted ahead, if :meth:`commit` kept it and it was drafted with the same codec.
        Its draft length may differ: a round's k-th token depends only on its start, its stream and
        its codec, so a longer round goes on drafting and a shorter one keeps its first ``limit``."""
        ahead, self._ahead = self._ahead, None
        if ahead is None:
            return None
        part = ahead.round
        if part.start != len(self.tokens) or replace(part.settings, draft_len=s.draft_len) != s:
            # codec changed: redraft. Keep the last verified token out of the cache: the first
            # forward of the new round needs an input.
            self.model.truncate(min(self.model.cache_len, len(self.tokens) - 1))
            return None
        if len(part.steps) > limit:
            # the cache as a round of `limit` steps leaves it: every draft but the last fed
            kept = limit / len(part.steps)
            part.t_draft, part.t_encode = part.t_draft * kept, part.t_encode * kept
            part.forwards -= len(part.steps) - limit  # one forward per dropped step
            part.steps = part.steps[:limit]
            part.bits = sum(step.encoded.theoretical_bits for step in part.steps)
            self.model.truncate(min(self.model.cache_len, part.start + limit - 1))
        part.settings = s
        return part

    def head_start(self) -> tuple[DraftSettings, int] | None:
        """The next round's head start: the settings and the tokens of a round drafted ahead whose
        guess :meth:`commit` confirmed (None if there is none)."""
        if self._ahead is None:
            return None
        return self._ahead.round.settings, len(self._ahead.round.steps)

    # -- token trees ------------------------------------------------------------------------------------
    def _draft_tree(self, s: DraftSettings, depth: int) -> RoundDraft:
        config = s.tree[:depth]
        if config not in self._specs:
            self._specs[config] = TreeSpec.from_config(config)
        spec = self._specs[config]
        start = len(self.tokens)
        tree = draft_tree(self.model, spec, self.tokens, lambda q: self.encode(q, s),
                          stream(self.hello.seed, Purpose.DRAFT, start))
        block = self._block(tuple(tree.nodes[1:]), s, distributions=tuple(e.payload for e in tree.encoded),
                            tree_depth=spec.depth)
        return RoundDraft(block=block, settings=s, q_rows=[e.q_hat for e in tree.encoded],
                          theoretical_bits=sum(e.theoretical_bits for e in tree.encoded),
                          support_sizes=[e.support_size for e in tree.encoded], draft_seconds=tree.t_draft,
                          encode_seconds=tree.t_encode, start=start, tree=spec,
                          dropped=[e.dropped_mass for e in tree.encoded])

    # -- verdicts ---------------------------------------------------------------------------------------
    def resolve_dssd(self, rd: RoundDraft, verdict: Verdict) -> int | None:
        """DSSD device half: accept one of the edge's samples y ~ p_j, or None (fallback needed)."""
        generator = stream(self.hello.seed, Purpose.DSSD_RESOLVE, rd.start)
        return dssd.resolve(rd.q_rows[verdict.num_accepted], verdict, generator)

    def resolve_residual(self, rd: RoundDraft, verdict: Verdict, reply: ResidualReply) -> int | None:
        """A DSSD fallback's reply: from p_j's head and tail samples (None when those run out: ask for
        the whole p_j), or from the whole p_j. ValueError on a malformed reply."""
        q_j = rd.q_rows[verdict.num_accepted]
        if reply.is_head:
            return dssd.resolve_head(q_j, reply, stream(self.hello.seed, Purpose.DSSD_HEAD, rd.start))
        p_j = decode_target_probs(reply.target_probs, self.vocab_size)
        return dssd.residual(p_j, q_j, stream(self.hello.seed, Purpose.DSSD_RESIDUAL, rd.start))

    def commit(self, rd: RoundDraft, verdict: Verdict, next_token: int, *, dssd_correction: bool) -> list[int]:
        """Apply a verdict: keep the accepted prefix, roll the draft cache back, return new tokens."""
        if rd.tree is not None:
            return self._commit_tree(rd, verdict, next_token)
        n = verdict.num_accepted
        ids = list(rd.block.token_ids)
        if not 0 <= n <= len(ids) or verdict.round_id != rd.block.round_id:
            raise ValueError(f"verdict does not match round {rd.block.round_id}")
        new = ids[:n] + [int(next_token)]
        ahead, self._ahead = self._ahead, None
        if ahead is not None and n == len(ids) and int(next_token) == ahead.guess:
            self._ahead = ahead  # the guess was right: the cache already holds its context
        else:
            if ahead is not None:
                rd.ahead_discarded = len(ahead.round.steps)
            self.model.truncate(min(self.model.cache_len, len(self.tokens) + n))
        self.tokens.extend(new)
        if dssd_correction:
            self.pending_correction = int(next_token)
        if self.controller is not None and rd.settings.mode is Mode.CSQS:
            self.controller.on_verdict(n)
        return new

    def _commit_tree(self, rd: RoundDraft, verdict: Verdict, next_token: int) -> list[int]:
        spec = rd.tree
        path = list(verdict.accepted_nodes)
        if verdict.round_id != rd.block.round_id or not is_root_path(spec, path):
            raise ValueError(f"verdict path {path} is not a root path of round {rd.block.round_id}'s tree")
        nodes = (0, *rd.block.token_ids)
        new = [nodes[n] for n in path] + [int(next_token)]
        fed_until = spec.layer_offsets[spec.depth]  # the last layer never went through the drafter
        self.model.keep(path_cache_indices(len(self.tokens), path, fed_until))
        self.tokens.extend(new)
        if self.controller is not None and rd.settings.mode is Mode.CSQS:
            # C-SQS along the path (Alg. 1): one update per accepted position + the resampled one.
            used = [0, *path][: len(path) + 1]
            for node in used:
                if node < spec.num_internal:
                    self.controller.observe(rd.dropped[node])
            self.controller.on_verdict(sum(1 for n in used if n < spec.num_internal))
        return new

    # -- per-settings state ------------------------------------------------------------------------------
    def _codec(self, s: DraftSettings) -> CodecConfig | None:
        if s not in self._codecs:
            self._codecs[s] = s.codec(self.vocab_size)
        return self._codecs[s]

    def _ensure_controller(self, s: DraftSettings) -> None:
        """C-SQS keeps its threshold across rounds; new C-SQS parameters start a new controller."""
        if s.mode is not Mode.CSQS:
            return
        key = (s.csqs_alpha, s.csqs_eta, s.csqs_beta0)
        if key != self._controller_key:
            self.controller = ConformalController(*key)
            self._controller_key = key

    @property
    def threshold(self) -> float | None:
        """The C-SQS threshold beta now, or None outside C-SQS."""
        return self.controller.beta if self.controller is not None and self.settings.mode is Mode.CSQS else None

