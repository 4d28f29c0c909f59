"""gRPC client side of one generation session: moves drafts up and verdicts down, nothing more.

Converts between protobuf and :mod:`specdec.common.protocol` with :mod:`specdec.common.wire`, and
calls the blocking :class:`~specdec.device.drafter.DraftSession` off the event loop.
Byte counts are the serialized sizes of the messages actually written and read.
"""
from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Callable

import grpc

from specdec.common import protocol as P
from specdec.common import wire
from specdec.common.engine import decode_target_probs
from specdec.common.pb import speculative_pb2_grpc as pb_grpc
from specdec.device.drafter import DraftSession, RoundDraft
from specdec.device.metrics import DeviceMetrics


class EdgeError(RuntimeError):
    """The edge ended the session with a gRPC status; ``code`` and ``details`` say why."""

    def __init__(self, code: grpc.StatusCode, details: str):
        super().__init__(f"edge session failed: {code.name}: {details}")
        self.code = code
        self.details = details


@dataclass
class GenerationResult:
    token_ids: list[int]
    welcome: P.Welcome
    uplink_bytes: int = 0          # serialized Draft (+ ResidualRequest) messages
    downlink_bytes: int = 0        # serialized Verdict (+ ResidualReply) messages
    setup_bytes: int = 0           # Hello + Prompt + Welcome + Close
    wall_seconds: float = 0.0      # from sending the prompt to the last token
    network_seconds: float = 0.0   # round trips minus the edge's reported verify/queue time
    verify_seconds: float = 0.0    # edge-reported
    dssd_fallbacks: int = 0
    round_uplink_bytes: list[int] = field(default_factory=list)


@dataclass
class _Stream:
    call: object
    metrics: DeviceMetrics | None = None
    mode: str = ""

    async def send(self, msg) -> int:
        await self.call.write(msg)
        return msg.ByteSize()

    async def recv(self):
        msg = await self.call.read()
        if msg is grpc.aio.EOF:
            raise EdgeError(grpc.StatusCode.UNAVAILABLE, "edge closed the stream")
        return msg


async def generate(channel: grpc.aio.Channel, session: DraftSession, hello: P.Hello,
                   prompt_ids: list[int], eos_ids: tuple[int, ...],
                   on_tokens: Callable[[list[int]], None] | None = None,
                   timeout: float | None = None, metrics: DeviceMetrics | None = None) -> GenerationResult:
    """Run one session to EOS or ``hello.max_new_tokens``; stream new tokens to ``on_tokens``."""
    stub = pb_grpc.SpeculativeDecodingStub(channel)
    call = stub.Generate(timeout=timeout)
    mode = hello.mode.value
    if metrics:
        metrics.session_started(mode)
    status = "ok"
    try:
        result = await _run(_Stream(call, metrics=metrics, mode=mode), session, hello, prompt_ids, eos_ids,
                            on_tokens)
        if metrics:
            metrics.request_done(mode, result.wall_seconds, len(result.token_ids))
        return result
    except grpc.aio.AioRpcError as exc:
        status = exc.code().name.lower()
        raise EdgeError(exc.code(), exc.details() or "") from None
    except EdgeError as exc:
        status = exc.code.name.lower()
        raise
    except asyncio.CancelledError:
        status = "cancelled"
        raise
    finally:
        call.cancel()
        if metrics:
            metrics.session_ended(status)


async def _run(stream: _Stream, session, hello, prompt_ids, eos_ids, on_tokens) -> GenerationResult:
    setup = await stream.send(wire.hello_to_pb(hello))
    msg = await stream.recv()
    welcome = wire.edge_message_from_pb(msg)
    if not isinstance(welcome, P.Welcome):
        raise EdgeError(grpc.StatusCode.INTERNAL, "expected Welcome")
    result = GenerationResult(token_ids=[], welcome=welcome)
    result.setup_bytes = setup + msg.ByteSize()
    t_start = time.perf_counter()
    result.setup_bytes += await stream.send(wire.prompt_to_pb(P.Prompt(tuple(prompt_ids))))
    session.start(prompt_ids)
    while not _finished(result.token_ids, hello.max_new_tokens, eos_ids):
        remaining = hello.max_new_tokens - len(result.token_ids)
        new = await _round(stream, session, result, remaining)
        new = _clip(result.token_ids, new, hello.max_new_tokens, eos_ids)
        result.token_ids.extend(new)
        if stream.metrics:  # counted after the cut at EOS / max_new_tokens: what the caller gets
            stream.metrics.tokens_delivered(stream.mode, len(new))
        if on_tokens and new:
            on_tokens(new)
    result.wall_seconds = time.perf_counter() - t_start
    result.setup_bytes += await stream.send(wire.close_to_pb())
    await stream.call.done_writing()
    # Wait for the edge's OK: cancelling the call (generate's finally) before it arrives would end
    # a finished session as CANCELLED on the edge and count it as failed there.
    await stream.call.code()
    return result


async def _round(stream: _Stream, session: DraftSession, result: GenerationResult, remaining: int) -> list[int]:
    # Drafting fewer than `remaining` tokens: the round's correction/bonus token is the last one.
    rd = await asyncio.to_thread(session.draft, max(1, remaining - 1))
    t0 = time.perf_counter()
    sent = await stream.send(wire.draft_to_pb(rd.block))
    reply = await stream.recv()
    elapsed = time.perf_counter() - t0
    verdict = wire.edge_message_from_pb(reply)
    if not isinstance(verdict, P.Verdict):
        raise EdgeError(grpc.StatusCode.INTERNAL, "expected Verdict")
    result.uplink_bytes += sent
    result.round_uplink_bytes.append(sent)
    result.downlink_bytes += reply.ByteSize()
    result.verify_seconds += verdict.verify_seconds
    result.network_seconds += max(0.0, elapsed - verdict.verify_seconds - verdict.queue_seconds)
    down_before = result.downlink_bytes - reply.ByteSize()
    if verdict.next_token is not None:
        new = await asyncio.to_thread(session.commit, rd, verdict, verdict.next_token, dssd_correction=False)
    else:
        token = await asyncio.to_thread(session.resolve_dssd, rd, verdict)
        if token is None:
            token = await _dssd_fallback(stream, session, rd, verdict, result)
        new = await asyncio.to_thread(session.commit, rd, verdict, token, dssd_correction=True)
    if stream.metrics:
        _observe_round(stream, session, rd, verdict, new, sent, result.downlink_bytes - down_before,
                       elapsed)
    return new


def _observe_round(stream: _Stream, session: DraftSession, rd: RoundDraft, verdict: P.Verdict,
                   new: list[int], sent: int, received: int, elapsed: float) -> None:
    network = max(0.0, elapsed - verdict.verify_seconds - verdict.queue_seconds)
    # The edge's verify_seconds includes payload decode: split it so the phases add up to the round.
    phases = {"draft": rd.draft_seconds, "encode": rd.encode_seconds, "network": network,
              "queue": verdict.queue_seconds, "decode": verdict.decode_seconds,
              "verify": max(0.0, verdict.verify_seconds - verdict.decode_seconds)}
    threshold = session.controller.beta if session.controller is not None else None
    depth = getattr(rd.block, "tree_depth", 0) or None  # trees: positions are depths
    stream.metrics.round_done(stream.mode, drafted=len(rd.block.token_ids), accepted=verdict.num_accepted,
                              uplink=sent, downlink=received, phases=phases,
                              support_sizes=rd.support_sizes, threshold=threshold, depth=depth)


async def _dssd_fallback(stream, session, rd, verdict, result) -> int:
    """All sampled candidates failed: fetch the full p_j and sample the residual locally."""
    t0 = time.perf_counter()
    result.uplink_bytes += await stream.send(wire.residual_request_to_pb(P.ResidualRequest(verdict.round_id)))
    reply = await stream.recv()
    result.network_seconds += time.perf_counter() - t0
    result.downlink_bytes += reply.ByteSize()
    result.dssd_fallbacks += 1
    residual = wire.edge_message_from_pb(reply)
    if not isinstance(residual, P.ResidualReply) or residual.round_id != verdict.round_id:
        raise EdgeError(grpc.StatusCode.INTERNAL, "expected ResidualReply for the rejected round")
    p_j = decode_target_probs(residual.target_probs, session.vocab_size)
    return await asyncio.to_thread(session.residual_from_full, rd, verdict, p_j)


def _finished(tokens: list[int], max_new: int, eos_ids: tuple[int, ...]) -> bool:
    return len(tokens) >= max_new or (bool(tokens) and tokens[-1] in eos_ids)


def _clip(done: list[int], new: list[int], max_new: int, eos_ids: tuple[int, ...]) -> list[int]:
    """Cut the round's tokens at the first EOS (kept) and at max_new_tokens."""
    out = []
    for t in new[: max_new - len(done)]:
        out.append(t)
        if t in eos_ids:
            break
    return out
