"""Trace replay in the link emulator (testbed/traces.py, testbed/linkemu.py): the schedule a Mahimahi
trace describes, a byte stream served from it with a drop-tail queue, and, live on loopback, the
bytes per window a saturating stream gets against the trace's capacity (no root needed)."""
from __future__ import annotations

import asyncio
import math
import random

import pytest

from tests.support.harness import run_main
from specdec.testbed import linkemu
from specdec.testbed.linkemu import HEADER_BYTES, MSS_BYTES, LinkClock, LinkEmulator, LinkSpec
from specdec.testbed.traces import PACKET_BYTES, Trace, load_trace, trace_pairs
from specdec.testbed.tracecheck import measure
from specdec.testbed.units import parse_queue

# A trace of known shape: 500 ms at one packet per ms (12 Mbit/s), 500 ms with none (an outage),
# 500 ms at one packet every 2 ms (6 Mbit/s); it repeats every 1500 ms.
FAST_MS, OUTAGE_MS, SLOW_MS = 500, 500, 500
PERIOD_MS = FAST_MS + OUTAGE_MS + SLOW_MS


def square_trace(fast_every_ms: int = 1, slow_every_ms: int = 2) -> str:
    times = (list(range(fast_every_ms, FAST_MS + 1, fast_every_ms))
             + list(range(FAST_MS + OUTAGE_MS + slow_every_ms, PERIOD_MS + 1, slow_every_ms)))
    return "\n".join(map(str, times)) + "\n"


@pytest.fixture
def square(tmp_path):
    path = tmp_path / "square.up"
    path.write_text(square_trace())
    return path


def test_trace_schedule_repeats_shifted_by_its_last_timestamp() -> None:
    t = Trace.parse("0\n0\n5\n10\n", "t")
    assert t.period_ms == 10 and t.opportunities == 4
    assert [t.opportunity_ms(g) for g in range(9)] == [0, 0, 5, 10, 10, 10, 15, 20, 20]
    assert t.first_at_or_after(0) == 0 and t.first_at_or_after(0.5) == 2 and t.first_at_or_after(11) == 6
    assert t.first_at_or_after(10) == 3
    assert t.first_at_or_after(-10) == 0  # the schedule starts at 0
    # (a, b]: at 10 ms the first period's last and the second's two at its start
    assert t.opportunities_between(0, 10) == 4 and t.opportunities_between(0, 20) == 8
    assert t.opportunities_between(-1, 10) == 6
    assert t.mean_bps == pytest.approx(4 * PACKET_BYTES * 8 / 0.01)
    for bad in ("", "0\n", "5\n3\n", "1\nfast\n", "-1\n2\n"):
        with pytest.raises(ValueError):
            Trace.parse(bad, "bad")


def test_square_trace_capacity_series(square) -> None:
    t = load_trace(square)
    assert t is load_trace(square)  # parsed once
    per_s = t.capacity_series(0.0, 1.5, 0.5)
    assert per_s == pytest.approx([12e6, 0.0, 6e6])
    assert t.outages(100) == [(0.5, pytest.approx(0.502))]


def test_stream_served_from_the_trace_follows_its_capacity(square) -> None:
    """Pure: a saturating stream of full segments released over 3 s (two periods) delivers, per
    100 ms window, one segment per opportunity, and nothing in the outage."""
    clock = LinkClock(LinkSpec(trace=str(square)), random.Random(0), trace_origin=0.0)
    released = [clock.release_time(MSS_BYTES, 0.0) for _ in range(4000)]
    per_window = [0] * 30
    for r in released:
        if r <= 3.0:
            per_window[math.ceil(round(r / 0.1, 9)) - 1] += MSS_BYTES  # windows (a, b], as the trace counts
    want = [100 if w % 15 < 5 else 0 if w % 15 < 10 else 50 for w in range(30)]
    assert [n // MSS_BYTES for n in per_window] == pytest.approx(want, abs=1)
    assert released == sorted(released)


def test_small_packets_share_an_opportunity_and_delay_adds_on_top(square) -> None:
    clock = LinkClock(LinkSpec(trace=str(square), delay_s=0.02), random.Random(0), trace_origin=0.0)
    # Three 100-byte messages fit in one 1500-byte opportunity (each is a packet of 152 bytes).
    assert [clock.release_time(100, 0.0002) for _ in range(3)] == pytest.approx([0.021] * 3)
    # In the outage nothing crosses: a message sent at 0.6 s leaves at the first slow opportunity.
    assert clock.release_time(100, 0.6) == pytest.approx(1.002 + 0.02)
    assert (100 + HEADER_BYTES) * 9 < PACKET_BYTES < (100 + HEADER_BYTES) * 10


def test_drop_tail_queue_drops_a_burst_beyond_it_and_the_stream_waits_for_the_resend(square) -> None:
    spec = LinkSpec(trace=str(square), queue_packets=10, rto_s=0.2)
    clock = LinkClock(spec, random.Random(0), trace_origin=0.0)
    # 20 segments at 0.55 s, in the outage: 10 fit the queue, 10 are dropped and sent again at 0.75 s,
    # still in the outage; all cross at the slow rate from 1.002 s, the resent ones after the queued.
    release = clock.release_time(20 * MSS_BYTES, 0.55)
    assert clock.dropped == 10
    assert release == pytest.approx(1.002 + 2 * 19 / 1e3)
    # The resent copies take capacity when sent: a later segment waits behind all 20.
    assert clock.release_time(MSS_BYTES, 0.8) == pytest.approx(1.002 + 2 * 20 / 1e3)
    # Without a limit nothing is dropped.
    unlimited = LinkClock(LinkSpec(trace=str(square)), random.Random(0), trace_origin=0.0)
    unlimited.release_time(20 * MSS_BYTES, 0.55)
    assert unlimited.dropped == 0
    # A byte limit at a rate: 3 segments fit 5000 bytes, the 2 others are sent again after a timeout.
    rate = LinkClock(LinkSpec(rate_bps=1e6, queue_bytes=5000, rto_s=0.2), random.Random(0))
    assert rate.release_time(5 * MSS_BYTES, 0.0) == pytest.approx(0.2 + 2 * MSS_BYTES * 8 / 1e6)  # the link is idle by then
    assert rate.dropped == 2


def test_queue_units_and_control_fields(square) -> None:
    assert parse_queue("150kb") == (150e3, 0) and parse_queue("64kib") == (65536, 0)
    assert parse_queue("100pkt") == (0, 100) and parse_queue("0") == (0, 0)
    for bad in ("lots", "1.5pkt", "10gb"):
        with pytest.raises(ValueError):
            parse_queue(bad)
    emu = LinkEmulator(("127.0.0.1", 1), LinkSpec(), LinkSpec())
    reply = emu.apply_control({"uplink": {"trace": str(square), "trace_offset_s": 3, "queue_packets": 50}})
    assert reply["uplink"]["trace"] == str(square) and reply["uplink"]["queue_packets"] == 50
    assert reply["applied_wall"] > 0
    with pytest.raises(ValueError, match="cannot read trace"):
        emu.apply_control({"uplink": {}, "downlink": {"trace": str(square) + ".missing"}})
    assert emu.uplink.trace == str(square) and emu.downlink == LinkSpec()  # all or nothing


def test_trace_pairs(tmp_path, square) -> None:
    (tmp_path / "square.down").write_text(square_trace())
    (tmp_path / "lonely.up").write_text(square_trace())
    assert list(trace_pairs(tmp_path)) == ["square"]


def test_live_stream_follows_the_square_trace(tmp_path) -> None:
    """Live on loopback: a saturating stream through the emulator gets the trace's capacity per
    500 ms phase (6 Mbit/s, nothing, 3 Mbit/s: rates a busy shared core keeps up with) within 20 %,
    and nothing in the outage."""
    path = tmp_path / "square-slow.up"
    path.write_text(square_trace(fast_every_ms=2, slow_every_ms=4))
    r = asyncio.run(measure(str(path), PERIOD_MS / 1e3, bin_s=0.5))
    print(r["ratio_per_bin"], r["ratio_total"])
    assert r["capacity_bytes"] == [250 * MSS_BYTES, 0, 125 * MSS_BYTES]
    for got, want in zip(r["delivered_bytes"], r["capacity_bytes"]):
        if want:
            assert 0.8 * want <= got <= 1.2 * want, (got, want)
        else:
            assert got <= 0.05 * 250 * MSS_BYTES, got  # at most the last packets' lateness


@pytest.mark.parametrize("args,why", [
    (["--up-trace", "/nonexistent.up"], "cannot read trace"),
    (["--up-queue", "lots"], "not a queue limit"),
])
def test_command_line_rejects_bad_traces_and_queues(args, why, capsys, linkemu_never_serves) -> None:
    rc, err = run_main(linkemu.main, ["--connect", "127.0.0.1:1", *args], capsys)
    assert rc == 2 and why in err and len(err.strip().splitlines()) == 1, err


def test_command_line_rate_and_trace_exclude_each_other(square, capsys, linkemu_never_serves) -> None:
    """linkemu's main in this process (test_testbed runs the real process once)."""
    rc, err = run_main(linkemu.main, ["--connect", "127.0.0.1:1", "--up-trace", str(square), "--up-rate", "1mbit"],
                       capsys)
    assert rc == 2 and "not both" in err
