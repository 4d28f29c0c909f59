"""Mode none: the edge generates alone and streams its tokens over the same protocol (the baseline
every link benchmark compares with). Greedy identity and the exact-law test run with every mode in
test_end_to_end.py and test_lossless_e2e.py; here: streaming, the round's bounds, replay, bad input."""
from __future__ import annotations

import asyncio
import json
import shutil
from dataclasses import replace

import grpc
import pytest

from tests.support.harness import device_cli, device_config, edge, load, run, run_sessions, target_greedy
from specdec.common import wire
from specdec.common.modes import Mode
from specdec.common.modeling import encode_prompt, vocab_fingerprint
from specdec.common.pb import speculative_pb2_grpc as pb_grpc
from specdec.common.protocol import DraftBlock, Prompt
from specdec.common.settings import resolve
from specdec.device.client import generate
from specdec.device.session import DraftSession
from specdec.device.factory import connection_policy, edge_channel
from specdec.edge.server import target_info
from specdec.edge.metrics import EdgeMetrics
from specdec.edge.verifier import EdgeLimits, VerifierSession

PROMPT = "w1 w2 w3"


def test_tokens_stream_one_by_one_in_one_round(tiny_pair_v512) -> None:
    """All the tokens in one round, each handed on as it arrives (not at the round's end)."""
    target_dir, drafter_dir = tiny_pair_v512
    cfg = device_config(mode=Mode.NONE, temperature=0.0, max_new_tokens=10)
    seen: list[list[int]] = []

    async def main():
        async with edge(target_dir) as address:
            drafter = load(str(drafter_dir))
            hello = cfg.hello(vocab_fingerprint(drafter.tokenizer), drafter.vocab_size, seed=0)
            session = DraftSession(drafter, hello)
            ids = encode_prompt(drafter.tokenizer, PROMPT, raw=True)
            async with edge_channel(replace(cfg, edge=address)) as channel:
                r = await generate(channel, session, hello, ids, drafter.eos_token_ids, on_tokens=seen.append,
                                   policy=connection_policy(cfg))
            return r, session, ids

    r, session, ids = run(main())
    assert r.token_ids == target_greedy(target_dir, ids, 10)
    assert session.stats.rounds == 1 and session.stats.draft_tokens == 0
    assert seen == [[t] for t in r.token_ids]  # one callback per token
    assert r.downlink_bytes > 0 and r.uplink_bytes < 64  # an empty Draft up, one Verdict per token down


def _fresh_edge(target_dir, hello, prefix):
    target = load(str(target_dir))
    session = VerifierSession(target, target_info(target), hello, EdgeLimits(), "s")
    session.prefill(Prompt(tuple(prefix)))
    return session


def _hello(drafter, **settings):
    return device_config(mode=Mode.NONE, temperature=1.0, **settings).hello(
        vocab_fingerprint(drafter.tokenizer), drafter.vocab_size, seed=7)


def test_a_round_stops_at_edge_tokens_and_replays_on_a_fresh_edge(tiny_pair_v512) -> None:
    """edge_tokens bounds the round; the token at each position comes from that position's own
    stream, so an edge that lost the session and re-prefills at any point redraws the same tokens."""
    target_dir, drafter_dir = tiny_pair_v512
    drafter = load(str(drafter_dir))
    hello = _hello(drafter)
    prompt = encode_prompt(drafter.tokenizer, PROMPT, raw=True)
    settings = resolve({"mode": "none", "edge_tokens": 6})
    first = [v for v in _fresh_edge(target_dir, hello, prompt).generate(DraftBlock(1, (), settings=settings))]
    tokens = [v.next_token for v in first]
    assert len(first) == 6 or first[-1].next_token in drafter.eos_token_ids
    assert [v.more for v in first] == [True] * (len(first) - 1) + [False]
    for cut in range(1, len(tokens)):  # the stream broke after `cut` tokens: resume on a fresh edge
        rest = resolve({"mode": "none", "edge_tokens": len(tokens) - cut})
        again = _fresh_edge(target_dir, hello, prompt + tokens[:cut]).generate(DraftBlock(1, (), settings=rest))
        assert [v.next_token for v in again] == tokens[cut:], cut


def test_a_round_sent_ahead_after_an_eos_is_void_and_one_not_sent_ahead_goes_on(tiny_pair_v512) -> None:
    """The device sends an edge-only round's request before the last one's end (engine._send_ahead);
    if that round ended at an end-of-sequence token, the device has most likely finished: the edge
    answers one token-less Verdict and runs no forward. A round asked for normally goes on past it."""
    target_dir, drafter_dir = tiny_pair_v512
    drafter = load(str(drafter_dir))
    hello = _hello(drafter)
    prompt = encode_prompt(drafter.tokenizer, PROMPT, raw=True) + [min(drafter.eos_token_ids)]
    settings = resolve({"mode": "none", "edge_tokens": 3})
    edge = _fresh_edge(target_dir, hello, prompt)
    [void] = edge.generate(DraftBlock(1, (), settings=settings, sent_ahead=True))
    assert void.next_token is None and not void.more and void.num_accepted == 0
    assert edge.tokens == prompt and edge.lm.cache_len < len(prompt)  # nothing generated, no forward
    on = [v.next_token for v in edge.generate(DraftBlock(2, (), settings=settings))]
    assert len(on) >= 1 and all(t is not None for t in on) and edge.tokens == prompt + on
    with pytest.raises(ValueError, match="only an edge-only round"):
        edge.verify(DraftBlock(3, (5,), settings=resolve({"mode": "gumbel", "draft_len": 1}), sent_ahead=True))


def test_edge_only_rounds_sent_ahead_over_grpc_are_the_targets_greedy_decode(tiny_pair_v512, edge_v512) -> None:
    """Rounds of 4 tokens, each after the first requested while the one before streams, over a real
    stream: the target's greedy tokens, in the rounds asked for."""
    target_dir, drafter_dir = tiny_pair_v512
    cfg = device_config(mode=Mode.NONE, edge_tokens=4, temperature=0.0, max_new_tokens=14, draft_ahead=True,
                        edge=edge_v512.address)
    drafter = load(str(drafter_dir))
    hello = cfg.hello(vocab_fingerprint(drafter.tokenizer), drafter.vocab_size, seed=0)
    session = DraftSession(drafter, hello, draft_ahead=True, round_log=True)
    ids = encode_prompt(drafter.tokenizer, PROMPT, raw=True)

    async def main():
        async with edge_channel(cfg) as channel:
            return await generate(channel, session, hello, ids, drafter.eos_token_ids, policy=connection_policy(cfg))

    r = run(main())
    assert r.token_ids == target_greedy(target_dir, ids, 14) and len(r.token_ids) == 14  # no EOS on the way
    assert [e["generated"] for e in session.round_log] == [4, 4, 4, 2]
    assert [e["sent_ahead"] for e in session.round_log] == [False, True, True, True]
    # each round measured how its tokens streamed (mode auto prices edge-only by it)
    assert all(0 < e["token_interval_s"] < 5 for e in session.round_log)


@pytest.mark.parametrize("edge_knows_the_eos", (True, False))
def test_a_session_that_ends_with_a_round_sent_ahead_closes_at_once(tiny_pair_v512, tmp_path,
                                                                   edge_knows_the_eos) -> None:
    """A session ends at an end-of-sequence token after the next round's request went out: the edge
    answers that round void (its target's EOS) or streams it (a token only the device stops at), and
    the device reads what comes and closes (a gRPC call's status waits for its messages to be read:
    without that the device waited for the status forever). The edge counts the session as ok."""
    target_dir, drafter_dir = tiny_pair_v512
    drafter = load(str(drafter_dir))
    ids = encode_prompt(drafter.tokenizer, PROMPT, raw=True)
    greedy = target_greedy(target_dir, ids, 12)
    # chunks of 4: the second round's request for the third goes out after its second token (index 5)
    end = next(i for i in (6, 7) if greedy[i] not in greedy[:i])
    eos = greedy[end]
    edge_dir = _with_eos(target_dir, tmp_path, eos) if edge_knows_the_eos else target_dir
    cfg = device_config(mode=Mode.NONE, edge_tokens=4, temperature=0.0, max_new_tokens=12)
    hello = cfg.hello(vocab_fingerprint(drafter.tokenizer), drafter.vocab_size, seed=0)
    session = DraftSession(drafter, hello, draft_ahead=True, round_log=True)

    metrics = EdgeMetrics()

    async def main():
        async with edge(edge_dir, metrics=metrics) as address:
            async with edge_channel(replace(cfg, edge=address)) as channel:
                return await asyncio.wait_for(generate(channel, session, hello, ids, (eos,),
                                                       policy=connection_policy(cfg)), 20)

    r = run(main())
    assert r.token_ids == greedy[:end + 1]
    assert session.take_sent_ahead() is not None  # the round asked for ahead was never needed
    ended = metrics.registry.get_sample_value
    assert ended("specdec_edge_sessions_ended_total", {"status": "ok"}) == 1
    assert metrics.registry.get_sample_value("specdec_edge_sessions_active") == 0


def _with_eos(target_dir, tmp_path, eos: int):
    """A copy of the target whose configs name ``eos`` its end-of-sequence token."""
    edge_dir = tmp_path / "target"
    shutil.copytree(target_dir, edge_dir)
    for name in ("config.json", "generation_config.json"):
        if (edge_dir / name).exists():
            conf = json.loads((edge_dir / name).read_text())
            conf["eos_token_id"] = eos
            (edge_dir / name).write_text(json.dumps(conf))
    return edge_dir


def test_a_session_that_outlives_its_early_close_resumes(tiny_pair_v512, tmp_path) -> None:
    """The one round that would end the session sends Close with its first token; the edge ends that
    round early at its target's end-of-sequence token, which the device does not stop at. The device
    resumes on a new stream (the edge has ended the session, or ends it when it reads the Close) and
    gets the target's greedy tokens on past it, none lost or repeated."""
    target_dir, drafter_dir = tiny_pair_v512
    drafter = load(str(drafter_dir))
    ids = encode_prompt(drafter.tokenizer, PROMPT, raw=True)
    greedy = target_greedy(target_dir, ids, 8)
    end = next(i for i in range(2, 6) if greedy[i] not in greedy[:i])
    cfg = device_config(mode=Mode.NONE, edge_tokens=8, temperature=0.0, max_new_tokens=8)
    hello = cfg.hello(vocab_fingerprint(drafter.tokenizer), drafter.vocab_size, seed=0)
    session = DraftSession(drafter, hello, draft_ahead=True, round_log=True)

    async def main():
        async with edge(_with_eos(target_dir, tmp_path, greedy[end])) as address:
            async with edge_channel(replace(cfg, edge=address)) as channel:
                return await asyncio.wait_for(generate(channel, session, hello, ids, (),
                                                       policy=connection_policy(cfg)), 20)
    r = run(main())
    assert r.token_ids == greedy and r.reconnects >= 1
    assert session.round_log[0]["generated"] == end + 1


def test_an_edge_only_round_with_a_draft_is_refused_and_the_edge_carries_on(tiny_pair_v512) -> None:
    target_dir, drafter_dir = tiny_pair_v512
    drafter = load(str(drafter_dir))
    hello = _hello(drafter)
    prompt = encode_prompt(drafter.tokenizer, PROMPT, raw=True)
    bad = DraftBlock(1, (5, 6), settings=resolve({"mode": "none", "edge_tokens": 2}))

    async def main():
        async with edge(target_dir) as address:
            async with grpc.aio.insecure_channel(address) as channel:
                call = pb_grpc.SpeculativeDecodingStub(channel).Generate()
                for msg in (wire.hello_to_pb(hello), wire.prompt_to_pb(Prompt(tuple(prompt))), wire.draft_to_pb(bad)):
                    await call.write(msg)
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    while True:
                        await call.read()
                good = await run_sessions(address, drafter_dir, device_config(mode=Mode.NONE, max_new_tokens=4),
                                          PROMPT, [0])
            return err.value, good

    error, [(tokens, _, _)] = run(main())
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT and "no draft" in error.details()
    assert tokens == target_greedy(target_dir, prompt, 4)


def test_device_client_mode_none(tiny_pair_v512, edge_v512) -> None:
    target_dir, drafter_dir = tiny_pair_v512
    r = device_cli("--edge", edge_v512.address, "--draft-model", str(drafter_dir), "--prompt", PROMPT, "--raw",
                   "--mode", "none", "--max-new-tokens", "8", "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout.splitlines()[-1])
    ids = encode_prompt(load(str(drafter_dir)).tokenizer, PROMPT, raw=True)
    assert out["mode"] == "none" and out["token_ids"] == target_greedy(target_dir, ids, 8)
    assert out["stats"]["rounds"] == 1 and out["stats"]["draft_tokens"] == 0
