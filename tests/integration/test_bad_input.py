"""Malformed sessions end with a clear gRPC status; the server stays up and other sessions finish."""
from __future__ import annotations

import asyncio
from dataclasses import replace
import math
import struct

import grpc
import pytest

from tests.support.harness import device_config, edge, load, run, run_sessions, target_greedy
from specdec.common import wire
from specdec.common.adjust import MAX_LOGIT_BIAS_ENTRIES, LogitAdjust
from specdec.common.grammar import Grammar, GrammarKind
from specdec.common.codecs import CodecConfig, encode_distribution
from specdec.common.modes import Mode
from specdec.common.modeling import encode_prompt, vocab_fingerprint
from specdec.common.pb import speculative_pb2 as pb
from specdec.common.pb import speculative_pb2_grpc as pb_grpc
from specdec.common.protocol import MAX_STOP_IDS, DraftBlock, DraftSettings, Hello, Prompt
from specdec.device.factory import open_channel
from specdec.edge.verifier import EdgeLimits

PROMPT = "w1 w2 w3"


def _hello(drafter, mode=Mode.TSLT, **settings) -> Hello:
    draft = DraftSettings(**{"mode": mode, "draft_len": 4, "top_k": 8, **settings})
    return Hello(vocab_fingerprint=vocab_fingerprint(drafter.tokenizer),
                 vocab_size=drafter.vocab_size, temperature=1.0, draft=draft, seed=1)


def _valid_payload(vocab_size: int, token: int, top_k: int = 8) -> bytes:
    import torch
    q = torch.full((vocab_size,), 1.0 / vocab_size)
    return encode_distribution(q, CodecConfig(mode=Mode.TSLT, vocab_size=vocab_size, top_k=top_k)).payload


async def _raw_session(address: str, messages) -> grpc.StatusCode:
    """Send raw DeviceMessages after reading Welcome; return the status the edge ends with."""
    async with open_channel(address) as channel:
        call = pb_grpc.SpeculativeDecodingStub(channel).Generate(timeout=30)
        try:
            for msg in messages:
                await call.write(msg)
                if msg.WhichOneof("kind") in ("hello", "draft"):
                    reply = await call.read()
                    if reply is grpc.aio.EOF:
                        break
            await call.done_writing()
            while await call.read() is not grpc.aio.EOF:
                pass
            return await call.code(), await call.details()
        except grpc.aio.AioRpcError as exc:
            return exc.code(), exc.details()


def _bad_cases(drafter):
    V = drafter.vocab_size
    hello = wire.hello_to_pb(_hello(drafter))
    prompt = wire.prompt_to_pb(Prompt(tuple(encode_prompt(drafter.tokenizer, PROMPT, raw=True))))
    good = _valid_payload(V, 5)

    def draft(**kw):
        base = dict(round_id=1, token_ids=(5,), distributions=(good,))
        return wire.draft_to_pb(DraftBlock(**{**base, **kw}))

    bad_fp = pb.DeviceMessage(hello=pb.Hello(**{**_fields(hello.hello), "vocab_fingerprint": "0" * 64}))
    big_k = wire.hello_to_pb(_hello(drafter, top_k=V + 1))
    nan_payload = _tslt_with_nan(good)
    bias_beyond = wire.hello_to_pb(replace(_hello(drafter), adjust=LogitAdjust(((V, 1.0),))))
    bias_too_big = wire.hello_to_pb(replace(_hello(drafter), adjust=LogitAdjust.of(
        {i: 1.0 for i in range(MAX_LOGIT_BIAS_ENTRIES + 1)})))
    bias_uneven = wire.hello_to_pb(replace(_hello(drafter), adjust=LogitAdjust.of({3: 1.0})))
    bias_uneven.hello.adjust.bias_values.append(2.0)
    penalty = wire.hello_to_pb(replace(_hello(drafter), adjust=LogitAdjust(presence_penalty=3.0)))
    bad_regex = wire.hello_to_pb(replace(_hello(drafter), grammar=Grammar(GrammarKind.REGEX, "(unclosed")))
    huge_grammar = wire.hello_to_pb(replace(_hello(drafter), grammar=Grammar(GrammarKind.REGEX, "a" * 70_000)))
    odd_kind = wire.hello_to_pb(replace(_hello(drafter), grammar=Grammar(GrammarKind.REGEX, "a")))
    odd_kind.hello.grammar.kind = 99
    stop_beyond = wire.hello_to_pb(replace(_hello(drafter), stop_ids=(2, V)))
    stops_too_many = wire.hello_to_pb(replace(_hello(drafter), stop_ids=tuple(range(MAX_STOP_IDS + 1))))
    return {
        "vocabulary mismatch": ([bad_fp], grpc.StatusCode.FAILED_PRECONDITION),
        "K > V": ([big_k], grpc.StatusCode.RESOURCE_EXHAUSTED),
        "token id out of range": ([hello, prompt, draft(token_ids=(V + 3,))], grpc.StatusCode.INVALID_ARGUMENT),
        "prompt id out of range": ([hello, wire.prompt_to_pb(Prompt((1, V)))], grpc.StatusCode.INVALID_ARGUMENT),
        "NaN in payload": ([hello, prompt, draft(distributions=(nan_payload,))], grpc.StatusCode.INVALID_ARGUMENT),
        "truncated payload": ([hello, prompt, draft(distributions=(good[:-3],))], grpc.StatusCode.INVALID_ARGUMENT),
        "round id out of order": ([hello, prompt, draft(round_id=2)], grpc.StatusCode.INVALID_ARGUMENT),
        "missing distribution": ([hello, prompt, draft(distributions=())], grpc.StatusCode.INVALID_ARGUMENT),
        "draft before prompt": ([hello, draft()], grpc.StatusCode.INVALID_ARGUMENT),
        "empty message": ([pb.DeviceMessage()], grpc.StatusCode.INVALID_ARGUMENT),
        "logit bias beyond the vocabulary": ([bias_beyond], grpc.StatusCode.INVALID_ARGUMENT),
        "logit bias over the edge's limit": ([bias_too_big], grpc.StatusCode.RESOURCE_EXHAUSTED),
        "logit bias ids and values uneven": ([bias_uneven], grpc.StatusCode.INVALID_ARGUMENT),
        "presence penalty out of range": ([penalty], grpc.StatusCode.INVALID_ARGUMENT),
        "grammar the engine refuses": ([bad_regex], grpc.StatusCode.INVALID_ARGUMENT),
        "grammar over the size limit": ([huge_grammar], grpc.StatusCode.INVALID_ARGUMENT),
        "grammar of an unknown kind": ([odd_kind], grpc.StatusCode.INVALID_ARGUMENT),
        "stop id beyond the vocabulary": ([stop_beyond], grpc.StatusCode.INVALID_ARGUMENT),
        "more stop ids than an edge takes": ([stops_too_many], grpc.StatusCode.RESOURCE_EXHAUSTED),
        "prompt_len beyond the prompt": ([hello, wire.prompt_to_pb(Prompt((1, 2), prompt_len=3))],
                                         grpc.StatusCode.INVALID_ARGUMENT),
        "draft too long": ([hello, prompt, draft(token_ids=(5,) * 5, distributions=(good,) * 5)],
                           grpc.StatusCode.RESOURCE_EXHAUSTED),
    }


def _fields(msg) -> dict:
    return {f.name: getattr(msg, f.name) for f, _ in msg.ListFields()}


def _tslt_with_nan(payload: bytes) -> bytes:
    """Overwrite the last fp16 value of a TSLT payload with NaN."""
    return payload[:-2] + struct.pack("<e", math.nan)


def test_each_bad_session_ends_with_its_status_while_a_good_one_completes(tiny_pair_v512) -> None:
    target_dir, drafter_dir = tiny_pair_v512
    drafter = load(str(drafter_dir))
    cases = _bad_cases(drafter)
    cfg = device_config(mode=Mode.TSLT, temperature=0.0, max_new_tokens=24, top_k=8)

    async def main():
        async with edge(target_dir) as address:
            good = asyncio.create_task(run_sessions(address, drafter_dir, cfg, PROMPT, [0]))
            statuses = {name: await _raw_session(address, msgs) for name, (msgs, _) in cases.items()}
            [(tokens, _, _)] = await good
            # The server is still up for a fresh session after all of that.
            [(again, _, _)] = await run_sessions(address, drafter_dir, cfg, PROMPT, [0])
            return statuses, tokens, again

    statuses, tokens, again = run(main())
    for name, (_, expected) in cases.items():
        code, details = statuses[name]
        assert code == expected, f"{name}: {code} {details}"
        assert details, f"{name}: no message"
    expected_tokens = target_greedy(target_dir, encode_prompt(drafter.tokenizer, PROMPT, raw=True), 24)
    assert tokens == expected_tokens == again


RESUME_WINDOW_S = 0.5  # short, so the detached session of a vanished client expires during the test


def test_vanishing_client_mid_round_frees_its_session(tiny_pair_v512) -> None:
    """A vanished client's session waits RESUME_WINDOW_S for a resume, then is freed."""
    target_dir, drafter_dir = tiny_pair_v512
    drafter = load(str(drafter_dir))
    hello = wire.hello_to_pb(_hello(drafter))
    prompt = wire.prompt_to_pb(Prompt(tuple(encode_prompt(drafter.tokenizer, PROMPT, raw=True))))
    from specdec.edge.metrics import EdgeMetrics
    metrics = EdgeMetrics()

    async def main():
        async with edge(target_dir, metrics=metrics, limits=EdgeLimits(resume_window_s=RESUME_WINDOW_S)) as address:
            async with open_channel(address) as channel:
                call = pb_grpc.SpeculativeDecodingStub(channel).Generate()
                await call.write(hello)
                await call.read()
                await call.write(prompt)
                await call.write(wire.draft_to_pb(DraftBlock(1, (5,), (_valid_payload(drafter.vocab_size, 5),))))
                call.cancel()  # vanish without reading the verdict
            for _ in range(100):
                if metrics.registry.get_sample_value("specdec_edge_sessions_active") == 0:
                    break
                await asyncio.sleep(0.05)
            active = metrics.registry.get_sample_value("specdec_edge_sessions_active")
            cfg = device_config(mode=Mode.TSLT, temperature=0.0, max_new_tokens=8, top_k=8)
            [(tokens, _, _)] = await run_sessions(address, drafter_dir, cfg, PROMPT, [0])
            return active, tokens

    active, tokens = run(main())
    assert active == 0
    assert tokens == target_greedy(target_dir, encode_prompt(drafter.tokenizer, PROMPT, raw=True), 8)


def test_session_limit_answers_resource_exhausted(tiny_pair_v512) -> None:
    target_dir, drafter_dir = tiny_pair_v512
    drafter = load(str(drafter_dir))
    hello = wire.hello_to_pb(_hello(drafter))

    async def main():
        async with edge(target_dir, limits=EdgeLimits(max_sessions=1)) as address:
            async with open_channel(address) as channel:
                first = pb_grpc.SpeculativeDecodingStub(channel).Generate()
                await first.write(hello)
                await first.read()  # session 1 is open
                code = await _raw_session(address, [hello])
                first.cancel()
                return code

    code, details = run(main())
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and "limit" in details


@pytest.mark.parametrize("timeout", [0.3])
def test_idle_session_times_out(tiny_pair_v512, timeout) -> None:
    target_dir, drafter_dir = tiny_pair_v512
    drafter = load(str(drafter_dir))
    hello = wire.hello_to_pb(_hello(drafter))

    async def main():
        async with edge(target_dir, limits=EdgeLimits(idle_timeout_s=timeout)) as address:
            async with open_channel(address) as channel:
                # the call's own deadline is far later: a DEADLINE_EXCEEDED that names the idle time is the edge's
                call = pb_grpc.SpeculativeDecodingStub(channel).Generate(timeout=60)
                await call.write(hello)
                await call.read()
                try:
                    await call.read()  # nothing is sent: this returns when the edge gives up on the session
                except grpc.aio.AioRpcError as exc:
                    return exc.code(), exc.details()
                return await call.code(), await call.details()

    code, details = run(main())
    assert code == grpc.StatusCode.DEADLINE_EXCEEDED and f"idle for more than {timeout:g} s" in details, details
