"""What a replayed device sends and when: one script per session, pure bookkeeping (no grpc, no torch).

A script answers two questions, round after round: :meth:`next_round` (the Draft to send and how long
the device would have drafted before sending it) and :meth:`on_verdict` (the verdict's new tokens,
checked against the recording: a verdict the recording cannot follow raises :class:`Divergence`).

Drafting ahead, as the real device does it (device/chain.py): while the edge verifies round r the
device drafts round r + 1 on the guess that all of r is accepted and the bonus is its drafter's
argmax. The replay keeps the same clock: the ahead work starts when r is sent; if the guess was right
the next round is sent ``max(0, ahead cost - wait)`` after the verdict, else the step in flight is
finished and thrown away and the round is drafted afresh.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from specdec.common import protocol as P
from specdec.common.modes import Mode
from specdec.device.chain import chain_limit
from specdec.device.engine import clip_round, deliverable

from specdec.bench.capacity.recording import PositionTable, Proposal, SessionLog

try:  # the edge's load-aware advice applied to the device's settings, as the device applies it
    from specdec.common.settings import within_draft_len
except ImportError:  # a tree from before load-aware speculation: no edge sends advice there
    def within_draft_len(s, limit):
        return s



class Divergence(Exception):
    """The edge answered differently from what the recording can continue."""


@dataclass(frozen=True)
class RoundPlan:
    block: P.DraftBlock
    delay_s: float          # device time between the last verdict (or the Prompt) and sending this


def round_limit(s: P.DraftSettings, remaining: int) -> int:
    """Positions a round drafts with ``remaining`` tokens to go: the device's chain limit for the
    client's call, which leaves the last token to the verdict (client._round)."""
    return chain_limit(s, max(1, remaining - 1))


class Script:
    """Common bookkeeping: generated tokens, the session end, the Hello and Prompt to send."""

    def __init__(self, hello: P.Hello, prompt_ids: list[int], eos_ids, max_new: int):
        self.hello, self.prompt_ids, self.eos_ids, self.max_new = hello, list(prompt_ids), tuple(eos_ids), max_new
        self.generated: list[int] = []
        self.round_id = 0

    @property
    def remaining(self) -> int:
        return self.max_new - len(self.generated)

    @property
    def finished(self) -> bool:
        return self.remaining <= 0 or (bool(self.generated) and self.generated[-1] in self.eos_ids)

    def _take(self, new: list[int]) -> list[int]:
        new = deliverable(self.generated, new, self.max_new, self.eos_ids)
        self.generated.extend(new)
        return new


class GreedyScript(Script):
    """T = 0 from a :class:`PositionTable`: exact for any round boundaries and draft lengths, so it
    follows the edge's load-aware advice (``hint``) as the device does: drafts no longer than the
    hint, and at 0 an edge-only round (its tokens are the greedy path too)."""

    def __init__(self, table: PositionTable, hello: P.Hello, max_new: int, draft_scale: float = 1.0):
        super().__init__(hello, table.prompt_ids, table.eos_ids, min(max_new, table.max_new_tokens))
        self.table = table
        self.draft_scale = draft_scale  # recorded drafting seconds x this (the validation's slower device)
        self.draft_s = 0.0              # device seconds spent before sends (what the device's clock shows)
        self.ahead: tuple[P.DraftSettings, int, list[float]] | None = None  # (settings, guess, cumulative costs)
        self.kept: tuple[P.DraftSettings, float] | None = None  # a kept ahead round: settings, seconds left

    def _proposal(self, i: int) -> Proposal:
        p = self.table.proposals.get(i)
        if p is None:
            raise Divergence(f"no recorded proposal at generated={i}")
        return p

    def next_round(self, hint: int | None = None) -> RoundPlan:
        s = within_draft_len(self.hello.draft, hint)
        self.round_id += 1
        if s.mode is Mode.NONE:
            return self._edge_round(s)
        i = len(self.generated)
        prop = self._proposal(i)
        limit = min(round_limit(s, self.remaining), len(prop.tokens))
        kept, self.kept = self.kept, None
        delay = kept[1] if kept is not None and kept[0] == s else self._cost(prop.step_s[:limit])
        self.draft_s += delay
        block = P.DraftBlock(round_id=self.round_id, token_ids=tuple(prop.tokens[:limit]),
                             distributions=tuple(prop.payloads[:limit]),
                             settings=None if s == self.hello.draft else s)
        self.ahead = self._ahead_plan(i, limit, s)
        return RoundPlan(block, delay)

    def _edge_round(self, s: P.DraftSettings) -> RoundPlan:
        """Advised 0: ask the edge for a chunk of tokens (the device drops any round drafted ahead)."""
        self.ahead = self.kept = None
        s = replace(s, edge_tokens=min(s.edge_tokens or self.remaining, self.remaining))
        return RoundPlan(P.DraftBlock(round_id=self.round_id, token_ids=(), settings=s), 0.0)

    def _ahead_plan(self, i: int, limit: int, s: P.DraftSettings):
        """The round the device drafts ahead while this one is verified: its settings, the bonus it
        guesses (the drafter's argmax after a fully accepted round) and its cumulative costs."""
        after = self.remaining - limit - 1
        guess_at, nxt = self.table.proposals.get(i + limit), self.table.proposals.get(i + limit + 1)
        if after < 1 or guess_at is None or nxt is None:
            return None
        k = round_limit(s, after)
        feed = self._cost([min(nxt.step_s)])  # the ahead round first feeds the last draft: one drafter forward
        cum, t = [feed], feed
        for step in nxt.step_s[:k]:
            t += self._cost([step])
            cum.append(t)
        return s, guess_at.tokens[0], cum

    def on_verdict(self, plan: RoundPlan, v: P.Verdict, wait_s: float) -> list[int]:
        ids = list(plan.block.token_ids)
        if v.next_token is None or not 0 <= v.num_accepted <= len(ids):
            raise Divergence(f"verdict {v} does not fit round {plan.block.round_id}")
        start = len(self.generated)
        new = clip_round(start, ids[: v.num_accepted] + [int(v.next_token)], self.max_new, self.eos_ids)
        if new != self.table.path[start:start + len(new)]:  # the path was recorded to max_new_tokens only
            raise Divergence(f"at generated={start} the edge verified {new}, the greedy path has "
                             f"{self.table.path[start:start + len(new)]}")
        taken = self._take(new)
        if ids:
            self.kept = self._after_ahead(v, len(ids), wait_s)
        return taken

    def _after_ahead(self, v: P.Verdict, sent: int, wait_s: float):
        """(settings, seconds of drafting left before the next round can go) if drafting ahead decides it."""
        if self.ahead is None:
            return None
        s, guess, cum = self.ahead
        self.ahead = None
        if v.num_accepted == sent and int(v.next_token) == guess:
            return s, max(0.0, cum[-1] - wait_s)   # the guess held: the rest of the ahead round
        in_flight = next((c for c in cum if c >= wait_s), wait_s)
        extra = in_flight - wait_s                 # the step running at the verdict is finished first
        return None if extra <= 0 else (s, extra + self._fresh_cost(s))

    def _fresh_cost(self, s: P.DraftSettings) -> float:
        prop = self.table.proposals.get(len(self.generated))
        if prop is None:
            return 0.0
        return self._cost(prop.step_s[:round_limit(s, self.remaining)])

    def _cost(self, steps: list[float]) -> float:
        return sum(steps) * self.draft_scale


class SessionScript(Script):
    """T > 0 from a :class:`SessionLog`: the recorded rounds in order, while the verdicts agree. It
    cannot follow a load-aware hint shorter than a recorded round; such rounds are counted."""

    def __init__(self, log: SessionLog, hello: P.Hello, max_new: int, decode_draft):
        super().__init__(hello, log.prompt_ids, log.eos_ids, min(max_new, log.max_new_tokens))
        self.log, self.decode_draft = log, decode_draft
        self.index = 0
        self.last_wait = 0.0
        self.hints_not_followed = 0

    def next_round(self, hint: int | None = None) -> RoundPlan:
        if self.index >= len(self.log.rounds):
            raise Divergence("the recording ended before the session did")
        r = self.log.rounds[self.index]
        block = self.decode_draft(r.draft)
        if hint is not None and hint < len(block.token_ids):
            # A shorter round would draw other numbers than the recording holds: the replay sends the
            # recorded round and counts it (a device following the advice is replayed only at T = 0).
            self.hints_not_followed += 1
        delay = max(0.0, r.draft_s - self.last_wait) if r.drafted_ahead else r.draft_s
        self.round_id = block.round_id
        return RoundPlan(block, delay)

    def on_verdict(self, plan: RoundPlan, v: P.Verdict, wait_s: float) -> list[int]:
        r = self.log.rounds[self.index]
        if (v.num_accepted, v.next_token) != (r.num_accepted, r.next_token):
            raise Divergence(f"round {self.index + 1}: verdict ({v.num_accepted}, {v.next_token}), "
                             f"recorded ({r.num_accepted}, {r.next_token})")
        self.index += 1
        self.last_wait = wait_s
        ids = list(plan.block.token_ids)
        return self._take(ids[: v.num_accepted] + [int(v.next_token)])


class EdgeOnlyScript(Script):
    """Mode none: one round asks the edge for every remaining token; each arrives as its own verdict.
    ``hello``: a mode-none Hello as device-client --mode none sends it."""

    def __init__(self, hello: P.Hello, prompt_ids: list[int], eos_ids, max_new: int):
        if hello.draft.mode is not Mode.NONE:
            raise ValueError(f"edge-only sessions need a mode none Hello, got {hello.draft.mode.value}")
        super().__init__(hello, prompt_ids, eos_ids, max_new)

    def next_round(self, hint: int | None = None) -> RoundPlan:
        self.round_id += 1
        s = replace(self.hello.draft, edge_tokens=min(self.hello.draft.edge_tokens or self.remaining,
                                                      self.remaining))
        block = P.DraftBlock(round_id=self.round_id, token_ids=(), settings=None if s == self.hello.draft else s)
        return RoundPlan(block, 0.0)

    def on_verdict(self, plan: RoundPlan, v: P.Verdict, wait_s: float) -> list[int]:
        if v.round_id != plan.block.round_id or v.next_token is None or v.num_accepted:
            raise Divergence(f"verdict {v} is not a streamed token of round {plan.block.round_id}")
        return self._take([int(v.next_token)])
