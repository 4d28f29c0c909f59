"""A session on a raw gRPC stream to a loopback edge, for tests that must choose when a session opens,
sends its Prompt, closes (Close: freed) or breaks (no Close: detached for a resume).

Every wait is on an event the edge itself signals (its Welcome, its refusal, the verdict of a round,
its servicer's count of attached streams), never a sleep: a shared 2-core machine makes any fixed
delay either too short or wasteful.
"""
from __future__ import annotations

import asyncio
import time
from dataclasses import replace

import grpc

from specdec.common import wire
from specdec.common.modeling import vocab_fingerprint
from specdec.common.pb import speculative_pb2_grpc as pb_grpc
from specdec.common.protocol import DraftBlock, DraftSettings, Hello, Prompt, Welcome
from specdec.common.modes import Mode
from tests.support.harness import servicer_of

PROMPT_IDS = (5, 6, 7)
WAIT_S = 10.0     # an edge on loopback answers within this, however loaded the machine
POLL_S = 0.02


def raw_hello(drafter, **kw) -> Hello:
    """A greedy TSLT Hello for ``drafter``'s vocabulary (``kw``: resume fields and the like)."""
    return Hello(vocab_fingerprint=vocab_fingerprint(drafter.tokenizer), vocab_size=drafter.vocab_size,
                 temperature=0.0, draft=DraftSettings(mode=Mode.TSLT, top_k=16), **kw)


async def wait_for(predicate, timeout: float = WAIT_S) -> None:
    """Poll ``predicate`` until it holds; fail the test if it does not within ``timeout``."""
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached"
        await asyncio.sleep(POLL_S)


class RawSession:
    """Hello, then Welcome or the edge's refusal (``code``, ``details``); :meth:`open` sends the Prompt
    unless told not to (a session without one is not kept when its stream ends)."""

    def __init__(self, address: str, drafter, metadata=None, **hello_kw):
        self.address = address
        self.channel = grpc.aio.insecure_channel(address)
        self.call = pb_grpc.SpeculativeDecodingStub(self.channel).Generate(metadata=metadata)
        self.hello = raw_hello(drafter, **hello_kw)
        self.welcome: Welcome | None = None
        self.code: grpc.StatusCode | None = None
        self.details = ""

    async def open(self, prompt: bool = True) -> "RawSession":
        await self.call.write(wire.hello_to_pb(self.hello))
        try:
            msg = await self.call.read()
        except grpc.aio.AioRpcError as exc:
            self.code, self.details = exc.code(), exc.details()
            return self
        if msg is grpc.aio.EOF:
            self.code, self.details = await self.call.code(), await self.call.details()
            return self
        self.welcome = wire.edge_message_from_pb(msg)
        if prompt:
            await self.call.write(wire.prompt_to_pb(Prompt(PROMPT_IDS)))
        return self

    async def close(self) -> grpc.StatusCode:
        await self.call.write(wire.close_to_pb())
        await self.call.done_writing()
        code = await self.call.code()
        await self.channel.close()
        return code

    async def drop(self) -> None:
        """Break the stream once the edge has prefilled the Prompt (it answered a round after it), and
        return once the edge has seen the break and detached the session."""
        servicer = servicer_of(self.address)
        attached = servicer.attached_streams
        one_token = replace(self.hello.draft, mode=Mode.NONE, edge_tokens=1, coupled_bonus=False)
        await self.call.write(wire.draft_to_pb(DraftBlock(round_id=1, token_ids=(), settings=one_token)))
        await self.call.read()  # its verdict: the prefill is done
        await self.channel.close()
        await wait_for(lambda: servicer.attached_streams < attached)
