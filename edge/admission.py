"""Admission of new sessions: a cap per principal and a bounded wait queue at the global limit.

A session holds one of the edge's ``max_sessions`` slots from admission until it is freed (Close,
error, idle timeout, or its resume window running out), so a session detached for a resume still
counts, against its principal too. Resuming a session one still holds takes no new slot and is never
refused here.

A new session is refused at once (``RESOURCE_EXHAUSTED``, with the limit and its value in the
message) when its principal already holds or waits for ``cap`` sessions, or when the edge is full and
``queue`` sessions already wait; otherwise it waits its turn (first come, first served) for up to
``wait_s`` and is refused if no slot frees in time. A refusal touches nothing of any other session.

No grpc and no torch here: the servicer maps :class:`AdmissionRefused` to its status.
"""
from __future__ import annotations

import asyncio
import time
from collections import Counter, deque
from dataclasses import dataclass

# Why a new session was refused: the metric's ``reason`` label, a fixed set.
PRINCIPAL_CAP = "principal_cap"   # its principal already holds (or waits for) its cap of sessions
QUEUE_FULL = "queue_full"         # the edge is full and so is the queue (a queue of 0 is always full)
QUEUE_TIMEOUT = "queue_timeout"   # it waited wait_s in the queue and no slot freed
REASONS = (PRINCIPAL_CAP, QUEUE_FULL, QUEUE_TIMEOUT)


@dataclass(frozen=True)
class AdmissionSettings:
    """How new sessions are admitted (the edge-server flags derive their defaults from these)."""
    # Sessions one principal may hold (detached ones included) or wait for. None: half of
    # max_sessions, so no single client can hold every slot for a resume window while one device
    # daemon (all its requests are one principal) still gets half the edge; a one-slot edge has
    # nothing to share and gets no cap. 0: no cap.
    max_sessions_per_principal: int | None = None
    # New sessions that may wait for a slot while the edge is at max_sessions; 0 = refuse at once.
    queue: int = 16
    # How long a queued session waits before it is refused: covers the churn of sessions ending,
    # and answers well within a device's round timeout (30 s by default), which bounds its wait for
    # the Welcome.
    wait_s: float = 5.0

    def __post_init__(self) -> None:
        cap = self.max_sessions_per_principal
        if cap is not None and (isinstance(cap, bool) or not isinstance(cap, int) or cap < 0):
            raise ValueError(f"max sessions per principal must be an int >= 0 (0 = no cap), got {cap!r}")
        if isinstance(self.queue, bool) or not isinstance(self.queue, int) or self.queue < 0:
            raise ValueError(f"admission queue must be an int >= 0 (0 = no queue), got {self.queue!r}")
        if not (isinstance(self.wait_s, (int, float)) and 0 < self.wait_s < float("inf")):
            raise ValueError(f"admission wait must be > 0 seconds, got {self.wait_s!r}")

    def principal_cap(self, max_sessions: int) -> int:
        """The cap in force on an edge of ``max_sessions`` slots; 0 = none."""
        if self.max_sessions_per_principal is None:
            return max_sessions // 2
        return self.max_sessions_per_principal


class AdmissionRefused(Exception):
    """A new session the edge will not take now (RESOURCE_EXHAUSTED); ``reason`` is one of REASONS."""

    def __init__(self, reason: str, message: str):
        super().__init__(message)
        self.reason = reason
        self.message = message


class Slot:
    """One admitted session's hold on the edge: released exactly once, when the session is freed."""
    __slots__ = ("principal", "released")

    def __init__(self, principal: str):
        self.principal = principal
        self.released = False


@dataclass
class _Waiter:
    principal: str
    granted: asyncio.Future


class Admission:
    """The slots of one edge and the sessions waiting for one. Event-loop only (not thread-safe):
    every method runs on the servicer's loop, so no state changes between a check and its update."""

    def __init__(self, settings: AdmissionSettings, max_sessions: int, metrics=None):
        self.settings = settings
        self.max_sessions = max_sessions
        self.cap = settings.principal_cap(max_sessions)
        self.metrics = metrics
        self.in_use = 0                        # slots held (sessions, attached or detached)
        self.held: Counter[str] = Counter()    # slots held per principal
        self.waiting: Counter[str] = Counter()  # queued sessions per principal
        self._queue: deque[_Waiter] = deque()

    @property
    def queued(self) -> int:
        return len(self._queue)

    @property
    def saturated(self) -> bool:
        """A new session would be refused at once (every slot held and the queue full)."""
        return self.in_use >= self.max_sessions and len(self._queue) >= self.settings.queue

    async def admit(self, principal: str) -> Slot:
        """A slot for a new session of ``principal``, at once or after waiting in the queue; raises
        :class:`AdmissionRefused` when over its cap, when the queue is full, or when the wait expires.
        A caller cancelled while waiting leaves the queue (and any slot just handed to it) behind."""
        self.check_cap(principal)
        if not self._queue and self.in_use < self.max_sessions:
            self.in_use += 1
            return self._granted(principal, 0.0)
        if len(self._queue) >= self.settings.queue:
            if self.settings.queue == 0:
                self._refuse(QUEUE_FULL, f"edge is at its limit of {_sessions(self.max_sessions)}")
            self._refuse(QUEUE_FULL, f"edge is at its limit of {_sessions(self.max_sessions)} and its "
                                     f"admission queue of {self.settings.queue} is full")
        waiter = _Waiter(principal, asyncio.get_running_loop().create_future())
        self._queue.append(waiter)
        self.waiting[principal] += 1
        self._queue_changed()
        t0 = time.perf_counter()
        try:
            await asyncio.wait((waiter.granted,), timeout=self.settings.wait_s)
        except asyncio.CancelledError:  # the stream went away while waiting
            if waiter.granted.done():
                self.release(waiter.granted.result())  # handed a slot just now: pass it on
            else:
                self._leave(waiter)
            raise
        if waiter.granted.done():  # release() moved the slot (and the count) over to this waiter
            return self._observe_wait(waiter.granted.result(), time.perf_counter() - t0)
        self._leave(waiter)
        self._refuse(QUEUE_TIMEOUT, f"edge is at its limit of {_sessions(self.max_sessions)} and none "
                                    f"freed within {self.settings.wait_s:g} s in the admission queue")

    def check_cap(self, principal: str) -> None:
        """Refuse (AdmissionRefused) if ``principal`` already holds or waits for its cap of sessions:
        cheap, so the servicer asks before doing any work for a new session (admit asks again)."""
        held, waiting = self.held[principal], self.waiting[principal]
        if self.cap and held + waiting >= self.cap:
            also = f" and waits for {waiting} more" if waiting else ""
            self._refuse(PRINCIPAL_CAP, f"principal {principal!r} holds {_sessions(held)}{also}: "
                                        f"the limit per principal is {self.cap}")

    def release(self, slot: Slot) -> None:
        """Free ``slot`` (idempotent): the longest waiting session gets it, else it is free."""
        if slot.released:
            return
        slot.released = True
        self._decrement(self.held, slot.principal)
        if self._queue:
            waiter = self._queue.popleft()  # waiters that gave up have already left the queue
            self._decrement(self.waiting, waiter.principal)
            self.held[waiter.principal] += 1
            waiter.granted.set_result(Slot(waiter.principal))
            self._queue_changed()
        else:
            self.in_use -= 1

    def rebind(self, slot: Slot, principal: str) -> None:
        """A resumed session now counts against whoever resumed it (e.g. a device that moved to
        another address). Never refused: it holds its slot already."""
        if slot.released or slot.principal == principal:
            return
        self._decrement(self.held, slot.principal)
        self.held[principal] += 1
        slot.principal = principal

    # -- internals -------------------------------------------------------------------------------
    def _granted(self, principal: str, waited: float) -> Slot:
        self.held[principal] += 1
        return self._observe_wait(Slot(principal), waited)

    def _observe_wait(self, slot: Slot, waited: float) -> Slot:
        if self.metrics:
            self.metrics.admission_waited(waited)
        return slot

    def _leave(self, waiter: _Waiter) -> None:
        self._queue.remove(waiter)
        self._decrement(self.waiting, waiter.principal)
        self._queue_changed()

    def _queue_changed(self) -> None:
        if self.metrics:
            self.metrics.admission_queued(len(self._queue))

    def _refuse(self, reason: str, message: str):
        if self.metrics:
            self.metrics.admission_rejected(reason)
        raise AdmissionRefused(reason, message)

    @staticmethod
    def _decrement(counts: Counter, key: str) -> None:
        counts[key] -= 1
        if counts[key] <= 0:
            del counts[key]


def _sessions(n: int) -> str:
    return f"{n} session" if n == 1 else f"{n} sessions"
