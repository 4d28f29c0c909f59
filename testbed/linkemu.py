"""Userspace link emulator: an asyncio TCP proxy that shapes each direction like a slow link.

For kernels without ``netem`` (this project's machines) and for users without root: it sits
between the device and the edge, accepts the device's connections and forwards each to the edge.
Each direction is a FIFO link (:class:`LinkClock`): serialization at ``rate``, then a one-way
``delay`` with uniform ``jitter`` (netem's default distribution), and never a reordering, since
the payload is a TCP byte stream.

Loss cannot be emulated by dropping bytes: TCP below us would not retransmit them and the stream
would be corrupt. What a lost segment costs a TCP connection is time, so a lost segment (one of
``MSS_BYTES`` of a chunk, each lost with probability ``loss``) delays its chunk, and by FIFO order
everything behind it, by one retransmission timeout ``rto`` (Linux's minimum RTO, 200 ms, is the
default: short request/response rounds rarely carry enough segments behind a loss for fast
retransmit). That models head-of-line blocking, not congestion control's reaction to loss.

Recorded links: ``--up-trace`` / ``--down-trace`` take a Mahimahi trace each (testbed/traces.py: one
line per millisecond at which one 1500-byte packet may cross, repeated at its end), which then sets
that direction's capacity in place of ``rate``; the delay, jitter and loss apply on top, and
``--trace-offset`` starts both traces that far in. A drop-tail queue limit (``--up-queue 150kb`` or
``100pkt``) drops what a burst brings beyond it, each dropped segment costing its stream one
timeout as a lost one does (see :class:`LinkClock`); without a limit the queue only holds
QUEUE_LIMIT_BYTES before the emulator stops reading (back-pressure, as a sender's buffer).

Usage (no root): ``python -m specdec.testbed.linkemu --listen 127.0.0.1:7000 --connect 127.0.0.1:50051
--up-rate 1mbit --up-delay 20ms --down-delay 20ms`` and point the device at 127.0.0.1:7000.

Live changes: with ``--control HOST:PORT`` (or ``--control unix:PATH``, which a process in another
network namespace can reach) the emulator also accepts control connections. Each line sent there is
one JSON object ``{"uplink": {...}, "downlink": {...}}`` whose directions (either may be left out)
replace that direction's :class:`LinkSpec` (fields ``rate_bps``, ``delay_s``, ``jitter_s``, ``loss``,
``rto_s``, ``trace``, ``trace_offset_s``, ``queue_bytes``, ``queue_packets``; missing fields take
their defaults) for every open connection and every later one, without dropping a connection. A
direction given a trace (re)starts it at its ``trace_offset_s`` when the line is applied. Bytes
already inside the link keep the release time they were given; bytes read after the change see the
new link (and, FIFO, never overtake the earlier ones). Each line gets one JSON line back:
``{"ok": true, "uplink": {...}, "downlink": {...}, "connections": N, "applied_wall": T, "idle_in_s": I}``
(T: the ``time.time()`` at which the change took effect, where a trace's offset falls; I: seconds until
the last byte already inside the link leaves it, either direction, 0 when it is empty: bytes read later
queue behind those, so a client that wants a fresh link for a new session waits that long first), or
``{"ok": false, "error": "..."}``; ``{}`` only asks for the current specs. :func:`send_control`
is the client. The control line ``linkemu control on ADDRESS`` is printed before the ready line.
"""
from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import json
import random
import socket
import sys
import time
from dataclasses import asdict, dataclass, fields

from specdec.common.runtime import OneLineParser
from specdec.testbed.traces import PACKET_BYTES, load_trace
from specdec.testbed.units import argtype, parse_address, parse_percent, parse_queue, parse_rate, parse_time

MSS_BYTES = 1448            # TCP payload per Ethernet frame (1500 MTU - 40 IP/TCP - 12 timestamps)
HEADER_BYTES = PACKET_BYTES - MSS_BYTES  # what a segment adds to its payload in a trace's packet
LINUX_MIN_RTO_S = 0.2       # TCP_RTO_MIN: the least a timeout retransmission costs on Linux
# Read size: one chunk leaves the link at once, so it is the shaping granularity (4 KiB at
# 1 Mbit/s is 33 ms); small enough for smooth rates, large enough for Python at 100 Mbit/s.
CHUNK_BYTES = 4096
# Bytes a direction may hold in flight before it stops reading (back-pressure to the sender, as a
# router's buffer): 4 MiB covers the bandwidth-delay product of 100 Mbit/s x 300 ms.
QUEUE_LIMIT_BYTES = 4 * 1024 * 1024
CONNECT_TIMEOUT_S = 10.0


@dataclass(frozen=True)
class LinkSpec:
    """One direction of a link; zeros (and no trace) mean "not shaped"."""
    rate_bps: float = 0.0     # bits per second; 0 = unlimited (a trace, if given, sets the capacity instead)
    delay_s: float = 0.0      # one-way propagation delay
    jitter_s: float = 0.0     # delay varies uniformly in [delay - jitter, delay + jitter]
    loss: float = 0.0         # probability that a segment of MSS_BYTES is lost
    rto_s: float = LINUX_MIN_RTO_S  # what one lost (or dropped) segment costs
    trace: str = ""           # a Mahimahi trace file: the capacity, one packet per listed millisecond
    trace_offset_s: float = 0.0  # where in the trace the link starts when this spec is applied
    queue_bytes: float = 0.0  # drop-tail limit of the bottleneck's queue in bytes; 0 = none
    queue_packets: float = 0.0  # ... and in packets; 0 = none

    def __post_init__(self):
        if min(self.rate_bps, self.delay_s, self.jitter_s, self.rto_s, self.trace_offset_s, self.queue_bytes,
               self.queue_packets) < 0 or not 0 <= self.loss < 1:
            raise ValueError(f"invalid link: {self}")
        if not isinstance(self.trace, str):
            raise ValueError(f"invalid link: trace must be a path, got {self.trace!r}")

    @property
    def delays(self) -> bool:
        """Whether this direction needs the emulator, not just a rate limit in the kernel."""
        return bool(self.delay_s or self.jitter_s or self.loss or self.trace or self.queue_bytes
                    or self.queue_packets)

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, obj: dict) -> "LinkSpec":
        """From a control message's direction; unknown fields and bad values are a ValueError."""
        if not isinstance(obj, dict):
            raise ValueError(f"a link direction must be a JSON object, got {obj!r}")
        names = {f.name for f in fields(cls)}
        unknown = set(obj) - names
        if unknown:
            raise ValueError(f"unknown link fields {sorted(unknown)} (known: {sorted(names)})")
        try:
            return cls(**{k: (str(v) if k == "trace" else float(v)) for k, v in obj.items()})
        except (TypeError, ValueError) as exc:
            raise ValueError(f"invalid link {obj!r}: {exc}") from None


def segments(nbytes: int) -> list[int]:
    """The TCP segments a chunk of ``nbytes`` payload bytes crossed the bottleneck in."""
    full, rest = divmod(nbytes, MSS_BYTES)
    return [MSS_BYTES] * full + ([rest] if rest else [])


class LinkClock:
    """When each chunk written into one direction of the link comes out. Pure: time is passed in.

    The bottleneck is a FIFO queue served either at ``rate_bps`` (payload bytes) or by a trace's
    delivery opportunities (:mod:`specdec.testbed.traces`: each carries PACKET_BYTES of packets,
    a segment being its payload plus HEADER_BYTES, a partly used opportunity serving the next
    packet in the same millisecond, as Mahimahi does). A drop-tail limit (``queue_bytes`` /
    ``queue_packets``) drops the segments that find the queue full; TCP sends each again after
    ``rto_s``, so its chunk, and by FIFO order everything behind it, waits for that copy, which
    queues again when it is sent. Then the one-way delay with jitter, and the random loss."""

    def __init__(self, spec: LinkSpec, rng: random.Random, trace_origin: float = 0.0):
        self.rng = rng
        self.busy_until = 0.0    # the sender side is serializing until then (rate links)
        self.last_release = 0.0  # the byte stream leaves in order
        self.queue: collections.deque = collections.deque()  # (departure, bytes, packets) still queued
        self.queued_bytes, self.queued_packets = 0, 0
        self.resend: collections.deque = collections.deque()  # (time, size) of dropped segments sent again
        self.dropped = 0         # segments dropped at the queue so far
        self.set_spec(spec, trace_origin)

    def set_spec(self, spec: LinkSpec, trace_origin: float = 0.0) -> None:
        """Serve later bytes by ``spec``; a trace's position 0 is at ``trace_origin`` (monotonic s).
        Bytes already queued keep their times."""
        self.busy_until = max(self.busy_until, self._trace_busy_until())
        self.spec = spec
        self.trace = load_trace(spec.trace) if spec.trace else None
        self.origin = trace_origin
        self.last_opportunity, self.left = -1, 0  # trace: the last opportunity used, bytes left in it
        self._first_opportunity = None

    def release_time(self, nbytes: int, now: float) -> float:
        s = self.spec
        self._resend_due(now)
        self._forget_departed(now)
        admitted, dropped = self._admit(segments(nbytes))
        departure = self._serve(now, admitted) if admitted else now
        if dropped:  # each is sent again after a timeout and queues again; the stream waits for them
            self.resend.append((now + s.rto_s, dropped))
            self.dropped += len(dropped)
            departure = max(departure, self._peek_serve(now + s.rto_s, dropped))
        delay = s.delay_s + (self.rng.uniform(-s.jitter_s, s.jitter_s) if s.jitter_s else 0.0)
        lost = self._lost_segments(sum(admitted))
        release = departure + max(0.0, delay) + lost * s.rto_s
        self.last_release = max(release, self.last_release)
        return self.last_release

    def _lost_segments(self, nbytes: int) -> int:
        if not self.spec.loss:
            return 0
        return sum(self.rng.random() < self.spec.loss for _ in segments(nbytes))

    # -- the queue -------------------------------------------------------------------------------
    def _size(self, payload: int) -> int:
        """What a segment occupies on the bottleneck: its packet on a trace, its payload at a rate."""
        return payload + HEADER_BYTES if self.trace is not None else payload

    def _forget_departed(self, now: float) -> None:
        while self.queue and self.queue[0][0] <= now:
            _, b, p = self.queue.popleft()
            self.queued_bytes -= b
            self.queued_packets -= p

    def _admit(self, segs: list[int]) -> tuple[list[int], list[int]]:
        """(segments queued, segments dropped) by the drop-tail limits."""
        s = self.spec
        admitted, dropped = [], []
        b, p = self.queued_bytes, self.queued_packets
        for seg in segs:
            size = self._size(seg)
            if (s.queue_bytes and b + size > s.queue_bytes) or (s.queue_packets and p + 1 > s.queue_packets):
                dropped.append(seg)
                continue
            admitted.append(seg)
            b, p = b + size, p + 1
        return admitted, dropped

    def _serve(self, arrival: float, segs: list[int]) -> float:
        """Queue ``segs`` arriving at ``arrival``: when the last of them has crossed."""
        size = sum(self._size(x) for x in segs)
        if self.trace is not None:
            departure = self._trace_serve(arrival, size)
        else:
            self.busy_until = max(arrival, self.busy_until) + (size * 8 / self.spec.rate_bps if self.spec.rate_bps
                                                               else 0.0)
            departure = self.busy_until
        self.queue.append((departure, size, len(segs)))
        self.queued_bytes += size
        self.queued_packets += len(segs)
        return departure

    def _peek_serve(self, arrival: float, segs: list[int]) -> float:
        """When ``segs`` would cross if they arrived at ``arrival`` behind what is queued now."""
        state = (self.busy_until, self.last_opportunity, self.left, self.queued_bytes, self.queued_packets)
        departure = self._serve(arrival, segs)
        self.queue.pop()
        self.busy_until, self.last_opportunity, self.left, self.queued_bytes, self.queued_packets = state
        return departure

    def _resend_due(self, now: float) -> None:
        """Dropped segments sent again by now join the queue (they take capacity like any other)."""
        while self.resend and self.resend[0][0] <= now:
            at, segs = self.resend.popleft()
            self._serve(at, segs)

    # -- a trace's opportunities -------------------------------------------------------------------
    def _trace_serve(self, arrival: float, size: int) -> float:
        """Serve ``size`` bytes of packets from the trace's opportunities at or after ``arrival``."""
        t = self.trace
        first = t.first_at_or_after((arrival - self.origin) * 1e3)
        need = size
        if self.last_opportunity >= first and self.left > 0:  # the packets before left room in it
            used = min(self.left, need)
            self.left -= used
            need -= used
        if need:
            start = max(first, self.last_opportunity + 1)
            n = -(-need // PACKET_BYTES)
            self.last_opportunity = start + n - 1
            self.left = n * PACKET_BYTES - need
        return self.origin + t.opportunity_ms(self.last_opportunity) / 1e3

    def _trace_busy_until(self) -> float:
        if getattr(self, "trace", None) is None or self.last_opportunity < 0:
            return 0.0
        return self.origin + self.trace.opportunity_ms(self.last_opportunity) / 1e3


class _Direction:
    """One direction of one connection: read, stamp with the link clock, write out on time.

    The clock's spec may be replaced at any time (a live change, ``clock.set_spec``): the next
    chunk read uses it."""

    def __init__(self, reader, writer, spec: LinkSpec, rng: random.Random, trace_origin: float = 0.0):
        self.reader, self.writer = reader, writer
        self.clock = LinkClock(spec, rng, trace_origin)
        self.queue: asyncio.Queue = asyncio.Queue()
        self.queued = 0
        self.room = asyncio.Event()
        self.room.set()

    async def pump_in(self) -> None:
        while data := await self.reader.read(CHUNK_BYTES):
            await self.room.wait()
            self.queued += len(data)
            if self.queued >= QUEUE_LIMIT_BYTES:
                self.room.clear()
            self.queue.put_nowait((self.clock.release_time(len(data), time.monotonic()), data))
        self.queue.put_nowait(None)

    async def pump_out(self) -> None:
        while (item := await self.queue.get()) is not None:
            release, data = item
            await asyncio.sleep(max(0.0, release - time.monotonic()))
            self.writer.write(data)
            await self.writer.drain()
            self.queued -= len(data)
            if self.queued < QUEUE_LIMIT_BYTES:
                self.room.set()
        if self.writer.can_write_eof():
            self.writer.write_eof()  # half-close: the peer sees the end of this direction

    async def run(self) -> None:
        await asyncio.gather(self.pump_in(), self.pump_out())


class LinkEmulator:
    """Accepts on ``listen``, connects each connection to ``upstream``, shapes both directions."""

    def __init__(self, upstream: tuple[str, int], uplink: LinkSpec, downlink: LinkSpec, seed: int = 0):
        self.upstream = upstream
        self.rng = random.Random(seed)  # seeded: a run's jitter and losses are reproducible
        self.server: asyncio.AbstractServer | None = None
        self.control_server: asyncio.AbstractServer | None = None
        self._live: set[tuple[_Direction, _Direction]] = set()  # (uplink, downlink) of open connections
        self.applied_wall = 0.0
        self.set_specs(uplink, downlink)

    def set_specs(self, uplink: LinkSpec | None = None, downlink: LinkSpec | None = None) -> None:
        """Change the link now, for open connections and later ones (None keeps that direction). A
        direction given a trace starts it now at its ``trace_offset_s`` (again, if it had it already)."""
        now = time.monotonic()
        self.applied_wall = time.time()
        for spec in (uplink, downlink):
            if spec is not None and spec.trace:
                load_trace(spec.trace)  # a bad trace fails here, before anything changes
        if uplink is not None:
            self.uplink, self.up_origin = uplink, now - uplink.trace_offset_s
        if downlink is not None:
            self.downlink, self.down_origin = downlink, now - downlink.trace_offset_s
        for up, down in self._live:
            if uplink is not None:
                up.clock.set_spec(self.uplink, self.up_origin)
            if downlink is not None:
                down.clock.set_spec(self.downlink, self.down_origin)

    def apply_control(self, message: dict) -> dict:
        """One control message (see the module doc) applied; the reply. ValueError if invalid."""
        if not isinstance(message, dict) or set(message) - {"uplink", "downlink"}:
            raise ValueError('expected {"uplink": {...}, "downlink": {...}}')
        up = LinkSpec.from_json(message["uplink"]) if "uplink" in message else None
        down = LinkSpec.from_json(message["downlink"]) if "downlink" in message else None
        self.set_specs(up, down)  # both parsed and their traces read before either is applied
        return {"ok": True, "uplink": self.uplink.to_json(), "downlink": self.downlink.to_json(),
                "connections": len(self._live), "applied_wall": self.applied_wall, "idle_in_s": self.idle_in_s()}

    def idle_in_s(self) -> float:
        """Seconds until every byte already inside the link (any connection, either direction) has left it."""
        now = time.monotonic()
        last = max((d.clock.last_release for pair in self._live for d in pair), default=now)
        return max(0.0, last - now)

    async def start_control(self, address: str) -> str:
        """Listen for control connections on ``HOST:PORT`` or ``unix:PATH``; the address bound."""
        if address.startswith("unix:"):
            path = address[len("unix:"):]
            self.control_server = await asyncio.start_unix_server(self._control, path)
            return address
        host, port = parse_address(address)
        self.control_server = await asyncio.start_server(self._control, host, port)
        return f"{host}:{self.control_server.sockets[0].getsockname()[1]}"

    async def _control(self, reader, writer) -> None:
        try:
            while line := await reader.readline():
                if not line.strip():
                    continue
                try:
                    reply = self.apply_control(json.loads(line))
                except ValueError as exc:  # JSONDecodeError is one too
                    reply = {"ok": False, "error": str(exc)}
                writer.write((json.dumps(reply) + "\n").encode())
                await writer.drain()
        except (ConnectionError, OSError):
            pass
        finally:
            writer.close()

    async def start(self, host: str = "127.0.0.1", port: int = 0) -> int:
        self.server = await asyncio.start_server(self._handle, host, port)
        return self.server.sockets[0].getsockname()[1]

    async def _handle(self, client_reader, client_writer) -> None:
        try:
            up_reader, up_writer = await asyncio.wait_for(asyncio.open_connection(*self.upstream),
                                                          CONNECT_TIMEOUT_S)
        except (OSError, asyncio.TimeoutError):
            client_writer.close()
            return
        directions = (_Direction(client_reader, up_writer, self.uplink, self.rng, self.up_origin),
                      _Direction(up_reader, client_writer, self.downlink, self.rng, self.down_origin))
        self._live.add(directions)
        try:
            await asyncio.gather(*(d.run() for d in directions))
        except (ConnectionError, OSError):
            pass  # one side vanished: close both, as a cut link would
        except asyncio.CancelledError:
            pass  # the loop shuts down with bytes still in the link: end as a cut link (a cancelled
                  # handler task makes Python 3.11's stream server log a traceback)
        finally:
            self._live.discard(directions)
            for w in (client_writer, up_writer):
                w.close()

    async def close(self) -> None:
        for server in (self.server, self.control_server):
            if server is not None:
                server.close()
                await server.wait_closed()


def send_control(address: str, message: dict, timeout: float = CONNECT_TIMEOUT_S) -> dict:
    """Send one control message to an emulator's ``--control`` address (``HOST:PORT`` or
    ``unix:PATH``) and return its reply; RuntimeError if the emulator refused the message."""
    if address.startswith("unix:"):
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(timeout)
        target = address[len("unix:"):]
    else:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.settimeout(timeout)
        target = parse_address(address)
    with contextlib.closing(sock):
        sock.connect(target)
        sock.sendall((json.dumps(message) + "\n").encode())
        buf = b""
        while not buf.endswith(b"\n"):
            chunk = sock.recv(4096)
            if not chunk:
                raise ConnectionError("the emulator closed the control connection without a reply")
            buf += chunk
    reply = json.loads(buf)
    if not reply.get("ok"):
        raise RuntimeError(f"linkemu refused the change: {reply.get('error')}")
    return reply


# -- command line ---------------------------------------------------------------------------------

def build_parser() -> argparse.ArgumentParser:
    p = OneLineParser(prog="python -m specdec.testbed.linkemu", description="userspace link emulator (TCP proxy)")
    p.add_argument("--listen", type=argtype(parse_address), default=("127.0.0.1", 0),
                   help="HOST:PORT (port 0 = any)")
    p.add_argument("--connect", type=argtype(parse_address), required=True, help="upstream HOST:PORT (the edge)")
    for side in ("up", "down"):
        p.add_argument(f"--{side}-rate", type=argtype(parse_rate), default=0.0, help="e.g. 1mbit (0 = unlimited)")
        p.add_argument(f"--{side}-delay", type=argtype(parse_time), default=0.0, help="one-way, e.g. 20ms")
        p.add_argument(f"--{side}-jitter", type=argtype(parse_time), default=0.0, help="uniform +-, e.g. 5ms")
        p.add_argument(f"--{side}-loss", type=argtype(parse_percent), default=0.0, help="per segment, e.g. 1%%")
        p.add_argument(f"--{side}-trace", default="", help="Mahimahi trace file: the capacity (instead of a rate)")
        p.add_argument(f"--{side}-queue", type=argtype(parse_queue), default=(0.0, 0.0),
                       help="drop-tail queue limit, e.g. 150kb or 100pkt (default: none)")
    p.add_argument("--trace-offset", type=argtype(parse_time), default=0.0,
                   help="start both traces this far in, e.g. 30s")
    p.add_argument("--rto", type=argtype(parse_time), default=LINUX_MIN_RTO_S, help="cost of one lost segment")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--control", type=argtype(parse_control), default=None,
                   help="HOST:PORT or unix:PATH accepting live link changes (JSON lines; see the module doc)")
    return p


def parse_control(text: str) -> str:
    if text.startswith("unix:"):
        if len(text) <= len("unix:"):
            raise ValueError("unix: needs a socket path")
        return text
    parse_address(text)
    return text


def specs_from_args(a) -> tuple[LinkSpec, LinkSpec]:
    """Both directions from the command line; ValueError for a bad combination or an unreadable trace."""
    out = []
    for side in ("up", "down"):
        v = {k: getattr(a, f"{side}_{k}") for k in ("rate", "delay", "jitter", "loss", "trace", "queue")}
        if v["trace"] and v["rate"]:
            raise ValueError(f"--{side}-trace sets the capacity: give it or --{side}-rate, not both")
        if v["trace"]:
            load_trace(v["trace"])
        out.append(LinkSpec(v["rate"], v["delay"], v["jitter"], v["loss"], a.rto, v["trace"],
                            a.trace_offset if v["trace"] else 0.0, *v["queue"]))
    return out[0], out[1]


async def _serve(args) -> None:
    up, down = specs_from_args(args)
    emu = LinkEmulator(args.connect, up, down, seed=args.seed)
    port = await emu.start(*args.listen)
    if args.control:
        print(f"linkemu control on {await emu.start_control(args.control)}", flush=True)
    # The ready line: scripts and tests read the port from it.
    print(f"linkemu listening on {args.listen[0]}:{port} -> {args.connect[0]}:{args.connect[1]}", flush=True)
    await asyncio.Event().wait()  # until SIGTERM / SIGINT


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        specs_from_args(args)
        asyncio.run(_serve(args))
    except ValueError as exc:
        sys.stderr.write(f"linkemu: error: {exc}\n")
        return 2
    except OSError as exc:  # e.g. the listen address is taken
        sys.stderr.write(f"linkemu: error: {exc}\n")
        return 1
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
