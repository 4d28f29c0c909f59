"""A late round continued (Hello.continues_late, edge/verifier.continued, device/run_ahead.continued), over
real gRPC: a round that reaches the edge after it ran ahead past the round's start, whose first drafts are
the tokens generated ahead, gets the verdict it would have had on time instead of being superseded.

On a raw stream: exactly that verdict, and the rounds that must still be superseded (a device that did
not ask, a first draft that is not the token generated ahead). With the real device: an edge that runs
ahead one token per overdue wait (so that rounds are continued, not outrun) gives the target's greedy
tokens in each chain kind at T = 0, and a seeded gumbel session the edge alone's tokens at T = 1 (the
same tokens, so the same law, as the edge alone, whose law tests/integration/test_modes.py checks).
"""
from __future__ import annotations

from dataclasses import replace
from functools import partial

import pytest

from specdec.common import wire
from specdec.common.modes import Mode
from specdec.common.protocol import DraftBlock, DraftSettings
from specdec.device.session import DraftSession
from specdec.edge import servicer
from specdec.edge.metrics import EdgeMetrics
from specdec.edge.verifier import VerifierSession
from tests.integration.test_run_ahead import MAX_NEW, OVERDUE_30MS, PROMPTS, StallsEveryOtherRound, stalled_greedy
from tests.support.harness import device_config, edge, load, patched, run, run_sessions
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

    def superseded(self, rd, verdicts, downlink_bytes):
        ids, ahead = rd.block.token_ids, tuple(v.next_token for v in verdicts)
        if (rd.settings.mode is not Mode.DSSD and not rd.settings.tree and len(ids) > len(ahead)
                and ids[:len(ahead)] == ahead):
            self.could_continue.append((rd.settings.mode, ids, ahead))
        return super().superseded(rd, verdicts, downlink_bytes)


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
