"""Several edges behind one device: which one a session starts on, and where it goes when its edge fails.

``--edge`` names the edges as one of:

- ``HOST:PORT``: one edge, or a proxy in front of several (deploy/haproxy), which picks the edge;
- ``HOST:PORT,HOST:PORT,...``: a fleet the device balances itself, one channel per edge;
- a gRPC target with a scheme, e.g. ``dns:///edges.example:50051`` (every address the name resolves
  to) or ``ipv4:10.0.0.1:50051,10.0.0.2:50051``: gRPC's own resolver finds the edges and its
  ``round_robin`` policy spreads the sessions over them (and re-resolves when one goes away).

Each of these is a :class:`Route`: a channel and what the device knows about it. A new session starts
on the least loaded route (the fewest of this device's sessions, then the shortest queue its edge
reported in its verdicts, then round robin) or, with ``round-robin``, on the next one.

When a session's stream breaks, :class:`Failover` decides where it continues. The edge that holds its
KV cache first (a link blip: the session resumes there with its cache), then the other routes in
load order without waiting; only when every route has failed does it back off. An edge that says it
is draining is not retried. A refusal (bad token, a limit, another vocabulary or target) is final:
the same request would be refused anywhere, so it is never retried elsewhere. Whichever edge
continues the session re-prefills its verified prefix and, since every random number is keyed by
(seed, purpose, position) (:mod:`specdec.common.streams`), produces exactly the tokens the first
edge would have.

Every stream of a session carries the same :data:`~specdec.common.protocol.SESSION_KEY` metadata, so
a proxy can keep the session on the edge that holds its cache (hash or stick on it).
:class:`SessionTrail` records where the session ran and how often it moved.
"""
from __future__ import annotations

import asyncio
import enum
import logging
import random
import secrets
import time
from dataclasses import dataclass, field
from typing import Callable

import grpc

from specdec.common import protocol as P

log = logging.getLogger("specdec.device.fleet")

# Target schemes gRPC resolves itself (one channel, possibly many addresses).
GRPC_SCHEMES = ("dns", "ipv4", "ipv6", "unix", "unix-abstract")
# A channel over several resolved addresses spreads calls over all of them (the default policy,
# pick_first, would put every session on the first address).
MULTI_ADDRESS_OPTIONS = (("grpc.lb_policy_name", "round_robin"),)
# A route whose stream failed is avoided by new sessions for this long (a session already on it still
# retries it first: its KV cache is there). A draining edge stops within its drain time; by then its
# sessions have moved and it is gone from the fleet or back after a restart.
FAILED_COOLDOWN_S = 5.0
DRAINING_COOLDOWN_S = 60.0
# Weight of the newest queue time an edge reports in the route's running average.
QUEUE_EWMA_WEIGHT = 0.2
SESSION_KEY_BYTES = 16


class Selection(str, enum.Enum):
    LEAST_LOADED = "least-loaded"
    ROUND_ROBIN = "round-robin"


def parse_edges(spec: str) -> tuple[str, ...]:
    """The routes ``--edge`` names (see the module docstring); ValueError with the reason if malformed."""
    spec = spec.strip()
    if not spec:
        raise ValueError("no edge given")
    scheme, colon, _ = spec.partition(":")
    if colon and scheme in GRPC_SCHEMES:
        return (spec,)
    routes = tuple(part.strip() for part in spec.split(","))
    for route in routes:
        host, sep, port = route.rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(f"expected HOST:PORT[,HOST:PORT...] or a gRPC target such as dns:///NAME:PORT, "
                             f"got {route!r} in {spec!r}")
    if len(set(routes)) != len(routes):
        raise ValueError(f"an edge is named twice in {spec!r}")
    return routes


def is_multi_address(target: str) -> bool:
    """A target gRPC may resolve to several addresses (a scheme other than unix)."""
    scheme = target.partition(":")[0]
    return scheme in ("dns", "ipv4", "ipv6")


@dataclass(eq=False)
class Route:
    """One channel of the fleet and what this device knows about the edge(s) behind it."""
    target: str
    channel: grpc.aio.Channel
    open_sessions: int = 0      # this device's streams on it now
    queue_s: float = 0.0        # running average of the queue time its edge reports in verdicts
    avoid_until: float = 0.0    # time.monotonic(): new sessions avoid it until then (it failed / drains)

    def usable(self, now: float) -> bool:
        if now < self.avoid_until:
            return False
        return self.channel.get_state(try_to_connect=False) is not grpc.ChannelConnectivity.TRANSIENT_FAILURE

    def observe_queue(self, seconds: float) -> None:
        self.queue_s += QUEUE_EWMA_WEIGHT * (seconds - self.queue_s)


class Fleet:
    """The routes of one device (or daemon), shared by all its sessions. Create inside a coroutine
    (channels are); ``async with`` closes the channels it opened."""

    def __init__(self, targets: tuple[str, ...] | list[str], open_channel: Callable[[str, tuple], grpc.aio.Channel],
                 selection: Selection = Selection.LEAST_LOADED):
        if not targets:
            raise ValueError("a fleet needs at least one edge")
        self.routes = [Route(t, open_channel(t, MULTI_ADDRESS_OPTIONS if is_multi_address(t) else ()))
                       for t in targets]
        self.selection = Selection(selection)
        self._owned = True
        # Devices started together must not all begin with the first edge.
        self._turn = random.randrange(len(self.routes))

    @classmethod
    def of_channel(cls, channel: grpc.aio.Channel, target: str = "edge") -> "Fleet":
        """One route over a channel the caller owns (and closes)."""
        fleet = cls([target], lambda _t, _o: channel)
        fleet._owned = False
        return fleet

    async def __aenter__(self) -> "Fleet":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    async def close(self, grace: float | None = None) -> None:
        if self._owned:
            for route in self.routes:
                await route.channel.close(grace)

    def pick(self, exclude=()) -> Route | None:
        """The route for a new stream, or None when every route is excluded. Routes that failed
        lately (or whose channel cannot connect) come last, but are still taken if nothing else is."""
        candidates = [r for r in self.routes if r not in exclude]
        if not candidates:
            return None
        now = time.monotonic()
        usable = [r for r in candidates if r.usable(now)] or candidates
        order = {id(r): (i - self._turn) % len(self.routes) for i, r in enumerate(self.routes)}
        if self.selection is Selection.ROUND_ROBIN:
            chosen = min(usable, key=lambda r: order[id(r)])
        else:
            chosen = min(usable, key=lambda r: (r.open_sessions, round(r.queue_s, 3), order[id(r)]))
        self._turn = (self.routes.index(chosen) + 1) % len(self.routes)
        return chosen

    def failed(self, route: Route, draining: bool = False) -> None:
        cooldown = DRAINING_COOLDOWN_S if draining else FAILED_COOLDOWN_S
        route.avoid_until = max(route.avoid_until, time.monotonic() + cooldown)

    def succeeded(self, route: Route) -> None:
        route.avoid_until = 0.0

    async def ready(self, timeout: float) -> bool:
        """Whether any route connects within ``timeout`` seconds."""
        waits = [asyncio.ensure_future(r.channel.channel_ready()) for r in self.routes]
        try:
            done, _ = await asyncio.wait(waits, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
            return any(not w.cancelled() and w.exception() is None for w in done)
        finally:
            for w in waits:
                w.cancel()

    def states(self) -> dict[str, str]:
        return {r.target: r.channel.get_state(try_to_connect=False).name for r in self.routes}


RESUME_KV = "kv"                # the edge still held the session: its KV cache was reused
RESUME_REPREFILL = "reprefill"  # a new session on that edge, re-prefilled from the verified prefix
RESUME_KINDS = (RESUME_KV, RESUME_REPREFILL)


@dataclass
class SessionTrail:
    """Where a session ran: the edges in order, moves between them and how each resume went."""
    key: str = field(default_factory=lambda: secrets.token_hex(SESSION_KEY_BYTES))  # P.SESSION_KEY
    edges: list[str] = field(default_factory=list)  # each edge it ran on, in order (a move appends)
    moves: int = 0                # times it continued on another edge than the one before
    kv_resumes: int = 0           # resumes on an edge that still held it (KV cache reused)
    reprefills: int = 0           # resumes that started over on an edge (re-prefilling the prefix)
    welcomes: list[tuple[float, str]] = field(default_factory=list)  # (time.monotonic(), edge) per stream

    def welcomed(self, welcome: P.Welcome, route: Route) -> tuple[str, str | None, bool]:
        """Record a Welcome; returns (edge, resume kind or None for the first stream, moved)."""
        edge = welcome.edge_name or route.target
        self.welcomes.append((time.monotonic(), edge))
        if not self.edges:
            self.edges.append(edge)
            return edge, None, False
        kind = RESUME_KV if welcome.resumed else RESUME_REPREFILL
        if welcome.resumed:
            self.kv_resumes += 1
        else:
            self.reprefills += 1
        moved = edge != self.edges[-1]
        if moved:
            self.moves += 1
            self.edges.append(edge)
        return edge, kind, moved

    def to_json(self) -> dict:
        return {"edges": list(self.edges), "moves": self.moves, "kv_resumes": self.kv_resumes,
                "reprefills": self.reprefills}


class Failover:
    """Where the next stream of one session goes after a failure (see the module docstring).

    ``retryable(error)`` says whether an error is the edge or the link failing rather than a
    refusal. The policy gives the backoff and how long to keep trying without progress."""

    def __init__(self, fleet: Fleet, policy, retryable: Callable[[Exception], bool]):
        self.fleet = fleet
        self.policy = policy
        self.retryable = retryable
        self.tried: list[Route] = []     # routes that failed since the session last made progress
        self.backoff = policy.backoff_initial_s
        self.give_up_at: float | None = None

    async def next(self, route: Route, error, *, home: Route | None, progressed: bool) -> Route:
        """The route to try after ``error`` on ``route``; raises ``error`` when giving up.

        ``home``: the route whose edge holds the session (None before its first Welcome);
        ``progressed``: tokens were delivered since the last failure (the stream that failed
        worked for a while: its break is a fresh failure, and its edge may hold the KV cache)."""
        if not self.retryable(error):
            raise error  # a refusal: any edge would refuse it the same way
        if progressed:
            self.tried.clear()
            self.backoff = self.policy.backoff_initial_s
            self.give_up_at = None
        draining = getattr(error, "reason", "") == P.DRAINING
        self.fleet.failed(route, draining)
        now = time.monotonic()
        self.give_up_at = self.give_up_at or now + self.policy.reconnect_timeout_s
        if now >= self.give_up_at:
            raise type(error)(error.code, f"{error.details} (gave up reconnecting after "
                                          f"{self.policy.reconnect_timeout_s:g} s)", error.reason)
        if progressed and not draining:
            return route  # a break: the edge may well be alive and still hold the KV cache
        self.tried.append(route)
        nxt = self.fleet.pick(exclude=self.tried)
        if nxt is None and draining and self.tried.count(route) == 1:
            nxt = route  # one route (a proxy): through it, another edge
        if nxt is not None:
            return nxt
        if home is None and not draining:
            raise error  # never reached any edge: nothing to resume, and nowhere else to try
        await asyncio.sleep(min(self.backoff, max(0.0, self.give_up_at - time.monotonic())))
        self.backoff = min(self.backoff * 2, self.policy.backoff_max_s)
        self.tried.clear()
        return home if home is not None and not draining else self.fleet.pick()
