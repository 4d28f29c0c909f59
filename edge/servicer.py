"""gRPC servicer: one bidirectional stream per session; converts messages and calls the verifier.

Thin by design (as TGI's servicer): protobuf <-> domain via :mod:`specdec.common.wire`, blocking
torch work on a worker pool off the event loop, and one place that maps errors to gRPC statuses.
A failure ends only its own session; the server and other sessions carry on.

Sessions outlive their stream when it breaks: a stream that ends without ``Close`` (link cut,
device crash, keepalive timeout) leaves its session detached for ``resume_window_s``, so the device
can reconnect and resume with the session id and the secret resume token from ``Welcome``, under
the same credentials. ``Close``, a bad message or an idle timeout free the session at once.

New sessions pass admission (:mod:`specdec.edge.admission`): a cap per principal (the authenticated
identity, else the peer's host), and a bounded queue when all ``max_sessions`` slots are held;
a refusal is ``RESOURCE_EXHAUSTED`` with the limit and its value. Resuming one's own session is
never refused: a detached session keeps its slot for the resume window.

A resume of a session this edge does not hold (it ran on another edge of a fleet, this edge
restarted, or its resume window ran out) starts a new session here, answered ``Welcome.resumed =
false``: the device's Prompt is its whole verified prefix, which is re-prefilled. Every random number
is keyed by (seed, purpose, position), so the session goes on with exactly the tokens it would have
had. A Hello naming the target the session ran on (``target_fingerprint``) is refused here if this
edge serves another one.

Draining (SIGTERM, :meth:`SpeculativeDecodingServicer.drain`): the edge stops taking new sessions
(``UNAVAILABLE``, reason ``draining``: the device tries another edge) and reports itself not ready;
streams attached now get the drain time to finish; those still running then end at their next
message with the same status, so their devices resume them elsewhere.
"""
from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import re
import secrets
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace

import grpc
from google.protobuf.message import DecodeError

from specdec.common import protocol as P
from specdec.common import wire
from specdec.common.loadaware import Acceptance, RecentAcceptance
from specdec.common.modes import Mode
from specdec.common.stats import edge_only_record, edge_record
from specdec.common.pb import speculative_pb2_grpc as pb_grpc
from specdec.edge.admission import Admission, AdmissionRefused, AdmissionSettings, Slot
from specdec.edge.auth import Authenticator, admission_principal
from specdec.edge.batching import ForwardScheduler
from specdec.edge.verifier import (EdgeLimits, LimitError, RefusedError, TargetInfo,
                                   VerifierSession, forward_alone)

log = logging.getLogger("specdec.edge")

SESSION_ID_BYTES = 16    # 128 random bits: session ids are unguessable
RESUME_TOKEN_BYTES = 32  # the secret that, with the same credentials, lets a stream resume a session
SESSION_ID_RE = re.compile(f"[0-9a-f]{{{2 * SESSION_ID_BYTES}}}")  # secrets.token_hex's form
MOVED = "moved"  # status of a session a drain ended so that its device resumes it on another edge
END_WAIT_S = 5.0  # after an End, how long the device has to half-close before the status goes anyway


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


@dataclass
class _Entry:
    """A session and what binds it: its owner, its resume secret, the stream now attached."""
    session: VerifierSession
    principal: str
    resume_token: bytes
    slot: Slot                     # its hold on one of the edge's max_sessions (admission)
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)  # one stream works on a session at a time
    generation: int = 0            # bumped per attached stream; a superseded stream must not free it
    detached: bool = False


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
        self.sessions: dict[str, _Entry] = {}
        self.admission = Admission(admission or AdmissionSettings(), limits.max_sessions, metrics)
        self.scheduler = scheduler  # None: every session runs its own forwards (--no-batching)
        self.recent = RecentAcceptance()  # every session's drafts: where a new session's estimate starts
        self.name = name            # Welcome.edge_name: which edge of a fleet this is
        self.draining = False       # SIGTERM: no new sessions, not ready
        self.moving = False         # the drain time is up: running sessions are sent elsewhere
        self._streams = 0           # streams attached to a session right now
        self._no_streams = asyncio.Event()
        self._no_streams.set()

    async def Generate(self, request_iterator, context):
        state = {"sid": None, "gen": 0, "wants_end": False}
        # Credentials first: an unauthenticated caller gets no model work at all.
        principal = self.auth.principal(context.invocation_metadata(), context.auth_context())
        if principal is None:
            self._observe_end("unauthenticated", False)
            await self._refuse_unauthenticated(context, state)
        state["counts_as"] = admission_principal(principal, context.peer())
        status = None
        try:
            closed = await self._serve(principal, context, state)
            status = "ok" if closed else None  # end of stream without Close: keep it for a resume
        except _SessionEnd as end:
            status = MOVED if end.reason == P.DRAINING and state["sid"] else end.code.name.lower()
            await self._end(context, state, end)
        except asyncio.CancelledError:  # the stream broke: keep the session for a resume
            raise
        finally:
            self._release(state, status)

    async def _end(self, context, state: dict, end: _SessionEnd):
        """End the stream with ``end``'s status (and its reason as trailing metadata).

        To a device that reads End messages the status goes first as one, and the stream ends once the
        device has half-closed: a status sent while the device still writes comes with an HTTP/2
        stream reset, which HAProxy 2.6 turns into CANCEL, dropping the status (its issue 1219)."""
        if end.reason:
            context.set_trailing_metadata(((P.REASON_KEY, end.reason),))
        if state["wants_end"]:
            with contextlib.suppress(Exception):
                await context.write(wire.end_to_pb(P.End(end.code.value[0], end.details, end.reason)))
                await asyncio.wait_for(_until_half_closed(context), END_WAIT_S)
        await context.abort(end.code, end.details)

    async def _refuse_unauthenticated(self, context, state: dict):
        """UNAUTHENTICATED; the Hello is read first (nothing more) to learn whether End is understood."""
        with contextlib.suppress(Exception):
            msg = await asyncio.wait_for(context.read(), END_WAIT_S)
            state["wants_end"] = msg is not grpc.aio.EOF and msg.HasField("hello") and msg.hello.wants_end
        await self._end(context, state, _SessionEnd(grpc.StatusCode.UNAUTHENTICATED, "missing or invalid credentials"))

    # -- session lifecycle ---------------------------------------------------------------------------
    async def _serve(self, principal: str, context, state: dict) -> bool:
        """Serve one stream; True if the device closed the session, False if the stream just ended."""
        hello = await self._expect(context, P.Hello, "Hello")
        state["wants_end"] = hello.wants_end
        sid, entry, resumed = await self._attach(hello, principal, state["counts_as"])
        state["sid"], state["gen"] = sid, entry.generation
        self._stream_attached(1)
        try:
            return await self._stream(context, entry, resumed)
        finally:
            self._stream_attached(-1)

    async def _stream(self, context, entry: _Entry, resumed: bool) -> bool:
        """The attached stream of a session: Welcome, Prompt (prefill or resync), rounds until Close."""
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
            await self._call(entry.session.resync if resumed else entry.session.prefill, prompt)
        while True:
            msg, size = await self._read_sized(context)
            if msg is None:
                return False
            if isinstance(msg, P.Close):
                self._observe_request(entry.session, len(prompt.token_ids), time.perf_counter() - t_start)
                return True
            if self.moving:  # at a round boundary: the device redrafts this round on another edge
                raise _SessionEnd(grpc.StatusCode.UNAVAILABLE, "edge is draining (shutting down): resume the "
                                  "session on another edge", P.DRAINING)
            async with entry.lock:
                await self._dispatch(entry.session, msg, size, context)

    async def _attach(self, hello: P.Hello, principal: str, counts_as: str) -> tuple[str, _Entry, bool]:
        """(session id, entry, resumed): the session to resume, or a new one once admitted.
        ``counts_as``: whom the session counts against for the per-principal cap."""
        resuming = bool(hello.resume_session_id or hello.resume_token)
        if resuming:
            _check_resume_fields(hello)
            entry = self.sessions.get(hello.resume_session_id)
            if entry is not None:
                if entry.principal != principal or not hmac.compare_digest(entry.resume_token, hello.resume_token):
                    raise _SessionEnd(grpc.StatusCode.PERMISSION_DENIED, "not the owner of that session")
                if self.moving:  # the drain is over: resume it elsewhere
                    self._refuse_draining()
                entry.generation += 1  # a half-dead older stream is superseded
                entry.detached = False
                self.admission.rebind(entry.slot, counts_as)  # it holds its slot: never refused
                if self.metrics:
                    self.metrics.session_resumed()
                return hello.resume_session_id, entry, True
            # Unknown (another edge's, expired, or this edge restarted): a fresh session re-prefills
            # the device's verified prefix.
        if self.draining:
            self._refuse_draining()
        sid = secrets.token_hex(SESSION_ID_BYTES)
        try:
            self.admission.check_cap(counts_as)  # over its cap: refused before any work
            # The Hello is checked before queueing (cheap: no KV cache exists before the prompt), so
            # a bad one is told so at once rather than after waiting in the admission queue.
            session = await self._call(self._new_session, hello, sid)
            slot = await self.admission.admit(counts_as)
        except AdmissionRefused as exc:
            log.debug("session refused (%s): %s", exc.reason, exc.message)
            raise _SessionEnd(grpc.StatusCode.RESOURCE_EXHAUSTED, exc.message, exc.reason) from None
        entry = _Entry(session=session, principal=principal, slot=slot,
                       resume_token=secrets.token_bytes(RESUME_TOKEN_BYTES))
        entry.generation = 1
        self.sessions[sid] = entry
        if self.metrics:
            self.metrics.session_started(hello.draft.mode.value)
            if resuming:
                self.metrics.session_reprefilled()
        return sid, entry, False

    @staticmethod
    def _refuse_draining():
        raise _SessionEnd(grpc.StatusCode.UNAVAILABLE, "edge is draining (shutting down): it takes no new "
                          "sessions; try another edge", P.DRAINING)

    # -- draining and readiness ---------------------------------------------------------------------
    def _stream_attached(self, delta: int) -> None:
        self._streams += delta
        if self._streams:
            self._no_streams.clear()
        else:
            self._no_streams.set()

    @property
    def attached_streams(self) -> int:
        return self._streams

    def readiness(self) -> tuple[bool, str]:
        """(ready, why): whether a new session would be taken now (what a load balancer's check or a
        Kubernetes readiness probe asks); not while draining or while admission refuses at once."""
        if self.draining:
            return False, "draining"
        if self.admission.saturated:
            return False, (f"full: {self.admission.in_use} sessions held and {self.admission.queued} "
                           "waiting in the admission queue")
        return True, "ready"

    async def drain(self, timeout_s: float) -> int:
        """Take no new sessions; give the streams attached now up to ``timeout_s`` to finish, then
        send those still running to another edge (at their next message). Returns how many were
        still attached when the time was up."""
        self.draining = True
        if self.metrics:
            self.metrics.set_draining(True)
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self._no_streams.wait(), timeout_s)
        self.moving = True
        return self._streams

    async def wait_streams_ended(self, timeout_s: float) -> None:
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self._no_streams.wait(), timeout_s)

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

    def _release(self, state: dict, status: str | None) -> None:
        """End of a stream: free its session, or (stream broke, status None) detach it for a while."""
        entry = self.sessions.get(state["sid"]) if state["sid"] else None
        if entry is None:
            if status is not None:
                self._observe_end(status, False)
            return
        if entry.generation != state["gen"]:
            return  # another stream resumed this session; it owns it now
        if status is None:
            entry.detached = True
            asyncio.get_running_loop().call_later(self.limits.resume_window_s, self._expire,
                                                   state["sid"], state["gen"])
            return
        self._free(state["sid"], status)

    def _expire(self, sid: str, generation: int) -> None:
        entry = self.sessions.get(sid)
        if entry is not None and entry.detached and entry.generation == generation:
            self._free(sid, "expired")

    def _free(self, sid: str, status: str) -> None:
        entry = self.sessions.pop(sid, None)
        if entry is not None:
            self.admission.release(entry.slot)  # the longest waiting new session gets it
            if self.scheduler is not None:
                self.scheduler.forget(entry.session.lm)  # not due back: no forward waits for it
            self._observe_end(status, True)

    # -- messages ------------------------------------------------------------------------------------
    async def _dispatch(self, session: VerifierSession, msg, size: int, context) -> None:
        if isinstance(msg, P.DraftBlock):
            try:  # cheap after a round's first use of its settings: no worker hop for it
                settings = session.round_settings(msg)
            except ValueError as exc:
                raise _SessionEnd(status_for(exc), str(exc), getattr(exc, "reason", "")) from None
            if settings.mode is Mode.NONE:
                await self._edge_round(session, msg, size, context)
                return
            t0 = time.perf_counter()
            verdict = await self._call(session.verify, msg)
            queue = max(0.0, time.perf_counter() - t0 - verdict.verify_seconds)
            self.recent.observe(msg.tree_depth or len(msg.token_ids), verdict.num_accepted)
            verdict = replace(verdict, queue_seconds=queue, draft_len_hint=self._hint(session))
            reply = wire.verdict_to_pb(verdict)
            if self.metrics:
                self.metrics.observe_round(edge_record(msg, verdict, settings.mode.value, size, reply.ByteSize()))
            await context.write(reply)
        elif isinstance(msg, P.ResidualRequest):
            residual = await self._call(session.residual, msg)
            reply = wire.residual_to_pb(residual)
            if self.metrics:
                self.metrics.dssd_fallback(residual.is_head, reply.ByteSize())
            await context.write(reply)
        else:
            raise _SessionEnd(grpc.StatusCode.INVALID_ARGUMENT, f"unexpected {type(msg).__name__} mid-session")

    async def _edge_round(self, session: VerifierSession, msg: P.DraftBlock, size: int, context) -> None:
        """Mode none: the target generates the round's tokens; each goes out as soon as it exists."""
        tokens = session.generate(msg)  # runs a step per next() on the worker pool
        generated, downlink, verify, queue = 0, 0, 0.0, 0.0
        while True:
            t0 = time.perf_counter()
            verdict = await self._call(next, tokens, None)
            if verdict is None:
                break
            wait = max(0.0, time.perf_counter() - t0 - verdict.verify_seconds)
            reply = wire.verdict_to_pb(replace(verdict, queue_seconds=wait, draft_len_hint=self._hint(session)))
            await context.write(reply)
            generated, downlink = generated + 1, downlink + reply.ByteSize()
            verify, queue = verify + verdict.verify_seconds, queue + wait
            if not verdict.more:
                break
        session.acceptance.relax(generated)  # no draft seen: the advice must not keep it edge-only for good
        if self.metrics:
            self.metrics.observe_round(edge_only_record(generated, size, downlink, verify, queue))

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

    def _observe_end(self, status: str, started: bool) -> None:
        if self.metrics:
            self.metrics.session_ended(status, started)


def _check_resume_fields(hello: P.Hello) -> None:
    """A resume names a session id of this protocol's form and carries its resume token."""
    if not SESSION_ID_RE.fullmatch(hello.resume_session_id):
        raise _SessionEnd(grpc.StatusCode.INVALID_ARGUMENT,
                          f"malformed resume_session_id {hello.resume_session_id[:40]!r}: expected "
                          f"{2 * SESSION_ID_BYTES} lowercase hex digits")
    if len(hello.resume_token) != RESUME_TOKEN_BYTES:
        raise _SessionEnd(grpc.StatusCode.INVALID_ARGUMENT,
                          f"resume_token of {len(hello.resume_token)} bytes: expected {RESUME_TOKEN_BYTES}")


async def _until_half_closed(context) -> None:
    """Read (and drop) what the device still sends until it half-closes."""
    while await context.read() is not grpc.aio.EOF:
        pass
