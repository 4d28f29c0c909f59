"""When the edge runs ahead (Draft.run_ahead_ms): how late the device's next round must be before the
edge, which would otherwise sit idle through an outage or a stall, generates the target's next tokens.

The edge counts from a round's last reply; the device's next message then takes a round trip plus the
device's own turnaround (applying the verdict, planning and drafting the next round where it was not
drafted ahead). Both are measured on the running device and link, nothing is tuned to a machine. The
round trip: a recent upper quantile, so that the link's ordinary jitter does not look like an outage
and one outage (a single huge sample) does not switch running ahead off for the next one. The
turnaround: the longest recent one, and at least what drafting the round being sent took (the next
round costs that where its drafting ahead guessed wrong): a round drafted ahead on a guess is sent at
once, one whose guess failed a whole draft later, and the wrong guesses are too few for a quantile to
see (they were: every failed guess ran ahead and cost its round).

A false alarm costs the round the device sent meanwhile (the edge supersedes it: the device drafts
again) and gains the tokens generated ahead, except where the edge continues the round (:func:`continued`:
a race or greedy round whose first drafts are those tokens gets the verdict it would have had on time,
and the alarm cost nothing); a late alarm costs the outage's time up to it. The tokens
are the ones any race round draws at their positions, so no alarm, early or late, changes a token of
a session whose rounds are race rounds (or greedy): see :func:`runs_ahead`.
"""
from __future__ import annotations

import math
import time
from collections import deque
from dataclasses import dataclass, field, replace

from specdec.common.modes import RACE_MODES, Mode
from specdec.common.protocol import DraftBlock, DraftSettings, Hello, Verdict
from specdec.device.rounds import RoundDraft, RoundPlan

# The next round is overdue at this multiple of the recent round trip plus turnaround: a link whose
# round trips double for a moment (LTE's scheduling, a handover) is still working.
OVERDUE_FACTOR = 2.0
# Added to it: the two hosts' timer and scheduling noise, which no measurement of the link holds.
OVERDUE_MARGIN_S = 0.05
# Samples kept of each (rounds): a few seconds of a session, so that what the clock says follows the link.
WINDOW = 16
# The quantile of the round trips used: above the typical round, below one outage's sample among them.
QUANTILE = 0.75


def runs_ahead(hello: Hello, fixed_cuts: bool, auto: bool) -> bool:
    """Whether a session's rounds let the edge run ahead: wherever no token depends on it. At T = 0 every
    mode gives the target's greedy tokens; the race modes (gumbel, edge-only) draw the very token the
    edge draws ahead; a reproducible mode auto keeps to them at T > 0. A fixed chain mode at T > 0 in a
    reproducible session (``fixed_cuts``) would change tokens with where rounds end: never. Elsewhere
    (``--no-reproducible``) only the law is promised, which running ahead keeps."""
    return not fixed_cuts or auto or hello.draft.mode in RACE_MODES


@dataclass
class OverdueClock:
    """The device's measurements behind each round's ``run_ahead_ms``."""
    trips: deque = field(default_factory=lambda: deque(maxlen=WINDOW))        # network seconds of a round
    turnarounds: deque = field(default_factory=lambda: deque(maxlen=WINDOW))  # reply in -> next round out
    continued: bool = False  # the edge continues this session's late rounds (:func:`continues`)
    continued_edge_only: bool = False  # ... and its late edge-only rounds (Welcome.continues_late_edge_only)

    def trip(self, seconds: float) -> None:
        self.trips.append(max(0.0, seconds))

    def turnaround(self, seconds: float) -> None:
        self.turnarounds.append(max(0.0, seconds))

    def after_ms(self, mode: Mode, draft_s: float = 0.0, streams_on: bool = False) -> int:
        """The ``run_ahead_ms`` of a round in ``mode`` whose drafting took ``draft_s``, sent now; 0
        (never) before any round trip was measured, and for DSSD rounds (the token after a rejection may
        be the device's own). ``streams_on``: an edge-only round that another follows (no drafted round
        is expected after it), whose request goes out while it streams, and which the edge continues
        if it comes late: the device's turnaround (planning, drafting) does not hold that request up,
        and a false alarm costs nothing. Counted in, the edge sat idle a second or more of a 2 s
        outage between two edge-only rounds (the turnarounds of drafted rounds at 1.5x the target's cost)
        where edge-only's one long round streamed on."""
        if not self.trips or mode is Mode.DSSD:
            return 0
        turnaround = 0.0 if streams_on else max(draft_s, max(self.turnarounds, default=0.0))
        # The factor covers the link's jitter; the device's own turnaround needs it only where a false
        # alarm costs the round in flight: a continued round loses nothing to one.
        turn_factor = 1.0 if self.continued else OVERDUE_FACTOR
        late = OVERDUE_FACTOR * quantile(self.trips, QUANTILE) + turn_factor * turnaround
        return max(1, math.ceil(1000.0 * (late + OVERDUE_MARGIN_S)))


def continues(hello: Hello, fixed_cuts: bool, auto: bool) -> bool:
    """Whether an edge that continues late rounds (Welcome.continues_late) would continue this session's:
    greedy sessions and race rounds (gumbel, or a reproducible mode auto at T > 0), not DSSD rounds or
    trees (edge/verifier.continued). Mode auto at T = 0 may still send a DSSD round or a tree now and then."""
    if not auto and (hello.draft.mode is Mode.DSSD or hello.draft.tree):
        return False
    return hello.temperature == 0 or hello.draft.mode is Mode.GUMBEL or (auto and fixed_cuts)


def quantile(xs, q: float) -> float:
    """The q-quantile of ``xs`` (nearest rank, from below)."""
    s = sorted(xs)
    return s[int(q * (len(s) - 1))]


def stamp(session, rd: RoundDraft) -> DraftBlock:
    """``rd``'s message as it goes out now, in a session that runs ahead: where it starts, and when the
    message after it is overdue; and the device's turnaround since the last reply, measured."""
    now = time.perf_counter()
    if session.replied_at is not None and not rd.sent_ahead:
        session.overdue.turnaround(now - session.replied_at)
    session.replied_at = None
    if session.runs_ahead:
        streams_on = (rd.settings.mode is Mode.NONE and session.overdue.continued_edge_only
                      and not (rd.plan.choice or {}).get("catch_up"))
        after = session.overdue.after_ms(rd.settings.mode, rd.draft_seconds + rd.encode_seconds, streams_on)
        rd.block = replace(rd.block, start=rd.start, run_ahead_ms=after)
    return rd.block


def ahead_token(verdict: Verdict, after_round: int) -> int:
    """The token of a Verdict generated ahead after round ``after_round``; ValueError for anything else."""
    if (not verdict.ahead or verdict.round_id != after_round or verdict.next_token is None
            or verdict.num_accepted or verdict.more):
        raise ValueError(f"a token generated ahead must follow round {after_round}")
    return int(verdict.next_token)


def continued(block: DraftBlock, early: list[Verdict], verdict: Verdict) -> Verdict:
    """The Verdict of round ``block`` that the edge continued after the tokens ``early`` it generated
    ahead (Hello.continues_late): those must be the round's first drafts, among its accepted ones. It
    is the round's verdict as on time, with their log-probabilities first; ValueError for anything else."""
    tokens = tuple(ahead_token(v, block.round_id - 1) for v in early)
    k = len(tokens)
    if (verdict.superseded or verdict.ahead or verdict.more or verdict.next_token is None
            or not k <= verdict.num_accepted <= len(block.token_ids)):
        raise ValueError(f"round {block.round_id}: a verdict after {k} tokens generated ahead must accept them")
    if tokens != tuple(block.token_ids[:k]):
        raise ValueError(f"round {block.round_id} continued after {k} tokens generated ahead that are not its drafts")
    logprobs = tuple(t for v in early for t in v.logprobs) + verdict.logprobs
    return replace(verdict, logprobs=logprobs)


def rest_of_edge_round(rd: RoundDraft, k: int) -> RoundDraft:
    """Edge-only round ``rd``, continued by the edge after ``k`` tokens it generated ahead past the round's
    start (Hello.continues_late_edge_only): its rest, from their end (they are a round of their own:
    :func:`ahead_round`). ValueError unless the round asked for more than k and streamed none yet."""
    if rd.settings.mode is not Mode.NONE or rd.received or not 0 < k < rd.settings.edge_tokens:
        raise ValueError(f"round {rd.block.round_id} continued after {k} tokens generated ahead: not an "
                         f"edge-only round that asked for more")
    rd.start, rd.continued_after = rd.start + k, k
    rd.plan = replace(rd.plan, settings=replace(rd.settings, edge_tokens=rd.settings.edge_tokens - k))
    return rd


def ahead_round(after_round: int, start: int, verdicts: list[Verdict]) -> tuple[RoundDraft, Verdict]:
    """The tokens generated ahead from sequence index ``start`` as an edge-only round of their own (what
    they are), and their totals as one Verdict, for the session's account."""
    n = len(verdicts)
    part = RoundDraft(block=DraftBlock(round_id=after_round, token_ids=()),
                      plan=RoundPlan(DraftSettings(mode=Mode.NONE, edge_tokens=n)), q_rows=[], theoretical_bits=0,
                      support_sizes=[], draft_seconds=0.0, encode_seconds=0.0, start=start, received=n)
    totals = replace(verdicts[-1], verify_seconds=sum(v.verify_seconds for v in verdicts), queue_seconds=0.0,
                     decode_seconds=0.0, ahead=False)
    return part, totals
