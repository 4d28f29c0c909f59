"""The drafter's model and KV cache for one session, and one draft position's encode-then-sample step.

State invariant (the same as the edge's): the session's ``tokens`` are the verified sequence; the
cache holds a prefix of them plus, during a round, the drafted tokens fed so far.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from specdec.common.adjust import NO_ADJUST, LogitAdjust
from specdec.common.grammar import Grammar
from specdec.common.codecs import CodecConfig, decode_distribution, encode_distribution
from specdec.common.distributions import densify, sample_token
from specdec.common.modeling import CachedLM, LoadedModel
from specdec.common.idpack import id_bits
from specdec.common.protocol import Hello
from specdec.common.sampling import TargetLaw, filter_probs, model_probs
from specdec.common.shaping import Shaping
from specdec.common.tree import TreeSpec
from specdec.common.treeplan import draft_layer_inputs, layer_node_ids


class DraftModel:
    """q after a sequence, with the cache rolled forward and back. Blocking (torch).

    q is the drafter's tempered softmax after the target law's bias, penalties and grammar, shaped as
    the edge shapes p (common/shaping.py, from the same prefix): drafts then stay where the target's law
    puts its mass (never outside its grammar), so acceptance holds up; any q is lossless, as the edge
    verifies against its own law."""

    def __init__(self, drafter: LoadedModel, temperature: float, adjust: LogitAdjust = NO_ADJUST,
                 grammar: Grammar | None = None):
        self.lm = CachedLM(drafter.model, drafter.device)
        self.temperature = temperature
        # its prompt_len is set by the session: of the sequences q is asked after, the prompt
        self.shaping = Shaping(TargetLaw(temperature, adjust=adjust), grammar, drafter.tokenizer,
                               drafter.vocab_size, drafter.eos_token_ids)
        self.vocab_size = drafter.vocab_size
        self.forwards = 0   # chain forwards so far: the drafter's cost is per forward, not per token

    @property
    def cache_len(self) -> int:
        return self.lm.cache_len

    def q_after(self, seq: list[int], *, one_token_per_forward: bool = False) -> torch.Tensor:
        """The drafter's distribution after ``seq`` (verified tokens + drafts): [V] float64.

        ``one_token_per_forward``: when two tokens are pending (the last draft of a fully accepted
        round and its bonus), feed them one call each, as drafting ahead does, so that a round
        drafted after the verdict is bit for bit the round drafted ahead."""
        pending = seq[self.lm.cache_len:]
        if one_token_per_forward and len(pending) == 2:
            self.lm.forward(pending[:1], num_logits=1)
            self.forwards += 1
            pending = pending[1:]
        self.forwards += 1
        return self.probs(self.shaped(self.lm.forward(pending, num_logits=1), seq)[0])

    def feed(self, seq: list[int]) -> torch.Tensor:
        """Feed what ``seq`` has beyond the cache; the last position's logits, shaped: [V]."""
        self.forwards += 1
        return self.shaped(self.lm.forward(seq[self.lm.cache_len:], num_logits=1), seq)[0]

    def feed_agreement(self, tokens: list[int], upto: int) -> list[int]:
        """Feed ``tokens[:upto]`` beyond the cache (``upto`` < len(tokens)); for each position fed whose
        next token is generated (not the prompt's: a session's first catch-up reads the prompt too), 1
        where the drafter's greedy choice there (its shaped logits' argmax) is that token, else 0. At
        T = 0 that is whether a draft there would have been accepted."""
        start, rows = self._feed_rows(tokens, upto)
        return [int(b == tokens[start + r]) for r, b in enumerate(rows.argmax(dim=-1).tolist())]

    def feed_token_probs(self, tokens: list[int], upto: int) -> list[tuple[int, float]]:
        """As :meth:`feed_agreement`, at T > 0: (sequence index, q of the token there) for each generated
        token after a position fed, q the drafter's law as its drafts are drawn (:meth:`probs`)."""
        start, rows = self._feed_rows(tokens, upto)
        if not len(rows):
            return []
        ids = torch.tensor(tokens[start:start + len(rows)], dtype=torch.long)
        q = self.probs(rows)[torch.arange(len(rows)), ids]  # [n]
        return list(zip(range(start, start + len(rows)), q.tolist()))

    def _feed_rows(self, tokens: list[int], upto: int) -> tuple[int, torch.Tensor]:
        """Feed ``tokens[:upto]`` beyond the cache: (the sequence index of the first generated token a row
        predicts, the shaped logits of the rows that predict generated tokens [n, V])."""
        c0 = self.lm.cache_len
        pending = tokens[c0:upto]
        assert pending and upto < len(tokens), (c0, upto, len(tokens))
        self.forwards += 1
        logits = self.lm.forward(pending, num_logits=len(pending))  # [n, V]
        rows = self.shaped(logits, tokens[:c0], [pending[:r + 1] for r in range(len(pending))])
        first = max(0, self.shaping.prompt_len - c0 - 1)  # rows before it predict the prompt's own tokens
        return c0 + first + 1, rows[first:]

    def shaped(self, logits: torch.Tensor,  # [n, V]
               seq: list[int], paths: list[list[int]] | None = None) -> torch.Tensor:  # [n, V]
        """The law's bias, penalties and grammar on the logits of the positions after ``seq`` (+
        ``paths[r]`` for row r: a tree node's path), as the edge shapes its rows."""
        return self.shaping.shaped(logits, seq, paths if paths is not None else [[]] * logits.shape[0])

    def probs(self, logits: torch.Tensor) -> torch.Tensor:  # [..., V] -> [..., V] float64
        return model_probs(logits.cpu(), self.temperature)

    def tree_layer_qs(self, spec: TreeSpec, layer: int, nodes: list[int], prefix: list[int]) -> list[torch.Tensor]:
        """q of every node of ``layer`` after the verified ``prefix`` (one batched forward with tree
        attention): [V] float64 each."""
        ids = layer_node_ids(spec, layer)
        attend, positions = draft_layer_inputs(spec, layer, len(prefix))
        logits = self.lm.forward_masked([nodes[n] for n in ids], attend, positions, len(ids))
        paths = spec.paths(nodes) if self.shaping.active else None
        return list(self.probs(self.shaped(logits, prefix, [paths[n] for n in ids] if paths else None)))

    def truncate(self, length: int) -> None:
        self.lm.truncate(length)

    def keep(self, indices: list[int]) -> None:
        self.lm.keep(indices)


@dataclass(frozen=True)
class EncodedQ:
    """One draft distribution as sent, and the law the device samples from (its decoding)."""
    payload: bytes                  # the codec packet (empty in DSSD)
    q_hat: torch.Tensor             # [V] float64: exactly what the edge decodes (DSSD: q itself)
    theoretical_bits: int           # the papers' bit count for this packet
    support_size: int               # K transmitted (V for dense and DSSD)
    dropped_mass: float             # q outside the sent support (C-SQS observes it)


def encode_q(q: torch.Tensor, codec: CodecConfig | None, threshold: float | None = None) -> EncodedQ:
    """Encode q [V] with ``codec`` and decode it again: the device samples from the decoded packet,
    which is what the edge verifies against (lossless whatever the compression). ``codec`` None
    (DSSD) sends no distribution: the device samples from q itself and sends q(x) later."""
    if codec is None:
        return EncodedQ(b"", q, 0, q.numel(), 0.0)
    enc = encode_distribution(q.float(), codec, threshold=threshold)
    q_hat = densify(decode_distribution(enc.payload, codec))
    return EncodedQ(enc.payload, q_hat, enc.theoretical_bits, enc.support_size, enc.dropped_mass)


@dataclass(frozen=True)
class DraftStep:
    """One drafted position: the token and the packet it was sampled from."""
    token: int
    encoded: EncodedQ


def gumbel_q(q: torch.Tensor, hello: Hello, vocab_size: int) -> EncodedQ:
    """A gumbel round's q [V]: the drafter's, with the target's own top-k / top-p applied (the coupling
    is tighter the closer q is to the filtered target; the output never depends on q). Nothing of it is
    sent: the packet is the token id alone."""
    q_hat = filter_probs(q, hello.target_top_k, hello.target_top_p, hello.target_min_p) if hello.temperature > 0 else q
    return EncodedQ(b"", q_hat, id_bits(vocab_size), 0, 0.0)


def sample_step(encoded: EncodedQ, generator: torch.Generator) -> DraftStep:
    return DraftStep(sample_token(encoded.q_hat, generator), encoded)
