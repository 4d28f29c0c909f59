"""gRPC servicer: one bidirectional stream per session; converts messages and calls the verifier.

Thin by design (as TGI's servicer): protobuf <-> domain via :mod:`specdec.common.wire`, blocking
torch work on a worker pool off the event loop, and one place that maps errors to gRPC statuses.
A failure ends only its own session; the server and other sessions carry on.

Sessions, their owners, resumes, expiry, admission and draining are the registry's
(:mod:`specdec.edge.registry`); this module reads and writes the stream and turns the registry's
refusals into statuses: ``PERMISSION_DENIED`` for another's session, ``UNAVAILABLE`` with reason
``draining`` while the edge drains (the device tries another edge), ``RESOURCE_EXHAUSTED`` with the
limit and its value for an admission refusal.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

import grpc
from google.protobuf.message import DecodeError

from specdec.common import protocol as P
from specdec.common import wire
from specdec.common.loadaware import Acceptance, RecentAcceptance
from specdec.common.modes import Mode
from specdec.common.stats import edge_only_record, edge_record
from specdec.common.pb import speculative_pb2_grpc as pb_grpc
from specdec.edge.admission import AdmissionRefused, AdmissionSettings
from specdec.edge.auth import Authenticator, admission_principal
from specdec.edge.batching import ForwardScheduler
from specdec.edge.registry import (MOVED, RESUME_TOKEN_BYTES, SESSION_ID_BYTES, Draining, Entry, NotOwner,
                                  SessionRegistry, Stream)
from specdec.edge.verifier import (EdgeLimits, LimitError, RefusedError, TargetInfo,
                                   VerifierSession, complete, continues_like, forward_alone, verify_round)

log = logging.getLogger("specdec.edge")

SESSION_ID_RE = re.compile(f"[0-9a-f]{{{2 * SESSION_ID_BYTES}}}")  # secrets.token_hex's form
END_WAIT_S = 5.0  # after an End, how long the device has to half-close before the status goes anyway
# _serve's answer for a session that holds every token its device asked for (verifier.complete), to a
# device that reads End: ended by the edge with End(OK) at once, not after the device's Close (proto)
COMPLETE = object()


class _SessionEnd(Exception):
    def __init__(self, code: grpc.StatusCode, details: str, reason: str = ""):
        super().__init__(details)
        self.code = code
        self.details = details
        self.reason = reason  # machine-readable, sent as trailing metadata (protocol.REASON_KEY)


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
                 metrics=None, auth: Authenticator | None = None,
                 admission: AdmissionSettings | None = None, scheduler: ForwardScheduler | None = None,
                 name: str = ""):
        self.target = target
        self.info = info
        self.limits = limits
        self.executor = executor
        self.metrics = metrics
        self.auth = auth or Authenticator()
        self.registry = SessionRegistry(limits.max_sessions, limits.resume_window_s, admission, metrics, scheduler)
        self.scheduler = scheduler  # None: every session runs its own forwards (--no-batching)
        self.recent = RecentAcceptance()  # every session's drafts: where a new session's estimate starts
        self.name = name            # Welcome.edge_name: which edge of a fleet this is

    async def Generate(self, request_iterator, context):
        stream = Stream()
        # Credentials first: an unauthenticated caller gets no model work at all.
        principal = self.auth.principal(context.invocation_metadata(), context.auth_context())
        if principal is None:
            self.registry.observe_end("unauthenticated", False)
            await self._refuse_unauthenticated(context, stream)
        stream.counts_as = admission_principal(principal, context.peer())
        status, released = None, False
        try:
            ended = await self._serve(principal, context, stream)
            status = "ok" if ended else None  # end of stream without Close: keep it for a resume
            if ended is COMPLETE:  # freed first: the device may cancel the call once it reads the End
                self.registry.release(stream, status)
                released = True
                await _announce(context, P.End(grpc.StatusCode.OK.value[0], "session complete"))
        except _SessionEnd as end:
            status = MOVED if end.reason == P.DRAINING and stream.sid else end.code.name.lower()
            log.info("session %s ended: %s: %s", (stream.sid or "-")[:8], end.code.name, end.details)
            await self._end(context, stream, end)
        except asyncio.CancelledError:  # the stream broke: keep the session for a resume
            if not released:
                log.info("session %s: stream broke, kept for a resume", (stream.sid or "-")[:8])
            raise
        finally:
            if not released:
                self.registry.release(stream, status)

    async def _end(self, context, stream: Stream, end: _SessionEnd):
        """End the stream with ``end``'s status (and its reason as trailing metadata).

        To a device that reads End messages the status goes first as one, and the stream ends once the
        device has half-closed: a status sent while the device still writes comes with an HTTP/2
        stream reset, which HAProxy 2.6 turns into CANCEL, dropping the status (its issue 1219)."""
        if end.reason:
            context.set_trailing_metadata(((P.REASON_KEY, end.reason),))
        if stream.wants_end:
            await _announce(context, P.End(end.code.value[0], end.details, end.reason))
        await context.abort(end.code, end.details)

    async def _refuse_unauthenticated(self, context, stream: Stream):
        """UNAUTHENTICATED; the Hello is read first (nothing more) to learn whether End is understood."""
        with contextlib.suppress(Exception):
            msg = await asyncio.wait_for(context.read(), END_WAIT_S)
            stream.wants_end = msg is not grpc.aio.EOF and msg.HasField("hello") and msg.hello.wants_end
        await self._end(context, stream, _SessionEnd(grpc.StatusCode.UNAUTHENTICATED, "missing or invalid credentials"))

    # -- session lifecycle ---------------------------------------------------------------------------
    async def _serve(self, principal: str, context, stream: Stream) -> bool | object:
        """Serve one stream; True if the device closed the session, False if the stream just ended, or COMPLETE."""
        hello = await self._expect(context, P.Hello, "Hello")
        stream.wants_end = hello.wants_end
        entry, resumed = await self._attach(stream, hello, principal)
        if resumed:
            log.info("session %s resumed (stream %d)", stream.sid[:8], stream.generation)
        with self.registry.attached():
            return await self._stream(context, entry, stream, resumed)

    async def _stream(self, context, entry: Entry, stream: Stream, resumed: bool) -> bool | object:
        """The attached stream of a session: Welcome, Prompt (prefill or resync), rounds until Close (or COMPLETE).
        A stream another one has resumed the session from (a half-dead one, whose device reconnected
        before this edge saw the break) stops at once: what it still reads is stale, and the session is
        the newer stream's."""
        welcome = replace(entry.session.welcome(), session_id=entry.session.session_id,
                          resume_token=entry.resume_token, resumed=resumed, edge_name=self.name,
                          forward_cost=self.scheduler.cost.points() if self.scheduler is not None else (),
                          draft_len_hint=None if resumed else self._hint(entry.session))
        await context.write(wire.welcome_to_pb(welcome))
        prompt = await self._read(context)
        if prompt is None and resumed:
            return False  # a resumed session whose new stream broke again: keep it
        if not isinstance(prompt, P.Prompt):  # a new session without a prompt is not kept (no slot hoarding)
            got = "end of stream" if prompt is None else type(prompt).__name__
            raise _SessionEnd(grpc.StatusCode.INVALID_ARGUMENT, f"expected Prompt, got {got}")
        t_start = time.perf_counter()  # end-to-end time on the edge: Prompt to Close
        async with entry.lock:
            if not _owns(entry, stream):
                return False
            await self._call(entry.session.resync if resumed else entry.session.prefill, prompt)
        overdue = None  # seconds after which the next round is overdue and the edge runs ahead; None: never
        while True:
            if stream.wants_end and complete(entry.session) and _owns(entry, stream):
                self._observe_request(entry.session, len(prompt.token_ids), time.perf_counter() - t_start)
                return COMPLETE
            msg, size = await self._read_or_run_ahead(context, entry, stream, overdue)
            if msg is None or not _owns(entry, stream):
                return False
            if isinstance(msg, P.Close):
                self._observe_request(entry.session, len(prompt.token_ids), time.perf_counter() - t_start)
                return True
            if self.registry.moving:  # at a round boundary: the device redrafts this round on another edge
                raise _SessionEnd(grpc.StatusCode.UNAVAILABLE, "edge is draining (shutting down): resume the "
                                  "session on another edge", P.DRAINING)
            async with entry.lock:
                if not _owns(entry, stream):
                    return False
                overdue = await self._dispatch(entry.session, msg, size, context, after_at_once=overdue == AT_ONCE)

    async def _attach(self, stream: Stream, hello: P.Hello, principal: str) -> tuple[Entry, bool]:
        """(entry, resumed): the registry's session for ``hello``; its refusals as statuses."""
        if hello.resume_session_id or hello.resume_token:
            _check_resume_fields(hello)
        try:
            return await self.registry.attach(stream, hello, principal, self._checked_session)
        except NotOwner as exc:
            raise _SessionEnd(grpc.StatusCode.PERMISSION_DENIED, str(exc)) from None
        except Draining as exc:
            raise _SessionEnd(grpc.StatusCode.UNAVAILABLE, str(exc), P.DRAINING) from None
        except AdmissionRefused as exc:
            log.debug("session refused (%s): %s", exc.reason, exc.message)
            raise _SessionEnd(grpc.StatusCode.RESOURCE_EXHAUSTED, exc.message, exc.reason) from None

    async def _checked_session(self, hello: P.Hello, sid: str) -> VerifierSession:
        """A new session for ``hello``, checked on the worker pool (a bad Hello: its status)."""
        return await self._call(self._new_session, hello, sid)

    @property
    def attached_streams(self) -> int:
        return self.registry.attached_streams

    def _new_session(self, hello: P.Hello, sid: str) -> VerifierSession:
        if self.scheduler is None:
            return VerifierSession(self.target, self.info, hello, self.limits, sid)
        lm = self.scheduler.new_lm(self.target.model, self.target.device)  # a KV slot where the edge has them
        try:
            session = VerifierSession(self.target, self.info, hello, self.limits, sid,
                                      forward=self.scheduler.forward, lm=lm, verify=self.scheduler.verify)
        except Exception:
            self.scheduler.forget(lm)
            raise
        session.acceptance = Acceptance.starting_at(self.recent.alpha)  # load-aware advice from round 1
        return session

    # -- messages ------------------------------------------------------------------------------------
    async def _dispatch(self, session: VerifierSession, msg, size: int, context,
                        after_at_once: bool = False) -> float | None:
        """Serve one message; the seconds after its last reply from which the next message is overdue
        and the edge runs ahead (the round's ``run_ahead_ms``), None where it must not. ``after_at_once``:
        the edge ran ahead at once before it (:func:`_overdue_after_superseded`)."""
        if isinstance(msg, P.DraftBlock):
            try:  # cheap after a round's first use of its settings: no worker hop for it
                settings = session.round_settings(msg)
                superseded = session.superseded(msg)
            except ValueError as exc:
                raise _SessionEnd(status_for(exc), str(exc), getattr(exc, "reason", "")) from None
            if superseded is not None:
                await context.write(wire.verdict_to_pb(superseded))
                if self.metrics:
                    self.metrics.round_superseded()
                return _overdue_after_superseded(session, msg, settings, after_at_once)
            if settings.mode is Mode.NONE:
                last = await self._edge_round(session, msg, size, context)
                return _overdue_after(msg, settings, last)
            t0, late = time.perf_counter(), bool(msg.start) and msg.start < len(session.tokens)  # continued
            verdict = await self._call(verify_round, session, msg)
            queue = max(0.0, time.perf_counter() - t0 - verdict.verify_seconds)
            self.recent.observe(msg.tree_depth or len(msg.token_ids), verdict.num_accepted)
            verdict = replace(verdict, queue_seconds=queue, draft_len_hint=self._hint(session))
            reply = wire.verdict_to_pb(verdict)
            if self.metrics:
                self.metrics.observe_round(edge_record(msg, verdict, settings.mode.value, size, reply.ByteSize()), late)
            await context.write(reply)
            return _overdue_after(msg, settings, verdict)
        elif isinstance(msg, P.ResidualRequest):
            residual = await self._call(session.residual, msg)
            reply = wire.residual_to_pb(residual)
            if self.metrics:
                self.metrics.dssd_fallback(residual.is_head, reply.ByteSize())
            await context.write(reply)
            return None
        raise _SessionEnd(grpc.StatusCode.INVALID_ARGUMENT, f"unexpected {type(msg).__name__} mid-session")

    async def _edge_round(self, session: VerifierSession, msg: P.DraftBlock, size: int,
                          context) -> P.Verdict | None:
        """Mode none: the target generates the round's tokens; each goes out as soon as it exists.
        Returns the last Verdict sent."""
        tokens, late = session.generate(msg), bool(msg.start) and msg.start < len(session.tokens)  # (continued)
        generated, downlink, verify, queue, last = 0, 0, 0.0, 0.0, None
        while True:
            t0 = time.perf_counter()
            verdict = await self._call(next, tokens, None)
            if verdict is None:
                break
            last = verdict
            wait = max(0.0, time.perf_counter() - t0 - verdict.verify_seconds)
            reply = wire.verdict_to_pb(replace(verdict, queue_seconds=wait, draft_len_hint=self._hint(session)))
            await context.write(reply)
            generated, downlink = generated + 1, downlink + reply.ByteSize()
            verify, queue = verify + verdict.verify_seconds, queue + wait
            if not verdict.more:
                break
        session.acceptance.relax(generated)  # no draft seen: the advice must not keep it edge-only for good
        if self.metrics:
            self.metrics.observe_round(edge_only_record(generated, size, downlink, verify, queue), late)
        return last

    async def _read_or_run_ahead(self, context, entry: Entry, stream: Stream, overdue_s: float | None):
        """The next message, as :meth:`_read_sized`. If it has not arrived ``overdue_s`` after the last
        round's reply (an outage, a stalled device), the target's next tokens meanwhile, each sent as it
        exists, until it arrives (Draft.run_ahead_ms): what the edge would compute for an edge-only
        round, so a link that stops for seconds costs the device the wait, not the tokens."""
        if overdue_s is None:
            return await self._read_sized(context)
        read = asyncio.ensure_future(self._read_sized(context))
        generated, downlink, verify = 0, 0, 0.0
        try:
            await asyncio.wait({read}, timeout=overdue_s)
            while not read.done() and not self.registry.moving:
                async with entry.lock:
                    if not _owns(entry, stream):
                        break
                    verdict = await self._call(entry.session.ahead_token)
                if verdict is None:
                    break
                reply = wire.verdict_to_pb(replace(verdict, draft_len_hint=self._hint(entry.session)))
                await context.write(reply)
                generated, downlink, verify = generated + 1, downlink + reply.ByteSize(), verify + verdict.verify_seconds
                if self.metrics:
                    self.metrics.ran_ahead()
            return await read
        finally:
            read.cancel()  # a no-op once it is done; else the stream is ending
            if generated and self.metrics:  # one edge-only round, as the device accounts for it
                self.metrics.observe_round(edge_only_record(generated, 0, downlink, verify, 0.0))

    def _hint(self, session: VerifierSession) -> int | None:
        """Load-aware speculation: how long this device should draft at the edge's load now."""
        if self.scheduler is None:
            return None  # one session per forward: load does not change what a draft costs
        active = self.scheduler.active_sessions()
        hint = self.scheduler.draft_len_hint(session.acceptance.alpha, self.limits.max_draft_len, active)
        if hint is not None and self.metrics:
            self.metrics.draft_len_hinted(hint, active)
        return hint

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
        except DecodeError as exc:  # bytes that are no DeviceMessage: this session's fault only
            raise _SessionEnd(grpc.StatusCode.INVALID_ARGUMENT, f"undecodable message: {exc}") from None
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
            return await loop.run_in_executor(self.executor, self._work, fn, *args)
        except ValueError as exc:
            raise _SessionEnd(status_for(exc), str(exc), getattr(exc, "reason", "")) from None
        except Exception as exc:  # a bug in one session must not take the server down
            log.exception("session failed")
            raise _SessionEnd(grpc.StatusCode.INTERNAL, f"internal error: {type(exc).__name__}") from None

    def _work(self, fn, *args):
        """On a worker thread: a scheduler may hold a forward briefly for this thread to join it."""
        if self.scheduler is None:
            return fn(*args)
        with self.scheduler.working():
            return fn(*args)

    def _observe_request(self, session: VerifierSession, prompt_len: int, seconds: float) -> None:
        if self.metrics:
            self.metrics.request_done(session.hello.draft.mode.value, seconds, len(session.tokens) - prompt_len)


def _owns(entry: Entry, stream: Stream) -> bool:
    """Whether ``stream`` is the one attached to ``entry``'s session now (no newer one resumed it)."""
    return entry.generation == stream.generation


AT_ONCE = 0.0  # the next message is overdue at once: the edge runs ahead until it arrives


def _overdue_after(draft: P.DraftBlock, settings, verdict: P.Verdict | None) -> float | None:
    """When the message after ``draft`` is overdue (its run_ahead_ms), None where the edge must not run
    ahead: a round that did not ask, a DSSD round (its next token may be the device's), or one whose
    reply left no token to go on from (a DSSD rejection, a void round). A superseded round (``verdict``
    None) asks again: the device drafts after the tokens it gets."""
    if not draft.run_ahead_ms or settings.mode is Mode.DSSD:
        return None
    if verdict is not None and verdict.next_token is None:
        return None
    return draft.run_ahead_ms / 1000.0


def _overdue_after_superseded(session: VerifierSession, draft: P.DraftBlock, settings,
                              after_at_once: bool = False) -> float | None:
    """When the message after a superseded ``draft`` is overdue: at once (``AT_ONCE``) where a late round
    like it is served from the tokens generated ahead (verifier.continues_like), else as after any round.
    The superseded round came later than its own ``run_ahead_ms``: what held it (an uplink outage on a
    recorded cellular link lasts seconds) likely holds the device's next message too, which goes out
    only after the verdict's trip down and a new draft; waiting ``run_ahead_ms`` again left the edge
    idle through most of it. Where it was no outage, the next round is served from the tokens made
    meanwhile if its drafts are theirs. Not twice in a row (``after_at_once``: ``draft`` met tokens the
    edge ran ahead at once, as any round does that reaches it a drafting and a round trip later): each
    next round would be superseded in turn, the device drafting for nothing at edge-only's pace."""
    overdue = _overdue_after(draft, settings, None)
    if overdue is None or after_at_once or not continues_like(session.hello, settings):
        return overdue
    return AT_ONCE


def _check_resume_fields(hello: P.Hello) -> None:
    """A resume names a session id of this protocol's form and carries its resume token."""
    if not SESSION_ID_RE.fullmatch(hello.resume_session_id):
        raise _SessionEnd(grpc.StatusCode.INVALID_ARGUMENT,
                          f"malformed resume_session_id {hello.resume_session_id[:40]!r}: expected "
                          f"{2 * SESSION_ID_BYTES} lowercase hex digits")
    if len(hello.resume_token) != RESUME_TOKEN_BYTES:
        raise _SessionEnd(grpc.StatusCode.INVALID_ARGUMENT,
                          f"resume_token of {len(hello.resume_token)} bytes: expected {RESUME_TOKEN_BYTES}")


async def _announce(context, end: P.End) -> None:
    """``end`` as a message, then (up to END_WAIT_S) the device's half-close, after which the status
    goes without a stream reset (``_end``). A complete session (:data:`COMPLETE`) ends so at its last
    verdict: its device returns on the End, and its Close is one of the messages dropped meanwhile."""
    with contextlib.suppress(Exception):
        await context.write(wire.end_to_pb(end))
        await asyncio.wait_for(_until_half_closed(context), END_WAIT_S)


async def _until_half_closed(context) -> None:
    """Read (and drop) what the device still sends until it half-closes."""
    while await context.read() is not grpc.aio.EOF:
        pass
