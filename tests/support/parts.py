"""Session parts the tests compose (device/parts.py) instead of overriding DraftSession's methods:
scripted plans, the classic bugs planted in the sampler, drafting ahead to the end. Module level, so
that a session factory built from them travels to the twin process (pickled)."""
from __future__ import annotations

from dataclasses import fields
from functools import partial

import torch

from specdec.common.settings import resolve as resolve_settings
from specdec.device.draft_model import DraftStep
from specdec.device.parts import Planner, Sampler, SessionParts
from specdec.device.rounds import RoundPlan
from specdec.device.session import DraftSession


def with_parts(**kw) -> partial:
    """A session factory ``(drafter, hello, **kw) -> DraftSession`` built with these parts (the
    SessionParts fields) and DraftSession keywords (``draft_ahead`` ...)."""
    part_names = {f.name for f in fields(SessionParts)}
    parts = SessionParts(**{k: v for k, v in kw.items() if k in part_names})
    return partial(DraftSession, parts=parts, **{k: v for k, v in kw.items() if k not in part_names})


class SamplesUniformOnSupport(Sampler):
    """The classic bug: the packet carries q_hat but the token is drawn from another law over the same
    support (uniform on it, as when sampling and packet use different settings). Same support, so the
    edge's "q_hat(x) = 0" check cannot catch it: only the statistics can. It draws what the honest
    device draws first, then ignores it."""

    def sample(self, encoded, generator, position):
        super().sample(encoded, generator, position)
        other = (encoded.q_hat > 0).double()
        return DraftStep(int(torch.multinomial(other / other.sum(), 1, generator=generator)), encoded)


class ScriptedPlanner(Planner):
    """Round settings from a script: ``script(hello, round_id)`` -> the settings' dict (resolved by the
    settings table against the drafter's vocabulary)."""

    def __init__(self, script):
        self.script = script

    def plan(self, hello, vocab_size, round_id):
        return RoundPlan(resolve_settings(self.script(hello, round_id), vocab_size=vocab_size))


# Modes, K, lattice, length, a tree: transitions include a DSSD rejection followed by a round of another mode.
SWITCH_PLAN: tuple[dict, ...] = (
    dict(mode="tslt", top_k=3), dict(mode="dssd", dssd_samples=1), dict(mode="dense", dense_dtype="bf16"),
    dict(mode="ksqs", top_k=3, lattice=8), dict(mode="csqs", csqs_beta0=0.05, lattice=8, max_k=8),
    dict(mode="tslt", top_k=4, tree=(2,)), dict(mode="none", edge_tokens=1), dict(mode="gumbel"))


def switch_every_round(hello, round_id: int) -> dict:
    """One of SWITCH_PLAN by seed and round (at the Hello's draft length), as a link-aware
    controller's settings might change."""
    return {"draft_len": hello.draft.draft_len, **SWITCH_PLAN[(hello.seed + round_id) % len(SWITCH_PLAN)]}


def gumbel_or_none(hello, round_id: int) -> dict:
    """A gumbel round (L from 1 to 5) and an edge-only round (1 to 3 tokens) by turns, as mode auto may."""
    i = hello.seed + round_id
    return dict(mode="gumbel", draft_len=1 + i % 5) if i % 2 else dict(mode="none", edge_tokens=1 + i % 3)


def edge_only_3_to_6(hello, round_id: int) -> dict:
    """Edge-only rounds of 3 to 6 tokens, by seed and round."""
    return dict(mode="none", edge_tokens=3 + (hello.seed + round_id) % 4)


# A device whose settings change every round; each Draft says how it was drafted.
SwitchesEveryRound = with_parts(planner=ScriptedPlanner(switch_every_round))
# The classic bug, alone and under per-round settings.
SamplesOtherQ = with_parts(sampler=SamplesUniformOnSupport())
SwitchesAndSamplesOtherQ = with_parts(planner=ScriptedPlanner(switch_every_round), sampler=SamplesUniformOnSupport())
# Drafts every round ahead in full, whatever the verdict's timing (the edges here answer at once).
TO_THE_END = SessionParts(ahead_stops_at_verdict=False)
AheadToTheEnd = partial(DraftSession, draft_ahead=True, parts=TO_THE_END)
AlternatesGumbelAndNone = with_parts(planner=ScriptedPlanner(gumbel_or_none))
# Edge-only rounds, each after the first requested while the one before streams (engine._send_ahead).
EdgeOnlyAhead = with_parts(draft_ahead=True, planner=ScriptedPlanner(edge_only_3_to_6))
