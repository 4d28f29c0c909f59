"""Measures what a link does: goodput per direction and one-way delays, over plain TCP.

``python -m specdec.testbed.probe serve --listen HOST:PORT`` on one side (prints its ready line), and
``python -m specdec.testbed.probe measure --connect HOST:PORT`` on the other (prints one JSON object).
Both sides run on one machine (two namespaces of one kernel), so they share CLOCK_MONOTONIC and a
one-way delay is simply receive time minus the send time stamped into the message.

Goodput is taken at the receiver from the first to the last byte, which leaves out connection
set-up, slow start's first round trip and the propagation delay: what remains is the rate. With
``--transfers K`` each direction moves its bytes K times and reports the fastest: a process stalled
by a busy CPU (the relay of a userspace emulator, the receiver) only ever idles the link and lowers
a transfer's goodput, never raises it past the shaped rate, as it only ever adds to a delay.
"""
from __future__ import annotations

import argparse
import json
import socket
import socketserver
import statistics
import struct
import sys
import time

from specdec.common.runtime import OneLineParser, bounded
from specdec.testbed.units import argtype, parse_address

STAMP = struct.Struct("<d")  # a CLOCK_MONOTONIC send time, in each delay probe
PROBE_BYTES = 64             # small: serialization adds < 0.5 ms even at 1 Mbit/s
# Probes are spaced apart so each finds an empty queue: the delay measured is the link's, not the
# backlog of the previous probe (and so that jitter cannot reorder them into one read).
PROBE_SPACING_S = 0.02
RECV_BYTES = 65536
SOCKET_TIMEOUT_S = 60.0


def _connect(address: tuple[str, int]) -> socket.socket:
    s = socket.create_connection(address, timeout=SOCKET_TIMEOUT_S)
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # probes must not wait for Nagle
    return s


def _read_line(s: socket.socket) -> bytes:
    buf = bytearray()
    while not buf.endswith(b"\n"):
        chunk = s.recv(1)
        if not chunk:
            raise ConnectionError("peer closed before the end of the line")
        buf += chunk
    return bytes(buf[:-1])


def _recv_exact(s: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = s.recv(n - len(buf))
        if not chunk:
            raise ConnectionError("peer closed early")
        buf += chunk
    return bytes(buf)


def receive_bulk(s: socket.socket, total: int) -> dict:
    """Read ``total`` bytes; goodput from the end of the first read to the last byte."""
    got = 0
    first_bytes = 0
    t_first = t_last = 0.0
    while got < total:
        chunk = s.recv(min(RECV_BYTES, total - got))
        if not chunk:
            raise ConnectionError("peer closed early")
        now = time.monotonic()
        if got == 0:
            t_first, first_bytes = now, len(chunk)
        got += len(chunk)
        t_last = now
    span = t_last - t_first
    return {"bytes": got, "seconds": span, "bps": (got - first_bytes) * 8 / span if span > 0 else 0.0}


def send_bulk(s: socket.socket, total: int) -> None:
    block = bytes(RECV_BYTES)
    sent = 0
    while sent < total:
        n = min(len(block), total - sent)
        s.sendall(block[:n])
        sent += n


def send_stamped(s: socket.socket, count: int) -> None:
    for _ in range(count):
        s.sendall(STAMP.pack(time.monotonic()) + bytes(PROBE_BYTES - STAMP.size))
        time.sleep(PROBE_SPACING_S)


def receive_stamped(s: socket.socket, count: int) -> list[float]:
    delays = []
    for _ in range(count):
        msg = _recv_exact(s, PROBE_BYTES)
        delays.append(time.monotonic() - STAMP.unpack_from(msg)[0])
    return delays


class _Handler(socketserver.BaseRequestHandler):
    """Commands, one per connection: ``up N``, ``down N``, ``upstamp K``, ``downstamp K``."""

    def handle(self) -> None:
        s = self.request
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        s.settimeout(SOCKET_TIMEOUT_S)
        command, arg = _read_line(s).decode().split()
        n = int(arg)
        if command == "up":
            s.sendall(json.dumps(receive_bulk(s, n)).encode() + b"\n")
        elif command == "down":
            send_bulk(s, n)
            _read_line(s)  # wait for the client's receipt before closing
        elif command == "upstamp":
            s.sendall(json.dumps(receive_stamped(s, n)).encode() + b"\n")
        elif command == "downstamp":
            send_stamped(s, n)
            _read_line(s)


class _Server(socketserver.ThreadingTCPServer):
    allow_reuse_address = True
    daemon_threads = True


def measure(address: tuple[str, int], up_bytes: int, down_bytes: int, probes: int, transfers: int = 1) -> dict:
    """Goodput up and down (bit/s: the fastest of ``transfers`` transfers, each one's in
    ``{side}_transfers``) and one-way delays (s, least and median) through the link to ``address``."""
    out: dict = {}
    if up_bytes:
        out["up_transfers"] = [_upload(address, up_bytes) for _ in range(transfers)]
        out["up"] = max(out["up_transfers"], key=lambda t: t["bps"])
    if down_bytes:
        out["down_transfers"] = [_download(address, down_bytes) for _ in range(transfers)]
        out["down"] = max(out["down_transfers"], key=lambda t: t["bps"])
    if probes:
        with _connect(address) as s:
            s.sendall(f"upstamp {probes}\n".encode())
            send_stamped(s, probes)
            out["up_delays"] = json.loads(_read_line(s))
        with _connect(address) as s:
            s.sendall(f"downstamp {probes}\n".encode())
            out["down_delays"] = receive_stamped(s, probes)
            s.sendall(b"ok\n")
        # The least delay is the link's: a process stalled by a busy CPU only ever adds to it (and
        # delays every probe queued behind it), which moves the median on a loaded machine.
        for side in ("up", "down"):
            out[f"{side}_delay_s"] = min(out[f"{side}_delays"])
            out[f"{side}_delay_median_s"] = statistics.median(out[f"{side}_delays"])
    return out


def _upload(address: tuple[str, int], total: int) -> dict:
    with _connect(address) as s:
        s.sendall(f"up {total}\n".encode())
        send_bulk(s, total)
        return json.loads(_read_line(s))


def _download(address: tuple[str, int], total: int) -> dict:
    with _connect(address) as s:
        s.sendall(f"down {total}\n".encode())
        got = receive_bulk(s, total)
        s.sendall(b"ok\n")
        return got


# -- command line ---------------------------------------------------------------------------------

def build_parser() -> argparse.ArgumentParser:
    p = OneLineParser(prog="python -m specdec.testbed.probe", description="measure a link's rate and delay")
    sub = p.add_subparsers(dest="command", required=True, parser_class=OneLineParser)
    serve = sub.add_parser("serve")
    serve.add_argument("--listen", type=argtype(parse_address), default=("127.0.0.1", 0))
    m = sub.add_parser("measure")
    m.add_argument("--connect", type=argtype(parse_address), required=True)
    m.add_argument("--up-bytes", type=int, default=0)
    m.add_argument("--down-bytes", type=int, default=0)
    m.add_argument("--probes", type=int, default=0, help="stamped messages per direction")
    m.add_argument("--transfers", type=bounded(int, 1), default=1,
                   help="bulk transfers per direction; the fastest is the rate (default: %(default)s)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "serve":
        with _Server(args.listen, _Handler) as server:
            host, port = server.server_address[:2]
            print(f"probe listening on {host}:{port}", flush=True)
            server.serve_forever()
        return 0
    print(json.dumps(measure(args.connect, args.up_bytes, args.down_bytes, args.probes, args.transfers)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
