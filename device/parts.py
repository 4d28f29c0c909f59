"""The parts a :class:`~specdec.device.session.DraftSession` is built from besides its drafter, its
Hello and its policy: how a position's draft is drawn (:class:`Sampler`), what a round runs with when
no policy plans it (:class:`Planner`), and who watches the session's work (:class:`Observer`).

Each part has the product's behaviour by default. Tests and benchmarks compose another one (to plant
a known bug, script each round's settings, record what was sent, time the drafter, cut the link at a
chosen moment) instead of overriding the session's methods, so what they exercise is the session's
own code with one named part swapped.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from specdec.common import verification as V
from specdec.common.distributions import race_token_unchecked
from specdec.common.protocol import DraftSettings, Hello, Verdict
from specdec.device.draft_model import DraftStep, EncodedQ, sample_step
from specdec.device.rounds import RoundDraft, RoundPlan


class Sampler:
    """How a draft token is drawn. Lossless only as the product draws: from exactly the decoded packet
    the edge verifies against (``sample``), or, in gumbel rounds, as the race of that q with the
    position's noise, the noise the edge races p with (``token_noise``: keyed by the position alone,
    as the edge's VerifierSession.token_noise)."""

    def sample(self, encoded: EncodedQ, generator: torch.Generator, position: int) -> DraftStep:
        """The draft at sequence index ``position`` from the round's own stream."""
        return sample_step(encoded, generator)

    def token_noise(self, seed: int, start: int, offset: int, vocab_size: int) -> torch.Tensor:  # [V] float64
        """The noise of sequence index ``start + offset`` (in a round that starts at ``start``)."""
        return V.token_noise(seed, start + offset, vocab_size)

    def race(self, encoded: EncodedQ, noise: torch.Tensor) -> DraftStep:
        """A gumbel draft: q raced with the position's noise, the draw the edge makes on p."""
        return DraftStep(race_token_unchecked(encoded.q_hat, noise), encoded)


class Planner:
    """What a round runs with when no policy (mode auto) plans it: the Hello's settings, and a broken
    round's retry repeats its plan (its random numbers may have been drawn: the lossless rule)."""

    def plan(self, hello: Hello, vocab_size: int, round_id: int) -> RoundPlan:
        """The plan of the round after ``round_id`` rounds on this stream."""
        return RoundPlan(hello.draft)

    def retry(self, plan: RoundPlan) -> RoundPlan:
        return plan


class Observer:
    """Watches a session's work and changes nothing (every method a no-op here). Round events go to
    the session's listeners; this sees what they do not: the drafter's positions and each round
    as it leaves."""

    def measure(self, q: torch.Tensor, encoded: EncodedQ, settings: DraftSettings) -> Any:
        """A record of one encoded position, kept with its round (only rounds sent reach a listener,
        not those drafted ahead on a wrong guess); ignored where mode auto measures."""
        return None

    def step(self, seconds: float) -> None:
        """A chain position was drafted in ``seconds`` (forward, encoding, sampling)."""

    def sent(self, rd: RoundDraft) -> None:
        """A drafted round is ready to go to the edge."""

    def fallback(self, rd: RoundDraft, verdict: Verdict) -> None:
        """A DSSD rejection needs a fallback round trip (the verdict did not settle it)."""

    def edge_token(self, token: int) -> None:
        """An edge-only round's token arrived and was committed."""


@dataclass(frozen=True)
class SessionParts:
    sampler: Sampler = field(default_factory=Sampler)
    planner: Planner = field(default_factory=Planner)
    observer: Observer = field(default_factory=Observer)
    # False: a round drafted ahead is drafted in full whatever the verdict's timing, as behind a slow
    # edge (tests use it to exercise whole rounds drafted ahead against a fast one)
    ahead_stops_at_verdict: bool = True
