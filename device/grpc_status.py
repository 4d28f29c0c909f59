"""How the device reads a gRPC call's outcome: grpc.aio's behaviours that would otherwise turn a clear
refusal into a retried "broken connection", or a cancelled session into one that never says goodbye.
Each work-around here says which behaviour it answers and why; the client (client.py) only calls them.

- the local write failure (grpc issue 36066): a write into a call that already ended is reported as
  INTERNAL "Internal error from Core", set locally, over or before the peer's own status;
  :func:`watch_status` and :func:`final_error` recover the peer's;
- the shielded read: grpc.aio cancels the whole RPC when an awaited read is cancelled (a round timeout
  is such a cancellation), which would keep the session from sending its Close; :class:`ShieldedRead`
  keeps the read alive across a timeout;
- which final statuses mean "reconnect and resume" (:func:`retryable`), torn connections that gRPC
  core reports as INTERNAL among them.
"""
from __future__ import annotations

import asyncio
import contextlib

import grpc

from specdec.common import protocol as P


class EdgeError(RuntimeError):
    """The edge ended the session with a gRPC status; ``code`` and ``details`` say why, ``reason``
    (protocol.REASON_KEY in the trailing metadata, "" if none) says it to programs."""

    def __init__(self, code: grpc.StatusCode, details: str, reason: str = ""):
        super().__init__(f"edge session failed: {code.name}: {details}")
        self.code = code
        self.details = details
        self.reason = reason


def reason_of(metadata) -> str:
    return next((str(v) for k, v in (metadata or ()) if k == P.REASON_KEY), "")


STATUS_BY_NUMBER = {code.value[0]: code for code in grpc.StatusCode}


async def half_close(call) -> None:
    """Done writing, so the edge can end the stream without resetting it (see End in the proto)."""
    with contextlib.suppress(Exception):
        await call.done_writing()


# grpc.aio reports a write that fails because the call has already ended (the edge, or a proxy,
# refused it while the device was still writing) as INTERNAL "Internal error from Core", set locally
# (grpc issue 36066). The peer's own status (UNAUTHENTICATED, RESOURCE_EXHAUSTED, ...) either came just
# before, and that local status overwrote it, or comes moments later and overwrites the local one.
# watch_status keeps the first status a call got; final_error waits this long for a later one (a
# round trip on a slow link; a connection that died has its status, UNAVAILABLE, at once).
FINAL_STATUS_WAIT_S = 1.0
FINAL_STATUS_POLL_S = 0.01


# gRPC core reports some torn connections (a peer killed mid-frame) as INTERNAL with this text;
# the servicer's own INTERNAL errors say "internal error: ...", and those are not retried.
CORE_TRANSPORT_FAILURE = "Internal error from Core"


def is_local_write_failure(code, details) -> bool:
    return code is grpc.StatusCode.INTERNAL and details == CORE_TRANSPORT_FAILURE


def _at_once(coro):
    """The value of a coroutine that completes without suspending (a finished call's status
    accessors), from synchronous code; None if it would have to wait."""
    try:
        coro.send(None)
    except StopIteration as done:
        return done.value
    coro.close()
    return None


def watch_status(call) -> dict:
    """A dict that receives the first final status the call gets, (code, details, trailing metadata),
    under "first", the moment it is set (before anything can overwrite it)."""
    seen: dict = {}

    def done(c) -> None:
        if "first" not in seen:
            seen["first"] = (_at_once(c.code()), _at_once(c.details()), _at_once(c.trailing_metadata()))
    call.add_done_callback(done)
    return seen


async def final_error(call, seen: dict | None = None) -> "EdgeError":
    """The call's final status as an EdgeError. When it is only the local write failure, the peer's
    status: the one that came first (``seen``, from watch_status) or one that comes within
    FINAL_STATUS_WAIT_S, so that a refusal is never mistaken for a broken connection and retried."""
    first = (seen or {}).get("first")
    if first and first[0] is not None and not is_local_write_failure(first[0], first[1]):
        code, details, trailing = first
        return EdgeError(code, details or "stream ended", reason_of(trailing))
    loop = asyncio.get_running_loop()
    deadline = loop.time() + FINAL_STATUS_WAIT_S
    while True:
        code, details = await call.code(), await call.details()
        if not is_local_write_failure(code, details) or loop.time() >= deadline:
            break
        await asyncio.sleep(FINAL_STATUS_POLL_S)
    return EdgeError(code, details or "stream ended", reason_of(await call.trailing_metadata()))


# Statuses after which the device reconnects and resumes instead of failing: the link or the edge
# went away, or a round took longer than the policy allows.
RETRYABLE = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED,
                       grpc.StatusCode.ABORTED, grpc.StatusCode.CANCELLED})


def retryable(error: EdgeError) -> bool:
    return error.code in RETRYABLE or is_local_write_failure(error.code, error.details)


class ShieldedRead:
    """Reads a call's next message with a timeout, without cancelling the read (and with it the
    whole RPC) when the timeout fires: the pending read is kept and the next call awaits it again."""

    def __init__(self, call):
        self.call = call
        self._pending: asyncio.Future | None = None

    async def __call__(self, timeout: float | None):
        """The next message (or grpc.aio.EOF); asyncio.TimeoutError after ``timeout`` seconds."""
        if self._pending is None:
            self._pending = asyncio.ensure_future(self.call.read())
        msg = await asyncio.wait_for(asyncio.shield(self._pending), timeout)
        self._pending = None
        return msg
