"""Admission on a real loopback edge (issue 19, item 3): a cap on sessions per principal (bearer
token, or the peer's host without auth), a bounded FIFO queue at --max-sessions with a wait limit,
RESOURCE_EXHAUSTED with the limit and its value; refused sessions harm no other session, and
resuming one's own detached session is never refused. Plus the flags and the metrics."""
from __future__ import annotations

import asyncio
import contextlib
import time

import grpc
import pytest

from tests.support.harness import assert_edge_flags_rejected, device_config, edge, load, run, run_sessions, target_greedy
from tests.support.raw_stream import RawSession, wait_for
from specdec.common.modes import Mode
from specdec.common.modeling import ModelSpec, encode_prompt
from specdec.common.protocol import Welcome
from specdec.device.client import EdgeError
from specdec.device.grpc_status import RETRYABLE
from specdec.edge import __main__ as edge_cli
from specdec.edge.admission import Admission, AdmissionRefused, AdmissionSettings
from specdec.edge.auth import admission_principal, peer_host, token_digest
from specdec.edge.metrics import EdgeMetrics
from specdec.edge.server import EdgeConfig, start_server, stop_server
from specdec.edge.verifier import EdgeLimits

PROMPT = "w21 w22 w23"
MAX_NEW = 8
ALICE = (("authorization", "Bearer s3cret-alice"),)
BOB = (("authorization", "Bearer s3cret-bob"),)
ALICE_PRINCIPAL = f"token:{token_digest('s3cret-alice')[:16]}"
EXHAUSTED = grpc.StatusCode.RESOURCE_EXHAUSTED


def _greedy(pair) -> list[int]:
    return target_greedy(pair[0], encode_prompt(load(str(pair[1])).tokenizer, PROMPT, raw=True), MAX_NEW)


def _sample(metrics: EdgeMetrics, name: str, labels: dict | None = None) -> float:
    return metrics.registry.get_sample_value(name, labels or {}) or 0.0


def _device_cfg(**kw):
    return device_config(mode=Mode.TSLT, temperature=0.0, max_new_tokens=MAX_NEW, top_k=16, **kw)


async def _device_session(address, pair, **kw):
    """A whole device-client session (greedy); its tokens, or the EdgeError it ended with."""
    try:
        [(out, _, _)] = await run_sessions(address, pair[1], _device_cfg(**kw), PROMPT, [0])
        return out
    except EdgeError as exc:
        return exc


# -- the per-principal cap --------------------------------------------------------------------------

def test_cap_per_bearer_token_principal(tiny_pair_v512, bearer_tokens) -> None:
    """Alice at her cap of 2 is refused a third session (device client: RESOURCE_EXHAUSTED, the
    principal and the cap in the message, not retried); Bob is not affected, nor are Alice's two,
    and once one of hers closes she gets a session again."""
    drafter = load(str(tiny_pair_v512[1]))
    metrics = EdgeMetrics()

    async def main():
        async with edge(tiny_pair_v512[0], metrics=metrics, auth_token_file=str(bearer_tokens / "edge.tokens"),
                        limits=EdgeLimits(max_sessions=8),
                        admission=AdmissionSettings(max_sessions_per_principal=2)) as address:
            held = [await RawSession(address, drafter, ALICE).open() for _ in range(2)]
            t0 = time.monotonic()
            refused = await _device_session(address, tiny_pair_v512, auth_token_file=str(bearer_tokens / "alice.token"))
            refused_after = time.monotonic() - t0
            raw_refused = await RawSession(address, drafter, ALICE).open()
            bob = await _device_session(address, tiny_pair_v512, auth_token_file=str(bearer_tokens / "bob.token"))
            closed = [await h.close() for h in held[:1]]
            again = await _device_session(address, tiny_pair_v512, auth_token_file=str(bearer_tokens / "alice.token"))
            closed.append(await held[1].close())
            return held, refused, refused_after, raw_refused, bob, closed, again

    held, refused, refused_after, raw_refused, bob, closed, again = run(main())
    assert all(isinstance(h.welcome, Welcome) for h in held)
    assert isinstance(refused, EdgeError) and refused.code == EXHAUSTED
    reason = f"principal '{ALICE_PRINCIPAL}' holds 2 sessions: the limit per principal is 2"
    assert refused.details == reason
    assert refused.reason == "principal_cap"  # machine-readable: a daemon does not read it as a full context
    assert "RESOURCE_EXHAUSTED" in str(refused) and reason in str(refused)  # what device-client prints
    assert EXHAUSTED not in RETRYABLE and refused_after < 5.0  # refused at once, and not retried
    assert (raw_refused.code, raw_refused.details) == (EXHAUSTED, reason)
    assert bob == again == _greedy(tiny_pair_v512)
    assert closed == [grpc.StatusCode.OK] * 2
    assert _sample(metrics, "specdec_edge_admission_rejected_total", {"reason": "principal_cap"}) == 2
    assert _sample(metrics, "specdec_edge_admission_rejected_total", {"reason": "queue_full"}) == 0
    assert _sample(metrics, "specdec_edge_sessions_ended_total", {"status": "resource_exhausted"}) == 2
    assert _sample(metrics, "specdec_edge_sessions_started_total", {"mode": "tslt"}) == 4
    assert _sample(metrics, "specdec_edge_admission_wait_seconds_count") == 4  # admitted at once
    assert _sample(metrics, "specdec_edge_sessions_active") == 0


def test_cap_per_peer_host_without_auth(tiny_pair_v512) -> None:
    """Without authentication the principal is the peer's host, whatever its port: a second
    connection from 127.0.0.1 is refused at the cap of 1, while ::1 (another host) is served."""
    drafter = load(str(tiny_pair_v512[1]))
    metrics = EdgeMetrics()
    cfg = EdgeConfig(model=ModelSpec(model=str(tiny_pair_v512[0])), host="localhost", port=0, workers=2,
                     admission=AdmissionSettings(max_sessions_per_principal=1))

    async def main():
        server, port = await start_server(cfg, load(str(tiny_pair_v512[0])), metrics)  # 127.0.0.1 and ::1
        try:
            v4, v6 = f"127.0.0.1:{port}", f"[::1]:{port}"
            held = await RawSession(v4, drafter).open()
            refused = await _device_session(v4, tiny_pair_v512)  # another connection, another port
            other_host = await _device_session(v6, tiny_pair_v512)
            code = await held.close()
            again = await _device_session(v4, tiny_pair_v512)
            return held, refused, other_host, code, again
        finally:
            await stop_server(server, grace=0)

    held, refused, other_host, code, again = run(main())
    assert isinstance(held.welcome, Welcome)
    assert isinstance(refused, EdgeError) and refused.code == EXHAUSTED
    assert refused.details == "principal 'peer:127.0.0.1' holds 1 session: the limit per principal is 1"
    assert other_host == again == _greedy(tiny_pair_v512)
    assert code == grpc.StatusCode.OK
    assert _sample(metrics, "specdec_edge_admission_rejected_total", {"reason": "principal_cap"}) == 1


def test_resuming_own_detached_session_is_not_refused(tiny_pair_v512, bearer_tokens) -> None:
    """A detached session (stream broken, within the resume window) counts against its principal:
    a new session over the cap is refused, but resuming that session is not."""
    drafter = load(str(tiny_pair_v512[1]))
    metrics = EdgeMetrics()

    async def main():
        async with edge(tiny_pair_v512[0], metrics=metrics, auth_token_file=str(bearer_tokens / "edge.tokens"),
                        admission=AdmissionSettings(max_sessions_per_principal=1)) as address:
            first = await RawSession(address, drafter, ALICE).open()
            await first.drop()  # returns once the edge has seen the break and detached the session
            assert _sample(metrics, "specdec_edge_sessions_active") == 1
            new = await RawSession(address, drafter, ALICE).open()
            resumed = await RawSession(address, drafter, ALICE, resume_session_id=first.welcome.session_id,
                                resume_token=first.welcome.resume_token).open()
            code = await resumed.close()
            after = await RawSession(address, drafter, ALICE).open()  # the resumed session is freed: room again
            after_code = await after.close()
            return first, new, resumed, code, after, after_code

    first, new, resumed, code, after, after_code = run(main())
    assert (new.code, new.details) == (EXHAUSTED, f"principal '{ALICE_PRINCIPAL}' holds 1 session: "
                                                  f"the limit per principal is 1")
    assert resumed.welcome.resumed and resumed.welcome.session_id == first.welcome.session_id
    assert code == after_code == grpc.StatusCode.OK and isinstance(after.welcome, Welcome)
    assert _sample(metrics, "specdec_edge_sessions_resumed_total") == 1


# -- the queue at --max-sessions --------------------------------------------------------------------

def test_queued_session_is_admitted_when_a_slot_frees(tiny_pair_v512) -> None:
    """At --max-sessions 1 with a queue of 1: the next session waits (gauge 1), one more is refused
    at once (queue full); when the holder closes, the waiting session gets the slot and completes
    with the target's own greedy tokens."""
    drafter = load(str(tiny_pair_v512[1]))
    metrics = EdgeMetrics()

    async def main():
        async with edge(tiny_pair_v512[0], metrics=metrics, limits=EdgeLimits(max_sessions=1),
                        admission=AdmissionSettings(max_sessions_per_principal=0, queue=1, wait_s=60)) as address:
            holder = await RawSession(address, drafter).open()
            waiting = asyncio.ensure_future(_device_session(address, tiny_pair_v512))
            await wait_for(lambda: _sample(metrics, "specdec_edge_admission_queued_sessions") == 1)
            t0 = time.monotonic()
            full = await RawSession(address, drafter).open()
            full_after = time.monotonic() - t0
            # still queued after another session was refused: it waits for the slot, not for a timer
            assert not waiting.done() and _sample(metrics, "specdec_edge_admission_queued_sessions") == 1
            seen_waiting = time.monotonic() - t0
            code = await holder.close()
            out = await asyncio.wait_for(waiting, 60)
            return full, full_after, seen_waiting, code, out

    full, full_after, seen_waiting, code, out = run(main())
    assert (full.code, full.details) == (EXHAUSTED, "edge is at its limit of 1 session and its admission "
                                                    "queue of 1 is full")
    assert full_after < 5.0
    assert code == grpc.StatusCode.OK
    assert out == _greedy(tiny_pair_v512)
    assert _sample(metrics, "specdec_edge_admission_rejected_total", {"reason": "queue_full"}) == 1
    assert _sample(metrics, "specdec_edge_admission_queued_sessions") == 0
    assert _sample(metrics, "specdec_edge_admission_wait_seconds_count") == 2
    # the queued one's wait: at least as long as this test saw it queued
    assert _sample(metrics, "specdec_edge_admission_wait_seconds_sum") >= seen_waiting
    assert _sample(metrics, "specdec_edge_admission_wait_seconds_bucket", {"le": "0.001"}) == 1  # holder
    assert _sample(metrics, "specdec_edge_sessions_ended_total", {"status": "ok"}) == 2


def test_queue_wait_expires_and_a_cancelled_waiter_leaves_no_trace(tiny_pair_v512) -> None:
    """A queued session that gets no slot within the wait is refused (queue_timeout); one whose
    device gives up while waiting leaves the queue; neither harms the holder, and the slot it frees
    goes to the next session at once (nothing leaked)."""
    drafter = load(str(tiny_pair_v512[1]))
    metrics = EdgeMetrics()
    wait_s = 0.4

    async def main():
        async with edge(tiny_pair_v512[0], metrics=metrics, limits=EdgeLimits(max_sessions=1),
                        admission=AdmissionSettings(max_sessions_per_principal=0, queue=4,
                                                    wait_s=wait_s)) as address:
            holder = await RawSession(address, drafter).open()
            t0 = time.monotonic()
            timed_out = await RawSession(address, drafter).open()
            waited = time.monotonic() - t0
            quitter = RawSession(address, drafter)
            opening = asyncio.ensure_future(quitter.open())
            await wait_for(lambda: _sample(metrics, "specdec_edge_admission_queued_sessions") == 1)
            await quitter.channel.close()  # the device gives up while queued
            with contextlib.suppress(Exception, asyncio.CancelledError):  # its read was cancelled
                await opening
            await wait_for(lambda: _sample(metrics, "specdec_edge_admission_queued_sessions") == 0)
            code = await holder.close()
            out = await _device_session(address, tiny_pair_v512)
            return timed_out, waited, code, out

    timed_out, waited, code, out = run(main())
    assert (timed_out.code, timed_out.details) == (
        EXHAUSTED, f"edge is at its limit of 1 session and none freed within {wait_s:g} s in the admission queue")
    assert waited >= wait_s
    assert code == grpc.StatusCode.OK and out == _greedy(tiny_pair_v512)
    assert _sample(metrics, "specdec_edge_admission_rejected_total", {"reason": "queue_timeout"}) == 1
    assert _sample(metrics, "specdec_edge_admission_wait_seconds_count") == 2  # holder and the last session
    assert _sample(metrics, "specdec_edge_sessions_active") == 0


# -- the admission controller alone -------------------------------------------------------------------

def test_queue_is_first_come_first_served_and_counts_against_the_cap() -> None:
    async def main():
        adm = Admission(AdmissionSettings(max_sessions_per_principal=2, queue=3, wait_s=30), max_sessions=1)
        holder = await adm.admit("a")
        b1 = asyncio.ensure_future(adm.admit("b"))
        await asyncio.sleep(0)
        c1 = asyncio.ensure_future(adm.admit("c"))
        b2 = asyncio.ensure_future(adm.admit("b"))
        await asyncio.sleep(0)
        with pytest.raises(AdmissionRefused) as capped:  # b holds 0 and waits for 2: at its cap
            await adm.admit("b")
        adm.release(holder)
        adm.release(holder)  # idempotent
        slot_b = await b1
        assert not c1.done() and not b2.done() and adm.in_use == 1
        adm.release(slot_b)
        slot_c = await c1
        c1_cancel = asyncio.ensure_future(adm.admit("c"))
        await asyncio.sleep(0)
        c1_cancel.cancel()
        await asyncio.sleep(0)
        adm.release(slot_c)
        slot_b2 = await b2
        adm.release(slot_b2)
        return capped.value, adm

    capped, adm = run(main())
    assert capped.reason == "principal_cap"
    assert str(capped) == "principal 'b' holds 0 sessions and waits for 2 more: the limit per principal is 2"
    assert adm.in_use == 0 and adm.queued == 0 and not adm.held and not adm.waiting


def test_principal_is_the_identity_or_the_peer_host() -> None:
    assert peer_host("ipv4:10.0.0.7:5123") == "10.0.0.7"
    assert peer_host("ipv6:[::1]:5123") == peer_host("ipv6:%5B::1%5D:5123") == "::1"
    assert peer_host("ipv6:[::ffff:10.0.0.7]:5123") == "10.0.0.7"
    assert admission_principal("anonymous", "ipv4:10.0.0.7:5123") == "peer:10.0.0.7"
    assert admission_principal("token:abc", "ipv4:10.0.0.7:5123") == "token:abc"
    assert admission_principal("cert:alice", "ipv4:10.0.0.7:5123") == "cert:alice"


# -- flags ------------------------------------------------------------------------------------------

def test_flags_derive_from_the_settings_and_bad_values_exit_with_one_line(capsys) -> None:
    default = edge_cli.config_from_args(edge_cli.build_parser().parse_args([]))
    assert default.admission == AdmissionSettings()
    assert default.admission.principal_cap(default.limits.max_sessions) == 32  # half of --max-sessions 64
    assert default.admission.principal_cap(1) == 0  # a one-slot edge: nothing to share, no cap
    cfg = edge_cli.config_from_args(edge_cli.build_parser().parse_args(
        ["--max-sessions-per-principal", "0", "--admission-queue", "0", "--admission-wait-ms", "250"]))
    assert cfg.admission == AdmissionSettings(max_sessions_per_principal=0, queue=0, wait_s=0.25)
    assert_edge_flags_rejected(capsys, (["--max-sessions-per-principal", "-1"], ["--admission-queue", "x"],
                                        ["--admission-wait-ms", "0"], ["--admission-wait-ms", "nan"],
                                        ["--admission-wait-ms", "inf"]))
