"""What the round kinds (:mod:`.chain`, :mod:`.tree_round`, :mod:`.edge_only`) need of the session they
draft for: :class:`Drafting`, one session's tools for drafting a position (its drafter, codecs,
sampler, measurement), and :class:`RoundHost`, the few pieces of session state a round kind reads or
sets. The round kinds import this module and never the session, which imports them."""
from __future__ import annotations

from typing import Any, Protocol

import torch

from specdec.common import verification as V
from specdec.common.codecs import CodecConfig
from specdec.common.distributions import sample_token_gumbel
from specdec.common.modeling import LoadedModel
from specdec.common.modes import Mode
from specdec.common.protocol import DraftBlock, DraftSettings, Hello
from specdec.common.sampling import model_probs
from specdec.common.tree import TreeSpec
from specdec.device.conformal import SessionThreshold
from specdec.device.draft_model import DraftModel, DraftStep, EncodedQ, encode_q, gumbel_q
from specdec.device.parts import SessionParts
from specdec.device.rounds import RoundDraft


class Drafting:
    """One session's tools for drafting a position: the drafter and its cache, the codec of each
    settings, the C-SQS threshold, the sampler, and the measurement a round carries to its event (mode
    auto's, else the observer's). Blocking (torch)."""

    def __init__(self, drafter: LoadedModel, hello: Hello, parts: SessionParts, policy=None):
        self.hello = hello
        self.vocab_size = drafter.vocab_size
        self.model = DraftModel(drafter, hello.temperature, hello.adjust, hello.grammar)
        self.parts = parts
        self.policy = policy
        self.csqs = SessionThreshold()  # C-SQS's threshold across rounds (SQS Alg. 1)
        self._codecs: dict[DraftSettings, CodecConfig | None] = {}
        self._specs: dict[tuple[int, ...], TreeSpec] = {}
        # at T > 0, log p of the tokens edge-only rounds streamed, by sequence index, until mode auto's
        # shadow reads them (edge_only.catch_up)
        self.edge_logp: dict[int, float] = {}

    def encode(self, q: torch.Tensor, settings: DraftSettings) -> EncodedQ:
        """The packet of q [V] with these settings, and the law the draft is drawn from (its decoding)."""
        if settings.mode is Mode.GUMBEL:
            return gumbel_q(q, self.hello, self.vocab_size)
        if settings not in self._codecs:
            self._codecs[settings] = settings.codec(self.vocab_size)
        return encode_q(q, self._codecs[settings], self.csqs.threshold(settings))

    def measure(self, q: torch.Tensor, encoded: EncodedQ, settings: DraftSettings) -> Any:
        """The record of one encoded q kept with its round, handed on in the round's event (never
        before its verdict): mode auto's measurement, else the observer's."""
        if self.policy is not None:
            return self.policy.measure_q(q, encoded.q_hat, settings)
        return self.parts.observer.measure(q, encoded, settings)

    def sample(self, encoded: EncodedQ, settings: DraftSettings, generator: torch.Generator, start: int,
               offset: int) -> DraftStep:
        """The draft at sequence index ``start + offset``: a gumbel round's is q's race with the
        position's noise (not the round's stream), every other round's a draw from its stream."""
        if settings.mode is Mode.GUMBEL:
            return self.parts.sampler.race(encoded, self.token_noise(start, offset))
        return self.parts.sampler.sample(encoded, generator, start + offset)

    def token_noise(self, start: int, offset: int) -> torch.Tensor:  # [V] float64
        """The noise of sequence index ``start + offset``. At T = 0 q is one-hot: none drawn."""
        if self.hello.temperature == 0:
            return torch.ones(self.vocab_size, dtype=torch.float64)
        return self.parts.sampler.token_noise(self.hello.seed, start, offset, self.vocab_size)

    def guess_bonus(self, logits: torch.Tensor, rd: RoundDraft, position: int) -> int:
        """The edge's likely bonus token after ``rd`` (at sequence index ``position``): in gumbel rounds
        the race of the drafter's q with the position's noise, as every gumbel draft; in the other
        chains the coupled bonus's guess (:func:`coupled_guess`)."""
        if rd.settings.mode is Mode.GUMBEL:
            encoded = gumbel_q(self.model.probs(logits), self.hello, self.vocab_size)
            return self.parts.sampler.race(encoded, self.token_noise(rd.start, position - rd.start)).token
        return coupled_guess(logits, position, self.hello.temperature, self.hello.seed, rd.settings.coupled,
                             self.vocab_size)

    def tree_spec(self, config: tuple[int, ...]) -> TreeSpec:
        if config not in self._specs:
            self._specs[config] = TreeSpec.from_config(config)
        return self._specs[config]


def coupled_guess(logits: torch.Tensor, position: int, temperature: float, seed: int, coupled: bool,
                  vocab_size: int) -> int:
    """The edge's likely bonus token at sequence index ``position``. With the coupled bonus the edge
    draws it as ``argmax log p + g`` with noise g both sides derive from the seed and the position
    (verification.bonus_noise); the same draw on the drafter's q is the edge's token with probability
    >= (1 - TV) / (1 + TV). Otherwise (and at T = 0) the drafter's argmax."""
    if not coupled or temperature == 0:
        return int(logits.argmax())
    q = model_probs(logits.cpu(), temperature)
    return sample_token_gumbel(q, V.bonus_noise(seed, position, vocab_size))


class RoundHost(Protocol):
    """The session state a round kind reads or sets while it drafts."""
    tokens: list[int]            # the verified sequence
    ahead: Any                   # chain.Ahead | None: the next round, drafted ahead
    drafting: Drafting
    round_id: int                # rounds numbered on this stream

    def block(self, ids: tuple[int, ...], s: DraftSettings, **payload) -> DraftBlock: ...

    def drop_drafted(self) -> None: ...
