"""A device over several edges (issue 34): real grpc.aio edges on loopback, in this process.

- ``--edge A,B,C``: new sessions spread over the edges; an edge that dies mid-stream loses none of
  its sessions: they continue on the others with exactly the tokens of an unbroken run (greedy and
  T = 1 with fixed seeds), re-prefilled; the daemon's requests too.
- ``dns://SERVER/NAME:PORT``: gRPC's own resolver (a DNS server in the test answers two loopback
  addresses) finds both edges, and sessions go on when one of them dies.
- A refusal (wrong token, principal cap, vocabulary) is never retried on another edge; a resume on an
  edge with another target is refused (target_mismatch) and disturbs nobody there; malformed resume
  ids get INVALID_ARGUMENT, an unknown one a fresh session re-prefilled (Welcome.resumed false).

The proxy in front of edge-server processes is test_fleet_proxy.py; the exact law of sessions that
moved is test_fleet_lossless.py.
"""
from __future__ import annotations

import asyncio
import json
import secrets
import socket
import struct
import urllib.request

import grpc
import pytest

from tests.support.fleet_rig import ALICE, MAX_NEW, POLICY, PROMPT, edges, kill_busiest_after, sessions, total, unbroken
from tests.support.harness import device_config, load, run, target_greedy
from tests.support.raw_stream import wait_for
from specdec.common import protocol as P
from specdec.common import wire
from specdec.common.modeling import encode_prompt, vocab_fingerprint
from specdec.common.pb import speculative_pb2_grpc as pb_grpc
from specdec.device.client import EdgeError
from specdec.device.daemon import DaemonConfig, start_daemon
from specdec.device.fleet import Fleet, Selection
from specdec.device.metrics import DeviceMetrics
from specdec.device.factory import edge_fleet, open_channel
from specdec.edge.admission import AdmissionSettings

KILL_AFTER_TOKENS = 8            # per session on average, before the busiest edge dies


@pytest.mark.parametrize("settings", [None, dict(mode="gumbel", draft_len=4)], ids=["tslt", "gumbel"])
def test_sessions_spread_over_edges_and_move_exactly_when_one_dies(tiny_pair_v512, settings) -> None:
    target_dir, drafter_dir = tiny_pair_v512
    seeds, temps = list(range(6)), [0.0, 1.0] * 3
    reference = unbroken(target_dir, drafter_dir, seeds, temps, settings=settings)
    metrics = DeviceMetrics()
    killed: list = []

    async def main():
        async with edges(*[(target_dir, f"edge{i}", {}) for i in range(3)]) as es:
            async with Fleet([e.address for e in es], lambda t, o: open_channel(t, o)) as fleet:
                results = await sessions(fleet, drafter_dir, seeds, temps,
                                         kill_busiest_after(es, KILL_AFTER_TOKENS * len(seeds), killed), metrics=metrics,
                                         settings=settings)
            return results, total(es, "specdec_edge_sessions_reprefilled_total")
    results, reprefilled = run(main())
    errors = [r for r in results if isinstance(r, BaseException)]  # the sessions' own errors
    assert not errors, errors
    assert [r.token_ids for r in results] == reference  # nothing lost, repeated or changed
    assert {r.trail.edges[0] for r in results} == {"edge0", "edge1", "edge2"}  # least loaded: 2 each
    moved = [r for r in results if r.trail.moves]
    assert moved and all(r.trail.edges[0] == killed[0].name and r.trail.reprefills >= 1 for r in moved)
    assert reprefilled == sum(r.trail.reprefills for r in results)
    assert metrics.registry.get_sample_value("specdec_device_fleet_moves_total") == len(moved)
    assert metrics.registry.get_sample_value("specdec_device_fleet_resumes_total", {"kind": "reprefill"}) >= len(moved)


def test_a_refusal_is_never_retried_on_another_edge(tiny_pair_v512, tiny_pair_v8, tmp_path) -> None:
    target_dir, drafter_dir = tiny_pair_v512
    (tmp_path / "tokens").write_text(f"{ALICE}\n")
    edge_kw = {"auth_token_file": str(tmp_path / "tokens"),
               "admission": AdmissionSettings(max_sessions_per_principal=1)}

    async def main():
        async with edges(*[(target_dir, f"edge{i}", edge_kw) for i in range(3)]) as es:
            async with Fleet([e.address for e in es], lambda t, o: open_channel(t, o)) as fleet:
                wrong = await sessions(fleet, drafter_dir, range(5), [0.0] * 5, token="guess")
                vocab = await sessions(fleet, tiny_pair_v8[1], [0], [0.0], token=ALICE)
                holds = [await hold_session(e.address, drafter_dir, ALICE) for e in es]  # each edge at its cap
                capped = await sessions(fleet, drafter_dir, [0], [0.0], token=ALICE)
                for call in holds:
                    call.cancel()
            return wrong, vocab, capped, [
                total(es, "specdec_edge_sessions_ended_total", {"status": s})
                for s in ("unauthenticated", "failed_precondition")] + [
                total(es, "specdec_edge_admission_rejected_total", {"reason": "principal_cap"})]
    wrong, vocab, capped, (unauthenticated, mismatched, over_cap) = run(main())
    assert all(isinstance(e, EdgeError) and e.code is grpc.StatusCode.UNAUTHENTICATED for e in wrong), wrong
    assert isinstance(vocab[0], EdgeError) and vocab[0].code is grpc.StatusCode.FAILED_PRECONDITION
    assert isinstance(capped[0], EdgeError) and capped[0].code is grpc.StatusCode.RESOURCE_EXHAUSTED
    assert capped[0].reason == "principal_cap"
    # Each refused once, by one edge: never tried on the other two.
    assert (unauthenticated, mismatched, over_cap) == (5, 1, 1)


async def hold_session(address: str, drafter_dir, token: str):
    """A session opened (Hello, Welcome, Prompt) and left running: it holds its slot on that edge."""
    drafter = load(str(drafter_dir))
    channel = grpc.aio.insecure_channel(address)
    call = pb_grpc.SpeculativeDecodingStub(channel).Generate(metadata=(("authorization", f"Bearer {token}"),))
    hello = device_config(mode="tslt", top_k=16).hello(vocab_fingerprint(drafter.tokenizer), drafter.vocab_size, seed=0)
    await call.write(wire.hello_to_pb(hello))
    assert (await call.read()).HasField("welcome")
    await call.write(wire.prompt_to_pb(P.Prompt((5, 6, 7))))
    return call


def test_a_resume_on_an_edge_with_another_target_is_refused_and_harms_nobody(tiny_pair_v512) -> None:
    target_dir, drafter_dir = tiny_pair_v512  # the drafter has the same vocabulary, other weights
    killed: list = []

    async def main():
        async with edges((target_dir, "a", {}), (drafter_dir, "b", {})) as es:
            a, b = es
            async with Fleet([a.address, b.address], lambda t, o: open_channel(t, o), Selection.ROUND_ROBIN) as fleet:
                fleet._turn = 0  # the first session starts on a
                moving = sessions(fleet, drafter_dir, [1], [1.0], kill_busiest_after([a], 4, killed))
                async with open_channel(b.address) as direct:
                    bystander = sessions(direct, drafter_dir, [2], [0.0])
                    (moved,), (other,) = await asyncio.gather(moving, bystander)
            # the edge counts the refusal once the device's half-close (after the End) reaches it
            refused = lambda: b.value("specdec_edge_sessions_ended_total", {"status": "failed_precondition"})  # noqa: E731
            await wait_for(lambda: refused() >= 1)
            return moved, other, refused()
    moved, other, refused_on_b = run(main())
    assert isinstance(moved, EdgeError) and moved.code is grpc.StatusCode.FAILED_PRECONDITION, moved
    assert moved.reason == P.TARGET_MISMATCH and "target mismatch" in moved.details
    assert killed and refused_on_b == 1
    greedy_on_b = target_greedy(drafter_dir, encode_prompt(load(str(drafter_dir)).tokenizer, PROMPT, raw=True), MAX_NEW)
    assert other.token_ids == greedy_on_b  # the session already on b carried on undisturbed


def test_resume_ids_malformed_or_unknown_get_a_clear_answer(tiny_pair_v512) -> None:
    target_dir, drafter_dir = tiny_pair_v512
    drafter = load(str(drafter_dir))
    base = device_config(mode="tslt", top_k=16).hello(vocab_fingerprint(drafter.tokenizer), drafter.vocab_size, seed=0)
    token = secrets.token_bytes(32)

    async def first_answer(address, **resume):
        async with grpc.aio.insecure_channel(address) as channel:
            call = pb_grpc.SpeculativeDecodingStub(channel).Generate()
            await call.write(wire.hello_to_pb(P.Hello(**{**base.__dict__, **resume})))
            try:
                msg = await call.read()
            except grpc.aio.AioRpcError as exc:
                return exc.code(), exc.details()
            welcome = wire.edge_message_from_pb(msg)
            await call.write(wire.prompt_to_pb(P.Prompt((5, 6, 7))))
            await call.write(wire.close_to_pb())
            await call.done_writing()
            return await call.code(), welcome

    async def main():
        async with edges((target_dir, "a", {})) as [a]:
            async with open_channel(a.address) as channel:
                bystander = asyncio.ensure_future(sessions(channel, drafter_dir, [0], [0.0]))
                answers = [await first_answer(a.address, resume_session_id=sid, resume_token=tok)
                           for sid, tok in (("../etc", token), ("AB" * 16, token), ("ab" * 16, b"short"),
                                            ("", token), ("ab" * 16, token))]
                return answers, await bystander, a.value("specdec_edge_sessions_reprefilled_total")
    answers, (other,), reprefilled = run(main())
    for code, details in answers[:4]:
        assert code is grpc.StatusCode.INVALID_ARGUMENT and "resume" in details, (code, details)
    code, welcome = answers[4]  # well-formed, unknown here: a new session re-prefills the prefix
    assert code is grpc.StatusCode.OK and not welcome.resumed and welcome.session_id != "ab" * 16
    assert welcome.edge_name == "a" and len(welcome.target_fingerprint) == 64
    assert reprefilled == 1
    assert other.token_ids == target_greedy(target_dir, encode_prompt(drafter.tokenizer, PROMPT, raw=True), MAX_NEW)


class _Dns(asyncio.DatagramProtocol):
    """A DNS server answering A queries for the names it knows (every other query: no records)."""

    def __init__(self, records: dict[str, list[str]]):
        self.records = records

    def connection_made(self, transport):
        self.transport = transport

    def datagram_received(self, data: bytes, addr) -> None:
        query_id, i, labels = data[:2], 12, []
        while data[i]:
            labels.append(data[i + 1:i + 1 + data[i]].decode())
            i += 1 + data[i]
        name, (qtype,) = ".".join(labels).lower(), struct.unpack(">H", data[i + 1:i + 3])
        ips = self.records.get(name, []) if qtype == 1 else []  # 1 = A
        rcode = 0 if name in self.records else 3                 # 3 = NXDOMAIN
        answers = b"".join(struct.pack(">HHHIH", 0xC00C, 1, 1, 30, 4) + socket.inet_aton(ip) for ip in ips)
        header = query_id + struct.pack(">HHHHH", 0x8180 | rcode, 1, len(ips), 0, 0)
        self.transport.sendto(header + data[12:i + 5] + answers, addr)


def test_a_dns_name_with_several_addresses_is_a_fleet(tiny_pair_v512) -> None:
    """gRPC's own resolver: dns://SERVER/NAME:PORT, NAME resolving to two loopback addresses."""
    target_dir, drafter_dir = tiny_pair_v512
    seeds, temps = list(range(4)), [0.0, 1.0] * 2
    reference = unbroken(target_dir, drafter_dir, seeds, temps)
    killed: list = []

    async def main():
        async with edges((target_dir, "first", {"host": "127.0.0.2"})) as [first]:
            port = int(first.address.rpartition(":")[2])
            async with edges((target_dir, "second", {"host": "127.0.0.3", "port": port})) as [second]:
                transport, _ = await asyncio.get_running_loop().create_datagram_endpoint(
                    lambda: _Dns({"fleet.test": ["127.0.0.2", "127.0.0.3"]}), local_addr=("127.0.0.1", 0))
                dns_port = transport.get_extra_info("sockname")[1]
                cfg = device_config(edge=f"dns://127.0.0.1:{dns_port}/fleet.test:{port}")
                try:
                    async with edge_fleet(cfg) as fleet:
                        # One at a time: round_robin alternates over the addresses that are connected.
                        spread = [(await sessions(fleet, drafter_dir, [s], [t]))[0] for s, t in zip(seeds, temps)]
                        survived = await sessions(fleet, drafter_dir, seeds, temps,
                                                  kill_busiest_after([first, second], 8, killed))
                finally:
                    transport.close()
                return spread, survived
    spread, survived = run(main())
    assert {r.trail.edges[0] for r in spread} == {"first", "second"}
    assert [r.token_ids for r in spread] == reference
    errors = [r for r in survived if isinstance(r, BaseException)]  # the sessions' own errors
    assert not errors, errors
    assert [r.token_ids for r in survived] == reference and killed
    assert any(r.trail.moves for r in survived)


def test_daemon_requests_survive_their_edge(tiny_pair_v512) -> None:
    """device-client serve over two edges: a streamed request whose edge dies completes, exactly."""
    target_dir, drafter_dir = tiny_pair_v512
    greedy = target_greedy(target_dir, encode_prompt(load(str(drafter_dir)).tokenizer, PROMPT, raw=True), MAX_NEW)
    text = load(str(drafter_dir)).tokenizer.decode(greedy, skip_special_tokens=True)
    killed: list = []

    async def main():
        async with edges((target_dir, "a", {}), (target_dir, "b", {})) as es:
            cfg = DaemonConfig(device=device_config(edge=",".join(e.address for e in es), draft_model=str(drafter_dir),
                                                    mode="tslt", top_k=16, temperature=0.0, max_new_tokens=MAX_NEW,
                                                    round_timeout=POLICY.round_timeout_s),
                               port=0)
            daemon = await start_daemon(cfg, drafter=load(str(drafter_dir)))
            loop = asyncio.get_running_loop()
            try:
                return await asyncio.to_thread(_stream_completion, daemon.port, es, killed, loop)
            finally:
                await daemon.stop()
    chunks = run(main())
    assert killed and "".join(chunks) == text


def _stream_completion(port: int, es, killed: list, loop) -> list[str]:
    """POST a streamed completion; kill the edge running it after its third chunk."""
    body = json.dumps({"model": "specdec", "prompt": PROMPT, "max_tokens": MAX_NEW, "temperature": 0,
                       "stream": True}).encode()
    request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", body,
                                     {"Content-Type": "application/json"})
    chunks = []
    with urllib.request.urlopen(request, timeout=60) as response:
        for line in response:
            line = line.decode().strip()
            if not line.startswith("data: {"):
                continue
            event = json.loads(line[len("data: "):])
            assert "error" not in event, event
            chunks.append(event["choices"][0]["text"])
            if len(chunks) == 3 and not killed:
                victim = max(es, key=lambda e: e.value("specdec_edge_sessions_active"))
                killed.append(victim)
                asyncio.run_coroutine_threadsafe(victim.kill(), loop)
    return chunks
