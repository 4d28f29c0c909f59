"""Three edge-server processes behind a real HAProxy (issue 34), run with deploy/haproxy/haproxy.cfg
as committed; every device dials the proxy only.

- a session whose stream breaks is routed back to the edge that holds it (the stick table on the
  specdec-session header) and resumes with its KV cache;
- a wrong token is refused once, by one edge, and reported as UNAUTHENTICATED every time, never as
  the INTERNAL "Internal error from Core" that a write racing the refusal produces (grpc 36066);
- SIGKILL of the busiest edge with 12 sessions streaming (greedy and T = 1): sessions were spread
  over all three, every one completes with the tokens of its unbroken run, the moved ones
  re-prefilled on another edge;
- SIGTERM (drain) of another: it reports not ready, no session fails, its sessions finish there or
  move, it exits 0.

The tests share one fleet (module fixture) and run in file order: the kill leaves two edges, and
the drain needs only two. The heavier run with 24 sessions (the issue's goal) is marked slow;
``make bench-fleet`` measures it with timings.
"""
from __future__ import annotations

import contextlib
import threading
import time

import grpc
import pytest

from tests.support.fleet_rig import ALICE, MAX_NEW, Proxy, kill_busiest_after, sessions, start_edges, total, unbroken
from tests.support.harness import run
from tests.support.linkcut import CuttableLink
from specdec.device.client import EdgeError
from specdec.device.factory import open_channel

DRAIN_TIMEOUT_S = 1.0     # the drained edge's running sessions: some finish within it, the rest move
WRONG_TOKEN_TRIES = 12    # the write race showed about once in ten tries before the fix
STREAMING = 12            # sessions in flight through the proxy when an edge dies


@contextlib.contextmanager
def proxied_fleet(target_dir, tmp_dir):
    """Three edges (bearer token ALICE) and the proxy in front of them."""
    tokens = tmp_dir / "tokens"
    tokens.write_text(f"{ALICE}\n")
    es = start_edges(target_dir, ["edge1", "edge2", "edge3"], "--auth-token-file", str(tokens),
                     "--drain-timeout", str(DRAIN_TIMEOUT_S), "--workers", "4", "--no-batching")  # fleet_rig.NO_BATCHING
    proxy = None
    try:
        proxy = Proxy(es)
        yield es, proxy
    finally:
        if proxy is not None:
            proxy.stop()
        for e in es:
            e.stop()


@pytest.fixture(scope="module")
def fleet(tiny_pair_v512, tmp_path_factory):
    with proxied_fleet(tiny_pair_v512[0], tmp_path_factory.mktemp("fleet")) as f:
        yield f


def test_a_resume_through_the_proxy_reaches_the_edge_that_holds_the_session(fleet, tiny_pair_v512) -> None:
    es, proxy = fleet
    target_dir, drafter_dir = tiny_pair_v512
    reference = unbroken(target_dir, drafter_dir, [7], [1.0])

    async def main():
        link = await CuttableLink("127.0.0.1", proxy.port).start()
        cut = {"n": 0}

        def on_tokens(new):  # once, mid-session: drop the device's connection to the proxy
            cut["n"] += len(new)
            if cut["n"] >= MAX_NEW // 2 and "done" not in cut:
                cut["done"] = link.cut(0) or True
        try:
            async with open_channel(link.address) as channel:
                before = total(es, "specdec_edge_sessions_resumed_total")
                [r] = await sessions(channel, drafter_dir, [7], [1.0], on_tokens, token=ALICE)
                return r, total(es, "specdec_edge_sessions_resumed_total") - before
        finally:
            await link.close()
    r, resumed = run(main())
    assert not isinstance(r, BaseException), r
    assert r.token_ids == reference[0]
    # The edges' own account goes with a failure: this assertion has failed rarely in CI (a second
    # break, CANCELLED, right after the resume, then a re-prefill), never where the logs could be read.
    if not (r.reconnects == 1 and r.trail.kv_resumes == 1 and r.trail.moves == 0):
        for name, tail in _log_tails(es).items():  # printed: an assertion's message is cut short
            print(f"--- {name}\n{tail}")
    assert r.reconnects == 1 and r.trail.kv_resumes == 1 and r.trail.moves == 0, r.trail
    assert resumed == 1


def _log_tails(es, lines: int = 40) -> dict[str, str]:
    return {e.name: "".join(list(e.log)[-lines:]) for e in es}


def test_a_wrong_token_is_refused_once_and_reported_as_such(fleet, tiny_pair_v512) -> None:
    es, proxy = fleet

    async def main():
        before = total(es, "specdec_edge_sessions_ended_total", {"status": "unauthenticated"})
        async with open_channel(proxy.address) as channel:
            results = [await sessions(channel, tiny_pair_v512[1], [i], [0.0], token="guess")
                       for i in range(WRONG_TOKEN_TRIES)]
        return [r for [r] in results], total(es, "specdec_edge_sessions_ended_total",
                                              {"status": "unauthenticated"}) - before
    results, refused = run(main())
    codes = [r.code if isinstance(r, EdgeError) else r for r in results]
    assert codes == [grpc.StatusCode.UNAUTHENTICATED] * WRONG_TOKEN_TRIES
    assert refused == WRONG_TOKEN_TRIES  # one edge each time: never retried on another


def _kill_run(es, proxy, pair, n: int):
    target_dir, drafter_dir = pair
    seeds, temps = list(range(n)), [0.0, 1.0] * (n // 2)
    reference = unbroken(target_dir, drafter_dir, seeds, temps)
    killed: list = []

    async def main():
        async with open_channel(proxy.address) as channel:
            return await sessions(channel, drafter_dir, seeds, temps,
                                  kill_busiest_after(es, n * MAX_NEW // 4, killed), token=ALICE)
    results = run(main())
    errors = [r for r in results if isinstance(r, BaseException)]  # the sessions' own errors
    assert not errors, errors
    assert [r.token_ids for r in results] == reference  # none lost, repeated or changed, T = 0 and 1
    assert {r.trail.edges[0] for r in results} == {e.name for e in es}  # spread over all three
    [victim] = killed
    assert victim.wait(10) == -9
    moved = [r for r in results if r.trail.moves]
    assert moved and all(r.trail.edges[0] == victim.name and r.trail.reprefills >= 1 for r in moved)
    assert all(victim.name not in r.trail.edges[1:] for r in results)


def test_sigkill_of_the_busiest_edge_loses_no_session(fleet, tiny_pair_v512) -> None:
    es, proxy = fleet
    _kill_run(es, proxy, tiny_pair_v512, STREAMING)


def test_a_draining_edge_fails_no_session(fleet, tiny_pair_v512) -> None:
    es, proxy = fleet
    target_dir, drafter_dir = tiny_pair_v512
    alive = [e for e in es if e.alive()]
    assert len(alive) >= 2
    seeds, temps = list(range(100, 100 + STREAMING)), [1.0, 0.0] * (STREAMING // 2)
    reference = unbroken(target_dir, drafter_dir, seeds, temps)
    state: dict = {"readyz": []}

    def watch_readiness(victim) -> None:  # what a balancer's check sees once SIGTERM arrived
        deadline = time.monotonic() + 5
        while victim.alive() and time.monotonic() < deadline:
            with contextlib.suppress(OSError):
                state["readyz"].append(victim.ready())
            time.sleep(0.05)

    def on_tokens(new):
        state["n"] = state.get("n", 0) + len(new)
        if state["n"] >= STREAMING * MAX_NEW // 4 and "victim" not in state:
            victim = max(alive, key=lambda e: e.value("specdec_edge_sessions_active"))
            state["victim"] = victim
            victim.terminate()
            threading.Thread(target=watch_readiness, args=(victim,), daemon=True).start()

    async def main():
        async with open_channel(proxy.address) as channel:
            results = await sessions(channel, drafter_dir, seeds, temps, on_tokens, token=ALICE)
        return results
    results = run(main())
    victim = state["victim"]
    errors = [r for r in results if isinstance(r, BaseException)]  # the sessions' own errors
    assert not errors, errors
    assert [r.token_ids for r in results] == reference
    assert victim.wait(30) == 0  # a clean exit after its drain
    on_victim = [r for r in results if r.trail.edges[0] == victim.name]
    assert on_victim, "the drained edge ran none of the sessions"
    assert all(r.trail.edges == [victim.name] or r.trail.moves for r in on_victim)
    assert any("edge-server draining" in line for line in victim.log)
    assert (503, '{"status": "not ready", "reason": "draining"}') in state["readyz"]
    assert proxy.wait_for(rf"edges/{victim.name} is DOWN", 10)


@pytest.mark.slow
def test_sigkill_with_24_sessions_in_flight(tiny_pair_v512, tmp_path) -> None:
    """The issue's goal size, on a fleet of its own."""
    with proxied_fleet(tiny_pair_v512[0], tmp_path) as (es, proxy):
        _kill_run(es, proxy, tiny_pair_v512, 24)
