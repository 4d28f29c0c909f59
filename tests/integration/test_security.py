"""TLS, mutual TLS and bearer tokens on a real loopback server, with certificates made in the test;
sessions bound to their creator: nobody else can resume them."""
from __future__ import annotations

import logging

import grpc
import pytest

from tests.support.certs import TestCA
from tests.support.harness import device_config, edge, load, run, run_sessions, target_greedy
from tests.support.raw_stream import RawSession
from specdec.common.modes import Mode
from specdec.common.modeling import encode_prompt
from specdec.device.client import EdgeError
from specdec.edge.metrics import EdgeMetrics
from specdec.edge.server import EdgeConfig, TlsConfig, start_server, stop_server
from specdec.common.modeling import ModelSpec

PROMPT = "w21 w22 w23"
MAX_NEW = 10


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    d = tmp_path_factory.mktemp("pki")
    ca = TestCA(d)
    other_ca = TestCA(d, name="someone else CA")
    return {"ca": ca.pem, "server": ca.issue("edge", server=True), "alice": ca.issue("alice", server=False),
            "mallory": other_ca.issue("mallory", server=False), "dir": d}


def _greedy(pair) -> list[int]:
    tok = load(str(pair[1])).tokenizer
    return target_greedy(pair[0], encode_prompt(tok, PROMPT, raw=True), MAX_NEW)


def _session(pair, edge_kw: dict, **device_kw):
    """Run one greedy session against an edge configured with edge_kw; (tokens or EdgeError, metrics)."""
    metrics = EdgeMetrics()
    cfg = device_config(mode=Mode.TSLT, temperature=0.0, max_new_tokens=MAX_NEW, top_k=16,
                        reconnect_timeout=0, **device_kw)

    async def main():
        async with edge(pair[0], metrics=metrics, **edge_kw) as address:
            try:
                [(tokens, _, _)] = await run_sessions(address, pair[1], cfg, PROMPT, [0])
                return tokens
            except EdgeError as exc:
                return exc

    return run(main()), metrics


def _tls(pki, mutual=False) -> dict:
    return {"tls": TlsConfig(cert=str(pki["server"].cert), key=str(pki["server"].key),
                             client_ca=str(pki["ca"].cert) if mutual else None)}


def test_tls_session_matches_target_and_plaintext_client_is_refused(tiny_pair_v512, pki) -> None:
    out, _ = _session(tiny_pair_v512, _tls(pki), tls_ca=str(pki["ca"].cert))
    assert out == _greedy(tiny_pair_v512)
    out, _ = _session(tiny_pair_v512, _tls(pki))  # no --tls-ca: plaintext against a TLS port
    assert isinstance(out, EdgeError) and out.code == grpc.StatusCode.UNAVAILABLE


def test_mutual_tls_needs_a_client_certificate_from_the_trusted_ca(tiny_pair_v512, pki) -> None:
    ok, _ = _session(tiny_pair_v512, _tls(pki, mutual=True), tls_ca=str(pki["ca"].cert),
                     tls_cert=str(pki["alice"].cert), tls_key=str(pki["alice"].key))
    assert ok == _greedy(tiny_pair_v512)
    for kw in ({}, {"tls_cert": str(pki["mallory"].cert), "tls_key": str(pki["mallory"].key)}):
        out, metrics = _session(tiny_pair_v512, _tls(pki, mutual=True), tls_ca=str(pki["ca"].cert), **kw)
        assert isinstance(out, EdgeError) and out.code == grpc.StatusCode.UNAVAILABLE
        assert metrics.registry.get_sample_value("specdec_edge_sessions_started_total", {"mode": "tslt"}) is None


def test_bearer_token_is_checked_before_any_model_work(tiny_pair_v512, bearer_tokens) -> None:
    edge_kw = {"auth_token_file": str(bearer_tokens / "edge.tokens")}
    ok, _ = _session(tiny_pair_v512, edge_kw, auth_token_file=str(bearer_tokens / "alice.token"))
    assert ok == _greedy(tiny_pair_v512)
    for device_kw in ({}, {"auth_token_file": str(bearer_tokens / "wrong.token")}):
        out, metrics = _session(tiny_pair_v512, edge_kw, **device_kw)
        assert isinstance(out, EdgeError) and out.code == grpc.StatusCode.UNAUTHENTICATED
        # Refused before a session (and its KV cache) existed.
        assert metrics.registry.get_sample_value("specdec_edge_sessions_started_total", {"mode": "tslt"}) is None
        assert metrics.registry.get_sample_value("specdec_edge_sessions_ended_total", {"status": "unauthenticated"}) == 1


async def _open_and_detach(address: str, drafter, metadata):
    """Open a session, then break its stream without Close (as a link cut does); its Welcome."""
    session = await RawSession(address, drafter, metadata).open()
    await session.drop()
    return session.welcome


async def _try_resume(address: str, drafter, metadata, session_id: str, token: bytes) -> grpc.StatusCode:
    """OK if the edge welcomes the resume, else the status it refused it with."""
    session = await RawSession(address, drafter, metadata, resume_session_id=session_id, resume_token=token).open(
        prompt=False)
    await session.channel.close()
    return session.code or grpc.StatusCode.OK


def test_nobody_else_can_resume_a_session(tiny_pair_v512, bearer_tokens) -> None:
    drafter = load(str(tiny_pair_v512[1]))
    alice = (("authorization", "Bearer s3cret-alice"),)
    bob = (("authorization", "Bearer s3cret-bob"),)

    async def main():
        async with edge(tiny_pair_v512[0], auth_token_file=str(bearer_tokens / "edge.tokens")) as address:
            welcome = await _open_and_detach(address, drafter, alice)
            assert len(welcome.session_id) == 32 and len(welcome.resume_token) == 32
            wrong_token = await _try_resume(address, drafter, alice, welcome.session_id, b"x" * 32)
            other_user = await _try_resume(address, drafter, bob, welcome.session_id, welcome.resume_token)
            owner = await _try_resume(address, drafter, alice, welcome.session_id, welcome.resume_token)
            return wrong_token, other_user, owner

    wrong_token, other_user, owner = run(main())
    assert wrong_token == grpc.StatusCode.PERMISSION_DENIED
    assert other_user == grpc.StatusCode.PERMISSION_DENIED
    assert owner == grpc.StatusCode.OK  # the owner gets its Welcome back (resumed)


def test_plaintext_on_a_non_loopback_address_warns(tiny_pair_v512, caplog) -> None:
    cfg = EdgeConfig(model=ModelSpec(model=str(tiny_pair_v512[0])), host="0.0.0.0", port=0)

    async def main():
        server, _ = await start_server(cfg, load(str(tiny_pair_v512[0])))
        await stop_server(server, grace=0)

    with caplog.at_level(logging.WARNING, logger="specdec.edge"):
        run(main())
    assert any("PLAINTEXT" in r.message for r in caplog.records)
