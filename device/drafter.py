"""The device's per-session drafter: draft KV cache, drafting with compression, rollback.

No grpc here: :mod:`specdec.device.client` moves :class:`DraftBlock` / :class:`Verdict` over the
stream. Lossless rule (DESIGN.md): each draft token is sampled from exactly the distribution the edge
will verify against, i.e. the DECODED packet, so the device encodes, decodes, then samples.

State invariant (same as the edge's): ``tokens`` is the verified sequence; the KV cache holds
``tokens[:cache_len]`` plus, during a round, the drafted tokens fed so far.
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

import torch

from specdec.common import verification as V
from specdec.common.budget import MIN_DRAFT_LEN, fits_budget
from specdec.common.codecs import (Mode, decode_distribution, dssd_theoretical_bits,
                                   encode_distribution, encode_dssd_scalars)
from specdec.common.conformal import ConformalController
from specdec.common.distributions import densify, sample_token, sample_token_gumbel
from specdec.common.engine import codec_config, model_probs
from specdec.common.modeling import CachedLM, LoadedModel
from specdec.common.protocol import DraftBlock, Hello, Verdict
from specdec.common.streams import Purpose, stream
from specdec.common.tree import TreeSpec
from specdec.common.treeplan import draft_layer_inputs, layer_node_ids, path_cache_indices

# Modes whose chain rounds carry no state but the cache and the tokens: their rounds can be drafted
# ahead (C-SQS updates its threshold while drafting, DSSD resolves on the device, trees and bit
# budgets shape the round: those draft after each verdict). Every round of every mode draws from
# its own stream (streams.py), keyed by where it starts.
DRAFT_AHEAD_MODES = (Mode.DENSE, Mode.TSLT, Mode.KSQS)


@dataclass
class RoundDraft:
    """One round's draft and what the device keeps to finish it."""
    block: DraftBlock
    q_rows: list[torch.Tensor]      # [V] float64 per position (tree: per internal node): sampled-from q
    theoretical_bits: int
    support_sizes: list[int]
    draft_seconds: float            # drafter forwards + sampling
    encode_seconds: float           # codec encode + decode
    start: int = 0                  # sequence position of the round's first draft token (its streams' key)
    tree: TreeSpec | None = None    # the round's tree (a prefix of the configured one)
    dropped: list[float] = field(default_factory=list)  # C-SQS: dropped mass per encoded q

    @property
    def positions(self) -> int:
        """Draft positions (tree depth for trees): the denominator of the acceptance rate."""
        return self.tree.depth if self.tree is not None else len(self.block.token_ids)


@dataclass
class _Partial:
    """A chain round being drafted: what is sampled so far, and the generator it draws from."""
    start: int                      # sequence position of the round's first draft token
    generator: torch.Generator
    ids: list[int] = field(default_factory=list)
    payloads: list[bytes] = field(default_factory=list)
    q_rows: list[torch.Tensor] = field(default_factory=list)
    sizes: list[int] = field(default_factory=list)
    bits: int = 0
    t_draft: float = 0.0
    t_encode: float = 0.0


@dataclass
class _Ahead:
    """The next round, drafted while the edge verifies the current one, on the guess that every
    draft is accepted and the bonus token is ``guess`` (:meth:`DraftSession._guess_bonus`)."""
    guess: int
    partial: _Partial


@dataclass
class DeviceStats:
    rounds: int = 0
    draft_tokens: int = 0           # tokens (tree: nodes) sent
    draft_positions: int = 0        # chain: = draft_tokens; tree: sum of depths
    accepted_tokens: int = 0
    positions_verified: int = 0     # positions the edge tested: accepted + one per round that rejected
    theoretical_uplink_bits: int = 0
    draft_seconds: float = 0.0
    encode_seconds: float = 0.0
    accepted_per_position: list[int] = field(default_factory=list)
    drafted_per_position: list[int] = field(default_factory=list)  # rounds that drafted position i
    ahead_rounds_used: int = 0      # rounds whose drafting began while the edge verified the last one
    ahead_tokens_used: int = 0      # draft tokens sampled ahead and sent
    ahead_tokens_discarded: int = 0  # sampled ahead on a wrong guess (never sent)


class DraftSession:
    """Drafts rounds for one generation and applies the edge's verdicts. Blocking (torch)."""

    def __init__(self, drafter: LoadedModel, hello: Hello, *, draft_ahead: bool = False):
        self.hello = hello
        self.vocab_size = drafter.vocab_size
        self.codec = None if hello.mode is Mode.DSSD else codec_config(hello.mode, hello.draft, self.vocab_size)
        self.lm = CachedLM(drafter.model, drafter.device)
        d = hello.draft
        self.controller = (ConformalController(d.csqs_alpha, d.csqs_eta, d.csqs_beta0)
                           if hello.mode is Mode.CSQS else None)
        self.tokens: list[int] = []
        self.round_id = 0
        self.stats = DeviceStats()
        self.pending_correction: int | None = None
        self.tree = tuple(hello.draft.tree)
        self._specs: dict[int, TreeSpec] = {}
        # Rounds that may be drafted ahead feed the last draft + bonus one token per forward: with
        # the round's own stream, a round drafted ahead is then bit for bit the round that would be
        # drafted after the verdict, so drafting ahead changes timing only, never tokens.
        self.ahead_eligible = (not self.tree and hello.mode in DRAFT_AHEAD_MODES and not hello.draft.bit_budget)
        self.draft_ahead_enabled = draft_ahead and self.ahead_eligible
        self._ahead: _Ahead | None = None

    def start(self, prompt_ids: list[int]) -> None:
        self.tokens = list(prompt_ids)

    def abort_round(self) -> None:
        """The stream broke before the verdict: drop drafted state, keep the verified prefix.

        The next stream re-sends the whole verified prefix (which already holds any DSSD correction)
        and numbers its rounds from 1 again.
        """
        # Keep the cache strictly behind the verified tokens: the next forward needs an input.
        self.lm.truncate(min(self.lm.cache_len, len(self.tokens) - 1))
        if self.controller is not None:
            self.controller.abort_round()
        self.pending_correction = None
        self.round_id = 0
        self._ahead = None

    def draft(self, max_tokens: int) -> RoundDraft:
        """Draft up to ``min(draft_len, max_tokens)`` tokens (at least one), encoding each q."""
        if self.tree:
            return self._draft_tree(max(1, min(len(self.tree), max_tokens)))
        limit = self._chain_limit(max_tokens)
        if self.controller is not None:
            self.controller.start_round()
        part = self._take_ahead(limit) or self._new_partial(len(self.tokens))
        while len(part.ids) < limit and self._draft_step(part, self.tokens):
            pass
        return self._round(part)

    def _chain_limit(self, max_tokens: int) -> int:
        return max(MIN_DRAFT_LEN, min(self.hello.draft.draft_len, max_tokens))

    def _new_partial(self, start: int) -> _Partial:
        return _Partial(start, self._stream(Purpose.DRAFT, start))

    def _stream(self, purpose: Purpose, start: int) -> torch.Generator:
        """The generator of one of this session's streams (streams.py's table says which is which)."""
        return stream(self.hello.seed, purpose, start)

    def _draft_step(self, part: _Partial, base: list[int]) -> bool:
        """Sample and encode one more draft token after ``base + part.ids``; False if the bit budget
        says the round ends before it."""
        t0 = time.perf_counter()
        q = self._next_q(base + part.ids)
        t1 = time.perf_counter()
        token, row, payload, nbits, support, dropped = self._encode_and_sample(q, part.generator)
        t2 = time.perf_counter()
        part.t_draft += t1 - t0
        part.t_encode += t2 - t1
        if self.hello.draft.bit_budget and len(part.ids) >= MIN_DRAFT_LEN and \
                not fits_budget(part.bits, nbits, self.hello.draft.bit_budget):
            return False  # this position would overflow the round's bit budget B (SQS sec. 4)
        if self.controller is not None:
            self.controller.observe(dropped)
        part.ids.append(token)
        part.payloads.append(payload)
        part.q_rows.append(row)
        part.sizes.append(support)
        part.bits += nbits
        return True

    # -- drafting ahead: the next round while the edge verifies this one -----------------------------
    def draft_ahead(self, rd: RoundDraft, max_tokens: int, stop: threading.Event) -> None:
        """Called (in a worker thread) once ``rd`` is sent: guess that all of it is accepted and what
        the bonus token is (:meth:`_guess_bonus`), and draft the next round from there until ``stop``
        is set (when the verdict arrives) or the round is full. :meth:`commit` keeps the work if
        the guess was right and drops it otherwise. ``max_tokens``: what the next :meth:`draft`
        call will be given if the guess is right.

        Lossless: the round drafted ahead is exactly the round :meth:`draft` would produce after the
        verdict (same context, same per-round stream, same forward calls), so this only moves
        work into time the device would otherwise spend waiting.
        """
        if not self.draft_ahead_enabled or rd.tree is not None or stop.is_set():
            return
        seq = self.tokens + list(rd.block.token_ids)
        part = self._new_partial(len(seq) + 1)
        t0 = time.perf_counter()
        logits = self.lm.forward(seq[self.lm.cache_len:], num_logits=1)[0]   # feeds the last draft token
        part.t_draft += time.perf_counter() - t0
        self._ahead = _Ahead(guess=self._guess_bonus(logits, len(seq)), partial=part)
        base = seq + [self._ahead.guess]
        limit = self._chain_limit(max_tokens)
        while len(part.ids) < limit and not stop.is_set() and self._draft_step(part, base):
            pass

    def _guess_bonus(self, logits: torch.Tensor, position: int) -> int:
        """The edge's likely bonus token at sequence index ``position``. With the coupled bonus the
        edge draws it as ``argmax log p + g`` with noise g both sides derive from the seed and the
        position (verification.bonus_noise); the same draw on the drafter's q is the edge's token
        with probability >= (1 - TV) / (1 + TV). Otherwise (and at T = 0) the drafter's argmax."""
        if not self.hello.draft.coupled_bonus or self.hello.temperature == 0:
            return int(logits.argmax())
        q = model_probs(logits.cpu(), self.hello.temperature)
        return sample_token_gumbel(q, V.bonus_noise(self.hello.seed, position, self.vocab_size))

    def _take_ahead(self, limit: int) -> _Partial | None:
        """The round drafted ahead, if :meth:`commit` kept it and it fits this round."""
        ahead, self._ahead = self._ahead, None
        if ahead is None:
            return None
        part = ahead.partial
        if part.start != len(self.tokens) or len(part.ids) > limit:
            self.lm.truncate(min(self.lm.cache_len, len(self.tokens)))  # cannot happen; stay safe
            return None
        self.stats.ahead_rounds_used += 1
        self.stats.ahead_tokens_used += len(part.ids)
        return part

    def _round(self, part: _Partial) -> RoundDraft:
        self.round_id += 1
        ids, bits = part.ids, part.bits
        if self.hello.mode is Mode.DSSD:
            scalars = torch.stack([row[t] for row, t in zip(part.q_rows, ids)])  # float64: bit for bit
            block = DraftBlock(round_id=self.round_id, token_ids=tuple(ids),
                               dssd_scalars=encode_dssd_scalars(scalars),
                               correction_token=self.pending_correction)
            bits = dssd_theoretical_bits(len(ids), self.vocab_size)
        else:
            block = DraftBlock(round_id=self.round_id, token_ids=tuple(ids), distributions=tuple(part.payloads))
        self.pending_correction = None
        return RoundDraft(block=block, q_rows=part.q_rows, theoretical_bits=bits, support_sizes=part.sizes,
                          draft_seconds=part.t_draft, encode_seconds=part.t_encode, start=part.start)

    # -- token trees (TSLT Alg. 7: one batched forward per layer, tree attention) -------------------
    def _draft_tree(self, depth: int) -> RoundDraft:
        if depth not in self._specs:
            self._specs[depth] = TreeSpec.from_config(self.tree[:depth])
        spec = self._specs[depth]
        if self.controller is not None:
            self.controller.start_round()  # one threshold per round; updated along the path later
        nodes = [0] * spec.num_nodes
        steps = []
        generator = self._stream(Purpose.DRAFT, len(self.tokens))
        t_draft = t_encode = 0.0
        t0 = time.perf_counter()
        q_layer = [self._next_q(self.tokens)]  # layer 0: the root's q, after the prefix
        t_draft += time.perf_counter() - t0
        for layer in range(spec.depth):
            parents = range(spec.layer_offsets[layer], spec.layer_offsets[layer + 1])
            for parent, q in zip(parents, q_layer):
                t1 = time.perf_counter()
                step = self._encode_q(q)
                kids = spec.children(parent)
                t2 = time.perf_counter()
                picks = V.sample_candidates(step[1], len(kids), generator, with_replacement=True)
                nodes[kids.start:kids.stop] = picks.tolist()
                t_encode += t2 - t1
                t_draft += time.perf_counter() - t2
                steps.append(step)
            if layer + 1 < spec.depth:
                t3 = time.perf_counter()
                q_layer = self._tree_layer_qs(spec, layer + 1, nodes)
                t_draft += time.perf_counter() - t3
        return self._tree_round(spec, nodes, steps, t_draft, t_encode)

    def _tree_layer_qs(self, spec: TreeSpec, layer: int, nodes: list[int]) -> list[torch.Tensor]:
        ids = layer_node_ids(spec, layer)
        attend, positions = draft_layer_inputs(spec, layer, len(self.tokens))
        logits = self.lm.forward_masked([nodes[n] for n in ids], attend, positions, len(ids))
        return list(model_probs(logits.cpu(), self.hello.temperature))

    def _tree_round(self, spec, nodes, steps, t_draft, t_encode) -> RoundDraft:
        self.round_id += 1
        payloads, q_rows, bits, sizes, dropped = (list(x) for x in zip(*steps))
        block = DraftBlock(round_id=self.round_id, token_ids=tuple(nodes[1:]), distributions=tuple(payloads),
                           tree_depth=spec.depth)
        return RoundDraft(block=block, q_rows=q_rows, theoretical_bits=sum(bits), support_sizes=sizes,
                          draft_seconds=t_draft, encode_seconds=t_encode, start=len(self.tokens), tree=spec,
                          dropped=dropped)

    def _encode_q(self, q: torch.Tensor):
        """(payload, decoded q_hat [V] float64, bits, support size, dropped mass)."""
        threshold = self.controller.beta if self.controller is not None else None
        enc = encode_distribution(q.float(), self.codec, threshold=threshold)
        q_hat = densify(decode_distribution(enc.payload, self.codec))  # exactly what the edge decodes
        return enc.payload, q_hat, enc.theoretical_bits, enc.support_size, enc.dropped_mass

    def _next_q(self, seq: list[int]) -> torch.Tensor:
        """The drafter's distribution after ``seq`` (verified tokens + drafts): [V] float64."""
        pending = seq[self.lm.cache_len:]
        if self.ahead_eligible and len(pending) == 2:
            # the last draft token + the bonus: one call each, as drafting ahead feeds them
            self.lm.forward(pending[:1], num_logits=1)
            pending = pending[1:]
        logits = self.lm.forward(pending, num_logits=1)[0]
        return model_probs(logits.cpu(), self.hello.temperature)

    def _encode_and_sample(self, q: torch.Tensor, generator: torch.Generator):
        """(token, q row it was sampled from, payload, bits, support size, dropped mass)."""
        if self.hello.mode is Mode.DSSD:
            token = sample_token(q, generator)
            return token, q, b"", 0, self.vocab_size, 0.0
        payload, q_hat, bits, support, dropped = self._encode_q(q)
        token = sample_token(q_hat, generator)
        return token, q_hat, payload, bits, support, dropped

    # -- verdicts ----------------------------------------------------------------------------------
    def resolve_dssd(self, rd: RoundDraft, verdict: Verdict) -> int | None:
        """DSSD device half: accept one of the edge's samples y ~ p_j, or None (fallback needed)."""
        q_j = rd.q_rows[verdict.num_accepted]
        samples = torch.tensor(verdict.reject_samples, dtype=torch.long)
        probs = torch.tensor(verdict.reject_sample_probs, dtype=torch.float64)
        return V.dssd_device_resolve(samples, probs, q_j, self._stream(Purpose.DSSD_RESOLVE, rd.start))

    def residual_from_full(self, rd: RoundDraft, verdict: Verdict, p_j: torch.Tensor) -> int:
        q_j = rd.q_rows[verdict.num_accepted]
        return V.dssd_device_residual(p_j, q_j, self._stream(Purpose.DSSD_RESIDUAL, rd.start))

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
                self.stats.ahead_tokens_discarded += len(ahead.partial.ids)
            self.lm.truncate(min(self.lm.cache_len, len(self.tokens) + n))
        self.tokens.extend(new)
        if dssd_correction:
            self.pending_correction = int(next_token)
        if self.controller is not None:
            self.controller.on_verdict(n)
        self._count(rd, n)
        return new

    def _commit_tree(self, rd: RoundDraft, verdict: Verdict, next_token: int) -> list[int]:
        spec = rd.tree
        path = list(verdict.accepted_nodes)
        if verdict.round_id != rd.block.round_id or not _is_root_path(spec, path):
            raise ValueError(f"verdict path {path} is not a root path of round {rd.block.round_id}'s tree")
        nodes = (0, *rd.block.token_ids)
        new = [nodes[n] for n in path] + [int(next_token)]
        fed_until = spec.layer_offsets[spec.depth]  # the last layer never went through the drafter
        self.lm.keep(path_cache_indices(len(self.tokens), path, fed_until))
        self.tokens.extend(new)
        if self.controller is not None:
            # C-SQS along the path (Alg. 1): one update per accepted position + the resampled one.
            used = [0, *path][: len(path) + 1]
            for node in used:
                if node < spec.num_internal:
                    self.controller.observe(rd.dropped[node])
            self.controller.on_verdict(sum(1 for n in used if n < spec.num_internal))
        self._count(rd, len(path))
        return new

    def _count(self, rd: RoundDraft, n: int) -> None:
        s = self.stats
        s.rounds += 1
        s.draft_positions += rd.positions
        s.draft_tokens += len(rd.block.token_ids)
        s.accepted_tokens += n
        s.positions_verified += n + (n < rd.positions)
        s.theoretical_uplink_bits += rd.theoretical_bits
        s.draft_seconds += rd.draft_seconds
        s.encode_seconds += rd.encode_seconds
        while len(s.accepted_per_position) < rd.positions:
            s.accepted_per_position.append(0)
            s.drafted_per_position.append(0)
        for i in range(rd.positions):
            s.drafted_per_position[i] += 1
        for i in range(n):
            s.accepted_per_position[i] += 1


def _is_root_path(spec: TreeSpec, path: list[int]) -> bool:
    """True iff ``path`` walks from the root down parent -> child (node indices, depth order)."""
    parent = 0
    for node in path:
        if not 0 < node < spec.num_nodes or int(spec.parents[node]) != parent:
            return False
        parent = node
    return True
