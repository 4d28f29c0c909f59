"""The device's round loop over any message link: one round at a time, drafting the next ahead.

No grpc here: :mod:`specdec.device.client` gives it a link over a gRPC stream, the in-process test
harness one straight to an edge :class:`~specdec.edge.verifier.VerifierSession`. A link moves the
domain messages of :mod:`specdec.common.protocol` and says what each cost in serialized bytes; it
raises on a broken stream, and the caller (the client's resilient loop) decides whether to resume.
The blocking torch work of :class:`~specdec.device.session.DraftSession` runs off the event loop.
"""
from __future__ import annotations

import asyncio
import threading
import time
from dataclasses import replace
from typing import Callable, Protocol

from specdec.common import protocol as P
from specdec.common.modes import Mode
from specdec.device import edge_only, run_ahead
from specdec.device.rounds import RoundDraft, RoundEvent, RoundIO, RoundPlan
from specdec.device.session import DraftSession


class ProtocolError(Exception):
    """The edge sent a message that does not belong where it arrived (a bug or a hostile edge)."""


class Link(Protocol):
    async def send(self, msg) -> int:
        """Send a DraftBlock or ResidualRequest; its serialized size in bytes."""

    async def recv(self) -> tuple[object, int]:
        """The next Verdict or ResidualReply and its serialized size."""

    async def close(self) -> int:
        """Tell the edge that the session ends with the round it streams now (Close); its size."""


async def run_round(link: Link, session: DraftSession, remaining: int,
                    deliver: Callable[[list[int]], None]) -> RoundEvent:
    """Run the next round of ``session`` (at most ``remaining`` new tokens) and hand its tokens to
    ``deliver`` as they are verified: a drafted round's at its verdict, an edge-only round's one by one."""
    sent = session.take_sent_ahead()
    if sent is not None:
        return await _edge_round(link, session, sent, remaining, deliver, time.perf_counter())
    plan = session.plan()
    if plan.settings.mode is Mode.NONE:
        rd, t0 = session.edge_round(plan, remaining), time.perf_counter()
        rd.block_bytes = await link.send(run_ahead.stamp(session, rd))
        return await _edge_round(link, session, rd, remaining, deliver, t0)
    return await _drafted_round(link, session, plan, remaining, deliver)


async def _drafted_round(link: Link, session: DraftSession, plan: RoundPlan, remaining: int,
                         deliver: Callable[[list[int]], None]) -> RoundEvent:
    # Drafting fewer than `remaining` tokens: the round's correction/bonus token is the last one.
    rd = await asyncio.to_thread(session.draft, plan, max(1, remaining - 1))
    t0 = time.perf_counter()
    sent = await link.send(run_ahead.stamp(session, rd))
    ahead = _start_draft_ahead(session, rd, remaining)
    early: list[P.Verdict] = []  # tokens the edge generated ahead before this round reached it
    try:
        verdict, received = await link.recv()
        while isinstance(verdict, P.Verdict) and verdict.ahead:
            early.append(verdict)
            verdict, size = await link.recv()
            received += size
    finally:
        await _stop_worker(ahead)  # the worker must be off the drafter before anyone touches it
    session.replied_at = time.perf_counter()
    if not isinstance(verdict, P.Verdict) or verdict.round_id != rd.block.round_id:
        raise ProtocolError(f"expected the Verdict of round {rd.block.round_id}")
    if verdict.superseded:
        return await _superseded(session, rd, early, verdict, received, deliver)
    io = RoundIO(sent, received, max(0.0, session.replied_at - t0 - verdict.verify_seconds - verdict.queue_seconds))
    if early:  # continued after tokens the edge generated ahead: its wait was no round trip
        verdict = _continued(rd, early, verdict)
    else:
        session.overdue.trip(io.network_s)
    correction = verdict.next_token is None  # DSSD rejection: the device draws the token itself
    token = verdict.next_token
    if correction:
        token = await asyncio.to_thread(session.resolve, rd, verdict)
        if token is None:
            t1 = time.perf_counter()
            token, up, down, trips = await _dssd_fallback(link, session, rd, verdict)
            io = RoundIO(sent + up, received + down, io.network_s + time.perf_counter() - t1, trips, down)
    event = await asyncio.to_thread(session.apply_verdict, rd, verdict, token, io, dssd_correction=correction,
                                    learn=not early)
    deliver(list(event.new_tokens))
    return event


def _continued(rd: RoundDraft, early: list[P.Verdict], verdict: P.Verdict) -> P.Verdict:
    """``rd``'s verdict after the tokens generated ahead before it reached the edge (run_ahead.continued)."""
    try:
        return run_ahead.continued(rd.block, early, verdict)
    except ValueError as exc:
        raise ProtocolError(str(exc)) from None


async def _superseded(session: DraftSession, rd: RoundDraft, early: list[P.Verdict], verdict: P.Verdict,
                      received: int, deliver: Callable[[list[int]], None]) -> RoundEvent:
    """The edge ran ahead before ``rd`` reached it (it was overdue): the tokens it generated, then
    ``rd`` superseded, unverified. Anything else is out of turn: a round is superseded exactly when
    tokens were generated ahead of its start, and they come first on the stream."""
    if not (early and verdict.superseded):
        raise ProtocolError(f"round {rd.block.round_id}: {len(early)} tokens generated ahead, then a verdict "
                            f"that is {'' if verdict.superseded else 'not '}superseded")
    try:
        event = await asyncio.to_thread(session.superseded, rd, early, received)
    except ValueError as exc:
        raise ProtocolError(str(exc)) from None
    deliver(list(event.new_tokens))
    return event


async def _edge_round_continued(session: DraftSession, rd: RoundDraft, early: list[P.Verdict], received: int,
                                deliver: Callable[[list[int]], None]) -> None:
    """The edge continued edge-only round ``rd`` after ``early``, tokens it generated ahead past the
    round's start (Hello.continues_late_edge_only): they are committed as a round of their own, as
    where a round is superseded, and ``rd`` streams on with its rest. Out of turn from an edge that did
    not say it continues such rounds."""
    if not session.overdue.continued_edge_only:
        raise ProtocolError(f"round {rd.block.round_id}: {len(early)} tokens generated ahead, then a verdict "
                            f"that is not superseded")
    try:
        event = await asyncio.to_thread(session.superseded, run_ahead.rest_of_edge_round(rd, len(early)), early,
                                        received, True)
    except ValueError as exc:
        raise ProtocolError(str(exc)) from None
    deliver(list(event.new_tokens))


async def _edge_round(link: Link, session: DraftSession, rd: RoundDraft, remaining: int,
                      deliver: Callable[[list[int]], None], t0: float) -> RoundEvent:
    """Mode none: the edge streams the round's tokens (its request is sent already, by the caller or
    ahead while the last round streamed); each is handed on as soon as it arrives. Once the last few
    are due, the next round's request goes out if that round is edge-only too (:func:`_send_ahead`).
    A round that streams all the session still wants sends Close once its first token is in: the edge
    reads it after the round's last token and ends the stream at once, where a Close sent after that
    token waited a round trip more for the edge's answer, and a link down just then (a cellular outage)
    held the finished session for seconds. Not before that token: a round the edge supersedes (it ran
    ahead) delivers less, and the session goes on."""
    # t0: when the round's request went out, or (sent ahead) when it became the round in flight
    catch_up = _start_catch_up(session, rd)
    received, edge_verify, edge_queue, first, verdict, planned = 0, 0.0, 0.0, None, None, False
    arrived = edge_only.Arrivals()
    after = remaining - rd.settings.edge_tokens  # tokens still wanted after this round, if it streams them all
    ends_session = after <= 0                    # so Close goes out with its first token

    def io() -> RoundIO:
        return RoundIO(rd.block_bytes, received, max(0.0, time.perf_counter() - t0 - edge_verify - edge_queue),
                       first_reply_s=first, token_interval_s=arrived.interval(), stream_stall_s=arrived.stall())

    def totals() -> P.Verdict:
        return replace(verdict, verify_seconds=edge_verify, queue_seconds=edge_queue, decode_seconds=0.0)
    early: list[P.Verdict] = []  # tokens the edge generated ahead before this round reached it
    try:
        while True:
            verdict, size = await link.recv()
            if not isinstance(verdict, P.Verdict):
                raise ProtocolError("expected a Verdict of the edge-only round")
            received += size
            if verdict.superseded:
                await _stop_worker(catch_up)
                session.replied_at = time.perf_counter()
                return await _superseded(session, rd, early, verdict, received, deliver)
            if verdict.ahead:
                early.append(verdict)
                continue
            if early:  # the edge continued this round after the tokens it generated ahead
                await _edge_round_continued(session, rd, early, received - size, deliver)
                early, received = [], size
            edge_verify, edge_queue = edge_verify + verdict.verify_seconds, edge_queue + verdict.queue_seconds
            arrived.add(time.perf_counter())
            if first is None:
                first = max(0.0, arrived.first - t0 - edge_verify - edge_queue)
                if not (rd.sent_ahead or rd.continued_after):  # (a continued round waited an outage out)
                    session.edge_rtt_s = first
                    session.overdue.trip(first)
            if edge_only.is_void(rd, verdict):
                break
            try:
                deliver([session.take_edge_token(rd, verdict)])
            except ValueError as exc:
                raise ProtocolError(str(exc)) from None
            if ends_session:
                ends_session = False
                await link.close()
            if catch_up is not None:
                catch_up[2].set()
            if not verdict.more:
                break
            if not planned:
                planned = await _send_ahead(link, session, rd, after, arrived)
    except BaseException:
        await _stop_worker(catch_up)
        if rd.received:  # its tokens are committed and delivered: the session's stats count them
            session.end_edge_round(rd, totals(), io(), broken=True)
        raise
    await _stop_worker(catch_up)  # the worker must be off the drafter before anyone touches it
    session.replied_at = time.perf_counter()
    return session.end_edge_round(rd, totals(), io())


async def _send_ahead(link: Link, session: DraftSession, rd: RoundDraft, after: int,
                      arrived: edge_only.Arrivals) -> bool:
    """Send the next round's request while ``rd`` streams, once its remaining tokens take about a
    round trip to arrive (edge_only.send_ahead_lead, from the measured token interval): the edge then
    goes on with it when ``rd`` ends, instead of waiting a round trip for it. True once the next round
    is planned (sent or not)."""
    if arrived.count < 2 or session.edge_rtt_s is None:
        return False  # no interval measured yet
    interval = arrived.interval()
    if rd.settings.edge_tokens - rd.received > edge_only.send_ahead_lead(session.edge_rtt_s, interval):
        return False
    nxt = session.send_ahead(rd, after)
    if nxt is not None:
        nxt.block_bytes = await link.send(run_ahead.stamp(session, nxt))
    return True


def _start_catch_up(session: DraftSession, rd: RoundDraft):
    """While edge-only round ``rd`` streams, time the drafter's forwards (its plan's ``retime``: how
    many, into the round's ``forward_s``) and feed it the tokens it has not seen (its plan's
    ``catch_up``: a drafted round is expected soon; ``shadow``: the same, noting the drafter's greedy
    agreement with each token into the round's ``shadow``); no random number is drawn."""
    choice = rd.plan.choice or {}
    forwards, catch_up, shadow = int(choice.get("retime") or 0), bool(choice.get("catch_up")), bool(choice.get("shadow"))
    if not (forwards or catch_up or shadow):
        return None
    stop, arrived = threading.Event(), threading.Event()

    def work() -> None:
        if forwards:
            rd.forward_s = edge_only.time_drafter(session, stop, arrived, forwards)
        if catch_up or shadow:
            edge_only.catch_up(session, stop, arrived, rd if shadow else None)
    return stop, asyncio.ensure_future(asyncio.to_thread(work)), arrived


def _start_draft_ahead(session: DraftSession, rd: RoundDraft, remaining: int):
    """Plan the next round and draft it in a worker thread while the edge verifies ``rd``."""
    after = remaining - len(rd.block.token_ids) - 1  # tokens still wanted if the guess is right
    if after < 1 or rd.tree is not None:
        return None
    plan = session.plan_ahead(rd)
    if plan is None:
        return None
    stop = threading.Event()
    task = asyncio.ensure_future(asyncio.to_thread(session.draft_ahead, rd, plan, max(1, after - 1), stop))
    return stop, task


async def _stop_worker(worker) -> None:
    """Stop a worker thread started by the round loop (drafting ahead, catching up) and wait for it."""
    if worker is not None:
        stop, task = worker[0], worker[1]
        stop.set()
        if len(worker) > 2:
            worker[2].set()
        await task


async def _dssd_fallback(link: Link, session: DraftSession, rd: RoundDraft,
                         verdict: P.Verdict) -> tuple[int, int, int, int]:
    """All sampled candidates failed: fetch p_j's head and tail samples (the round's
    dssd_fallback_top_k) and rejection-sample the residual locally; if the tail samples run out (or
    the round asked for it), fetch the whole p_j. Returns (token, uplink bytes, downlink bytes,
    round trips)."""
    up = down = trips = 0
    whole = False
    while True:
        up += await link.send(P.ResidualRequest(verdict.round_id, whole=whole))
        residual, size = await link.recv()
        down, trips = down + size, trips + 1
        if not isinstance(residual, P.ResidualReply) or residual.round_id != verdict.round_id:
            raise ProtocolError("expected ResidualReply for the rejected round")
        if whole and residual.is_head:
            raise ProtocolError("asked for the whole p_j, got its head")
        try:
            token = await asyncio.to_thread(session.resolve, rd, verdict, residual)
        except ValueError as e:
            raise ProtocolError(f"malformed ResidualReply: {e}") from None
        if token is not None:
            return token, up, down, trips
        whole = True  # the head's tail samples ran out: one more trip, for the whole p_j


def finished(tokens: list[int], max_new: int, eos_ids) -> bool:
    """Whether a session that delivered ``tokens`` is done: ``max_new`` of them, or one ends it."""
    return len(tokens) >= max_new or (bool(tokens) and tokens[-1] in eos_ids)


def deliverable(delivered: list[int], new: list[int], max_new: int, eos_ids) -> list[int]:
    """What of a round's ``new`` tokens a session that delivered ``delivered`` hands on: nothing once it
    is finished (an edge-only round streams on past a token that ends the session on this side only,
    the device's own end-of-sequence), else :func:`clip_round`."""
    if finished(delivered, max_new, eos_ids):
        return []
    return clip_round(len(delivered), new, max_new, eos_ids)


def clip_round(done: int, new: list[int], max_new: int, eos_ids) -> list[int]:
    """Cut a round's tokens at the first EOS (kept) and at max_new_tokens, ``done`` already delivered."""
    out = []
    for t in new[: max_new - done]:
        out.append(t)
        if t in eos_ids:
            break
    return out
