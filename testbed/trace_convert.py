"""A recorded throughput series as a Mahimahi trace: from ``[(t_seconds, bits_per_second), ...]`` to the
delivery opportunities of :mod:`specdec.testbed.traces` (one line per 1500-byte packet, whole ms).

    python -m specdec.testbed.trace_convert --csv LOG.csv --up-column UL_bitrate --down-column DL_bitrate \\
        --unit kbps --out bench/traces/heldout --name NAME [--time-column T | --step 1] \\
        [--start S --duration D] [--no-header] [--unit-column C]

Sample ``i`` is the rate over ``[t_i, t_i+1)`` (the last one's interval ends at ``end_s``, by default
one step after it). Each interval's packets are spread evenly across it, the last at its end; the
fraction of a packet an interval cannot deliver carries into the next, so each interval is within one
packet of its rate and the whole within one packet of its total bits. A zero-rate interval is an outage:
no opportunity. A Mahimahi trace repeats after its last line, so a series that ends in an outage gets
one opportunity at its very end (still within one packet), which keeps the trace's period the series'.

Pure but for the CSV reading and the writing: ``series_to_times`` has no clock and no file.
"""
from __future__ import annotations

import argparse
import csv
import math
import sys
from pathlib import Path
from typing import Sequence

from specdec.common.runtime import OneLineParser
from specdec.testbed.traces import PACKET_BYTES, Trace

PACKET_BITS = PACKET_BYTES * 8
UNITS = {"bps": 1.0, "kbps": 1e3, "Mbps": 1e6, "Gbps": 1e9}
# iperf's per-line units (its K, M and G are powers of 1000 for bits), for --unit-column
IPERF_UNITS = {"bits/sec": 1.0, "Kbits/sec": 1e3, "Mbits/sec": 1e6, "Gbits/sec": 1e9, **UNITS}
TIME_UNITS = {"s": 1.0, "ms": 1e-3}


def series_to_times(series: Sequence[tuple[float, float]], end_s: float | None = None) -> list[int]:
    """The opportunity times (ms from the first sample, non-decreasing, the last at the series' end) of a
    throughput series; ValueError if it is not one (empty, unordered, negative or non-finite rate,
    samples closer than 1 ms, or no capacity at all)."""
    if not series:
        raise ValueError("the series is empty")
    t0 = series[0][0]
    starts = []
    for i, (t, rate) in enumerate(series):
        if not (math.isfinite(t) and math.isfinite(rate)):
            raise ValueError(f"sample {i}: time and rate must be finite numbers, got ({t!r}, {rate!r})")
        if rate < 0:
            raise ValueError(f"sample {i}: a negative rate ({rate:g} bit/s)")
        if i and t <= series[i - 1][0]:
            raise ValueError(f"sample {i}: time {t:g} s does not come after {series[i - 1][0]:g} s")
        starts.append(round((t - t0) * 1e3))
    if end_s is None:
        if len(series) < 2:
            raise ValueError("a single sample needs an end time (end_s) for its interval")
        end_s = series[-1][0] + (series[-1][0] - series[-2][0])
    if not math.isfinite(end_s) or end_s <= series[-1][0]:
        raise ValueError(f"the end ({end_s!r} s) must come after the last sample ({series[-1][0]:g} s)")
    bounds = [*starts, round((end_s - t0) * 1e3)]
    for i, (a, b) in enumerate(zip(bounds, bounds[1:])):
        if b <= a:
            raise ValueError(f"sample {i}: its interval is shorter than 1 ms (a trace has whole ms)")
    if not any(rate > 0 for _, rate in series):
        raise ValueError("the series has no capacity at all (every rate is 0)")

    times: list[int] = []
    carry = 0.0  # packets owed from the intervals before: always in [0, 1)
    for (a, b), (_, rate) in zip(zip(bounds, bounds[1:]), series):
        span = b - a
        due = rate * span / 1e3 / PACKET_BITS + carry
        n = math.floor(due + 1e-9)
        carry = max(0.0, due - n)
        # packet k at the ceiling of (k + 1) / n of the interval: in (a, b], evenly, the last at b
        times.extend(a + -(-(k + 1) * span // n) for k in range(n))
    if not times or times[-1] < bounds[-1]:
        times.append(bounds[-1])
    return times


def trace_text(times: Sequence[int]) -> str:
    return "".join(f"{t}\n" for t in times)


def _number(text: str, where: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise ValueError(f"{where}: {text.strip()[:40]!r} is not a number") from None
    if not math.isfinite(value):
        raise ValueError(f"{where}: {text.strip()!r} is not a finite number")
    return value


def read_rows(path: str | Path, header: bool = True) -> tuple[list[str] | None, list[list[str]]]:
    """(column names or None, rows) of a CSV file, blank lines left out."""
    try:
        with open(path, newline="", encoding="utf-8-sig") as f:
            rows = [row for row in csv.reader(f) if any(cell.strip() for cell in row)]
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"cannot read {str(path)!r}: {getattr(exc, 'strerror', None) or exc}") from None
    if header:
        if not rows:
            raise ValueError(f"{path}: no header line")
        return [c.strip() for c in rows[0]], rows[1:]
    return None, rows


def _column(names: list[str] | None, column: str, path) -> int:
    if names is None:
        if not column.isdigit():
            raise ValueError(f"{path}: without a header a column is its 0-based index, got {column!r}")
        return int(column)
    if column not in names:
        raise ValueError(f"{path}: no column {column!r} (it has {', '.join(names)})")
    return names.index(column)


def read_series(path: str | Path, rate_column: str, *, unit: str = "bps", unit_column: str | None = None,
                time_column: str | None = None, time_unit: str = "s", step_s: float = 1.0,
                header: bool = True, start_s: float = 0.0,
                duration_s: float | None = None) -> tuple[list[tuple[float, float]], float]:
    """(series, end_s) of one rate column of a CSV file: times from ``time_column`` (in ``time_unit``)
    or, without one, row ``i`` at ``i * step_s``; rates in ``unit``, or per row in the unit that
    ``unit_column`` names (iperf's ``Mbits/sec`` etc.); cut to ``[start_s, start_s + duration_s)`` of
    the series' own time (from its first row), which then starts at 0. ValueError on anything else."""
    if unit not in UNITS:
        raise ValueError(f"unknown unit {unit!r} (one of {', '.join(UNITS)})")
    if time_unit not in TIME_UNITS:
        raise ValueError(f"unknown time unit {time_unit!r} (one of {', '.join(TIME_UNITS)})")
    if not (math.isfinite(step_s) and step_s > 0):
        raise ValueError(f"the step must be a finite number of seconds > 0, got {step_s!r}")
    names, rows = read_rows(path, header)
    if not rows:
        raise ValueError(f"{path}: no data rows")
    rate_i = _column(names, rate_column, path)
    unit_i = _column(names, unit_column, path) if unit_column is not None else None
    time_i = _column(names, time_column, path) if time_column is not None else None
    first = 2 if header else 1
    series = []
    for n, row in enumerate(rows):
        where = f"{path}: line {n + first}"
        need = max(i for i in (rate_i, unit_i, time_i) if i is not None)
        if len(row) <= need:
            raise ValueError(f"{where}: only {len(row)} columns")
        scale = UNITS[unit]
        if unit_i is not None:
            name = row[unit_i].strip()
            if name not in IPERF_UNITS:
                raise ValueError(f"{where}: unknown unit {name!r} (one of {', '.join(IPERF_UNITS)})")
            scale = IPERF_UNITS[name]
        t = _number(row[time_i], where) * TIME_UNITS[time_unit] if time_i is not None else n * step_s
        series.append((t, _number(row[rate_i], where) * scale))
    if time_i is None or len(series) < 2:
        end = series[-1][0] + step_s
    else:
        end = series[-1][0] + (series[-1][0] - series[-2][0])
    t0 = series[0][0]
    series = [(t - t0, r) for t, r in series]
    end -= t0
    if not (math.isfinite(start_s) and start_s >= 0) or (
            duration_s is not None and not (math.isfinite(duration_s) and duration_s > 0)):
        raise ValueError("the stretch needs a start >= 0 and a duration > 0")
    stop = end if duration_s is None else start_s + duration_s
    if stop > end + 1e-9:
        raise ValueError(f"{path}: the stretch ends at {stop:g} s, after the series ({end:g} s)")
    cut = [(t - start_s, r) for t, r in series if start_s - 1e-9 <= t < stop - 1e-9]
    if not cut or abs(cut[0][0]) > 1e-9:
        raise ValueError(f"{path}: no sample starts the stretch at {start_s:g} s")
    return cut, stop - start_s


def build_parser() -> argparse.ArgumentParser:
    p = OneLineParser(prog="python -m specdec.testbed.trace_convert", description=__doc__.split("\n\n")[0])
    p.add_argument("--csv", required=True, help="the recorded series, one row per sample")
    p.add_argument("--up-column", required=True, help="the rate column of NAME.up (device to edge)")
    p.add_argument("--down-column", required=True, help="the rate column of NAME.down (edge to device)")
    p.add_argument("--out", required=True, help="folder for NAME.up and NAME.down (made if missing)")
    p.add_argument("--name", required=True, help="the pair's name")
    p.add_argument("--unit", default="bps", choices=list(UNITS), help="the rate columns' unit (default bps)")
    p.add_argument("--unit-column", help="a column naming each row's unit (iperf's bits/sec, Kbits/sec, "
                   "Mbits/sec, ...) instead of --unit")
    p.add_argument("--time-column", help="a column of sample times (default: rows --step apart)")
    p.add_argument("--time-unit", default="s", choices=list(TIME_UNITS), help="the time column's unit")
    p.add_argument("--step", type=float, default=1.0, help="seconds between rows without --time-column")
    p.add_argument("--start", type=float, default=0.0, help="the stretch's start, s from the first row")
    p.add_argument("--duration", type=float, help="the stretch's length in s (default: to the end)")
    p.add_argument("--no-header", action="store_true", help="no header line: columns are 0-based indexes")
    return p


def convert(args: argparse.Namespace) -> list[str]:
    """Write NAME.up and NAME.down; one summary line per file."""
    out = Path(args.out)
    texts = {}
    for side, column in (("up", args.up_column), ("down", args.down_column)):
        series, end = read_series(args.csv, column, unit=args.unit, unit_column=args.unit_column,
                                  time_column=args.time_column, time_unit=args.time_unit, step_s=args.step,
                                  header=not args.no_header, start_s=args.start, duration_s=args.duration)
        try:
            texts[side] = trace_text(series_to_times(series, end))
        except ValueError as exc:
            raise ValueError(f"{args.csv}: column {column!r}: {exc}") from None
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ValueError(f"cannot make {str(out)!r}: {exc.strerror}") from None
    lines = []
    for side, text in texts.items():
        path = out / f"{args.name}.{side}"
        try:
            path.write_text(text)
        except OSError as exc:
            raise ValueError(f"cannot write {str(path)!r}: {exc.strerror}") from None
        t = Trace.parse(text, path.name)
        lines.append(f"{path}: {t.opportunities} opportunities over {t.period_ms / 1e3:g} s, "
                     f"mean {t.mean_bps / 1e6:.3f} Mbit/s")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        for line in convert(args):
            print(line)
    except ValueError as exc:
        parser.error(str(exc))
    return 0


if __name__ == "__main__":
    sys.exit(main())
