"""gRPC servicer: one bidirectional stream per session; converts messages and calls the verifier.

Thin by design (as TGI's servicer): protobuf <-> domain via :mod:`specdec.common.wire`, blocking
torch work on a worker pool off the event loop, and one place that maps errors to gRPC statuses.
A failure ends only its own session; the server and other sessions carry on.
"""
from __future__ import annotations

import asyncio
import logging
import secrets
import time
from dataclasses import replace
from concurrent.futures import ThreadPoolExecutor

import grpc

from specdec.common import protocol as P
from specdec.common import wire
from specdec.common.pb import speculative_pb2_grpc as pb_grpc
from specdec.edge.verifier import (EdgeLimits, LimitError, RefusedError, TargetInfo,
                                   VerifierSession)

log = logging.getLogger("specdec.edge")

# 128 random bits: session ids are unguessable.
SESSION_ID_BYTES = 16


class _SessionEnd(Exception):
    def __init__(self, code: grpc.StatusCode, details: str):
        super().__init__(details)
        self.code = code
        self.details = details


def status_for(exc: Exception) -> grpc.StatusCode:
    """The gRPC status a session error maps to."""
    if isinstance(exc, RefusedError):
        return grpc.StatusCode.FAILED_PRECONDITION
    if isinstance(exc, LimitError):
        return grpc.StatusCode.RESOURCE_EXHAUSTED
    if isinstance(exc, ValueError):
        return grpc.StatusCode.INVALID_ARGUMENT
    return grpc.StatusCode.INTERNAL


class SpeculativeDecodingServicer(pb_grpc.SpeculativeDecodingServicer):
    def __init__(self, target, info: TargetInfo, limits: EdgeLimits, executor: ThreadPoolExecutor,
                 metrics=None):
        self.target = target
        self.info = info
        self.limits = limits
        self.executor = executor
        self.metrics = metrics
        self.active: dict[str, VerifierSession] = {}

    async def Generate(self, request_iterator, context):
        session_id = secrets.token_hex(SESSION_ID_BYTES)
        if len(self.active) >= self.limits.max_sessions:
            self._observe_end("resource_exhausted", False)
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                f"edge is at its limit of {self.limits.max_sessions} sessions")
        status = "ok"
        try:
            await self._serve(session_id, context)
        except _SessionEnd as end:
            status = end.code.name.lower()
            await context.abort(end.code, end.details)
        except asyncio.CancelledError:
            status = "cancelled"
            raise
        finally:
            started = self.active.pop(session_id, None) is not None
            self._observe_end(status, started)

    async def _serve(self, session_id: str, context) -> None:
        hello = await self._expect(context, P.Hello, "Hello")
        session = await self._call(VerifierSession, self.target, self.info, hello, self.limits, session_id)
        self.active[session_id] = session
        if self.metrics:
            self.metrics.session_started(hello.mode.value)
        await context.write(wire.welcome_to_pb(session.welcome()))
        prompt = await self._expect(context, P.Prompt, "Prompt")
        t_start = time.perf_counter()  # end-to-end time on the edge: Prompt to Close
        await self._call(session.prefill, prompt)
        while True:
            msg, size = await self._read_sized(context)
            if msg is None or isinstance(msg, P.Close):
                self._observe_request(session, len(prompt.token_ids), time.perf_counter() - t_start)
                return
            await self._dispatch(session, msg, size, context)

    async def _dispatch(self, session: VerifierSession, msg, size: int, context) -> None:
        if isinstance(msg, P.DraftBlock):
            t0 = time.perf_counter()
            verdict = await self._call(session.verify, msg)
            queue = max(0.0, time.perf_counter() - t0 - verdict.verify_seconds)
            verdict = replace(verdict, queue_seconds=queue)
            reply = wire.verdict_to_pb(verdict)
            if self.metrics:
                self.metrics.round_done(session.hello.mode.value, msg, verdict, reply.ByteSize(), size)
            await context.write(reply)
        elif isinstance(msg, P.ResidualRequest):
            reply = wire.residual_to_pb(await self._call(session.residual, msg))
            await context.write(reply)
        else:
            raise _SessionEnd(grpc.StatusCode.INVALID_ARGUMENT, f"unexpected {type(msg).__name__} mid-session")

    async def _read(self, context):
        return (await self._read_sized(context))[0]

    async def _read_sized(self, context):
        """(next domain message or None at end of stream, its serialized size).

        An idle timeout or a malformed message ends the session with a status."""
        try:
            msg = await asyncio.wait_for(context.read(), timeout=self.limits.idle_timeout_s)
        except asyncio.TimeoutError:
            raise _SessionEnd(grpc.StatusCode.DEADLINE_EXCEEDED,
                              f"session idle for more than {self.limits.idle_timeout_s:g} s") from None
        if msg is grpc.aio.EOF:
            return None, 0
        try:
            return wire.device_message_from_pb(msg), msg.ByteSize()
        except ValueError as exc:
            raise _SessionEnd(grpc.StatusCode.INVALID_ARGUMENT, str(exc)) from None

    async def _expect(self, context, kind, name: str):
        msg = await self._read(context)
        if not isinstance(msg, kind):
            got = "end of stream" if msg is None else type(msg).__name__
            raise _SessionEnd(grpc.StatusCode.INVALID_ARGUMENT, f"expected {name}, got {got}")
        return msg

    async def _call(self, fn, *args):
        """Run blocking torch work on the worker pool; map its errors to a session status."""
        loop = asyncio.get_running_loop()
        try:
            return await loop.run_in_executor(self.executor, fn, *args)
        except ValueError as exc:
            raise _SessionEnd(status_for(exc), str(exc)) from None
        except Exception as exc:  # a bug in one session must not take the server down
            log.exception("session failed")
            raise _SessionEnd(grpc.StatusCode.INTERNAL, f"internal error: {type(exc).__name__}") from None

    def _observe_request(self, session: VerifierSession, prompt_len: int, seconds: float) -> None:
        if self.metrics:
            self.metrics.request_done(session.hello.mode.value, seconds, len(session.tokens) - prompt_len)

    def _observe_end(self, status: str, started: bool) -> None:
        if self.metrics:
            self.metrics.session_ended(status, started)
