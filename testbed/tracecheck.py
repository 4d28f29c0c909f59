"""Does the link emulator let through what a trace says? A saturating stream, measured per window.

    python -m specdec.testbed.tracecheck --trace ../shared/traces/TMobile-LTE-short.up --seconds 30 \\
        [--offset 10s] [--bin 1s] [--json OUT]

One sender writes as fast as the emulator takes bytes (it stops reading at QUEUE_LIMIT_BYTES, so
the queue never runs dry) through a :class:`~specdec.testbed.linkemu.LinkEmulator` on loopback
whose uplink replays the trace, and a sink timestamps what arrives. Per window it compares the
payload delivered with the trace's capacity in payload (``opportunities x MSS_BYTES``: each
1500-byte packet carries one full TCP segment), so a ratio of 1.0 is the trace followed exactly.
No root needed; it takes ``--seconds`` of wall time and most of one core at LTE rates.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path

from specdec.common.runtime import OneLineParser
from specdec.testbed.linkemu import MSS_BYTES, LinkEmulator, LinkSpec
from specdec.testbed.traces import load_trace
from specdec.testbed.units import argtype, parse_time

WRITE_BYTES = 64 * 1024


async def measure(trace_path: str, seconds: float, offset_s: float = 0.0, bin_s: float = 1.0) -> dict:
    """Per ``bin_s`` window of ``seconds`` from ``offset_s`` into the trace: payload bytes delivered
    and the trace's payload capacity; their totals and the ratio of each window."""
    arrivals: list[tuple[float, int]] = []

    async def sink(reader, writer) -> None:
        try:
            while data := await reader.read(1 << 16):
                arrivals.append((time.monotonic(), len(data)))
        except (asyncio.CancelledError, ConnectionError):
            pass  # the measurement is over with bytes still in the link
        writer.close()

    server = await asyncio.start_server(sink, "127.0.0.1", 0)
    spec = LinkSpec(trace=str(trace_path), trace_offset_s=offset_s)
    emu = LinkEmulator(("127.0.0.1", server.sockets[0].getsockname()[1]), spec, LinkSpec())
    port = await emu.start()
    try:
        _, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"!")  # the path is up (the emulator has connected to the sink) before the clock starts
        while not arrivals:
            await asyncio.sleep(0.01)
        arrivals.clear()
        emu.set_specs(spec)  # the trace starts now, at its offset
        t0 = time.monotonic()
        block = b"x" * WRITE_BYTES
        while time.monotonic() - t0 < seconds:
            writer.write(block)
            await writer.drain()
        writer.close()
    finally:
        await emu.close()
        server.close()
    return compare(arrivals, t0, load_trace(trace_path), offset_s, seconds, bin_s)


def compare(arrivals: list[tuple[float, int]], t0: float, trace, offset_s: float, seconds: float,
            bin_s: float) -> dict:
    """Delivered payload per window (``arrivals``: (monotonic time, bytes)) against the trace's. Pure."""
    bins = int(seconds / bin_s)
    got = [0] * bins
    for t, n in arrivals:
        k = int((t - t0) / bin_s)
        if 0 <= k < bins:
            got[k] += n
    want = [trace.opportunities_between((offset_s + k * bin_s) * 1e3, (offset_s + (k + 1) * bin_s) * 1e3)
            * MSS_BYTES for k in range(bins)]
    ratios = [g / w if w else None for g, w in zip(got, want)]
    return {"trace": trace.name, "offset_s": offset_s, "seconds": seconds, "bin_s": bin_s,
            "delivered_bytes": got, "capacity_bytes": want, "ratio_per_bin": ratios,
            "ratio_total": sum(got) / sum(want) if sum(want) else None,
            "mean_abs_error_share": (sum(abs(g - w) for g, w in zip(got, want)) / sum(want)) if sum(want) else None}


def main(argv: list[str] | None = None) -> int:
    p = OneLineParser(prog="python -m specdec.testbed.tracecheck", description=__doc__.split("\n\n")[0])
    p.add_argument("--trace", required=True, help="a Mahimahi trace file")
    p.add_argument("--seconds", type=float, default=30.0)
    p.add_argument("--offset", type=argtype(parse_time), default=0.0, help="start this far into the trace")
    p.add_argument("--bin", type=argtype(parse_time), default=1.0, help="window, e.g. 1s or 250ms")
    p.add_argument("--json", type=Path, default=None, help="write the result here too")
    a = p.parse_args(argv)
    if a.seconds <= 0 or a.bin <= 0 or a.bin > a.seconds:
        p.error("--seconds and --bin must be positive, --bin at most --seconds")
    try:
        load_trace(a.trace)
    except ValueError as exc:
        sys.stderr.write(f"tracecheck: error: {exc}\n")
        return 2
    r = asyncio.run(measure(a.trace, a.seconds, a.offset, a.bin))
    for k, (g, w) in enumerate(zip(r["delivered_bytes"], r["capacity_bytes"])):
        print(f"{a.offset + k * a.bin:8.2f} s  capacity {w * 8 / a.bin / 1e6:7.2f} Mbit/s  "
              f"delivered {g * 8 / a.bin / 1e6:7.2f} Mbit/s")
    print(f"total delivered / capacity: {r['ratio_total']:.3f}; mean |error| per window: "
          f"{r['mean_abs_error_share']:.3f} of the capacity")
    if a.json:
        a.json.write_text(json.dumps(r, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
