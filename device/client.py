"""gRPC client side of one generation session: moves drafts up and verdicts down, nothing more.

Converts between protobuf and :mod:`specdec.common.protocol` with :mod:`specdec.common.wire`, and
calls the blocking :class:`~specdec.device.session.DraftSession` off the event loop.
Byte counts are the serialized sizes of the messages actually written and read.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass, field, replace
from typing import Callable

import grpc

from specdec.common import protocol as P
from specdec.common import wire
from specdec.common.pb import speculative_pb2_grpc as pb_grpc
from specdec.common.stats import SpecStats
from specdec.device.engine import ProtocolError, deliverable, finished, run_round
from specdec.device.fleet import Failover, Fleet, Route, SessionTrail
from specdec.device.grpc_status import (EdgeError, ShieldedRead, STATUS_BY_NUMBER, final_error, half_close,
                                        retryable, watch_status)
from specdec.device.metrics import DeviceMetrics, SessionMeter
from specdec.device.session import DraftSession

log = logging.getLogger("specdec.device")


@dataclass
class GenerationResult:
    token_ids: list[int]
    welcome: P.Welcome | None      # of the latest stream (its session id and resume token)
    stats: SpecStats = field(default_factory=SpecStats)  # the session's account of its rounds (DraftSession.stats)
    setup_bytes: int = 0           # Hello + Prompt + Welcome + Close
    wall_seconds: float = 0.0      # from sending the prompt to the last token
    reconnects: int = 0            # broken streams resumed
    t_start: float | None = None
    trail: SessionTrail = field(default_factory=SessionTrail)  # the edges it ran on, moves, resumes

    # What the rounds add up to, read from the one account.
    @property
    def uplink_bytes(self) -> int:
        return self.stats.uplink_bytes

    @property
    def downlink_bytes(self) -> int:
        return self.stats.downlink_bytes

    @property
    def network_seconds(self) -> float:
        return self.stats.seconds["network"]

    @property
    def verify_seconds(self) -> float:
        """Edge-reported payload decode + verification."""
        return self.stats.seconds["decode"] + self.stats.seconds["verify"]

    @property
    def dssd_fallbacks(self) -> int:
        return self.stats.dssd_fallbacks

    @property
    def dssd_residual_trips(self) -> int:
        return self.stats.dssd_residual_trips

    @property
    def round_uplink_bytes(self) -> list[int]:
        return self.stats.round_uplink_bytes


@dataclass
class _Stream:
    """One gRPC stream as the round loop's link (engine.Link): domain messages in and out."""
    call: object
    meter: SessionMeter = SessionMeter(None, "")
    round_timeout: float | None = None
    _read: ShieldedRead | None = None
    seen: dict | None = None            # watch_status(call): the first final status it gets
    route: Route | None = None          # the fleet's route this stream runs on
    trail: SessionTrail | None = None   # the session's record of edges and resumes
    edge: str | None = None             # the edge that welcomed this stream
    close_bytes: int = 0                # the Close's size once sent (0: not yet)

    async def send(self, msg) -> int:
        return await self.write(wire.device_message_to_pb(msg))

    async def close(self) -> int:
        if not self.close_bytes:
            self.close_bytes = await self.write(wire.close_to_pb())
        return self.close_bytes

    async def recv(self) -> tuple[object, int]:
        msg = await self.read()
        return wire.edge_message_from_pb(msg), msg.ByteSize()

    async def write(self, msg) -> int:
        try:
            await self.call.write(msg)
        except (asyncio.InvalidStateError, grpc.aio.AioRpcError):  # the RPC already ended: why?
            raise await final_error(self.call, self.seen) from None
        return msg.ByteSize()

    async def read(self):
        try:
            msg = await self._next()
        except asyncio.TimeoutError:
            raise EdgeError(grpc.StatusCode.DEADLINE_EXCEEDED,
                            f"no answer from the edge within {self.round_timeout:g} s") from None
        if msg is grpc.aio.EOF:
            raise EdgeError(grpc.StatusCode.UNAVAILABLE, "edge closed the stream")
        if msg.WhichOneof("kind") == "end":  # the session's status, ahead of the status itself
            await half_close(self.call)
            end = wire.end_from_pb(msg.end)
            raise EdgeError(STATUS_BY_NUMBER.get(end.code, grpc.StatusCode.UNKNOWN), end.details, end.reason)
        self._observe(msg)
        return msg

    async def drain(self) -> bool:
        """After Close: read and drop what the edge still sends until it ends the stream (the answer
        to an edge-only round sent ahead that the session no longer needs: its Verdicts, or the void
        one after an end-of-sequence token). A gRPC call's status waits until its messages are read.
        True if the edge's End came (its status, sent as a message), False at the end of the stream."""
        while True:
            msg = await self._next()
            if msg is grpc.aio.EOF:
                return False
            if msg.WhichOneof("kind") == "end":
                return True

    async def _next(self):
        """The call's next message (or EOF) within the round timeout (asyncio.TimeoutError), the read
        shielded across timeouts."""
        if self._read is None:
            self._read = ShieldedRead(self.call)
        return await self._read(self.round_timeout)

    def _observe(self, msg) -> None:
        """What the fleet learns from the edge: where the session runs, and the edge's queue time."""
        if self.route is None:
            return
        kind = msg.WhichOneof("kind")
        if kind == "verdict":
            self.route.observe_queue(msg.verdict.timings.queue_seconds)
        elif kind == "welcome" and self.trail is not None:
            self.edge, resume, moved = self.trail.welcomed(wire.welcome_from_pb(msg.welcome), self.route)
            self.meter.welcomed(self.edge, resume, moved)


CLOSE_GRACE_S = 1.0  # how long a cancelled session waits to deliver its Close


@dataclass(frozen=True)
class ConnectionPolicy:
    round_timeout_s: float = 30.0         # a verdict later than this means a dead link: reconnect
    reconnect_timeout_s: float = 60.0     # give up after this long without a working stream
    backoff_initial_s: float = 0.2        # first wait before reconnecting; doubles per failure
    backoff_max_s: float = 5.0
    metadata: tuple[tuple[str, str], ...] = ()  # call metadata, e.g. ("authorization", "Bearer ...")


async def generate(edges: grpc.aio.Channel | Fleet, session: DraftSession, hello: P.Hello,
                   prompt_ids: list[int], eos_ids: tuple[int, ...],
                   on_tokens: Callable[[list[int]], None] | None = None,
                   timeout: float | None = None, metrics: DeviceMetrics | None = None,
                   policy: ConnectionPolicy = ConnectionPolicy()) -> GenerationResult:
    """Run one session to EOS (not with ``hello.ignore_eos``) or ``hello.max_new_tokens``; stream new
    tokens to ``on_tokens``.

    ``edges``: a channel to one edge (or to a proxy), or a :class:`~specdec.device.fleet.Fleet`.
    A broken stream (link cut, edge restart or gone, a drain, round timeout) is resumed: on the same
    edge first (its KV cache), else on another (which re-prefills the verified prefix); every random
    number is keyed by (seed, purpose, position), so no verified token is lost, duplicated or changed.
    A refusal is never retried. ``timeout`` bounds the whole session.
    """
    fleet = edges if isinstance(edges, Fleet) else Fleet.of_channel(edges)
    eos_ids = () if hello.ignore_eos else eos_ids  # the session ends at max_new_tokens only
    meter = SessionMeter(metrics, "auto" if session.policy is not None else hello.draft.mode.value)
    meter.started(session.listeners)
    status = "ok"
    try:
        result = await asyncio.wait_for(
            _resilient(fleet, session, hello, prompt_ids, eos_ids, on_tokens, meter, policy), timeout)
        meter.done(result.wall_seconds, len(result.token_ids))
        return result
    except asyncio.TimeoutError:
        status = "deadline_exceeded"
        raise EdgeError(grpc.StatusCode.DEADLINE_EXCEEDED, f"session took longer than {timeout:g} s") from None
    except EdgeError as exc:
        status = exc.code.name.lower()
        raise
    except asyncio.CancelledError:
        status = "cancelled"
        raise
    finally:
        meter.ended(status)


def stop_ids(eos_ids) -> tuple[int, ...]:
    """Hello.stop_ids: the device's end-of-sequence ids, or none where there are more than an edge takes
    (it then learns of the end from the device's Close, as before the field)."""
    ids = tuple(sorted({int(i) for i in eos_ids}))
    return ids if len(ids) <= P.MAX_STOP_IDS else ()


async def _resilient(fleet: Fleet, session, hello, prompt_ids, eos_ids, on_tokens, meter: SessionMeter,
                     policy) -> GenerationResult:
    result = GenerationResult(token_ids=[], welcome=None, stats=session.stats)
    session.start(prompt_ids)
    failover = Failover(fleet, policy, retryable)
    route, home, delivered = fleet.pick(), None, 0
    metadata = (*policy.metadata, (P.SESSION_KEY, result.trail.key))  # the same on every stream: affinity
    # End messages: statuses that survive proxies (see the proto), and one right after the token that
    # ends the session (stop_ids); late rounds continued (engine._continued)
    hello = replace(hello, wants_end=True, continues_late=True, continues_late_edge_only=True,
                    stop_ids=stop_ids(eos_ids))
    while True:
        call = pb_grpc.SpeculativeDecodingStub(route.channel).Generate(metadata=metadata)
        stream = _Stream(call, meter=meter, round_timeout=policy.round_timeout_s, seen=watch_status(call), route=route,
                         trail=result.trail)
        route.open_sessions += 1
        try:
            await _run(stream, session, hello, eos_ids, on_tokens, result)
            fleet.succeeded(route)
            return result
        except grpc.aio.AioRpcError:
            error = await final_error(call, stream.seen)
        except EdgeError as exc:
            error = exc
        except ProtocolError as exc:  # the edge answered out of turn: not a link fault, never retried
            error = EdgeError(grpc.StatusCode.INTERNAL, str(exc))
        except BaseException:  # cancelled, or stopped by the caller: free the edge session at once
            await _close_quietly(call)
            raise
        finally:
            call.cancel()
            route.open_sessions -= 1
            meter.left(stream.edge)
        if stream.edge is not None:
            home = route
            # Wherever it continues, the target must be the one it ran on (else the law changes).
            hello = replace(hello, target_fingerprint=result.welcome.target_fingerprint)
        progressed, delivered = len(result.token_ids) > delivered, len(result.token_ids)
        route = await failover.next(route, error, home=home, progressed=progressed)
        if result.welcome is not None:
            await asyncio.to_thread(session.abort_round)
            result.reconnects += 1
        log.warning("stream to the edge broke (%s: %s); resuming via %s", error.code.name, error.details,
                    route.target)


async def _close_quietly(call) -> None:
    """Best effort: tell the edge this session is over, so it frees it instead of keeping it for a
    resume; a link that is already gone just times out."""
    async def close():
        await call.write(wire.close_to_pb())
        await call.done_writing()
        await call.code()  # cancelling before the edge has read the Close could drop it
    with contextlib.suppress(Exception, asyncio.CancelledError):
        await asyncio.wait_for(close(), CLOSE_GRACE_S)


async def _run(stream: _Stream, session, hello, eos_ids, on_tokens, result: GenerationResult) -> None:
    """One stream: Hello (resuming if we hold a session), Prompt = verified prefix, rounds, Close."""
    if result.welcome is not None:
        hello = replace(hello, resume_session_id=result.welcome.session_id,
                        resume_token=result.welcome.resume_token)
    setup = await stream.write(wire.hello_to_pb(hello))
    msg = await stream.read()
    welcome = wire.edge_message_from_pb(msg)
    if not isinstance(welcome, P.Welcome):
        raise EdgeError(grpc.StatusCode.INTERNAL, "expected Welcome")
    result.welcome = welcome
    if hello.adjusts_law and not welcome.adjusts_law:
        raise EdgeError(grpc.StatusCode.FAILED_PRECONDITION,
                        f"edge {welcome.edge_name or welcome.model_name} does not apply min-p, logit bias, "
                        "penalties or grammars: its output would not follow the requested law")
    if hello.ignore_eos and not welcome.ignores_eos:
        raise EdgeError(grpc.StatusCode.FAILED_PRECONDITION,
                        f"edge {welcome.edge_name or welcome.model_name} does not honour ignore_eos: it would end "
                        "the session's edge-only rounds at an end-of-sequence token")
    session.observe_welcome(welcome)
    result.setup_bytes += setup + msg.ByteSize()
    if result.t_start is None:
        result.t_start = time.perf_counter()
    result.setup_bytes += await stream.write(wire.prompt_to_pb(P.Prompt(tuple(session.tokens), session.prompt_len)))

    def deliver(new: list[int]) -> None:
        new = deliverable(result.token_ids, new, hello.max_new_tokens, eos_ids)
        result.token_ids.extend(new)
        stream.meter.delivered(len(new))
        if on_tokens and new:
            on_tokens(new)

    while not finished(result.token_ids, hello.max_new_tokens, eos_ids):
        if stream.close_bytes:  # the edge ended the closing round early, at a token the device goes on after
            raise EdgeError(grpc.StatusCode.UNAVAILABLE, "the session outlived its Close: resuming on a new stream")
        await run_round(stream, session, hello.max_new_tokens - len(result.token_ids), deliver)
    result.wall_seconds = time.perf_counter() - result.t_start
    result.setup_bytes += await stream.close()  # (sent already if an edge-only round ended the session)
    # Through half_close: a call that broke under it raises grpc's ExecuteBatchError here, not a status
    # (a fleet's edge SIGKILLed just after the last round); the drain below reads how it ended.
    await half_close(stream.call)
    # Wait for the edge's End, or its status: cancelling the call (generate's finally) before either
    # arrives would end a finished session as CANCELLED on the edge and count it as failed there. An
    # End says the edge has freed the session: its status, a round trip later (after this half-close
    # reaches it), is not waited for. An edge that does not end the stream within a round's timeout is
    # left to that cancel: every token is delivered already.
    with contextlib.suppress(asyncio.TimeoutError):
        if not await stream.drain():
            await stream.call.code()

