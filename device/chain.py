"""Chain rounds on the device: drafting position by position, and drafting the next round ahead.

Drafting ahead: while the edge verifies round r, the device drafts round r + 1 on the guess that all
of r is accepted and what the bonus token is (:func:`guess_bonus`). The round drafted ahead is bit
for bit the round that would be drafted after the verdict (same context, same per-round stream, same
forward calls), so a right guess only moves work into time spent waiting, and a wrong one is
dropped unsent.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from specdec.common import verification as V
from specdec.common.budget import MIN_DRAFT_LEN, fits_budget
from specdec.common.settings import Mode
from specdec.common.distributions import sample_token_gumbel
from specdec.common.protocol import DraftSettings
from specdec.common.sampling import model_probs
from specdec.device.draft_model import DraftStep

# Modes whose chain rounds carry no state but the cache and the tokens: their rounds can be drafted
# ahead (C-SQS updates its threshold while drafting, trees and bit budgets shape the round: those
# draft after each verdict). DSSD too: a round drafted ahead guesses a full accept, where DSSD needs
# nothing of the device but the bonus, drawn coupled as in the other chains.
DRAFT_AHEAD_MODES = (Mode.DENSE, Mode.TSLT, Mode.KSQS, Mode.DSSD)


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
    bits: int = 0                       # theoretical uplink bits so far
    t_draft: float = 0.0                # drafter forwards + sampling
    t_encode: float = 0.0               # codec encode + decode
    forwards: int = 0                   # drafter forwards in t_draft (one per token, plus feeding the
                                        # last draft and the bonus one at a time after a full accept)
    drafted_ahead: bool = False         # its drafting began while the edge verified the last round

    @property
    def ids(self) -> list[int]:
        return [s.token for s in self.steps]

    def fits(self, bits: int) -> bool:
        """Whether one more position of ``bits`` stays within the bit budget B (SQS section 4)."""
        budget = self.settings.bit_budget
        return not budget or len(self.steps) < MIN_DRAFT_LEN or fits_budget(self.bits, bits, budget)

    def add(self, step: DraftStep) -> None:
        self.steps.append(step)
        self.bits += step.encoded.theoretical_bits


@dataclass
class Ahead:
    """The next round, drafted while the edge verifies the current one, on the guess that every draft
    is accepted and that the bonus token is ``guess``."""
    guess: int
    round: ChainRound


def guess_bonus(logits: torch.Tensor, position: int, temperature: float, seed: int, coupled: bool,
                vocab_size: int) -> int:
    """The edge's likely bonus token at sequence index ``position``. With the coupled bonus the edge
    draws it as ``argmax log p + g`` with noise g both sides derive from the seed and the position
    (verification.bonus_noise); the same draw on the drafter's q is the edge's token with probability
    >= (1 - TV) / (1 + TV). Otherwise (and at T = 0) the drafter's argmax."""
    if not coupled or temperature == 0:
        return int(logits.argmax())
    q = model_probs(logits.cpu(), temperature)
    return sample_token_gumbel(q, V.bonus_noise(seed, position, vocab_size))
