"""Resume after faults: the edge process killed and restarted, the link cut for 5 s. With a fixed
seed at temperature 0 the output is identical to an uninterrupted run: nothing lost or duplicated."""
from __future__ import annotations

import asyncio

from tests.support.harness import EdgeProcess, device_config, edge, load, run, target_greedy
from tests.support.linkcut import CuttableLink
from specdec.common.modes import Mode
from specdec.common.modeling import encode_prompt, vocab_fingerprint
from specdec.device.client import ConnectionPolicy, generate
from specdec.device.session import DraftSession
from specdec.device.factory import open_channel
from specdec.edge.metrics import EdgeMetrics
from specdec.edge.verifier import EdgeLimits

PROMPT = "w11 w12 w13"
MAX_NEW = 40
CUT_AFTER_TOKENS = 12
LINK_DOWN_S = 5.0
POLICY = ConnectionPolicy(round_timeout_s=10.0, reconnect_timeout_s=60.0, backoff_initial_s=0.2, backoff_max_s=1.0)


async def _generate(address: str, drafter_dir, on_tokens=None, mode=Mode.TSLT):
    drafter = load(str(drafter_dir))
    cfg = device_config(mode=mode, temperature=0.0, max_new_tokens=MAX_NEW, top_k=16)
    hello = cfg.hello(vocab_fingerprint(drafter.tokenizer), drafter.vocab_size, seed=0)
    prompt = encode_prompt(drafter.tokenizer, PROMPT, raw=True)
    async with open_channel(address) as channel:
        return await generate(channel, DraftSession(drafter, hello), hello, prompt, drafter.eos_token_ids,
                              on_tokens=on_tokens, timeout=120, policy=POLICY)


def _expected(target_dir, drafter_dir) -> list[int]:
    tok = load(str(drafter_dir)).tokenizer
    return target_greedy(target_dir, encode_prompt(tok, PROMPT, raw=True), MAX_NEW)


def _once_after(n: int, action):
    """An on_tokens callback that runs ``action`` once, when n tokens have been delivered."""
    seen = {"n": 0, "done": False}

    def on_tokens(new):
        seen["n"] += len(new)
        if seen["n"] >= n and not seen["done"]:
            seen["done"] = True
            action()
    return on_tokens


def test_link_cut_for_5s_resumes_the_same_session(accepting_pair_v512) -> None:
    target_dir, drafter_dir = accepting_pair_v512
    metrics = EdgeMetrics()

    async def main():
        async with edge(target_dir, metrics=metrics, limits=EdgeLimits(resume_window_s=30)) as address:
            host, port = address.split(":")
            link = await CuttableLink(host, int(port)).start()
            try:
                t0 = asyncio.get_running_loop().time()
                r = await _generate(link.address, drafter_dir, _once_after(CUT_AFTER_TOKENS, lambda: link.cut(LINK_DOWN_S)))
                return r, asyncio.get_running_loop().time() - t0
            finally:
                await link.close()

    result, elapsed = run(main())
    assert result.token_ids == _expected(target_dir, drafter_dir)
    assert result.stats.accepted_tokens > 0  # drafts accepted, before and after the resume
    assert result.reconnects >= 1 and elapsed >= LINK_DOWN_S
    # The edge still had the session: it was resumed (KV reused), not re-created.
    assert metrics.registry.get_sample_value("specdec_edge_sessions_resumed_total") >= 1
    assert metrics.registry.get_sample_value("specdec_edge_sessions_started_total", {"mode": "tslt"}) == 1


def test_edge_killed_and_restarted_mid_generation(accepting_pair_v512) -> None:
    target_dir, drafter_dir = accepting_pair_v512
    first = EdgeProcess("--model", str(target_dir))
    port = first.port
    state = {"second": None}

    def kill_and_restart():
        first.proc.kill()  # no graceful shutdown: the edge loses every session
        first.proc.wait()

        async def restart():
            state["second"] = await asyncio.to_thread(EdgeProcess, "--model", str(target_dir), port=port)
        asyncio.get_running_loop().create_task(restart())

    try:
        result = run(_generate(first.address, drafter_dir, _once_after(CUT_AFTER_TOKENS, kill_and_restart)))
    finally:
        for proc in (first, state["second"]):
            if proc is not None and proc.proc.poll() is None:
                proc.stop()
    assert result.token_ids == _expected(target_dir, drafter_dir)
    assert result.stats.accepted_tokens > 0
    assert result.reconnects >= 1
    assert state["second"] is not None


def test_a_half_close_failing_after_the_last_token_ends_the_session_as_usual(tiny_pair_v512, monkeypatch) -> None:
    """grpc.aio raises its ExecuteBatchError from ``done_writing`` when the call broke under it (CI: a
    fleet's edge SIGKILLed just after a session's last round). Every token is delivered by then: the
    session ends with them, as a broken write would (not with an error the device never meant)."""
    from grpc._cython import cygrpc
    from grpc.aio import _call

    real, failed = _call._StreamRequestMixin.done_writing, []

    async def failing_once(self):
        if not failed:
            failed.append(True)
            raise cygrpc.ExecuteBatchError('Failed "execute_batch": (SendCloseFromClientOperation,)')
        return await real(self)

    monkeypatch.setattr(_call._StreamRequestMixin, "done_writing", failing_once)
    target_dir, drafter_dir = tiny_pair_v512
    drafter = load(str(drafter_dir))
    prompt = encode_prompt(drafter.tokenizer, PROMPT, raw=True)
    cfg = device_config(temperature=0.0, max_new_tokens=12, mode=Mode.TSLT, top_k=16)
    hello = cfg.hello(vocab_fingerprint(drafter.tokenizer), drafter.vocab_size, seed=0)

    async def main():
        async with edge(target_dir) as address, open_channel(address) as channel:
            return await generate(channel, DraftSession(drafter, hello), hello, prompt, drafter.eos_token_ids,
                                  timeout=60, policy=POLICY)

    r = run(main())
    assert failed, "the patched half-close never ran"
    assert r.token_ids == target_greedy(target_dir, prompt, 12)


def test_a_stream_a_resume_replaced_acts_no_more_on_the_session(tiny_pair_v512) -> None:
    """A device that reconnects before the edge sees its old stream break (a proxy holds the old one
    open) resumes on a new stream while the old one still delivers what was in flight: the old stream's
    late round must not touch the session (it would verify a stale round on it, and the new stream's
    next round would be out of order), nor may it go on generating ahead."""
    from specdec.common import wire
    from specdec.common.protocol import DraftBlock, DraftSettings, Prompt
    import grpc
    from tests.support.raw_stream import PROMPT_IDS, RawSession
    drafter = load(str(tiny_pair_v512[1]))
    one = DraftSettings(mode=Mode.NONE, edge_tokens=1, coupled_bonus=False)

    async def main():
        async with edge(tiny_pair_v512[0]) as address:
            old = await RawSession(address, drafter).open()
            new = await RawSession(address, drafter, resume_session_id=old.welcome.session_id,
                                   resume_token=old.welcome.resume_token).open(prompt=False)
            await new.call.write(wire.prompt_to_pb(Prompt(PROMPT_IDS)))
            assert new.welcome.resumed
            await old.call.write(wire.draft_to_pb(DraftBlock(1, (), settings=one, run_ahead_ms=1)))
            stale = await old.call.read()  # before the fix: a Verdict of the stale round
            await new.call.write(wire.draft_to_pb(DraftBlock(1, (), settings=one)))
            fresh = wire.edge_message_from_pb(await new.call.read())
            code = await new.close()
            await old.channel.close()
            return stale, fresh, code

    stale, fresh, code = run(main())
    assert stale is grpc.aio.EOF  # the old stream ended without acting
    assert fresh.round_id == 1 and fresh.next_token is not None and code is grpc.StatusCode.OK
