"""Draft modes: how a round is drafted and what its uplink carries, and the sets of modes that share a
trait. Its own module because everything that handles a round names a mode (settings, codecs, wire,
both sides), while the settings table and the codecs depend on each other's types only through it.
Pure: no I/O, no torch.
"""
from __future__ import annotations

import enum


class Mode(str, enum.Enum):
    """How a round is drafted and what its uplink carries."""
    DENSE = "dense"  # full distribution, TSLT eq. (2)-(3) baseline
    TSLT = "tslt"  # truncated sparse logits, TSLT section 3.2
    KSQS = "ksqs"  # top-K + lattice, SQS section 2
    CSQS = "csqs"  # conformal threshold + lattice, SQS section 3
    DSSD = "dssd"  # split verification, uplink scalars only (DSSD, Method; see verification.py)
    NONE = "none"  # no speculation: the edge generates the round's tokens alone and streams them
    # token ids only: both sides race each position's shared noise (Gumbel sampling, Daliri et al. 2024,
    # arXiv 2408.07978), the edge accepts a draft iff it is the target's own draw (see verification.py)
    GUMBEL = "gumbel"


ALL_MODES = frozenset(Mode)
DRAFTING_MODES = ALL_MODES - {Mode.NONE}  # modes whose rounds carry drafts (none: the edge generates alone)
# ``mode auto``: the device picks each round's mode, K and length itself (device/auto.py). A device
# policy, not a way of drafting: it is accepted wherever a user gives settings, and never reaches the
# wire, where every round says how it was actually drafted.
AUTO = "auto"
# Modes whose rounds send no distribution (DSSD: q(x) scalars; gumbel: nothing but ids; none: no draft).
NO_CODEC_MODES = frozenset({Mode.DSSD, Mode.GUMBEL, Mode.NONE})
# Modes whose every emitted token is the target's own Gumbel-max draw with the position's noise
# (verification.token_noise): their tokens depend on neither the drafter nor the draft length.
RACE_MODES = frozenset({Mode.GUMBEL, Mode.NONE})
TOP_K_MODES = frozenset({Mode.TSLT, Mode.KSQS})
LATTICE_MODES = frozenset({Mode.KSQS, Mode.CSQS})
