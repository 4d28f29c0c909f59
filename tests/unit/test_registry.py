"""The edge's session registry without gRPC: attach, resume by the owner only, detach and expire,
free, drain. Sessions here are stand-ins (the registry only reads their id and KV handle); the real
ones over gRPC: tests/integration/test_resume.py, test_admission.py, test_fleet.py."""
from __future__ import annotations

import asyncio
from dataclasses import dataclass

import pytest

from specdec.common import protocol as P
from specdec.edge.admission import AdmissionRefused, AdmissionSettings
from specdec.edge.registry import EXPIRED, Draining, NotOwner, SessionRegistry, Stream

WINDOW_S = 0.05  # resume window of these tests


@dataclass
class FakeSession:
    session_id: str
    lm: object = None


class Ended:
    """The edge metrics' session hooks, recorded."""

    def __init__(self):
        self.ended: list[tuple[str, bool]] = []
        self.events: list[str] = []

    def session_started(self, mode: str) -> None:
        self.events.append("started")

    def session_resumed(self) -> None:
        self.events.append("resumed")

    def session_reprefilled(self) -> None:
        self.events.append("reprefilled")

    def session_ended(self, status: str, started: bool) -> None:
        self.ended.append((status, started))

    def set_draining(self, on: bool) -> None:
        self.events.append("draining")

    def __getattr__(self, name):  # admission's gauges: not what these tests check
        return lambda *a, **k: None


async def make(hello: P.Hello, sid: str) -> FakeSession:
    return FakeSession(sid)


def hello(**resume) -> P.Hello:
    return P.Hello(vocab_fingerprint="v", vocab_size=8, temperature=0.0, draft=P.DraftSettings(), seed=0,
                   **resume)


def registry(max_sessions: int = 4, **kw) -> tuple[SessionRegistry, Ended]:
    metrics = Ended()
    return SessionRegistry(max_sessions, WINDOW_S, AdmissionSettings(**kw), metrics), metrics


def test_a_session_is_resumed_by_its_owner_only_and_supersedes_the_old_stream() -> None:
    async def main():
        reg, metrics = registry()
        first = Stream(counts_as="alice")
        entry, resumed = await reg.attach(first, hello(), "alice", make)
        assert not resumed and first.sid == entry.session.session_id and first.generation == 1
        again = hello(resume_session_id=first.sid, resume_token=entry.resume_token)
        with pytest.raises(NotOwner):
            await reg.attach(Stream(counts_as="bob"), again, "bob", make)
        with pytest.raises(NotOwner):
            await reg.attach(Stream(counts_as="alice"), hello(resume_session_id=first.sid, resume_token=b"x" * 32),
                             "alice", make)
        second = Stream(counts_as="alice")
        same, resumed = await reg.attach(second, again, "alice", make)
        assert resumed and same is entry and second.generation == 2
        reg.release(first, None)  # the superseded stream ends: the session is the new stream's
        assert not entry.detached and first.sid in reg.sessions
        reg.release(second, "ok")
        assert first.sid not in reg.sessions and metrics.ended == [("ok", True)]
        assert metrics.events == ["started", "resumed"]
    asyncio.run(main())


def test_a_detached_session_expires_after_the_window_unless_resumed() -> None:
    async def main():
        reg, metrics = registry()
        kept, gone = Stream(counts_as="a"), Stream(counts_as="a")
        entry, _ = await reg.attach(kept, hello(), "a", make)
        await reg.attach(gone, hello(), "a", make)
        reg.release(kept, None)
        reg.release(gone, None)
        assert reg.sessions[kept.sid].detached
        back = Stream(counts_as="a")
        await reg.attach(back, hello(resume_session_id=kept.sid, resume_token=entry.resume_token), "a", make)
        await asyncio.sleep(WINDOW_S * 4)
        assert kept.sid in reg.sessions and gone.sid not in reg.sessions
        assert metrics.ended == [(EXPIRED, True)]
    asyncio.run(main())


def test_an_unknown_resume_starts_a_new_session_that_reprefills() -> None:
    async def main():
        reg, metrics = registry()
        stream = Stream(counts_as="a")
        _, resumed = await reg.attach(stream, hello(resume_session_id="0" * 32, resume_token=b"t" * 32), "a", make)
        assert not resumed and stream.sid != "0" * 32 and metrics.events == ["started", "reprefilled"]
    asyncio.run(main())


def test_admission_refusals_pass_through_and_a_freed_slot_is_reused() -> None:
    async def main():
        reg, _ = registry(max_sessions=1, queue=0)
        first = Stream(counts_as="a")
        await reg.attach(first, hello(), "a", make)
        with pytest.raises(AdmissionRefused):
            await reg.attach(Stream(counts_as="b"), hello(), "b", make)
        reg.release(first, "ok")
        await reg.attach(Stream(counts_as="b"), hello(), "b", make)
    asyncio.run(main())


def test_drain_refuses_new_sessions_waits_for_attached_streams_then_moves_them() -> None:
    async def main():
        reg, metrics = registry()
        stream = Stream(counts_as="a")
        entry, _ = await reg.attach(stream, hello(), "a", make)
        with reg.attached():
            left = await reg.drain(WINDOW_S)
            assert left == 1 and reg.moving and reg.readiness() == (False, "draining")
        assert reg.attached_streams == 0
        with pytest.raises(Draining):
            await reg.attach(Stream(counts_as="a"), hello(), "a", make)
        with pytest.raises(Draining):  # the drain is over: resume it elsewhere
            await reg.attach(Stream(counts_as="a"),
                             hello(resume_session_id=stream.sid, resume_token=entry.resume_token), "a", make)
        assert "draining" in metrics.events
    asyncio.run(main())
