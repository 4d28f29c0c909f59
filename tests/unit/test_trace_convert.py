"""A throughput series as a Mahimahi trace (testbed/trace_convert.py): the trace's capacity per interval
is the series' within one packet, outages stay outages, the fraction of a packet carries over, and the
CSV command writes a pair that testbed/traces.py reads back, or says in one line what is wrong."""
from __future__ import annotations

import math
import random

import pytest

from specdec.testbed import trace_convert as tc
from specdec.testbed.traces import PACKET_BYTES, Trace, load_trace, trace_pairs
from tests.support.harness import run_main

PACKET_BITS = PACKET_BYTES * 8


def as_trace(series, end_s=None) -> Trace:
    return Trace.parse(tc.trace_text(tc.series_to_times(series, end_s)), "t")


@pytest.mark.parametrize("step_s", [1.0, 0.5, 0.1, 2.5])
def test_round_trip_within_one_packet_per_interval(step_s) -> None:
    rng = random.Random(int(step_s * 10))
    rates = [rng.choice([0.0, rng.uniform(0, 2e5), rng.uniform(1e5, 4e7)]) for _ in range(200)]
    rates[0] = 5e6
    series = [(i * step_s, r) for i, r in enumerate(rates)]
    trace = as_trace(series)
    duration = len(rates) * step_s
    assert trace.period_ms == round(duration * 1e3)
    got = trace.capacity_series(0.0, duration, step_s)
    one_packet = PACKET_BITS / step_s
    for i, (g, want) in enumerate(zip(got, rates)):
        assert abs(g - want) <= one_packet + 1e-6, (i, g, want)
    total_bits = sum(r * step_s for r in rates)
    assert abs(trace.opportunities * PACKET_BITS - total_bits) <= PACKET_BITS
    assert trace.mean_bps == pytest.approx(total_bits / duration, abs=PACKET_BITS / duration)


def test_packets_spread_evenly_the_last_at_the_interval_end() -> None:
    ten_per_s = 10 * PACKET_BITS
    assert tc.series_to_times([(0.0, ten_per_s)], end_s=1.0) == list(range(100, 1001, 100))
    # more packets than milliseconds: several in one ms, never before the interval, the last at its end
    times = tc.series_to_times([(0.0, 2500 * PACKET_BITS), (1.0, 3 * PACKET_BITS)])
    assert times[:5] == [1, 1, 2, 2, 2] and times[2499] == 1000 and times[2500:] == [1334, 1667, 2000]
    assert times == sorted(times)


def test_a_zero_rate_interval_is_an_outage() -> None:
    series = [(0.0, 12e6), (1.0, 0.0), (2.0, 0.0), (3.0, 6e6)]
    trace = as_trace(series)
    assert trace.capacity_series(0.0, 4.0, 1.0) == [12e6, 0.0, 0.0, 6e6]
    assert trace.outages(1000) == [(1.0, pytest.approx(2.002))]  # 1 s to the first packet at 3.002 s
    assert trace.opportunities_between(1000, 3000) == 0


def test_the_fraction_of_a_packet_carries_into_the_next_interval() -> None:
    half = PACKET_BITS / 2
    # half a packet a second: one every two seconds, not none
    assert tc.series_to_times([(float(t), half) for t in range(6)]) == [2000, 4000, 6000]
    # 1.5 then 1.5: one, then two (the half carried), whatever the split of the interval
    assert tc.series_to_times([(0.0, 1.5 * PACKET_BITS), (1.0, 1.5 * PACKET_BITS)]) == [1000, 1500, 2000]
    # what an outage cannot deliver waits: 0.7 + 0 + 0.7 packets -> one, in the third second
    assert tc.series_to_times([(0.0, 0.7 * PACKET_BITS), (1.0, 0.0), (2.0, 0.7 * PACKET_BITS)]) == [3000]


def test_a_trailing_outage_keeps_the_period() -> None:
    # Mahimahi repeats after the last line: one opportunity at the very end keeps the 3 s period
    trace = as_trace([(0.0, 2 * PACKET_BITS), (1.0, 0.0), (2.0, 0.0)])
    assert trace.times_ms == (500, 1000, 3000) and trace.period_ms == 3000
    # less than a packet in all: one opportunity, at the end
    assert tc.series_to_times([(0.0, 100.0), (1.0, 100.0)]) == [2000]


def test_times_are_from_the_first_sample_and_a_sampling_of_any_step() -> None:
    series = [(100.0, 16 * PACKET_BITS), (100.25, 0.0), (101.0, 4 * PACKET_BITS)]
    assert tc.series_to_times(series, end_s=101.5) == [63, 125, 188, 250, 1250, 1500]


@pytest.mark.parametrize("series, end_s, needle", [
    ([], None, "empty"),
    ([(0.0, 1e6)], None, "single sample needs an end"),
    ([(0.0, 1e6), (0.0, 1e6)], None, "does not come after"),
    ([(1.0, 1e6), (0.5, 1e6)], None, "does not come after"),
    ([(0.0, -1.0), (1.0, 1e6)], None, "negative rate"),
    ([(0.0, math.nan), (1.0, 1e6)], None, "finite"),
    ([(0.0, math.inf), (1.0, 1e6)], None, "finite"),
    ([(0.0, 0.0), (1.0, 0.0)], None, "no capacity"),
    ([(0.0, 1e6), (0.0004, 1e6)], None, "shorter than 1 ms"),
    ([(0.0, 1e6), (1.0, 1e6)], 1.0, "must come after the last sample"),
])
def test_bad_series_are_refused(series, end_s, needle) -> None:
    with pytest.raises(ValueError, match=needle):
        tc.series_to_times(series, end_s)


GNETTRACK = """Timestamp,Speed,DL_bitrate,UL_bitrate,State
2019.12.16_07.22.43,0,12000,120,D
2019.12.16_07.22.44,3,0,0,D
2019.12.16_07.22.44,9,6000,60,D
2019.12.16_07.22.46,20,24000,240,D
"""


def test_csv_to_a_pair_that_traces_reads(tmp_path, capsys) -> None:
    src = tmp_path / "log.csv"
    src.write_text(GNETTRACK)
    out = tmp_path / "pairs"
    argv = ["--csv", str(src), "--up-column", "UL_bitrate", "--down-column", "DL_bitrate", "--unit", "kbps",
            "--out", str(out), "--name", "drive"]
    assert run_main(tc.main, argv, capsys)[0] == 0
    assert list(trace_pairs(out)) == ["drive"]
    down, up = load_trace(out / "drive.down"), load_trace(out / "drive.up")
    assert down.period_ms == up.period_ms == 4000  # rows 1 s apart (--step), the last one's second too
    assert down.capacity_series(0, 4, 1) == [12e6, 0.0, 6e6, 24e6]
    assert up.capacity_series(0, 4, 1) == [pytest.approx(x, abs=PACKET_BITS) for x in (120e3, 0, 60e3, 240e3)]
    # a stretch of it, from its own start
    argv += ["--start", "2", "--duration", "2", "--name", "cut"]
    assert run_main(tc.main, argv, capsys)[0] == 0
    assert load_trace(out / "cut.down").capacity_series(0, 2, 1) == [6e6, 24e6]


def test_csv_without_header_in_iperf_units_and_a_time_column(tmp_path, capsys) -> None:
    src = tmp_path / "iperf.csv"
    src.write_text("3.6,Mbits/sec\r\n0,bits/sec\r\n720,Kbits/sec\r\n")
    argv = ["--csv", str(src), "--up-column", "0", "--down-column", "0", "--unit-column", "1", "--no-header",
            "--out", str(tmp_path), "--name", "bus"]
    assert run_main(tc.main, argv, capsys)[0] == 0
    assert load_trace(tmp_path / "bus.up").capacity_series(0, 3, 1) == [3.6e6, 0.0, 720e3]
    timed = tmp_path / "timed.csv"
    timed.write_text("ms,rate\n0,1.2\n500,0\n1500,2.4\n")
    argv = ["--csv", str(timed), "--up-column", "rate", "--down-column", "rate", "--unit", "Mbps",
            "--time-column", "ms", "--time-unit", "ms", "--out", str(tmp_path), "--name", "timed"]
    assert run_main(tc.main, argv, capsys)[0] == 0
    t = load_trace(tmp_path / "timed.down")
    assert t.period_ms == 2500 and t.capacity_series(0, 2.5, 0.5) == [1.2e6, 0, 0, 2.4e6, 2.4e6]


@pytest.mark.parametrize("content, extra, needle", [
    (GNETTRACK, ["--down-column", "DL"], "no column 'DL' (it has Timestamp, Speed"),
    (GNETTRACK.replace("6000,60", "fast,60"), [], "line 4: 'fast' is not a number"),
    (GNETTRACK.replace("6000,60", "-6000,60"), [], "negative rate"),
    (GNETTRACK.replace("6000,60", "nan,60"), [], "not a finite number"),
    (GNETTRACK.replace("9,6000,60,D", "9,6000"), [], "line 4: only 3 columns"),
    ("Timestamp,DL_bitrate,UL_bitrate\n", [], "no data rows"),
    ("", [], "no header"),
    ("Timestamp,DL_bitrate,UL_bitrate\n1,0,0\n2,0,0\n", [], "no capacity at all"),
    (GNETTRACK, ["--start", "1", "--duration", "9"], "ends at 10 s, after the series (4 s)"),
    (GNETTRACK, ["--start", "0.5"], "no sample starts the stretch"),
    (GNETTRACK, ["--duration", "0"], "a duration > 0"),
    (GNETTRACK, ["--step", "0"], "step must be"),
    (GNETTRACK, ["--unit", "furlongs"], "invalid choice"),
    (GNETTRACK, ["--unit-column", "State"], "unknown unit 'D'"),
    (GNETTRACK, ["--no-header"], "column is its 0-based index"),
])
def test_bad_input_is_one_line_and_status_2(tmp_path, capsys, content, extra, needle) -> None:
    src = tmp_path / "log.csv"
    src.write_text(content)
    argv = ["--csv", str(src), "--up-column", "UL_bitrate", "--down-column", "DL_bitrate", "--unit", "kbps",
            "--out", str(tmp_path / "out"), "--name", "x", *extra]
    rc, err = run_main(tc.main, argv, capsys)
    assert rc == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("python -m specdec.testbed.trace_convert: error:"), err
    assert needle in lines[0], lines[0]
    assert not (tmp_path / "out").exists()  # nothing half written


def test_a_missing_file_is_one_line(tmp_path, capsys) -> None:
    rc, err = run_main(tc.main, ["--csv", str(tmp_path / "none.csv"), "--up-column", "a", "--down-column", "a",
                                 "--out", str(tmp_path), "--name", "x"], capsys)
    assert rc == 2 and len(err.strip().splitlines()) == 1 and "cannot read" in err and "No such file" in err
