"""A session that holds every token its device asked for, or a token among its end-of-sequence ids
(Hello.stop_ids), ends at once (servicer.COMPLETE): the edge sends End(OK) after the last verdict,
without waiting for the device's Close, and the device returns on that End without waiting for the
call's status, which a round trip later (its half-close reaching the edge) is all that would add. Real
gRPC on loopback, tiny models."""
from __future__ import annotations

import asyncio
from dataclasses import dataclass

import grpc
import pytest

from specdec.common import wire
from specdec.common.modeling import encode_prompt
from specdec.common.modes import Mode
from specdec.common.modeling import LoadedModel
from specdec.common.protocol import MAX_STOP_IDS, DraftBlock, DraftSettings, End
from specdec.device.client import stop_ids
from specdec.edge import servicer
from specdec.edge.metrics import EdgeMetrics
from specdec.edge.verifier import VerifierSession
from tests.support.harness import device_config, edge, load, patched, run, run_sessions, servicer_of, target_greedy
from tests.support.raw_stream import PROMPT_IDS, RawSession

MAX_NEW = 6
WAIT_S = 30.0  # an End that never comes, a generate that waits for the held status: the test fails at this


def test_the_edge_ends_a_complete_session_before_its_close(tiny_pair_v512) -> None:
    """Three edge-only tokens of three asked for, then End(OK) unprompted; the status once the device
    half-closes; the session freed and counted ok. A device that does not read End (the default Hello)
    still closes the session itself, as before."""
    target_dir, drafter_dir = tiny_pair_v512
    drafter = load(str(drafter_dir))
    three = DraftSettings(mode=Mode.NONE, edge_tokens=3, coupled_bonus=False)
    metrics = EdgeMetrics()

    async def main():
        async with edge(target_dir, metrics=metrics) as address:
            s = await RawSession(address, drafter, max_new_tokens=3, wants_end=True).open()
            await s.call.write(wire.draft_to_pb(DraftBlock(1, (), settings=three, start=len(PROMPT_IDS))))
            got = [wire.edge_message_from_pb(await asyncio.wait_for(s.call.read(), WAIT_S)) for _ in range(4)]
            await s.call.done_writing()
            code = await s.call.code()
            await s.channel.close()
            return got, code, len(servicer_of(address).registry.sessions)

    got, code, left = run(main())
    assert [v.next_token for v in got[:3]] == target_greedy(target_dir, list(PROMPT_IDS), 3)
    assert isinstance(got[3], End) and got[3].code == grpc.StatusCode.OK.value[0], got[3]
    assert code is grpc.StatusCode.OK and left == 0
    assert metrics.registry.get_sample_value("specdec_edge_sessions_ended_total", {"status": "ok"}) == 1


def _status_held(target_dir, metrics, sessions, *patches):
    """``sessions(address)``'s result against an edge whose status, after an End, is held until they have
    returned (its wait for the half-close blocks): a device that waits for the status fails at WAIT_S."""
    release = None

    async def held_until_released(context) -> None:
        await release.wait()

    async def main():
        nonlocal release
        release = asyncio.Event()
        async with edge(target_dir, metrics=metrics) as address:
            out = await asyncio.wait_for(sessions(address), WAIT_S)
            release.set()
            return out

    with patched([(servicer, "_until_half_closed", held_until_released), (servicer, "END_WAIT_S", 2 * WAIT_S), *patches]):
        return run(main())


def test_a_device_returns_on_the_end_without_the_status(tiny_pair_v512) -> None:
    """The edge's status is held until the test releases it, after the sessions returned: drafted and
    edge-only sessions to max_new_tokens return the target's greedy tokens all the same, and the edge
    counts each ok. Without the device's change (awaiting the status after an End) they never return."""
    target_dir, drafter_dir = tiny_pair_v512
    metrics = EdgeMetrics()

    async def sessions(address):
        return [await run_sessions(address, drafter_dir, device_config(mode=mode, max_new_tokens=MAX_NEW,
                                                                       temperature=0.0), "w5 w6 w7", [1])
                for mode in ("tslt", "none")]

    out = _status_held(target_dir, metrics, sessions)
    tok = load(str(drafter_dir)).tokenizer
    expected = target_greedy(target_dir, encode_prompt(tok, "w5 w6 w7", raw=True), MAX_NEW)
    assert [o[0][0] for o in out] == [expected, expected]
    assert metrics.registry.get_sample_value("specdec_edge_sessions_ended_total", {"status": "ok"}) == 2


def _first_new(tokens: list[int], at_least: int) -> int:
    """The first index from ``at_least`` on whose token does not occur before it: a stop token there ends
    the session there."""
    return next(i for i in range(at_least, len(tokens)) if tokens[i] not in tokens[:i])


def test_the_edge_ends_a_session_at_the_device_s_stop_token(tiny_pair_v512) -> None:
    """An edge-only round of 6 tokens ends at the first of the Hello's stop ids, and End(OK) follows."""
    target_dir, drafter_dir = tiny_pair_v512
    drafter = load(str(drafter_dir))
    greedy = target_greedy(target_dir, list(PROMPT_IDS), MAX_NEW)
    stop_at = _first_new(greedy, 1)
    six = DraftSettings(mode=Mode.NONE, edge_tokens=MAX_NEW, coupled_bonus=False)

    async def main():
        async with edge(target_dir) as address:
            s = await RawSession(address, drafter, max_new_tokens=MAX_NEW, wants_end=True,
                                 stop_ids=(greedy[stop_at],)).open()
            await s.call.write(wire.draft_to_pb(DraftBlock(1, (), settings=six, start=len(PROMPT_IDS))))
            got = []  # up to the End (or, without the stop ids, the round's 6 tokens and the End at max_new_tokens)
            while not got or not isinstance(got[-1], End):
                got.append(wire.edge_message_from_pb(await asyncio.wait_for(s.call.read(), WAIT_S)))
            await s.call.done_writing()
            code = await s.call.code()
            await s.channel.close()
            return got, code

    got, code = run(main())
    assert [v.next_token for v in got[:-1]] == greedy[:stop_at + 1] and not got[-2].more
    assert isinstance(got[-1], End) and got[-1].code == grpc.StatusCode.OK.value[0] and code is grpc.StatusCode.OK


@dataclass
class _StopsAt(LoadedModel):
    """The drafter with other end-of-sequence ids: the device's, as generate gets them."""
    stop: tuple[int, ...] = ()

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        return self.stop


class SeesStopIds(VerifierSession):
    seen: list = []

    def __init__(self, target, info, hello, *args, **kw):
        SeesStopIds.seen.append(hello.stop_ids)
        super().__init__(target, info, hello, *args, **kw)


@pytest.mark.parametrize("mode", ["tslt", "gumbel", "none"])
def test_a_device_whose_session_ends_at_its_stop_token_names_it_and_returns_on_the_end(tiny_pair_v512, mode) -> None:
    """With the edge's status held, as above: a session that ends at a token of the device's own
    end-of-sequence set (a drafter whose set is that token) names the set in its Hello, returns the
    target's greedy tokens up to it, and the edge counts it ok."""
    target_dir, drafter_dir = tiny_pair_v512
    drafter = load(str(drafter_dir))
    tok = drafter.tokenizer
    expected = target_greedy(target_dir, encode_prompt(tok, "w5 w6 w7", raw=True), 3 * MAX_NEW)
    stop_at = _first_new(expected, MAX_NEW)
    stops = _StopsAt(drafter.model, drafter.tokenizer, drafter.name, drafter.device, stop=(expected[stop_at],))
    metrics = EdgeMetrics()
    cfg = device_config(mode=mode, max_new_tokens=3 * MAX_NEW, temperature=0.0)
    SeesStopIds.seen = []
    [(tokens, _, _)] = _status_held(target_dir, metrics, lambda address: run_sessions(address, stops, cfg, "w5 w6 w7", [1]),
                                    (servicer, "VerifierSession", SeesStopIds))
    assert tokens == expected[:stop_at + 1] and SeesStopIds.seen == [(expected[stop_at],)]
    assert metrics.registry.get_sample_value("specdec_edge_sessions_ended_total", {"status": "ok"}) == 1


def test_a_device_names_its_stop_ids_unless_there_are_more_than_an_edge_takes() -> None:
    assert stop_ids([7, 2, 7]) == (2, 7) and stop_ids(()) == ()
    assert stop_ids(range(MAX_STOP_IDS + 1)) == ()  # the edge would refuse the Hello: the Close tells it instead
