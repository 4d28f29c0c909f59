"""Edge-only rounds sent ahead: the device's round loop (engine.run_round) against a scripted edge.

While an edge-only round streams, the request of the next one (if that is edge-only too) goes out
before the last token arrives, so that the edge goes on without waiting a round trip. What is
checked here, message by message: when it goes out and what it says, that a round ended early at an
end-of-sequence token makes the edge's answer to it void (and the device carries on), that a
drafted plan or a round whose end expects a drafted one sends nothing ahead, and that a break drops
the round sent ahead so the retry comes first. Token identity with one-round edge-only sessions, also
through broken streams: tests/integration/test_gumbel.py; over gRPC: tests/integration/test_mode_none.py.
"""
from __future__ import annotations

import asyncio
from dataclasses import replace

import pytest

from specdec.common import protocol as P
from specdec.device import edge_only
from specdec.device.engine import run_round
from specdec.device.parts import Planner
from specdec.device.rounds import RoundPlan
from specdec.common.settings import resolve as resolve_settings
from tests.support.parts import ScriptedPlanner, with_parts
from specdec.device.session import DraftSession
from specdec.testbed.tiny_models import make_model
from tests.support.harness import device_config, load

VOCAB = 64
PROMPT = [1, 2, 3]
EOS = 63
CHUNK = 4


@pytest.fixture(scope="module")
def drafter(tmp_path_factory):
    return load(str(make_model(tmp_path_factory.mktemp("drafter") / "m", VOCAB, seed=3)))


class ScriptedEdge:
    """engine.Link: records what the device sends and answers each edge-only Draft with the verdicts
    ``answer(block)`` gives (queued at once, as a fast edge would stream them)."""

    def __init__(self, answer):
        self.answer, self.sent, self.queue, self.sent_during = answer, [], [], []
        self.closed_during: list[int] = []  # per Close: the verdicts still to read when it went out

    async def send(self, msg) -> int:
        self.sent_during.append(len(self.queue))  # verdicts of earlier rounds not yet read: it went ahead
        self.sent.append(msg)
        self.queue.extend(self.answer(msg))
        return 10

    async def close(self) -> int:
        self.closed_during.append(len(self.queue))
        return 2

    async def recv(self):
        return self.queue.pop(0), 5


def asked(block: P.DraftBlock) -> int:
    """The tokens an edge-only Draft asks for (no settings: the session's, CHUNK)."""
    return block.settings.edge_tokens if block.settings is not None else CHUNK


def tokens_from(start: int):
    """An edge whose round of n tokens streams start, start + 1, ... (numbering on across rounds)."""
    state = {"next": start}

    def answer(block: P.DraftBlock) -> list[P.Verdict]:
        n = asked(block)
        out = [P.Verdict(block.round_id, 0, state["next"] + i, more=i + 1 < n) for i in range(n)]
        state["next"] += n
        return out
    return answer


def session_of(drafter, chunk: int = CHUNK, draft_ahead: bool = True, cls=DraftSession) -> DraftSession:
    cfg = device_config(mode="none", edge_tokens=chunk, temperature=1.0)
    session = cls(drafter, cfg.hello("fp", VOCAB, seed=1), draft_ahead=draft_ahead)
    session.start(PROMPT)
    return session


def rounds(link, session, max_new: int) -> tuple[list, list[int]]:
    events, delivered = [], []

    async def main():
        while len(delivered) < max_new:
            events.append(await run_round(link, session, max_new - len(delivered), delivered.extend))
    asyncio.run(main())
    return events, delivered


def two_rounds(link, session) -> None:
    """Two rounds of a session that wants 10 tokens more before each."""
    async def main():
        for _ in range(2):
            await run_round(link, session, 10, lambda _: None)
    asyncio.run(main())


def test_the_next_round_goes_out_before_the_last_token_and_streams_on(drafter) -> None:
    """Each round after the first goes out while the one before streams."""
    session, link = session_of(drafter), ScriptedEdge(tokens_from(10))
    events, delivered = rounds(link, session, 14)
    assert delivered == list(range(10, 24)) and session.tokens == PROMPT + delivered
    assert [asked(b) for b in link.sent] == [4, 4, 4, 2]  # the last one asks for what remains
    assert [b.sent_ahead for b in link.sent] == [False, True, True, True]
    assert [b.round_id for b in link.sent] == [1, 2, 3, 4]
    assert link.sent_during[0] == 0 and all(n > 0 for n in link.sent_during[1:])  # out mid-stream
    assert [e.sent_ahead for e in events] == [False, True, True, True]
    assert [e.new_tokens for e in events] == [tuple(range(10, 14)), tuple(range(14, 18)), tuple(range(18, 22)),
                                              (22, 23)]


def test_the_round_that_ends_the_session_sends_close_with_its_first_token(drafter) -> None:
    """Close goes out once, as the last round's first token is in (its other three still to read):
    the edge ends the stream right after that round's last token, not a round trip later."""
    session, link = session_of(drafter), ScriptedEdge(tokens_from(10))
    _, delivered = rounds(link, session, 16)
    assert [asked(b) for b in link.sent] == [4, 4, 4, 4] and link.closed_during == [3]
    # rounds that leave tokens for the rounds after them send none
    session, link = session_of(drafter, cls=DraftsAfterTwo), ScriptedEdge(tokens_from(10))
    two_rounds(link, session)
    assert link.closed_during == []


def test_without_drafting_ahead_each_round_waits_for_the_last(drafter) -> None:
    session, link = session_of(drafter, draft_ahead=False), ScriptedEdge(tokens_from(10))
    _, delivered = rounds(link, session, 14)
    assert delivered == list(range(10, 24))
    assert not any(b.sent_ahead for b in link.sent) and link.sent_during == [0, 0, 0, 0]


def test_a_round_after_an_eos_is_void_and_the_device_carries_on(drafter) -> None:
    """The edge ended the second round early at its end-of-sequence token (a device whose own EOS set
    lacks it carries on): the round sent ahead is answered void, the device commits nothing for it
    and asks again, not ahead."""
    def answer(block):
        if block.round_id == 2:
            return [P.Verdict(2, 0, 20, more=True), P.Verdict(2, 0, 21, more=True), P.Verdict(2, 0, EOS)]
        if block.sent_ahead:
            return [P.Verdict(block.round_id, 0, None)]
        first = 10 if block.round_id == 1 else 30
        return [P.Verdict(block.round_id, 0, first + i, more=i + 1 < asked(block)) for i in range(asked(block))]
    session, link = session_of(drafter), ScriptedEdge(answer)
    events, delivered = rounds(link, session, 11)
    assert delivered == [10, 11, 12, 13, 20, 21, EOS, 30, 31, 32, 33]
    assert [b.sent_ahead for b in link.sent] == [False, True, True, False]
    assert events[2].new_tokens == () and events[2].record.generated == 0
    assert session.stats.generated_tokens == 11


def test_a_token_for_a_round_that_cannot_start_yet_is_a_protocol_error(drafter) -> None:
    """An edge that streams the round sent ahead as if the one before had ended early (instead of
    answering it void) is caught, not trusted."""
    from specdec.device.engine import ProtocolError

    def answer(block):
        if block.round_id == 1:
            return tokens_from(10)(block)
        if block.round_id == 2:  # three tokens where four were asked for, and no EOS
            return [P.Verdict(2, 0, 20, more=True), P.Verdict(2, 0, 21, more=True), P.Verdict(2, 0, 22)]
        return [P.Verdict(block.round_id, 0, 30, more=True)]
    session, link = session_of(drafter), ScriptedEdge(answer)
    with pytest.raises(ProtocolError, match="ended early"):
        rounds(link, session, 12)


def none_then_gumbel(hello, round_id: int) -> dict:
    """A gumbel round once two edge-only rounds have been planned: nothing goes ahead."""
    return dict(mode="none", edge_tokens=4) if round_id < 2 else dict(mode="gumbel", draft_len=2)


DraftsAfterTwo = with_parts(planner=ScriptedPlanner(none_then_gumbel))


def test_a_drafted_next_round_or_a_round_that_expects_one_sends_nothing_ahead(drafter) -> None:
    session, link = session_of(drafter, cls=DraftsAfterTwo), ScriptedEdge(tokens_from(10))
    two_rounds(link, session)
    assert len(link.sent) == 2 and session.take_sent_ahead() is None and session.plan().settings.mode.value == "gumbel"
    # a round whose plan says a drafted round is due after it (auto's catch_up) plans nothing ahead
    session = session_of(drafter)
    rd = session.edge_round(replace(session.plan(), choice={"catch_up": True}), 6)
    assert session.send_ahead(rd, 2) is None
    rd = session.edge_round(session.plan(), 6)
    assert session.send_ahead(rd, 2) is not None  # the same round without catch_up goes


def test_a_break_drops_the_round_sent_ahead_and_retries_the_round_in_flight(drafter) -> None:
    class Breaks(ScriptedEdge):
        broke = False

        async def recv(self):  # the link is cut just before the second round's last token
            if not self.broke and len(self.sent) == 3 and self.queue[0].round_id == 2 and not self.queue[0].more:
                self.broke = True
                raise ConnectionError("link cut")
            return await super().recv()
    session, link = session_of(drafter), Breaks(tokens_from(10))
    with pytest.raises(ConnectionError):
        rounds(link, session, 10)
    assert link.sent[2].sent_ahead and session.tokens == PROMPT + list(range(10, 17))
    session.abort_round()
    assert session.take_sent_ahead() is None
    retry = session.plan()
    assert retry.retry and retry.settings.edge_tokens == 1  # the token the broken round lacks


class TailPlanner(Planner):
    """Mode auto's edge-only plan as it comes: chunks of CHUNK tokens that may not leave fewer than
    ``tail`` for the session."""

    def __init__(self, tail: int):
        self.tail = tail

    def plan(self, hello, vocab_size, round_id):
        settings = resolve_settings(dict(mode="none", edge_tokens=CHUNK), vocab_size=vocab_size)
        return RoundPlan(settings, edge_tail=self.tail)


@pytest.mark.parametrize("tail,expected", [(3, [4, 4, 6]), (0, [4, 4, 4, 2])])
def test_an_edge_only_round_that_would_leave_a_short_tail_asks_for_it_too(drafter, tail, expected) -> None:
    """A round of a few tokens at a session's end waits a round trip for its first one for nothing:
    a plan with ``edge_tail`` asks for them in the round before (the tokens stay the edge's)."""
    session = session_of(drafter, cls=with_parts(draft_ahead=True, planner=TailPlanner(tail)))
    link = ScriptedEdge(tokens_from(10))
    _, delivered = rounds(link, session, 14)
    assert delivered == list(range(10, 24)) and [asked(b) for b in link.sent] == expected
    assert edge_only.asked(4, 6, 2) == 4 and edge_only.asked(4, 5, 2) == 5 and edge_only.asked(0, 7, 9) == 7
