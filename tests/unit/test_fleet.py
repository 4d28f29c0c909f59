"""The device's fleet logic without a network: parsing --edge, choosing an edge for a new session,
where a session goes after a failure (device/fleet.py), and what its trail records."""
from __future__ import annotations

import asyncio

import grpc
import pytest

from specdec.common import protocol as P
from specdec.device.client import EdgeError
from specdec.device.grpc_status import retryable
from specdec.device.fleet import (Failover, Fleet, Route, Selection, SessionTrail, is_multi_address,
                                  parse_edges)


class FakeChannel:
    def __init__(self, state=grpc.ChannelConnectivity.READY):
        self.state = state

    def get_state(self, try_to_connect=False):
        return self.state


def fleet_of(n: int, selection=Selection.LEAST_LOADED) -> Fleet:
    fleet = Fleet([f"10.0.0.{i}:50051" for i in range(n)], lambda _t, _o: FakeChannel(), selection)
    fleet._turn = 0  # deterministic start (a real fleet starts at a random edge)
    return fleet


class Policy:  # ConnectionPolicy's backoff and give-up fields, short
    backoff_initial_s = 0.01
    backoff_max_s = 0.02
    reconnect_timeout_s = 5.0


BROKEN = EdgeError(grpc.StatusCode.UNAVAILABLE, "Socket closed")
DRAINING = EdgeError(grpc.StatusCode.UNAVAILABLE, "edge is draining", P.DRAINING)
REFUSED = [EdgeError(grpc.StatusCode.UNAUTHENTICATED, "missing or invalid credentials"),
           EdgeError(grpc.StatusCode.RESOURCE_EXHAUSTED, "principal cap", "principal_cap"),
           EdgeError(grpc.StatusCode.FAILED_PRECONDITION, "vocabulary mismatch"),
           EdgeError(grpc.StatusCode.FAILED_PRECONDITION, "target mismatch", P.TARGET_MISMATCH),
           EdgeError(grpc.StatusCode.INVALID_ARGUMENT, "bad draft"),
           EdgeError(grpc.StatusCode.INTERNAL, "internal error: KeyError")]


@pytest.mark.parametrize("spec, routes", [
    ("edge:50051", ("edge:50051",)),
    ("a:1, b:2,c:3", ("a:1", "b:2", "c:3")),
    ("[::1]:50051,127.0.0.1:50052", ("[::1]:50051", "127.0.0.1:50052")),
    ("dns:///edges.example:50051", ("dns:///edges.example:50051",)),
    ("dns://127.0.0.1:53/edges.example:50051", ("dns://127.0.0.1:53/edges.example:50051",)),
    ("ipv4:10.0.0.1:50051,10.0.0.2:50051", ("ipv4:10.0.0.1:50051,10.0.0.2:50051",)),
])
def test_parse_edges(spec, routes) -> None:
    assert parse_edges(spec) == routes


@pytest.mark.parametrize("spec", ["", "edge", "a:1,b", "a:1,,b:2", "a:99999", "a:1,a:1", ":50051"])
def test_parse_edges_refuses_malformed_lists(spec) -> None:
    with pytest.raises(ValueError):
        parse_edges(spec)


def test_multi_address_targets_get_round_robin_from_grpc() -> None:
    assert is_multi_address("dns:///edges:1") and is_multi_address("ipv4:a:1,b:1")
    assert not is_multi_address("edge:1") and not is_multi_address("unix:/tmp/s")


def test_least_loaded_spreads_new_sessions_and_prefers_the_shorter_queue() -> None:
    fleet = fleet_of(3)
    picked = []
    for _ in range(6):
        route = fleet.pick()
        route.open_sessions += 1
        picked.append(fleet.routes.index(route))
    assert sorted(picked) == [0, 0, 1, 1, 2, 2]
    for route in fleet.routes:
        route.open_sessions = 0
    fleet.routes[0].queue_s, fleet.routes[1].queue_s, fleet.routes[2].queue_s = 0.05, 0.001, 0.02
    assert fleet.pick() is fleet.routes[1]


def test_round_robin_takes_edges_in_turn_whatever_their_load() -> None:
    fleet = fleet_of(3, Selection.ROUND_ROBIN)
    fleet.routes[1].open_sessions = 10
    assert [fleet.routes.index(fleet.pick()) for _ in range(6)] == [0, 1, 2, 0, 1, 2]


def test_failed_and_unconnectable_routes_come_last_but_are_not_lost() -> None:
    fleet = fleet_of(3)
    fleet.failed(fleet.routes[0])
    fleet.routes[1].channel.state = grpc.ChannelConnectivity.TRANSIENT_FAILURE
    assert all(fleet.pick() is fleet.routes[2] for _ in range(3))
    assert fleet.pick(exclude=[fleet.routes[2]]) in fleet.routes[:2]  # nothing better: try anyway
    assert fleet.pick(exclude=fleet.routes) is None
    fleet.succeeded(fleet.routes[0])
    fleet.routes[2].open_sessions = 1
    assert fleet.pick() is fleet.routes[0]


def test_trail_counts_moves_and_resume_kinds() -> None:
    route = Route("proxy:50051", FakeChannel())
    trail = SessionTrail()
    welcome = P.Welcome(session_id="s", model_name="m", vocab_size=8, max_context=64, max_draft_len=4,
                        max_k=8, edge_name="edge1")
    assert trail.welcomed(welcome, route) == ("edge1", None, False)
    assert trail.welcomed(P.Welcome(**{**welcome.__dict__, "resumed": True}), route) == ("edge1", "kv", False)
    assert trail.welcomed(P.Welcome(**{**welcome.__dict__, "edge_name": "edge2"}), route) == ("edge2", "reprefill", True)
    assert trail.welcomed(P.Welcome(**{**welcome.__dict__, "edge_name": ""}), route) == ("proxy:50051", "reprefill", True)
    assert trail.to_json() == {"edges": ["edge1", "edge2", "proxy:50051"], "moves": 2, "kv_resumes": 1,
                               "reprefills": 2}
    assert len(trail.key) == 32 and trail.key != SessionTrail().key


def run(coro):
    return asyncio.run(coro)


@pytest.mark.parametrize("error", REFUSED)
def test_a_refusal_is_never_retried_anywhere(error) -> None:
    fleet = fleet_of(3)
    failover = Failover(fleet, Policy(), retryable)
    with pytest.raises(EdgeError) as raised:
        run(failover.next(fleet.routes[0], error, home=fleet.routes[0], progressed=True))
    assert raised.value is error


def test_a_break_retries_the_edge_holding_the_kv_first_then_moves_without_waiting() -> None:
    fleet = fleet_of(3)
    home = fleet.routes[0]
    failover = Failover(fleet, Policy(), retryable)

    async def main():
        first = await failover.next(home, BROKEN, home=home, progressed=True)
        second = await failover.next(first, BROKEN, home=home, progressed=False)  # the edge is gone
        third = await failover.next(second, BROKEN, home=home, progressed=False)
        return first, second, third
    first, second, third = run(main())
    assert first is home
    assert {second, third} == set(fleet.routes[1:])


def test_a_draining_edge_is_left_at_once_and_avoided() -> None:
    fleet = fleet_of(2)
    failover = Failover(fleet, Policy(), retryable)
    nxt = run(failover.next(fleet.routes[0], DRAINING, home=fleet.routes[0], progressed=True))
    assert nxt is fleet.routes[1]
    assert fleet.pick() is fleet.routes[1] and fleet.pick() is fleet.routes[1]


def test_one_route_a_proxy_is_retried_after_a_drain_since_it_leads_elsewhere() -> None:
    fleet = fleet_of(1)
    failover = Failover(fleet, Policy(), retryable)
    assert run(failover.next(fleet.routes[0], DRAINING, home=None, progressed=False)) is fleet.routes[0]


def test_a_session_that_never_reached_an_edge_fails_once_every_edge_failed() -> None:
    fleet = fleet_of(2)
    failover = Failover(fleet, Policy(), retryable)

    async def main():
        nxt = await failover.next(fleet.routes[0], BROKEN, home=None, progressed=False)
        assert nxt is fleet.routes[1]
        await failover.next(nxt, BROKEN, home=None, progressed=False)
    with pytest.raises(EdgeError, match="Socket closed"):
        run(main())


def test_a_started_session_backs_off_after_every_edge_failed_and_gives_up_in_time() -> None:
    fleet = fleet_of(2)
    policy = Policy()
    policy.reconnect_timeout_s = 0.1
    failover = Failover(fleet, policy, retryable)
    home = fleet.routes[0]

    async def main():
        route, tries = home, 0
        while True:
            route = await failover.next(route, BROKEN, home=home, progressed=False)
            tries += 1
    with pytest.raises(EdgeError, match="gave up reconnecting after 0.1 s"):
        run(main())
