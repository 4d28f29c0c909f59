"""The edge's sessions: which exist, who owns each, which stream works on one now, and when each is freed.

Sessions outlive their stream when it breaks: a stream that ends without ``Close`` (link cut, device
crash, keepalive timeout) leaves its session detached for ``resume_window_s``, so the device can
reconnect and resume with the session id and the secret resume token from ``Welcome``, under the same
credentials. ``Close``, a bad message or an idle timeout free the session at once.

New sessions pass admission (:mod:`specdec.edge.admission`): a cap per principal and a bounded queue
when all ``max_sessions`` slots are held. Resuming one's own session is never refused: a detached
session keeps its slot for the resume window. A resume of a session this registry does not hold (it
ran on another edge, this edge restarted, its window ran out) starts a new session.

Draining (SIGTERM): no new sessions, not ready; streams attached now get the drain time to finish;
then ``moving`` is set, and the servicer sends those still running elsewhere at their next message.

No gRPC here: refusals are exceptions (:class:`NotOwner`, :class:`Draining`, admission's
``AdmissionRefused``) that the servicer turns into statuses.
"""
from __future__ import annotations

import asyncio
import contextlib
import hmac
import secrets
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from specdec.common import protocol as P
from specdec.edge.admission import Admission, AdmissionSettings, Slot
from specdec.edge.batching import ForwardScheduler
from specdec.edge.verifier import VerifierSession

SESSION_ID_BYTES = 16    # 128 random bits: session ids are unguessable
RESUME_TOKEN_BYTES = 32  # the secret that, with the same credentials, lets a stream resume a session
MOVED = "moved"  # status of a session a drain ended so that its device resumes it on another edge
EXPIRED = "expired"  # status of a detached session whose resume window ran out
DRAINING_REFUSAL = "edge is draining (shutting down): it takes no new sessions; try another edge"


class NotOwner(Exception):
    """A resume by another principal, or with the wrong resume token."""


class Draining(Exception):
    """The edge is draining: it takes no new sessions (and, once ``moving``, resumes none)."""


@dataclass
class Entry:
    """A session and what binds it: its owner, its resume secret, the stream now attached."""
    session: VerifierSession
    principal: str
    resume_token: bytes
    slot: Slot                     # its hold on one of the edge's max_sessions (admission)
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)  # one stream works on a session at a time
    generation: int = 1            # bumped per attached stream; a superseded stream must not free it
    detached: bool = False


@dataclass
class Stream:
    """One gRPC stream's hold on the registry, from its Hello to its end."""
    counts_as: str = ""            # whom its session counts against for the per-principal cap
    wants_end: bool = False        # the device reads End messages (Hello.wants_end)
    sid: str | None = None         # the session it is attached to
    generation: int = 0            # that session's generation when it attached


NewSession = Callable[[P.Hello, str], Awaitable[VerifierSession]]  # (hello, session id) -> a checked session


class SessionRegistry:
    """Attach, resume, detach, expire and free sessions; count attached streams; drain."""

    def __init__(self, max_sessions: int, resume_window_s: float, admission: AdmissionSettings | None = None,
                 metrics=None, scheduler: ForwardScheduler | None = None):
        self.sessions: dict[str, Entry] = {}
        self.admission = Admission(admission or AdmissionSettings(), max_sessions, metrics)
        self.resume_window_s = resume_window_s
        self.metrics = metrics
        self.scheduler = scheduler  # forgets a freed session's forwards
        self.draining = False       # SIGTERM: no new sessions, not ready
        self.moving = False         # the drain time is up: running sessions are sent elsewhere
        self._streams = 0           # streams attached to a session right now
        self._no_streams = asyncio.Event()
        self._no_streams.set()

    async def attach(self, stream: Stream, hello: P.Hello, principal: str,
                     new_session: NewSession) -> tuple[Entry, bool]:
        """(entry, resumed): the session ``hello`` resumes, or a new one once admitted (``new_session``
        checks the Hello first: a bad one is told so before it waits in the admission queue)."""
        entry = self._resume(hello, principal, stream.counts_as) if hello.resume_session_id else None
        resumed = entry is not None
        if entry is None:
            entry = await self._new(hello, principal, stream.counts_as, new_session)
        stream.sid, stream.generation = entry.session.session_id, entry.generation
        return entry, resumed

    def _resume(self, hello: P.Hello, principal: str, counts_as: str) -> Entry | None:
        entry = self.sessions.get(hello.resume_session_id)
        if entry is None:
            return None  # unknown here: a fresh session re-prefills the device's verified prefix
        if entry.principal != principal or not hmac.compare_digest(entry.resume_token, hello.resume_token):
            raise NotOwner("not the owner of that session")
        if self.moving:  # the drain is over: resume it elsewhere
            raise Draining(DRAINING_REFUSAL)
        entry.generation += 1  # a half-dead older stream is superseded
        entry.detached = False
        self.admission.rebind(entry.slot, counts_as)  # it holds its slot: never refused
        if self.metrics:
            self.metrics.session_resumed()
        return entry

    async def _new(self, hello: P.Hello, principal: str, counts_as: str, new_session: NewSession) -> Entry:
        if self.draining:
            raise Draining(DRAINING_REFUSAL)
        sid = secrets.token_hex(SESSION_ID_BYTES)
        self.admission.check_cap(counts_as)  # over its cap: refused before any work
        session = await new_session(hello, sid)
        slot = await self.admission.admit(counts_as)
        entry = Entry(session=session, principal=principal, slot=slot,
                      resume_token=secrets.token_bytes(RESUME_TOKEN_BYTES))
        self.sessions[sid] = entry
        if self.metrics:
            self.metrics.session_started(hello.draft.mode.value)
            if hello.resume_session_id or hello.resume_token:
                self.metrics.session_reprefilled()
        return entry

    @contextlib.contextmanager
    def attached(self):
        """While a stream works on its session (drain waits for these)."""
        self._count(1)
        try:
            yield
        finally:
            self._count(-1)

    def _count(self, delta: int) -> None:
        self._streams += delta
        if self._streams:
            self._no_streams.clear()
        else:
            self._no_streams.set()

    @property
    def attached_streams(self) -> int:
        return self._streams

    def release(self, stream: Stream, status: str | None) -> None:
        """End of a stream: free its session, or (stream broke, status None) detach it for a while."""
        entry = self.sessions.get(stream.sid) if stream.sid else None
        if entry is None:
            if status is not None:
                self.observe_end(status, False)
            return
        if entry.generation != stream.generation:
            return  # another stream resumed this session; it owns it now
        if status is None:
            entry.detached = True
            asyncio.get_running_loop().call_later(self.resume_window_s, self._expire, stream.sid, stream.generation)
            return
        self._free(stream.sid, status)

    def _expire(self, sid: str, generation: int) -> None:
        entry = self.sessions.get(sid)
        if entry is not None and entry.detached and entry.generation == generation:
            self._free(sid, EXPIRED)

    def _free(self, sid: str, status: str) -> None:
        entry = self.sessions.pop(sid, None)
        if entry is not None:
            self.admission.release(entry.slot)  # the longest waiting new session gets it
            if self.scheduler is not None:
                self.scheduler.forget(entry.session.lm)  # not due back: no forward waits for it
            self.observe_end(status, True)

    def observe_end(self, status: str, started: bool) -> None:
        if self.metrics:
            self.metrics.session_ended(status, started)

    # -- draining and readiness ---------------------------------------------------------------------
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
        await self.wait_streams_ended(timeout_s)
        self.moving = True
        return self._streams

    async def wait_streams_ended(self, timeout_s: float) -> None:
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self._no_streams.wait(), timeout_s)
