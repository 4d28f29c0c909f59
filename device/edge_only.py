"""Edge-only rounds (mode none): no draft; the edge generates the round's tokens from the target alone
and streams each in its own Verdict, which the device commits as it arrives.

Each token at sequence index t is the target's race with the noise of position t
(verification.token_noise), the token a gumbel round emits there too, so the tokens do not depend on
how rounds are cut (nor on which of the two modes cut them): a round broken after k tokens is retried
as a round asking for the rest.
"""
from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

from specdec.common.protocol import Verdict
from specdec.device.rounds import RoundDraft, RoundPlan

if TYPE_CHECKING:
    from specdec.device.session import DraftSession


def draft(session: "DraftSession", plan: RoundPlan, remaining: int) -> RoundDraft:
    """An empty round asking the edge for up to ``edge_tokens`` tokens (0 = all ``remaining``)."""
    session.drop_ahead()
    s = plan.settings
    s = replace(s, edge_tokens=min(s.edge_tokens or remaining, remaining))  # the edge must know when to stop
    plan = replace(plan, settings=s)
    return RoundDraft(block=session.block((), s), plan=plan, q_rows=[], theoretical_bits=0, support_sizes=[],
                      draft_seconds=0.0, encode_seconds=0.0, start=len(session.tokens))


def take_token(session: "DraftSession", rd: RoundDraft, verdict: Verdict) -> int:
    """One streamed token: append it (the draft cache catches up in the next drafted round)."""
    if verdict.round_id != rd.block.round_id or verdict.next_token is None or verdict.num_accepted:
        raise ValueError(f"verdict does not belong to edge-only round {rd.block.round_id}")
    session.tokens.append(int(verdict.next_token))
    rd.received += 1
    return int(verdict.next_token)


def retry_plan(rd: RoundDraft) -> RoundPlan | None:
    """The plan that finishes ``rd`` after a broken stream: the same settings for the tokens it has
    not received yet (None if it had them all)."""
    rest = rd.settings.edge_tokens - rd.received
    if rest <= 0:
        return None
    return replace(rd.plan, settings=replace(rd.settings, edge_tokens=rest), retry=True)
