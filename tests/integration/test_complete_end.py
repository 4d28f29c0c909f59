"""A session that holds every token its device asked for ends at once (servicer.COMPLETE): the edge sends
End(OK) after the last verdict, without waiting for the device's Close, and the device returns on that
End without waiting for the call's status, which a round trip later (its half-close reaching the edge)
is all that would add. Real gRPC on loopback, tiny models."""
from __future__ import annotations

import asyncio

import grpc

from specdec.common import wire
from specdec.common.modeling import encode_prompt
from specdec.common.modes import Mode
from specdec.common.protocol import DraftBlock, DraftSettings, End
from specdec.edge import servicer
from specdec.edge.metrics import EdgeMetrics
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


def test_a_device_returns_on_the_end_without_the_status(tiny_pair_v512) -> None:
    """The edge's status is held until the test releases it, after the sessions returned: drafted and
    edge-only sessions to max_new_tokens return the target's greedy tokens all the same, and the edge
    counts each ok. Without the device's change (awaiting the status after an End) they never return."""
    target_dir, drafter_dir = tiny_pair_v512
    release = None
    metrics = EdgeMetrics()

    async def held_until_released(context) -> None:
        await release.wait()

    async def main():
        nonlocal release
        release = asyncio.Event()
        async with edge(target_dir, metrics=metrics) as address:
            out = []
            for mode in ("tslt", "none"):
                cfg = device_config(mode=mode, max_new_tokens=MAX_NEW, temperature=0.0)
                out.append(await asyncio.wait_for(run_sessions(address, drafter_dir, cfg, "w5 w6 w7", [1]), WAIT_S))
            release.set()
            return out

    with patched([(servicer, "_until_half_closed", held_until_released), (servicer, "END_WAIT_S", 2 * WAIT_S)]):
        out = run(main())
    tok = load(str(drafter_dir)).tokenizer
    expected = target_greedy(target_dir, encode_prompt(tok, "w5 w6 w7", raw=True), MAX_NEW)
    assert [o[0][0] for o in out] == [expected, expected]
    assert metrics.registry.get_sample_value("specdec_edge_sessions_ended_total", {"status": "ok"}) == 2
