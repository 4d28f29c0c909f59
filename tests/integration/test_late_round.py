"""A late round continued (Hello.continues_late, edge/verifier.continued, device/run_ahead.continued), over
real gRPC: a round that reaches the edge after it ran ahead past the round's start, whose first drafts are
the tokens generated ahead, gets the verdict it would have had on time instead of being superseded.

On a raw stream: exactly that verdict, and the rounds that must still be superseded (a device that did
not ask, a first draft that is not the token generated ahead). With the real device: an edge that runs
ahead one token per overdue wait (so that rounds are continued, not outrun) gives the target's greedy
tokens in each chain kind at T = 0, and a seeded gumbel session the edge alone's tokens at T = 1 (the
same tokens, so the same law, as the edge alone, whose law tests/integration/test_modes.py checks).
A late edge-only round (Hello.continues_late_edge_only) that asks for more than the tokens generated
ahead: the edge streams its rest after them; with the real device, sessions whose every edge-only round
is late give the target's greedy tokens and, seeded at T = 1, the edge alone's.
"""
from __future__ import annotations

from dataclasses import replace
from functools import partial

import time

import pytest

from specdec.common import wire
from specdec.common.modes import Mode
from specdec.common.protocol import DraftBlock, DraftSettings
from specdec.device.session import DraftSession
from specdec.edge import servicer
from specdec.edge.metrics import EdgeMetrics
from specdec.edge.verifier import VerifierSession
from tests.integration.test_run_ahead import (MAX_NEW, OVERDUE_30MS, PROMPTS, STALL_S, StallsEveryOtherRound,
                                              stalled_greedy)
from tests.support.harness import device_config, edge, load, patched, run, run_sessions, target_greedy
from specdec.common.modeling import encode_prompt
from tests.support.laws import COMPRESSING_MODES
from tests.support.raw_stream import PROMPT_IDS, RawSession

AHEAD_MAX = 12      # max_new_tokens less round 1's token: the edge stops running ahead at the session's end
DRAFTS = 16         # the late round's drafts
WRONG_AT = 14       # its first draft that is not the target's token: past every token generated ahead
EDGE_ONLY = DraftSettings(mode=Mode.NONE, edge_tokens=1, coupled_bonus=False)
GUMBEL = DraftSettings(mode=Mode.GUMBEL, draft_len=DRAFTS)


async def _alone(address, drafter, temperature: float, seed: int, n: int) -> list[int]:
    """The target's first ``n`` tokens from the edge alone (one edge-only round): each its position's race."""
    s = RawSession(address, drafter, max_new_tokens=n)
    s.hello = replace(s.hello, temperature=temperature, seed=seed)
    await s.open()
    await s.call.write(wire.draft_to_pb(DraftBlock(1, (), settings=replace(EDGE_ONLY, edge_tokens=n))))
    tokens = [wire.edge_message_from_pb(await s.call.read()).next_token for _ in range(n)]
    await s.close()
    return tokens


async def _late(address, drafter, temperature: float, seed: int, drafts: tuple[int, ...], continues: bool):
    """Round 1 (one edge-only token) lets the edge run ahead at once; round 2 (gumbel, ``drafts`` from
    round 1's token on) goes out once two tokens generated ahead have arrived. Returns the tokens
    generated ahead and round 2's verdict."""
    s = RawSession(address, drafter, max_new_tokens=1 + AHEAD_MAX, continues_late=continues)
    s.hello = replace(s.hello, temperature=temperature, seed=seed)
    await s.open()
    start = len(PROMPT_IDS)
    await s.call.write(wire.draft_to_pb(DraftBlock(1, (), settings=EDGE_ONLY, start=start, run_ahead_ms=1)))
    got = [wire.edge_message_from_pb(await s.call.read()) for _ in range(3)]  # round 1's token, 2 ahead
    await s.call.write(wire.draft_to_pb(DraftBlock(2, drafts, settings=GUMBEL, start=start + 1)))
    while (v := wire.edge_message_from_pb(await s.call.read())).ahead:
        got.append(v)
    await s.close()
    return [g.next_token for g in got[1:]], v


@pytest.mark.parametrize("temperature", [0.0, 1.0])
@pytest.mark.parametrize("case", ["continued", "device did not ask", "first draft differs"])
def test_a_late_round_whose_first_drafts_were_generated_ahead_gets_its_on_time_verdict(tiny_pair_v512, temperature,
                                                                                   case) -> None:
    target_dir, drafter_dir = tiny_pair_v512
    drafter = load(str(drafter_dir))
    metrics = EdgeMetrics()

    async def main():
        async with edge(target_dir, metrics=metrics) as address:
            alone = await _alone(address, drafter, temperature, 7, 2 + DRAFTS)
            drafts = list(alone[1:1 + DRAFTS])
            drafts[WRONG_AT] = (drafts[WRONG_AT] + 1) % drafter.vocab_size
            if case == "first draft differs":
                drafts[0] = (drafts[0] + 1) % drafter.vocab_size
            ahead, verdict = await _late(address, drafter, temperature, 7, tuple(drafts), case != "device did not ask")
            return alone, ahead, verdict

    alone, ahead, verdict = run(main())
    assert 2 <= len(ahead) <= AHEAD_MAX and ahead == alone[1:1 + len(ahead)]  # the edge's own race tokens
    value = metrics.registry.get_sample_value
    if case != "continued":
        assert verdict.superseded and verdict.next_token is None and not verdict.num_accepted
        assert value("specdec_edge_superseded_rounds_total") == 1 and value("specdec_edge_continued_rounds_total") == 0
        return
    # the verdict the round would have had on time: its drafts up to the wrong one, then the target's token
    assert not verdict.superseded and verdict.round_id == 2
    assert (verdict.num_accepted, verdict.next_token) == (WRONG_AT, alone[1 + WRONG_AT])
    assert value("specdec_edge_superseded_rounds_total") == 0 and value("specdec_edge_continued_rounds_total") == 1


class OneTokenAhead(VerifierSession):
    """An edge that runs ahead one token per overdue wait (it may stop at any token, as at an
    end-of-sequence one): the late round is then continued wherever its first draft is that token,
    instead of being outrun by tokens generated on a fast loopback."""

    def ahead_token(self):
        if getattr(self, "_ahead_after", None) == self.round_id:
            return None
        self._ahead_after = self.round_id
        return super().ahead_token()


class CountsContinued(StallsEveryOtherRound):
    """Counts the rounds continued, and keeps those superseded that the edge could have continued: a
    chain kind's (greedy sessions), more drafts than tokens generated ahead, and those tokens first."""

    def __init__(self, drafter, hello, **kw):
        super().__init__(drafter, hello, **kw)
        self.continued, self.could_continue = 0, []

    def apply_verdict(self, rd, verdict, next_token, io, **kw):
        self.continued += kw.get("learn") is False
        return super().apply_verdict(rd, verdict, next_token, io, **kw)

    def superseded(self, rd, verdicts, downlink_bytes, go_on=False):
        ids, ahead = rd.block.token_ids, tuple(v.next_token for v in verdicts)
        if (rd.settings.mode is not Mode.DSSD and not rd.settings.tree and len(ids) > len(ahead)
                and ids[:len(ahead)] == ahead):
            self.could_continue.append((rd.settings.mode, ids, ahead))
        return super().superseded(rd, verdicts, downlink_bytes, go_on)


def _stalled(target_dir, drafter_dir, cfg, seeds, factory, metrics):
    async def main():
        async with edge(target_dir, metrics=metrics) as address:
            return [await run_sessions(address, drafter_dir, cfg, prompt, seeds, factory) for prompt in PROMPTS]
    with patched([*OVERDUE_30MS, (servicer, "VerifierSession", OneTokenAhead)]):
        return run(main())


@pytest.mark.parametrize("name", ["tslt", "ksqs", "gumbel", "auto"])
def test_greedy_output_equals_the_target_s_with_late_rounds_continued(accepting_pair_v512, name) -> None:
    metrics = EdgeMetrics()
    sessions = stalled_greedy(accepting_pair_v512, name, CountsContinued, metrics, _stalled)
    continued = sum(s.continued for s in sessions)
    assert metrics.registry.get_sample_value("specdec_edge_continued_rounds_total") == continued
    assert [r for s in sessions for r in s.could_continue] == []
    assert all(s.overdue.continued for s in sessions)  # the edge said it continues them: a shorter alarm
    if name != "auto":  # auto's stalled rounds here are DSSD or single drafts (its choice): none continues
        assert continued > 0, name


def test_seeded_gumbel_sessions_give_the_edge_alone_s_tokens_with_late_rounds_continued(tiny_pair_v512) -> None:
    """Same seed, same tokens at T = 1: a continued round's drafts after the token generated ahead race
    with their positions' noise, as on time."""
    target_dir, drafter_dir = tiny_pair_v512
    kw = dict(temperature=1.0, max_new_tokens=MAX_NEW)
    metrics = EdgeMetrics()
    stalled = _stalled(target_dir, drafter_dir, device_config(**kw, **COMPRESSING_MODES["gumbel"]), [3, 4],
                       partial(CountsContinued, reproducible=True), metrics)
    alone = _stalled(target_dir, drafter_dir, device_config(**kw, mode=Mode.NONE), [3, 4], DraftSession,
                     EdgeMetrics())
    for prompt, got, want in zip(PROMPTS, stalled, alone):
        assert [t for t, _, _ in got] == [t for t, _, _ in want], prompt
    assert sum(s.continued for runs in stalled for _, _, s in runs) > 0


async def _late_edge_only(address, drafter, temperature: float, asks: int, continues: bool):
    """Round 1 (one edge-only token) lets the edge run ahead one token (OneTokenAhead); round 2, edge-only
    for ``asks`` tokens from round 1's token on, goes out once that token has arrived. Returns the
    tokens generated ahead and round 2's verdicts."""
    s = RawSession(address, drafter, max_new_tokens=1 + AHEAD_MAX, continues_late=True,
                   continues_late_edge_only=continues)
    s.hello = replace(s.hello, temperature=temperature, seed=7)
    await s.open()
    start = len(PROMPT_IDS)
    await s.call.write(wire.draft_to_pb(DraftBlock(1, (), settings=EDGE_ONLY, start=start, run_ahead_ms=1)))
    got = [wire.edge_message_from_pb(await s.call.read()) for _ in range(2)]  # round 1's token, 1 ahead
    await s.call.write(wire.draft_to_pb(DraftBlock(2, (), settings=replace(EDGE_ONLY, edge_tokens=asks),
                                                   start=start + 1)))
    verdicts = [wire.edge_message_from_pb(await s.call.read())]
    while verdicts[-1].more:
        verdicts.append(wire.edge_message_from_pb(await s.call.read()))
    await s.close()
    return [g.next_token for g in got[1:] if g.ahead], verdicts


@pytest.mark.parametrize("temperature", [0.0, 1.0])
@pytest.mark.parametrize("case", ["continued", "device did not ask", "asks no more than generated ahead"])
def test_a_late_edge_only_round_streams_its_rest_after_the_tokens_generated_ahead(tiny_pair_v512, temperature,
                                                                                   case) -> None:
    target_dir, drafter_dir = tiny_pair_v512
    drafter = load(str(drafter_dir))
    metrics = EdgeMetrics()
    asks = 1 if case == "asks no more than generated ahead" else 5

    async def main():
        async with edge(target_dir, metrics=metrics) as address:
            alone = await _alone(address, drafter, temperature, 7, 1 + asks)
            with patched([(servicer, "VerifierSession", OneTokenAhead)]):
                ahead, verdicts = await _late_edge_only(address, drafter, temperature, asks, case != "device did not ask")
            return alone, ahead, verdicts

    alone, ahead, verdicts = run(main())
    assert len(ahead) == 1 and ahead == alone[1:2]   # the edge's own race token there
    value = metrics.registry.get_sample_value
    if case != "continued":
        [verdict] = verdicts
        assert verdict.superseded and verdict.next_token is None and not verdict.num_accepted
        assert value("specdec_edge_superseded_rounds_total") == 1 and value("specdec_edge_continued_rounds_total") == 0
        return
    # the round's rest: its tokens after the one generated ahead, the very ones the edge alone makes there
    assert all(v.round_id == 2 and not v.ahead and not v.superseded for v in verdicts)
    assert ahead + [v.next_token for v in verdicts] == alone[1:1 + asks]
    assert value("specdec_edge_superseded_rounds_total") == 0 and value("specdec_edge_continued_rounds_total") == 1


class StallsBeforeEdgeRounds(DraftSession):
    """A device that runs ahead and asks for each edge-only round STALL_S late, none sent ahead (a stalled
    device, a link that stops for a moment): the edge runs ahead a token (OneTokenAhead) and, asked,
    streams each round's rest after it. Counts the rounds continued and superseded."""

    def __init__(self, drafter, hello, **kw):
        super().__init__(drafter, hello, **{**kw, "run_ahead": True, "draft_ahead": False})
        self.continued = self.superseded_rounds = 0
        self.overdue.trip(0.0)  # a measured round trip from the start: the first round lets the edge run ahead too

    def edge_round(self, plan, remaining):
        time.sleep(STALL_S)  # (on the event loop: the whole device stalls)
        return super().edge_round(plan, remaining)

    def superseded(self, rd, verdicts, downlink_bytes, go_on=False):
        self.continued += go_on
        self.superseded_rounds += not go_on
        return super().superseded(rd, verdicts, downlink_bytes, go_on)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_sessions_whose_edge_only_rounds_come_late_give_the_edge_alone_s_tokens(tiny_pair_v512, temperature) -> None:
    """Greedy: the target's greedy tokens; seeded at T = 1: the edge alone's (the same tokens, so the same
    law), every edge-only round but the first continued after a token generated ahead, none superseded."""
    target_dir, drafter_dir = tiny_pair_v512
    kw = dict(temperature=temperature, max_new_tokens=MAX_NEW, mode=Mode.NONE, edge_tokens=4)
    metrics = EdgeMetrics()
    late = _stalled(target_dir, drafter_dir, device_config(**kw), [3, 4], StallsBeforeEdgeRounds, metrics)
    alone = _stalled(target_dir, drafter_dir, device_config(**kw), [3, 4], DraftSession, EdgeMetrics())
    tok = load(str(drafter_dir)).tokenizer
    for prompt, got, want in zip(PROMPTS, late, alone):
        assert [t for t, _, _ in got] == [t for t, _, _ in want], prompt
        if temperature == 0:
            assert got[0][0] == target_greedy(target_dir, encode_prompt(tok, prompt, raw=True), MAX_NEW), prompt
    sessions = [s for runs in late for _, _, s in runs]
    assert all(s.superseded_rounds == 0 for s in sessions)
    assert all(s.continued >= MAX_NEW // 4 - 2 for s in sessions), [s.continued for s in sessions]
    assert metrics.registry.get_sample_value("specdec_edge_continued_rounds_total") == sum(s.continued for s in sessions)

